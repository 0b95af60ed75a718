"""The error bound of each phase of a compressed allreduce, from the plan's split.

A plan (:mod:`ccoll.collectives.policy.plan`) says what share of the bound the allgather
phase gets; :func:`phase_bounds` turns it into the reduce-scatter's bound and the
requantization of the reduced blocks, the same numbers on every rank (docs/error-bound.md,
"Split bound").
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ccoll.collectives import ratios
from ccoll.collectives.homomorphic import rank_bound, sum_bound

__all__ = ["Bounds", "phase_bounds"]


class Bounds(NamedTuple):
    """The bound of each phase of a compressed allreduce (docs/error-bound.md)."""

    ring: float  # bound of the reduce-scatter's sum (of the sum, also for an average)
    requant: Any  # ccoll.collectives.requant.Requant, or None (no split)


def phase_bounds(eb_abs: float, n_ranks: int, avg: bool, share: float,
                 ring_ranks: int | None = None) -> Bounds:
    """Split the bound ``eb_abs`` of the result between the phases of an allreduce.

    With a split share ``f``, ``e2 = fl(f eb)`` and ``e1 = fl(eb - e2)``: the sum is bounded
    by ``e1`` (``N e1`` for an average) and each reduced block is requantized within ``e2``.
    Where ``f`` makes the allgather's grid an odd multiple ``k`` of the reduced sum's
    (:func:`ratios.split_multiple`), ``e1 = fl(eb f K / k)``, the grid is ``k`` times the
    sum's and the requantization may move a value by ``fl(eb - e1)`` at most, which the owner
    checks. Without a split the sum is bounded by ``eb`` (``N eb``) and nothing is
    requantized. ``ring_ranks``: the ranks of the ring when it is not all ``n_ranks`` (the
    inter-node ring of a two-level call); ``N`` stays the number the average divides by.
    """
    from ccoll.collectives.requant import Requant

    streams = n_ranks if ring_ranks is None else ring_ranks
    if share <= 0.0 or eb_abs == 0.0 or streams < 2:
        return Bounds(sum_bound(eb_abs, n_ranks, avg), None)
    divide = n_ranks if avg else 1
    k = ratios.split_multiple(streams, share)
    if k:  # the allgather's grid is k times the reduced sum's
        e1 = eb_abs * ratios.split_reduce_share(streams, share)
        accept = eb_abs - e1
        ring_eb = sum_bound(e1, n_ranks, avg)
        e2 = k * rank_bound(ring_eb, streams) / divide
        if 0.0 < accept < e2 and 0.0 < e1 < eb_abs:
            return Bounds(ring_eb, Requant(e2, divide, accept, share))
    e2 = eb_abs * share
    e1 = eb_abs - e2
    return Bounds(sum_bound(e1, n_ranks, avg), Requant(e2, divide, None, share))
