"""numba-cuda kernels of the ccoll compressor, stream format v1 (docs/format.md).

The design is in docs/cuda.md. In short: a warp works on one 32-element block at a time,
lane ``l`` on element ``l``, so every load and store of a block is one coalesced access and
the sign word and bit-planes of a block are ``ballot_sync`` results. A thread block (8 warps)
owns a tile of 32 blocks, i.e. one bitmap word; tiles take their index from an atomic ticket,
so a tile only ever waits for tiles that are already running, and find where their codes and
payload go with a single-pass decoupled look-back (``_lookback``).

Arithmetic follows docs/format.md exactly: float64 division, ``floor(v + 0.5)``, one float64
multiplication then one rounding to the dtype. Products and sums go through ``_dmul`` /
``_dadd`` / ``_dsub``, which compile to ``mul.rn.f64`` / ``add.rn.f64``: an
explicit rounding mode stops NVVM and ptxas from contracting them into an FMA, which would
change results (tests/ptx checks that no kernel contains an ``fma``). No fastmath anywhere.

Every small helper below has a plain-Python body and an ``@overload`` for compiled code.
The compiled code uses the overload; the CUDA simulator, which runs kernels as Python,
uses the Python body (with numpy's floating-point warnings silenced, since IEEE overflow to
inf is intended here). Kernel logic itself is one source for both.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, types
from numba.cuda import libdevice
from numba.extending import overload

__all__ = [
    "TPB",
    "WARPS",
    "TILE",
    "compress_kernel",
    "assemble_kernel",
    "index_kernel",
    "decode_kernel",
    "add_kernel",
    "range_kernel",
    "KERNELS",
]

FULL = 0xFFFFFFFF
BLOCK = 32
WARPS = 8  # warps per thread block
TPB = WARPS * 32  # threads per thread block
BPW = 4  # blocks per warp in the compress and add kernels
TILE = WARPS * BPW  # blocks per thread block there: one bitmap word
STAGE_WORDS = TILE * 64  # largest payload of a tile (every block 64 words)
QLIM = 2147483647.0  # |v| < 2^31 - 1: quantizable
QMAX_ADD = 2147483647  # |q_a + q_b| >= 2^31 - 1: the sum block is raw
CODE_RAW = 32
CODE_RAW64 = 33
LOR = 0x80
CANON_NAN64 = 0x7FF8000000000000  # the NaN a homomorphic sum stores (same as the CPU backend)
ST_AGG = 1  # look-back flag states; a flag is (epoch << 2) | state
ST_PRE = 2

_JIT = dict(cache=True)  # fastmath stays off on purpose


# ------------------------------------------------------------------------ scalar helpers
# Python bodies run in the simulator; the overloads are what the kernels compile to.


def _dmul(a, b):  # type: ignore[no-untyped-def]
    """float64 product, rounded once (never fused)."""
    with np.errstate(all="ignore"):
        return np.float64(a) * np.float64(b)


@overload(_dmul)
def _dmul_ol(a, b):  # type: ignore[no-untyped-def]
    return lambda a, b: libdevice.dmul_rn(a, b)


def _dadd(a, b):  # type: ignore[no-untyped-def]
    """float64 sum, rounded once (never fused)."""
    with np.errstate(all="ignore"):
        return np.float64(a) + np.float64(b)


@overload(_dadd)
def _dadd_ol(a, b):  # type: ignore[no-untyped-def]
    return lambda a, b: libdevice.dadd_rn(a, b)


def _dsub(a, b):  # type: ignore[no-untyped-def]
    """float64 difference, rounded once (never fused)."""
    with np.errstate(all="ignore"):
        return np.float64(a) - np.float64(b)


@overload(_dsub)
def _dsub_ol(a, b):  # type: ignore[no-untyped-def]
    # libdevice has no dsub_rn; negation is exact, so a + (-b) rounds like a - b.
    return lambda a, b: libdevice.dadd_rn(a, -b)


def _ddiv(a, b):  # type: ignore[no-untyped-def]
    """float64 quotient, correctly rounded (div.rn.f64)."""
    with np.errstate(all="ignore"):
        return np.float64(a) / np.float64(b)


@overload(_ddiv)
def _ddiv_ol(a, b):  # type: ignore[no-untyped-def]
    return lambda a, b: libdevice.ddiv_rn(a, b)


def _value_of(b, xb):  # type: ignore[no-untyped-def]
    """float64 value of bit pattern ``b`` (int64; int32-view data sign-extended) of ``xb``."""
    if xb.dtype == np.int32:
        return np.float64(np.array([b], np.int64).astype(np.int32).view(np.float32)[0])
    return np.array([b], np.int64).view(np.float64)[0]


@overload(_value_of)
def _value_of_ol(b, xb):  # type: ignore[no-untyped-def]
    if xb.dtype == types.int32:
        return lambda b, xb: np.float64(libdevice.int_as_float(np.int32(b)))
    return lambda b, xb: libdevice.longlong_as_double(b)


def _words_of(b, xb):  # type: ignore[no-untyped-def]
    """Split bit pattern ``b`` of an element of ``xb`` into (low word, high word).

    The high word is 0 for float32 data.
    """
    b = np.int64(b)
    if xb.dtype == np.int32:
        return b & 0xFFFFFFFF, np.int64(0)
    return b & 0xFFFFFFFF, (b >> 32) & 0xFFFFFFFF


@overload(_words_of)
def _words_of_ol(b, xb):  # type: ignore[no-untyped-def]
    if xb.dtype == types.int32:
        return lambda b, xb: (b & 0xFFFFFFFF, np.int64(0))
    return lambda b, xb: (b & 0xFFFFFFFF, (b >> 32) & 0xFFFFFFFF)


def _raw_words(xb):  # type: ignore[no-untyped-def]
    """Payload words of a raw block of the bit view's dtype (32 or 64)."""
    return 32 if xb.dtype == np.int32 else 64


@overload(_raw_words)
def _raw_words_ol(xb):  # type: ignore[no-untyped-def]
    if xb.dtype == types.int32:
        return lambda xb: 32
    return lambda xb: 64


def _round_like(d, xb):  # type: ignore[no-untyped-def]
    """``float64(T(d))`` where T is the float type behind the bit view ``xb``."""
    if xb.dtype == np.int32:
        with np.errstate(all="ignore"):
            return np.float64(np.float32(d))
    return np.float64(d)


@overload(_round_like)
def _round_like_ol(d, xb):  # type: ignore[no-untyped-def]
    if xb.dtype == types.int32:
        return lambda d, xb: np.float64(np.float32(d))
    return lambda d, xb: d


def _f64_of_words(lo, hi):  # type: ignore[no-untyped-def]
    """Return the float64 whose bit pattern is ``hi:lo``."""
    return np.array([np.int64(lo) | (np.int64(hi) << 32)], np.int64).view(np.float64)[0]


@overload(_f64_of_words)
def _f64_of_words_ol(lo, hi):  # type: ignore[no-untyped-def]
    return lambda lo, hi: libdevice.longlong_as_double(np.int64(lo) | (np.int64(hi) << 32))


def _f64_of_f32word(w):  # type: ignore[no-untyped-def]
    """float64 value of the float32 whose bit pattern is the word ``w`` (0 <= w < 2^32)."""
    return np.float64(np.array([w], np.uint32).view(np.float32)[0])


@overload(_f64_of_f32word)
def _f64_of_f32word_ol(w):  # type: ignore[no-untyped-def]
    return lambda w: np.float64(libdevice.int_as_float(np.int32(w)))


def _bits_of_f64(d):  # type: ignore[no-untyped-def]
    """Return the bit pattern of a float64, as int64."""
    return np.array([d], np.float64).view(np.int64)[0]


@overload(_bits_of_f64)
def _bits_of_f64_ol(d):  # type: ignore[no-untyped-def]
    return lambda d: libdevice.double_as_longlong(d)


def _store(out, i, d):  # type: ignore[no-untyped-def]
    """``out[i] = d`` with the usual rounding to ``out``'s dtype."""
    with np.errstate(all="ignore"):
        out[i] = d


@overload(_store)
def _store_ol(out, i, d):  # type: ignore[no-untyped-def]
    def impl(out, i, d):  # type: ignore[no-untyped-def]
        out[i] = d

    return impl


def _i32(v):  # type: ignore[no-untyped-def]
    """Return the int32 with the bit pattern of the low 32 bits of ``v`` (0 <= v < 2^32)."""
    v = np.int64(v)
    return np.int32(v - ((v >> 31) << 32))


@overload(_i32)
def _i32_ol(v):  # type: ignore[no-untyped-def]
    return lambda v: np.int32(v)


# --------------------------------------------------------------------- warp-level helpers


@cuda.jit(device=True)
def _ballot(pred):  # type: ignore[no-untyped-def]
    """Ballot of the full warp, as int64."""
    return np.int64(cuda.ballot_sync(FULL, pred))


@cuda.jit(device=True)
def _scan(v, lane):  # type: ignore[no-untyped-def]
    """Inclusive prefix sum over the 32 lanes."""
    d = 1
    while d < 32:
        t = cuda.shfl_up_sync(FULL, v, d)
        if lane >= d:
            v += t
        d <<= 1
    return v


@cuda.jit(device=True)
def _wsum(v):  # type: ignore[no-untyped-def]
    """Sum over the 32 lanes, on every lane."""
    d = 16
    while d > 0:
        v += cuda.shfl_xor_sync(FULL, v, d)
        d >>= 1
    return v


@cuda.jit(device=True)
def _wor(v):  # type: ignore[no-untyped-def]
    """Bitwise OR over the 32 lanes, on every lane."""
    d = 16
    while d > 0:
        v |= cuda.shfl_xor_sync(FULL, v, d)
        d >>= 1
    return v


@cuda.jit(device=True)
def _wmin(v):  # type: ignore[no-untyped-def]
    """Minimum over the 32 lanes, on every lane."""
    d = 16
    while d > 0:
        v = min(v, cuda.shfl_xor_sync(FULL, v, d))
        d >>= 1
    return v


@cuda.jit(device=True)
def _wmax(v):  # type: ignore[no-untyped-def]
    """Maximum over the 32 lanes, on every lane."""
    d = 16
    while d > 0:
        v = max(v, cuda.shfl_xor_sync(FULL, v, d))
        d >>= 1
    return v


@cuda.jit(device=True)
def _bitlen32(v):  # type: ignore[no-untyped-def]
    """Bit length of a non-negative int32."""
    return 32 - cuda.clz(np.int32(v))


@cuda.jit(device=True)
def _code_words(code, is32):  # type: ignore[no-untyped-def]
    """Payload words of a valid code byte (0 stands for a zero block)."""
    if code == 0:
        return 0
    if code == CODE_RAW:
        return 32 if is32 else 64
    if code == CODE_RAW64:
        return 64
    return 1 + (code & 0x7F)


@cuda.jit(device=True)
def _code_ok(code, is32):  # type: ignore[no-untyped-def]
    """Tell whether a code byte is allowed for a non-zero block (format.md, "Block kinds")."""
    w = code & 0x7F
    if code & LOR:
        return w >= 1 and w <= 31
    if code >= 1 and code <= CODE_RAW:
        return True
    return code == CODE_RAW64 and is32 != 0


# ------------------------------------------------------------------ tickets and look-back


@cuda.jit(device=True)
def _ticket(ctr, ntakes):  # type: ignore[no-untyped-def]
    """Tile index in launch order; the last of ``ntakes`` takers resets the counter.

    A launch takes exactly ``ntakes`` tickets, so the reset leaves the counter at 0 for the
    next launch on the same stream. One tile per thread block: ``ntakes`` is the number of
    tiles. Persistent thread blocks (``compress_kernel``) take tickets until one is past the
    last tile, i.e. every thread block takes exactly one ticket beyond it: ``ntakes`` is
    tiles + thread blocks.
    """
    t = cuda.atomic.add(ctr, 0, 1)
    if t == ntakes - 1:
        ctr[0] = 0
    return t


@cuda.jit(device=True)
def _lookback(flags, vals, tile, a0, a1, epoch, lane):  # type: ignore[no-untyped-def]
    """Exclusive prefix of the pair (a0, a1) over tiles 0..tile-1; called by one whole warp.

    Single-pass decoupled look-back. ``vals[4t:4t+4]`` hold tile t's aggregate pair and
    inclusive-prefix pair; ``flags[t]`` is ``(epoch << 2) | state`` with state 1 when the
    aggregate is published and 2 when the inclusive prefix is. Flags of older launches
    carry an older epoch and read as "not yet", so the arrays are never cleared between
    launches. Values are written, then ``threadfence``, then the flag; readers read the
    flag, ``threadfence``, then the values, all through L2 atomics.
    """
    tag = np.int64(epoch) << 2
    if lane == 0:
        if tile == 0:
            vals[2] = a0
            vals[3] = a1
            cuda.threadfence()
            cuda.atomic.exch(flags, 0, np.uint32(tag | ST_PRE))
        else:
            vals[4 * tile] = a0
            vals[4 * tile + 1] = a1
            cuda.threadfence()
            cuda.atomic.exch(flags, tile, np.uint32(tag | ST_AGG))
    ex0 = np.int64(0)
    ex1 = np.int64(0)
    if tile > 0:
        end = tile - 1
        done = False
        while not done:
            # Lane l looks at tile end - l: lane 0 is the nearest predecessor.
            idx = end - lane
            st = ST_PRE  # before tile 0: an inclusive prefix of 0
            if idx >= 0:
                f = np.int64(cuda.atomic.add(flags, idx, np.uint32(0)))
                st = f - tag if (f >> 2) == epoch else 0
            pmask = _ballot(st == ST_PRE)
            inval = _ballot(st == 0)
            first = 31
            need = np.int64(FULL)
            if pmask != 0:
                first = cuda.ffs(np.uint32(pmask)) - 1
                need = (np.int64(2) << first) - 1
            if (inval & need) == 0:
                cuda.threadfence()
                v0 = np.int64(0)
                v1 = np.int64(0)
                if idx >= 0 and lane <= first:
                    at = 4 * idx + (2 if st == ST_PRE else 0)
                    v0 = cuda.atomic.add(vals, at, 0)
                    v1 = cuda.atomic.add(vals, at + 1, 0)
                ex0 += _wsum(v0)
                ex1 += _wsum(v1)
                if pmask != 0:
                    done = True
                else:
                    end -= 32
        if lane == 0:
            vals[4 * tile + 2] = ex0 + a0
            vals[4 * tile + 3] = ex1 + a1
            cuda.threadfence()
            cuda.atomic.exch(flags, tile, np.uint32(tag | ST_PRE))
    return ex0, ex1


# ----------------------------------------------------------------------- block encoding


@cuda.jit(device=True)
def _encode_q(q, valid, lane):  # type: ignore[no-untyped-def]
    """Code and this lane's payload word for quantized values ``q`` (|q| <= 2^31 - 1).

    Rules 3-4 of format.md: zero block when every q is 0; else the narrower of
    no-prediction and 1-D Lorenzo (Lorenzo only if strictly narrower). Lane 0's word is the
    sign word, lane 1 + j's word is bit-plane j; other lanes' words are unused.
    """
    # Most blocks of a gradient quantize to zero: one ballot settles them.
    if _ballot(q != 0) == 0:
        return np.int64(0), np.int64(0)
    qp = cuda.shfl_up_sync(FULL, q, 1)
    c = q - qp if lane > 0 else q
    if not valid:
        c = np.int64(0)  # Lorenzo codes of padding lanes are 0
    aq = abs(q)
    ac = abs(c)
    # |c| can reach 2^32 - 2. Saturating at 2^31 - 1 keeps the decision: such a width (31
    # or more) is never strictly below the no-prediction width, which is at most 31.
    if ac > 0x7FFFFFFF:
        ac = np.int64(0x7FFFFFFF)
    # Both ORs in one 64-bit reduction: no-prediction in the low half, Lorenzo in the high.
    both = _wor(aq | (ac << 32))
    wq = _bitlen32(both & 0x7FFFFFFF)
    wc = _bitlen32(both >> 32)
    mag = aq
    neg = q < 0
    w = wq
    code = np.int64(wq)
    if wc < wq:
        mag = abs(c)
        neg = c < 0
        w = wc
        code = np.int64(LOR | wc)
    word = _ballot(neg)
    if lane != 0:
        word = np.int64(0)
    for j in range(w):
        p = _ballot(((mag >> j) & 1) != 0)
        if lane == j + 1:
            word = p
    return code, word


@cuda.jit(device=True)
def _compress_block(xb, b, n, blk, eb, step, lane):  # type: ignore[no-untyped-def]
    """(code, payload words, lane word lo, lane word hi) of block ``blk``; whole warp.

    ``b`` is this lane's element of ``xb`` (bit pattern, int64), loaded by the caller.
    """
    i = blk * BLOCK + lane
    valid = i < n
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
    if _ballot(not ok) != 0:
        return np.int64(CODE_RAW), np.int64(_raw_words(xb)), lo, hi
    code, word = _encode_q(q, valid, lane)
    size = np.int64(0)
    if code != 0:
        size = 1 + (code & 0x7F)
    return code, size, word, np.int64(0)


@cuda.jit(device=True)
def _decode_fixed(w32, off, code, lane):  # type: ignore[no-untyped-def]
    """Integer value (int64, Lorenzo undone) of this lane of a fixed-length block."""
    w = code & 0x7F
    word = np.int32(0)
    if lane <= w:
        word = _i32(w32[off + lane])
    sign = cuda.shfl_sync(FULL, word, 0)
    mag = np.int64(0)
    for j in range(w):
        p = cuda.shfl_sync(FULL, word, j + 1)
        mag |= np.int64((p >> lane) & 1) << j
    c = -mag if (sign >> lane) & 1 else mag
    if code & LOR:
        c = _scan(c, lane)
    return c


@cuda.jit(device=True)
def _finish_tile(tile, ntiles, tid, lo, hi, s_code, s_size, s_off, s_stage, s_misc,  # type: ignore[no-untyped-def]
                 flags, vals, epoch, bitmap_s, codes_s, pay_s, totals):
    """Place a tile's blocks: bitmap word, code bytes, payload (compress and add).

    Every warp has left its blocks' code and size in ``s_code``/``s_size`` and holds its
    payload words in ``lo``/``hi``. Warp 0 scans the sizes, the warps compact their words
    into ``s_stage``, warp 0 finds the tile's place by look-back, then the whole thread block
    copies the compacted payload out with contiguous stores.
    """
    warp = tid >> 5
    lane = tid & 31
    cd = np.int64(0)
    nzm = np.int64(0)
    total = np.int64(0)
    if warp == 0:
        sz = np.int64(s_size[lane])
        cd = np.int64(s_code[lane])
        inc = _scan(sz, lane)
        s_off[lane] = inc - sz
        total = cuda.shfl_sync(FULL, inc, 31)
        nzm = _ballot(cd != 0)
        if lane == 0:
            s_misc[1] = total
    cuda.syncthreads()
    for k in range(BPW):
        j = warp * BPW + k
        size = s_size[j]
        off = s_off[j]
        if size == 64:
            s_stage[off + 2 * lane] = lo[k]
            s_stage[off + 2 * lane + 1] = hi[k]
        elif lane < size:
            s_stage[off + lane] = lo[k]
    if warp == 0:
        cnt = np.int64(cuda.popc(nzm))
        ex0, ex1 = _lookback(flags, vals, tile, cnt, total, epoch, lane)
        if cd != 0:
            codes_s[ex0 + cuda.popc(nzm & ((np.int64(1) << lane) - 1))] = cd
        if lane == 0:
            bitmap_s[tile] = nzm
            s_misc[2] = ex1
            if tile == ntiles - 1:
                totals[0] = ex0 + cnt
                totals[1] = ex1 + total
    cuda.syncthreads()
    base = s_misc[2]
    total = s_misc[1]
    i = tid
    while i < total:
        pay_s[base + i] = s_stage[i]
        i += TPB


# ------------------------------------------------------------------------------ kernels


@cuda.jit(**_JIT)
def compress_kernel(xb, n, eb, step, ntiles, ctr, flags, vals, epoch,  # type: ignore[no-untyped-def]
                    bitmap_s, codes_s, pay_s, totals):
    """Compress bit view ``xb`` (int32 for float32, int64 for float64) into scratch.

    Tiles of 32 blocks. Writes the bitmap word of each tile, its code bytes and payload at
    their final positions relative to their sections, and the totals (non-zero blocks,
    payload words) from the last tile. Thread blocks are persistent: each takes tickets
    until one is past the last tile, so any grid size (``_cuda`` caps it with
    ``max_blocks``) writes the same bytes. Look-back stays deadlock-free: a tile waits only
    on lower tickets, taken earlier by thread blocks that are running and that themselves
    wait only on lower tickets.
    """
    s_code = cuda.shared.array(TILE, np.int32)
    s_size = cuda.shared.array(TILE, np.int32)
    s_off = cuda.shared.array(TILE, np.int32)
    s_stage = cuda.shared.array(STAGE_WORDS, np.uint32)
    s_misc = cuda.shared.array(4, np.int64)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    ntakes = ntiles + np.int64(cuda.gridDim.x)
    lo = cuda.local.array(BPW, np.int64)
    hi = cuda.local.array(BPW, np.int64)
    xw = cuda.local.array(BPW, np.int64)
    while True:
        # The previous tile's last shared reads (s_misc[1:3], s_stage) end before this
        # barrier is passed, and its shared writes start after it.
        if tid == 0:
            s_misc[0] = _ticket(ctr, ntakes)
        cuda.syncthreads()
        tile = s_misc[0]
        if tile >= ntiles:
            break  # the same value on every thread: the whole thread block leaves
        # Issue the warp's 4 coalesced loads before any arithmetic: more bytes in flight.
        for k in range(BPW):
            i = (tile * TILE + warp * BPW + k) * BLOCK + lane
            xw[k] = np.int64(xb[i]) if i < n else np.int64(0)
        for k in range(BPW):
            j = warp * BPW + k
            code, size, wlo, whi = _compress_block(xb, xw[k], n, tile * TILE + j, eb, step,
                                                   lane)
            lo[k] = wlo
            hi[k] = whi
            if lane == 0:
                s_code[j] = code
                s_size[j] = size
        cuda.syncthreads()
        _finish_tile(tile, ntiles, tid, lo, hi, s_code, s_size, s_off, s_stage, s_misc,
                     flags, vals, epoch, bitmap_s, codes_s, pay_s, totals)


@cuda.jit(**_JIT)
def assemble_kernel(out32, bm_w0, nbw, bitmap_s, codes_w, nnz, pwords, pay_s):  # type: ignore[no-untyped-def]
    """Copy bitmap, code bytes (zero-padded to a word) and payload from scratch to a stream."""
    cw = (nnz + 3) >> 2
    total = nbw + cw + pwords
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < total:
        if i < nbw:
            out32[bm_w0 + i] = bitmap_s[i]
        elif i < nbw + cw:
            j = i - nbw
            v = np.int64(codes_w[j])
            rem = nnz - 4 * j
            if rem < 4:
                v &= (np.int64(1) << (8 * rem)) - 1  # little-endian: keep the first rem bytes
            out32[bm_w0 + i] = v
        else:
            out32[bm_w0 + i] = pay_s[i - nbw - cw]
        i += stride


@cuda.jit(**_JIT)
def index_kernel(buf8, buf32, bm_w0, codes_off, nnz, pwords, nblocks, nbw, is32, ntiles,  # type: ignore[no-untyped-def]
                 ctr, flags_k, vals_k, flags_w, vals_w, epoch, pre, bad, slot):
    """Validate bitmap and codes of a stream and index it for decoding; payload untouched.

    Warp w of thread block t handles bitmap word 8t + w. Two chained look-backs give each
    word's first code index and payload offset (``pre[2i]``, ``pre[2i+1]``). Any problem
    (bits past the last block, a code index past ``nnz``, an invalid code byte, totals that
    disagree with the header, non-zero code padding) raises ``bad[slot]`` to at least
    ``(epoch << 4) | reason``; later kernels of the same call test ``bad[slot] >> 4``.
    """
    s_cnt = cuda.shared.array(WARPS, np.int64)
    s_kpre = cuda.shared.array(WARPS, np.int64)
    s_wcnt = cuda.shared.array(WARPS, np.int64)
    s_wpre = cuda.shared.array(WARPS, np.int64)
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
    reason = 0  # see _cuda._BAD_REASONS; the largest one found is reported
    if t == nbw - 1:
        tail = nblocks & 31
        if tail != 0 and (bw >> tail) != 0:
            reason = 5
    cnt = np.int64(cuda.popc(bw))
    if lane == 0:
        s_cnt[warp] = cnt
    cuda.syncthreads()
    if warp == 0:
        v = np.int64(0)
        if lane < WARPS:
            v = s_cnt[lane]
        inc = _scan(v, lane)
        tot = cuda.shfl_sync(FULL, inc, 31)
        ex0, _ = _lookback(flags_k, vals_k, tile, tot, np.int64(0), epoch, lane)
        if lane < WARPS:
            s_kpre[lane] = ex0 + inc - v
        if lane == 0:
            s_misc[1] = ex0 + tot
    cuda.syncthreads()
    k0 = s_kpre[warp]
    k = k0 + lane
    sz = np.int64(0)
    if lane < cnt:
        if k < nnz:
            code = np.int64(buf8[codes_off + k])
            if _code_ok(code, is32):
                sz = _code_words(code, is32)
            else:
                reason = max(reason, 4)
        else:
            reason = max(reason, 3)
    wsz = _wsum(sz)
    if lane == 0:
        s_wcnt[warp] = wsz
    cuda.syncthreads()
    if warp == 0:
        v = np.int64(0)
        if lane < WARPS:
            v = s_wcnt[lane]
        inc = _scan(v, lane)
        tot = cuda.shfl_sync(FULL, inc, 31)
        ex1, _ = _lookback(flags_w, vals_w, tile, tot, np.int64(0), epoch, lane)
        if lane < WARPS:
            s_wpre[lane] = ex1 + inc - v
        if lane == 0:
            s_misc[2] = ex1 + tot
    cuda.syncthreads()
    if lane == 0 and t < nbw:
        pre[2 * t] = k0
        pre[2 * t + 1] = s_wpre[warp]
    if tid == 0 and tile == ntiles - 1:
        if s_misc[1] != nnz:
            reason = max(reason, 3)
        if s_misc[2] != pwords:
            reason = max(reason, 2)
        p = nnz
        while p & 3:
            if buf8[codes_off + p] != 0:
                reason = max(reason, 1)
            p += 1
    if reason != 0:
        cuda.atomic.max(bad, slot, (np.int64(epoch) << 4) | reason)


@cuda.jit(device=True)
def _tile_codes(buf8, buf32, bm_w0, codes_off, pre, t, is32, lane):  # type: ignore[no-untyped-def]
    """Bitmap word ``t``, and on lane j the code and payload offset of its j-th block."""
    bw = np.int64(buf32[bm_w0 + t])
    k0 = pre[2 * t]
    cnt = cuda.popc(bw)
    c = np.int64(0)
    if lane < cnt:
        c = np.int64(buf8[codes_off + k0 + lane])
    sz = _code_words(c, is32)
    inc = _scan(sz, lane)
    return bw, c, pre[2 * t + 1] + inc - sz


@cuda.jit(**_JIT)
def decode_kernel(buf8, buf32, bm_w0, codes_off, pay_w0, n, nbw, is32, step, pre, bad, slot,  # type: ignore[no-untyped-def]
                  vepoch, out, outbits):
    """Decode a validated stream into ``out`` (``outbits``: uint32 / int64 view of it).

    One warp per bitmap word (32 blocks); does nothing when validation flagged the stream.
    """
    if (bad[slot] >> 4) == vepoch:
        return
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    t = cuda.blockIdx.x * WARPS + warp
    if t >= nbw:
        return
    bw, c, offs = _tile_codes(buf8, buf32, bm_w0, codes_off, pre, t, is32, lane)
    packed = (offs << 8) | c  # one 64-bit shuffle fetches a block's code and offset
    for j in range(32):
        base = (t * 32 + j) * BLOCK
        if base >= n:
            break
        i = base + lane
        valid = i < n
        if (bw >> j) & 1:
            kk = cuda.popc(bw & ((np.int64(1) << j) - 1))
            got = cuda.shfl_sync(FULL, packed, kk)
            code = got & 0xFF
            off = pay_w0 + (got >> 8)
            if code == CODE_RAW or code == CODE_RAW64:
                if code == CODE_RAW and is32:
                    if valid:
                        outbits[i] = buf32[off + lane]
                elif valid:
                    wlo = np.int64(buf32[off + 2 * lane])
                    whi = np.int64(buf32[off + 2 * lane + 1])
                    if code == CODE_RAW:
                        outbits[i] = wlo | (whi << 32)
                    else:
                        d = _f64_of_words(wlo, whi)
                        if d != d:
                            # float32 NaN from a float64 NaN as CPUs convert it: sign kept,
                            # quiet bit set, top payload bits kept.
                            outbits[i] = ((whi >> 31) << 31) | 0x7FC00000 | (
                                ((whi & 0xFFFFF) << 3) | (wlo >> 29)) & 0x3FFFFF
                        else:
                            _store(out, i, d)
            else:
                q = _decode_fixed(buf32, off, code, lane)
                if valid:
                    _store(out, i, _dmul(np.float64(q), step))
        elif valid:
            outbits[i] = 0


@cuda.jit(device=True)
def _lane_value(buf32, off, code, q, is32, step, lane):  # type: ignore[no-untyped-def]
    """float64 value of this lane of a non-zero block, for the raw sum of an add."""
    if code == CODE_RAW and is32:
        return _f64_of_f32word(np.int64(buf32[off + lane]))
    if code == CODE_RAW or code == CODE_RAW64:
        return _f64_of_words(np.int64(buf32[off + 2 * lane]), np.int64(buf32[off + 2 * lane + 1]))
    return _dmul(np.float64(q), step)


@cuda.jit(**_JIT)
def add_kernel(a8, a32, a_bm, a_codes, a_pay, pre_a, b8, b32, b_bm, b_codes, b_pay, pre_b,  # type: ignore[no-untyped-def]
               bad, va_epoch, vb_epoch, n, is32, step, ntiles, ctr, flags, vals, epoch,
               bitmap_s, codes_s, pay_s, totals):
    """Homomorphic sum of two validated streams into scratch (format.md, "Homomorphic add").

    Tile t (32 blocks) pairs bitmap word t of both streams. Warps 0 and 1 look up the codes
    and payload offsets of a's and b's blocks in the tile; each warp then builds 4 output
    blocks, and ``_finish_tile`` places them as in compression.
    """
    if (bad[0] >> 4) == va_epoch or (bad[1] >> 4) == vb_epoch:
        return
    s_code = cuda.shared.array(TILE, np.int32)
    s_size = cuda.shared.array(TILE, np.int32)
    s_off = cuda.shared.array(TILE, np.int32)
    s_stage = cuda.shared.array(STAGE_WORDS, np.uint32)
    s_misc = cuda.shared.array(4, np.int64)
    s_ic = cuda.shared.array(64, np.int32)
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
        bw, c, o = _tile_codes(a8, a32, a_bm, a_codes, pre_a, tile, is32, lane)
        s_ic[lane] = c
        s_io[lane] = a_pay + o
        if lane == 0:
            s_bw[0] = bw
    elif warp == 1:
        bw, c, o = _tile_codes(b8, b32, b_bm, b_codes, pre_b, tile, is32, lane)
        s_ic[32 + lane] = c
        s_io[32 + lane] = b_pay + o
        if lane == 0:
            s_bw[1] = bw
    cuda.syncthreads()
    bwa = s_bw[0]
    bwb = s_bw[1]
    lo = cuda.local.array(BPW, np.int64)
    hi = cuda.local.array(BPW, np.int64)
    for k in range(BPW):
        j = warp * BPW + k
        i = (tile * TILE + j) * BLOCK + lane
        valid = i < n
        za = (bwa >> j) & 1
        zb = (bwb >> j) & 1
        code = np.int64(0)
        size = np.int64(0)
        wlo = np.int64(0)
        whi = np.int64(0)
        if za != 0 and zb != 0:
            ka = cuda.popc(bwa & ((np.int64(1) << j) - 1))
            kb = cuda.popc(bwb & ((np.int64(1) << j) - 1))
            ca = np.int64(s_ic[ka])
            oa = s_io[ka]
            cb = np.int64(s_ic[32 + kb])
            ob = s_io[32 + kb]
            rawa = ca == CODE_RAW or ca == CODE_RAW64
            rawb = cb == CODE_RAW or cb == CODE_RAW64
            qa = np.int64(0)
            qb = np.int64(0)
            if not rawa:
                qa = _decode_fixed(a32, oa, ca, lane)
            if not rawb:
                qb = _decode_fixed(b32, ob, cb, lane)
            raw = rawa or rawb
            s = np.int64(0)
            if valid:
                s = qa + qb
            if not raw:
                raw = _ballot(abs(s) >= QMAX_ADD) != 0
            if not raw:
                code, wlo = _encode_q(s, valid, lane)
                if code != 0:
                    size = 1 + (code & 0x7F)
            else:
                code = np.int64(CODE_RAW64 if is32 else CODE_RAW)
                size = np.int64(64)
                if valid:
                    va = _lane_value(a32, oa, ca, qa, is32, step, lane)
                    vb = _lane_value(b32, ob, cb, qb, is32, step, lane)
                    sm = _dadd(va, vb)
                    bits = np.int64(CANON_NAN64)
                    if sm == sm:
                        bits = _bits_of_f64(sm)
                    wlo = bits & 0xFFFFFFFF
                    whi = (bits >> 32) & 0xFFFFFFFF
        elif za != 0 or zb != 0:
            # One side is a zero block: the other block's code and payload, unchanged.
            if za != 0:
                kk = cuda.popc(bwa & ((np.int64(1) << j) - 1))
                code = np.int64(s_ic[kk])
                off = s_io[kk]
                size = _code_words(code, is32)
                if size == 64:
                    wlo = np.int64(a32[off + 2 * lane])
                    whi = np.int64(a32[off + 2 * lane + 1])
                elif lane < size:
                    wlo = np.int64(a32[off + lane])
            else:
                kk = cuda.popc(bwb & ((np.int64(1) << j) - 1))
                code = np.int64(s_ic[32 + kk])
                off = s_io[32 + kk]
                size = _code_words(code, is32)
                if size == 64:
                    wlo = np.int64(b32[off + 2 * lane])
                    whi = np.int64(b32[off + 2 * lane + 1])
                elif lane < size:
                    wlo = np.int64(b32[off + lane])
        lo[k] = wlo
        hi[k] = whi
        if lane == 0:
            s_code[j] = code
            s_size[j] = size
    cuda.syncthreads()
    _finish_tile(tile, ntiles, tid, lo, hi, s_code, s_size, s_off, s_stage, s_misc,
                 flags, vals, epoch, bitmap_s, codes_s, pay_s, totals)


@cuda.jit(**_JIT)
def range_kernel(xb, n, keys):  # type: ignore[no-untyped-def]
    """Min and max of the finite values as order-preserving int64 keys (atomics on keys)."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    lo = np.int64(0x7FFFFFFFFFFFFFFF)
    hi = np.int64(-0x7FFFFFFFFFFFFFFF - 1)
    is32 = _raw_words(xb) == 32
    while i < n:
        s = np.int64(xb[i])
        if is32:
            fin = (s & 0x7F800000) != 0x7F800000
            key = s ^ ((s >> 63) & 0x7FFFFFFF)
        else:
            fin = (s & 0x7FF0000000000000) != 0x7FF0000000000000
            key = s ^ ((s >> 63) & 0x7FFFFFFFFFFFFFFF)
        if fin:
            lo = min(lo, key)
            hi = max(hi, key)
        i += stride
    lo = _wmin(lo)
    hi = _wmax(hi)
    if (cuda.threadIdx.x & 31) == 0:
        cuda.atomic.min(keys, 0, lo)
        cuda.atomic.max(keys, 1, hi)


KERNELS = {
    "compress_kernel": compress_kernel,
    "assemble_kernel": assemble_kernel,
    "index_kernel": index_kernel,
    "decode_kernel": decode_kernel,
    "add_kernel": add_kernel,
    "range_kernel": range_kernel,
}


def signatures() -> dict[str, list[tuple[str, tuple]]]:
    """Argument types of every kernel as ``_cuda`` launches them, per data type.

    Used to compile PTX without a GPU (tests/ptx, bench/gpu/ptx_report.py).
    """
    from numba import float32, float64, int32, int64, uint8, uint32

    a_u8, a_u32, a_i32, a_i64 = uint8[::1], uint32[::1], int32[::1], int64[::1]
    out: dict[str, list[tuple[str, tuple]]] = {}
    out["compress_kernel"] = [
        (dt, (xb, int64, float64, float64, int64, a_i64, a_u32, a_i64, int64, a_u32, a_u8,
              a_u32, a_i64))
        for dt, xb in (("float32", a_i32), ("float64", a_i64))
    ]
    out["assemble_kernel"] = [
        ("any", (a_u32, int64, int64, a_u32, a_u32, int64, int64, a_u32)),
    ]
    out["index_kernel"] = [
        ("any", (a_u8, a_u32, int64, int64, int64, int64, int64, int64, int64, int64, a_i64,
                 a_u32, a_i64, a_u32, a_i64, int64, a_i64, a_i64, int64)),
    ]
    out["decode_kernel"] = [
        (dt, (a_u8, a_u32, int64, int64, int64, int64, int64, int64, float64, a_i64, a_i64,
              int64, int64, fo, bo))
        for dt, fo, bo in (("float32", float32[::1], a_u32), ("float64", float64[::1], a_i64))
    ]
    out["add_kernel"] = [
        ("any", (a_u8, a_u32, int64, int64, int64, a_i64, a_u8, a_u32, int64, int64, int64,
                 a_i64, a_i64, int64, int64, int64, int64, float64, int64, a_i64, a_u32, a_i64,
                 int64, a_u32, a_u8, a_u32, a_i64)),
    ]
    out["range_kernel"] = [
        (dt, (xb, int64, a_i64)) for dt, xb in (("float32", a_i32), ("float64", a_i64))
    ]
    return out
