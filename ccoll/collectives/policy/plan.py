"""One plan per call: every choice of a collective call, made in one place.

:class:`Planner` (one per channel of a Communicator) turns a call's agreed signature
(:class:`Facts`: collective, count, dtype, bound, op, policy, where the data lives) and
state that every rank holds identically (the Communicator's options, its frozen
:class:`~ccoll.collectives.policy.calibration.Calibration`, and the times and ratios that
earlier calls of the same signature agreed on) into a frozen :class:`Plan`: raw or
compressed, the path (the flat ring, recursive halving, or two levels), the chunk, the
split of the bound between the phases, the stream format. Nothing else decides.

**The decision.** The cost model (:mod:`ccoll.collectives.model`, docs/model.md) prices
each candidate path of the call, in each stream format it compares
(:mod:`ccoll.collectives.policy.paths`). Then one measured loop per signature (docs/model.md,
"Measured feedback"): a candidate's time, once measured, replaces its prediction; the
candidate with the lowest estimate runs, a compressed one predicted (not measured) faster
only by a margin (:data:`MARGIN`); an unmeasured candidate predicted within
:data:`TRY_FACTOR` of the best's measured time is tried (so a raw size the model underrated
gets its compressed trial, and a compressed one its raw trial); a measured loser is tried
again after ``2**k`` calls of the signature, ``k`` one higher at every loss. A
candidate's first run is not measured (kernels load, connections open).

**Identical on every rank.** Each rank measures its own time of each call, and keeps it
(its own least time per candidate since the signature's last agreement); the next
agreement of the same signature carries it and returns the maximum over ranks, which goes
into the state at that point on every rank alike. A plan therefore depends on the agreed
signature, the Communicator's settings and calibration and agreed times only (never a
clock read or a value that exists on some ranks only), and the state's fingerprint
(:meth:`Planner.digest`) travels in the agreement, so ranks that would plan differently
raise :class:`~ccoll.errors.MismatchError` instead of hanging.

**A repeated raw call is cheap.** A signature whose plan is raw and settled (measured, or
raw whatever the data, and no trial due) is marked :attr:`Plan.fast`: the Communicator
then runs its next repeat without the agreement (docs/collectives.md, "Every call").
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any

from ccoll.collectives import model, ratios
from ccoll.collectives.model import Params
from ccoll.collectives.policy.paths import (
    FEWER_BYTES,
    Candidate,
    Facts,
    Formats,
    Options,
    Plan,
    _format_why,
    _ms,
    _paths,
    candidates,
)

__all__ = [
    "Facts", "Plan", "Planner", "State", "Options", "Formats", "Candidate", "candidates",
    "skips_agreement",
    "MARGIN", "TRY_FACTOR", "FEWER_BYTES", "FIRST_LEVEL", "MAX_LEVEL", "WINDOW", "VARIANTS",
]

# A compressed path predicted (not measured) faster runs only if faster by this share: the
# model was within about 10% of measured compressed times on the bench, and a wrong
# "compress" near the break-even point costs more than a missed one.
MARGIN = 0.15
# An unmeasured candidate predicted within this factor of the best's measured time is tried.
TRY_FACTOR = 2.0
# A measured loser is tried again after 2**k calls of its signature, k from FIRST_LEVEL up
# to MAX_LEVEL (one higher at every loss): a job that repeats a size once a step tries
# again about every thousand steps at most.
FIRST_LEVEL = 2
MAX_LEVEL = 10
# Agreed times kept per candidate; the least counts (one slowed call decides nothing).
WINDOW = 3
# The candidates' keys (:attr:`Plan.key`), in the order their times are agreed on.
VARIANTS = ("raw", "flat", "two levels", "flat v2", "two levels v2")
_MAX_STATES = 4096  # signatures kept per channel (a job that never repeats starts over)


def _ideal_loses(f: Facts, p: Params, o: Options) -> bool:
    """Whether every compressed path loses even at an infinite ratio (raw whatever the data)."""
    cands = candidates(f, p, 1e30, ratios.DEFAULT_WIDTH, o._replace(version=1))
    raw = cands[0].seconds
    return all(c.seconds * (1 + MARGIN) >= raw for c in cands[1:])


# -------------------------------------------------------------------------- the state


def _mix(h: int, *vals: float) -> int:
    """Fold ``vals`` into the 52-bit fingerprint ``h`` (exact in float64)."""
    raw = struct.pack(f"=q{len(vals)}d", h, *(float(v) for v in vals))
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 12


@dataclass(eq=False)
class State:
    """What one signature's calls agreed on, and this rank's times not yet agreed."""

    key: Any
    facts: Facts
    digest: int
    calls: int = 0  # completed calls of this signature (every rank alike)
    ratio: float | None = None  # agreed sampled ratio
    width: float = ratios.DEFAULT_WIDTH
    gain2: float | None = None  # agreed sampled ratio of format 2 over format 1
    # Agreed sampled speed factors of format 2's compress, add and decompress over format 1's
    # (format 1's seconds over format 2's on the same sample; None: not sampled).
    speed2: tuple[float, float, float] | None = None
    runs: dict[str, int] = field(default_factory=dict)  # runs per variant
    times: dict[str, list[float]] = field(default_factory=dict)  # agreed seconds per variant
    level: dict[str, int] = field(default_factory=dict)  # k of a loser: tried after 2**k calls
    last_run: dict[str, int] = field(default_factory=dict)  # call index of its latest run
    awaiting: bool = False  # the last call was not raw: its time is to be agreed
    # This rank's least unagreed seconds per variant (local; sent at the next agreement).
    unsent: dict[str, float] = field(default_factory=dict)
    cached: Plan | None = None  # the plan of the next call, while nothing changes
    due: float = math.inf  # call index from which the cached plan must be made again
    cands: list[Any] | None = None  # the model's candidates (they change with the ratio)


def skips_agreement(st: State) -> bool:
    """Whether the next call of ``st``'s signature may skip the agreement (:meth:`Planner.fast`)."""
    plan = st.cached
    return not st.awaiting and plan is not None and plan.fast


class Planner:
    """The plans of one channel's calls: candidates, the measured loop, the fast path.

    ``params`` and ``forced_ratio`` come from the Communicator's calibration, ``options``
    from its settings; ``base`` fingerprints all three (part of :meth:`digest`).
    """

    def __init__(self, params: Params, options: Options, base: int,
                 forced_ratio: float | None = None, formats: Formats | None = None) -> None:
        self.params = params
        self.options = options
        self.base = base
        self.forced_ratio = forced_ratio
        self.formats = formats  # format 2's rates and ratio gain (None: format 1 only)
        self._states: dict[Any, State] = {}
        # Counts the clearings of _states: a State looked up under an unchanged epoch is
        # still the one of its key (the fast path keeps the last repeat's).
        self.epoch = 0
        self._ideal: dict[Facts, bool] = {}

    # -- before the agreement (local, the same on every rank) --------------------------

    def state(self, key: Any, facts: Facts) -> State:
        """Return the signature's state, made at its first call."""
        st = self._states.get(key)
        if st is None:
            if len(self._states) >= _MAX_STATES:
                self._states.clear()
                self.epoch += 1
            st = self._states[key] = State(key, facts, self.base)
        return st

    def digest(self, st: State) -> int:
        """Return the fingerprint of what the signature's plans depend on but the call."""
        return _mix(st.digest, float(st.calls))

    def needs_ratio(self, st: State, facts: Facts) -> bool:
        """Whether this call's ranks sample their data's ratio before the agreement.

        ``policy="auto"`` calls of host data that may compress, on the first call of their
        signature (the ratio is kept), unless a ratio is forced.
        """
        if (facts.policy != "auto" or facts.exact or facts.device or facts.ranks < 2
                or facts.elements == 0 or self.forced_ratio is not None or st.ratio is not None):
            return False
        return not self.raw_whatever(facts)

    def raw_whatever(self, facts: Facts) -> bool:
        """Whether the call goes raw whatever its data (and its ratio)."""
        if facts.exact or facts.policy == "raw":
            return True
        if facts.policy != "auto":
            return False
        if facts.ranks < 2 or facts.elements == 0:
            return True
        known = self._ideal.get(facts)
        if known is None:
            if len(self._ideal) >= _MAX_STATES:
                self._ideal.clear()
            known = self._ideal[facts] = _ideal_loses(facts, self.params, self.options)
        return known

    def fast(self, key: Any) -> State | None:
        """Return the state of ``key`` if its next call may skip the agreement, else None.

        Its plan (:attr:`State.cached`) is raw and settled: nothing it would agree on can
        change it (docs/collectives.md, "Every call").
        """
        st = self._states.get(key)
        return st if st is not None and skips_agreement(st) else None

    # -- the plan ------------------------------------------------------------------------

    def plan(self, st: State, facts: Facts, *, ratio: float | None = None,
             width: float | None = None, gain2: float | None = None,
             speed2: tuple[float, ...] | None = None,
             times: tuple[float, ...] = ()) -> Plan:
        """Return the plan of this call, after its agreement (the same on every rank).

        ``ratio``/``width``/``gain2``: the agreed sample (first call of the signature;
        ``gain2``: format 2's ratio over format 1's on the same blocks, which replaces the
        calibration's; ``speed2``: format 1's seconds over format 2's of compress, add and
        decompress on those blocks, which times format 1's rates replace the calibration's
        format-2 rates); ``times``: the agreed seconds per :data:`VARIANTS` (0: none) of the
        signature's earlier calls.
        """
        if facts != st.facts:  # the bound resolved to 0 on this call, or no longer
            st.facts = facts
            st.cached = st.cands = None
        if ratio is not None and st.ratio is None and math.isfinite(ratio) and ratio > 0:
            st.ratio = ratio
            if width is not None and math.isfinite(width) and width > 0:
                st.width = width
            if gain2 is not None and math.isfinite(gain2) and gain2 > 0:
                st.gain2 = gain2
            if (speed2 is not None and len(speed2) == 3
                    and all(math.isfinite(v) and v > 0 for v in speed2)):
                st.speed2 = (float(speed2[0]), float(speed2[1]), float(speed2[2]))
            st.digest = _mix(st.digest, 1.0, st.ratio, st.width,
                             -1.0 if st.gain2 is None else st.gain2,
                             *((-1.0,) * 3 if st.speed2 is None else st.speed2))
            st.cached = st.cands = None
        for v, t in zip(VARIANTS, times, strict=False):
            if t > 0:
                self._take(st, v, t)
        st.unsent.clear()
        st.awaiting = False
        if st.cached is None or st.calls >= st.due:
            self._refresh(st)
        assert st.cached is not None
        return st.cached

    def end(self, st: State, plan: Plan, seconds: float) -> None:
        """Count a completed call (every rank alike); keep this rank's time of it."""
        v = plan.key
        runs = st.runs.get(v, 0)
        st.runs[v] = runs + 1
        if runs > 0:  # a variant's first run is not measured
            got = st.unsent.get(v)
            if got is None or seconds < got:
                st.unsent[v] = seconds
        if plan.fast and plan is st.cached:  # a settled raw repeat: nothing else changes
            st.last_run[v] = st.calls
            st.calls += 1
            if st.calls >= st.due:
                self._refresh(st)
            return
        st.last_run[v] = st.calls
        if plan.trial:
            if v in st.times:  # a measured loser's try: the next one waits twice as long
                st.level[v] = min(st.level.get(v, FIRST_LEVEL) + 1, MAX_LEVEL)
        else:
            st.level.pop(v, None)
        st.calls += 1
        st.digest = _mix(st.digest, 2.0, float(VARIANTS.index(v)), float(plan.trial))
        st.awaiting = v != "raw"
        self._refresh(st)  # a first run, a due retry, a trial to repeat

    def unsent(self, st: State) -> tuple[float, ...]:
        """Return this rank's least unagreed seconds per :data:`VARIANTS` (0: none)."""
        if not st.unsent:
            return (0.0,) * len(VARIANTS)
        return tuple(st.unsent.get(v, 0.0) for v in VARIANTS)

    def describe(self) -> dict[str, Any]:
        """Per signature: the calls, the agreed times and the current plan (for ``--json``)."""
        out = {}
        for st in self._states.values():
            f = st.facts
            name = f"{f.collective} {f.policy} {f.elements}x{f.itemsize}B"
            out[name] = {"calls": st.calls, "ratio": st.ratio,
                         "seconds": {v: min(t) for v, t in st.times.items() if t},
                         "plan": None if st.cached is None else st.cached.variant,
                         "reason": None if st.cached is None else st.cached.reason}
        return out

    def _refresh(self, st: State) -> None:
        st.cached, st.due = self._choose(st, st.facts)

    # -- the measured loop ------------------------------------------------------------

    def _take(self, st: State, variant: str, t: float) -> None:
        times = st.times.setdefault(variant, [])
        times.append(t)
        if len(times) > WINDOW:
            del times[0]
        st.digest = _mix(st.digest, 3.0, float(VARIANTS.index(variant)), t)
        st.cached = None

    def _choose(self, st: State, f: Facts) -> tuple[Plan, float]:
        """Return the plan of the signature's next call and the call it holds until (pure)."""
        inf = math.inf
        if f.exact:
            return Plan("raw", "eb=None: exact", fast=True), inf
        if f.policy == "raw":
            return Plan("raw", 'policy="raw"', fast=True), inf
        if f.policy == "compress":
            cands = self._cands(st, f)
            est = {c.plan.key: c.seconds for c in cands}
            best = min(_paths(cands[1:], {}), key=lambda c: c.seconds)
            p = best.plan
            return Plan(p.variant, 'policy="compress"', p.chunk_elems, p.pieces, p.split,
                        p.version, format_reason=_format_why(best, cands, est, {})), inf
        if f.ranks < 2:
            return Plan("raw", "one rank", fast=True), inf
        if f.elements == 0:
            return Plan("raw", "empty", fast=True), inf
        if f.lossless:
            return Plan("raw", "lossless bound: nothing to gain"), inf
        cands = self._cands(st, f)
        if f.device:  # the CUDA compressor cannot be timed here: by size alone
            if self.raw_whatever(f):
                return Plan("raw", "too small to gain", predicted_raw=cands[0].seconds), inf
            return _named(cands[1].plan, "device data above the size threshold"), inf
        if self.raw_whatever(f):
            return Plan("raw", "too small to gain", predicted_raw=cands[0].seconds,
                        fast=True), inf
        return self._measured(st, cands)

    def _cands(self, st: State, f: Facts) -> list[Candidate]:
        cands = st.cands
        if cands is None:
            # Only policy="auto" plans take a sampled ratio: a fixed policy's plans (and bytes)
            # do not depend on what calls measured.
            sampled = st.ratio if f.policy == "auto" else None
            ratio = self.forced_ratio or sampled or model.DEFAULT_RATIO
            width = st.width if f.policy == "auto" else ratios.DEFAULT_WIDTH
            formats = self.formats
            if formats is not None and f.policy == "auto":
                # This data's gain and kernel speeds, not the calibration sample's.
                params2 = formats.params
                if st.speed2 is not None:
                    fc, fa, fd = st.speed2
                    p1 = self.params
                    params2 = replace(p1, compress=p1.compress * fc, add=p1.add * fa,
                                      decompress=p1.decompress * fd)
                formats = Formats(params2, formats.gain if st.gain2 is None else st.gain2)
            cands = st.cands = candidates(f, self.params, ratio, width, self.options,
                                          formats)
        return cands

    def _measured(self, st: State, cands: list[Candidate]) -> tuple[Plan, float]:
        measured = {v: min(t) for v, t in st.times.items() if t}
        est = {c.plan.key: measured.get(c.plan.key, c.seconds) for c in cands}
        paths = _paths(cands, measured)

        def score(c: Candidate) -> float:
            v = c.plan.key
            # A prediction of a compressed path must beat the rest by the margin.
            return est[v] * (1.0 + MARGIN) if v != "raw" and v not in measured else est[v]

        best = min(paths, key=score)
        bv = best.plan.key
        # The loop measures every path in the format it runs, and the best path in its
        # other format too (no more trials than paths where compression loses).
        pool = paths + [c for c in cands
                        if c.plan.variant == best.plan.variant and c.plan.key != bv]
        trial = self._trial(st, pool, best, measured, est)
        pick = trial or best
        v = pick.plan.key
        t_raw = est["raw"]
        if trial is not None:
            why = (f"trial of {_label(v)} (predicted {_ms(pick.seconds)}, "
                   f"{'measured' if bv in measured else 'predicted'} {_label(bv)} "
                   f"{_ms(est[bv])})" if v not in measured
                   else f"{_label(v)} tried again ({_label(v)} {_ms(est[v])}, "
                        f"{_label(bv)} {_ms(est[bv])})")
        elif v in measured and len(measured) > 1:
            others = ", ".join(f"{_label(u)} {_ms(t)}" for u, t in measured.items() if u != v)
            why = f"measured faster: {_label(v)} {_ms(est[v])}, {others}"
        elif v == "raw":
            why = "predicted slower compressed"
        else:
            why = f"predicted {t_raw / est[v]:.2f}x faster compressed" + (
                " in two levels" if pick.plan.two_level else "")
        # Raw, measured, and no trial due: the next repeats may skip the agreement, until
        # the call at which a measured loser is due again.
        settled = v == "raw" and trial is None and "raw" in measured
        keys = {c.plan.key for c in pool}
        due = min((st.last_run.get(u, 0) + (1 << st.level.get(u, FIRST_LEVEL))
                   for u in measured if u != v and u in keys), default=math.inf)
        p = pick.plan
        fwhy = _format_why(pick, cands, est, measured, trial is not None) if p.compress \
            else p.format_reason
        return (Plan(p.variant, why, p.chunk_elems, p.pieces, p.split, p.version,
                     cands[0].seconds, est[v], p.ratio, trial is not None, settled,
                     fwhy), due)

    def _trial(self, st: State, cands: list[Candidate], best: Candidate,
               measured: dict[str, float], est: dict[str, float]) -> Candidate | None:
        """Return the candidate to try on this call instead of the best, or None (pure)."""
        bv = best.plan.key
        if bv not in measured:
            return None  # first measure what the model chose
        for c in cands:
            v = c.plan.key
            if v == bv:
                continue
            if v not in measured:
                # Untried (or its first run only): try it where the model finds it plausible.
                if c.seconds <= TRY_FACTOR * est[bv]:
                    return c
            elif st.calls >= st.last_run.get(v, 0) + (1 << st.level.get(v, FIRST_LEVEL)):
                return c
        return None


def _named(p: Plan, why: str) -> Plan:
    """``p`` chosen by a fixed rule (``why``), not by comparing predictions."""
    return Plan(p.variant, why, p.chunk_elems, p.pieces, p.split, p.version,
                format_reason=p.format_reason)


def _label(v: str) -> str:
    return {"raw": "raw", "flat": "compressed", "two levels": "two levels",
            "flat v2": "compressed in format 2", "two levels v2": "two levels in format 2"}[v]


