"""Where a collective's data lives, and how its bytes reach MPI from there.

Host data (numpy arrays, CPU tensors) is compressed by the CPU backend and its streams go
to MPI as they are. Device data (numba device arrays, CuPy, CUDA tensors: whatever
``ccoll.compressor`` routes to its CUDA backend) is compressed, added and decoded on the
device; its streams reach MPI

- directly, when the loaded MPI library is CUDA-aware (``MPIX_Query_cuda_support()``
  returns 1; after a device synchronization, since MPI ignores CUDA streams), or
- through pinned host buffers otherwise (both pip wheels of MPICH and Open MPI): a stream
  is copied to a pinned buffer before its send and a received stream is copied to the
  device before its add. Only compressed bytes make these trips.

``CCOLL_CUDA_AWARE=0`` or ``=1`` overrides the detection.

The device work runs on the streams of the process-wide CUDA scheduler's lanes
(:class:`DeviceLanes`, ``ccoll.gpu_sched.default_scheduler("cuda")``): compression on
``compress`` (its grid capped by ``grid_limit("compress")``), homomorphic adds, decodes and
the DAR add/divide on ``reduce``, host<->device copies on ``copy``. Each task waits for its
own stream before it returns, so MPI and the next task only ever see finished bytes.
Without lanes (``CCOLL_SCHED=off``, ``configure(enabled=False)``) everything runs on the
default stream, as before the lanes.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "HOST", "HostPlace", "DevicePlace", "DeviceLanes", "cuda_aware_mpi", "is_device",
    "DeviceData", "device_lanes",
]

_aware: bool | None = None
_aware_lock = threading.Lock()


def cuda_aware_mpi() -> bool:
    """Return True when the MPI library that mpi4py loaded accepts device pointers."""
    global _aware
    with _aware_lock:
        if _aware is None:
            from ccoll.settings import current

            forced = current().cuda_aware  # CCOLL_CUDA_AWARE, read once
            _aware = forced if forced is not None else _query_cuda_support()
        return _aware


def _query_cuda_support() -> bool:
    from mpi4py import MPI  # noqa: F401 - loads libmpi
    from numba.core import config

    if getattr(config, "ENABLE_CUDASIM", 0):
        return False  # simulator "device" arrays are host memory: exercise the staging path
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({ln.split()[-1] for ln in maps if "libmpi" in ln and "/" in ln})
    except OSError:
        pass
    for path in [*paths, None]:
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if fn is not None:
            fn.restype = ctypes.c_int
            return bool(fn())
    return False


def is_device(x: Any) -> bool:
    """Return True when the compressor would route ``x`` to its CUDA backend."""
    from ccoll.compressor._backend import backend_of

    return backend_of(x) == "cuda"


class HostPlace:
    """Streams and arrays in host memory: MPI reads and writes them directly."""

    device = False
    lanes: DeviceLanes  # no streams: set below, after DeviceLanes

    def recv_buffers(self, ch: Any, count: int, nbytes: int) -> list[Any]:
        """Receive buffers for ``count`` chunk streams of up to ``nbytes`` each."""
        return ch.recv_buffers(count, nbytes)

    def for_send(self, stream: Any, nb: int) -> tuple[Any, Any]:
        """Return the buffer to give MPI for the first ``nb`` bytes of ``stream``, and a token."""
        return stream[:nb], None

    def sent(self, token: Any) -> None:
        """Release what :meth:`for_send` lent once the send completed."""

    def received(self, buf: Any, nb: int) -> Any:
        """Return the stream to compute on from a receive buffer holding ``nb`` bytes."""
        return buf[:nb]

    def to_host(self, stream: Any, nb: int) -> np.ndarray:
        """Return the first ``nb`` bytes of ``stream`` in host memory."""
        return stream[:nb]

    def to_place(self, host: np.ndarray) -> Any:
        """Return host bytes where this place computes (here: unchanged)."""
        return host

    def task(self, lane: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Return ``fn`` as a task of ``lane`` (host data: ``fn`` itself)."""
        return fn


class DeviceLanes:
    """The streams of the CUDA scheduler's lanes that a collective's device work uses.

    ``sched`` None (lanes off): every call gets no ``stream=`` (numba's default stream) and
    no ``max_blocks``, as before the lanes.
    """

    def __init__(self, sched: Any) -> None:
        self.sched = sched

    def stream(self, lane: str) -> Any:
        """Return the lane's numba stream, or None (default stream)."""
        return None if self.sched is None else self.sched.lane(lane).stream

    def kw(self, lane: str) -> dict[str, Any]:
        """Keyword arguments of a compressor call on ``lane``: ``stream=`` (or none)."""
        s = self.stream(lane)
        return {} if s is None else {"stream": s}

    def compress_kw(self) -> dict[str, Any]:
        """``stream=`` and ``max_blocks=grid_limit("compress")`` of a compression (or none)."""
        if self.sched is None:
            return {}
        return {"stream": self.stream("compress"),
                "max_blocks": self.sched.grid_limit("compress")}

    def after(self, lane: str, before: str) -> None:
        """Make ``lane``'s later work wait for what ``before``'s stream holds (an event)."""
        if self.sched is not None and lane != before:
            self.sched.lane(lane).wait(self.sched.lane(before).record())

    def finish(self, lane: str) -> None:
        """Block until ``lane``'s stream has done its work (nothing to do without lanes).

        A task's result (a stream MPI sends, an array the next task reads) is complete
        only then: the compressor returns with its last copies still queued.
        """
        s = self.stream(lane)
        if s is not None:  # without lanes the default stream orders everything, as before
            s.synchronize()

    def busy(self) -> Any:
        """Context manager: count a collective on the lanes (``configure()`` then refuses)."""
        from contextlib import nullcontext

        if self.sched is None:
            return nullcontext()
        return _Busy()


class _Busy:
    def __enter__(self) -> None:
        from ccoll.gpu_sched import scheduler as _sched

        _sched.task_started("cuda")

    def __exit__(self, *exc: object) -> None:
        from ccoll.gpu_sched import scheduler as _sched

        _sched.task_finished("cuda")


HostPlace.lanes = DeviceLanes(None)
HOST = HostPlace()


def device_lanes(enabled: bool = True) -> DeviceLanes:
    """Return the lanes for device data now: the CUDA scheduler's, unless lanes are off.

    ``enabled``: the Communicator's ``CCOLL_SCHED`` setting; :func:`ccoll.gpu_sched.configure`
    can turn the lanes off too.
    """
    from ccoll.gpu_sched.scheduler import configured_on, default_scheduler

    return DeviceLanes(default_scheduler("cuda") if enabled and configured_on() else None)


class DevicePlace(HostPlace):
    """Streams on a CUDA device; MPI gets device pointers or pinned host copies."""

    device = True

    def __init__(self, ch: Any, cuda_aware: bool, lanes: DeviceLanes | None = None) -> None:
        from numba import cuda

        self._cuda = cuda
        self._ch = ch
        self.cuda_aware = cuda_aware
        self.lanes = lanes if lanes is not None else DeviceLanes(None)

    def task(self, lane: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Return ``fn`` followed by a wait for ``lane``'s stream: the task ends with its work."""
        lanes = self.lanes

        def run() -> Any:
            out = fn()
            lanes.finish(lane)
            return out

        return run

    def recv_buffers(self, ch: Any, count: int, nbytes: int) -> list[Any]:
        """Device receive buffers (CUDA-aware MPI) or pinned host ones."""
        if self.cuda_aware:
            return [self._cuda.device_array(nbytes, np.uint8) for _ in range(count)]
        return [ch.pinned(nbytes) for _ in range(count)]

    def for_send(self, stream: Any, nb: int) -> tuple[Any, Any]:
        """Synchronize and hand MPI the device stream, or a pinned host copy of it."""
        if self.cuda_aware:
            self._cuda.synchronize()
            return stream[:nb], None
        host = self._ch.pinned(nb)
        s = self.lanes.stream("copy")
        if s is None:
            stream[:nb].copy_to_host(host[:nb])
        else:  # the stream was finished by the task that made it
            stream[:nb].copy_to_host(host[:nb], stream=s)
            s.synchronize()  # MPI reads the pinned bytes next
        return host[:nb], host

    def sent(self, token: Any) -> None:
        """Return a pinned staging buffer to the channel's pool."""
        if token is not None:
            self._ch.unpin(token)

    def received(self, buf: Any, nb: int) -> Any:
        """Return the received stream on the device (copied there when it was staged)."""
        if self.cuda_aware:
            return buf[:nb]
        return self.to_place(buf[:nb])

    def to_host(self, stream: Any, nb: int) -> np.ndarray:
        """Copy the first ``nb`` bytes of a device stream to the host."""
        s = self.lanes.stream("copy")
        if s is None:
            return stream[:nb].copy_to_host()
        out = stream[:nb].copy_to_host(stream=s)
        s.synchronize()
        return out

    def to_place(self, host: np.ndarray) -> Any:
        """Copy host bytes to the device (complete on return)."""
        s = self.lanes.stream("copy")
        if s is None:
            return self._cuda.to_device(host)
        out = self._cuda.to_device(host, stream=s)
        # Wait here: the pinned source is reposted for the next receive right after this.
        s.synchronize()
        return out


class DeviceData:
    """A device array as the collectives see it: a flat numba view, its shape and dtype.

    ``export`` returns a result in the caller's kind (a CUDA tensor for tensors, a CuPy
    array for CuPy, the numba array otherwise), sharing memory.
    """

    def __init__(self, x: Any) -> None:
        from numba import cuda
        from numba.cuda.cudadrv import devicearray

        self.obj = x
        self.kind = type(x).__module__.split(".", 1)[0]
        # The stream whose work produced x (None: nothing to wait for). Not waited for here:
        # see ready(), which makes the lanes wait for it on the device where it can.
        self.producer: Any = None
        if devicearray.is_cuda_ndarray(x):
            arr = x
        elif self.kind == "torch":
            import torch

            # PyTorch exports no stream with its arrays: x is the caller's current stream's.
            self.producer = torch.cuda.current_stream(x.device)
            arr = cuda.as_cuda_array(x.detach())
        else:
            # sync=False: the stream the array interface names is waited for in ready().
            stream = getattr(x, "__cuda_array_interface__", {}).get("stream")
            self.producer = int(stream) if stream else None
            arr = cuda.as_cuda_array(x, sync=False)
        self.arr = arr
        self.shape = tuple(int(d) for d in arr.shape)
        self.dtype = np.dtype(arr.dtype)
        self.size = int(arr.size)
        self.contiguous = self.size == 0 or bool(arr.is_c_contiguous())

    def ready(self, lanes: DeviceLanes) -> None:
        """Order every later read of the data after the work of the stream that produced it.

        With the CUDA lanes, the ``compress`` and ``reduce`` lanes (the ones that read the
        input) wait for that stream on the device (an event; the host does not block).
        Without lanes the host waits for it, as readers on the default stream need. Once
        per call; later calls do nothing.
        """
        producer, self.producer = self.producer, None
        if producer is None:
            return
        sched = lanes.sched
        if sched is None:
            _numba_stream(producer).synchronize()  # torch, numba and CuPy streams all have it
            return
        ev = sched.lane("compress").wait_stream(_numba_stream(producer))
        sched.lane("reduce").wait(ev)

    def flat(self) -> Any:
        """Return the array as a 1-D device view (requires C-contiguity)."""
        return self.arr.reshape(self.size)

    def empty(self, shape: tuple[int, ...]) -> Any:
        """Return a new numba device array of ``shape`` and this dtype."""
        from numba import cuda

        return cuda.device_array(shape, self.dtype)

    def export(self, arr: Any) -> Any:
        """Return ``arr`` (numba) as an array of the input's kind."""
        if self.kind == "torch":
            import torch

            return torch.as_tensor(arr, device=self.obj.device)
        if self.kind == "cupy":
            import cupy

            return cupy.asarray(arr)
        return arr


def device_add(a: Any, b: Any, stream: Any = None) -> None:
    """Add ``b`` to ``a`` elementwise on the device, in their dtype (DAR ring on the GPU)."""
    from ccoll.collectives.devkernels import add_inplace

    add_inplace(a, b, stream)


def device_divide(a: Any, n: int, lanes: DeviceLanes | None = None) -> None:
    """Divide ``a`` by ``n`` on the device (IEEE division, as numpy on the host); wait for it.

    On the ``reduce`` lane's stream when ``lanes`` has a scheduler.
    """
    from ccoll.collectives.devkernels import divide_inplace

    ln = lanes if lanes is not None else DeviceLanes(None)
    divide_inplace(a, n, ln.stream("reduce"))
    ln.finish("reduce")


def _numba_stream(obj: Any) -> Any:
    """Return a caller's stream as a numba one (handles 0, 1, 2: numba's default streams)."""
    from numba import cuda

    from ccoll.gpu_sched.cuda_lanes import in_simulator, stream_pointer

    if in_simulator():
        return obj  # the simulator has numba streams only (as_numba_stream checks it)
    ptr = stream_pointer(obj)
    if ptr == 0:
        return cuda.default_stream()
    if ptr == 1:
        return cuda.legacy_default_stream()
    if ptr == 2:
        return cuda.per_thread_default_stream()
    return cuda.external_stream(ptr) if isinstance(obj, int) else obj
