"""Helpers of the collective tests: gradient-like inputs and exact float64 references."""

from __future__ import annotations

import numpy as np

import ccoll


def gradient_like(rank: int, n: int, dtype: type, seed: int = 0) -> np.ndarray:
    """Heavy-tailed values with exact zeros, different on every rank."""
    rng = np.random.default_rng([seed, rank, n])
    x = rng.standard_t(3, size=n) * 1e-2
    x[rng.random(n) < 0.2] = 0.0
    return x.astype(dtype)


def exact_sum(comm, x: np.ndarray) -> np.ndarray:
    """Sum over ranks in float64 (every rank's input gathered, then summed once)."""
    xs = comm.allgather(np.asarray(x, dtype=np.float64))
    return np.sum(np.stack(xs), axis=0) if xs else x.astype(np.float64)


def global_eb(comm, x: np.ndarray, eb) -> float:
    """The absolute bound the collective must meet: REL against every rank's finite range."""
    if isinstance(eb, ccoll.ABS):
        return eb.value
    fin = np.asarray(x, dtype=np.float64)
    fin = fin[np.isfinite(fin)]
    lo = comm.allreduce(float(fin.min()) if fin.size else np.inf, op=min_op())
    hi = comm.allreduce(float(fin.max()) if fin.size else -np.inf, op=max_op())
    return eb.resolve(lo, hi)


def min_op():
    from mpi4py import MPI

    return MPI.MIN


def max_op():
    from mpi4py import MPI

    return MPI.MAX
