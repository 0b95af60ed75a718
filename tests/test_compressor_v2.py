"""Format version 2 (docs/format.md, "Format version 2"): headers, kernels, add, robustness."""

from __future__ import annotations

import numpy as np
import pytest
from kit import decoded_dtypes

from ccoll.compressor import format as fmt
from ccoll.errors import FormatError

# The worked example of docs/format.md, "Example (version 2)".
EXAMPLE_HEX = (
    "43434f4c020101002000000001000000" "4600000000000000000000000000e03f"
    "000000000000e03f0300000000000000" "04000000000000000100000003000000"
    "46000000000000000700000022002104" "40040000210000005040800823 1a1182"
    "208831a3440ac04014010000"
).replace(" ", "")
EXAMPLE = np.frombuffer(bytes.fromhex(EXAMPLE_HEX), np.uint8)


def example_q() -> np.ndarray:
    q = np.zeros(70, np.int64)
    q[3], q[17] = 2, -1
    q[32:64] = [0, 1, -1, 0, 2, 0, -3, 1, 0, 0, 1, -1, 0, 0, 2, 1,
                0, -1, 0, 0, 1, 0, 0, -2, 1, 0, 0, 9, 0, -1, 0, 0]
    q[64:70] = [1, 0, -1, 0, 0, 1]
    return q


def test_example_header_fields_and_section_offsets():
    h = fmt.parse_header(EXAMPLE)
    assert (h.version, h.nmask, h.ntab, h.nnz, h.payload_words) == (2, 1, 3, 3, 4)
    assert h.index_bits == 2
    assert (h.table_offset, h.index_offset, h.mask_offset, h.payload_offset) == (76, 84, 88, 92)
    assert h.nbytes == EXAMPLE.size == 108
    assert np.array_equal(h.pack(), EXAMPLE[:72])


def _edit_v2(buf: np.ndarray, off: int, fmtc: str, val) -> np.ndarray:
    import struct

    out = bytearray(buf.tobytes())
    struct.pack_into(fmtc, out, off, val)
    return np.frombuffer(bytes(out), np.uint8)


@pytest.mark.parametrize("off, fmtc, val, match", [
    (12, "<I", 4, "nmask"),
    (60, "<I", 0, "ntab"),
    (60, "<I", 4, "ntab"),
    (7, "<B", 3, "source dtype code 3"),
    (16, "<Q", 1 << 37, "shape|2\\^37"),
])
def test_v2_header_fields_are_checked(off, fmtc, val, match):
    with pytest.raises(FormatError, match=match):
        fmt.parse_header(_edit_v2(EXAMPLE, off, fmtc, val))


def test_v2_refuses_2_to_the_37_elements():
    import struct

    n = 1 << 37
    raw = bytearray(EXAMPLE[:72].tobytes())
    struct.pack_into("<Q", raw, 16, n)
    struct.pack_into("<Q", raw, 64, n)
    with pytest.raises(FormatError, match="2\\^37"):
        fmt.parse_header(np.frombuffer(bytes(raw), np.uint8), exact=False, total_nbytes=1 << 50)


# ------------------------------------------------------------------------------ kernels

import math  # noqa: E402

import numba  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

import ccoll  # noqa: E402
from ccoll.compressor import add, add_data, compress_abs, decompress, header  # noqa: E402
from ccoll.compressor.cpu import blocks as cpu_blocks  # noqa: E402
from ccoll.errors import CCollError, InputError, MismatchError  # noqa: E402


def test_worked_example_is_encoded_and_decoded_byte_for_byte():
    x = example_q().astype(np.float32)  # eb = 0.5: step 1, q is the value
    assert compress_abs(x, 0.5, version=2).tobytes() == EXAMPLE.tobytes()
    assert np.array_equal(decompress(EXAMPLE), x)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hnp.arrays(st.sampled_from([np.float32, np.float64]), st.integers(0, 300),
               elements=st.floats(-1e6, 1e6, width=32)),
    st.sampled_from([1e-6, 1e-3, 0.1, 7.0, 1e4]),
)
def test_round_trip_within_the_strict_bound(x, eb):
    y = decompress(compress_abs(x, eb, version=2))
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.all(np.abs(y.astype(np.float64) - x.astype(np.float64)) < eb)


def test_specials_are_kept_bit_for_bit():
    for dt in (np.float32, np.float64):
        x = np.linspace(-3, 3, 200).astype(dt)
        x[[3, 50, 51, 199]] = [np.nan, np.inf, -np.inf, -0.0]
        x[100] = np.frombuffer(np.array(0x7FC00123 if dt == np.float32 else 0x7FF0000000000123,
                                        np.uint64 if dt == np.float64 else np.uint32).tobytes(),
                               dt)[0]
        y = decompress(compress_abs(x, 1e-3, version=2))
        raw = [3, 50, 51, 100]  # blocks 0, 1 and 3 are raw: specials come back as they were
        assert y[raw].tobytes() == x[raw].tobytes()
        z = decompress(compress_abs(x, 0.0, version=2))  # lossless: every bit
        assert z.tobytes() == x.tobytes()


@pytest.mark.parametrize("shape", [(0,), (0, 4), (), (1,), (31,), (33,), (5, 7, 3)])
def test_shapes_empty_zero_d_and_partial_blocks(shape):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    buf = compress_abs(x, 1e-2, version=2)
    h = header(buf)
    assert (h.version, h.shape) == (2, shape)
    y = decompress(buf)
    assert y.shape == shape and np.all(np.abs(y - x) < 1e-2)


def test_float16_and_bfloat16_go_through_float32():
    x = np.linspace(-2, 2, 100).astype(np.float16)
    buf = ccoll.compress(x, ccoll.ABS(1e-3), version=2)
    assert header(buf).version == 2 and header(buf).dtype == np.float32
    y = decompress(buf, like=x)
    assert y.dtype == np.float16
    assert np.array_equal(y, decompress(ccoll.compress(x, ccoll.ABS(1e-3)), like=x))


def test_compress_default_is_version_1_and_rel_works_for_2():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert header(ccoll.compress(x, ccoll.REL(1e-3))).version == 1
    b2 = ccoll.compress(x, ccoll.REL(1e-3), version=2)
    assert header(b2).version == 2
    assert decompress(b2).tobytes() == decompress(ccoll.compress(x, ccoll.REL(1e-3))).tobytes()


@pytest.mark.parametrize("version", [0, 3, "2", True, 2.0])
def test_bad_version_is_an_input_error(version):
    with pytest.raises(InputError, match="version=1 or version=2"):
        ccoll.compress(np.zeros(4, np.float32), ccoll.ABS(1e-3), version=version)


def test_v2_refuses_arrays_of_2_to_the_37_elements():
    from ccoll.compressor.cpu import v2

    with pytest.raises(InputError, match="version=1"):
        v2.check_v2_size(1 << 37)
    v2.check_v2_size((1 << 37) - 1)


def test_mixed_versions_do_not_add():
    x = np.arange(100, dtype=np.float32)
    a1, a2 = compress_abs(x, 0.1), compress_abs(x, 0.1, version=2)
    for p, q in ((a1, a2), (a2, a1)):
        with pytest.raises(FormatError, match="versions 1 and 2 cannot be added; compress both "
                                              "with the same version"):
            add(p, q)
    assert header(add(a1, a1)).version == 1
    assert header(add(a2, a2)).version == 2


def _decoded_q(buf: np.ndarray, eb: float) -> np.ndarray:
    return np.round(decompress(buf).astype(np.float64) / (2 * eb)).astype(np.int64)


def test_add_is_an_exact_integer_sum_and_copies_one_sided_blocks():
    rng = np.random.default_rng(7)
    eb = 1e-3
    x = (rng.standard_normal(5000) * 0.05)
    z = (rng.standard_normal(5000) * 0.05)
    x[:1024] = 0.0  # blocks zero on one side are copied bit-exact
    z[2048:3072] = 0.0
    a, b = compress_abs(x, eb, version=2), compress_abs(z, eb, version=2)
    s = add(a, b)
    assert np.array_equal(_decoded_q(s, eb), _decoded_q(a, eb) + _decoded_q(b, eb))
    assert header(s).nterms == 2 and header(s).bound == 2 * eb
    # the copied blocks: the sum of a and a zero stream is a itself, byte for byte
    zero = compress_abs(np.zeros(5000), eb, version=2)
    assert add(a, zero).tobytes()[64:] == a.tobytes()[64:]
    assert add(zero, a).tobytes()[64:] == a.tobytes()[64:]


def test_add_overflow_and_raw_give_raw_float64_blocks():
    eb = 0.5
    x = np.full(64, 2.0**30, np.float32)  # |q| = 2^30: the sum of two reaches 2^31 - 1
    x[40] = np.nan
    a = compress_abs(x, eb, version=2)
    s = add(a, a)
    h = header(s)
    from ccoll.compressor.cpu.v2 import validate_v2

    lay = validate_v2(s)
    assert list(lay.table) == [3 << 10]  # both blocks raw float64 (kind 3)
    y = decompress(s)
    assert y[0] == np.float32(2.0**31) and np.isnan(y[40])
    assert h.nterms == 2


def _block_of(rng: np.random.Generator, kind: str) -> np.ndarray:
    """32 integers (so ``q`` itself at ``eb = 0.5``) that make blocks of every shape."""
    q = np.zeros(32, np.int64)
    if kind == "sparse":  # 1..4 non-zeros: SP(c, v)
        lanes = rng.choice(32, int(rng.integers(1, 5)), replace=False)
        q[lanes] = rng.integers(1, 2 ** int(rng.integers(1, 12)), lanes.size)
    elif kind == "k0":  # many small values, a few larger: PP(0, h)
        q[:] = rng.integers(0, 2, 32) * rng.integers(1, 3, 32)
        q[rng.integers(0, 32, 3)] = rng.integers(1, 60, 3)
    elif kind == "wide_highs":  # 22 values in 2..8: PP(0, 3), p * h = 66 > 64 bits of highs
        lanes = rng.choice(32, 22, replace=False)
        q[lanes] = rng.integers(2, 9, 22)
        q[lanes[0]] = 8
    elif kind == "dense":  # every lane up to 2^10: PP(k > 0, h), the 32-bit sign word
        q[:] = rng.integers(0, 1024, 32)
    elif kind == "narrow_max":  # 2^29 - 1 (29 bits): the widest that adds on planes
        q[:] = rng.integers(0, 2**29, 32)
        q[rng.integers(0, 32)] = 2**29 - 1
    elif kind == "too_wide":  # 30 bits: added lane by lane, as is a raw overflow (2^30 + 2^30)
        q[:] = rng.integers(0, 2**30, 32)
        q[rng.integers(0, 32)] = 2**30
    return q * rng.choice([-1, 1], 32)


BLOCK_KINDS = ["zero", "sparse", "k0", "wide_highs", "dense", "narrow_max", "too_wide"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_tail", [0, 1, 17])
def test_add_on_planes_and_lane_by_lane_equals_the_reference(seed, n_tail):
    # Every pair of block kinds side by side (quantized pairs up to 29 bits add on their
    # bit-planes, wider ones and raw blocks lane by lane), cancellations, and a partial
    # last block; the bytes are the slow reference's.
    from test_compressor_reference import ref_add_v2

    from ccoll.compressor.cpu.v2 import validate_v2

    rng = np.random.default_rng(seed)
    pairs = [(ka, kb) for ka in BLOCK_KINDS for kb in BLOCK_KINDS]
    qa = np.concatenate([_block_of(rng, ka) for ka, _ in pairs] + [np.arange(n_tail)])
    qb = np.concatenate([_block_of(rng, kb) for _, kb in pairs] + [-np.arange(n_tail) // 2])
    qb[32 * 7 : 32 * 14] = -qa[32 * 7 : 32 * 14]  # sparse blocks that cancel: zero blocks
    a = compress_abs(qa.astype(np.float64), 0.5, version=2)
    b = compress_abs(qb.astype(np.float64), 0.5, version=2)
    s = add(a, b)
    assert s.tobytes() == ref_add_v2(a.tobytes(), b.tobytes())
    assert np.array_equal(decompress(s), (qa + qb).astype(np.float64))
    codes = set(validate_v2(a).table.tolist()) | set(validate_v2(s).table.tolist())
    assert {0, 1} <= {c >> 10 for c in codes}  # patched planes and sparse
    assert any(c >> 10 == 0 and (c >> 5) & 31 > 0 for c in codes)  # k > 0 (sign word)
    assert 3 in codes  # PP(0, 3): the 66 bits of highs of "wide_highs"
    # 30-bit blocks in a float32 stream: the sum of two overflows to raw (kind 3)
    big = np.concatenate([_block_of(rng, "too_wide") for _ in range(3)]).astype(np.float32)
    a32 = compress_abs(big, 0.5, version=2)
    s32 = add(a32, a32)
    assert s32.tobytes() == ref_add_v2(a32.tobytes(), a32.tobytes())
    assert 3 << 10 in validate_v2(s32).table.tolist()


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_chunks_packed_while_planned_and_written_again_give_the_same_bytes(dt):
    # The plan pass packs a chunk into its scratch region when its payload fits (a
    # quarter of a float32 chunk); a denser chunk, or one with raw blocks, is quantized
    # again by the write pass. Streams mixing both, on 1 and 2 threads, are the reference's.
    from test_compressor_reference import ref_compress_v2

    rng = np.random.default_rng(5)
    chunk = cpu_blocks.CHUNK_BLOCKS * 32
    sparse = np.where(rng.random(chunk) < 0.01, rng.standard_normal(chunk), 0.0)
    dense = rng.standard_normal(chunk) * 100  # about 9 bits a value: written again
    raw = sparse.copy()
    raw[::97] = np.nan
    x = np.concatenate([sparse, dense, raw] * 3 + [dense[:1000], sparse[:77]]).astype(dt)
    assert x.size > cpu_blocks.SERIAL_BELOW  # chunks run in parallel
    eb = 0.05
    outs = []
    prev = numba.get_num_threads()
    try:
        for t in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(t)
            outs.append(compress_abs(x, eb, version=2).tobytes())
    finally:
        numba.set_num_threads(prev)
    assert all(o == outs[0] for o in outs)
    assert outs[0] == ref_compress_v2(x, eb)


def test_add_ignores_mask_bits_of_padding_lanes():
    # A hostile but valid stream: the partial last block is PP(1, 0) (64 payload bits
    # whatever its mask), with a mask bit set on a padding lane. The sum, as the format
    # says, sets padding lanes to 0 (both the plane and the lane-by-lane sums).
    from test_compressor_reference import ref_add_v2

    from ccoll.compressor.cpu.v2 import validate_v2

    q = np.resize(np.array([3, -2, 1, 2, 3, -3, 1, 2], np.float64), 30)  # 30 valid lanes
    a = compress_abs(q, 0.5, version=2)
    assert validate_v2(a).table.tolist() == [1 << 5]  # PP(1, 0)
    off = header(a).mask_offset
    bad = a.copy()
    bad[off : off + 4].view("<u4")[0] |= 1 << 30
    assert np.array_equal(decompress(bad), q)
    s = add(bad, bad)
    assert s.tobytes() == ref_add_v2(bad.tobytes(), bad.tobytes())
    assert np.array_equal(decompress(s), 2 * q)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([np.float32, np.float64]),
       st.sampled_from([0.0, 1e-4, 0.1]), st.integers(0, 700))
def test_add_data_equals_add_of_the_compressed_data(seed, dt, eb, n):
    rng = np.random.default_rng(seed)
    x = np.where(rng.random(n) < 0.5, 0.0, rng.standard_normal(n)).astype(dt)
    z = np.where(rng.random(n) < 0.5, 0.0, rng.standard_normal(n) * 10).astype(dt)
    if n > 3:
        z[n // 2] = np.nan
    a = compress_abs(x, eb, version=2)
    assert add_data(a, z).tobytes() == add(a, compress_abs(z, eb, version=2)).tobytes()


def _kind_block(kind: str, rng: np.random.Generator, dt: type) -> np.ndarray:
    """32 values (eb = 0.5, step 1) that compress to a block of ``kind``."""
    if kind == "zero":
        return np.zeros(32, dt)
    if kind == "tiny":  # the compressor's zero-block shortcut: |x| <= eb / 2
        return (rng.uniform(-0.2, 0.2, 32)).astype(dt)
    if kind == "sparse":
        v = np.zeros(32, dt)
        v[rng.choice(32, 3, replace=False)] = rng.integers(-9, 10, 3)
        return v
    if kind == "narrow":
        return rng.integers(-300, 301, 32).astype(dt)
    if kind == "wide":  # |q| of 30-31 bits: past the planes, summed lane by lane
        return (rng.choice([-1, 1], 32) * (2.0**30 + 2.0**7 * rng.integers(0, 2**20, 32))
                ).astype(dt)
    assert kind == "raw"
    v = rng.integers(-5, 6, 32).astype(dt)
    v[rng.integers(32)] = [np.nan, np.inf, -np.inf][rng.integers(3)]
    return v


_KINDS = ["zero", "tiny", "sparse", "narrow", "wide", "raw"]


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_add_data_equals_add_for_every_pair_of_block_kinds(dt):
    # The one-pass add_data quantizes each block of the data beside the stream's block:
    # every pair of kinds (zero, the zero shortcut, sparse, narrow, wide past the planes,
    # raw) on the two sides, on plain streams and on partial sums whose overflowing lanes
    # made 64-bit raw blocks, over several chunks, with a partial last block, must give
    # add(a, compress(x)) byte for byte, and the reference's bytes.
    from test_compressor_reference import ref_add_v2

    from ccoll.compressor.cpu.v2 import validate_v2
    from ccoll.compressor.cpu.v2blocks import CODE_RAW64_V2, CODE_RAW_V2

    rng = np.random.default_rng(20261205)
    pairs = [(ka, kx) for ka in _KINDS for kx in _KINDS] * 12  # 432 blocks: 2 chunks
    order = rng.permutation(len(pairs))
    a = np.concatenate([_kind_block(pairs[i][0], rng, dt) for i in order])
    x = np.concatenate([_kind_block(pairs[i][1], rng, dt) for i in order])
    a, x = a[:-7], x[:-7]  # a partial last block
    sa = compress_abs(a, 0.5, version=2)
    ssum = add(sa, sa)  # wide blocks overflow: raw sums (64-bit fields in float32)
    assert (CODE_RAW64_V2 if dt is np.float32 else CODE_RAW_V2) in validate_v2(ssum).table
    for s in (sa, ssum):
        expect = add(s, compress_abs(x, 0.5, version=2))
        got = add_data(s, x)
        assert got.tobytes() == expect.tobytes()
        assert got.tobytes() == ref_add_v2(s.tobytes(), compress_abs(x, 0.5, version=2).tobytes())


def test_bytes_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(2)
    n = 3 * cpu_blocks.SERIAL_BELOW + 1234  # many chunks, run in parallel
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 3)).astype(np.float32)
    x[rng.random(n) < 0.3] = 0.0
    x[rng.random(n) < 1e-3] = np.nan
    z = rng.standard_normal(n).astype(np.float32)
    outs = []
    prev = numba.get_num_threads()
    try:
        for t in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(t)
            a = compress_abs(x, 1e-3, version=2)
            b = compress_abs(z, 1e-3, version=2)
            outs.append((a.tobytes(), add(a, b).tobytes(), add_data(a, z).tobytes(),
                         decompress(a).tobytes()))
    finally:
        numba.set_num_threads(prev)
    assert all(o == outs[0] for o in outs)
    # and the chunks' shared words are right: the reference reader agrees
    from test_compressor_reference import ref_compress_v2

    assert outs[0][0] == ref_compress_v2(x, 1e-3)


# ------------------------------------------------------------------------- robustness

def _v2_streams():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(300) * 1e-2).astype(np.float32)
    x[5] = np.nan
    x[100:140] = 0.0
    x[200:204] = [0, 3e-3, 0, -5e-3]  # sparse blocks
    y = rng.standard_normal((3, 37))
    a = compress_abs(x, 1e-4, version=2)
    return {
        "f32": a,
        "f64": compress_abs(y, 1e-3, version=2),
        "sum32": add(a, compress_abs(x * 1e6, 1e-4, version=2)),
        "lossless": compress_abs(y, 0.0, version=2),
        "empty": compress_abs(np.zeros((0, 4), np.float32), 1e-3, version=2),
        "example": EXAMPLE.copy(),
    }


V2 = _v2_streams()


def _decode_or_format_error(buf) -> None:
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


@pytest.mark.parametrize("name", sorted(V2))
def test_every_truncation_and_extension_is_rejected(name):
    buf = V2[name]
    for cut in range(buf.size):
        with pytest.raises(FormatError):
            decompress(buf[:cut])
    with pytest.raises(FormatError, match="truncated or trailing"):
        decompress(np.concatenate([buf, np.zeros(4, np.uint8)]))


def _put32(buf: np.ndarray, off: int, val: int) -> np.ndarray:
    out = buf.copy()
    out[off : off + 4] = np.frombuffer(np.uint32(val).tobytes(), np.uint8)
    return out


def test_section_checks_name_the_problem():
    h = header(EXAMPLE)
    cases = [
        (_put32(EXAMPLE, h.table_offset, 0x0022_0421), "increasing"),  # swapped codes
        (_put32(EXAMPLE, h.table_offset, 0x0421_03E0), "invalid code"),  # k = 31
        (_put32(EXAMPLE, h.table_offset + 4, 0x0001_0440), "padding"),
        (_put32(EXAMPLE, h.index_offset, 0x23), "ntab"),  # index 3 >= ntab
        (_put32(EXAMPLE, h.index_offset, 0x121), "index padding"),
        (_put32(EXAMPLE, h.index_offset, 0x16), "nmask"),  # no patched-planes block
        (_put32(EXAMPLE, h.mask_offset, 0xFFFFFFFF), "payload"),  # 32 high lanes
        (_put32(EXAMPLE, h.payload_offset + 12, 0x00400114), "after the last block"),
        (_put32(EXAMPLE, h.payload_offset, 0x82111A23 & ~0x3FF | (17 | 3 << 5)),
         "not increasing"),  # sparse positions 17, 3
    ]
    for buf, match in cases:
        with pytest.raises(FormatError, match=match):
            decompress(buf)


mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("byte"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("field"), st.integers(0, 63), st.integers(0, 255)),
    st.tuples(st.just("word"), st.integers(0, 10**6), st.integers(0, 2**32 - 1)),
)


def _mutate(buf: np.ndarray, muts) -> np.ndarray:
    import struct

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
    bad = _mutate(V2[name], muts)
    _decode_or_format_error(bad)
    for other in (V2[name], bad):
        try:
            add(bad, other)
        except CCollError as exc:
            assert isinstance(exc, (FormatError, MismatchError, ccoll.ErrorBoundError))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(V2)), st.lists(mutations, min_size=1, max_size=4))
def test_mutated_v2_streams(name, muts):
    _fuzz_one(name, muts)


@pytest.mark.slow
@settings(max_examples=12000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(V2)), st.lists(mutations, min_size=1, max_size=6))
def test_mutated_v2_streams_long(name, muts):
    _fuzz_one(name, muts)


def test_every_header_byte_mutation_is_a_format_error_or_decodes():
    for buf in V2.values():
        for off in range(min(64, buf.size)):
            for val in (0, 1, 0x7F, 0xFF):
                b = buf.copy()
                b[off] = val
                _decode_or_format_error(b)
    assert math.isfinite(header(V2["f32"]).eb)


def test_pext_pdep_match_their_definition_and_the_portable_loops():
    from numba import njit

    from ccoll.compressor.cpu import intrinsics as it

    @njit
    def both(x, m):  # type: ignore[no-untyped-def]
        return it._pext64(x, m), it._pdep64(x, m), it._pext_sw(x, m), it._pdep_sw(x, m)

    rng = np.random.default_rng(4)
    for _ in range(300):
        x, m = (int(v) for v in rng.integers(-(2**63), 2**63 - 1, 2, dtype=np.int64))
        m &= int(rng.integers(0, 2**63 - 1))  # sparse and dense masks
        bits = [i for i in range(64) if (m >> i) & 1]
        pext = sum(((x >> b) & 1) << i for i, b in enumerate(bits))
        pdep = sum(((x >> i) & 1) << b for i, b in enumerate(bits))
        got = [v & (2**64 - 1) for v in both(x, m)]
        assert got == [pext, pdep & (2**64 - 1), pext, pdep & (2**64 - 1)]


def _same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equal, except that any NaN equals any NaN (a widened sNaN is quieted)."""
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb) and np.array_equal(a.view(np.uint32)[~na],
                                                          b.view(np.uint32)[~nb]))


def _table_agrees_with_lanes(buf: np.ndarray) -> None:
    """A float32 decode (small blocks through the output table) is the wide decode rounded."""
    from ccoll.compressor.cpu.decode import decompress_wide

    try:
        y = decompress(buf)
    except FormatError:
        return
    if y.dtype == np.float32:
        with np.errstate(over="ignore"):  # a raw float64 lane beyond float32's range
            wide = decompress_wide(buf).astype(np.float32)
        assert _same_floats(y.reshape(-1), wide)


@pytest.mark.parametrize("seed", range(4))
def test_decoding_through_the_output_table_equals_lane_by_lane(seed):
    # Scales and bounds that give patched planes with every k + h up to 8 and sparse
    # blocks with b up to 6, so blocks on both sides of the table's limits.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(32 * 600).astype(np.float32)
    x *= np.repeat(rng.choice([0.0, 1e-3, 1e-2, 0.1, 1.0, 10.0], 600), 32).astype(np.float32)
    x[rng.random(x.size) < 0.3] = 0.0
    x[-7:] = rng.standard_normal(7)  # a partial last block
    for eb in (0.5, 1e-1, 1e-2, 1e-3):
        _table_agrees_with_lanes(compress_abs(x, eb, version=2))
        _table_agrees_with_lanes(compress_abs(x[:-7], eb, version=2))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["f32", "sum32", "example"]), st.lists(mutations, min_size=1, max_size=3))
def test_mutated_streams_decode_through_the_table_as_lane_by_lane(name, muts):
    # Mutated payloads give sign bits on zero lanes and fields the encoder never writes.
    _table_agrees_with_lanes(_mutate(V2[name], muts))


def test_lut_store_matches_the_portable_loop():
    from numba import njit

    from ccoll.compressor.cpu import intrinsics as it

    @njit
    def both(tab, pl, k, neg, a, b):  # type: ignore[no-untyped-def]
        it._lut_store(a, 3, tab, pl, k, neg)
        it._lut_store_sw(b, 3, tab, pl, k, neg)

    rng = np.random.default_rng(5)
    nlo = it.LUT_BITS - 1
    tab = (np.arange(1 << it.LUT_BITS) * 0.37).astype(np.float32)
    for _ in range(300):
        k = int(rng.integers(0, it.LUT_BITS))
        h = int(rng.integers(0, min(4, it.LUT_BITS - 1 - k) + 1))
        pl = np.zeros(nlo + 3, np.int64)
        for j in range(k):
            pl[j] = rng.integers(0, 2**32)
        hi = rng.integers(0, 1 << h, 32) if h else np.zeros(32, np.int64)
        f = int(rng.integers(0, 2**32))
        hi[[(f >> l) & 1 == 0 for l in range(32)]] = 0
        for q in range(2):  # lane l's field at bit 4 * (l % 16) of word nlo + l // 16
            w = sum(int(v) << (4 * l) for l, v in enumerate(hi[16 * q : 16 * q + 16]))
            pl[nlo + q] = w - (1 << 64) if w >= 1 << 63 else w
        pl[nlo + 2] = f
        neg = int(rng.integers(0, 2**32))
        a = np.full(40, np.nan, np.float32)
        b = np.full(40, np.nan, np.float32)
        both(tab, pl, k, neg, a, b)
        lo = [sum(((int(pl[j]) >> l) & 1) << j for j in range(nlo)) for l in range(32)]
        idx = [lo[l] + ((int(hi[l]) + ((f >> l) & 1)) << k) for l in range(32)]
        want = np.array([-tab[i] if (neg >> l) & 1 and i else tab[i] for l, i in enumerate(idx)],
                        np.float32)
        assert np.array_equal(a[3:35].view(np.uint32), want.view(np.uint32))
        assert np.array_equal(b[3:35].view(np.uint32), want.view(np.uint32))
        assert np.isnan(a[:3]).all() and np.isnan(a[35:]).all()


def test_patched_lanes_by_pdep_equal_lanes_by_rank_and_the_definition():
    # Machines without a vector popcount take the pdep way for h <= 2 (v2blocks.SPREAD_HIGH);
    # both ways run here whatever this machine takes, against the format's definition.
    from numba import njit

    from ccoll.compressor.cpu import v2blocks as vb

    @njit
    def both(M, hb, h, k, sign, lo, a, b):  # type: ignore[no-untyped-def]
        vb._pp_lanes_ranked(M, hb, h, k, sign, lo, a)
        vb._pp_lanes_spread(M, hb, h, k, sign, lo, b)

    rng = np.random.default_rng(6)
    for _ in range(400):
        h = int(rng.integers(0, 3))
        k = int(rng.integers(0, 31 - h))
        M = int(rng.integers(0, 2**32)) & int(rng.integers(0, 2**32))  # sparse and dense
        high = [l for l in range(32) if (M >> l) & 1]
        fields = rng.integers(0, 1 << h, len(high)) if h else np.zeros(len(high), np.int64)
        hb = sum(int(v) << (i * h) for i, v in enumerate(fields))
        hb = hb - (1 << 64) if hb >= 1 << 63 else hb
        sign = int(rng.integers(0, 2**32))
        lo = rng.integers(0, 1 << k, 32).astype(np.uint32) if k else np.zeros(32, np.uint32)
        a = np.zeros(32, np.int64)
        b = np.zeros(32, np.int64)
        both(M, hb, h, k, sign, lo, a, b)
        mag = [int(lo[l]) for l in range(32)]
        for i, l in enumerate(high):
            mag[l] += (int(fields[i]) + 1) << k
        want = [-v if (sign >> l) & 1 else v for l, v in enumerate(mag)]
        assert a.tolist() == want
        assert b.tolist() == want


def test_patched_blocks_stored_from_32_bit_lanes_equal_lanes_by_rank_times_the_step():
    # Machines without a vector popcount decode patched-planes blocks with h <= 8 and
    # values below 2^31 in 32-bit lanes straight to floats (v2blocks.DIRECT32); that way
    # runs here whatever this machine takes, into float32 and float64 arrays at an offset.
    from numba import njit

    from ccoll.compressor.cpu import v2blocks as vb

    @njit
    def both(M, hb, h, k, sign, lo, sl, qv, o32, o64, step):  # type: ignore[no-untyped-def]
        vb._pp_lanes_ranked(M, hb, h, k, sign, lo, qv)
        vb._pp_store_lanes(M, hb, h, k, sign, lo, sl, o32, 3, step)
        vb._pp_store_lanes(M, hb, h, k, sign, lo, sl, o64, 3, step)

    rng = np.random.default_rng(8)
    seen = set()
    for _ in range(1500):
        h = int(rng.integers(0, 9))
        k = int(rng.integers(0, 31 - h))
        M = int(rng.integers(0, 2**32))
        if rng.random() < 0.1:
            M = 2**32 - 1  # every lane high
        elif rng.random() < 0.7:
            M &= int(rng.integers(0, 2**32))
        while bin(M).count("1") * h > 64:  # p*h <= 64
            M &= int(rng.integers(0, 2**32))
        high = [l for l in range(32) if (M >> l) & 1]
        # the widest fields half the time: all ones, so that no slot spills into the next
        fields = (np.full(len(high), (1 << h) - 1) if rng.random() < 0.5
                  else rng.integers(0, 1 << h, len(high)))
        hb = sum(int(v) << (i * h) for i, v in enumerate(fields))
        hb = hb - (1 << 64) if hb >= 1 << 63 else hb
        sign = int(rng.integers(0, 2**32))
        lo = rng.integers(0, 1 << k, 32).astype(np.uint32) if k else np.zeros(32, np.uint32)
        step = float(rng.uniform(1e-9, 1e-2))
        qv = np.zeros(32, np.int64)
        o32 = np.full(38, np.nan, np.float32)
        o64 = np.full(38, np.nan)
        both(M, hb, h, k, sign, lo, np.zeros(4, np.int64), qv, o32, o64, step)
        mag = [int(lo[l]) for l in range(32)]
        for i, l in enumerate(high):
            mag[l] += (int(fields[i]) + 1) << k
        assert qv.tolist() == [-v if (sign >> l) & 1 else v for l, v in enumerate(mag)]
        want = qv.astype(np.float64) * step
        assert np.array_equal(o64[3:35], want), (h, k, M)
        assert np.array_equal(o32[3:35].view(np.uint32), want.astype(np.float32).view(np.uint32))
        assert np.isnan(o32[:3]).all() and np.isnan(o32[35:]).all(), (h, k)
        assert np.isnan(o64[:3]).all() and np.isnan(o64[35:]).all(), (h, k)
        seen.add((2 if h <= 2 else 4 if h <= 4 else 8, bin(M).count("1") * h == 64))
    # every slot width, with and without all 64 bits of high parts
    assert seen == {(s, full) for s in (2, 4, 8) for full in (False, True)}, seen


def test_the_costs_of_small_blocks_in_32_bit_lanes_equal_the_64_bit_ones_and_the_rules():
    # Machines without a vector popcount price a small block's 8 codes in 32-bit lanes
    # (v2.COSTS32); both ways run here, against rules 3-4 computed in Python.
    from numba import njit

    from ccoll.compressor.cpu import intrinsics as it

    @njit
    def both(S, m):  # type: ignore[no-untyped-def]
        return it._costs8(S, 0, m), it._costs8_32(S, 0, m, it.BITLEN8)

    rng = np.random.default_rng(9)
    for m in range(1, 256):
        for _ in range(12):
            mags = rng.integers(0, m + 1, 32) if rng.random() < 0.5 else rng.integers(0, 2, 32)
            mags[rng.integers(0, 32)] = m
            S = np.array([sum(1 << l for l in range(32) if mags[l] >= 1 << j) for j in range(8)],
                         np.int64)
            p = [bin(int(S[k])).count("1") for k in range(8)]
            costs = [32 + p[0] + p[0] * (m - 1).bit_length()]
            costs += [64 + 32 * k + p[k] * ((m >> k) - 1).bit_length()
                      for k in range(1, m.bit_length())]
            best = min(costs)
            want = (best << 3) | costs.index(best)
            assert both(S, m) == (want, want), (m, mags)


def test_planes_and_signs_of_int32_lanes_equal_those_of_int64_lanes():
    # Machines without AVX-512DQ keep the plan pass's quantized values in int32 (v2.Q_LANE);
    # the plane and sign intrinsics take either width, here both against the definition.
    from numba import njit

    from ccoll.compressor.cpu import intrinsics as it

    @njit
    def planes(q, w, T, S):  # type: ignore[no-untyped-def]
        it._planes_abs(q, T, S, w, 1)
        it._planes_abs8(q, T, S, 40)
        return it._neg_mask(q)

    rng = np.random.default_rng(10)
    for _ in range(300):
        top = int(rng.choice([2, 256, 2**31]))
        q = rng.integers(-top + 1, top, 32)
        w = max(int(np.abs(q).max()).bit_length(), 1)
        mag = np.abs(q)
        want_t = [sum(((int(mag[l]) >> j) & 1) << l for l in range(32)) for j in range(w)]
        want_s = [sum(int(mag[l] >= 1 << j) << l for l in range(32)) for j in range(w)]
        want_neg = sum(int(q[l] < 0) << l for l in range(32))
        for dt in (np.int64, np.int32):
            T = np.zeros(48, np.int64)
            S = np.zeros(48, np.int64)
            assert planes(q.astype(dt), w, T, S) == want_neg
            assert T[1:1 + w].tolist() == want_t and S[1:1 + w].tolist() == want_s
            if top <= 256:  # the byte-lane form: 8 planes, 0 above the maximum's
                assert T[40:48].tolist() == (want_t + [0] * 8)[:8], dt
                assert S[40:48].tolist() == (want_s + [0] * 8)[:8], dt


def test_conversions_through_int32_are_exact_for_every_quantized_value():
    # Machines without AVX-512DQ convert quantized values through int32 (intrinsics._q_int).
    from numba import njit

    from ccoll.compressor.cpu import intrinsics as it

    @njit
    def conv(d, i, oi, of, wi, wf):  # type: ignore[no-untyped-def]
        for j in range(d.size):
            oi[j] = it._int_via_i32(d[j])
            of[j] = it._float_via_i32(i[j])
            wi[j] = it._q_int(d[j])
            wf[j] = it._q_float(i[j])

    lim = 2**31 - 1
    i = np.concatenate([np.array([0, 1, -1, lim, -lim, lim - 1, -lim + 1, -(2**31)]),
                        np.random.default_rng(7).integers(-lim, lim + 1, 2000)])
    d = i.astype(np.float64)
    outs = [np.empty(i.size, np.int64), np.empty(i.size), np.empty(i.size, np.int64),
            np.empty(i.size)]
    conv(d, i, *outs)
    for o in (outs[0], outs[2]):
        assert np.array_equal(o, i)
    for o in (outs[1], outs[3]):
        assert np.array_equal(o, d)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_of_quantized_blocks_whose_sum_goes_raw_stays_in_its_scratch(dtype):
    # Two sparse blocks of one value near 2^31 steps (37 bits each) sum past 2^31 - 1: the
    # sum's block is raw float64, 2048 bits, where each chunk's scratch region was sized for
    # 1024 bits a summed pair. The sum overran it: glibc aborts, segfaults, or 503 wrong
    # elements (±Inf, -5.75e-28 for 0) without an error.
    import ccoll
    from ccoll.compressor import add
    from ccoll.compressor.cpu.v2 import _sum_regions

    rng = np.random.default_rng(0)
    x = np.zeros(16384, dtype)
    x[:8192:32] = 2147483520.0  # q = 2^31 - 128 at ABS(0.5): accepted, and doubled past
    x[8192:] = rng.integers(-100, 100, 8192)
    s = ccoll.compress(x, ccoll.ABS(0.5), version=2)
    y = ccoll.decompress(add(s, s))
    assert np.array_equal(y, (x.astype(np.float64) * 2).astype(dtype))
    # The region of a chunk where both operands hold one 37-bit block: room for a raw
    # float64 block (64 words) however small the operands.
    reg = np.empty(1, np.int64)
    assert _sum_regions(np.zeros(1, np.int64), 2, np.zeros(1, np.int64), 1,
                        np.zeros(1, np.int64), 2, np.zeros(1, np.int64), 1, reg) >= 64
