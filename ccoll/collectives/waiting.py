"""Waiting for MPI requests, with an optional deadline.

Without a deadline the waits are plain ``MPI_Waitall``, unless the caller asks to poll
(the compressed collectives do: MPICH's waits spin on a core their compute threads need).
With one (``Communicator(timeout=)``) they poll ``MPI_Testall`` with short sleeps and raise
:class:`~ccoll.errors.CollectiveError` when the deadline passes, instead of waiting forever
for a rank that failed or never entered the collective. The requests left behind cannot be
completed safely, so the communicator that timed out is marked unusable (see
docs/collectives.md, "Faults").

A deadline made on the progress engine's thread belongs to the request running there: when
:func:`ccoll.runtime.progress.cancel` cancels that request (its Communicator was closed),
the deadline expires at once with the reason. Its waits never block in MPI on the data's
requests alone: without a timeout they block in ``MPI_Waitsome`` on them and on the
request's wake receive (:meth:`~ccoll.runtime.progress.Request.wake_handle`), which the
cancel completes; with one they poll. A closed Communicator so never leaves the engine
thread inside an MPI wait, and a wait that nobody cancels costs what a plain one does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
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


class Deadline:
    """A point in time after which a collective gives up; ``None`` seconds means never.

    Made on the progress engine's thread, it also ends when the engine's request is
    cancelled; ``at`` is then never ``None`` (``inf`` without a timeout), so that every wait
    that branches on ``at is None`` takes MPI's nonblocking form, which :func:`wait_all`
    can end.
    """

    __slots__ = ("timeout", "at", "what", "req")

    def __init__(self, timeout: float | None, what: str) -> None:
        self.timeout = timeout
        self.req: Request | None = current_request()
        if timeout is not None:
            self.at: float | None = time.monotonic() + timeout
        else:
            self.at = None if self.req is None else math.inf
        self.what = what

    def remaining(self) -> float | None:
        """Seconds left (may be negative), or ``None`` without a deadline."""
        if self.req is not None and self.req.cancelled is not None:
            return 0.0
        return None if self.at is None else self.at - time.monotonic()

    def expired(self) -> bool:
        """Return True once the deadline has passed (or its request was cancelled)."""
        if self.req is not None and self.req.cancelled is not None:
            return True
        return self.at is not None and time.monotonic() >= self.at

    def error(self, stage: str) -> CollectiveError:
        """Return the error to raise when ``stage`` of the collective ran past the deadline."""
        if self.req is not None and self.req.cancelled is not None:
            return CollectiveError(f"{self.what} stopped ({stage}): {self.req.cancelled}")
        return CollectiveError(
            f"{self.what} did not complete within its timeout of {self.timeout} s ({stage}): "
            "another rank failed, is slower than the timeout, or did not enter the same "
            "collective; this ccoll Communicator cannot be used any more"
        )


def wait_all(reqs: Sequence[MPI.Request], deadline: Deadline, stage: str, *,
             poll: bool = False) -> None:
    """Complete every request, or raise ``deadline.error(stage)`` once it expires.

    ``poll=True`` polls with sleeps even without a deadline: MPICH's ``MPI_Waitall``
    spins on a core, which the compressed collectives leave to their compute threads (and
    to the other ranks' on the same node); see :func:`poll_pause`.
    """
    reqs = list(reqs)
    if not reqs:
        return
    rec = _trace.ACTIVE
    t0 = rec.clock() if rec is not None else 0.0
    if deadline.at is None and not poll:
        MPI.Request.Waitall(reqs)
    elif deadline.at == math.inf and deadline.req is not None and not poll:
        _wait_or_cancel(reqs, deadline.req, deadline, stage)
    else:
        pause = _POLL_MIN_S
        while not MPI.Request.Testall(reqs):
            if deadline.expired():
                abandon(reqs)  # the requests hold their buffers
                raise deadline.error(stage)
            pause = poll_pause(pause, deadline)
    if rec is not None:
        rec.span("wait", t0, rec.clock(), {"stage": stage})


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
