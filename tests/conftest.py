import collections
import logging
import os

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from torch.utils._python_dispatch import TorchDispatchMode

import hookcap


settings.register_profile(
    "default",
    deadline=None,
    max_examples=int(os.environ.get("HOOKCAP_HYPOTHESIS_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")

EXACT = ("count", "nan", "posinf", "neginf", "inf", "zeros", "finite", "min", "max", "absmax")


class WarningLog(logging.Handler):
    """The messages of warnings logged to the handler's logger (in worker
    processes, where pytest's caplog does not reach)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def assert_stats_match(got, ref, *, rtol_sum=1e-5, rtol_std=1e-4, abs_sum=None):
    """Compare hookcap stats with the float64 reference.

    Counts and extrema must match exactly, histograms bin for bin. ``sum`` and
    ``mean`` are judged against ``abs_sum`` (sum of |x|) when given, since a
    sum that cancels to ~0 can only be as exact as the size of its terms.
    """
    for k in EXACT:
        g, r = got[k], ref[k]
        assert (np.isnan(g) and np.isnan(r)) or g == r, f"{k}: got {g!r}, reference {r!r}"
    n = max(ref["finite"], 1.0)
    amax = 0.0 if np.isnan(ref["absmax"]) else ref["absmax"]
    tols = {
        "sum": rtol_sum * (abs(ref["sum"]) if abs_sum is None else abs_sum),
        "mean": rtol_sum * (abs(ref["mean"]) if abs_sum is None else abs_sum / n),
        "sumsq": rtol_sum * ref["sumsq"],
        "l2norm": rtol_sum * ref["l2norm"],
        "rms": rtol_sum * (0.0 if np.isnan(ref["rms"]) else ref["rms"]),
        "crest": rtol_sum * (0.0 if np.isnan(ref["crest"]) else ref["crest"]),
        "std": rtol_std * (0.0 if np.isnan(ref["std"]) else ref["std"]) + 1e-7 * amax,
    }
    for k, tol in tols.items():
        g, r = got[k], ref[k]
        if np.isnan(r):
            assert np.isnan(g), f"{k}: got {g!r}, reference NaN"
            continue
        if np.isinf(r) or np.isinf(g):
            assert g == r, f"{k}: got {g!r}, reference {r!r}"
            continue
        assert abs(g - r) <= tol, f"{k}: got {g!r}, reference {r!r} (tol {tol:g})"
    if np.isnan(ref["zero_frac"]):
        assert np.isnan(got["zero_frac"])
    else:
        assert got["zero_frac"] == ref["zero_frac"]
    if "hist" in ref:
        np.testing.assert_array_equal(got["hist"], ref["hist"])
        assert got["hist"].sum() == ref["finite"]
        np.testing.assert_array_equal(got["bin_edges"], ref["bin_edges"])


def abs_sum(x: torch.Tensor) -> float:
    """sum |x| over the finite elements: the scale of sum's rounding error."""
    a = x.detach().to(torch.float64).reshape(-1)
    return float(a[torch.isfinite(a)].abs().sum())


def stall_reader(mon):
    """Inject a stuck host reader into ``mon``'s drain: polls that do not
    wait find nothing (copies stay queued, and the ring overwrites unread
    slots). Returns the function that unsticks it."""
    drain = mon._drain
    real = drain.collect
    drain.collect = lambda rings, wait: real(rings, wait) if wait else []

    def undo():
        del drain.collect

    return undo


def assert_recorded(h, step, name, values):
    """``name``'s statistics (and histogram) at ``step`` in History ``h``
    equal the float64 reference of ``values`` (arrays or tensors, joined)."""
    import hookcap

    vals = np.concatenate([np.asarray(torch.as_tensor(v).detach().double()).reshape(-1) for v in values])
    s = h.steps.tolist().index(step)
    m = h.column(name)
    want = hookcap.reference.stats_from_values(vals, h.histogram_spec)
    got = {k: h[k][s, m] for k in hookcap.STAT_NAMES}
    if h.histogram_spec is not None:
        got["hist"], got["bin_edges"] = h.histogram(name)[s], h.bin_edges
    else:
        want.pop("hist", None)
    assert_stats_match(got, want, rtol_sum=1e-6, abs_sum=float(np.abs(vals[np.isfinite(vals)]).sum()))


def mlp():
    """The small MLP the sink tests train (seeded)."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def train_steps(mon, steps, state):
    """``steps`` forward + backward + ``mon.step()`` of ``mon.model`` on seeded
    [4, 6] inputs, inside ``with mon``; ``state["step"]`` is the step being
    run (for hooks that act at one step)."""
    g = torch.Generator().manual_seed(1)
    with mon:
        for i in range(steps):
            state["step"] = i
            mon.model(torch.randn(4, 6, generator=g)).sum().backward()
            mon.step()


MOMENT_STATS = ("sum", "sumsq", "mean", "std", "rms", "l2norm")
EXACT_STATS = ("count", "nan", "posinf", "neginf", "zeros", "finite", "min", "max", "absmax")


def scaled_abs_mean(values: np.ndarray) -> float:
    """mean |x| over finite values, computed without overflow."""
    f = values[np.isfinite(values)]
    if not f.size:
        return 0.0
    e = int(np.frexp(np.abs(f).max())[1])
    return float(np.ldexp(np.mean(np.abs(np.ldexp(f, -e))), e))


def assert_wide_match(got: dict, values: np.ndarray, histogram=None, rtol=1e-10):
    """``got`` (a stats dict) equals the float64 reference of ``values``:
    counts and extrema exactly, moments within ``rtol`` (sum and mean of the
    scale of mean |x|, std of the scale of std plus 1e-12 of absmax)."""
    import hookcap

    ref = hookcap.reference.stats_from_values(values, histogram)
    for k in EXACT_STATS:
        g, r = got[k], ref[k]
        assert (np.isnan(g) and np.isnan(r)) or g == r, f"{k}: got {g!r}, reference {r!r}"
    n = max(ref["finite"], 1.0)
    amean = scaled_abs_mean(values)
    amax = 0.0 if np.isnan(ref["absmax"]) else ref["absmax"]
    for k in MOMENT_STATS:
        g, r = got[k], ref[k]
        if np.isnan(r):
            assert np.isnan(g), f"{k}: got {g!r}, reference NaN"
            continue
        if np.isinf(r):
            assert g == r, f"{k}: got {g!r}, reference {r!r}"
            continue
        assert np.isfinite(g), f"{k}: got {g!r}, reference {r!r}"
        scale = {"sum": amean * n, "mean": amean, "std": r + 1e-2 * amax}.get(k, abs(r))
        assert abs(g - r) <= rtol * scale, f"{k}: got {g!r}, reference {r!r} ({abs(g - r) / max(scale, 1e-300):.3g})"
    if histogram is not None:
        np.testing.assert_array_equal(got["hist"], ref["hist"])


# moments=4: the powers are summed in double (the CPU loop) or in float runs
# flushed to double (the CUDA kernel) about the row's shift; the mean and
# variance they are centred with come from the float sums of inputs of 32 bits
# or fewer: std's accuracy, a few parts per million at worst (measured: up to
# 1.7e-6 on the CPU and 2.8e-6 in the emulated kernel, float16 data at +-6e4).
MOMENTS_RTOL = 5e-6


def assert_moments(got, want, values, rtol=MOMENTS_RTOL):
    """m3 within rtol of the scale of its terms (mean |x - mean|^3), m4 and
    kurtosis within rtol relative, skew within rtol (times the scale ratio
    for very skewed data)."""
    f = np.asarray(values, np.float64).reshape(-1)
    f = f[np.isfinite(f)]
    for k in hookcap.MOMENT_NAMES:
        if np.isnan(want[k]):
            assert np.isnan(got[k]), (k, got[k])
            continue
        assert np.isfinite(got[k]), (k, got[k])
    if np.isnan(want["kurtosis"]):
        return
    d = np.abs(f - f.mean())
    scale3 = np.mean(d ** 3)
    assert abs(got["m3"] - want["m3"]) <= rtol * scale3, (got["m3"], want["m3"])
    assert abs(got["m4"] - want["m4"]) <= rtol * want["m4"], (got["m4"], want["m4"])
    assert abs(got["skew"] - want["skew"]) <= rtol * max(1.0, scale3 / np.mean(d * d) ** 1.5), \
        (got["skew"], want["skew"])
    assert abs(got["kurtosis"] - want["kurtosis"]) <= rtol * want["kurtosis"], (got["kurtosis"], want["kurtosis"])


def draw(kind: str, n: int, seed: int) -> torch.Tensor:
    """float64 test data of a named shape, for the higher moments."""
    g = np.random.default_rng(seed)
    x = {
        "normal": lambda: g.standard_normal(n),
        "t3": lambda: g.standard_t(3, n),  # heavy tails: kurtosis far above 3
        "cauchy": lambda: g.standard_cauchy(n),
        "offset": lambda: 1e4 + g.standard_normal(n) * 1e-2,  # |mean| >> std
        "negative": lambda: -np.abs(g.lognormal(0, 2, n)),  # all negative, skewed
        "spiky": lambda: np.where(g.random(n) < 1e-3, 300.0, g.standard_normal(n)),  # outliers
        "two_sd": lambda: 2.0 + g.standard_normal(n),  # mean at the edge of a run's centring at 0
        "tiny": lambda: g.standard_t(3, n) * 1e-13,  # fourth powers below float's range
        "huge": lambda: g.standard_normal(n) * 1e11,  # fourth powers above it
        "halves": lambda: np.concatenate([g.standard_normal(n // 2), 1e3 + g.standard_normal(n - n // 2)]),
    }[kind]()
    return torch.from_numpy(x)


def ring_for(rows, h):
    """A CPU ring of one slot with ``rows`` rows, reset, for histogram ``h`` (or None)."""
    from hookcap import _layout
    from hookcap.functional import new_state

    ring = torch.zeros(1, rows, _layout.HEADER + (h.nbins if h else 0), dtype=torch.int64)
    torch.ops.hookcap.reset_slot(ring, new_state("cpu"))
    return ring


def decoded(ring, row, h):
    """Row ``row`` of slot 0 of ``ring`` as stats (plus its histogram where ``h``)."""
    from hookcap import _layout

    raw = ring[0, row].numpy()
    out = {k: float(v) for k, v in _layout.decode(raw).items()}
    if h is not None:
        out["hist"] = raw[_layout.HEADER:].copy()
        out["bin_edges"] = h.bin_edges
    return out


class CountOps(TorchDispatchMode):
    """Counts the hookcap op calls made through the dispatcher, by op name."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "hookcap":
            self.calls[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def attention_tile(seed: int, shape: tuple, peaked: bool = False, holes: bool = True) -> torch.Tensor:
    """A float32 tile of logits [..., rows, keys] for attention_rows: random
    rows, some with ties at the max, -inf holes (a mask), a row with no
    allowed key, and (peaked) rows whose max stands far above the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 4
    if peaked:
        x[..., 0, :] -= 12.0
        x[..., 0, 0] = 12.0  # entropy about 1e-7 nats: lse - sum(p * l) would cancel to noise
    rows = x.reshape(-1, shape[-1])
    if holes:
        rows[torch.rand(rows.shape, generator=g) < 0.2] = float("-inf")
        rows[-1] = float("-inf")
    if rows.shape[0] > 2 and shape[-1] > 2:
        rows[1, :2] = rows[1].max() + 1.0  # a tie at the max
    return x


def attention_rows_ref(logits: torch.Tensor, causal_row0: int = -1):
    """float64 (masked logits, lse, entropy in nats) of each row, the causal
    mask applied as attention_rows applies it; -inf both for a row with no
    allowed key."""
    x = logits.double().clone()
    if causal_row0 >= 0:
        q = causal_row0 + torch.arange(x.shape[-2])[:, None]
        x = x.masked_fill(torch.arange(x.shape[-1])[None, :] > q, float("-inf"))
    lse = torch.logsumexp(x, -1)
    p = torch.softmax(x, -1)
    ent = -torch.where(p > 0, p * p.log(), torch.zeros((), dtype=x.dtype)).sum(-1)
    none = torch.isneginf(x).all(-1)
    return x, lse, ent.masked_fill(none, float("-inf"))


def attention_reference(q, k, mask, causal, scale=None):
    """float64 per head: max, min and count of allowed logits; lse min/max; entropy mean/min."""
    if q.dim() == 3:
        q, k = q[None], k[None]
    q, k = q.double(), k.double()
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    logits = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed &= mask
        else:
            ok = mask > torch.finfo(mask.dtype).min / 2
            allowed &= ok
            logits = logits + torch.where(ok, mask.double(), 0.0)
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.softmax(logits, -1)
    ent = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)
    per_head = lambda t: t.transpose(0, 1).reshape(t.shape[1], -1)  # noqa: E731
    lf, lsef, entf = per_head(logits), per_head(lse), per_head(ent)
    fin = torch.isfinite(lf)
    return {"max": lf.amax(1), "min": torch.where(fin, lf, float("inf")).amin(1), "finite": fin.sum(1).double(),
            "neginf": torch.isneginf(lf).sum(1).double(), "count": torch.full((lf.shape[0],), float(lf.shape[1])),
            "lse_min": lsef.amin(1), "lse_max": lsef.amax(1), "ent_mean": entf.mean(1), "ent_min": entf.amin(1)}
