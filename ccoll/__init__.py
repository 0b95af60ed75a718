"""ccoll: MPI collectives on deep-learning gradients with an error-bounded lossy compressor.

The public API is listed in ``__all__``; docs/ has the format, the error-bound proof and the
performance notes. Importing ccoll changes nothing in the process: the OpenMP wait policy and
numba's threading layer are settled right before the first parallel CPU kernel
(:mod:`ccoll.runtime.cpu_threads`, docs/scheduler.md).
"""

from ccoll._version import __version__
from ccoll.collectives import (
    Communicator,
    allgather,
    allreduce,
    bcast,
    iallreduce,
    reduce_scatter,
)
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
    "CCollError",
    "CollectiveError",
    "DTypeError",
    "ErrorBoundError",
    "FormatError",
    "MismatchError",
]
