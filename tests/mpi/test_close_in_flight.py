"""A Communicator closed while its requests run: every request fails, the engine goes on.

Run with 2 or 3 ranks. Each rank holds its ring on purpose: the first ``prepare`` task of
the request blocks the compute lane on an event, so the ring's other tasks (compressions of
later chunks, prepares, combines of chunks already received) wait in the Worker's queue.
The test then waits until the ring has nothing else to do (every task that finished was
handled, every chunk the left neighbour sent was received) and closes the Communicator.
Before the fix, ``Worker.close()`` dropped those tasks but still counted them outstanding,
and the ring, with no deadline, waited for them forever on the progress engine's only
thread: the rank's later requests, on any Communicator, never ran.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from collkit import gradient_like
from mpi4py import MPI

import ccoll
from ccoll.collectives import ring
from ccoll.collectives.homomorphic import HomomorphicOps
from ccoll.errors import CollectiveError
from ccoll.runtime import progress

GUARD_S = 60  # only a failing run waits this long
CHUNK = 512
N_CHUNKS = 8  # chunks per block


class _HeldRing:
    """Holds the first ring of this process in its first ``prepare`` task until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.gate, self.idle = threading.Event(), threading.Event(), threading.Event()
        self.received = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0  # chunks this rank sent at reduce-scatter step 0
        self.recvs = 0  # reduce-scatter chunks received
        self.expect: int | None = None
        held = self
        prepare, pump, send, on_mpi = (HomomorphicOps.prepare, ring._Ring.pump_tasks,
                                       ring._Ring.send, ring._Ring.on_mpi)

        def held_prepare(self, block, chunk):
            if not held.entered.is_set():
                held.entered.set()
                assert held.gate.wait(GUARD_S)
            return prepare(self, block, chunk)

        def held_pump(self):
            # Once the held task runs, no other task of this worker finishes: a pass that
            # finds nothing after it started has handled every earlier outcome.
            was = held.entered.is_set()
            got = pump(self)
            if was and not got:
                held.idle.set()
            return got

        def counted_send(self, kind, s, c, *args, **kw):
            send(self, kind, s, c, *args, **kw)
            if kind == "send" and s == 0:
                held.sent += 1

        def counted_on_mpi(self, i, status):
            kind = self.meta[i][0]
            on_mpi(self, i, status)  # a received chunk's combine is queued by now
            if kind == "recv":
                with held.lock:
                    held.recvs += 1
                    if held.expect is not None and held.recvs >= held.expect:
                        held.received.set()

        monkeypatch.setattr(HomomorphicOps, "prepare", held_prepare)
        monkeypatch.setattr(ring._Ring, "pump_tasks", held_pump)
        monkeypatch.setattr(ring._Ring, "send", counted_send)
        monkeypatch.setattr(ring._Ring, "on_mpi", counted_on_mpi)

    def wait_quiet(self, comm: MPI.Intracomm) -> None:
        """Return once the held ring can make no more progress on any rank."""
        assert self.idle.wait(GUARD_S), "the ring never reached its held task"
        sent = comm.allgather(self.sent)  # every rank is idle: these are final
        with self.lock:
            self.expect = sent[(comm.rank - 1) % comm.size]
            if self.recvs >= self.expect:
                self.received.set()
        assert self.received.wait(GUARD_S), "the left neighbour's chunks never arrived"


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2,
                    reason="one rank's ring has no step with a peer to hold")
@pytest.mark.parametrize("how", ["iallreduce", "engine"])
def test_close_with_requests_in_flight_fails_them_everywhere(comm, monkeypatch, how):
    # "engine": blocking calls submitted to the progress engine, as the DDP comm hook does.
    n = N_CHUNKS * CHUNK * comm.size
    x = gradient_like(comm.rank, n, np.float32)
    eb = ccoll.ABS(1e-3)
    c = ccoll.Communicator(comm, policy="compress", chunk_elems=CHUNK)
    other = ccoll.Communicator(comm)
    held = _HeldRing(monkeypatch)
    if how == "iallreduce":
        reqs = [c.iallreduce(x, eb=eb) for _ in range(3)]
    else:
        reqs = [progress.submit(c.allreduce, x, eb, comm=comm) for _ in range(3)]
    later = other.iallreduce(x, eb=None)  # queued behind them on the one engine thread
    held.wait_quiet(comm)

    c.close()
    done_at_close = [r.done() for r in reqs]
    held.gate.set()
    y = later.wait(timeout=GUARD_S)  # before the fix: CCollTimeoutError (the engine hung)

    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    assert y.tobytes() == want.tobytes()
    # The running request failed at once; queued iallreduce requests never started.
    assert done_at_close[0]
    if how == "iallreduce":
        assert done_at_close == [True] * 3
    errors = []
    for r in reqs:
        with pytest.raises(CollectiveError, match="closed") as info:
            r.wait(timeout=GUARD_S)
        errors.append(type(info.value).__name__)
    assert comm.allgather(errors) == [["CollectiveError"] * 3] * comm.size
    other.close()


def test_a_closed_communicator_refuses_iallreduce_and_later_ones_run(comm):
    x = gradient_like(comm.rank, 4 * CHUNK * comm.size, np.float32)
    with ccoll.Communicator(comm, policy="compress", chunk_elems=CHUNK) as c:
        assert c.iallreduce(x, eb=ccoll.ABS(1e-3)).wait(timeout=GUARD_S).shape == x.shape
    with pytest.raises(CollectiveError, match="closed"):
        c.iallreduce(x, eb=ccoll.ABS(1e-3))
    with ccoll.Communicator(comm) as d:
        y = d.iallreduce(x, eb=None).wait(timeout=GUARD_S)
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    assert y.tobytes() == want.tobytes()
