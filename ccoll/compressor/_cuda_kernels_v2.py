"""numba-cuda kernels of the ccoll compressor, format v2 (docs/format.md, "Format version 2").

The layout of the work follows the v1 kernels (``_cuda_kernels``, docs/cuda.md): a warp
works on one 32-element block, lane ``l`` on element ``l``; a thread block of 8 warps owns a
tile of 32 blocks (one bitmap word), takes its tile from an atomic ticket and finds where its
blocks go with the v1 single-pass decoupled look-back (``_lookback``). The quantization is
v1's, through the same float64 helpers, so the same ``q`` comes out.

What is new in v2:

- the kind choice (patched planes ``PP(k, h)``, sparse ``SP(c, v)``, raw) is made from warp
  ballots and popcounts: ``p_k = popc(ballot(|q| >= 2^k))``, ``m`` by a max reduction;
- a tile's blocks need three offsets: the non-zero index ``j``, the mask index ``r`` and the
  payload bit offset ``o``. The first two are packed into one 64-bit look-back value
  (``j`` in the low half, ``r`` in the high half, both < 2^32 since ``n < 2^37``), the bit
  offset is the second value of the same look-back, so compression needs one look-back;
- the payload is a bit stream: every field is OR'd into a zeroed scratch buffer with an
  atomic OR (neighbouring blocks share words; an OR is order-independent, so the bytes do
  not depend on scheduling);
- the code table is the set of codes present: compression ORs a bit per code into a
  4096-bit set (codes are 12-bit), ``table_kernel`` ranks the set bits by a prefix popcount
  and the assembly writes the index fields from those ranks;
- decoding indexes a stream with three chained look-backs (non-zero index, then the mask
  index, which needs the codes, then the bit offset, which needs the masks), validating the
  bitmap, index, table, mask count, sizes and padding before any payload is read.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ccoll.compressor._cuda_kernels import (
    BLOCK,
    BPW,
    CANON_NAN64,
    FULL,
    QLIM,
    QMAX_ADD,
    TILE,
    TPB,
    WARPS,
    _ballot,
    _bitlen32,
    _bits_of_f64,
    _dadd,
    _ddiv,
    _dmul,
    _dsub,
    _f64_of_f32word,
    _f64_of_words,
    _lookback,
    _raw_words,
    _round_like,
    _scan,
    _store,
    _ticket,
    _value_of,
    _wmax,
    _words_of,
    _wsum,
)

__all__ = [
    "NCODES_SET",
    "compress2_kernel",
    "table_kernel",
    "assemble2_kernel",
    "index2_kernel",
    "decode2_kernel",
    "add2_kernel",
    "zero_kernel",
    "KERNELS",
    "signatures",
]

KIND_PP = 0
KIND_SP = 1
KIND_RAW = 2
KIND_RAW64 = 3
CODE_RAW = KIND_RAW << 10
CODE_RAW64 = KIND_RAW64 << 10
# Validation reasons (the largest found is reported; _cuda._BAD2_REASONS has the texts).
R_PAD = 1
R_SIZES = 2
R_NMASK = 3
R_COUNT = 4
R_SPARSE = 5
R_INDEX = 6
R_TABLE = 7
R_BEYOND = 8
ZERO = -1  # stands for a zero block: code 0 is PP(0, 0), a valid code
NCODES_SET = 4096  # codes are below 2^12: the presence set has 128 words

_JIT = dict(cache=True)  # fastmath stays off on purpose


# ----------------------------------------------------------------------- bit streams


@cuda.jit(device=True, inline="always")
def _put(pay, bit, val, width):  # type: ignore[no-untyped-def]
    """OR the ``width``-bit field ``val`` (int64 bit pattern, width <= 64) in at bit ``bit``.

    Atomic OR: a word may hold fields of neighbouring blocks written by other warps. Zero
    parts are skipped (the buffer starts zeroed).
    """
    if width == 0:
        return
    w = bit >> 5
    s = bit & 31
    v = np.int64(val)
    part = (v << s) & 0xFFFFFFFF
    if part != 0:
        cuda.atomic.or_(pay, w, np.uint32(part))
    if s + width > 32:
        part = (v >> (32 - s)) & 0xFFFFFFFF
        if part != 0:
            cuda.atomic.or_(pay, w + 1, np.uint32(part))
        if s + width > 64:
            part = (v >> (64 - s)) & ((np.int64(1) << s) - 1)
            if part != 0:
                cuda.atomic.or_(pay, w + 2, np.uint32(part))


@cuda.jit(device=True, inline="always")
def _get(buf32, w0, bit, width):  # type: ignore[no-untyped-def]
    """Read the ``width``-bit field (width <= 32) at bit ``bit`` of the bit stream at ``w0``."""
    if width == 0:
        return np.int64(0)
    w = w0 + (bit >> 5)
    s = bit & 31
    v = np.int64(buf32[w]) >> s
    if s + width > 32:
        v |= np.int64(buf32[w + 1]) << (32 - s)
    return v & ((np.int64(1) << width) - 1)


@cuda.jit(device=True, inline="always")
def _get64(buf32, w0, bit):  # type: ignore[no-untyped-def]
    """Read the 64-bit field at bit ``bit`` (a float64 bit pattern, as int64)."""
    lo = _get(buf32, w0, bit, 32)
    hi = _get(buf32, w0, bit + 32, 32)
    return lo | (hi << 32)


# --------------------------------------------------------------------------- codes


@cuda.jit(device=True, inline="always")
def _size_bits(code, mask, is32):  # type: ignore[no-untyped-def]
    """Payload bits of a block with ``code`` (ZERO: zero block) and mask word ``mask``.

    Defined for any 16-bit value, valid or not, so that validation can sum sizes first.
    """
    if code < 0:
        return np.int64(0)
    kind = code >> 10
    a = np.int64((code >> 5) & 31)
    b = np.int64(code & 31)
    if kind == KIND_PP:
        p = np.int64(cuda.popc(np.uint32(mask)))
        return (p if a == 0 else np.int64(32)) + 32 * a + p * b
    if kind == KIND_SP:
        return (a + 1) * (6 + b)
    if kind == KIND_RAW and is32:
        return np.int64(1024)
    return np.int64(2048)


@cuda.jit(device=True, inline="always")
def _code_ok(code, is32):  # type: ignore[no-untyped-def]
    """Tell whether a table entry is a valid code for the stream's dtype."""
    if code < 0 or code >= NCODES_SET:
        return False
    kind = code >> 10
    a = (code >> 5) & 31
    b = code & 31
    if kind == KIND_PP:
        return a <= 30
    if kind == KIND_SP:
        return a <= 3
    if kind == KIND_RAW:
        return a == 0 and b == 0
    return a == 0 and b == 0 and is32 != 0


# ---------------------------------------------------------------------- block coding


@cuda.jit(device=True, inline="always")
def _quantize(xb, b, valid, eb, step):  # type: ignore[no-untyped-def]
    """(q, accepted, raw field) of this lane; exactly v1's pre-quantization."""
    ok = True
    q = np.int64(0)
    lo = np.int64(0)
    hi = np.int64(0)
    if valid:
        lo, hi = _words_of(b, xb)
        if eb > 0.0:
            xd = _value_of(b, xb)
            v = _ddiv(xd, step)
            if abs(v) < QLIM:
                q = np.int64(math.floor(_dadd(v, 0.5)))
                yd = _round_like(_dmul(np.float64(q), step), xb)
                ok = abs(_dsub(yd, xd)) < eb
            else:
                ok = False
        else:
            # eb = 0: a block is zero when every element is +0.0 or -0.0, else raw.
            ok = (lo | (hi & 0x7FFFFFFF)) == 0 if _raw_words(xb) == 64 else (lo & 0x7FFFFFFF) == 0
    return q, ok, lo | (hi << 32)


@cuda.jit(device=True, inline="always")
def _choose(q):  # type: ignore[no-untyped-def]
    """(code, mask, payload bits) of quantized values ``q`` (|q| < 2^31 - 1); whole warp.

    "Encoding a block (version 2)", rules 2-4: code ZERO for a zero block.
    """
    nz = _ballot(q != 0)
    if nz == 0:
        return np.int64(ZERO), np.int64(0), np.int64(0)
    aq = abs(q)
    m = _wmax(aq)
    w = _bitlen32(m)
    c = np.int64(cuda.popc(np.uint32(nz)))
    best = np.int64(1) << 40
    kb = np.int64(0)
    hb = np.int64(0)
    for k in range(w):
        pk = np.int64(cuda.popc(np.uint32(_ballot(aq >= (np.int64(1) << k)))))
        hk = np.int64(_bitlen32((m >> k) - 1))
        cost = 32 + (pk if k == 0 else np.int64(32)) + 32 * k + pk * hk
        if cost < best:
            best = cost
            kb = np.int64(k)
            hb = hk
    v = np.int64(_bitlen32(m - 1))
    if c <= 4 and c * (6 + v) <= best:
        return (np.int64(KIND_SP << 10) | ((c - 1) << 5) | v), np.int64(0), c * (6 + v)
    mask = _ballot(aq >= (np.int64(1) << kb))
    return (kb << 5) | hb, mask, best - 32


@cuda.jit(device=True, inline="always")
def _write_block(pay, o, code, mask, val, lane, is32):  # type: ignore[no-untyped-def]
    """OR one block's payload fields in at bit ``o``; whole warp (``code`` not ZERO).

    ``val`` is this lane's ``q`` for the quantized kinds and its raw bit pattern (0 on
    padding lanes) for the raw kinds.
    """
    kind = code >> 10
    if kind == KIND_PP:
        k = (code >> 5) & 31
        h = code & 31
        aq = abs(val)
        high = (mask >> lane) & 1
        rank = np.int64(cuda.popc(np.uint32(mask & ((np.int64(1) << lane) - 1))))
        if k == 0:
            s = np.int64(cuda.popc(np.uint32(mask)))
            if high != 0 and val < 0:
                _put(pay, o + rank, 1, 1)
        else:
            s = np.int64(32)
            sw = _ballot(val < 0)
            if lane == 0:
                _put(pay, o, sw, 32)
        plane = np.int64(0)
        for j in range(k):
            pj = _ballot(((aq >> j) & 1) != 0)
            if lane == j:
                plane = pj
        if lane < k:
            _put(pay, o + s + 32 * lane, plane, 32)
        if high != 0:
            _put(pay, o + s + 32 * k + rank * h, (aq >> k) - 1, h)
    elif kind == KIND_SP:
        c = np.int64(((code >> 5) & 31) + 1)
        v = code & 31
        nz = _ballot(val != 0)
        if val != 0:
            rank = np.int64(cuda.popc(np.uint32(nz & ((np.int64(1) << lane) - 1))))
            _put(pay, o + 5 * rank, lane, 5)
            if val < 0:
                _put(pay, o + 5 * c + rank, 1, 1)
            _put(pay, o + 6 * c + rank * v, abs(val) - 1, v)
    elif kind == KIND_RAW and is32:
        _put(pay, o + 32 * lane, val & 0xFFFFFFFF, 32)
    else:
        _put(pay, o + 64 * lane, val, 64)


@cuda.jit(device=True, inline="always")
def _decode_block(buf32, w0, o, code, mask, lane, is32):  # type: ignore[no-untyped-def]
    """(q, raw bit pattern, positions ok) of this lane of a non-zero block; whole warp.

    ``q`` for the quantized kinds (int64), the raw field for the raw kinds. A sparse block
    whose positions are not strictly increasing reports False on every lane.
    """
    kind = code >> 10
    q = np.int64(0)
    raw = np.int64(0)
    ok = True
    if kind == KIND_PP:
        k = (code >> 5) & 31
        h = code & 31
        high = (mask >> lane) & 1
        rank = np.int64(cuda.popc(np.uint32(mask & ((np.int64(1) << lane) - 1))))
        neg = np.int64(0)
        if k == 0:
            s = np.int64(cuda.popc(np.uint32(mask)))
            if high != 0:
                neg = _get(buf32, w0, o + rank, 1)
        else:
            s = np.int64(32)
            neg = _get(buf32, w0, o + lane, 1)
        word = np.int64(0)
        if lane < k:
            word = _get(buf32, w0, o + s + 32 * lane, 32)
        mag = np.int64(0)
        for j in range(k):
            pj = cuda.shfl_sync(FULL, word, j)
            mag |= ((pj >> lane) & 1) << j
        if high != 0:
            mag += (_get(buf32, w0, o + s + 32 * k + rank * h, h) + 1) << k
        q = -mag if neg != 0 else mag
    elif kind == KIND_SP:
        c = np.int64(((code >> 5) & 31) + 1)
        v = code & 31
        pos = np.int64(-1)
        sv = np.int64(0)
        if lane < c:
            pos = _get(buf32, w0, o + 5 * lane, 5)
            sv = _get(buf32, w0, o + 6 * c + lane * v, v) + 1
            if _get(buf32, w0, o + 5 * c + lane, 1) != 0:
                sv = -sv
        nxt = cuda.shfl_down_sync(FULL, pos, 1)
        ok = _ballot(lane + 1 < c and nxt <= pos) == 0
        for i in range(c):
            pi = cuda.shfl_sync(FULL, pos, i)
            vi = cuda.shfl_sync(FULL, sv, i)
            if pi == lane:
                q = vi
    elif kind == KIND_RAW and is32:
        raw = _get(buf32, w0, o + 32 * lane, 32)
    else:
        raw = _get64(buf32, w0, o + 64 * lane)
    return q, raw, ok


@cuda.jit(device=True, inline="always")
def _lane_value(code, q, raw, is32, step):  # type: ignore[no-untyped-def]
    """float64 value of a lane of a non-zero block, for the raw sum of an add."""
    kind = code >> 10
    if kind == KIND_RAW and is32:
        return _f64_of_f32word(raw)
    if kind >= KIND_RAW:
        return _f64_of_words(raw & 0xFFFFFFFF, (raw >> 32) & 0xFFFFFFFF)
    return _dmul(np.float64(q), step)


# ------------------------------------------------------------------- tile placement


@cuda.jit(device=True, inline="always")
def _place_tile(tile, ntiles, lane, s_code, s_mask, s_size, s_off, s_misc, flags, vals,  # type: ignore[no-untyped-def]
                epoch, bitmap_s, codes_s, masks_s, pres, totals):
    """Warp 0: offsets of a tile's 32 blocks, their codes, masks and the presence set.

    ``s_off[j]`` gets block j's bit offset inside the tile, ``s_misc[1]`` the tile's first
    payload bit. One look-back carries (non-zero count | mask count << 32, payload bits).
    """
    sz = np.int64(s_size[lane])
    cd = np.int64(s_code[lane])
    inc = _scan(sz, lane)
    s_off[lane] = inc - sz
    total = cuda.shfl_sync(FULL, inc, 31)
    nzm = _ballot(cd >= 0)
    k0m = _ballot(cd >= 0 and (cd >> 10) == KIND_PP)
    cnt = np.int64(cuda.popc(np.uint32(nzm)))
    cnt0 = np.int64(cuda.popc(np.uint32(k0m)))
    ex0, ex1 = _lookback(flags, vals, tile, cnt | (cnt0 << 32), total, epoch, lane)
    lt = (np.int64(1) << lane) - 1
    if cd >= 0:
        codes_s[(ex0 & 0xFFFFFFFF) + cuda.popc(np.uint32(nzm & lt))] = cd
        cuda.atomic.or_(pres, cd >> 5, np.uint32(np.int64(1) << (cd & 31)))
        if (cd >> 10) == KIND_PP:
            masks_s[(ex0 >> 32) + cuda.popc(np.uint32(k0m & lt))] = np.uint32(s_mask[lane])
    if lane == 0:
        bitmap_s[tile] = np.uint32(nzm)
        s_misc[1] = ex1
        if tile == ntiles - 1:
            totals[0] = (ex0 & 0xFFFFFFFF) + cnt
            totals[1] = (ex0 >> 32) + cnt0
            totals[2] = ex1 + total


# ------------------------------------------------------------------------------ kernels


@cuda.jit(**_JIT)
def zero_kernel(a, n):  # type: ignore[no-untyped-def]
    """Zero ``a[:n]`` (the payload scratch that fields are OR'd into)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        a[i] = 0
        i += stride


@cuda.jit(**_JIT)
def compress2_kernel(xb, n, eb, step, ntiles, ctr, flags, vals, epoch,  # type: ignore[no-untyped-def]
                     bitmap_s, codes_s, masks_s, pay_s, pres, totals):
    """Compress bit view ``xb`` (int32 for float32, int64 for float64) into v2 scratch.

    Per tile: bitmap word, the codes of its non-zero blocks at their non-zero index (int32
    scratch), mask words at their mask index, payload bits OR'd into the zeroed ``pay_s``
    at their bit offsets, and every code into the presence set ``pres``. The last tile
    writes the totals (non-zero blocks, mask words, payload bits). Persistent thread blocks
    take tickets as in v1's ``compress_kernel``, so any grid writes the same bytes.
    """
    s_code = cuda.shared.array(TILE, np.int32)
    s_mask = cuda.shared.array(TILE, np.int64)
    s_size = cuda.shared.array(TILE, np.int64)
    s_off = cuda.shared.array(TILE, np.int64)
    s_misc = cuda.shared.array(4, np.int64)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    is32 = _raw_words(xb) == 32
    ntakes = ntiles + np.int64(cuda.gridDim.x)
    xw = cuda.local.array(BPW, np.int64)
    qv = cuda.local.array(BPW, np.int64)
    while True:
        if tid == 0:
            s_misc[0] = _ticket(ctr, ntakes)
        cuda.syncthreads()
        tile = s_misc[0]
        if tile >= ntiles:
            break
        for k in range(BPW):
            i = (tile * TILE + warp * BPW + k) * BLOCK + lane
            xw[k] = np.int64(xb[i]) if i < n else np.int64(0)
        for k in range(BPW):
            j = warp * BPW + k
            valid = (tile * TILE + j) * BLOCK + lane < n
            q, ok, rawv = _quantize(xb, xw[k], valid, eb, step)
            if _ballot(not ok) != 0:
                code = np.int64(CODE_RAW)
                mask = np.int64(0)
                size = np.int64(1024 if is32 else 2048)
                qv[k] = rawv
            else:
                code, mask, size = _choose(q)
                qv[k] = q
            if lane == 0:
                s_code[j] = code
                s_mask[j] = mask
                s_size[j] = size
        cuda.syncthreads()
        if warp == 0:
            _place_tile(tile, ntiles, lane, s_code, s_mask, s_size, s_off, s_misc, flags, vals,
                        epoch, bitmap_s, codes_s, masks_s, pres, totals)
        cuda.syncthreads()
        base = s_misc[1]
        for k in range(BPW):
            j = warp * BPW + k
            code = np.int64(s_code[j])
            if code >= 0:
                _write_block(pay_s, base + s_off[j], code, s_mask[j], qv[k], lane, is32)


@cuda.jit(**_JIT)
def table_kernel(pres, tab, rank, totals):  # type: ignore[no-untyped-def]
    """Table from the presence set: ``tab[r]`` = the r-th present code, ``rank[code] = r``.

    One thread block of 128 threads, one per word of the set; ``totals[3]`` = ntab. Clears
    the set for the next call.
    """
    s_pre = cuda.shared.array(129, np.int64)
    t = cuda.threadIdx.x
    wv = np.int64(pres[t])
    s_pre[t + 1] = cuda.popc(np.uint32(wv))
    cuda.syncthreads()
    if t == 0:
        s_pre[0] = 0
        for i in range(128):
            s_pre[i + 1] += s_pre[i]
        totals[3] = s_pre[128]
    cuda.syncthreads()
    r = s_pre[t]
    bits = wv
    while bits != 0:
        b = cuda.ffs(np.uint32(bits)) - 1
        code = 32 * t + b
        tab[r] = code
        rank[code] = r
        r += 1
        bits &= bits - 1
    pres[t] = 0


@cuda.jit(**_JIT)
def assemble2_kernel(out32, bm_w0, nbw, bitmap_s, ntab, tab, nnz, ib, codes_s, rank,  # type: ignore[no-untyped-def]
                     nmask, masks_s, pwords, pay_s):
    """Write bitmap, table, index, masks and payload from scratch into a v2 stream."""
    tw = (ntab + 1) >> 1
    iw = (nnz * ib + 31) >> 5
    e1 = nbw + tw
    e2 = e1 + iw
    e3 = e2 + nmask
    total = e3 + pwords
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < total:
        v = np.int64(0)
        if i < nbw:
            v = np.int64(bitmap_s[i])
        elif i < e1:
            t = 2 * (i - nbw)
            v = np.int64(tab[t])
            if t + 1 < ntab:
                v |= np.int64(tab[t + 1]) << 16
        elif i < e2:
            bit0 = 32 * (i - e1)
            j = bit0 // ib
            while j < nnz and j * ib < bit0 + 32:
                f = np.int64(rank[codes_s[j]])
                sh = j * ib - bit0
                if sh >= 0:
                    v |= f << sh
                else:
                    v |= f >> (-sh)
                j += 1
            v &= 0xFFFFFFFF
        elif i < e3:
            v = np.int64(masks_s[i - e2])
        else:
            v = np.int64(pay_s[i - e3])
        out32[bm_w0 + i] = np.uint32(v)
        i += stride


@cuda.jit(device=True, inline="always")
def _tab_code(buf8, tab_off, idx):  # type: ignore[no-untyped-def]
    """Table entry ``idx`` (u16 little-endian) of a stream."""
    p = tab_off + 2 * idx
    return np.int64(buf8[p]) | (np.int64(buf8[p + 1]) << 8)


@cuda.jit(device=True, inline="always")
def _tile_codes(buf8, buf32, tab_off, idx_w0, mask_w0, ib, pre, t, is32, lane):  # type: ignore[no-untyped-def]
    """Bitmap word ``t`` of an indexed stream; lane i gets its i-th block's code, mask, bit.

    Only for streams ``index2_kernel`` validated: every read is in bounds then.
    """
    j0 = pre[3 * t]
    cnt = pre[3 * t + 3] - j0  # the next word's first index (pre has nbw + 1 rows)
    code = np.int64(ZERO)
    if lane < cnt:
        code = _tab_code(buf8, tab_off, _get(buf32, idx_w0, (j0 + lane) * ib, ib))
    k0 = _ballot(code >= 0 and (code >> 10) == KIND_PP)
    mask = np.int64(0)
    if (k0 >> lane) & 1:
        r = pre[3 * t + 1] + cuda.popc(np.uint32(k0 & ((np.int64(1) << lane) - 1)))
        mask = np.int64(buf32[mask_w0 + r])
    sz = _size_bits(code, mask, is32)
    inc = _scan(sz, lane)
    return code, mask, pre[3 * t + 2] + inc - sz


@cuda.jit(**_JIT)
def index2_kernel(buf8, buf32, bm_w0, tab_off, idx_w0, mask_w0, pay_w0, nnz, ntab, ib, nmask,  # type: ignore[no-untyped-def]
                  pwords, nblocks, nbw, is32, ntiles, ctr, flags_a, vals_a, flags_b, vals_b,
                  flags_c, vals_c, epoch, pre, bad, slot):
    """Validate a v2 stream's bitmap, table, index, masks and sizes; index it for decoding.

    Warp w of thread block t handles bitmap word 8t + w. Three chained look-backs give each
    word's first non-zero index, first mask index and first payload bit
    (``pre[3i:3i+3]``; row ``nbw`` holds the totals). Problems raise ``bad[slot]`` to at
    least ``(epoch << 4) | reason`` (``_cuda._BAD2_REASONS``).
    """
    s_a = cuda.shared.array(WARPS, np.int64)
    s_pa = cuda.shared.array(WARPS, np.int64)
    s_b = cuda.shared.array(WARPS, np.int64)
    s_pb = cuda.shared.array(WARPS, np.int64)
    s_c = cuda.shared.array(WARPS, np.int64)
    s_pc = cuda.shared.array(WARPS, np.int64)
    s_misc = cuda.shared.array(4, np.int64)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    if tid == 0:
        s_misc[0] = _ticket(ctr, ntiles)
    cuda.syncthreads()
    tile = s_misc[0]
    t = tile * WARPS + warp
    bw = np.int64(0)
    if t < nbw:
        bw = np.int64(buf32[bm_w0 + t])
    reason = 0
    if t == nbw - 1:
        tail = nblocks & 31
        if tail != 0 and (bw >> tail) != 0:
            reason = R_BEYOND
    cnt = np.int64(cuda.popc(np.uint32(bw)))
    # look-back 1: non-zero index
    if lane == 0:
        s_a[warp] = cnt
    cuda.syncthreads()
    if warp == 0:
        v = np.int64(0)
        if lane < WARPS:
            v = s_a[lane]
        inc = _scan(v, lane)
        tot = cuda.shfl_sync(FULL, inc, 31)
        ex, _ = _lookback(flags_a, vals_a, tile, tot, np.int64(0), epoch, lane)
        if lane < WARPS:
            s_pa[lane] = ex + inc - v
        if lane == 0:
            s_misc[1] = ex + tot
    cuda.syncthreads()
    j0 = s_pa[warp]
    j = j0 + lane
    code = np.int64(ZERO)
    if lane < cnt:
        if j < nnz:
            idx = _get(buf32, idx_w0, j * ib, ib)
            if idx < ntab:
                code = _tab_code(buf8, tab_off, idx)
            else:
                reason = max(reason, R_INDEX)
        else:
            reason = max(reason, R_COUNT)
    # look-back 2: mask index (the codes are known now)
    k0m = _ballot(code >= 0 and (code >> 10) == KIND_PP)
    if lane == 0:
        s_b[warp] = cuda.popc(np.uint32(k0m))
    cuda.syncthreads()
    if warp == 0:
        v = np.int64(0)
        if lane < WARPS:
            v = s_b[lane]
        inc = _scan(v, lane)
        tot = cuda.shfl_sync(FULL, inc, 31)
        ex, _ = _lookback(flags_b, vals_b, tile, tot, np.int64(0), epoch, lane)
        if lane < WARPS:
            s_pb[lane] = ex + inc - v
        if lane == 0:
            s_misc[2] = ex + tot
    cuda.syncthreads()
    r0 = s_pb[warp]
    mask = np.int64(0)
    if (k0m >> lane) & 1:
        r = r0 + cuda.popc(np.uint32(k0m & ((np.int64(1) << lane) - 1)))
        if r < nmask:
            mask = np.int64(buf32[mask_w0 + r])
        else:
            reason = max(reason, R_NMASK)
    # look-back 3: payload bit offset (the masks are known now)
    sz = _size_bits(code, mask, is32)
    wsz = _wsum(sz)
    if lane == 0:
        s_c[warp] = wsz
    cuda.syncthreads()
    if warp == 0:
        v = np.int64(0)
        if lane < WARPS:
            v = s_c[lane]
        inc = _scan(v, lane)
        tot = cuda.shfl_sync(FULL, inc, 31)
        ex, _ = _lookback(flags_c, vals_c, tile, tot, np.int64(0), epoch, lane)
        if lane < WARPS:
            s_pc[lane] = ex + inc - v
        if lane == 0:
            s_misc[3] = ex + tot
    cuda.syncthreads()
    if lane == 0 and t < nbw:
        pre[3 * t] = j0
        pre[3 * t + 1] = r0
        pre[3 * t + 2] = s_pc[warp]
    if tile == ntiles - 1:
        if tid == 0:
            pre[3 * nbw] = s_misc[1]
            pre[3 * nbw + 1] = s_misc[2]
            pre[3 * nbw + 2] = s_misc[3]
            if s_misc[1] != nnz:
                reason = max(reason, R_COUNT)
            elif s_misc[2] != nmask:
                reason = max(reason, R_NMASK)
            nbits = s_misc[3]
            if (nbits + 31) >> 5 != pwords:
                reason = max(reason, R_SIZES)
            elif nbits & 31:
                if np.int64(buf32[pay_w0 + pwords - 1]) >> (nbits & 31) != 0:
                    reason = max(reason, R_PAD)
            ibits = nnz * ib
            if ibits & 31:
                if np.int64(buf32[idx_w0 + (ibits >> 5)]) >> (ibits & 31) != 0:
                    reason = max(reason, R_PAD)
            if ntab & 1:
                if _tab_code(buf8, tab_off, ntab) != 0:
                    reason = max(reason, R_PAD)
        # table entries: valid codes, strictly increasing (every thread of this block)
        e = tid
        while e < ntab:
            cd = _tab_code(buf8, tab_off, e)
            if not _code_ok(cd, is32):
                reason = max(reason, R_TABLE)
            elif e > 0 and _tab_code(buf8, tab_off, e - 1) >= cd:
                reason = max(reason, R_TABLE)
            e += TPB
    if reason != 0:
        cuda.atomic.max(bad, slot, (np.int64(epoch) << 4) | reason)


@cuda.jit(**_JIT)
def decode2_kernel(buf8, buf32, tab_off, idx_w0, mask_w0, pay_w0, ib, n, nbw, is32, step,  # type: ignore[no-untyped-def]
                   pre, bad, slot, vepoch, bm_w0, out, outbits):
    """Decode an indexed v2 stream into ``out`` (``outbits``: uint32 / int64 view of it).

    One warp per bitmap word; nothing when validation flagged the stream. A sparse block
    with positions not strictly increasing raises ``bad[slot]`` (``R_SPARSE``).
    """
    if (bad[slot] >> 4) == vepoch:
        return
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    t = cuda.blockIdx.x * WARPS + warp
    if t >= nbw:
        return
    bw = np.int64(buf32[bm_w0 + t])
    c_l, m_l, o_l = _tile_codes(buf8, buf32, tab_off, idx_w0, mask_w0, ib, pre, t, is32, lane)
    for jb in range(32):
        base = (t * 32 + jb) * BLOCK
        if base >= n:
            break
        i = base + lane
        valid = i < n
        if (bw >> jb) & 1:
            kk = cuda.popc(np.uint32(bw & ((np.int64(1) << jb) - 1)))
            code = cuda.shfl_sync(FULL, c_l, kk)
            mask = cuda.shfl_sync(FULL, m_l, kk)
            o = cuda.shfl_sync(FULL, o_l, kk)
            q, raw, ok = _decode_block(buf32, pay_w0, o, code, mask, lane, is32)
            if not ok:
                if lane == 0:
                    cuda.atomic.max(bad, slot, (np.int64(vepoch) << 4) | R_SPARSE)
            kind = code >> 10
            if valid:
                if kind < KIND_RAW:
                    _store(out, i, _dmul(np.float64(q), step))
                elif kind == KIND_RAW:
                    outbits[i] = raw
                else:
                    d = _f64_of_words(raw & 0xFFFFFFFF, (raw >> 32) & 0xFFFFFFFF)
                    if d != d:
                        # float32 NaN from a float64 NaN as CPUs convert it (v1's rule).
                        whi = (raw >> 32) & 0xFFFFFFFF
                        wlo = raw & 0xFFFFFFFF
                        outbits[i] = ((whi >> 31) << 31) | 0x7FC00000 | (
                            ((whi & 0xFFFFF) << 3) | (wlo >> 29)) & 0x3FFFFF
                    else:
                        _store(out, i, d)
        elif valid:
            outbits[i] = 0


@cuda.jit(**_JIT)
def add2_kernel(a8, a32, a_tab, a_idx, a_msk, a_pay, a_bm, a_ib, pre_a,  # type: ignore[no-untyped-def]
                b8, b32, b_tab, b_idx, b_msk, b_pay, b_bm, b_ib, pre_b,
                bad, va_epoch, vb_epoch, n, is32, step, ntiles, ctr, flags, vals, epoch,
                bitmap_s, codes_s, masks_s, pay_s, pres, totals):
    """Homomorphic sum of two indexed v2 streams into v2 scratch (format.md, v2 add).

    Tile t pairs bitmap word t of both streams. Warps 0 and 1 look up the codes, masks and
    bit offsets of a's and b's blocks in the tile; each warp then builds 4 output blocks
    (sum, raw sum, or a copy of the non-zero side's bits), and the tile is placed as in
    compression.
    """
    if (bad[0] >> 4) == va_epoch or (bad[1] >> 4) == vb_epoch:
        return
    s_code = cuda.shared.array(TILE, np.int32)
    s_mask = cuda.shared.array(TILE, np.int64)
    s_size = cuda.shared.array(TILE, np.int64)
    s_off = cuda.shared.array(TILE, np.int64)
    s_src = cuda.shared.array(TILE, np.int64)  # 0: built here; 1/2: copied from a/b at bit
    s_sbit = cuda.shared.array(TILE, np.int64)
    s_misc = cuda.shared.array(4, np.int64)
    s_ic = cuda.shared.array(64, np.int64)
    s_im = cuda.shared.array(64, np.int64)
    s_io = cuda.shared.array(64, np.int64)
    s_bw = cuda.shared.array(2, np.int64)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    if tid == 0:
        s_misc[0] = _ticket(ctr, ntiles)
    cuda.syncthreads()
    tile = s_misc[0]
    if warp == 0:
        c, m, o = _tile_codes(a8, a32, a_tab, a_idx, a_msk, a_ib, pre_a, tile, is32, lane)
        s_ic[lane] = c
        s_im[lane] = m
        s_io[lane] = o
        if lane == 0:
            s_bw[0] = np.int64(a32[a_bm + tile])
    elif warp == 1:
        c, m, o = _tile_codes(b8, b32, b_tab, b_idx, b_msk, b_ib, pre_b, tile, is32, lane)
        s_ic[32 + lane] = c
        s_im[32 + lane] = m
        s_io[32 + lane] = o
        if lane == 0:
            s_bw[1] = np.int64(b32[b_bm + tile])
    cuda.syncthreads()
    bwa = s_bw[0]
    bwb = s_bw[1]
    qv = cuda.local.array(BPW, np.int64)
    for k in range(BPW):
        j = warp * BPW + k
        i = (tile * TILE + j) * BLOCK + lane
        valid = i < n
        za = (bwa >> j) & 1
        zb = (bwb >> j) & 1
        lt = (np.int64(1) << j) - 1
        code = np.int64(ZERO)
        mask = np.int64(0)
        size = np.int64(0)
        src = np.int64(0)
        sbit = np.int64(0)
        val = np.int64(0)
        if za != 0 and zb != 0:
            ka = cuda.popc(np.uint32(bwa & lt))
            kb = 32 + cuda.popc(np.uint32(bwb & lt))
            ca = s_ic[ka]
            cb = s_ic[kb]
            qa, ra, oka = _decode_block(a32, a_pay, s_io[ka], ca, s_im[ka], lane, is32)
            qb, rb, okb = _decode_block(b32, b_pay, s_io[kb], cb, s_im[kb], lane, is32)
            if lane == 0:
                # A decoded sparse block must have increasing positions, as in decode.
                if not oka:
                    cuda.atomic.max(bad, 0, (np.int64(va_epoch) << 4) | R_SPARSE)
                if not okb:
                    cuda.atomic.max(bad, 1, (np.int64(vb_epoch) << 4) | R_SPARSE)
            raw = (ca >> 10) >= KIND_RAW or (cb >> 10) >= KIND_RAW
            s = np.int64(0)
            if valid:
                s = qa + qb
            if not raw:
                raw = _ballot(abs(s) >= QMAX_ADD) != 0
            if not raw:
                code, mask, size = _choose(s)
                val = s
            else:
                code = np.int64(CODE_RAW64 if is32 else CODE_RAW)
                size = np.int64(2048)
                if valid:
                    va = _lane_value(ca, qa, ra, is32, step)
                    vb = _lane_value(cb, qb, rb, is32, step)
                    sm = _dadd(va, vb)
                    val = np.int64(CANON_NAN64)
                    if sm == sm:
                        val = _bits_of_f64(sm)
        elif za != 0:
            ka = cuda.popc(np.uint32(bwa & lt))
            code = s_ic[ka]
            mask = s_im[ka]
            size = _size_bits(code, mask, is32)
            src = np.int64(1)
            sbit = s_io[ka]
        elif zb != 0:
            kb = 32 + cuda.popc(np.uint32(bwb & lt))
            code = s_ic[kb]
            mask = s_im[kb]
            size = _size_bits(code, mask, is32)
            src = np.int64(2)
            sbit = s_io[kb]
        qv[k] = val
        if lane == 0:
            s_code[j] = code
            s_mask[j] = mask
            s_size[j] = size
            s_src[j] = src
            s_sbit[j] = sbit
    cuda.syncthreads()
    if warp == 0:
        _place_tile(tile, ntiles, lane, s_code, s_mask, s_size, s_off, s_misc, flags, vals,
                    epoch, bitmap_s, codes_s, masks_s, pres, totals)
    cuda.syncthreads()
    base = s_misc[1]
    for k in range(BPW):
        j = warp * BPW + k
        code = np.int64(s_code[j])
        if code < 0:
            continue
        o = base + s_off[j]
        src = s_src[j]
        if src == 0:
            _write_block(pay_s, o, code, s_mask[j], qv[k], lane, is32)
        else:
            # A block next to a zero block: its bits, moved to the new offset.
            size = s_size[j]
            sb = s_sbit[j]
            c = np.int64(lane)
            while 32 * c < size:
                wd = min(np.int64(32), size - 32 * c)
                if src == 1:
                    f = _get(a32, a_pay, sb + 32 * c, wd)
                else:
                    f = _get(b32, b_pay, sb + 32 * c, wd)
                _put(pay_s, o + 32 * c, f, wd)
                c += 32


KERNELS = {
    "zero_kernel": zero_kernel,
    "compress2_kernel": compress2_kernel,
    "table_kernel": table_kernel,
    "assemble2_kernel": assemble2_kernel,
    "index2_kernel": index2_kernel,
    "decode2_kernel": decode2_kernel,
    "add2_kernel": add2_kernel,
}


def signatures() -> dict[str, list[tuple[str, tuple]]]:
    """Argument types of every v2 kernel as ``_cuda`` launches them, per data type.

    Used to compile PTX without a GPU (tests/ptx).
    """
    from numba import float32, float64, int32, int64, uint8, uint32

    a_u8, a_u32, a_i32, a_i64 = uint8[::1], uint32[::1], int32[::1], int64[::1]
    out: dict[str, list[tuple[str, tuple]]] = {}
    out["zero_kernel"] = [("any", (a_u32, int64))]
    out["compress2_kernel"] = [
        (dt, (xb, int64, float64, float64, int64, a_i64, a_u32, a_i64, int64, a_u32, a_i32,
              a_u32, a_u32, a_u32, a_i64))
        for dt, xb in (("float32", a_i32), ("float64", a_i64))
    ]
    out["table_kernel"] = [("any", (a_u32, a_i32, a_i32, a_i64))]
    out["assemble2_kernel"] = [
        ("any", (a_u32, int64, int64, a_u32, int64, a_i32, int64, int64, a_i32, a_i32, int64,
                 a_u32, int64, a_u32)),
    ]
    out["index2_kernel"] = [
        ("any", (a_u8, a_u32, int64, int64, int64, int64, int64, int64, int64, int64, int64,
                 int64, int64, int64, int64, int64, a_i64, a_u32, a_i64, a_u32, a_i64, a_u32,
                 a_i64, int64, a_i64, a_i64, int64)),
    ]
    out["decode2_kernel"] = [
        (dt, (a_u8, a_u32, int64, int64, int64, int64, int64, int64, int64, int64, float64,
              a_i64, a_i64, int64, int64, int64, fo, bo))
        for dt, fo, bo in (("float32", float32[::1], a_u32), ("float64", float64[::1], a_i64))
    ]
    out["add2_kernel"] = [
        ("any", (a_u8, a_u32, int64, int64, int64, int64, int64, int64, a_i64,
                 a_u8, a_u32, int64, int64, int64, int64, int64, int64, a_i64,
                 a_i64, int64, int64, int64, int64, float64, int64, a_i64, a_u32, a_i64, int64,
                 a_u32, a_i32, a_u32, a_u32, a_u32, a_i64)),
    ]
    return out
