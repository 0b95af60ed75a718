"""Block codec of the CPU backend: constants, per-block encode/decode, chunks and launches.

A block is 32 elements (docs/format.md); the helpers here quantize, encode and decode one
block and are inlined (``inline="always"``) into the chunk kernels of ``encode``, ``decode``
and ``add``. Work is split into chunks of ``CHUNK_BLOCKS`` blocks (a multiple of 32, so
each chunk owns whole bitmap words) and ``prange`` runs over chunks; the host helpers at the
end size chunks, scan their counts and launch the kernels.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ccoll.compressor import format as fmt
from ccoll.compressor.cpu import notice
from ccoll.compressor.cpu.intrinsics import (
    _bitlen,
    _f32_from_bits,
    _f64_from_bits,
    _or_plane,
    _plane_of,
    _popcount,
    _q_float,
    _q_int,
    _round_like,
)
from ccoll.errors import MismatchError
from ccoll.runtime.cpu_threads import counts, parallel_launch

BLOCK = fmt.BLOCK
CHUNK_BLOCKS = 256  # 8192 elements; a multiple of 32 so bitmap words are never shared
QLIM = 2147483647.0  # |v| < 2^31 - 1: quantizable (format.md, "Pre-quantization")
QMAX_ADD = 2147483647  # a homomorphic sum with |q| >= 2^31 - 1 is stored raw
CODE_RAW = fmt.CODE_RAW
CODE_RAW64 = fmt.CODE_RAW64
LOR = fmt.LORENZO_BIT
CANONICAL_NAN64 = 0x7FF8000000000000  # stored for a NaN sum (docs/format.md, "Homomorphic add")
# Below this many elements the kernels run on the calling thread: waking the pool costs
# more than the work, and far more on a loaded machine where a pool thread may wait
# for a core.
SERIAL_BELOW = 1 << 16


# ---------------------------------------------------------------------- per-block helpers
#
# Hot loops index slices with the loop variable (``xb[l]``, not ``x[base + l]``): numba
# cannot prove ``base + l >= 0`` and would emit negative-index wraparound, which turns the
# vectorized loads into gathers. Lorenzo differences use a ``prev`` recurrence, which LLVM
# vectorizes with lane shuffles instead of re-reading a freshly stored array.


@njit(nogil=True, cache=True, inline="always")
def _block_words(code, is32):  # type: ignore[no-untyped-def]
    """Payload words of a valid code (0 for a zero block)."""
    if code == 0:
        return 0
    if code == CODE_RAW:
        return 32 if is32 else 64
    if code == CODE_RAW64:
        return 64
    return 1 + (code & 0x7F)


@njit(nogil=True, cache=True, inline="always")
def _code_valid(code, is32):  # type: ignore[no-untyped-def]
    """Tell whether a code byte is allowed in a non-zero block (format.md, "Block kinds")."""
    w = code & 0x7F
    if code & LOR:
        return 1 <= w <= 31
    if 1 <= code <= CODE_RAW:
        return True
    return code == CODE_RAW64 and is32


@njit(nogil=True, cache=True, inline="always")
def _code_of(orq, ord_):  # type: ignore[no-untyped-def]
    """Code from the OR of ``|q|`` and of ``|Lorenzo c|`` over a block (rules 3-4).

    The bit length of the maximum equals the bit length of the OR. Requires every
    ``|q| <= 2^31 - 1``; a Lorenzo candidate of 32 bits or more is never chosen because
    it is not narrower.
    """
    if orq == 0:
        return 0
    wq = _bitlen(orq)
    wd = _bitlen(ord_)
    if wd < wq:
        return LOR | wd
    return wq


@njit(nogil=True, cache=True, inline="always")
def _quantize(xb, eb, step, q):  # type: ignore[no-untyped-def]
    """Quantize one block; ``xb`` holds its valid elements (1..32), ``q`` receives 32 lanes.

    Returns (rejected lanes, OR of ``|q|``, OR of ``|q[l] - q[l-1]|`` over valid lanes). A
    lane is accepted when ``|v| < 2^31 - 1`` and ``|y - x| < eb`` in float64, with
    ``y = T(float64(q) * step)``. Padding lanes get ``q = 0``.
    """
    m = xb.size
    bad = np.int64(0)
    orq = np.int64(0)
    ord_ = np.int64(0)
    prev = np.int64(0)
    if m == BLOCK:
        # Branch-free body with a constant trip count so LLVM vectorizes it.
        for l in range(BLOCK):
            xd = np.float64(xb[l])
            v = xd / step
            inr = abs(v) < QLIM
            vv = v if inr else 0.0
            fq = np.floor(vv + 0.5)  # |fq| < 2^31: float64(qi) is fq itself
            qi = _q_int(fq)
            yd = _round_like(fq * step, xb)
            ok = inr & (abs(yd - xd) < eb)
            bad += np.int64(not ok)
            orq |= abs(qi)
            ord_ |= abs(qi - prev)
            prev = qi
            q[l] = qi
    else:
        for l in range(m):
            xd = np.float64(xb[l])
            v = xd / step
            inr = abs(v) < QLIM
            vv = v if inr else 0.0
            fq = np.floor(vv + 0.5)  # |fq| < 2^31: float64(qi) is fq itself
            qi = _q_int(fq)
            yd = _round_like(fq * step, xb)
            ok = inr & (abs(yd - xd) < eb)
            bad += np.int64(not ok)
            orq |= abs(qi)
            ord_ |= abs(qi - prev)
            prev = qi
            q[l] = qi
        for l in range(m, BLOCK):
            q[l] = 0
    return bad, orq, ord_


@njit(nogil=True, cache=True, inline="always")
def _planes(mag, w, Wb):  # type: ignore[no-untyped-def]
    """Bit-planes 0..w-1 of the 32 uint32 magnitudes ``mag`` into ``Wb[1 : 1 + w]``."""
    for j in range(w):
        Wb[1 + j] = _plane_of(mag, j)


@njit(nogil=True, cache=True, inline="always")
def _encode_x(xb, step, code, Wb, mag):  # type: ignore[no-untyped-def]
    """Quantize ``xb`` again and write the fixed-length block ``code`` into ``Wb``."""
    m = xb.size
    lor = np.int64(1) if code & LOR else np.int64(0)
    sign = np.int64(0)
    prev = np.int64(0)
    if m == BLOCK:
        for l in range(BLOCK):
            # Same arithmetic as _quantize; the block is known to be accepted.
            v = np.float64(xb[l]) / step
            qi = _q_int(np.floor(v + 0.5))  # accepted: |v| < 2^31 - 1
            c = qi - prev * lor
            prev = qi
            sign |= np.int64(c < 0) << l
            mag[l] = abs(c)
    else:
        for l in range(m):
            v = np.float64(xb[l]) / step
            qi = _q_int(np.floor(v + 0.5))  # accepted: |v| < 2^31 - 1
            c = qi - prev * lor
            prev = qi
            sign |= np.int64(c < 0) << l
            mag[l] = abs(c)
        for l in range(m, BLOCK):
            mag[l] = 0
    Wb[0] = sign
    _planes(mag, code & 0x7F, Wb)


@njit(nogil=True, cache=True, inline="always")
def _encode_q(q, m, code, Wb, mag):  # type: ignore[no-untyped-def]
    """Write quantized values ``q`` (valid lanes ``< m``) as the fixed-length block ``code``."""
    lor = np.int64(1) if code & LOR else np.int64(0)
    sign = np.int64(0)
    prev = np.int64(0)
    if m == BLOCK:
        for l in range(BLOCK):  # a constant trip count, so LLVM vectorizes it
            c = q[l] - prev * lor
            prev = q[l]
            sign |= np.int64(c < 0) << l
            mag[l] = abs(c)
    else:
        for l in range(m):
            c = q[l] - prev * lor
            prev = q[l]
            sign |= np.int64(c < 0) << l
            mag[l] = abs(c)
        for l in range(m, BLOCK):
            mag[l] = 0
    Wb[0] = sign
    _planes(mag, code & 0x7F, Wb)


@njit(nogil=True, cache=True, inline="always")
def _magnitudes(Wb, code, mag):  # type: ignore[no-untyped-def]
    """Assemble the 32 magnitudes (uint32, below 2^31) of a fixed-length block."""
    for l in range(BLOCK):
        mag[l] = 0
    for j in range(code & 0x7F):
        _or_plane(mag, np.int64(Wb[1 + j]), j)


@njit(nogil=True, cache=True, inline="always")
def _decode_q(Wb, code, mag, q):  # type: ignore[no-untyped-def]
    """Read a fixed-length block ``Wb`` into ``q[0:32]`` (int64, Lorenzo undone)."""
    _magnitudes(Wb, code, mag)
    sign = np.int64(Wb[0])
    for l in range(BLOCK):
        s = (sign >> l) & 1
        q[l] = (np.int64(mag[l]) ^ -s) + s  # negate where the sign bit is set
    if code & LOR:
        # Magnitudes are below 2^31, so 32 of them cannot overflow int64.
        acc = np.int64(0)
        for l in range(BLOCK):
            acc += q[l]
            q[l] = acc


@njit(nogil=True, cache=True, inline="always")
def _decode_to(Wb, code, mag, ob, step):  # type: ignore[no-untyped-def]
    """Decode a fixed-length block straight into ``ob`` (its valid lanes)."""
    _magnitudes(Wb, code, mag)
    sign = np.int64(Wb[0])
    m = ob.size
    if code & LOR:
        acc = np.int64(0)
        for l in range(m):
            s = (sign >> l) & 1
            acc += (np.int64(mag[l]) ^ -s) + s
            ob[l] = np.float64(acc) * step
    elif m == BLOCK:
        for l in range(BLOCK):
            s = (sign >> l) & 1
            ob[l] = _q_float((np.int64(mag[l]) ^ -s) + s) * step
    else:
        for l in range(m):
            s = (sign >> l) & 1
            ob[l] = _q_float((np.int64(mag[l]) ^ -s) + s) * step


@njit(nogil=True, cache=True, inline="always")
def _write_raw(bb, is32, Wb):  # type: ignore[no-untyped-def]
    """Store a raw block (code 32) of the valid lanes' bit patterns ``bb`` into ``Wb``."""
    m = bb.size
    if is32:
        for l in range(m):
            Wb[l] = bb[l]
        for l in range(m, BLOCK):
            Wb[l] = 0
    else:
        for l in range(m):
            v = np.int64(bb[l])
            Wb[2 * l] = v & 0xFFFFFFFF
            Wb[2 * l + 1] = (v >> 32) & 0xFFFFFFFF
        for l in range(2 * m, 2 * BLOCK):
            Wb[l] = 0


@njit(nogil=True, cache=True, inline="always")
def _raw_value(Wb, code, l, is32):  # type: ignore[no-untyped-def]
    """float64 value of lane ``l`` of a raw block (code 32 or 33)."""
    if code == CODE_RAW and is32:
        return _f32_from_bits(np.int64(Wb[l]))
    lo = np.int64(Wb[2 * l])
    hi = np.int64(Wb[2 * l + 1])
    return _f64_from_bits(lo | (hi << 32))


# ------------------------------------------------------------------ chunks and launches


class _threads_for:  # noqa: N801 - used as a function: ``with _threads_for(n):``
    """Launch the numba kernels inside safely, on one thread when ``n`` elements are few.

    A class, not a generator-based context manager (it runs around every kernel launch:
    docs/performance.md, "What a kernel launch and a ring chunk cost").
    """

    __slots__ = ("n", "launch", "prev")

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        notice.watch()  # a compilation (numba cache miss) says so on stderr
        launch = self.launch = parallel_launch()
        launch.__enter__()
        self.prev = 0
        if self.n < SERIAL_BELOW:
            try:
                get, put = counts()  # thread-local, so concurrent callers do not interfere
                prev = get()
                if prev != 1:  # already one (a one-thread lane): two calls saved
                    put(1)
                    self.prev = prev
            except BaseException:
                launch.__exit__(None, None, None)
                raise

    def __exit__(self, *exc: object) -> None:
        try:
            if self.prev:
                counts()[1](self.prev)
        finally:
            self.launch.__exit__(*exc)


def _small(eb: float, dtype: np.dtype) -> np.floating:
    """Largest value of ``dtype`` that is at most ``eb / 2`` (see ``_plan_lossy``).

    -1 (no element qualifies) when ``step = 2 * eb`` overflows: then every reconstruction
    is NaN and every block raw, which the shortcut must not contradict.
    """
    if not math.isfinite(2.0 * eb):
        return dtype.type(-1.0)
    # Exact unless eb is subnormal; then it may round up by half a subnormal, which still
    # leaves |x / step| <= 1/3 and |x| < eb for every |x| <= half.
    half = eb * 0.5
    big = float(np.finfo(dtype).max)
    if half >= big:
        return dtype.type(big)
    t = dtype.type(half)
    if float(t) > half:
        t = np.nextafter(t, dtype.type(0))
    return dtype.type(t)


def _scan(counts: np.ndarray) -> tuple[np.ndarray, int]:
    """Exclusive prefix sum (int64) and total."""
    out = np.zeros(counts.size, np.int64)
    if counts.size > 1:
        np.cumsum(counts[:-1], out=out[1:])
    total = int(out[-1] + counts[-1]) if counts.size else 0
    return out, total


def _readonly(a: np.ndarray) -> np.ndarray:
    """Return a read-only view, so kernels always see the same array type.

    numba compiles a separate specialization for read-only arrays (bytes, mapped files);
    passing every input read-only halves the compiled (and cached) kernels.
    """
    v = a.view()
    v.flags.writeable = False
    return v


def _stream_out(out: object, nbytes: int, sizing: str) -> np.ndarray:
    """Check a caller's ``out`` for a stream of ``nbytes`` and return its first bytes.

    ``sizing`` names the call that sizes such an ``out`` (the message's hint).
    """
    if not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1):
        raise MismatchError("out for a stream must be a 1-D uint8 numpy array")
    if not (out.flags.writeable and out.flags.c_contiguous):
        raise MismatchError("out for a stream must be writable and contiguous")
    if out.size < nbytes:
        raise MismatchError(
            f"out holds {out.size} bytes, the sum needs {nbytes} (size it with {sizing})"
        )
    if out.ctypes.data % 4:
        raise MismatchError("out for a stream must be 4-byte aligned")
    return out[:nbytes]


def _nchunks(nblocks: int) -> int:
    return (nblocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS


@njit(nogil=True, cache=True, inline="always")
def _chunk_nonzero(bitmap, c):  # type: ignore[no-untyped-def]
    """Non-zero blocks of chunk ``c``: the set bits of its bitmap words."""
    per = CHUNK_BLOCKS // 32
    s = 0
    for i in range(c * per, min(c * per + per, bitmap.size)):
        s += _popcount(np.int64(bitmap[i]))
    return s


@njit(nogil=True, cache=True, inline="always")
def _exclusive_scan(counts, out):  # type: ignore[no-untyped-def]
    """``out[i]`` = the sum of ``counts[:i]``; returns the total."""
    t = np.int64(0)
    for i in range(counts.size):
        out[i] = t
        t += counts[i]
    return t
