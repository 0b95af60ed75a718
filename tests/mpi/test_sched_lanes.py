"""The compressed collectives' host tasks run on the process scheduler's CPU lanes.

Run with 1-5 ranks. Results stay within the bound, bitwise identical on every rank and
bitwise equal to the private-thread path (``CCOLL_SCHED=off``); the kernels ran on the
lane threads, with numba's count = min(the rank's share, the lane's grid_limit).
"""

from __future__ import annotations

import numpy as np
import pytest
from collkit import exact_sum, global_eb, gradient_like, my_block
from kit import assert_same_on_every_rank, assert_within
from test_threads import _expected

import ccoll
from ccoll.gpu_sched import configure, default_scheduler

EB = ccoll.REL(1e-3)


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    monkeypatch.delenv("CCOLL_SCHED", raising=False)
    monkeypatch.delenv("CCOLL_THREADS", raising=False)
    configure()
    yield
    configure()


def _three(c: ccoll.Communicator, algorithm: str) -> tuple[np.ndarray, ...]:
    x = gradient_like(c.rank, 200_003, np.float32)
    y = c.allreduce(x, eb=EB, algorithm=algorithm, policy="compress")
    rs = c.reduce_scatter(x, eb=EB, algorithm=algorithm, policy="compress")
    ag = c.allgather(x[:30_011], eb=EB)
    return x, y, rs, ag


@pytest.mark.parametrize("algorithm", ["homomorphic", "dar"])
def test_results_on_the_lanes_are_within_bound_identical_and_as_before(comm, algorithm,
                                                                       monkeypatch, launches):
    with ccoll.Communicator(comm, chunk_elems=1 << 13, policy="compress") as c:
        x, y, rs, ag = _three(c, algorithm)
        lanes = "lanes=True" in repr(c)
    bound = global_eb(comm, x, EB)
    assert_within(y, exact_sum(comm, x), bound, roundings=1)
    assert_same_on_every_rank(comm, y)
    assert_within(rs, my_block(exact_sum(comm, x), comm), bound, roundings=1)
    xs = np.stack(comm.allgather(x[:30_011]))
    assert_within(ag, xs, global_eb(comm, x[:30_011], EB))
    assert_same_on_every_rank(comm, ag)
    names = {n for n, _ in launches}
    if comm.size > 1:
        assert lanes
        assert "ccoll-lane-compress" in names, names
        assert "ccoll-lane-reduce" in names or algorithm == "homomorphic", names
        assert not any(n.endswith("-worker") for n in names), names
    # The private thread's path gives the very same bytes.
    monkeypatch.setenv("CCOLL_SCHED", "off")
    launches.clear()
    with ccoll.Communicator(comm, chunk_elems=1 << 13, policy="compress") as c:
        _, y0, rs0, ag0 = _three(c, algorithm)
        assert "lanes=False" in repr(c)
    assert y0.tobytes() == y.tobytes()
    assert rs0.tobytes() == rs.tobytes()
    assert ag0.tobytes() == ag.tobytes()
    assert not any(n.startswith("ccoll-lane-") for n, _ in launches), launches


def test_lane_tasks_use_the_smaller_of_the_rank_share_and_the_grid_limit(comm, launches):
    configure("cpu", max_sm_fraction=0.5)
    limit = default_scheduler("cpu").grid_limit("compress")
    want = min(_expected(comm), limit)
    with ccoll.Communicator(comm, chunk_elems=1 << 13, policy="compress") as c:
        x = gradient_like(c.rank, 200_003, np.float32)
        c.allreduce(x, eb=EB, algorithm="dar")
    on_lanes = {(n, k) for n, k in launches if n.startswith("ccoll-lane-")}
    if comm.size > 1:
        assert on_lanes, launches
    assert {k for _, k in on_lanes} <= {want}, (want, launches)


def test_a_hook_state_puts_the_lanes_below_training(comm, monkeypatch):
    pytest.importorskip("torch")
    from ccoll.gpu_sched import DEFAULT_PRIORITY_RANKS
    from ccoll.gpu_sched import scheduler as sched_mod
    from ccoll.torch import CCollHookState

    monkeypatch.setattr(sched_mod, "_training", False)
    with ccoll.Communicator(comm, chunk_elems=1 << 13, policy="compress") as c:
        c.allreduce(gradient_like(c.rank, 50_000, np.float32), eb=EB)  # lanes at nice 0
    before = default_scheduler("cpu")
    assert set(before.priority_ranks.values()) == {0}
    with CCollHookState(comm=comm):
        assert before._closed
        assert default_scheduler("cpu").priority_ranks == dict(DEFAULT_PRIORITY_RANKS)
