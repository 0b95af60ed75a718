"""A call's arguments as the stages use them: conversion, checks, overlaps, the value range.

Problems are recorded on the call (:meth:`ccoll.collectives.agreement.Call.problem`), not
raised: every rank then raises the same error after the agreement, so that no rank waits
for a partner that gave up (docs/collectives.md, "Faults").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ccoll.collectives.agreement import BOUND_KINDS, DTYPES, Call
from ccoll.collectives.channel import Channel
from ccoll.collectives.devices import DeviceData, DeviceLanes, is_device
from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.compressor._backend import is_torch
from ccoll.compressor.cpu import finite_range as cpu_range
from ccoll.compressor.precision import (
    DeviceNarrow,
    Narrow,
    device_low_precision,
    widen,
    widen_device,
)
from ccoll.errorbound import ErrorBound, as_bound, finite_range
from ccoll.errors import DTypeError, ErrorBoundError, InputError

__all__ = [
    "Input", "shape_of", "in_place", "split_code", "check_option", "valid_root", "dtype_message",
    "as_array", "bcast_header", "value_range", "resolve_bound", "check_out", "host_overlap",
    "device_span", "device_overlap",
]

_NATIVE = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


class Input(NamedTuple):
    """The input of this rank, as the stages use it."""

    arr: np.ndarray  # host data (float32 for float16/bfloat16); empty for device data
    dev: DeviceData | None  # device data (its float32 copy for float16/bfloat16)
    narrow: Narrow | DeviceNarrow | None
    as_torch: bool
    dtype_name: str  # the caller's dtype, by name ("float16", "bfloat16", ...)


def shape_of(inp: Input) -> tuple[tuple[int, ...], np.dtype]:
    """Return the shape and dtype of what moves (host array, or device data)."""
    if inp.dev is None:
        return inp.arr.shape, inp.arr.dtype
    return inp.dev.shape, inp.dev.dtype


def in_place(x: Any, out: Any, out_arr: Any, narrow: Narrow | DeviceNarrow | None, flat: Any,
              dev: DeviceData | None) -> bool:
    """Whether ``out`` is x's very buffer (MPI_IN_PLACE); check_out allowed no other overlap.

    Never for float16/bfloat16: their float32 copy is what moves.
    """
    return out_arr is not None and narrow is None and (
        out is x
        or (np.may_share_memory(flat, out_arr) if dev is None
            else device_span(dev) == device_span(DeviceData(out)))
    )


def split_code(split: float | None) -> float:
    """Return the agreement's code of a ``split`` setting: -1 for the model's choice."""
    return -1.0 if split is None else split


def check_option(call: Call, name: str, value: Any, allowed: dict[str, int]) -> int:
    """Return the code of option ``value`` (0 and a recorded problem if it is not allowed)."""
    if not isinstance(value, str) or value not in allowed:
        call.problem(InputError, f"{name} {value!r} is not supported (expected one of "
                     f"{', '.join(map(repr, allowed))})")
        return 0
    return allowed[value]




def valid_root(root: Any, n_ranks: int) -> bool:
    """Whether ``root`` is a rank of a communicator of ``n_ranks`` (an int, not a bool)."""
    return bool(not isinstance(root, bool) and isinstance(root, (int, np.integer))
                and 0 <= root < n_ranks)


def dtype_message(name: str, dtype: np.dtype, device: bool) -> str:
    """Return the message for an input dtype the collectives do not take, with the fix."""
    if device and "complex" in name:
        from ccoll.compressor.api import dtype_fix

        return f"x is a device array of dtype {name}; {dtype_fix(name)}"
    if device:
        return (f"x is a device array of dtype {name}; ccoll's collectives take float16, "
                "bfloat16 (torch, CuPy), float32 or float64 device arrays: pass x.float() "
                "(torch) or x.astype(cupy.float32)")
    if dtype.kind == "f" and name in DTYPES:  # a float of non-native byte order
        return (f"x has dtype {dtype.str} (not the machine's byte order); pass "
                f"x.astype(np.{name})")
    from ccoll.compressor.api import dtype_fix

    return (f"x has dtype {name}; ccoll reduces float16, bfloat16, float32 or float64 "
            f"arrays: {dtype_fix(name)}")


def as_array(call: Call, x: Any, collective: str) -> Input:
    """Return this rank's input: a host array, or device data (the array then empty)."""
    if type(x) is np.ndarray:  # the common case, checked cheaply (dtype.name costs ~2 us)
        name = _NATIVE.get(x.dtype)
        if name is not None:
            return Input(x, None, None, False, name)
    empty = np.empty(0, dtype=np.float32)
    if x is None:
        fix = (" (None is allowed on the non-root ranks of bcast only)"
               if collective == "bcast" else "")
        call.problem(InputError, f"x is None; pass a numpy array or a torch tensor{fix}")
        return Input(empty, None, None, False, "None")
    torch_in = is_torch(x)
    if torch_in and bool(getattr(x, "requires_grad", False)):
        call.problem(InputError, "x is a torch tensor that requires grad; ccoll reduces data, "
                     "not autograd graphs: pass x.detach()")
        return Input(empty, None, None, False, str(x.dtype).removeprefix("torch."))
    if is_device(x):
        half = device_low_precision(x)
        narrow = None
        if half is not None:
            # The device kernels take float32/float64: reduce an exact float32 device copy
            # and round the result once at the end (Narrow's contract, on the device).
            try:
                x, narrow = widen_device(x)  # type: ignore[misc]
            except (DTypeError, InputError) as exc:
                call.problem(type(exc), str(exc))
                return Input(empty, None, None, False, half)
            except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
                call.problem(InputError, f"x cannot be widened to float32 on its device "
                             f"({type(exc).__name__}: {exc}); pass x as float32")
                return Input(empty, None, None, False, half)
        try:
            dev = DeviceData(x)
        except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
            call.problem(InputError, f"x cannot be read as a device array ({exc}); pass a "
                         "CUDA tensor, a CuPy array or a numba device array")
            return Input(empty, None, None, False, "unknown")
        if not dev.contiguous:
            call.problem(InputError, "a device array x must be C-contiguous: pass "
                         "x.contiguous() (torch) or cupy.ascontiguousarray(x)")
        return Input(empty, dev, narrow, False, half or dev.dtype.name)
    low = widen(x)
    if low is not None:
        return Input(low[0], None, low[1], torch_in, low[1].name)
    try:
        arr = x.numpy() if torch_in else np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
        call.problem(InputError, f"x cannot be read as an array ({type(exc).__name__}: {exc}); "
                     "pass a numpy array or a CPU torch tensor")
        return Input(empty, None, None, False, "unknown")
    if arr.dtype == object:
        call.problem(InputError, f"x of type {type(x).__name__} is not a numeric array; pass "
                     "a numpy array of float32 or float64")
        return Input(empty, None, None, False, "object")
    return Input(arr, None, None, torch_in, arr.dtype.name)


def bcast_header(ch: Channel, root: Any, inp: Input, deadline: Deadline) -> Input:
    """Send the root's dtype, array kind and shape to every rank (bcast with a None rank).

    Returns this rank's input, with an empty array of the root's shape on a rank that
    passed None (the values are the root's after the broadcast). Buffer-based.
    """
    head = np.zeros(3 + 64, np.int64)
    comm = ch.comm
    if comm.Get_rank() == root:
        shape = inp.arr.shape if inp.dev is None else inp.dev.shape
        head[0] = DTYPES[inp.dtype_name]
        head[1] = int(inp.as_torch)
        head[2] = len(shape)
        head[3:3 + len(shape)] = shape
    if deadline.at is None:
        comm.Bcast(head, root=root)
    else:
        wait_all([comm.Ibcast(head, root=root)], deadline, "the bcast header")
    if inp.dtype_name != "None":
        return inp
    name = {v: k for k, v in DTYPES.items()}[int(head[0])]
    as_torch = bool(head[1])
    shape = tuple(int(d) for d in head[3:3 + int(head[2])])
    narrow = None
    if name in ("float16", "bfloat16"):
        if as_torch:
            import torch

            narrow = Narrow(name, getattr(torch, name), True)
        else:
            narrow = Narrow(name, np.dtype(name), False)  # float16, or ml_dtypes' bfloat16
    compute = np.float64 if name == "float64" else np.float32
    return Input(np.empty(shape, compute), None, narrow, as_torch, name)


# Elements from which the fused range pass beats numpy's (docs/dev/collectives-timeline.md,
# "The REL check stage": 4 Mi float32 elements took 0.40 ms both ways, 1 Mi 0.13 ms fused,
# 0.07 numpy).
_FUSED_RANGE_MIN = 1 << 22


def value_range(arr: np.ndarray, dev: DeviceData | None) -> tuple[float, float]:
    """Return the min and max of the finite values of this rank's data (host or device)."""
    if dev is None:
        if arr.dtype in _NATIVE and arr.size >= _FUSED_RANGE_MIN:
            # One parallel pass (numba, the rank's threads) instead of numpy's min, max and,
            # with non-finite values, a filtered copy: same range
            # (docs/dev/collectives-timeline.md).
            # Below this size the parallel launch costs more than numpy's passes.
            return cpu_range(arr)
        return finite_range(arr)
    from ccoll.compressor._backend import cuda_module

    dev.ready(DeviceLanes(None))  # the range goes to the host anyway: wait there
    lo, hi = cuda_module().finite_range(dev.flat())
    return float(lo), float(hi)


def resolve_bound(call: Call, eb: Any) -> ErrorBound | None:
    """Return the call's bound (None: exact), recording its kind and value, or a problem."""
    if eb is None:
        call.bound_kind = BOUND_KINDS["exact"]
        call.shown["error-bound kind"] = "exact (None)"
        return None
    try:
        bound = as_bound(eb)
    except ErrorBoundError as exc:
        call.problem(ErrorBoundError, str(exc))
        call.bound_kind = -1
        call.shown["error-bound kind"] = repr(eb)
        return None
    call.bound_kind = BOUND_KINDS[bound.kind]
    call.bound_value = bound.value
    call.shown["error-bound kind"] = bound.kind
    call.shown["error-bound value"] = bound
    return bound


def check_out(
    call: Call, out: Any, shape: tuple[int, ...], dtype: np.dtype, x: np.ndarray | DeviceData,
    inp: Input,
) -> Any:
    """Check ``out``; return the buffer the stage writes.

    ``None`` for float16/bfloat16, whose float32 result is rounded into ``out`` at the end.
    """
    target: Any = out
    oname = inp.dtype_name
    if isinstance(x, DeviceData):
        if not is_device(out):
            call.problem(InputError, "out must be a device array like x: pass out=None or "
                         "a device array of x's shape and dtype")
            return None
        try:
            if inp.narrow is not None and is_torch(out):  # numba cannot view bfloat16
                oshape, odtype = tuple(out.shape), str(out.dtype).removeprefix("torch.")
                ok = bool(out.is_contiguous())
            else:
                o = DeviceData(out)
                oshape, odtype, ok = o.shape, o.dtype.name, o.contiguous
        except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
            call.problem(InputError, f"out cannot be read as a device array ({exc})")
            return None
        # float16/bfloat16: x's float32 copy is what moves, so out may be any buffer.
        overlap = inp.narrow is None and out is not x.obj and device_overlap(x, o)
    elif is_torch(out) and out.device.type == "cpu":
        if out.requires_grad:
            call.problem(InputError, "out is a torch tensor that requires grad: pass "
                         "out.detach() or out=None")
            return None
        oshape, odtype = tuple(out.shape), str(out.dtype).removeprefix("torch.")
        ok = out.is_contiguous()
        if inp.narrow is None and odtype in ("float32", "float64"):
            target = out.detach().numpy()
        overlap = inp.narrow is None and out is not x and isinstance(target, np.ndarray) and (
            host_overlap(x, target))
    elif not isinstance(out, np.ndarray):
        call.problem(InputError, f"out must be a numpy array or CPU tensor like x, got "
                     f"{type(out).__name__}: pass out=None or an array of x's shape and dtype")
        return None
    else:
        oshape, odtype = out.shape, out.dtype.name if out.dtype.isnative else out.dtype.str
        ok = out.flags.c_contiguous and out.flags.writeable
        overlap = inp.narrow is None and out is not x and host_overlap(x, out)
    if oshape != shape or odtype != oname:
        call.problem(
            InputError,
            f"out has shape {oshape} and dtype {odtype}; expected {shape} and {oname}: pass "
            "out=None or an array like x",
        )
    elif not ok:
        call.problem(InputError, "out must be C-contiguous and writeable: pass out=None or "
                     "a fresh array like x")
    elif overlap:
        # MPI_IN_PLACE (or reading x while out is written) would reduce shifted data.
        call.problem(
            InputError,
            "out overlaps x without being the same buffer: pass out=x (in place) or an "
            "array that shares no memory with x",
        )
    return None if inp.narrow is not None else target


def host_overlap(x: np.ndarray, out: np.ndarray) -> bool:
    """Whether ``out`` shares memory with ``x`` but is not exactly x's buffer."""
    if not np.may_share_memory(x, out):
        return False
    same = (
        x.flags.c_contiguous
        and x.__array_interface__["data"][0] == out.__array_interface__["data"][0]
        and x.nbytes == out.nbytes
    )
    return not same and bool(np.shares_memory(x, out))


def device_span(d: DeviceData) -> tuple[int, int]:
    """``(address, bytes)`` of C-contiguous device data."""
    iface = getattr(d.arr, "__cuda_array_interface__", None)
    if iface is None:  # numba's CUDA simulator: a wrapped host array
        iface = d.arr._ary.__array_interface__
    return int(iface["data"][0]), d.size * d.dtype.itemsize


def device_overlap(x: DeviceData, out: DeviceData) -> bool:
    """Whether device array ``out`` overlaps ``x``'s bytes without being the same buffer."""
    (a0, na), (b0, nb) = device_span(x), device_span(out)
    if (a0, na) == (b0, nb):
        return False
    return a0 < b0 + nb and b0 < a0 + na and na > 0 and nb > 0
