"""Whether MPI is still running: ccoll's calls after ``MPI_Finalize`` raise, not abort.

MPICH ends the process ("Attempting to use an MPI routine ... after finalizing", exit
status 1) at the first MPI call after ``MPI_Finalize``, which a user's ``MPI.Finalize()``
makes before ccoll's objects are gone. :func:`watch` (called when a Communicator is made)
puts an attribute on ``MPI_COMM_SELF``, which ``MPI_Finalize`` deletes first of all; its
callback sets :data:`FINALIZED`, which every call's first check reads
(:meth:`ccoll.collectives.channel.Channel.check_usable`: one list read).
"""

from __future__ import annotations

import threading
from typing import Any

from mpi4py import MPI

from ccoll.errors import CollectiveError

__all__ = ["FINALIZED", "watch", "check_alive", "finalized_error"]

#: ``[True]`` once ``MPI_Finalize`` has begun (a list: read without a global lookup's cost).
FINALIZED = [False]
_lock = threading.Lock()
_watching = False


def _on_finalize(comm: MPI.Comm, keyval: int, attr: Any) -> None:
    FINALIZED[0] = True


def watch() -> None:
    """Have ``MPI_Finalize`` set :data:`FINALIZED` (once per process; MPI must be running)."""
    global _watching
    if _watching:
        return
    with _lock:
        if not _watching:
            keyval = MPI.Comm.Create_keyval(delete_fn=_on_finalize)
            MPI.COMM_SELF.Set_attr(keyval, True)
            _watching = True


def finalized_error(what: str) -> CollectiveError:
    """Return the error of ``what`` (a call, a query) asked for after ``MPI_Finalize``."""
    return CollectiveError(f"MPI is already finalized: {what} needs MPI running (call "
                           "MPI.Finalize() after the last ccoll call, or leave it to "
                           "mpi4py, which finalizes at exit)")


def check_alive(what: str) -> None:
    """Raise :func:`finalized_error` if MPI was finalized (or never initialized)."""
    if FINALIZED[0] or MPI.Is_finalized():
        raise finalized_error(what)
