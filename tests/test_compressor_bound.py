"""Every finite element comes back within the bound; NaN and ±Inf come back as they were.

Property tests over random shapes, dtypes, values and bounds (ABS and REL), then the
adversarial inputs of docs/error-bound.md one by one.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kit import assert_within, rel_bound

import ccoll
from ccoll.compressor import compress_abs, header
from ccoll.errorbound import finite_range  # only to compare with the parallel range

F32_MAX = float(np.finfo(np.float32).max)
F64_MAX = float(np.finfo(np.float64).max)
DTYPES = [np.float32, np.float64]


def _np(x):
    return x.detach().numpy() if type(x).__module__.startswith("torch") else np.asarray(x)


def roundtrip(x, eb):
    buf = ccoll.compress(x, eb)
    y = ccoll.decompress(buf)
    assert isinstance(y, np.ndarray)
    assert y.dtype == _np(x).dtype and y.shape == _np(x).shape
    return buf, y


def resolved(x, eb):
    """The bound the contract promises, computed here from the data, exactly."""
    if isinstance(eb, ccoll.REL):
        return rel_bound(eb.value, _np(x))
    return Fraction(eb.value)


def check(x, eb):
    buf, y = roundtrip(x, eb)
    e = resolved(x, eb)
    # The header states that bound, REL's product rounded to float64 (two roundings).
    assert abs(Fraction(header(buf).eb) - e) <= e * Fraction(1, 2**51), (header(buf).eb, e)
    # docs/error-bound.md promises |y - x| < eb, strictly (and y == x where eb = 0).
    assert_within(y, x, e, strict=e > 0)
    if e == 0.0:
        # Lossless: equal values (signed zeros may become +0.0 in zero blocks).
        fin = np.isfinite(x)
        assert np.array_equal(y[fin], x[fin])
    return y


# ------------------------------------------------------------------------------ properties

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=9)
bounds = st.one_of(
    st.floats(1e-12, 1e6).map(ccoll.ABS),
    st.sampled_from([1e-6, 1e-4, 1e-3, 1e-2, 0.3]).map(ccoll.REL),
)


@st.composite
def data(draw):  # type: ignore[no-untyped-def]
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    width = 32 if dtype == np.float32 else 64
    elems = draw(st.sampled_from(["any", "finite", "small"]))
    if elems == "any":
        strat = st.floats(width=width)
    elif elems == "finite":
        strat = st.floats(width=width, allow_nan=False, allow_infinity=False)
    else:
        strat = st.floats(-10, 10, width=width)
    return draw(hnp.arrays(dtype, shape, elements=strat))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data(), bounds)
def test_every_finite_element_within_the_bound(x, eb):
    check(x, eb)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5000), st.sampled_from(DTYPES),
       st.sampled_from([1e-5, 1e-4, 1e-3, 1e-2]))
def test_gradient_like_data_rel(seed, n, dtype, rel):
    rng = np.random.default_rng(seed)
    # Heavy tails and many exact zeros, like real gradients.
    x = rng.standard_t(2, n) * 1e-3
    x[rng.random(n) < 0.3] = 0.0
    check(x.astype(dtype), ccoll.REL(rel))


# ---------------------------------------------------------------------------- adversarial

def _cases():
    rng = np.random.default_rng(1)
    alt = np.empty(100)
    alt[0::2] = 1e30
    alt[1::2] = 1e-30
    return {
        "zeros": np.zeros(100),
        "neg_zeros": -np.zeros(100),
        "constant": np.full(77, 3.25),
        "huge_1e38": np.array([1e38, -1e38, 1e38, 0.0, 1.0]),
        "flt_max": np.array([F32_MAX, -F32_MAX, 0.0, 1.0, -F32_MAX]),
        "subnormals": np.array([1e-45, -1e-45, 1e-40, 5e-324, 0.0, 1e-310]),
        "nan": np.array([np.nan, 1.0, np.nan, -2.0] * 10),
        "inf": np.array([np.inf, -np.inf, 1.0, -1.0, 0.5] * 9),
        "alternating_huge_tiny": alt,
        "one": np.array([0.123]),
        "thirty_three": rng.standard_normal(33),
        "empty": np.zeros(0),
        "zero_d": np.array(2.5),
        "ramp": np.linspace(-1, 1, 1000),
        "near_half_steps": (np.arange(-64, 64) + 0.5) * 2e-3,
    }


CASES = _cases()
EBS = [ccoll.ABS(1e-30), ccoll.ABS(1e-3), ccoll.ABS(1e30), ccoll.REL(1e-3), ccoll.REL(1e-6)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("eb", EBS, ids=repr)
def test_adversarial(name, dtype, eb):
    with np.errstate(over="ignore"):
        x = CASES[name].astype(dtype)
    check(x, eb)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_payload_and_sign_kept_bit_for_bit(dtype):
    x = np.array([1.0, np.nan, -np.nan, 2.0], dtype)
    bits = x.view(np.uint32 if dtype == np.float32 else np.uint64)
    bits[1] |= 0x123  # a payload
    _, y = roundtrip(x, ccoll.ABS(1e-3))
    assert y.tobytes()[x.itemsize : 3 * x.itemsize] == x.tobytes()[x.itemsize : 3 * x.itemsize]


def test_rel_on_constant_data_is_lossless():
    x = np.full((4, 5), -7.125, np.float32)
    buf, y = roundtrip(x, ccoll.REL(1e-3))
    assert header(buf).eb == 0.0 and header(buf).bound == 0.0
    assert np.array_equal(y, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rel_ignores_non_finite_values_in_the_range(dtype):
    x = np.array([np.inf, 0.0, 1.0, np.nan, -np.inf, 0.5], dtype)
    buf, y = roundtrip(x, ccoll.REL(1e-2))
    assert header(buf).eb == 1e-2
    assert_within(y, x, rel_bound(1e-2, x), strict=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_range_overflow_still_bounded(dtype):
    big = F32_MAX if dtype == np.float32 else F64_MAX
    x = np.array([big, -big, 0.0, 1.0], dtype)
    buf, y = roundtrip(x, ccoll.REL(1e-3))
    assert math.isfinite(header(buf).eb)
    assert_within(y, x, rel_bound(1e-3, x), strict=True)


def test_rounding_to_float32_forces_raw_at_tiny_bounds():
    # eb far below the float32 spacing near 1: only the exact value passes, the block is
    # stored raw, and the values come back exactly.
    x = np.float32(1.0) + np.arange(32, dtype=np.float32) * np.float32(2**-23)
    buf = compress_abs(x, 1e-12)
    assert header(buf).payload_words == 32
    assert np.array_equal(ccoll.decompress(buf), x)


def test_codes_beyond_31_bits_are_raw():
    x = np.array([3e9 * 2e-3] + [0.0] * 31)  # q = 3e9 >= 2^31 - 1
    buf = compress_abs(x, 1e-3)
    assert header(buf).payload_words == 64
    assert np.array_equal(ccoll.decompress(buf), x)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fortran_and_strided_inputs(order, dtype):
    rng = np.random.default_rng(3)
    base = np.asarray(rng.standard_normal((40, 30)), dtype=dtype, order=order)
    for x in (base, base[::3, 1::2], base.T):
        _, y = roundtrip(x, ccoll.ABS(1e-3))
        assert_within(y, x, 1e-3, strict=True)
        assert y.flags.c_contiguous


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_cpu_tensors(dtype):
    torch = pytest.importorskip("torch")
    t = torch.randn(17, 9, dtype=getattr(torch, dtype), requires_grad=True)
    buf, y = roundtrip(t, ccoll.REL(1e-3))
    x = t.detach().numpy()
    assert_within(y, x, rel_bound(1e-3, x), strict=True)
    # A non-contiguous view is copied, not misread.
    tv = t.detach().t()
    y2 = ccoll.decompress(ccoll.compress(tv, ccoll.ABS(1e-4)))
    assert_within(y2, tv.numpy(), 1e-4, strict=True)


def test_big_endian_input():
    x = np.linspace(0, 1, 100).astype(">f4")
    _, y = roundtrip(x.astype(np.float32), ccoll.ABS(1e-3))
    buf = ccoll.compress(x, ccoll.ABS(1e-3))
    assert ccoll.decompress(buf).dtype == np.float32
    assert np.array_equal(ccoll.decompress(buf), y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("values", [
    [], [np.nan], [np.inf, -np.inf, np.nan], [-0.0, 0.0], [1.0], [3.0, np.nan, -2.0, np.inf],
    list(np.linspace(-5, 7, 70001)) + [np.nan, -np.inf], [F32_MAX, -F32_MAX, 1e-45],
], ids=lambda v: f"n{len(v)}" if isinstance(v, list) else None)
def test_parallel_range_equals_the_reference_range(values, dtype):
    from ccoll.compressor import cpu as _cpu

    with np.errstate(over="ignore"):
        x = np.array(values, dtype)
    assert _cpu.finite_range(x) == finite_range(x)
