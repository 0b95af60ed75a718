"""Decompress-add-recompress (DAR) ring allreduce, the baseline that C-Coll uses.

Each ring step decompresses the received partial sum, adds this rank's data to it in the
data's own dtype, and compresses the result again with ``eb / (2N - 1)``. A chunk's value
passes through N compressions (N-1 in the reduce-scatter, one for the allgather, which
forwards the final streams unchanged); docs/error-bound.md gives the bound. ccoll keeps
this algorithm to measure what the homomorphic one saves: N-1 decompressions and
recompressions per block, and the error they add.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ccoll.collectives.codec import api
from ccoll.collectives.devices import DeviceLanes
from ccoll.collectives.layout import Layout

__all__ = ["DarOps", "dar_bound"]


def dar_bound(eb: float, n_ranks: int) -> float:
    """Bound of each compression in the DAR ring: ``eb / (2N - 1)``."""
    return eb / (2 * n_ranks - 1)


class DarOps:
    """Ring operations of the DAR algorithm on one rank's flattened input."""

    def __init__(
        self, flat: Any, layout: Layout, eb_step: float, add: Callable[[Any, Any], None],
        lanes: DeviceLanes | None = None, version: int = 1,
    ) -> None:
        self.flat = flat
        self.version = version  # stream format of every compression
        self.layout = layout
        self.eb_step = eb_step
        self._add = add  # in-place a += b in the dtype, on the host or the device
        self._api = api()
        # Device data: decode and add on the reduce lane's stream, compress on compress's.
        self._lanes = lanes if lanes is not None else DeviceLanes(None)

    def first(self, block: int, chunk: int) -> Any:
        """Compress this rank's part of the block it sends first."""
        lo, hi = self.layout.chunks(block)[chunk]
        return self._api.compress_abs(self.flat[lo:hi], self.eb_step, version=self.version,
                                      **self._lanes.compress_kw())

    def prepare(self, block: int, chunk: int) -> None:
        """Nothing to do ahead of time: DAR compresses only after adding."""

    def combine(self, block: int, chunk: int, received: Any) -> Any:
        """Decompress the partial sum, add this rank's data in its dtype, recompress."""
        lo, hi = self.layout.chunks(block)[chunk]
        lanes = self._lanes
        part = self._api.decompress(received, **lanes.kw("reduce"))
        self._add(part, self.flat[lo:hi])
        lanes.after("compress", "reduce")  # the compression reads the sum: an event, no wait
        out = self._api.compress_abs(part, self.eb_step, version=self.version,
                                     **lanes.compress_kw())
        lanes.finish("compress")  # the task (on reduce) waits for its own stream
        return out
