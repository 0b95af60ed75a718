"""The split bound of the homomorphic allreduce (run with 1..5 ranks).

The reduce-scatter sums within ``e1``, the owner of each reduced block requantizes it
within ``e2`` and the allgather forwards that (docs/error-bound.md, "Split bound"). Checked
exactly: the bound on every element (one rounding to the dtype, sum and average), bitwise
identical results on every rank, the requantized grid, and the agreement on ``split``.
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


@pytest.mark.many_ranks
@pytest.mark.parametrize("chunk", [None, 1000])
@pytest.mark.parametrize("split", [None, 0.25, 0.5])
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3)], ids=["abs", "rel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_split_within_bound_and_identical(comm, op, dtype, eb, split, chunk):
    x = gradient_like(comm.rank, 20_011, dtype)
    x[7] = np.nan if comm.rank == 0 else x[7]
    x[100] = 1e30 if comm.rank == SIZE - 1 else x[100]  # a raw lane through the requantization
    with ccoll.Communicator(comm, policy="compress", split=split, chunk_elems=chunk) as c:
        y = c.allreduce(x, eb, op=op)
    ref = allreduce_reference(comm, x, op)
    assert y.dtype == x.dtype and y.shape == x.shape
    allow = allowance(global_eb(comm, x, eb), y, SIZE, op)
    if split:  # a split bound rounds once to the dtype, the average too ("Split bound")
        allow["roundings"] = 1
    assert_within(y, ref, **allow)
    assert_same_on_every_rank(comm, y)


@pytest.mark.many_ranks
@pytest.mark.parametrize("split", ["model", "fewest bytes"])
@pytest.mark.parametrize("schedule", ["ring", "halving"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_values_off_the_sums_grid_stay_within_bound(comm, op, dtype, schedule, split):
    # A value whose code needs more than 31 bits on the ring's grid, not on the allgather's
    # (k times coarser): its block of that rank's input is raw, so the reduced lane holds
    # float64 sums off the sum's grid, which the coarse grid could move farther than the
    # rest of the bound allows. The owner stores those blocks raw; its stream keeps its
    # header, so the halving's owners still join their streams. The split: the model's
    # (split=None), or the share with the fewest bytes for the ranks, always applied.
    from ccoll.collectives import ratios
    from ccoll.collectives.homomorphic import rank_bound
    from ccoll.collectives.policy.bounds import phase_bounds

    eb = 1e-3
    share = None if split == "model" else ratios.split_fraction(comm.size)
    x = gradient_like(comm.rank, 20_011, dtype)
    with ccoll.Communicator(comm, policy="compress", schedule=schedule, split=share) as c:
        # The plan of this signature (policy="compress": the same at every call), and the
        # bounds of its phases.
        c.allreduce(x, ccoll.ABS(eb), op=op)
        plan = c._last_plan()
        if share is not None:
            assert plan.split == (share if comm.size > 1 else 0.0)
        ring_eb, rq = phase_bounds(eb, comm.size, op == "avg", plan.split)
        step_r = 2 * rank_bound(ring_eb, comm.size)
        if comm.rank == comm.size - 1:
            x[100] = dtype(1.5 * 2**31 * step_r)
            x[5000] = dtype(-1.25 * 2**31 * step_r)
        y = c.allreduce(x, ccoll.ABS(eb), op=op)
        assert c._last_plan() == plan
    ref = allreduce_reference(comm, x, op)
    assert_within(y, ref, **allowance(eb, y, SIZE, op))
    assert_same_on_every_rank(comm, y)
    if rq is not None and rq.accept is not None:
        # aligned: the allowance is below the stream's bound, so the coarse grid alone
        # could move an off-grid value too far (tests/test_split_requant.py shows one)
        assert rq.accept < rq.bound


@pytest.mark.many_ranks
def test_split_result_lies_on_the_allgather_grid(comm):
    # float64 data: every fixed-length lane of a requantized result is q * 2 e2 for an
    # integer q (one float64 product), which the reduced sum on its finer grid is not.
    # e2 is 0.5 eb, or just below where the grid is an odd multiple of the sum's.
    x = gradient_like(comm.rank, 50_000, np.float64)
    eb = 1e-3
    from ccoll.collectives.policy.bounds import phase_bounds

    with ccoll.Communicator(comm, policy="compress", split=0.5) as c:
        y = c.allreduce(x, ccoll.ABS(eb), op="avg")
        sent = c.last_call.bytes_sent
        share = c._last_plan().split
        rq = phase_bounds(eb, comm.size, True, share).requant
    if comm.size == 1:
        assert share == 0.0 and sent == 0 and rq is None  # one rank: nothing to split
        return
    assert share == 0.5 and rq is not None
    assert eb * 0.5 * (1 - 2**-18) <= rq.bound <= eb * 0.5
    step2 = 2 * rq.bound
    q = y / step2
    on_grid = np.abs(q - np.round(q)) <= 1e-6
    assert on_grid.all(), (int((~on_grid).sum()), q[~on_grid][:5])
    with ccoll.Communicator(comm, policy="compress", split=0) as c:
        y0 = c.allreduce(x, ccoll.ABS(eb), op="avg")
    q0 = y0 / step2
    assert (np.abs(q0 - np.round(q0)) > 1e-6).mean() > 0.5  # the unsplit one is not


# A link where the model finds a split worth its requantization at 3 or more ranks
# (8 Mbit/s, a 5 GB/s compressor), and the calibration of this machine's own link.
SLOW_LINK = {"CCOLL_ALPHA": "50us", "CCOLL_BANDWIDTH": "8Mbit", "CCOLL_COMPRESS_GBPS": "5",
             "CCOLL_ADD_GBPS": "5", "CCOLL_DECOMPRESS_GBPS": "5", "CCOLL_CALIBRATION": "off"}


@pytest.mark.parametrize("link", ["slow", "calibrated"])
def test_split_auto_follows_the_model(comm, monkeypatch, link):
    # split=None: the share with the fewest bytes for the number of ranks
    # (ratios.split_fraction), where the model predicts it faster than none
    # (model.split_pays; policy="compress" prices at the default ratio); none for one
    # rank, for DAR and for device data.
    from ccoll.collectives import model, ratios
    from ccoll.collectives.policy.plan import Facts, candidates

    if link == "slow":
        for k, v in SLOW_LINK.items():
            monkeypatch.setenv(k, v)
    n = comm.size
    count = 1 << 16
    x = gradient_like(comm.rank, count, np.float32)
    with ccoll.Communicator(comm, policy="compress") as c:
        assert c.split is None
        c.allreduce(x, ccoll.ABS(1e-3))
        got = c._last_plan().split
        p = c.calibration.params
        fewest = ratios.split_fraction(n) if n > 1 else 0.0
        pays = fewest > 0 and model.split_pays(4.0 * count, n, p, model.DEFAULT_RATIO, fewest,
                                               width=ratios.DEFAULT_WIDTH)
        assert got == (fewest if pays else 0.0), (got, fewest, pays)
        if link == "slow" and n >= 3:
            assert got == fewest > 0  # the case where the split is taken
        # Device data: no split (the device kernels do not requantize).
        dev = Facts("allreduce", count, 4, "compress", "homomorphic", False, False, False,
                    True, n)
        flat = candidates(dev, p, model.DEFAULT_RATIO, ratios.DEFAULT_WIDTH,
                          c._sync.planner.options)[1]
        assert flat.plan.variant == "flat" and flat.plan.split == 0.0
    with ccoll.Communicator(comm, policy="compress", algorithm="dar") as c:
        c.allreduce(x, ccoll.ABS(1e-3))
        assert c.last_call.compressed and c._last_plan().split == 0.0


def test_reduce_scatter_keeps_the_whole_bound(comm):
    x = gradient_like(comm.rank, 10_007, np.float32)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, policy="compress", split=0.5) as c:
        y = c.reduce_scatter(x, eb, op="avg")
    with ccoll.Communicator(comm, policy="compress", split=0) as c:
        y0 = c.reduce_scatter(x, eb, op="avg")
    assert np.array_equal(y, y0)
    assert_within(y, my_block(exact_sum(comm, x) / comm.size, comm), global_eb(comm, x, eb),
                  roundings=3)


def test_mismatched_split_is_refused_on_every_rank(comm):
    if comm.size == 1:
        with pytest.raises(InputError, match="split"):
            ccoll.Communicator(comm, split=1.0)
        return
    split = 0.5 if comm.rank == 0 else None
    with pytest.raises(MismatchError) as info:
        ccoll.Communicator(comm, split=split)
    msg = str(info.value)
    assert "split" in msg and "rank 0" in msg, msg
    assert len(set(comm.allgather(msg))) == 1


@pytest.mark.parametrize("bad", [1.0, -0.25, True, "half", float("nan"), 10**400])
def test_invalid_split_is_refused_on_every_rank(comm, bad):
    with pytest.raises(InputError) as info:
        ccoll.Communicator(comm, split=bad)
    msg = str(info.value)
    assert "split must be None" in msg, msg
    assert len(set(comm.allgather(msg))) == 1


def test_repeated_calls_on_both_channels_stay_in_step(comm):
    # Requantized streams of both channels, call after call: an allgather arrival that
    # completes before the one of the step before it must still be forwarded after it
    # (seen at 5 ranks: a block's stream reached a rank expecting the next block's).
    with ccoll.Communicator(comm, chunk_elems=8192, policy="compress", split=0.5) as c:
        for i in range(6):
            x = gradient_like(comm.rank, 39_704, np.float64 if i < 3 else np.float32, seed=i)
            y = c.iallreduce(x, ccoll.REL(1e-3)).wait(timeout=120)
            y2 = c.allreduce(x, ccoll.REL(1e-3))
            assert np.array_equal(y, y2)
            assert_same_on_every_rank(comm, y)
