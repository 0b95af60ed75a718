"""Calibration measurements on a channel: the link, the ring's fixed costs, MPI's own share.

- :func:`probe_link`: ring latency ``alpha`` and bandwidth ``beta`` (``Isend``/``Irecv``
  steps), a plain sum's throughput and the share of ``beta`` MPI_Allreduce reaches;
- :func:`measure_ring_costs`: the fixed and per-chunk costs of a compressed allreduce,
  timed on tiny ring allreduces (:func:`ccoll.collectives.ring.ring_allreduce`).

Every measurement runs on the :class:`~ccoll.collectives.channel.Channel` whose calls it
calibrates, and every collective here (and in :mod:`~ccoll.collectives.policy.cache`, which
uses the helpers below) is

- buffer-based: mpi4py's pickled, lowercase collectives duplicate the communicator on
  first use, collectively and with the GIL held, which deadlocks two threads (the progress
  engine's ``iallreduce`` and the caller's ``allreduce``) that calibrate at once;
- nonblocking and waited for under the channel's timeout (``Communicator(timeout=)``),
  each collective on its own, so that a rank that never joins the calibration makes the
  others raise :class:`~ccoll.errors.CollectiveError` instead of hanging.

Every function returns the same numbers on every rank (maxima of times, minima of rates).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
from mpi4py import MPI

from ccoll.collectives import exact
from ccoll.collectives.channel import Channel
from ccoll.collectives.ring import ring_allreduce
from ccoll.collectives.waiting import Deadline, abandon, spin, wait_all

__all__ = [
    "LinkCalibration",
    "probe_link",
    "measure_ring_costs",
    "compressed_call",
    "uncounted",
    "finish",
    "allreduce",
    "allgather",
    "bcast",
    "barrier",
]

WHAT = 'the calibration of policy="auto"'
# Doubles of the agreement vector that every real call allreduces before its ring
# (ccoll.collectives.agreement): timed with the ring so that the fixed cost of a call
# includes it.
_AGREEMENT_DOUBLES = 26
# The link probe's largest ring step: on a link fast enough that this takes under 30 ms
# (shared memory, 10 Gbit/s and faster), a shaper's burst is a small share of it anyway.
_PROBE_MAX = 8 << 20
# MPI_Allreduce's throughput over the probe's ring (``raw_efficiency``) may exceed 1: on
# shared memory MPICH's own intra-node reduction beats point-to-point ring steps, and ranks
# that share cores poll such steps slowly. Capping it at 1 priced raw calls up to 3x too
# slow there (4 ranks on 2 cores: 288 ms predicted for a 64 MiB MPI_Allreduce that took
# 99 ms), so compressed calls that lost were never compared with raw ones.
_EFF_MAX = 16.0


@dataclass(frozen=True)
class LinkCalibration:
    """Ring-step latency and bandwidth of one communicator, plus a plain sum's throughput."""

    alpha: float
    beta: float
    reduce: float
    source: str  # "probe", "cache", "env", or "single rank"
    raw_efficiency: float = 1.0  # share of beta that MPI_Allreduce itself reaches


# ------------------------------------------------------------------ calibration collectives


def finish(ch: Channel, reqs: Sequence[MPI.Request], stage: str, *, timed: bool = False) -> None:
    """Complete ``reqs`` within the channel's timeout, or raise :class:`CollectiveError`.

    ``timed``: the wait is part of a measurement; with a timeout it spins (yielding the core
    now and then, as MPI's blocking waits do) without sleeping, so that the time measured
    is not the length of a poll pause.
    """
    deadline = Deadline(ch.timeout, WHAT)
    if timed and deadline.at is not None:
        reqs = list(reqs)
        test = partial(MPI.Request.Testall, reqs)
        while not spin(test, 0.05):
            if deadline.expired():
                abandon(reqs)  # the requests hold their buffers
                raise deadline.error(stage)
        return
    wait_all(reqs, deadline, stage)


def allreduce(ch: Channel, mine: np.ndarray, op: MPI.Op, stage: str) -> np.ndarray:
    """Return ``MPI_Allreduce(op)`` of the numeric array ``mine`` (collective)."""
    mine = np.ascontiguousarray(mine)
    out = np.empty_like(mine)
    finish(ch, [ch.comm.Iallreduce(mine, out, op=op)], stage)
    return out


def allgather(ch: Channel, mine: np.ndarray, stage: str) -> np.ndarray:
    """Return every rank's ``mine`` (same shape on every rank), stacked in rank order."""
    mine = np.ascontiguousarray(mine)
    out = np.empty((ch.comm.Get_size(), *mine.shape), dtype=mine.dtype)
    finish(ch, [ch.comm.Iallgather(mine, out)], stage)
    return out


def bcast(ch: Channel, buf: np.ndarray, root: int, stage: str) -> None:
    """Broadcast ``root``'s ``buf`` in place (same shape and dtype on every rank)."""
    finish(ch, [ch.comm.Ibcast(buf, root=root)], stage)


def barrier(ch: Channel, stage: str) -> None:
    """Synchronize the ranks before a timing."""
    finish(ch, [ch.comm.Ibarrier()], stage, timed=True)


@contextmanager
def uncounted(ch: Channel) -> Iterator[None]:
    """Leave the channel's traffic counters as they were: calibration is not the user's."""
    sent = ch.stats.bytes_sent
    try:
        yield
    finally:
        ch.stats.bytes_sent = sent


# ------------------------------------------------------------------------------ the link


def _ring_time(ch: Channel, nbytes: int, reps: int) -> float:
    """Best over ``reps`` of the slowest rank's time for one ring step of ``nbytes``."""
    comm = ch.comm
    n, r = comm.Get_size(), comm.Get_rank()
    a = np.ones(max(1, nbytes), np.uint8)
    b = np.empty_like(a)
    right, left = (r + 1) % n, (r - 1) % n
    best = np.inf
    for _ in range(reps):
        barrier(ch, "link probe")
        t0 = time.perf_counter()
        reqs = [comm.Irecv([b[:nbytes], MPI.BYTE], left, 77),
                comm.Isend([a[:nbytes], MPI.BYTE], right, 77)]
        finish(ch, reqs, "link probe", timed=True)
        best = min(best, time.perf_counter() - t0)
    return float(allreduce(ch, np.array([best]), MPI.MAX, "link probe")[0])


def _sum_throughput() -> float:
    # 16 MiB: larger than caches, like the messages where the sum's cost matters.
    a = np.ones(4 << 20, np.float32)
    b = np.ones(4 << 20, np.float32)
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / max(best, 1e-9)


def probe_link(ch: Channel) -> LinkCalibration:
    """Measure ``alpha`` and ``beta`` with ring steps (collective, ~0.1-0.3 s).

    ``alpha`` is the best time of a 1-byte step; ``beta`` comes from the growth of the time
    between 1 byte and a message large enough to take about 30 ms (at most 8 MiB), so that
    a token-bucket shaper's burst does not inflate it. Every rank returns the same numbers.
    """
    comm = ch.comm
    if comm.Get_size() == 1:
        return LinkCalibration(0.0, 1e12, _sum_throughput(), "single rank")
    with uncounted(ch):
        _ring_time(ch, 1, 3)  # connections are made lazily; keep that out of the timing
        alpha = _ring_time(ch, 1, 20)
        m = 256 << 10
        t = _ring_time(ch, m, 2)
        while t < 0.03 and m < _PROBE_MAX:  # same t on every rank: the loop agrees
            m *= 4
            t = _ring_time(ch, m, 2)
        beta = m / max(t - alpha, 1e-9)
        red = float(allreduce(ch, np.array([_sum_throughput()]), MPI.MIN, "link probe")[0])
        # MPI's own allreduce of a message whose ring blocks are m bytes: how much of the
        # link it reaches sets the baseline the compressed algorithms compete with.
        n = comm.Get_size()
        a = np.ones(m * n // 4, np.float32)
        y = np.empty_like(a)
        deadline = Deadline(ch.timeout, WHAT)
        best = np.inf
        for _ in range(2):
            barrier(ch, "link probe")
            t0 = time.perf_counter()
            exact.allreduce(ch, a, y, deadline)
            best = min(best, time.perf_counter() - t0)
        t_ar = float(allreduce(ch, np.array([best]), MPI.MAX, "link probe")[0])
    wire = t_ar - 2 * (n - 1) * alpha - (n - 1) / n * a.nbytes / red
    eff = 2 * (n - 1) / n * a.nbytes / beta / max(wire, 1e-9)
    return LinkCalibration(alpha, beta, red, "probe", min(max(eff, 0.05), _EFF_MAX))


# ------------------------------------------------------------------------- the ring's costs


def compressed_call(ch: Channel, data: np.ndarray, out: np.ndarray, eb_abs: float,
                    chunk_elems: int) -> None:
    """Do what a compressed allreduce call does on the wire: the agreement, then the ring.

    Collective. ``eb_abs`` is the bound of the sum (each rank's streams use about
    ``eb_abs / N``).
    """
    vec = np.zeros(_AGREEMENT_DOUBLES)
    finish(ch, [ch.comm.Iallreduce(vec, np.empty_like(vec), op=MPI.MIN)], "ring costs")
    ring_allreduce(ch, data, out, data.dtype, eb_abs, algorithm="homomorphic",
                   chunk_elems=chunk_elems, deadline=Deadline(ch.timeout, WHAT))


def measure_ring_costs(ch: Channel, data: np.ndarray, eb: float) -> tuple[float, float]:
    """Time a compressed allreduce's fixed cost and each further chunk's cost (collective).

    Times tiny homomorphic allreduces of ``data`` (256 elements per rank and block; the
    caller picks them from its message) on the channel, the median of seven: one chunk per
    block, then 8. ``eb`` is the bound of each rank's streams.
    Returns this rank's ``(call, per_chunk)`` seconds; the caller takes the maximum.
    """
    n = ch.comm.Get_size()
    blk = 256
    data = np.ascontiguousarray(np.resize(data, blk * n))
    out = np.empty_like(data)
    times = []
    with uncounted(ch):
        for chunk in (blk, blk // 8):
            compressed_call(ch, data, out, eb * n, chunk)
            ts = []
            for _ in range(7):
                barrier(ch, "ring costs")
                t0 = time.perf_counter()
                compressed_call(ch, data, out, eb * n, chunk)
                ts.append(time.perf_counter() - t0)
            # The median, not the best: these costs recur on every call, and thread
            # hand-offs and polling vary from call to call.
            times.append(float(np.median(ts)))
    return times[0], max(0.0, (times[1] - times[0]) / 7)
