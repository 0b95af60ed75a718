"""float16 <-> float32 on the device: the widening and the one rounding of device float16.

Imported only when float16 device data shows up. Elementwise, one thread per element; a
float32 -> float16 assignment rounds to nearest even (``cvt.rn.f16.f32``), as numpy's and
torch's casts do, so device and host results agree bit for bit. Kept at module level
(numba's simulator swaps the ``cuda`` module only in a kernel's globals).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

__all__ = ["SIGNATURES", "narrow_into", "widen_f16"]

_TPB = 256


@cuda.jit
def _widen(src, dst):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < src.size:
        dst[i] = src[i]  # exact: float32 holds every float16


@cuda.jit
def _narrow(src, dst):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < src.size:
        dst[i] = src[i]  # rounds to nearest even


# (kernel, signature) pairs for the PTX tests (tests/ptx/).
SIGNATURES = {
    "widen": (_widen, "void(float16[::1], float32[::1])"),
    "narrow": (_narrow, "void(float32[::1], float16[::1])"),
}


def _blocks(n: int) -> int:
    return (n + _TPB - 1) // _TPB


def widen_f16(x: Any) -> Any:
    """Return a new float32 numba device array equal to C-contiguous float16 device ``x``."""
    from numba.cuda.cudadrv import devicearray

    src = x if devicearray.is_cuda_ndarray(x) else cuda.as_cuda_array(x)
    dst = cuda.device_array(src.shape, np.float32)
    if src.size:
        _widen[_blocks(src.size), _TPB](src.reshape(src.size), dst.reshape(src.size))
    return dst


def narrow_into(y32: Any, dst: Any) -> None:
    """Round float32 device array ``y32`` once to nearest into float16 device array ``dst``."""
    if y32.size:
        _narrow[_blocks(y32.size), _TPB](y32.reshape(y32.size), dst.reshape(y32.size))
