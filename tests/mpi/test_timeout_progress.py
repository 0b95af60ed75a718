"""The timeout bounds a wait without progress, not a call: a slow call that keeps moving runs on.

A compressed allreduce is made slow on purpose: every compressor call of this rank (compress,
add, decode) takes a tenth of the timeout on the clock the deadlines read
(``ccoll.collectives.waiting._clock``, which the test advances; each call also sleeps a
millisecond, so that no rank runs ahead of the clock it reads by more than a few calls).
The whole call so lasts several timeouts, while no wait in it lasts more than a few of
those steps. It must finish, within its bound and the same on every rank. (A rank that
skips a call, which no progress can end, is in tests/test_collectives_faults.py.)

Run: mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_timeout_progress.py
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kit import assert_same_on_every_rank

import ccoll
from ccoll.collectives import waiting
from ccoll.compressor import api as capi

TIMEOUT = 30.0
STEP = TIMEOUT / 10  # what one compressor call of this rank takes on the deadlines' clock
N = 48_000


@pytest.fixture
def slow_compressor(monkeypatch):
    """Every compressor call advances this rank's deadline clock by ``STEP``; return it."""
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    def slow(fn):
        def call(*args, **kw):
            out = fn(*args, **kw)
            time.sleep(1e-3)
            offset[0] += STEP
            return out
        return call

    monkeypatch.setattr(waiting, "_clock", clock)
    for name in ("compress_abs", "add_data", "add", "decompress"):
        monkeypatch.setattr(capi, name, slow(getattr(capi, name)))
    return clock


@pytest.mark.parametrize("how", ["allreduce", "iallreduce"])
@pytest.mark.parametrize("schedule", ["ring", "halving"])
def test_a_slow_call_that_keeps_moving_is_not_cut(comm, slow_compressor, schedule, how):
    if comm.size == 1:
        pytest.skip("one rank sends raw: nothing to slow down")
    x = np.sin(np.arange(N, dtype=np.float32) * 0.01 * (comm.rank + 1))
    want = np.empty(N, np.float64)
    comm.Allreduce(x.astype(np.float64), want)
    eb = 1e-3
    with ccoll.Communicator(comm, policy="compress", chunk_elems=1024, schedule=schedule,
                            timeout=TIMEOUT) as c:
        t0 = slow_compressor()
        if how == "allreduce":
            y = c.allreduce(x, eb=ccoll.ABS(eb))
            report = c.last_call
        else:
            y = c.iallreduce(x, eb=ccoll.ABS(eb)).wait()
            report = c.last_async_call
        took = slow_compressor() - t0
    assert report.compressed, report
    assert (report.path, report.chunk_elems) == ("flat", 1024)
    # It ran for several timeouts on the deadlines' clock, and was not cut.
    assert took > 2 * TIMEOUT, took
    assert np.abs(y - want).max() <= eb * (1 + 1e-6)
    assert_same_on_every_rank(comm, y)
