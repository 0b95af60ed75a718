"""Cut a stream at block boundaries, join streams end to end, store chosen blocks raw.

Every 32-element block is encoded on its own, in both formats (docs/format.md, "Blocks";
version 2: "Encoding a block (version 2)": a block's code and payload depend on its own
values only), so the blocks ``[b0, b1)`` of a stream are exactly the stream of the
elements they cover, and streams of consecutive ranges are together the stream of the
whole range:

- ``slice_blocks(compress_abs(x, eb, version=v), b0, b1)
  == compress_abs(x[32 b0 : min(n, 32 b1)], eb, version=v)``
- ``concat([compress_abs(x, eb, version=v), compress_abs(y, eb, version=v)])
  == compress_abs(concatenate(x, y), eb, version=v)`` when ``x.size`` is a multiple of 32,

byte for byte (1-D data; the result is 1-D), and the same for homomorphic sums (the
header's ``eb``, ``bound`` and ``nterms`` are kept): ``slice_blocks(add(a, b), b0, b1) ==
add(slice_blocks(a, b0, b1), slice_blocks(b, b0, b1))``. Recursive halving
(:mod:`ccoll.collectives.halving`) uses them to send a step's data in a few large streams
instead of one per chunk. Nothing is decoded: version 1 copies the metadata (bitmap bits,
code bytes) and the payload words as they are; version 2 copies the bitmap bits, codes
(re-indexed into the table of the codes the result holds), mask words and payload bits
(:mod:`ccoll.compressor.cpu.v2slices`). ``raw_blocks`` stores chosen blocks of a stream
raw (the split allreduce's requantization uses it for values off its grid).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu.decode import _validate, as_stream
from ccoll.compressor.cpu.encode import compress_abs
from ccoll.compressor.cpu.v2slices import PartsV2, concat_v2, raw_blocks_v2, slice_v2
from ccoll.errors import FormatError, MismatchError

__all__ = ["slice_blocks", "concat", "raw_blocks"]

BLOCK = fmt.BLOCK


def _open(stream: object) -> tuple[np.ndarray, fmt.StreamHeader]:
    buf = as_stream(stream)
    return buf, fmt.parse_header(buf)


def _parts(stream: object) -> tuple[fmt.StreamHeader, np.ndarray, np.ndarray, np.ndarray,
                                     np.ndarray]:
    """Header, per-block non-zero bits, code bytes, payload words, payload offsets (v1)."""
    buf, hdr = _open(stream)
    return _parts_v1(buf, hdr)


def _parts_v1(buf: np.ndarray, hdr: fmt.StreamHeader
              ) -> tuple[fmt.StreamHeader, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
    out_hdr.pack_into(res)
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

    A stream of the same format version. ``0 <= b0 <= b1 <= nblocks`` (``b0 == b1``: the
    stream of no elements); the last block keeps its own length (a partial final block
    stays partial). Raises :class:`~ccoll.errors.FormatError` for a damaged stream and
    :class:`~ccoll.errors.MismatchError` for a range outside it.
    """
    buf, hdr0 = _open(stream)
    if not (0 <= b0 <= b1 <= hdr0.nblocks):
        raise MismatchError(f"block range [{b0}, {b1}) is not inside the stream's "
                            f"{hdr0.nblocks} blocks")
    if hdr0.version == fmt.VERSION2:
        return slice_v2(PartsV2(buf, hdr0), b0, b1)
    hdr, bits, codes, W, offsets = _parts_v1(buf, hdr0)
    k0 = int(bits[:b0].sum())
    k1 = k0 + int(bits[b0:b1].sum())
    n = max(0, min(hdr.n, BLOCK * b1) - BLOCK * b0)
    return _build(hdr, n, bits[b0:b1], codes[k0:k1], [W[offsets[k0] : offsets[k1]]])


def concat(streams: Sequence[object]) -> np.ndarray:
    """Join streams of one format version end to end into one 1-D stream of that version.

    Every stream but the last must hold a whole number of blocks, and all must have the
    same dtype, ``eb``, ``bound`` and ``nterms`` (what adding them would require):
    :class:`~ccoll.errors.MismatchError` otherwise; streams of versions 1 and 2 together
    raise :class:`~ccoll.errors.FormatError`.
    """
    if not streams:
        raise MismatchError("concat needs at least one stream")
    opened = [_open(s) for s in streams]
    versions = {hdr.version for _buf, hdr in opened}
    if len(versions) > 1:
        raise FormatError("streams of format versions 1 and 2 cannot be joined; compress "
                          "all with the same version")
    heads = [hdr for _buf, hdr in opened]
    _check_joinable(heads)
    if fmt.VERSION2 in versions:
        return concat_v2([PartsV2(buf, hdr) for buf, hdr in opened])
    parts = [_parts_v1(buf, hdr) for buf, hdr in opened]
    n = sum(p[0].n for p in parts)
    bits = np.concatenate([p[1] for p in parts])
    codes = np.concatenate([p[2] for p in parts])
    return _build(parts[0][0], n, bits, codes, [p[3] for p in parts])


def _check_joinable(heads: Sequence[fmt.StreamHeader]) -> None:
    first = heads[0]
    for i, hdr in enumerate(heads):
        if (hdr.dtype, hdr.eb, hdr.bound, hdr.nterms) != (first.dtype, first.eb, first.bound,
                                                          first.nterms):
            raise MismatchError(
                f"stream {i} has dtype {hdr.dtype}, eb {hdr.eb!r}, bound {hdr.bound!r}, "
                f"{hdr.nterms} terms; stream 0 has {first.dtype}, {first.eb!r}, "
                f"{first.bound!r}, {first.nterms}")
        if i < len(heads) - 1 and hdr.n % BLOCK:
            raise MismatchError(f"stream {i} of {len(heads)} holds {hdr.n} elements, not a "
                                f"multiple of {BLOCK}: only the last may end a block early")


def raw_blocks(stream: object, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Return ``stream`` with the blocks ``blocks`` stored raw: ``x``'s values bit for bit.

    ``x`` is the stream's data (its dtype and length); ``blocks`` sorted, distinct block
    indices. Each listed block becomes the block a lossless compression of its elements
    makes (raw, or a zero block when every element is ``±0.0``, decoded as ``+0.0``):
    neither kind depends on ``eb``, so the header stays as it was and the other blocks keep
    their bytes. A stream of the same format version (version 2: raw is kind 2,
    :func:`~ccoll.compressor.cpu.v2slices.raw_blocks_v2`); the result is 1-D.
    :class:`~ccoll.errors.MismatchError` for data of another dtype or length or a block
    outside the stream.
    """
    buf, hdr = _open(stream)
    x = np.asarray(x)
    if x.dtype != hdr.dtype or x.shape != (hdr.n,):
        raise MismatchError(f"raw_blocks: data of {x.dtype} {x.shape} for a stream of "
                            f"{hdr.dtype} ({hdr.n},)")
    blocks = np.asarray(blocks, np.int64)
    if blocks.size and (blocks[0] < 0 or blocks[-1] >= hdr.nblocks
                        or np.any(np.diff(blocks) <= 0)):
        raise MismatchError(f"raw_blocks: blocks must be sorted, distinct and below "
                            f"{hdr.nblocks}")
    if hdr.version == fmt.VERSION2:
        return raw_blocks_v2(PartsV2(buf, hdr), x, blocks)
    hdr, bits, codes, W, offsets = _parts_v1(buf, hdr)
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
