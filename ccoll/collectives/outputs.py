"""Where a call's result goes: new arrays or the caller's ``out``, and MPI's buffers.

Shared by the data stages of :mod:`~ccoll.collectives.calls` (host and device data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ccoll.collectives.channel import Channel
from ccoll.collectives.devices import DeviceData, device_divide
from ccoll.collectives.prepare import Prepared

__all__ = ["new_output", "result", "divide", "on_mpi_buffers", "mpi_buffers"]


def new_output(p: Prepared, shape: tuple[int, ...], out: Any) -> Any:
    """Return the array to write the result to: ``out`` (numba for device data) or new.

    float16/bfloat16 input: always a new float32 array (rounded into ``out`` at the end).
    """
    if p.dev is None:
        return np.empty(shape, dtype=p.dtype) if out is None else out
    return p.dev.empty(shape) if out is None else DeviceData(out).arr


def result(p: Prepared, y: Any, out: Any) -> Any:
    """Return what the caller gets: ``out`` itself, or ``y`` in the kind of the input.

    float16/bfloat16: ``y`` (float32) rounded once to the caller's dtype; a CPU tensor in
    gives a CPU tensor out.
    """
    if p.narrow is not None:
        if out is not None:
            p.narrow.into(out, y)
            return out
        return p.narrow.result(y)
    if out is not None:
        return out
    if p.dev is not None:
        return p.dev.export(y)
    if p.as_torch:
        import torch

        return torch.from_numpy(y)
    return y


def divide(p: Prepared, y: Any, n: int) -> None:
    """``y /= n`` where ``y`` lives (the average of a raw call or a reduce_scatter)."""
    if p.dev is None:
        np.divide(y, y.dtype.type(n), out=y)
    else:
        device_divide(y, n, p.place.lanes)


def on_mpi_buffers(ch: Channel, p: Prepared, src: Any, dst: Any,
                   call: Callable[[Any, Any], None]) -> None:
    """Run a plain MPI call, ``call(src, dst)``, on buffers MPI can use.

    Host arrays are passed as they are; device data goes through :func:`mpi_buffers`.
    """
    if p.dev is None:
        call(src, dst)
        return
    with mpi_buffers(ch, p, src, dst) as (xs, ys):
        call(xs, ys)


@contextmanager
def mpi_buffers(ch: Channel, p: Prepared, src: Any, dst: Any) -> Iterator[tuple[Any, Any]]:
    """Yield the buffers for a plain MPI call on device data ``src``/``dst``.

    They are ``src``/``dst`` themselves with CUDA-aware MPI, else pinned host copies
    (``dst`` is copied back to the device afterwards).
    """
    from numba import cuda

    if p.place.cuda_aware:  # type: ignore[attr-defined]
        cuda.synchronize()  # MPI does not wait for CUDA streams
        yield src, dst
        return
    tokens = []

    def host_of(arr: Any) -> np.ndarray:
        raw = ch.pinned(max(arr.nbytes, 1))
        tokens.append(raw)
        return raw[: arr.nbytes].view(p.dtype).reshape(arr.shape)

    hsrc = None if src is None else host_of(src)
    if src is not None and src.size:  # an empty copy fails on strides (numba's simulator)
        src.copy_to_host(hsrc)
    hdst = host_of(dst)
    try:
        yield hsrc, hdst
        if dst.size:
            dst.copy_to_device(hdst)
    finally:
        for t in tokens:
            ch.unpin(t)
