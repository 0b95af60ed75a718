"""Recursive halving and doubling (``schedule="halving"``), run with 1..5 ranks.

Power-of-two rank counts halve and double directly; 3 and 5 fold their extra ranks into a
partner first. Checked exactly: the bound on every element against the exact sum, bitwise
identical results on every rank, the same output bytes as the ring without a split
(integer sums of codes do not depend on the order they are added in), the requantized
split, both stream formats, few compute calls, two levels between nodes, a rank failing
midway, and the agreement on ``schedule`` (docs/collectives.md, "Schedules").
"""

from __future__ import annotations

import numpy as np
import pytest
from collkit import allowance, allreduce_reference, global_eb, gradient_like
from kit import assert_same_on_every_rank, assert_within
from mpi4py import MPI

import ccoll
from ccoll.collectives import trace
from ccoll.errors import InputError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
# Halving has log2 N steps and folds a rank in at 3 and 5: it also runs at 4 and 5 ranks.
pytestmark = pytest.mark.many_ranks


@pytest.mark.parametrize("chunk", [None, 997])
@pytest.mark.parametrize("split", [None, 0.0, 0.5])
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3)], ids=["abs", "rel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_halving_within_bound_and_identical(comm, op, dtype, eb, split, chunk):
    x = gradient_like(comm.rank, 20_011, dtype)
    x[7] = np.nan if comm.rank == 0 else x[7]
    x[100] = 1e30 if comm.rank == SIZE - 1 else x[100]  # a raw lane in the sums
    x[101] = -np.inf if comm.rank == SIZE // 2 else x[101]
    with ccoll.Communicator(comm, policy="compress", schedule="halving", split=split,
                            chunk_elems=chunk) as c:
        y = c.allreduce(x, eb, op=op)
    ref = allreduce_reference(comm, x, op)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.isnan(y[7]) and y[101] == -np.inf
    allow = allowance(global_eb(comm, x, eb), y, SIZE, op)
    if split:  # a split bound rounds once to the dtype, the average too ("Split bound")
        allow["roundings"] = 1
    assert_within(y, ref, **allow)
    assert_same_on_every_rank(comm, y)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_halving_gives_the_rings_bytes(comm, op):
    # The reduced codes are exact integer sums: the order of the additions (a ring, a
    # tree) cannot change them, so both schedules decode the same values. (With a split
    # the owners requantize blocks cut at other places, ring blocks against 32-element
    # aligned ones, so a block that goes raw there may differ: both within the bound.)
    split = 0.0
    x = gradient_like(comm.rank, 30_000, np.float32, seed=3)
    out = {}
    for schedule in ("ring", "halving"):
        with ccoll.Communicator(comm, policy="compress", schedule=schedule, split=split,
                                chunk_elems=1500) as c:
            out[schedule] = c.allreduce(x, ccoll.REL(1e-3), op=op)
    np.testing.assert_array_equal(out["ring"].view(np.uint32), out["halving"].view(np.uint32))


@pytest.mark.parametrize("split", [0.0, 0.5])
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3)], ids=["abs", "rel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_halving_in_format_2(comm, monkeypatch, op, dtype, eb, split):
    # Format 2 through the halving: every message a version-2 stream (cut, joined,
    # requantized), the bound on every element, the same bits on every rank. Both formats
    # code the same quantized values (and requantize the same values), so the result is
    # format 1's bit for bit, and without a split the ring's in format 2 as well (but for
    # the blocks with a raw lane, whose float64 sums follow each schedule's order).
    from ccoll.collectives import halving

    seen: list[int] = []
    real = halving.check_stream

    def spy(buf, n, dt, bound, version=None):
        seen.append(int(np.asarray(buf)[4]))  # the header's version byte
        return real(buf, n, dt, bound, version)

    monkeypatch.setattr(halving, "check_stream", spy)
    x = gradient_like(comm.rank, 20_011, dtype, seed=4)
    x[7] = np.nan if comm.rank == 0 else x[7]
    x[100] = 1e30 if comm.rank == SIZE - 1 else x[100]  # a raw lane in the sums
    x[101] = -np.inf if comm.rank == SIZE // 2 else x[101]
    out, versions = {}, {}
    for schedule, v in (("halving", 2), ("halving", 1), ("ring", 2)):
        seen.clear()
        with ccoll.Communicator(comm, policy="compress", schedule=schedule, split=split,
                                chunk_elems=1500, format_version=v) as c:
            with trace.tracing() as rec:
                out[schedule, v] = c.allreduce(x, eb, op=op)
            assert c.last_call.format_version == v
            assert c.last_call.compressed or SIZE == 1
        ran = [e for e in rec.events if e[0] == "halving allreduce"]
        assert len(ran) == (1 if schedule == "halving" and SIZE > 1 else 0)
        versions[schedule, v] = set(seen)
    y = out["halving", 2]
    if SIZE > 1:
        assert versions["halving", 2] == {2} and versions["halving", 1] == {1}
    assert np.isnan(y[7]) and y[101] == -np.inf
    allow = allowance(global_eb(comm, x, eb), y, SIZE, op)
    if split:
        allow["roundings"] = 1
    assert_within(y, allreduce_reference(comm, x, op), **allow)
    assert_same_on_every_rank(comm, y)
    np.testing.assert_array_equal(y.view(np.uint8), out["halving", 1].view(np.uint8))
    if not split:  # blocks with a raw lane add floats, in each schedule's order: not those
        coded = np.ones(y.size, bool)
        for i in (7, 100, 101):
            coded[32 * (i // 32): 32 * (i // 32 + 1)] = False
        np.testing.assert_array_equal(y[coded].view(np.uint8),
                                      out["ring", 2][coded].view(np.uint8))


@pytest.mark.skipif(SIZE != 4, reason="two nodes of two ranks need 4 ranks")
def test_halving_between_nodes_in_format_2(comm):
    x = gradient_like(comm.rank, 25_000, np.float32)
    ys = {}
    for v in (1, 2):
        with ccoll.Communicator(comm, policy="compress", schedule="halving", split=0.5,
                                ranks_per_node=2, format_version=v) as c:
            ys[v] = c.allreduce(x, ccoll.REL(1e-3), op="avg")
            assert c.last_call.hierarchical and c.last_call.format_version == v
    assert_within(ys[2], allreduce_reference(comm, x, "avg"),
                  global_eb(comm, x, ccoll.REL(1e-3)), roundings=1)
    assert_same_on_every_rank(comm, ys[2])
    np.testing.assert_array_equal(ys[2].view(np.uint32), ys[1].view(np.uint32))


@pytest.mark.parametrize("count", [0, 1, SIZE - 1, 3 * SIZE + 1])
def test_halving_tiny_counts(comm, count):
    # Fewer elements than blocks: empty blocks take part in no message on any rank.
    x = gradient_like(comm.rank, count, np.float64)
    with ccoll.Communicator(comm, policy="compress", schedule="halving", timeout=60) as c:
        y = c.allreduce(x, ccoll.ABS(1e-4))
    assert_within(y, allreduce_reference(comm, x, "sum"), global_eb(comm, x, ccoll.ABS(1e-4)))
    assert_same_on_every_rank(comm, y)


@pytest.mark.parametrize("chunk", [2_000, 40_000])
def test_halving_runs_in_log_steps_with_few_calls(comm, chunk):
    # The trace names the schedule, its steps and the folded ranks; a rank makes about
    # one compute call per first-step piece plus a few per step (cut, add, join,
    # decode), not one per block and step.
    x = gradient_like(comm.rank, 40_000, np.float32)
    with ccoll.Communicator(comm, policy="compress", schedule="halving",
                            chunk_elems=chunk) as c:
        with trace.tracing() as rec:
            c.allreduce(x, ccoll.REL(1e-3))
    spans = [e[5] for e in rec.events if e[0] == "halving allreduce"]
    if SIZE == 1:  # one rank: nothing to exchange, no schedule runs
        assert spans == []
        return
    m = SIZE.bit_length() - 1
    (span,) = spans
    assert (span["steps"], span["fold"]) == (m, SIZE - (1 << m))
    assert span["pieces"] == max(2, -(-40_000 // chunk))
    assert span["calls"] <= 2 * span["pieces"] + 5 * (m + 1) + 2  # (a folded rank adds K)
    tasks = [e for e in rec.events if e[1] == "compute"]
    assert len(tasks) == span["calls"]


@pytest.mark.skipif(SIZE != 4, reason="two nodes of two ranks need 4 ranks")
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_halving_between_nodes(comm, op):
    x = gradient_like(comm.rank, 25_000, np.float32)
    with ccoll.Communicator(comm, policy="compress", schedule="halving",
                            ranks_per_node=2) as c:
        assert c.grouping.hierarchical
        y = c.allreduce(x, ccoll.REL(1e-3), op=op)
    # two levels round once to the dtype, the average too ("Hierarchical allreduce")
    assert_within(y, allreduce_reference(comm, x, op), global_eb(comm, x, ccoll.REL(1e-3)),
                  roundings=1)
    assert_same_on_every_rank(comm, y)


def test_reduce_scatter_keeps_the_ring(comm):
    x = gradient_like(comm.rank, 10_000, np.float32)
    with ccoll.Communicator(comm, policy="compress", schedule="halving") as c:
        y = c.reduce_scatter(x, ccoll.ABS(1e-3))
    assert y.size == np.array_split(x, SIZE)[comm.rank].size


@pytest.mark.parametrize("bad", ["tree", "", None, 2])
def test_bad_schedule_raises_on_every_rank(comm, bad):
    with pytest.raises(InputError, match="schedule"):
        ccoll.Communicator(comm, schedule=bad)
    comm.Barrier()


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs two ranks")
def test_mismatched_schedule(comm):
    mine = "ring" if comm.rank == 0 else "halving"
    with pytest.raises(MismatchError, match="schedule"):
        ccoll.Communicator(comm, schedule=mine)
    comm.Barrier()


def test_schedule_in_repr(comm):
    with ccoll.Communicator(comm, schedule="ring") as c:
        assert "schedule='ring'" in repr(c) and c.schedule == "ring"


@pytest.mark.skipif(SIZE < 2, reason="a failure that others wait for needs two ranks")
def test_a_rank_failing_midway_times_out_everywhere(comm, monkeypatch):
    # The last rank's first addition raises after its first messages went out: it raises
    # that error, every other rank raises CollectiveError after the timeout instead of
    # waiting forever, and the Communicator refuses further calls on every rank.
    x = gradient_like(comm.rank, 10_000, np.float32)
    c = ccoll.Communicator(comm, policy="compress", schedule="halving", timeout=3.0)
    try:
        c.allreduce(x, ccoll.ABS(1e-3))  # compiled and warmed up everywhere
        if comm.rank == SIZE - 1:
            from ccoll.collectives import halving

            def broken(self, i, received):
                raise RuntimeError("this rank failed")
            monkeypatch.setattr(halving._Halving, "_combine", broken)
            with pytest.raises(RuntimeError, match="this rank failed"):
                c.allreduce(x, ccoll.ABS(1e-3))
        else:
            with pytest.raises(ccoll.CollectiveError, match="timeout"):
                c.allreduce(x, ccoll.ABS(1e-3))
        with pytest.raises(ccoll.CollectiveError, match="cannot be used"):
            c.allreduce(x, ccoll.ABS(1e-3))
    finally:
        c.close()
    comm.Barrier()
    # The failed call's messages still on their way must not reach a later communicator
    # (MPI reuses a freed one's context: the failed one is kept, never freed).
    y = gradient_like(comm.rank, 30_000, np.float32, seed=5)
    with ccoll.Communicator(comm, policy="compress", schedule="ring", chunk_elems=1500) as d:
        z = d.allreduce(y, ccoll.ABS(1e-3))
    assert_within(z, allreduce_reference(comm, y, "sum"), global_eb(comm, y, ccoll.ABS(1e-3)))
