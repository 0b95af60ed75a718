"""What a collective call did, and why: :class:`CallReport`, and its log line.

Every blocking call of a :class:`~ccoll.collectives.communicator.Communicator` leaves a
report in ``Communicator.last_call`` (``iallreduce``: ``last_async_call``): compressed or
raw, the reason (the fixed policy, ``eb=None``, or ``policy="auto"``'s predicted times and
ratio), the bytes this rank sent, the absolute bound and the elapsed time. The decision
fields are the same on every rank (they come from agreed numbers); ``bytes_sent`` and
``seconds`` are this rank's.

With ``CCOLL_LOG=info`` (read when a Communicator is created; also ``debug``, ``warning``
or ``off``) the ``"ccoll"`` logger logs one INFO line per call, the report's ``str()``, to
stderr. Without it nothing is configured: a program that sets the ``"ccoll"`` logger to
INFO itself gets the same lines through its own handlers.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

__all__ = ["CallReport", "LOGGER", "configure_logging"]

LOGGER = logging.getLogger("ccoll")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_configured_lock = threading.Lock()
_handler: logging.Handler | None = None


@dataclass(frozen=True, slots=True)
class CallReport:
    """What one collective call did (``Communicator.last_call``).

    - ``collective``: ``"allreduce"``, ``"reduce_scatter"``, ``"allgather"`` or ``"bcast"``;
    - ``compressed``: whether the data went compressed (else plain MPI: raw);
    - ``reason``: why, in words: ``'policy="compress"'``, ``'policy="raw"'``,
      ``"eb=None: exact"``, or ``policy="auto"``'s reason ("predicted 2.10x faster
      compressed", "predicted slower compressed", "too small to gain", "measured faster:
      raw ..., compressed ...", "trial of compressed (...)", ...: docs/model.md,
      "Measured feedback"); a repeat that skipped the agreement adds "; repeated: ran
      without the agreement";
    - ``predicted_raw_s``, ``predicted_compressed_s``, ``ratio``: the cost model's
      predicted seconds and the estimated compression ratio, where ``policy="auto"``
      consulted the model for this call (else ``None``);
    - ``eb_abs``: the absolute bound the result is within (``None``: a raw call, whose
      result is MPI's; docs/error-bound.md, "A bound with a raw plan");
    - ``dtype``, ``count``: the caller's dtype name and element count; ``bytes_input`` the
      input's bytes on this rank (for float16/bfloat16: its float32 copy, what moves, raw
      or compressed: twice the data's own bytes on a raw call, whose ``str()`` says "moved
      as float32"; docs/collectives.md);
    - ``bytes_sent``: bytes this rank put on the wire (counted as ``Communicator.stats``);
    - ``seconds``: wall time of the call on this rank, from its checks to its result;
    - ``overlapped``: the call repeated the signature that the agreed history predicted,
      whose plan is raw and settled, so it ran without the agreement: its MPI collective
      carried the check (docs/collectives.md, "Every call");
    - ``chunk_elems``: elements per pipeline chunk of a compressed call (0 for a raw one):
      the Communicator's ``chunk_elems``, or the one the model chose for this call;
    - ``hierarchical``: the call ran in two levels (exact sums inside each node, the
      compressed ring between nodes, docs/collectives.md, "Hierarchical collectives");
      ``nodes`` and ``ranks_per_node`` are the Communicator's node grouping (``ranks_per_node``
      0: nodes of different sizes), whether or not this call used it;
    - ``format_version``: the stream format a compressed call sent, ``format_reason``
      why (``"format_version=2"``: the Communicator forced it; else the model's
      prediction of both formats, docs/model.md, "Stream format"); ``path``: what ran
      (``"raw"``, ``"flat"``: the flat ring or recursive halving, ``"two levels"``);
      ``trial``: the plan ran this path to measure it (docs/model.md, "Measured feedback").

    For a compressed call ``ratio`` is the one measured: the bytes a raw call would have
    sent over the bytes this rank sent; where this rank sent nothing (one rank, a
    broadcast's last rank), the data's bytes over its compressed streams' (the root's
    stream for a broadcast).
    """

    collective: str
    compressed: bool
    reason: str
    policy: str
    algorithm: str
    dtype: str
    count: int
    eb_abs: float | None
    bytes_input: int
    bytes_sent: int
    seconds: float
    predicted_raw_s: float | None = None
    predicted_compressed_s: float | None = None
    ratio: float | None = None
    overlapped: bool = False
    chunk_elems: int = 0
    hierarchical: bool = False
    nodes: int = 1
    ranks_per_node: int = 0
    format_version: int = 1
    path: str = "raw"
    trial: bool = False
    format_reason: str = ""

    @property
    def mode(self) -> str:
        """``"compressed"`` or ``"raw"``."""
        return "compressed" if self.compressed else "raw"

    def decision(self) -> tuple[object, ...]:
        """Return the fields that every rank shares (all but bytes and time)."""
        return (self.collective, self.compressed, self.reason, self.policy, self.algorithm,
                self.dtype, self.count, self.eb_abs, self.predicted_raw_s,
                self.predicted_compressed_s, self.overlapped, self.chunk_elems,
                self.hierarchical, self.nodes, self.ranks_per_node, self.format_version,
                self.path, self.trial, self.format_reason)

    def __str__(self) -> str:
        why = self.reason
        if self.predicted_raw_s is not None and self.predicted_compressed_s is not None:
            why += (f"; predicted raw {_ms(self.predicted_raw_s)}, compressed "
                    f"{_ms(self.predicted_compressed_s)}")
        if self.compressed:
            why += f"; format {self.format_version}"
            if self.format_reason:
                why += f" ({self.format_reason})"
            if self.ratio is not None:
                why += f", ratio {self.ratio:.3g}"
        if self.hierarchical:
            why += f"; hierarchical: {self.nodes} nodes x {self.ranks_per_node} ranks"
        bound = "MPI's result" if self.eb_abs is None else f"eb {self.eb_abs:.3g}"
        moved = " (moved as float32)" if self.dtype in ("float16", "bfloat16") else ""
        return (f"{self.collective} {self.dtype}[{self.count}] {self.mode} ({why}); {bound}; "
                f"sent {self.bytes_sent} B of {self.bytes_input} B input{moved} in "
                f"{_ms(self.seconds)}")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def configure_logging(rank: int, level: str) -> None:
    """Apply the ``CCOLL_LOG`` setting (:class:`ccoll.settings.Settings`): level and handler.

    Does nothing for ``"off"``. The stderr handler, added once per process, prefixes each
    line with ``ccoll[rank]``.
    """
    global _handler
    lvl = _LEVELS.get(level)
    if lvl is None:
        return
    with _configured_lock:
        LOGGER.setLevel(lvl)
        if _handler is None:
            _handler = logging.StreamHandler()
            _handler.setFormatter(logging.Formatter(f"ccoll[{rank}]: %(message)s"))
            LOGGER.addHandler(_handler)
