"""float16 and bfloat16 host data: computed in float32, rounded once back to the input's dtype.

The kernels compress float32 and float64 only. A float16 or bfloat16 input (a numpy
float16 array, a CPU torch tensor of either dtype, or a numpy array of ``ml_dtypes``'
bfloat16 where that package is installed) is widened to float32, which holds every one of
its values exactly; the float32 result is rounded to the input's dtype once, to nearest
(docs/error-bound.md, "float16 and bfloat16"). :func:`widen` and :class:`Narrow` are the one
implementation of that for ``ccoll.compress``/``decompress``, the collectives and the DDP
hook. torch is imported only for a torch tensor (its dtype is read by name before that).

Device data of those dtypes takes the same route on the device (:func:`widen_device`,
:class:`DeviceNarrow`): a CUDA tensor through torch's own casts, a CuPy array through
CuPy's, a numba device float16 array through two small kernels
(:mod:`ccoll.compressor._cuda_cast`). numba has no bfloat16, so a bfloat16 array that is
neither a tensor nor a CuPy array is refused.

:func:`stage_bound` is the one rule for the bound such data is compressed with: the bound
asked for holds on the result in the caller's dtype, after its final rounding, so the float32
stage gets what the rounding leaves of it; a bound the dtype cannot hold at the result's
magnitude is refused with an :class:`~ccoll.errors.ErrorBoundError` that names the smallest
one it can (docs/error-bound.md, "float16 and bfloat16").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ccoll.compressor._backend import is_torch

__all__ = ["LOW_PRECISION", "DeviceNarrow", "Narrow", "device_low_precision", "low_precision",
           "half_gap", "stage_bound", "widen", "widen_device"]

LOW_PRECISION = ("float16", "bfloat16")
_TORCH_LOW = {"torch.float16": "float16", "torch.bfloat16": "bfloat16"}
# The dtypes of most calls, told apart by identity: reading ``dtype.name`` costs 2-3 us,
# and a small ring step asks it several times (docs/performance.md, "A small call's fixed
# cost").
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


# Significand bits (the leading one included), smallest normal exponent, largest finite value.
_FORMATS: dict[str, tuple[int, int, float]] = {
    "float16": (11, -14, 65504.0),
    "bfloat16": (8, -126, float.fromhex("0x1.fep127")),
    "float32": (24, -126, float.fromhex("0x1.fffffep127")),
}


def half_gap(name: str, a: float) -> float:
    """Half the widest gap between neighbouring values of dtype ``name`` within ``[-a, a]``.

    Rounding any real number of magnitude at most ``a`` to nearest in that dtype moves it by
    at most this much (``a`` is capped at the largest finite value: beyond it a result
    overflows to ±Inf, by contract). A power of two, exact in float64.
    """
    p, emin, top = _FORMATS[name]
    a = min(abs(a), top)
    if a < 2.0**emin:  # subnormals: one fixed spacing, 2^(emin - p + 1)
        return 2.0 ** (emin - p)
    return 2.0 ** (math.frexp(a)[1] - 1 - p)


def _floor(v: Fraction) -> float:
    """Return the largest float64 that is at most ``v`` (``v >= 0``)."""
    f = float(v)
    while f > 0 and Fraction(f) > v:
        f = math.nextafter(f, 0.0)
    return max(f, 0.0)


def _magnitude(lo: float, hi: float) -> float:
    """Return the largest magnitude of finite values spanning ``[lo, hi]`` (0: none)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return 0.0
    return max(abs(lo), abs(hi))


def _reserve(name: str, eb: float, lo: float, hi: float, ranks: int, avg: bool) -> float:
    """Return what the roundings after the float32 stage of a sum or average move it by.

    ``a`` bounds the result in float32 and in the dtype: the exact average lies within the
    inputs' largest magnitude ``M``, a sum of ``ranks`` inputs within ``ranks * M``, and the
    float32 stage is at most ``eb`` from it. The dtype's rounding moves it by at most half its
    gap at ``a``; the float32 roundings of every path (the sum's, the average's three, the
    ``ranks - 1`` of a plain MPI float32 sum of an average's inputs, which are at most twice
    their share of ``M``) by at most ``2 (ranks + 2)`` float32 half gaps there, a small part
    of the dtype's (``2^-13`` of float16's gap, ``2^-16`` of bfloat16's).
    """
    m = _magnitude(lo, hi)
    a = (m if avg else ranks * m) + eb
    return half_gap(name, a) + 2 * (ranks + 2) * half_gap("float32", a)


def stage_bound(eb: float, name: str, lo: float, hi: float, *, ranks: int = 0,
                avg: bool = False, asked: Any = None, what: str = "") -> float:
    """Return the bound of the float32 stage that keeps the result in ``name`` within ``eb``.

    ``eb`` is the absolute bound asked for (``>= 0``), ``name`` the caller's dtype
    (``"float16"`` or ``"bfloat16"``), ``[lo, hi]`` the range of the finite inputs (every
    rank's, in a collective). ``ranks = 0``: the exact result is the input itself, a value of
    the dtype (``compress``/``decompress``, ``allgather``, ``bcast``, and a reduction over one
    rank); rounding the float32 stage's ``y`` to nearest then lands no farther from ``x`` than
    ``y`` is, so half the bound always serves, and where the dtype's gaps at the data's
    magnitude are narrower than the bound, the bound less half a gap serves better: the
    larger of the two is returned, never more than keeps ``y`` below the dtype's overflow
    threshold. ``ranks >= 2``: the result is a sum (``avg``: an average) of that many inputs,
    not a value of the dtype, and its final rounding costs up to half a gap at its
    magnitude: the bound less that (and the float32 roundings, :func:`_reserve`) is returned,
    and where nothing is left, :class:`~ccoll.errors.ErrorBoundError` names the smallest
    bound the dtype can hold there (in ``asked``'s kind: ``ABS`` or ``REL`` of the range).
    ``eb = 0`` (``REL`` of data whose finite values are all equal) stays 0: the result is
    then the exact one, rounded once to the dtype.
    """
    if not eb > 0:
        return 0.0
    ebq = Fraction(eb)
    if ranks < 2:
        m = _magnitude(lo, hi)
        e = max(_floor(ebq / 2), _floor(ebq - Fraction(half_gap(name, m + eb))))
        top = _FORMATS[name][2]
        # |y| <= m + e must stay below the overflow threshold top + half_gap(top), strictly:
        # a value exactly there rounds (to even) to ±Inf.
        room = Fraction(top) + Fraction(half_gap(name, top)) - Fraction(m)
        if Fraction(e) < room:
            return e
        cap = _floor(room)
        return math.nextafter(cap, 0.0) if Fraction(cap) == room else cap
    reserve = Fraction(_reserve(name, eb, lo, hi, ranks, avg))
    if ebq < reserve:
        raise _refusal(eb, name, lo, hi, ranks, avg, asked, what)
    return _floor(ebq - reserve)


def _refusal(eb: float, name: str, lo: float, hi: float, ranks: int, avg: bool,
             asked: Any, what: str) -> Exception:
    """Return the ErrorBoundError for a bound below what ``name`` can hold (and the least)."""
    from ccoll.errorbound import ABS, REL
    from ccoll.errors import ErrorBoundError

    m = _magnitude(lo, hi)
    a = (m if avg else ranks * m) + eb
    rel = isinstance(asked, REL) and hi > lo
    need = _reserve(name, eb, lo, hi, ranks, avg)
    for _ in range(8):  # the smallest bound moves the magnitude a little: settle it
        shown = _round_up(need / (hi - lo) if rel else need)
        value = shown * (hi - lo) if rel else shown
        again = _reserve(name, value, lo, hi, ranks, avg)
        if again <= value * (1 - 1e-12):
            break
        need = again
    smallest = REL(shown) if rel else ABS(shown)
    asked_s = repr(asked) if asked is not None else f"ABS({eb!r})"
    result = f"an average of {ranks} ranks' inputs" if avg else (
        f"a sum of {ranks} ranks' inputs (up to {ranks} x {m:.4g})")
    return ErrorBoundError(
        f"{asked_s} asks for less than {name} can hold on {what or result}: {name} values "
        f"near {a:.4g} are {2 * half_gap(name, a):.3g} apart, so rounding the result to "
        f"{name} alone can move it by {half_gap(name, a):.3g}, more than the bound "
        f"({eb:.3g}); the smallest bound ccoll can hold there is {smallest!r}: pass that or "
        f"more, or pass the data as float32")


def _round_up(v: float) -> float:
    """Return ``v`` rounded up to three significant digits (a bound to show and pass back)."""
    if v <= 0:
        return v
    k = math.floor(math.log10(v)) - 2
    r = math.ceil(v / 10.0**k * (1 - 1e-12)) * 10.0**k
    r = float(f"{r:.3g}")
    while r < v:
        r = float(f"{r + 10.0**k:.3g}")
    return r


def low_precision(x: Any) -> str | None:
    """Return ``"float16"`` or ``"bfloat16"`` for such an array or tensor, else ``None``."""
    dt = getattr(x, "dtype", None)
    if dt is None or dt is _F32 or dt is _F64:  # numpy's own dtypes are singletons
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
        with np.errstate(over="ignore"):  # beyond float16's range: ±Inf, by contract
            return y32.astype(self.dtype)

    def into(self, out: Any, y32: np.ndarray) -> None:
        """Write ``y32`` rounded once to nearest into ``out`` (of the caller's dtype)."""
        if is_torch(out):
            import torch

            out.copy_(torch.from_numpy(np.ascontiguousarray(y32)).reshape(out.shape))
        else:
            with np.errstate(over="ignore"):
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


def device_low_precision(x: Any) -> str | None:
    """Return ``"float16"``/``"bfloat16"`` for device data of that dtype, else ``None``."""
    dt = getattr(x, "dtype", None)
    if is_torch(x):
        name = str(dt).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dt).name
        except TypeError:
            return None
    return name if name in LOW_PRECISION else None


def _kind(x: Any) -> str:
    """``"torch"``, ``"cupy"`` or ``"numba"`` (anything else with a CUDA array interface)."""
    mod = type(x).__module__.split(".", 1)[0]
    return mod if mod in ("torch", "cupy") else "numba"


def _contiguous(x: Any) -> bool:
    kind = _kind(x)
    if kind == "torch":
        return bool(x.is_contiguous())
    if kind == "cupy":
        return bool(x.flags.c_contiguous)
    from numba import cuda
    from numba.cuda.cudadrv import devicearray

    arr = x if devicearray.is_cuda_ndarray(x) else cuda.as_cuda_array(x)
    return arr.size == 0 or bool(arr.is_c_contiguous())


@dataclass(frozen=True, slots=True)
class DeviceNarrow:
    """How to hand a float32 device result back as the caller's float16/bfloat16 device data."""

    name: str  # "float16" | "bfloat16"
    kind: str  # the caller's kind: "torch" | "cupy" | "numba"
    dtype: Any  # the caller's dtype: a torch dtype, or a numpy dtype
    device: Any  # the caller's torch device (None for the other kinds)

    @classmethod
    def of(cls, x: Any) -> DeviceNarrow | None:
        """Return the DeviceNarrow for device data ``x`` of dtype float16/bfloat16, else ``None``.

        Raises :class:`~ccoll.errors.DTypeError` for bfloat16 data that only numba would
        carry (numba has no bfloat16 on the device).
        """
        name = device_low_precision(x)
        if name is None:
            return None
        kind = _kind(x)
        if kind == "torch":
            return cls(name, kind, x.dtype, x.device)
        if kind == "cupy":
            return cls(name, kind, x.dtype, None)
        if name == "bfloat16":
            from ccoll.errors import DTypeError

            raise DTypeError(
                "x is a bfloat16 device array that is neither a torch tensor nor a CuPy "
                "array; numba has no bfloat16 on the device: pass a CUDA torch tensor of it, "
                "or the data as float16 or float32")
        return cls(name, kind, np.dtype(np.float16), None)

    def result(self, y32: Any) -> Any:
        """Return device ``y32`` (float32) rounded once to nearest, new, in the caller's kind."""
        if self.kind == "torch":
            import torch

            return torch.as_tensor(y32, device=self.device).to(self.dtype)
        if self.kind == "cupy":
            import cupy

            return cupy.asarray(y32).astype(self.dtype)
        from numba import cuda
        from numba.cuda.cudadrv import devicearray

        from ccoll.compressor._cuda_cast import narrow_into

        y32 = y32 if devicearray.is_cuda_ndarray(y32) else cuda.as_cuda_array(y32)
        out = cuda.device_array(y32.shape, np.float16)
        narrow_into(y32, out)
        return out

    def into(self, out: Any, y32: Any) -> None:
        """Write ``y32`` rounded once to nearest into device array ``out`` (of ``self.name``)."""
        kind = _kind(out)
        if kind == "torch":
            import torch

            out.copy_(torch.as_tensor(y32, device=out.device).reshape(out.shape))
        elif kind == "cupy":
            import cupy

            cupy.copyto(out, cupy.asarray(y32).reshape(out.shape), casting="unsafe")
        else:
            from numba import cuda
            from numba.cuda.cudadrv import devicearray

            from ccoll.compressor._cuda_cast import narrow_into

            dst = out if devicearray.is_cuda_ndarray(out) else cuda.as_cuda_array(out)
            y32 = y32 if devicearray.is_cuda_ndarray(y32) else cuda.as_cuda_array(y32)
            narrow_into(y32, dst)


def widen_device(x: Any) -> tuple[Any, DeviceNarrow] | None:
    """Return a float32 device copy of float16/bfloat16 device ``x`` and its DeviceNarrow.

    ``None`` when ``x`` is not float16/bfloat16. The copy is exact and of ``x``'s kind (a
    CUDA tensor, a CuPy array, a numba device array), on its device. Raises
    :class:`~ccoll.errors.DTypeError` for bfloat16 data that only numba would carry,
    :class:`~ccoll.errors.InputError` for non-contiguous data.
    """
    narrow = DeviceNarrow.of(x)
    if narrow is None:
        return None
    if not _contiguous(x):
        from ccoll.errors import InputError

        raise InputError("a device array x must be C-contiguous: pass x.contiguous() (torch) "
                         "or cupy.ascontiguousarray(x)")
    if narrow.kind == "torch":
        import torch

        return x.detach().to(torch.float32), narrow
    if narrow.kind == "cupy":
        import cupy

        return x.astype(cupy.float32), narrow
    from ccoll.compressor._cuda_cast import widen_f16

    return widen_f16(x), narrow
