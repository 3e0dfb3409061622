"""FP8 fit from the log2 histogram: the true fractions (computed from the
values in float64) always inside the bounds; exact at power-of-two scales;
the underflow definition is what torch's float8 casts do."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hookcap
from hookcap import Histogram, Monitor
from hookcap.fp8 import FORMATS, fit

H = Histogram.log2(-40, 20)  # covers both formats' ranges at the scales drawn


def truth(x, fmt, s):
    fmax, fnorm, fsub = FORMATS[fmt]
    a = np.abs(x.double().numpy().reshape(-1))
    a = a[np.isfinite(a)]
    y = a * s
    n = max(a.size, 1)
    # absmax * (max / absmax) may round above max: the values are what is scaled, not the product.
    # Half the smallest subnormal is a tie: it rounds to even, to 0.
    return ((a > 0) & (y <= fsub / 2)).sum() / n, ((y > fsub / 2) & (y < fnorm)).sum() / n, \
        (y > fmax * (1 + 1e-12)).sum() / n


def tie_bin(x, fmt, s):
    """The fraction of finite values in the log2 bin that starts at half the
    smallest subnormal (scaled): the only bin that may hold ties."""
    a = np.abs(x.double().numpy().reshape(-1))
    a = a[np.isfinite(a)]
    y = a * s
    half = FORMATS[fmt][2] / 2
    return ((y >= half) & (y < 2 * half)).sum() / max(a.size, 1)


@st.composite
def data(draw):
    n = draw(st.integers(1, 4000))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    x = rng.standard_t(draw(st.sampled_from([1, 3, 30])), size=n) * 10.0 ** draw(st.integers(-6, 2))
    x[rng.random(n) < draw(st.sampled_from([0.0, 0.3]))] = 0.0
    if draw(st.booleans()):
        x[rng.integers(n)] = np.nan
    return torch.tensor(x, dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])))


@given(x=data(), fmt=st.sampled_from(["e4m3", "e5m2"]),
       scaling=st.sampled_from(["amax", 2.0 ** -3, 2.0 ** 7, 3.7]),
       h=st.sampled_from([H, Histogram.log2(-40, 20, sub=4), Histogram.log2(-40, 20, signed=True)]))
def test_true_fractions_inside_bounds(x, fmt, scaling, h):
    s = hookcap.tensor_stats(x, h)
    f = fit(s["hist"], h, s["absmax"], fmt, scaling)
    if s["finite"] == 0:
        assert np.isnan(f.underflow_lo)
        return
    scale = FORMATS[fmt][0] / s["absmax"] if scaling == "amax" and s["absmax"] > 0 else \
        (1.0 if scaling == "amax" else scaling)
    assert f.scale == pytest.approx(scale, rel=1e-15)
    u, sub, sat = truth(x, fmt, float(f.scale))
    for (lo, hi), t in zip([(f.underflow_lo, f.underflow_hi), (f.subnormal_lo, f.subnormal_hi),
                            (f.saturate_lo, f.saturate_hi)], (u, sub, sat)):
        assert lo <= t + 1e-15 and t <= hi + 1e-15, (lo, t, hi)
    if scaling == "amax":
        assert f.saturate_lo == f.saturate_hi == 0  # amax maps to the format's max
    if isinstance(scaling, float) and scaling in (2.0 ** -3, 2.0 ** 7):
        # Thresholds on powers of two: exact but for the bin that starts at the tie.
        slack = tie_bin(x, fmt, float(f.scale))
        assert f.underflow_hi - f.underflow_lo <= slack + 1e-15 and f.subnormal_hi - f.subnormal_lo <= slack + 1e-15


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_underflow_is_what_the_cast_does(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.exp(torch.randn(100_000, generator=g) * 4)
    s = 2.0 ** -4
    st_ = hookcap.tensor_stats(x, H)
    f = fit(st_["hist"], H, st_["absmax"], fmt, s)
    cast = (x * s).clamp(-FORMATS[fmt][0], FORMATS[fmt][0]).to(dtype).float()
    zeroed = ((cast == 0) & (x != 0)).double().mean().item()
    assert f.underflow_lo <= zeroed <= f.underflow_hi
    assert f.underflow_hi - f.underflow_lo <= tie_bin(x, fmt, s) + 1e-15


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_half_the_smallest_subnormal_is_counted_as_underflow(fmt, dtype):
    """Values at exactly half the smallest subnormal: the cast rounds the tie
    to 0; the fit's underflow bounds hold that (it cannot be told from the
    bin's other values, so it is not called exact)."""
    half = FORMATS[fmt][2] / 2
    x = torch.tensor([half] * 3 + [half * 1.5] + [1.0] * 6)
    st_ = hookcap.tensor_stats(x, H)
    f = fit(st_["hist"], H, st_["absmax"], fmt, 1.0)
    zeroed = ((x.to(dtype).float() == 0) & (x != 0)).double().mean().item()
    assert zeroed == pytest.approx(0.3)
    assert f.underflow_lo <= zeroed <= f.underflow_hi and not bool(f.exact)


def test_history_fp8_fit_and_errors():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    mon = Monitor(model, capture="output", histogram=H)
    keep = {}
    model[0].register_forward_hook(lambda m, i, o: keep.__setitem__(len(keep), o.detach().clone()))
    with mon:
        for _ in range(3):
            model(torch.randn(16, 8) * 1e-3).sum().backward()
            mon.step()
    h = mon.history()
    f = h.fp8_fit("0/output", "e5m2", 2.0 ** 3)
    assert f.underflow_lo.shape == (3,)
    for i in range(3):
        u, sub, sat = truth(keep[i], "e5m2", 2.0 ** 3)
        assert f.underflow_lo[i] == u and f.subnormal_lo[i] == sub and f.saturate_lo[i] <= sat <= f.saturate_hi[i]
    with pytest.raises(ValueError, match="fmt"):
        h.fp8_fit("0/output", "e3m4")
    with pytest.raises(ValueError, match="scaling"):
        h.fp8_fit("0/output", scaling=-1.0)
    with pytest.raises(ValueError, match="log2"):
        fit(np.zeros(6), Histogram.linear(0, 1, 4), 1.0)
