"""Homomorphic add: streams summed without decompressing, exactly as docs/format.md says.

The exact-equality tests use power-of-two bounds, where ``float64(q) * step`` is exact,
so the format's integer sum and the float64 sum of the decoded arrays must agree bit for
bit. Other bounds are checked against the bound of docs/error-bound.md.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import ExactSum, assert_within
from test_compressor_reference import ref_add, ref_parse

import ccoll
from ccoll.compressor import add, add_data, compress_abs, decompress, header, max_nbytes
from ccoll.errors import ErrorBoundError, MismatchError

DTYPES = [np.float32, np.float64]


def gradient(rng, n, dtype, scale=1e-2):
    x = rng.standard_t(3, n) * scale
    x[rng.random(n) < 0.4] = 0.0
    return x.astype(dtype)


def codes_of(buf):
    return [c for c, _ in ref_parse(buf.tobytes())["blocks"]]


# ---------------------------------------------------------------------------- exactness


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(1, 3000), st.sampled_from(DTYPES),
       st.integers(-16, -4), st.sampled_from([1.0, 30.0, 1e9]))
def test_sum_decodes_to_the_sum_of_decodes(seed, n, dtype, k, scale_b):
    rng = np.random.default_rng(seed)
    eb = 2.0**k  # power of two: decoded lanes are exact multiples of step
    xa = gradient(rng, n, dtype)
    xb = gradient(rng, n, dtype, scale=1e-2 * scale_b)
    xa[rng.random(n) < 0.01] = np.nan
    a, b = compress_abs(xa, eb), compress_abs(xb, eb)
    s = add(a, b)
    ya, yb, ys = decompress(a), decompress(b), decompress(s)
    expect = (ya.astype(np.float64) + yb.astype(np.float64)).astype(dtype)
    assert np.array_equal(ys, expect, equal_nan=True)
    assert np.array_equal(np.isnan(ys), np.isnan(xa) | np.isnan(xb))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(1, 400), st.sampled_from(DTYPES),
       st.floats(1e-7, 1e-1), st.integers(2, 5))
def test_sum_of_many_within_the_sum_of_bounds(seed, n, dtype, eb, terms):
    rng = np.random.default_rng(seed)
    xs = [gradient(rng, n, dtype, scale=10.0 ** rng.integers(-4, 2)) for _ in range(terms)]
    s = compress_abs(xs[0], eb)
    for x in xs[1:]:
        s = add(s, compress_abs(x, eb))
    h = header(s)
    bound = Fraction(eb) * terms  # the exact sum of the streams' bounds
    assert h.nterms == terms
    assert Fraction(h.bound) >= bound
    y = decompress(s)
    # docs/error-bound.md, "Homomorphic sum": at most bound (1 + 2^-21) from quantization;
    # float64 roundings, 3 per add and one in the final product, each within 2^-53 of
    # M = sum |x| + bound; one rounding to the dtype. M is summed here in float64, so the
    # float64 part counts one rounding more than the proof, which covers M's own roundings.
    m = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0) + float(bound)
    extra = (3 * (terms - 1) + 2) * 2.0**-53 * m
    assert_within(y, ExactSum(xs), bound * (1 + Fraction(1, 2**21)), roundings=1, extra=extra)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_is_commutative_bytewise_and_order_free_in_the_integer_domain(dtype):
    rng = np.random.default_rng(7)
    xs = [gradient(rng, 5000, dtype) for _ in range(3)]
    a, b, c = (compress_abs(x, 1e-4) for x in xs)
    assert add(a, b).tobytes() == add(b, a).tobytes()
    left, right = add(add(a, b), c), add(a, add(b, c))
    assert not {32, 33} & set(codes_of(left))  # integer domain only
    assert np.array_equal(decompress(left), decompress(right))


# ---------------------------------------------------------------------- block kinds


def _blocks(*blocks):
    return np.concatenate([np.asarray(b, np.float64) for b in blocks])


EB = 0.5  # step 1: q equals the value for integers


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_kinds(dtype):
    z = np.zeros(32)
    narrow = np.array([1.0, -1.0] * 16)
    wide = np.full(32, 2.0**30)  # q = 2^30, width 31
    raw = np.array([np.inf] + [1.0] * 31)  # an Inf makes the block raw
    ovf = np.full(32, 2.0**30 + 2.0**29)  # fine alone (31 bits); the sum overflows
    xa = _blocks(z, narrow, z, narrow, wide, raw, ovf, narrow).astype(dtype)
    xb = _blocks(z, z, narrow, -narrow, wide, narrow, ovf, raw).astype(dtype)
    a, b = compress_abs(xa, EB), compress_abs(xb, EB)
    ca, cb, cs = codes_of(a), codes_of(b), codes_of(s := add(a, b))
    raw_sum = 33 if dtype == np.float32 else 32
    assert ca[0] == cb[0] == cs[0] == 0  # zero + zero
    assert cs[1] == ca[1] and cs[2] == cb[2]  # zero + X: X unchanged
    pa, ps = ref_parse(a.tobytes()), ref_parse(s.tobytes())
    assert ps["blocks"][1] == pa["blocks"][1]
    assert cs[3] == 0  # narrow + (-narrow) = 0: a zero block
    assert ca[4] == 31 and cs[4] == raw_sum  # 2^30 + 2^30 = 2^31 >= 2^31 - 1
    assert ca[5] == 32 and cs[5] == raw_sum  # raw + fixed
    assert ca[6] == cb[6] not in (32, 33) and cs[6] == raw_sum  # overflow
    assert cs[7] == raw_sum
    ys = decompress(s)
    with np.errstate(over="ignore", invalid="ignore"):
        expect = (xa.astype(np.float64) + xb.astype(np.float64)).astype(dtype)
    assert np.array_equal(ys, expect, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eb", [EB, 0.0])
def test_add_data_is_add_of_the_compressed_data_for_every_block_kind(dtype, eb):
    # Every pairing of zero, fixed, Lorenzo, wide, raw and overflowing blocks, with the
    # data on either side of the pair; eb = 0 is the lossless case (zero or raw blocks).
    z = np.zeros(32)
    narrow = np.array([1.0, -1.0] * 16)
    ramp = np.arange(32.0) * 100.0
    wide = np.full(32, 2.0**30)
    raw = np.array([np.inf] + [1.0] * 31)
    ovf = np.full(32, 2.0**30 + 2.0**29)
    kinds = [z, narrow, ramp, wide, raw, ovf, narrow[:7]]
    pairs = [(p, q) for p in kinds for q in kinds if p.size == q.size or p is q]
    xa = _blocks(*(p for p, _ in pairs)).astype(dtype)
    xb = _blocks(*(q for _, q in pairs)).astype(dtype)
    for u, v in ((xa, xb), (xb, xa)):
        a = compress_abs(u, eb)
        with np.errstate(over="ignore", invalid="ignore"):
            assert add_data(a, v).tobytes() == add(a, compress_abs(v, eb)).tobytes()


def test_add_data_checks_its_operands():
    a = compress_abs(np.zeros(64, np.float32), EB)
    with pytest.raises(MismatchError, match="float64 data to a float32 stream"):
        add_data(a, np.zeros(64))
    with pytest.raises(MismatchError, match="cannot add 63 values to a stream of 64"):
        add_data(a, np.zeros(63, np.float32))
    with pytest.raises(MismatchError, match="eb=0.25 to a stream with eb=0.5"):
        add_data(a, np.zeros(64, np.float32), 0.25)
    assert add_data(a, np.ones(64, np.float32), EB).tobytes() == add(
        a, compress_abs(np.ones(64, np.float32), EB)).tobytes()
    import ccoll

    for bad in ("abc", [0.5], float("nan"), -1.0):  # float()'s ValueError escaped
        with pytest.raises(ccoll.ErrorBoundError, match="absolute bound must be"):
            add_data(a, np.zeros(64, np.float32), bad)


def test_lorenzo_blocks_add_in_the_integer_domain():
    # Each block rises from 0 in steps of 100: Lorenzo codes (7 bits) beat q (12 bits).
    ramp = np.tile(np.arange(32, dtype=np.float64) * 100.0, 2)
    a, b = compress_abs(ramp, EB), compress_abs(ramp * 3, EB)
    assert all(c & 0x80 for c in codes_of(a))
    s = add(a, b)
    assert np.array_equal(decompress(s), ramp * 4)
    assert all(c not in (32, 33) for c in codes_of(s))


def _int_block(rng, width, m):
    """``m`` random integers whose largest magnitude has exactly ``width`` bits."""
    hi = min(2**width - 1, 2**31 - 2)  # |q| = 2^31 - 1 is not quantizable: raw
    q = rng.integers(-hi, hi + 1, m)
    q[rng.integers(m)] = hi * rng.choice([-1, 1])
    return q.astype(np.float64)


WIDTHS = [1, 2, 3, 7, 16, 28, 29, 30, 31]


@pytest.mark.parametrize("m", [32, 19, 1])
@pytest.mark.parametrize("wa", WIDTHS)
def test_no_prediction_sums_of_every_width_equal_the_reference(wa, m):
    # Blocks of q_a of width wa against q_b of every width, each sign mix, a partial last
    # block: sums of up to 29 bits take the bit-plane path, wider ones the per-lane path
    # (where 2^30-sized lanes may overflow to raw). Float64 holds every q exactly.
    rng = np.random.default_rng(wa * 100 + m)
    xa, xb = [], []
    for wb in WIDTHS:
        for _ in range(3):
            xa.append(_int_block(rng, wa, 32))
            xb.append(_int_block(rng, wb, 32))
    xa.append(_int_block(rng, wa, m))
    xb.append(_int_block(rng, min(wa + 1, 31), m))
    a = compress_abs(_blocks(*xa), EB)
    b = compress_abs(_blocks(*xb), EB)
    assert not any(c & 0x80 or c >= 32 for c in codes_of(a) + codes_of(b))
    s = add(a, b)
    assert s.tobytes() == ref_add(a.tobytes(), b.tobytes())
    assert s.tobytes() == add(b, a).tobytes()


@pytest.mark.parametrize("w", [8, 12, 20, 27])
def test_sums_that_become_smooth_choose_lorenzo(w):
    # a = r and b = ramp - r are noisy (no prediction), their sum is a ramp: the sum's
    # Lorenzo residual is narrower, so the sum block must switch to Lorenzo.
    rng = np.random.default_rng(w)
    ramp = np.arange(32, dtype=np.float64) * 3.0
    r = _int_block(rng, w, 32)
    a, b = compress_abs(r, EB), compress_abs(ramp - r, EB)
    assert not any(c & 0x80 for c in codes_of(a) + codes_of(b))
    s = add(a, b)
    assert codes_of(s) == [0x80 | 2]  # residuals 0, 3, 3, ...
    assert s.tobytes() == ref_add(a.tobytes(), b.tobytes())
    assert np.array_equal(decompress(s), ramp)


def test_nan_sums_store_one_canonical_nan():
    x = np.array([np.nan, 1.0, np.inf, -np.inf] + [0.5] * 28)
    neg = x.copy()
    neg.view(np.uint64)[0] |= np.uint64(1 << 63 | 0x55)  # another NaN payload, sign set
    s = add(compress_abs(x, 1e-3), compress_abs(-neg, 1e-3))
    words = ref_parse(s.tobytes())["blocks"][0][1]
    lane = [words[2 * i] | words[2 * i + 1] << 32 for i in range(4)]
    assert lane[0] == 0x7FF8000000000000  # NaN + NaN
    assert lane[2] == 0x7FF8000000000000 and lane[3] == 0x7FF8000000000000  # inf - inf


def test_lossless_streams_add_raw():
    x = np.array([1.0, 2.0, 0.0] + [0.0] * 29, np.float32)
    s = add(compress_abs(x, 0.0), compress_abs(x, 0.0))
    assert codes_of(s) == [33]
    assert np.array_equal(decompress(s), 2 * x)


# --------------------------------------------------------------------------- headers


@pytest.mark.parametrize("ba, bb", [(0.1, 0.2), (1e-3, 1e-3), (1.0, 2.0**-60), (3e-5, 7e-9)])
def test_bound_is_rounded_up(ba, bb):
    x = np.zeros(4)
    a = compress_abs(x, 1e-3)
    b = compress_abs(x, 1e-3)
    # Give the streams other bounds (same eb): only the header's bound field changes.
    a[32:40] = np.frombuffer(np.float64(ba).tobytes(), np.uint8)
    b[32:40] = np.frombuffer(np.float64(bb).tobytes(), np.uint8)
    got = header(add(a, b)).bound
    exact = Fraction(ba) + Fraction(bb)
    assert Fraction(got) >= exact
    assert Fraction(math.nextafter(got, 0.0)) < exact


def test_bound_overflow_is_an_error():
    x = np.zeros(4)
    a = compress_abs(x, 1e308)
    with pytest.raises(ErrorBoundError, match="overflows"):
        add(a, a)


@pytest.mark.parametrize("other, match", [
    (lambda: compress_abs(np.zeros(10, np.float64), 1e-3), "float32 stream to a float64"),
    (lambda: compress_abs(np.zeros(11, np.float32), 1e-3), "elements"),
    (lambda: compress_abs(np.zeros(10, np.float32), 2e-3), "different bounds"),
])
def test_mismatches(other, match):
    a = compress_abs(np.zeros(10, np.float32), 1e-3)
    with pytest.raises(MismatchError, match=match):
        add(a, other())


def test_shape_of_the_first_stream_is_kept():
    a = compress_abs(np.ones((2, 6)), 1e-3)
    b = compress_abs(np.ones(12), 1e-3)
    assert header(add(a, b)).shape == (2, 6)


def test_add_into_out():
    rng = np.random.default_rng(2)
    xa, xb = gradient(rng, 1000, np.float32), gradient(rng, 1000, np.float32)
    a, b = compress_abs(xa, 1e-4), compress_abs(xb, 1e-4)
    out = np.full(max_nbytes(1000, np.float32), 0xEE, np.uint8)
    got = add(a, b, out=out)
    assert np.shares_memory(got, out) and got.size < out.size
    assert got.tobytes() == add(a, b).tobytes()
    with pytest.raises(MismatchError, match="max_nbytes"):
        add(a, b, out=np.empty(10, np.uint8))
    with pytest.raises(MismatchError, match="uint8"):
        add(a, b, out=np.empty(10000, np.float32))


@pytest.mark.parametrize("version", [1, 2])
def test_both_formats_check_an_out_for_the_sum_alike(version):
    rng = np.random.default_rng(4)
    xa, xb = gradient(rng, 1000, np.float32), gradient(rng, 1000, np.float32)
    a, b = compress_abs(xa, 1e-4, version=version), compress_abs(xb, 1e-4, version=version)
    room = np.zeros(max_nbytes(1000, np.float32, version=version) + 4, np.uint8)
    assert add(a, b, out=room[:-4]).tobytes() == add(a, b).tobytes()
    hint = "max_nbytes" if version == 1 else r"max_nbytes\(\.\.\., version=2\)"
    with pytest.raises(MismatchError, match=rf"out holds 10 bytes, .*{hint}"):
        add(a, b, out=np.empty(10, np.uint8))
    with pytest.raises(MismatchError, match="1-D uint8"):
        add(a, b, out=np.empty(10000, np.float32))
    ro = room[:-4].copy()
    ro.flags.writeable = False
    with pytest.raises(MismatchError, match="writable and contiguous"):
        add(a, b, out=ro)
    shift = (1 - room.ctypes.data) % 4 or 1  # a start that is not on a 4-byte boundary
    with pytest.raises(MismatchError, match="4-byte aligned"):
        add(a, b, out=room[shift:])


def test_public_api_add():
    a = ccoll.compress(np.ones(5, np.float32), ccoll.ABS(0.25))
    assert np.array_equal(ccoll.decompress(ccoll.compressor.add(a, a)), np.full(5, 2.0))
