"""policy="auto"'s measured feedback under MPI: ranks that measure different times decide alike.

Each rank's measured seconds are replaced through the feedback's test hook
(``Feedback.measure``) by numbers that differ wildly between ranks: a rank-local
comparison would split the ranks (one sends raw while the others compress); the
agreed maximum never does. The calibration is forced through environment variables
(a slow link on which the model compresses), so the decisions do not depend on the machine.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from collkit import exact_sum, global_eb, gradient_like
from kit import assert_same_on_every_rank, assert_within

import ccoll
from ccoll.collectives.agreement import Call, agree
from ccoll.collectives.waiting import Deadline

SLOW_LINK = {  # 100 Mbit/s, fast compressor: the model compresses 1.2 MB
    "CCOLL_ALPHA": "50us", "CCOLL_BANDWIDTH": "100Mbit", "CCOLL_COMPRESS_GBPS": "5",
    "CCOLL_ADD_GBPS": "5", "CCOLL_DECOMPRESS_GBPS": "5",
}


@pytest.fixture
def slow_link(comm, monkeypatch):
    """A fresh calibration cache for every rank, and the slow link's overrides."""
    path = tempfile.mkdtemp(prefix="ccoll-cache-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    monkeypatch.setenv("CCOLL_CACHE_DIR", path)
    for k in ("CCOLL_CALIBRATION", "CCOLL_RATIO", "CCOLL_EFFICIENCY", "CCOLL_OVERHEAD"):
        monkeypatch.delenv(k, raising=False)
    for k, v in SLOW_LINK.items():
        monkeypatch.setenv(k, v)
    yield
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _split_clock(rank: int):
    """Rank 0 measures compressed calls at 1000 s; the others compressed 10 ms, raw 0.5 s.

    Alone, rank 0 would go raw and the others keep compressing. Agreed (the maximum):
    compressed 1000 s, raw 0.5 s, so every rank goes raw, and every re-probe loses.
    """
    if rank == 0:
        return lambda compressed, s: 1000.0 if compressed else 1e-3
    return lambda compressed, s: 0.01 if compressed else 0.5


def test_agreement_returns_the_slowest_ranks_seconds(comm):
    call = Call("allreduce", count=3, dtype=1)
    call.elapsed = 1.0 + comm.rank
    assert agree(comm, call, Deadline(60.0, "test")).elapsed == float(comm.size)


def _calls(cc, x, eb, n):
    modes, reasons = [], []
    for _ in range(n):
        y = cc.allreduce(x, eb)
        assert_same_on_every_rank(cc.comm, y)
        modes.append("C" if cc.last_call.compressed else "R")
        reasons.append(cc.last_call.reason)
    return "".join(modes), reasons, y


def test_ranks_that_measure_different_times_decide_alike(comm, slow_link):
    if comm.size == 1:
        pytest.skip("one rank never compresses")
    x = gradient_like(comm.rank, 300_001, np.float32)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, timeout=60) as cc:
        cc._auto_policy(cc._sync).feedback.measure = _split_clock(comm.rank)
        modes, reasons, y = _calls(cc, x, eb, 11)
    # The 1st call calibrates (not timed); the 2nd call's time is agreed in the 3rd and
    # taken in at its end: raw from the 4th, re-probes after 2 and 4 raw calls, which lose.
    assert modes == "CCC" + "RR" + "C" + "RRRR" + "C"
    assert reasons[3].startswith("measured raw faster: compressed 1e+06 ms, raw")
    assert comm.allgather((modes, reasons)) == [(modes, reasons)] * comm.size
    assert_within(y, exact_sum(comm, x), global_eb(comm, x, eb), roundings=1)


def test_a_call_of_another_policy_carries_the_time_in(comm, slow_link):
    # An exact call after the 2nd auto call carries that call's time in its agreement and
    # applies it at its end: the next auto call is already raw.
    if comm.size == 1:
        pytest.skip("one rank never compresses")
    x = gradient_like(comm.rank, 300_001, np.float32)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, timeout=60) as cc:
        cc._auto_policy(cc._sync).feedback.measure = _split_clock(comm.rank)
        first, _, _ = _calls(cc, x, eb, 2)
        exact = cc.allreduce(x, None)
        assert not cc.last_call.compressed
        then, reasons, y = _calls(cc, x, eb, 3)
    assert first + then == "CC" + "RRC"
    assert comm.allgather((first, then, reasons)) == [(first, then, reasons)] * comm.size
    assert_same_on_every_rank(comm, exact)
    assert_within(y, exact_sum(comm, x), global_eb(comm, x, eb), roundings=1)
