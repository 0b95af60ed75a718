"""How a flattened array is cut into ring blocks and pipeline chunks.

Ring blocks follow ``numpy.array_split(x.ravel(), size)``: the first ``n % size`` blocks hold
one element more than the others, so block ``r`` is exactly what ``reduce_scatter`` returns
on rank ``r``. Each block is cut into chunks of at most ``chunk_elems`` elements; one chunk is
one compressed stream and one message, the unit that pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "block_bounds"]


def block_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each of ``size`` blocks of ``n`` elements, as ``numpy.array_split``."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    base, extra = divmod(n, size)
    out = []
    lo = 0
    for b in range(size):
        hi = lo + base + (1 if b < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass(frozen=True)
class Layout:
    """Blocks of a flattened array of ``n`` elements over ``size`` ranks, cut into chunks."""

    n: int
    size: int
    chunk_elems: int

    def __post_init__(self) -> None:
        if self.chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {self.chunk_elems}")

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """``[lo, hi)`` of every ring block."""
        return block_bounds(self.n, self.size)

    def chunks(self, block: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` (offsets into the flattened array) of the chunks of ``block``."""
        lo, hi = self.blocks[block]
        c = self.chunk_elems
        return [(a, min(a + c, hi)) for a in range(lo, hi, c)]

    @property
    def max_chunks(self) -> int:
        """Most chunks of any block (block 0 is the largest)."""
        lo, hi = self.blocks[0]
        return -(-(hi - lo) // self.chunk_elems)
