"""The default :class:`~ccoll.collectives.communicator.Communicator` of each mpi4py communicator.

The module-level collectives (``ccoll.allreduce(x, comm=...)``) run on it: made on the
first call for a communicator (collectively over it), cached on the communicator as an MPI
attribute and freed with it (``Comm.Free``).
"""

from __future__ import annotations

import threading
from typing import Any

from mpi4py import MPI

from ccoll.errors import InputError
from ccoll.runtime.mpilife import check_alive

__all__ = ["default_communicator", "existing_default"]

_keyval_lock = threading.Lock()
_keyval: int | None = None
# One lock per communicator being given its default: the collective creation runs under
# it, never under _keyval_lock, so threads creating defaults for different communicators
# do not wait for each other (in whatever order the ranks run them).
_creating: dict[int, threading.Lock] = {}
# MPI.COMM_WORLD's default, once made (comm=None, the common case, then skips the lookup).
_world: Any = None
_Communicator: Any = None


def _on_comm_free(comm: MPI.Comm, keyval: int, attr: Any) -> None:
    # Runs inside the user's Comm.Free (collective): free our duplicates with it. The
    # predefined communicators only lose their attributes inside MPI_Finalize, where
    # freeing is pointless.
    if _is_communicator(attr) and comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
        attr.free()


def _mpi_comm(comm: Any) -> MPI.Intracomm:
    """``comm`` checked as an mpi4py intracommunicator (``None``: ``MPI.COMM_WORLD``)."""
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise InputError(
            f"comm must be an mpi4py intracommunicator or a ccoll.Communicator, got {comm!r}"
        )
    return comm


def default_communicator(comm: Any) -> Any:
    """Return the Communicator that the module-level functions use for ``comm``.

    ``comm`` may be a :class:`Communicator` (returned as is), an mpi4py communicator (its
    default Communicator is cached on it as an MPI attribute and freed with it) or ``None``
    (``MPI.COMM_WORLD``). The first call for a communicator is collective over it.
    """
    global _keyval, _world
    if comm is None:
        w = _world
        if w is not None and not w._closed():
            return w
    elif _is_communicator(comm):
        return comm
    world = comm is None
    comm = _mpi_comm(comm)
    check_alive("a ccoll collective")
    with _keyval_lock:
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval(delete_fn=_on_comm_free)
        keyval = _keyval
        found = comm.Get_attr(keyval)
        if _is_communicator(found):
            return found
        handle = MPI._handleof(comm)
        lock = _creating.setdefault(handle, threading.Lock())
    with lock:  # two threads of one rank asking for the same default make one
        found = comm.Get_attr(keyval)
        if not _is_communicator(found):
            from ccoll.collectives.communicator import Communicator

            found = Communicator(comm)
            comm.Set_attr(keyval, found)
    with _keyval_lock:
        if _creating.get(handle) is lock:
            del _creating[handle]
    if world:
        _world = found
    return found


def existing_default(comm: Any) -> Any:
    """Return the default Communicator of ``comm`` if one was made, else ``None`` (local).

    ``comm`` as for :func:`default_communicator`; unlike it, this never creates one.
    """
    if _is_communicator(comm):
        return comm
    if comm is None and _world is not None:
        return _world  # without an MPI call: a report stays readable after MPI_Finalize
    comm = _mpi_comm(comm)
    check_alive("looking up a communicator's default ccoll Communicator")
    with _keyval_lock:
        if _keyval is None:
            return None
        found = comm.Get_attr(_keyval)
    return found if _is_communicator(found) else None


def _is_communicator(obj: Any) -> bool:
    global _Communicator
    if _Communicator is None:
        from ccoll.collectives.communicator import Communicator

        _Communicator = Communicator
    return isinstance(obj, _Communicator)
