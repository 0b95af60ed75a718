"""Bad input gets a clear ccoll error; hostile streams get FormatError and nothing else.

Truncated, extended, bit-flipped, re-headed and hand-crafted streams are decoded; the
decoder must raise :class:`ccoll.FormatError` (or decode to an array of the announced
shape), never crash, hang, or raise anything else.
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import assert_clear_error, decoded_dtypes

import ccoll
from ccoll.compressor import add, add_data, compress_abs, decompress, header
from ccoll.compressor.cpu.v2 import _stream_words
from ccoll.errors import CCollError, FormatError

HEADER = struct.Struct("<4sBBBBIIQddQQII")


def _sample_streams():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(300) * 1e-2).astype(np.float32)
    x[5] = np.nan
    x[40:72] = np.cumsum(np.full(32, 1e-3))  # a Lorenzo block
    x[100:140] = 0.0
    y = rng.standard_normal((3, 37))
    return {
        "f32": compress_abs(x, 1e-4),
        "f64": compress_abs(y, 1e-3),
        "sum32": add(compress_abs(x, 1e-4), compress_abs(x * 1e6, 1e-4)),
        "lossless": compress_abs(y, 0.0),
        "empty": compress_abs(np.zeros((0, 4), np.float32), 1e-3),
        "zero_d": compress_abs(np.array(1.5), 1e-3),
    }


STREAMS = _sample_streams()


def decode_or_format_error(buf) -> None:
    """Decode ``buf``; only a FormatError may come out, and success means a sane array."""
    try:
        h = header(buf)
    except FormatError:
        with pytest.raises(FormatError):
            decompress(buf)
        return
    try:
        y = decompress(buf)
    except FormatError:
        return
    assert y.shape == h.shape and y.dtype.name in decoded_dtypes(h)


# ------------------------------------------------------------------------ argument errors


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.complex64, np.bool_,
                                   np.longdouble])
def test_unsupported_dtypes_raise_dtype_error(dtype):
    x = np.zeros(10, dtype)
    # The message names what was passed, what is taken and the fix.
    msg = (f"x has dtype {np.dtype(dtype).name}; ccoll compresses float16, bfloat16, float32 "
           "or float64 data: " + (
               # a cast would drop the imaginary part: the advice keeps both parts
               "a complex array has a real and an imaginary part, and a cast to float drops "
               "the imaginary one: pass x.real and x.imag separately, or both as one real "
               "array (numpy: x.view(x.real.dtype); torch: torch.view_as_real(x))"
               if np.dtype(dtype).kind == "c" else "pass x.astype(np.float32)"))
    assert_clear_error(ccoll.DTypeError, re.escape(msg), ccoll.compress, x, ccoll.ABS(1e-3))
    with pytest.raises(TypeError):
        compress_abs(x, 1e-3)


def test_torch_unsupported_dtype():
    torch = pytest.importorskip("torch")
    assert_clear_error(ccoll.DTypeError, r"dtype torch.int32; .*: pass x.astype\(np.float32\) "
                       r"\(a torch tensor: x.float\(\)\)", ccoll.compress,
                       torch.zeros(4, dtype=torch.int32), ccoll.ABS(1e-3))


@pytest.mark.parametrize("eb", [None, -1.0, 0.0, float("nan"), float("inf"), "fast", "rel:x", [1]])
def test_bad_bounds(eb):
    with pytest.raises(ccoll.ErrorBoundError):
        ccoll.compress(np.zeros(4, np.float32), eb)


@pytest.mark.parametrize("eb", [-1e-3, float("nan"), float("inf"), "1e-3", True])
def test_bad_absolute_bounds(eb):
    assert_clear_error(ccoll.ErrorBoundError, "absolute bound", compress_abs,
                       np.zeros(4, np.float32), eb)


# -------------------------------------------------------------------------- foreign input


@pytest.mark.parametrize("buf", [
    b"", b"CCOL", b"\0" * 64, b"PK\x03\x04" + b"\0" * 100, np.zeros(10, np.float32),
    np.arange(200, dtype=np.uint8), "CCOL", [1, 2, 3],
], ids=["empty", "magic-only", "zeros", "zip", "float-array", "counting", "str", "list"])
def test_foreign_input_is_a_format_error(buf):
    with pytest.raises(FormatError):
        decompress(buf)


_RANDOM = np.random.default_rng(5).integers(0, 256, 300, dtype=np.uint8)
_RANDOM[6] = 200  # a field that, read before the magic, gave "ndim=200"


@pytest.mark.parametrize("buf, starts", [
    (b"PK\x03\x04\x14\x00w\x00" + b"\0" * 300, "PK\\x03\\x04"),
    (b"\x89HDF\r\n\x1a\n" + b"\0" * 300, "\\x89HDF"),
    (_RANDOM.tobytes(), None),
    (b"PK", "PK"),
    (b"\x89", "\\x89"),
    (b"", "empty"),
], ids=["zip", "hdf5", "random", "short-zip", "one-byte", "empty"])
def test_foreign_bytes_are_refused_by_their_magic_first(buf, starts):
    with pytest.raises(FormatError) as info:
        decompress(buf)
    msg = str(info.value)
    assert msg.startswith("not a ccoll stream") and "expected the magic b'CCOL'" in msg, msg
    assert "ndim" not in msg and "truncated" not in msg and "short" not in msg
    if starts is not None:
        assert starts in msg


def test_version_is_checked_before_the_other_fields():
    buf = b"CCOL\x07\x01w\x00" + b"\xff" * 300  # ndim 119, reserved fields not zero
    assert_clear_error(FormatError, r"^unsupported ccoll stream version 7 .*reads versions 1 and 2",
                       decompress, buf)


def test_a_truncated_ccoll_header_is_called_short_not_foreign():
    assert_clear_error(FormatError, "too short", decompress, b"CCOL\x01\x01")


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_every_truncation_and_extension_is_rejected(name):
    buf = STREAMS[name]
    for cut in range(buf.size):
        with pytest.raises(FormatError):
            decompress(buf[:cut])
    with pytest.raises(FormatError, match="truncated or trailing"):
        decompress(np.concatenate([buf, np.zeros(4, np.uint8)]))


def test_bytes_memoryview_and_unaligned_streams_decode():
    buf = STREAMS["f32"]
    ref = decompress(buf)
    assert np.array_equal(decompress(buf.tobytes()), ref, equal_nan=True)
    assert np.array_equal(decompress(bytearray(buf.tobytes())), ref, equal_nan=True)
    assert np.array_equal(decompress(memoryview(buf.tobytes())), ref, equal_nan=True)
    shifted = np.empty(buf.size + 1, np.uint8)[1:]
    shifted[:] = buf
    assert np.array_equal(decompress(shifted), ref, equal_nan=True)
    # A strided uint8 view of the stream's bytes (ValueError from numpy's word view).
    strided = np.repeat(buf, 2)[::2]
    assert not strided.flags.c_contiguous
    assert np.array_equal(decompress(strided), ref, equal_nan=True)
    assert header(strided) == header(buf)
    assert np.array_equal(ccoll.decompress(strided), ref, equal_nan=True)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_array_subclasses_compress_as_their_data():
    # np.matrix reached the kernels as itself: a numba TypingError.
    x = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    want = ccoll.compress(x.reshape(10, 10), ccoll.ABS(1e-3))
    got = ccoll.compress(np.matrix(x.reshape(10, 10)), ccoll.ABS(1e-3))
    assert np.array_equal(got, want)
    masked = np.ma.masked_array(x, mask=x > 0)  # the mask is not data: every value goes
    assert np.array_equal(ccoll.compress(masked, ccoll.ABS(1e-3)),
                          ccoll.compress(x, ccoll.ABS(1e-3)))


def _shifted(buf: np.ndarray, by: int) -> np.ndarray:
    """A copy of ``buf`` whose data starts ``by`` bytes past a 4-byte boundary."""
    out = np.empty(buf.size + 4, np.uint8)
    start = (-out.ctypes.data) % 4 + by
    out = out[start : start + buf.size]
    out[:] = buf
    assert out.ctypes.data % 4 == by
    return out


@pytest.mark.parametrize("by", [1, 2, 3])
def test_unaligned_version2_streams_decode_and_add_as_aligned_ones(by):
    # A word view of a stream's sections must start on a 4-byte boundary: a stream that
    # does not is read through an aligned copy, whatever the check that finds it.
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(3000) * 1e-2).astype(np.float32)
    z = (rng.standard_normal(3000) * 1e-2).astype(np.float32)
    a = compress_abs(x, 1e-4, version=2)
    b = compress_abs(z, 1e-4, version=2)
    sa, sb = _shifted(a, by), _shifted(b, by)
    assert _stream_words(sa).ctypes.data % 4 == 0  # a copy
    aligned = _shifted(a, 0)
    assert np.shares_memory(_stream_words(aligned), aligned)  # a view
    assert np.array_equal(decompress(sa), decompress(a))
    assert np.array_equal(add(sa, sb), add(a, b))
    assert np.array_equal(add_data(sa, z), add_data(a, z))
    assert np.array_equal(add_data(sa, z), add(a, b))


# ------------------------------------------------------------------------ crafted streams


def _edit(buf: np.ndarray, **fields) -> np.ndarray:
    """Copy of ``buf`` with header fields replaced (names as in docs/format.md)."""
    names = ["magic", "version", "dtype", "ndim", "r0", "block", "r1", "n", "eb", "bound",
             "nnz", "payload_words", "nterms", "r2"]
    vals = dict(zip(names, HEADER.unpack_from(buf.tobytes(), 0), strict=True))
    vals.update(fields)
    out = buf.copy()
    out[:64] = np.frombuffer(HEADER.pack(*(vals[k] for k in names)), np.uint8)
    return out


def _sections(buf):
    h = header(buf)
    return h, h.bitmap_offset, h.codes_offset, h.payload_offset


@pytest.mark.parametrize("fields, match", [
    ({"magic": b"CCOM"}, "magic"),
    ({"version": 3}, "version"),
    ({"version": 2}, "ntab"),  # a v1 stream read as v2: its zero ntab with nnz > 0
    ({"dtype": 3}, "dtype"),
    ({"r0": 3}, "source dtype code 3"),  # 1 and 2 name float16/bfloat16 data
    ({"r2": 7}, "reserved"),
    ({"block": 64}, "block size"),
    ({"n": 301}, "shape|length"),
    ({"eb": float("nan")}, "error bound"),
    ({"eb": -1.0}, "error bound"),
    ({"bound": float("inf")}, "bound"),
    ({"nnz": 10**6}, "non-zero blocks"),
    ({"payload_words": 2**40}, "payload"),
    ({"nterms": 0}, "nterms"),
    ({"ndim": 40}, "ndim"),
])
def test_bad_header_fields(fields, match):
    assert_clear_error(FormatError, match, decompress, _edit(STREAMS["f32"], **fields))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dims, match", [
    # n = 0, each dimension below the limit, their product beyond numpy's: ValueError
    ((0, 2**40, 2**40), "shape .* is implausibly large"),
    ((0, 2**31, 2**31), "shape .* is implausibly large"),
    ((0, 2**62), "shape .* is implausibly large"),  # named the element count (0)
])
def test_an_empty_shape_whose_dimensions_overflow_is_refused(version, dims, match):
    base = ccoll.compress(np.zeros((0, 3), np.float32), ccoll.ABS(1.0), version=version).tobytes()
    raw = (base[:6] + bytes([len(dims)]) + base[7:64]
           + b"".join(int(d).to_bytes(8, "little") for d in dims) + base[80:])
    assert_clear_error(FormatError, match, decompress, np.frombuffer(raw, np.uint8))
    assert_clear_error(FormatError, match, header, np.frombuffer(raw, np.uint8))


def test_bitmap_popcount_must_match_nnz():
    buf = STREAMS["f32"]
    h, bm, _, _ = _sections(buf)
    bad = buf.copy()
    words = bad[bm : bm + 4].view(np.uint32)
    # Clear one set bit: popcount now nnz - 1.
    w = int(words[0])
    words[0] = w & (w - 1)
    assert_clear_error(FormatError, "non-zero blocks", decompress, bad)


def test_bitmap_bits_beyond_the_blocks():
    buf = STREAMS["f32"]  # 300 elements: 10 blocks, bits 10..31 must be 0
    h, bm, _, _ = _sections(buf)
    bad = buf.copy()
    bad[bm : bm + 4].view(np.uint32)[0] |= np.uint32(1 << 20)
    assert_clear_error(FormatError, "beyond", decompress, bad)


@pytest.mark.parametrize("code", [0, 34, 100, 128, 0x80 | 32, 0xA5, 255])
def test_invalid_code_bytes(code):
    buf = STREAMS["f32"]
    _, _, co, _ = _sections(buf)
    bad = buf.copy()
    bad[co] = code
    assert_clear_error(FormatError, "invalid block code|payload words", decompress, bad)


def test_code_33_is_invalid_in_float64_streams():
    buf = STREAMS["f64"]
    _, _, co, _ = _sections(buf)
    h = header(buf)
    bad = buf.copy()
    codes = bad[co : co + h.nnz]
    i = int(np.flatnonzero(codes == 32)[0]) if (codes == 32).any() else 0
    codes[i] = 33
    assert_clear_error(FormatError, "invalid block code", decompress, bad)


def test_code_padding_must_be_zero():
    buf = STREAMS["f32"]
    h, _, co, po = _sections(buf)
    assert po > co + h.nnz, "the sample needs code padding"
    bad = buf.copy()
    bad[co + h.nnz] = 1
    assert_clear_error(FormatError, "padding", decompress, bad)


def test_block_sizes_must_add_up():
    buf = STREAMS["f32"]
    h, _, co, _ = _sections(buf)
    bad = buf.copy()
    codes = bad[co : co + h.nnz]
    i = int(np.flatnonzero((codes >= 1) & (codes <= 30))[0])
    codes[i] += 1  # one more bit-plane than the payload holds
    assert_clear_error(FormatError, "payload words", decompress, bad)


def test_hostile_lorenzo_magnitudes_do_not_overflow():
    # Every block Lorenzo with 31 bit-planes of ones: prefix sums reach 32 * (2^31 - 1).
    n = 64
    nblocks = 2
    payload = []
    for _ in range(nblocks):
        payload += [0] + [0xFFFFFFFF] * 31
    buf = (HEADER.pack(b"CCOL", 1, 2, 1, 0, 32, 0, n, 0.5, 0.5, nblocks, len(payload), 1, 0)
           + struct.pack("<Q", n) + struct.pack("<I", 0b11) + bytes([0x80 | 31] * 2) + b"\0\0"
           + struct.pack(f"<{len(payload)}I", *payload))
    y = decompress(buf)
    assert y[31] == 32 * (2**31 - 1) * 1.0


def test_claimed_huge_array_needs_its_bitmap():
    # 2^40 elements of zeros would need a 128 MiB bitmap; a short buffer is rejected
    # before anything is allocated.
    n = 1 << 40
    buf = (HEADER.pack(b"CCOL", 1, 1, 1, 0, 32, 0, n, 0.5, 0.5, 0, 0, 1, 0)
           + struct.pack("<Q", n) + b"\0" * 64)
    assert_clear_error(FormatError, "length", decompress, buf)


# ------------------------------------------------------------------------- mutation fuzz

mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("byte"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("field"), st.integers(0, 63), st.integers(0, 255)),
    st.tuples(st.just("word"), st.integers(0, 10**6), st.integers(0, 2**32 - 1)),
)


def mutate(buf: np.ndarray, muts) -> np.ndarray:
    b = bytearray(buf.tobytes())
    for kind, pos, val in muts:
        if not b:
            break
        if kind == "flip":
            b[pos % len(b)] ^= 1 << val
        elif kind == "byte":
            b[pos % len(b)] = val
        elif kind == "cut":
            del b[pos % len(b) :]
        elif kind == "field":
            if pos < len(b):
                b[pos] = val
        else:
            i = (pos % max(1, len(b) // 4)) * 4
            b[i : i + 4] = struct.pack("<I", val)
    return np.frombuffer(bytes(b), np.uint8)


def _fuzz_one(name, muts):
    bad = mutate(STREAMS[name], muts)
    decode_or_format_error(bad)
    try:
        add(bad, STREAMS[name])
    except CCollError as exc:
        assert isinstance(exc, (FormatError, ccoll.MismatchError, ccoll.ErrorBoundError))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(STREAMS)), st.lists(mutations, min_size=1, max_size=4))
def test_mutated_streams(name, muts):
    _fuzz_one(name, muts)


@pytest.mark.slow
@settings(max_examples=12000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(STREAMS)), st.lists(mutations, min_size=1, max_size=6))
def test_mutated_streams_long(name, muts):
    _fuzz_one(name, muts)
