"""Two elementwise CUDA kernels the device path needs besides the compressor's.

Imported only when device data shows up. Kept at module level (numba's simulator swaps the
``cuda`` module only in a kernel's globals, not in closures).
"""

from __future__ import annotations

from typing import Any

from numba import cuda

__all__ = ["add_inplace", "divide_inplace"]

_TPB = 256


@cuda.jit
def _add(a, b):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < a.size:
        a[i] += b[i]


@cuda.jit
def _divide(a, d):  # type: ignore[no-untyped-def]
    i = cuda.grid(1)
    if i < a.size:
        a[i] = a[i] / d


def _config(n: int, stream: Any) -> tuple[Any, ...]:
    grid = (n + _TPB - 1) // _TPB
    # No stream: numba's default stream, as before the scheduler's lanes.
    return (grid, _TPB) if stream is None else (grid, _TPB, stream)


def add_inplace(a: Any, b: Any, stream: Any = None) -> None:
    """Add ``b`` to ``a`` elementwise, in their dtype (the DAR ring on the device).

    Enqueued on ``stream`` (a numba stream; None: the default stream), without a host wait.
    """
    if a.size:
        _add[_config(a.size, stream)](a, b)


def divide_inplace(a: Any, n: int, stream: Any = None) -> None:
    """Divide ``a`` by ``n`` elementwise (IEEE division, as numpy does on the host).

    Enqueued on ``stream`` (a numba stream; None: the default stream), without a host wait.
    """
    if a.size:
        _divide[_config(a.size, stream)](a, a.dtype.type(n))
