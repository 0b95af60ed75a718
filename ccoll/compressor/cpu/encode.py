"""Compression on the CPU: the finite range of the data and the two-pass encoder.

Compression is two kernel passes: the first decides every block's code (and sums payload
words and non-zero blocks per chunk), a serial exclusive scan over the chunk sums gives
each chunk's code index and payload offset, and the second pass recomputes the
quantization and writes bitmap, codes and payload into an output allocated once at its
exact size. No per-element integer array is kept.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu.blocks import (
    BLOCK,
    CHUNK_BLOCKS,
    CODE_RAW,
    _block_words,
    _code_of,
    _encode_x,
    _nchunks,
    _quantize,
    _readonly,
    _scan,
    _small,
    _threads_for,
    _write_raw,
)
from ccoll.compressor.cpu.intrinsics import _q_float

__all__ = ["compress_abs", "finite_range", "residual_abs"]


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
    """Min and max of the finite values of a float array (``(inf, -inf)`` if none).

    One parallel, vectorized pass (a non-contiguous array is copied first); equal to
    :func:`ccoll.errorbound.finite_range`, whose two numpy passes (and, with NaN or ±inf, a
    filtered copy) it replaces, except that a zero end of the range is always ``0.0``:
    numpy returns ``0.0`` or ``-0.0`` depending on where the zeros sit in its SIMD lanes,
    and no bound depends on that sign (``REL.resolve`` gives the same ``eb``).
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
    return vlo + 0.0, vhi + 0.0  # -0.0 + 0.0 is 0.0: one sign for a zero end


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
def _residual_lossy(x, eb, step, small, out):  # type: ignore[no-untyped-def]
    """``out = x - decode(compress(x))`` block by block, with :func:`_plan_lossy`'s choices.

    A zero block decodes to 0 (``out = x - 0``), a raw block to ``x`` itself (``x - x``), a
    coded block to ``T(float64(q) * step)``, the decoder's value; the subtraction is in
    ``x``'s dtype, as numpy's. ``out`` may be ``x``: a block is read whole before its
    lanes are written.
    """
    n = x.size
    nblocks = (n + BLOCK - 1) // BLOCK
    for c in prange((nblocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS):
        q = np.empty(BLOCK, np.int64)
        t = np.empty(BLOCK, x.dtype)
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        for b in range(b0, b1):
            base = b * BLOCK
            e = min(base + BLOCK, n)
            xb = x[base:e]
            ob = out[base:e]
            m = xb.size
            if m == BLOCK:
                tiny = True
                for l in range(BLOCK):
                    tiny &= abs(xb[l]) <= small
                if tiny:
                    for l in range(BLOCK):
                        t[l] = 0.0
                        ob[l] = xb[l] - t[l]
                    continue
            bad, orq, ord_ = _quantize(xb, eb, step, q)
            if bad:
                for l in range(m):
                    ob[l] = xb[l] - xb[l]
            else:
                for l in range(m):  # |q| < 2^31 in an accepted block
                    t[l] = _q_float(q[l]) * step
                for l in range(m):
                    ob[l] = xb[l] - t[l]


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


def compress_abs(x: np.ndarray, eb: float, version: int = fmt.VERSION) -> np.ndarray:
    """Compress a contiguous native float32/float64 host array with an absolute bound ``eb``.

    ``eb`` must be finite and ``>= 0`` (checked by the caller); ``eb = 0`` is lossless.
    ``version`` is the stream format, 1 or 2 (docs/format.md).
    """
    if version == fmt.VERSION2:
        from ccoll.compressor.cpu import v2  # v2 builds on the v1 modules

        return v2.compress_abs_v2(x, eb)
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
    hdr.pack_into(out)
    out[hdr.codes_offset + nnz : hdr.payload_offset] = 0
    if nblocks:
        bitmap = out[hdr.bitmap_offset : hdr.codes_offset].view(np.uint32)
        cbytes = out[hdr.codes_offset : hdr.codes_offset + nnz]
        W = out[hdr.payload_offset :].view(np.uint32)
        with _threads_for(n):
            _write_stream(flat, bits, step, codes, chunk_k, chunk_pos, bitmap, cbytes, W)
    return out


def residual_abs(x: np.ndarray, eb: float, out: np.ndarray) -> np.ndarray:
    """Write into ``out`` what ``compress_abs(x, eb)`` drops: ``x - decompress(...)``.

    Bit for bit numpy's ``x - decompress(compress_abs(x, eb))`` (either format version: both
    code the same quantized values, docs/format.md), in one pass without a stream: error
    feedback's residual. ``x`` and ``out`` are contiguous native float32/float64 host
    arrays of one dtype and size (``out`` may be ``x``); ``eb`` is finite and ``> 0``.
    Returns ``out``.
    """
    if x.dtype not in (np.float32, np.float64) or out.dtype != x.dtype:
        raise TypeError(f"residual_abs takes float32/float64 x and out of its dtype, got "
                        f"{x.dtype} and {out.dtype}")
    # Checked before reshaping: reshape(-1) of a non-contiguous array is a copy, and the
    # residual written into a copy of out would be lost.
    if out.size != x.size or not (x.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("residual_abs needs contiguous x and out of one size")
    flat = x.reshape(-1)
    dst = out.reshape(-1)
    eb = float(eb)
    if not (math.isfinite(eb) and eb > 0.0):
        raise ValueError(f"residual_abs needs a finite bound > 0, got {eb!r}")
    if flat.size:
        with _threads_for(flat.size):
            _residual_lossy(flat, eb, 2.0 * eb, _small(eb, flat.dtype), dst)
    return out
