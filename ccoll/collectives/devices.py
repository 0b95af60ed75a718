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
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np

__all__ = ["HOST", "HostPlace", "DevicePlace", "cuda_aware_mpi", "is_device", "DeviceData"]

_aware: bool | None = None
_aware_lock = threading.Lock()


def cuda_aware_mpi() -> bool:
    """Return True when the MPI library that mpi4py loaded accepts device pointers."""
    global _aware
    with _aware_lock:
        if _aware is None:
            env = os.environ.get("CCOLL_CUDA_AWARE")
            _aware = env == "1" if env in ("0", "1") else _query_cuda_support()
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


HOST = HostPlace()


class DevicePlace(HostPlace):
    """Streams on a CUDA device; MPI gets device pointers or pinned host copies."""

    device = True

    def __init__(self, ch: Any, cuda_aware: bool) -> None:
        from numba import cuda

        self._cuda = cuda
        self._ch = ch
        self.cuda_aware = cuda_aware

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
        stream[:nb].copy_to_host(host[:nb])
        return host[:nb], host

    def sent(self, token: Any) -> None:
        """Return a pinned staging buffer to the channel's pool."""
        if token is not None:
            self._ch.unpin(token)

    def received(self, buf: Any, nb: int) -> Any:
        """Return the received stream on the device (copied there when it was staged)."""
        if self.cuda_aware:
            return buf[:nb]
        return self._cuda.to_device(buf[:nb])

    def to_host(self, stream: Any, nb: int) -> np.ndarray:
        """Copy the first ``nb`` bytes of a device stream to the host."""
        return stream[:nb].copy_to_host()

    def to_place(self, host: np.ndarray) -> Any:
        """Copy host bytes to the device."""
        return self._cuda.to_device(host)


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
        if devicearray.is_cuda_ndarray(x):
            arr = x
        elif self.kind == "torch":
            import torch

            # PyTorch exports no stream with its arrays: let its work finish first.
            torch.cuda.current_stream(x.device).synchronize()
            arr = cuda.as_cuda_array(x.detach())
        else:
            arr = cuda.as_cuda_array(x)
        self.arr = arr
        self.shape = tuple(int(d) for d in arr.shape)
        self.dtype = np.dtype(arr.dtype)
        self.size = int(arr.size)
        self.contiguous = self.size == 0 or bool(arr.is_c_contiguous())

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


def device_add(a: Any, b: Any) -> None:
    """Add ``b`` to ``a`` elementwise on the device, in their dtype (DAR ring on the GPU)."""
    from ccoll.collectives.devkernels import add_inplace

    add_inplace(a, b)


def device_divide(a: Any, n: int) -> None:
    """Divide ``a`` by ``n`` elementwise on the device (IEEE division, as numpy on the host)."""
    from ccoll.collectives.devkernels import divide_inplace

    divide_inplace(a, n)
