"""ccoll's collectives under MPI (run with 1..5 ranks; see the Makefile's test-mpi).

Every compressed result is checked element by element, exactly, against the exact
reduction of all ranks' inputs (tests/kit.py), and bitwise across ranks. The default policy ("auto")
sends these small messages raw, so the tests that check compression ask for it
(``policy="compress"``); tests/mpi/test_policy.py checks the default itself.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from collkit import exact_sum, global_eb, gradient_like, my_block
from kit import assert_same_on_every_rank, assert_within, rel_bound
from mpi4py import MPI

import ccoll
from ccoll.errors import DTypeError, ErrorBoundError, InputError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
COUNTS = sorted({0, 1, 31, 33, max(SIZE - 1, 0), 100_003})
DTYPES = [np.float32, np.float64]
BOUNDS = [ccoll.ABS(1e-3), ccoll.REL(1e-3)]
ALGOS = ["homomorphic", "dar"]


def _bound_id(b):
    return f"{type(b).__name__}{b.value:g}"


@pytest.fixture
def compressing(comm):
    """A Communicator that always compresses (allgather and bcast take no per-call policy)."""
    with ccoll.Communicator(comm, policy="compress") as c:
        yield c


def same_error_everywhere(comm, exc_info, exc_type, match):
    err = exc_info.value
    assert type(err) is exc_type, f"{type(err).__name__}: {err}"
    assert match in str(err), str(err)
    msgs = comm.allgather(str(err))
    assert len(set(msgs)) == 1, msgs


@pytest.mark.many_ranks
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("eb", BOUNDS, ids=_bound_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", COUNTS)
def test_allreduce_within_bound_and_identical(comm, n, dtype, eb, algorithm):
    x = gradient_like(comm.rank, n, dtype)
    y = ccoll.allreduce(x, eb=eb, comm=comm, algorithm=algorithm, policy="compress")
    assert y.shape == x.shape and y.dtype == x.dtype
    # The contract: within eb of the exact sum, plus one rounding to the dtype.
    assert_within(y, exact_sum(comm, x), global_eb(comm, x, eb), roundings=1)
    assert_same_on_every_rank(comm, y)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("eb", BOUNDS, ids=_bound_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_allreduce_avg(comm, dtype, eb, algorithm):
    x = gradient_like(comm.rank, 5000, dtype).reshape(50, 100)
    y = ccoll.allreduce(x, eb=eb, op="avg", comm=comm, algorithm=algorithm, policy="compress")
    # docs/error-bound.md, "avg": the bound is on the average (REL: v times the range of the
    # inputs). Host data: the decoded sum's float64 values (within N eb) divided by N in
    # float64 and rounded once: eb plus half a spacing of y. (float32 at 3 ranks rounded the
    # sum to float32 first and then the quotient: up to eb plus three half spacings, and
    # hundreds of elements past one.)
    assert_within(y, exact_sum(comm, x) / comm.size, global_eb(comm, x, eb), roundings=1)
    assert_same_on_every_rank(comm, y)


@pytest.mark.parametrize("schedule", ["ring", "halving"])
def test_avg_rounds_once_where_eb_is_near_the_spacing(comm, schedule):
    # float32 values near 300 are 3.05e-5 apart: ABS(1e-5) is a third of a spacing. At 3
    # ranks the average was within eb plus three half spacings only (one element 0.67
    # spacings past eb + 0), hundreds of elements past one half spacing: the decoded sum
    # was rounded to float32 and then divided by 3. Now the sum's float64 values are divided
    # and rounded once (docs/error-bound.md, "avg"). (DAR's bound needs spacings well below
    # eb: "allreduce, DAR".)
    x = (np.random.default_rng(comm.rank).standard_normal(4096) * 300).astype(np.float32)
    eb = ccoll.ABS(1e-5)
    with ccoll.Communicator(comm, policy="compress", split=0, schedule=schedule) as c:
        y = c.allreduce(x, eb, op="avg")
        rs = c.reduce_scatter(x, eb, op="avg")
    avg = exact_sum(comm, x) / comm.size
    assert_within(y, avg, Fraction(eb.value), roundings=1)
    assert_within(rs, my_block(avg, comm), Fraction(eb.value), roundings=1)
    assert_same_on_every_rank(comm, y)


@pytest.mark.parametrize("schedule", ["ring", "halving"])
def test_avg_of_a_sum_beyond_float32_is_the_finite_average(comm, schedule):
    # Every rank holds 2e38: the sum is beyond float32's range, the average is not. At 2
    # and 4 ranks (a power of two, where the decode rounded the sum to float32 before
    # dividing) the result was inf; at 3 ranks 2e38.
    x = np.full(64, 2.0e38, np.float32)
    x[::2] = -3.0e38  # and a sum below float32's range, whose average is -3e38
    with ccoll.Communicator(comm, policy="compress", split=0, schedule=schedule) as c:
        y = c.allreduce(x, ccoll.ABS(1e-3), op="avg")
        rs = c.reduce_scatter(x, ccoll.ABS(1e-3), op="avg")
        z = c.iallreduce(x, ccoll.ABS(1e-3), op="avg").wait()
    for got, want in ((y, x), (z, x), (rs, my_block(x, comm))):
        assert np.all(np.isfinite(got))
        assert_within(got, want, Fraction(1, 1000), roundings=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_avg_quantizes_on_the_grid_of_its_own_bound(comm, dtype):
    # op="avg" within eb must cost what op="sum" within N * eb costs: the same per-rank grid
    # (not one N times finer), so the same streams, the same bytes, and the sum's result
    # divided by N, bit for bit. (Without the split bound, which requantizes the average
    # itself: tests/mpi/test_split.py.)
    x = gradient_like(comm.rank, 20_000, dtype)
    eb, n = 1e-3, comm.size
    with ccoll.Communicator(comm, policy="compress", split=0) as c:
        y_avg = c.allreduce(x, ccoll.ABS(eb), op="avg")
        sent_avg = c.last_call.bytes_sent
        y_sum = c.allreduce(x, ccoll.ABS(eb * n), op="sum")
        sent_sum = c.last_call.bytes_sent
        rs_avg = c.reduce_scatter(x, ccoll.ABS(eb), op="avg")
        rs_sum = c.reduce_scatter(x, ccoll.ABS(eb * n), op="sum")
    assert sent_avg == sent_sum, (sent_avg, sent_sum)
    if dtype == np.float64 or n & (n - 1) == 0:
        # The sum's decoded values divided by N: float64's are its float64 values, and a
        # power of two divides exactly.
        assert np.array_equal(y_avg, y_sum / dtype(n)), np.abs(y_avg - y_sum / dtype(n)).max()
        assert np.array_equal(rs_avg, rs_sum / dtype(n))
    else:
        # float32 at 3 ranks: the average rounds once from the sum's float64 values, the
        # sum's result divided by 3 twice; they differ by two spacings at most (each
        # rounding half of one, and the sum's own half spacing over 3).
        for a, s in ((y_avg, y_sum), (rs_avg, rs_sum)):
            q = s / dtype(n)
            gap = np.spacing(np.maximum(np.abs(a), np.abs(q))).astype(np.float64)
            assert np.all(np.abs(a.astype(np.float64) - q) <= 2 * gap)
    assert_within(y_avg, exact_sum(comm, x) / n, eb, roundings=1)
    assert_same_on_every_rank(comm, y_avg)


@pytest.mark.parametrize("eb", BOUNDS, ids=_bound_id)
def test_reduce_scatter_avg_within_bound(comm, eb):
    x = gradient_like(comm.rank, 10_007, np.float32)
    y = ccoll.reduce_scatter(x, eb=eb, op="avg", comm=comm, policy="compress")
    ref = my_block(exact_sum(comm, x) / comm.size, comm)
    assert_within(y, ref, global_eb(comm, x, eb), roundings=1)


@pytest.mark.parametrize("chunk", [7, 32, 1000])
def test_allreduce_pipelined_chunks(comm, chunk):
    # Small chunks: many streams per block, the worker thread and the pipelined ring.
    x = gradient_like(comm.rank, 2_011 if chunk < 32 else 20_011, np.float32)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, chunk_elems=chunk, policy="compress") as c:
        y = c.allreduce(x, eb=eb)
    assert_within(y, exact_sum(comm, x), global_eb(comm, x, eb), roundings=1)
    assert_same_on_every_rank(comm, y)


def test_compressed_allreduce_sends_fewer_bytes_than_a_raw_ring(comm):
    x = gradient_like(comm.rank, 100_000, np.float32)
    with ccoll.Communicator(comm, policy="compress") as c:
        c.allreduce(x, eb=ccoll.REL(1e-3))
        sent = c.stats.last["bytes_sent"]
    raw_ring = 2 * (comm.size - 1) * x.nbytes / comm.size
    assert sent <= raw_ring / 2, (sent, raw_ring)
    if comm.size == 1:
        assert sent == 0


def test_allreduce_tiny_bound_goes_raw_and_stays_within(comm):
    # An absolute bound far below float32 resolution: blocks are stored raw and summed in
    # float64, so the result is the float64 sum rounded once to float32.
    x = gradient_like(comm.rank, 4099, np.float32) + np.float32(1.0)
    y = ccoll.allreduce(x, eb=ccoll.ABS(1e-12), comm=comm, policy="compress")
    assert_within(y, exact_sum(comm, x), 1e-12, roundings=1)
    assert_same_on_every_rank(comm, y)


@pytest.mark.parametrize("policy", ["compress", "raw"])
def test_allreduce_out_and_in_place(comm, policy):
    x = gradient_like(comm.rank, 1000, np.float64)
    ref = ccoll.allreduce(x, eb=ccoll.ABS(1e-4), comm=comm, policy=policy)
    out = np.empty_like(x)
    y = ccoll.allreduce(x, eb=ccoll.ABS(1e-4), comm=comm, out=out, policy=policy)
    assert y is out and np.array_equal(out, ref)
    xin = x.copy()
    y2 = ccoll.allreduce(xin, eb=ccoll.ABS(1e-4), comm=comm, out=xin, policy=policy)
    assert y2 is xin and np.array_equal(xin, ref)
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    xin = x.copy()
    assert ccoll.allreduce(xin, eb=None, comm=comm, out=xin) is xin
    assert np.array_equal(xin, want)


@pytest.mark.many_ranks
@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [0, 1, 33, 10_007])
def test_reduce_scatter(comm, n, dtype, algorithm):
    x = gradient_like(comm.rank, n, dtype)
    eb = ccoll.REL(1e-3)
    y = ccoll.reduce_scatter(x, eb=eb, comm=comm, algorithm=algorithm, policy="compress")
    want = my_block(exact_sum(comm, x), comm)
    assert y.dtype == x.dtype
    assert_within(y, want, global_eb(comm, x, eb), roundings=1)


@pytest.mark.many_ranks
@pytest.mark.parametrize("eb", BOUNDS, ids=_bound_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 5), (3000,)])
def test_allgather(comm, compressing, shape, dtype, eb):
    x = gradient_like(comm.rank, int(np.prod(shape)), dtype).reshape(shape)
    y = ccoll.allgather(x, eb=eb, comm=compressing)
    assert y.shape == (comm.size, *shape) and y.dtype == x.dtype
    xs = np.stack(comm.allgather(x))
    assert_within(y, xs, global_eb(comm, x, eb))
    assert_same_on_every_rank(comm, y)


@pytest.mark.many_ranks
@pytest.mark.parametrize("eb", BOUNDS, ids=_bound_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(0,), (1,), (20, 30)])
def test_bcast(comm, compressing, shape, dtype, eb):
    root = comm.size - 1
    n = int(np.prod(shape))
    x = gradient_like(99 if comm.rank == root else comm.rank + 1000, n, dtype).reshape(shape)
    y = ccoll.bcast(x, eb=eb, root=root, comm=compressing)
    want = comm.bcast(x, root=root)
    ebabs = eb.value if isinstance(eb, ccoll.ABS) else rel_bound(eb.value, want)
    assert y.shape == shape and y.dtype == x.dtype
    assert_within(y, want, ebabs)
    assert_same_on_every_rank(comm, y)


# -- exact path: plain MPI bit for bit ---------------------------------------------------


@pytest.mark.many_ranks
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [0, 5, 100_003])
def test_exact_equals_mpi(comm, n, dtype):
    x = gradient_like(comm.rank, n, dtype)
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    assert np.array_equal(ccoll.allreduce(x, eb=None, comm=comm).view(np.uint8),
                          want.view(np.uint8))
    counts = [len(b) for b in np.array_split(np.empty(n), comm.size)]
    rs = np.empty(counts[comm.rank], dtype=dtype)
    comm.Reduce_scatter(x, rs, recvcounts=counts, op=MPI.SUM)
    assert np.array_equal(ccoll.reduce_scatter(x, eb=None, comm=comm).view(np.uint8),
                          rs.view(np.uint8))
    ag = np.empty((comm.size, n), dtype=dtype)
    comm.Allgather(x, ag)
    assert np.array_equal(ccoll.allgather(x, eb=None, comm=comm), ag)
    bc = x.copy()
    comm.Bcast(bc, root=0)
    assert np.array_equal(ccoll.bcast(x, eb=None, comm=comm), bc)


def test_raw_policy_is_plain_mpi(comm):
    x = gradient_like(comm.rank, 3001, np.float32)
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    y = ccoll.allreduce(x, eb=ccoll.REL(1e-3), comm=comm, policy="raw")
    assert np.array_equal(y.view(np.uint8), want.view(np.uint8))


# -- non-finite values ---------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_nan_inf_propagate(comm, dtype, algorithm):
    x = gradient_like(comm.rank, 1000, dtype)
    if comm.rank == 0:
        x[3] = np.nan
        x[7] = np.inf
    if comm.rank == comm.size - 1:
        x[11] = -np.inf
    eb = ccoll.REL(1e-3)
    y = ccoll.allreduce(x, eb=eb, comm=comm, algorithm=algorithm, policy="compress")
    assert np.isnan(y[3])
    if comm.size > 1:
        assert y[7] == np.inf and y[11] == -np.inf
    else:
        assert np.isnan(y[7]) or y[7] == np.inf  # one rank: +inf at 7, -inf at 11
    fin = np.ones(x.size, dtype=bool)
    fin[[3, 7, 11]] = False
    ex = exact_sum(comm, x)
    assert_within(y[fin], ex[fin], global_eb(comm, x, eb), roundings=1)
    assert_same_on_every_rank(comm, y)


# -- agreement: invalid and disagreeing calls fail on every rank -------------------------


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("element count", {"n": 101}),
        ("dtype", {"dtype": np.float64}),
        ("error-bound value", {"eb": ccoll.REL(2e-3)}),
        ("error-bound kind", {"eb": ccoll.ABS(1e-3)}),
        ("op", {"op": "avg"}),
        ("algorithm", {"algorithm": "dar"}),
    ],
)
def test_mismatch_raises_same_error_everywhere(comm, field, kwargs):
    n, dtype, eb, op, algo = 100, np.float32, ccoll.REL(1e-3), "sum", "homomorphic"
    if comm.rank == 1:
        n = kwargs.get("n", n)
        dtype = kwargs.get("dtype", dtype)
        eb = kwargs.get("eb", eb)
        op = kwargs.get("op", op)
        algo = kwargs.get("algorithm", algo)
    x = gradient_like(comm.rank, n, dtype)
    with pytest.raises(MismatchError) as info:
        ccoll.allreduce(x, eb=eb, op=op, comm=comm, algorithm=algo)
    same_error_everywhere(comm, info, MismatchError, field)
    # The communicator is still usable afterwards: nothing was left in flight.
    y = ccoll.allreduce(gradient_like(comm.rank, 10, np.float32), eb=None, comm=comm)
    assert y.shape == (10,)


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
def test_different_collectives_detected(comm):
    x = gradient_like(comm.rank, 10, np.float32)
    with pytest.raises(MismatchError) as info:
        if comm.rank == 0:
            ccoll.bcast(x, comm=comm)
        else:
            ccoll.allreduce(x, comm=comm)
    same_error_everywhere(comm, info, MismatchError, "different collectives")
    assert "bcast on rank 0" in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "what, kwargs, exc, match",
    [
        ("op", {"op": "max"}, InputError, "op 'max' is not supported"),
        ("dtype", {"x": np.arange(10, dtype=np.int32)}, DTypeError, "dtype int32"),
        ("bound", {"eb": -1.0}, ErrorBoundError, "must be finite and > 0"),
        # float() of it raised OverflowError on this rank alone, before the agreement: the
        # other ranks' call then met this rank's next one.
        ("huge bound", {"eb": 10**400}, ErrorBoundError, "beyond float64's range"),
        ("out", {"out": np.empty(3, np.float32)}, InputError, "out has shape"),
        ("algorithm", {"algorithm": "tree"}, InputError, "algorithm 'tree'"),
    ],
)
def test_invalid_argument_on_one_rank_fails_everywhere(comm, what, kwargs, exc, match):
    args = {"x": gradient_like(comm.rank, 10, np.float32), "eb": ccoll.REL(1e-3), "op": "sum"}
    if comm.rank == comm.size - 1:
        args.update(kwargs)
    with pytest.raises(exc) as info:
        ccoll.allreduce(comm=comm, **args)
    same_error_everywhere(comm, info, exc, match)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_raw_plan_holds_a_bound_that_covers_the_sums_roundings(comm, dtype):
    # docs/error-bound.md, "A bound with a raw plan": MPI's N - 1 roundings stay within eb
    # wherever eb >= (N - 1) N M u; a call too small to gain is sent raw by "auto".
    from collkit import allowance

    n = comm.size
    x = np.random.default_rng(comm.rank + 17).standard_normal(4099).astype(dtype)
    m = comm.allreduce(float(np.abs(x).max()), op=MPI.MAX)
    u = 2.0**-24 if dtype == np.float32 else 2.0**-53
    eb = max((n - 1) * n * m * u, 1e-300)
    ref = exact_sum(comm, x)
    with ccoll.Communicator(comm) as cc:
        y = cc.allreduce(x, eb=ccoll.ABS(eb))
        rep = cc.last_call
        assert n == 1 or not rep.compressed, str(rep)  # the raw plan is the one checked
        assert_within(y, ref, **allowance(eb, y, n, "sum"))
        assert_same_on_every_rank(comm, y)
        if dtype == np.float32:
            # Below that, "compress" holds a bound under float32's spacing (float64 sums;
            # float64's own raw lanes round as MPI does: "Lanes with a raw input").
            y = cc.allreduce(x, eb=ccoll.ABS(1e-7), policy="compress")
            assert_within(y, ref, **allowance(1e-7, y, n, "sum"))
            assert_same_on_every_rank(comm, y)


@pytest.mark.parametrize("where", ["every rank", "the root"])
@pytest.mark.parametrize("bad", ["size", None, 1.0])
def test_bcast_bad_root(comm, bad, where):
    root = comm.size if bad == "size" else bad
    if where == "the root" and comm.rank != 0:
        root = 0
    with pytest.raises(InputError) as info:
        ccoll.bcast(np.zeros(3, np.float32), root=root, comm=comm)
    same_error_everywhere(comm, info, InputError, "root")
    # Refused before any data moved: the next call works on every rank.
    y = ccoll.bcast(np.full(3, comm.rank, np.float32), root=0, comm=comm)
    assert np.array_equal(y, np.zeros(3, np.float32))


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
def test_allgather_shape_mismatch(comm):
    shape = (4, 5) if comm.rank == 0 else (5, 4)
    with pytest.raises(MismatchError) as info:
        ccoll.allgather(np.zeros(shape, np.float32), comm=comm)
    same_error_everywhere(comm, info, MismatchError, "shape")


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
def test_communicator_options_must_agree(comm):
    with pytest.raises(MismatchError) as info:
        ccoll.Communicator(comm, chunk_elems=1000 + (comm.rank == 1))
    same_error_everywhere(comm, info, MismatchError, "chunk size")


# -- nonblocking ---------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGOS)
def test_iallreduce_matches_allreduce(comm, algorithm):
    x = gradient_like(comm.rank, 30_000, np.float32)
    with ccoll.Communicator(comm, algorithm=algorithm, chunk_elems=4096,
                            policy="compress") as c:
        reqs = [c.iallreduce(x * (i + 1), eb=ccoll.REL(1e-3)) for i in range(3)]
        ys = [r.wait(timeout=60) for r in reqs]
        assert all(r.test() and r.done() for r in reqs)
        for i, y in enumerate(ys):
            assert np.array_equal(y, c.allreduce(x * (i + 1), eb=ccoll.REL(1e-3)))
            assert_same_on_every_rank(comm, y)


def test_iallreduce_error_at_wait(comm):
    req = ccoll.iallreduce(np.zeros(4, np.float32), op="max", comm=comm)
    with pytest.raises(InputError, match="op 'max'"):
        req.wait(timeout=60)


# -- demo and soak ---------------------------------------------------------------------------


def test_demo_runs(comm, capsys):
    # The ranks' part of `make demo` (ccoll/demo.py: run_ranks), on this job's ranks.
    from ccoll import demo

    args = demo.build_parser().parse_args(
        ["--rank", "--max-tensors", "4", "--repeat", "1", "--policy", "compress",
         "--bucket-mib", "1"])
    assert demo.run_ranks(args) == 0
    out = capsys.readouterr().out
    if comm.rank == 0:
        rows = [ln for ln in out.splitlines()
                if ln.startswith(("total of the 4 calls", "DDP bucket"))]
        assert len(rows) == 2, out
        for row in rows:
            cells = row.split()
            assert cells[-1] == "yes", row  # identical bytes on every rank
            assert float(cells[-2]) <= 1.0, row  # worst error over the bound
        assert "4/4 comp" in rows[0], rows[0]  # the demo compressed every tensor


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_soak_mixed_calls_do_not_grow_memory(comm):
    rng = np.random.default_rng(1234)  # same sequence of calls on every rank
    kinds = ["allreduce", "dar", "reduce_scatter", "allgather", "bcast", "exact", "iallreduce"]
    with ccoll.Communicator(comm, chunk_elems=8192, policy="compress") as c:
        rss = []
        for i in range(1000):
            kind = kinds[int(rng.integers(len(kinds)))]
            n = int(rng.integers(0, 50_000))
            dtype = np.float32 if rng.random() < 0.5 else np.float64
            x = gradient_like(comm.rank, n, dtype, seed=i)
            eb = ccoll.REL(1e-3)
            if kind == "allreduce":
                y = c.allreduce(x, eb=eb)
            elif kind == "dar":
                y = c.allreduce(x, eb=eb, algorithm="dar")
            elif kind == "reduce_scatter":
                y = c.reduce_scatter(x, eb=eb)
            elif kind == "allgather":
                y = c.allgather(x, eb=eb)
            elif kind == "bcast":
                y = c.bcast(x, eb=eb, root=i % comm.size)
            elif kind == "exact":
                y = c.allreduce(x, eb=None)
            else:
                y = c.iallreduce(x, eb=eb).wait(timeout=60)
            assert np.all(np.isfinite(y))
            if i in (199, 999):
                rss.append(_rss_bytes())
        growth = rss[1] - rss[0]
        assert growth < 32 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB"
