"""Closing while work is in flight: the Worker's queued tasks and the engine's requests.

A Communicator closed while an ``iallreduce`` runs must fail the request, drop its queued
compute tasks without losing count of them, and leave the progress engine free for the
next request. These tests hold tasks and requests in place with events (never sleeps);
tests/mpi/test_close_in_flight.py runs the whole path at 2 and 3 ranks.
"""

from __future__ import annotations

import gc
import mmap
import threading
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import ccoll.gpu_sched as gs
from ccoll.collectives.channel import Channel
from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.collectives.worker import Worker
from ccoll.errors import CollectiveError
from ccoll.gpu_sched import configure, default_scheduler
from ccoll.gpu_sched import scheduler as sched_mod
from ccoll.runtime import progress

GUARD_S = 60  # only a failing run waits this long


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    monkeypatch.delenv("CCOLL_SCHED", raising=False)
    monkeypatch.setattr(sched_mod, "_training", False)
    configure()
    yield
    configure()


def _lanes() -> gs.Scheduler:
    return default_scheduler("cpu")


def _hold(w: Worker, lane: str | None) -> threading.Event:
    """Occupy ``w``'s lane (or its private thread) with a task until the event is set."""
    gate, started = threading.Event(), threading.Event()

    def block() -> str:
        started.set()
        assert gate.wait(GUARD_S)
        return "gate"

    w.submit((0,), block, "gate", lane=lane)
    assert started.wait(GUARD_S)
    return gate


# -- Worker.close ----------------------------------------------------------------------


@pytest.mark.parametrize("lane", ["compress", None], ids=["lane", "private-thread"])
def test_close_hands_back_every_queued_task_as_an_error(lane):
    w = Worker("test-worker", lanes=_lanes if lane else None)
    gate = _hold(w, lane)
    ran: list[int] = []
    for k in range(1, 4):
        w.submit((k,), lambda k=k: ran.append(k), ("task", k), lane=lane)
    assert w.outstanding == 4
    thread = w._thread  # the private thread (None on lanes)
    w.close()  # three tasks queued behind the running one
    gate.set()
    if lane:
        default_scheduler("cpu").lane(lane).synchronize()
    else:
        thread.join(GUARD_S)
        assert not thread.is_alive()
    got = w.drain()
    assert ran == []
    assert ("gate", "gate", None) in got
    failed = sorted(tag for tag, _, exc in got if isinstance(exc, CollectiveError))
    assert failed == [("task", 1), ("task", 2), ("task", 3)], got
    assert all("closed" in str(exc) for _, _, exc in got if exc is not None)
    assert w.outstanding == 0  # a loop waiting for outstanding tasks ends
    assert sched_mod._busy["cpu"] == 0


@pytest.mark.parametrize("inline", [False, True])
def test_a_closed_worker_refuses_new_tasks(inline):
    w = Worker("test-worker", lanes=_lanes)
    w.close()
    with pytest.raises(CollectiveError, match="closed"):
        w.submit((0,), lambda: 1, "t", inline=inline, lane="reduce")
    assert w.outstanding == 0 and w.drain() == []


# -- progress.cancel -------------------------------------------------------------------


class _Thing:
    """Stands for a channel or its communicator: cancel() matches by identity."""


def _stuck_in_mpi(started: threading.Event, irecv: list[MPI.Request], bulk: bool) -> None:
    """A request that waits for a message nobody sends, without a timeout."""
    req = MPI.COMM_SELF.Irecv(bytearray(8), source=0, tag=4711)
    irecv.append(req)
    deadline = Deadline(None, "the stuck test request")  # made on the engine thread
    started.set()
    wait_all([req], deadline, "waiting for nobody", bulk=bulk)


# bulk: blocked in MPI_Waitsome with the wake request; else tested with sleeps
@pytest.mark.parametrize("bulk", [True, False])
def test_cancel_fails_running_and_queued_requests_and_frees_the_engine(bulk):
    mine, other = _Thing(), _Thing()
    started = threading.Event()
    irecv: list[MPI.Request] = []
    ran: list[str] = []
    try:
        stuck = progress.submit(_stuck_in_mpi, started, irecv, bulk, comm=mine)
        queued = [progress.submit(ran.append, "mine", comm=mine) for _ in range(2)]
        later = progress.submit(lambda: ran.append("other") or 42, comm=other)
        assert started.wait(GUARD_S)
        assert progress.cancel((mine,), "closed for the test") is True
        # At once, without waiting for the engine thread: every request of `mine`.
        for r in (stuck, *queued):
            assert r.done()
            with pytest.raises(CollectiveError, match="closed for the test"):
                r.wait(timeout=0)
        # The engine thread leaves the stuck wait and runs the next request.
        assert later.wait(timeout=GUARD_S) == 42
        assert ran == ["other"]
        assert progress.cancel((mine,), "again") is False  # nothing of it left
    finally:
        for r in irecv:
            r.Cancel()
            r.Wait()


def test_cancel_reaches_a_request_through_what_it_uses():
    channel = _Thing()
    started, gate = threading.Event(), threading.Event()

    def call() -> str:
        progress.uses(channel)
        started.set()
        assert gate.wait(GUARD_S)
        return "finished anyway"

    r = progress.submit(call)  # comm=None: known only through uses()
    assert started.wait(GUARD_S)
    assert progress.cancel((channel,), "closed for the test") is True
    assert r.done()
    gate.set()
    with pytest.raises(CollectiveError, match="closed for the test"):
        r.wait(timeout=0)  # the late result is dropped
    assert progress.submit(lambda: 7).wait(timeout=GUARD_S) == 7
    assert progress.current_request() is None  # not on this thread


def test_a_deadline_off_the_engine_thread_still_blocks_as_before():
    d = Deadline(None, "x")
    assert d.at is None and d.req is None and not d.expired()


# -- what a stopped call leaves pending stays alive ---------------------------------------


def _posted_receive() -> tuple[MPI.Request, weakref.ref[mmap.mmap]]:
    """A receive nobody sends to, into memory of its own; a weak reference to that memory.

    On a duplicate of COMM_SELF that is never freed, like a failed channel's.
    """
    mem = mmap.mmap(-1, 1 << 16)
    req = MPI.COMM_SELF.Dup().Irecv([np.frombuffer(mem, np.uint8), MPI.BYTE], source=0,
                                    tag=4712)
    return req, weakref.ref(mem)


def test_a_wait_that_gives_up_keeps_its_requests_and_their_buffers():
    # MPI may still write a late message into the buffer: it must never be freed.
    req, mem = _posted_receive()
    with pytest.raises(CollectiveError, match="timeout"):
        wait_all([req], Deadline(0.0, "the test wait"), "waiting for nobody")
    del req
    gc.collect()
    assert mem() is not None


def test_a_failed_channel_keeps_its_buffers():
    ch = Channel(MPI.COMM_SELF.Dup(), "test", None)
    ch.check_usable()
    (buf,) = ch.recv_buffers(1, 1 << 20)
    kept = weakref.ref(buf.base if buf.base is not None else buf)
    del buf
    ch.fail("a test failure")
    ch.close()
    gc.collect()
    assert kept() is not None
