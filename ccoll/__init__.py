"""ccoll: MPI collectives on deep-learning gradients with an error-bounded lossy compressor.

The public API is listed in ``__all__``; docs/ has the format, the error-bound proof and the
performance notes. Importing ccoll changes nothing in the process: the OpenMP wait policy and
numba's threading layer are settled right before the first parallel CPU kernel
(:mod:`ccoll.runtime.cpu_threads`, docs/scheduler.md).

The collectives (``allreduce``, ``Communicator``, ...) are loaded on first use, and MPI with
them: ``import ccoll`` and ``ccoll.compress`` work on a machine without any MPI library, and
the first collective there raises a :class:`CollectiveError` that says how to get one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ccoll._version import __version__
from ccoll.compressor import compress, decompress
from ccoll.errorbound import ABS, REL
from ccoll.errors import (
    CCollError,
    CollectiveError,
    DTypeError,
    ErrorBoundError,
    FormatError,
    MismatchError,
)

if TYPE_CHECKING:
    from ccoll.collectives import (
        Communicator,
        allgather,
        allreduce,
        bcast,
        iallreduce,
        last_call,
        reduce_scatter,
    )

__all__ = [
    "__version__",
    "ABS",
    "REL",
    "compress",
    "decompress",
    "allreduce",
    "iallreduce",
    "reduce_scatter",
    "allgather",
    "bcast",
    "Communicator",
    "last_call",
    "CCollError",
    "CollectiveError",
    "DTypeError",
    "ErrorBoundError",
    "FormatError",
    "MismatchError",
]

# ccoll.collectives' names: it imports them (and mpi4py.MPI) on first access (PEP 562).
_COLLECTIVES = frozenset(
    ("Communicator", "allgather", "allreduce", "bcast", "iallreduce", "last_call",
     "reduce_scatter")
)


def __getattr__(name: str) -> Any:
    if name in _COLLECTIVES:
        from ccoll import collectives

        value = getattr(collectives, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ccoll' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
