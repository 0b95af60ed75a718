"""The measured feedback of ``policy="auto"`` as a state machine, driven by a stand-in clock.

Each simulated call goes as the Communicator runs it: the decision reads the state
(:meth:`Feedback.raw_reason`, else the model, which here always says "compress"), the
call's seconds come from the stand-in clock, and at the end of the call the state takes in
the previous call's seconds (what the agreement would have returned) and this call.
"""

from __future__ import annotations

import pytest

from ccoll.collectives.policy.auto import DECISION_MARGIN, AutoPolicy
from ccoll.collectives.policy.feedback import (
    FIRST_PATH_LEVEL,
    MAX_LEVEL,
    WINDOW,
    Feedback,
    FeedbackCall,
)

KEY = (1 << 24, "float32", "allreduce", "homomorphic", "REL", 1e-3)


class Sim:
    """One rank's calls of one key; ``clock(compressed) -> seconds`` stands in for the timer."""

    def __init__(self, clock, model_raw: float | None = 1.0, key=KEY) -> None:
        self.fb = Feedback(DECISION_MARGIN)
        self.clock = clock
        self.model_raw = model_raw
        self.key = key
        self.modes: list[str] = []

    def call(self, *, measured: bool = True) -> str:
        why = self.fb.raw_reason(self.key)
        compressed = why is None  # the model (stand-in) compresses whenever asked
        agreed = self.fb.outgoing()  # one rank: the maximum over ranks is its own value
        self.fb.end_call(agreed, FeedbackCall(self.key, compressed, measured,
                                              self.model_raw if compressed else None),
                         self.clock(compressed))
        mode = "C" if compressed else "R"
        self.modes.append(mode)
        return mode

    def run(self, n: int) -> str:
        for _ in range(n):
            self.call()
        return "".join(self.modes[-n:])


def test_compressed_slower_than_the_predicted_raw_goes_raw():
    # Compressed calls take 2 s, the model predicted raw at 1 s: the first compressed
    # call's time is agreed in the second call and applied at its end, so the third goes raw.
    sim = Sim(lambda c: 2.0 if c else 0.5)
    assert sim.run(3) == "CCR"
    assert "measured raw faster" in sim.fb.raw_reason(KEY)


def test_reprobe_schedule_doubles_up_to_the_cap():
    # Compressing always loses: raw runs of 2, 4, 8, ... calls between re-probes.
    sim = Sim(lambda c: 2.0 if c else 1.0)
    modes = sim.run(2 + 2 + 1 + 4 + 1 + 8 + 1 + 16 + 1)
    assert modes == "CC" + "RR" + "C" + "RRRR" + "C" + "R" * 8 + "C" + "R" * 16 + "C"
    # The wait stops growing at 2**MAX_LEVEL raw calls.
    sim.run(sum(1 << k for k in range(5, MAX_LEVEL + 1)) + (MAX_LEVEL - 4) + 3000)
    tail = "".join(sim.modes)
    runs = [len(r) for r in tail.split("C") if r]
    assert max(runs) == 1 << MAX_LEVEL
    assert runs[-2] == 1 << MAX_LEVEL  # the latest complete run


def test_back_to_compressed_when_a_reprobe_wins():
    slow = {"comp": 2.0}
    sim = Sim(lambda c: slow["comp"] if c else 1.0)
    assert sim.run(5) == "CCRRC"  # demoted, then a re-probe (still slow)
    slow["comp"] = 0.5  # the link got slower, say: compressing pays now
    # The next re-probe (after 4 raw calls) measures 0.5 s < 1 s raw: compress from then on.
    assert sim.run(4 + 1 + 1 + 5) == "RRRR" + "C" + "R" + "CCCCC"
    assert sim.fb.raw_reason(KEY) is None


def test_raw_reference_is_the_measured_raw_time_once_there_is_one():
    # Model raw prediction 10 s (badly high); raw really takes 1 s, compressed 1.5 s.
    # Against the prediction compressing wins by far, so no raw is measured and it stays
    # compressed; once a raw call is measured, the comparison is between measurements.
    sim = Sim(lambda c: 1.5 if c else 1.0, model_raw=10.0)
    assert sim.run(6) == "CCCCCC"
    sim.fb._entries[KEY].raw.append(1.0)  # as if a raw call of the key had been measured
    # The 6th call's 1.5 s is taken in at the end of the 7th: the 8th goes raw.
    assert sim.run(4) == "CRRC"


def _with_outlier(compressed: float, raw: float, outlier_mode: bool, nth: int, value: float):
    """A clock whose ``nth`` call of one mode (compressed or raw) takes ``value``."""
    seen = {True: 0, False: 0}

    def clock(c: bool) -> float:
        seen[c] += 1
        if c == outlier_mode and seen[c] == nth:
            return value
        return compressed if c else raw

    return clock


def test_a_slow_raw_call_does_not_bring_a_losing_size_back():
    # The 2nd raw call is slowed down (another job, a page-cache flush): 100 s. The
    # re-probe's 2 s still loses against the other raw calls' 1 s.
    plain = Sim(lambda c: 2.0 if c else 1.0).run(19)
    sim = Sim(_with_outlier(2.0, 1.0, False, 2, 100.0))
    assert sim.run(19) == plain == "CC" + "RR" + "C" + "RRRR" + "C" + "R" * 8 + "C"


def test_a_slow_compressed_call_does_not_send_a_winning_size_raw():
    sim = Sim(_with_outlier(0.5, 1.0, True, 4, 100.0), model_raw=1.0)
    assert sim.run(12) == "C" * 12


def test_a_lasting_change_takes_over_after_the_window():
    slow = {"comp": 0.5}
    sim = Sim(lambda c: slow["comp"] if c else 1.0, model_raw=1.0)
    assert sim.run(5) == "C" * 5
    slow["comp"] = 2.0  # from the 6th call on, compressing loses
    # WINDOW slow calls fill the window; the last of them is taken in two calls later.
    assert sim.run(WINDOW + 1 + 2) == "C" * (WINDOW + 1) + "RR"


def test_a_thin_win_against_the_model_measures_raw_once():
    # Compressed 0.95 s against a predicted raw of 1.0 s: within the decision margin, so
    # one raw call is measured (0.8 s), and compressing, now known to lose, stops.
    sim = Sim(lambda c: 0.95 if c else 0.8, model_raw=1.0)
    assert sim.run(5) == "CC" + "R" + "C" + "R"
    assert "raw 800 ms;" in sim.fb.raw_reason(KEY)  # measured, not predicted
    assert sim.run(2) == "RC"  # then the re-probe


def test_a_clear_win_against_the_model_measures_nothing_more():
    sim = Sim(lambda c: 0.5 if c else 0.8, model_raw=1.0)
    assert sim.run(8) == "C" * 8


def test_calls_with_a_calibration_are_not_timed():
    sim = Sim(lambda c: 100.0 if c else 1.0)
    sim.call(measured=False)  # e.g. the first call, which calibrated: its 100 s say nothing
    assert sim.fb.outgoing() == 0.0
    sim.fb.end_call(0.0, FeedbackCall(KEY, True, True, 1.0), 0.5)
    assert sim.fb.outgoing() == 0.5
    assert sim.fb.raw_reason(KEY) is None


def test_the_agreed_time_decides_not_this_ranks():
    # This rank measured its compressed call fast, but the agreement returns a slower rank's
    # time: the state follows the agreed one (the same on every rank).
    fb = Feedback(DECISION_MARGIN)
    fb.end_call(0.0, FeedbackCall(KEY, True, True, 1.0), 0.1)
    assert fb.outgoing() == 0.1
    fb.end_call(3.0, FeedbackCall(KEY, True, True, 1.0), 0.1)
    assert fb.raw_reason(KEY) is not None


def test_the_measure_hook_replaces_this_ranks_seconds():
    fb = Feedback(DECISION_MARGIN)
    fb.measure = lambda compressed, s: 7.0 if compressed else s
    fb.end_call(0.0, FeedbackCall(KEY, True, True, None), 0.1)
    assert fb.outgoing() == 7.0


def test_keys_are_independent():
    sim = Sim(lambda c: 2.0 if c else 1.0)
    sim.run(3)
    other = KEY[:-1] + (1e-2,)
    assert sim.fb.raw_reason(KEY) is not None and sim.fb.raw_reason(other) is None


def test_a_call_outside_the_feedback_still_carries_the_previous_time_in():
    # A policy="raw" call between two auto calls: it carries the auto call's time and the
    # state takes it in at its end.
    fb = Feedback(DECISION_MARGIN)
    fb.end_call(0.0, FeedbackCall(KEY, True, True, 1.0), 2.0)
    fb.end_call(2.0, None, 0.01)
    assert fb.outgoing() == 0.0
    assert fb.raw_reason(KEY) is not None


def test_a_call_without_an_agreed_time_leaves_the_previous_one_pending():
    fb = Feedback(DECISION_MARGIN)
    fb.end_call(0.0, FeedbackCall(KEY, True, True, 1.0), 2.0)
    fb.end_call(None, None, 0.01)  # nothing agreed: the 2 s are still to be sent
    assert fb.outgoing() == 2.0 and fb.raw_reason(KEY) is None
    fb.end_call(2.0, None, 0.01)
    assert fb.raw_reason(KEY) is not None


def test_auto_policy_holds_one_feedback_with_the_decision_margin():
    from types import SimpleNamespace

    pol = AutoPolicy(SimpleNamespace(comm=None, timeout=None, name="stub", failed=None))  # type: ignore[arg-type]
    assert isinstance(pol.feedback, Feedback) and pol.feedback.margin == DECISION_MARGIN
    assert pol.calibrations == 0


@pytest.mark.parametrize("level", [1, 3, MAX_LEVEL])
def test_reason_names_the_wait(level):
    sim = Sim(lambda c: 2.0 if c else 1.0)
    sim.run(3)
    e = sim.fb._entries[KEY]
    e.level, e.wait = level, 1 << level
    assert f"after {1 << level} more raw calls" in sim.fb.raw_reason(KEY)


def test_describe_names_the_keys_readably():
    import numpy as np

    from ccoll.errorbound import REL

    key = (1 << 22, np.dtype(np.float32), "allreduce", "homomorphic", REL, 1e-3)
    sim = Sim(lambda c: 2.0 if c else 1.0, key=key)
    sim.run(3)
    got = sim.fb.describe()["allreduce homomorphic float32[4194304] REL(0.001)"]
    assert got["demoted"] and got["compressed_s"] == 2.0 and got["wait"] == 1  # 1 of 2 done


class PathSim(Sim):
    """A hierarchical grouping: compressed calls run two levels ("T") or the flat ring ("F").

    ``clock(mode)`` with mode "T", "F" or "R" (raw); the model's path is ``model_two``.
    """

    def __init__(self, clock, model_two: bool = True, model_raw: float | None = 1.0) -> None:
        super().__init__(clock, model_raw)
        self.model_two = model_two

    def call(self, *, measured: bool = True) -> str:
        why = self.fb.raw_reason(self.key)
        compressed = why is None
        two = self.fb.path(self.key, self.model_two)[0] if compressed else None
        mode = "R" if not compressed else ("T" if two else "F")
        agreed = self.fb.outgoing()
        self.fb.end_call(agreed, FeedbackCall(self.key, compressed, measured,
                                              self.model_raw if compressed else None, two),
                         self.clock(mode))
        self.modes.append(mode)
        return mode


def test_two_levels_slower_than_the_flat_ring_falls_back_to_flat():
    # The model picks two levels; it measures 0.75 s, the flat ring 0.2 s: after one
    # measured call of each (times agreed two calls on), every call runs the flat ring.
    sim = PathSim({"T": 0.75, "F": 0.2, "R": 0.8}.get)
    assert sim.run(8) == "TTFT" + "FFFF"
    two, why = sim.fb.path(KEY, True)
    assert not two and "flat ring: measured faster" in why and "750 ms" in why
    assert sim.fb.describe()[next(iter(sim.fb.describe()))]["flat_ring_s"] == 0.2


def test_two_levels_faster_stays_two_levels():
    sim = PathSim({"T": 0.1, "F": 0.2, "R": 0.8}.get)
    assert sim.run(8) == "TTFT" + "TTTT"
    assert sim.fb.path(KEY, False) == (True, "two levels: measured faster "
                                              "(two levels 100 ms, flat ring 200 ms)")


def test_the_model_choosing_flat_tries_two_levels_once():
    sim = PathSim({"T": 0.1, "F": 0.2, "R": 0.8}.get, model_two=False)
    assert sim.run(8) == "FFTF" + "TTTT"


def test_both_paths_slower_than_raw_go_raw():
    # Two levels lose to the model's raw prediction (1 s): raw, and the re-probe after the
    # wait tries the flat ring, which loses too.
    sim = PathSim({"T": 2.0, "F": 1.5, "R": 0.5}.get)
    assert sim.run(19) == "TTRR" + "F" + "RRRR" + "F" + "R" * 8 + "F"
    sim.run(2)
    assert "measured raw faster" in sim.fb.raw_reason(KEY)


def test_a_slow_exploration_keeps_the_better_compressed_time_against_raw():
    # The flat ring's one exploratory call is slower than raw; two levels are faster than
    # raw: the key is not demoted, and two levels stay.
    sim = PathSim({"T": 0.3, "F": 1.5, "R": 0.8}.get)
    assert sim.run(10) == "TTFT" + "T" * 6
    assert sim.fb.raw_reason(KEY) is None


def test_without_two_paths_nothing_changes():
    # two_level None (one compressed path): path() answers the model's choice.
    sim = Sim(lambda c: 0.2 if c else 1.0)
    sim.run(5)
    assert sim.fb.path(KEY, True) == (True, "") and sim.fb.path(KEY, False) == (False, "")


def test_the_slower_path_is_tried_again_after_doubling_waits():
    # After the first exploration, the slower path runs again after 8, then 16, ... calls
    # of the faster one (FIRST_PATH_LEVEL = 3), at most 2**MAX_LEVEL.
    sim = PathSim({"T": 0.75, "F": 0.2, "R": 0.8}.get)
    k = FIRST_PATH_LEVEL
    want = "TTFT" + "F" * (1 << k) + "T" + "F" * (1 << (k + 1)) + "T" + "F" * (1 << (k + 2))
    assert sim.run(len(want)) == want
    assert sim.fb.path(KEY, False) == (
        True, "two levels tried again (two levels 750 ms, flat ring 200 ms)")


def test_one_slowed_exploration_does_not_decide_for_good():
    # The flat ring's first call was slowed to 3 s by something else; two levels take
    # 0.75 s, the flat ring really 0.2 s: its next try (after 8 calls) wins it back.
    flat_calls = []

    def clock(mode):
        if mode == "F":
            flat_calls.append(1)
            return 3.0 if len(flat_calls) == 1 else 0.2
        return {"T": 0.75, "R": 0.8}[mode]

    sim = PathSim(clock)
    modes = sim.run(4 + 8 + 1 + 2 + 6)
    assert modes[:13] == "TTFT" + "T" * 8 + "F"
    assert modes[-6:] == "F" * 6
    two, why = sim.fb.path(KEY, True)
    assert not two and "flat ring: measured faster" in why
