"""The DDP hook's float16/bfloat16 buckets: the bound holds on the gradient in its own dtype.

The rule of the collectives (docs/error-bound.md, "float16 and bfloat16"): every element of
the averaged gradient, in the bucket's dtype, is within the bound of the exact average of
every rank's gradient, with no rounding allowance, or every rank refuses the bound with
:class:`ccoll.ErrorBoundError` (reaching ``backward()`` as a RuntimeError that names it).

Run: mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_narrow_hook.py
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kit import ExactSum, assert_same_on_every_rank, assert_within  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torchkit import Net, process_group  # noqa: E402, F401

import ccoll  # noqa: E402
import ccoll.torch as ct  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Significand bits of each dtype (the leading one included), to compute its gaps here.
BITS = {"float16": 11, "bfloat16": 8}


def gap(dtype: str, a: float) -> float:
    """The gap between neighbouring normal values of ``dtype`` in the binade of ``a``."""
    return 2.0 ** (math.frexp(a)[1] - BITS[dtype])


def _setup(comm, dtype: str):
    """(model, input, exact average per parameter, largest |input|, value range of inputs).

    Inputs: every rank's gradient; the average is no larger than the largest of them.
    """
    dt = DTYPES[dtype]
    torch.manual_seed(0)
    model = Net().to(dt)
    g = torch.Generator().manual_seed(1000 * MPI.COMM_WORLD.Get_rank())
    x = (4 * torch.randn(32, 64, generator=g)).to(dt)
    model.zero_grad()
    model(x).square().mean().backward()
    mine = [p.grad.double().numpy().copy() for p in model.parameters()]
    every = comm.allgather(mine)
    exact = [ExactSum([r[i] for r in every]) / comm.size for i in range(len(mine))]
    flat = np.concatenate([a.ravel() for r in every for a in r])
    top = float(np.abs(flat).max())
    return model, x, exact, top, (float(flat.min()), float(flat.max()))


def _bound(kind: str, dtype: str, top: float, lo: float, hi: float) -> ccoll.ErrorBound:
    """A bound the dtype can hold at the average's largest possible magnitude, barely.

    0.6 of the dtype's gap at the largest input (1.2 where adding it crosses a binade):
    half a gap goes to the final rounding, the float32 stage gets the rest. A float32 stage
    given the whole bound misses it by up to half a gap after that rounding.
    """
    e = 0.6 * gap(dtype, top)
    if math.frexp(top + e)[1] != math.frexp(top)[1]:
        e = 1.2 * gap(dtype, top)
    if kind == "abs":
        return ccoll.ABS(e)
    return ccoll.REL(float(f"{e / (hi - lo):.3g}") * 1.01)


def _resolved(eb: ccoll.ErrorBound, lo: float, hi: float) -> Fraction:
    if isinstance(eb, ccoll.ABS):
        return Fraction(eb.value)
    return Fraction(eb.value) * (Fraction(hi) - Fraction(lo))


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("kind", ["abs", "rel"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_averaged_gradient_holds_the_bound_in_its_dtype(comm, state_factory, dtype, kind,
                                                            error_feedback) -> None:
    model, x, exact, top, (lo, hi) = _setup(comm, dtype)
    eb = _bound(kind, dtype, top, lo, hi)
    eb_abs = _resolved(eb, lo, hi)
    assert eb_abs < gap(dtype, top), "the test needs a bound below the dtype's gap"
    # Error feedback's first step: no residual yet, the bucket is the gradient itself.
    state = state_factory(eb=eb, start_iter=0, min_numel=0, error_feedback=error_feedback)
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    ddp.zero_grad()
    ddp(x).square().mean().backward()
    assert (state.compressed, state.exact) == (1, 0)
    for p, ref in zip(model.parameters(), exact, strict=True):
        assert p.grad.dtype == DTYPES[dtype]
        # No rounding allowance: the gradient in its own dtype holds the bound.
        assert_within(p.grad.double().numpy(), ref, eb_abs)
        assert_same_on_every_rank(comm, p.grad.double().numpy())


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_bound_the_dtype_cannot_hold_is_refused_on_every_rank(comm, state_factory, dtype,
                                                                error_feedback) -> None:
    if comm.Get_size() == 1:
        pytest.skip("one rank: the average is the gradient itself, which holds any bound")
    model, x, exact, top, _ = _setup(comm, dtype)
    eb = ccoll.ABS(0.05 * gap(dtype, top))  # a twentieth of the gap at the largest input
    state = state_factory(eb=eb, start_iter=0, min_numel=0, error_feedback=error_feedback)
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    ddp.zero_grad()
    with pytest.raises(RuntimeError, match="ErrorBoundError") as info:
        ddp(x).square().mean().backward()
    msg = str(info.value)
    assert f"asks for less than {dtype} can hold" in msg, msg
    assert "the smallest bound ccoll can hold there is ABS(" in msg, msg
    tail = msg[msg.index("ErrorBoundError"):].splitlines()[0]
    assert len(set(comm.allgather(tail))) == 1, "ranks differ in the refusal"
