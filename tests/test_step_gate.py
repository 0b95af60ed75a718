"""The DDP hook's step check (ccoll/torch/_stepgate.py) as a state machine on stand-in step times.

Each simulated step goes as the hook runs it: at the step's first bucket the gate gets the
previous step's (agreed) seconds and returns this step's mode; the step's seconds come
from a stand-in clock that knows what each mode costs.
"""

from __future__ import annotations

import pytest

from ccoll.torch._stepgate import AUTO, RAW, StepGate


def run(gate: StepGate, cost, steps: int, lag: int = 1) -> list[str]:
    """Drive ``gate`` for ``steps`` steps; ``cost(mode, i)`` is step i's seconds.

    Step i's time reaches the gate at the start of step ``i + lag`` (the hook: 1, the time
    agreed by the next step's first bucket; 2 covers a slower agreement).
    """
    modes: list[str] = []
    times: list[float] = []
    for i in range(steps):
        mode = gate.next(times[i - lag] if i >= lag else None)
        modes.append(mode)
        times.append(cost(mode, i))
    return modes


LAGS = pytest.mark.parametrize("lag", [1, 2])


def flat(auto: float, raw: float):
    return lambda mode, i: auto if mode == AUTO else raw


def test_first_steps_compress_then_try_raw() -> None:
    modes = run(StepGate(probe=3, warmup=1), flat(1.0, 1.2), 7)
    assert modes == [AUTO] * 4 + [RAW] * 3


@LAGS
def test_compression_that_slows_steps_is_dropped(lag) -> None:
    # 10 Gbit/s: compressing makes the step 8% slower. After the tries, raw runs, and the
    # tries of auto come at growing intervals.
    gate = StepGate(probe=3, warmup=1)
    modes = run(gate, flat(1.08, 1.0), 400, lag)
    assert gate.winner == RAW
    assert modes[7:13] == [RAW] * 6  # the first run of the winner: probe << first_level
    assert modes.count(AUTO) < 0.15 * len(modes)
    # Tries of auto get rarer: each lost try doubles the run before the next one.
    starts = [i for i in range(8, len(modes)) if modes[i] == AUTO and modes[i - 1] == RAW]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]


@LAGS
def test_compression_that_pays_keeps_running(lag) -> None:
    gate = StepGate(probe=3, warmup=1)
    modes = run(gate, flat(1.0, 1.76), 400, lag)
    assert gate.winner == AUTO
    assert modes.count(RAW) < 0.1 * len(modes)


@LAGS
def test_compression_must_win_by_the_margin(lag) -> None:
    # 2% faster with compression is within the steps' spread: the safe side, raw, runs.
    gate = StepGate(margin=0.05)
    modes = run(gate, flat(0.98, 1.0), 200, lag)
    assert gate.winner == RAW and modes.count(AUTO) < 0.2 * len(modes)
    gate = StepGate(margin=0.05)
    run(gate, flat(0.94, 1.0), 200, lag)
    assert gate.winner == AUTO


@LAGS
def test_a_much_slower_try_ends_after_one_step(lag) -> None:
    # 100 Mbit/s: a raw step costs 7x; each try of raw costs one step (a step more for
    # each step of lag), not three.
    gate = StepGate(probe=3, warmup=1, abort=1.5)
    modes = run(gate, flat(1.0, 7.0), 200, lag)
    runs_of_raw = [len(r) for r in "".join("r" if m == RAW else "a" for m in modes).split("a")
                   if r]
    assert runs_of_raw and all(n == lag for n in runs_of_raw)
    assert gate.winner == AUTO


@LAGS
def test_a_try_at_one_gigabit_ends_after_one_step(lag) -> None:
    # 1 Gbit/s on shared cores: raw steps 1.5x auto's, both spreading by +-10% from step to
    # step. The default abort (1.3x) still ends every raw try at its first measured step.
    wobble = [1.0, 1.1, 0.9, 1.05, 0.95, 1.08, 0.92]
    gate = StepGate()
    modes = run(gate, lambda mode, i: (1.0 if mode == AUTO else 1.5) * wobble[i % 7], 200, lag)
    runs_of_raw = [len(r) for r in "".join("r" if m == RAW else "a" for m in modes).split("a")
                   if r]
    assert runs_of_raw and all(n == lag for n in runs_of_raw), runs_of_raw
    assert gate.winner == AUTO and modes.count(RAW) < 0.06 * len(modes)


@LAGS
def test_warmup_steps_are_not_measured(lag) -> None:
    # The first auto step compiles (100 s); without the warm-up skip it would decide.
    gate = StepGate(probe=3, warmup=1)
    modes = run(gate, lambda mode, i: 100.0 if i == 0 else (1.0 if mode == AUTO else 1.2), 20,
                lag)
    first_raw = modes.index(RAW)
    back = modes.index(AUTO, first_raw)
    assert gate.winner == AUTO and modes[back:back + 6] == [AUTO] * 6
    assert back - first_raw == 3 + lag - 1  # one try of raw, not decided by step 0


@LAGS
def test_one_slow_step_does_not_decide(lag) -> None:
    # An evaluation or a stall in one step of a try: the median of the try ignores it.
    slow = {2}
    gate = StepGate(probe=3, warmup=1)
    run(gate, lambda mode, i: (5.0 if i in slow else 1.0) if mode == AUTO else 1.2, 8 + lag, lag)
    assert gate.winner == AUTO


@LAGS
def test_a_change_in_the_link_is_followed(lag) -> None:
    # Compression pays for 100 steps, then the link gets fast and it stops paying.
    gate = StepGate(probe=3, warmup=1, max_level=3)
    modes = run(gate, lambda mode, i: (1.0 if mode == AUTO else 2.0) if i < 100
                else (1.2 if mode == AUTO else 1.0), 300, lag)
    assert gate.winner == RAW and gate.switches == 1
    assert modes[250:].count(AUTO) < 0.2 * 50


@LAGS
def test_identical_inputs_give_identical_modes(lag) -> None:
    # Every rank feeds the same agreed times, so every rank switches at the same step.
    cost = lambda mode, i: 1.0 + 0.3 * ((i * 7919) % 13) / 13 + (0.05 if mode == AUTO else 0.0)  # noqa: E731
    assert run(StepGate(), cost, 300, lag) == run(StepGate(), cost, 300, lag)


@LAGS
def test_steps_are_counted(lag) -> None:
    gate = StepGate()
    modes = run(gate, flat(1.0, 1.2), 50, lag)
    assert gate.steps == {AUTO: modes.count(AUTO), RAW: modes.count(RAW)}
    assert gate.mode == modes[-1]


@pytest.mark.parametrize("kw", [{"probe": 0}, {"warmup": -1}, {"abort": 1.0},
                                {"first_level": 5, "max_level": 4}, {"margin": 1.0},
                                {"margin": -0.1}])
def test_bad_settings_raise(kw) -> None:
    with pytest.raises(ValueError):
        StepGate(**kw)


@LAGS
def test_a_raw_try_that_cannot_win_is_not_made(lag) -> None:
    # 100 Mbit/s: compressed steps take 1.8 s, a raw step at least 5 s (its floor), in
    # truth 11 s. No raw step runs; the tries are counted as lost and come ever more rarely.
    gate = StepGate(probe=3, warmup=1)
    modes = []
    times: list[float] = []
    for i in range(200):
        mode = gate.next(times[i - lag] if i >= lag else None, raw_floor=5.0)
        modes.append(mode)
        times.append(1.8 if mode == AUTO else 11.0)
    assert modes == [AUTO] * 200
    assert gate.winner == AUTO
    # Each skipped try counts as one lost: the runs between them double. Skips after 3
    # measured steps (the first block), then after 6, 12, 24, 48 and 96 more: at measured
    # steps 3, 9, 21, 45, 93 and 189, all before step 200 (one warm-up step, lag <= 2).
    assert gate.raw_skipped == 6


@LAGS
def test_a_floor_below_the_compressed_steps_changes_nothing(lag) -> None:
    # 10 Gbit/s: raw's floor (0.1 s) is far below any step: every try is made as without one.
    with_floor, without = StepGate(probe=3, warmup=1), StepGate(probe=3, warmup=1)
    cost = flat(1.08, 1.0)
    times_a: list[float] = []
    times_b: list[float] = []
    for i in range(300):
        a = with_floor.next(times_a[i - lag] if i >= lag else None, raw_floor=0.1)
        b = without.next(times_b[i - lag] if i >= lag else None)
        assert a == b
        times_a.append(cost(a, i))
        times_b.append(cost(b, i))
    assert with_floor.raw_skipped == 0 and with_floor.winner == RAW


@LAGS
def test_raw_is_tried_once_compressed_steps_no_longer_beat_its_floor(lag) -> None:
    # The link got faster (the floor falls, 5 s -> 0.5 s) while compressed steps stay at
    # 1.8 s and raw ones take 1.0 s: the next due try runs raw, and raw takes over.
    gate = StepGate(probe=3, warmup=1)
    times: list[float] = []
    modes = []
    for i in range(120):
        floor = 5.0 if i < 40 else 0.5
        mode = gate.next(times[i - lag] if i >= lag else None, raw_floor=floor)
        modes.append(mode)
        times.append(1.8 if mode == AUTO else 1.0)
    assert RAW not in modes[:40]
    assert gate.winner == RAW and modes[-1] == RAW
