"""Cut a version-1 stream at block boundaries, and join streams end to end.

Every 32-element block of a version-1 stream is encoded on its own (docs/format.md,
"Blocks": a block's kind, width and prediction depend on its own values only), so the
blocks ``[b0, b1)`` of a stream are exactly the stream of the elements they cover, and
streams of consecutive ranges are together the stream of the whole range:

- ``slice_blocks(compress_abs(x, eb), b0, b1) == compress_abs(x[32 b0 : 32 b1], eb)``
- ``concat([compress_abs(x, eb), compress_abs(y, eb)]) == compress_abs(concat(x, y), eb)``
  when ``x.size`` is a multiple of 32,

byte for byte, and the same for homomorphic sums (the header's ``bound`` and ``nterms``
are kept). Recursive halving (:mod:`ccoll.collectives.halving`) uses them to send a step's
data in a few large streams instead of one per chunk. Only the metadata is touched (bitmap
bits, code bytes, and the payload words copied as they are); the result is 1-D.
``raw_blocks`` stores chosen blocks of a stream raw (the split allreduce's requantization
uses it for values off its grid).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu.decode import _validate, as_stream
from ccoll.compressor.cpu.encode import compress_abs
from ccoll.errors import FormatError, MismatchError

__all__ = ["slice_blocks", "concat", "raw_blocks"]

BLOCK = fmt.BLOCK


def _parts(stream: object) -> tuple[fmt.StreamHeader, np.ndarray, np.ndarray, np.ndarray,
                                     np.ndarray]:
    """Header, per-block non-zero bits, code bytes, payload words, payload offsets."""
    buf = as_stream(stream)
    hdr = fmt.parse_header(buf)
    if hdr.version != fmt.VERSION:
        raise FormatError("only version-1 streams can be cut or joined")
    lay = _validate(buf, hdr)
    bits = np.unpackbits(np.ascontiguousarray(lay.bitmap).view(np.uint8),
                         bitorder="little")[: hdr.nblocks]
    codes = np.asarray(lay.codes)
    raw_words = 32 if hdr.dtype == np.float32 else 64
    sizes = np.where(codes == 33, 64, np.where(codes == 32, raw_words,
                                               1 + (codes & 0x1F).astype(np.int64)))
    offsets = np.zeros(codes.size + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return hdr, bits, codes, lay.W, offsets


def _build(hdr: fmt.StreamHeader, n: int, bits: np.ndarray, codes: np.ndarray,
           words: Sequence[np.ndarray]) -> np.ndarray:
    nnz = int(codes.size)
    pwords = sum(int(w.size) for w in words)
    out_hdr = fmt.StreamHeader(dtype=hdr.dtype, shape=(n,), eb=hdr.eb, bound=hdr.bound,
                               nnz=nnz, payload_words=pwords, nterms=hdr.nterms)
    res = np.zeros(out_hdr.nbytes, np.uint8)
    head = out_hdr.pack()
    res[: head.size] = head
    packed = np.packbits(bits.astype(np.uint8), bitorder="little")
    res[out_hdr.bitmap_offset : out_hdr.bitmap_offset + packed.size] = packed
    res[out_hdr.codes_offset : out_hdr.codes_offset + nnz] = codes
    W = res[out_hdr.payload_offset :].view(np.uint32)
    at = 0
    for w in words:
        W[at : at + w.size] = w
        at += w.size
    return res


def slice_blocks(stream: object, b0: int, b1: int) -> np.ndarray:
    """Return the stream of blocks ``[b0, b1)`` of ``stream`` (elements ``32 b0`` on).

    ``0 <= b0 < b1 <= nblocks``; the last block keeps its own length (a partial final
    block stays partial). Raises :class:`~ccoll.errors.FormatError` for a damaged or a
    version-2 stream and :class:`~ccoll.errors.MismatchError` for a range outside it.
    """
    hdr, bits, codes, W, offsets = _parts(stream)
    if not (0 <= b0 < b1 <= hdr.nblocks):
        raise MismatchError(f"block range [{b0}, {b1}) is not inside the stream's "
                            f"{hdr.nblocks} blocks")
    k0 = int(bits[:b0].sum())
    k1 = k0 + int(bits[b0:b1].sum())
    n = min(hdr.n, BLOCK * b1) - BLOCK * b0
    return _build(hdr, n, bits[b0:b1], codes[k0:k1], [W[offsets[k0] : offsets[k1]]])


def concat(streams: Sequence[object]) -> np.ndarray:
    """Join version-1 streams end to end into one 1-D stream.

    Every stream but the last must hold a whole number of blocks, and all must have the
    same dtype, ``eb``, ``bound`` and ``nterms`` (what adding them would require):
    :class:`~ccoll.errors.MismatchError` otherwise.
    """
    if not streams:
        raise MismatchError("concat needs at least one stream")
    parts = [_parts(s) for s in streams]
    first = parts[0][0]
    for i, (hdr, *_rest) in enumerate(parts):
        if (hdr.dtype, hdr.eb, hdr.bound, hdr.nterms) != (first.dtype, first.eb, first.bound,
                                                          first.nterms):
            raise MismatchError(
                f"stream {i} has dtype {hdr.dtype}, eb {hdr.eb!r}, bound {hdr.bound!r}, "
                f"{hdr.nterms} terms; stream 0 has {first.dtype}, {first.eb!r}, "
                f"{first.bound!r}, {first.nterms}")
        if i < len(parts) - 1 and hdr.n % BLOCK:
            raise MismatchError(f"stream {i} of {len(parts)} holds {hdr.n} elements, not a "
                                f"multiple of {BLOCK}: only the last may end a block early")
    n = sum(p[0].n for p in parts)
    bits = np.concatenate([p[1] for p in parts])
    codes = np.concatenate([p[2] for p in parts])
    return _build(first, n, bits, codes, [p[3] for p in parts])


def raw_blocks(stream: object, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Return ``stream`` with the blocks ``blocks`` stored raw: ``x``'s values bit for bit.

    ``x`` is the stream's data (its dtype and length); ``blocks`` sorted, distinct block
    indices. Each listed block becomes the block a lossless compression of its elements
    makes (raw, or a zero block when every element is ``±0.0``, decoded as ``+0.0``):
    neither kind depends on ``eb``, so the header stays as it was and the other blocks keep
    their bytes. :class:`~ccoll.errors.MismatchError` for data of another dtype or length
    or a block outside the stream.
    """
    hdr, bits, codes, W, offsets = _parts(stream)
    x = np.asarray(x)
    if x.dtype != hdr.dtype or x.shape != (hdr.n,):
        raise MismatchError(f"raw_blocks: data of {x.dtype} {x.shape} for a stream of "
                            f"{hdr.dtype} ({hdr.n},)")
    blocks = np.asarray(blocks, np.int64)
    if blocks.size and (blocks[0] < 0 or blocks[-1] >= hdr.nblocks
                        or np.any(np.diff(blocks) <= 0)):
        raise MismatchError(f"raw_blocks: blocks must be sorted, distinct and below "
                            f"{hdr.nblocks}")
    rank = np.zeros(hdr.nblocks + 1, np.int64)  # non-zero blocks before each block
    np.cumsum(bits, out=rank[1:])
    new_bits = bits.copy()
    code_parts: list[np.ndarray] = []
    words: list[np.ndarray] = []
    k_at = 0  # next non-zero block of ``stream`` not yet copied
    for b in blocks.tolist():
        k0 = int(rank[b])
        code_parts.append(codes[k_at:k0])
        words.append(W[offsets[k_at]:offsets[k0]])
        _, pbits, pcodes, pW, _ = _parts(compress_abs(x[BLOCK * b: BLOCK * (b + 1)], 0.0))
        new_bits[b] = pbits[0]
        code_parts.append(pcodes)
        words.append(pW)
        k_at = k0 + int(bits[b])
    code_parts.append(codes[k_at:])
    words.append(W[offsets[k_at]:offsets[codes.size]])
    return _build(hdr, hdr.n, new_bits, np.concatenate(code_parts), words)
