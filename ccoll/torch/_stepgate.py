"""Whole-step check of the DDP hook's ``policy="auto"``: compress only while steps are faster.

The collectives' own policy (ccoll.collectives.policy) prices each bucket's allreduce and
measures it against raw calls, but not what compressing costs the rest of the step: on a
machine whose cores the backward pass also needs, the compressor's CPU comes out of the
backward pass, and a bucket whose allreduce got faster can still make the step slower
(docs/dev/training-runs.md measured this at 10 Gbit/s). :class:`StepGate` compares whole steps:

- the first ``warmup + probe`` gated steps run ``"auto"`` (the collectives' policy decides
  per bucket; the first ``warmup`` steps compile and calibrate and are not measured), the
  next ``probe`` steps run ``"raw"`` (every bucket averaged exactly, by the hook through
  DDP's own allreduce);
- the mode whose median step time over its latest ``probe`` steps is lower (``"auto"`` by
  at least ``margin``, 5%: otherwise ``"raw"``, the safe side) wins and runs for
  ``probe * 2**level`` steps, then the other mode is tried again for ``probe`` steps; a try
  that loses raises ``level`` (at most ``max_level``), one that wins takes over at the
  first level;
- a try whose step took more than ``abort`` times the winner's median (1.3: more than
  twice the spread of one run's steps on a loaded machine) ends as soon as that step's
  time arrives (one step shows a loss that large; a slow link then costs one raw step per
  try, plus the steps of lag, not ``probe``);
- a raw try that cannot win is not made: the hook passes the least time a raw step can take
  (its buckets' ring allreduce at the link's calibrated bandwidth, halved for safety), and
  where the compressed steps' median is below that floor by the margin the raw try counts
  as lost without running (100 Mbit/s: a raw step of MiniLM's 90 MB takes at least 5 s
  where compressed steps take under 2 s; one such try cost more than the rest of a short
  run). ``raw_skipped`` counts them.

Blocks are counted in measured steps: the times arrive a step late (the hook's lag; the
gate takes any), so a block runs that many steps past its measured ones.

A step's time, as the hook measures it, runs from the queuing of its first bucket to the
end of its last bucket's average: the backward pass from the first gradient on, with the
averaging it hid and the part it did not. The time is each rank's; the gate takes the
maximum over ranks (the hook agrees on it, and the agreed time reaches the gate at the
next step), so every rank switches at the same step.

Pure and local: the hook feeds it agreed times and asks for the next step's mode.
"""

from __future__ import annotations

from collections import deque
from statistics import median

__all__ = ["StepGate"]

AUTO = "auto"
RAW = "raw"


class StepGate:
    """Choose per step between the hook's ``"auto"`` compression and ``"raw"`` averaging.

    Call :meth:`next` once at the start of every gated step; it returns that step's mode.
    Pass it the agreed seconds of the oldest gated step not yet measured, or ``None`` when
    no time has come in (the hook's times arrive a step late: the gate keeps the
    started steps in order and counts a block's steps as their times arrive).
    """

    def __init__(self, probe: int = 3, warmup: int = 1, first_level: int = 1,
                 max_level: int = 7, abort: float = 1.3, margin: float = 0.05) -> None:
        if probe < 1 or warmup < 0 or not 0 <= first_level <= max_level or abort <= 1.0 \
                or not 0.0 <= margin < 1.0:
            raise ValueError("StepGate needs probe >= 1, warmup >= 0, "
                             "0 <= first_level <= max_level, abort > 1 and 0 <= margin < 1")
        self.margin = margin
        self.probe = probe
        self.first_level = first_level
        self.max_level = max_level
        self.abort = abort
        self.level = first_level
        self.times: dict[str, deque[float]] = {AUTO: deque(maxlen=probe),
                                               RAW: deque(maxlen=probe)}
        self.steps = {AUTO: 0, RAW: 0}  # steps run in each mode
        self.raw_skipped = 0  # raw tries not made: auto's steps beat raw's floor
        self.raw_floor: float | None = None  # least seconds of a raw step (hook's estimate)
        self.switches = 0  # times the winner changed
        self.winner: str | None = None
        self._skip = warmup  # first auto steps, not measured
        # Started steps whose time has not come: (mode, counted, block).
        self._pending: deque[tuple[str, bool, int]] = deque()
        self._running: str | None = None
        # Current block: its number, mode, measured steps it needs and has, and whether it
        # tries the loser (or, before a winner, a mode not measured yet).
        self._block = 0
        self._mode = AUTO
        self._need = probe
        self._got = 0
        self._trial = True

    @property
    def mode(self) -> str:
        """The mode of the step in progress (of the next step before the first call)."""
        return self._running or self._mode

    def next(self, seconds: float | None, raw_floor: float | None = None) -> str:
        """Record the oldest unmeasured step's agreed ``seconds``; return this step's mode.

        ``raw_floor``: the least seconds a raw step can take (the same on every rank), or
        ``None`` where unknown (then every raw try is made).
        """
        if raw_floor is not None:
            self.raw_floor = raw_floor
        if seconds is not None and self._pending:
            mode, counted, block = self._pending.popleft()
            if counted:
                self.times[mode].append(float(seconds))
                if block == self._block:
                    self._got += 1
                    self._check_abort(mode, float(seconds))
        if self._got >= self._need:
            self._end_block()
        counted = not (self._mode == AUTO and self._skip > 0)
        if not counted:
            self._skip -= 1
        self._pending.append((self._mode, counted, self._block))
        self._running = self._mode
        self.steps[self._mode] += 1
        return self._mode

    def _median(self, mode: str) -> float | None:
        t = self.times[mode]
        return median(t) if t else None

    def _check_abort(self, mode: str, seconds: float) -> None:
        ref = self._median(RAW if mode == AUTO else AUTO)
        if self._trial and ref is not None and seconds > self.abort * ref:
            self._got = self._need  # this try has lost already

    def _end_block(self) -> None:
        auto, raw = self._median(AUTO), self._median(RAW)
        self._block += 1
        self._got = 0
        if auto is None or raw is None:  # a mode without a measured step: try it
            if auto is None:
                self._try(AUTO)
            elif self._raw_hopeless(auto):
                self._keep_auto()
            else:
                self._try(RAW)
            return
        # Compression must win by the margin: step times spread by more than the
        # differences that matter here, and a wrong "auto" costs more than a wrong "raw"
        # (ccoll is never to be slower than plain averaging; a little speed may be lost).
        best = AUTO if auto < raw * (1.0 - self.margin) else RAW
        if self._trial:
            if self.winner is not None and best != self.winner:
                self.switches += 1
                self.level = self.first_level
            elif self.winner is not None:
                self.level = min(self.level + 1, self.max_level)
            self.winner = best
            self._mode, self._need, self._trial = best, self.probe << self.level, False
        elif self.winner == AUTO and self._raw_hopeless(auto):
            self._keep_auto()  # the winner's run is over, and raw still cannot win
        else:  # the winner's run is over: try the other mode again
            self._try(RAW if self.winner == AUTO else AUTO)

    def _raw_hopeless(self, auto: float) -> bool:
        """Whether a raw step cannot beat ``auto``'s median: it wins only by the margin."""
        floor = self.raw_floor
        return floor is not None and auto < floor * (1.0 - self.margin)

    def _keep_auto(self) -> None:
        """Count a raw try as lost without running it; auto runs on, twice as long."""
        self.raw_skipped += 1
        if self.winner == AUTO:
            self.level = min(self.level + 1, self.max_level)
        self.winner = AUTO
        self._mode, self._need, self._trial = AUTO, self.probe << self.level, False

    def _try(self, mode: str) -> None:
        # A try is judged on its own steps only (an older, luckier time of the mode must
        # not outvote a step that was aborted for being slow).
        self.times[mode].clear()
        self._mode, self._need, self._trial = mode, self.probe, True
