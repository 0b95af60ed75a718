"""Helpers of the collective tests: gradient-like inputs, exact references and exact bounds."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
from kit import ExactSum

import ccoll


def gradient_like(rank: int, n: int, dtype: type, seed: int = 0) -> np.ndarray:
    """Heavy-tailed values with exact zeros, different on every rank."""
    rng = np.random.default_rng([seed, rank, n])
    x = rng.standard_t(3, size=n) * 1e-2
    x[rng.random(n) < 0.2] = 0.0
    return x.astype(dtype)


def exact_sum(comm, x: np.ndarray) -> ExactSum:
    """The exact sum over ranks of every element (every rank's input gathered; kept as
    terms, so float64 inputs are summed without rounding: see kit.ExactSum)."""
    xs = comm.allgather(np.asarray(x, dtype=np.float64))
    return ExactSum(np.stack(xs))


def allreduce_reference(comm, x: np.ndarray, op: str):
    """The exact result of ``allreduce(x, op=op)``: the exact sum, over N for ``"avg"``."""
    ref = exact_sum(comm, x)
    return ref / comm.size if op == "avg" else ref


def allowance(eb: object, y: np.ndarray, size: int, op: str) -> dict[str, Any]:
    """``assert_within``'s allowance for ``y``, an allreduce or reduce_scatter result.

    The documented contract only (docs/error-bound.md, "Collectives"), from the bound
    ``eb``, ``y``'s dtype and the rank count, whatever path the call took: ``eb`` plus, for
    a sum, one rounding to the dtype; for an average three half spacings (device data: the
    sum's rounding over N, and the quotient's). Host data's compressed average rounds once
    ("avg"), as do a split bound ("Split bound") and two levels ("Hierarchical
    allreduce"), and one rank divides by 1 exactly: a test that knows its call took such a
    path may ask for ``roundings=1`` itself. float16 results hold the bound itself
    ("float16 and bfloat16": the float32 stage gets what the final rounding leaves of it).
    """
    k = 1 if op == "sum" or size == 1 else 3
    dt = np.asarray(y).dtype
    if dt == np.float16:
        return {"eb": eb}
    assert dt in (np.float32, np.float64), f"no documented allowance for {dt}"
    return {"eb": eb, "roundings": k}


def f32_rounding(y16: np.ndarray, k: int = 1) -> np.ndarray:
    """``k`` float32 half spacings at the float32 value that rounded to ``y16`` (upper bound).

    A float16 result is a float32 result rounded once more (docs/error-bound.md, "float16
    and bfloat16"); float32 has 13 more significand bits, so its half spacing is at most
    ``2^-14`` of float16's spacing.
    """
    with np.errstate(invalid="ignore", over="ignore"):  # ±Inf results: no allowance needed
        return k * np.spacing(np.abs(y16)).astype(np.float64) * 2.0**-14


def global_eb(comm, x: np.ndarray, eb) -> Fraction:
    """The absolute bound the collective must meet, exactly: ABS's value, or REL's value
    times the range of every rank's finite values (computed here, not by ccoll)."""
    if isinstance(eb, ccoll.ABS):
        return Fraction(eb.value)
    fin = np.asarray(x, dtype=np.float64)
    fin = fin[np.isfinite(fin)]
    lo = comm.allreduce(float(fin.min()) if fin.size else np.inf, op=min_op())
    hi = comm.allreduce(float(fin.max()) if fin.size else -np.inf, op=max_op())
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return Fraction(0)
    return Fraction(eb.value) * (Fraction(hi) - Fraction(lo))


def my_block(ref: ExactSum, comm) -> ExactSum:
    """This rank's part of the flattened reference, as numpy.array_split cuts it."""
    flat = ref.ravel()
    idx = np.array_split(np.arange(flat.shape[0]), comm.size)[comm.rank]
    return flat[idx]


def min_op():
    from mpi4py import MPI

    return MPI.MIN


def max_op():
    from mpi4py import MPI

    return MPI.MAX
