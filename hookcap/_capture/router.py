"""Capture kind ``"router"``: the routing of a mixture-of-experts layer, read
from a watched module that returns a router's outputs: its logits
``[..., E]`` and its top-k expert choices (an integer tensor ``[..., k]`` over
the same tokens), with or without their routing weights ``[..., k]``, in any
order inside a tuple (HF Mixtral, OLMoE and Qwen-MoE routers return
``(logits, weights, indices)``). On recorded steps, per router module:

- ``{module}/router.tokens``: one group per expert (``History.groups``):
  ``count`` = tokens routed to the expert (top-k choices naming it, exactly);
  the values are the routing weights of those choices (``mean``: the
  expert's mean routing weight), or 1.0 without weights.
- ``{module}/router.load``: the E per-expert counts as one tensor: ``max /
  mean`` is the load's max over mean, ``std / mean`` its coefficient of
  variation, ``zeros`` the experts that got no token (dead this step).
- ``{module}/router.z``: each token's ``logsumexp(logits)²``; ``mean`` is the
  router z-loss (Zoph et al. 2022, ST-MoE).
- ``{module}/router.entropy``: each token's entropy of ``softmax(logits)``
  in nats (``ln E`` at most: uniform routing).

Both from one pass over a float32 copy of the logits (``attention_rows``'
row math); a token whose logits are all ``-inf`` has z ``inf`` and entropy
``-inf``, one holding NaN or ``+inf`` NaN for both.

A router returning a dispatch mask after capacity instead of indices (HF
Switch Transformers: ``(mask [..., E], top weight [..., 1], logits)``) also
gets ``{module}/router.wanted``: one group per expert, the tokens whose
largest logit names it (demand before capacity, for top-1 routing), and
``{module}/router.dropped``: 1.0 per token no expert took (``sum``: dropped
tokens, ``mean``: their share); ``router.tokens`` counts the kept ones.

Computed on the tensors' device with no host sync (a few small temporaries
of E or tokens values, on recorded steps only). Inside ``torch.compile``d
code an opaque op in the graph does the same at run time."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .._ops import attention_rows, make_effectful


def router_parts(out) -> tuple | None:
    """``(logits, weights or None, choices)`` of a router's output, or None
    where ``out`` is no router's: a tuple or list holding an integer tensor
    ``[..., k]`` (top-k choices) and a floating tensor ``[..., E]`` over the
    same tokens (``E > k``), weights a floating tensor of the choices' shape;
    or a dispatch mask (integer or bool, the logits' shape ``[..., E]``: 1
    where a token goes to an expert after capacity, as HF Switch
    Transformers' router returns), weights ``[..., 1]`` or ``[..., E]``."""
    if not isinstance(out, (tuple, list)):
        return None
    ts = [t for t in out if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.numel() > 0]
    ints = [t for t in ts if not t.is_floating_point() and not t.is_complex()]
    floats = [t for t in ts if t.is_floating_point()]
    idx = next((t for t in ints if t.dtype != torch.bool), None)
    if idx is not None:
        k = idx.shape[-1]
        tokens = idx.numel() // k
        logits = next((t for t in floats if t.shape[-1] > k and t.numel() == tokens * t.shape[-1]), None)
        if logits is not None:
            return logits, next((t for t in floats if t.shape == idx.shape), None), idx
    for mask in ints:  # no wider logits: a dispatch mask, if one has the logits' shape
        logits = next((f for f in floats if f.shape == mask.shape and f.shape[-1] >= 2), None)
        if logits is not None:
            weights = next((f for f in floats if f is not logits and f.shape[:-1] == mask.shape[:-1]
                            and f.shape[-1] in (1, mask.shape[-1])), None)
            return logits, weights, mask
    return None


_CAPTURES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> RouterCapture


@torch.library.custom_op("hookcap::observe_router", mutates_args=())
def _observe_op(logits: torch.Tensor, weights: Optional[torch.Tensor], choices: torch.Tensor, capture: int,
                module: str, mtype: str) -> None:
    """Compiled code's router call: opaque to the compiler, so it runs as
    eager code at each call and reads the Monitor's state then (no guard)."""
    c = _CAPTURES.get(capture)
    if c is not None and c.rec.records("router"):
        with torch.no_grad():
            record_router(c.rec, module, mtype, logits, weights, choices)


@_observe_op.register_fake
def _(logits, weights, choices, capture, module, mtype) -> None:
    return None


_OBSERVE_IN_GRAPHS = make_effectful(torch.ops.hookcap.observe_router.default)


class RouterCapture:
    """One Monitor's router capture: a forward hook per watched module.
    ``on_traced``: called when dynamo traces a hook (the Monitor then keeps
    its hooks in place on off-steps: no recompile)."""

    def __init__(self, recorder, on_traced=lambda: None) -> None:
        self.rec = recorder
        self.on_traced = on_traced
        _CAPTURES[id(self)] = self

    def hook(self, name: str, mtype: str):
        """The forward hook recording module ``name``'s routing, if its output is a router's."""
        rec, me = self.rec, id(self)

        def post(mod, args, out):
            # Compiled code reads no Monitor state (a guard on `recording`
            # would recompile at each change): the op in the graph does.
            compiling = torch.compiler.is_compiling()
            if not (compiling or rec.records("router")):
                return
            parts = router_parts(out)  # compiled: the output's structure, a constant of the graph
            if parts is None:
                return
            if not compiling:
                with torch.no_grad():
                    record_router(rec, name, mtype, *parts)
            elif _OBSERVE_IN_GRAPHS:
                self.on_traced()
                _observe_op(*parts, me, name, mtype)

        return post


def record_router(rec, name: str, mtype: str, logits: torch.Tensor, weights: torch.Tensor | None,
                  choices: torch.Tensor) -> None:
    """Write one router call's metrics (module docstring) into ``rec``;
    ``choices``: top-k indices, or a dispatch mask of the logits' shape."""
    experts = logits.shape[-1]
    # A float32 copy, never the model's tensor: attention_rows' argument is in-out.
    lf = logits.detach().reshape(-1, experts).to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if choices.shape == logits.shape:  # a dispatch mask: expert e where set, else -1 (in no group)
        mask = choices.detach().reshape(-1, experts) != 0
        idx = torch.where(mask, torch.arange(experts, device=mask.device), -1)
        if weights is not None:
            weights = weights.detach().reshape(mask.shape[0], -1).expand(mask.shape)
        rec.write(name, "router", "dropped", (~mask.any(-1)).to(torch.float32), mtype, 0)
        rec.write_bins(name, "router", "wanted", lf.argmax(-1), None, experts, mtype, 0)
    else:
        idx = choices.detach()
    rec.write_bins(name, "router", "tokens", idx, None if weights is None else weights.detach(), experts, mtype, 0)
    flat = idx.reshape(-1).long()
    # Choices outside [0, E) (dropped: no expert) count in an extra last slot, left out.
    slot = torch.where((flat >= 0) & (flat < experts), flat, experts)
    counts = torch.zeros(experts + 1, dtype=torch.float64, device=flat.device)
    counts.index_add_(0, slot, torch.ones((), dtype=torch.float64, device=flat.device).expand(flat.numel()))
    rec.write(name, "router", "load", counts[:experts], mtype, 0)
    lse, entropy = attention_rows(lf)  # each token's logsumexp and entropy in one pass
    rec.write(name, "router", "z", lse.square_(), mtype, 0)
    rec.write(name, "router", "entropy", entropy, mtype, 0)
