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

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu.v2 import _new_stream, _sections, compress_abs_v2, validate_v2
from ccoll.compressor.cpu.v2blocks import KIND_PP, KIND_RAW, KIND_SP, NCODES
from ccoll.errors import MismatchError

__all__ = ["PartsV2", "slice_v2", "concat_v2", "raw_blocks_v2"]

BLOCK = fmt.BLOCK
_LOW32 = np.uint64(0xFFFFFFFF)


class PartsV2:
    """A validated version-2 stream taken apart block by block.

    ``bits``: per block, 1 if non-zero; ``codes``: the code of each non-zero block (block
    order); ``masks``: the mask words; ``rpre[k]``: the patched-planes blocks among non-zero
    blocks ``0..k-1`` (their first mask word); ``opre[k]``: the payload bit where non-zero
    block ``k`` starts; ``W``: the payload words.
    """

    __slots__ = ("hdr", "bits", "kpre", "codes", "masks", "rpre", "opre", "W")

    def __init__(self, buf: np.ndarray, hdr: fmt.StreamHeader) -> None:
        lay = validate_v2(buf, hdr)
        self.hdr = hdr
        nblocks, nnz = hdr.nblocks, hdr.nnz
        self.bits = np.unpackbits(np.ascontiguousarray(lay.bitmap).view(np.uint8),
                                  bitorder="little")[:nblocks]
        self.kpre = np.zeros(nblocks + 1, np.int64)  # non-zero blocks before each block
        np.cumsum(self.bits, out=self.kpre[1:])
        ib = hdr.index_bits
        if ib:
            ibits = np.unpackbits(np.ascontiguousarray(lay.idx).view(np.uint8),
                                  bitorder="little")[: nnz * ib].reshape(nnz, ib)
            fields = ibits.astype(np.int64) @ (np.int64(1) << np.arange(ib, dtype=np.int64))
        else:
            fields = np.zeros(nnz, np.int64)
        codes = np.asarray(lay.table, np.int64)[fields] if nnz else np.zeros(0, np.int64)
        self.codes = codes
        self.masks = np.asarray(lay.masks)
        kind = codes >> 10
        a = (codes >> 5) & 31
        b = codes & 31
        pp = kind == KIND_PP
        self.rpre = np.zeros(nnz + 1, np.int64)
        np.cumsum(pp, out=self.rpre[1:])
        p = np.zeros(nnz, np.int64)
        p[pp] = np.bitwise_count(self.masks).astype(np.int64)
        raw32 = 1024 if hdr.dtype == np.float32 else 2048
        sizes = np.where(
            pp, np.where(a == 0, p, 32) + 32 * a + p * b,
            np.where(kind == KIND_SP, (a + 1) * (6 + b),
                     np.where(kind == KIND_RAW, raw32, 2048)))
        self.opre = np.zeros(nnz + 1, np.int64)
        np.cumsum(sizes, out=self.opre[1:])
        self.W = lay.W


def _take_bits(W: np.ndarray, start: int, nbits: int) -> np.ndarray:
    """Bits ``[start, start + nbits)`` of the bit stream ``W``, from bit 0 of a new one.

    The bits after ``nbits`` in the last word are 0.
    """
    nw = (nbits + 31) >> 5
    if nw == 0:
        return np.zeros(0, np.uint32)
    s, r = start >> 5, start & 31
    src = W[s: s + nw + 1].astype(np.uint64)
    if src.size < nw + 1:
        src = np.concatenate([src, np.zeros(nw + 1 - src.size, np.uint64)])
    if r:
        out = ((src[:nw] >> np.uint64(r)) | (src[1:] << np.uint64(32 - r))) & _LOW32
    else:
        out = src[:nw]
    tail = nbits & 31
    if tail:
        out[-1] &= np.uint64((1 << tail) - 1)
    return out.astype(np.uint32)


def _put_bits(dst: np.ndarray, o: int, words: np.ndarray) -> None:
    """OR the bit stream ``words`` into the zeroed bits of ``dst`` from bit ``o`` on.

    The bits of ``words`` past its content are 0, so whatever would fall past the end of
    ``dst`` is 0.
    """
    nw = words.size
    if nw == 0:
        return
    p, d = o >> 5, o & 31
    if d == 0:
        dst[p: p + nw] |= words
        return
    w = words.astype(np.uint64)
    dst[p: p + nw] |= ((w << np.uint64(d)) & _LOW32).astype(np.uint32)
    hi = (w >> np.uint64(32 - d)).astype(np.uint32)
    m = min(nw, dst.size - (p + 1))
    dst[p + 1: p + 1 + m] |= hi[:m]


def _pack_fields(dst: np.ndarray, fields: np.ndarray, ib: int) -> None:
    """Write ``fields`` as consecutive ``ib``-bit fields into the zeroed words ``dst``."""
    if ib == 0 or fields.size == 0:
        return
    bits = ((fields[:, None] >> np.arange(ib, dtype=np.int64)) & 1).astype(np.uint8)
    packed = np.packbits(bits.reshape(-1), bitorder="little")
    dst.view(np.uint8)[: packed.size] = packed


Segment = tuple[PartsV2, int, int]  # blocks [b0, b1) of a stream


def _assemble(like: fmt.StreamHeader, n: int, segments: Sequence[Segment]) -> np.ndarray:
    """Return the 1-D version-2 stream of the given block ranges, end to end.

    ``like`` gives the dtype, ``eb``, ``bound`` and ``nterms``; ``n`` the element count
    (the ranges' blocks cover it). Every block keeps its code, mask word and payload bits.
    """
    if n >= fmt.MAX_N_V2:
        raise MismatchError(f"the stream would hold {n} elements: version 2 holds fewer "
                            "than 2^37")
    bits, codes, masks, pays = [], [], [], []
    for s, b0, b1 in segments:
        k0, k1 = int(s.kpre[b0]), int(s.kpre[b1])
        r0, r1 = int(s.rpre[k0]), int(s.rpre[k1])
        bits.append(s.bits[b0:b1])
        codes.append(s.codes[k0:k1])
        masks.append(s.masks[r0:r1])
        pays.append((s.W, int(s.opre[k0]), int(s.opre[k1] - s.opre[k0])))
    code = np.concatenate(codes) if codes else np.zeros(0, np.int64)
    # The codes present, increasing (a count per code: no sort of the blocks' codes).
    table = np.flatnonzero(np.bincount(code, minlength=NCODES)).astype(np.uint16)
    ntab = int(table.size)
    nbits = sum(nb for _w, _o, nb in pays)
    hdr = fmt.StreamHeader(dtype=like.dtype, shape=(n,), eb=like.eb, bound=like.bound,
                           nnz=int(code.size), payload_words=(nbits + 31) // 32,
                           nterms=like.nterms, version=fmt.VERSION2,
                           nmask=sum(int(m.size) for m in masks), ntab=ntab)
    res = _new_stream(hdr, table)
    bitmap, idx, msk, pay = _sections(res, hdr)
    bitmap[:] = 0
    if bitmap.size:
        packed = np.packbits(np.concatenate(bits), bitorder="little")
        bitmap.view(np.uint8)[: packed.size] = packed
    idx[:] = 0
    if ntab > 1:
        rank = np.zeros(NCODES, np.int64)
        rank[table] = np.arange(ntab)
        _pack_fields(idx, rank[code], hdr.index_bits)
    if msk.size:
        msk[:] = np.concatenate(masks)
    pay[:] = 0
    at = 0
    for W, o, nb in pays:
        _put_bits(pay, at, _take_bits(W, o, nb))
        at += nb
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
