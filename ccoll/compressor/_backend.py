"""Where an array lives decides which backend compresses it; this module decides, once.

``backend_of`` answers ``"cpu"`` for host data (numpy arrays, CPU torch tensors, bytes) and
``"cuda"`` for device data (objects exposing ``__cuda_array_interface__``, CUDA torch
tensors, CuPy arrays, numba device arrays, DLPack objects on a CUDA device). The CUDA
backend is imported lazily, only when device data shows up, so host-only installations
never touch the CUDA toolkit.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal

import numpy as np

from ccoll.errors import CCollError

__all__ = ["backend_of", "cuda_module", "is_torch"]

Backend = Literal["cpu", "cuda"]

# DLPack device types (dlpack.h): CPU, CUDA, pinned host, managed.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DEVICE_MODULES = ("cupy", "numba.cuda", "numba_cuda")


def is_torch(obj: object) -> bool:
    """Tell whether ``obj`` is a torch tensor, without importing torch."""
    return type(obj).__module__.startswith("torch")


def backend_of(obj: object) -> Backend:
    """``"cpu"`` or ``"cuda"``: the backend that handles ``obj``, from where its data lives."""
    if isinstance(obj, (np.ndarray, np.generic, bytes, bytearray, memoryview)):
        return "cpu"
    if is_torch(obj):
        kind = getattr(getattr(obj, "device", None), "type", "cpu")
        if kind == "cpu":
            return "cpu"
        if kind == "cuda":
            return "cuda"
        raise CCollError(f"ccoll handles CPU and CUDA tensors, got a tensor on device {kind!r}")
    if type(obj).__module__.startswith(_DEVICE_MODULES):
        return "cuda"
    if hasattr(obj, "__cuda_array_interface__"):
        return "cuda"
    dl = getattr(obj, "__dlpack_device__", None)
    if callable(dl):
        try:
            kind_code = int(dl()[0])
        except Exception:  # noqa: BLE001 - a broken exporter is treated as host data
            kind_code = _DL_CPU
        if kind_code in (_DL_CUDA, _DL_CUDA_MANAGED):
            return "cuda"
    return "cpu"


def cuda_module() -> ModuleType:
    """Import the CUDA backend; raise a clear :class:`ccoll.CCollError` if it cannot load."""
    try:
        from ccoll.compressor import _cuda  # type: ignore[attr-defined]
    except ImportError as exc:
        raise CCollError(
            f"the CUDA backend of the compressor is unavailable ({exc}); device arrays need "
            "ccoll.compressor._cuda and a working numba-cuda"
        ) from exc
    return _cuda
