"""CPU lanes: FIFO within a lane, dependencies across lanes, errors, synchronize, limits."""

from __future__ import annotations

import os
import sys
import threading
import time

import numba
import pytest

from ccoll.errors import CCollError, CCollTimeoutError
from ccoll.gpu_sched import LANES, Scheduler, current_lane, current_stream, default_scheduler
from ccoll.gpu_sched.thread_lanes import ThreadEvent


@pytest.fixture
def sched():
    s = Scheduler("cpu")
    yield s
    s.close()


def _gate(lane):
    """Block ``lane`` until the returned gate is set; return (event, gate)."""
    gate = threading.Event()
    return lane.submit(gate.wait), gate


def _not_yet(ev, settle=0.05):
    time.sleep(settle)
    return not ev.query()


@pytest.mark.parametrize("name", LANES)
def test_fifo_within_a_lane(sched, name):
    lane = sched.lane(name)
    ran = []
    evs = [lane.submit(lambda i: (ran.append(i), -i)[1], i) for i in range(300)]
    assert [e.wait(timeout=30) for e in evs] == [-i for i in range(300)]
    assert ran == list(range(300))


def test_submit_passes_args_and_kwargs(sched):
    ev = sched.lane("reduce").submit(lambda a, *, b: a * b, 6, b=7)
    assert ev.wait(timeout=10) == 42


@pytest.mark.parametrize("src,dst", [("compute", "compress"), ("compress", "reduce"),
                                     ("reduce", "copy"), ("copy", "compute")])
def test_after_dependency_across_lanes(sched, src, dst):
    log = []
    a, gate = _gate(sched.lane(src))
    a2 = sched.lane(src).submit(log.append, "A")
    b = sched.lane(dst).submit(log.append, "B", after=[a2])
    assert _not_yet(b) and log == []
    gate.set()
    b.wait(timeout=10)
    assert log == ["A", "B"] and a.query()


def test_after_waits_for_every_event(sched):
    log = []
    e1, g1 = _gate(sched.lane("compute"))
    e2, g2 = _gate(sched.lane("compress"))
    b = sched.lane("reduce").submit(log.append, "B", after=[e1, e2])
    g1.set()
    assert _not_yet(b)
    g2.set()
    b.wait(timeout=10)
    assert log == ["B"]


def test_lane_wait_gates_only_later_work(sched):
    a, gate = _gate(sched.lane("compute"))
    reduce = sched.lane("reduce")
    before = reduce.submit(lambda: "before")
    assert before.wait(timeout=10) == "before"  # not held back by the gate
    reduce.wait(a)
    later = reduce.submit(lambda: "later")
    assert _not_yet(later)
    gate.set()
    assert later.wait(timeout=10) == "later"


def test_record_completes_after_earlier_work(sched):
    lane = sched.lane("copy")
    _, gate = _gate(lane)
    rec = lane.record()
    assert _not_yet(rec)
    gate.set()
    assert rec.wait(timeout=10) is None


def test_synchronize_waits_for_all_work(sched):
    lane = sched.lane("compress")
    evs = [lane.submit(time.sleep, 0.01) for _ in range(5)]
    lane.synchronize()
    assert all(e.query() for e in evs)


class Boom(Exception):
    pass


def _boom():
    raise Boom("kernel failed")


def test_error_reaches_waiter_and_is_sticky_until_synchronize(sched):
    lane = sched.lane("compress")
    ran = []
    bad = lane.submit(_boom)
    skipped = lane.submit(ran.append, 1)
    rec = lane.record()
    with pytest.raises(Boom, match="kernel failed"):
        bad.wait(timeout=10)
    with pytest.raises(Boom):
        skipped.wait(timeout=10)
    with pytest.raises(Boom):
        rec.wait(timeout=10)
    assert ran == [] and isinstance(bad.error, Boom)
    with pytest.raises(Boom):
        lane.synchronize()
    lane.synchronize()  # cleared
    assert lane.submit(lambda: "ok").wait(timeout=10) == "ok"


def test_error_propagates_through_after_and_wait(sched):
    bad = sched.lane("compress").submit(_boom)
    ran = []
    dep = sched.lane("reduce").submit(ran.append, "dep", after=[bad])
    copy = sched.lane("copy")
    copy.wait(bad)
    gated = copy.submit(ran.append, "gated")
    for ev in (dep, gated):
        with pytest.raises(Boom):
            ev.wait(timeout=10)
    assert ran == []
    with pytest.raises(Boom):
        sched.synchronize()
    sched.synchronize()  # every lane cleared
    assert sched.lane("reduce").submit(lambda: 1).wait(timeout=10) == 1


def test_wait_timeout(sched):
    ev, gate = _gate(sched.lane("compute"))
    with pytest.raises(CCollTimeoutError, match="within 0.05 s"):
        ev.wait(timeout=0.05)
    gate.set()
    assert ev.wait(timeout=10) is True


def test_waiting_on_own_later_work_is_refused(sched):
    lane = sched.lane("reduce")
    box = []

    def waits_for_later():
        box[0].wait()

    gate = threading.Event()
    lane.submit(gate.wait)
    first = lane.submit(waits_for_later)
    box.append(lane.submit(lambda: None))
    gate.set()
    with pytest.raises(CCollError, match="would deadlock"):
        first.wait(timeout=10)
    with pytest.raises(CCollError):
        lane.synchronize()


def test_current_lane_inside_callables(sched):
    lane = sched.lane("copy")
    assert lane.submit(current_lane).wait(timeout=10) is lane
    assert lane.submit(current_stream).wait(timeout=10) is None
    assert current_lane() is None


def test_cpu_streams(sched):
    assert sched.adopt_stream(None) is sched.lane("compute")
    ev = sched.lane("compress").wait_stream(None)
    assert ev.query() and ev.wait() is None
    with pytest.raises(ValueError, match="no streams"):
        sched.adopt_stream(object())
    with pytest.raises(ValueError, match="no streams"):
        sched.lane("reduce").wait_stream(123)


@pytest.mark.parametrize("bad", [object(), 3, None])
def test_only_cpu_events_are_accepted(sched, bad):
    with pytest.raises(TypeError, match="events of CPU lanes"):
        sched.lane("reduce").submit(print, after=[bad])
    with pytest.raises(TypeError, match="events of CPU lanes"):
        sched.lane("reduce").wait(bad)


def test_submit_needs_a_callable(sched):
    with pytest.raises(TypeError, match="callable"):
        sched.lane("copy").submit("not callable")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(device="tpu"), "device must be"),
        (dict(max_sm_fraction=0.0), r"must be in \(0, 1\]"),
        (dict(max_sm_fraction=1.5), r"must be in \(0, 1\]"),
        (dict(max_sm_fraction={"bogus": 0.5}), "unknown lane"),
        (dict(priorities={"bogus": 1}), "unknown lane"),
        (dict(priorities={"compress": -1}), "int >= 0"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(**kwargs)


def test_unknown_lane(sched):
    with pytest.raises(ValueError, match="unknown lane 'training'"):
        sched.lane("training")


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_grid_limit_on_cpu_is_the_numba_thread_share(fraction):
    with Scheduler("cpu", max_sm_fraction=fraction) as s:
        n = numba.config.NUMBA_NUM_THREADS
        want = max(1, int(n * fraction))
        assert s.grid_limit("compute") == n
        for name in ("compress", "reduce", "copy"):
            assert s.grid_limit(name) == want
            assert s.lane(name).submit(numba.get_num_threads).wait(timeout=30) == want


def test_per_lane_fractions():
    with Scheduler("cpu", max_sm_fraction={"compress": 0.5}) as s:
        assert s.sm_fractions == {"compute": 1.0, "compress": 0.5, "reduce": 1.0, "copy": 1.0}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux")
def test_lower_lanes_run_at_higher_nice_values(sched):
    base = os.getpriority(os.PRIO_PROCESS, 0)

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    got = {name: sched.lane(name).submit(nice).wait(timeout=10) for name in LANES}
    assert got == {n: min(19, base + 5 * r) for n, r in
                   {"compute": 0, "reduce": 1, "copy": 1, "compress": 2}.items()}
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the process itself is untouched


def test_closed_scheduler_refuses_work():
    s = Scheduler("cpu")
    lane = s.lane("copy")
    ev = lane.submit(time.sleep, 0.05)
    s.close()
    assert ev.query()  # close let pending work finish
    with pytest.raises(CCollError, match="closed"):
        lane.submit(print)
    with pytest.raises(CCollError, match="closed"):
        s.lane("copy")


def test_default_scheduler_is_shared():
    assert default_scheduler("cpu") is default_scheduler("cpu")
    assert isinstance(default_scheduler().lane("compress").record(), ThreadEvent)
