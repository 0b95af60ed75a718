"""The process-wide scheduler: configure(), and the collectives' Worker on its CPU lanes."""

from __future__ import annotations

import sys
import threading
import time

import pytest

import ccoll.gpu_sched as gs
from ccoll.collectives.worker import Worker
from ccoll.errors import CCollError, InputError
from ccoll.gpu_sched import configure, default_scheduler
from ccoll.gpu_sched import scheduler as sched_mod


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    monkeypatch.delenv("CCOLL_SCHED", raising=False)
    monkeypatch.setattr(sched_mod, "_training", False)
    configure()
    yield
    configure()


def _lanes() -> gs.Scheduler:
    return default_scheduler("cpu")


def _collect(*workers: Worker, timeout: float = 10.0) -> list[list[tuple]]:
    out: list[list[tuple]] = [[] for _ in workers]
    end = time.monotonic() + timeout
    while any(w.outstanding for w in workers):
        assert time.monotonic() < end, "tasks did not finish"
        for w, got in zip(workers, out, strict=True):
            w.wait(0.05)
            got.extend(w.drain())
    return out


def _hold(w: Worker, lane: str, key: tuple = (0,)) -> threading.Event:
    """Block ``lane``'s thread with a task of ``w`` until the returned event is set."""
    gate, started = threading.Event(), threading.Event()

    def block() -> str:
        started.set()
        gate.wait(10)
        return "gate"

    w.submit(key, block, "gate", lane=lane)
    assert started.wait(10)
    return gate


def test_configure_is_exported():
    assert gs.configure is configure
    assert "configure" in gs.__all__


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "gpu"}, "device must be 'cpu', 'cuda' or None"),
    ({"max_sm_fraction": 0}, r"max_sm_fraction for lane 'every lane' must be in \(0, 1\]"),
    ({"max_sm_fraction": 1.5}, r"must be in \(0, 1\]"),
    ({"max_sm_fraction": "half"}, "max_sm_fraction must be a number"),
    ({"max_sm_fraction": {"compres": 0.5}}, r"unknown lane\(s\) \['compres'\]"),
    ({"priorities": {"reduce": -1}}, "priority rank of 'reduce' must be an int >= 0"),
    ({"priorities": {"training": 0}}, r"unknown lane\(s\) \['training'\] in priorities"),
    ({"enabled": "yes"}, "enabled must be True or False"),
])
def test_configure_rejects_bad_options(kwargs, match):
    before = default_scheduler("cpu")
    with pytest.raises(ValueError, match=match):
        configure(**kwargs)
    assert default_scheduler("cpu") is before  # nothing changed


def test_configure_replaces_the_idle_scheduler():
    old = default_scheduler("cpu")
    configure("cpu", max_sm_fraction=0.25, priorities={"compress": 3})
    new = default_scheduler("cpu")
    assert new is not old and old._closed
    assert new.sm_fractions["compress"] == 0.25
    assert new.priority_ranks["compress"] == 3
    assert default_scheduler("cpu") is new  # shared from now on


def test_the_process_scheduler_on_the_cpu_takes_the_rank_share_whole():
    # Default fraction 1.0 on the CPU: a lane's numba threads are the rank's share, as
    # the private thread's were (cpu_threads caps them).
    assert default_scheduler("cpu").sm_fractions["compress"] == 1.0


def test_the_cpu_lanes_run_at_nice_0_until_training_registers():
    flat = default_scheduler("cpu")
    assert set(flat.priority_ranks.values()) == {0}
    assert {ln.priority for ln in flat.lanes.values()} == {0}
    sched_mod.yield_to_training()
    assert flat._closed  # it was idle
    low = default_scheduler("cpu")
    assert low.priority_ranks == dict(sched_mod.DEFAULT_PRIORITY_RANKS)
    if sys.platform.startswith("linux"):
        nice = {n: low.lane(n).priority for n in ("compress", "reduce")}
        # +10 / +5 where setpriority is allowed (a sandbox may refuse: 0)
        assert nice in ({"compress": 10, "reduce": 5}, {"compress": 0, "reduce": 0}), nice
    sched_mod.yield_to_training()  # once per process
    assert default_scheduler("cpu") is low


def test_configured_priorities_stand_when_training_registers():
    configure("cpu", priorities={"compress": 1})
    mine = default_scheduler("cpu")
    sched_mod.yield_to_training()
    assert default_scheduler("cpu") is mine and mine.priority_ranks["compress"] == 1


def test_configure_refuses_while_a_collective_runs_on_the_lanes():
    w = Worker("test-worker", lanes=_lanes)
    gate = _hold(w, "compress")
    try:
        with pytest.raises(CCollError, match="while a collective has 1 task"):
            configure("cpu", max_sm_fraction=0.5)
    finally:
        gate.set()
    _collect(w)
    old = default_scheduler("cpu")
    configure("cpu", max_sm_fraction=0.5)  # idle now
    assert old._closed


@pytest.mark.parametrize("how", ["configure", "env"])
def test_lanes_switched_off_keep_the_private_thread(how, monkeypatch):
    # configure(enabled=False) for the process, or CCOLL_SCHED=off for Communicators made
    # from then on: their channels' workers take no lane.
    from mpi4py import MPI

    import ccoll

    if how == "configure":
        configure(enabled=False)
    else:
        monkeypatch.setenv("CCOLL_SCHED", "off")
    with ccoll.Communicator(MPI.COMM_SELF, policy="raw") as cc:
        w = cc._sync.ch.worker
        w.submit((0,), lambda: threading.current_thread().name, "t", lane="compress")
        ((tag, name, exc),) = _collect(w)[0]
        assert (tag, name, exc) == ("t", "ccoll-sync-worker", None)
        assert not w.used_lanes


def test_a_bad_ccoll_sched_names_the_fix(monkeypatch):
    from mpi4py import MPI

    import ccoll

    monkeypatch.setenv("CCOLL_SCHED", "sometimes")
    with pytest.raises(InputError,
                       match="CCOLL_SCHED='sometimes' is not a switch: set it to 'off'"):
        ccoll.Communicator(MPI.COMM_SELF)


def test_worker_on_a_lane_honours_the_priority_keys():
    w = Worker("test-worker", lanes=_lanes)
    gate = _hold(w, "compress")
    ran: list[tuple[int, str]] = []
    for k in (3, 1, 2):
        w.submit((k,), lambda k=k: ran.append((k, threading.current_thread().name)), k,
                 lane="compress")
    gate.set()
    _collect(w)
    assert ran == [(1, "ccoll-lane-compress"), (2, "ccoll-lane-compress"),
                   (3, "ccoll-lane-compress")]
    assert w.used_lanes


def test_an_error_comes_back_from_drain_and_the_lane_stays_usable():
    w = Worker("test-worker", lanes=_lanes)
    w.submit((0,), lambda: 1 / 0, "boom", lane="reduce")
    ((tag, result, exc),) = _collect(w)[0]
    assert tag == "boom" and result is None and isinstance(exc, ZeroDivisionError)
    lane = default_scheduler("cpu").lane("reduce")
    lane.synchronize()  # no sticky error on the shared lane
    w.submit((0,), lambda: threading.current_thread().name, "after", lane="reduce")
    assert _collect(w)[0] == [("after", "ccoll-lane-reduce", None)]
    assert lane.submit(lambda: 7).wait(10) == 7


def test_two_workers_sharing_the_lanes_collect_their_own_outcomes():
    a, b = Worker("a", lanes=_lanes), Worker("b", lanes=_lanes)
    gate = _hold(a, "reduce")
    for i in range(5):
        a.submit((i,), lambda i=i: ("a", i), ("a", i), lane="reduce")
        b.submit((i,), lambda i=i: ("b", i), ("b", i), lane="reduce")
        b.submit((i,), lambda i=i: ("b", -i), ("bc", i), lane="compress")
    gate.set()
    got_a, got_b = _collect(a, b)
    assert sorted(t for t, _, _ in got_a if t != "gate") == [("a", i) for i in range(5)]
    assert all(r == t for t, r, _ in got_a if t != "gate")
    assert sorted(t for t, _, _ in got_b) == sorted(
        [("b", i) for i in range(5)] + [("bc", i) for i in range(5)])
    assert sched_mod._busy["cpu"] == 0


def _name_into(ran: list[str]):
    return lambda: ran.append(threading.current_thread().name)


def test_a_worker_runs_one_lane_task_at_a_time_lowest_key_first():
    w = Worker("test-worker", lanes=_lanes)
    gate = _hold(w, "compress", (1, 0))
    ran: list[str] = []
    w.submit((0, 9), _name_into(ran), "combine", lane="reduce")  # the reduce lane is free
    # Everything handed to the reduce lane so far has run once synchronize() returns, so a
    # task dispatched beside the running compress would be in ``ran`` now.
    default_scheduler("cpu").lane("reduce").synchronize()
    assert ran == []  # but this worker's compress is running: as on one thread
    gate.set()
    _collect(w)
    assert ran == ["ccoll-lane-reduce"]


def test_help_leaves_a_critical_task_running_on_a_lane_alone():
    w = Worker("test-worker", lanes=_lanes)
    gate = _hold(w, "compress")  # key (0,), below the decodes', runs on the compress lane
    ran: list[str] = []
    w.submit((1, 0), _name_into(ran), "decode", lane="reduce")
    try:
        assert w.help((1,)) is False
    finally:
        gate.set()
    _collect(w)
    assert ran == ["ccoll-lane-reduce"]


@pytest.mark.parametrize("critical", [False, True])
def test_help_takes_a_queued_decode_unless_a_critical_task_waits(critical):
    w = Worker("test-worker", lanes=_lanes)
    gate = _hold(w, "reduce", (2,))  # running, but not below the decodes
    ran: list[str] = []
    if critical:
        w.submit((0, 5), _name_into(ran), "combine", lane="reduce")
    w.submit((1, 0), _name_into(ran), "decode", lane="reduce")
    try:
        if critical:
            assert w.help((1,)) is False
        else:
            assert w.help((1,)) is True  # on the caller
            assert w.help((1,)) is False  # nothing left
    finally:
        gate.set()
    _collect(w)
    me = threading.current_thread().name
    want = ["ccoll-lane-reduce"] * 2 if critical else [me]
    assert ran == want
    assert sched_mod._busy["cpu"] == 0


def test_discard_drops_queued_lane_tasks():
    w = Worker("test-worker", lanes=_lanes)
    gate = _hold(w, "compress")
    ran: list[int] = []
    for k in range(3):
        w.submit((k,), lambda k=k: ran.append(k), k, lane="compress")
    w.discard()
    gate.set()
    default_scheduler("cpu").lane("compress").synchronize()
    assert ran == [] and w.outstanding == 0
    assert sched_mod._busy["cpu"] == 0


_LANE_COUNT = """
import numba
from ccoll.gpu_sched import Scheduler
from ccoll.runtime import cpu_threads

cpu_threads.prepare()
cpu_threads.set_thread_count(1)  # the rank's share, below the lane's grid_limit of 2

def launch():
    with cpu_threads.parallel_launch():
        return numba.get_num_threads()

with Scheduler("cpu", max_sm_fraction=0.5) as s:
    print(s.grid_limit("compress"), s.lane("compress").submit(launch).wait(60))
"""


def test_a_lane_kernel_uses_the_smaller_of_share_and_grid_limit(tmp_path):
    # A pool of 4 (on any machine): the lane caps at 2 threads, the share is 1.
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_NUM_THREADS": "4"}
    env.pop("CCOLL_THREADS", None)
    out = subprocess.run([sys.executable, "-c", _LANE_COUNT], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1"], out.stdout


def test_a_lane_left_failed_by_other_work_fails_the_task_instead_of_hanging():
    lane = default_scheduler("cpu").lane("compress")
    with pytest.raises(ZeroDivisionError):
        lane.submit(lambda: 1 / 0).wait(10)  # someone else's failure, not synchronized
    w = Worker("test-worker", lanes=_lanes)
    w.submit((0,), lambda: "ran", "t", lane="compress")
    ((tag, result, exc),) = _collect(w)[0]
    assert tag == "t" and result is None and isinstance(exc, CCollError)
    assert "'compress' lane failed earlier (ZeroDivisionError" in str(exc)
    assert "lane.synchronize()" in str(exc)
    with pytest.raises(ZeroDivisionError):
        lane.synchronize()  # reports and clears the lane's error
    w.submit((0,), lambda: "ran", "again", lane="compress")
    assert _collect(w)[0] == [("again", "ran", None)]
    assert sched_mod._busy["cpu"] == 0
