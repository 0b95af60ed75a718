"""One plan per call: the measured loop of ``policy="auto"``, driven by a stand-in clock.

Each simulated call runs as the Communicator runs it: before the agreement the rank reads
its unagreed times (:meth:`Planner.unsent`); the agreement returns the maximum over ranks
(here the ranks are simulated side by side, each with its own clock); the plan is made
from the agreed numbers; the call's seconds come from the rank's clock; :meth:`Planner.end`
counts it. A call whose plan is fast runs without an agreement (its time stays unagreed).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ccoll.collectives import model
from ccoll.collectives.policy.plan import (
    FEWER_BYTES,
    FIRST_LEVEL,
    MAX_LEVEL,
    VARIANTS,
    Facts,
    Formats,
    Options,
    Plan,
    Planner,
    candidates,
)

MiB = 1 << 20
# A link where the model finds 64 MiB of float32 at ratio 16 clearly faster compressed,
# and one where it finds raw clearly faster.
SLOW = replace(model.DEFAULTS, beta=1.25e8)
FAST = replace(model.DEFAULTS, beta=5e9, alpha=5e-6)  # raw whatever the ratio
# 10 Gbit/s and a fast compressor: at a ratio of 1.1 the model prices raw a little faster.
MID = replace(model.DEFAULTS, beta=1.25e9, compress=8e9, add=16e9, decompress=16e9)
FACTS = Facts("allreduce", 16 * MiB, 4, "auto", "homomorphic", False, False, False, False, 4)
KEY = ("allreduce", 16 * MiB)


class Ranks:
    """``n`` ranks' planners of one channel, fed the same agreed numbers."""

    def __init__(self, p: model.Params, clocks: list, *, facts: Facts = FACTS,
                 hier: tuple[int, int] | None = None, ratio: float = 16.0,
                 formats: Formats | None = None) -> None:
        self.planners = [Planner(p, Options(None, None, "auto", hier), 7, formats=formats)
                         for _ in clocks]
        self.clocks = clocks  # per rank: candidate (Plan.key) -> seconds
        self.facts = facts
        self.ratio = ratio
        self.log: list[Plan] = []
        self.fast: list[bool] = []

    def call(self) -> Plan:
        states = [pl.state(KEY, self.facts) for pl in self.planners]
        fast = [pl.fast(KEY) for pl in self.planners]
        assert len({f is None for f in fast}) == 1, "ranks disagree on the fast path"
        if fast[0] is not None:
            plans = [st.cached for st in states]
        else:
            digests = {pl.digest(st) for pl, st in zip(self.planners, states, strict=True)}
            assert len(digests) == 1, "ranks' plan states differ"
            sent = [pl.unsent(st) for pl, st in zip(self.planners, states, strict=True)]
            agreed = tuple(max(s[i] for s in sent) for i in range(len(VARIANTS)))
            sample = self.ratio if self.planners[0].needs_ratio(states[0], self.facts) else None
            plans = [pl.plan(st, self.facts, ratio=sample, width=3.0, times=agreed)
                     for pl, st in zip(self.planners, states, strict=True)]
        assert all(p == plans[0] for p in plans), "ranks planned differently"
        for pl, st, p, clock in zip(self.planners, states, plans, self.clocks, strict=True):
            pl.end(st, p, clock(p.key))
        self.log.append(plans[0])
        self.fast.append(fast[0] is not None)
        return plans[0]

    def run(self, n: int) -> str:
        """``n`` calls; one letter per call: R raw, C compressed, T two levels (V, W: the
        same in format 2)."""
        letters = {"raw": "R", "flat": "C", "two levels": "T", "flat v2": "V",
                   "two levels v2": "W"}
        return "".join(letters[self.call().key] for _ in range(n))


def times(raw: float, flat: float, two: float = 9.0):
    table = {"raw": raw, "flat": flat, "two levels": two}
    return lambda v: table[v]


def test_model_says_compress_and_the_measurements_agree():
    r = Ranks(SLOW, [times(1.0, 0.2), times(1.1, 0.25)])
    # Compressed from the start; raw is not tried (predicted far slower than measured).
    assert r.run(12) == "C" * 12
    assert r.log[-1].reason.startswith("predicted")
    assert not any(r.fast)


def test_compressed_measured_slower_than_raw_is_demoted_then_retried_less_often():
    # The model says compress, but compressed calls take 2 s and raw ones 0.5 s.
    r = Ranks(SLOW, [times(0.5, 2.0), times(0.6, 1.9)])
    seq = r.run(80)
    # Two compressed runs (the first is not measured), then the agreed 2 s lose against
    # the predicted raw time: raw.
    assert seq.startswith("CCR")
    tail = seq[2:]
    # The loser comes back after 4, 8, 16, ... calls of the signature.
    gaps = [i for i, c in enumerate(tail) if c == "C"]
    diffs = [b - a for a, b in zip(gaps, gaps[1:], strict=False)]
    assert diffs == sorted(diffs) and len(set(diffs)) == len(diffs), (seq, diffs)
    assert "measured faster: raw" in r.log[-1].reason or r.log[-1].trial


def test_a_raw_size_the_model_underrated_is_promoted():
    # The model prices raw faster (fast link), compressed measures faster anyway.
    r = Ranks(MID, [times(1.0, 0.4), times(1.0, 0.5)], ratio=1.1)
    first = r.call()
    assert first.variant == "raw" and first.reason == "predicted slower compressed"
    seq = r.run(30)
    # raw measured (its second run), then the compressed trial (two runs), then compressed,
    # with raw tried again now and then.
    assert seq[:4] == "RCCC", seq
    best = [p for p in r.log[4:] if not p.trial]
    assert best and all(p.variant == "flat" for p in best)
    assert best[-1].reason.startswith("measured faster: compressed")


def test_a_settled_raw_signature_runs_fast_until_a_retry_is_due():
    r = Ranks(MID, [times(1.0, 1.5), times(1.0, 1.6)], ratio=1.1)
    seq = r.run(60)
    fast = r.fast
    # Fast calls are raw, never a trial, and there are many of them.
    assert all(v == "R" for v, f in zip(seq, fast, strict=True) if f)
    assert sum(fast) > 30
    # The call right after a compressed trial is never fast: its time must be agreed.
    for i, c in enumerate(seq[:-1]):
        if c == "C":
            assert not fast[i + 1]


def test_the_retry_wait_is_capped():
    r = Ranks(MID, [times(1.0, 1.5)], ratio=1.1)
    seq = r.run(6000)
    gaps = [b - a for a, b in zip(
        [i for i, c in enumerate(seq) if c == "C"],
        [i for i, c in enumerate(seq) if c == "C"][1:], strict=False)]
    assert max(gaps) <= (1 << MAX_LEVEL) + 3
    assert min(gaps[2:]) >= 1 << FIRST_LEVEL


@pytest.mark.parametrize("formats", [None, Formats(SLOW, 2.0)], ids=["format 1", "both"])
def test_ranks_with_different_clocks_plan_alike(formats):
    # Each rank's own times differ, sometimes a lot; the agreed maxima decide everywhere
    # (with both formats, between them too).
    import random

    rng = random.Random(3)
    base = {"raw": 1.0, "flat": 0.9, "flat v2": 0.92}
    clocks = [lambda v, k=k: base[v] * (1 + rng.random() * k) for k in (0.0, 0.5, 2.0)]
    r = Ranks(SLOW, clocks, formats=formats)
    seq = r.run(300)  # Ranks.call asserts identical plans, digests and fast decisions
    if formats is not None:
        assert "C" in seq and "V" in seq, seq


def test_a_first_run_is_not_measured():
    # Compressed runs: the first takes 50 s (kernels load), the rest 0.1 s; raw 1 s.
    seen = {"n": 0}

    def clock(v):
        if v == "flat":
            seen["n"] += 1
            return 50.0 if seen["n"] == 1 else 0.1
        return 1.0

    r = Ranks(SLOW, [clock])
    assert r.run(10) == "C" * 10


def test_two_levels_against_the_flat_ring_by_measurement():
    facts = FACTS._replace(ranks=4)
    # The model prefers two levels on a slow shared link; measured, flat is faster.
    r = Ranks(SLOW, [times(5.0, 0.5, 1.0)], facts=facts, hier=(2, 2))
    assert r.call().variant == "two levels"
    r.run(40)
    best = [p for p in r.log[-10:] if not p.trial]
    assert best and all(p.variant == "flat" for p in best)
    assert "measured faster: compressed" in best[-1].reason
    assert any(p.trial and p.variant == "two levels" for p in r.log)  # tried again


def test_fixed_policies_ignore_measurements():
    f = FACTS._replace(policy="compress")
    r = Ranks(FAST, [times(0.1, 50.0)], facts=f)
    plans = {r.call() for _ in range(20)}
    assert len(plans) == 1 and next(iter(plans)).compress
    assert next(iter(plans)).reason == 'policy="compress"'


def test_a_raw_whatever_call_is_fast_from_its_second_call():
    tiny = FACTS._replace(elements=16)
    r = Ranks(SLOW, [times(1e-5, 1.0)], facts=tiny)
    assert r.run(5) == "RRRRR"
    assert r.fast == [False, True, True, True, True]
    assert r.log[0].reason == "too small to gain"


def test_the_digest_follows_every_agreed_change():
    pl = Planner(SLOW, Options(None, None, "auto", None), 7)
    st = pl.state(KEY, FACTS)
    d0 = pl.digest(st)
    p = pl.plan(st, FACTS, ratio=16.0, width=3.0)
    d1 = pl.digest(st)
    assert d1 != d0
    pl.end(st, p, 1.0)
    d2 = pl.digest(st)
    assert d2 != d1
    pl.plan(st, FACTS, times=(0.0, 1.0, 0.0))
    assert pl.digest(st) != d2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_sampled_ratio_that_is_not_a_ratio_is_ignored(bad):
    pl = Planner(SLOW, Options(None, None, "auto", None), 7)
    st = pl.state(KEY, FACTS)
    p = pl.plan(st, FACTS, ratio=bad)
    assert p.ratio == model.DEFAULT_RATIO and st.ratio is None


# ------------------------------------------------------------------- the stream format

def _plan_of(p: model.Params, formats, *, facts: Facts = FACTS, version=None,
             schedule: str = "auto", ratio: float = 16.0) -> Plan:
    pl = Planner(p, Options(None, None, schedule, None, version), 7, formats=formats)
    st = pl.state(KEY, facts)
    return pl.plan(st, facts, ratio=ratio)


def test_a_rel_bounds_range_pass_is_priced_in_compressed_paths_only():
    # A REL bound on host data: a call that may compress first scans its data for the
    # range (size / scan seconds); raw calls do not. The same in model.predict.
    size = 16 * MiB * 4
    opts = Options(None, None, "auto", None)
    plain = candidates(FACTS, SLOW, 16.0, 1.0, opts)
    ranged = candidates(FACTS._replace(ranged=True), SLOW, 16.0, 1.0, opts)
    assert ranged[0].seconds == plain[0].seconds  # raw
    for a, b in zip(plain[1:], ranged[1:], strict=True):
        assert b.seconds == pytest.approx(a.seconds + size / SLOW.scan)
    pred = model.predict(size, 4, SLOW, 16.0)
    with_scan = model.predict(size, 4, SLOW, 16.0, ranged=True)
    assert with_scan.raw == pred.raw
    assert with_scan.homomorphic == pytest.approx(pred.homomorphic + size / SLOW.scan)
    assert with_scan.dar == pytest.approx(pred.dar + size / SLOW.scan)
    # A scan slow enough turns a compressed plan raw.
    slow_scan = replace(SLOW, scan=size / (2 * plain[0].seconds))
    assert Planner(slow_scan, opts, 7).raw_whatever(FACTS._replace(ranged=True))
    assert not Planner(slow_scan, opts, 7).raw_whatever(FACTS)


def test_format_2_where_its_bytes_pay_on_a_slow_link():
    # The same kernel rates, twice the ratio: on a slow link the model sends format 2.
    formats = Formats(SLOW, 2.0)
    plan = _plan_of(SLOW, formats)
    assert plan.compress and plan.version == 2 and plan.pieces == 0
    assert plan.format_reason.startswith("predicted ") and "format 1 " in plan.format_reason
    assert plan.ratio == 32.0  # format 1's sampled ratio times the gain


def test_format_1_where_format_2s_kernels_cost_more_than_its_bytes_save():
    # A fast link and format-2 kernels ten times slower for 5% fewer bytes: format 1.
    fast_link = replace(model.DEFAULTS, beta=1.25e9)
    slow2 = replace(fast_link, compress=fast_link.compress / 10, add=fast_link.add / 10,
                    decompress=fast_link.decompress / 10)
    plan = _plan_of(fast_link, Formats(slow2, 1.05), facts=FACTS._replace(policy="compress"))
    assert plan.compress and plan.version == 1


def test_format_forced_unknown_and_device():
    formats = Formats(SLOW, 2.0)
    forced = _plan_of(SLOW, formats, version=1)
    assert forced.version == 1 and forced.format_reason == "format_version=1"
    forced2 = _plan_of(SLOW, None, version=2)  # forced without a calibration of format 2
    assert forced2.version == 2 and forced2.format_reason == "format_version=2"
    assert _plan_of(SLOW, None).version == 1  # format 2 never measured: format 1
    dev = _plan_of(SLOW, formats, facts=FACTS._replace(device=True))
    assert dev.compress and dev.version == 1


def test_halving_compares_both_formats_like_the_ring():
    # Recursive halving cuts and joins either format: the plan prices both, picks format 2
    # where its bytes pay (as the ring does on the same slow link) and keeps the halving.
    formats = Formats(SLOW, 2.0)
    plan = _plan_of(SLOW, formats, schedule="halving")
    assert plan.compress and plan.version == 2 and plan.pieces > 0
    assert plan.format_reason.startswith("predicted ") and "format 1 " in plan.format_reason
    forced = _plan_of(SLOW, None, schedule="halving", version=2)
    assert forced.version == 2 and forced.pieces > 0
    fast_link = replace(model.DEFAULTS, beta=1.25e9)
    slow2 = replace(fast_link, compress=fast_link.compress / 10, add=fast_link.add / 10,
                    decompress=fast_link.decompress / 10)
    one = _plan_of(fast_link, Formats(slow2, 1.05), schedule="halving",
                   facts=FACTS._replace(policy="compress"))
    assert one.compress and one.version == 1 and one.pieces > 0


def test_format_2s_calibration_is_in_the_plans_digest():
    from ccoll.collectives.policy.calibration import Calibration

    a = Calibration(SLOW, "settings", "cache", format2=SLOW, gain2=2.0)
    b = Calibration(SLOW, "settings", "cache", format2=SLOW, gain2=2.5)
    c = Calibration(SLOW, "settings", "cache")
    assert len({a.digest, b.digest, c.digest}) == 3
    assert c.formats is None and a.formats == Formats(SLOW, 2.0)


def test_the_sampled_gain_of_this_data_replaces_the_calibrations():
    # Format 2's kernels a little slower: at the calibration's gain (1.0) format 1 wins,
    # this call's data shows 3x fewer bytes: on a slow link the plan prices format 2 at
    # the sampled gain, and the gain is part of the agreed state (the digest).
    fast_link = SLOW
    slow2 = replace(SLOW, compress=SLOW.compress * 0.7, add=SLOW.add * 0.7,
                    decompress=SLOW.decompress * 0.7)
    formats = Formats(slow2, 1.0)
    pl = Planner(fast_link, Options(None, None, "auto", None, None), 7, formats=formats)
    facts = FACTS._replace(policy="compress")
    st = pl.state(KEY, facts)
    d0 = pl.digest(st)
    assert pl.plan(st, facts, ratio=4.0).version == 1
    pl2 = Planner(fast_link, Options(None, None, "auto", None, None), 7, formats=formats)
    st2 = pl2.state(KEY, FACTS)
    plan = pl2.plan(st2, FACTS, ratio=4.0, gain2=3.0)
    assert plan.version == 2 and plan.ratio == 12.0, plan
    assert pl2.digest(st2) != d0
    # A fixed policy's plans never take a sample: the calibration's gain stays.
    pl3 = Planner(fast_link, Options(None, None, "auto", None, None), 7, formats=formats)
    st3 = pl3.state(KEY, facts)
    assert pl3.plan(st3, facts, ratio=4.0, gain2=3.0).version == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_a_sampled_gain_that_is_not_a_gain_is_ignored(bad):
    pl = Planner(SLOW, Options(None, None, "auto", None), 7, formats=Formats(SLOW, 2.0))
    st = pl.state(KEY, FACTS)
    p = pl.plan(st, FACTS, ratio=16.0, gain2=bad)
    assert st.gain2 is None and p.ratio == 32.0


def test_sampled_gain2_matches_the_whole_arrays_streams():
    # The gain sampled on runs of blocks is close to the gain of compressing all of it.
    from ccoll.bench import load_gradients
    from ccoll.collectives.policy.fits import sampled_format2
    from ccoll.compressor.api import add, compress_abs, decompress

    x = load_gradients("datasets/minilm.h5", 0)[: 1 << 20]
    for rel in (1e-3, 1e-2):
        eb = rel * float(x.max() - x.min())
        whole = compress_abs(x, eb, version=1).nbytes / compress_abs(x, eb, version=2).nbytes
        got = sampled_format2(x, eb, 2048, (compress_abs, add, decompress)).gain
        assert abs(got / whole - 1) < 0.15, (rel, got, whole)


# Format 1's constants of the hand-priced calls below: no latency, 1 Gbit/s, compress 1,
# add 2, decompress 4 GB/s; one chunk, no split, the ring (no halving).
HAND = replace(model.DEFAULTS, alpha=0.0, beta=1.25e8, compress=1e9, add=2e9, decompress=4e9)
HAND_OPTS = Options(16 * MiB, 0.0, "ring", None, None)
HAND_FACTS = Facts("allreduce", 16 * MiB, 4, "auto", "homomorphic", False, False, False,
                   False, 4)


def _hand_seconds(r: float, c: float, a: float, d: float) -> float:
    """docs/model.md's homomorphic ring by hand: 64 MiB on 4 ranks, one chunk, width 3.

    ``S/c + 3/4 S/a`` (compress, adds) + ``3/4 S/(r beta)`` (the reduce-scatter) +
    ``max(3/4 S/(r_sum beta), S/4/d) + 3/4 S/d`` (allgather, decode), ``r_sum = r 4/5``
    (a sum of 4 streams: codes ``0.5 log2 4 = 1`` bit wider than width 3, so 4 words a
    block become 5), plus the fixed cost of a call.
    """
    s, b = 64.0 * MiB, 1.25e8
    return (HAND.overhead + s / c + 0.75 * s / a + 0.75 * s / (r * b)
            + max(0.75 * s / (r * 0.8 * b), 0.25 * s / d) + 0.75 * s / d)


@pytest.mark.parametrize("calibrated, speed2, version", [
    # The calibration's format-2 kernels at a quarter of format 1's speed would keep
    # format 1; this data's sample finds them as fast: format 2's half bytes win.
    (0.25, (1.0, 1.0, 1.0), 2),
    # The calibration's format 2 as fast as format 1 would send format 2; this data's
    # sample finds every kernel at half speed: the kernels cost more than the bytes save.
    (1.0, (0.5, 0.5, 0.5), 1),
    # Faster compress and decompress, a slower add (as at loose bounds): format 2.
    (0.25, (1.25, 0.5, 1.25), 2),
])
def test_sampled_speed_factors_replace_the_calibrations_format_2_rates(calibrated, speed2,
                                                                      version):
    r, gain = 16.0, 2.0
    slow2 = replace(HAND, compress=HAND.compress * calibrated, add=HAND.add * calibrated,
                    decompress=HAND.decompress * calibrated)
    fc, fa, fd = speed2
    t1 = _hand_seconds(r, 1e9, 2e9, 4e9)
    t2 = _hand_seconds(r * gain, 1e9 * fc, 2e9 * fa, 4e9 * fd)
    t2_cal = _hand_seconds(r * gain, 1e9 * calibrated, 2e9 * calibrated, 4e9 * calibrated)
    # The calibration's rates alone would choose the other format.
    assert (t2 < t1) == (version == 2) and (t2_cal < t1) == (version == 1)
    pl = Planner(HAND, HAND_OPTS, 7, formats=Formats(slow2, 1.0))
    st = pl.state(KEY, HAND_FACTS)
    d0 = pl.digest(st)
    plan = pl.plan(st, HAND_FACTS, ratio=r, width=3.0, gain2=gain, speed2=speed2)
    assert plan.variant == "flat" and plan.version == version, plan
    assert plan.ratio == (r * gain if version == 2 else r)
    assert plan.predicted == pytest.approx(min(t1, t2), rel=1e-12)
    assert f"format {3 - version} {max(t1, t2) * 1e3:.3g} ms" in plan.format_reason
    # The factors are part of the agreed state: another sample, another fingerprint.
    other = Planner(HAND, HAND_OPTS, 7, formats=Formats(slow2, 1.0))
    st2 = other.state(KEY, HAND_FACTS)
    assert other.digest(st2) == d0
    other.plan(st2, HAND_FACTS, ratio=r, width=3.0, gain2=gain,
               speed2=(fc, fa, fd * 1.001))
    assert other.digest(st2) != pl.digest(st)


@pytest.mark.parametrize("bad", [(float("inf"),) * 3, (1.0, float("nan"), 1.0),
                                 (1.0, 0.0, 1.0), (-1.0, 1.0, 1.0), None])
def test_speed_factors_that_are_not_factors_keep_the_calibrations_rates(bad):
    # No sample (+inf from the agreement) or a broken one: format 2 priced as today, with
    # the calibration's rates, here a quarter of format 1's: format 1.
    slow2 = replace(HAND, compress=HAND.compress / 4, add=HAND.add / 4,
                    decompress=HAND.decompress / 4)
    pl = Planner(HAND, HAND_OPTS, 7, formats=Formats(slow2, 1.0))
    st = pl.state(KEY, HAND_FACTS)
    plan = pl.plan(st, HAND_FACTS, ratio=16.0, width=3.0, gain2=2.0, speed2=bad)
    assert st.speed2 is None and plan.version == 1
    assert plan.predicted == pytest.approx(_hand_seconds(16.0, 1e9, 2e9, 4e9), rel=1e-12)


def test_a_fixed_policy_never_takes_the_sampled_speeds():
    slow2 = replace(HAND, compress=HAND.compress / 4, add=HAND.add / 4,
                    decompress=HAND.decompress / 4)
    facts = HAND_FACTS._replace(policy="compress")
    pl = Planner(HAND, HAND_OPTS, 7, formats=Formats(slow2, 2.0))
    st = pl.state(KEY, facts)
    plan = pl.plan(st, facts, ratio=16.0, width=3.0, gain2=2.0, speed2=(1.0, 1.0, 1.0))
    # At the default ratio, the calibration's gain and rates: format 2 loses.
    r = model.DEFAULT_RATIO
    assert _hand_seconds(2 * r, 0.25e9, 0.5e9, 1e9) > _hand_seconds(r, 1e9, 2e9, 4e9)
    assert plan.version == 1


def test_sampled_format2_times_both_formats_on_one_sample(monkeypatch):
    # A stand-in clock whose every reading advances by a step that doubles per reading
    # (so a later timing is longer): format 1's kernels are timed first (compress, add,
    # decompress, two runs each), then format 2's with the same order; the factors are
    # format 1's least time over format 2's, by hand from the readings' order.
    from ccoll.collectives.policy import fits
    from ccoll.compressor.api import add, compress_abs, decompress

    ticks = iter(2.0 ** k for k in range(64))
    monkeypatch.setattr(fits, "_clock", lambda: next(ticks))
    monkeypatch.setattr(fits, "SPEED_REPS", 2)
    x = np.linspace(-1.0, 1.0, 32 * fits.GAIN_MIN_BLOCKS * 2, dtype=np.float32)
    got = fits.sampled_format2(x, 1e-3, 64, (compress_abs, add, decompress))
    # Reading pairs (2j, 2j+1) time a run: 2**(2j+1) - 2**(2j) = 2**(2j). Format 1's least
    # runs: j = 0 (compress), 2 (add), 4 (decompress); format 2's: j = 6, 8, 10.
    assert got.speed == (2.0 ** -12, 2.0 ** -12, 2.0 ** -12)
    s = fits._gain_sample(x, 64)
    assert got.gain == ((compress_abs(s, 1e-3, version=1).nbytes - 64)
                        / (compress_abs(s, 1e-3, version=2).nbytes - 64))


def test_sampled_format2_times_the_kernels_on_one_thread_by_its_cpu_time():
    # Ranks that share cores sample at once: the kernels run on the calling thread alone,
    # timed by its CPU time, each SPEED_REPS times; the caller's thread count comes back.
    import time

    import numba

    from ccoll.collectives.policy import fits
    from ccoll.compressor.api import add, compress_abs, decompress

    assert fits._clock is time.thread_time
    seen = []

    def spy(f):  # type: ignore[no-untyped-def]
        def run(*a, **k):  # type: ignore[no-untyped-def]
            seen.append(numba.get_num_threads())
            return f(*a, **k)
        return run

    before = numba.get_num_threads()
    x = np.linspace(-1.0, 1.0, 32 * fits.GAIN_MIN_BLOCKS * 2, dtype=np.float32)
    fits.sampled_format2(x, 1e-3, 64, (spy(compress_abs), spy(add), spy(decompress)))
    assert seen == [1] * (2 * 3 * fits.SPEED_REPS) and fits.SPEED_REPS >= 3
    assert numba.get_num_threads() == before


def test_sampled_format2_prices_the_add_as_the_ring_step(monkeypatch):
    # With add_data as a fourth kernel, the add factor is the ring's step: add_data's time
    # less the compression's (the model counts the compression apart), at least a quarter
    # of add_data's. Durations by hand, in the order of the timings (two runs each:
    # compress, add, decompress, add_data; format 1, then format 2).
    from ccoll.collectives.policy import fits
    from ccoll.compressor.api import add, add_data, compress_abs, decompress

    runs = [4, 5, 2, 3, 1, 1, 3, 9,  # format 1: add_data 3 < compress 4: the quarter, 0.75
            8, 8, 4, 4, 2, 2, 20, 20]  # format 2: 20 - 8 = 12
    readings = []
    t = 0.0
    for d in runs:
        readings += [t, t + d]
        t += d + 100.0
    ticks = iter(readings)
    monkeypatch.setattr(fits, "_clock", lambda: next(ticks))
    monkeypatch.setattr(fits, "SPEED_REPS", 2)
    x = np.linspace(-1.0, 1.0, 32 * fits.GAIN_MIN_BLOCKS * 2, dtype=np.float32)
    got = fits.sampled_format2(x, 1e-3, 64, (compress_abs, add, decompress, add_data))
    assert got.speed == (4 / 8, 0.75 / 12, 1 / 2)
    assert next(ticks, None) is None  # every kernel timed twice, no other reading


# ------------------------------------------- the stream format in the measured loop

def _clock(**t: float):
    """Seconds per candidate key (``flat_v2`` for "flat v2"), the same every call."""
    table = {k.replace("_v2", " v2").replace("_", " "): v for k, v in t.items()}
    return lambda key: table[key]


def test_the_other_format_of_the_best_path_is_measured_and_the_faster_runs():
    # Format 2 predicted faster (the same kernels, twice the ratio on a slow link); on this
    # machine format 1's calls take 0.20 s and format 2's 0.25 s: format 2 first, format 1
    # tried (two runs: the first is not measured), then format 1 by measurement, format 2
    # tried again after 4, 8, ... calls. Ranks with different clocks plan alike.
    clocks = [_clock(raw=1.0, flat=0.20, flat_v2=0.25),
              _clock(raw=1.1, flat=0.21, flat_v2=0.26)]
    r = Ranks(SLOW, clocks, formats=Formats(SLOW, 2.0))
    seq = r.run(60)
    assert seq.startswith("VVCC"), seq
    best = [p for p in r.log[4:] if not p.trial]
    assert best and all(p.key == "flat" and p.version == 1 for p in best), seq
    assert best[-1].reason.startswith("measured faster: compressed 210 ms")
    assert "measured 210 ms" in best[-1].format_reason
    assert "format 2 measured 260 ms" in best[-1].format_reason
    v2 = [i for i, c in enumerate(seq) if c == "V"][2:]
    assert v2 and all(r.log[i].trial for i in v2)
    gaps = [b - a for a, b in zip(v2, v2[1:], strict=False)]
    assert gaps == sorted(gaps) and len(set(gaps)) == len(gaps), (seq, gaps)
    assert "R" not in seq  # raw is predicted far slower: never tried


def test_format_2_runs_where_it_is_within_the_share_of_format_1s_time():
    # The model prefers format 1 (format 2's kernels at half speed, 1.05x fewer bytes);
    # measured, format 2 is 2% slower: it runs, for its fewer bytes. At 10% slower it does
    # not.
    slow2 = replace(SLOW, compress=SLOW.compress / 2, add=SLOW.add / 2,
                    decompress=SLOW.decompress / 2)
    near = Ranks(SLOW, [_clock(raw=9.0, flat=0.200, flat_v2=0.204)],
                 formats=Formats(slow2, 1.05))
    seq = near.run(30)
    assert seq.startswith("CCVV"), seq
    best = [p for p in near.log[4:] if not p.trial]
    assert best and all(p.version == 2 for p in best), seq
    assert best[-1].format_reason.endswith(f"(within {FEWER_BYTES:.0%}: fewer bytes)")
    far = Ranks(SLOW, [_clock(raw=9.0, flat=0.200, flat_v2=0.220)],
                formats=Formats(slow2, 1.05))
    seq = far.run(30)
    assert seq.startswith("CCVV"), seq
    assert all(p.version == 1 for p in far.log[4:] if not p.trial), seq


def test_a_prediction_within_the_share_sends_format_2():
    # Neither format measured: format 2 predicted at most FEWER_BYTES slower runs (also
    # for a fixed policy, whose plans come from the model alone).
    cands = candidates(HAND_FACTS, HAND, 16.0, 3.0, HAND_OPTS,
                       Formats(replace(HAND, compress=HAND.compress / 1.02), 1.0))
    t1, t2 = (c.seconds for c in cands[1:])
    assert t1 < t2 <= t1 * (1 + FEWER_BYTES)
    for policy in ("auto", "compress"):
        facts = HAND_FACTS._replace(policy=policy)
        pl = Planner(HAND, HAND_OPTS, 7,
                     formats=Formats(replace(HAND, compress=HAND.compress / 1.02), 1.0))
        plan = pl.plan(pl.state(KEY, facts), facts, ratio=16.0, width=3.0)
        assert plan.version == 2, (policy, plan)
        assert plan.format_reason.endswith("fewer bytes)"), plan.format_reason
    slower = Formats(replace(HAND, compress=HAND.compress / 1.5, add=HAND.add / 1.5), 1.0)
    pl = Planner(HAND, HAND_OPTS, 7, formats=slower)
    assert pl.plan(pl.state(KEY, HAND_FACTS), HAND_FACTS, ratio=16.0,
                   width=3.0).version == 1


def test_where_compression_loses_only_one_format_is_tried():
    # Raw measures faster: the compressed path is tried in the format that would run, and
    # its other format never (the same trials as with one format).
    r = Ranks(MID, [_clock(raw=1.0, flat=1.5, flat_v2=1.5)], ratio=1.1,
              formats=Formats(MID, 1.5))
    seq = r.run(200)
    assert "C" not in seq or "V" not in seq, seq
    assert seq.count("V") + seq.count("C") <= 2 + 8, seq  # two runs, then 4, 8, ... apart
    assert sum(r.fast) > 150


def test_the_agreement_carries_one_time_per_candidate():
    # Planner.unsent() sends len(VARIANTS) times; the agreement vector has that many slots.
    from ccoll.collectives import agreement

    assert agreement._NTIMES == len(VARIANTS)
    assert len(agreement.Call(collective="allreduce").times) == len(VARIANTS)
