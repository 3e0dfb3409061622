"""hookcap inside the real training stacks: HF Trainer, Lightning and
accelerate. Each run records a float64 reference of one module's training
outputs with a plain forward hook, tagged with the step the framework is in,
and compares the Monitor's record at a named step with it."""

import collections
import json
import logging
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_recorded

import hookcap

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from hookcap.integrations.transformers import HookcapCallback as HFCallback  # noqa: E402


# -- HF Trainer -------------------------------------------------------------------


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n, seed, vocab=64, length=12):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class StepTag(transformers.TrainerCallback):
    """The step a forward belongs to, numbered like the Trainer's logged loss."""

    def __init__(self):
        self.step = 1

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step + 1


def trainer_for(model, out, callbacks, max_steps, save_steps=None):
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, max_steps=max_steps, eval_strategy="steps", eval_steps=2,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, logging_steps=1,
        report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0, learning_rate=1e-2,
        disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=TokenData(32, 1),
                                eval_dataset=TokenData(8, 2), callbacks=callbacks)


def test_hf_trainer_records_training_steps_against_float64(tmp_path):
    model = tiny_llama()
    seen = collections.defaultdict(list)
    cb = HFCallback(capture=("output", "grad_output"))
    trainer = trainer_for(model, tmp_path, [cb], max_steps=4)

    def tag(m, a, out):
        # A training forward belongs to the step being trained (global_step + 1), an
        # evaluation to the global_step the Trainer evaluates at.
        step = trainer.state.global_step + (1 if m.training else 0)
        seen[(step, m.training)].append(out.detach().double().clone())

    def loss(m, a, out):
        if m.training:
            seen[(trainer.state.global_step + 1, "loss")].append(out.loss.detach().double().clone())

    model.model.embed_tokens.register_forward_hook(tag)
    model.register_forward_hook(loss)
    trainer.train()
    h = cb.monitor.history()
    assert h.steps.tolist() == [1, 2, 3, 4]  # as the Trainer numbers the logged loss
    for step in (1, 3):
        train = seen[(step, True)]
        assert len(train) == 2  # gradient accumulation: two micro-batches, one hookcap step
        assert_recorded(h, step, "model.embed_tokens/output", train)
    # The loss each training forward returned, tapped (tap_loss=True): both micro-batches.
    assert h.meta("loss")["kind"] == "tap"
    for step in (1, 2, 3, 4):
        assert len(seen[(step, "loss")]) == 2
        assert_recorded(h, step, "loss", seen[(step, "loss")])
    assert list(model._forward_hooks.values()) == [loss]  # the callback's loss tap is gone
    # Evaluation at global_step 2 and 4 (the last step too), never in training rows.
    assert sorted(k for k in seen if not k[1]) == [(2, False), (4, False)]
    for step in (2, 4):
        assert_recorded(h, step, "eval/model.embed_tokens/output", seen[(step, False)])
    assert np.isnan(h["count"][[0, 2], h.column("eval/model.embed_tokens/output")]).all()
    assert os.path.exists(tmp_path / "hookcap.npz")
    assert hookcap.load(tmp_path / "hookcap.npz") == h


def test_hf_trainer_resume_continues_numbering_and_detector_windows(tmp_path):
    spike = lambda: hookcap.Spike("l2norm", window=50, warmup=40)  # noqa: E731  (never fires here)
    cb = HFCallback(capture="output", detectors=[spike()])
    trainer_for(tiny_llama(), tmp_path, [cb], max_steps=2, save_steps=2).train()
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "hookcap.npz").exists() and (ckpt / "hookcap_state.json").exists()
    saved = json.loads((ckpt / "hookcap_state.json").read_text())
    assert saved["step"] == 3 and len(saved["detectors"][0]["window"]["model.norm/output"]) == 2
    cb2 = HFCallback(capture="output", detectors=[spike()])
    trainer_for(tiny_llama(), tmp_path, [cb2], max_steps=4, save_steps=2).train(resume_from_checkpoint=str(ckpt))
    assert cb2.monitor.history().steps.tolist() == [3, 4]
    assert len(cb2.monitor.detectors[0].state_dict()["window"]["model.norm/output"]) == 4


class StopAt(transformers.TrainerCallback):
    """Ends training after step ``n`` (its checkpoint saved), as an interruption would."""

    def __init__(self, n):
        self.n = n

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.n:
            control.should_training_stop = True


def test_hf_trainer_resumed_run_writes_the_whole_run(tmp_path):
    whole = HFCallback(capture=("output", "grad_output"))
    trainer_for(tiny_llama(), tmp_path / "a", [whole], max_steps=4, save_steps=2).train()
    first = HFCallback(capture=("output", "grad_output"))
    trainer_for(tiny_llama(), tmp_path / "b", [first, StopAt(2)], max_steps=4, save_steps=2).train()  # interrupted
    resumed = HFCallback(capture=("output", "grad_output"))
    trainer_for(tiny_llama(), tmp_path / "b", [resumed], max_steps=4, save_steps=2).train(
        resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    assert resumed.monitor.history().steps.tolist() == [3, 4]
    h = hookcap.load(tmp_path / "b" / "hookcap.npz")
    assert h.steps.tolist() == [1, 2, 3, 4]
    assert hookcap.load(tmp_path / "b" / "checkpoint-4" / "hookcap.npz") == h
    # The same values as the uninterrupted run, step by step (the Trainer's resume is exact on CPU).
    want = hookcap.load(tmp_path / "a" / "hookcap.npz")
    assert sorted(h.names) == sorted(want.names)
    for name in want.names:
        for stat in ("count", "sum", "sumsq", "min", "max", "nan"):
            np.testing.assert_array_equal(h[stat][:, h.column(name)], want[stat][:, want.column(name)],
                                          err_msg=f"{name} {stat}")
        np.testing.assert_array_equal(h.histogram(name), want.histogram(name))


def test_history_concat_checks_its_inputs():
    m = nn.Linear(3, 2)
    mon = hookcap.Monitor(m, capture="output").attach()
    for _ in range(3):
        m(torch.randn(4, 3))
        mon.step()
    h = mon.history()
    with pytest.raises(ValueError, match="does not follow"):
        hookcap.History.concat([h, h])
    other = hookcap.Monitor(m, capture="output", histogram=None)
    with pytest.raises(ValueError, match="histograms differ"):
        hookcap.History.concat([h, other.history()])
    with pytest.raises(ValueError, match="no history"):
        hookcap.History.concat([])
    assert hookcap.History.concat([h]) == h


def test_callbacks_check_monitor_arguments_early():
    with pytest.raises(ValueError, match="capture"):
        HFCallback(capture="outputs")
    with pytest.raises(ValueError, match="model"):
        HFCallback(model=nn.Linear(2, 2))


# -- Lightning --------------------------------------------------------------------


def lightning_module():
    pl = pytest.importorskip("lightning.pytorch")

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.losses = collections.defaultdict(list)  # global_step -> training_step's losses

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.losses[self.global_step].append(loss.detach().double().clone())
            return loss

        def validation_step(self, batch, i):
            x, y = batch
            self.log("val", nn.functional.mse_loss(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return pl, Net()


def loaders():
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g))
    return (torch.utils.data.DataLoader(data, batch_size=4), torch.utils.data.DataLoader(data, batch_size=8))


def fit_tagged(pl, module, cb, tmp_path, max_steps, sanity):
    """Fit (2 batches per optimizer step, validation every 4 batches) with a float64 copy of
    ``net.0``'s outputs kept by (global_step, training) at each forward."""
    seen = collections.defaultdict(list)
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, num_sanity_val_steps=sanity,
                         val_check_interval=4, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=str(tmp_path), callbacks=[cb])
    module.net[0].register_forward_hook(
        lambda m, a, out: seen[(trainer.global_step, m.training)].append(out.detach().double().clone()))
    trainer.fit(module, *loaders())
    return seen


def test_lightning_records_training_steps_against_float64(tmp_path):
    pl, module = lightning_module()
    from hookcap.integrations.lightning import HookcapCallback

    cb = HookcapCallback(capture=("output", "grad_output"))
    seen = fit_tagged(pl, module, cb, tmp_path, max_steps=3, sanity=1)
    h = cb.monitor.history()
    assert h.steps.tolist() == [0, 1, 2]  # as Lightning logs them
    for step in (0, 1, 2):
        assert len(seen[(step, True)]) == 2
        assert_recorded(h, step, "net.0/output", seen[(step, True)])
    # The loss each training batch returned, tapped (tap_loss=True).
    for step in (0, 1, 2):
        assert len(module.losses[step]) == 2
        assert_recorded(h, step, "loss", module.losses[step])
    # The sanity check ran before step 0's batches, validation after step 1's.
    assert_recorded(h, 0, "eval/net.0/output", seen[(0, False)])
    assert_recorded(h, 2, "eval/net.0/output", seen[(2, False)])


def test_lightning_validation_at_the_end_of_fit_is_kept(tmp_path):
    pl, module = lightning_module()
    from hookcap.integrations.lightning import HookcapCallback

    cb = HookcapCallback(capture="output")
    seen = fit_tagged(pl, module, cb, tmp_path, max_steps=2, sanity=0)
    h = cb.monitor.history()
    # The validation after the last optimizer step runs at global_step 2: closed by detach().
    assert h.steps.tolist() == [0, 1, 2] and list(seen) == [(0, True), (1, True), (2, False)]
    assert_recorded(h, 2, "eval/net.0/output", seen[(2, False)])
    assert np.isnan(h["count"][2, h.column("net.0/output")])


def test_lightning_checkpoint_resume_continues_numbering(tmp_path):
    pl, module = lightning_module()
    from hookcap.integrations.lightning import HookcapCallback

    def trainer(steps, cb):
        return pl.Trainer(max_steps=steps, accumulate_grad_batches=2, num_sanity_val_steps=0,
                          limit_val_batches=0, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                          default_root_dir=str(tmp_path), callbacks=[cb])

    cb = HookcapCallback(capture="output", detectors=[hookcap.Spike(window=50, warmup=40)])
    t1 = trainer(2, cb)
    t1.fit(module, loaders()[0])
    t1.save_checkpoint(tmp_path / "a.ckpt")
    cb2 = HookcapCallback(capture="output", detectors=[hookcap.Spike(window=50, warmup=40)])
    _, module2 = lightning_module()
    first = hookcap.load(tmp_path / "hookcap.npz")  # written at the end of the first fit
    assert first.steps.tolist() == [0, 1] and first == cb.history()
    trainer(4, cb2).fit(module2, loaders()[0], ckpt_path=str(tmp_path / "a.ckpt"))
    assert cb2.monitor.history().steps.tolist() == [2, 3]
    assert len(cb2.monitor.detectors[0].state_dict()["window"]["net.0/output"]) == 4
    # The whole run, in the callback and in the file: the first fit's steps unchanged, then the resumed ones.
    whole = hookcap.load(tmp_path / "hookcap.npz")
    assert whole.steps.tolist() == [0, 1, 2, 3] and whole == cb2.history()
    for stat in ("count", "sum", "max", "sumsq"):
        np.testing.assert_array_equal(whole[stat][:2], first[stat])
        np.testing.assert_array_equal(whole[stat][2:], cb2.monitor.history()[stat])


# -- accelerate -------------------------------------------------------------------


def test_accelerate_optimizer_drives_step(caplog):
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(model, opt)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    seen = collections.defaultdict(list)
    step = [0]
    model[0].register_forward_hook(lambda m, a, out: seen[step[0]].append(out.detach().double().clone()))
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        mon = hookcap.Monitor(model, capture="output", optimizer=opt).attach()
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(3, 4, generator=g)).sum())
            opt.step()  # accelerate steps the inner optimizer every 2nd micro-batch
            opt.zero_grad()
        if i % 2 == 1:
            step[0] += 1
    mon.detach()
    h = mon.history()
    assert h.steps.tolist() == [0, 1, 2]
    for s in range(3):
        assert len(seen[s]) == 2
        assert_recorded(h, s, "0/output", seen[s])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def assert_updates(h, steps, deltas):
    """``{param}/update`` l2norm at each step against w_after − w_before in float64."""
    for step in steps:
        for name, (delta, w0) in deltas[step].items():
            c = h.column(f"{name}/update")
            tol = 4 * 2.0 ** -24 * float(w0.abs().max()) * delta.numel() ** 0.5 + 1e-6 * float(delta.norm())
            assert abs(h["l2norm"][h.steps.tolist().index(step), c] - float(delta.norm())) <= tol, (step, name)


class Deltas(transformers.TrainerCallback):
    """Each optimizer step's w_after − w_before, by the step the Trainer numbers."""

    def __init__(self):
        self.deltas, self._before = {}, None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self._before = {n: p.detach().double().clone() for n, p in model.named_parameters()}

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        self.deltas[state.global_step + 1] = {n: (p.detach().double() - self._before[n], self._before[n])
                                              for n, p in model.named_parameters()}


def test_hf_trainer_records_optimizer_updates_and_state(tmp_path):
    """The callback hands the Trainer's optimizer to the Monitor: update and
    optim_state are recorded right after each optimizer step (before
    zero_grad and the scheduler), numbered like the logged loss."""
    model = tiny_llama()
    cb = HFCallback(capture=("update", "optim_state"))
    deltas = Deltas()
    trainer = trainer_for(model, tmp_path, [deltas, cb], max_steps=3)
    trainer.train()
    h = cb.monitor.history()
    assert h.steps.tolist() == [1, 2, 3]
    assert_updates(h, (1, 2, 3), deltas.deltas)
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    p = dict(model.named_parameters())["model.embed_tokens.weight"]
    assert_recorded(h, 3, "model.embed_tokens.weight/state.exp_avg_sq", [opt.state[p]["exp_avg_sq"]])


def test_lightning_records_optimizer_updates(tmp_path):
    """As for the HF Trainer: the optimizer from on_before_optimizer_step, its
    update recorded right after its step, numbered as Lightning logs."""
    pl, module = lightning_module()
    from hookcap.integrations.lightning import HookcapCallback

    deltas = {}

    class Deltas(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.before = {n: p.detach().double().clone() for n, p in pl_module.named_parameters()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step - 1 not in deltas and trainer.global_step > 0 and hasattr(self, "before"):
                deltas[trainer.global_step - 1] = {n: (p.detach().double() - self.before[n], self.before[n])
                                                   for n, p in pl_module.named_parameters()}

    cb = HookcapCallback(capture=("output", "update"))
    trainer = pl.Trainer(max_steps=3, accumulate_grad_batches=2, num_sanity_val_steps=0, limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=str(tmp_path),
                         callbacks=[Deltas(), cb])
    trainer.fit(module, loaders()[0])
    h = cb.monitor.history()
    assert h.steps.tolist() == [0, 1, 2]
    assert sorted(deltas) == [0, 1, 2]
    assert_updates(h, (0, 1, 2), deltas)
