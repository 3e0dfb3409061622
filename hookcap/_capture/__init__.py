"""The first stage of hookcap's flow: where tensors come from and how they
reach the recorder. Module, tensor and parameter hooks (``hooks``, parked on
off-steps by ``park``), the model's changes (``follow``), hookcap-free copies
and pickles (``portable``), the optimizer's state (``optim``), per-module
durations (``timing``), nested inputs and outputs (``tree``), traced hooks
under torch.compile and the process-global state (``compile``), where a
tensor-parallel output lies (``parallel_plan``), hook order (``hook_order``),
GradScaler steps (``scaler``) and reduced parameter gradients
(``param_grads``)."""
