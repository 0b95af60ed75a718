"""How much does compressing gradients slow a training-like loop on the CPU?

Training stand-in: a fixed number of float32 matmuls (numpy/OpenBLAS, all cores). After
each step one "gradient" is compressed with ccoll's compressor. Modes, measured side by
side in one run, interleaved, median of --repeats:

- train-alone     the matmul loop only (the reference for slowdowns);
- compress-alone  the compressions only, on the main thread with all numba threads;
- inline          each step compresses on the training thread (serial);
- inline-capped   the same with the compress lane's numba thread count;
- lane            compressions go to a Scheduler("cpu") compress lane at nice 0;
- lane-nice       same at the lane's default priority (nice +10 on Linux).

The lanes use Scheduler.grid_limit("compress") numba threads (--max-sm-fraction of them).
Reported: the training loop's time (time until the last matmul returned) and the total
(until the last compression finished), with ratios to train-alone, and the share of the
CPUs other processes used meanwhile (a shared machine makes runs with others% > 0 unclean).

Run: .venv/bin/python bench/sched_cpu.py [--iters 40] [--grad-mib 8] [--repeats 3]

``--hook`` measures the DDP hook's real work instead (see :func:`run_hook`): under
``mpiexec -n N python -m mpi4py bench/sched_cpu.py --hook`` each rank trains a torch MLP
under DDP with ccoll's comm hook, whose compression and ring run on the process
scheduler's lanes, against the same training with a hook that does nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ccoll.gpu_sched import Scheduler  # noqa: E402


def _standin_compress() -> Callable[[np.ndarray, float], Any]:
    """A numba kernel with the compressor's shape of work (quantize, block widths, pack)."""
    from numba import njit, prange

    @njit(parallel=True, nogil=True, cache=True)
    def kernel(x, step, out):  # type: ignore[no-untyped-def]
        nb = x.size // 32
        for b in prange(nb):
            m = 0
            for j in range(32):
                q = int(np.round(x[b * 32 + j] / step))
                m = max(m, abs(q))
            w = 0
            while m:
                w += 1
                m >>= 1
            for p in range(w):
                word = 0
                for j in range(32):
                    q = abs(int(np.round(x[b * 32 + j] / step)))
                    word |= ((q >> p) & 1) << j
                out[b * 33 + p] = word
            out[b * 33 + 32] = w
        return out

    def compress(x: np.ndarray, eb: float) -> np.ndarray:
        out = np.empty((x.size // 32) * 33, dtype=np.uint32)
        return kernel(x, 2.0 * eb, out)

    return compress


def resolve_compressor(allow_standin: bool) -> tuple[Callable[[np.ndarray, Any], Any], Any, str]:
    """Return (compress, error bound, description): ccoll's compressor when it exists."""
    import ccoll

    fn = getattr(ccoll, "compress", None)
    if fn is None:
        try:
            from ccoll.compressor import compress as fn  # type: ignore[attr-defined,no-redef]
        except ImportError:
            fn = None
    if fn is not None:
        return fn, ccoll.REL(1e-3), f"{fn.__module__}.{fn.__qualname__}, REL 1e-3"
    if not allow_standin:
        raise SystemExit("ccoll.compress is not available; pass --stand-in to develop without it")
    return _standin_compress(), None, "STAND-IN numba kernel (not ccoll's compressor)"


def gradient(n: int, seed: int) -> np.ndarray:
    """Gradient-like data: small Laplace-distributed values, a few large ones set the range."""
    rng = np.random.default_rng(seed)
    g = rng.laplace(0.0, 1e-4, n).astype(np.float32)
    g[rng.integers(0, n, max(1, n // 100000))] = rng.normal(0.0, 1e-1, max(1, n // 100000))
    return g


def _busy_s() -> float | None:
    """CPU seconds all processes spent busy since boot (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measured(fn: Callable[[], tuple[float, float]]) -> tuple[float, float, float]:
    """Run one mode; also return the share of all CPUs that other processes used meanwhile.

    The machine may be shared: a run where others took a noticeable share is not a clean
    measurement, and more threads of ours then also win a larger share of a contended CPU.
    """
    b0, o0, w0 = _busy_s(), os.times(), time.perf_counter()
    t_train, t_total = fn()
    b1, o1, w1 = _busy_s(), os.times(), time.perf_counter()
    if b0 is None or b1 is None:
        return t_train, t_total, float("nan")
    own = (o1.user + o1.system) - (o0.user + o0.system)
    others = max(0.0, (b1 - b0) - own) / ((w1 - w0) * (os.cpu_count() or 1))
    return t_train, t_total, others


def run(args: argparse.Namespace) -> None:
    compress, eb_obj, desc = resolve_compressor(args.stand_in)
    n = args.size
    a = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal((n, n)).astype(np.float32)
    c = np.empty_like(a)
    grads = [gradient(args.grad_mib * 2**18, s) for s in range(4)]
    eb: Any = eb_obj
    if eb is None:  # the stand-in takes an absolute bound
        eb = 1e-3 * float(grads[0].max() - grads[0].min())

    def step() -> None:
        np.matmul(a, b, out=c)

    # Warm up: JIT, thread pools, page faults.
    step()
    compress(grads[0], eb)

    def train_alone() -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        t = time.perf_counter() - t0
        return t, t

    def compress_alone() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(args.iters):
            compress(grads[i % 4], eb)
        t = time.perf_counter() - t0
        return 0.0, t

    def inline() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(args.iters):
            step()
            compress(grads[i % 4], eb)
        t = time.perf_counter() - t0
        return t, t

    def inline_capped() -> tuple[float, float]:
        # Inline with the lane's numba thread count: separates "fewer threads" from "lane".
        n0 = numba.get_num_threads()
        numba.set_num_threads(lane_threads)
        try:
            return inline()
        finally:
            numba.set_num_threads(n0)

    def on_lane(sched: Scheduler) -> Callable[[], tuple[float, float]]:
        lane = sched.lane("compress")
        lane.submit(compress, grads[0], eb).wait()  # warm the lane's thread and numba pool

        def go() -> tuple[float, float]:
            t0 = time.perf_counter()
            for i in range(args.iters):
                step()
                lane.submit(compress, grads[i % 4], eb)
            t_train = time.perf_counter() - t0
            lane.synchronize()
            return t_train, time.perf_counter() - t0

        return go

    frac = args.max_sm_fraction
    s0 = Scheduler("cpu", max_sm_fraction=frac, priorities={"compress": 0})
    s10 = Scheduler("cpu", max_sm_fraction=frac)
    lane_threads, lane_nice = s10.grid_limit("compress"), s10.priority("compress")
    modes: dict[str, Callable[[], tuple[float, float]]] = {
        "train-alone": train_alone,
        "compress-alone": compress_alone,
        "inline": inline,
        "inline-capped": inline_capped,
        "lane": on_lane(s0),
        "lane-nice": on_lane(s10),
    }
    res: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for name, fn in modes.items():
            res[name].append(measured(fn))
    s0.close()
    s10.close()

    med = {m: tuple(statistics.median(x[k] for x in r) for k in range(3))
           for m, r in res.items()}
    base = med["train-alone"][0]
    worst_others = max(x[2] for r in res.values() for x in r)
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{_cpu_model()}; load average before: {args.load0}")
    print(f"# compressor: {desc}")
    print(f"# training: {args.iters} x matmul {n}x{n} float32 (OpenBLAS); one {args.grad_mib} MiB "
          f"float32 gradient compressed per step; numba threads {numba.get_num_threads()}, "
          f"compress lane threads {lane_threads} "
          f"(max_sm_fraction {frac}), lane nice +{lane_nice}")
    print(f"# median of {args.repeats}, modes interleaved; other processes used at most "
          f"{100 * worst_others:.0f}% of the CPUs during any one run")
    print(f"{'mode':<15}{'train_s':>10}{'total_s':>10}{'train/alone':>13}{'total/alone':>13}"
          f"{'others%':>9}")
    for m, (t, tot, oth) in med.items():
        tr = f"{t / base:13.2f}" if t else f"{'-':>13}"
        print(f"{m:<15}{t:10.3f}{tot:10.3f}{tr}{tot / base:13.2f}{100 * oth:9.0f}")


# ---------------------------------------------------------------- the hook's real work

HOOK_MODES = ("alone", "lanes", "lanes-nice0", "worker")


def run_hook(args: argparse.Namespace) -> None:
    """``--hook``: DDP training with ccoll's comm hook next to it, against training alone.

    Run under ``mpiexec -n N python -m mpi4py bench/sched_cpu.py --hook``. Each rank trains
    an MLP (torch, one intra-op thread: the ranks share the cores) under DDP. Modes, a fresh
    DDP model each, interleaved, median of ``--repeats``:

    - alone        a hook that returns each bucket at once (no averaging): training alone;
    - lanes        ccoll's comm hook (policy "compress", REL 1e-3), its compute on the
                   process scheduler's lanes at their default priorities;
    - lanes-nice0  the same with every lane at the training thread's priority;
    - worker       the same with the scheduler off (a private worker thread per channel).

    The training lane's time per step is the forward and backward compute: from the step's
    start to the moment the last bucket was handed to the hook (DDP calls the hook as soon
    as a bucket's gradients are ready, so later buckets' compute runs beside earlier ones'
    compression and ring). Also reported: the whole step (with the wait for the averages).
    """
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ccoll
    import ccoll.gpu_sched as gs
    import ccoll.torch as ct

    torch.set_num_threads(1)
    ct.init_process_group_from_mpi()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    torch.manual_seed(0)
    width, depth, batch = args.hook_width, args.hook_depth, args.hook_batch
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    base = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    nparams = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1 + rank)
    xs = [torch.randn(batch, width, generator=gen) for _ in range(4)]
    ys = [torch.randint(0, 10, (batch,), generator=gen) for _ in range(4)]
    loss_fn = torch.nn.CrossEntropyLoss()
    handed = [0.0]

    # No annotations: DDP checks a hook's by identity, and here they are strings.
    def noop(state, bucket):  # type: ignore[no-untyped-def]
        handed[0] = time.perf_counter()
        fut: Any = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def timed(state, bucket):  # type: ignore[no-untyped-def]
        handed[0] = time.perf_counter()
        return ct.comm_hook(state, bucket)

    def configure(mode: str) -> None:
        if mode == "lanes-nice0":
            gs.configure("cpu", priorities={n: 0 for n in gs.LANES})
        elif mode == "worker":
            gs.configure("cpu", enabled=False)
        else:
            gs.configure("cpu")

    def one(mode: str) -> tuple[float, float]:
        configure(mode)
        model = DDP(copy.deepcopy(base))
        state = None
        if mode == "alone":
            model.register_comm_hook(None, noop)
        else:
            state = ct.CCollHookState(eb=ccoll.REL(1e-3), policy="compress", start_iter=0)
            model.register_comm_hook(state, timed)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        comp, whole = [], []
        try:
            for i in range(args.warmup + args.iters):
                world.Barrier()
                t0 = time.perf_counter()
                loss = loss_fn(model(xs[i % 4]), ys[i % 4])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                t1 = time.perf_counter()
                if i >= args.warmup:
                    comp.append(handed[0] - t0)
                    whole.append(t1 - t0)
        finally:
            if state is not None:
                state.close()
        # the slowest rank's medians
        return (world.allreduce(statistics.median(comp), MPI.MAX),
                world.allreduce(statistics.median(whole), MPI.MAX))

    res: dict[str, list[tuple[float, float]]] = {m: [] for m in HOOK_MODES}
    for _ in range(args.repeats):
        for m in HOOK_MODES:
            res[m].append(one(m))
    gs.configure("cpu")
    if rank == 0:
        med = {m: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
               for m, v in res.items()}
        alone = med["alone"][0]
        print(f"# machine: {os.cpu_count()} CPUs, {_cpu_model()}; load average before: "
              f"{args.load0}, after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"# {size} ranks; DDP MLP {depth} x {width}x{width} ({nparams / 1e6:.1f} M "
              f"parameters, {nparams * 4 / 2**20:.0f} MiB of gradients per step), batch {batch}, "
              f"torch {torch.__version__}, one intra-op thread per rank")
        print(f"# ccoll hook: REL 1e-3, policy compress, every bucket from step 0; "
              f"{args.iters} steps after {args.warmup} warm-up, median over steps, slowest rank, "
              f"median of {args.repeats} interleaved repeats")
        print(f"{'mode':<13}{'compute_ms':>12}{'vs alone':>10}{'step_ms':>10}{'vs alone':>10}")
        for m, (c, w) in med.items():
            print(f"{m:<13}{c * 1e3:12.1f}{c / alone:10.2f}{w * 1e3:10.1f}"
                  f"{w / med['alone'][1]:10.2f}")
    dist.destroy_process_group()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iters", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--size", type=int, default=1024, help="matmul size n (default 1024)")
    p.add_argument("--grad-mib", type=int, default=8, help="gradient MiB per step (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per mode (default 3)")
    p.add_argument("--max-sm-fraction", type=float, default=0.5,
                   help="share of numba threads for the compress lane (default 0.5)")
    p.add_argument("--stand-in", action="store_true",
                   help="use a stand-in numba kernel when ccoll.compress does not exist yet")
    p.add_argument("--hook", action="store_true",
                   help="DDP training with ccoll's comm hook on the lanes (needs torch; run "
                   "under mpiexec)")
    p.add_argument("--warmup", type=int, default=3, help="--hook: warm-up steps (default 3)")
    p.add_argument("--hook-width", type=int, default=1024,
                   help="--hook: MLP width (default 1024)")
    p.add_argument("--hook-depth", type=int, default=8,
                   help="--hook: hidden layers (default 8: 8.4 M parameters)")
    p.add_argument("--hook-batch", type=int, default=64, help="--hook: batch (default 64)")
    args = p.parse_args()
    args.load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.hook:
        run_hook(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
