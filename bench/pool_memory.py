"""Memory a long-lived process holds: peak and final RSS of 1,000 calls of mixed sizes.

Run under MPI (2 ranks on one node: shared memory)::

    .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py bench/pool_memory.py --calls 1000

Every rank makes the same sequence of compressed calls on one ``Communicator``
(``policy="compress"``, ``ABS(2e-5)``, float32 gradient-like data: Student-t values of
scale 1e-2, a fifth of them zeros): mostly 16 Ki to 1 Mi elements, one call in 50 of
8 Mi elements (32 MiB per rank) but none in the last 100 to 150 calls, every fifth call
an ``iallreduce`` (the progress engine's channel). It prints, per rank, the resident set
(``VmRSS``) after a warm-up, its peak (``VmHWM``) over the calls and at the end, the
seconds the calls took, and the bytes each channel's buffer pools hold at the end; then
the CPU as llvm names it. ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import ccoll

SMALL = [1 << 14, 1 << 16, 1 << 18, 1 << 20]
LARGE = 1 << 23
TAIL = 100  # small calls at the end


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    # Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _pool_bytes(c: ccoll.Communicator) -> dict[str, int]:
    out = {}
    for ch in c._channels:  # noqa: SLF001 - a benchmark looks inside
        held = sum(b.size for b in ch._pool) + sum(b.size for b in ch._pinned)
        out[ch.name] = int(held)
    return out


def sizes(calls: int, seed: int) -> list[int]:
    """The sequence of element counts (the same on every rank)."""
    rng = np.random.default_rng(seed)
    seq = [int(rng.choice(SMALL)) for _ in range(calls)]
    for i in range(0, calls - TAIL, 50):
        seq[i] = LARGE
    return seq


def data(rank: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([rank, n])
    x = rng.standard_t(3, size=n) * 1e-2
    x[rng.random(n) < 0.2] = 0.0
    return x.astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    eb = ccoll.ABS(1e-3 * 0.02)
    inputs = {n: data(comm.rank, n) for n in sorted({*SMALL, LARGE})}
    with ccoll.Communicator(comm, policy="compress") as c:
        for n in SMALL:  # warm-up: kernels compiled, both channels made
            c.allreduce(inputs[n], eb=eb)
            c.iallreduce(inputs[n], eb=eb).wait()
        comm.Barrier()
        warm = _status_kib("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        for i, n in enumerate(sizes(args.calls, args.seed)):
            if i % 5 == 4:
                c.iallreduce(inputs[n], eb=eb).wait()
            else:
                c.allreduce(inputs[n], eb=eb)
        comm.Barrier()
        seconds = time.perf_counter() - t0
        peak, final = _status_kib("VmHWM"), _status_kib("VmRSS")
        pools = _pool_bytes(c)
    rows = comm.gather({"rank": comm.rank, "warm_MiB": warm / 1024, "peak_MiB": peak / 1024,
                        "final_MiB": final / 1024, "seconds": seconds,
                        "pools_MiB": {k: v / 2**20 for k, v in pools.items()}}, root=0)
    if comm.rank == 0:
        import llvmlite.binding as llvm

        print(f"# {args.calls} calls, {comm.size} ranks, sizes {SMALL} and {LARGE} elements "
              f"(float32), cpu {llvm.get_host_cpu_name()}")
        print(f"{'rank':>4} {'after warm-up MiB':>18} {'peak MiB':>9} {'final MiB':>10} "
              f"{'seconds':>8}  pools at the end (MiB)")
        for r in rows:
            pools_s = ", ".join(f"{k} {v:.1f}" for k, v in r["pools_MiB"].items())
            print(f"{r['rank']:>4} {r['warm_MiB']:>18.1f} {r['peak_MiB']:>9.1f} "
                  f"{r['final_MiB']:>10.1f} {r['seconds']:>8.2f}  {pools_s}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"calls": args.calls, "ranks": comm.size,
                           "cpu": llvm.get_host_cpu_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
