"""The two-level allreduce: exact sums inside each node, the compressed ring between nodes.

:func:`own_residual` says, for whichever path a compressed allreduce took (the flat ring,
recursive halving, or these two levels), what the quantization dropped of this rank's own
data (error feedback's residual).

:class:`TwoLevel` holds what a hierarchical :class:`~ccoll.collectives.communicator.Communicator`
keeps for it: the node's channel and the inter-node channel (the ranks of one local rank
on every node), the node's shared memory (made at its first call) and the float64 buffers
of this rank's share (docs/collectives.md, "Hierarchical collectives").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ccoll.collectives import halving, ring
from ccoll.collectives import trace as _trace
from ccoll.collectives.channel import Channel
from ccoll.collectives.halving import halving_allreduce
from ccoll.collectives.homomorphic import rank_bound
from ccoll.collectives.layout import block_bounds
from ccoll.collectives.node import Grouping
from ccoll.collectives.nodeshm import NodeShm
from ccoll.collectives.nodesum import sum_slots
from ccoll.collectives.policy.bounds import phase_bounds
from ccoll.collectives.policy.plan import Plan
from ccoll.collectives.ring import ring_allreduce
from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.compressor.cpu import residual_abs

__all__ = ["TwoLevel", "own_residual"]


def own_residual(flat: np.ndarray, n_ranks: int, rank: int, eb_abs: float, avg: bool,
                 plan: Plan, algorithm: str, out: np.ndarray) -> np.ndarray:
    """Write into ``out`` what a compressed allreduce dropped of this rank's host data ``flat``.

    ``plan`` is the call's (``Communicator._last_plan()``), ``eb_abs`` its bound on the
    result, ``avg`` its op, ``algorithm`` the Communicator's. The schedule that ran says how
    it quantized this rank's data, once, on the per-rank grid of the reduce-scatter's bound
    (:func:`phase_bounds`, :func:`rank_bound`): the ring chunk by chunk of its blocks
    (:func:`ccoll.collectives.ring.own_pieces`), recursive halving in the pieces of its
    first step (:func:`ccoll.collectives.halving.own_pieces`). ``out`` (``flat`` itself, or
    an array of its size and dtype) receives ``flat`` minus the decoded values of those
    streams, bit for bit (:func:`ccoll.compressor.cpu.residual_abs`, without making them).
    With a split bound the owner of each reduced block requantizes it too; that error is
    the owner's sum's, not this rank's. Decompress-add-recompress mixes the ranks' errors at
    every step, and two levels quantize the node sums, not this rank's data: neither has a
    residual of this rank's own (``ValueError``).
    """
    if not plan.compress:
        raise ValueError(f"the call was not compressed ({plan.reason}): nothing was quantized")
    if plan.two_level:
        raise ValueError("a two-level allreduce quantizes the node sums, not this rank's data")
    if algorithm != "homomorphic":
        raise ValueError(f"algorithm {algorithm!r} mixes the ranks' errors at every step: no "
                         "rank has an own contribution (use algorithm='homomorphic')")
    ring_eb, _ = phase_bounds(eb_abs, n_ranks, avg, plan.split)
    if plan.pieces:
        pieces = halving.own_pieces(flat.size, n_ranks, rank, plan.pieces)
    else:
        pieces = ring.own_pieces(flat.size, n_ranks, plan.chunk_elems)
    eb_rank = rank_bound(ring_eb, n_ranks)
    for lo, hi in pieces:
        if hi > lo:
            residual_abs(flat[lo:hi], eb_rank, out[lo:hi])
    return out


class TwoLevel:
    """The node and inter-node channels of a hierarchical grouping, and their buffers."""

    def __init__(self, grouping: Grouping, node: Channel, inter: Channel, shm: bool) -> None:
        self.grouping = grouping
        self.node = node
        self.inter = inter
        self._shm_enabled = shm
        self._shm: NodeShm | None = None
        self._shm_failed = False
        self._bufs: np.ndarray | None = None

    def release(self) -> None:
        """Drop the shared memory (unmapped when the last view goes) and the buffers."""
        self._shm = None
        self._bufs = None

    def allreduce(self, ch: Channel, flat: np.ndarray, yflat: np.ndarray, dtype: np.dtype,
                  eb_abs: float, avg: bool, algorithm: str, plan: Plan,
                  deadline: Deadline) -> None:
        """Two-level compressed allreduce of host data ``flat`` into ``yflat``.

        (1) Local rank ``l`` gets the node's float64 sum of share ``l``
        (``numpy.array_split(x, R)[l]``): through the node's shared memory (every rank
        writes its input, one node barrier, each rank adds its share of the ``R`` inputs in
        local rank order), else ``MPI_Reduce_scatter`` of float64 copies; (2) the compressed
        ring (or halving) of the ranks with local rank ``l`` on all nodes reduces those node
        sums (op="sum" with the bound of the whole result: ``N eb`` for an average, divided
        by ``N`` once); (3) every rank gets all shares, the same bytes: the owners write them
        into the shared result, a barrier, every rank copies it out (else
        ``MPI_Allgatherv``). ``ch`` counts the bytes.
        """
        node, inter = self.node, self.inter
        if flat.size == 0:  # agreed: every rank skips
            return
        g = self.grouping
        n_ranks, r = ch.comm.Get_size(), g.ranks_per_node
        bounds = block_bounds(flat.size, r)
        counts = [b - a for a, b in bounds]
        lo, hi = bounds[g.local]
        sent = node.stats.bytes_sent + inter.stats.bytes_sent
        rec = _trace.ACTIVE
        t0 = rec.clock() if rec is not None else 0.0
        shm = self._memory(flat.size, dtype, deadline)
        # The float64 share and its reduced copy, reused across calls: fresh 100 MB arrays
        # would page-fault on every call (measured: as long as the node phases themselves).
        k = hi - lo
        if self._bufs is None or self._bufs.size < 2 * k:
            self._bufs = None
            self._bufs = np.empty(2 * k, np.float64)
        share, reduced = self._bufs[:k], self._bufs[k:2 * k]
        if shm is not None:
            slots = shm.slots
            mine = slots[g.local]
            for m, (a, b) in enumerate(bounds):  # the other ranks read only their shares
                if m != g.local:
                    mine[a:b] = flat[a:b]
            wait_all([node.comm.Ibarrier()], deadline, "node barrier (inputs written)",
                     poll=True)
            sum_slots(flat, slots[:r], g.local, lo, share)
            # What the other ranks read of this rank's input (an MPI ring's bytes).
            node.stats.bytes_sent += (flat.size - (hi - lo)) * dtype.itemsize
        else:
            from ccoll.collectives import exact

            wide = flat.astype(np.float64)  # the node sums in float64: one rounding at the end
            exact.reduce_scatter(node, wide, counts, share, deadline)
            del wide
        if rec is not None:
            t1 = rec.clock()
            rec.span("node reduce", t0, t1, {"shared memory": shm is not None})
        if share.size:  # the same size on every node's rank l: all skip, or none
            ring_eb, requant = phase_bounds(eb_abs, n_ranks, avg, plan.split,
                                            ring_ranks=g.nodes)
            if plan.pieces:
                halving_allreduce(inter, share, reduced, np.dtype(np.float64), ring_eb,
                                  pieces=plan.pieces, deadline=deadline, requant=requant,
                                  version=plan.version)
            else:
                ring_allreduce(inter, share, reduced, np.dtype(np.float64), ring_eb,
                               algorithm=algorithm, chunk_elems=plan.chunk_elems,
                               deadline=deadline, requant=requant, version=plan.version)
            if requant is None and avg:  # requant's owners divided before requantizing
                np.divide(reduced, float(n_ranks), out=reduced)
        t2 = rec.clock() if rec is not None else 0.0
        if shm is not None:
            result = shm.slots[r]
            # The one rounding to the dtype, before sharing. Only this rank touches
            # [lo, hi) of the regions, and every rank copied the previous call's result
            # out before it passed this call's first barrier.
            with np.errstate(over="ignore"):  # beyond the dtype's range: ±Inf
                result[lo:hi] = reduced
            wait_all([node.comm.Ibarrier()], deadline, "node barrier (result written)",
                     poll=True)
            np.copyto(yflat, result[:flat.size])
            node.stats.bytes_sent += (r - 1) * (hi - lo) * dtype.itemsize
        else:
            with np.errstate(over="ignore"):  # the one rounding to the dtype, before sharing
                mine_out = reduced.astype(dtype)
            displs = [a for a, _ in bounds]
            if deadline.at is None:
                node.comm.Allgatherv(mine_out, [yflat, (counts, displs)])
            else:
                req = node.comm.Iallgatherv(mine_out, [yflat, (counts, displs)])
                wait_all([req], deadline, "MPI_Iallgatherv in the node", bulk=True)
            node.stats.bytes_sent += (r - 1) * mine_out.nbytes
        if rec is not None:
            rec.span("node share", t2, rec.clock(), {"shared memory": shm is not None})
        ch.stats.bytes_sent += node.stats.bytes_sent + inter.stats.bytes_sent - sent

    def _memory(self, count: int, dtype: np.dtype, deadline: Deadline) -> NodeShm | None:
        """Return the node's shared memory for ``count`` elements of ``dtype``, or ``None``.

        Made at the first call that needs it (collective over the node: every rank of the
        node gets the same answer from agreed arguments) and reused while calls fit; a node
        where it could not be made uses MPI's collectives from then on.
        """
        shm = self._shm
        if self._shm_failed or (shm is not None and shm.fits(count, dtype)):
            return shm
        self._shm = None  # drop the old mapping before making a larger one
        shm = NodeShm.create(self.node.comm, count, dtype, deadline, enabled=self._shm_enabled)
        self._shm = shm
        self._shm_failed = shm is None
        return shm

    def describe(self) -> dict[str, Any]:
        """Return the grouping and whether the node's memory is shared (for reports)."""
        return {"grouping": str(self.grouping), "shared memory": self._shm is not None}
