"""float16 / bfloat16 host input to the collectives, and ``bcast(None)`` (run at 1..5 ranks).

float16 data is reduced in float32 and rounded once to float16 (docs/error-bound.md,
"float16 and bfloat16"); the bound holds on the float16 result itself (the float32 stage
gets what the rounding leaves of it), so the checks allow no rounding; everything is
decided exactly (tests/kit.py). tests/mpi/test_narrow_bound.py has the bounds float16 and
bfloat16 cannot hold.
"""

from __future__ import annotations

import numpy as np
import pytest
from collkit import exact_sum, global_eb, gradient_like, my_block
from kit import assert_same_on_every_rank, assert_within
from mpi4py import MPI

import ccoll
from ccoll.errors import DTypeError, ErrorBoundError, InputError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
BOUNDS = [ccoll.ABS(1e-3), ccoll.REL(1e-3)]


def _bid(b):
    return f"{type(b).__name__}{b.value:g}"


@pytest.fixture
def compressing(comm):
    with ccoll.Communicator(comm, policy="compress") as c:
        yield c


@pytest.mark.parametrize("eb", BOUNDS, ids=_bid)
@pytest.mark.parametrize("n", [0, 1, 33, 10_001])
def test_allreduce_float16_within_bound(comm, compressing, n, eb):
    x = gradient_like(comm.rank, n, np.float16)
    try:
        y = compressing.allreduce(x, eb)
    except ErrorBoundError as exc:
        # From 4-5 ranks REL(1e-3) of these small ranges is less than float16 can hold at
        # the sum of the ranks' values: every rank refuses alike (test_narrow_bound.py has
        # the exact cases), and a bound it names the smallest of is then held.
        msgs = comm.allgather(str(exc))
        assert len(set(msgs)) == 1 and "smallest bound ccoll can hold" in msgs[0], msgs
        assert isinstance(eb, ccoll.REL) and SIZE >= 4, msgs[0]
        eb = ccoll.REL(2 * float(msgs[0].split("hold there is REL(")[1].split(")")[0]))
        y = compressing.allreduce(x, eb)
    assert y.dtype == np.float16 and y.shape == x.shape
    assert compressing.last_call.compressed
    assert_within(y, exact_sum(comm, x), global_eb(comm, x, eb))
    assert_same_on_every_rank(comm, y)


def test_allreduce_float16_avg_and_out(comm, compressing):
    x = gradient_like(comm.rank, 5000, np.float16).reshape(50, 100)
    out = np.empty_like(x)
    y = compressing.allreduce(x, ccoll.REL(1e-3), op="avg", out=out)
    assert y is out
    bound = global_eb(comm, x, ccoll.REL(1e-3))  # the bound is on the average
    assert_within(y, exact_sum(comm, x) / comm.size, bound)
    assert_same_on_every_rank(comm, y)


def test_allreduce_float16_in_place_and_exact(comm, compressing):
    x = gradient_like(comm.rank, 1000, np.float16)
    ref = exact_sum(comm, x)
    mag = np.sum(np.abs(np.stack(comm.allgather(x)).astype(np.float64)), axis=0)
    y = compressing.allreduce(x, None, out=x)  # exact: MPI's float32 sum, rounded once
    assert y is x
    # Recursive float32 summation of N terms: within (N - 1) 2^-24 sum|x| (plus O(2^-48)).
    assert_within(y, ref, 0.0, roundings=1, extra=SIZE * 2.0**-24 * mag)
    assert not compressing.last_call.compressed


@pytest.mark.parametrize("eb", BOUNDS, ids=_bid)
def test_reduce_scatter_float16(comm, compressing, eb):
    x = gradient_like(comm.rank, 10_001, np.float16)
    y = compressing.reduce_scatter(x, eb)
    assert y.dtype == np.float16
    assert_within(y, my_block(exact_sum(comm, x), comm), global_eb(comm, x, eb))


@pytest.mark.parametrize("eb", BOUNDS, ids=_bid)
def test_allgather_float16(comm, compressing, eb):
    x = gradient_like(comm.rank, 999, np.float16).reshape(27, 37)
    y = compressing.allgather(x, eb)
    assert y.dtype == np.float16 and y.shape == (comm.size, 27, 37)
    every = np.stack(comm.allgather(x))
    assert_within(y, every, global_eb(comm, x, eb))
    assert_same_on_every_rank(comm, y)


def test_iallreduce_float16(comm, compressing):
    x = gradient_like(comm.rank, 3000, np.float16)
    y = compressing.iallreduce(x, ccoll.ABS(1e-3)).wait()
    assert y.dtype == np.float16
    assert_within(y, exact_sum(comm, x), 1e-3)
    assert compressing.last_async_call.compressed


def test_bfloat16_tensor_allreduce(comm, compressing):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(gradient_like(comm.rank, 2000, np.float32)).to(torch.bfloat16)
    x32 = x.float().numpy()
    # bfloat16's gaps are 2^-7 of a value: ABS(1e-2) holds on sums up to 2.5.
    y = compressing.allreduce(x, ccoll.ABS(1e-2))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    y32 = y.float().numpy()
    assert_within(y32, exact_sum(comm, x32), 1e-2)
    assert_same_on_every_rank(comm, y32)


@pytest.mark.parametrize("policy", ["compress", "raw"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("root", sorted({0, SIZE - 1}))
def test_bcast_none_on_non_root_ranks(comm, policy, dtype, root):
    src = gradient_like(root, 600, dtype).reshape(20, 30)
    x = src if comm.rank == root else None
    eb = ccoll.ABS(1e-3)
    with ccoll.Communicator(comm, policy=policy) as cc:
        y = cc.bcast(x, eb, root=root)
        assert y.dtype == np.dtype(dtype) and y.shape == (20, 30)
        assert_within(y, src, 1e-3 if policy == "compress" else 0.0)
        assert_same_on_every_rank(comm, y)
        assert cc.last_call.compressed == (policy == "compress")


def test_bcast_none_bfloat16_tensor(comm):
    torch = pytest.importorskip("torch")
    src = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    y = ccoll.bcast(src if comm.rank == 0 else None, None, comm=comm)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert torch.equal(y, src)


@pytest.mark.skipif(SIZE < 2, reason="needs a non-root rank")
def test_bcast_none_still_detects_a_wrong_shape(comm):
    x = np.zeros(6, np.float32) if comm.rank in (0, 1) else None
    if comm.rank == 1:
        x = np.zeros(5, np.float32)
    with pytest.raises(MismatchError) as info:
        ccoll.bcast(x, comm=comm)
    msgs = comm.allgather(str(info.value))
    assert len(set(msgs)) == 1 and "shape" in msgs[0], msgs


def test_bcast_none_on_the_root_names_the_fix(comm):
    with pytest.raises(InputError) as info:
        ccoll.bcast(None, comm=comm)
    assert "x is None; pass a numpy array" in str(info.value)
    assert "non-root ranks of bcast only" in str(info.value)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: np.arange(10, dtype=np.int32), DTypeError,
         "x has dtype int32; ccoll reduces float16, bfloat16, float32 or float64 arrays: pass "
         "x.astype(np.float32)"),
        (lambda: np.zeros(10, ">f4"), DTypeError, "pass x.astype(np.float32)"),
        (lambda: None, InputError, "x is None; pass a numpy array or a torch tensor"),
        (lambda: [object()], InputError, "is not a numeric array; pass"),
    ],
)
def test_rejected_inputs_name_the_fix(comm, make, exc, match):
    with pytest.raises(exc) as info:
        ccoll.allreduce(make(), comm=comm)
    assert match in str(info.value), str(info.value)


def test_tensor_requiring_grad_names_detach(comm):
    torch = pytest.importorskip("torch")
    x = torch.zeros(4, requires_grad=True)
    with pytest.raises(InputError, match=r"requires grad.*pass x\.detach\(\)"):
        ccoll.allreduce(x, comm=comm)
