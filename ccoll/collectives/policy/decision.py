"""The one place that decides, per call, whether a collective compresses or sends raw.

:func:`_decide` sees only numbers that every rank agreed on (the agreement step checks
them), so every rank takes the same decision and the ranks never mix a compressed and a
raw algorithm in one call. ``policy="compress"`` always compresses, ``policy="raw"`` never
does (plain MPI with ccoll's API), and ``eb=None`` is always exact. A cost model ("auto")
plugs in here: it must decide from agreed inputs only (for example a calibration that the
ranks measured and allreduced together), never from rank-local timings.

:func:`_fixed` answers the calls that need no model (and the ``"auto"`` calls that
:meth:`~ccoll.collectives.policy.auto.AutoPolicy.known_raw` settles from calibrations
already agreed), so that those do not build a :class:`Decision`: a raw call should cost
little more than the MPI call it makes.

This module imports no other part of the policy: an ``"auto"`` call carries its
:class:`~ccoll.collectives.policy.auto.AutoPolicy` in :attr:`Decision.auto`, which decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Decision", "_decide", "_fixed"]


@dataclass(frozen=True)
class Decision:
    """The agreed facts a policy may use."""

    collective: str
    policy: str
    algorithm: str
    exact: bool
    count: int
    dtype: np.dtype
    n_ranks: int
    eb_abs: float
    # policy="auto" only: this rank's data, the channel's AutoPolicy and the bcast root
    # (ccoll.collectives.policy.auto; its decide_call() is collective and sees agreed numbers).
    data: Any = None
    auto: Any = None
    root: int | None = None


def _fixed(policy: str, exact: bool, known_raw: bool = False) -> str | None:
    """Return the mode of a call that needs no cost model, or ``None`` (ask :func:`_decide`).

    ``known_raw``: a ``policy="auto"`` call that the calibrations already send raw whatever
    its data (the same answer on every rank that passes the same arguments).
    """
    if exact or policy == "raw" or (known_raw and policy == "auto"):
        return "raw"
    if policy == "compress":
        return "compress"
    return None


def _decide(d: Decision) -> str:
    """Return ``"compress"`` or ``"raw"`` for this call (identical on every rank)."""
    fixed = _fixed(d.policy, d.exact)
    if fixed is not None:
        return fixed
    if d.policy == "auto":
        return "compress" if d.auto.decide_call(d).compress else "raw"
    raise AssertionError(f"policy {d.policy!r} passed validation but has no rule")
