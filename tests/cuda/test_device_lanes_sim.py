"""Device data on the CUDA scheduler's lanes, in the simulator: which call gets which stream.

The collectives' device work must run on the process-wide CUDA scheduler's lanes:
compression on ``compress`` with ``max_blocks=grid_limit("compress")``, homomorphic adds,
decodes and the DAR add/divide on ``reduce``, host<->device copies on ``copy``. The
simulator runs streams synchronously, so these tests spy on the arguments the compressor
and the kernels get; tests/mpi/test_collectives_gpu_sim.py checks the results.
``CCOLL_SCHED=off`` keeps numba's default stream (no ``stream=``, no ``max_blocks``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from numba import cuda

import ccoll
from ccoll.collectives import devkernels
from ccoll.collectives.dar import DarOps
from ccoll.collectives.devices import DeviceData, DeviceLanes, DevicePlace, device_lanes
from ccoll.collectives.homomorphic import HomomorphicOps
from ccoll.collectives.layout import Layout
from ccoll.collectives.ring import ring_ops
from ccoll.compressor import api as capi
from ccoll.gpu_sched import default_scheduler

COMM = MPI.COMM_WORLD


class Spy:
    """Record the keyword arguments of the compressor's calls (and pass them on)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        for name in ("compress_abs", "decompress", "add_data", "add"):
            self._wrap(monkeypatch, name)

    def _wrap(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        real = getattr(capi, name)

        def spy(*args: Any, **kw: Any) -> Any:
            self.calls.append((name, dict(kw)))
            return real(*args, **kw)

        monkeypatch.setattr(capi, name, spy)

    def of(self, name: str) -> list[dict[str, Any]]:
        return [kw for n, kw in self.calls if n == name]


def data(n: int, dtype=np.float32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 1e-2).astype(dtype)


@pytest.fixture
def sched(monkeypatch):
    monkeypatch.delenv("CCOLL_SCHED", raising=False)
    return default_scheduler("cuda")


def test_device_lanes_follow_ccoll_sched(monkeypatch, sched):
    on = device_lanes()
    assert on.sched is sched
    assert on.stream("compress") is sched.lane("compress").stream
    assert on.compress_kw() == {"stream": sched.lane("compress").stream,
                                "max_blocks": sched.grid_limit("compress")}
    assert on.kw("reduce") == {"stream": sched.lane("reduce").stream}
    # CCOLL_SCHED=off, as a Communicator's settings pass it on (its channels' lanes flag).
    off = device_lanes(False)
    assert off.sched is None and off.compress_kw() == {} and off.kw("reduce") == {}


@pytest.mark.parametrize("algorithm", ["homomorphic", "dar"])
def test_one_rank_allreduce_compresses_on_compress_lane_and_decodes_on_reduce(
        monkeypatch, sched, algorithm):
    spy = Spy(monkeypatch)
    x = data(200)
    with ccoll.Communicator(COMM, policy="compress", chunk_elems=100) as c:
        want = ccoll.allreduce(x, eb=1e-3, comm=c, algorithm=algorithm)
        spy.calls.clear()
        y = ccoll.allreduce(cuda.to_device(x), eb=1e-3, comm=c, algorithm=algorithm, op="avg")
    assert y.copy_to_host().tobytes() == want.tobytes()  # avg of one rank: the sum
    comp, dec = spy.of("compress_abs"), spy.of("decompress")
    assert len(comp) == 2 and len(dec) == 2  # one per chunk
    for kw in comp:
        assert kw["stream"] is sched.lane("compress").stream
        assert kw["max_blocks"] == sched.grid_limit("compress")
    for kw in dec:
        assert kw["stream"] is sched.lane("reduce").stream


def test_ccoll_sched_off_keeps_the_default_stream(monkeypatch):
    monkeypatch.setenv("CCOLL_SCHED", "off")
    spy = Spy(monkeypatch)
    x = data(200)
    with ccoll.Communicator(COMM, policy="compress", chunk_elems=100) as c:
        y = ccoll.allreduce(cuda.to_device(x), eb=1e-3, comm=c)
        want = ccoll.allreduce(x, eb=1e-3, comm=c)
    assert y.copy_to_host().tobytes() == want.tobytes()
    assert spy.of("compress_abs") and spy.of("decompress")
    for _, kw in spy.calls:
        assert kw.get("stream") is None and kw.get("max_blocks") is None


def test_allgather_and_bcast_use_the_lanes(monkeypatch, sched):
    spy = Spy(monkeypatch)
    x = data(100)
    with ccoll.Communicator(COMM, policy="compress") as c:
        ccoll.allgather(cuda.to_device(x), eb=1e-3, comm=c)
        ccoll.bcast(cuda.to_device(x), eb=1e-3, root=0, comm=c)
    comp, dec = spy.of("compress_abs"), spy.of("decompress")
    assert len(comp) == 2 and len(dec) == 2
    assert all(kw["stream"] is sched.lane("compress").stream for kw in comp)
    assert all(kw["max_blocks"] == sched.grid_limit("compress") for kw in comp)
    assert all(kw["stream"] is sched.lane("reduce").stream for kw in dec)


def test_homomorphic_combine_adds_on_reduce_lane(monkeypatch, sched):
    x = data(200)
    layout = Layout(x.size, 2, 100)
    lanes = DeviceLanes(sched)
    ops = HomomorphicOps(cuda.to_device(x), layout, 1e-3, lanes)
    lo, hi = layout.chunks(1)[0]
    # A received stream on the device (made on the host: the same bytes, no kernel launch).
    received = cuda.to_device(capi.compress_abs(data(hi - lo, seed=1), 1e-3))
    spy = Spy(monkeypatch)
    out = ops.combine(1, 0, received)
    assert spy.of("add_data") == [{"stream": sched.lane("reduce").stream}]
    want = capi.add_data(received.copy_to_host(), x[lo:hi], 1e-3)
    assert out.copy_to_host().tobytes() == want.tobytes()  # the same bytes as the host's


def test_dar_combine_decodes_and_adds_on_reduce_recompresses_on_compress(monkeypatch, sched):
    x = data(200)
    layout = Layout(x.size, 2, 100)
    place = DevicePlace(None, False, DeviceLanes(sched))
    ops = ring_ops(cuda.to_device(x), layout, "dar", 1e-3, place)
    assert isinstance(ops, DarOps)
    launches: list[Any] = []
    real_add = devkernels.add_inplace

    def add_spy(a: Any, b: Any, stream: Any = None) -> None:
        launches.append(stream)
        real_add(a, b, stream)

    monkeypatch.setattr(devkernels, "add_inplace", add_spy)
    lo, hi = layout.chunks(1)[0]
    received = cuda.to_device(capi.compress_abs(data(hi - lo, seed=1), ops.eb_step))
    spy = Spy(monkeypatch)
    out = ops.combine(1, 0, received)
    assert spy.of("decompress") == [{"stream": sched.lane("reduce").stream}]
    assert launches == [sched.lane("reduce").stream]
    assert spy.of("compress_abs") == [{"stream": sched.lane("compress").stream,
                                       "max_blocks": sched.grid_limit("compress"),
                                       "version": 1}]  # the plan's stream format
    part = capi.decompress(received.copy_to_host()) + x[lo:hi]
    assert out.copy_to_host().tobytes() == capi.compress_abs(part, ops.eb_step).tobytes()


class _Launch:
    """Stands in for a cuda.jit kernel: records the launch configuration, runs the real one."""

    def __init__(self, kernel: Any, log: list[tuple[Any, ...]]) -> None:
        self.kernel, self.log = kernel, log

    def __getitem__(self, config: tuple[Any, ...]) -> Any:
        self.log.append(config)
        return self.kernel[config]


@pytest.mark.parametrize("with_stream", [True, False])
def test_devkernels_launch_on_the_given_stream(monkeypatch, with_stream):
    log: list[tuple[Any, ...]] = []
    monkeypatch.setattr(devkernels, "_add", _Launch(devkernels._add, log))
    monkeypatch.setattr(devkernels, "_divide", _Launch(devkernels._divide, log))
    s = cuda.stream() if with_stream else None
    a = cuda.to_device(np.arange(300, dtype=np.float32))
    b = cuda.to_device(np.ones(300, dtype=np.float32))
    devkernels.add_inplace(a, b, s)
    devkernels.divide_inplace(a, 3, s)
    want = (np.arange(300, dtype=np.float32) + np.float32(1)) / np.float32(3)
    assert a.copy_to_host().tobytes() == want.tobytes()
    tail = (s,) if with_stream else ()
    assert log == [(2, 256, *tail), (2, 256, *tail)]


class _CopyCuda:
    """numba.cuda stand-in for DevicePlace: records the stream of to_device."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def to_device(self, host: Any, stream: Any = None) -> Any:
        self.log.append(("to_device", stream))
        return cuda.to_device(host)


class _Stream:
    """A device stream stand-in whose slices record the stream of copy_to_host."""

    def __init__(self, arr: Any, log: list[Any]) -> None:
        self.arr, self.log = arr, log

    def __getitem__(self, sl: slice) -> Any:
        outer = self

        class View:
            def copy_to_host(self, ary: Any = None, stream: Any = None) -> Any:
                outer.log.append(("copy_to_host", stream))
                return outer.arr[sl].copy_to_host(ary)

        return View()


class _Pins:
    def pinned(self, nb: int) -> np.ndarray:
        return np.empty(nb, np.uint8)

    def unpin(self, buf: Any) -> None:
        pass


@pytest.mark.parametrize("lanes_on", [True, False])
def test_device_place_copies_on_the_copy_lane(monkeypatch, sched, lanes_on):
    log: list[Any] = []
    place = DevicePlace(_Pins(), False, DeviceLanes(sched if lanes_on else None))
    place._cuda = _CopyCuda(log)
    dev = _Stream(cuda.to_device(np.arange(16, dtype=np.uint8)), log)
    host, token = place.for_send(dev, 10)
    assert host.tobytes() == bytes(range(10))
    assert place.to_host(dev, 4).tobytes() == bytes(range(4))
    back = place.received(np.arange(8, dtype=np.uint8), 6)
    assert back.copy_to_host().tobytes() == bytes(range(6))
    want = sched.lane("copy").stream if lanes_on else None
    assert log == [("copy_to_host", want), ("copy_to_host", want), ("to_device", want)]


def test_device_data_waits_for_its_producer_on_the_lanes_or_the_host(sched):
    waited: list[Any] = []

    class Lane:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, s: Any) -> str:
            waited.append((self.name, "stream", s))
            return "ev"

        def wait(self, ev: Any) -> None:
            waited.append((self.name, "event", ev))

    class Sched:
        def lane(self, name: str) -> Lane:
            return Lane(name)

    class Producer:
        synced = 0

        def synchronize(self) -> None:
            Producer.synced += 1

    d = DeviceData(cuda.to_device(np.zeros(4, np.float32)))
    assert d.producer is None  # a numba array: produced by numba's own (default) stream
    p = Producer()
    d.producer = p
    d.ready(DeviceLanes(Sched()))
    assert waited == [("compress", "stream", p), ("reduce", "event", "ev")]
    assert Producer.synced == 0  # the host did not block
    d.ready(DeviceLanes(Sched()))  # once per call
    assert len(waited) == 2
    d.producer = p
    d.ready(DeviceLanes(None))  # without lanes the host waits, as before the lanes
    assert Producer.synced == 1
