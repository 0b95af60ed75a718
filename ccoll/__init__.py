"""ccoll: MPI collectives on deep-learning gradients with an error-bounded lossy compressor.

The public API is listed in ``__all__``; docs/ has the format, the error-bound proof and the
performance notes.
"""

import os as _os

# numba's OpenMP pool spins while idle by default. MPI ranks that share cores (several
# ranks per node, or a progress thread beside training) then steal each other's cores and
# a 2 ms kernel can take a second; passive waiting costs nothing measurable when cores are
# free. It must be set before the OpenMP runtime loads; a value the user set is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ccoll._version import __version__  # noqa: E402
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
