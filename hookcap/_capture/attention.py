"""Capture kind ``"attention"``: inside every ``F.scaled_dot_product_attention``
call that a watched module makes on a recorded step, per head, the
statistics of the pre-softmax logits the mask allows (``{module}/attn.logit``,
whose ``max`` is the head's max logit), and over query rows each row's
logsumexp (``{module}/attn.lse``) and attention entropy in nats
(``{module}/attn.entropy``). One group per head (``History.groups``).

On a GPU, a call with 16-bit ``q`` and ``k`` and no mask or a causal one
is observed by one ``hookcap::attention_qk`` call, whose kernel keeps the
logits on chip (``attention_qk_supported`` says which calls it takes).
Otherwise the logits are recomputed from ``q`` and ``k`` in float32, a tile of query
rows at a time (at most ``TILE_VALUES`` logits in memory, ``CUDA_TILE_VALUES``
on a GPU), on the tensors' device with no host sync; masked positions are ``-inf`` (counted in
``neginf``: every other statistic of ``attn.logit`` is over the allowed
logits). While a Monitor capturing ``"attention"`` is attached,
``torch.nn.functional.scaled_dot_product_attention`` is wrapped (code that
imported the function itself before is not seen), and so is transformers'
``AttentionInterface.get_interface`` where transformers is loaded: a model's
own eager attention is observed with the mask it applies."""

from __future__ import annotations

import functools
import math
import sys

import torch
import torch.nn.functional as F

from .. import _ops
from .._ops import make_effectful
from ..groups import Groups

TILE_VALUES = 1 << 22  # logits per tile on the CPU (16 MiB in float32)
# On a GPU each tile costs the product's launches, one accumulate_attention
# call (four launches) and their Python: larger tiles keep that under the
# GPU's time for them (GPT-2-124M, B 8 x T 1,024: 4 tiles per layer, not 25).
CUDA_TILE_VALUES = 1 << 25  # 128 MiB in float32
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()  # torch.bmm(..., out_dtype=): torch >= 2.8
ON_CHIP = True  # 16-bit q, k on a GPU, no mask or a causal one: hookcap::attention_qk, no tiles
CAUSAL_TILES = 4  # a causal call's fewest tiles (of 16 query rows or more): 5/8 of the logits computed
_PER_HEAD = Groups(dim=1, size=1)
_PATHS = ("logit", "lse", "entropy")
_OP_RECORD = torch.ops.hookcap.accumulate_attention.default
_OP_QK = torch.ops.hookcap.attention_qk.default  # CUDA, 16-bit q and k: no logits in memory
_OP_QK_SUPPORTED = torch.ops.hookcap.attention_qk_supported.default
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_ORIGINAL = F.scaled_dot_product_attention
_HF_ORIGINAL: list = [None]  # AttentionInterface.get_interface while wrapped
_ACTIVE: list[AttentionCapture] = []


def _observe(q, k, attn_mask, is_causal, scale, module: str | None = None) -> None:
    for capture in list(_ACTIVE):
        capture.observe(q, k, attn_mask, is_causal, scale, module)


def _hf_eager(fn, module, query, key, value, attention_mask, *args, **kwargs):
    """A transformers model's own eager attention ``fn``, observed: the mask
    it is given is all it applies (additive, the dtype's lowest value forbids)."""
    out = fn(module, query, key, value, attention_mask, *args, **kwargs)
    if _ACTIVE:
        _observe_traced_or_now(query, key, attention_mask, False, kwargs.get("scaling"))
    return out


def _observe_traced_or_now(q, k, mask, causal: bool, scale) -> None:
    """Eagerly: observe now. While compiling: put the opaque observation in
    the graph, for the innermost watched module at trace time."""
    if not torch.compiler.is_compiling():
        _observe(q, k, mask, causal, scale)
    elif _OBSERVE_IN_GRAPHS and _ACTIVE[0].stack:
        _observe_op(q, k, mask, causal, None if scale is None else float(scale), _ACTIVE[0].stack[-1])


def _hf_get_interface(self, attn_implementation, default):
    fn = _HF_ORIGINAL[0](self, attn_implementation, default)
    # Only the model's own eager function (the default): every other
    # implementation HF registers ("sdpa": F.scaled_dot_product_attention,
    # seen there) is left as it is.
    return functools.partial(_hf_eager, fn) if fn is default and _ACTIVE else fn


def _hf_interface():
    """transformers' AttentionInterface class where transformers is loaded (never imported here)."""
    mod = sys.modules.get("transformers.modeling_utils")
    return getattr(mod, "AttentionInterface", None)


@torch.library.custom_op("hookcap::observe_attention", mutates_args=())
def _observe_op(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                scale: float | None, module: str) -> None:
    """Compiled code's observation: opaque to the compiler, so it runs as
    eager code at each call (the Monitors' state is read then, never
    guarded), for the module named when the graph was traced."""
    _observe(q, k, attn_mask, is_causal, scale, module)


@_observe_op.register_fake
def _(q, k, attn_mask, is_causal, scale, module) -> None:
    return None


_OBSERVE_IN_GRAPHS = make_effectful(torch.ops.hookcap.observe_attention.default)


def _wrapped(*args, **kwargs):
    out = _ORIGINAL(*args, **kwargs)
    if _ACTIVE:
        a = dict(zip(_ARGS, args), **kwargs)
        _observe_traced_or_now(a["query"], a["key"], a.get("attn_mask"), bool(a.get("is_causal", False)),
                               a.get("scale"))
    return out


def attention_tiles(q: torch.Tensor, k: torch.Tensor, attn_mask=None, is_causal: bool = False, scale=None,
                    tile_values: int = TILE_VALUES):
    """Yield, per tile of query rows, ``(logits, causal_row0, hidden)``:
    float32 ``[B, H, rows, keys]`` logits ``(q·scale)·kᵀ`` (plus a float
    mask's finite values; ``-inf`` where a boolean mask or a float mask's
    ``-inf`` or lowest value forbids), the tile's first query under a causal
    mask (else -1: the argument of ``hookcap::attention_rows`` and
    ``accumulate_attention``, which write the causal mask's ``-inf`` and
    compute each row's logsumexp and entropy), and ``hidden = Tk - keys``:
    under a causal mask, the keys after the tile's last query, hidden from
    every row of it, are neither computed nor held (``keys`` = that query +
    1). ``q``: ``[B, H, Tq, D]`` or ``[H, Tq, D]``; ``k``: the same with
    ``Hk`` heads dividing ``H`` (grouped query attention); masks as
    ``F.scaled_dot_product_attention`` takes them."""
    if q.dim() == 3:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    rep = h // hk
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qg = q.reshape(b, hk, rep, tq, d)
    # 16-bit q and k on a GPU: the product on tensor cores, accumulated and
    # written in float32 (each product of two 16-bit values is exact in
    # float32). Scaling by a power of two is exact in 16 bits too.
    low = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and _BMM_OUT_DTYPE
    pow2 = math.frexp(scale)[0] == 0.5
    kt = (k if low else k.float()).transpose(-1, -2)
    # The queries scaled once for all tiles (1/Tk of the logits' values): per
    # tile only views, the product and the statistics (host time per tile
    # bounds how small a tile can be).
    if low:
        qs_all = qg * scale if pow2 else qg
    else:
        qs_all = qg.float() * scale
    rows = max(1, tile_values // max(1, b * h * tk))
    if is_causal and tq >= CAUSAL_TILES * 16:
        # At least CAUSAL_TILES tiles: each computes only the keys up to its
        # last query, (1 + 1/n) / 2 of the square.
        rows = min(rows, -(-tq // CAUSAL_TILES))
    for q0 in range(0, tq, rows):
        q1 = min(tq, q0 + rows)
        keys = min(tk, q1) if is_causal else tk
        kt_tile = kt if keys == tk else kt.narrow(-1, 0, keys)
        qt = qs_all if q1 - q0 == tq else qs_all.narrow(3, q0, q1 - q0)
        if low:
            logits = torch.bmm(qt.reshape(b * hk, rep * (q1 - q0), d), kt_tile.reshape(b * hk, d, keys),
                               out_dtype=torch.float32).view(b, h, q1 - q0, keys)
            if not pow2:
                logits.mul_(scale)
        else:
            logits = torch.matmul(qt.reshape(b, hk, rep * (q1 - q0), d), kt_tile).view(b, h, q1 - q0, keys)
        if attn_mask is not None:
            m = attn_mask[..., q0:q1, :] if attn_mask.shape[-2] != 1 else attn_mask
            m = m[..., :keys] if m.shape[-1] != 1 else m
            if m.dtype != torch.bool:  # additive; -inf or the dtype's lowest value (HF's) forbids
                mf = m.float()
                forbid = (mf > torch.finfo(m.dtype).min / 2).logical_not_()
                logits.add_(mf)  # the forbidden sums are overwritten next
            else:
                forbid = m.logical_not()
            logits.masked_fill_(forbid, float("-inf"))
        yield logits, q0 if is_causal else -1, tk - keys


class AttentionCapture:
    """One Monitor's attention capture: the watched modules being run (a
    stack kept by their pre and post forward hooks), and the writes."""

    def __init__(self, recorder, on_traced=lambda: None) -> None:
        """``on_traced``: called when dynamo traces a hook (the Monitor then
        keeps its hooks in place on off-steps: no recompile)."""
        self.rec = recorder
        self.stack: list[str] = []
        self.on_traced = on_traced

    def install(self) -> None:
        if self not in _ACTIVE:
            _ACTIVE.append(self)
        F.scaled_dot_product_attention = _wrapped
        hf = _hf_interface()
        if hf is not None and _HF_ORIGINAL[0] is None:
            _HF_ORIGINAL[0] = hf.get_interface
            hf.get_interface = _hf_get_interface

    def uninstall(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if not _ACTIVE and F.scaled_dot_product_attention is _wrapped:
            F.scaled_dot_product_attention = _ORIGINAL
        hf = _hf_interface()
        if not _ACTIVE and hf is not None and _HF_ORIGINAL[0] is not None:
            hf.get_interface, _HF_ORIGINAL[0] = _HF_ORIGINAL[0], None
        self.stack.clear()

    def module_hooks(self, name: str):
        """(pre, post) forward hooks of watched module ``name``."""
        stack, on_traced = self.stack, self.on_traced

        def pre(mod, args):
            if torch.compiler.is_compiling():
                on_traced()
            stack.append(name)

        def post(mod, args, output):
            if stack and stack[-1] == name:
                stack.pop()

        return pre, post

    def observe(self, q, k, attn_mask, is_causal: bool, scale, module: str | None = None) -> None:
        """Record one attention call of the innermost running watched module
        (``module``: compiled code's, named when traced)."""
        rec = self.rec
        if module is None and self.stack:
            module = self.stack[-1]
        if not (module and rec.records("attention")) or rec.in_eval():
            return
        if q.dim() not in (3, 4) or k.dim() != q.dim() or q.shape[-3] % k.shape[-3]:
            rec.warn_once(("attention", module), f"hookcap: {module}/attn.*: query and key of "
                          f"shapes {tuple(q.shape)}, {tuple(k.shape)} are not recorded (3 or 4 dimensions, "
                          "heads at -3)")
            return
        # Autocast off: the products stay float32 (or 16-bit in, float32 out) in a model run under autocast.
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            if q.is_cuda and self._on_chip(module, q.detach(), k.detach(), attn_mask, is_causal, scale):
                return
            tile = CUDA_TILE_VALUES if q.is_cuda else TILE_VALUES
            hidden_per_head = 0  # logits the causal tiles left uncomputed, per batch entry and head
            hist = rec.config.hist_args
            for logits, row0, hidden in attention_tiles(q.detach(), k.detach(), attn_mask, is_causal, scale, tile):
                # One op: the rows' logsumexp and entropy, and the three metrics' statistics per head.
                if not rec.write_joint(module, "attn", _PATHS, (logits, logits[..., 0], logits[..., 0]),
                                       logits.device, "attention", _PER_HEAD,
                                       lambda ring, rows: _OP_RECORD(logits, row0, ring.ring, ring.state, *rows,
                                                                     *hist)):
                    lse, entropy = _ops.attention_rows(logits, row0)
                    for path, t in zip(_PATHS, (logits, lse, entropy)):
                        rec.write(module, "attn", path, t, "attention", 0, groups=_PER_HEAD)
                hidden_per_head += logits.shape[-2] * hidden
            if hidden_per_head:  # still counted (neginf): one -inf, read once, counted per repeat
                ninf = torch.full((), float("-inf"), device=logits.device)
                rec.write(module, "attn", "logit", ninf.expand(*logits.shape[:2], hidden_per_head), "attention", 0,
                          groups=_PER_HEAD)

    def _on_chip(self, module: str, q, k, attn_mask, is_causal: bool, scale) -> bool:
        """The whole call by one ``hookcap::attention_qk`` (16-bit ``q`` and
        ``k`` on a GPU, no mask or a causal one: the logits never leave the
        chip); False where it does not take the call (the tiles then do)."""
        if attn_mask is not None or not ON_CHIP:
            return False
        if q.dim() == 3:
            q, k = q.unsqueeze(0), k.unsqueeze(0)
        rec = self.rec
        cfg = rec.config
        if not _OP_QK_SUPPORTED(q, k, *cfg.hist_args, cfg.width):
            return False
        b, h, tq, _ = q.shape
        tk = k.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        # Stand-ins of the captures' shapes (one element, expanded; never read, no kernel).
        one = torch.empty((), device=q.device)
        shapes = (one.expand(b, h, tq, tk), one.expand(b, h, tq))
        return rec.write_joint(module, "attn", _PATHS, (shapes[0], shapes[1], shapes[1]), q.device, "attention",
                               _PER_HEAD, lambda ring, rows: _OP_QK(q, k, bool(is_causal), scale, ring.ring,
                                                                     ring.state, *rows, *cfg.hist_args))
