"""Run by tests/test_distributed.py under torchrun (2 ranks, gloo): HF Trainer
with HookcapCallback recording param_grad; each rank also keeps, as the
reference, every gradient as the optimizer sees it (at on_pre_optimizer_step)."""

import os
import sys

import torch
import transformers

from hookcap.integrations.transformers import HookcapCallback


class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(64, (16, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Reference(transformers.TrainerCallback):
    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads[state.global_step + 1] = {n: p.grad.detach().double().clone()
                                             for n, p in model.named_parameters() if p.grad is not None}


def main(out):
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ref, cb = Reference(), HookcapCallback(capture=("param_grad",))
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=2, use_cpu=True, ddp_backend="gloo",
        report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, seed=0,
        learning_rate=1e-2, max_grad_norm=0.0)  # param_grad is the gradient before clipping
    transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=[ref, cb]).train()
    rank = int(os.environ["RANK"])
    torch.save(ref.grads, os.path.join(out, f"ref{rank}.pt"))
    merged = cb.monitor.history(all_ranks=True)
    if rank == 0:
        merged.save(os.path.join(out, "merged.npz"))
    torch.distributed.barrier()
    # Left to interpreter exit, gloo's threads can be torn down mid-flight (SIGABRT).
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
