"""Decompression on the CPU: stream views, validation and the block decoder.

Decompression validates the bitmap and the codes (two small parallel passes) before a
third pass reads the payload, so malformed bytes raise :class:`ccoll.FormatError` before
any value is written. :func:`_validate` is shared with the homomorphic add.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu.blocks import (
    BLOCK,
    CHUNK_BLOCKS,
    CODE_RAW,
    CODE_RAW64,
    _block_words,
    _chunk_nonzero,
    _code_valid,
    _decode_to,
    _exclusive_scan,
    _nchunks,
    _raw_value,
    _readonly,
    _scan,
    _threads_for,
)
from ccoll.errors import FormatError, MismatchError

__all__ = ["decompress", "decompress_wide", "header", "as_stream"]


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
def _check_codes(bitmap, codes, is32, chunk_k, chunk_words):  # type: ignore[no-untyped-def]
    """Each chunk's first code index and payload words, in one launch.

    Returns the bitmap's count of non-zero blocks (the caller compares it with the
    header's ``nnz`` before anything else) and whether every code byte is valid;
    ``chunk_words`` is filled only when the count equals ``codes.size``.
    """
    nch = chunk_k.size
    for c in prange(nch):
        chunk_words[c] = _chunk_nonzero(bitmap, c)  # the chunk's count, for now
    total = _exclusive_scan(chunk_words, chunk_k)
    if total != codes.size:
        return total, True
    for c in prange(nch):
        k0 = chunk_k[c]
        k1 = chunk_k[c + 1] if c + 1 < nch else total
        words = 0
        for i in range(k0, k1):
            code = np.int64(codes[i])
            if not _code_valid(code, is32):
                words = -1
                break
            words += _block_words(code, is32)
        chunk_words[c] = words
    ok = True
    for c in range(nch):
        if chunk_words[c] < 0:
            ok = False
    return total, ok


def as_stream(buf: object) -> np.ndarray:
    """View a host stream as a 1-D uint8 numpy array (no copy where possible)."""
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8:
            raise FormatError(f"a ccoll stream is a uint8 array, got dtype {buf.dtype}")
        if not buf.flags.c_contiguous:  # a strided view: its bytes in order, once
            buf = np.ascontiguousarray(buf)
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


def _validate(buf: np.ndarray, hdr: fmt.StreamHeader | None = None) -> _Layout:
    """Header, bitmap and codes checked (docs/format.md, "Robustness"); payload untouched.

    ``hdr``: the header already parsed from ``buf`` (``fmt.parse_header(buf)``), if any.
    """
    if hdr is None:
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
    chunk_k = np.zeros(nch, np.int64)
    chunk_words = np.zeros(nch, np.int64)
    total, ok = 0, True
    if nch:
        # codes holds the header's nnz bytes: the kernel sizes the chunks only when the
        # bitmap agrees with it.
        with _threads_for(hdr.n):
            total, ok = _check_codes(bitmap, codes, is32, chunk_k, chunk_words)
    if total != hdr.nnz:
        raise FormatError(
            f"stream bitmap has {total} non-zero blocks, its header says {hdr.nnz}"
        )
    if not ok:
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


def _result_of(out: np.ndarray | None, hdr: fmt.StreamHeader) -> tuple[np.ndarray, np.ndarray]:
    """Return the result array and its flat view: a new array, or the checked ``out``."""
    if out is None:
        result = np.empty(hdr.shape, hdr.dtype)
        return result, result.reshape(-1)
    return out, _check_out(out, hdr)


def decompress(buf: object, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a host stream; ``out`` (matching dtype and shape or size) receives the values."""
    stream = as_stream(buf)
    hdr = fmt.parse_header(stream)
    if hdr.version == fmt.VERSION2:
        from ccoll.compressor.cpu import v2  # v2 builds on this module

        lay2 = v2.validate_v2(stream, hdr)
        result, flat = _result_of(out, hdr)
        v2.decode_into(lay2, flat)
        return result
    lay = _validate(stream, hdr)
    result, flat = _result_of(out, hdr)
    if hdr.n:
        outbits = flat.view(np.uint32) if hdr.dtype == np.float32 else flat.view(np.int64)
        with _threads_for(hdr.n):
            _decode(lay.W, lay.bitmap, lay.codes, lay.chunk_k, lay.chunk_pos, 2.0 * hdr.eb,
                    hdr.n, flat, outbits)
    return result


@njit(parallel=True, nogil=True, cache=True)
def _decode_wide(W, bitmap, codes, chunk_k, chunk_pos, step, n, is32, out):  # type: ignore[no-untyped-def]
    """:func:`_decode` into a float64 ``out`` whatever the stream's dtype, no rounding to it."""
    nblocks = (n + BLOCK - 1) // BLOCK
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
            if code == CODE_RAW or code == CODE_RAW64:
                for l in range(m):
                    ob[l] = _raw_value(Wb, code, l, is32)
            else:
                _decode_to(Wb, code, mag, ob, step)


def decompress_wide(buf: object, out: np.ndarray | None = None) -> np.ndarray:
    """Decode a host stream to float64 (flat): each lane's float64 value before rounding.

    A fixed-length lane is ``fl(q * step)``, a raw lane its stored value, exactly what
    :func:`decompress` computes before it rounds to the stream's dtype (the same for a
    float64 stream). The requantizing allreduce starts from these values, so that the
    rounding to the dtype happens once, at the end (docs/error-bound.md, "Split bound").
    """
    stream = as_stream(buf)
    hdr = fmt.parse_header(stream)
    if out is None:
        out = np.empty(hdr.n, np.float64)
    elif out.dtype != np.float64 or out.size != hdr.n or not out.flags.c_contiguous:
        raise MismatchError(f"out must be a C-contiguous float64 array of {hdr.n} elements")
    flat = out.reshape(-1)
    if hdr.version == fmt.VERSION2:
        from ccoll.compressor.cpu import v2

        v2.decode_into(v2.validate_v2(stream, hdr), flat)
        return out
    lay = _validate(stream, hdr)
    if hdr.n:
        with _threads_for(hdr.n):
            _decode_wide(lay.W, lay.bitmap, lay.codes, lay.chunk_k, lay.chunk_pos,
                         2.0 * hdr.eb, hdr.n, hdr.dtype == np.float32, flat)
    return out
