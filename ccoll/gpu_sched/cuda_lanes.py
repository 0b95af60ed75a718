"""CUDA lanes: one prioritized CUDA stream per lane, CUDA events between them.

Streams come from the first source that works, in this order:

1. CuPy: ``cupy.cuda.Stream(non_blocking=True, priority=p)``;
2. cuda.core: ``Device.create_stream(options=StreamOptions(nonblocking=True, priority=p))``;
3. numba's ``cuda.stream()``, which has no priority (logged as a warning).

Each is wrapped for numba with ``numba.cuda.external_stream(ptr)``, so kernels launch on
``lane.stream`` and numba events (``cuda.event()``) record on and wait for it. Priorities
come from the device's range (``deviceGetStreamPriorityRange``; lower number = higher
priority). numba's CUDA simulator has no external streams and no priorities; there every
lane gets a plain ``cuda.stream()``, and work runs synchronously.

A lane's ``submit`` calls ``fn`` at once on the submitting thread: ``fn`` enqueues its work
on ``lane.stream`` (``ccoll.gpu_sched.current_stream()`` returns it while ``fn`` runs), and
the lane records an event after it. Dependencies become ``cuStreamWaitEvent`` calls issued
before ``fn`` runs, so nothing blocks the host.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ccoll.errors import CCollError, CCollTimeoutError
from ccoll.gpu_sched.lanes import LANES, Event, Lane, _current_lane

__all__ = [
    "CudaEvent",
    "CudaLane",
    "StreamSource",
    "as_numba_stream",
    "device_limits",
    "in_simulator",
    "make_cuda_lanes",
    "priority_value",
    "stream_pointer",
]

_log = logging.getLogger(__name__)

# Stand-ins for device attributes the simulator does not have.
_SIM_LIMITS = (1, 2048, 32)


def in_simulator() -> bool:
    """Return True when numba runs its CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def device_limits() -> tuple[int, int, int]:
    """Return (SM count, max threads per SM, max blocks per SM) of numba's current device."""
    if in_simulator():
        return _SIM_LIMITS
    from numba import cuda

    dev = cuda.get_current_device()
    return (
        int(dev.MULTIPROCESSOR_COUNT),
        int(dev.MAX_THREADS_PER_MULTIPROCESSOR),
        int(dev.MAX_BLOCKS_PER_MULTIPROCESSOR),
    )


def priority_value(rank: int, max_rank: int, least: int, greatest: int) -> int:
    """Map a priority rank (0 = highest) onto the device range [greatest, least].

    CUDA numbers priorities downwards: ``greatest`` (e.g. -5) is the highest priority,
    ``least`` (0) the lowest. Rank 0 gets ``greatest``, the largest rank gets ``least``.
    """
    if max_rank <= 0:
        return greatest
    return int(greatest + round((least - greatest) * rank / max_rank))


class StreamSource:
    """Creates the lanes' streams: ``create(priority) -> (numba stream, owner or None)``."""

    def __init__(
        self,
        kind: str,
        create: Callable[[int | None], tuple[Any, Any]],
        least: int = 0,
        greatest: int = 0,
        prioritized: bool = True,
    ) -> None:
        self.kind = kind
        self.create = create
        self.least = least
        self.greatest = greatest
        self.prioritized = prioritized


def _numba_device_id() -> int:
    from numba import cuda

    cuda.current_context()  # make numba's (primary) context current before others use it
    return int(cuda.get_current_device().id)


def _cupy_source() -> StreamSource:
    import cupy
    from numba import cuda

    dev_id = _numba_device_id()
    with cupy.cuda.Device(dev_id):
        least, greatest = cupy.cuda.runtime.deviceGetStreamPriorityRange()

    def create(p: int | None) -> tuple[Any, Any]:
        with cupy.cuda.Device(dev_id):
            s = cupy.cuda.Stream(non_blocking=True, priority=p)
        return cuda.external_stream(int(s.ptr)), s

    return StreamSource("cupy", create, int(least), int(greatest))


def _cuda_core_source() -> StreamSource:
    from cuda.bindings import driver as cu
    from cuda.core import Device, StreamOptions
    from numba import cuda

    dev = Device(_numba_device_id())
    dev.set_current()
    err, least, greatest = cu.cuCtxGetStreamPriorityRange()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuCtxGetStreamPriorityRange failed: {err}")

    def create(p: int | None) -> tuple[Any, Any]:
        s = dev.create_stream(options=StreamOptions(nonblocking=True, priority=p))
        return cuda.external_stream(int(s.handle)), s

    return StreamSource("cuda.core", create, int(least), int(greatest))


def _numba_source(kind: str = "numba") -> StreamSource:
    from numba import cuda

    def create(p: int | None) -> tuple[Any, Any]:
        return cuda.stream(), None

    return StreamSource(kind, create, prioritized=False)


def _stream_source() -> StreamSource:
    """Return the first stream source that works here (see the module docstring)."""
    if in_simulator():
        _log.info("CUDA simulator: lanes use numba streams without priorities")
        return _numba_source("simulator")
    reasons = []
    for label, make in (("CuPy", _cupy_source), ("cuda.core", _cuda_core_source)):
        try:
            return make()
        except Exception as exc:  # noqa: BLE001 - absent or unusable: try the next source
            reasons.append(f"{label}: {type(exc).__name__}: {exc}")
    _log.warning(
        "neither CuPy nor cuda.core could create prioritized CUDA streams (%s); ccoll's "
        "lanes fall back to numba streams without priorities, so compression competes with "
        "training on equal terms",
        "; ".join(reasons),
    )
    return _numba_source()


def stream_pointer(obj: Any) -> int:
    """Return the ``cudaStream_t`` of a user's stream object as an int.

    Accepts objects with ``__cuda_stream__`` (cuda.core, numba, recent CuPy and PyTorch),
    ``torch.cuda.Stream`` (``.cuda_stream``), CuPy streams (``.ptr``) and raw ints.
    """
    if isinstance(obj, bool):
        raise TypeError("a stream cannot be a bool")
    if isinstance(obj, int):
        return obj
    if hasattr(obj, "__cuda_stream__"):
        version, ptr = obj.__cuda_stream__()
        if version != 0:
            raise ValueError(f"unsupported __cuda_stream__ protocol version {version}")
        return int(ptr)
    if hasattr(obj, "cuda_stream"):  # torch.cuda.Stream
        return int(obj.cuda_stream)
    if hasattr(obj, "ptr"):  # cupy.cuda.Stream
        return int(obj.ptr)
    raise TypeError(
        "expected a CUDA stream (torch.cuda.Stream, CuPy or numba stream, an object with "
        f"__cuda_stream__, or a cudaStream_t int), got {type(obj).__name__}"
    )


def as_numba_stream(obj: Any) -> Any:
    """Return a numba stream for a user's stream object (see :func:`stream_pointer`).

    The caller keeps ownership and must keep the stream alive while ccoll uses it.
    """
    from numba import cuda

    if in_simulator():
        from numba.cuda.simulator.api import stream as sim_stream

        if isinstance(obj, sim_stream):
            return obj
        raise ValueError(
            "the CUDA simulator has no external streams; only numba streams "
            f"(cuda.stream()) can be adopted there, got {type(obj).__name__}"
        )
    from numba.cuda.cudadrv.driver import Stream as NumbaStream

    if isinstance(obj, NumbaStream):
        return obj
    return cuda.external_stream(stream_pointer(obj))


class _NumbaApi:
    """Events and stream wrapping through numba (the one place that touches numba.cuda)."""

    def __init__(self) -> None:
        self.simulator = in_simulator()

    def event(self) -> Any:
        from numba import cuda

        make: Any = cuda.event
        # The simulator's cuda.event() takes no arguments; on hardware skip timing (cheaper).
        return make() if self.simulator else make(timing=False)

    def wrap_stream(self, obj: Any) -> Any:
        return as_numba_stream(obj)


def _default_api() -> Any:
    return _NumbaApi()


class CudaEvent(Event):
    """A CUDA event recorded after a lane's work, with the callable's host-side result."""

    __slots__ = ("lane", "native", "_result", "_exc")

    def __init__(
        self, lane: CudaLane | None, native: Any, result: Any = None,
        exc: BaseException | None = None,
    ) -> None:
        self.lane = lane
        self.native = native
        self._result = result
        self._exc = exc

    def query(self) -> bool:
        """Return True when the GPU has passed the event (or it failed on the host)."""
        if self._exc is not None:
            return True
        q = getattr(self.native, "query", None)
        return True if q is None else bool(q())  # the simulator runs synchronously

    def wait(self, timeout: float | None = None) -> Any:
        """Block the host until the GPU passed the event; return ``fn``'s return value."""
        if self._exc is not None:
            raise self._exc
        if timeout is None:
            self.native.synchronize()
        else:
            deadline = time.monotonic() + timeout
            pause = 1e-5
            while not self.query():
                if time.monotonic() >= deadline:
                    raise CCollTimeoutError(f"CUDA event did not complete within {timeout} s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        return self._result

    @property
    def error(self) -> BaseException | None:
        """The exception the event failed with on the host, or None."""
        return self._exc

    def __repr__(self) -> str:
        name = self.lane.name if self.lane is not None else "-"
        return f"<ccoll CudaEvent lane={name} {'failed' if self._exc else 'recorded'}>"


def _check_events(events: Iterable[Any]) -> tuple[CudaEvent, ...]:
    out = tuple(events)
    for e in out:
        if not isinstance(e, CudaEvent):
            raise TypeError(
                f"a CUDA lane can wait only on events of CUDA lanes, got {type(e).__name__}"
            )
    return out


class CudaLane(Lane):
    """A CUDA stream with a priority; see the module docstring."""

    def __init__(
        self, name: str, priority: int | None, stream: Any, owner: Any = None, api: Any = None
    ) -> None:
        self.name = name
        self.priority = priority
        self.stream = stream
        self._api = api if api is not None else _default_api()
        self._owned = [owner] if owner is not None else []  # streams we must destroy
        self._borrowed: list[Any] = []  # users' streams we keep alive while in use
        self._error: BaseException | None = None
        self._closed = False
        # Reentrant: fn may submit to this lane again (it then runs inline, in order).
        self._lock = threading.RLock()

    def _failed(self, exc: BaseException) -> CudaEvent:
        return CudaEvent(self, None, None, exc)

    def _absorb(self, ev: CudaEvent) -> None:
        if ev._exc is not None:
            if self._error is None:
                self._error = ev._exc
        elif ev.native is not None:
            ev.native.wait(self.stream)

    def _check_open(self) -> None:
        if self._closed:
            raise CCollError(f"lane {self.name!r} is closed")

    def submit(
        self, fn: Callable[..., Any], *args: Any, after: Iterable[Event] = (), **kwargs: Any
    ) -> CudaEvent:
        """Wait for ``after`` on this stream, call ``fn`` to enqueue its work, record an event."""
        if not callable(fn):
            raise TypeError(f"submit expects a callable, got {type(fn).__name__}")
        deps = _check_events(after)
        with self._lock:
            self._check_open()
            for d in deps:
                self._absorb(d)
            if self._error is not None:
                return self._failed(self._error)
            token = _current_lane.set(self)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - goes to the event's waiters
                self._error = exc
                return self._failed(exc)
            finally:
                _current_lane.reset(token)
            native = self._api.event()
            native.record(self.stream)
            return CudaEvent(self, native, result)

    def record(self) -> CudaEvent:
        """Record an event after all work enqueued on the lane's stream so far."""
        with self._lock:
            self._check_open()
            if self._error is not None:
                return self._failed(self._error)
            native = self._api.event()
            native.record(self.stream)
            return CudaEvent(self, native)

    def wait(self, event: Event) -> None:
        """Make the lane's stream wait for ``event`` (``cuStreamWaitEvent``; no host block)."""
        (ev,) = _check_events([event])
        with self._lock:
            self._check_open()
            self._absorb(ev)

    def wait_stream(self, user_stream: Any) -> CudaEvent:
        """Record an event on the user's stream and make this lane wait for it."""
        s = self._api.wrap_stream(user_stream)
        native = self._api.event()
        native.record(s)
        ev = CudaEvent(None, native)
        self.wait(ev)
        return ev

    def adopt(self, user_stream: Any) -> None:
        """Run this lane's future work on ``user_stream``, after the work already queued."""
        s = self._api.wrap_stream(user_stream)
        with self._lock:
            self._check_open()
            # Keep the lane's order: the new stream starts after what the old one holds.
            mark = self._api.event()
            mark.record(self.stream)
            mark.wait(s)
            self._borrowed.append(user_stream)
            self.stream = s
            self.priority = None  # the user's stream has whatever priority it was given

    def synchronize(self) -> None:
        """Block until the lane's stream is idle; raise (and clear) the lane's error."""
        with self._lock:
            stream = self.stream
        stream.synchronize()
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        """Wait for the stream's work, then destroy the streams this lane created."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.stream.synchronize()
            for owner in self._owned:
                close = getattr(owner, "close", None)  # cuda.core; CuPy frees on release
                if close is not None:
                    close()
            self._owned.clear()
            self._borrowed.clear()


def make_cuda_lanes(
    ranks: Mapping[str, int], *, source: StreamSource | None = None, api: Any = None
) -> dict[str, Lane]:
    """Create one stream per lane with priorities spread from the lanes' ``ranks``."""
    src = source if source is not None else _stream_source()
    max_rank = max(ranks.values())
    lanes: dict[str, Lane] = {}
    for name in LANES:
        p = priority_value(ranks[name], max_rank, src.least, src.greatest)
        stream, owner = src.create(p if src.prioritized else None)
        lanes[name] = CudaLane(name, p if src.prioritized else None, stream, owner, api)
    _log.debug("CUDA lanes from %s: %s", src.kind, {n: ln.priority for n, ln in lanes.items()})
    return lanes
