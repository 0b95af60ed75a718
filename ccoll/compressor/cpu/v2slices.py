"""Cut a version-2 stream at block boundaries, join version-2 streams, mark blocks raw.

A version-2 block is coded from its own quantized values alone (docs/format.md, "Encoding
a block (version 2)"): its code, its mask word (patched planes) and its payload bits do not
depend on any other block. Only where they sit does: the code is an index into the
stream's table of the codes it uses, the mask is the ``r``-th of the mask section, the
payload starts at the bit where the previous block's ends. So a block range is cut, and
streams are joined, by copying: the bitmap bits, the blocks' codes (re-indexed into the
table of the codes the result holds), their mask words, and their payload bits (shifted to
their new bit offset). Nothing is decoded or re-encoded, and the result is the stream an
encoder would write for those blocks:

- ``slice_v2(compress_abs(x, eb, version=2), b0, b1)
  == compress_abs(x[32 b0 : min(n, 32 b1)], eb, version=2)``,
- ``concat_v2([compress_abs(x, eb, version=2), compress_abs(y, eb, version=2)])
  == compress_abs(concatenate(x, y), eb, version=2)`` when ``x.size`` is a multiple of 32,

byte for byte (1-D ``x`` and ``y``; the result is always 1-D), and, since the homomorphic
add is block by block too, ``slice_v2(add(a, b), b0, b1) == add(slice_v2(a, b0, b1),
slice_v2(b, b0, b1))`` with the header's ``eb``, ``bound`` and ``nterms`` kept.
:func:`ccoll.compressor.cpu.slices.slice_blocks`, ``concat`` and ``raw_blocks`` call these
for version-2 streams.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu.blocks import CHUNK_BLOCKS
from ccoll.compressor.cpu.v2 import LayoutV2, _new_stream, _sections, compress_abs_v2, validate_v2
from ccoll.compressor.cpu.v2blocks import (
    KIND_PP,
    NCODES,
    _code_bits,
    _get,
    _reader_at,
    _writer_at,
)
from ccoll.errors import MismatchError

__all__ = ["PartsV2", "slice_v2", "concat_v2", "raw_blocks_v2"]

BLOCK = fmt.BLOCK


class PartsV2:
    """A validated version-2 stream: its sections and per-chunk offsets (``lay``).

    :meth:`at` finds where block ``b``'s index field, mask word and payload bits start
    from the offsets of its chunk (at most ``CHUNK_BLOCKS`` blocks read), so a cut costs
    a pass over the blocks it keeps, not over the whole stream.
    """

    __slots__ = ("hdr", "lay")

    def __init__(self, buf: np.ndarray, hdr: fmt.StreamHeader) -> None:
        self.hdr = hdr
        self.lay: LayoutV2 = validate_v2(buf, hdr)

    def at(self, b: int) -> tuple[int, int, int]:
        """Index field, mask word and payload bit where block ``b`` starts (0..nblocks)."""
        lay = self.lay
        k, r, o = _offsets_at(lay.bitmap, lay.idx, lay.ib, lay.table, lay.masks,
                              lay.chunk_k, lay.chunk_r, lay.chunk_o, b,
                              self.hdr.dtype == np.float32)
        return int(k), int(r), int(o)


@njit(nogil=True, cache=True)
def _offsets_at(bitmap, idx, ib, table, masks, chunk_k, chunk_r, chunk_o, b, is32):  # type: ignore[no-untyped-def]
    """Index field, mask word and payload bit before block ``b``, from its chunk's start."""
    nch = chunk_k.size
    if nch == 0:
        return np.int64(0), np.int64(0), np.int64(0)
    c = min(b // CHUNK_BLOCKS, nch - 1)
    k = chunk_k[c]
    r = chunk_r[c]
    o = chunk_o[c]
    pos, acc, nb = _reader_at(idx, k * ib)
    for j in range(c * CHUNK_BLOCKS, b):
        if (np.int64(bitmap[j >> 5]) >> (j & 31)) & 1:
            i = np.int64(0)
            if ib:
                i, pos, acc, nb = _get(idx, pos, acc, nb, ib)
            code = table[i]
            mask = np.int64(0)
            if (code >> 10) == KIND_PP:
                mask = np.int64(masks[r])
                r += 1
            o += _code_bits(code, mask, is32)
            k += 1
    return k, r, o


@njit(nogil=True, cache=True)
def _mark_codes(idx, ib, table, k0, k1, present):  # type: ignore[no-untyped-def]
    """Mark the codes of index fields ``[k0, k1)`` in ``present`` (one entry per code)."""
    if k1 <= k0:
        return
    if ib == 0:
        present[table[0]] = 1
        return
    pos, acc, nb = _reader_at(idx, k0 * ib)
    for _ in range(k1 - k0):
        i, pos, acc, nb = _get(idx, pos, acc, nb, ib)
        present[table[i]] = 1


@njit(nogil=True, cache=True)
def _copy_fields(idx, ib, table, k0, k1, rank, dst, dib, at):  # type: ignore[no-untyped-def]
    """OR index fields ``[k0, k1)``, re-indexed by ``rank`` (per code), into ``dst``.

    ``dst`` holds ``dib``-bit fields; they go from field ``at`` on, where its bits are 0.
    """
    if dib == 0 or k1 <= k0:
        return
    pos, acc, nb = _reader_at(idx, k0 * ib)
    wpos, wacc, wnb = _writer_at(at * dib)
    for _ in range(k1 - k0):
        i = np.int64(0)
        if ib:
            i, pos, acc, nb = _get(idx, pos, acc, nb, ib)
        wacc |= rank[table[i]] << wnb
        wnb += dib
        if wnb >= 32:
            dst[wpos] |= np.uint32(wacc & 0xFFFFFFFF)
            wpos += 1
            wacc >>= 32
            wnb -= 32
    if wnb:
        dst[wpos] |= np.uint32(wacc & 0xFFFFFFFF)


@njit(nogil=True, cache=True)
def _or_bits(dst, at, src, start, nbits):  # type: ignore[no-untyped-def]
    """OR bits ``[start, start + nbits)`` of the words ``src`` into ``dst`` from bit ``at``.

    The bits of ``dst`` from ``at`` on are 0, and ``dst`` has room for ``at + nbits`` bits.
    """
    if nbits <= 0:
        return
    nw = (nbits + 31) >> 5
    s = start >> 5
    r = np.uint64(start & 31)
    d = at >> 5
    q = np.uint64(at & 31)
    low = np.uint64(0xFFFFFFFF)
    for j in range(nw - 1):  # whole words: the next source word is inside src
        w = ((np.uint64(src[s + j]) | (np.uint64(src[s + j + 1]) << np.uint64(32))) >> r) & low
        v = w << q
        dst[d + j] |= np.uint32(v & low)
        dst[d + j + 1] |= np.uint32(v >> np.uint64(32))
    j = nw - 1
    hi = np.uint64(src[s + j + 1]) if s + j + 1 < src.size else np.uint64(0)
    w = ((np.uint64(src[s + j]) | (hi << np.uint64(32))) >> r) & low
    tail = nbits & 31
    if tail:
        w &= (np.uint64(1) << np.uint64(tail)) - np.uint64(1)
    v = w << q
    dst[d + j] |= np.uint32(v & low)
    if v >> np.uint64(32):
        dst[d + j + 1] |= np.uint32(v >> np.uint64(32))


Segment = tuple[PartsV2, int, int]  # blocks [b0, b1) of a stream


def _assemble(like: fmt.StreamHeader, n: int, segments: Sequence[Segment]) -> np.ndarray:
    """Return the 1-D version-2 stream of the given block ranges, end to end.

    ``like`` gives the dtype, ``eb``, ``bound`` and ``nterms``; ``n`` the element count
    (the ranges' blocks cover it). Every block keeps its code, mask word and payload bits.
    """
    if n >= fmt.MAX_N_V2:
        raise MismatchError(f"the stream would hold {n} elements: version 2 holds fewer "
                            "than 2^37")
    present = np.zeros(NCODES, np.uint8)
    spans = []
    for s, b0, b1 in segments:
        k0, r0, o0 = s.at(b0)
        k1, r1, o1 = s.at(b1)
        lay = s.lay
        _mark_codes(lay.idx, lay.ib, lay.table, k0, k1, present)
        spans.append((k0, k1, r0, r1, o0, o1))
    # The codes present, increasing.
    table = np.flatnonzero(present).astype(np.uint16)
    ntab = int(table.size)
    nbits = sum(o1 - o0 for _k0, _k1, _r0, _r1, o0, o1 in spans)
    hdr = fmt.StreamHeader(dtype=like.dtype, shape=(n,), eb=like.eb, bound=like.bound,
                           nnz=sum(k1 - k0 for k0, k1, *_ in spans),
                           payload_words=(nbits + 31) // 32, nterms=like.nterms,
                           version=fmt.VERSION2,
                           nmask=sum(r1 - r0 for _k0, _k1, r0, r1, _o0, _o1 in spans),
                           ntab=ntab)
    res = _new_stream(hdr, table)
    bitmap, idx, msk, pay = _sections(res, hdr)
    bitmap[:] = 0
    idx[:] = 0
    pay[:] = 0
    rank = np.zeros(NCODES, np.int64)
    rank[table] = np.arange(ntab)
    ib = hdr.index_bits
    at_b = at_k = at_r = at_o = 0
    for (s, b0, b1), (k0, k1, r0, r1, o0, o1) in zip(segments, spans, strict=True):
        lay = s.lay
        _or_bits(bitmap, at_b, lay.bitmap, b0, b1 - b0)
        _copy_fields(lay.idx, lay.ib, lay.table, k0, k1, rank, idx, ib, at_k)
        msk[at_r: at_r + (r1 - r0)] = lay.masks[r0:r1]
        _or_bits(pay, at_o, lay.W, o0, o1 - o0)
        at_b += b1 - b0
        at_k += k1 - k0
        at_r += r1 - r0
        at_o += o1 - o0
    return res


def slice_v2(s: PartsV2, b0: int, b1: int) -> np.ndarray:
    """Return the stream of blocks ``[b0, b1)`` of ``s`` (``0 <= b0 <= b1 <= nblocks``)."""
    hdr = s.hdr
    n = max(0, min(hdr.n, BLOCK * b1) - BLOCK * b0)
    return _assemble(hdr, n, [(s, b0, b1)])


def concat_v2(parts: Sequence[PartsV2]) -> np.ndarray:
    """Join streams end to end (checked by the caller: same dtype, eb, bound, nterms)."""
    n = sum(p.hdr.n for p in parts)
    return _assemble(parts[0].hdr, n, [(p, 0, p.hdr.nblocks) for p in parts])


def raw_blocks_v2(s: PartsV2, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Return ``s`` with the blocks ``blocks`` (sorted, distinct, checked) stored losslessly.

    Each listed block becomes the block that a lossless compression of its elements makes
    (raw, kind 2, or a zero block when every element is ``±0.0``): the listed blocks of
    ``x`` are compressed together with ``eb = 0`` (every block coded on its own, so block
    ``j`` of that stream is the ``j``-th listed block's) and spliced in; the header and the
    other blocks stay as they were.
    """
    hdr = s.hdr
    blocks = np.asarray(blocks, np.int64)
    if blocks.size == 0:
        return _assemble(hdr, hdr.n, [(s, 0, hdr.nblocks)])
    ind = (blocks[:, None] * BLOCK + np.arange(BLOCK, dtype=np.int64)).reshape(-1)
    picked = np.ascontiguousarray(x[ind[ind < hdr.n]])
    loss_buf = compress_abs_v2(picked, 0.0)
    loss = PartsV2(loss_buf, fmt.parse_header(loss_buf))
    segments: list[Segment] = []
    at = 0
    for j, b in enumerate(blocks.tolist()):
        if b > at:
            segments.append((s, at, b))
        segments.append((loss, j, j + 1))
        at = b + 1
    if at < hdr.nblocks:
        segments.append((s, at, hdr.nblocks))
    return _assemble(hdr, hdr.n, segments)
