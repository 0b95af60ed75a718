"""Warp intrinsics for the numba CUDA simulator, which has none.

The simulator runs every CUDA thread of a block as a Python thread. These shims let the 32
threads of a warp meet at a per-warp ``threading.Barrier`` and exchange one value each, so
``ballot_sync``, ``shfl_*_sync``, ``syncwarp`` and ``activemask`` behave as on hardware for
converged warps. As on hardware, every lane of the warp must reach the same sequence of
calls: a lane that skips a call deadlocks its warp (the barrier times out instead of hanging
forever). Only the full mask is supported, which is all ccoll's kernels use.

``install()`` also stops the simulator's block manager from holding the GIL while it waits:
numba-cuda's ``BlockManager.run`` polls its threads in a pure-Python loop (``is_alive`` on each
live thread, over and over) until all are blocked in ``syncthreads`` or done, and such a loop
gives up the GIL only when the interpreter's switch interval (5 ms) forces it, so the threads
it waits for run in short slices between long idle polls. A ``time.sleep(0)`` in each
``is_alive`` call hands the GIL over at once; the scheduling semantics are unchanged (the
same poll, the same barrier rule) and kernels in the simulator ran about twice as fast.

``install()`` is idempotent; tests/cuda/conftest.py and the simulator mode of
bench/gpu/compressor_gpu.py call it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

FULL = 0xFFFFFFFF
TIMEOUT_S = 120.0

_lock = threading.Lock()


class _Warp:
    """Exchange slots of one warp, double-buffered so one barrier per call suffices.

    A lane writes slot ``phase``, waits, reads it; its next call writes the other buffer.
    A lane cannot write the same buffer again before every lane has passed the barrier of
    the call in between, so nobody overwrites a value that is still being read.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots = [[None] * 32, [None] * 32]
        self.phase = [0] * 32


def _warp() -> tuple[_Warp, int]:
    t = threading.current_thread()
    mgr = t._manager  # type: ignore[attr-defined]
    tid = t.thread_id  # type: ignore[attr-defined]
    wid, lane = divmod(tid, 32)
    with _lock:
        warps = mgr.__dict__.setdefault("_ccoll_warps", {})
        w = warps.get(wid)
        if w is None:
            nthreads = int(np.prod(mgr._block_dim))
            w = warps[wid] = _Warp(min(32, nthreads - 32 * wid))
    return w, lane


def _exchange(value: Any) -> tuple[list[Any], int]:
    w, lane = _warp()
    ph = w.phase[lane]
    w.phase[lane] = ph ^ 1
    buf = w.slots[ph]
    buf[lane] = value
    w.barrier.wait(TIMEOUT_S)
    return list(buf), lane


def _check_mask(mask: Any) -> None:
    if int(mask) & FULL != FULL:
        raise NotImplementedError("the warp shim supports only the full mask 0xffffffff")


def ballot_sync(self: Any, mask: Any, predicate: Any) -> np.uint32:
    _check_mask(mask)
    vals, _ = _exchange(bool(predicate))
    r = 0
    for i, v in enumerate(vals):
        if v:
            r |= 1 << i
    return np.uint32(r)


def shfl_sync(self: Any, mask: Any, value: Any, src_lane: Any) -> Any:
    _check_mask(mask)
    vals, _ = _exchange(value)
    return vals[int(src_lane) % 32]


def shfl_up_sync(self: Any, mask: Any, value: Any, delta: Any) -> Any:
    _check_mask(mask)
    vals, lane = _exchange(value)
    src = lane - int(delta)
    return vals[src] if src >= 0 else value


def shfl_down_sync(self: Any, mask: Any, value: Any, delta: Any) -> Any:
    _check_mask(mask)
    vals, lane = _exchange(value)
    src = lane + int(delta)
    return vals[src] if src < len(vals) and vals[src] is not None else value


def shfl_xor_sync(self: Any, mask: Any, value: Any, lane_mask: Any) -> Any:
    _check_mask(mask)
    vals, lane = _exchange(value)
    return vals[(lane ^ int(lane_mask)) & 31]


def syncwarp(self: Any, mask: Any = FULL) -> None:
    _check_mask(mask)
    _exchange(None)


def activemask(self: Any) -> np.uint32:
    return np.uint32(FULL)


def lanemask_lt(self: Any) -> np.uint32:
    lane = threading.current_thread().thread_id % 32  # type: ignore[attr-defined]
    return np.uint32((1 << lane) - 1)


_SHIMS = {
    "ballot_sync": ballot_sync,
    "shfl_sync": shfl_sync,
    "shfl_up_sync": shfl_up_sync,
    "shfl_down_sync": shfl_down_sync,
    "shfl_xor_sync": shfl_xor_sync,
    "syncwarp": syncwarp,
    "activemask": activemask,
    "lanemask_lt": lanemask_lt,
}


def _yielding_is_alive(self: threading.Thread) -> bool:
    """``Thread.is_alive`` that first lets another thread take the GIL (see the docstring)."""
    time.sleep(0)
    return threading.Thread.is_alive(self)


def install() -> None:
    """Add the warp intrinsics to the simulator's fake ``cuda`` module and make its block
    manager's polling loop yield the GIL (idempotent)."""
    from numba.cuda.simulator import kernel, kernelapi

    for name, fn in _SHIMS.items():
        setattr(kernelapi.FakeCUDAModule, name, fn)
    kernel.BlockThread.is_alive = _yielding_is_alive  # type: ignore[method-assign]
