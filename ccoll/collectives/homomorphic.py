"""Homomorphic ring allreduce: compress once, add in the integer domain, decode at the end.

Every rank compresses each chunk of each block once, on the grid of the per-rank bound
``eb_r`` (:func:`rank_bound`), which every rank computes from the same agreed numbers, so
all streams of one chunk share one grid and add exactly (docs/format.md, "Homomorphic
add"). Nothing is decompressed until the reduced blocks have been gathered. Both stream formats
add homomorphically (version 2 on its own codes, docs/format.md); one call's streams all
have the version of its plan.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from ccoll.collectives.codec import api
from ccoll.collectives.devices import DeviceLanes
from ccoll.collectives.layout import Layout

__all__ = ["HomomorphicOps", "rank_bound", "sum_bound"]


def sum_bound(eb: float, n_ranks: int, avg: bool) -> float:
    """Bound of the ranks' sum that keeps the result within ``eb``.

    ``eb`` itself for ``op="sum"``; ``N * eb`` for ``op="avg"``, whose result is the sum
    divided by ``N``: the caller's bound is on the average, so no rank quantizes on a grid
    ``N`` times finer than asked (docs/error-bound.md, "avg"). The float64 product may lie
    an ulp above ``N * eb``; :func:`rank_bound`'s margin absorbs it.
    """
    if not avg:
        return eb
    # Beyond float64's range N * eb is no bound at all: the largest float64 is a tighter
    # one, so the average stays within eb (an infinite bound would fail in the ring, on
    # the ranks that own a block).
    return min(eb * n_ranks, sys.float_info.max)


def rank_bound(eb: float, n_ranks: int) -> float:
    """Grid bound of each rank's streams so that the sum of ``n_ranks`` is within ``eb``.

    ``eb / N * (1 - (N + 8) * 2**-22)``: the margin absorbs the float64 roundings of the
    decoder and of raw-block sums (docs/error-bound.md, "Collectives", gives the argument).
    Among float64's subnormals the margin's product rounds back to ``eb / N``, which itself
    may have rounded up, so that ``N`` such bounds, added exactly there, exceeded ``eb``
    and the ring's check of a received stream's bound failed on some ranks: the result is
    stepped down until ``N`` times it is at most ``eb``.
    """
    if eb == 0.0:
        return 0.0
    share = eb / n_ranks * (1.0 - (n_ranks + 8) * 2.0**-22)
    while share > 0.0 and share * n_ranks > eb:
        share = math.nextafter(share, 0.0)
    return share


class HomomorphicOps:
    """Ring operations of the homomorphic algorithm on one rank's flattened input."""

    def __init__(self, flat: Any, layout: Layout, eb_rank: float,
                 lanes: DeviceLanes | None = None, version: int = 1) -> None:
        self.flat = flat
        self.layout = layout
        self.eb_rank = eb_rank
        self.version = version  # stream format; add_data keeps the received stream's
        self._api = api()
        # Device data: compress on the compress lane's stream (grid capped), adds on reduce's.
        self._lanes = lanes if lanes is not None else DeviceLanes(None)

    def _compress(self, block: int, chunk: int) -> Any:
        lo, hi = self.layout.chunks(block)[chunk]
        return self._api.compress_abs(self.flat[lo:hi], self.eb_rank, version=self.version,
                                      **self._lanes.compress_kw())

    def first(self, block: int, chunk: int) -> Any:
        """Compress this rank's part of the block it sends first."""
        return self._compress(block, chunk)

    def prepare(self, block: int, chunk: int) -> None:
        """Nothing ahead of time: :meth:`combine` quantizes this rank's part as it adds it."""

    def combine(self, block: int, chunk: int, received: Any) -> Any:
        """Add this rank's part to the received partial sum (no decompression).

        ``add_data`` gives the bytes of ``add(received, compress_abs(part))`` in one pass,
        without encoding this rank's part to bit-planes and decoding it again.
        """
        lo, hi = self.layout.chunks(block)[chunk]
        return self._api.add_data(received, self.flat[lo:hi], self.eb_rank,
                                  **self._lanes.kw("reduce"))
