"""Tensors in, tensors out for the four collectives (run at 1..5 ranks).

For each input kind (numpy float32, CPU tensors of float32/float64/float16/bfloat16, a
non-contiguous tensor) every collective returns the input's kind, dtype and device, the
values within the bound of the exact float64 result (float16/bfloat16: plus one rounding
to the dtype and the float32 rounding before it, docs/error-bound.md), bitwise identical
on every rank; ``out=`` of the same kind is written and returned. A tensor that requires
grad is refused on every rank with the fix. CuPy: a visible skip where it is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
from collkit import exact_sum, gradient_like, my_block
from kit import assert_clear_error, assert_same_on_every_rank, assert_within

import ccoll
from ccoll.errors import InputError

torch = pytest.importorskip("torch")

EB = 1e-3
LOW = {"float16": 2.0**-14, "bfloat16": 2.0**-17}  # float32 rounding, in spacings of y


def _tensor(rank, dtype, noncontig=False):
    x = gradient_like(rank, 1200, np.float64).reshape(30, 40)
    t = torch.from_numpy(x).to(getattr(torch, dtype))
    return t.T if noncontig else t  # .T: a (40, 30) view with strides (1, 40)


KINDS = {
    "numpy-float32": lambda r: gradient_like(r, 1200, np.float32).reshape(30, 40),
    "torch-float32": lambda r: _tensor(r, "float32"),
    "torch-float64": lambda r: _tensor(r, "float64"),
    "torch-float16": lambda r: _tensor(r, "float16"),
    "torch-bfloat16": lambda r: _tensor(r, "bfloat16"),
    "torch-noncontiguous": lambda r: _tensor(r, "float32", noncontig=True),
}


def _np(a):
    """Values as float64 numpy (exact for every float dtype)."""
    if isinstance(a, torch.Tensor):
        return a.to(torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


def _name(a):
    return str(a.dtype).removeprefix("torch.")


def _allowance(y):
    """(spacing, extra) of the last rounding of ``y`` to its dtype, for assert_within.

    ``None, 0`` for float32/float64 (numpy's spacing of y's dtype applies); for float16 and
    bfloat16 the dtype's spacing at ``|y|`` and the float32 rounding before it.
    """
    name = _name(y)
    if name not in LOW:
        return None, 0.0
    mag = np.abs(_np(y))
    if name == "float16":
        sp = np.spacing(mag.astype(np.float16)).astype(np.float64)
    else:  # bfloat16 keeps 16 fewer significand bits than float32 (numpy has no bfloat16)
        sp = np.spacing(mag.astype(np.float32)).astype(np.float64) * 2.0**16
    return sp, sp * LOW[name]


def _check_kind(y, x, shape):
    assert type(y) is type(x)
    assert _name(y) == _name(x) and tuple(y.shape) == shape
    if isinstance(x, torch.Tensor):
        assert y.device == x.device and not y.requires_grad


@pytest.fixture
def compressing(comm):
    with ccoll.Communicator(comm, policy="compress") as c:
        yield c


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_allreduce(comm, compressing, kind):
    x = KINDS[kind](comm.rank)
    ref = exact_sum(comm, _np(x))
    # bfloat16 sums of up to 5 ranks' values (|x| < 0.22) are 0.0078 apart near 1: ABS(1e-3)
    # is refused there (test_narrow_bound.py); 1e-2 it can hold.
    eb = 1e-2 if kind == "torch-bfloat16" else EB
    y = compressing.allreduce(x, ccoll.ABS(eb))
    _check_kind(y, x, tuple(x.shape))
    assert compressing.last_call.compressed
    if _name(y) in LOW:  # the bound holds on the result in its own dtype
        assert_within(_np(y), ref, eb)
    else:
        sp, extra = _allowance(y)
        assert_within(_np(y), ref, eb, roundings=1, spacing=sp, extra=extra)
    assert_same_on_every_rank(comm, _np(y))
    # iallreduce: the same kind, and the blocking call's result bit for bit.
    a = compressing.iallreduce(x, ccoll.ABS(eb)).wait()
    _check_kind(a, x, tuple(x.shape))
    assert np.array_equal(_np(a), _np(y))
    # out= of the caller's kind is written and returned (contiguous, like x).
    out = torch.empty(tuple(x.shape), dtype=x.dtype) if isinstance(x, torch.Tensor) else (
        np.empty_like(x))
    z = compressing.allreduce(x, ccoll.ABS(eb), out=out)
    assert z is out
    assert np.array_equal(_np(out), _np(y))
    # Exact (eb=None) path: still the caller's kind.
    e = compressing.allreduce(x, None)
    _check_kind(e, x, tuple(x.shape))
    assert_same_on_every_rank(comm, _np(e))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_reduce_scatter(comm, compressing, kind):
    x = KINDS[kind](comm.rank)
    ref = my_block(exact_sum(comm, _np(x)), comm)
    eb = 1e-2 if kind == "torch-bfloat16" else EB  # as in test_allreduce
    y = compressing.reduce_scatter(x, ccoll.ABS(eb))
    _check_kind(y, x, ref.shape)
    if _name(y) in LOW:  # the bound holds on the result in its own dtype
        assert_within(_np(y), ref, eb)
    else:
        sp, extra = _allowance(y)
        assert_within(_np(y), ref, eb, roundings=1, spacing=sp, extra=extra)
    # Every rank's block is identical to what the other ranks computed for it: gather
    # and compare against the allreduce of the same data (without the split bound, which
    # requantizes the allreduce's blocks; reduce_scatter keeps the whole bound).
    with ccoll.Communicator(comm, policy="compress", split=0) as whole:
        full = whole.allreduce(x, ccoll.ABS(eb))
    blocks = comm.allgather(_np(y))
    assert np.array_equal(np.concatenate(blocks), _np(full).ravel())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_allgather(comm, compressing, kind):
    x = KINDS[kind](comm.rank)
    y = compressing.allgather(x, ccoll.ABS(EB))
    _check_kind(y, x, (comm.size, *x.shape))
    every = np.stack(comm.allgather(_np(x)))
    sp, _ = _allowance(y)
    # The decoded float32 is within eb of a value of the dtype; rounding adds at most s/2.
    assert_within(_np(y), every, EB, roundings=1 if sp is not None else 0, spacing=sp)
    assert_same_on_every_rank(comm, _np(y))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_bcast(comm, compressing, kind):
    x = KINDS[kind](0)
    y = compressing.bcast(x if comm.rank == 0 else None, ccoll.ABS(EB))
    _check_kind(y, x, tuple(x.shape))
    sp, _ = _allowance(y)
    assert_within(_np(y), _np(x), EB, roundings=1 if sp is not None else 0, spacing=sp)
    assert_same_on_every_rank(comm, _np(y))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_zero_dimensional_tensor(comm, compressing, dtype):
    x = torch.tensor(0.5 + comm.rank, dtype=getattr(torch, dtype))
    total = sum(0.5 + r for r in range(comm.size))  # exact in every dtype here
    # A bound each dtype can hold on sums up to 12.5 (5 ranks): half its gap there is
    # 0.004 (float16) and 0.03 (bfloat16); a smaller one is refused (test_narrow_bound.py).
    eb = {"float32": EB, "float16": 0.01, "bfloat16": 0.1}[dtype]
    for y in (compressing.allreduce(x, ccoll.ABS(eb)), compressing.allreduce(x, None)):
        _check_kind(y, x, ())
        assert abs(float(y) - total) <= eb
    y = compressing.bcast(x, ccoll.ABS(eb))
    _check_kind(y, x, ())
    assert abs(float(y) - 0.5) <= eb
    y = compressing.allgather(x, ccoll.ABS(eb))
    _check_kind(y, x, (comm.size,))
    _check_kind(compressing.reduce_scatter(x, ccoll.ABS(eb)), x,
                (1 if comm.rank == 0 else 0,))


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "bcast"])
def test_requires_grad_refused_everywhere(comm, collective):
    x = torch.ones(64)
    if comm.rank == comm.size - 1:
        x.requires_grad_(True)  # one rank is enough: every rank raises
    assert_clear_error(InputError, r"requires grad.*x\.detach\(\)",
                       getattr(ccoll, collective), x, ccoll.ABS(EB), comm=comm)


def test_cupy_in_cupy_out(comm):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed here")
    x = cupy.asarray(gradient_like(comm.rank, 1200, np.float32))
    y = ccoll.allreduce(x, ccoll.ABS(EB), comm=comm, policy="compress")
    assert isinstance(y, cupy.ndarray) and y.dtype == x.dtype and y.device == x.device
    assert_within(cupy.asnumpy(y), exact_sum(comm, cupy.asnumpy(x)), EB, roundings=1)
