"""Block codec of stream format version 2 on the CPU (docs/format.md, "Format version 2").

The index and the payload are bit streams. Writers and readers keep their state in
scalars (``pos`` the next word, ``acc`` the pending bits, ``nb`` how many) that the inline
helpers take and return, so a field costs a shift, an OR and a predictable branch; a
field is at most 32 bits wide, so ``acc`` stays below ``2^63`` in an int64.

A writer stores every word it completes; the last, partial word of a chunk is handed back
to the caller (the next chunk's stream may start inside it), who ORs it in after all
chunks are written, so the bytes do not depend on how chunks are scheduled.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ccoll.compressor.cpu.blocks import BLOCK
from ccoll.compressor.cpu.intrinsics import (
    HAVE_AVX512,
    HAVE_BMI2,
    HAVE_VPOPCNT,
    LUT_BITS,
    _bitlen,
    _bits_at,
    _lut_store,
    _or_plane,
    _pdep64,
    _pext64,
    _plane_of,
    _popcount,
    _pp_store2,
    _pp_store4,
    _pp_store8,
    _tzcnt,
)

KIND_PP = 0
KIND_SP = 1
KIND_RAW = 2
KIND_RAW64 = 3
CODE_RAW_V2 = KIND_RAW << 10
CODE_RAW64_V2 = KIND_RAW64 << 10
NO_BLOCK = -1  # code array entry of a zero block (code 0 is PP(0, 0))
NCODES = 4096  # 12-bit code space of the presence and rank tables
BIG_COST = 1 << 40


def _rep_table() -> np.ndarray:
    """``REP[h]``: bit ``i*h`` set for every ``i*h < 64``, the first bit of each h-bit field."""
    rep = np.zeros(33, np.uint64)
    for h in range(1, 33):
        rep[h] = sum(1 << i for i in range(0, 64, h))
    return rep.view(np.int64)


# The high parts of a patched-planes block are p fields of h bits in lane order. When
# p*h <= 64 they are moved between that layout and bit-planes over the lanes with one
# pext and one pdep per plane (bit j of every field: the set bits of REP[h] << j), so no
# loop runs over the high lanes.
REP = _rep_table()


@njit(nogil=True, cache=True, inline="always")
def _put(W, pos, acc, nb, val, w):  # type: ignore[no-untyped-def]
    """Append the ``w``-bit field ``val`` (``w <= 32``, ``nb < 32``)."""
    acc |= val << nb
    nb += w
    if nb >= 32:
        W[pos] = acc & 0xFFFFFFFF
        pos += 1
        acc >>= 32
        nb -= 32
    return pos, acc, nb


@njit(nogil=True, cache=True, inline="always")
def _push(W, pos, acc, nb, val, w):  # type: ignore[no-untyped-def]
    """:func:`_put` without a branch, for a buffer that only this writer touches.

    The pending word is stored whether or not it is complete (a later field or the
    caller's final store overwrites it), so whether a word completes costs no branch
    misprediction. The buffer needs one word of room after the last field's word.
    """
    acc |= val << nb
    nb += w
    W[pos] = acc & 0xFFFFFFFF
    full = nb >> 5
    pos += full
    acc >>= full << 5
    nb &= 31
    return pos, acc, nb


@njit(nogil=True, cache=True, inline="always")
def _get(W, pos, acc, nb, w):  # type: ignore[no-untyped-def]
    """Read a ``w``-bit field (``w <= 32``); a word is loaded only when its bits are needed."""
    if nb < w:
        acc |= np.int64(W[pos]) << nb
        pos += 1
        nb += 32
    val = acc & ((np.int64(1) << w) - 1)
    acc >>= w
    nb -= w
    return val, pos, acc, nb


@njit(nogil=True, cache=True, inline="always")
def _reader_at(W, bit):  # type: ignore[no-untyped-def]
    """Reader state at bit offset ``bit`` (reads the word only if ``bit`` is inside it)."""
    pos = bit >> 5
    r = bit & 31
    if r:
        return pos + 1, np.int64(W[pos]) >> r, 32 - r
    return pos, np.int64(0), np.int64(0)


@njit(nogil=True, cache=True, inline="always")
def _writer_at(bit):  # type: ignore[no-untyped-def]
    """Writer state at bit offset ``bit``: the bits before it in its word stay 0 here."""
    return bit >> 5, np.int64(0), bit & 31


@njit(nogil=True, cache=True, inline="always")
def _code_bits(code, mask, is32):  # type: ignore[no-untyped-def]
    """Payload bits of a valid code; ``mask`` is the block's mask word for kind 0."""
    kind = code >> 10
    a = (code >> 5) & 31
    b = code & 31
    if kind == KIND_PP:
        p = _popcount(mask)
        return (p if a == 0 else 32) + 32 * a + p * b
    if kind == KIND_SP:
        return (a + 1) * (6 + b)
    if kind == KIND_RAW and is32:
        return 1024
    return 2048


@njit(nogil=True, cache=True, inline="always")
def _choose(q, mag):  # type: ignore[no-untyped-def]
    """Code and payload bits of a non-zero quantized block (rules 3-4); fills ``mag``.

    ``q`` holds 32 lanes (padding 0) with ``|q| < 2^31 - 1``. The cost of ``k >= 1`` is at
    least ``64 + 32k``, so the search stops once that reaches the best cost: a later ``k``
    cannot be cheaper, and ties keep the smallest ``k``.
    """
    m = np.int64(0)
    c = np.int64(0)
    for l in range(BLOCK):
        a = abs(q[l])
        mag[l] = a
        m = max(m, a)
        c += np.int64(a != 0)
    return _choose_mc(mag, m, c)


@njit(nogil=True, cache=True, inline="always")
def _choose_mc(mag, m, c):  # type: ignore[no-untyped-def]
    """:func:`_choose` given ``mag = |q|``, its maximum ``m`` and non-zero count ``c``."""
    w = _bitlen(m)
    best = np.int64(BIG_COST)
    bk = np.int64(0)
    bh = np.int64(0)
    for k in range(w):
        if k == 0:
            p = c
            cost = 32 + p + p * _bitlen(m - 1)
        else:
            if 64 + 32 * k >= best:
                break
            thr = np.uint32(1) << np.uint32(k)
            p = np.int64(0)
            for l in range(BLOCK):
                p += np.int64(mag[l] >= thr)
            cost = 64 + 32 * k + p * _bitlen((m >> k) - 1)
        if cost < best:
            best = cost
            bk = k
            bh = _bitlen((m >> k) - 1)
    v = _bitlen(m - 1)
    if c <= 4 and c * (6 + v) <= best:
        return (KIND_SP << 10) | ((c - 1) << 5) | v, c * (6 + v)
    return (bk << 5) | bh, best - 32


@njit(nogil=True, cache=True, inline="always")
def _emit_q(W, pos, acc, nb, code, q, mag, tmp):  # type: ignore[no-untyped-def]
    """Write the payload of quantized block ``q`` (``mag = |q|``) with ``code``.

    ``tmp`` is scratch (32 uint32).
    Returns the writer state and the mask word (0 for a sparse block).
    """
    sign = np.int64(0)
    for l in range(BLOCK):
        sign |= np.int64(q[l] < 0) << l
    a = (code >> 5) & 31
    b = code & 31
    if code >> 10 == KIND_SP:
        nzm = np.int64(0)
        for l in range(BLOCK):
            nzm |= np.int64(mag[l] != 0) << l
        c = a + 1
        posf = np.int64(0)
        sg = np.int64(0)
        mm = nzm
        for i in range(c):
            l = _tzcnt(mm)
            posf |= l << (5 * i)
            sg |= ((sign >> l) & 1) << i
            mm &= mm - 1
        pos, acc, nb = _push(W, pos, acc, nb, posf, 5 * c)
        pos, acc, nb = _push(W, pos, acc, nb, sg, c)
        if b:
            mm = nzm
            for _ in range(c):
                l = _tzcnt(mm)
                pos, acc, nb = _push(W, pos, acc, nb, np.int64(mag[l]) - 1, b)
                mm &= mm - 1
        return pos, acc, nb, np.int64(0)
    k = a
    h = b
    thr = np.uint32(1) << np.uint32(k)
    M = np.int64(0)
    for l in range(BLOCK):
        M |= np.int64(mag[l] >= thr) << l
    p = _popcount(M)
    if k == 0:
        pos, acc, nb = _push(W, pos, acc, nb, _pext64(sign, M), p)
    else:
        pos, acc, nb = _push(W, pos, acc, nb, sign, 32)
    for j in range(k):
        pos, acc, nb = _push(W, pos, acc, nb, np.int64(_plane_of(mag, j)), 32)
    nbh = p * h
    if h and nbh <= 64:
        for l in range(BLOCK):
            f = (M >> l) & 1
            tmp[l] = ((np.int64(mag[l]) >> k) - 1) & -f
        hb = np.int64(0)
        rep = REP[h]
        for j in range(h):
            hb |= _pdep64(_pext64(np.int64(_plane_of(tmp, j)), M), rep << j)
        if nbh > 32:
            pos, acc, nb = _push(W, pos, acc, nb, hb & 0xFFFFFFFF, 32)
            pos, acc, nb = _push(W, pos, acc, nb, (hb >> 32) & 0xFFFFFFFF, nbh - 32)
        else:
            pos, acc, nb = _push(W, pos, acc, nb, hb & 0xFFFFFFFF, nbh)
    elif h:
        mm = M
        while mm:
            l = _tzcnt(mm)
            pos, acc, nb = _push(W, pos, acc, nb, (np.int64(mag[l]) >> k) - 1, h)
            mm &= mm - 1
    return pos, acc, nb, M


@njit(nogil=True, cache=True, inline="always")
def _emit_raw_bits(W, pos, acc, nb, bb, m, wide):  # type: ignore[no-untyped-def]
    """Write a raw block of the ``m`` valid lanes' bit patterns ``bb`` (32 or 64 bits each)."""
    for l in range(BLOCK):
        v = np.int64(bb[l]) if l < m else np.int64(0)
        if wide:
            pos, acc, nb = _push(W, pos, acc, nb, v & 0xFFFFFFFF, 32)
            pos, acc, nb = _push(W, pos, acc, nb, (v >> 32) & 0xFFFFFFFF, 32)
        else:
            pos, acc, nb = _push(W, pos, acc, nb, v & 0xFFFFFFFF, 32)
    return pos, acc, nb


@njit(nogil=True, cache=True, inline="always")
def _read_q(W, pos, acc, nb, code, M, qv, lo, hi):  # type: ignore[no-untyped-def]
    """Read a quantized block (kind 0 or 1) into ``qv[0:32]`` (int64, signed).

    ``lo`` and ``hi`` are scratch (32 uint32 each).
    Returns the reader state and 0, or -1 for sparse positions that are not strictly
    increasing. Magnitudes of a hostile stream stay below ``2^62``.
    """
    a = (code >> 5) & 31
    b = code & 31
    if code >> 10 == KIND_SP:
        for l in range(BLOCK):
            qv[l] = 0
        c = a + 1
        posf, pos, acc, nb = _get(W, pos, acc, nb, 5 * c)
        sg, pos, acc, nb = _get(W, pos, acc, nb, c)
        prev = np.int64(-1)
        bad = np.int64(0)
        for i in range(c):
            l = (posf >> (5 * i)) & 31
            bad |= np.int64(l <= prev)
            prev = l
            val, pos, acc, nb = _get(W, pos, acc, nb, b)
            s = (sg >> i) & 1
            qv[l] = ((val + 1) ^ -s) + s
        return pos, acc, nb, -bad
    k = a
    h = b
    p = _popcount(M)
    if k == 0:
        g, pos, acc, nb = _get(W, pos, acc, nb, p)
        sign = _pdep64(g, M)
    else:
        sign, pos, acc, nb = _get(W, pos, acc, nb, 32)
    for l in range(BLOCK):
        lo[l] = 0
    for j in range(k):
        pl, pos, acc, nb = _get(W, pos, acc, nb, 32)
        _or_plane(lo, pl, j)
    nbh = p * h
    if nbh <= 64:
        if nbh > 32:
            h0, pos, acc, nb = _get(W, pos, acc, nb, 32)
            h1, pos, acc, nb = _get(W, pos, acc, nb, nbh - 32)
            hb = h0 | (h1 << 32)
        else:
            hb, pos, acc, nb = _get(W, pos, acc, nb, nbh)
        for l in range(BLOCK):
            hi[l] = 0
        rep = REP[h] if h else np.int64(0)
        for j in range(h):
            _or_plane(hi, _pdep64(_pext64(hb, rep << j), M), j)
        for l in range(BLOCK):
            f = (M >> l) & 1
            v = np.int64(lo[l]) + (((np.int64(hi[l]) + 1) << k) & -f)
            s = (sign >> l) & 1
            qv[l] = (v ^ -s) + s
        return pos, acc, nb, np.int64(0)
    for l in range(BLOCK):
        qv[l] = np.int64(lo[l])
    mm = M
    while mm:
        l = _tzcnt(mm)
        hi, pos, acc, nb = _get(W, pos, acc, nb, h)
        qv[l] += (hi + 1) << k
        mm &= mm - 1
    for l in range(BLOCK):
        s = (sign >> l) & 1
        qv[l] = (qv[l] ^ -s) + s
    return pos, acc, nb, np.int64(0)


@njit(nogil=True, cache=True, inline="always")
def _read_raw(W, pos, acc, nb, wide, rb):  # type: ignore[no-untyped-def]
    """Read a raw block's 32 fields (64-bit if ``wide``) into the int64 array ``rb``."""
    for l in range(BLOCK):
        lo_, pos, acc, nb = _get(W, pos, acc, nb, 32)
        if wide:
            hi_, pos, acc, nb = _get(W, pos, acc, nb, 32)
            rb[l] = lo_ | (hi_ << 32)
        else:
            rb[l] = lo_
    return pos, acc, nb


# The decoder reads the payload by bit offset instead: a field is one unaligned 8-byte
# load, a shift and a mask (``_field_at``), so whether a field crosses a word costs no
# branch, and fields whose offsets are known read independently of each other. ``last``
# is ``W.nbytes - 8``; ``W`` must hold at least 2 words (decode_into pads a shorter
# payload), and every field read ends inside ``W`` (validation summed the sizes).


@njit(nogil=True, cache=True, inline="always")
def _field_at(W, last, bit, w):  # type: ignore[no-untyped-def]
    """Read the ``w``-bit field (``w <= 57``) at bit ``bit`` of ``W``, without a branch."""
    return _bits_at(W, bit, last) & ((np.int64(1) << w) - 1)


@njit(nogil=True, cache=True, inline="always")
def _sparse_head(W, last, bit, a):  # type: ignore[no-untyped-def]
    """Return a sparse block's count ``a + 1``, position and sign fields, and the next bit."""
    c = a + 1
    posf = _field_at(W, last, bit, 5 * c)
    bit += 5 * c
    sg = _field_at(W, last, bit, c)
    return c, posf, sg, bit + c


@njit(nogil=True, cache=True, inline="always")
def _sparse_entry(W, last, bit, posf, i, b, prev):  # type: ignore[no-untyped-def]
    """Return sparse entry ``i``: lane, 1 if not after ``prev``, value, next bit."""
    l = (posf >> (5 * i)) & 31
    return l, np.int64(l <= prev), _field_at(W, last, bit, b), bit + b


@njit(nogil=True, cache=True, inline="always")
def _pp_sign(W, last, bit, k, M):  # type: ignore[no-untyped-def]
    """Return a patched-planes block's high-lane count, 32-lane sign word and next bit.

    With ``k = 0`` only the ``p`` lanes of mask ``M`` have signs stored.
    """
    p = _popcount(M)
    sw = p if k == 0 else 32
    g = _field_at(W, last, bit, sw)
    return p, _pdep64(g, M) if k == 0 else g, bit + sw


# The high parts of a patched-planes block go to their lanes by rank (a popcount per
# lane) where a vector popcount exists. Without one (AVX2) that popcount costs a dozen
# instructions per 4 lanes, and pdep (one instruction with BMI2) spreads the fields of
# blocks with h <= 2 instead: 1.35-1.38x the decoder's speed on a Zen 3 core
# (docs/dev/avx2.md).
SPREAD_HIGH = HAVE_BMI2 and not HAVE_VPOPCNT
_EVEN = 0x5555555555555555  # bit 2l for every lane l


@njit(nogil=True, cache=True, inline="always")
def _pp_lanes_ranked(M, hb, h, k, sign, lo, qv):  # type: ignore[no-untyped-def]
    """Write the lanes of a patched-planes block to ``qv``: ``lo`` plus the high parts, signed.

    ``hb`` holds the ``p*h <= 64`` bits of the high parts, lane by lane in the order of
    mask ``M``'s set bits. ``qv[l] = +-(lo[l] + ((field + 1) << k))`` for a high lane,
    ``+-lo[l]`` for another, negative where bit ``l`` of ``sign`` is set.
    """
    hm = (np.int64(1) << h) - 1
    for l in range(BLOCK):
        f = (M >> l) & 1
        # The i-th high lane's field starts at bit i*h < 64 of hb (the clamp keeps the
        # shift of a lane that is not high defined; its field is masked off by f).
        sh = min(_popcount(M & ((np.int64(1) << l) - 1)) * h, 63)
        v = np.int64(lo[l]) + (((((hb >> sh) & hm) + 1) << k) & -f)
        s = (sign >> l) & 1
        qv[l] = (v ^ -s) + s


@njit(nogil=True, cache=True, inline="always")
def _pp_lanes_spread(M, hb, h, k, sign, lo, qv):  # type: ignore[no-untyped-def]
    """Write :func:`_pp_lanes_ranked`'s lanes for ``h <= 2``, no lane's rank needed.

    pdep puts the i-th field of ``hb`` in the i-th high lane's 2-bit slot.
    """
    hm = (np.int64(1) << h) - 1
    e = _pdep64(hb, _pdep64(M, _EVEN) * hm)
    for l in range(BLOCK):
        f = (M >> l) & 1
        v = np.int64(lo[l]) + (((((e >> (2 * l)) & hm) + 1) << k) & -f)
        s = (sign >> l) & 1
        qv[l] = (v ^ -s) + s


@njit(nogil=True, cache=True, inline="always")
def _pp_low(W, last, bit, k, M, lo):  # type: ignore[no-untyped-def]
    """Read a patched-planes block's signs and ``k`` low planes (into ``lo``, 32 uint32).

    Returns the high-lane count, the 32-lane sign word and the bit of the high parts.
    """
    p, sign, bit = _pp_sign(W, last, bit, k, M)
    for l in range(BLOCK):
        lo[l] = 0
    for j in range(k):
        _or_plane(lo, _field_at(W, last, bit, 32), j)
        bit += 32
    return p, sign, bit


@njit(nogil=True, cache=True, inline="always")
def _pp_high(W, last, bit, nbh):  # type: ignore[no-untyped-def]
    """Return the ``nbh <= 64`` bits of a block's high parts at ``bit``, and the next bit."""
    w0 = min(nbh, 32)
    return _field_at(W, last, bit, w0) | (_field_at(W, last, bit + 32, nbh - w0) << 32), bit + nbh


@njit(nogil=True, cache=True, inline="always")
def _read_q_at(W, last, bit, code, M, qv, lo):  # type: ignore[no-untyped-def]
    """:func:`_read_q` by bit offset: the quantized block at ``bit`` into ``qv[0:32]``.

    ``lo`` is scratch (32 uint32). The high parts of a patched-planes block with
    ``p*h <= 64`` go to their lanes in one vectorized loop (:func:`_pp_lanes_ranked`,
    :func:`_pp_lanes_spread`; no loop over the ``h`` planes, whose trip count changes
    from block to block). Returns the bit after the block and 0, or -1 for
    sparse positions that are not strictly increasing.
    """
    a = (code >> 5) & 31
    b = code & 31
    if code >> 10 == KIND_SP:
        for l in range(BLOCK):
            qv[l] = 0
        c, posf, sg, bit = _sparse_head(W, last, bit, a)
        prev = np.int64(-1)
        bad = np.int64(0)
        for i in range(c):
            l, out_of_order, val, bit = _sparse_entry(W, last, bit, posf, i, b, prev)
            bad |= out_of_order
            prev = l
            s = (sg >> i) & 1
            qv[l] = ((val + 1) ^ -s) + s
        return bit, -bad
    k = a
    h = b
    p, sign, bit = _pp_low(W, last, bit, k, M, lo)
    nbh = p * h
    if nbh <= 64:
        hb, bit = _pp_high(W, last, bit, nbh)
        if SPREAD_HIGH and h <= 2:
            _pp_lanes_spread(M, hb, h, k, sign, lo, qv)
        else:
            _pp_lanes_ranked(M, hb, h, k, sign, lo, qv)
        return bit, np.int64(0)
    for l in range(BLOCK):
        qv[l] = np.int64(lo[l])
    mm = M
    while mm:
        l = _tzcnt(mm)
        hv = _field_at(W, last, bit, h)
        bit += h
        qv[l] += (hv + 1) << k
        mm &= mm - 1
    for l in range(BLOCK):
        s = (sign >> l) & 1
        qv[l] = (qv[l] ^ -s) + s
    return bit, np.int64(0)


# A block whose magnitudes are all below 2^LUT_BITS is decoded through a table of its
# float32 outputs (intrinsics._lut_store): the fields it needs are read into words, and
# the lanes are built, looked up and stored with a few vector instructions and no loop
# over lanes or over planes. Patched planes qualify with k + h < LUT_BITS and h <= 4
# (|q| <= 2^(k+h) + 2^k - 1) and p*h <= 64, sparse blocks with b <= 4 (|q| <= 2^b).
_NIB = 0x1111111111111111  # bit 4i for every i < 16


@njit(nogil=True, cache=True, inline="always")
def _lut_ok(code):  # type: ignore[no-untyped-def]
    """Whether a block of ``code`` may take :func:`_read_lut_at` (given p*h <= 64)."""
    kind = code >> 10
    a = (code >> 5) & 31
    b = code & 31
    return (kind == KIND_SP and b <= 4) or (kind == KIND_PP and b <= 4 and a + b < LUT_BITS)


@njit(nogil=True, cache=True, inline="always")
def _read_lut_at(W, last, bit, code, M, pl):  # type: ignore[no-untyped-def]
    """Read a block that :func:`_lut_ok` admits into ``pl`` for ``intrinsics._lut_store``.

    Returns the bit after the block, ``k``, the sign word and 0, or -1 for sparse
    positions that are not strictly increasing. The high parts go to 4-bit fields with
    one ``pdep`` per half block (their mask spreads the high lanes at a 4-bit stride).
    """
    nlo = LUT_BITS - 1
    a = (code >> 5) & 31
    b = code & 31
    if code >> 10 == KIND_SP:
        c, posf, sg, bit = _sparse_head(W, last, bit, a)
        prev = np.int64(-1)
        bad = np.int64(0)
        neg = np.int64(0)
        f = np.int64(0)
        x0 = np.int64(0)
        x1 = np.int64(0)
        for i in range(c):
            l, out_of_order, val, bit = _sparse_entry(W, last, bit, posf, i, b, prev)
            bad |= out_of_order
            prev = l
            f |= np.int64(1) << l
            neg |= ((sg >> i) & 1) << l
            v = val << (4 * (l & 15))
            x0 |= v & -np.int64(l < 16)
            x1 |= v & -np.int64(l >= 16)
        for j in range(nlo):
            pl[j] = 0
        pl[nlo] = x0
        pl[nlo + 1] = x1
        pl[nlo + 2] = f
        return bit, np.int64(0), neg, -bad
    k = a
    h = b
    p, sign, bit = _pp_sign(W, last, bit, k, M)
    if k:  # the planes past k are read and masked off: no loop whose length is k
        for j in range(nlo):
            pl[j] = _field_at(W, last, bit + 32 * j, 32) & -np.int64(j < k)
        bit += 32 * k
    else:
        for j in range(nlo):
            pl[j] = 0
    hb, bit = _pp_high(W, last, bit, p * h)
    hm = (np.int64(1) << h) - 1
    m0 = M & 0xFFFF
    pl[nlo] = _pdep64(hb, _pdep64(m0, _NIB) * hm)
    # h * popcount(m0) <= nbh <= 64; at 64 no high lane is left for X1, whose mask is 0.
    pl[nlo + 1] = _pdep64(hb >> ((h * _popcount(m0)) & 63), _pdep64(M >> 16, _NIB) * hm)
    pl[nlo + 2] = M
    return bit, k, sign, np.int64(0)


def _decode_lut_at(W, last, bit, code, M, pl, out, base, tab):  # type: ignore[no-untyped-def]
    """Decode a block :func:`_lut_ok` admits into ``out[base:base+32]`` through ``tab``.

    Returns the bit after the block and 0, or -1 for sparse positions that are not
    strictly increasing. Only with AVX-512 into a float32 ``out``: elsewhere it does
    nothing and is never called, so that those kernels do not compile it.
    """
    raise NotImplementedError  # only called from numba code, see the overload below


@overload(_decode_lut_at, inline="always")
def _decode_lut_at_impl(W, last, bit, code, M, pl, out, base, tab):  # type: ignore[no-untyped-def]
    if HAVE_AVX512 and out.dtype == types.float32:

        def impl(W, last, bit, code, M, pl, out, base, tab):  # type: ignore[no-untyped-def]
            bit, k, sign, err = _read_lut_at(W, last, bit, code, M, pl)
            _lut_store(out, base, tab, pl, k, sign)
            return bit, err

        return impl
    return lambda W, last, bit, code, M, pl, out, base, tab: (bit, np.int64(0))


# Without a vector popcount (AVX2) a patched-planes block with h <= 8 and p*h <= 64 whose
# values fit 31 bits is built in 32-bit lanes and stored as floats in one step
# (intrinsics._pp_store2/4/8): its high parts go to 2-, 4- or 8-bit slots by pdep, one word
# per 32, 16 or 8 lanes, so no lane needs its rank (docs/dev/avx2.md).
DIRECT32 = SPREAD_HIGH
_BYTE = 0x0101010101010101  # bit 8i for every i < 8


@njit(nogil=True, cache=True, inline="always")
def _d32_ok(code):  # type: ignore[no-untyped-def]
    """Whether a block of ``code`` may take :func:`_pp_store_lanes` (given p*h <= 64)."""
    a = (code >> 5) & 31
    b = code & 31
    return code >> 10 == KIND_PP and b <= 8 and a + b <= 30


@njit(nogil=True, cache=True, inline="always")
def _pp_store_lanes(M, hb, h, k, sign, lo, sl, out, base, step):  # type: ignore[no-untyped-def]
    """Store :func:`_pp_lanes_ranked`'s lanes times ``step`` to ``out[base:base+32]``.

    For ``h <= 8``, ``p*h <= 64`` and values below ``2^31``; ``sl`` is scratch (4 int64).
    The i-th field of ``hb`` goes to the i-th high lane's slot of 2, 4 or 8 bits by pdep.
    """
    hm = (np.int64(1) << h) - 1
    if h <= 2:
        sl[0] = _pdep64(hb, _pdep64(M, _EVEN) * hm)
        _pp_store2(out, base, lo, sl, M, k, sign, step)
    elif h <= 4:
        m0 = M & 0xFFFF
        sl[0] = _pdep64(hb, _pdep64(m0, _NIB) * hm)
        # h * popcount(m0) <= p*h <= 64; at 64 no high lane is left, and the mask is 0.
        sl[1] = _pdep64(hb >> ((h * _popcount(m0)) & 63), _pdep64(M >> 16, _NIB) * hm)
        _pp_store4(out, base, lo, sl, M, k, sign, step)
    else:
        off = np.int64(0)
        for g in range(4):
            mg = (M >> (8 * g)) & 0xFF
            sl[g] = _pdep64(hb >> (off & 63), _pdep64(mg, _BYTE) * hm)
            off += h * _popcount(mg)
        _pp_store8(out, base, lo, sl, M, k, sign, step)


@njit(nogil=True, cache=True, inline="always")
def _decode_pp32_at(W, last, bit, code, M, lo, sl, out, base, step):  # type: ignore[no-untyped-def]
    """Decode a full patched-planes block into ``out[base:base+32]``; return the next bit.

    For blocks that :func:`_d32_ok` admits and whose ``p*h <= 64``.
    """
    k = (code >> 5) & 31
    h = code & 31
    p, sign, bit = _pp_low(W, last, bit, k, M, lo)
    hb, bit = _pp_high(W, last, bit, p * h)
    _pp_store_lanes(M, hb, h, k, sign, lo, sl, out, base, step)
    return bit


@njit(nogil=True, cache=True, inline="always")
def _read_raw_at(W, last, bit, wide, rb):  # type: ignore[no-untyped-def]
    """:func:`_read_raw` by bit offset; returns the bit after the block."""
    if wide:
        for l in range(BLOCK):
            o = bit + 64 * l
            rb[l] = _field_at(W, last, o, 32) | (_field_at(W, last, o + 32, 32) << 32)
        return bit + 2048
    for l in range(BLOCK):
        rb[l] = _field_at(W, last, bit + 32 * l, 32)
    return bit + 1024


@njit(nogil=True, cache=True, inline="always")
def _place_words(src, s0, dst, o, nbits):  # type: ignore[no-untyped-def]
    """Copy ``nbits`` bits from word ``s0`` of ``src`` to bit ``o`` of ``dst``, word-wise.

    The bits of ``src`` after the ``nbits`` up to the end of their word must be 0. As a
    writer started at ``o`` (:func:`_writer_at`) would, it stores every word of ``dst`` it
    completes (the bits before ``o`` in the first one 0) and returns the last, partial
    word (0 if none), so the caller ORs it in. One shift pair per word, no branch: the
    loop vectorizes into plain vector loads and stores. The words are indexed with
    unsigned offsets: with signed ones numba's negative-index wraparound made LLVM
    vectorize the loop into gathers and scatters, several times slower.
    """
    p0 = o >> 5
    d = o & 31
    end = o + nbits
    nfull = (end >> 5) - p0
    nsrc = (nbits + 31) >> 5
    if nfull > 0:
        dst[p0] = (np.int64(src[s0]) << d) & 0xFFFFFFFF
    up = np.uint64(p0)
    us = np.uint64(s0)
    if d == 0:
        for j in range(1, nfull):
            uj = np.uint64(j)
            dst[up + uj] = src[us + uj]
    else:
        ud = np.uint32(d)
        ur = np.uint32(32 - d)
        for j in range(1, nfull):
            uj = np.uint64(j)
            prev = np.uint32(src[us + uj - np.uint64(1)])
            dst[up + uj] = (np.uint32(src[us + uj]) << ud) | (prev >> ur)
    if end & 31 == 0:
        return np.int64(0)
    cur = np.int64(src[s0 + nfull]) if nfull < nsrc else np.int64(0)
    prev = np.int64(src[s0 + nfull - 1]) if nfull >= 1 and d else np.int64(0)
    return ((cur << d) | (prev >> (32 - d))) & 0xFFFFFFFF


# ------------------------------------------------------------- bit-sliced homomorphic sum
#
# Two quantized blocks add on bit-planes, as v1's bit-sliced add does: word j of a plane
# array holds bit j of all 32 lanes' magnitudes, so one 32-bit operation acts on 32 lanes.
# A patched-planes block is nearly in that form already (its k low planes are payload
# words; its high parts become planes with one pext and one pdep per plane), and so is
# the sum that rules 3-4 code: the low planes are written as they are, the high parts
# are the planes above k less one (a borrow chain), gathered back to lane order.

# Blocks whose magnitudes have at most this many bits add on planes: the sum has at most
# 30 bits (|q_a + q_b| <= 2^30 - 2 < 2^31 - 1), so it never overflows to raw.
PLANES_MAX_W = 29
_ALL = 0xFFFFFFFF


@njit(nogil=True, cache=True, inline="always")
def _qwidth(code):  # type: ignore[no-untyped-def]
    """Bound on the bit length of ``|q|`` in a quantized block of ``code`` (kind 0 or 1)."""
    a = (code >> 5) & 31
    b = code & 31
    if code >> 10 == KIND_SP:
        return b + 1  # |q| = field + 1 <= 2^b
    return a + b + 1  # |q| = ((hi + 1) << k) + lo <= 2^(k+h) + 2^k - 1


@njit(nogil=True, cache=True, inline="always")
def _read_planes(W, pos, acc, nb, code, M, vm, P):  # type: ignore[no-untyped-def]
    """Read a quantized block (kind 0 or 1) as magnitude planes ``P[0:w]`` and a sign word.

    Lanes outside ``vm`` (the valid lanes) are cleared, as the lane-wise sum does. Returns
    the reader state, the sign word, ``w = _qwidth(code)`` and 0, or -1 for sparse
    positions that are not strictly increasing. ``P`` holds at least ``w`` int64.
    """
    a = (code >> 5) & 31
    b = code & 31
    if code >> 10 == KIND_SP:
        c = a + 1
        w = b + 1
        posf, pos, acc, nb = _get(W, pos, acc, nb, 5 * c)
        sg, pos, acc, nb = _get(W, pos, acc, nb, c)
        for j in range(w):
            P[j] = 0
        neg = np.int64(0)
        prev = np.int64(-1)
        bad = np.int64(0)
        for i in range(c):
            l = (posf >> (5 * i)) & 31
            bad |= np.int64(l <= prev)
            prev = l
            val, pos, acc, nb = _get(W, pos, acc, nb, b)
            val += 1
            neg |= ((sg >> i) & 1) << l
            for j in range(w):
                P[j] |= ((val >> j) & 1) << l
        for j in range(w):
            P[j] &= vm
        return pos, acc, nb, neg & vm, w, -bad
    k = a
    h = b
    p = _popcount(M)
    if k == 0:
        g, pos, acc, nb = _get(W, pos, acc, nb, p)
        neg = _pdep64(g, M)
    else:
        neg, pos, acc, nb = _get(W, pos, acc, nb, 32)
    for j in range(k):
        pl, pos, acc, nb = _get(W, pos, acc, nb, 32)
        P[j] = pl & vm
    nbh = p * h
    if nbh <= 64:
        if nbh > 32:
            h0, pos, acc, nb = _get(W, pos, acc, nb, 32)
            h1, pos, acc, nb = _get(W, pos, acc, nb, nbh - 32)
            hb = h0 | (h1 << 32)
        else:
            hb, pos, acc, nb = _get(W, pos, acc, nb, nbh)
        rep = REP[h] if h else np.int64(0)
        for j in range(h):
            P[k + j] = _pdep64(_pext64(hb, rep << j), M)
    else:
        for j in range(h):
            P[k + j] = 0
        mm = M
        while mm:
            l = _tzcnt(mm)
            val, pos, acc, nb = _get(W, pos, acc, nb, h)
            for j in range(h):
                P[k + j] |= ((val >> j) & 1) << l
            mm &= mm - 1
    # |q| >> k = hi + 1 on the high lanes: an increment chain with carry-in M.
    carry = M & vm
    for j in range(h):
        hj = P[k + j] & vm
        P[k + j] = hj ^ carry
        carry &= hj
    P[k + h] = carry
    return pos, acc, nb, neg & vm, k + h + 1, np.int64(0)


@njit(nogil=True, cache=True, inline="always")
def _sum_planes(Pa, wa, sa, Pb, wb, sb, T):  # type: ignore[no-untyped-def]
    """Magnitude planes of ``q_a + q_b`` into ``T``; returns (sign word, bit length of the max).

    ``q = (|q| ^ s) + s`` with ``s`` all-ones where negative, so the sum is
    ``(|q_a| ^ s_a) + (|q_b| ^ s_b) + s_a + s_b``: one ripple-carry pass with carry-in
    ``s_a`` and an increment chain for ``s_b``, over ``max(w_a, w_b) + 2`` planes of two's
    complement; then ``|t| = (t ^ neg) + neg``. ``T`` holds ``max(w_a, w_b) + 2`` int64.
    """
    top = max(wa, wb) + 1
    c1 = sa
    c2 = sb
    for j in range(top + 1):
        x = (Pa[j] if j < wa else np.int64(0)) ^ sa
        y = (Pb[j] if j < wb else np.int64(0)) ^ sb
        hx = x ^ y
        s = hx ^ c1
        c1 = (x & y) | (c1 & hx)
        T[j] = s ^ c2
        c2 = s & c2
    neg = T[top]
    c = neg
    w = 0
    for j in range(top):
        v = T[j] ^ neg
        mj = v ^ c
        c = v & c
        T[j] = mj
        if mj != 0:
            w = j + 1
    return neg, w


@njit(nogil=True, cache=True, inline="always")
def _choose_planes(T, w, S):  # type: ignore[no-untyped-def]
    """Code of a non-zero block given as magnitude planes ``T[0:w]`` (rules 3-4).

    The same choice as :func:`_choose_mc`: ``S[k]`` receives the lanes with
    ``|q| >= 2^k`` (the OR of planes ``k..w-1``), so ``p_k = popcount(S[k])``, and the
    maximum ``m`` is found plane by plane from the top.
    """
    acc = np.int64(0)
    cand = np.int64(_ALL)  # lanes that may hold the maximum
    m = np.int64(0)
    for j in range(w - 1, -1, -1):
        tj = T[j]
        acc |= tj
        S[j] = acc
        t = cand & tj
        f = np.int64(t != 0)
        cand ^= (cand ^ t) & -f
        m |= f << j
    c = _popcount(acc)
    best = np.int64(BIG_COST)
    bk = np.int64(0)
    bh = np.int64(0)
    for k in range(w):
        if k == 0:
            cost = 32 + c + c * _bitlen(m - 1)
        else:
            if 64 + 32 * k >= best:
                break
            cost = 64 + 32 * k + _popcount(S[k]) * _bitlen((m >> k) - 1)
        if cost < best:
            best = cost
            bk = k
            bh = _bitlen((m >> k) - 1)
    v = _bitlen(m - 1)
    if c <= 4 and c * (6 + v) <= best:
        return (KIND_SP << 10) | ((c - 1) << 5) | v
    return (bk << 5) | bh


@njit(nogil=True, cache=True, inline="always")
def _choose_max(S, o, m, c):  # type: ignore[no-untyped-def]
    """:func:`_choose_planes` given the maximum ``m >= 1`` and the non-zero count ``c``.

    ``S[o + k]`` are the lanes with ``|q| >= 2^k`` for ``k < bitlen(m)``, as
    :func:`_choose_planes` leaves them; the compressor knows ``m`` and ``c`` from the
    quantizer, so the planes need not be searched for the maximum. The same code.
    """
    w = _bitlen(m)
    v = _bitlen(m - 1)
    best = 32 + c + c * v
    bk = np.int64(0)
    bh = v
    for k in range(1, w):
        if 64 + 32 * k >= best:
            break
        hk = _bitlen((m >> k) - 1)
        cost = 64 + 32 * k + _popcount(S[o + k]) * hk
        if cost < best:
            best = cost
            bk = k
            bh = hk
    if c <= 4 and c * (6 + v) <= best:
        return (KIND_SP << 10) | ((c - 1) << 5) | v
    return (bk << 5) | bh


@njit(nogil=True, cache=True, inline="always")
def _put_fields(W, pos, acc, nb, H, h, L, p):  # type: ignore[no-untyped-def]
    """Write the ``h``-bit values given as planes ``H[0:h]`` of the ``p`` lanes of ``L``.

    One field per set bit of ``L`` in lane order (the high parts of a patched-planes block,
    the values of a sparse one), in groups of at most 64 bits: each group is the next
    ``min(64 // h, 32)`` lanes of ``L`` (one ``pdep`` finds them), gathered with one
    ``pext`` and one ``pdep`` per plane (all ``p * h`` bits at once when they fit in 64).
    ``h <= 32``.
    """
    rep = REP[h]
    if p * h <= 64:
        hb = np.int64(0)
        for j in range(h):
            hb |= _pdep64(_pext64(H[j], L), rep << j)
        nbh = p * h
        if nbh > 32:
            pos, acc, nb = _push(W, pos, acc, nb, hb & 0xFFFFFFFF, 32)
            pos, acc, nb = _push(W, pos, acc, nb, (hb >> 32) & 0xFFFFFFFF, nbh - 32)
        else:
            pos, acc, nb = _push(W, pos, acc, nb, hb & 0xFFFFFFFF, nbh)
        return pos, acc, nb
    g = min(64 // h, 32)
    gm = (np.int64(1) << g) - 1
    left = p
    LL = L
    while left > 0:
        Lg = _pdep64(gm, LL)
        ng = min(g, left)
        nbh = ng * h
        hb = np.int64(0)
        for j in range(h):
            hb |= _pdep64(_pext64(H[j], Lg), rep << j)
        if nbh > 32:
            pos, acc, nb = _push(W, pos, acc, nb, hb & 0xFFFFFFFF, 32)
            pos, acc, nb = _push(W, pos, acc, nb, (hb >> 32) & 0xFFFFFFFF, nbh - 32)
        else:
            pos, acc, nb = _push(W, pos, acc, nb, hb & 0xFFFFFFFF, nbh)
        LL ^= Lg
        left -= ng
    return pos, acc, nb


@njit(nogil=True, cache=True, inline="always")
def _emit_planes(W, pos, acc, nb, code, T, S, o, neg, H):  # type: ignore[no-untyped-def]
    """Write the payload of a block given as planes (after :func:`_choose_planes`).

    ``T[o:]`` the magnitude planes, ``S[o:]`` their suffix ORs, ``neg`` the sign word (0
    on zero lanes), ``H`` scratch planes. Returns the writer state and the mask word (0 for a
    sparse block): the bits of :func:`_emit_q` for the same block.
    """
    a = (code >> 5) & 31
    b = code & 31
    if code >> 10 == KIND_SP:
        nzm = S[o]
        c = a + 1
        posf = np.int64(0)
        mm = nzm
        for i in range(c):
            posf |= _tzcnt(mm) << (5 * i)
            mm &= mm - 1
        pos, acc, nb = _push(W, pos, acc, nb, posf, 5 * c)
        pos, acc, nb = _push(W, pos, acc, nb, _pext64(neg, nzm), c)
        if b:
            borrow = nzm  # |q| - 1 on the non-zero lanes
            for j in range(b):
                tj = T[o + j]
                H[j] = tj ^ borrow
                borrow &= tj ^ _ALL
            pos, acc, nb = _put_fields(W, pos, acc, nb, H, b, nzm, c)
        return pos, acc, nb, np.int64(0)
    k = a
    h = b
    L = S[o + k]
    p = _popcount(L)
    if k == 0:
        pos, acc, nb = _push(W, pos, acc, nb, _pext64(neg, L), p)
    else:
        pos, acc, nb = _push(W, pos, acc, nb, neg, 32)
    for j in range(k):
        pos, acc, nb = _push(W, pos, acc, nb, T[o + j], 32)
    if h:
        borrow = L  # (|q| >> k) - 1 on the high lanes
        for j in range(h):
            tj = T[o + k + j]
            H[j] = tj ^ borrow
            borrow &= tj ^ _ALL
        pos, acc, nb = _put_fields(W, pos, acc, nb, H, h, L, p)
    return pos, acc, nb, L


@njit(nogil=True, cache=True, inline="always")
def _copy_bits(Wi, rpos, racc, rnb, Wo, wpos, wacc, wnb, nbits):  # type: ignore[no-untyped-def]
    """Copy ``nbits`` bits from a reader to a writer (a block moved unchanged)."""
    while nbits >= 32:
        v, rpos, racc, rnb = _get(Wi, rpos, racc, rnb, 32)
        wpos, wacc, wnb = _push(Wo, wpos, wacc, wnb, v, 32)
        nbits -= 32
    if nbits:
        v, rpos, racc, rnb = _get(Wi, rpos, racc, rnb, nbits)
        wpos, wacc, wnb = _push(Wo, wpos, wacc, wnb, v, nbits)
    return rpos, racc, rnb, wpos, wacc, wnb


__all__ = [
    "KIND_PP", "KIND_SP", "KIND_RAW", "KIND_RAW64", "CODE_RAW_V2", "CODE_RAW64_V2", "NO_BLOCK",
    "NCODES", "PLANES_MAX_W",
]
