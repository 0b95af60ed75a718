"""examples/train_ddp.py's options: a bad value is a usage error before any training."""

from __future__ import annotations

import pytest
from kit import load_example

pytest.importorskip("torch")


def _module():  # type: ignore[no-untyped-def]
    return load_example("train_ddp")


@pytest.mark.parametrize("argv, match", [
    # An unreadable bound trained PowerSGD under ccoll's name, then crashed at the end.
    (["--eb", "bogus"], "--eb: bound string must look like"),
    (["--eb", "abs:0"], "--eb: ABS bound must be finite and > 0"),
    (["--batch", "0"], "--batch must be >= 1"),  # taken as "not given" before
    (["--lr", "nan"], "--lr must be a finite number >= 0"),
    (["--min-numel", "-5"], "--min-numel must be >= 0"),
    (["--record-every", "0"], "--record-every must be >= 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--eval-every", "-2"], "--eval-every must be >= 0"),  # evaluated nothing, silently
    # Steps the run does not have traced nothing, and said nothing.
    (["--steps", "24", "--trace", "0,999"], "--trace: step 999 is not a step of this run"),
    (["--trace", "-1"], "--trace: step -1 is not a step of this run"),
    # One run name: the second run's log replaced the first's.
    (["--methods", "none,ccoll,none"], "--methods: 'none' and 'none' are the same run"),
    (["--methods", "ccoll,ccoll:rel:1e-3"], "'ccoll' and 'ccoll:rel:1e-3' are the same run"),
    (["--methods", "powersgd,powersgd:4"], "'powersgd' and 'powersgd:4' are the same run"),
])
def test_bad_options_are_usage_errors(capsys, argv, match) -> None:
    with pytest.raises(SystemExit) as info:
        _module().parse_args(["--model", "cnn", "--method", "ccoll", *argv])
    assert info.value.code == 2
    assert match in capsys.readouterr().err


def test_methods_of_different_runs_and_steps_of_the_run_are_taken() -> None:
    args = _module().parse_args(["--model", "cnn", "--steps", "5", "--trace", "0,4",
                                 "--methods", "ccoll,ccoll:rel:1e-2,ccoll@5,powersgd:8,"
                                 "powersgd", "--eval-every", "0"])
    assert args.trace_steps == {0, 4} and len(args.method_list) == 5
    assert args.eval_every == 0


def test_a_learning_rate_of_zero_is_kept() -> None:
    # `args.lr or default` replaced it by the default: a control run trained anyway.
    args = _module().parse_args(["--model", "cnn", "--lr", "0"])
    assert args.lr == 0.0 and args.batch == 64
