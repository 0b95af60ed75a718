"""The module-level collectives of ``ccoll`` (DESIGN.md, "Public API").

Each function runs on the default :class:`~ccoll.collectives.communicator.Communicator`
of ``comm`` (made on first use, collectively; ``policy="auto"``: compressed only where the
cost model predicts it pays) or on a Communicator passed as ``comm``.
``eb`` is an error bound (``ccoll.ABS``, ``ccoll.REL``, a float meaning absolute, or a
string ``"rel:1e-3"``) or ``None`` for the exact result of plain MPI. :func:`last_call`
says what the last call on ``comm`` did (compressed or raw, and why).

Inputs: numpy arrays and torch tensors of float32 or float64, on the host or a device
(the result has the input's kind), and host float16/bfloat16 data (reduced in float32,
rounded once to the input's dtype; docs/error-bound.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ccoll.collectives.communicator import DEFAULT_EB
from ccoll.collectives.registry import default_communicator, existing_default
from ccoll.collectives.report import CallReport

__all__ = ["allreduce", "iallreduce", "reduce_scatter", "allgather", "bcast", "last_call"]


def allreduce(
    x: Any,
    eb: Any = DEFAULT_EB,
    op: str = "sum",
    comm: Any = None,
    out: np.ndarray | None = None,
    *,
    algorithm: str | None = None,
    policy: str | None = None,
) -> np.ndarray:
    """Sum (``op="sum"``) or mean (``op="avg"``) of ``x`` over the ranks of ``comm``.

    Every finite element is within ``eb`` of the exact sum, or for ``op="avg"`` of the exact
    mean (the bound is on what the caller gets), up to the final roundings to the dtype
    (docs/error-bound.md), and every rank gets the same array bit for bit. ``REL`` bounds
    are relative to the global range of all ranks' inputs, for the mean too. ``out`` (same
    shape and dtype as ``x``, C-contiguous; may be ``x`` itself) receives the result.
    ``algorithm`` and ``policy`` override the Communicator's options for this call.
    """
    return default_communicator(comm).allreduce(
        x, eb, op, out, algorithm=algorithm, policy=policy
    )


def iallreduce(
    x: Any,
    eb: Any = DEFAULT_EB,
    op: str = "sum",
    comm: Any = None,
    out: np.ndarray | None = None,
    *,
    algorithm: str | None = None,
    policy: str | None = None,
) -> Any:
    """Nonblocking :func:`allreduce`: returns a request; ``request.wait()`` returns ``y``.

    The call runs on ccoll's progress engine (one background thread, in submission
    order), on a private duplicate of ``comm``. ``request.test()`` says whether it has
    finished. Leave ``x`` and ``out`` alone until then.
    """
    return default_communicator(comm).iallreduce(
        x, eb, op, out, algorithm=algorithm, policy=policy
    )


def reduce_scatter(
    x: Any,
    eb: Any = DEFAULT_EB,
    op: str = "sum",
    comm: Any = None,
    *,
    algorithm: str | None = None,
    policy: str | None = None,
) -> np.ndarray:
    """Return this rank's block of the reduction (flattened, split like ``array_split``).

    Returns ``numpy.array_split(reduced.ravel(), size)[rank]`` within ``eb`` of the exact
    sum, or of the exact mean for ``op="avg"``.
    """
    return default_communicator(comm).reduce_scatter(
        x, eb, op, algorithm=algorithm, policy=policy
    )


def allgather(x: Any, eb: Any = DEFAULT_EB, comm: Any = None) -> np.ndarray:
    """Every rank's ``x`` (same shape on every rank), stacked: shape ``(size, *x.shape)``.

    Each element is within ``eb`` of the original; all ranks get identical arrays.
    """
    return default_communicator(comm).allgather(x, eb)


def bcast(x: Any, eb: Any = DEFAULT_EB, root: int = 0, comm: Any = None) -> np.ndarray:
    """Return the root's ``x`` on every rank within ``eb`` (the root gets the decoded copy).

    Non-root ranks pass ``None`` (they get the root's shape and dtype) or an array of the
    root's shape and dtype (its values are ignored; a different shape raises
    :class:`ccoll.MismatchError` on every rank).
    """
    return default_communicator(comm).bcast(x, eb, root)


def last_call(comm: Any = None, *, nonblocking: bool = False) -> CallReport | None:
    """Return what the last blocking call (``nonblocking=True``: ``iallreduce``) did.

    ``comm`` is what the collectives took (an mpi4py communicator, ``None`` for
    ``MPI.COMM_WORLD``, or a :class:`Communicator`). Local; ``None`` before the first call.
    See :class:`~ccoll.collectives.report.CallReport`.
    """
    cc = existing_default(comm)
    if cc is None:
        return None
    return cc.last_async_call if nonblocking else cc.last_call
