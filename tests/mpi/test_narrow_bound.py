"""float16 and bfloat16 collectives: the bound holds on the result in the caller's dtype.

The bound asked for holds on what the caller gets, after the final rounding to float16 or
bfloat16, with no allowance for that rounding (docs/error-bound.md, "float16 and
bfloat16"); where the dtype cannot hold the bound at the result's magnitude, every rank
gets the same :class:`ccoll.ErrorBoundError`, whatever the plan, and the smallest bound it
names then holds. Every element is checked exactly (tests/kit.py) against the exact result
computed here from every rank's input. Run at 1 to 3 ranks.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from collkit import exact_sum, global_eb, my_block
from kit import assert_same_on_every_rank, assert_within
from mpi4py import MPI

import ccoll
from ccoll.errors import ErrorBoundError

torch = pytest.importorskip("torch")

SIZE = MPI.COMM_WORLD.Get_size()
DTYPES = ["float16", "bfloat16"]
# Bounds each dtype holds on the data below (bfloat16 has 8 significant bits to float16's 11:
# REL(1e-3) of a range is finer than its gaps at the range's ends).
BOUNDS = {"float16": {"abs": ccoll.ABS(1e-3), "rel": ccoll.REL(1e-3)},
          "bfloat16": {"abs": ccoll.ABS(1e-3), "rel": ccoll.REL(1e-2)}}


def _bid(b):
    return f"{type(b).__name__}{b.value:g}"


def _data(rank, n, scale, dtype, seed=0):
    """Heavy-tailed values with exact zeros, different on every rank; a torch tensor for
    bfloat16 (numpy has none), a numpy array for float16."""
    rng = np.random.default_rng([seed, rank, n])
    x = rng.standard_t(3, size=n) * scale
    x[rng.random(n) < 0.2] = 0.0
    if dtype == "float16":
        return x.astype(np.float16)
    return torch.from_numpy(x).to(torch.bfloat16)


def _f64(y):
    return y.double().numpy() if isinstance(y, torch.Tensor) else np.asarray(y, np.float64)


def _check_kind(y, x, shape):
    assert type(y) is type(x) and y.dtype == x.dtype and tuple(y.shape) == shape


# Scales at which both dtypes hold the bounds above on sums of up to 3 ranks.
SCALE = {"float16": 1e-2, "bfloat16": 1e-3}


@pytest.fixture(params=["compress", "raw"])
def cc(request, comm):
    with ccoll.Communicator(comm, policy=request.param) as c:
        yield c


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("kind", ["abs", "rel"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(comm, cc, dtype, kind, op):
    eb = BOUNDS[dtype][kind]
    x = _data(comm.rank, 10_001, SCALE[dtype], dtype)
    x64 = _f64(x)
    y = cc.allreduce(x, eb, op=op)
    _check_kind(y, x, x64.shape)
    ref = exact_sum(comm, x64)
    assert_within(_f64(y), ref / SIZE if op == "avg" else ref, global_eb(comm, x64, eb))
    assert_same_on_every_rank(comm, _f64(y))
    assert cc.last_call.compressed == (cc.policy == "compress")
    if cc.last_call.compressed:  # the report's bound is the one the result holds
        want = global_eb(comm, x64, eb)
        assert Fraction(cc.last_call.eb_abs) <= want
        assert cc.last_call.eb_abs >= float(want) * (1 - 2.0**-50)


# Bounds a few of the dtype's gaps wide at magnitude 1: where the final rounding matters.
NEAR = {"float16": ccoll.ABS(2e-3), "bfloat16": ccoll.ABS(2e-2)}


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_near_the_gaps_of_the_dtype(comm, cc, dtype, op):
    rng = np.random.default_rng([7, comm.rank])
    v = rng.uniform(-1, 1, 20_000)
    x = v.astype(np.float16) if dtype == "float16" else \
        torch.from_numpy(v).to(torch.bfloat16)
    x64 = _f64(x)
    eb = NEAR[dtype]
    y = cc.allreduce(x, eb, op=op)
    ref = exact_sum(comm, x64)
    assert_within(_f64(y), ref / SIZE if op == "avg" else ref, eb.value)
    z = cc.reduce_scatter(x, eb, op=op)
    assert_within(_f64(z), my_block(ref / SIZE if op == "avg" else ref, comm), eb.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_out_and_iallreduce(comm, cc, dtype):
    x = _data(comm.rank, 3000, SCALE[dtype], dtype)
    x64 = _f64(x)
    ref = exact_sum(comm, x64)
    out = torch.empty_like(x) if isinstance(x, torch.Tensor) else np.empty_like(x)
    assert cc.allreduce(x, ccoll.ABS(1e-3), op="avg", out=out) is out
    assert_within(_f64(out), ref / SIZE, 1e-3)
    y = cc.iallreduce(x, ccoll.ABS(1e-3)).wait()
    assert_within(_f64(y), ref, 1e-3)


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("kind", ["abs", "rel"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter(comm, cc, dtype, kind, op):
    eb = BOUNDS[dtype][kind]
    x = _data(comm.rank, 10_001, SCALE[dtype], dtype)
    x64 = _f64(x)
    y = cc.reduce_scatter(x, eb, op=op)
    ref = my_block(exact_sum(comm, x64), comm)
    _check_kind(y, x, ref.shape)
    assert_within(_f64(y), ref / SIZE if op == "avg" else ref, global_eb(comm, x64, eb))


@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3), ccoll.ABS(40.0)], ids=_bid)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_and_bcast(comm, cc, dtype, eb):
    # Larger values than above: a gathered value is itself one of the dtype, so any bound
    # holds (the float32 stage gets at least half of it); 40 is far above float16's gaps.
    x = _data(comm.rank, 999, 3.0, dtype)
    x64 = _f64(x)
    every = np.stack(comm.allgather(x64))
    y = cc.allgather(x, eb)
    _check_kind(y, x, (SIZE, 999))
    assert_within(_f64(y), every, global_eb(comm, x64, eb))
    assert_same_on_every_rank(comm, _f64(y))
    root = SIZE - 1
    z = cc.bcast(x if comm.rank == root else None, eb, root=root)
    _check_kind(z, x, (999,))
    src = comm.bcast(x64 if comm.rank == root else None, root=root)
    assert_within(_f64(z), src, global_eb(comm, src, eb) if isinstance(eb, ccoll.REL)
                  else eb.value)
    if cc.policy == "compress" and SIZE > 1:
        assert cc.last_call.compressed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_a_bound_the_dtype_cannot_hold_is_refused_on_every_rank(comm, cc, dtype, op):
    # Values up to about 8: float16's gaps there are 2^-7, bfloat16's 2^-4, both far above
    # ABS(1e-3); even the exact result rounded to the dtype can miss it.
    x = _data(comm.rank, 4000, 1.0, dtype)
    if comm.rank == 0:
        x[0] = 8.0
    x64 = _f64(x)
    eb = ccoll.ABS(1e-3)
    if SIZE == 1:  # one rank: the result is the input itself, which holds any bound
        assert_within(_f64(cc.allreduce(x, eb, op=op)), x64, 1e-3)
        return
    with pytest.raises(ErrorBoundError) as info:
        cc.allreduce(x, eb, op=op)
    msg = str(info.value)
    assert len(set(comm.allgather(msg))) == 1, "ranks differ in the message"
    assert f"ABS(0.001) asks for less than {dtype} can hold" in msg, msg
    smallest = msg.split("the smallest bound ccoll can hold there is ")[1].split(":")[0]
    # The communicator is still usable, and the bound it names holds.
    bound = eval(smallest, {"ABS": ccoll.ABS, "REL": ccoll.REL})
    assert bound.value > 1e-3
    y = cc.allreduce(x, bound, op=op)
    ref = exact_sum(comm, x64)
    assert_within(_f64(y), ref / SIZE if op == "avg" else ref, bound.value)
    with pytest.raises(ErrorBoundError):  # and so does reduce_scatter
        cc.reduce_scatter(x, eb, op=op)
    # REL names a REL bound.
    with pytest.raises(ErrorBoundError, match=r"the smallest bound ccoll can hold there is "
                       r"REL\("):
        cc.allreduce(x, ccoll.REL(1e-5), op=op)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_calls_keep_the_dtype_and_say_float32_moves(comm, cc, dtype):
    # eb=None: MPI's float32 sum of the exact float32 copies, rounded once to the dtype.
    x = _data(comm.rank, 1000, 1.0, dtype)
    y = cc.allreduce(x, None)
    x32 = [np.asarray(_f64(v), np.float32) for v in comm.allgather(x)]
    _check_kind(y, x, (1000,))
    rep = cc.last_call
    assert not rep.compressed and rep.bytes_input == 4000
    assert f"{dtype}[1000] raw" in str(rep) and "moved as float32" in str(rep), str(rep)
    if SIZE <= 2:  # one float32 addition at most: MPI's result is the float32 sum, exactly
        s = x32[0] if SIZE == 1 else x32[0] + x32[1]
        want = torch.from_numpy(s).to(torch.bfloat16).double().numpy() \
            if dtype == "bfloat16" else s.astype(np.float16).astype(np.float64)
        assert np.array_equal(_f64(y), want)
