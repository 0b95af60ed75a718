"""CPU backend of the ccoll compressor: numba kernels for stream format v1 (docs/format.md).

Work is split into chunks of ``CHUNK_BLOCKS`` blocks (a multiple of 32, so each chunk owns
whole bitmap words); ``prange`` runs over chunks. Compression is two kernel passes: the
first decides every block's code (and sums payload words and non-zero blocks per chunk),
a serial exclusive scan over the chunk sums gives each chunk's code index and payload
offset, and the second pass recomputes the quantization and writes bitmap, codes and
payload into an output allocated once at its exact size. No per-element integer array is
kept. Decompression validates the bitmap and the codes (two small passes) before a third
pass reads the payload.

The arithmetic is exactly the one of docs/format.md (float64 division, ``floor(v + 0.5)``,
one float64 multiplication, rounding to the dtype). The kernels are compiled without
fastmath so that no contraction or reassociation changes a bit; the CUDA backend makes
the same choices and produces byte-identical streams.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ccoll.compressor import format as fmt
from ccoll.errors import ErrorBoundError, FormatError, MismatchError

__all__ = ["compress_abs", "decompress", "add", "add_data", "header", "finite_range", "as_stream"]

BLOCK = fmt.BLOCK
CHUNK_BLOCKS = 256  # 8192 elements; a multiple of 32 so bitmap words are never shared
QLIM = 2147483647.0  # |v| < 2^31 - 1: quantizable (format.md, "Pre-quantization")
QMAX_ADD = 2147483647  # a homomorphic sum with |q| >= 2^31 - 1 is stored raw
CODE_RAW = fmt.CODE_RAW
CODE_RAW64 = fmt.CODE_RAW64
LOR = fmt.LORENZO_BIT
CANONICAL_NAN64 = 0x7FF8000000000000  # stored for a NaN sum (docs/format.md, "Homomorphic add")
# Below this many elements the kernels run on the calling thread: waking the pool costs
# more than the work, and far more on a loaded machine where a pool thread may wait
# for a core.
SERIAL_BELOW = 1 << 16


@contextmanager
def _threads_for(n: int) -> Iterator[None]:
    """Run the numba kernels inside on one thread when ``n`` elements are few."""
    if n >= SERIAL_BELOW:
        yield
        return
    prev = numba.get_num_threads()  # thread-local, so concurrent callers do not interfere
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(prev)



# ---------------------------------------------------------------------------- intrinsics


@intrinsic
def _bitlen(typingctx, x):  # type: ignore[no-untyped-def]
    """Bit length of a non-negative int64 (0 for 0): ``64 - clz``."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        lz = builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))
        return builder.sub(ir.Constant(ir.IntType(64), 64), lz)

    return sig, codegen


@intrinsic
def _popcount(typingctx, x):  # type: ignore[no-untyped-def]
    """Count the set bits of an int64."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def _f64_from_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """Reinterpret the 64 bits of an int64 as a float64."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.DoubleType())

    return sig, codegen


@intrinsic
def _bits_from_f64(typingctx, x):  # type: ignore[no-untyped-def]
    """Reinterpret a float64 as its 64-bit pattern (an int64)."""
    sig = types.int64(types.float64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(64))

    return sig, codegen


@intrinsic
def _f32_from_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """Reinterpret the low 32 bits of an int64 as a float32, widened to float64."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        lo = builder.trunc(args[0], ir.IntType(32))
        f = builder.bitcast(lo, ir.FloatType())
        return builder.fpext(f, ir.DoubleType())

    return sig, codegen


_I32 = ir.IntType(32)
_V32 = ir.VectorType(_I32, 32)
_M32 = ir.VectorType(ir.IntType(1), 32)


def _splat32(builder, val):  # type: ignore[no-untyped-def]
    v = builder.insert_element(ir.Constant(_V32, ir.Undefined), val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_V32, ir.Undefined), ir.Constant(_V32, [0] * 32))


@intrinsic
def _plane_of(typingctx, mag, j):  # type: ignore[no-untyped-def]
    """Gather bit ``j`` of the 32 uint32 lanes of ``mag`` into one word (bit l = lane l).

    One vector shift and a mask move on AVX-512 instead of a 32-step reduction; ``mag``
    must be a C-contiguous uint32 array of at least 32 elements.
    """
    sig = types.uint32(mag, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        vec = builder.load(builder.bitcast(arr.data, _V32.as_pointer()), align=4)
        shifted = builder.lshr(vec, _splat32(builder, builder.trunc(args[1], _I32)))
        return builder.bitcast(builder.trunc(shifted, _M32), _I32)

    return sig, codegen


@intrinsic
def _or_plane(typingctx, mag, p, j):  # type: ignore[no-untyped-def]
    """``mag[l] |= ((p >> l) & 1) << j`` for the 32 uint32 lanes of ``mag`` (a bit-plane)."""
    sig = types.void(mag, types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.bitcast(arr.data, _V32.as_pointer())
        vec = builder.load(ptr, align=4)
        mask = builder.bitcast(builder.trunc(args[1], _I32), _M32)
        bit = _splat32(builder, builder.shl(ir.Constant(_I32, 1), builder.trunc(args[2], _I32)))
        builder.store(builder.or_(vec, builder.select(mask, bit, ir.Constant(_V32, None))), ptr,
                      align=4)
        return context.get_dummy_value()

    return sig, codegen


def _round_like(d, arr):  # type: ignore[no-untyped-def]
    """``float64(T(d))`` where ``T`` is the dtype of ``arr`` (one rounding, nearest-even)."""
    raise NotImplementedError  # only called from numba code, see the overload below


@overload(_round_like)
def _round_like_impl(d, arr):  # type: ignore[no-untyped-def]
    if arr.dtype == types.float32:

        def impl(d, arr):  # type: ignore[no-untyped-def]
            return np.float64(np.float32(d))

    else:

        def impl(d, arr):  # type: ignore[no-untyped-def]
            return d

    return impl


# ---------------------------------------------------------------------- per-block helpers
#
# Hot loops index slices with the loop variable (``xb[l]``, not ``x[base + l]``): numba
# cannot prove ``base + l >= 0`` and would emit negative-index wraparound, which turns the
# vectorized loads into gathers. Lorenzo differences use a ``prev`` recurrence, which LLVM
# vectorizes with lane shuffles instead of re-reading a freshly stored array.


@njit(nogil=True, cache=True, inline="always")
def _block_words(code, is32):  # type: ignore[no-untyped-def]
    """Payload words of a valid code (0 for a zero block)."""
    if code == 0:
        return 0
    if code == CODE_RAW:
        return 32 if is32 else 64
    if code == CODE_RAW64:
        return 64
    return 1 + (code & 0x7F)


@njit(nogil=True, cache=True, inline="always")
def _code_valid(code, is32):  # type: ignore[no-untyped-def]
    """Tell whether a code byte is allowed in a non-zero block (format.md, "Block kinds")."""
    w = code & 0x7F
    if code & LOR:
        return 1 <= w <= 31
    if 1 <= code <= CODE_RAW:
        return True
    return code == CODE_RAW64 and is32


@njit(nogil=True, cache=True, inline="always")
def _code_of(orq, ord_):  # type: ignore[no-untyped-def]
    """Code from the OR of ``|q|`` and of ``|Lorenzo c|`` over a block (rules 3-4).

    The bit length of the maximum equals the bit length of the OR. Requires every
    ``|q| <= 2^31 - 1``; a Lorenzo candidate of 32 bits or more is never chosen because
    it is not narrower.
    """
    if orq == 0:
        return 0
    wq = _bitlen(orq)
    wd = _bitlen(ord_)
    if wd < wq:
        return LOR | wd
    return wq


@njit(nogil=True, cache=True, inline="always")
def _quantize(xb, eb, step, q):  # type: ignore[no-untyped-def]
    """Quantize one block; ``xb`` holds its valid elements (1..32), ``q`` receives 32 lanes.

    Returns (rejected lanes, OR of ``|q|``, OR of ``|q[l] - q[l-1]|`` over valid lanes). A
    lane is accepted when ``|v| < 2^31 - 1`` and ``|y - x| < eb`` in float64, with
    ``y = T(float64(q) * step)``. Padding lanes get ``q = 0``.
    """
    m = xb.size
    bad = np.int64(0)
    orq = np.int64(0)
    ord_ = np.int64(0)
    prev = np.int64(0)
    if m == BLOCK:
        # Branch-free body with a constant trip count so LLVM vectorizes it.
        for l in range(BLOCK):
            xd = np.float64(xb[l])
            v = xd / step
            inr = abs(v) < QLIM
            vv = v if inr else 0.0
            qi = np.int64(np.floor(vv + 0.5))
            yd = _round_like(np.float64(qi) * step, xb)
            ok = inr & (abs(yd - xd) < eb)
            bad += np.int64(not ok)
            orq |= abs(qi)
            ord_ |= abs(qi - prev)
            prev = qi
            q[l] = qi
    else:
        for l in range(m):
            xd = np.float64(xb[l])
            v = xd / step
            inr = abs(v) < QLIM
            vv = v if inr else 0.0
            qi = np.int64(np.floor(vv + 0.5))
            yd = _round_like(np.float64(qi) * step, xb)
            ok = inr & (abs(yd - xd) < eb)
            bad += np.int64(not ok)
            orq |= abs(qi)
            ord_ |= abs(qi - prev)
            prev = qi
            q[l] = qi
        for l in range(m, BLOCK):
            q[l] = 0
    return bad, orq, ord_


@njit(nogil=True, cache=True, inline="always")
def _planes(mag, w, Wb):  # type: ignore[no-untyped-def]
    """Bit-planes 0..w-1 of the 32 uint32 magnitudes ``mag`` into ``Wb[1 : 1 + w]``."""
    for j in range(w):
        Wb[1 + j] = _plane_of(mag, j)


@njit(nogil=True, cache=True, inline="always")
def _encode_x(xb, step, code, Wb, mag):  # type: ignore[no-untyped-def]
    """Quantize ``xb`` again and write the fixed-length block ``code`` into ``Wb``."""
    m = xb.size
    lor = np.int64(1) if code & LOR else np.int64(0)
    sign = np.int64(0)
    prev = np.int64(0)
    if m == BLOCK:
        for l in range(BLOCK):
            # Same arithmetic as _quantize; the block is known to be accepted.
            v = np.float64(xb[l]) / step
            qi = np.int64(np.floor(v + 0.5))
            c = qi - prev * lor
            prev = qi
            sign |= np.int64(c < 0) << l
            mag[l] = abs(c)
    else:
        for l in range(m):
            v = np.float64(xb[l]) / step
            qi = np.int64(np.floor(v + 0.5))
            c = qi - prev * lor
            prev = qi
            sign |= np.int64(c < 0) << l
            mag[l] = abs(c)
        for l in range(m, BLOCK):
            mag[l] = 0
    Wb[0] = sign
    _planes(mag, code & 0x7F, Wb)


@njit(nogil=True, cache=True, inline="always")
def _encode_q(q, m, code, Wb, mag):  # type: ignore[no-untyped-def]
    """Write quantized values ``q`` (valid lanes ``< m``) as the fixed-length block ``code``."""
    lor = np.int64(1) if code & LOR else np.int64(0)
    sign = np.int64(0)
    prev = np.int64(0)
    if m == BLOCK:
        for l in range(BLOCK):  # a constant trip count, so LLVM vectorizes it
            c = q[l] - prev * lor
            prev = q[l]
            sign |= np.int64(c < 0) << l
            mag[l] = abs(c)
    else:
        for l in range(m):
            c = q[l] - prev * lor
            prev = q[l]
            sign |= np.int64(c < 0) << l
            mag[l] = abs(c)
        for l in range(m, BLOCK):
            mag[l] = 0
    Wb[0] = sign
    _planes(mag, code & 0x7F, Wb)


@njit(nogil=True, cache=True, inline="always")
def _magnitudes(Wb, code, mag):  # type: ignore[no-untyped-def]
    """Assemble the 32 magnitudes (uint32, below 2^31) of a fixed-length block."""
    for l in range(BLOCK):
        mag[l] = 0
    for j in range(code & 0x7F):
        _or_plane(mag, np.int64(Wb[1 + j]), j)


@njit(nogil=True, cache=True, inline="always")
def _decode_q(Wb, code, mag, q):  # type: ignore[no-untyped-def]
    """Read a fixed-length block ``Wb`` into ``q[0:32]`` (int64, Lorenzo undone)."""
    _magnitudes(Wb, code, mag)
    sign = np.int64(Wb[0])
    for l in range(BLOCK):
        s = (sign >> l) & 1
        q[l] = (np.int64(mag[l]) ^ -s) + s  # negate where the sign bit is set
    if code & LOR:
        # Magnitudes are below 2^31, so 32 of them cannot overflow int64.
        acc = np.int64(0)
        for l in range(BLOCK):
            acc += q[l]
            q[l] = acc


@njit(nogil=True, cache=True, inline="always")
def _decode_to(Wb, code, mag, ob, step):  # type: ignore[no-untyped-def]
    """Decode a fixed-length block straight into ``ob`` (its valid lanes)."""
    _magnitudes(Wb, code, mag)
    sign = np.int64(Wb[0])
    m = ob.size
    if code & LOR:
        acc = np.int64(0)
        for l in range(m):
            s = (sign >> l) & 1
            acc += (np.int64(mag[l]) ^ -s) + s
            ob[l] = np.float64(acc) * step
    elif m == BLOCK:
        for l in range(BLOCK):
            s = (sign >> l) & 1
            ob[l] = np.float64((np.int64(mag[l]) ^ -s) + s) * step
    else:
        for l in range(m):
            s = (sign >> l) & 1
            ob[l] = np.float64((np.int64(mag[l]) ^ -s) + s) * step


@njit(nogil=True, cache=True, inline="always")
def _write_raw(bb, is32, Wb):  # type: ignore[no-untyped-def]
    """Store a raw block (code 32) of the valid lanes' bit patterns ``bb`` into ``Wb``."""
    m = bb.size
    if is32:
        for l in range(m):
            Wb[l] = bb[l]
        for l in range(m, BLOCK):
            Wb[l] = 0
    else:
        for l in range(m):
            v = np.int64(bb[l])
            Wb[2 * l] = v & 0xFFFFFFFF
            Wb[2 * l + 1] = (v >> 32) & 0xFFFFFFFF
        for l in range(2 * m, 2 * BLOCK):
            Wb[l] = 0


@njit(nogil=True, cache=True, inline="always")
def _raw_value(Wb, code, l, is32):  # type: ignore[no-untyped-def]
    """float64 value of lane ``l`` of a raw block (code 32 or 33)."""
    if code == CODE_RAW and is32:
        return _f32_from_bits(np.int64(Wb[l]))
    lo = np.int64(Wb[2 * l])
    hi = np.int64(Wb[2 * l + 1])
    return _f64_from_bits(lo | (hi << 32))


# -------------------------------------------------------------------------- compression


@njit(parallel=True, nogil=True, cache=True)
def _range_kernel(x, chunk_lo, chunk_hi):  # type: ignore[no-untyped-def]
    """Per-chunk min/max of the finite values (+inf/-inf for a chunk without any).

    32 running minima and maxima per chunk, updated lane by lane, so the loop vectorizes
    without fastmath (a float min reduction would not).
    """
    n = x.size
    nchunks = chunk_lo.size
    per = ((n + nchunks - 1) // nchunks + BLOCK - 1) // BLOCK * BLOCK
    big = np.finfo(x.dtype).max
    for c in prange(nchunks):
        lo = np.empty(BLOCK, x.dtype)
        hi = np.empty(BLOCK, x.dtype)
        for l in range(BLOCK):
            lo[l] = np.inf
            hi[l] = -np.inf
        i0 = min(c * per, n)
        i1 = min(i0 + per, n)
        nfull = (i1 - i0) // BLOCK
        for k in range(nfull):
            xb = x[i0 + k * BLOCK : i0 + k * BLOCK + BLOCK]
            for l in range(BLOCK):
                v = xb[l]
                fin = abs(v) <= big  # false for NaN and +-inf
                lo[l] = v if fin & (v < lo[l]) else lo[l]
                hi[l] = v if fin & (v > hi[l]) else hi[l]
        for i in range(i0 + nfull * BLOCK, i1):
            v = x[i]
            if abs(v) <= big:
                lo[0] = min(lo[0], v)
                hi[0] = max(hi[0], v)
        chunk_lo[c] = lo.min()
        chunk_hi[c] = hi.max()


def finite_range(x: np.ndarray) -> tuple[float, float]:
    """Min and max of the finite values of a contiguous float array (``(inf, -inf)`` if none).

    One parallel pass; equal to :func:`ccoll.errorbound.finite_range`.
    """
    flat = _readonly(x.reshape(-1))
    if flat.size == 0:
        return math.inf, -math.inf
    nchunks = max(1, min(256, flat.size // 65536))
    lo = np.empty(nchunks, np.float64)
    hi = np.empty(nchunks, np.float64)
    with _threads_for(flat.size):
        _range_kernel(flat, lo, hi)
    vlo, vhi = float(lo.min()), float(hi.max())
    if vlo > vhi:
        return math.inf, -math.inf
    return vlo, vhi


@njit(parallel=True, nogil=True, cache=True)
def _plan_lossy(x, eb, step, small, codes, chunk_nnz, chunk_words):  # type: ignore[no-untyped-def]
    """Pass 1 of a lossy compression: every block's code, per-chunk sums.

    ``small`` (of x's dtype) is at most ``eb / 2``: a full block whose elements all have
    ``|x| <= small`` is a zero block without quantizing it (``|x / step| <= 1/4`` gives
    ``q = 0``, and ``|0 - x| < eb`` accepts it), the same decision as the full path.
    """
    n = x.size
    nblocks = codes.size
    is32 = x.itemsize == 4
    for c in prange(chunk_nnz.size):
        q = np.empty(BLOCK, np.int64)
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        nz = 0
        words = 0
        for b in range(b0, b1):
            base = b * BLOCK
            xb = x[base : min(base + BLOCK, n)]
            if xb.size == BLOCK:
                tiny = True
                for l in range(BLOCK):
                    tiny &= abs(xb[l]) <= small
                if tiny:
                    codes[b] = 0
                    continue
            bad, orq, ord_ = _quantize(xb, eb, step, q)
            code = CODE_RAW if bad else _code_of(orq, ord_)
            codes[b] = code
            if code != 0:
                nz += 1
                words += _block_words(code, is32)
        chunk_nnz[c] = nz
        chunk_words[c] = words


@njit(parallel=True, nogil=True, cache=True)
def _plan_lossless(bits, mask, is32, codes, chunk_nnz, chunk_words):  # type: ignore[no-untyped-def]
    """Pass 1 of an ``eb = 0`` compression: zero block iff every element is +-0.0."""
    n = bits.size
    nblocks = codes.size
    for c in prange(chunk_nnz.size):
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        nz = 0
        words = 0
        for b in range(b0, b1):
            base = b * BLOCK
            bb = bits[base : min(base + BLOCK, n)]
            acc = np.uint64(0)
            for l in range(bb.size):
                acc |= np.uint64(bb[l]) & mask
            code = 0 if acc == 0 else CODE_RAW
            codes[b] = code
            if code != 0:
                nz += 1
                words += _block_words(code, is32)
        chunk_nnz[c] = nz
        chunk_words[c] = words


@njit(parallel=True, nogil=True, cache=True)
def _write_stream(x, bits, step, codes, chunk_k, chunk_pos, bitmap, cbytes, W):  # type: ignore[no-untyped-def]
    """Pass 2 of compression: bitmap, code bytes and payload of every chunk."""
    n = x.size
    nblocks = codes.size
    is32 = x.itemsize == 4
    for c in prange(chunk_k.size):
        mag = np.empty(BLOCK, np.uint32)
        k = chunk_k[c]
        pos = chunk_pos[c]
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        word = np.int64(0)
        for b in range(b0, b1):
            code = np.int64(codes[b])
            if code != 0:
                word |= np.int64(1) << (b & 31)
                cbytes[k] = code
                k += 1
                base = b * BLOCK
                e = min(base + BLOCK, n)
                size = _block_words(code, is32)
                Wb = W[pos : pos + size]
                if code == CODE_RAW:
                    _write_raw(bits[base:e], is32, Wb)
                else:
                    _encode_x(x[base:e], step, code, Wb, mag)
                pos += size
            if (b & 31) == 31 or b == b1 - 1:
                bitmap[b >> 5] = word
                word = 0


def _small(eb: float, dtype: np.dtype) -> np.floating:
    """Largest value of ``dtype`` that is at most ``eb / 2`` (see ``_plan_lossy``).

    -1 (no element qualifies) when ``step = 2 * eb`` overflows: then every reconstruction
    is NaN and every block raw, which the shortcut must not contradict.
    """
    if not math.isfinite(2.0 * eb):
        return dtype.type(-1.0)
    # Exact unless eb is subnormal; then it may round up by half a subnormal, which still
    # leaves |x / step| <= 1/3 and |x| < eb for every |x| <= half.
    half = eb * 0.5
    big = float(np.finfo(dtype).max)
    if half >= big:
        return dtype.type(big)
    t = dtype.type(half)
    if float(t) > half:
        t = np.nextafter(t, dtype.type(0))
    return dtype.type(t)


def _scan(counts: np.ndarray) -> tuple[np.ndarray, int]:
    """Exclusive prefix sum (int64) and total."""
    out = np.zeros(counts.size, np.int64)
    if counts.size > 1:
        np.cumsum(counts[:-1], out=out[1:])
    total = int(out[-1] + counts[-1]) if counts.size else 0
    return out, total


def _readonly(a: np.ndarray) -> np.ndarray:
    """Return a read-only view, so kernels always see the same array type.

    numba compiles a separate specialization for read-only arrays (bytes, mapped files);
    passing every input read-only halves the compiled (and cached) kernels.
    """
    v = a.view()
    v.flags.writeable = False
    return v


def _nchunks(nblocks: int) -> int:
    return (nblocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS


def compress_abs(x: np.ndarray, eb: float) -> np.ndarray:
    """Compress a contiguous native float32/float64 host array with an absolute bound ``eb``.

    ``eb`` must be finite and ``>= 0`` (checked by the caller); ``eb = 0`` is lossless.
    """
    flat = _readonly(x.reshape(-1))
    n = flat.size
    is32 = flat.dtype == np.float32
    nblocks = (n + BLOCK - 1) // BLOCK
    nch = _nchunks(nblocks)
    codes = np.empty(nblocks, np.uint8)
    chunk_nnz = np.empty(nch, np.int64)
    chunk_words = np.empty(nch, np.int64)
    bits = flat.view(np.uint32) if is32 else flat.view(np.uint64)
    step = 2.0 * eb
    if nblocks:
        with _threads_for(n):
            if eb == 0.0:
                mask = np.uint64(0x7FFFFFFF if is32 else 0x7FFFFFFFFFFFFFFF)
                _plan_lossless(bits, mask, is32, codes, chunk_nnz, chunk_words)
            else:
                _plan_lossy(flat, eb, step, _small(eb, flat.dtype), codes, chunk_nnz, chunk_words)
    chunk_k, nnz = _scan(chunk_nnz)
    chunk_pos, pwords = _scan(chunk_words)
    hdr = fmt.StreamHeader(
        dtype=flat.dtype, shape=tuple(x.shape), eb=eb, bound=eb, nnz=nnz, payload_words=pwords
    )
    out = np.empty(hdr.nbytes, np.uint8)
    head = hdr.pack()
    out[: head.size] = head
    out[hdr.codes_offset + nnz : hdr.payload_offset] = 0
    if nblocks:
        bitmap = out[hdr.bitmap_offset : hdr.codes_offset].view(np.uint32)
        cbytes = out[hdr.codes_offset : hdr.codes_offset + nnz]
        W = out[hdr.payload_offset :].view(np.uint32)
        with _threads_for(n):
            _write_stream(flat, bits, step, codes, chunk_k, chunk_pos, bitmap, cbytes, W)
    return out


# ------------------------------------------------------------------------ decompression


class _Layout:
    """A validated stream: header, section views and per-chunk code index / payload offset."""

    __slots__ = ("hdr", "bitmap", "codes", "W", "chunk_k", "chunk_pos")

    def __init__(self, hdr: fmt.StreamHeader, bitmap: np.ndarray, codes: np.ndarray,
                 W: np.ndarray, chunk_k: np.ndarray, chunk_pos: np.ndarray) -> None:
        self.hdr = hdr
        self.bitmap = bitmap
        self.codes = codes
        self.W = W
        self.chunk_k = chunk_k
        self.chunk_pos = chunk_pos


@njit(parallel=True, nogil=True, cache=True)
def _count_bitmap(bitmap, chunk_nnz):  # type: ignore[no-untyped-def]
    """Set bits of the bitmap words of each chunk."""
    per = CHUNK_BLOCKS // 32
    nw = bitmap.size
    for c in prange(chunk_nnz.size):
        s = 0
        for i in range(c * per, min(c * per + per, nw)):
            s += _popcount(np.int64(bitmap[i]))
        chunk_nnz[c] = s


@njit(parallel=True, nogil=True, cache=True)
def _size_codes(codes, chunk_k, chunk_nnz, is32, chunk_words):  # type: ignore[no-untyped-def]
    """Payload words of each chunk; -1 for a chunk holding an invalid code byte."""
    for c in prange(chunk_k.size):
        k0 = chunk_k[c]
        words = 0
        for i in range(k0, k0 + chunk_nnz[c]):
            code = np.int64(codes[i])
            if not _code_valid(code, is32):
                words = -1
                break
            words += _block_words(code, is32)
        chunk_words[c] = words


def as_stream(buf: object) -> np.ndarray:
    """View a host stream as a 1-D uint8 numpy array (no copy where possible)."""
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8:
            raise FormatError(f"a ccoll stream is a uint8 array, got dtype {buf.dtype}")
        return buf.reshape(-1)
    if isinstance(buf, (bytes, bytearray, memoryview)):
        mv = memoryview(buf)
        if not mv.contiguous:
            raise FormatError("a ccoll stream must be a contiguous buffer")
        return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, np.uint8)
    raise FormatError(f"a ccoll stream is a uint8 array or bytes, got {type(buf).__name__}")


def header(buf: object) -> fmt.StreamHeader:
    """Parse and validate the header of a host stream."""
    return fmt.parse_header(as_stream(buf))


def _validate(buf: np.ndarray) -> _Layout:
    """Header, bitmap and codes checked (docs/format.md, "Robustness"); payload untouched."""
    hdr = fmt.parse_header(buf)
    is32 = hdr.dtype == np.float32
    nblocks = hdr.nblocks
    raw = _readonly(buf if buf.ctypes.data % 4 == 0 else buf.copy())  # words need alignment
    bitmap = raw[hdr.bitmap_offset : hdr.codes_offset].view(np.uint32)
    codes = raw[hdr.codes_offset : hdr.codes_offset + hdr.nnz]
    pad = raw[hdr.codes_offset + hdr.nnz : hdr.payload_offset]
    W = raw[hdr.payload_offset :].view(np.uint32)
    if pad.any():
        raise FormatError("stream code padding bytes are not zero")
    tail = nblocks % 32
    if tail and int(bitmap[-1]) >> tail:
        raise FormatError(f"stream bitmap has bits set beyond its {nblocks} blocks")
    nch = _nchunks(nblocks)
    chunk_nnz = np.zeros(nch, np.int64)
    if nch:
        with _threads_for(hdr.n):
            _count_bitmap(bitmap, chunk_nnz)
    chunk_k, total = _scan(chunk_nnz)
    if total != hdr.nnz:
        raise FormatError(
            f"stream bitmap has {total} non-zero blocks, its header says {hdr.nnz}"
        )
    chunk_words = np.zeros(nch, np.int64)
    if nch:
        with _threads_for(hdr.n):
            _size_codes(codes, chunk_k, chunk_nnz, is32, chunk_words)
    if (chunk_words < 0).any():
        raise FormatError("stream holds an invalid block code byte")
    chunk_pos, words = _scan(chunk_words)
    if words != hdr.payload_words:
        raise FormatError(
            f"stream block sizes add up to {words} payload words, its header says "
            f"{hdr.payload_words}"
        )
    return _Layout(hdr, bitmap, codes, W, chunk_k, chunk_pos)


@njit(parallel=True, nogil=True, cache=True)
def _decode(W, bitmap, codes, chunk_k, chunk_pos, step, n, out, outbits):  # type: ignore[no-untyped-def]
    """Decode every block of a validated stream into ``out`` (``outbits``: its bit view)."""
    nblocks = (n + BLOCK - 1) // BLOCK
    is32 = out.itemsize == 4
    for c in prange(chunk_k.size):
        mag = np.empty(BLOCK, np.uint32)
        k = chunk_k[c]
        pos = chunk_pos[c]
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        for b in range(b0, b1):
            base = b * BLOCK
            e = min(base + BLOCK, n)
            ob = out[base:e]
            m = ob.size
            if (np.int64(bitmap[b >> 5]) >> (b & 31)) & 1 == 0:
                for l in range(m):
                    ob[l] = 0.0
                continue
            code = np.int64(codes[k])
            k += 1
            size = _block_words(code, is32)
            Wb = W[pos : pos + size]
            pos += size
            if code == CODE_RAW:
                obits = outbits[base:e]
                if is32:
                    for l in range(m):
                        obits[l] = Wb[l]
                else:
                    for l in range(m):
                        obits[l] = np.int64(Wb[2 * l]) | (np.int64(Wb[2 * l + 1]) << 32)
            elif code == CODE_RAW64:
                for l in range(m):
                    ob[l] = _raw_value(Wb, code, l, is32)
            else:
                _decode_to(Wb, code, mag, ob, step)


def _check_out(out: object, hdr: fmt.StreamHeader) -> np.ndarray:
    """Check a caller's output buffer; return it as a flat writable view."""
    if not isinstance(out, np.ndarray):
        raise MismatchError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype != hdr.dtype:
        raise MismatchError(f"out has dtype {out.dtype}, the stream holds {hdr.dtype}")
    if out.shape != hdr.shape and out.size != hdr.n:
        raise MismatchError(
            f"out has shape {out.shape} ({out.size} elements), the stream holds shape "
            f"{hdr.shape} ({hdr.n} elements)"
        )
    if not out.flags.writeable:
        raise MismatchError("out is read-only")
    if not out.flags.c_contiguous:
        raise MismatchError("out must be C-contiguous")
    return out.reshape(-1)


def decompress(buf: object, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a host stream; ``out`` (matching dtype and shape or size) receives the values."""
    lay = _validate(as_stream(buf))
    hdr = lay.hdr
    if out is None:
        result = np.empty(hdr.shape, hdr.dtype)
        flat = result.reshape(-1)
    else:
        flat = _check_out(out, hdr)
        result = out
    if hdr.n:
        outbits = flat.view(np.uint32) if hdr.dtype == np.float32 else flat.view(np.int64)
        with _threads_for(hdr.n):
            _decode(lay.W, lay.bitmap, lay.codes, lay.chunk_k, lay.chunk_pos, 2.0 * hdr.eb,
                    hdr.n, flat, outbits)
    return result


# ------------------------------------------------------------------------ homomorphic add


# Fixed-length blocks with no prediction and widths up to this add bit-sliced: their sum
# has at most 31 bits (|q_a + q_b| <= 2^30 - 2 < 2^31 - 1), so it never overflows to raw.
BITSLICE_MAX_W = 29
_ALL = 0xFFFFFFFF


@njit(nogil=True, cache=True, inline="always")
def _valid_mask(m):  # type: ignore[no-untyped-def]
    """Word with bits ``0..m-1`` set: the valid lanes of a block of ``m`` elements."""
    return (np.int64(1) << m) - 1 if m < BLOCK else np.int64(_ALL)


@njit(nogil=True, cache=True, inline="always")
def _bitsliced_sum(Wa, wa, Wb, wb, vm, T, M, D):  # type: ignore[no-untyped-def]
    """Code of the sum of two no-prediction blocks, computed on their bit-planes.

    Word ``j`` of a plane array holds bit ``j`` of all 32 lanes, so one 32-bit operation
    acts on 32 lanes (the lanes' carries stay in their own bit). ``q_a + q_b`` is formed in
    two's complement: sign-magnitude ``q = (|q| ^ s) + s`` (``s`` all-ones where negative),
    so the sum is ``(|q_a| ^ s_a) + (|q_b| ^ s_b) + s_a + s_b``, one ripple-carry pass with
    carry-in ``s_a`` and an increment chain for ``s_b``. The same planes give the sum's
    sign and magnitude (``M``), the Lorenzo residual ``d[l] = t[l] - t[l-1]`` (a lane shift
    and a subtraction) and its magnitude (``D``), hence both candidate widths of rules 3-4.
    Padding lanes (outside ``vm``) are 0. Returns ``(code, sign word)``; the payload
    planes are ``M`` (no prediction) or ``D`` (Lorenzo). Needs ``max(wa, wb) <= 29``.
    """
    sa = np.int64(Wa[0]) & vm
    sb = np.int64(Wb[0]) & vm
    top = max(wa, wb) + 1  # the sum fits planes 0..top in two's complement
    c1 = sa
    c2 = sb
    for j in range(top + 1):
        x = (np.int64(Wa[1 + j]) & vm if j < wa else np.int64(0)) ^ sa
        y = (np.int64(Wb[1 + j]) & vm if j < wb else np.int64(0)) ^ sb
        h = x ^ y
        s = h ^ c1
        c1 = (x & y) | (c1 & h)
        T[j] = s ^ c2
        c2 = s & c2
    neg = T[top]
    # |t| = (t ^ neg) + neg on planes 0..top-1 (|t| < 2^top).
    c = neg
    wq = 0
    nz = np.int64(0)
    for j in range(top):
        v = T[j] ^ neg
        mj = v ^ c
        c = v & c
        M[j] = mj
        nz |= mj
        if mj != 0:
            wq = j + 1
    if wq <= 1:
        # |t| <= 1 everywhere: a Lorenzo residual of width 0 would need every t equal to
        # t[0] - 0, i.e. all zero, so no prediction wins (or the block is zero).
        return np.int64(wq), neg
    # Lorenzo cannot be narrower if some lane with |t| >= 2^(wq-1) follows a zero lane (or
    # is lane 0) or a lane of the other sign: there |d| = |t[l]| + |t[l-1]| >= 2^(wq-1).
    # Most noisy blocks have such a lane, and this test costs a few word operations.
    if M[wq - 1] & (((nz << 1) ^ _ALL) | (neg ^ (neg << 1))) & vm:
        return np.int64(wq), neg
    # d = t - (t shifted up one lane), two's complement on planes 0..top+1.
    c = np.int64(_ALL)
    for j in range(top + 2):
        tj = T[min(j, top)]
        nu = ((tj << 1) & _ALL) ^ _ALL
        h = tj ^ nu
        D[j] = h ^ c
        c = (tj & nu) | (c & h)
    dneg = D[top + 1]
    c = dneg
    wd = 0
    for j in range(top + 1):
        v = D[j] ^ dneg
        dj = v ^ c
        c = v & c
        dj &= vm
        D[j] = dj
        if dj != 0:
            wd = j + 1
    if wd < wq:
        return np.int64(LOR | wd), dneg & vm
    return np.int64(wq), neg


@njit(nogil=True, cache=True, inline="always")
def _sum_into(qa, qb, m):  # type: ignore[no-untyped-def]
    """``qa[l] += qb[l]`` on the ``m`` valid lanes (padding lanes set to 0).

    Returns (any ``|sum| >= 2^31 - 1``, OR of ``|sum|``, OR of ``|sum[l] - sum[l-1]|``),
    the inputs of rules 3-4 and of the overflow test of docs/format.md.
    """
    big = np.int64(0)
    orq = np.int64(0)
    ord_ = np.int64(0)
    prev = np.int64(0)
    if m == BLOCK:
        for l in range(BLOCK):  # constant trip count: vectorized
            t = qa[l] + qb[l]
            big |= np.int64(abs(t) >= QMAX_ADD)
            orq |= abs(t)
            ord_ |= abs(t - prev)
            prev = t
            qa[l] = t
    else:
        for l in range(m):
            t = qa[l] + qb[l]
            big |= np.int64(abs(t) >= QMAX_ADD)
            orq |= abs(t)
            ord_ |= abs(t - prev)
            prev = t
            qa[l] = t
        for l in range(m, BLOCK):
            qa[l] = 0
    return big, orq, ord_


@njit(nogil=True, cache=True, inline="always")
def _add_block(Wa, ca, Wb, cb, m, is32, qa, qb, mag, magb):  # type: ignore[no-untyped-def]
    """Code of the sum of two non-zero blocks; for a fixed sum ``qa`` = q_a + q_b."""
    rawsum = CODE_RAW64 if is32 else CODE_RAW
    if ca == CODE_RAW or ca == CODE_RAW64 or cb == CODE_RAW or cb == CODE_RAW64:
        return rawsum
    if (ca | cb) & LOR:
        _decode_q(Wa, ca, mag, qa)
        _decode_q(Wb, cb, mag, qb)
        big, orq, ord_ = _sum_into(qa, qb, m)
        return rawsum if big else _code_of(orq, ord_)
    # No prefix sums: one vectorizable pass over both blocks' magnitudes and signs.
    big = np.int64(0)
    orq = np.int64(0)
    ord_ = np.int64(0)
    prev = np.int64(0)
    _magnitudes(Wa, ca, mag)
    _magnitudes(Wb, cb, magb)
    sa = np.int64(Wa[0])
    sb = np.int64(Wb[0])
    for l in range(m):
        ta = (sa >> l) & 1
        tb = (sb >> l) & 1
        t = ((np.int64(mag[l]) ^ -ta) + ta) + ((np.int64(magb[l]) ^ -tb) + tb)
        big |= np.int64(abs(t) >= QMAX_ADD)
        orq |= abs(t)
        ord_ |= abs(t - prev)
        prev = t
        qa[l] = t
    for l in range(m, BLOCK):
        qa[l] = 0
    if big:
        return rawsum
    return _code_of(orq, ord_)


@njit(nogil=True, cache=True, inline="always")
def _store_sum(Wo, l, s):  # type: ignore[no-untyped-def]
    """Store the float64 sum ``s`` as lane ``l`` of a code-32/33 block (one fixed NaN)."""
    bits = _bits_from_f64(s) if s == s else np.int64(CANONICAL_NAN64)
    Wo[2 * l] = bits & 0xFFFFFFFF
    Wo[2 * l + 1] = (bits >> 32) & 0xFFFFFFFF


@njit(nogil=True, cache=True, inline="always")
def _raw_sum(Wa, ca, Wb, cb, m, is32, step, qa, qb, mag, Wo):  # type: ignore[no-untyped-def]
    """Store ``float64(a) + float64(b)`` per lane as 64 words (code 32 or 33)."""
    fa = ca != CODE_RAW and ca != CODE_RAW64
    fb = cb != CODE_RAW and cb != CODE_RAW64
    if fa:
        _decode_q(Wa, ca, mag, qa)
    if fb:
        _decode_q(Wb, cb, mag, qb)
    for l in range(m):
        va = np.float64(qa[l]) * step if fa else _raw_value(Wa, ca, l, is32)
        vb = np.float64(qb[l]) * step if fb else _raw_value(Wb, cb, l, is32)
        _store_sum(Wo, l, va + vb)
    for l in range(2 * m, 2 * BLOCK):
        Wo[l] = 0


@njit(nogil=True, cache=True, inline="always")
def _sum_block(Wa, ca, Wb, cb, m, is32, So, qa, qb, mag, magb, T, M, D):  # type: ignore[no-untyped-def]
    """Code of the sum of two non-zero blocks; a fixed-length sum's payload goes to ``So``.

    ``So`` has room for ``len(Wa) + len(Wb)`` words, which holds any fixed-length sum of
    two fixed-length blocks (its Lorenzo width is at most ``max(w_a, w_b + 1) + 1`` and
    the chosen width is at most that). Raw sums are left to the write pass.
    """
    if ca == CODE_RAW or ca == CODE_RAW64 or cb == CODE_RAW or cb == CODE_RAW64:
        return CODE_RAW64 if is32 else CODE_RAW
    if ((ca | cb) & LOR) == 0 and max(ca, cb) <= BITSLICE_MAX_W:
        code, sign = _bitsliced_sum(Wa, ca, Wb, cb, _valid_mask(m), T, M, D)
        if code != 0:
            So[0] = sign
            src = D if code & LOR else M
            for j in range(code & 0x7F):
                So[1 + j] = src[j]
        return code
    code = _add_block(Wa, ca, Wb, cb, m, is32, qa, qb, mag, magb)
    if code != 0 and code != CODE_RAW and code != CODE_RAW64:
        _encode_q(qa, m, code, So, mag)
    return code


@njit(parallel=True, nogil=True, cache=True)
def _add_chunks(Wa, bma, ca, cka, cpa, Wb, bmb, cb, ckb, cpb, n, is32, step,
                ccodes, bitmap, chunk_nnz, chunk_words, S):  # type: ignore[no-untyped-def]
    """Pass 1 of an add: every chunk's sum, packed at the start of its own scratch region.

    Chunk ``c`` writes its code bytes to ``ccodes[b0:]`` (``b0`` its first block), its
    bitmap words in place, and its payload to ``S`` from ``2 * (cpa[c] + cpb[c])``: no
    output block is longer than twice its two inputs together (a fixed-length sum fits
    in ``w_a + w_b + 2`` words, a raw sum's 64 words in twice a raw input and a non-zero
    other), so the regions never overlap. A serial scan then places the chunks.
    """
    nblocks = ccodes.size
    for c in prange(chunk_nnz.size):
        qa = np.empty(BLOCK, np.int64)
        qb = np.empty(BLOCK, np.int64)
        mag = np.empty(BLOCK, np.uint32)
        magb = np.empty(BLOCK, np.uint32)
        T = np.empty(BLOCK + 2, np.int64)
        M = np.empty(BLOCK + 2, np.int64)
        D = np.empty(BLOCK + 2, np.int64)
        ka = cka[c]
        pa = cpa[c]
        kb = ckb[c]
        pb = cpb[c]
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        sp0 = 2 * (pa + pb)
        sp = sp0
        nz = 0
        word = np.int64(0)
        for b in range(b0, b1):
            za = (np.int64(bma[b >> 5]) >> (b & 31)) & 1
            zb = (np.int64(bmb[b >> 5]) >> (b & 31)) & 1
            codea = np.int64(ca[ka]) if za else np.int64(0)
            codeb = np.int64(cb[kb]) if zb else np.int64(0)
            sa = _block_words(codea, is32)
            sb = _block_words(codeb, is32)
            if za and zb:
                m = min(BLOCK, n - b * BLOCK)
                code = _sum_block(Wa[pa : pa + sa], codea, Wb[pb : pb + sb], codeb, m, is32,
                                  S[sp : sp + sa + sb], qa, qb, mag, magb, T, M, D)
                if code == CODE_RAW or code == CODE_RAW64:
                    _raw_sum(Wa[pa : pa + sa], codea, Wb[pb : pb + sb], codeb, m, is32, step,
                             qa, qb, mag, S[sp : sp + 64])
            elif za:
                # One side is a zero block: the other block's payload, unchanged.
                code = codea
                S[sp : sp + sa] = Wa[pa : pa + sa]
            else:
                code = codeb
                S[sp : sp + sb] = Wb[pb : pb + sb]
            if code != 0:
                word |= np.int64(1) << (b & 31)
                ccodes[b0 + nz] = code
                nz += 1
                sp += _block_words(code, is32)
            ka += za
            pa += sa
            kb += zb
            pb += sb
            if (b & 31) == 31 or b == b1 - 1:
                bitmap[b >> 5] = word
                word = 0
        chunk_nnz[c] = nz
        chunk_words[c] = sp - sp0


@njit(parallel=True, nogil=True, cache=True)
def _place_chunks(ccodes, S, chunk_src, chunk_nnz, chunk_words, chunk_k, chunk_pos,
                  cbytes, W):  # type: ignore[no-untyped-def]
    """Pass 2 of an add: copy each chunk's code bytes and payload to their final place."""
    for c in prange(chunk_nnz.size):
        b0 = c * CHUNK_BLOCKS
        k = chunk_k[c]
        cbytes[k : k + chunk_nnz[c]] = ccodes[b0 : b0 + chunk_nnz[c]]
        sp0 = chunk_src[c]
        pos = chunk_pos[c]
        W[pos : pos + chunk_words[c]] = S[sp0 : sp0 + chunk_words[c]]


@njit(nogil=True, cache=True, inline="always")
def _raw_sum_data(Wa, ca, xb, cb, qb, m, is32, step, qa, mag, Wo):  # type: ignore[no-untyped-def]
    """Like :func:`_raw_sum` with the second block given as data ``xb`` quantized to ``qb``."""
    fa = ca != CODE_RAW and ca != CODE_RAW64
    if fa:
        _decode_q(Wa, ca, mag, qa)
    for l in range(m):
        va = np.float64(qa[l]) * step if fa else _raw_value(Wa, ca, l, is32)
        vb = np.float64(xb[l]) if cb == CODE_RAW else np.float64(qb[l]) * step
        _store_sum(Wo, l, va + vb)
    for l in range(2 * m, 2 * BLOCK):
        Wo[l] = 0


@njit(parallel=True, nogil=True, cache=True)
def _add_data_chunks(Wa, bma, ca, cka, cpa, x, bits, eb, step, small, mask, ccodes, bitmap,
                     chunk_nnz, chunk_words, S, chunk_src):  # type: ignore[no-untyped-def]
    """One pass of :func:`add_data`: each chunk's sum packed at ``S[chunk_src[c]:]``.

    Each block of ``x`` gets the code :func:`compress_abs` would give it (same rules, same
    arithmetic), then the block is added to the stream's block by the rules of
    :func:`add` with that block as the second operand, so the bytes are those of
    ``add(a, compress_abs(x, eb))``. No output block is longer than its stream block plus
    64 words, which sizes each chunk's region.
    """
    n = x.size
    nblocks = ccodes.size
    is32 = x.itemsize == 4
    rawsum = CODE_RAW64 if is32 else CODE_RAW
    for c in prange(chunk_nnz.size):
        qa = np.empty(BLOCK, np.int64)
        qb = np.empty(BLOCK, np.int64)
        mag = np.empty(BLOCK, np.uint32)
        ka = cka[c]
        pa = cpa[c]
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        sp0 = chunk_src[c]
        sp = sp0
        nz = 0
        word = np.int64(0)
        for b in range(b0, b1):
            za = (np.int64(bma[b >> 5]) >> (b & 31)) & 1
            codea = np.int64(ca[ka]) if za else np.int64(0)
            sa = _block_words(codea, is32)
            base = b * BLOCK
            e = min(base + BLOCK, n)
            m = e - base
            xb = x[base:e]
            # The data block's code, exactly as compress_abs decides it.
            if eb == 0.0:
                bb = bits[base:e]
                acc = np.uint64(0)
                for l in range(m):
                    acc |= np.uint64(bb[l]) & mask
                codeb = np.int64(0) if acc == 0 else np.int64(CODE_RAW)
            else:
                tiny = m == BLOCK
                if tiny:
                    for l in range(BLOCK):
                        tiny &= abs(xb[l]) <= small
                if tiny:
                    codeb = np.int64(0)
                else:
                    bad, orq, ord_ = _quantize(xb, eb, step, qb)
                    codeb = np.int64(CODE_RAW) if bad else np.int64(_code_of(orq, ord_))
            Wo = S[sp : sp + sa + 2 * BLOCK]
            if codeb == 0:
                code = codea
                for i in range(sa):
                    Wo[i] = Wa[pa + i]
            elif codea == 0:
                code = codeb
                if codeb == CODE_RAW:
                    _write_raw(bits[base:e], is32, Wo)
                else:
                    _encode_q(qb, m, codeb, Wo, mag)
            elif codea == CODE_RAW or codea == CODE_RAW64 or codeb == CODE_RAW:
                code = rawsum
                _raw_sum_data(Wa[pa : pa + sa], codea, xb, codeb, qb, m, is32, step, qa, mag,
                              Wo)
            else:
                _decode_q(Wa[pa : pa + sa], codea, mag, qa)
                big, orq, ord_ = _sum_into(qa, qb, m)
                if big:
                    code = rawsum
                    # qa now holds the sum; decode the stream block again for the raw sum.
                    _raw_sum_data(Wa[pa : pa + sa], codea, xb, codeb, qb, m, is32, step, qa,
                                  mag, Wo)
                else:
                    code = np.int64(_code_of(orq, ord_))
                    if code != 0:
                        _encode_q(qa, m, code, Wo, mag)
            if code != 0:
                word |= np.int64(1) << (b & 31)
                ccodes[b0 + nz] = code
                nz += 1
                sp += _block_words(code, is32)
            ka += za
            pa += sa
            if (b & 31) == 31 or b == b1 - 1:
                bitmap[b >> 5] = word
                word = 0
        chunk_nnz[c] = nz
        chunk_words[c] = sp - sp0


def sum_bound(a: float, b: float) -> float:
    """Add two bounds, rounding up to the next float64 when the float64 sum is inexact."""
    s = a + b
    # Exact when the sum minus each term gives back the other (TwoSum error is zero).
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    if err > 0.0:
        s = math.nextafter(s, math.inf)
    return s


def add(a: object, b: object, out: np.ndarray | None = None) -> np.ndarray:
    """Homomorphic sum of two host streams (docs/format.md, "Homomorphic add").

    With ``out`` (a writable contiguous uint8 array, ``max_nbytes`` always suffices) the
    stream is written there and the used prefix is returned.
    """
    la = _validate(as_stream(a))
    lb = _validate(as_stream(b))
    ha, hb = la.hdr, lb.hdr
    if ha.dtype != hb.dtype:
        raise MismatchError(f"cannot add a {ha.dtype} stream to a {hb.dtype} stream")
    if ha.n != hb.n:
        raise MismatchError(f"cannot add streams of {ha.n} and {hb.n} elements")
    if np.float64(ha.eb).view(np.uint64) != np.float64(hb.eb).view(np.uint64):
        raise MismatchError(
            f"cannot add streams quantized with different bounds eb={ha.eb!r} and eb={hb.eb!r}"
        )
    bound = sum_bound(ha.bound, hb.bound)
    if not math.isfinite(bound):
        raise ErrorBoundError(f"the sum of bounds {ha.bound!r} + {hb.bound!r} overflows float64")
    nterms = ha.nterms + hb.nterms
    if nterms >= 1 << 32:
        raise MismatchError(f"a sum of {nterms} streams does not fit the header's nterms")
    is32 = ha.dtype == np.float32
    n = ha.n
    nblocks = ha.nblocks
    nch = _nchunks(nblocks)
    step = 2.0 * ha.eb
    ccodes = np.empty(nblocks, np.uint8)
    bitmap_t = np.empty((nblocks + 31) // 32, np.uint32)
    chunk_nnz = np.empty(nch, np.int64)
    chunk_words = np.empty(nch, np.int64)
    # Scratch for the chunks' payloads (see _add_chunks): twice both payloads.
    scratch = np.empty(2 * (la.W.size + lb.W.size), np.uint32)
    if nch:
        with _threads_for(n):
            _add_chunks(la.W, la.bitmap, la.codes, la.chunk_k, la.chunk_pos,
                        lb.W, lb.bitmap, lb.codes, lb.chunk_k, lb.chunk_pos,
                        n, is32, step, ccodes, bitmap_t, chunk_nnz, chunk_words, scratch)
    chunk_k, nnz = _scan(chunk_nnz)
    chunk_pos, pwords = _scan(chunk_words)
    hdr = fmt.StreamHeader(dtype=ha.dtype, shape=ha.shape, eb=ha.eb, bound=bound, nnz=nnz,
                           payload_words=pwords, nterms=nterms)
    if out is None:
        res = np.empty(hdr.nbytes, np.uint8)
    else:
        if not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1):
            raise MismatchError("out for a stream must be a 1-D uint8 numpy array")
        if not (out.flags.writeable and out.flags.c_contiguous):
            raise MismatchError("out for a stream must be writable and contiguous")
        if out.size < hdr.nbytes:
            raise MismatchError(
                f"out holds {out.size} bytes, the sum needs {hdr.nbytes} "
                "(size it with max_nbytes)"
            )
        if out.ctypes.data % 4:
            raise MismatchError("out for a stream must be 4-byte aligned")
        res = out[: hdr.nbytes]
    head = hdr.pack()
    res[: head.size] = head
    res[hdr.codes_offset + nnz : hdr.payload_offset] = 0
    if nch:
        res[hdr.bitmap_offset : hdr.codes_offset].view(np.uint32)[:] = bitmap_t
        cbytes = res[hdr.codes_offset : hdr.codes_offset + nnz]
        W = res[hdr.payload_offset :].view(np.uint32)
        with _threads_for(n):
            _place_chunks(ccodes, scratch, 2 * (la.chunk_pos + lb.chunk_pos), chunk_nnz,
                          chunk_words, chunk_k, chunk_pos, cbytes, W)
    return res


# Scratch of add_data, kept per thread: its chunk regions are sized for the worst case and
# written only at their start, and paging fresh memory in for that costs more than the
# kernel (numpy asks for 2 MiB huge pages from 4 MiB up, each zeroed when first touched).
# Buffers up to SCRATCH_KEEP words are kept; larger requests get one of their own.
SCRATCH_KEEP = 1 << 24
_kept = threading.local()


def _scratch(nwords: int) -> np.ndarray:
    """Return an uninitialized uint32 buffer of ``nwords`` words, reused by this thread."""
    if nwords > SCRATCH_KEEP:
        return np.empty(nwords, np.uint32)
    buf = getattr(_kept, "buf", None)
    if buf is None or buf.size < nwords:
        buf = np.empty(max(nwords, 1 << 16), np.uint32)
        _kept.buf = buf
    return buf[:nwords]


def add_data(a: object, x: np.ndarray, eb: float | None = None) -> np.ndarray:
    """``add(a, compress_abs(x, eb))`` in one pass, ``eb`` being the stream's own.

    Byte for byte the same stream (docs/format.md, "Homomorphic add"), without encoding
    ``x``'s blocks to bit-planes and decoding them again: what a homomorphic ring step does
    with its own share of a block. ``x`` is a contiguous float array of the stream's dtype
    and element count; a given ``eb`` must equal the stream's bit for bit, as :func:`add`
    requires of two streams.
    """
    la = _validate(as_stream(a))
    ha = la.hdr
    if eb is not None and np.float64(eb).view(np.uint64) != np.float64(ha.eb).view(np.uint64):
        raise MismatchError(
            f"cannot add data quantized with eb={eb!r} to a stream with eb={ha.eb!r}"
        )
    if not isinstance(x, np.ndarray) or x.dtype != ha.dtype:
        raise MismatchError(
            f"cannot add {getattr(x, 'dtype', type(x).__name__)} data to a {ha.dtype} stream"
        )
    if x.size != ha.n:
        raise MismatchError(f"cannot add {x.size} values to a stream of {ha.n} elements")
    bound = sum_bound(ha.bound, ha.eb)
    if not math.isfinite(bound):
        raise ErrorBoundError(f"the sum of bounds {ha.bound!r} + {ha.eb!r} overflows float64")
    nterms = ha.nterms + 1
    if nterms >= 1 << 32:
        raise MismatchError(f"a sum of {nterms} streams does not fit the header's nterms")
    flat = _readonly(np.ascontiguousarray(x).reshape(-1))
    is32 = ha.dtype == np.float32
    n = ha.n
    nblocks = ha.nblocks
    nch = _nchunks(nblocks)
    eb = ha.eb
    ccodes = np.empty(nblocks, np.uint8)
    bitmap_t = np.empty((nblocks + 31) // 32, np.uint32)
    chunk_nnz = np.empty(nch, np.int64)
    chunk_words = np.empty(nch, np.int64)
    chunk_src = la.chunk_pos + np.arange(nch, dtype=np.int64) * (CHUNK_BLOCKS * 2 * BLOCK)
    scratch = _scratch(la.W.size + nblocks * 2 * BLOCK)
    bits = flat.view(np.uint32) if is32 else flat.view(np.uint64)
    mask = np.uint64(0x7FFFFFFF if is32 else 0x7FFFFFFFFFFFFFFF)
    if nch:
        with _threads_for(n):
            _add_data_chunks(la.W, la.bitmap, la.codes, la.chunk_k, la.chunk_pos, flat, bits,
                             eb, 2.0 * eb, _small(eb, flat.dtype), mask, ccodes, bitmap_t,
                             chunk_nnz, chunk_words, scratch, chunk_src)
    chunk_k, nnz = _scan(chunk_nnz)
    chunk_pos, pwords = _scan(chunk_words)
    hdr = fmt.StreamHeader(dtype=ha.dtype, shape=ha.shape, eb=eb, bound=bound, nnz=nnz,
                           payload_words=pwords, nterms=nterms)
    res = np.empty(hdr.nbytes, np.uint8)
    head = hdr.pack()
    res[: head.size] = head
    res[hdr.codes_offset + nnz : hdr.payload_offset] = 0
    if nch:
        res[hdr.bitmap_offset : hdr.codes_offset].view(np.uint32)[:] = bitmap_t
        cbytes = res[hdr.codes_offset : hdr.codes_offset + nnz]
        W = res[hdr.payload_offset :].view(np.uint32)
        with _threads_for(n):
            _place_chunks(ccodes, scratch, chunk_src, chunk_nnz, chunk_words, chunk_k,
                          chunk_pos, cbytes, W)
    return res
