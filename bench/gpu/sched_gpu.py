"""How much does compressing gradients slow a training-like loop on one GPU?

Training stand-in: a fixed number of float32 cuBLAS matmuls (CuPy, else PyTorch) on the
training stream, which the training code creates itself at the device's highest stream
priority and hands to ccoll with ``Scheduler.adopt_stream``. After each step one
"gradient" is compressed with ``ccoll.compress(g, eb, stream=...)``. Modes, side by side
in one run, interleaved, median of --repeats:

- train-alone     the matmul loop only (the reference);
- compress-alone  the compressions only, on the compress lane;
- inline          each step compresses on the training stream (serial: the compressor
                  reads back its output size, so the host waits for the step first);
- lane            compressions on the compress lane, a low-priority stream, driven by a
                  second host thread; lane i waits (on the GPU) for step i's event;
- lane-same-prio  the same with the compress stream at the training stream's priority.

Reported: the training loop's time (until the training stream finished its last matmul)
and the total (until the last compression finished), with ratios to train-alone.

Run on a GPU machine: python bench/gpu/sched_gpu.py [--size 4096] [--iters 200]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from numba import cuda  # noqa: E402

import ccoll  # noqa: E402
from ccoll.gpu_sched import Scheduler  # noqa: E402


class _CupyBackend:
    name = "CuPy"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        least, greatest = cupy.cuda.runtime.deviceGetStreamPriorityRange()
        self.greatest = greatest
        self.train_stream = cupy.cuda.Stream(non_blocking=True, priority=greatest)

    def arrays(self, n: int, grad_elems: int, k: int) -> tuple[Any, Any, Any, list[Any]]:
        cp = self.cp
        rs = cp.random.RandomState(0)
        a = rs.standard_normal((n, n), dtype=cp.float32)
        b = rs.standard_normal((n, n), dtype=cp.float32)
        c = cp.empty_like(a)
        grads = []
        for i in range(k):
            g = cp.random.RandomState(i + 1).laplace(0.0, 1e-4, grad_elems).astype(cp.float32)
            g[:: max(1, grad_elems // 100)] *= 1000.0  # a few large values set the range
            grads.append(g)
        cp.cuda.Device().synchronize()
        return a, b, c, grads

    def matmul(self, a: Any, b: Any, c: Any) -> None:
        with self.train_stream:
            self.cp.matmul(a, b, out=c)

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()


class _TorchBackend:
    name = "PyTorch"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("PyTorch has no CUDA device")
        self.torch = torch
        torch.backends.cuda.matmul.allow_tf32 = False  # plain float32, like CuPy's default
        # Lower is higher; torch maps values beyond the device's range to its highest.
        self.train_stream = torch.cuda.Stream(priority=-1)

    def arrays(self, n: int, grad_elems: int, k: int) -> tuple[Any, Any, Any, list[Any]]:
        t = self.torch
        gen = t.Generator(device="cuda").manual_seed(0)
        a = t.randn((n, n), device="cuda", generator=gen)
        b = t.randn((n, n), device="cuda", generator=gen)
        c = t.empty_like(a)
        lap = t.distributions.Laplace(0.0, 1e-4)
        grads = []
        for _ in range(k):
            g = lap.sample((grad_elems,)).to("cuda", t.float32)
            g[:: max(1, grad_elems // 100)] *= 1000.0
            grads.append(g)
        t.cuda.synchronize()
        return a, b, c, grads

    def matmul(self, a: Any, b: Any, c: Any) -> None:
        with self.torch.cuda.stream(self.train_stream):
            self.torch.matmul(a, b, out=c)

    def sync(self) -> None:
        self.torch.cuda.synchronize()


class _NumbaBackend:
    """A naive numba matmul kernel: only for checking this script in the CUDA simulator
    (NUMBA_ENABLE_CUDASIM=1 ... --backend numba --size 4 --iters 2 --grad-mib 0.001), not for
    figures."""

    name = "numba (script check only)"
    # The simulator cannot run kernels launched from two host threads at once.
    lock = threading.Lock()

    def __init__(self) -> None:
        from ccoll.gpu_sched.cuda_lanes import in_simulator

        if in_simulator():  # ccoll's kernels use warp intrinsics the simulator lacks
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            sys.path.insert(0, os.path.join(root, "tests", "cuda"))
            import warp_shim

            warp_shim.install()
        self.cuda = cuda
        self.train_stream = cuda.stream()

        @cuda.jit
        def mm(a, b, c):  # type: ignore[no-untyped-def]
            i, j = cuda.grid(2)
            if i < c.shape[0] and j < c.shape[1]:
                acc = 0.0
                for k in range(a.shape[1]):
                    acc += a[i, k] * b[k, j]
                c[i, j] = acc

        self.mm = mm

    def arrays(self, n: int, grad_elems: int, k: int) -> tuple[Any, Any, Any, list[Any]]:
        import numpy as np

        rng = np.random.default_rng(0)
        a = self.cuda.to_device(rng.standard_normal((n, n)).astype(np.float32))
        b = self.cuda.to_device(rng.standard_normal((n, n)).astype(np.float32))
        c = self.cuda.device_array((n, n), np.float32)
        grads = [self.cuda.to_device(rng.laplace(0.0, 1e-4, grad_elems).astype(np.float32))
                 for _ in range(k)]
        return a, b, c, grads

    def matmul(self, a: Any, b: Any, c: Any) -> None:
        n = c.shape[0]
        g = (n + 15) // 16
        with self.lock:
            self.mm[(g, g), (16, 16), self.train_stream](a, b, c)

    def sync(self) -> None:
        self.cuda.synchronize()


def backend(name: str) -> Any:
    """CuPy if it is installed, else PyTorch with CUDA (or the named one)."""
    if name == "cupy":
        return _CupyBackend()
    if name == "torch":
        return _TorchBackend()
    if name == "numba":
        return _NumbaBackend()
    try:
        return _CupyBackend()
    except ImportError:
        return _TorchBackend()


def run(args: argparse.Namespace) -> None:
    be = backend(args.backend)
    eb = ccoll.REL(args.rel)
    compress = ccoll.compress
    lock = getattr(be, "lock", None)
    if lock is not None:

        def compress(*a: Any, **kw: Any) -> Any:
            with lock:
                return ccoll.compress(*a, **kw)

    k = 4
    a, b, c, grads = be.arrays(args.size, int(args.grad_mib * 2**18), k)
    frac = args.max_sm_fraction
    low = Scheduler("cuda", max_sm_fraction=frac)
    same = Scheduler("cuda", max_sm_fraction=frac, priorities={"compress": 0})
    for s in (low, same):
        s.adopt_stream(be.train_stream)

    # Warm up: cuBLAS handles, numba JIT of the compressor's kernels, per-stream buffers.
    be.matmul(a, b, c)
    for s in (low, same):
        lane = s.lane("compress")
        lane.submit(compress, grads[0], eb, stream=lane.stream).wait()
    compress(grads[0], eb, stream=be.train_stream)
    be.sync()

    def train_alone() -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(args.iters):
            be.matmul(a, b, c)
        low.lane("compute").record().wait()
        t = time.perf_counter() - t0
        return t, t

    def compress_alone() -> tuple[float, float]:
        lane = low.lane("compress")
        t0 = time.perf_counter()
        for i in range(args.iters):
            lane.submit(compress, grads[i % k], eb, stream=lane.stream)
        lane.synchronize()
        return 0.0, time.perf_counter() - t0

    def inline() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(args.iters):
            be.matmul(a, b, c)
            compress(grads[i % k], eb, stream=be.train_stream)
        be.sync()
        t = time.perf_counter() - t0
        return t, t

    def on_lane(sched: Scheduler) -> Callable[[], tuple[float, float]]:
        compute, lane = sched.lane("compute"), sched.lane("compress")

        def go() -> tuple[float, float]:
            ready: queue.SimpleQueue[Any] = queue.SimpleQueue()

            def compressor() -> None:
                # ccoll.compress waits on the host for its output size, so it gets a thread
                # of its own; the training thread only enqueues and never waits.
                while (ev := ready.get()) is not None:
                    i, step_done = ev
                    lane.submit(compress, grads[i % k], eb, stream=lane.stream,
                                after=[step_done])
                lane.synchronize()

            th = threading.Thread(target=compressor)
            t0 = time.perf_counter()
            th.start()
            for i in range(args.iters):
                be.matmul(a, b, c)
                ready.put((i, compute.record()))  # gradient i is ready after step i
            ready.put(None)
            compute.record().wait()
            t_train = time.perf_counter() - t0
            th.join()
            return t_train, time.perf_counter() - t0

        return go

    modes: dict[str, Callable[[], tuple[float, float]]] = {
        "train-alone": train_alone,
        "compress-alone": compress_alone,
        "inline": inline,
        "lane": on_lane(low),
        "lane-same-prio": on_lane(same),
    }
    res: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for name, fn in modes.items():
            res[name].append(fn())
            be.sync()
    med = {m: (statistics.median(t for t, _ in r), statistics.median(t for _, t in r))
           for m, r in res.items()}
    base = med["train-alone"][0]

    dev = cuda.get_current_device()
    name = getattr(dev, "name", b"CUDA simulator")
    print(f"# device: {name.decode() if isinstance(name, bytes) else name}, "
          f"{getattr(dev, 'MULTIPROCESSOR_COUNT', '?')} SMs; arrays: {be.name}")
    print(f"# training: {args.iters} x matmul {args.size}x{args.size} float32 on a stream of "
          f"priority {getattr(be.train_stream, 'priority', '?')}; one {args.grad_mib} MiB float32 "
          f"gradient compressed per step (ccoll.compress, REL {args.rel})")
    print(f"# compress lane priority {low.priority('compress')} (lane) / "
          f"{same.priority('compress')} (lane-same-prio); grid_limit('compress') = "
          f"{low.grid_limit('compress')} blocks of 256 (max_sm_fraction {frac}; applies only "
          "if the compressor reads it)")
    print(f"# median of {args.repeats}, modes interleaved")
    print(f"{'mode':<16}{'train_s':>10}{'total_s':>10}{'train/alone':>13}{'total/alone':>13}")
    for m, (t, tot) in med.items():
        tr = f"{t / base:13.2f}" if t else f"{'-':>13}"
        print(f"{m:<16}{t:10.4f}{tot:10.4f}{tr}{tot / base:13.2f}")
    low.close()
    same.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=int, default=4096, help="matmul size n (default 4096)")
    p.add_argument("--iters", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--grad-mib", type=float, default=64, help="gradient MiB per step (default 64)")
    p.add_argument("--rel", type=float, default=1e-3, help="REL error bound (default 1e-3)")
    p.add_argument("--repeats", type=int, default=5, help="repeats per mode (default 5)")
    p.add_argument("--max-sm-fraction", type=float, default=0.5,
                   help="Scheduler max_sm_fraction (default 0.5)")
    p.add_argument("--backend", choices=["auto", "cupy", "torch", "numba"], default="auto",
                   help="array library for the matmuls (default: CuPy, else PyTorch)")
    run(p.parse_args())


if __name__ == "__main__":
    main()
