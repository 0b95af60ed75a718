"""Random calls at the edges: the bound on every element and identical results on every rank.

Each trial draws, from a seed that every rank shares, one collective (allreduce twice as
often as reduce_scatter, allgather and bcast), a Communicator (algorithm, schedule, node
grouping, split, chunk size; ``policy="compress"``), a dtype (float16, float32, float64),
a count (0 to 200,003, block edges included), a layout (contiguous, a strided view, 2-D),
an op and a bound (ABS scaled to the data, or REL), and data that rank draws itself from
one of the shapes that break codecs (``tests/kit.py:edge_data``): scales from ``1e-20``
to ``1e20`` (float64), mixed scales within one array, lone spikes among zeros, constants,
subnormals, values near the dtype's largest (clipped so that sums stay finite), NaN and
±Inf, signed zeros, integers. The checks are the contracts of docs/error-bound.md,
decided exactly (tests/kit.py): float16 results hold the bound itself, and a bound
float16 cannot hold on a sum or average is refused on every rank (checked against
float16's spacing there) and the call is made again with the bound the refusal names. The
first
10 trials run in ``make test`` (at 1-5 ranks: other draws at each rank count), the rest
are marked slow (``make test-slow`` runs them at 2 and 4 ranks); ``CCOLL_RANDOM_TRIALS``
sets the number of trials.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from collkit import allowance, global_eb, my_block
from kit import EDGE_SHAPES, ExactSum, assert_same_on_every_rank, assert_within, edge_data
from mpi4py import MPI

import ccoll

SIZE = MPI.COMM_WORLD.Get_size()
TRIALS = int(os.environ.get("CCOLL_RANDOM_TRIALS", "60"))
QUICK = 10  # the first trials run in `make test` too; the rest are marked slow
DTYPES = (np.float16, np.float32, np.float64)
COUNTS = (0, 1, 7, 31, 32, 33, 100, 1000, 4097, 70_001, 200_003)
COLLECTIVES = ("allreduce", "allreduce", "reduce_scatter", "allgather", "bcast")


@pytest.fixture(scope="module")
def communicators():
    world = MPI.COMM_WORLD.Dup()
    made: dict[tuple, ccoll.Communicator] = {}

    def get(alg, schedule, rpn, split, chunk):
        key = (alg, schedule, rpn, split, chunk)
        if key not in made:
            made[key] = ccoll.Communicator(world, policy="compress", algorithm=alg,
                                           schedule=schedule, ranks_per_node=rpn, split=split,
                                           chunk_elems=chunk)
        return made[key]

    yield world, get
    for c in made.values():
        c.close()
    world.Free()


@pytest.mark.parametrize("trial", [
    t if t < QUICK else pytest.param(t, marks=pytest.mark.slow) for t in range(TRIALS)])
@pytest.mark.many_ranks
def test_random_call_within_bound_and_identical(communicators, trial):
    world, get = communicators
    rank = world.rank
    rng = np.random.default_rng([SIZE, trial])  # the same draws on every rank
    dt = DTYPES[rng.integers(len(DTYPES))]
    n = int(rng.choice(COUNTS))
    shape = str(rng.choice(EDGE_SHAPES))
    rpns = [None, 1] + ([2] if SIZE % 2 == 0 and SIZE >= 4 else [])
    c = get(str(rng.choice(["homomorphic", "dar"])), str(rng.choice(["ring", "halving", "auto"])),
            rpns[rng.integers(len(rpns))], [None, 0.0, 0.25, 0.5][rng.integers(4)],
            [None, 64, 1000][rng.integers(3)])
    op = str(rng.choice(["sum", "avg"]))
    coll = str(rng.choice(COLLECTIVES))
    root = int(rng.integers(SIZE))
    rel = bool(rng.random() < 0.5)
    e = 10.0 ** rng.uniform(-7, -1)
    layout = int(rng.integers(3))
    own = np.random.default_rng([SIZE, trial] if shape == "const" else [SIZE, trial, rank])
    # Sums stay finite in the dtype: a result beyond its range is ±Inf by contract, which
    # the checks would have to allow everywhere instead.
    top = float(np.finfo(dt).max) / (4 * SIZE)
    x = edge_data(own, shape, 2 * n if layout == 1 else n, dt, top=top)
    if layout == 1:
        x = x[::2]  # a strided view
    elif layout == 2 and n and n % 7 == 0:
        x = x.reshape(7, -1)
    fin = np.abs(x[np.isfinite(x)].astype(np.float64))
    mag = world.allreduce(float(fin.max()) if fin.size else 0.0, op=MPI.MAX)
    eb = ccoll.REL(e) if rel else ccoll.ABS(max(e * (mag if mag > 0 else 1.0), 1e-300))

    xs = np.stack([np.asarray(v, np.float64) for v in world.allgather(x)])
    # bcast: the root's data only (global_eb's exchange gives every rank its range).
    bound = global_eb(world, x if coll != "bcast" or rank == root else np.zeros(0, dt), eb)
    f16 = dt == np.float16
    ref = ExactSum(xs.reshape((SIZE, *x.shape)))
    if coll in ("allreduce", "reduce_scatter"):
        if op == "avg":
            ref = ref / SIZE
        run = c.allreduce if coll == "allreduce" else c.reduce_scatter
        try:
            y = run(x, eb, op=op)
        except ccoll.ErrorBoundError as exc:
            # float16 cannot hold every bound on a sum or average (its values near the
            # largest possible result are farther apart): refused on every rank, and the
            # smallest bound the message names holds.
            eb, bound = _refused(world, exc, x, eb, mag, op, f16)
            y = run(x, eb, op=op)
        if coll == "reduce_scatter":
            ref = my_block(ref, world)
        assert y.dtype == x.dtype
        assert_within(y, ref, **allowance(bound, y, SIZE, op))
    elif coll == "allgather":
        y = c.allgather(x, eb)
        assert y.shape == (SIZE, *x.shape) and y.dtype == x.dtype
        for r in range(SIZE):
            assert_within(y[r], xs[r].astype(dt).reshape(x.shape), bound)
    else:
        y = c.bcast(x if rank == root else None, eb, root=root)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert_within(y, xs[root].astype(dt).reshape(x.shape), bound)
    if coll != "reduce_scatter":
        assert_same_on_every_rank(world, y)


def _refused(world, exc, x, eb, mag, op, f16):
    """Check a refusal of ``eb`` on float16 data; return the bound it names (and its value).

    Justified when float16's own rounding near the largest possible result (the inputs'
    largest magnitude for an average, ``SIZE`` times it for a sum, plus the bound) can move
    a value by more than the bound: half its spacing there, from numpy's float16.
    """
    msg = str(exc)
    assert f16 and SIZE > 1, msg
    assert len(set(world.allgather(msg))) == 1, "ranks differ in the message"
    value = float(global_eb(world, x, eb))
    a = (mag if op == "avg" else SIZE * mag) + value
    half = float(np.spacing(np.float16(min(a, 65504.0)))) / 2
    assert value < half * 1.01, (value, half, msg)
    named = msg.split("the smallest bound ccoll can hold there is ")[1].split(":")[0]
    new = eval(named, {"ABS": ccoll.ABS, "REL": ccoll.REL})
    assert type(new) is type(eb) and new.value > eb.value
    return new, global_eb(world, x, new)
