"""Homomorphic add on the CPU: the sum of two streams, and of a stream and raw data.

The result decodes to the sum of what the operands decode to (docs/format.md,
"Homomorphic add"). Pass 1 sums each chunk into its own region of a scratch buffer; a
serial scan over the chunks' sizes then places them in the output (pass 2).
"""

from __future__ import annotations

import math
import threading

import numpy as np
from numba import njit, prange

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu import v2
from ccoll.compressor.cpu.blocks import (
    BLOCK,
    CANONICAL_NAN64,
    CHUNK_BLOCKS,
    CODE_RAW,
    CODE_RAW64,
    LOR,
    QMAX_ADD,
    _block_words,
    _code_of,
    _decode_q,
    _encode_q,
    _magnitudes,
    _nchunks,
    _quantize,
    _raw_value,
    _readonly,
    _scan,
    _small,
    _stream_out,
    _threads_for,
    _write_raw,
)
from ccoll.compressor.cpu.decode import _validate, as_stream
from ccoll.compressor.cpu.intrinsics import _bits_from_f64
from ccoll.errors import ErrorBoundError, FormatError, MismatchError

__all__ = ["add", "add_data", "sum_bound"]


# Fixed-length blocks with no prediction and widths up to this add bit-sliced: their sum
# has at most 31 bits (|q_a + q_b| <= 2^30 - 2 < 2^31 - 1), so it never overflows to raw.
BITSLICE_MAX_W = 29
_ALL = 0xFFFFFFFF


@njit(nogil=True, cache=True, inline="always")
def _valid_mask(m):  # type: ignore[no-untyped-def]
    """Word with bits ``0..m-1`` set: the valid lanes of a block of ``m`` elements."""
    return (np.int64(1) << m) - 1 if m < BLOCK else np.int64(_ALL)


@njit(nogil=True, cache=True, inline="always")
def _bitsliced_sum(Wa, wa, Wb, wb, vm, T, M, D):  # type: ignore[no-untyped-def]
    """Code of the sum of two no-prediction blocks, computed on their bit-planes.

    Word ``j`` of a plane array holds bit ``j`` of all 32 lanes, so one 32-bit operation
    acts on 32 lanes (the lanes' carries stay in their own bit). ``q_a + q_b`` is formed in
    two's complement: sign-magnitude ``q = (|q| ^ s) + s`` (``s`` all-ones where negative),
    so the sum is ``(|q_a| ^ s_a) + (|q_b| ^ s_b) + s_a + s_b``, one ripple-carry pass with
    carry-in ``s_a`` and an increment chain for ``s_b``. The same planes give the sum's
    sign and magnitude (``M``), the Lorenzo residual ``d[l] = t[l] - t[l-1]`` (a lane shift
    and a subtraction) and its magnitude (``D``), hence both candidate widths of rules 3-4.
    Padding lanes (outside ``vm``) are 0. Returns ``(code, sign word)``; the payload
    planes are ``M`` (no prediction) or ``D`` (Lorenzo). Needs ``max(wa, wb) <= 29``.
    """
    sa = np.int64(Wa[0]) & vm
    sb = np.int64(Wb[0]) & vm
    top = max(wa, wb) + 1  # the sum fits planes 0..top in two's complement
    c1 = sa
    c2 = sb
    for j in range(top + 1):
        x = (np.int64(Wa[1 + j]) & vm if j < wa else np.int64(0)) ^ sa
        y = (np.int64(Wb[1 + j]) & vm if j < wb else np.int64(0)) ^ sb
        h = x ^ y
        s = h ^ c1
        c1 = (x & y) | (c1 & h)
        T[j] = s ^ c2
        c2 = s & c2
    neg = T[top]
    # |t| = (t ^ neg) + neg on planes 0..top-1 (|t| < 2^top).
    c = neg
    wq = 0
    nz = np.int64(0)
    for j in range(top):
        v = T[j] ^ neg
        mj = v ^ c
        c = v & c
        M[j] = mj
        nz |= mj
        if mj != 0:
            wq = j + 1
    if wq <= 1:
        # |t| <= 1 everywhere: a Lorenzo residual of width 0 would need every t equal to
        # t[0] - 0, i.e. all zero, so no prediction wins (or the block is zero).
        return np.int64(wq), neg
    # Lorenzo cannot be narrower if some lane with |t| >= 2^(wq-1) follows a zero lane (or
    # is lane 0) or a lane of the other sign: there |d| = |t[l]| + |t[l-1]| >= 2^(wq-1).
    # Most noisy blocks have such a lane, and this test costs a few word operations.
    if M[wq - 1] & (((nz << 1) ^ _ALL) | (neg ^ (neg << 1))) & vm:
        return np.int64(wq), neg
    # d = t - (t shifted up one lane), two's complement on planes 0..top+1.
    c = np.int64(_ALL)
    for j in range(top + 2):
        tj = T[min(j, top)]
        nu = ((tj << 1) & _ALL) ^ _ALL
        h = tj ^ nu
        D[j] = h ^ c
        c = (tj & nu) | (c & h)
    dneg = D[top + 1]
    c = dneg
    wd = 0
    for j in range(top + 1):
        v = D[j] ^ dneg
        dj = v ^ c
        c = v & c
        dj &= vm
        D[j] = dj
        if dj != 0:
            wd = j + 1
    if wd < wq:
        return np.int64(LOR | wd), dneg & vm
    return np.int64(wq), neg


@njit(nogil=True, cache=True, inline="always")
def _sum_into(qa, qb, m):  # type: ignore[no-untyped-def]
    """``qa[l] += qb[l]`` on the ``m`` valid lanes (padding lanes set to 0).

    Returns (any ``|sum| >= 2^31 - 1``, OR of ``|sum|``, OR of ``|sum[l] - sum[l-1]|``),
    the inputs of rules 3-4 and of the overflow test of docs/format.md.
    """
    big = np.int64(0)
    orq = np.int64(0)
    ord_ = np.int64(0)
    prev = np.int64(0)
    if m == BLOCK:
        for l in range(BLOCK):  # constant trip count: vectorized
            t = qa[l] + qb[l]
            big |= np.int64(abs(t) >= QMAX_ADD)
            orq |= abs(t)
            ord_ |= abs(t - prev)
            prev = t
            qa[l] = t
    else:
        for l in range(m):
            t = qa[l] + qb[l]
            big |= np.int64(abs(t) >= QMAX_ADD)
            orq |= abs(t)
            ord_ |= abs(t - prev)
            prev = t
            qa[l] = t
        for l in range(m, BLOCK):
            qa[l] = 0
    return big, orq, ord_


@njit(nogil=True, cache=True, inline="always")
def _add_block(Wa, ca, Wb, cb, m, is32, qa, qb, mag, magb):  # type: ignore[no-untyped-def]
    """Code of the sum of two non-zero blocks; for a fixed sum ``qa`` = q_a + q_b."""
    rawsum = CODE_RAW64 if is32 else CODE_RAW
    if ca == CODE_RAW or ca == CODE_RAW64 or cb == CODE_RAW or cb == CODE_RAW64:
        return rawsum
    if (ca | cb) & LOR:
        _decode_q(Wa, ca, mag, qa)
        _decode_q(Wb, cb, mag, qb)
        big, orq, ord_ = _sum_into(qa, qb, m)
        return rawsum if big else _code_of(orq, ord_)
    # No prefix sums: one vectorizable pass over both blocks' magnitudes and signs.
    big = np.int64(0)
    orq = np.int64(0)
    ord_ = np.int64(0)
    prev = np.int64(0)
    _magnitudes(Wa, ca, mag)
    _magnitudes(Wb, cb, magb)
    sa = np.int64(Wa[0])
    sb = np.int64(Wb[0])
    for l in range(m):
        ta = (sa >> l) & 1
        tb = (sb >> l) & 1
        t = ((np.int64(mag[l]) ^ -ta) + ta) + ((np.int64(magb[l]) ^ -tb) + tb)
        big |= np.int64(abs(t) >= QMAX_ADD)
        orq |= abs(t)
        ord_ |= abs(t - prev)
        prev = t
        qa[l] = t
    for l in range(m, BLOCK):
        qa[l] = 0
    if big:
        return rawsum
    return _code_of(orq, ord_)


@njit(nogil=True, cache=True, inline="always")
def _store_sum(Wo, l, s):  # type: ignore[no-untyped-def]
    """Store the float64 sum ``s`` as lane ``l`` of a code-32/33 block (one fixed NaN)."""
    bits = _bits_from_f64(s) if s == s else np.int64(CANONICAL_NAN64)
    Wo[2 * l] = bits & 0xFFFFFFFF
    Wo[2 * l + 1] = (bits >> 32) & 0xFFFFFFFF


@njit(nogil=True, cache=True, inline="always")
def _raw_sum(Wa, ca, Wb, cb, m, is32, step, qa, qb, mag, Wo):  # type: ignore[no-untyped-def]
    """Store ``float64(a) + float64(b)`` per lane as 64 words (code 32 or 33)."""
    fa = ca != CODE_RAW and ca != CODE_RAW64
    fb = cb != CODE_RAW and cb != CODE_RAW64
    if fa:
        _decode_q(Wa, ca, mag, qa)
    if fb:
        _decode_q(Wb, cb, mag, qb)
    for l in range(m):
        va = np.float64(qa[l]) * step if fa else _raw_value(Wa, ca, l, is32)
        vb = np.float64(qb[l]) * step if fb else _raw_value(Wb, cb, l, is32)
        _store_sum(Wo, l, va + vb)
    for l in range(2 * m, 2 * BLOCK):
        Wo[l] = 0


@njit(nogil=True, cache=True, inline="always")
def _sum_block(Wa, ca, Wb, cb, m, is32, So, qa, qb, mag, magb, T, M, D):  # type: ignore[no-untyped-def]
    """Code of the sum of two non-zero blocks; a fixed-length sum's payload goes to ``So``.

    ``So`` has room for ``len(Wa) + len(Wb)`` words, which holds any fixed-length sum of
    two fixed-length blocks (its Lorenzo width is at most ``max(w_a, w_b + 1) + 1`` and
    the chosen width is at most that). Raw sums are left to the write pass.
    """
    if ca == CODE_RAW or ca == CODE_RAW64 or cb == CODE_RAW or cb == CODE_RAW64:
        return CODE_RAW64 if is32 else CODE_RAW
    if ((ca | cb) & LOR) == 0 and max(ca, cb) <= BITSLICE_MAX_W:
        code, sign = _bitsliced_sum(Wa, ca, Wb, cb, _valid_mask(m), T, M, D)
        if code != 0:
            So[0] = sign
            src = D if code & LOR else M
            for j in range(code & 0x7F):
                So[1 + j] = src[j]
        return code
    code = _add_block(Wa, ca, Wb, cb, m, is32, qa, qb, mag, magb)
    if code != 0 and code != CODE_RAW and code != CODE_RAW64:
        _encode_q(qa, m, code, So, mag)
    return code


@njit(parallel=True, nogil=True, cache=True)
def _add_chunks(Wa, bma, ca, cka, cpa, Wb, bmb, cb, ckb, cpb, n, is32, step,
                ccodes, bitmap, chunk_nnz, chunk_words, S):  # type: ignore[no-untyped-def]
    """Pass 1 of an add: every chunk's sum, packed at the start of its own scratch region.

    Chunk ``c`` writes its code bytes to ``ccodes[b0:]`` (``b0`` its first block), its
    bitmap words in place, and its payload to ``S`` from ``2 * (cpa[c] + cpb[c])``: no
    output block is longer than twice its two inputs together (a fixed-length sum fits
    in ``w_a + w_b + 2`` words, a raw sum's 64 words in twice a raw input and a non-zero
    other), so the regions never overlap. A serial scan then places the chunks.
    """
    nblocks = ccodes.size
    for c in prange(chunk_nnz.size):
        qa = np.empty(BLOCK, np.int64)
        qb = np.empty(BLOCK, np.int64)
        mag = np.empty(BLOCK, np.uint32)
        magb = np.empty(BLOCK, np.uint32)
        T = np.empty(BLOCK + 2, np.int64)
        M = np.empty(BLOCK + 2, np.int64)
        D = np.empty(BLOCK + 2, np.int64)
        ka = cka[c]
        pa = cpa[c]
        kb = ckb[c]
        pb = cpb[c]
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        sp0 = 2 * (pa + pb)
        sp = sp0
        nz = 0
        word = np.int64(0)
        for b in range(b0, b1):
            za = (np.int64(bma[b >> 5]) >> (b & 31)) & 1
            zb = (np.int64(bmb[b >> 5]) >> (b & 31)) & 1
            codea = np.int64(ca[ka]) if za else np.int64(0)
            codeb = np.int64(cb[kb]) if zb else np.int64(0)
            sa = _block_words(codea, is32)
            sb = _block_words(codeb, is32)
            if za and zb:
                m = min(BLOCK, n - b * BLOCK)
                code = _sum_block(Wa[pa : pa + sa], codea, Wb[pb : pb + sb], codeb, m, is32,
                                  S[sp : sp + sa + sb], qa, qb, mag, magb, T, M, D)
                if code == CODE_RAW or code == CODE_RAW64:
                    _raw_sum(Wa[pa : pa + sa], codea, Wb[pb : pb + sb], codeb, m, is32, step,
                             qa, qb, mag, S[sp : sp + 64])
            elif za:
                # One side is a zero block: the other block's payload, unchanged.
                code = codea
                S[sp : sp + sa] = Wa[pa : pa + sa]
            else:
                code = codeb
                S[sp : sp + sb] = Wb[pb : pb + sb]
            if code != 0:
                word |= np.int64(1) << (b & 31)
                ccodes[b0 + nz] = code
                nz += 1
                sp += _block_words(code, is32)
            ka += za
            pa += sa
            kb += zb
            pb += sb
            if (b & 31) == 31 or b == b1 - 1:
                bitmap[b >> 5] = word
                word = 0
        chunk_nnz[c] = nz
        chunk_words[c] = sp - sp0


@njit(parallel=True, nogil=True, cache=True)
def _place_chunks(ccodes, S, chunk_src, chunk_nnz, chunk_words, chunk_k, chunk_pos,
                  cbytes, W):  # type: ignore[no-untyped-def]
    """Pass 2 of an add: copy each chunk's code bytes and payload to their final place."""
    for c in prange(chunk_nnz.size):
        b0 = c * CHUNK_BLOCKS
        k = chunk_k[c]
        cbytes[k : k + chunk_nnz[c]] = ccodes[b0 : b0 + chunk_nnz[c]]
        sp0 = chunk_src[c]
        pos = chunk_pos[c]
        W[pos : pos + chunk_words[c]] = S[sp0 : sp0 + chunk_words[c]]


@njit(nogil=True, cache=True, inline="always")
def _raw_sum_data(Wa, ca, xb, cb, qb, m, is32, step, qa, mag, Wo):  # type: ignore[no-untyped-def]
    """Like :func:`_raw_sum` with the second block given as data ``xb`` quantized to ``qb``."""
    fa = ca != CODE_RAW and ca != CODE_RAW64
    if fa:
        _decode_q(Wa, ca, mag, qa)
    for l in range(m):
        va = np.float64(qa[l]) * step if fa else _raw_value(Wa, ca, l, is32)
        vb = np.float64(xb[l]) if cb == CODE_RAW else np.float64(qb[l]) * step
        _store_sum(Wo, l, va + vb)
    for l in range(2 * m, 2 * BLOCK):
        Wo[l] = 0


@njit(parallel=True, nogil=True, cache=True)
def _add_data_chunks(Wa, bma, ca, cka, cpa, x, bits, eb, step, small, mask, ccodes, bitmap,
                     chunk_nnz, chunk_words, S, chunk_src):  # type: ignore[no-untyped-def]
    """One pass of :func:`add_data`: each chunk's sum packed at ``S[chunk_src[c]:]``.

    Each block of ``x`` gets the code :func:`compress_abs` would give it (same rules, same
    arithmetic), then the block is added to the stream's block by the rules of
    :func:`add` with that block as the second operand, so the bytes are those of
    ``add(a, compress_abs(x, eb))``. No output block is longer than its stream block plus
    64 words, which sizes each chunk's region.
    """
    n = x.size
    nblocks = ccodes.size
    is32 = x.itemsize == 4
    rawsum = CODE_RAW64 if is32 else CODE_RAW
    for c in prange(chunk_nnz.size):
        qa = np.empty(BLOCK, np.int64)
        qb = np.empty(BLOCK, np.int64)
        mag = np.empty(BLOCK, np.uint32)
        ka = cka[c]
        pa = cpa[c]
        b0 = c * CHUNK_BLOCKS
        b1 = min(b0 + CHUNK_BLOCKS, nblocks)
        sp0 = chunk_src[c]
        sp = sp0
        nz = 0
        word = np.int64(0)
        for b in range(b0, b1):
            za = (np.int64(bma[b >> 5]) >> (b & 31)) & 1
            codea = np.int64(ca[ka]) if za else np.int64(0)
            sa = _block_words(codea, is32)
            base = b * BLOCK
            e = min(base + BLOCK, n)
            m = e - base
            xb = x[base:e]
            # The data block's code, exactly as compress_abs decides it.
            if eb == 0.0:
                bb = bits[base:e]
                acc = np.uint64(0)
                for l in range(m):
                    acc |= np.uint64(bb[l]) & mask
                codeb = np.int64(0) if acc == 0 else np.int64(CODE_RAW)
            else:
                tiny = m == BLOCK
                if tiny:
                    for l in range(BLOCK):
                        tiny &= abs(xb[l]) <= small
                if tiny:
                    codeb = np.int64(0)
                else:
                    bad, orq, ord_ = _quantize(xb, eb, step, qb)
                    codeb = np.int64(CODE_RAW) if bad else np.int64(_code_of(orq, ord_))
            Wo = S[sp : sp + sa + 2 * BLOCK]
            if codeb == 0:
                code = codea
                for i in range(sa):
                    Wo[i] = Wa[pa + i]
            elif codea == 0:
                code = codeb
                if codeb == CODE_RAW:
                    _write_raw(bits[base:e], is32, Wo)
                else:
                    _encode_q(qb, m, codeb, Wo, mag)
            elif codea == CODE_RAW or codea == CODE_RAW64 or codeb == CODE_RAW:
                code = rawsum
                _raw_sum_data(Wa[pa : pa + sa], codea, xb, codeb, qb, m, is32, step, qa, mag,
                              Wo)
            else:
                _decode_q(Wa[pa : pa + sa], codea, mag, qa)
                big, orq, ord_ = _sum_into(qa, qb, m)
                if big:
                    code = rawsum
                    # qa now holds the sum; decode the stream block again for the raw sum.
                    _raw_sum_data(Wa[pa : pa + sa], codea, xb, codeb, qb, m, is32, step, qa,
                                  mag, Wo)
                else:
                    code = np.int64(_code_of(orq, ord_))
                    if code != 0:
                        _encode_q(qa, m, code, Wo, mag)
            if code != 0:
                word |= np.int64(1) << (b & 31)
                ccodes[b0 + nz] = code
                nz += 1
                sp += _block_words(code, is32)
            ka += za
            pa += sa
            if (b & 31) == 31 or b == b1 - 1:
                bitmap[b >> 5] = word
                word = 0
        chunk_nnz[c] = nz
        chunk_words[c] = sp - sp0


def sum_bound(a: float, b: float) -> float:
    """Add two bounds, rounding up to the next float64 when the float64 sum is inexact."""
    s = a + b
    # Exact when the sum minus each term gives back the other (TwoSum error is zero).
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    if err > 0.0:
        s = math.nextafter(s, math.inf)
    return s


def _sum_header(ha: fmt.StreamHeader, hb: fmt.StreamHeader) -> tuple[float, int]:
    """Check that two streams add (dtype, count, eb) and return the sum's bound and nterms."""
    if ha.dtype != hb.dtype:
        raise MismatchError(f"cannot add a {ha.dtype} stream to a {hb.dtype} stream")
    if ha.n != hb.n:
        raise MismatchError(f"cannot add streams of {ha.n} and {hb.n} elements")
    if np.float64(ha.eb).view(np.uint64) != np.float64(hb.eb).view(np.uint64):
        raise MismatchError(
            f"cannot add streams quantized with different bounds eb={ha.eb!r} and eb={hb.eb!r}"
        )
    bound = sum_bound(ha.bound, hb.bound)
    if not math.isfinite(bound):
        raise ErrorBoundError(f"the sum of bounds {ha.bound!r} + {hb.bound!r} overflows float64")
    nterms = ha.nterms + hb.nterms
    if nterms >= 1 << 32:
        raise MismatchError(f"a sum of {nterms} streams does not fit the header's nterms")
    return bound, nterms


def add(a: object, b: object, out: np.ndarray | None = None) -> np.ndarray:
    """Homomorphic sum of two host streams (docs/format.md, "Homomorphic add").

    With ``out`` (a writable contiguous uint8 array, ``max_nbytes`` always suffices) the
    stream is written there and the used prefix is returned.
    """
    sa, sb = as_stream(a), as_stream(b)
    ha, hb = fmt.parse_header(sa), fmt.parse_header(sb)
    va, vb = ha.version, hb.version
    if va != vb:
        raise FormatError(
            "streams of format versions 1 and 2 cannot be added; compress both with the "
            "same version"
        )
    if va == fmt.VERSION2:
        l2a, l2b = v2.validate_v2(sa, ha), v2.validate_v2(sb, hb)
        bound, nterms = _sum_header(l2a.hdr, l2b.hdr)
        return v2.add_v2(l2a, l2b, bound, nterms, out)
    la = _validate(sa, ha)
    lb = _validate(sb, hb)
    bound, nterms = _sum_header(ha, hb)
    is32 = ha.dtype == np.float32
    n = ha.n
    nblocks = ha.nblocks
    nch = _nchunks(nblocks)
    step = 2.0 * ha.eb
    ccodes = np.empty(nblocks, np.uint8)
    bitmap_t = np.empty((nblocks + 31) // 32, np.uint32)
    chunk_nnz = np.empty(nch, np.int64)
    chunk_words = np.empty(nch, np.int64)
    # Scratch for the chunks' payloads (see _add_chunks): twice both payloads.
    scratch = np.empty(2 * (la.W.size + lb.W.size), np.uint32)
    if nch:
        with _threads_for(n):
            _add_chunks(la.W, la.bitmap, la.codes, la.chunk_k, la.chunk_pos,
                        lb.W, lb.bitmap, lb.codes, lb.chunk_k, lb.chunk_pos,
                        n, is32, step, ccodes, bitmap_t, chunk_nnz, chunk_words, scratch)
    chunk_k, nnz = _scan(chunk_nnz)
    chunk_pos, pwords = _scan(chunk_words)
    hdr = fmt.StreamHeader(dtype=ha.dtype, shape=ha.shape, eb=ha.eb, bound=bound, nnz=nnz,
                           payload_words=pwords, nterms=nterms)
    res = (np.empty(hdr.nbytes, np.uint8) if out is None
           else _stream_out(out, hdr.nbytes, "max_nbytes"))
    hdr.pack_into(res)
    res[hdr.codes_offset + nnz : hdr.payload_offset] = 0
    if nch:
        res[hdr.bitmap_offset : hdr.codes_offset].view(np.uint32)[:] = bitmap_t
        cbytes = res[hdr.codes_offset : hdr.codes_offset + nnz]
        W = res[hdr.payload_offset :].view(np.uint32)
        with _threads_for(n):
            _place_chunks(ccodes, scratch, 2 * (la.chunk_pos + lb.chunk_pos), chunk_nnz,
                          chunk_words, chunk_k, chunk_pos, cbytes, W)
    return res


# Scratch of add_data, kept per thread: its chunk regions are sized for the worst case and
# written only at their start, and paging fresh memory in for that costs more than the
# kernel (numpy asks for 2 MiB huge pages from 4 MiB up, each zeroed when first touched).
# Buffers up to SCRATCH_KEEP words are kept; larger requests get one of their own.
SCRATCH_KEEP = 1 << 24
_kept = threading.local()


def _scratch(nwords: int) -> np.ndarray:
    """Return an uninitialized uint32 buffer of ``nwords`` words, reused by this thread."""
    if nwords > SCRATCH_KEEP:
        return np.empty(nwords, np.uint32)
    buf = getattr(_kept, "buf", None)
    if buf is None or buf.size < nwords:
        buf = np.empty(max(nwords, 1 << 16), np.uint32)
        _kept.buf = buf
    return buf[:nwords]


def _data_header(ha: fmt.StreamHeader, x: object, eb: float | None) -> tuple[float, int]:
    """Check that data ``x`` adds to a stream (eb, dtype, count); the sum's bound and nterms."""
    if eb is not None and np.float64(eb).view(np.uint64) != np.float64(ha.eb).view(np.uint64):
        raise MismatchError(
            f"cannot add data quantized with eb={eb!r} to a stream with eb={ha.eb!r}"
        )
    if not isinstance(x, np.ndarray) or x.dtype != ha.dtype:
        raise MismatchError(
            f"cannot add {getattr(x, 'dtype', type(x).__name__)} data to a {ha.dtype} stream"
        )
    if x.size != ha.n:
        raise MismatchError(f"cannot add {x.size} values to a stream of {ha.n} elements")
    bound = sum_bound(ha.bound, ha.eb)
    if not math.isfinite(bound):
        raise ErrorBoundError(f"the sum of bounds {ha.bound!r} + {ha.eb!r} overflows float64")
    nterms = ha.nterms + 1
    if nterms >= 1 << 32:
        raise MismatchError(f"a sum of {nterms} streams does not fit the header's nterms")
    return bound, nterms


def add_data(a: object, x: np.ndarray, eb: float | None = None) -> np.ndarray:
    """``add(a, compress_abs(x, eb))`` in one pass, ``eb`` being the stream's own.

    Byte for byte the same stream (docs/format.md, "Homomorphic add"), without encoding
    ``x``'s blocks to bit-planes and decoding them again: what a homomorphic ring step does
    with its own share of a block. ``x`` is a contiguous float array of the stream's dtype
    and element count; a given ``eb`` must equal the stream's bit for bit, as :func:`add`
    requires of two streams.
    """
    sa = as_stream(a)
    ha = fmt.parse_header(sa)
    if ha.version == fmt.VERSION2:
        l2 = v2.validate_v2(sa, ha)
        bound, nterms = _data_header(ha, x, eb)
        return v2.add_data_v2(l2, x, bound, nterms)
    la = _validate(sa, ha)
    bound, nterms = _data_header(ha, x, eb)
    flat = _readonly(np.ascontiguousarray(x).reshape(-1))
    is32 = ha.dtype == np.float32
    n = ha.n
    nblocks = ha.nblocks
    nch = _nchunks(nblocks)
    eb = ha.eb
    ccodes = np.empty(nblocks, np.uint8)
    bitmap_t = np.empty((nblocks + 31) // 32, np.uint32)
    chunk_nnz = np.empty(nch, np.int64)
    chunk_words = np.empty(nch, np.int64)
    chunk_src = la.chunk_pos + np.arange(nch, dtype=np.int64) * (CHUNK_BLOCKS * 2 * BLOCK)
    scratch = _scratch(la.W.size + nblocks * 2 * BLOCK)
    bits = flat.view(np.uint32) if is32 else flat.view(np.uint64)
    mask = np.uint64(0x7FFFFFFF if is32 else 0x7FFFFFFFFFFFFFFF)
    if nch:
        with _threads_for(n):
            _add_data_chunks(la.W, la.bitmap, la.codes, la.chunk_k, la.chunk_pos, flat, bits,
                             eb, 2.0 * eb, _small(eb, flat.dtype), mask, ccodes, bitmap_t,
                             chunk_nnz, chunk_words, scratch, chunk_src)
    chunk_k, nnz = _scan(chunk_nnz)
    chunk_pos, pwords = _scan(chunk_words)
    hdr = fmt.StreamHeader(dtype=ha.dtype, shape=ha.shape, eb=eb, bound=bound, nnz=nnz,
                           payload_words=pwords, nterms=nterms)
    res = np.empty(hdr.nbytes, np.uint8)
    hdr.pack_into(res)
    res[hdr.codes_offset + nnz : hdr.payload_offset] = 0
    if nch:
        res[hdr.bitmap_offset : hdr.codes_offset].view(np.uint32)[:] = bitmap_t
        cbytes = res[hdr.codes_offset : hdr.codes_offset + nnz]
        W = res[hdr.payload_offset :].view(np.uint32)
        with _threads_for(n):
            _place_chunks(ccodes, scratch, chunk_src, chunk_nnz, chunk_words, chunk_k,
                          chunk_pos, cbytes, W)
    return res
