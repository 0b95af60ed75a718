"""Who frees ccoll's private communicators: ``close()`` on every rank, never the garbage collector.

``MPI_Comm_free`` is collective in the MPI standard. MPICH and Open MPI free locally (the call
drops a reference), but a garbage collector runs at a point of its own on each rank, or on
one rank only, possibly on a thread inside another collective: ccoll frees its duplicates
only in ``close()`` (``Communicator``, ``CCollHookState``, and the default Communicator's
delete callback, which runs inside the user's collective ``Comm.Free``), and leaves those of
an object dropped unclosed to ``MPI_Finalize``. A freed mpi4py communicator becomes
``MPI.COMM_NULL``; a leaked one still answers collectives.

tests/mpi/test_collectives_reliability.py checks ``close()``, ``with`` and a collected
Communicator and hook state on every rank; this file what one rank alone does. Runs under
any MPI: ``mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_comm_free.py`` (MPICH in
``make test``; docs/collectives.md, "Faults", has a run under Open MPI).
"""

from __future__ import annotations

import gc

import numpy as np
from mpi4py import MPI

import ccoll
from ccoll.collectives.registry import existing_default


def private_comms(cc: ccoll.Communicator) -> list[MPI.Intracomm]:
    """The mpi4py objects of ``cc``'s private duplicates (blocking and iallreduce channels)."""
    return [ch.comm for ch in cc._channels]


def used(comm) -> ccoll.Communicator:
    cc = ccoll.Communicator(comm, policy="compress")
    x = np.linspace(-1, 1, 5000, dtype=np.float32) * (comm.rank + 1)
    cc.allreduce(x, eb=ccoll.ABS(1e-3))
    cc.iallreduce(x, eb=None).wait()
    return cc


def test_garbage_collection_on_one_rank_only(comm) -> None:
    # Rank 0 drops its Communicator while the others keep theirs and go on: nothing that
    # rank 0's collector does may be a collective call the others do not make.
    cc = used(comm)
    comms = private_comms(cc)
    if comm.rank == 0:
        del cc
        gc.collect()
    other = ccoll.Communicator(comm, policy="compress")
    y = other.allreduce(np.ones(1000, np.float32), eb=ccoll.ABS(1e-3))
    assert np.all(np.abs(y - comm.size) <= 1e-3)
    other.close()
    # Rank 0's collector freed nothing: its duplicates still answer (the mpi4py objects
    # kept here), so every rank can free them together, as close() does on the others.
    if comm.rank == 0:
        assert all(c != MPI.COMM_NULL for c in comms)
        for c in comms:
            c.Free()
    else:
        cc.close()
    assert all(c == MPI.COMM_NULL for c in comms)


def test_default_communicator_is_freed_with_its_communicator() -> None:
    # Its delete callback runs inside the user's Comm.Free, a collective call on every rank.
    d = MPI.COMM_WORLD.Dup()
    ccoll.allreduce(np.ones(10, np.float32), eb=None, comm=d)
    cc = existing_default(d)
    comms = private_comms(cc)
    d.Free()
    assert cc._closed()
    assert all(c == MPI.COMM_NULL for c in comms)
