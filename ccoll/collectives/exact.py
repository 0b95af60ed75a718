"""Plain MPI collectives behind ccoll's API: ``eb=None`` and ``policy="raw"``.

These call MPI and nothing else, so the results equal plain MPI's bit for bit. With a
``timeout`` the nonblocking variants (``MPI_Iallreduce`` ...) run under a polled deadline;
MPI may pick other algorithms for those, so their floating-point sums may differ from the
blocking ones in the last bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives.channel import Channel
from ccoll.collectives.waiting import Deadline, wait_all

__all__ = ["allreduce", "reduce_scatter", "allgather", "bcast"]


def allreduce(
    ch: Channel, flat: Any, out: Any, deadline: Deadline, *, in_place: bool = False
) -> None:
    """``out = sum over ranks of flat`` with ``MPI_Allreduce`` (``in_place``: flat is out)."""
    comm = ch.comm
    n_ranks = comm.Get_size()
    send = MPI.IN_PLACE if in_place else flat
    if deadline.at is None:
        comm.Allreduce(send, out, op=MPI.SUM)
    else:
        wait_all([comm.Iallreduce(send, out, op=MPI.SUM)], deadline, "MPI_Iallreduce", bulk=True)
    ch.stats.bytes_sent += 2 * (n_ranks - 1) * out.nbytes // n_ranks


def reduce_scatter(
    ch: Channel, flat: np.ndarray, counts: list[int], out: np.ndarray, deadline: Deadline
) -> None:
    """Compute this rank's block of the sum with ``MPI_Reduce_scatter``."""
    comm = ch.comm
    if deadline.at is None:
        comm.Reduce_scatter(flat, out, recvcounts=counts, op=MPI.SUM)
    else:
        req = comm.Ireduce_scatter(flat, out, recvcounts=counts, op=MPI.SUM)
        wait_all([req], deadline, "MPI_Ireduce_scatter", bulk=True)
    ch.stats.bytes_sent += (flat.nbytes - out.nbytes)


def allgather(ch: Channel, flat: np.ndarray, out: np.ndarray, deadline: Deadline) -> None:
    """Every rank's array, stacked, with ``MPI_Allgather``."""
    comm = ch.comm
    if deadline.at is None:
        comm.Allgather(flat, out)
    else:
        wait_all([comm.Iallgather(flat, out)], deadline, "MPI_Iallgather", bulk=True)
    ch.stats.bytes_sent += (comm.Get_size() - 1) * flat.nbytes


def bcast(ch: Channel, buf: np.ndarray, root: int, deadline: Deadline) -> None:
    """Broadcast the root's array with ``MPI_Bcast`` (in place in ``buf``)."""
    comm = ch.comm
    if deadline.at is None:
        comm.Bcast(buf, root=root)
    else:
        wait_all([comm.Ibcast(buf, root=root)], deadline, "MPI_Ibcast", bulk=True)
    if comm.Get_rank() != (root - 1) % comm.Get_size():
        ch.stats.bytes_sent += buf.nbytes
