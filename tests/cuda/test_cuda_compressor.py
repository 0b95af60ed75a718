"""CUDA backend in the simulator: streams byte-identical to the CPU backend's, decoding,
homomorphic add, bounds, special values, malformed streams.

The simulator runs ~1 ms per warp intrinsic, so inputs stay small; sizes sit around the
kernels' boundaries: 32 elements per block, 1024 per compress/add thread block (one bitmap
word), 8192 per index thread block (its look-back runs across thread blocks above that).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from kit import ExactSum, assert_clear_error, assert_within, rel_bound
from numba import cuda

import ccoll
from ccoll.compressor import _cuda
from ccoll.compressor import _cuda_kernels as K
from ccoll.compressor import cpu as _cpu
from ccoll.compressor import format as fmt
from ccoll.errors import FormatError, MismatchError


def gradient_like(n: int, dtype: type, seed: int = 0) -> np.ndarray:
    """Mostly tiny noise, a smooth ramp (Lorenzo wins there), zeros, and a few spikes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 1e-3
    q = n // 4
    x[q : 2 * q] = np.linspace(-0.3, 0.4, q)  # smooth: Lorenzo is narrower
    x[2 * q : 2 * q + q // 2] = 0.0
    if n > 8:
        x[rng.integers(0, n, 3)] = [1.0, -0.75, 0.5]
    return x.astype(dtype)


def to_dev(a: np.ndarray):
    return cuda.to_device(np.ascontiguousarray(a))


def host(d) -> np.ndarray:
    return d.copy_to_host()


def rel_eb(x: np.ndarray, rel: float) -> float:
    """An absolute bound for compress_abs: rel times x's finite range (computed here)."""
    return float(rel_bound(rel, x))


def check_roundtrip(x: np.ndarray, eb: float) -> np.ndarray:
    """GPU stream == CPU stream; both backends decode it to the same bits within the bound."""
    return check_decoded(x, eb)[0]


def check_decoded(x: np.ndarray, eb: float) -> tuple[np.ndarray, np.ndarray]:
    """check_roundtrip, returning the stream and the GPU's decoding of it (tests read that
    instead of decoding the same bytes again: two kernel launches in the simulator)."""
    g = host(_cuda.compress_abs(to_dev(x), eb))
    c = _cpu.compress_abs(x, eb)
    assert g.tobytes() == c.tobytes(), f"streams differ ({g.size} vs {c.size} bytes)"
    y_gpu = host(_cuda.decompress(to_dev(c)))
    y_cpu = _cpu.decompress(g)
    assert y_gpu.dtype == x.dtype and y_gpu.shape == x.shape
    assert y_gpu.tobytes() == y_cpu.tobytes()
    if eb > 0:
        assert_within(y_gpu, x, eb, strict=True)
    else:
        np.testing.assert_array_equal(y_gpu, x)  # lossless (NaN == NaN, -0.0 == 0.0 here)
    return g, y_gpu


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 63, 64, 65, 1023, 1024, 1025])
def test_float32_stream_equals_cpu(n):
    x = gradient_like(n, np.float32, seed=n)
    check_roundtrip(x, rel_eb(x, 1e-3) if n else 1e-3)


@pytest.mark.parametrize("n", [1, 33, 1025])
def test_float64_stream_equals_cpu(n):
    x = gradient_like(n, np.float64, seed=n)
    check_roundtrip(x, rel_eb(x, 1e-4))


def test_many_thread_blocks_and_index_lookback():
    # 8193 elements: 9 compress thread blocks, 2 index thread blocks, a partial last block.
    # Mostly zero (cheap in the simulator), with non-zero blocks in several tiles.
    x = np.zeros(8193, np.float32)
    x[::509] = np.linspace(-1.0, 1.0, x[::509].size)
    x[4000:4100] = np.linspace(0.0, 0.3, 100)
    x[-1] = 0.25
    check_roundtrip(x, 1e-3)


@pytest.mark.parametrize("eb", [1e-6, 0.5, 1e30], ids=["tiny", "coarse", "huge"])
def test_abs_bounds_from_raw_to_all_zero(eb):
    x = gradient_like(96, np.float32, seed=3)
    check_roundtrip(x, eb)


def test_multidimensional_shape_kept():
    x = gradient_like(2 * 3 * 11, np.float64, seed=5).reshape(2, 3, 11)
    g = _cuda.compress_abs(to_dev(x), 1e-3)
    y = _cuda.decompress(g)
    assert tuple(y.shape) == (2, 3, 11)
    assert _cuda.header(g).shape == (2, 3, 11)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lossless_keeps_bits_and_signed_zeros(dtype):
    x = np.zeros(100, dtype)
    x[40:64] = -0.0  # a block of +-0 only: a zero block
    x[70] = 3.25
    x[71] = -0.0
    x[75] = np.nan
    g, y = check_decoded(x, 0.0)
    assert _cuda.header(to_dev(g)).nnz == 1
    assert np.signbit(y[71]) and np.isnan(y[75]) and y[70] == 3.25


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_inf_and_extremes_preserved(dtype):
    fi = np.finfo(dtype)
    x = gradient_like(70, dtype, seed=11)
    x[[2, 40]] = np.nan
    x[5] = np.inf
    x[6] = -np.inf
    x[45] = fi.max
    x[46] = fi.tiny / 4  # subnormal
    _, y = check_decoded(x, 1e-3)
    assert np.isnan(y[[2, 40]]).all() and y[5] == np.inf and y[6] == -np.inf


def add_pair(x1: np.ndarray, x2: np.ndarray, eb: float, gpu_streams: bool = True
             ) -> tuple[np.ndarray, np.ndarray]:
    """GPU sum == CPU sum of the two streams of x1, x2 (made on the GPU, or on the CPU when
    only the add is under test: the same bytes, two kernel launches fewer each)."""
    if gpu_streams:
        ga = _cuda.compress_abs(to_dev(x1), eb)
        gb = _cuda.compress_abs(to_dev(x2), eb)
    else:
        ga = to_dev(_cpu.compress_abs(x1, eb))
        gb = to_dev(_cpu.compress_abs(x2, eb))
    s_gpu = host(_cuda.add(ga, gb))
    s_cpu = _cpu.add(host(ga), host(gb))
    assert s_gpu.tobytes() == s_cpu.tobytes(), "sum streams differ"
    return s_gpu, s_cpu


@pytest.mark.parametrize(
    "n, dtype",
    [
        (300, np.float32),
        (300, np.float64),
        pytest.param(1100, np.float32, marks=pytest.mark.slow),
        pytest.param(1100, np.float64, marks=pytest.mark.slow),
    ],
)
def test_add_equals_cpu_and_bounds_the_exact_sum(n, dtype):
    x1 = gradient_like(n, dtype, seed=1)
    x2 = gradient_like(n, dtype, seed=2)
    x2[: n // 6] = 0.0  # zero + non-zero blocks
    x1[n // 2 : n // 2 + n // 11] = 0.0
    x2[n - 70] = np.nan  # a raw block summed with a fixed one
    eb = rel_eb(x1, 1e-3)
    s, _ = add_pair(x1, x2, eb, gpu_streams=False)
    hdr = _cuda.header(to_dev(s))
    bound = 2 * Fraction(eb)
    assert hdr.nterms == 2 and Fraction(hdr.bound) >= bound
    y = host(_cuda.decompress(to_dev(s)))
    assert y.tobytes() == _cpu.decompress(s).tobytes()
    # docs/error-bound.md, "Homomorphic sum", for two streams (as in test_compressor_add).
    m = np.abs(x1.astype(np.float64)) + np.abs(x2.astype(np.float64)) + float(bound)
    extra = 5 * 2.0**-53 * m
    assert_within(y, ExactSum([x1, x2]), bound * (1 + Fraction(1, 2**21)), roundings=1,
                  extra=extra)


def test_add_overflow_and_nan_sums_become_raw():
    eb = 0.5
    x1 = np.zeros(64, np.float32)
    x2 = np.zeros(64, np.float32)
    x1[:32] = 2.0**30  # q near 2^30: the sum reaches 2^31 -> raw (code 33 in float32)
    x2[:32] = 2.0**30
    x1[40] = np.inf
    x2[40] = -np.inf  # inf + -inf: NaN, stored canonical
    s, _ = add_pair(x1, x2, eb)
    codes = s[fmt.parse_header(s).codes_offset :][:2]
    assert list(codes) == [fmt.CODE_RAW64, fmt.CODE_RAW64]
    y = host(_cuda.decompress(to_dev(s)))
    assert y[0] == np.float32(2.0**31) and np.isnan(y[40])


def test_add_cross_decodes_and_chains():
    x = gradient_like(300, np.float32, seed=4)
    eb = rel_eb(x, 1e-3)
    g = _cuda.compress_abs(to_dev(x), eb)
    c = _cpu.compress_abs(x, eb)
    s1 = host(_cuda.add(g, to_dev(c)))  # GPU adds a CPU stream
    s2 = host(_cuda.add(to_dev(s1), g))  # and a sum again
    assert s2.tobytes() == _cpu.add(_cpu.add(c, c), c).tobytes()
    assert _cpu.header(s2).nterms == 3


def test_add_rejects_mismatched_streams():
    # Streams of the CPU backend (the same bytes as the GPU's): only the add runs here.
    a = to_dev(_cpu.compress_abs(np.ones(40, np.float32), 1e-3))
    b = to_dev(_cpu.compress_abs(np.ones(41, np.float32), 1e-3))
    c = to_dev(_cpu.compress_abs(np.ones(40, np.float32), 2e-3))
    assert_clear_error(MismatchError, "elements", _cuda.add, a, b)
    assert_clear_error(MismatchError, "different bounds", _cuda.add, a, c)


def test_decompress_into_out_and_on_a_stream():
    x = gradient_like(100, np.float32, seed=9)
    s = cuda.stream()
    g = _cuda.compress_abs(to_dev(x), 1e-3, stream=s)
    out = cuda.device_array(100, np.float32)
    res = _cuda.decompress(g, out=out, stream=s)
    assert res is out
    assert host(out).tobytes() == _cpu.decompress(host(g)).tobytes()
    bad = cuda.device_array(99, np.float32)
    assert_clear_error(MismatchError, "elements", _cuda.decompress, g, out=bad)


def test_a_raw_stream_handle_is_taken_and_a_bad_stream_refused():
    # docs/cuda.md: a numba, CuPy or PyTorch stream or a raw handle. In the simulator a
    # handle raised AttributeError ('int' object has no attribute 'synchronize').
    from ccoll.errors import InputError

    x = gradient_like(70, np.float32, seed=11)
    want = host(_cuda.compress_abs(to_dev(x), 1e-3)).tobytes()
    for handle in (0, 12345):
        assert host(_cuda.compress_abs(to_dev(x), 1e-3, stream=handle)).tobytes() == want
    assert host(ccoll.compress(to_dev(x), ccoll.ABS(1e-3), stream=0)).tobytes() == want
    assert_clear_error(InputError, "stream must be a numba, CuPy or PyTorch stream",
                       _cuda.compress_abs, to_dev(x), 1e-3, stream="default")


def test_add_into_out_returns_the_used_prefix():
    x = gradient_like(100, np.float64, seed=10)
    g = _cuda.compress_abs(to_dev(x), 1e-3)
    out = cuda.device_array(fmt.max_nbytes(100, np.float64), np.uint8)
    res = _cuda.add(g, g, out=out)
    assert host(res).tobytes() == _cpu.add(host(g), host(g)).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finite_range_matches_cpu(dtype):
    x = gradient_like(500, dtype, seed=12)
    x[3] = np.inf
    x[4] = np.nan
    x[5] = -np.inf
    assert _cuda.finite_range(to_dev(x)) == _cpu.finite_range(x)
    assert _cuda.finite_range(to_dev(np.full(7, np.nan, dtype))) == (math.inf, -math.inf)


def test_bad_inputs_are_clear_errors():
    from ccoll.errors import DTypeError, ErrorBoundError, InputError

    x = to_dev(np.ones(64, np.float32))
    assert_clear_error(ErrorBoundError, "finite", _cuda.compress_abs, x, math.nan)
    assert_clear_error(ErrorBoundError, "finite", _cuda.compress_abs, x, -1.0)
    assert_clear_error(DTypeError, "float32 or float64",
                       _cuda.compress_abs, to_dev(np.ones(8, np.int32)), 1e-3)
    strided = to_dev(np.ones((8, 8), np.float32)).T
    assert_clear_error(InputError, "C-contiguous", _cuda.compress_abs, strided, 1e-3)
    assert_clear_error(InputError, "CUDA device array", _cuda.compress_abs, np.ones(4), 1e-3)


@pytest.mark.parametrize("max_blocks", [1])
def test_capped_grid_writes_the_same_stream(max_blocks):
    # 3000 elements: 3 tiles, so one persistent thread block takes every tile
    # (the look-back then waits on tiles their own or another thread block did earlier).
    # Each tile holds 96 elements of gradient-like data (narrow and wide codes, Lorenzo) and
    # zeros elsewhere: cheap in the simulator, and every tile shifts the next one's codes
    # and payload.
    from ccoll.compressor import api

    x = np.zeros(3000, np.float32)
    for k, at in enumerate((0, 1100, 2300)):
        x[at : at + 96] = gradient_like(96, np.float32, seed=41 + k)
    x[-1] = 0.25
    eb = rel_eb(x, 1e-3)
    d = to_dev(x)
    want = _cpu.compress_abs(x, eb).tobytes()
    capped = host(_cuda.compress_abs(d, eb, max_blocks=max_blocks)).tobytes()
    assert capped == want
    # The ticket counter is left at 0: uncapped and capped launches after it agree.
    assert host(_cuda.compress_abs(d, eb)).tobytes() == want
    assert host(api.compress_abs(d, eb, max_blocks=max_blocks)).tobytes() == want
    assert host(_cuda.decompress(to_dev(np.frombuffer(capped, np.uint8)))).tobytes() == \
        _cpu.decompress(np.frombuffer(want, np.uint8)).tobytes()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_max_blocks_is_a_clear_error(bad):
    from ccoll.errors import InputError

    x = to_dev(np.ones(64, np.float32))
    assert_clear_error(InputError, "max_blocks", _cuda.compress_abs, x, 1e-3, max_blocks=bad)


# --------------------------------------------------------------------- malformed streams


@pytest.fixture(scope="module")
def good_stream() -> np.ndarray:
    # 7 blocks, 3 of them non-zero (so the code bytes have padding), the others zero.
    x = np.zeros(200, np.float32)
    x[0:32] = np.linspace(0, 0.1, 32)
    x[64:96] = np.linspace(0.2, -0.1, 32) ** 2
    x[192:200] = 0.05
    s = _cpu.compress_abs(x, 1e-3)
    assert fmt.parse_header(s).nnz == 3
    return s


def _corrupt(s: np.ndarray, kind: str) -> np.ndarray:
    s = s.copy()
    h = fmt.parse_header(s)
    if kind == "truncated":
        return s[:-4]
    if kind == "trailing":
        return np.concatenate([s, np.zeros(4, np.uint8)])
    if kind == "magic":
        s[0] = ord("X")
        return s
    if kind == "code":
        s[h.codes_offset] = 77
        return s
    if kind == "bitmap_tail":
        s[h.bitmap_offset] |= 0x80  # block 7 of 7 blocks does not exist
        return s
    if kind == "bitmap_count":
        words = s[h.bitmap_offset : h.codes_offset].view(np.uint32)
        zero_bits = [b for b in range(h.nblocks) if not (words[0] >> b) & 1]
        s[h.bitmap_offset + zero_bits[0] // 8] |= 1 << (zero_bits[0] % 8)
        return s
    if kind == "padding":
        assert h.nnz % 4, "the test stream needs code padding"
        s[h.codes_offset + h.nnz] = 1
        return s
    if kind == "sizes":
        # A wider code: the block sizes no longer add up to the header's payload length.
        c = s[h.codes_offset]
        assert 1 <= (c & 0x7F) < 31
        s[h.codes_offset] = c + 1
        return s
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, match",
    [
        ("truncated", "does not match its header"),
        ("trailing", "does not match its header"),
        ("magic", "not a ccoll stream"),
        ("code", "invalid block code"),
        ("bitmap_tail", "beyond its last block"),
        ("bitmap_count", "non-zero blocks does not match"),
        ("padding", "padding"),
        ("sizes", "do not add up"),
    ],
)
def test_malformed_stream_raises_format_error(good_stream, kind, match):
    bad = _corrupt(good_stream, kind)
    with pytest.raises(FormatError):
        _cpu.decompress(bad)  # the CPU backend agrees that it is malformed
    out = cuda.to_device(np.full(200, 7.0, np.float32))
    assert_clear_error(FormatError, match, _cuda.decompress, to_dev(bad), out=out)
    if kind not in ("truncated", "trailing", "magic"):
        assert (host(out) == 7.0).all(), "payload decoded before validation"


@pytest.mark.parametrize("kind, match", [("magic", "not a ccoll stream"),
                                         ("code", "invalid block code")])
def test_add_of_malformed_stream_raises_format_error(good_stream, kind, match):
    bad = to_dev(_corrupt(good_stream, kind))
    good = to_dev(good_stream)
    assert_clear_error(FormatError, match, _cuda.add, good, bad)
    assert_clear_error(FormatError, match, _cuda.add, bad, good)


def test_non_stream_buffers_raise_format_error():
    # Foreign bytes are refused by their magic, a ccoll stream cut inside its header as short.
    assert_clear_error(FormatError, "not a ccoll stream", _cuda.decompress,
                       to_dev(np.zeros(10, np.uint8)))
    assert_clear_error(FormatError, "too short", _cuda.decompress,
                       to_dev(np.frombuffer(b"CCOL\x01\x01\x01\x00\x00\x00", np.uint8)))
    assert_clear_error(FormatError, "uint8", _cuda.decompress, to_dev(np.zeros(10, np.float32)))
    assert_clear_error(FormatError, "it is empty", _cuda.header, cuda.device_array(0, np.uint8))


# ---------------------------------------------------------------------- look-back logic


@cuda.jit
def _lookback_probe(flags, vals, tile, epoch, out):
    lane = cuda.threadIdx.x
    ex0, ex1 = K._lookback(flags, vals, tile, np.int64(5), np.int64(7), epoch, lane)
    if lane == 0:
        out[0] = ex0
        out[1] = ex1


@pytest.mark.parametrize("ntiles, last_prefix", [(70, 0), (70, 33), (3, 1)])
def test_lookback_sums_aggregates_across_windows(ntiles, last_prefix):
    """Predecessors that published only aggregates, and one inclusive prefix further back."""
    epoch = 9
    flags = np.zeros(ntiles + 1, np.uint32)
    vals = np.zeros(4 * (ntiles + 1), np.int64)
    rng = np.random.default_rng(ntiles)
    agg = rng.integers(0, 1000, (ntiles, 2))
    for t in range(ntiles):
        vals[4 * t : 4 * t + 2] = agg[t]
        flags[t] = (epoch << 2) | K.ST_AGG
    # Tile last_prefix published its inclusive prefix as well.
    inc = agg[: last_prefix + 1].sum(axis=0)
    vals[4 * last_prefix + 2 : 4 * last_prefix + 4] = inc
    flags[last_prefix] = (epoch << 2) | K.ST_PRE
    d_flags, d_vals = to_dev(flags), to_dev(vals)
    out = cuda.device_array(2, np.int64)
    _lookback_probe[1, 32](d_flags, d_vals, ntiles, epoch, out)
    assert list(host(out)) == list(agg.sum(axis=0))
    f = host(d_flags)[ntiles]
    v = host(d_vals)[4 * ntiles : 4 * ntiles + 4]
    assert f == (epoch << 2) | K.ST_PRE
    assert list(v) == [5, 7, agg[:, 0].sum() + 5, agg[:, 1].sum() + 7]


# ------------------------------------------------------------------------ frozen streams

FIXTURES = __import__("pathlib").Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.ccoll")))
def test_frozen_streams_decode_to_the_frozen_values(name):
    frozen = np.frombuffer((FIXTURES / f"{name}.ccoll").read_bytes(), np.uint8)
    want = np.load(FIXTURES / f"{name}.npy")
    got = host(_cuda.decompress(to_dev(frozen)))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


# ------------------------------------------------------------------- through the public API


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_public_api_dispatches_device_arrays_here(dtype):
    from ccoll.compressor import add, header

    x = gradient_like(200, dtype, seed=31)
    d = to_dev(x)
    g = ccoll.compress(d, ccoll.REL(1e-3))  # REL resolved by the device range kernel
    assert not isinstance(g, np.ndarray), "device input must give a device stream"
    c = ccoll.compress(x, ccoll.REL(1e-3))
    assert host(g).tobytes() == c.tobytes()
    assert host(ccoll.decompress(g)).tobytes() == ccoll.decompress(c).tobytes()
    assert header(g) == header(c)
    assert host(add(g, g)).tobytes() == add(c, c).tobytes()
