"""Measured feedback of ``policy="auto"``: a size whose compressed calls ran slower goes raw.

The cost model decides before the data moves; this module checks the decision against
what the calls then took. Per key (count, dtype, collective, algorithm and bound: the
sticky key of :meth:`~ccoll.collectives.policy.auto.AutoPolicy.sticky_raw`) it keeps the
measured seconds of its latest :data:`WINDOW` compressed calls and raw calls, and the
model's raw prediction; "compressed" and "raw" below are the least of those (a call slowed
by something else, which on a shared machine happens often, then neither sends a size raw
nor brings it back; a truly changed time takes over after ``WINDOW`` calls):

- compressed slower than raw (measured raw calls of the key, else the model's raw
  prediction) sends the key raw ("demoted"), and sets the wait to
  ``2**k`` raw calls, ``k`` the key's level, raised by one at every demotion and at every
  re-probe, at most :data:`MAX_LEVEL`;
- once the wait is over, the next call asks the model again (a re-probe: normally it
  compresses); a re-probe that measures faster than raw brings the key back to
  compressing, one that measures slower keeps it raw for ``2**(k+1)`` calls;
- a compressed call that beat the model's raw prediction by less than ``margin`` (the
  model's own error) while no raw call of the key has been measured sends the next call
  raw once, so that the comparison is between two measurements.

On a hierarchical grouping a compressed allreduce can run the flat ring or two levels:
:meth:`Feedback.path` keeps the model's path until it is measured, runs the other path
once, then the one whose least time is lower, and tries the slower one again after
``2**k`` calls (``k`` from :data:`FIRST_PATH_LEVEL`, one more each time, at most
:data:`MAX_LEVEL`), so that one slowed call does not decide for good; "compressed" above
is the least time of either path.

**Every rank takes the same decision.** A call's seconds differ by rank, so they are not
used where they are measured: each rank puts its seconds of its latest call into the
*next* call's agreement vector (:attr:`ccoll.collectives.agreement.Call.elapsed`), which
comes back as the maximum over ranks (the slowest rank is when the call ended for the
job), and the state is updated with that maximum at the end of that next call
(:meth:`Feedback.end_call`), on every rank alike. So a call's decision depends only on
times agreed at earlier calls, never on the current call's own agreement, and the state
lags the measurements by two calls. Calls during which a collective calibration ran are
not measured (their time is the calibration's).

Local and pure: no MPI here; the Communicator carries the numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Feedback", "FeedbackCall", "FIRST_PATH_LEVEL", "MAX_LEVEL", "WINDOW"]

# The longest wait between re-probes is 2**MAX_LEVEL raw calls of the key: a job that
# repeats a size once a step still tries compressing again about every thousand steps.
MAX_LEVEL = 10
# Measurements per mode and key whose least is compared. Measured on 2 ranks of the shared
# 2-core machine: single 64 MiB raw allreduces of 55-420 ms in one run, so the latest time
# alone once brought a losing size back to compressing for good (the outlier stayed the
# reference while only compressed calls followed).
WINDOW = 3
# Hierarchical groupings: the slower compressed path is tried again after 2**k calls of the
# faster, k from FIRST_PATH_LEVEL up to MAX_LEVEL (at most 1 call in 8 on the slower path).
FIRST_PATH_LEVEL = 3
_MAX_KEYS = 4096  # keys kept (a job uses a few sizes; one that never repeats starts over)


class FeedbackCall(NamedTuple):
    """What the Communicator tells the feedback about a call that ended (the same on every rank).

    ``measured`` is False for a call whose time is not comparable (a calibration ran in
    it); ``model_raw_s`` is the model's raw prediction if the model decided the call.
    """

    key: Any
    compressed: bool
    measured: bool = True
    model_raw_s: float | None = None
    # A compressed allreduce on a hierarchical grouping: True if it ran in two levels,
    # False if it ran the flat ring; None where there is one compressed path only.
    two_level: bool | None = None


@dataclass
class _Entry:
    compressed: list[float] = field(default_factory=list)  # agreed seconds, latest WINDOW
    raw: list[float] = field(default_factory=list)  # the same for raw calls
    model_raw_s: float | None = None  # the model's raw prediction (latest model decision)
    demoted: bool = False  # compressed calls measured slower than raw: send raw
    level: int = 0  # k: a demotion waits 2**k raw calls before the next re-probe
    wait: int = 0  # raw calls left before the next re-probe
    measure_raw: bool = False  # send the next call raw once, to measure raw
    raw_asked: bool = False  # that was done (once per key)
    # Hierarchical groupings: agreed seconds of the latest WINDOW compressed calls per path
    # (True: two levels, False: the flat ring), and whether the other path was tried.
    paths: dict[bool, list[float]] = field(default_factory=dict)
    other_tried: bool = False
    # Compressed calls of the faster path left before the slower one is tried again (one
    # noisy call must not decide for good), and its level: the wait is 2**path_level.
    path_wait: int = 0
    path_level: int = FIRST_PATH_LEVEL - 1

    def best_path(self) -> bool | None:
        """Return the path whose least time is lower (True: two levels), None unless both ran."""
        t2, tf = self.paths.get(True), self.paths.get(False)
        if not t2 or not tf:
            return None
        return min(t2) <= min(tf)

    @property
    def compressed_s(self) -> float | None:
        return min(self.compressed) if self.compressed else None

    @property
    def raw_s(self) -> float | None:
        return min(self.raw) if self.raw else None

    def raw_ref(self) -> float | None:
        return self.raw_s if self.raw else self.model_raw_s


class Feedback:
    """The measured-feedback state of one channel's ``policy="auto"`` calls.

    ``margin``: a compressed call that beats the model's raw prediction by less than this
    share gets one raw call measured (the decision's own margin, ``DECISION_MARGIN``).

    ``measure``: a test hook, ``(compressed, seconds) -> seconds``, that replaces this
    rank's measured seconds of a call before they are sent to the other ranks.
    """

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self.measure: Callable[[bool, float], float] | None = None
        self._entries: dict[Any, _Entry] = {}
        # The latest measured call (key, compressed, two_level) and this rank's seconds of
        # it: sent in the next call's agreement, applied at the end of that call.
        self._pending: tuple[Any, bool, bool | None] | None = None
        self._pending_s = 0.0

    def outgoing(self) -> float:
        """Return this rank's seconds of the latest measured call (0.0 if none), to agree on."""
        return self._pending_s if self._pending is not None else 0.0

    def raw_reason(self, key: Any) -> str | None:
        """Why the feedback sends a call with this key raw, or ``None`` (ask the model).

        Local and without side effects; the same on every rank (agreed state).
        """
        e = self._entries.get(key)
        if e is None:
            return None
        if e.demoted and e.wait > 0:
            return (f"measured raw faster: compressed {_ms(e.compressed_s)}, raw "
                    f"{_ms(e.raw_ref())}{'' if e.raw else ' (predicted)'}; "
                    f"compressed again after {e.wait} more raw call"
                    f"{'s' if e.wait > 1 else ''}")
        if e.measure_raw:
            return (f"measuring raw once: compressed {_ms(e.compressed_s)}, "
                    f"within {self.margin:.0%} of the predicted raw {_ms(e.model_raw_s)}")
        return None

    def end_call(self, agreed_s: float | None, call: FeedbackCall | None,
                 seconds: float) -> None:
        """Update the state at the end of a successful call (every rank, every call alike).

        ``agreed_s``: the maximum over ranks of :meth:`outgoing` that this call's agreement
        carried (the previous measured call's seconds); ``call``: this call, if it was a
        ``policy="auto"`` call that the feedback follows (``None`` otherwise);
        ``seconds``: this rank's elapsed time of this call. A call whose agreement carried
        no time (``agreed_s`` None, on every rank alike) leaves the previous time pending.
        """
        if call is not None:
            self._count(call)
        if self._pending is not None and agreed_s is not None:
            key, compressed, two_level = self._pending
            self._pending = None
            self._apply(key, compressed, agreed_s, two_level)
        if call is not None and call.measured:
            s = seconds if self.measure is None else float(self.measure(call.compressed, seconds))
            self._pending = (call.key, call.compressed, call.two_level)
            self._pending_s = s

    def path(self, key: Any, model_two_level: bool) -> tuple[bool, str]:
        """Whether a compressed call of ``key`` runs in two levels, and why.

        For a hierarchical grouping, where a compressed allreduce can run the flat ring or
        two levels: the model's choice until one path is measured, then the other path
        once, then whichever measured faster (the least of each path's latest
        :data:`WINDOW` agreed times). Local and without side effects; the same on every
        rank (agreed state).
        """
        e = self._entries.get(key)
        if e is None or not e.paths:
            return model_two_level, ""
        best = {p: min(t) for p, t in e.paths.items() if t}
        two = e.best_path()
        if two is not None:
            times = f"(two levels {_ms(best[True])}, flat ring {_ms(best[False])})"
            if e.path_wait <= 0:
                return not two, f"{_path_name(not two)} tried again {times}"
            return two, f"{_path_name(two)}: measured faster {times}"
        (known, t), = best.items()
        if not e.other_tried:
            return (not known, f"{_path_name(not known)} measured once "
                    f"({_path_name(known)} {_ms(t)})")
        return known, ""

    def _count(self, call: FeedbackCall) -> None:
        """Advance the key's schedule by this call (its decision was taken on this state)."""
        e = self._entries.get(call.key)
        if e is None:
            if len(self._entries) >= _MAX_KEYS:
                self._entries.clear()
            e = self._entries[call.key] = _Entry()
        if call.model_raw_s is not None:
            e.model_raw_s = call.model_raw_s
        if call.compressed and call.two_level is not None and e.paths:
            if not e.other_tried and call.two_level not in e.paths:
                e.other_tried = True  # the first call of the other path
                self._path_again(e)
            elif (best := e.best_path()) is not None:
                if call.two_level == best:
                    e.path_wait = max(e.path_wait - 1, 0)
                else:  # the slower path was tried again
                    self._path_again(e)
        if not call.compressed:
            if e.measure_raw:
                e.measure_raw, e.raw_asked = False, True
            if e.demoted and e.wait > 0:
                e.wait -= 1
        elif e.demoted and e.wait == 0:
            # A re-probe: until its time is known (two calls on), wait as if it lost.
            self._demote(e)

    def _apply(self, key: Any, compressed: bool, t: float,
               two_level: bool | None = None) -> None:
        """Take in the agreed seconds of an earlier call of ``key``."""
        e = self._entries.get(key)
        if e is None:  # forgotten meanwhile (the table was cleared)
            return
        _push(e.compressed if compressed else e.raw, t)
        if compressed and two_level is not None:
            _push(e.paths.setdefault(two_level, []), t)
        comp, ref = e.compressed_s, e.raw_ref()
        if comp is None or ref is None:
            return
        if comp > ref:
            if not e.demoted:
                self._demote(e)
            return
        if compressed:  # only a compressed call's time brings a demoted key back
            e.demoted = False
            e.wait = 0
        if not e.raw and not e.raw_asked and comp * (1 + self.margin) > ref:
            e.measure_raw = True

    @staticmethod
    def _path_again(e: _Entry) -> None:
        e.path_level = min(e.path_level + 1, MAX_LEVEL)
        e.path_wait = 1 << e.path_level

    @staticmethod
    def _demote(e: _Entry) -> None:
        e.demoted = True
        e.level = min(e.level + 1, MAX_LEVEL)
        e.wait = 1 << e.level

    def describe(self) -> dict[str, Any]:
        """Return the state per key, for logs and ``ccoll bench --json``."""
        return {_name(k): {"compressed_s": e.compressed_s, "raw_s": e.raw_s,
                          "model_raw_s": e.model_raw_s, "demoted": e.demoted,
                          "level": e.level, "wait": e.wait,
                          **({"two_level_s": min(e.paths.get(True, []), default=None),
                              "flat_ring_s": min(e.paths.get(False, []), default=None)}
                             if e.paths else {})}
                for k, e in self._entries.items()}


def _name(key: Any) -> str:
    """``"allreduce homomorphic float32[4194304] REL(0.001)"`` for the Communicator's keys."""
    if isinstance(key, tuple) and len(key) == 6 and isinstance(key[4], type):
        count, dtype, collective, algorithm, kind, value = key
        return f"{collective} {algorithm} {dtype}[{count}] {kind.__name__}({value:g})"
    return repr(key)


def _path_name(two_level: bool) -> str:
    return "two levels" if two_level else "flat ring"


def _push(times: list[float], t: float) -> None:
    times.append(t)
    if len(times) > WINDOW:
        del times[0]


def _ms(s: float | None) -> str:
    return "?" if s is None else f"{s * 1e3:.3g} ms"
