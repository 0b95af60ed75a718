"""Stream format version 2 on the CPU: compress, validate, decompress, add, add_data.

The work is split into chunks of ``CHUNK_BLOCKS`` blocks as in version 1, and ``prange``
runs over chunks. Compression is a plan pass (every block's code and payload bits, per
chunk: non-zero blocks, patched-planes blocks and bits; a chunk whose payload fits in its
scratch region is also packed there), the code table from the codes present, three
exclusive scans over the chunks (index field, mask word, payload bit), and a write pass
that moves each packed chunk to its offsets word-wise, or quantizes a chunk that did not
fit again and packs it. Neighbouring chunks
share at most one word of the index and one of the payload; each chunk returns its last,
partial word, and those are OR'd in afterwards (docs/format.md, "Offsets (version 2)"),
so the bytes do not depend on the number of threads.

Decompression validates header, bitmap, table, index, mask count and sizes (docs/format.md,
"Robustness (version 2)") before a pass reads the payload. The homomorphic sum adds two
quantized blocks on their bit-planes (v2blocks), writes each chunk's payload into its own
region of a scratch buffer, then moves every chunk to its bit offset.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
from numba import njit, prange

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu.blocks import (
    BLOCK,
    CANONICAL_NAN64,
    CHUNK_BLOCKS,
    QLIM,
    QMAX_ADD,
    _chunk_nonzero,
    _exclusive_scan,
    _nchunks,
    _readonly,
    _small,
    _stream_out,
    _threads_for,
)
from ccoll.compressor.cpu.intrinsics import (
    BITLEN8,
    HAVE_AVX512,
    HAVE_AVX512DQ,
    HAVE_VPOPCNT,
    LUT_BITS,
    _bitlen,
    _bits_from_f64,
    _costs8,
    _costs8_32,
    _f32_from_bits,
    _f64_from_bits,
    _neg_mask,
    _planes_abs,
    _planes_abs8,
    _popcount,
    _q_float,
    _q_int,
    _round_like,
    _tzcnt,
)
from ccoll.compressor.cpu.v2blocks import (
    CODE_RAW64_V2,
    CODE_RAW_V2,
    DIRECT32,
    KIND_PP,
    KIND_RAW,
    KIND_RAW64,
    KIND_SP,
    NCODES,
    NO_BLOCK,
    PLANES_MAX_W,
    _choose,
    _choose_max,
    _choose_planes,
    _code_bits,
    _copy_bits,
    _d32_ok,
    _decode_lut_at,
    _decode_pp32_at,
    _emit_planes,
    _emit_q,
    _emit_raw_bits,
    _get,
    _lut_ok,
    _place_words,
    _push,
    _put,
    _qwidth,
    _read_planes,
    _read_q,
    _read_q_at,
    _read_raw,
    _read_raw_at,
    _reader_at,
    _sum_planes,
    _writer_at,
)
from ccoll.errors import FormatError, InputError

__all__ = ["compress_abs_v2", "add_v2", "add_data_v2", "validate_v2"]


# ----------------------------------------------------------------------------- compression


@njit(nogil=True, cache=True, inline="always")
def _quantize_v2(x, ub, m, eb, step, q):  # type: ignore[no-untyped-def]
    """v1's ``_quantize`` (same arithmetic, same acceptance) giving what rules 3-4 need.

    The block is ``x[ub : ub + m]`` (``ub`` unsigned), indexed from its start rather than
    sliced: a slice costs reference-count calls per block in the parfor.
    Returns (1 if a lane is rejected, else 0; max ``|q|``); ``q`` receives the quantized
    values (padding lanes 0). The magnitudes are not stored: :func:`_planes_abs` takes
    them from ``q``, and the non-zero count is the population count of their lowest
    suffix OR. Rejection is an AND of the lanes' acceptance rather than a count (a
    count took four vector instructions per 8 lanes, the AND one). The reconstruction
    multiplies the floored value itself rather than ``float64(q)``: both are the same
    integer-valued double (``|q| < 2^31``), and the conversion back is saved.
    """
    allok = True
    mx = np.int64(0)
    mx32 = np.int32(0)
    if m == BLOCK:
        for l in range(BLOCK):  # constant trip count, branch-free: vectorized
            xd = np.float64(x[ub + np.uint64(l)])
            v = xd / step
            inr = abs(v) < QLIM
            vv = v if inr else 0.0
            fq = np.floor(vv + 0.5)
            yd = _round_like(fq * step, x)
            allok &= inr & (abs(yd - xd) < eb)
            if HAVE_AVX512DQ:
                qi = np.int64(fq)
                q[l] = qi
                mx = max(mx, abs(qi))
            else:  # 32-bit lanes: AVX2 has their max and abs, not the 64-bit ones
                qs = np.int32(fq)
                q[l] = qs
                mx32 = max(mx32, abs(qs))
        if not HAVE_AVX512DQ:
            mx = np.int64(mx32)
    else:
        for l in range(BLOCK):
            qi = np.int64(0)
            if l < m:
                xd = np.float64(x[ub + np.uint64(l)])
                v = xd / step
                inr = abs(v) < QLIM
                vv = v if inr else 0.0
                fq = np.floor(vv + 0.5)
                qi = _q_int(fq)
                yd = _round_like(fq * step, x)
                allok &= inr & (abs(yd - xd) < eb)
            q[l] = qi
            mx = max(mx, abs(qi))
    return np.int64(not allok), mx


# Scratch words per chunk of the lossy plan pass: 8 per block (a quarter of a float32
# block). A chunk whose payload fits is packed there while it is planned, so it is
# quantized once; a chunk that does not fit (dense or raw data, ratio below 4 in float32)
# is quantized again by the write pass, as before. The scratch is a quarter of a float32
# input (an eighth of a float64 one); with transparent huge pages most of it counts
# towards peak memory (docs/performance.md, "Format v2 on the CPU").
SCRATCH_WORDS = 8 * CHUNK_BLOCKS + 1


# The plan pass works on the 32 blocks of a bitmap word at a time, in three steps:
# quantize every block and keep its bit-planes, then choose every block's code, then pack
# them. The packing's branches (the block's kind, the loops over its k low planes and h
# high planes) depend on the code; decided a group earlier, they resolve as soon as they
# are reached, where right after the choice a mispredicted branch waited for the whole
# chain of quantization, planes and choice of its block. GROUP_PLANES planes per block.
GROUP_PLANES = 32


# The plan pass's quantized values: int32 where the CPU lacks AVX-512DQ, which then
# quantizes in 32-bit lanes (|q| < 2^31), so that no lane is widened to 64 bits and back.
Q_LANE = np.int64 if HAVE_AVX512DQ else np.int32

# Without a vector popcount (AVX2) the 8 costs of a small block are computed in 32-bit
# lanes (intrinsics._costs8_32): the same key.
COSTS32 = not HAVE_VPOPCNT


@njit(nogil=True, cache=True, inline="always")
def _choose_block(SS, o, mx, is32):  # type: ignore[no-untyped-def]
    """Code and payload bits of a quantized block with max ``mx >= 1`` (rules 3-4).

    ``SS[o + j]`` are the suffix ORs of its planes. Below ``2^8`` all 8 costs are computed
    at once (:func:`_costs8`, no loop whose end depends on the data); wider blocks take
    :func:`_choose_max`. The same codes either way.
    """
    c = _popcount(SS[o])
    v = _bitlen(mx - 1)
    if mx < 256:
        key = _costs8_32(SS, o, mx, BITLEN8) if COSTS32 else _costs8(SS, o, mx)
        k = key & 7
        best = key >> 3
        if c <= 4 and c * (6 + v) <= best:
            return (KIND_SP << 10) | ((c - 1) << 5) | v, c * (6 + v)
        return (k << 5) | _bitlen((mx >> k) - 1), best - 32
    code = _choose_max(SS, o, mx, c)
    M = SS[o + ((code >> 5) & 31)] if (code >> 10) == KIND_PP else np.int64(0)
    return code, _code_bits(code, M, is32)


@njit(parallel=True, nogil=True, cache=True)
def _plan_lossy(x, bits_, eb, step, small, codes, chunk_nnz, chunk_nmask, chunk_bits, S,
                omasks, packed, present):  # type: ignore[no-untyped-def]
    """Pass 1: every block's code (``NO_BLOCK`` for a zero block) and per-chunk sums.

    Each chunk's payload also goes to its region of ``S`` (from word
    ``c * SCRATCH_WORDS``) and its mask words to ``omasks[b0:]``, with ``packed[c] = 1``,
    unless it would not fit. ``present[code]`` is set to 1 for every code used (chunks
    may store the same 1 concurrently; the result is the set of codes either way, and
    it saves :func:`_presence`'s serial pass over the codes). The blocks go 32 at a time
    (one bitmap word): quantized, then coded, then packed (see ``GROUP_PLANES``).
    """
    n = x.size
    nblocks = codes.size
    is32 = x.itemsize == 4
    wide = not is32
    rawbits = 1024 if is32 else 2048
    room = (SCRATCH_WORDS - 1) * 32
    for c in prange(chunk_nnz.size):
        q = np.empty(BLOCK, Q_LANE)
        H = np.empty(BLOCK, np.int64)
        TT = np.empty(32 * GROUP_PLANES, np.int64)  # planes of the group's blocks
        SS = np.empty(32 * GROUP_PLANES, np.int64)  # and their suffix ORs
        MX = np.empty(32, np.int64)  # max |q| of each block; 0 zero, -1 raw
        NEG = np.empty(32, np.int64)  # sign words
        CODE = np.empty(32, np.int64)
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        s0 = c * SCRATCH_WORDS * 32
        sp, sa, sn = _writer_at(s0)
        pack = True
        nz = 0
        nm = 0
        bits = 0
        zprev = True
        for g in range(b0, b1, 32):
            ge = min(g + 32, b1)
            nzw = np.int64(0)  # the group's non-zero blocks
            for b in range(g, ge):
                i = b - g
                base = b * BLOCK
                e = min(base + BLOCK, n)
                ub = np.uint64(base)  # unsigned: no negative-index wraparound per lane
                # The shortcut for a zero block is tried only after a zero block: it
                # decides as the full path does, so skipping it changes nothing, and
                # where zero blocks are a minority (REL 1e-3 and below) its
                # data-dependent branch mispredicted often.
                if e - base == BLOCK and zprev:
                    tiny = True
                    for l in range(BLOCK):
                        tiny &= abs(x[ub + np.uint64(l)]) <= small
                    if tiny:
                        continue
                bad, mx = _quantize_v2(x, ub, e - base, eb, step, q)
                MX[i] = -bad | mx
                zprev = MX[i] == 0
                nzw |= np.int64(not zprev) << i
                if mx and not bad:
                    # Rules 3-4 on the bit-planes of |q| (a few vector ops each): p_k are
                    # population counts, and the payload is written from the same
                    # planes. Magnitudes below 2^8 (most blocks at REL 1e-3 and 1e-4):
                    # all 8 planes in straight-line code.
                    NEG[i] = _neg_mask(q)
                    if mx < 256:
                        _planes_abs8(q, TT, SS, GROUP_PLANES * i)
                    else:
                        _planes_abs(q, TT, SS, _bitlen(mx), GROUP_PLANES * i)
            for b in range(g, ge):
                codes[b] = NO_BLOCK
            mm = nzw
            while mm:
                i = _tzcnt(mm)
                mm &= mm - 1
                b = g + i
                mx = MX[i]
                if mx < 0:
                    code = np.int64(CODE_RAW_V2)
                    size = rawbits
                else:
                    code, size = _choose_block(SS, GROUP_PLANES * i, mx, is32)
                pack = pack and bits + size <= room
                if (code >> 10) == KIND_PP:
                    if pack:
                        omasks[b0 + nm] = SS[GROUP_PLANES * i + (code >> 5)]
                    nm += 1
                CODE[i] = code
                codes[b] = code
                present[code] = 1
                nz += 1
                bits += size
            mm = nzw if pack else 0
            while mm:
                i = _tzcnt(mm)
                mm &= mm - 1
                if MX[i] > 0:
                    sp, sa, sn, _ = _emit_planes(S, sp, sa, sn, CODE[i], TT, SS,
                                                 GROUP_PLANES * i, NEG[i], H)
                else:
                    base = (g + i) * BLOCK
                    e = min(base + BLOCK, n)
                    sp, sa, sn = _emit_raw_bits(S, sp, sa, sn, bits_[base:e], e - base, wide)
        if pack and sn:
            S[sp] = sa
        packed[c] = pack
        chunk_nnz[c] = nz
        chunk_nmask[c] = nm
        chunk_bits[c] = bits


@njit(parallel=True, nogil=True, cache=True)
def _plan_lossless(bits_, mask, is32, codes, chunk_nnz, chunk_nmask, chunk_bits):  # type: ignore[no-untyped-def]
    """Pass 1 of ``eb = 0``: a zero block iff every element is +-0.0, else raw."""
    n = bits_.size
    nblocks = codes.size
    rawbits = 1024 if is32 else 2048
    for c in prange(chunk_nnz.size):
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        nz = 0
        for b in range(b0, b1):
            base = b * BLOCK
            bb = bits_[base : min(base + BLOCK, n)]
            acc = np.uint64(0)
            for l in range(bb.size):
                acc |= np.uint64(bb[l]) & mask
            if acc == 0:
                codes[b] = NO_BLOCK
            else:
                codes[b] = CODE_RAW_V2
                nz += 1
        chunk_nnz[c] = nz
        chunk_nmask[c] = 0
        chunk_bits[c] = nz * rawbits


@njit(nogil=True, cache=True)
def _presence(codes, present):  # type: ignore[no-untyped-def]
    """Mark the codes that occur (the table is the marked codes, increasing)."""
    for b in range(codes.size):
        code = codes[b]
        if code >= 0:
            present[code] = 1


@njit(nogil=True, cache=True, inline="always")
def _zero_ends(idx, pay, ib, chunk_k, chunk_nnz, chunk_o, chunk_bits):  # type: ignore[no-untyped-def]
    """Zero the index and payload words that chunks' last, partial words are OR'd into.

    Before the chunks are written in parallel; :func:`_merge_ends` ORs those partial words
    in after them.
    """
    for c in range(chunk_k.size):
        ie = (chunk_k[c] + chunk_nnz[c]) * ib
        if ie & 31:
            idx[ie >> 5] = 0
        pe = chunk_o[c] + chunk_bits[c]
        if pe & 31:
            pay[pe >> 5] = 0


@njit(nogil=True, cache=True, inline="always")
def _merge_ends(idx, pay, ib, chunk_k, chunk_nnz, chunk_o, chunk_bits, last_idx,
                last_pay):  # type: ignore[no-untyped-def]
    """OR each chunk's last, partial index and payload words in, after every chunk is written."""
    for c in range(chunk_k.size):
        ie = (chunk_k[c] + chunk_nnz[c]) * ib
        if ie & 31:
            idx[ie >> 5] |= last_idx[c]
        pe = chunk_o[c] + chunk_bits[c]
        if pe & 31:
            pay[pe >> 5] |= last_pay[c]


@njit(parallel=True, nogil=True, cache=True)
def _write_v2(x, bits_, step, codes, rank, ib, chunk_k, chunk_r, chunk_o, bitmap, idx, masks,
              pay, S, omasks, packed, chunk_nnz, chunk_nmask, chunk_bits):  # type: ignore[no-untyped-def]
    """Pass 2: bitmap, index fields, mask words and payload of every chunk.

    A chunk the plan pass packed (``packed[c]``) is moved from its scratch region word-wise
    (:func:`_place_words`); the others are quantized again and packed here. The words
    that chunks' last, partial words are OR'd into are zeroed before the chunks run and
    the OR is done after them, serially (:func:`_zero_ends`, :func:`_merge_ends`; the add's
    :func:`_place_v2` does the same).
    """
    n = x.size
    nblocks = codes.size
    wide = x.itemsize == 8
    nch = chunk_k.size
    _zero_ends(idx, pay, ib, chunk_k, chunk_nnz, chunk_o, chunk_bits)
    last_idx = np.empty(nch, np.int64)
    last_pay = np.empty(nch, np.int64)
    for c in prange(nch):
        if packed[c]:
            ipos, iacc, inb = _writer_at(chunk_k[c] * ib)
            b0 = c * CHUNK_BLOCKS
            b1 = min(b0 + CHUNK_BLOCKS, nblocks)
            # A bitmap word from a compare of its 32 codes, then the index fields of its
            # set bits: no branch per block on whether it is zero.
            for base in range(b0, b1, 32):
                cw = codes[base : min(base + 32, b1)]
                word = np.int64(0)
                for l in range(cw.size):
                    word |= np.int64(cw[l] >= 0) << l
                bitmap[base >> 5] = word
                mm = word
                while mm:
                    code = np.int64(cw[_tzcnt(mm)])
                    ipos, iacc, inb = _put(idx, ipos, iacc, inb, rank[code], ib)
                    mm &= mm - 1
            r = chunk_r[c]
            for i in range(chunk_nmask[c]):
                masks[r + i] = omasks[b0 + i]
            last_idx[c] = iacc if inb else 0
            last_pay[c] = _place_words(S, c * SCRATCH_WORDS, pay, chunk_o[c], chunk_bits[c])
            continue
        q = np.empty(BLOCK, np.int64)
        mag = np.empty(BLOCK, np.uint32)
        tmp = np.empty(BLOCK, np.uint32)
        # The payload goes to a buffer of the chunk's own first (the emitters store
        # words before they are complete), then to its bit offset.
        P = np.empty(CHUNK_BLOCKS * (64 if wide else 32) + 1, np.uint32)
        ipos, iacc, inb = _writer_at(chunk_k[c] * ib)
        ppos, pacc, pnb = _writer_at(0)
        r = chunk_r[c]
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        word = np.int64(0)
        for b in range(b0, b1):
            code = np.int64(codes[b])
            if code >= 0:
                word |= np.int64(1) << (b & 31)
                ipos, iacc, inb = _put(idx, ipos, iacc, inb, rank[code], ib)
                base = b * BLOCK
                e = min(base + BLOCK, n)
                m = e - base
                if (code >> 10) == KIND_RAW:
                    ppos, pacc, pnb = _emit_raw_bits(P, ppos, pacc, pnb, bits_[base:e], m, wide)
                else:
                    xb = x[base:e]
                    if m == BLOCK:
                        for l in range(BLOCK):
                            # The arithmetic of _quantize; the block is known to be accepted.
                            qi = _q_int(np.floor(np.float64(xb[l]) / step + 0.5))
                            q[l] = qi
                            mag[l] = abs(qi)
                    else:
                        for l in range(BLOCK):
                            qi = np.int64(0)
                            if l < m:
                                qi = _q_int(np.floor(np.float64(xb[l]) / step + 0.5))
                            q[l] = qi
                            mag[l] = abs(qi)
                    ppos, pacc, pnb, M = _emit_q(P, ppos, pacc, pnb, code, q, mag, tmp)
                    if (code >> 10) == KIND_PP:
                        masks[r] = M
                        r += 1
            if (b & 31) == 31 or b == b1 - 1:
                bitmap[b >> 5] = word
                word = 0
        if pnb:
            P[ppos] = pacc
        last_idx[c] = iacc if inb else 0
        last_pay[c] = _place_words(P, 0, pay, chunk_o[c], chunk_bits[c])
    _merge_ends(idx, pay, ib, chunk_k, chunk_nnz, chunk_o, chunk_bits, last_idx, last_pay)


@njit(nogil=True, cache=True)
def _layout_v2(present, chunk_nnz, chunk_nmask, chunk_bits, table, rank, chunk_k, chunk_r,
               chunk_o):  # type: ignore[no-untyped-def]
    """Build the code table and do the three exclusive scans of compression in one call.

    ``table[:ntab]`` receives the codes present, increasing, and ``rank`` their index
    (what a flatnonzero, an arange and three :func:`_scan` calls gave, without their numpy
    calls per array). Returns ``(ntab, nnz, nmask, nbits)``.
    """
    ntab = 0
    for code in range(present.size):
        if present[code]:
            table[ntab] = code
            rank[code] = ntab
            ntab += 1
    nnz = _exclusive_scan(chunk_nnz, chunk_k)
    nmask = _exclusive_scan(chunk_nmask, chunk_r)
    nbits = _exclusive_scan(chunk_bits, chunk_o)
    return ntab, nnz, nmask, nbits


def _new_stream(hdr: fmt.StreamHeader, table: np.ndarray, out: np.ndarray | None = None
                ) -> np.ndarray:
    """Allocate (or check ``out``) and fill header, shape and table of a v2 stream."""
    res = (np.empty(hdr.nbytes, np.uint8) if out is None
           else _stream_out(out, hdr.nbytes, "max_nbytes(..., version=2)"))
    hdr.pack_into(res)
    tab = res[hdr.table_offset : hdr.index_offset]
    tab[:] = 0
    tab[: 2 * table.size] = table.astype("<u2").view(np.uint8)
    return res


def _sections(res: np.ndarray, hdr: fmt.StreamHeader
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    bitmap = res[hdr.bitmap_offset : hdr.table_offset].view(np.uint32)
    idx = res[hdr.index_offset : hdr.mask_offset].view(np.uint32)
    masks = res[hdr.mask_offset : hdr.payload_offset].view(np.uint32)
    pay = res[hdr.payload_offset : hdr.nbytes].view(np.uint32)
    return bitmap, idx, masks, pay


def _compressed_stream(hdr: fmt.StreamHeader, table: np.ndarray, out: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_new_stream` and :func:`_sections` in one call: the stream and its sections."""
    res = _new_stream(hdr, table, out)
    return (res, *_sections(res, hdr))


def check_v2_size(n: int) -> None:
    """Refuse arrays that version 2 cannot hold (``n >= 2^37``)."""
    if n >= fmt.MAX_N_V2:
        raise InputError(
            f"an array of {n} elements is too large for stream format version 2 (fewer than "
            "2^37 elements): compress it with version=1, which holds up to 2^48"
        )


def compress_abs_v2(x: np.ndarray, eb: float) -> np.ndarray:
    """Compress a contiguous native float32/float64 host array as a version-2 stream.

    ``eb`` must be finite and ``>= 0`` (checked by the caller); ``eb = 0`` is lossless.
    """
    flat = _readonly(x.reshape(-1))
    n = flat.size
    check_v2_size(n)
    is32 = flat.dtype == np.float32
    nblocks = (n + BLOCK - 1) // BLOCK
    nch = _nchunks(nblocks)
    codes = np.empty(nblocks, np.int16)
    chunk_nnz = np.empty(nch, np.int64)
    chunk_nmask = np.empty(nch, np.int64)
    chunk_bits = np.empty(nch, np.int64)
    bits_ = flat.view(np.uint32) if is32 else flat.view(np.uint64)
    step = 2.0 * eb
    present = np.zeros(NCODES, np.uint8)
    packed = np.zeros(nch, np.uint8)
    omasks = np.empty(nblocks if eb else 0, np.uint32)
    S = np.empty(nch * SCRATCH_WORDS if eb else 0, np.uint32)
    # One launch context for both passes: with few elements it sets numba's thread count
    # to 1 and back, which costs about as much as a small array's plan pass.
    with _threads_for(n) if nblocks else nullcontext():
        if nblocks:
            if eb == 0.0:
                mask = np.uint64(0x7FFFFFFF if is32 else 0x7FFFFFFFFFFFFFFF)
                _plan_lossless(bits_, mask, is32, codes, chunk_nnz, chunk_nmask, chunk_bits)
                _presence(codes, present)
            else:
                _plan_lossy(flat, bits_, eb, step, _small(eb, flat.dtype), codes, chunk_nnz,
                            chunk_nmask, chunk_bits, S, omasks, packed, present)
        table = np.empty(NCODES, np.uint16)
        rank = np.empty(NCODES, np.int64)
        chunk_k = np.empty(nch, np.int64)
        chunk_r = np.empty(nch, np.int64)
        chunk_o = np.empty(nch, np.int64)
        ntab, nnz, nmask, nbits = _layout_v2(present, chunk_nnz, chunk_nmask, chunk_bits,
                                             table, rank, chunk_k, chunk_r, chunk_o)
        ib = fmt.bitlen(ntab - 1) if ntab > 1 else 0
        hdr = fmt.StreamHeader(dtype=flat.dtype, shape=tuple(x.shape), eb=eb, bound=eb,
                               nnz=nnz, payload_words=(nbits + 31) // 32,
                               version=fmt.VERSION2, nmask=nmask, ntab=ntab)
        res, bitmap, idx, masks, pay = _compressed_stream(hdr, table[:ntab])
        if nblocks:
            _write_v2(flat, bits_, step, codes, rank, ib, chunk_k, chunk_r, chunk_o, bitmap,
                      idx, masks, pay, S, omasks, packed, chunk_nnz, chunk_nmask, chunk_bits)
    return res


# ------------------------------------------------------------------------------ validation


class LayoutV2:
    """A validated version-2 stream: header, section views and per-chunk offsets."""

    __slots__ = ("hdr", "bitmap", "table", "idx", "masks", "W", "ib", "chunk_k", "chunk_r",
                 "chunk_o")

    def __init__(self, hdr: fmt.StreamHeader, bitmap: np.ndarray, table: np.ndarray,
                 idx: np.ndarray, masks: np.ndarray, W: np.ndarray, chunk_k: np.ndarray,
                 chunk_r: np.ndarray, chunk_o: np.ndarray) -> None:
        self.hdr = hdr
        self.bitmap = bitmap
        self.table = table
        self.idx = idx
        self.masks = masks
        self.W = W
        self.ib = hdr.index_bits
        self.chunk_k = chunk_k
        self.chunk_r = chunk_r
        self.chunk_o = chunk_o


# Errors of _check_v2, in the order they are checked (docs/format.md, "Robustness").
(E_BITMAP_TAIL, E_BITMAP_COUNT, E_TABLE_PAD, E_CODE, E_TABLE_ORDER, E_INDEX_PAD, E_INDEX,
 E_NMASK, E_SIZES, E_PAYLOAD_TAIL) = range(1, 11)


@njit(parallel=True, nogil=True, cache=True)
def _check_v2(bitmap, tabbytes, idx, masks, W, nblocks, nnz, nmask, payload_words, ib, is32,
              table, coef, chunk_k, chunk_r, chunk_o, cnt):  # type: ignore[no-untyped-def]
    """Check a stream's sections before its payload is read; one call, one index pass.

    Fills ``table`` (the codes) and the per-chunk offsets ``chunk_k`` (index field),
    ``chunk_r`` (mask word) and ``chunk_o`` (payload bit); ``coef`` (one per block) and
    ``cnt`` (one per chunk) are scratch. Returns 0 and 0, or the first failed check
    (``E_*``) and the number its message quotes. A block's size is a part that follows
    from its code and, for patched planes, ``popcount(mask) * (h + (k == 0))``: the index
    pass sums the first and keeps each patched-planes block's factor at the chunk's
    blocks, and once the mask offsets are known a pass over the masks adds the second.
    """
    nch = chunk_k.size
    tail = nblocks % 32
    if tail and np.int64(bitmap[bitmap.size - 1]) >> tail:
        return E_BITMAP_TAIL, 0
    for c in prange(nch):
        cnt[c] = _chunk_nonzero(bitmap, c)
    total = _exclusive_scan(cnt, chunk_k)
    if total != nnz:
        return E_BITMAP_COUNT, total
    ntab = table.size
    for i in range(2 * ntab, tabbytes.size):
        if tabbytes[i]:
            return E_TABLE_PAD, 0
    fixed = np.empty(ntab, np.int64)  # payload bits that follow from the code alone
    factor = np.empty(ntab, np.int64)  # times popcount(mask); -1: not patched planes
    for i in range(ntab):
        code = np.int64(tabbytes[2 * i]) | (np.int64(tabbytes[2 * i + 1]) << 8)
        kind = code >> 10
        a = (code >> 5) & 31
        b = code & 31
        ok = (code >> 12) == 0
        if kind == KIND_PP:
            ok &= a <= 30
            fixed[i] = 32 * (a + (a > 0))
            factor[i] = b + (a == 0)
        elif kind == KIND_SP:
            ok &= a <= 3
            fixed[i] = (a + 1) * (6 + b)
            factor[i] = -1
        else:
            ok &= a == 0 and b == 0 and (kind == KIND_RAW or is32)
            fixed[i] = 1024 if kind == KIND_RAW and is32 else 2048
            factor[i] = -1
        if not ok:
            return E_CODE, code
        table[i] = code
    for i in range(1, ntab):
        if table[i] <= table[i - 1]:
            return E_TABLE_ORDER, 0
    used = nnz * ib
    if used & 31 and np.int64(idx[idx.size - 1]) >> (used & 31):
        return E_INDEX_PAD, 0
    for c in prange(nch):
        pos, acc, nb = _reader_at(idx, chunk_k[c] * ib)
        b0 = c * CHUNK_BLOCKS
        end = chunk_k[c + 1] if c + 1 < nch else nnz
        nm = 0
        bits = np.int64(0)
        for _ in range(end - chunk_k[c]):
            i, pos, acc, nb = _get(idx, pos, acc, nb, ib)
            if i >= ntab:
                nm = -1
                break
            bits += fixed[i]
            f = factor[i]
            if f >= 0:
                coef[b0 + nm] = f
                nm += 1
        cnt[c] = nm
        chunk_o[c] = bits
    for c in range(nch):
        if cnt[c] < 0:
            return E_INDEX, 0
    total = _exclusive_scan(cnt, chunk_r)
    if total != nmask:
        return E_NMASK, total
    for c in prange(nch):
        r = chunk_r[c]
        b0 = c * CHUNK_BLOCKS
        bits = chunk_o[c]
        for j in range(cnt[c]):
            bits += _popcount(np.int64(masks[r + j])) * np.int64(coef[b0 + j])
        cnt[c] = bits
    nbits = _exclusive_scan(cnt, chunk_o)
    if (nbits + 31) // 32 != payload_words:
        return E_SIZES, nbits
    if nbits & 31 and np.int64(W[W.size - 1]) >> (nbits & 31):
        return E_PAYLOAD_TAIL, 0
    return 0, 0


def _stream_words(buf: np.ndarray) -> np.ndarray:
    """Read-only, 4-byte aligned view (or copy) of a stream.

    Aligned or not as a word view of its first bytes says (``buf.ctypes.data`` costs 1.4
    us, this 0.5).
    """
    if buf.size >= 4:
        aligned = buf[:4].view(np.uint32).flags.aligned
    else:
        aligned = buf.ctypes.data % 4 == 0
    return _readonly(buf if aligned else buf.copy())


def _check_message(err: int, val: int, hdr: fmt.StreamHeader) -> str:
    return {
        E_BITMAP_TAIL: f"stream bitmap has bits set beyond its {hdr.nblocks} blocks",
        E_BITMAP_COUNT: f"stream bitmap has {val} non-zero blocks, its header says {hdr.nnz}",
        E_TABLE_PAD: "stream code table padding is not zero",
        E_CODE: f"stream code table holds the invalid code {val:#x}",
        E_TABLE_ORDER: "stream code table is not strictly increasing",
        E_INDEX_PAD: "stream index padding bits are not zero",
        E_INDEX: f"stream index field is not below ntab = {hdr.ntab}",
        E_NMASK: f"stream has {val} patched-planes blocks, its header says nmask = {hdr.nmask}",
        E_SIZES: f"stream block sizes add up to {val} payload bits, its header says "
                 f"{hdr.payload_words} words",
        E_PAYLOAD_TAIL: "stream payload bits after the last block are not zero",
    }[err]


def validate_v2(buf: np.ndarray, hdr: fmt.StreamHeader | None = None) -> LayoutV2:
    """Check a version-2 stream before its payload is read (docs/format.md, "Robustness")."""
    if hdr is None:
        hdr = fmt.parse_header(buf)
    nblocks = hdr.nblocks
    raw = _stream_words(buf)
    bitmap = raw[hdr.bitmap_offset : hdr.table_offset].view(np.uint32)
    tabbytes = raw[hdr.table_offset : hdr.index_offset]
    idx = raw[hdr.index_offset : hdr.mask_offset].view(np.uint32)
    masks = raw[hdr.mask_offset : hdr.payload_offset].view(np.uint32)
    W = raw[hdr.payload_offset : hdr.nbytes].view(np.uint32)
    nch = _nchunks(nblocks)
    table = np.empty(hdr.ntab, np.int64)
    chunk_k = np.empty(nch, np.int64)
    chunk_r = np.empty(nch, np.int64)
    chunk_o = np.empty(nch, np.int64)
    with _threads_for(hdr.n):
        err, val = _check_v2(bitmap, tabbytes, idx, masks, W, nblocks, hdr.nnz, hdr.nmask,
                             hdr.payload_words, hdr.index_bits, hdr.dtype == np.float32, table,
                             np.empty(nblocks, np.uint8), chunk_k, chunk_r, chunk_o,
                             np.empty(nch, np.int64))
    if err:
        raise FormatError(_check_message(err, val, hdr))
    return LayoutV2(hdr, bitmap, table, idx, masks, W, chunk_k, chunk_r, chunk_o)


# ---------------------------------------------------------------------------- decompression


@njit(nogil=True, cache=True, inline="always")
def _q_narrow(code):  # type: ignore[no-untyped-def]
    """Whether every value of a quantized block of ``code`` has ``|q| < 2^31``.

    The compressor makes no other (docs/format.md, "Pre-quantization"), but the format
    allows patched planes of ``k + h`` up to 61 bits and sparse values of 31 bits plus 1.
    """
    if code >> 10 == KIND_SP:
        return (code & 31) <= 30
    return ((code >> 5) & 31) + (code & 31) <= 30


@njit(parallel=True, nogil=True, cache=True)
def _decode_v2(W, bitmap, table, idx, ib, masks, chunk_k, chunk_r, chunk_o, step, n, is32,
               out, outbits, errs):  # type: ignore[no-untyped-def]
    """Decode every block of a validated stream into ``out`` (float32, or float64 = wide).

    ``W`` (the payload) must hold at least 2 words (:func:`decode_into` pads a shorter
    one); the payload is read by bit offset (``v2blocks._field_at``). With AVX-512 and a
    float32 ``out``, a full block whose magnitudes are below ``2^LUT_BITS`` is looked up
    in a table of its outputs (``v2blocks._read_lut_at``, ``intrinsics._lut_store``);
    the others are converted lane by lane. ``out`` is indexed from the block's start,
    not sliced: a slice costs two reference-count calls per block in the parfor.
    ``errs[c]`` is set for a chunk holding a sparse block with positions out of order.
    """
    nblocks = (n + BLOCK - 1) // BLOCK
    same = (out.itemsize == 4) == is32
    last = 4 * W.size - 8
    use_lut = HAVE_AVX512 and out.itemsize == 4
    tab = np.empty(1 << LUT_BITS, np.float32)  # float32(float64(j) * step), as a lane's
    for j in range(1 << LUT_BITS):
        tab[j] = np.float64(j) * step
    lutok = np.empty(table.size, np.uint8)
    d32ok = np.empty(table.size, np.uint8)
    for t in range(table.size):
        lutok[t] = use_lut and _lut_ok(np.int64(table[t]))
        d32ok[t] = DIRECT32 and _d32_ok(np.int64(table[t]))
    for c in prange(chunk_k.size):
        qv = np.empty(BLOCK, np.int64)
        lo = np.empty(BLOCK, np.uint32)
        rb = np.empty(BLOCK, np.int64)
        pl = np.empty(LUT_BITS + 2, np.int64)
        sl = np.empty(4, np.int64)
        ipos, iacc, inb = _reader_at(idx, chunk_k[c] * ib)
        bit = chunk_o[c]
        r = chunk_r[c]
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        for b in range(b0, b1):
            ub = np.uint64(b * BLOCK)  # unsigned: no negative-index wraparound per lane
            m = min(BLOCK, n - b * BLOCK)
            if (np.int64(bitmap[b >> 5]) >> (b & 31)) & 1 == 0:
                if m == BLOCK:
                    for l in range(BLOCK):
                        out[ub + np.uint64(l)] = 0.0
                else:
                    for l in range(m):
                        out[ub + np.uint64(l)] = 0.0
                continue
            i, ipos, iacc, inb = _get(idx, ipos, iacc, inb, ib)
            code = np.int64(table[i])
            kind = code >> 10
            if kind <= 1:
                M = np.int64(0)
                if kind == KIND_PP:
                    M = np.int64(masks[r])
                    r += 1
                if lutok[i] and m == BLOCK and _popcount(M) * (code & 31) <= 64:
                    bit, err = _decode_lut_at(W, last, bit, code, M, pl, out, b * BLOCK, tab)
                elif d32ok[i] and m == BLOCK and _popcount(M) * (code & 31) <= 64:
                    bit = _decode_pp32_at(W, last, bit, code, M, lo, sl, out, b * BLOCK, step)
                    err = np.int64(0)
                else:
                    bit, err = _read_q_at(W, last, bit, code, M, qv, lo)
                    if _q_narrow(code):  # |q| < 2^31: converted 4 lanes at a time
                        for l in range(m):
                            out[ub + np.uint64(l)] = _q_float(qv[l]) * step
                    else:
                        for l in range(m):
                            out[ub + np.uint64(l)] = np.float64(qv[l]) * step
                if err:
                    errs[c] = 1
                    break
            elif kind == KIND_RAW:
                bit = _read_raw_at(W, last, bit, not is32, rb)
                if same:
                    for l in range(m):
                        outbits[ub + np.uint64(l)] = rb[l]
                else:
                    for l in range(m):
                        out[ub + np.uint64(l)] = _f32_from_bits(rb[l])
            else:
                bit = _read_raw_at(W, last, bit, True, rb)
                for l in range(m):
                    out[ub + np.uint64(l)] = _f64_from_bits(rb[l])


def decode_into(lay: LayoutV2, flat: np.ndarray) -> None:
    """Decode a validated stream into the flat float32/float64 array ``flat``."""
    hdr = lay.hdr
    if not hdr.n:
        return
    outbits = flat.view(np.uint32) if flat.dtype == np.float32 else flat.view(np.int64)
    errs = np.zeros(lay.chunk_k.size, np.uint8)
    W = lay.W
    if W.size < 2:  # the field reader loads 8 bytes at a time (v2blocks._field_at)
        W = _readonly(np.concatenate([W, np.zeros(2, np.uint32)]))
    with _threads_for(hdr.n):
        _decode_v2(W, lay.bitmap, lay.table, lay.idx, lay.ib, lay.masks, lay.chunk_k,
                   lay.chunk_r, lay.chunk_o, 2.0 * hdr.eb, hdr.n, hdr.dtype == np.float32,
                   flat, outbits, errs)
    if np.count_nonzero(errs):  # not errs.any(): 1.3 against 0.3 us
        raise FormatError("stream holds a sparse block whose positions are not increasing")


# ------------------------------------------------------------------------ homomorphic sum


@njit(nogil=True, cache=True, inline="always")
def _lane_value(kind, qv, rb, l, step, is32):  # type: ignore[no-untyped-def]
    """float64 value of lane ``l`` of a decoded block (quantized: ``q * step``, unrounded)."""
    if kind <= 1:
        return np.float64(qv[l]) * step
    if kind == KIND_RAW and is32:
        return _f32_from_bits(rb[l])
    return _f64_from_bits(rb[l])


@njit(nogil=True, cache=True, inline="always")
def _emit_raw_sum(S, pos, acc, nb, ka, qa, ra, kb, qb, rb, m, step, is32):  # type: ignore[no-untyped-def]
    """Write ``float64(a) + float64(b)`` per lane as 64-bit fields (one fixed NaN)."""
    for l in range(BLOCK):
        bits = np.int64(0)
        if l < m:
            s = _lane_value(ka, qa, ra, l, step, is32) + _lane_value(kb, qb, rb, l, step, is32)
            bits = _bits_from_f64(s) if s == s else np.int64(CANONICAL_NAN64)
        pos, acc, nb = _push(S, pos, acc, nb, bits & 0xFFFFFFFF, 32)
        pos, acc, nb = _push(S, pos, acc, nb, (bits >> 32) & 0xFFFFFFFF, 32)
    return pos, acc, nb


@njit(nogil=True, cache=True, inline="always")
def _sum_q(qa, qb, qs, mag, m):  # type: ignore[no-untyped-def]
    """``qs = qa + qb`` on valid lanes (padding 0); (overflow to raw, OR of ``|qs|``)."""
    big = np.int64(0)
    orq = np.int64(0)
    for l in range(BLOCK):
        t = qa[l] + qb[l] if l < m else np.int64(0)
        a = abs(t)
        big |= np.int64(a >= QMAX_ADD)
        orq |= a
        qs[l] = t
    return big, orq


@njit(nogil=True, cache=True, inline="always")
def _read_side(W, pos, acc, nb, code, M, is32, qv, lo, hi, rv):  # type: ignore[no-untyped-def]
    """Decode one operand's block: quantized into ``qv`` or raw bit patterns into ``rv``."""
    kind = code >> 10
    if kind <= 1:
        return _read_q(W, pos, acc, nb, code, M, qv, lo, hi)
    pos, acc, nb = _read_raw(W, pos, acc, nb, kind == KIND_RAW64 or not is32, rv)
    return pos, acc, nb, np.int64(0)


@njit(nogil=True, cache=True)
def _add_lanes(Wa, ap, aa, an, codea, Ma, Wb, bp, ba, bn, codeb, Mb, is32, m, step, S, sp, sa,
               sn, qa, qb, qs, ra, rb, lo, mag, tmp):  # type: ignore[no-untyped-def]
    """Sum of two non-zero blocks lane by lane, into the writer ``S, sp, sa, sn``.

    For the blocks the planes do not take (a raw block on either side, or magnitudes wider
    than ``PLANES_MAX_W``). It is rare, so it is called, not inlined: inlined beside the
    planes it doubled the add kernel's compile time. Returns both readers' and the
    writer's state, the sum's code (``NO_BLOCK`` for a zero sum), its mask word and an
    error flag (sparse positions not increasing).
    """
    ap, aa, an, e1 = _read_side(Wa, ap, aa, an, codea, Ma, is32, qa, lo, tmp, ra)
    bp, ba, bn, e2 = _read_side(Wb, bp, ba, bn, codeb, Mb, is32, qb, lo, tmp, rb)
    if e1 or e2:
        return ap, aa, an, bp, ba, bn, sp, sa, sn, np.int64(NO_BLOCK), np.int64(0), True
    sp, sa, sn, code, M = _sum_lanes(codea >> 10, qa, ra, codeb >> 10, qb, rb, is32, m, step,
                                     S, sp, sa, sn, qs, mag, tmp)
    return ap, aa, an, bp, ba, bn, sp, sa, sn, code, M, False


@njit(nogil=True, cache=True, inline="always")
def _sum_lanes(ka, qa, ra, kb, qb, rb, is32, m, step, S, sp, sa, sn, qs, mag, tmp):  # type: ignore[no-untyped-def]
    """Write the sum of two decoded non-zero blocks of kinds ``ka``, ``kb`` lane by lane.

    Quantized lanes in ``qa``/``qb``, raw bit patterns in ``ra``/``rb``. A raw block on
    either side, or a sum that reaches ``QMAX_ADD``, gives a raw sum. Returns the writer's
    state, the sum's code (``NO_BLOCK`` for a zero sum) and its mask word.
    """
    code = np.int64(NO_BLOCK)
    M = np.int64(0)
    raw = ka > 1 or kb > 1
    if not raw:
        big, orq = _sum_q(qa, qb, qs, mag, m)
        if big:
            raw = True
        elif orq != 0:
            code, _ = _choose(qs, mag)
            sp, sa, sn, M = _emit_q(S, sp, sa, sn, code, qs, mag, tmp)
    if raw:
        code = CODE_RAW64_V2 if is32 else CODE_RAW_V2
        sp, sa, sn = _emit_raw_sum(S, sp, sa, sn, ka, qa, ra, kb, qb, rb, m, step, is32)
    return sp, sa, sn, code, M


@njit(nogil=True, cache=True, inline="always")
def _note_sum(code, M, b, b0, b1, nz, nm, word, ocodes, omasks, bitmap):  # type: ignore[no-untyped-def]
    """Record block ``b``'s code in a sum (``NO_BLOCK``: a zero block) and its mask word.

    A chunk's codes and mask words are packed from ``ocodes[b0]`` and ``omasks[b0]``;
    its bitmap word is stored once its 32nd block (or the chunk's last) is recorded.
    Returns the updated counts and bitmap word.
    """
    if code >= 0:
        word |= np.int64(1) << (b & 31)
        ocodes[b0 + nz] = code
        nz += 1
        if (code >> 10) == KIND_PP:
            omasks[b0 + nm] = M
            nm += 1
    if (b & 31) == 31 or b == b1 - 1:
        bitmap[b >> 5] = word
        word = 0
    return nz, nm, word


@njit(nogil=True, cache=True, inline="always")
def _end_chunk(S, sp, sa, sn, s0, c, nz, nm, chunk_nnz, chunk_nmask, chunk_bits):  # type: ignore[no-untyped-def]
    """Flush a sum's chunk writer and store the chunk's counts (pass 1 of add/add_data)."""
    if sn:
        S[sp] = sa
    chunk_nnz[c] = nz
    chunk_nmask[c] = nm
    chunk_bits[c] = (sp * 32 + sn) - s0


@njit(parallel=True, nogil=True, cache=True)
def _add_v2_chunks(Wa, bma, ta, ia, iba, ma, cka, cra, coa, Wb, bmb, tb, ib_, ib_b, mb, ckb,
                   crb, cob, n, is32, step, ocodes, omasks, bitmap, reg, S, chunk_nnz,
                   chunk_nmask, chunk_bits, errs):  # type: ignore[no-untyped-def]
    """Pass 1 of an add: each chunk's sum, packed from bit ``32 * reg[c]`` of ``S``.

    Codes go to ``ocodes[b0:]`` and mask words to ``omasks[b0:]`` (``b0`` the chunk's first
    block), bitmap words in place.
    """
    nblocks = ocodes.size
    for c in prange(chunk_nnz.size):
        qa = np.empty(BLOCK, np.int64)
        qb = np.empty(BLOCK, np.int64)
        qs = np.empty(BLOCK, np.int64)
        ra = np.empty(BLOCK, np.int64)
        rb = np.empty(BLOCK, np.int64)
        lo = np.empty(BLOCK, np.uint32)
        mag = np.empty(BLOCK, np.uint32)
        tmp = np.empty(BLOCK, np.uint32)
        Pa = np.empty(BLOCK, np.int64)
        Pb = np.empty(BLOCK, np.int64)
        T = np.empty(BLOCK, np.int64)
        Sk = np.empty(BLOCK, np.int64)
        aip, aia, ain = _reader_at(ia, cka[c] * iba)
        ap, aa, an = _reader_at(Wa, coa[c])
        ar = cra[c]
        bip, bia, bin_ = _reader_at(ib_, ckb[c] * ib_b)
        bp, ba, bn = _reader_at(Wb, cob[c])
        br = crb[c]
        s0 = reg[c] * 32
        sp, sa, sn = _writer_at(s0)
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        nz = 0
        nm = 0
        word = np.int64(0)
        for b in range(b0, b1):
            za = (np.int64(bma[b >> 5]) >> (b & 31)) & 1
            zb = (np.int64(bmb[b >> 5]) >> (b & 31)) & 1
            if za == 0 and zb == 0:
                nz, nm, word = _note_sum(NO_BLOCK, 0, b, b0, b1, nz, nm, word, ocodes,
                                         omasks, bitmap)
                continue
            codea = np.int64(-1)
            Ma = np.int64(0)
            if za:
                i, aip, aia, ain = _get(ia, aip, aia, ain, iba)
                codea = np.int64(ta[i])
                if (codea >> 10) == KIND_PP:
                    Ma = np.int64(ma[ar])
                    ar += 1
            codeb = np.int64(-1)
            Mb = np.int64(0)
            if zb:
                i, bip, bia, bin_ = _get(ib_, bip, bia, bin_, ib_b)
                codeb = np.int64(tb[i])
                if (codeb >> 10) == KIND_PP:
                    Mb = np.int64(mb[br])
                    br += 1
            code = np.int64(NO_BLOCK)
            M = np.int64(0)
            if not zb:
                code = codea
                M = Ma
                ap, aa, an, sp, sa, sn = _copy_bits(Wa, ap, aa, an, S, sp, sa, sn,
                                                    _code_bits(codea, Ma, is32))
            elif not za:
                code = codeb
                M = Mb
                bp, ba, bn, sp, sa, sn = _copy_bits(Wb, bp, ba, bn, S, sp, sa, sn,
                                                    _code_bits(codeb, Mb, is32))
            elif (codea >> 10) <= 1 and (codeb >> 10) <= 1 and \
                    _qwidth(codea) <= PLANES_MAX_W and _qwidth(codeb) <= PLANES_MAX_W:
                # Both quantized and narrow: summed on bit-planes, never raw (v2blocks).
                m = min(BLOCK, n - b * BLOCK)
                vm = (np.int64(1) << m) - 1 if m < BLOCK else np.int64(0xFFFFFFFF)
                ap, aa, an, sga, wa, e1 = _read_planes(Wa, ap, aa, an, codea, Ma, vm, Pa)
                bp, ba, bn, sgb, wb, e2 = _read_planes(Wb, bp, ba, bn, codeb, Mb, vm, Pb)
                if e1 or e2:
                    errs[c] = 1
                    break
                neg, w = _sum_planes(Pa, wa, sga, Pb, wb, sgb, T)
                if w:
                    code = _choose_planes(T, w, Sk)
                    sp, sa, sn, M = _emit_planes(S, sp, sa, sn, code, T, Sk, 0, neg, Pa)
            else:
                m = min(BLOCK, n - b * BLOCK)
                (ap, aa, an, bp, ba, bn, sp, sa, sn, code, M,
                 err) = _add_lanes(Wa, ap, aa, an, codea, Ma, Wb, bp, ba, bn, codeb, Mb, is32,
                                   m, step, S, sp, sa, sn, qa, qb, qs, ra, rb, lo, mag, tmp)
                if err:
                    errs[c] = 1
                    break
            nz, nm, word = _note_sum(code, M, b, b0, b1, nz, nm, word, ocodes, omasks,
                                     bitmap)
        _end_chunk(S, sp, sa, sn, s0, c, nz, nm, chunk_nnz, chunk_nmask, chunk_bits)


@njit(nogil=True, cache=True)
def _layout_sum(ocodes, chunk_nnz, chunk_nmask, chunk_bits, table, rank, chunk_k, chunk_r,
                chunk_o):  # type: ignore[no-untyped-def]
    """:func:`_layout_v2` of a sum, whose codes are packed at the start of each chunk."""
    present = np.zeros(NCODES, np.uint8)
    for c in range(chunk_nnz.size):
        b0 = c * CHUNK_BLOCKS
        for i in range(b0, b0 + chunk_nnz[c]):
            present[ocodes[i]] = 1
    return _layout_v2(present, chunk_nnz, chunk_nmask, chunk_bits, table, rank, chunk_k,
                      chunk_r, chunk_o)


@njit(parallel=True, nogil=True, cache=True)
def _place_v2(ocodes, omasks, bitmap_t, S, reg, rank, ib, chunk_nnz, chunk_nmask, chunk_bits,
              chunk_k, chunk_r, chunk_o, bitmap, idx, masks, pay):  # type: ignore[no-untyped-def]
    """Pass 2 of an add: bitmap, index fields, mask words and payload bits of each chunk.

    The words that chunks' last, partial words are OR'd into are zeroed before the chunks
    run and the OR is done after them, serially, as :func:`_write_v2` does.
    """
    nch = chunk_nnz.size
    for i in range(bitmap_t.size):
        bitmap[i] = bitmap_t[i]
    _zero_ends(idx, pay, ib, chunk_k, chunk_nnz, chunk_o, chunk_bits)
    last_idx = np.empty(nch, np.int64)
    last_pay = np.empty(nch, np.int64)
    for c in prange(nch):
        b0 = c * CHUNK_BLOCKS
        ip, ia, inb = _writer_at(chunk_k[c] * ib)
        for i in range(chunk_nnz[c]):
            ip, ia, inb = _put(idx, ip, ia, inb, rank[ocodes[b0 + i]], ib)
        r = chunk_r[c]
        for i in range(chunk_nmask[c]):
            masks[r + i] = omasks[b0 + i]
        last_idx[c] = ia if inb else 0
        last_pay[c] = _place_words(S, reg[c], pay, chunk_o[c], chunk_bits[c])
    _merge_ends(idx, pay, ib, chunk_k, chunk_nnz, chunk_o, chunk_bits, last_idx, last_pay)


def _finish_sum(dtype: np.dtype, shape: tuple[int, ...], eb: float, bound: float, nterms: int,
                nblocks: int, ocodes: np.ndarray, omasks: np.ndarray, bitmap_t: np.ndarray,
                S: np.ndarray, reg: np.ndarray, chunk_nnz: np.ndarray, chunk_nmask: np.ndarray,
                chunk_bits: np.ndarray, n: int, out: np.ndarray | None) -> np.ndarray:
    """Build the summed stream from the chunks' scratch regions (pass 2 of add/add_data).

    Three kernel calls and the header (docs/performance.md, "A small call's fixed cost"):
    the table and the chunks' offsets, the stream's allocation, the placing.
    """
    nch = chunk_nnz.size
    table = np.empty(NCODES, np.uint16)
    rank = np.empty(NCODES, np.int64)
    chunk_k = np.empty(nch, np.int64)
    chunk_r = np.empty(nch, np.int64)
    chunk_o = np.empty(nch, np.int64)
    ntab, nnz, nmask, nbits = _layout_sum(ocodes, chunk_nnz, chunk_nmask, chunk_bits, table,
                                          rank, chunk_k, chunk_r, chunk_o)
    ib = fmt.bitlen(ntab - 1) if ntab > 1 else 0
    hdr = fmt.StreamHeader(dtype=dtype, shape=shape, eb=eb, bound=bound, nnz=nnz,
                           payload_words=(nbits + 31) // 32, nterms=nterms,
                           version=fmt.VERSION2, nmask=nmask, ntab=ntab)
    res, bitmap, idx, masks, pay = _compressed_stream(hdr, table[:ntab], out)
    if nch:
        with _threads_for(n):
            _place_v2(ocodes, omasks, bitmap_t, S, reg, rank, ib, chunk_nnz, chunk_nmask,
                      chunk_bits, chunk_k, chunk_r, chunk_o, bitmap, idx, masks, pay)
    return res


@njit(nogil=True, cache=True)
def _sum_regions(ao, awords, ak, annz, bo, bwords, bk, bnnz, reg):  # type: ignore[no-untyped-def]
    """Each chunk's scratch region of a sum of two streams: first word in ``reg``; the total.

    A copied block keeps its size, a raw sum is at most twice its raw operand, and a sum
    of two quantized blocks at most 2048 bits: C_0 - 32 <= 1024 where it stays quantized,
    but a sum whose ``|q|`` reaches ``2^31 - 1`` is stored raw, as float64 (two sparse
    blocks of 37 bits each holding ``2^31 - 2`` summed to a 2048-bit raw block, which
    overran a region sized for 1024: a heap overwrite, a crash or a wrong sum).
    ``ao``/``ak``: the first payload bit and index field of each of ``a``'s chunks
    (``awords`` payload words and ``annz`` blocks in all); the same of ``b``.
    """
    nch = reg.size
    t = np.int64(0)
    for c in range(nch):
        last = c + 1 == nch
        abits = (32 * awords if last else ao[c + 1]) - ao[c]
        bbits = (32 * bwords if last else bo[c + 1]) - bo[c]
        both = min((annz if last else ak[c + 1]) - ak[c], (bnnz if last else bk[c + 1]) - bk[c])
        reg[c] = t
        t += (2 * (abits + bbits) + 2048 * both + 31) // 32 + 1
    return t


def add_v2(la: LayoutV2, lb: LayoutV2, bound: float, nterms: int,
           out: np.ndarray | None = None) -> np.ndarray:
    """Homomorphic sum of two validated version-2 streams (docs/format.md)."""
    ha = la.hdr
    is32 = ha.dtype == np.float32
    n = ha.n
    nblocks = ha.nblocks
    nch = _nchunks(nblocks)
    reg = np.empty(nch, np.int64)
    total = _sum_regions(la.chunk_o, ha.payload_words, la.chunk_k, ha.nnz, lb.chunk_o,
                         lb.hdr.payload_words, lb.chunk_k, lb.hdr.nnz, reg)
    S = np.empty(max(total, 1), np.uint32)
    ocodes = np.empty(nblocks, np.int16)
    omasks = np.empty(nblocks, np.uint32)
    bitmap_t = np.empty((nblocks + 31) // 32, np.uint32)
    chunk_nnz = np.zeros(nch, np.int64)
    chunk_nmask = np.zeros(nch, np.int64)
    chunk_bits = np.zeros(nch, np.int64)
    errs = np.zeros(nch, np.uint8)
    if nch:
        with _threads_for(n):
            _add_v2_chunks(la.W, la.bitmap, la.table, la.idx, la.ib, la.masks, la.chunk_k,
                           la.chunk_r, la.chunk_o, lb.W, lb.bitmap, lb.table, lb.idx, lb.ib,
                           lb.masks, lb.chunk_k, lb.chunk_r, lb.chunk_o, n, is32, 2.0 * ha.eb,
                           ocodes, omasks, bitmap_t, reg, S, chunk_nnz, chunk_nmask,
                           chunk_bits, errs)
    if np.count_nonzero(errs):  # not errs.any(): 1.3 against 0.3 us
        raise FormatError("stream holds a sparse block whose positions are not increasing")
    return _finish_sum(ha.dtype, ha.shape, ha.eb, bound, nterms, nblocks, ocodes, omasks,
                       bitmap_t, S, reg, chunk_nnz, chunk_nmask, chunk_bits, n, out)


# ------------------------------------------------------------------ sum with raw data


# Scratch words per block of a chunk's region in add_data: no block of the sum takes more
# than 2048 bits (a raw float64 block, a raw sum's 64-bit fields, a copied block).
DATA_SUM_WORDS = 2 * BLOCK


@njit(nogil=True, cache=True)
def _add_lanes_x(Wa, ap, aa, an, codea, Ma, za, xbad, qb, rb, is32, m, step, S, sp, sa, sn,
                 qa, qs, ra, lo, mag, tmp):  # type: ignore[no-untyped-def]
    """:func:`_add_lanes` with the second operand a quantized (or raw, ``xbad``) block of data.

    For what the planes do not take: a raw block on either side, or magnitudes wider than
    ``PLANES_MAX_W``. With ``za == 0`` (the stream's block is zero) the data's quantized
    block is written as the compressor writes it (no overflow check: the add copies that
    block). Called, not inlined, as :func:`_add_lanes` is.
    """
    code = np.int64(NO_BLOCK)
    M = np.int64(0)
    if not za:
        code, _ = _choose(qb, mag)
        sp, sa, sn, M = _emit_q(S, sp, sa, sn, code, qb, mag, tmp)
        return ap, aa, an, sp, sa, sn, code, M, False
    ap, aa, an, e1 = _read_side(Wa, ap, aa, an, codea, Ma, is32, qa, lo, tmp, ra)
    if e1:
        return ap, aa, an, sp, sa, sn, code, M, True
    kb = np.int64(KIND_RAW) if xbad else np.int64(0)
    sp, sa, sn, code, M = _sum_lanes(codea >> 10, qa, ra, kb, qb, rb, is32, m, step, S, sp,
                                     sa, sn, qs, mag, tmp)
    return ap, aa, an, sp, sa, sn, code, M, False


@njit(parallel=True, nogil=True, cache=True)
def _add_data_v2_chunks(Wa, bma, ta, ia, iba, ma, cka, cra, coa, x, bits_, eb, step, small,
                        is32, ocodes, omasks, bitmap, S, chunk_nnz, chunk_nmask, chunk_bits,
                        errs):  # type: ignore[no-untyped-def]
    """Pass 1 of add_data: each chunk's ``a + compress(x)``, packed into its region of ``S``.

    ``x``'s blocks are quantized as :func:`_plan_lossy` quantizes them (the same zero,
    raw and quantized decisions) and added where they are: on bit-planes where both
    operands are narrow (a zero block of the stream counts as narrow, so the data's block
    alone is coded from the same planes), lane by lane (:func:`_add_lanes_x`) otherwise.
    Chunk ``c`` packs from word ``c * (DATA_SUM_WORDS * CHUNK_BLOCKS + 1)`` of ``S``.
    Codes, mask words and bitmap words as :func:`_add_v2_chunks`.
    """
    n = x.size
    nblocks = ocodes.size
    wide = not is32
    region = DATA_SUM_WORDS * CHUNK_BLOCKS + 1
    for c in prange(chunk_nnz.size):
        qa = np.empty(BLOCK, np.int64)
        qb = np.empty(BLOCK, np.int64)
        qs = np.empty(BLOCK, np.int64)
        ra = np.empty(BLOCK, np.int64)
        rb = np.empty(BLOCK, np.int64)
        lo = np.empty(BLOCK, np.uint32)
        mag = np.empty(BLOCK, np.uint32)
        tmp = np.empty(BLOCK, np.uint32)
        Pa = np.empty(BLOCK, np.int64)
        Pb = np.empty(BLOCK, np.int64)
        Sb = np.empty(BLOCK, np.int64)
        T = np.empty(BLOCK, np.int64)
        Sk = np.empty(BLOCK, np.int64)
        aip, aia, ain = _reader_at(ia, cka[c] * iba)
        ap, aa, an = _reader_at(Wa, coa[c])
        ar = cra[c]
        s0 = c * region * 32
        sp, sa, sn = _writer_at(s0)
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        nz = 0
        nm = 0
        word = np.int64(0)
        zprev = True
        for b in range(b0, b1):
            base = b * BLOCK
            e = min(base + BLOCK, n)
            m = e - base
            ub = np.uint64(base)
            za = (np.int64(bma[b >> 5]) >> (b & 31)) & 1
            # The data's block: zero, raw (bad) or quantized, decided as _plan_lossy does.
            xz = False
            if m == BLOCK and zprev:
                tiny = True
                for l in range(BLOCK):
                    tiny &= abs(x[ub + np.uint64(l)]) <= small
                xz = tiny
            bad = np.int64(0)
            mx = np.int64(0)
            if not xz:
                bad, mx = _quantize_v2(x, ub, m, eb, step, qb)
                xz = mx == 0 and bad == 0
            zprev = xz
            if za == 0 and xz:
                nz, nm, word = _note_sum(NO_BLOCK, 0, b, b0, b1, nz, nm, word, ocodes,
                                         omasks, bitmap)
                continue
            codea = np.int64(-1)
            Ma = np.int64(0)
            if za:
                i, aip, aia, ain = _get(ia, aip, aia, ain, iba)
                codea = np.int64(ta[i])
                if (codea >> 10) == KIND_PP:
                    Ma = np.int64(ma[ar])
                    ar += 1
            code = np.int64(NO_BLOCK)
            M = np.int64(0)
            if xz:
                code = codea
                M = Ma
                ap, aa, an, sp, sa, sn = _copy_bits(Wa, ap, aa, an, S, sp, sa, sn,
                                                    _code_bits(codea, Ma, is32))
            elif bad and za == 0:
                code = np.int64(CODE_RAW_V2)
                sp, sa, sn = _emit_raw_bits(S, sp, sa, sn, bits_[base:e], m, wide)
            elif bad == 0 and _bitlen(mx) <= PLANES_MAX_W and (
                    za == 0 or ((codea >> 10) <= 1 and _qwidth(codea) <= PLANES_MAX_W)):
                wa = np.int64(0)
                sga = np.int64(0)
                if za:
                    vm = (np.int64(1) << m) - 1 if m < BLOCK else np.int64(0xFFFFFFFF)
                    ap, aa, an, sga, wa, e1 = _read_planes(Wa, ap, aa, an, codea, Ma, vm, Pa)
                    if e1:
                        errs[c] = 1
                        break
                wb = _bitlen(mx)
                if mx < 256:
                    _planes_abs8(qb, Pb, Sb, 0)
                else:
                    _planes_abs(qb, Pb, Sb, wb, 0)
                neg, w = _sum_planes(Pa, wa, sga, Pb, wb, _neg_mask(qb), T)
                if w:
                    code = _choose_planes(T, w, Sk)
                    sp, sa, sn, M = _emit_planes(S, sp, sa, sn, code, T, Sk, 0, neg, Pa)
            else:
                if bad:
                    for l in range(m):
                        rb[l] = np.int64(bits_[base + l])
                (ap, aa, an, sp, sa, sn, code, M,
                 err) = _add_lanes_x(Wa, ap, aa, an, codea, Ma, za, bad != 0, qb, rb, is32, m,
                                     step, S, sp, sa, sn, qa, qs, ra, lo, mag, tmp)
                if err:
                    errs[c] = 1
                    break
            nz, nm, word = _note_sum(code, M, b, b0, b1, nz, nm, word, ocodes, omasks,
                                     bitmap)
        _end_chunk(S, sp, sa, sn, s0, c, nz, nm, chunk_nnz, chunk_nmask, chunk_bits)


def add_data_v2(la: LayoutV2, x: np.ndarray, bound: float, nterms: int) -> np.ndarray:
    """``add(a, compress_abs(x, eb, version=2))`` in one pass, ``x`` checked by the caller.

    Byte for byte that sum, without writing ``x``'s stream and reading it back: each of
    ``x``'s blocks is quantized as the compressor quantizes it and added to the stream's
    block where it is (:func:`_add_data_v2_chunks`), then the chunks are placed as the
    add places them. A stream without a bound (``eb = 0``, lossless) is summed through
    its compressed data.
    """
    ha = la.hdr
    flat = _readonly(np.ascontiguousarray(x).reshape(-1))
    eb = ha.eb
    if eb == 0.0:
        b = compress_abs_v2(flat.reshape(ha.shape), eb)
        return add_v2(la, validate_v2(b), bound, nterms)
    is32 = ha.dtype == np.float32
    n = ha.n
    nblocks = ha.nblocks
    nch = _nchunks(nblocks)
    region = DATA_SUM_WORDS * CHUNK_BLOCKS + 1
    S = np.empty(max(nch * region, 1), np.uint32)
    reg = np.arange(nch, dtype=np.int64) * region
    ocodes = np.empty(nblocks, np.int16)
    omasks = np.empty(nblocks, np.uint32)
    bitmap_t = np.empty((nblocks + 31) // 32, np.uint32)
    chunk_nnz = np.zeros(nch, np.int64)
    chunk_nmask = np.zeros(nch, np.int64)
    chunk_bits = np.zeros(nch, np.int64)
    errs = np.zeros(nch, np.uint8)
    bits_ = flat.view(np.uint32) if is32 else flat.view(np.uint64)
    if nch:
        with _threads_for(n):
            _add_data_v2_chunks(la.W, la.bitmap, la.table, la.idx, la.ib, la.masks,
                                la.chunk_k, la.chunk_r, la.chunk_o, flat, bits_, eb, 2.0 * eb,
                                _small(eb, flat.dtype), is32, ocodes, omasks, bitmap_t, S,
                                chunk_nnz, chunk_nmask, chunk_bits, errs)
    if np.count_nonzero(errs):  # not errs.any(): 1.3 against 0.3 us
        raise FormatError("stream holds a sparse block whose positions are not increasing")
    return _finish_sum(ha.dtype, ha.shape, eb, bound, nterms, nblocks, ocodes, omasks,
                       bitmap_t, S, reg, chunk_nnz, chunk_nmask, chunk_bits, n, None)
