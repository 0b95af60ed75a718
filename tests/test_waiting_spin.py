"""The spin of a wait under a deadline yields the core, more often where ranks share cores."""

from __future__ import annotations

import pytest

from ccoll.collectives import waiting


@pytest.mark.parametrize("shared, every", [(False, waiting._YIELD_EVERY),
                                           (True, waiting._YIELD_SHARED)])
def test_spin_yields_every_so_many_tests(monkeypatch, shared, every):
    yields = []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
    tests = 10 * every + 1  # completes on the last test
    calls = iter(range(tests))
    waiting.share_cores(shared)
    try:
        assert waiting.spin(lambda: next(calls) == tests - 1, 60.0)
    finally:
        waiting.share_cores(False)
    assert len(yields) == 10


def test_a_spin_that_runs_out_of_time_says_so(monkeypatch):
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: None)
    assert not waiting.spin(lambda: False, 0.0)
