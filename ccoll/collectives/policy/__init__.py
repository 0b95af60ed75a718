"""Whether a collective call compresses or sends raw: the fixed rules and ``policy="auto"``.

- :mod:`~ccoll.collectives.policy.decision`: the one place that decides, from agreed inputs;
- :mod:`~ccoll.collectives.policy.auto`: ``policy="auto"`` (calibrations and the model);
- :mod:`~ccoll.collectives.policy.probes`: link probe, ring costs, MPI's own efficiency;
- :mod:`~ccoll.collectives.policy.fits`: compressor rates, efficiency fit, ratio sampling;
- :mod:`~ccoll.collectives.policy.feedback`: what the calls measured, against the model;
- :mod:`~ccoll.collectives.policy.cache`: the calibration cache file.

None of them imports the Communicator: the calibration times the ring on a
:class:`~ccoll.collectives.channel.Channel` (docs/model.md, "Calibration").
"""

from ccoll.collectives.policy.auto import (
    AutoDecision,
    AutoPolicy,
    choose,
    decide_call,
    describe,
    link_calibration,
    stream_bound,
)
from ccoll.collectives.policy.cache import cache_dir, newest_cached_params
from ccoll.collectives.policy.decision import Decision, _decide, _fixed

__all__ = [
    "Decision",
    "_decide",
    "_fixed",
    "AutoDecision",
    "AutoPolicy",
    "choose",
    "decide_call",
    "describe",
    "link_calibration",
    "stream_bound",
    "cache_dir",
    "newest_cached_params",
]
