"""Waiting for MPI requests, with an optional deadline on progress.

A :class:`Deadline` (``Communicator(timeout=)``, by default the ``CCOLL_TIMEOUT`` setting's
:data:`ccoll.settings.DEFAULT_TIMEOUT`) bounds how long a collective waits *without
progress*, not how long it runs: every wait that completes (:func:`wait_all`), and every
message or task a compressed collective's loop completes (:meth:`Deadline.progress`),
starts the clock again. A rank whose peer never entered the collective, or stopped in it,
raises :class:`~ccoll.errors.CollectiveError` after that long; a large call that keeps
moving runs as long as it needs. The requests left behind cannot be completed safely, so
the communicator that timed out is marked unusable (see docs/collectives.md, "Faults").

With a deadline the waits use MPI's nonblocking calls and test them: first in a tight loop
(:data:`_SPIN_S`, as MPICH's own blocking waits spin, so a call of a few microseconds costs
what the blocking one does), then with sleeps no longer than a small share of the time
already waited (:func:`_backoff`), so that a rank waiting for a slow peer leaves the CPU to
the peer's compressor without adding more than a few percent to the wait. A wait for data
(``bulk``) in the caller's own thread spins to the end instead (:func:`_spin_until`), as
MPI's blocking call would there: a rank asleep when its part of an exact collective came
due delayed every rank (4 ranks on 2 cores, 4 MiB: 0.62x of ``MPI_Allreduce`` sleeping,
0.99x spinning). Without a
deadline (``Communicator(timeout=math.inf)``, or a call on one rank, which has no peer to
wait for) the waits are plain ``MPI_Waitall``, unless the caller asks to poll (the
compressed collectives do: MPICH's waits spin on a core their compute threads need).

A deadline made on the progress engine's thread belongs to the request running there: when
:func:`ccoll.runtime.progress.cancel` cancels that request (its Communicator was closed),
the deadline expires at once with the reason. Its waits never block in MPI on the data's
requests alone: without a timeout a wait for data (``bulk``: the exact collectives'
``MPI_I*`` calls, whose algorithms move only while MPI is called) blocks in
``MPI_Waitsome`` on them and on the request's wake receive
(:meth:`~ccoll.runtime.progress.Request.wake_handle`), which the cancel completes; every
other wait there (the agreement, a bucket's range, the sizes of streams: a few bytes) polls
as a wait under a deadline does, and so does every wait with a timeout. A blocking wait
spins on a core: beside a training's backward pass on shared cores it both slowed the
compute and made a small collective late (4 ranks on 2 cores with a matrix-product thread
each, 100 Mbit/s: 17-45 ms from the last rank's arrival to the end of a 320-byte
``MPI_Iallreduce`` in ``MPI_Waitsome``, 4-14 ms in this module's tests and sleeps, with a
third more products beside; docs/dev/training-runs.md, "Small waits beside the backward
pass"). A closed
Communicator so never leaves the engine thread inside an MPI wait.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from mpi4py import MPI

from ccoll.collectives import trace as _trace
from ccoll.errors import CollectiveError
from ccoll.runtime.progress import Request, current_request

__all__ = ["Deadline", "wait_all", "poll_pause", "test_some", "drain_tasks", "abandon"]

# What calls that stopped with MPI operations pending left behind: see abandon().
_ABANDONED: list[tuple[object, ...]] = []


def abandon(*objs: object) -> None:
    """Keep ``objs`` alive for the life of the process: pending MPI operations use them.

    A call that stops with operations pending (a failure, a timeout, ``close()`` during
    the call) leaves MPI requests whose buffers MPI may still write or read; freeing them
    would let a late message land in memory reused for something else. Like the failed
    channel's communicator, they are never released.
    """
    _ABANDONED.append(objs)

# Polling starts fast (a reply usually arrives within microseconds on one node) and backs
# off so that a rank waiting for a slow peer leaves the CPU to the peer's compressor.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3
# A wait under a deadline tests its requests in a tight loop this long before it sleeps
# (MPICH's blocking waits spin all along), yielding the core every _YIELD_EVERY tests as
# MPICH's do; its sleeps then stay below 1/_BACKOFF_SHARE of the time waited so far.
_SPIN_S = 2e-3
# A wait for data in the caller's thread spins to the end, looking at its deadline this often.
_SPIN_CHECK_S = 0.05
_YIELD_EVERY = 256
# Where this rank has less than a core of its own (more ranks than cores on the node), the
# spin yields every few tests instead: the peer that must move next is waiting for this
# core (4 ranks on 2 cores, 4 B repeated allreduce: 85 us with a yield every 256 tests,
# 45 us every 8, 46 us in MPI's blocking call). Set by :func:`share_cores`.
_YIELD_SHARED = 8
_yield_every = _YIELD_EVERY


def share_cores(shared: bool) -> None:
    """Say whether this rank shares its cores with other ranks (less than one of its own)."""
    global _yield_every
    _yield_every = _YIELD_SHARED if shared else _YIELD_EVERY
_BACKOFF_SHARE = 32

# The clock of deadlines (a name of its own, so that tests can stand in for time).
_clock = time.monotonic


class Deadline:
    """How long a collective may go without progress before it gives up (``None``: forever).

    ``at`` is when it gives up unless something moves first: ``timeout`` seconds after it
    was made or after the last :meth:`progress`. Made on the progress engine's thread, it
    also ends when the engine's request is cancelled; ``at`` is then never ``None`` (``inf``
    without a timeout), so that every wait that branches on ``at is None`` takes MPI's
    nonblocking form, which :func:`wait_all` can end.
    """

    __slots__ = ("timeout", "at", "what", "req")

    def __init__(self, timeout: float | None, what: str) -> None:
        self.timeout = timeout
        self.req: Request | None = current_request()
        if timeout is not None:
            self.at: float | None = _clock() + timeout
        else:
            self.at = None if self.req is None else math.inf
        self.what = what

    def progress(self) -> None:
        """Something completed (a wait, a message, a task): the timeout starts again."""
        timeout = self.timeout
        if timeout is not None:
            self.at = _clock() + timeout

    def remaining(self) -> float | None:
        """Seconds left (may be negative), or ``None`` without a deadline."""
        if self.req is not None and self.req.cancelled is not None:
            return 0.0
        return None if self.at is None else self.at - _clock()

    def expired(self) -> bool:
        """Return True once the deadline has passed (or its request was cancelled)."""
        if self.req is not None and self.req.cancelled is not None:
            return True
        return self.at is not None and _clock() >= self.at

    def error(self, stage: str) -> CollectiveError:
        """Return the error to raise when ``stage`` of the collective ran past the deadline."""
        if self.req is not None and self.req.cancelled is not None:
            return CollectiveError(f"{self.what} stopped ({stage}): {self.req.cancelled}")
        # On the progress engine: its one queue per process runs the requests of every
        # Communicator in submission order, so ranks that submitted them in other orders
        # (legal in MPI across communicators) wait for each other here.
        queue = ("" if self.req is None else
                 "; requests (iallreduce, the DDP hook's buckets) run one at a time in one "
                 "queue per process, across all Communicators: did every rank submit them "
                 "in the same order?")
        return CollectiveError(
            f"{self.what} made no progress for {self.timeout} s, its timeout of "
            f"{self.timeout} s ({stage}): another rank failed, stopped, or did not enter the "
            f"same collective{queue}; this ccoll Communicator cannot be used any more (the "
            "timeout is Communicator(timeout=) or the CCOLL_TIMEOUT setting)"
        )


def wait_all(reqs: Sequence[MPI.Request], deadline: Deadline, stage: str, *,
             poll: bool = False, bulk: bool = False) -> None:
    """Complete ``reqs``, or raise :class:`CollectiveError` once ``deadline`` expires.

    ``poll``: test with sleeps even without a deadline, never a blocking wait, which
    spins on a core, which the compressed collectives leave to their compute threads (and
    to the other ranks' on the same node); see :func:`poll_pause`. ``bulk``: the requests
    move data (an exact collective's), which MPI moves only while it is called: on the
    progress engine without a timeout they are waited for in ``MPI_Waitsome``; other
    requests there are tested, with a short spin and then sleeps (the module's text).
    """
    if not reqs:
        return
    rec = _trace.ACTIVE
    t0 = rec.clock() if rec is not None else 0.0
    at = deadline.at
    if at is None and not poll:
        MPI.Request.Waitall(reqs)
    elif at == math.inf and deadline.req is not None and bulk and not poll:
        _wait_or_cancel(list(reqs), deadline.req, deadline, stage)
    else:
        test = reqs[0].Test if len(reqs) == 1 else partial(MPI.Request.Testall, list(reqs))
        if poll:
            _backoff(test, reqs, deadline, stage, _POLL_MIN_S)
        elif bulk and deadline.req is None:
            _spin_until(test, reqs, deadline, stage)
        elif not (test() or spin(test, _SPIN_S)):
            _backoff(test, reqs, deadline, stage, 0.0)
        deadline.progress()
    if rec is not None:
        rec.span("wait", t0, rec.clock(), {"stage": stage})


def spin(test: Callable[[], bool], seconds: float) -> bool:
    """Call ``test`` in a tight loop for up to ``seconds``; return whether it returned True.

    What MPICH's blocking waits do (they spin too), so a short call costs no more under a
    deadline than without one. The core is yielded every :data:`_YIELD_EVERY` tests (about
    every 60 µs; MPICH's blocking waits yield after 1,000 polls), so that a peer rank or a
    compute thread that shares it still runs: a spin that never yields doubled the time of
    a 64 KiB ``MPI_Iallreduce`` between two ranks on two busy cores, and one that yields
    every 16 tests lost the core to other jobs for about 100 µs a time. A rank with less
    than a core of its own (:func:`share_cores`) yields every :data:`_YIELD_SHARED` tests.
    """
    end = time.perf_counter() + seconds
    n = 0
    every = _yield_every
    while not test():
        n += 1
        if n >= every:
            if time.perf_counter() >= end:
                return False
            n = 0
            os.sched_yield()
    return True


def _spin_until(test: Callable[[], bool], reqs: Sequence[MPI.Request], deadline: Deadline,
                stage: str) -> None:
    """Test in a tight loop (yielding as :func:`spin` does) until done; raise once expired.

    A wait for data in the caller's own thread: what MPI's blocking call would do there,
    with the deadline looked at every :data:`_SPIN_CHECK_S`. Sleeping instead (as other
    waits do after :data:`_SPIN_S`) left a rank asleep when its part of the collective
    came due: 4 ranks on 2 cores, a 4 MiB ``MPI_Iallreduce`` took 5.5-5.9 ms against the
    blocking call's 3.5-3.7 ms, and 3.6 ms spinning (docs/dev/repeated-calls.md).
    """
    while not spin(test, _SPIN_CHECK_S):
        if deadline.expired():
            abandon(list(reqs))  # the requests hold their buffers
            raise deadline.error(stage)


def _backoff(test: Callable[[], bool], reqs: Sequence[MPI.Request], deadline: Deadline,
             stage: str, pause: float) -> None:
    """Test with sleeps until the requests complete; raise once ``deadline`` expires.

    After a spin (``pause`` 0) each sleep is 1/:data:`_BACKOFF_SHARE` of the time waited
    so far (at most :data:`_POLL_MAX_S`): a wait that ends during one overshoots by a few
    percent only. Callers that poll from the start pass the first sleep
    (:data:`_POLL_MIN_S`), which doubles up to :data:`_POLL_MAX_S` (:func:`poll_pause`).
    """
    grow = 2.0 if pause else 1.0
    t0 = time.perf_counter() - (0.0 if pause else _SPIN_S)
    while not test():
        if deadline.expired():
            abandon(list(reqs))  # the requests hold their buffers
            raise deadline.error(stage)
        waited = time.perf_counter() - t0
        sleep = min(_POLL_MAX_S, max(pause, waited / _BACKOFF_SHARE))
        pause = sleep * grow
        left = deadline.remaining()
        time.sleep(sleep if left is None else min(sleep, max(left, 0.0)))


def _wait_or_cancel(reqs: list[MPI.Request], req: Request, deadline: Deadline,
                    stage: str) -> None:
    """Block until ``reqs`` complete or the engine's request ``req`` is cancelled."""
    wake = req.wake_handle()
    pending = reqs
    while pending:
        if req.cancelled is not None:  # after posting the wake: see wake_handle
            abandon(pending)  # the requests hold their buffers
            raise deadline.error(stage)
        idx = MPI.Request.Waitsome([*pending, wake])
        if idx:
            done = set(idx)
            pending = [r for i, r in enumerate(pending) if i not in done]


def poll_pause(pause: float, deadline: Deadline) -> float:
    """Sleep ``pause`` seconds (never past the deadline) and return the next, longer pause."""
    left = deadline.remaining()
    time.sleep(pause if left is None else min(pause, max(left, 0.0)))
    return min(2 * pause, _POLL_MAX_S)


def test_some(reqs: list[MPI.Request], meta: list[Any], statuses: list[MPI.Status],
              on_done: Callable[[int, MPI.Status], None]) -> bool:
    """Complete what ``MPI_Testsome`` finds done among ``reqs``; False if nothing was.

    ``meta[i]`` describes ``reqs[i]``; ``on_done(i, status)`` runs for each completed one
    (it may append new requests and their meta, which the deletions of the completed
    indices afterwards leave alone). ``statuses`` is a scratch list reused across calls
    (this runs on every turn of a collective's loop).
    """
    if not reqs:
        return False
    while len(statuses) < len(reqs):
        statuses.append(MPI.Status())
    idx = MPI.Request.Testsome(reqs, statuses)
    if not idx:
        return False
    # MPI fills the statuses in completion order, not request order.
    for k, i in enumerate(idx):
        on_done(i, statuses[k])
    for i in sorted(idx, reverse=True):
        del reqs[i]
        del meta[i]
    return True


def drain_tasks(worker: Any, on_task: Callable[[Any, Any], None]) -> bool:
    """Hand each finished task's ``(tag, result)`` to ``on_task``; raise a task's error.

    ``worker`` is a :class:`~ccoll.collectives.worker.Worker`; False if nothing finished.
    """
    done = worker.drain()
    for tag, result, exc in done:
        if exc is not None:
            raise exc
        on_task(tag, result)
    return bool(done)
