"""Shared memory of a node for the two levels of a hierarchical allreduce.

The node's ranks map one file of ``/dev/shm`` made by the node's local rank 0: ``R`` input
slots and one result region, each ``count`` elements of the call's dtype. A call writes
its input into its slot, waits at a node barrier, sums its share of all ``R`` slots itself
(float64, in local rank order, so every node's sum is deterministic:
:func:`~ccoll.collectives.nodesum.sum_slots`), runs the inter-node
ring on that share, writes the rounded share into the result region, waits at a second
barrier and copies the whole result out. No float64 message traffic and no MPI reduction
inside the node (docs/collectives.md, "Hierarchical collectives").

Why a file and not ``MPI_Win_allocate_shared``: freeing an MPI window is collective (MPICH
waits for every rank of the window), and a Communicator may be closed or garbage collected
at different times on different ranks. A mapping is released by each process alone; the
file is unlinked as soon as every rank of the node has mapped it, so nothing is left behind.

Setup is collective over the node communicator, with nonblocking collectives under the
call's deadline: when any rank cannot map the file (no ``/dev/shm``, a node override that
spans several hosts, ``CCOLL_NODE_SHM=0``), every rank of the node learns it and the node
uses MPI's ``Reduce_scatter``/``Allgatherv`` instead.
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np
from mpi4py import MPI

from ccoll.collectives.waiting import Deadline, wait_all

__all__ = ["NodeShm"]

_SHM_DIR = "/dev/shm"
_NAME_BYTES = 128


class NodeShm:
    """One node's mapped file: ``ranks + 1`` regions of ``count`` elements of ``dtype``."""

    __slots__ = ("count", "dtype", "ranks", "local", "_mm", "slots")

    def __init__(self, count: int, dtype: np.dtype, ranks: int, local: int, mm: mmap.mmap):
        self.count, self.dtype, self.ranks, self.local = count, dtype, ranks, local
        self._mm = mm
        arr = np.frombuffer(mm, dtype=dtype, count=(ranks + 1) * count)
        self.slots = arr.reshape(ranks + 1, count)  # slots[0:R] inputs, slots[R] result


    def fits(self, count: int, dtype: np.dtype) -> bool:
        """Whether a call of ``count`` elements of ``dtype`` can use these regions."""
        return self.dtype == dtype and count <= self.count

    @staticmethod
    def create(node: MPI.Intracomm, count: int, dtype: np.dtype,
               deadline: Deadline, *, enabled: bool = True) -> NodeShm | None:
        """Map a new file on every rank of ``node``, or return ``None`` on every rank.

        Collective over ``node``. ``enabled``: this rank may use shared memory
        (``CCOLL_NODE_SHM``); a node where one rank may not uses MPI.
        """
        ranks, local = node.Get_size(), node.Get_rank()
        nbytes = max(1, (ranks + 1) * count * np.dtype(dtype).itemsize)
        name = np.zeros(_NAME_BYTES, np.uint8)
        path = ""
        mm: mmap.mmap | None = None
        if local == 0 and enabled:
            path = os.path.join(_SHM_DIR, f"ccoll-{os.getpid()}-{secrets.token_hex(8)}")
            try:
                mm = _map(path, nbytes, create=True)
                raw = path.encode()
                name[:len(raw)] = np.frombuffer(raw, np.uint8)
            except OSError:
                mm = None
                _unlink(path)
        try:
            wait_all([node.Ibcast(name, root=0)], deadline, "sharing the node's memory")
            if local != 0:
                got = bytes(name).rstrip(b"\0").decode()
                if got and enabled:
                    try:
                        mm = _map(got, nbytes, create=False)
                    except OSError:
                        mm = None
            ok = np.array([1 if mm is not None else 0], np.int32)
            # Also the barrier after which every rank has mapped the file (or failed to).
            wait_all([node.Iallreduce(MPI.IN_PLACE, ok, op=MPI.MIN)], deadline,
                     "sharing the node's memory")
        finally:
            if local == 0 and path:
                _unlink(path)
        if not ok[0] or mm is None:
            return None
        return NodeShm(count, np.dtype(dtype), ranks, local, mm)


def _map(path: str, nbytes: int, *, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            # Reserve the pages now: a full /dev/shm fails here, not as SIGBUS on a write.
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size < nbytes:
            raise OSError(f"{path} is smaller than the node's shared memory")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
