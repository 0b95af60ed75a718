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


def add_inplace(a: Any, b: Any) -> None:
    """Add ``b`` to ``a`` elementwise, in their dtype (the DAR ring on the device)."""
    if a.size:
        _add[(a.size + _TPB - 1) // _TPB, _TPB](a, b)


def divide_inplace(a: Any, n: int) -> None:
    """Divide ``a`` by ``n`` elementwise (IEEE division, as numpy does on the host)."""
    if a.size:
        _divide[(a.size + _TPB - 1) // _TPB, _TPB](a, a.dtype.type(n))
