"""float16 and bfloat16 host data: computed in float32, rounded once back to the input's dtype.

The kernels compress float32 and float64 only. A float16 or bfloat16 input (a numpy
float16 array, a CPU torch tensor of either dtype, or a numpy array of ``ml_dtypes``'
bfloat16 where that package is installed) is widened to float32, which holds every one of
its values exactly; the float32 result is rounded to the input's dtype once, to nearest
(docs/error-bound.md, "float16 and bfloat16"). :func:`widen` and :class:`Narrow` are the one
implementation of that for ``ccoll.compress``/``decompress``, the collectives and the DDP
hook. torch is imported only for a torch tensor (its dtype is read by name before that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ccoll.compressor._backend import is_torch

__all__ = ["LOW_PRECISION", "Narrow", "low_precision", "widen"]

LOW_PRECISION = ("float16", "bfloat16")
_TORCH_LOW = {"torch.float16": "float16", "torch.bfloat16": "bfloat16"}


def low_precision(x: Any) -> str | None:
    """Return ``"float16"`` or ``"bfloat16"`` for such an array or tensor, else ``None``."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return None
    if is_torch(x):
        return _TORCH_LOW.get(str(dt))
    if isinstance(dt, np.dtype):
        # ml_dtypes' bfloat16 is a numpy dtype named "bfloat16" (kind "V").
        name = dt.name
        return name if name in LOW_PRECISION else None
    return None


@dataclass(frozen=True, slots=True)
class Narrow:
    """How to hand a float32 result back in the caller's float16 or bfloat16."""

    name: str  # "float16" | "bfloat16"
    dtype: Any  # the caller's dtype: a numpy dtype, or a torch dtype
    torch: bool  # the caller passed a torch tensor

    @classmethod
    def of(cls, x: Any) -> Narrow | None:
        """Return the Narrow for ``x``'s dtype, or ``None`` when ``x`` is not float16/bfloat16."""
        name = low_precision(x)
        return None if name is None else cls(name, x.dtype, is_torch(x))

    def result(self, y32: np.ndarray) -> Any:
        """Return ``y32`` rounded once to nearest in the caller's dtype (a new array/tensor)."""
        if self.torch:
            import torch

            # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
            y32 = y32 if y32.flags.c_contiguous else y32.copy(order="C")
            return torch.from_numpy(y32).to(self.dtype)
        return y32.astype(self.dtype)

    def into(self, out: Any, y32: np.ndarray) -> None:
        """Write ``y32`` rounded once to nearest into ``out`` (of the caller's dtype)."""
        if is_torch(out):
            import torch

            out.copy_(torch.from_numpy(np.ascontiguousarray(y32)).reshape(out.shape))
        else:
            np.copyto(out, y32.reshape(out.shape), casting="unsafe")


def widen(x: Any) -> tuple[np.ndarray, Narrow] | None:
    """Return a float32 host copy of float16/bfloat16 host data ``x`` and its :class:`Narrow`.

    ``None`` when ``x`` is not float16/bfloat16. The copy is exact (float32 holds every
    float16 and bfloat16 value). A torch tensor is detached first; the caller decides
    whether a tensor that requires grad is acceptable.
    """
    narrow = Narrow.of(x)
    if narrow is None:
        return None
    if narrow.torch:
        import torch

        return x.detach().to(device="cpu", dtype=torch.float32).numpy(), narrow
    return np.asarray(x).astype(np.float32), narrow
