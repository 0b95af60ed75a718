"""CUDA backend, stream format version 2, in the simulator: streams byte-identical to the
slow reference encoder of the spec (tests/cuda/v2ref.py), decoding equal to the reference
decoder bit for bit, the homomorphic add equal to the reference sum, malformed streams
refused with FormatError.

Inputs stay small (the simulator runs about 1 ms per warp intrinsic); sizes sit at the
kernels' boundaries: 32 elements per block, 1024 per compress/add thread block.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import v2ref
from kit import assert_clear_error
from numba import cuda

from ccoll.compressor import _cuda
from ccoll.compressor import cpu as _cpu
from ccoll.errors import FormatError, InputError

SPEC_EXAMPLE = bytes.fromhex(
    "43434f4c0201010020000000010000004600000000000000000000000000e03f"
    "000000000000e03f03000000000000000400000000000000010000000300000046"
    "000000000000000700000022002104400400002100000050408008231a118220"
    "8831a3440ac04014010000"
)


def mixed_q(nblocks: int, seed: int) -> np.ndarray:
    """Integer values (float64) whose blocks take every kind: zero, sparse with 1..4 values
    and widths 0..30, patched planes with k = 0 and k > 0, a few lanes far above the rest."""
    rng = np.random.default_rng(seed)
    q = np.zeros((nblocks, 32))
    for b in range(nblocks):
        kind = b % 6
        if kind == 0:
            continue  # zero block
        if kind == 1:  # sparse
            c = 1 + (b // 6) % 4
            lanes = rng.choice(32, c, replace=False)
            q[b, lanes] = rng.integers(1, 2 ** int(rng.integers(1, 31)), c) * rng.choice([-1, 1], c)
        elif kind == 2:  # dense small: PP(0, h)
            q[b] = rng.integers(-2, 3, 32)
        elif kind == 3:  # dense with outliers: PP(k, h), k > 0
            q[b] = rng.integers(-40, 41, 32)
            q[b, rng.integers(0, 32, 2)] = rng.integers(1000, 2 ** 20, 2)
        elif kind == 4:  # wide values
            q[b] = rng.integers(-(2 ** 30), 2 ** 30, 32)
        else:  # sparse-ish but dense enough for patched planes
            q[b, rng.choice(32, 6, replace=False)] = rng.integers(-3, 4, 6)
    return q.ravel()


def gpu_compress(x: np.ndarray, eb: float) -> bytes:
    return _cuda.compress_abs(cuda.to_device(np.ascontiguousarray(x)), eb, version=2
                              ).copy_to_host().tobytes()


def gpu_decode(buf: bytes) -> np.ndarray:
    return _cuda.decompress(cuda.to_device(np.frombuffer(buf, np.uint8))).copy_to_host()


def gpu_add(a: bytes, b: bytes) -> bytes:
    da = cuda.to_device(np.frombuffer(a, np.uint8))
    db = cuda.to_device(np.frombuffer(b, np.uint8))
    return _cuda.add(da, db).copy_to_host().tobytes()


def check_decoded(x: np.ndarray, eb: float) -> tuple[bytes, np.ndarray]:
    """GPU stream == reference stream; GPU decode == reference decode (bitwise).

    Returns the stream and the GPU's decoding of it (tests read that instead of decoding
    the same bytes again: each decode is two kernel launches in the simulator).
    """
    g = gpu_compress(x, eb)
    r = v2ref.encode_v2(x, eb)
    assert g == r, f"streams differ ({len(g)} vs {len(r)} bytes)"
    y = gpu_decode(r)
    want = v2ref.decode_v2(r)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.tobytes() == want.tobytes()
    return g, y


def check(x: np.ndarray, eb: float) -> bytes:
    return check_decoded(x, eb)[0]


def test_spec_example_bytes():
    q = np.zeros(70)
    q[3], q[17] = 2, -1
    q[32:64] = [0, 1, -1, 0, 2, 0, -3, 1, 0, 0, 1, -1, 0, 0, 2, 1,
                0, -1, 0, 0, 1, 0, 0, -2, 1, 0, 0, 9, 0, -1, 0, 0]
    q[64:70] = [1, 0, -1, 0, 0, 1]
    assert check(q.astype(np.float32), 0.5) == SPEC_EXAMPLE


# 31, 32 and 33 elements would quantize to all-zero streams here (block 0 of mixed_q is a zero
# block and block 1 keeps at most lane 0), showing only what 1 shows; 63-65 put the same
# block boundaries (partial, exact, one past) on blocks with content.
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1023, 1025])
def test_float32_stream_equals_reference(n):
    x = (mixed_q((n + 31) // 32, seed=n)[:n] * 1e-3).astype(np.float32)
    if n in (63, 64, 65):
        assert x.any()
    check(x, 0.5e-3)


@pytest.mark.parametrize("n", [33, 65])
def test_float64_stream_equals_reference(n):
    x = mixed_q((n + 31) // 32, seed=n)[:n] * 0.25
    check(x, 0.125)


@pytest.mark.slow  # ~1 min in the simulator on the loaded 2-core machine
def test_many_tiles_and_index_lookback():
    # 8193 elements: 9 compress tiles, 2 index thread blocks (whose three look-backs chain
    # across them), a partial last block; mostly zero, which is cheap in the simulator.
    x = np.zeros(8193, np.float32)
    x[::509] = np.linspace(-1.0, 1.0, x[::509].size)
    x[4000:4100] = np.linspace(0.0, 0.3, 100)
    x[-1] = 0.25
    g = check(x, 1e-3)
    capped = _cuda.compress_abs(cuda.to_device(x), 1e-3, version=2, max_blocks=2)
    assert capped.copy_to_host().tobytes() == g  # persistent thread blocks: same bytes
    y = np.zeros_like(x)
    y[4050:4300] = 0.125
    b = gpu_compress(y, 1e-3)
    assert gpu_add(g, b) == v2ref.add_v2(g, b)


def test_every_kind_and_table_size():
    """Tables of 1 code (no index bits), 2 codes (1-bit index) and many codes."""
    one = np.zeros(96, np.float32)
    one[[3, 40, 77]] = 1.0  # three SP(1, 0) blocks: ntab = 1, ib = 0
    g = check(one, 0.5)
    assert struct.unpack_from("<I", g, 60)[0] == 1
    two = np.zeros(96, np.float32)
    two[[3, 40]] = 1.0
    two[64:96] = 1.0  # PP(0, 0) next to SP(1, 0)
    g = check(two, 0.5)
    assert struct.unpack_from("<I", g, 60)[0] == 2
    many = mixed_q(24, seed=7)  # 9 codes: 4 index bits (2 tiles: n = 1025 and the add test)
    g = check(many, 0.5)
    codes = v2ref.parse(g)["table"]
    assert len(codes) > 8 and {c >> 10 for c in codes} == {0, 1}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_inf_and_lossless(dtype):
    x = (mixed_q(3, seed=3) * 0.01).astype(dtype)
    x[[5, 40, 90]] = [np.nan, np.inf, -np.inf]
    x[70] = np.array([0x7FC01234], np.uint32).view(np.float32)[0] if dtype == np.float32 else \
        np.array([0x7FF0000000001234], np.uint64).view(np.float64)[0]
    g, y = check_decoded(x, 0.005)
    assert {c >> 10 for c in v2ref.parse(g)["table"]} >= {2}
    assert y[[5, 40, 90, 70]].tobytes() == x[[5, 40, 90, 70]].tobytes()  # raw, bit for bit
    z = x.copy()
    z[32:64] = 0.0
    z[33] = -0.0
    _, y = check_decoded(z, 0.0)  # lossless: zero block for +-0.0, raw otherwise
    want = z.copy()
    want[33] = 0.0  # a zero block decodes to +0.0
    assert y.tobytes() == want.tobytes()


def test_add_equals_reference():
    # Two tiles: blocks 0-13 of tile 0 hold every kind and the special sums below, blocks
    # 14-31 are zero in both (cheap in the simulator), and tile 1 holds one partial block
    # of 20 small values on both sides, whose sum is a patched-planes block: its code,
    # mask and payload land at offsets that the add kernel's look-back takes from tile 0.
    rng = np.random.default_rng(1)
    n = 1024 + 20
    qa = np.zeros(n)
    qb = np.zeros(n)
    qa[: 32 * 14] = mixed_q(14, seed=11)
    qb[: 32 * 14] = mixed_q(14, seed=12)
    qb[: 32 * 4] = 0  # zero next to non-zero: blocks copied bit for bit
    qa[32 * 6: 32 * 7] = 0
    qb[32 * 8: 32 * 9] = -qa[32 * 8: 32 * 9]  # the sum cancels to a zero block
    qa[32 * 10] = qb[32 * 10] = 2 ** 30 + rng.integers(0, 2 ** 29)  # sum overflows: raw
    qa[1024:] = rng.integers(-2, 3, n - 1024)
    qb[1024:] = rng.integers(-2, 3, n - 1024)
    tail = [int(v) for v in qa[1024:] + qb[1024:]] + [0] * (32 - (n - 1024))
    assert v2ref.encode_block_v2(tail)[1] is not None  # a mask: patched planes
    xa = (qa * 0.5).astype(np.float32)
    xb = (qb * 0.5).astype(np.float32)
    xb[32 * 12 + 5] = np.nan  # raw on one side: raw float64 sum, canonical NaN
    xa[32 * 12 + 5] = 1.0
    a, b = gpu_compress(xa, 0.25), gpu_compress(xb, 0.25)
    assert a == v2ref.encode_v2(xa, 0.25) and b == v2ref.encode_v2(xb, 0.25)
    s = gpu_add(a, b)
    want = v2ref.add_v2(a, b)
    assert s == want, f"sums differ ({len(s)} vs {len(want)} bytes)"
    kinds = {c >> 10 for c in v2ref.parse(s)["table"]}
    assert kinds == {0, 1, 3}
    # the sum decodes and adds again (kind 3 next to zero blocks is copied)
    assert gpu_decode(s).tobytes() == v2ref.decode_v2(s).tobytes()
    z = gpu_compress(np.zeros(n, np.float32), 0.25)
    assert z == v2ref.encode_v2(np.zeros(n, np.float32), 0.25)  # two all-zero tiles
    assert gpu_add(s, z) == v2ref.add_v2(s, z)


def test_add_float64_and_lossless():
    # Inputs from the reference encoder (the kernels' float64 and lossless streams are
    # checked by test_float64_stream_equals_reference and test_nan_inf_and_lossless).
    x = mixed_q(3, seed=5)[:70] * 0.25
    y = mixed_q(3, seed=6)[:70] * 0.25
    a, b = v2ref.encode_v2(x, 0.125), v2ref.encode_v2(y, 0.125)
    assert gpu_add(a, b) == v2ref.add_v2(a, b)
    a0, b0 = v2ref.encode_v2(x, 0.0), v2ref.encode_v2(y, 0.0)
    s = v2ref.add_v2(a0, b0)
    # the lossless sum into a caller's buffer, and decoded into a caller's array
    buf = cuda.device_array(len(s) + 40, np.uint8)
    got = _cuda.add(cuda.to_device(np.frombuffer(a0, np.uint8)),
                    cuda.to_device(np.frombuffer(b0, np.uint8)), out=buf)
    assert got.copy_to_host().tobytes() == s
    out = cuda.device_array(70, np.float64)
    _cuda.decompress(cuda.to_device(np.frombuffer(s, np.uint8)), out=out)
    np.testing.assert_array_equal(out.copy_to_host(), x + y)


def test_add_rejects_mixed_versions():
    x = np.ones(40, np.float32)
    a = cuda.to_device(_cpu.compress_abs(x, 0.1, 2))
    b = cuda.to_device(_cpu.compress_abs(x, 0.1, 1))
    assert_clear_error(FormatError, "versions 1 and 2", _cuda.add, a, b)
    assert_clear_error(FormatError, "versions 1 and 2", _cuda.add, b, a)


def test_version_argument_checked():
    assert_clear_error(InputError, "version must be 1 or 2", _cuda.compress_abs,
                       cuda.to_device(np.ones(3, np.float32)), 0.1, version=3)


# ----------------------------------------------------------------- malformed streams


def _stream() -> bytearray:
    """A 3-block float32 stream with SP, PP(k>0) and PP(0) blocks: ntab 3, one index word."""
    q = np.zeros(96)
    q[[1, 9]] = [3, -1]
    q[32:64] = np.arange(-16, 16) * 3
    q[64:96] = [1, -1] * 16
    buf = bytearray(v2ref.encode_v2(q.astype(np.float32), 0.5))
    assert struct.unpack_from("<I", buf, 60)[0] == 3
    return buf


def _layout(buf: bytes) -> dict[str, int]:
    (nmask, n, nnz, pw, ntab) = (struct.unpack_from("<I", buf, 12)[0],
                                 struct.unpack_from("<Q", buf, 16)[0],
                                 struct.unpack_from("<Q", buf, 40)[0],
                                 struct.unpack_from("<Q", buf, 48)[0],
                                 struct.unpack_from("<I", buf, 60)[0])
    ndim = buf[6]
    bm = 64 + 8 * ndim
    tab = bm + 4 * (((n + 31) // 32 + 31) // 32)
    idx = tab + 4 * ((ntab + 1) // 2)
    ib = max(ntab - 1, 0).bit_length()
    msk = idx + 4 * ((nnz * ib + 31) // 32)
    pay = msk + 4 * nmask
    return dict(bm=bm, tab=tab, idx=idx, msk=msk, pay=pay, pw=pw, ntab=ntab)


def _mut(fn) -> bytes:
    buf = _stream()
    fn(buf, _layout(bytes(buf)))
    return bytes(buf)


def _set16(buf, off, v):
    struct.pack_into("<H", buf, off, v)


MUTATIONS = {
    "bits beyond the last block": (lambda b, L: b.__setitem__(L["bm"], b[L["bm"]] | 8), "beyond"),
    "table not increasing": (lambda b, L: _set16(b, L["tab"] + 2, 0), "table"),
    "invalid code (k = 31)": (lambda b, L: _set16(b, L["tab"] + 4, 31 << 5), "table"),
    "invalid code (bits 12..15)": (lambda b, L: _set16(b, L["tab"] + 4, 0xF000), "table"),
    "table padding": (lambda b, L: _set16(b, L["tab"] + 6, 1), "padding"),
    "index past the table": (lambda b, L: b.__setitem__(L["idx"], 0x3F), "index"),
    "index padding": (lambda b, L: b.__setitem__(L["idx"] + 1, 0x80), "padding"),
    "mask bits": (lambda b, L: struct.pack_into("<I", b, L["msk"] + 4, 0), "sizes"),
    "payload tail": (lambda b, L: b.__setitem__(len(b) - 1, 0x80), "padding"),
    "sparse positions": (lambda b, L: b.__setitem__(L["pay"], (b[L["pay"]] & ~31) | 9),
                         "sparse"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_malformed_stream_raises_format_error(name):
    mut, match = MUTATIONS[name]
    bad = _mut(mut)
    assert_clear_error(FormatError, match, _cuda.decompress,
                       cuda.to_device(np.frombuffer(bad, np.uint8)))


def test_add_refuses_unordered_sparse_positions():
    bad = _mut(MUTATIONS["sparse positions"][0])
    good = bytes(_stream())
    d = cuda.to_device
    assert_clear_error(FormatError, "sparse", _cuda.add, d(np.frombuffer(bad, np.uint8)),
                       d(np.frombuffer(good, np.uint8)))


def test_header_of_a_v2_stream():
    h = _cuda.header(cuda.to_device(np.frombuffer(SPEC_EXAMPLE, np.uint8)))
    assert (h.version, h.dtype, h.shape, h.n, h.eb, h.bound, h.nnz, h.payload_words,
            h.nterms, h.nmask, h.ntab, h.index_bits) == (
        2, np.float32, (70,), 70, 0.5, 0.5, 3, 4, 1, 1, 3, 2)
    assert (h.table_offset, h.index_offset, h.mask_offset, h.payload_offset, h.nbytes) == (
        76, 84, 88, 92, 108)


def test_malformed_headers_raise_format_error():
    good = bytes(_stream())
    d = cuda.to_device

    def hdr(off, fmt_, v):
        b = bytearray(good)
        struct.pack_into(fmt_, b, off, v)
        return d(np.frombuffer(bytes(b), np.uint8))

    assert_clear_error(FormatError, "ntab 0", _cuda.decompress, hdr(60, "<I", 0))
    assert_clear_error(FormatError, "nmask 4", _cuda.decompress, hdr(12, "<I", 4))
    big = bytearray(good)
    struct.pack_into("<QQ", big, 16, 1 << 37, 0)
    struct.pack_into("<Q", big, 64, 1 << 37)
    assert_clear_error(FormatError, "2\\^37", _cuda.decompress,
                       d(np.frombuffer(bytes(big), np.uint8)))
    assert_clear_error(FormatError, "shape", _cuda.decompress, hdr(16, "<Q", 97))
    assert_clear_error(FormatError, "length", _cuda.decompress, hdr(48, "<Q", 1))
    assert_clear_error(FormatError, "truncated",
                       _cuda.decompress, d(np.frombuffer(good[:-4], np.uint8)))
    # the kind-0 count disagrees with nmask (one mask word fewer, length kept consistent)
    b = bytearray(good)
    L = _layout(good)
    struct.pack_into("<I", b, 12, 1)
    del b[L["msk"] + 4: L["msk"] + 8]
    assert_clear_error(FormatError, "nmask|mask", _cuda.decompress,
                       d(np.frombuffer(bytes(b), np.uint8)))


def test_mutated_streams_never_crash():
    """Random byte flips after the header: a FormatError or a decode, nothing else."""
    rng = np.random.default_rng(0)
    good = bytes(_stream())
    seen = 0
    for _ in range(6):
        b = bytearray(good)
        for p in rng.integers(80, len(b), 2):
            b[p] ^= 1 << int(rng.integers(0, 8))
        try:
            gpu_decode(bytes(b))
        except FormatError:
            seen += 1
    assert seen > 0
