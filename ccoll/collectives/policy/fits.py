"""Compressor calibration for ``policy="auto"``: throughputs, their efficiency, the ratio.

- :func:`calibrate_compressor`: compress, add and decompress rates, timed locally on a
  strided sample of the message (64 MiB of float32 for large ones), and the fixed cost
  of one kernel call;
- :func:`measure_efficiency`: the share of those rates that a real compressed allreduce
  reaches (a ring allreduce on the channel, fitted to the model by bisection);
- :func:`sample_blocks` / :func:`estimate_stream`: the compressed size of a message,
  estimated from a strided sample of its 32-element blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives import model
from ccoll.collectives.channel import Channel
from ccoll.collectives.model import Params
from ccoll.collectives.policy.probes import (
    EFF_ELEMS,
    allreduce,
    compressed_call,
    slowest_median,
    uncounted,
)

__all__ = [
    "Ops",
    "CompressorCalibration",
    "calibrate_compressor",
    "measure_efficiency",
    "size_class",
    "sample_blocks",
    "estimate_stream",
    "MAX_SAMPLE_BLOCKS",
]

Ops = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]

# Elements timed for compressor throughputs: 64 MiB of float32, twice the last-level cache
# here, so that the rates are those of a large message streamed from memory (a 4 MiB sample
# ran 2-4x faster than a 64 MiB message, and a 16 MiB one still 10-30% faster).
_CAL_SAMPLE_ELEMS = 1 << 24
_CAL_RUN = 1 << 18  # elements per contiguous run of the calibration sample
_CAL_PIECE = 8192  # elements of the piece that measures the fixed cost of a call
MAX_SAMPLE_BLOCKS = 4096


@dataclass(frozen=True)
class CompressorCalibration:
    """Throughputs of one backend (bytes of float data per second) and the ring's fixed costs.

    ``call_overhead`` is what a tiny compressed allreduce takes end to end (Python, the
    agreement, the exchange of stream sizes, thread hand-offs, latencies); ``chunk_overhead``
    what each further pipeline chunk per ring block adds.
    """

    compress: float
    add: float
    decompress: float
    chunk_overhead: float
    source: str
    call_overhead: float = 0.0
    # Share of the rates above that the kernels reach inside a real compressed allreduce
    # (where MPI's polling, the network stack and the other ranks take their share of the
    # cores); the rates above already include it.
    efficiency: float = 1.0


def _calibration_sample(x: np.ndarray) -> np.ndarray:
    """16 Mi elements of ``x`` in evenly spaced runs of 256 Ki, or all of a smaller ``x``."""
    flat = x.reshape(-1)
    n = flat.size
    if n > _CAL_SAMPLE_ELEMS:
        runs = _CAL_SAMPLE_ELEMS // _CAL_RUN
        starts = np.arange(runs, dtype=np.int64) * ((n - _CAL_RUN) // max(runs - 1, 1))
        idx = (starts[:, None] + np.arange(_CAL_RUN)[None, :]).reshape(-1)
        return np.ascontiguousarray(flat[idx])
    return np.array(flat, copy=True)


def size_class(count: int) -> str:
    """Messages whose compressor costs are calibrated together: by powers of 4, or "large".

    Throughput depends on the size (cache) and on the data (zero blocks are cheap; the
    first tensors of a gradient are often mostly zero), so a small message's numbers are
    not used for a large one. From 16 Mi elements on, a strided 64 MiB sample stands for all.
    """
    return "large" if count >= _CAL_SAMPLE_ELEMS else str(count.bit_length() // 2)


def _best(f: Callable[[], Any], reps: int = 3) -> tuple[float, Any]:
    best, out = np.inf, None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t0)
    return best, out


def calibrate_compressor(x: np.ndarray, eb: float, ops: Ops) -> CompressorCalibration:
    """Time ``(compress_abs, add, decompress)`` on a sample of ``x`` at bound ``eb`` (local).

    Each throughput is the sample's size over its best time (so one call's fixed
    cost is included, which errs on the slow side); the fixed cost of a call
    (``chunk_overhead``) is what an 8 Ki-element piece takes beyond its share of that rate,
    capped at 2 ms so that one descheduled timing on a busy machine cannot dominate.
    """
    compress_abs, add, decompress = ops
    big = _calibration_sample(x)
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
    return CompressorCalibration(c, a, d, min(fixed, 2e-3), "measured")


def measure_efficiency(ch: Channel, x: np.ndarray, eb: float, p: Params,
                       compress_abs: Callable[..., Any], chunk_elems: int) -> float:
    """Fit the share of the calibrated compute rates that a real compressed allreduce reaches.

    Times a homomorphic ring allreduce on the channel (with ``chunk_elems`` elements per
    chunk, as the collectives; median of three, the slowest rank's) of the first
    ``EFF_ELEMS`` elements of ``x`` on every rank and finds by bisection the factor ``e``
    by which the model (``p``, with its compress, add and decompress rates times ``e``)
    predicts exactly that time, clamped to [1/16, 4]. Collective; every input of the
    bisection is agreed, so every rank gets the same ``e``.
    """
    n = ch.comm.Get_size()
    data = np.ascontiguousarray(x.reshape(-1)[:EFF_ELEMS])
    out = np.empty_like(data)
    # eb * n: the ring quantizes each rank's streams with about eb.
    with uncounted(ch):
        measured = slowest_median(
            ch, lambda: compressed_call(ch, data, out, eb * n, chunk_elems), "efficiency fit")
    mine = np.array(estimate_stream(data, eb, MAX_SAMPLE_BLOCKS, compress_abs))
    tot = allreduce(ch, mine, MPI.SUM, "efficiency fit")
    size = float(data.nbytes)
    ratio = n * size / max(float(tot[0]), 1.0)
    width = float(tot[2]) / float(tot[1]) if tot[1] > 0 else 1.0
    block = -(-data.size // n)
    chunks = -(-block // chunk_elems)

    def slower(e: float) -> bool:
        q = replace(p, compress=p.compress * e, add=p.add * e, decompress=p.decompress * e)
        return model.predict(size, n, q, ratio, width=width, chunks=chunks).homomorphic > measured

    lo, hi = 1.0 / 16, 4.0
    if not slower(lo):
        return lo
    if slower(hi):
        return hi
    return model._bisect(lambda e: not slower(e), lo, hi, 60)


def sample_blocks(x: np.ndarray, nsample: int) -> np.ndarray:
    """``nsample`` evenly spaced whole 32-element blocks of ``x``, contiguous (a copy)."""
    flat = x.reshape(-1)
    nblocks = flat.size // 32
    if nblocks == 0:
        return np.ascontiguousarray(flat)
    k = max(1, min(nsample, nblocks))
    sel = (np.arange(k, dtype=np.int64) * nblocks) // k
    return np.ascontiguousarray(flat[: nblocks * 32].reshape(nblocks, 32)[sel].reshape(-1))


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
