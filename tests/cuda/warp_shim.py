"""Warp intrinsics for the numba CUDA simulator, which has none, and a faster simulator.

The simulator runs every CUDA thread of a block as a Python thread. These shims let the 32
threads of a warp meet at a per-warp barrier and exchange one value each, so
``ballot_sync``, ``shfl_*_sync``, ``syncwarp`` and ``activemask`` behave as on hardware for
converged warps. As on hardware, every lane of the warp must reach the same sequence of
calls: a lane that skips a call deadlocks its warp (the barrier times out instead of hanging
forever). Only the full mask is supported, which is all ccoll's kernels use.

``install()`` also makes the simulator itself cheaper to run, with the same semantics
(nearly all of the CUDA test phases' time is spent inside simulated kernels):

- numba-cuda's ``BlockManager.run`` polls its threads in a pure-Python loop (``is_alive`` on
  each live thread, over and over), which gives up the GIL only when the interpreter's
  switch interval (5 ms) forces it, so the threads it waits for ran in short slices between
  long idle polls. Its ``is_alive`` calls now wait (up to 50 ms) for the thread to end,
  without the GIL; with ``syncthreads`` off the poll (below), the poll only has to notice
  threads ending and exceptions.
- ``syncthreads`` and the warp barrier block each waiting thread on a gate of its own that
  the last thread to arrive opens (:class:`_Block`, :class:`_Warp`), instead of numba's
  polled events and ``threading.Barrier``'s shared condition lock.
- ``cuda.shared.array`` finds its call site from the calling frame instead of a
  ``traceback.extract_stack`` of the whole stack per call and thread.

Together they about halve the time of the simulated kernels (numbers in the commit
messages that brought them).

``install()`` is idempotent; tests/cuda/conftest.py, tests/mpi/test_collectives_gpu_sim.py
and the simulator modes of bench/gpu/compressor_gpu.py and bench/gpu/sched_gpu.py call it.
"""

from __future__ import annotations

import sys
import threading
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

    The barrier: each lane owns a gate, a lock held closed; a lane that arrives before the
    last one blocks on its own gate, and the last one to arrive opens every other gate.
    A waiting lane then wakes once, where ``threading.Barrier`` makes it wait for its own
    lock and then again for the barrier's shared condition lock, which the other 30 woken
    lanes contend for: half the thread switches per warp intrinsic in the simulator.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.mutex = threading.Lock()
        self.arrived = 0
        self.gates = [threading.Lock() for _ in range(size)]
        for gate in self.gates:
            gate.acquire()
        self.slots = [[None] * 32, [None] * 32]
        self.phase = [0] * 32

    def wait(self, lane: int) -> None:
        with self.mutex:
            self.arrived += 1
            last = self.arrived == self.size
            if last:
                self.arrived = 0
        if last:
            for i, gate in enumerate(self.gates):
                if i != lane:
                    gate.release()
        elif not self.gates[lane].acquire(timeout=TIMEOUT_S):
            raise RuntimeError(
                f"warp_shim: lane {lane} waited {TIMEOUT_S:.0f} s for the other lanes of its "
                "warp at a warp intrinsic; lanes of a warp must reach the same calls"
            )


def _warp() -> tuple[_Warp, int]:
    t = threading.current_thread()
    mine = t.__dict__.get("_ccoll_warp")  # a simulated thread stays in one warp
    if mine is not None:
        return mine  # type: ignore[no-any-return]
    mgr = t._manager  # type: ignore[attr-defined]
    tid = t.thread_id  # type: ignore[attr-defined]
    wid, lane = divmod(tid, 32)
    with _lock:
        warps = mgr.__dict__.setdefault("_ccoll_warps", {})
        w = warps.get(wid)
        if w is None:
            nthreads = int(np.prod(mgr._block_dim))
            w = warps[wid] = _Warp(min(32, nthreads - 32 * wid))
    t._ccoll_warp = (w, lane)  # type: ignore[attr-defined]
    return w, lane


def _exchange(value: Any) -> tuple[list[Any], int]:
    w, lane = _warp()
    ph = w.phase[lane]
    w.phase[lane] = ph ^ 1
    buf = w.slots[ph]
    buf[lane] = value
    w.wait(lane)
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


class _Aborted(BaseException):
    """Ends a thread whose block another thread's exception aborted; numba's ``run`` keeps
    only ``Exception``s, so the launch reports that other thread's error, not this."""


class _Block:
    """``syncthreads`` of one simulated thread block, on gates like the warps' barrier.

    numba's simulator parks a thread in ``syncthreads`` on its own ``threading.Event`` and
    lets the block manager's polling loop notice when every live thread is parked and set
    the events: about 100 us per thread per call (25 ms for 256 threads). Here the last
    live thread to arrive opens the others' gates itself. The rule is numba's: the block
    passes when every thread that has not returned waits in ``syncthreads``; a thread that
    returns may be the one the others waited for; a thread that raises ends the threads
    that wait (or come) here, quietly, and the manager raises that thread's error.
    """

    def __init__(self, nthreads: int) -> None:
        self.mutex = threading.Lock()
        self.live = nthreads
        self.waiting: list[Any] = []
        self.aborted = False

    def arrive(self, gate: Any) -> None:
        with self.mutex:
            if self.aborted:
                raise _Aborted
            if len(self.waiting) + 1 < self.live:
                self.waiting.append(gate)
                opened = None
            else:
                opened, self.waiting = self.waiting, []
        if opened is None:
            gate.acquire()
            if self.aborted:
                raise _Aborted
            return
        for g in opened:
            g.release()

    def leave(self, failed: bool) -> None:
        with self.mutex:
            self.live -= 1
            if failed:
                self.aborted = True
            if failed or (self.waiting and len(self.waiting) == self.live):
                opened, self.waiting = self.waiting, []
            else:
                opened = []
        for g in opened:
            g.release()


def _block(t: Any) -> _Block:
    mgr = t._manager
    b = mgr.__dict__.get("_ccoll_block")
    if b is None:
        with _lock:
            b = mgr.__dict__.get("_ccoll_block")
            if b is None:
                b = mgr._ccoll_block = _Block(int(np.prod(mgr._block_dim)))
    return b  # type: ignore[no-any-return]


def _syncthreads(self: Any) -> None:
    """``BlockThread.syncthreads`` on the block's gates (see :class:`_Block`)."""
    gate = self.__dict__.get("_ccoll_gate")
    if gate is None:
        gate = self._ccoll_gate = threading.Lock()
        gate.acquire()
    _block(self).arrive(gate)


def _waiting_is_alive(self: Any) -> bool:
    """``Thread.is_alive`` for the block manager's poll: wait up to 50 ms for the thread to
    end (blocked, without the GIL) instead of answering at once (see the docstring).

    A thread that has recorded an exception counts as alive, so that the poll, which looks
    at the exceptions of the threads it still counts, raises it on its next round.
    """
    if self.exception is not None:
        return True
    self.join(0.05)
    return threading.Thread.is_alive(self)


def _run_then_leave(self: Any) -> None:
    """numba's ``BlockThread.run`` (which keeps the kernel's exception), then leave the block."""
    try:
        type(self)._ccoll_numba_run(self)
    except _Aborted:
        pass
    finally:
        _block(self).leave(self.exception is not None)


_kernelapi: Any = None  # numba.cuda.simulator.kernelapi, once installed


def _shared_array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> Any:
    """numba's ``FakeCUDAShared.array`` keyed by the caller's frame, not a stack extract.

    numba identifies a shared array by the source file and line of its ``cuda.shared.array``
    call, taken from ``traceback.extract_stack``: a walk of the whole stack that stats every
    source file (to refresh linecache) on each call, in every simulated thread. The key is
    the same here, read from the calling frame; so is everything else.
    """
    if alignment is not None or shape == 0:
        return type(self)._ccoll_numba_array(self, shape, dtype, alignment)
    if isinstance(dtype, _kernelapi.types.Type):
        dtype = _kernelapi.numpy_support.as_dtype(dtype)
    f = sys._getframe(1)
    caller = (f.f_code.co_filename, f.f_lineno)
    res = self._allocations.get(caller)
    if res is None:
        res = self._allocations[caller] = np.empty(shape, dtype)
    return res


def install() -> None:
    """Add the warp intrinsics to the simulator's fake ``cuda`` module, give its thread
    blocks gate-based ``syncthreads`` and shared arrays, and make its block manager's
    polling loop wait instead of spinning (idempotent)."""
    global _kernelapi
    from numba.cuda.simulator import kernel, kernelapi

    _kernelapi = kernelapi
    for name, fn in _SHIMS.items():
        setattr(kernelapi.FakeCUDAModule, name, fn)
    bt = kernel.BlockThread
    if not hasattr(bt, "_ccoll_numba_run"):  # kept on the class: one original, however
        bt._ccoll_numba_run = bt.run  # type: ignore[attr-defined]  # often installed
    bt.run = _run_then_leave  # type: ignore[method-assign]
    sh = kernelapi.FakeCUDAShared
    if not hasattr(sh, "_ccoll_numba_array"):
        sh._ccoll_numba_array = sh.array  # type: ignore[attr-defined]
    sh.array = _shared_array  # type: ignore[method-assign]
    bt.syncthreads = _syncthreads  # type: ignore[method-assign]
    bt.is_alive = _waiting_is_alive  # type: ignore[method-assign]
