"""CUDA lanes in the simulator: streams/events wiring, priorities, fallbacks, grid limits.

The simulator runs streams synchronously and has no external streams, so concurrency is
not what is tested here. The dependency graph is: a fake CUDA API records every event
record/wait the lanes issue, and the tests compare that log with the expected graph.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
from numba import cuda

from ccoll.errors import CCollError, CCollTimeoutError
from ccoll.gpu_sched import Scheduler, current_stream
from ccoll.gpu_sched import cuda_lanes as cl
from ccoll.gpu_sched.cuda_lanes import CudaEvent, StreamSource, priority_value, stream_pointer

# -- the real simulator -------------------------------------------------------------------


@cuda.jit
def _scale(x, a, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = a * x[i]


@pytest.fixture
def sim_sched():
    s = Scheduler("cuda")
    yield s
    s.close()


def test_simulator_lanes_are_numba_streams_without_priority(sim_sched):
    from numba.cuda.simulator.api import stream as sim_stream

    for lane in sim_sched.lanes.values():
        assert isinstance(lane.stream, sim_stream)
        assert lane.priority is None


def test_kernels_on_lanes_with_dependencies(sim_sched):
    x = np.arange(100, dtype=np.float32)
    d_x = cuda.to_device(x)
    d_y = cuda.device_array_like(d_x)
    d_z = cuda.device_array_like(d_x)
    compress, reduce = sim_sched.lane("compress"), sim_sched.lane("reduce")

    def first():
        _scale[4, 32, current_stream()](d_x, np.float32(2), d_y)
        return "first"

    e1 = compress.submit(first)
    e2 = reduce.submit(lambda: _scale[4, 32, reduce.stream](d_y, np.float32(3), d_z), after=[e1])
    assert e1.wait() == "first"
    e2.wait(timeout=5)
    assert e1.query() and e2.query()
    np.testing.assert_array_equal(d_z.copy_to_host(), 6 * x)
    sim_sched.synchronize()


def test_simulator_errors_are_sticky_until_synchronize(sim_sched):
    lane = sim_sched.lane("compress")
    bad = lane.submit(lambda: 1 / 0)
    assert bad.query() and isinstance(bad.error, ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        lane.record().wait()
    with pytest.raises(ZeroDivisionError):
        sim_sched.lane("copy").submit(lambda: "never", after=[bad]).wait()
    with pytest.raises(ZeroDivisionError):
        sim_sched.synchronize()
    assert lane.submit(lambda: 5).wait() == 5


def test_adopting_a_simulator_stream(sim_sched):
    user = cuda.stream()
    lane = sim_sched.adopt_stream(user)
    assert lane is sim_sched.lane("compute") and lane.stream is user
    assert sim_sched.lane("compress").wait_stream(user).query()
    with pytest.raises(ValueError, match="no external streams"):
        sim_sched.adopt_stream(12345)


def test_cpu_events_are_refused_by_cuda_lanes(sim_sched):
    with Scheduler("cpu") as cpu:
        ev = cpu.lane("compress").record()
        with pytest.raises(TypeError, match="events of CUDA lanes"):
            sim_sched.lane("reduce").submit(print, after=[ev])


@pytest.mark.parametrize(
    "sms,fraction,tpb,bps,want",
    [
        (None, 0.5, 256, None, 8),  # simulator stand-in: 1 SM, 2048 threads/SM
        (132, 0.5, 256, None, 66 * 8),
        (132, 0.5, 1024, None, 66 * 2),
        (132, 0.25, 32, None, 33 * 32),  # capped by 32 blocks per SM
        (132, 1.0, 256, 3, 132 * 3),
        (108, 0.3, 128, None, 32 * 16),
    ],
)
def test_grid_limit(sms, fraction, tpb, bps, want):
    with Scheduler("cuda", max_sm_fraction=fraction, sm_count=sms) as s:
        assert s.grid_limit("compress", threads_per_block=tpb, blocks_per_sm=bps) == want
        full = (sms or 1) * (bps or min(2048 // tpb, 32))
        assert s.grid_limit("compute", threads_per_block=tpb, blocks_per_sm=bps) == full


def test_grid_limit_rejects_impossible_blocks():
    with Scheduler("cuda", sm_count=10) as s:
        with pytest.raises(ValueError, match="blocks_per_sm must be > 0"):
            s.grid_limit("compress", threads_per_block=4096)
        with pytest.raises(ValueError, match="threads_per_block"):
            s.grid_limit("compress", threads_per_block=0)


# -- the dependency graph, on a recording fake ------------------------------------------


class FakeStream:
    def __init__(self, name):
        self.name = name

    def synchronize(self):
        LOG.append(("sync", self.name))


class FakeEvent:
    ids = itertools.count()

    def __init__(self):
        self.id = next(FakeEvent.ids)
        self.done = True

    def record(self, stream):
        LOG.append(("record", self.id, stream.name))

    def wait(self, stream):
        LOG.append(("wait", self.id, stream.name))

    def synchronize(self):
        LOG.append(("evsync", self.id))

    def query(self):
        return self.done


class FakeApi:
    def event(self):
        return FakeEvent()

    def wrap_stream(self, obj):
        return FakeStream(f"user:{obj}")


class FakeOwner:
    def __init__(self, name):
        self.name = name

    def close(self):
        LOG.append(("destroy", self.name))


LOG: list = []


@pytest.fixture
def fake(monkeypatch):
    LOG.clear()
    created = []

    def create(p):
        name = f"s{len(created)}"
        created.append((name, p))
        return FakeStream(name), FakeOwner(name)

    monkeypatch.setattr(cl, "_stream_source", lambda: StreamSource("fake", create, 0, -5))
    monkeypatch.setattr(cl, "_default_api", FakeApi)
    s = Scheduler("cuda")
    names = {n: lane.stream.name for n, lane in s.lanes.items()}
    LOG.clear()
    yield s, names, created
    s.close()


def test_streams_get_priorities_from_the_device_range(fake):
    s, names, created = fake
    assert [p for _, p in created] == [-5, 0, -3, -3]  # compute, compress, reduce, copy
    assert {n: s.priority(n) for n in names} == {
        "compute": -5, "compress": 0, "reduce": -3, "copy": -3}


def test_submit_waits_then_calls_then_records(fake):
    s, st, _ = fake
    e_train = s.lane("compute").record()
    e_comp = s.lane("compress").submit(lambda: LOG.append(("fn", "compress")), after=[e_train])
    s.lane("copy").submit(lambda: LOG.append(("fn", "copy")), after=[e_comp, e_train])
    t, c = e_train.native.id, e_comp.native.id
    assert LOG == [
        ("record", t, st["compute"]),
        ("wait", t, st["compress"]),
        ("fn", "compress"),
        ("record", c, st["compress"]),
        ("wait", c, st["copy"]),
        ("wait", t, st["copy"]),
        ("fn", "copy"),
        ("record", c + 1, st["copy"]),
    ]


def test_lane_wait_and_wait_stream(fake):
    s, st, _ = fake
    ev = s.lane("reduce").record()
    s.lane("copy").wait(ev)
    user_ev = s.lane("compress").wait_stream("torch-stream")
    assert LOG == [
        ("record", ev.native.id, st["reduce"]),
        ("wait", ev.native.id, st["copy"]),
        ("record", user_ev.native.id, "user:torch-stream"),
        ("wait", user_ev.native.id, st["compress"]),
    ]


def test_adopted_stream_continues_after_the_old_one(fake):
    s, st, _ = fake
    lane = s.adopt_stream("train")
    mark = LOG[0][1]
    assert LOG == [("record", mark, st["compute"]), ("wait", mark, "user:train")]
    assert lane.priority is None
    LOG.clear()
    e = s.lane("compute").record()
    s.lane("compress").submit(lambda: None, after=[e])
    assert LOG[:2] == [("record", e.native.id, "user:train"), ("wait", e.native.id, st["compress"])]


def test_failed_dependency_issues_nothing(fake):
    s, st, _ = fake
    bad = s.lane("compress").submit(lambda: 1 / 0)
    assert bad.native is None and LOG == []
    ran = []
    dep = s.lane("reduce").submit(ran.append, 1, after=[bad])
    assert ran == [] and LOG == [] and isinstance(dep.error, ZeroDivisionError)
    s.lane("copy").wait(bad)
    with pytest.raises(ZeroDivisionError):
        s.lane("copy").record().wait()
    with pytest.raises(ZeroDivisionError):
        s.synchronize()
    assert [e for e in LOG if e[0] != "sync"] == []


def test_event_wait_synchronizes_and_times_out(fake):
    s, st, _ = fake
    ev = s.lane("compress").submit(lambda: "result")
    assert ev.wait() == "result"
    assert LOG[-1] == ("evsync", ev.native.id)
    ev.native.done = False
    assert not ev.query()
    with pytest.raises(CCollTimeoutError, match="within 0.01 s"):
        ev.wait(timeout=0.01)
    ev.native.done = True
    assert ev.wait(timeout=1) == "result"


def test_close_synchronizes_then_destroys_owned_streams(fake):
    s, st, _ = fake
    s.adopt_stream("train", lane="copy")
    LOG.clear()
    s.close()
    for name in ("compute", "compress", "reduce", "copy"):
        stream = "user:train" if name == "copy" else st[name]
        i = LOG.index(("sync", stream))
        assert LOG[i + 1] == ("destroy", st[name])
    assert ("destroy", "user:train") not in LOG
    with pytest.raises(CCollError, match="closed"):
        s.lane("compute")


def test_nested_submit_to_the_same_lane_runs_in_order(fake):
    s, st, _ = fake
    lane = s.lane("reduce")
    inner = []

    def outer():
        inner.append(lane.submit(lambda: LOG.append(("fn", "inner"))))
        LOG.append(("fn", "outer"))

    lane.submit(outer)
    assert [e for e in LOG if e[0] == "fn"] == [("fn", "inner"), ("fn", "outer")]
    assert isinstance(inner[0], CudaEvent)


# -- stream sources and user streams -----------------------------------------------------


def test_fallback_to_numba_streams_without_priority_is_logged(monkeypatch, caplog):
    def absent():
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(cl, "in_simulator", lambda: False)
    monkeypatch.setattr(cl, "_cupy_source", absent)
    monkeypatch.setattr(cl, "_cuda_core_source", absent)
    with caplog.at_level(logging.WARNING, logger="ccoll.gpu_sched.cuda_lanes"):
        src = cl._stream_source()
    assert src.kind == "numba" and not src.prioritized
    assert "without priorities" in caplog.text and "CuPy: ImportError" in caplog.text
    stream, owner = src.create(None)
    assert owner is None and hasattr(stream, "synchronize")


def test_simulator_source_is_chosen_in_the_simulator():
    assert cl._stream_source().kind == "simulator"


@pytest.mark.parametrize(
    "rank,max_rank,least,greatest,want",
    [(0, 2, 0, -5, -5), (1, 2, 0, -5, -3), (2, 2, 0, -5, 0), (0, 0, 0, -5, -5),
     (1, 2, 0, 0, 0), (3, 3, 0, -1, 0), (1, 3, 0, -1, -1)],
)
def test_priority_value(rank, max_rank, least, greatest, want):
    assert priority_value(rank, max_rank, least, greatest) == want


class _TorchLike:
    cuda_stream = 0x1234


class _CupyLike:
    ptr = 0x5678


class _CoreLike:
    def __cuda_stream__(self):
        return (0, 0x9ABC)


class _FutureProtocol:
    def __cuda_stream__(self):
        return (1, 0x1)


@pytest.mark.parametrize(
    "obj,want", [(0x42, 0x42), (_TorchLike(), 0x1234), (_CupyLike(), 0x5678), (_CoreLike(), 0x9ABC)]
)
def test_stream_pointer(obj, want):
    assert stream_pointer(obj) == want


@pytest.mark.parametrize(
    "obj,exc", [(True, TypeError), ("s", TypeError), (_FutureProtocol(), ValueError)]
)
def test_stream_pointer_rejects(obj, exc):
    with pytest.raises(exc):
        stream_pointer(obj)
