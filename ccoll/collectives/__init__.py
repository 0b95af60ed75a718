"""Compressor-assisted MPI collectives: allreduce, iallreduce, reduce_scatter, allgather, bcast.

The functions take an mpi4py communicator (default ``MPI.COMM_WORLD``) or a
:class:`Communicator`; docs/collectives.md describes the algorithms and
docs/error-bound.md the bounds.
"""

from ccoll.collectives.api import (
    allgather,
    allreduce,
    bcast,
    iallreduce,
    last_call,
    reduce_scatter,
)
from ccoll.collectives.communicator import Communicator
from ccoll.collectives.report import CallReport

__all__ = [
    "allreduce", "iallreduce", "reduce_scatter", "allgather", "bcast", "Communicator",
    "CallReport", "last_call",
]
