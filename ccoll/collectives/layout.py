"""How a flattened array is cut into ring blocks and pipeline chunks.

Ring blocks follow ``numpy.array_split(x.ravel(), size)``: the first ``n % size`` blocks hold
one element more than the others, so block ``r`` is exactly what ``reduce_scatter`` returns
on rank ``r``. Each block is cut into chunks of at most ``chunk_elems`` elements; one chunk is
one compressed stream and one message, the unit that pipelines.

A chunk's index is its MPI tag in the ring, and MPI guarantees only tags up to 32767
(``MPI_TAG_UB`` >= 32767): a block never has more than :data:`MAX_CHUNKS` chunks, the chunk
size grows instead (the same on every rank, and for every caller that builds the layout).
The lists are built once per layout and shared by every call that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["Layout", "block_bounds", "MAX_CHUNKS"]

# Chunks per block at most: chunk indices are MPI tags 0 .. MAX_CHUNKS - 1 <= 32767.
MAX_CHUNKS = 32768


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
    """Blocks of a flattened array of ``n`` elements over ``size`` ranks, cut into chunks.

    ``chunk_elems`` is raised where needed so that no block has more than
    :data:`MAX_CHUNKS` chunks (the chunk index is the ring's MPI tag), and cut to the
    largest block where it is larger (the same chunks; buffers sized from it stay small).
    """

    n: int
    size: int
    chunk_elems: int

    def __post_init__(self) -> None:
        if self.chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {self.chunk_elems}")
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        largest = -(-self.n // self.size)
        if self.chunk_elems > largest:  # no chunk outgrows its block (nor its buffers)
            object.__setattr__(self, "chunk_elems", max(1, largest))
        elif -(-largest // self.chunk_elems) > MAX_CHUNKS:
            object.__setattr__(self, "chunk_elems", -(-largest // MAX_CHUNKS))

    @cached_property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        """``[lo, hi)`` of every ring block (built once)."""
        return tuple(block_bounds(self.n, self.size))

    @cached_property
    def _chunks(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        c = self.chunk_elems
        return tuple(
            tuple((a, min(a + c, hi)) for a in range(lo, hi, c)) for lo, hi in self.blocks
        )

    def chunks(self, block: int) -> tuple[tuple[int, int], ...]:
        """``[lo, hi)`` (offsets into the flattened array) of the chunks of ``block``."""
        return self._chunks[block]

    @property
    def max_chunks(self) -> int:
        """Most chunks of any block (block 0 is the largest)."""
        lo, hi = self.blocks[0]
        return -(-(hi - lo) // self.chunk_elems)
