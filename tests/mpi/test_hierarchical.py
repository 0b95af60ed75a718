"""Hierarchical collectives: nodes from ``ranks_per_node`` (run with 1..5 ranks).

With at least 2 nodes of at least 2 ranks (4 ranks, ``ranks_per_node=2``) a compressed
allreduce sums exactly inside each node, runs the compressed ring between nodes (one per
local rank) and shares the result inside the node; otherwise (1 node, or 1 rank per node)
calls stay flat. Checked exactly: the bound on every element against the exact sum, bitwise
identical results on every rank, sum and avg, ABS and REL, reduce_scatter, the agreement on
the grouping, bad ``ranks_per_node`` and the call report (docs/collectives.md,
"Hierarchical collectives").
"""

from __future__ import annotations

import numpy as np
import pytest
from collkit import (
    allowance,
    allreduce_reference,
    exact_sum,
    global_eb,
    gradient_like,
    my_block,
)
from kit import assert_same_on_every_rank, assert_within
from mpi4py import MPI

import ccoll
from ccoll.errors import InputError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
# Two nodes of two ranks need 4 ranks: this module also runs at 4 and 5 ranks.
pytestmark = pytest.mark.many_ranks
# Groupings the tests use at each size: (2 nodes x 2) at 4 ranks; one node of all ranks
# at 2 and 3; one rank per node at 3 and 5 (and 1); None: MPI's shared-memory domains
# (one machine here: one node of all ranks).
RPNS = {1: [1], 2: [2], 3: [1, 3], 4: [2], 5: [1]}.get(SIZE, [1]) + [None]


def _hierarchical(rpn: int | None) -> bool:
    return rpn is not None and rpn >= 2 and SIZE // rpn >= 2


@pytest.mark.parametrize("split", [None, 0.0, 0.5])
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3)], ids=["abs", "rel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("rpn", RPNS)
def test_allreduce_within_bound_and_identical(comm, rpn, op, dtype, eb, split):
    x = gradient_like(comm.rank, 30_011, dtype)
    x[5] = 1e30 if comm.rank == SIZE - 1 else x[5]  # a raw lane through every phase
    with ccoll.Communicator(comm, policy="compress", ranks_per_node=rpn, split=split,
                            chunk_elems=2000) as c:
        y = c.allreduce(x, eb, op=op)
        rep = c.last_call
    ref = allreduce_reference(comm, x, op)
    assert y.dtype == x.dtype and y.shape == x.shape
    allow = allowance(global_eb(comm, x, eb), y, SIZE, op)
    if _hierarchical(rpn) or split:  # both round once to the dtype, the average too
        allow["roundings"] = 1
    assert_within(y, ref, **allow)
    assert_same_on_every_rank(comm, y)
    assert rep.compressed and rep.hierarchical == _hierarchical(rpn)


@pytest.mark.parametrize("timeout", [None, 60.0])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 5000])
def test_tiny_shares_some_empty(comm, count, timeout):
    # Fewer elements than ranks per node: some local ranks' shares are empty, and every
    # node's rank with that local rank skips its ring alike. With a timeout the node
    # phases run as nonblocking MPI calls under the deadline.
    x = (np.arange(count, dtype=np.float32) + comm.rank) * 0.25
    with ccoll.Communicator(comm, policy="compress", ranks_per_node=RPNS[0],
                            timeout=timeout) as c:
        y = c.allreduce(x, ccoll.ABS(1e-2))
    assert_within(y, exact_sum(comm, x), 1e-2, roundings=1)
    assert_same_on_every_rank(comm, y)


def test_in_place_and_exact_calls(comm):
    x = gradient_like(comm.rank, 10_007, np.float32)
    with ccoll.Communicator(comm, policy="compress", ranks_per_node=RPNS[0]) as c:
        buf = x.copy()
        y = c.allreduce(buf, ccoll.ABS(1e-3), out=buf)
        assert y is buf
        assert_within(buf, exact_sum(comm, x), 1e-3, roundings=1)
        assert_same_on_every_rank(comm, buf)
        # eb=None stays plain MPI: bit for bit MPI's own allreduce, never two levels.
        e = c.allreduce(x, None)
        assert not c.last_call.hierarchical and not c.last_call.compressed
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    assert e.tobytes() == want.tobytes()


@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3)], ids=["abs", "rel"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("rpn", RPNS)
def test_reduce_scatter_within_bound(comm, rpn, op, eb):
    x = gradient_like(comm.rank, 20_003, np.float32)
    with ccoll.Communicator(comm, policy="compress", ranks_per_node=rpn) as c:
        y = c.reduce_scatter(x, eb, op=op)
        rep = c.last_call
    ref = my_block(exact_sum(comm, x), comm)
    if op == "avg":
        ref = ref / comm.size
    assert_within(y, ref, global_eb(comm, x, eb), roundings=1 if op == "sum" else 3)
    # reduce_scatter stays flat: its blocks belong to world ranks, not to local shares.
    assert rep.compressed and not rep.hierarchical


def test_call_report_and_grouping(comm):
    rpn = RPNS[0]
    x = gradient_like(comm.rank, 8_000, np.float32)
    with ccoll.Communicator(comm, policy="compress", ranks_per_node=rpn) as c:
        g = c.grouping
        assert (g.nodes, g.ranks_per_node) == (SIZE // rpn, rpn)
        assert (g.node, g.local) == (comm.rank // rpn, comm.rank % rpn)
        c.allreduce(x, ccoll.ABS(1e-3))
        rep = c.last_call
        assert (rep.nodes, rep.ranks_per_node) == (SIZE // rpn, rpn)
        assert rep.hierarchical == _hierarchical(rpn)
        assert ("hierarchical: " in str(rep)) == _hierarchical(rpn)
        assert f"ranks_per_node={rpn}" in repr(c)
        decisions = comm.allgather(rep.decision())
    assert all(d == decisions[0] for d in decisions)


def test_default_grouping_is_shared_memory(comm):
    # Every rank of this test runs on one machine: one shared-memory node of all ranks.
    with ccoll.Communicator(comm) as c:
        g = c.grouping
    assert (g.nodes, g.ranks_per_node, g.local) == (1, SIZE, comm.rank)
    assert g.source == "shared memory" and not g.hierarchical


@pytest.mark.parametrize("bad", [0, -2, SIZE + 1, 1.5, "2", True])
def test_bad_ranks_per_node_raises_on_every_rank(comm, bad):
    with pytest.raises(InputError, match="ranks_per_node") as info:
        ccoll.Communicator(comm, ranks_per_node=bad)
    if bad == SIZE + 1:
        assert f"does not divide the {SIZE} ranks" in str(info.value)
    comm.Barrier()


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs two ranks")
def test_mismatched_ranks_per_node(comm):
    mine = None if comm.rank == 0 else 1
    with pytest.raises(MismatchError, match="ranks per node") as info:
        ccoll.Communicator(comm, ranks_per_node=mine)
    assert "rank 0" in str(info.value) or "ranks 0" in str(info.value) or "on rank 0" in str(
        info.value)
    comm.Barrier()


_MODEL_ENV = {  # every constant given: no calibration collective, the same on every rank
    "CCOLL_ALPHA": "50us", "CCOLL_COMPRESS_GBPS": "5", "CCOLL_ADD_GBPS": "5",
    "CCOLL_DECOMPRESS_GBPS": "5", "CCOLL_RATIO": "20", "CCOLL_EFFICIENCY": "1",
    "CCOLL_OVERHEAD": "100us", "CCOLL_CALIBRATION": "off",
}


@pytest.mark.parametrize("link, compress", [("100Mbit", True), ("1000Gbit", False)],
                         ids=["slow", "fast"])
def test_auto_chooses_on_the_two_level_model(comm, monkeypatch, link, compress):
    for k, v in {**_MODEL_ENV, "CCOLL_BANDWIDTH": link}.items():
        monkeypatch.setenv(k, v)
    rpn = RPNS[0]
    x = gradient_like(comm.rank, 1 << 20, np.float32)
    with ccoll.Communicator(comm, policy="auto", ranks_per_node=rpn) as c:
        y = c.allreduce(x, ccoll.REL(1e-3), op="avg")
        rep = c.last_call
        # The grouping the planner prices two levels on (None: flat only).
        hier = c._sync.planner.options.hier
        plan = c._last_plan()
    assert hier == ((SIZE // rpn, rpn) if _hierarchical(rpn) else None)
    if comm.size > 1:
        assert rep.compressed == compress, rep
        assert rep.hierarchical == (compress and _hierarchical(rpn))
        assert rep.path == ("raw" if not compress else
                            "two levels" if _hierarchical(rpn) else "flat")
        assert plan.two_level == rep.hierarchical and plan.variant == rep.path
        if compress:
            assert rep.reason == (
                f"predicted {rep.predicted_raw_s / rep.predicted_compressed_s:.2f}x faster "
                "compressed" + (" in two levels" if rep.hierarchical else ""))
    if rep.compressed:
        assert_within(y, exact_sum(comm, x) / comm.size, global_eb(comm, x, ccoll.REL(1e-3)),
                      roundings=1 if rep.hierarchical else 3)
    assert_same_on_every_rank(comm, y)
    assert len(set(comm.allgather(rep.decision()))) == 1


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_float16_rounds_once_to_its_dtype(comm, op):
    # float16 moves as its float32 copy; the two-level result is rounded to float32 by the
    # share's owner and once more to float16 (one float32 half spacing, one float16).
    x = gradient_like(comm.rank, 10_001, np.float16)
    with ccoll.Communicator(comm, policy="compress", ranks_per_node=RPNS[0]) as c:
        y = c.allreduce(x, ccoll.REL(1e-3), op=op)
        hier = c.last_call.hierarchical
    assert y.dtype == np.float16 and hier == _hierarchical(RPNS[0])
    ref = allreduce_reference(comm, x, op)
    k = 1 if op == "sum" or hier else 3
    f32 = k * np.spacing(np.abs(y)).astype(np.float64) * 2.0**-14
    assert_within(y, ref, global_eb(comm, x, ccoll.REL(1e-3)), roundings=1, extra=f32)
    assert_same_on_every_rank(comm, y)


def test_node_phases_run_in_shared_memory(comm):
    # Several calls of changing sizes and data through the node's shared memory: the
    # memory is made once, reused by smaller calls, remade for a larger one. A missed
    # barrier would let a rank read another's previous input or result: checked exactly.
    rpn = RPNS[0]
    with ccoll.Communicator(comm, policy="compress", ranks_per_node=rpn) as c:
        made = []
        for i, count in enumerate([20_000, 20_000, 5_001, 40_000, 3]):
            x = gradient_like(comm.rank + 7 * i, count, np.float32)
            y = c.allreduce(x, ccoll.ABS(1e-3))
            assert_within(y, exact_sum(comm, x), 1e-3, roundings=1)
            assert_same_on_every_rank(comm, y)
            shm = None if c._sync.two is None else c._sync.two._shm
            made.append(None if shm is None else shm.count)
    if _hierarchical(rpn):
        assert made == [20_000, 20_000, 20_000, 40_000, 40_000]
    else:
        assert made == [None] * 5


def test_a_rank_without_shared_memory_moves_its_node_to_mpi(comm, monkeypatch):
    # CCOLL_NODE_SHM=0 on rank 1 only (read when the Communicator is made): its node
    # learns it when the memory is set up and runs MPI's Reduce_scatter/Allgatherv; the
    # other node keeps shared memory. Results are bound and the same bytes on every rank
    # either way.
    if comm.rank == 1:
        monkeypatch.setenv("CCOLL_NODE_SHM", "0")
    rpn = RPNS[0]
    x = gradient_like(comm.rank, 30_001, np.float64)
    with ccoll.Communicator(comm, policy="compress", ranks_per_node=rpn) as c:
        y = c.allreduce(x, ccoll.REL(1e-3), op="avg")
        hier = c.last_call.hierarchical
        shm = c._sync.two is not None and c._sync.two._shm is not None
        node = c.grouping.node
    assert_within(y, exact_sum(comm, x) / comm.size, global_eb(comm, x, ccoll.REL(1e-3)),
                  roundings=1 if hier else 3)
    assert_same_on_every_rank(comm, y)
    if hier:
        assert shm == (node != 1 // rpn)


@pytest.mark.skipif(not _hierarchical(RPNS[0]), reason="needs 2 nodes of 2+ ranks (4 ranks)")
def test_a_rank_failing_before_the_node_barrier_times_out_everywhere(comm):
    # The last rank fails after the agreement, before it writes its input: its node's
    # other ranks wait at the node barrier, the other node's ranks in the ring between the
    # nodes. Every rank raises (CollectiveError after the timeout) instead of hanging, and
    # the Communicator refuses further calls.
    x = gradient_like(comm.rank, 10_000, np.float32)
    c = ccoll.Communicator(comm, policy="compress", ranks_per_node=RPNS[0], timeout=3.0)
    try:
        c.allreduce(x, ccoll.ABS(1e-3))  # sets up the node's memory on every rank
        if comm.rank == SIZE - 1:
            def broken(*args):
                raise RuntimeError("this rank failed")
            c._sync.two._memory = broken
            with pytest.raises(RuntimeError, match="this rank failed"):
                c.allreduce(x, ccoll.ABS(1e-3))
        else:
            with pytest.raises(ccoll.CollectiveError, match="timeout") as info:
                c.allreduce(x, ccoll.ABS(1e-3))
            if c.grouping.node == (SIZE - 1) // RPNS[0]:
                assert "node barrier" in str(info.value)
        with pytest.raises(ccoll.CollectiveError, match="cannot be used"):
            c.allreduce(x, ccoll.ABS(1e-3))
    finally:
        c.close()
    comm.Barrier()


def test_auto_falls_back_to_the_flat_ring_when_two_levels_measure_slower(comm, monkeypatch):
    # The model (a slow link) compresses in two levels; the measured times, replaced on
    # every rank alike, say two levels take 10 s and the flat ring 0.1 ms (well under the
    # model's raw time, about 30 ms here, so raw gets no trial): after two levels'
    # measured run, auto runs the flat ring, on every rank; two levels is only tried again
    # now and then (after 2**k calls), and loses again.
    from ccoll.collectives.policy.plan import Planner

    for k, v in {**_MODEL_ENV, "CCOLL_BANDWIDTH": "100Mbit"}.items():
        monkeypatch.setenv(k, v)
    measured = {"two levels": 10.0, "flat": 1e-4}
    real_end = Planner.end

    def end(self, st, plan, seconds):
        real_end(self, st, plan, measured.get(plan.variant, seconds))

    monkeypatch.setattr(Planner, "end", end)
    rpn = RPNS[0]
    x = gradient_like(comm.rank, 1 << 16, np.float32)
    reports = []
    with ccoll.Communicator(comm, policy="auto", ranks_per_node=rpn) as c:
        for _ in range(10):
            y = c.allreduce(x, ccoll.REL(1e-3), op="avg")
            rep = c.last_call
            reports.append(rep)
            assert_same_on_every_rank(comm, y)
            assert_within(y, exact_sum(comm, x) / comm.size,
                          global_eb(comm, x, ccoll.REL(1e-3)),
                          roundings=1 if rep.hierarchical else 3)
    every = comm.allgather([r.decision() for r in reports])
    assert all(d == every[0] for d in every), every
    paths = "".join("T" if r.hierarchical else ("F" if r.compressed else "R") for r in reports)
    if comm.size == 1:
        assert set(paths) == {"R"}
        return
    if _hierarchical(rpn):
        # The model's two levels twice (its first run is not measured), then the flat ring
        # (twice before its own time is in, once more on both measured times); two levels
        # comes back only as a retry of the loser, at least 2**FIRST_LEVEL calls apart.
        from ccoll.collectives.policy.plan import FIRST_LEVEL

        assert paths.startswith("TTFFF") and "R" not in paths, paths
        for r in reports[:2]:
            assert r.reason.endswith("faster compressed in two levels"), r.reason
        at = [i for i, r in enumerate(reports) if r.hierarchical][2:]
        assert all(reports[i].trial and reports[i].reason.startswith("two levels tried again (")
                   for i in at), [r.reason for r in reports]
        assert all(b - a >= 1 << FIRST_LEVEL for a, b in zip([1, *at], at, strict=False)), paths
        flats = [r for r in reports[4:] if not r.hierarchical]
        assert len(flats) >= 4 and all(
            r.reason == "measured faster: compressed 0.1 ms, two levels 1e+04 ms"
            and not r.trial for r in flats), [r.reason for r in flats]
    else:
        assert set(paths) == {"F"}, paths
