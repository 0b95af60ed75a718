"""Compressor-assisted MPI collectives: allreduce, iallreduce, reduce_scatter, allgather, bcast.

The functions take an mpi4py communicator (default ``MPI.COMM_WORLD``) or a
:class:`Communicator`; docs/collectives.md describes the algorithms and
docs/error-bound.md the bounds.

They, and MPI with them, are imported on first access (PEP 562), so that the MPI-free
submodules (:mod:`ccoll.collectives.model`, ...) load on a machine without any MPI library.
There the first access raises a :class:`ccoll.CollectiveError` that says how to get one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ccoll.errors import CollectiveError

if TYPE_CHECKING:
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

_HOMES = {
    "allreduce": "ccoll.collectives.api",
    "iallreduce": "ccoll.collectives.api",
    "reduce_scatter": "ccoll.collectives.api",
    "allgather": "ccoll.collectives.api",
    "bcast": "ccoll.collectives.api",
    "Communicator": "ccoll.collectives.communicator",
    "last_call": "ccoll.collectives.api",
    "CallReport": "ccoll.collectives.report",  # plain data: needs no MPI
}

NO_MPI = (
    "no MPI library found: pip install 'ccoll[mpich]' or load your site's MPI module "
    "(or point MPI4PY_LIBMPI at its libmpi.so; README.md, 'On a cluster')"
)


def require_mpi() -> None:
    """Import mpi4py.MPI; without an MPI library raise a :class:`CollectiveError` naming the fix."""
    try:
        importlib.import_module("mpi4py.MPI")
    except (ImportError, RuntimeError) as exc:
        # RuntimeError: mpi4py found no libmpi to load; ImportError: no mpi4py at all.
        raise CollectiveError(f"{NO_MPI}. mpi4py said: {type(exc).__name__}: {exc}") from exc


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ccoll.collectives' has no attribute {name!r}")
    if home != "ccoll.collectives.report":
        require_mpi()
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
