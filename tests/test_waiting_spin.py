"""The spin of a wait under a deadline yields the core, more often where ranks share cores."""

from __future__ import annotations

import threading
import time

import pytest
from mpi4py import MPI

from ccoll.collectives import waiting
from ccoll.runtime import progress


@pytest.mark.parametrize("shared, every", [(False, waiting._YIELD_EVERY),
                                           (True, waiting._YIELD_SHARED)])
def test_spin_yields_every_so_many_tests(monkeypatch, shared, every):
    yields = []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
    tests = 10 * every + 1  # completes on the last test
    calls = iter(range(tests))
    waiting.share_cores(shared)
    try:
        assert waiting.spin(lambda: next(calls) == tests - 1, 60.0)
    finally:
        waiting.share_cores(False)
    assert len(yields) == 10


def test_a_spin_that_runs_out_of_time_says_so(monkeypatch):
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: None)
    assert not waiting.spin(lambda: False, 0.0)


@pytest.mark.parametrize("bulk", [False, True])
def test_engine_blocks_in_mpi_only_for_bulk_data(monkeypatch, bulk):
    # On the progress engine without a timeout, a wait for data blocks in MPI_Waitsome (MPI
    # moves a large exact collective only while it is called); a small one (the agreement,
    # a range) is tested with sleeps: a blocking wait spins on a core that the backward
    # pass beside it needs (docs/dev/training-runs.md, "Small waits beside the backward pass").
    blocked = []
    real = waiting._wait_or_cancel
    monkeypatch.setattr(waiting, "_wait_or_cancel",
                        lambda *a: blocked.append(1) or real(*a))
    buf, tag = bytearray(8), 4712

    def wait() -> bytes:
        req = MPI.COMM_SELF.Irecv(buf, source=0, tag=tag)
        late = threading.Timer(0.05, lambda: MPI.COMM_SELF.Send(b"12345678", dest=0, tag=tag))
        late.start()
        t0 = time.perf_counter()
        waiting.wait_all([req], waiting.Deadline(None, "test"), "a late message", bulk=bulk)
        late.join()
        assert time.perf_counter() - t0 >= 0.04
        return bytes(buf)

    assert progress.submit(wait).wait(timeout=60) == b"12345678"
    assert blocked == ([1] if bulk else [])


@pytest.mark.parametrize("bulk", [False, True])
def test_a_wait_for_data_in_the_callers_thread_spins_to_the_end(monkeypatch, bulk):
    # Under a deadline on the caller's thread, a wait for data spins (yielding) until it
    # completes, as MPI's blocking call would: asleep, a rank missed its turn in the
    # collective (4 ranks on 2 cores, 4 MiB: 5.5-5.9 ms against 3.6 ms spinning). Other
    # waits sleep after a short spin.
    sleeps = []
    real_sleep = time.sleep
    monkeypatch.setattr(waiting.time, "sleep", lambda s: sleeps.append(s) or real_sleep(s))
    buf, tag = bytearray(8), 4713
    req = MPI.COMM_SELF.Irecv(buf, source=0, tag=tag)
    late = threading.Timer(0.03, lambda: MPI.COMM_SELF.Send(b"abcdefgh", dest=0, tag=tag))
    late.start()
    waiting.wait_all([req], waiting.Deadline(60.0, "test"), "a late message", bulk=bulk)
    late.join()
    assert bytes(buf) == b"abcdefgh"
    assert (sleeps == []) == bulk, sleeps


def test_a_spinning_wait_for_data_still_times_out(monkeypatch):
    monkeypatch.setattr(waiting, "_SPIN_CHECK_S", 0.01)
    buf = bytearray(8)
    req = MPI.COMM_SELF.Irecv(buf, source=0, tag=4714)
    t0 = time.perf_counter()
    with pytest.raises(waiting.CollectiveError, match="made no progress for 0.05 s"):
        waiting.wait_all([req], waiting.Deadline(0.05, "test"), "nobody sends", bulk=True)
    assert time.perf_counter() - t0 < 5.0
    req.Cancel()  # this test's own receive: nothing else can match it
    req.Wait()


def test_a_timeout_on_the_progress_engine_names_its_ordering_rule():
    # iallreduce on two Communicators, submitted in opposite orders on two ranks (legal in
    # MPI), waited for each other in the engine's one queue to the timeout, under a message
    # that blamed a failed rank only (docs/collectives.md, "Ordering rules").
    from ccoll.runtime import progress

    seen = []

    def on_engine():
        d = waiting.Deadline(0.5, "ccoll.iallreduce")
        seen.append(str(d.error("the agreement")))

    progress.submit(on_engine).wait(10)
    assert "one queue per process, across all Communicators: did every rank submit them " \
           "in the same order?" in seen[0]
    # A blocking call's timeout (the caller's thread) does not speak of the queue.
    assert "queue" not in str(waiting.Deadline(0.5, "ccoll.allreduce").error("the agreement"))
