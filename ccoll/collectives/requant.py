"""The allgather half of a split bound: requantize a reduced chunk, decode what moves.

With a split (:class:`Requant`, from :func:`ccoll.collectives.policy.bounds.phase_bounds`)
the owner of a block decodes each fully reduced chunk to its float64 values, divides them
by ``N`` for an average, compresses them with the allgather's bound into a float64 stream
(:func:`requant_one`) and forwards that; every rank, the owner too, decodes those bytes and
rounds them once to the dtype (:func:`decode_one`). The ring (:mod:`ccoll.collectives.ring`)
and recursive halving (:mod:`ccoll.collectives.halving`) both run these on their worker
threads (docs/error-bound.md, "Split bound").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from ccoll.collectives.codec import api, stream_nbytes
from ccoll.compressor import format as fmt

__all__ = ["Requant", "decode_one", "divide_into", "requant_one", "scratch"]

# Elements per piece of the owner's check of a requantized chunk (float64 scratch: 256 KiB).
_CHECK_CHUNK = 1 << 15
# float64 elements of each decoding buffer a worker thread keeps (16 MiB; larger chunks
# decode into fresh arrays).
_SCRATCH_MAX = 1 << 21
_SCRATCH = threading.local()


@dataclass(frozen=True)
class Requant:
    """The allgather half of a split bound: requantize each reduced chunk before forwarding.

    ``bound`` is the absolute bound of the requantized streams (``e2``, on the result);
    ``divide`` is ``N`` for an average (the owner divides the reduced sum before it
    requantizes, so nobody divides afterwards) and 1 for a sum. ``accept``, when set, is
    what the requantization may move a value by (below ``bound``: the allgather's grid is an
    odd multiple of the reduced sum's, :func:`ccoll.collectives.ratios.split_multiple`); the
    owner checks every element against it and stores the blocks with one farther raw
    (values off the sum's grid: raw lanes). ``share`` is the split's share of the bound,
    for the cost model. Host data only.
    """

    bound: float
    divide: int = 1
    accept: float | None = None
    share: float = 0.0


def scratch(n: int, slot: int) -> np.ndarray:
    """``n`` float64 elements of a buffer this thread keeps (fresh ones above the cap).

    Decoding into memory already touched skips the page faults of a fresh array, about
    half of a decode's time on a chunk of millions of elements. The caller uses it only
    until it returns.
    """
    if n > _SCRATCH_MAX:
        return np.empty(n)
    bufs: dict[int, np.ndarray] | None = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.size < n:
        buf = bufs[slot] = np.empty(n)
    return buf[:n]


def decode_one(stream: Any, nb: int, flat_out: Any, lo: int, hi: int, wide: bool,
               kw: dict[str, Any] | None = None, divide: int = 1) -> None:
    """Decode the ``nb`` bytes of ``stream`` into ``flat_out[lo:hi]``.

    ``wide``: a requantized float64 stream into a float32 output (one rounding, to
    nearest); ``kw``: the reduce lane's ``stream=`` for device data. ``divide`` (host
    data): the average of a reduced sum, ``N``: each value's float64 sum before any
    rounding (:func:`~ccoll.compressor.cpu.decompress_wide`) is divided by it in float64
    and rounded once to the dtype, where decoding to the dtype and then dividing rounded
    twice (docs/error-bound.md, "avg").
    """
    if divide > 1:
        from ccoll.compressor.cpu import decompress_wide

        seg = flat_out[lo:hi]
        if divide & (divide - 1) == 0:
            # A power of two scales exactly (below the normal range the scaling's rounding
            # stays inside the ring bound's margin, docs/error-bound.md "avg"): decoding to
            # the dtype and scaling rounds once, unless the rounded sum overflowed where the
            # average does not (one cheap check; such a chunk takes the float64 way below).
            api().decompress(stream[:nb], out=seg)
            np.divide(seg, seg.dtype.type(divide), out=seg)
            if not np.isinf(seg).any():
                return
        w = decompress_wide(stream[:nb], out=scratch(hi - lo, 0))
        divide_into(w, float(divide), seg)
    elif wide:  # a requantized float64 stream into float32: one rounding, to nearest
        w = api().decompress(stream[:nb], out=scratch(hi - lo, 0))
        with np.errstate(over="ignore"):  # beyond the dtype's range: ±Inf, by contract
            flat_out[lo:hi] = w
    else:  # kw: the reduce lane's stream= for device data
        api().decompress(stream[:nb], out=flat_out[lo:hi], **(kw or {}))


@njit(nogil=True, cache=True)
def divide_into(w, d, out):  # type: ignore[no-untyped-def]
    """``out[i] = w[i] / d``: float64 division, then one rounding to ``out``'s dtype.

    One pass (numpy's in-place divide and then the cast took 1.3 ms on 2 Mi elements where
    this takes 0.7; beyond the dtype's range: ±Inf, by contract, without warnings).
    """
    for i in range(w.size):
        out[i] = w[i] / d


def requant_one(stream: Any, flat_out: Any, lo: int, hi: int, rq: Requant,
                version: int = 1) -> Any:
    """Requantize this rank's reduced chunk; return the stream the allgather forwards.

    The chunk's float64 values (before any rounding to the dtype), divided by ``N`` in
    float64 for an average, are compressed with the allgather's bound into a float64
    stream of format ``version``; with ``rq.accept``, the blocks with a value moved by
    ``rq.accept`` or more are stored raw instead (:func:`~ccoll.compressor.cpu.slices.raw_blocks`,
    either format). This rank decodes that stream like every other rank does.
    """
    from ccoll.compressor.cpu import decompress_wide
    from ccoll.compressor.cpu.slices import raw_blocks

    wide = decompress_wide(stream[:stream_nbytes(stream)], out=scratch(hi - lo, 0))
    if rq.divide > 1:
        np.divide(wide, float(rq.divide), out=wide)
    a = api()
    out = a.compress_abs(wide, rq.bound, version=version)
    # A float64 stream: w is exactly what every rank decodes.
    w = decompress_wide(out, out=scratch(hi - lo, 1))
    if rq.accept is not None:
        far = _far_blocks(w, wide, rq.accept)
        if far.size:
            out = raw_blocks(out, wide, far)
            w = decompress_wide(out, out=w)
    with np.errstate(over="ignore"):  # one rounding to the dtype, as decode_one's
        flat_out[lo:hi] = w
    return out


def _far_blocks(w: np.ndarray, v: np.ndarray, accept: float) -> np.ndarray:
    """Blocks (of 32) with an element whose decoded ``w`` is not within ``accept`` of ``v``.

    Decided exactly: ``fl(|w - v|) < accept`` implies ``|w - v| < accept`` (rounding is
    monotone and ``accept`` is a float64), the compressor's own acceptance test
    (docs/error-bound.md). Non-finite values pass when ``w`` has ``v``'s bits.
    """
    step = _CHECK_CHUNK
    d = np.empty(min(step, w.size))
    near = np.empty(d.size, bool)
    found: list[np.ndarray] = []
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(0, w.size, step):  # pieces that stay in cache
            m = min(step, w.size - i)
            np.subtract(w[i:i + m], v[i:i + m], out=d[:m])
            np.abs(d[:m], out=d[:m])
            np.less(d[:m], accept, out=near[:m])
            if not near[:m].all():
                found.append(i + np.flatnonzero(~near[:m]))
    if not found:
        return np.zeros(0, np.int64)
    far = np.concatenate(found)
    far = far[w[far].view(np.uint64) != v[far].view(np.uint64)]
    return np.unique(far // fmt.BLOCK)
