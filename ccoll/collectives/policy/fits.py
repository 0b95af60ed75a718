"""The compressor's side of the calibration, and the ratio of a call's data.

- :func:`calibrate_compressor`: compress, add and decompress rates, timed locally on a
  sample (the calibration's synthetic gradient-like one), and the fixed cost of one
  kernel call;
- :func:`sample_blocks` / :func:`estimate_stream`: the compressed size of a message,
  estimated from a strided sample of its 32-element blocks (a call's ratio sample);
- :func:`sampled_format2`: format 2's ratio over format 1's on a call's data, and the
  speed of format 2's kernels relative to format 1's on the same sample.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Rates", "Format2", "calibrate_compressor", "sample_blocks", "estimate_stream",
           "sampled_format2"]

_CAL_PIECE = 8192  # elements of the piece that measures the fixed cost of a call


class Rates(NamedTuple):
    """Throughputs of one backend (bytes of float data per second) and a call's fixed cost."""

    compress: float
    add: float
    decompress: float
    chunk_overhead: float  # what one more kernel call costs, whatever its size


# The clock of :func:`sampled_format2`'s timings (a test may put a stand-in here): the
# calling thread's CPU time, with the kernels on that one thread, so that time the rank
# spends descheduled (ranks that share cores sample at once) does not count.
_clock: Callable[[], float] = time.thread_time


def _best(f: Callable[[], Any], reps: int = 3,
          clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    best, out = np.inf, None
    for _ in range(reps):
        t0 = clock()
        out = f()
        best = min(best, clock() - t0)
    return best, out


def calibrate_compressor(x: np.ndarray, eb: float,
                         ops: tuple[Callable[..., Any], ...]) -> Rates:
    """Time ``(compress_abs, add, decompress)`` on ``x`` at bound ``eb`` (local).

    Each throughput is the sample's size over its best time (so one call's fixed cost is
    included, which errs on the slow side); the fixed cost of a call is what an 8
    Ki-element piece takes beyond its share of that rate, capped at 2 ms so that one
    descheduled timing on a busy machine cannot dominate.
    """
    compress_abs, add, decompress = ops
    big = np.ascontiguousarray(x.reshape(-1))
    small = np.ascontiguousarray(big[:_CAL_PIECE])
    out = np.empty_like(big)
    s0 = compress_abs(small, eb)  # compile or load the kernels outside the timing
    add(s0, s0)
    decompress(s0, out=out[: small.size])
    tcb, sb = _best(lambda: compress_abs(big, eb), 2)
    tcs, ss = _best(lambda: compress_abs(small, eb), 5)
    tab, _ = _best(lambda: add(sb, sb), 2)
    tas, _ = _best(lambda: add(ss, ss), 5)
    tdb, _ = _best(lambda: decompress(sb, out=out), 2)
    tds, _ = _best(lambda: decompress(ss, out=out[: small.size]), 5)
    c, a, d = (big.nbytes / max(t, 1e-9) for t in (tcb, tab, tdb))
    sm = small.nbytes
    fixed = sum(max(0.0, ts - sm / r) for ts, r in ((tcs, c), (tas, a), (tds, d)))
    return Rates(c, a, d, min(fixed, 2e-3))


def sample_blocks(x: np.ndarray, nsample: int) -> np.ndarray:
    """``nsample`` evenly spaced whole 32-element blocks of ``x``, contiguous (a copy)."""
    flat = x.reshape(-1)
    nblocks = flat.size // 32
    if nblocks == 0:
        return np.ascontiguousarray(flat)
    k = max(1, min(nsample, nblocks))
    sel = (np.arange(k, dtype=np.int64) * nblocks) // k
    return np.ascontiguousarray(flat[: nblocks * 32].reshape(nblocks, 32)[sel].reshape(-1))


# Format 2 codes neighbouring blocks together (a bitmap word's 32 blocks), so its gain is
# sampled on runs of this many whole blocks, not on blocks taken one by one; and its
# streams carry tables of a fixed size, which smaller samples overweight (at REL 1e-2 on
# MiniLM, 512 blocks showed a gain of 1.7 where the whole array has 3.0; 8192 showed 2.9).
GAIN_RUN_BLOCKS = 32
GAIN_MIN_BLOCKS = 8192


class Format2(NamedTuple):
    """Format 2 against format 1 on one sample of a call's data, at the call's bound.

    ``gain``: format 1's stream bytes over format 2's; ``compress``, ``add``,
    ``decompress``: format 1's seconds over format 2's for the same kernel on the same
    sample (> 1: format 2's kernel is faster there); ``inf`` where not timed.
    """

    gain: float
    compress: float = math.inf
    add: float = math.inf
    decompress: float = math.inf

    @property
    def speed(self) -> tuple[float, float, float]:
        """The three speed factors (compress, add, decompress)."""
        return self.compress, self.add, self.decompress


def _gain_sample(x: np.ndarray, nsample: int) -> np.ndarray:
    flat = x.reshape(-1)
    run = GAIN_RUN_BLOCKS * 32
    nruns = flat.size // run
    if nruns == 0:
        return np.ascontiguousarray(flat)
    k = max(1, min(-(-max(nsample, GAIN_MIN_BLOCKS) // GAIN_RUN_BLOCKS), nruns))
    sel = (np.arange(k, dtype=np.int64) * nruns) // k
    return np.ascontiguousarray(flat[: nruns * run].reshape(nruns, run)[sel].reshape(-1))


# Timings of each kernel in :func:`sampled_format2` (the least counts).
SPEED_REPS = 5


def sampled_format2(x: np.ndarray, eb: float, nsample: int,
                    ops: tuple[Callable[..., Any], ...]) -> Format2:
    """Format 2's gain and kernel speeds relative to format 1 on about ``nsample`` blocks.

    The gain is format 1's stream bytes over format 2's on evenly spaced runs of
    :data:`GAIN_RUN_BLOCKS` whole 32-element blocks (at least :data:`GAIN_MIN_BLOCKS`
    blocks, or all of ``x``), compressed at ``eb``, the streams' 64-byte headers left out.
    ``ops``: ``(compress_abs, add, decompress)`` of the compressor (``compress_abs`` takes
    ``version=``), optionally with ``add_data`` fourth. On the same sample of runs of
    blocks, each format's compress, add (the stream plus itself: a partial sum's wider
    codes) and decompress are timed, the least of :data:`SPEED_REPS` runs each (the first
    run of each kernel also loads it where it was not yet), on one numba thread and by the
    thread's CPU time (:data:`_clock`), and each factor is format 1's seconds over format
    2's. With ``add_data``, the add is priced as the ring's step does it: ``add_data`` of
    the sample to its own stream, less the sample's compression (the model counts every
    rank's whole input compressed once, then the adds), each format's difference at least
    a quarter of its ``add_data`` time. Local: every rank times its own; the collectives
    agree on the minimum (docs/model.md, "Stream format").
    """
    compress_abs, add, decompress = ops[:3]
    add_data = ops[3] if len(ops) > 3 else None
    s = _gain_sample(x, nsample)
    out = np.empty_like(s)
    secs: dict[int, tuple[float, float, float]] = {}
    size: dict[int, int] = {}
    import numba

    from ccoll.runtime.cpu_threads import prepare

    prepare()  # the process's threading set-up comes before numba's pool starts
    threads = numba.get_num_threads()  # this thread's setting: others are not touched
    numba.set_num_threads(1)
    try:
        _time_formats(s, out, eb, compress_abs, add, decompress, add_data, secs, size)
    finally:
        numba.set_num_threads(threads)
    gain = max(size[1], 1) / max(size[2], 1)
    f = [a / b if a > 0 and b > 0 and math.isfinite(a / b) else math.inf
         for a, b in zip(secs[1], secs[2], strict=True)]
    return Format2(gain, *f)


def _time_formats(s: np.ndarray, out: np.ndarray, eb: float, compress_abs: Callable[..., Any],
                  add: Callable[..., Any], decompress: Callable[..., Any],
                  add_data: Callable[..., Any] | None,
                  secs: dict[int, tuple[float, float, float]], size: dict[int, int]) -> None:
    """Fill ``secs[v]`` (compress, add, decompress) and ``size[v]`` for formats 1 and 2."""
    for v in (1, 2):
        tc, got = _best(partial(compress_abs, s, eb, version=v), SPEED_REPS, _clock)
        buf = np.asarray(got)
        size[v] = buf.nbytes - 64
        ta, _ = _best(partial(add, buf, buf), SPEED_REPS, _clock)
        td, _ = _best(partial(decompress, buf, out=out), SPEED_REPS, _clock)
        if add_data is not None:
            tad, _ = _best(partial(add_data, buf, s), SPEED_REPS, _clock)
            ta = max(tad - tc, 0.25 * tad)
        secs[v] = (tc, ta, td)


def estimate_stream(x: np.ndarray, eb: float, nsample: int,
                    compress_abs: Callable[..., Any]) -> tuple[float, float, float]:
    """Estimated stream bytes of all of ``x``, its non-zero blocks and their summed widths.

    Compresses ``nsample`` evenly spaced blocks and scales the bitmap, code bytes and
    payload words up to the whole array (the 64-byte header counted once).
    """
    from ccoll.compressor.format import parse_header

    s = sample_blocks(x, nsample)
    hdr = parse_header(np.asarray(compress_abs(s, eb)))
    scale = -(-x.size // 32) / max(hdr.nblocks, 1)
    nb = -(-x.size // 32)
    nnz = hdr.nnz * scale
    words = hdr.payload_words * scale
    est = 64 + 4 * -(-nb // 32) + nnz + 4 * words
    widths = max(words - nnz, 0.0)  # a fixed-length block has 1 + width payload words
    return est, nnz, widths
