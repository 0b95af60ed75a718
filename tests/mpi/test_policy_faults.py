"""policy="auto" calibrations under MPI: two threads at once, and a rank that fails in them.

- The progress engine's ``iallreduce`` and the caller's ``allreduce`` each calibrate their
  own channel on first use, at the same time. With pickle-based mpi4py collectives that
  deadlocked (mpi4py duplicates a communicator with the GIL held on the first of them);
  the calibration now uses buffer-based calls only.
- A rank that raises inside the calibration must not leave the others waiting forever:
  with ``timeout=`` they raise :class:`~ccoll.errors.CollectiveError` in time, and every
  rank's Communicator refuses further calls.

Run with 1..5 ranks (the Makefile's test-mpi); the cache is off, so every fresh
Communicator probes its links.
"""

from __future__ import annotations

import threading
import time
from fractions import Fraction

import numpy as np
import pytest
from collkit import gradient_like
from kit import assert_same_on_every_rank

import ccoll
from ccoll.errors import CollectiveError

ROUNDS = 3
_OVERRIDES = ("CCOLL_ALPHA", "CCOLL_BANDWIDTH", "CCOLL_REDUCE_GBPS", "CCOLL_COMPRESS_GBPS",
              "CCOLL_ADD_GBPS", "CCOLL_DECOMPRESS_GBPS", "CCOLL_OVERHEAD", "CCOLL_RATIO",
              "CCOLL_EFFICIENCY")


@pytest.fixture
def probing(monkeypatch):
    """The same settings on every rank: no cache, no overrides, so every channel probes."""
    monkeypatch.setenv("CCOLL_CALIBRATION", "off")
    for k in _OVERRIDES:
        monkeypatch.delenv(k, raising=False)


def _assert_exact_sum_within(comm, x: np.ndarray, y: np.ndarray, eb: float) -> None:
    """|y - sum over ranks of x| <= eb per element, decided in exact rational arithmetic."""
    xs = comm.allgather(x)
    for i in range(x.size):
        exact = sum(Fraction(float(v[i])) for v in xs)
        assert abs(Fraction(float(y[i])) - exact) <= Fraction(eb), (i, y[i], float(exact))


# mpi4py's pickle-based methods of a communicator.
PICKLED = frozenset({
    "send", "recv", "isend", "irecv", "sendrecv", "bsend", "ssend", "bcast", "gather",
    "scatter", "allgather", "alltoall", "reduce", "allreduce", "scan", "exscan",
})


class _WorstOrder:
    """A channel's communicator that makes pickle-based calls race in the worst order.

    Before such a call, the two threads of a rank meet (so that they make it together),
    then the engine thread waits a little on even ranks and the caller's thread on odd
    ranks: the two threads reach it in opposite orders on neighbouring ranks, which the
    race does by chance now and then. Everything else is forwarded unchanged, so
    buffer-based calls are neither met nor delayed.
    """

    def __init__(self, comm, rank: int, meet: threading.Barrier) -> None:
        self._comm = comm
        self._rank = rank
        self._meet = meet

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in PICKLED:
            return attr

        def staggered(*args, **kwargs):
            try:
                self._meet.wait()
            except threading.BrokenBarrierError:
                pass  # the other thread made no such call: nothing to line up
            engine = threading.current_thread() is not threading.main_thread()
            if engine == (self._rank % 2 == 0):
                time.sleep(0.05)
            return attr(*args, **kwargs)

        return staggered

    def __eq__(self, other):
        return self._comm == (other._comm if isinstance(other, _WorstOrder) else other)

    def __ne__(self, other):
        return not self == other

    __hash__ = object.__hash__


def test_engine_and_caller_calibrate_at_once_on_first_use(comm, probing, monkeypatch):
    from ccoll.collectives import channel

    real_init = channel.Channel.__init__
    meet = threading.Barrier(2, timeout=10)

    def init(self, c, name, timeout):
        real_init(self, _WorstOrder(c, comm.rank, meet), name, timeout)

    monkeypatch.setattr(channel.Channel, "__init__", init)
    eb = 1e-4
    for k in range(ROUNDS):
        a = gradient_like(comm.rank, 1000, np.float32, seed=k)
        b = gradient_like(comm.rank, 3000, np.float32, seed=100 + k)
        with ccoll.Communicator(comm, policy="auto") as cc:
            # First use of both channels, at once: the engine thread calibrates the
            # iallreduce channel while this thread calibrates the blocking one.
            req = cc.iallreduce(a, ccoll.ABS(eb))
            yb = cc.allreduce(b, ccoll.ABS(eb))
            ya = req.wait(timeout=120)
        _assert_exact_sum_within(comm, a, ya, eb)
        _assert_exact_sum_within(comm, b, yb, eb)
        assert_same_on_every_rank(comm, ya)
        assert_same_on_every_rank(comm, yb)


def test_a_rank_failing_in_the_calibration_fails_the_others_within_the_timeout(
    comm, probing, monkeypatch
):
    if comm.size == 1:
        pytest.skip("needs a peer that waits in the calibration")
    from ccoll.collectives.policy import cache

    x = gradient_like(comm.rank, 1000, np.float32)
    eb = ccoll.REL(1e-3)
    failing = comm.size - 1
    cc = ccoll.Communicator(comm, policy="auto", timeout=2.0)
    try:
        if comm.rank == failing:
            def boom() -> str:
                raise RuntimeError("injected failure in the calibration")

            # Raised before this rank's first calibration collective (the cache key's).
            monkeypatch.setattr(cache, "_netns_id", boom)
            with pytest.raises(RuntimeError, match="injected failure in the calibration"):
                cc.allreduce(x, eb)
        else:
            t0 = time.monotonic()
            with pytest.raises(CollectiveError, match="timeout of 2.0 s") as info:
                cc.allreduce(x, eb)
            waited = time.monotonic() - t0
            assert "calibration" in str(info.value)
            assert 1.9 <= waited < 30, f"raised after {waited:.1f} s"
        # Peers may still be inside the calibration: the Communicator must refuse, on
        # every rank, rather than start another collective that could hang.
        with pytest.raises(CollectiveError, match="cannot be used after an earlier"):
            cc.allreduce(x, eb)
    finally:
        comm.Barrier()
        cc.free()
