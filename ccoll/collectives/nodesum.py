"""The node sum of a two-level allreduce: one numba pass over the node's input slots.

Kept apart from :mod:`~ccoll.collectives.nodeshm` (which maps the slots and needs MPI) so
that ``python -m ccoll.warmup`` can compile it into numba's cache without starting MPI:
otherwise every rank of a node compiles it at its first hierarchical call, side by side.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["sum_slots"]


@njit(parallel=True, nogil=True, cache=True)
def _sum_share(own, slots, local, lo, out):  # type: ignore[no-untyped-def]
    ranks = slots.shape[0]
    for i in prange(out.size):
        j = lo + i
        acc = np.float64(own[j] if local == 0 else slots[0, j])
        for r in range(1, ranks):
            acc += np.float64(own[j] if r == local else slots[r, j])
        out[i] = acc


def sum_slots(own: np.ndarray, slots: np.ndarray, local: int, lo: int, out: np.ndarray) -> None:
    """``out = sum_r x_r[lo:lo + out.size]`` in float64, adding in local rank order.

    ``x_r`` is ``slots[r]``, except this rank's own input ``own`` for ``r == local`` (its
    slot holds only the other ranks' shares). One pass, and a fixed order: the sum is the
    same bytes whichever rank computes it, with however many threads.
    """
    if out.size:
        _sum_share(own, slots, int(local), int(lo), out)
