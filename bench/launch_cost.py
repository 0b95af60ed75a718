"""What launching ccoll's CPU kernels costs on a tiny array: numba's thread-count calls.

Times ``compress``, ``decompress``, ``add_data`` and ``add`` of 256 float32 values (both
stream formats) with ccoll's reads and sets of numba's per-thread count made through
numba's public ``get_num_threads``/``set_num_threads`` ("public", as before 2026-12-06)
and through the threading layer's own functions (``cpu_threads.counts()``, "layer"), in
alternating rounds in one process; the least of ``--calls`` calls per round, the median
over ``--rounds``. Prints the speed index of the run (docs/performance.md, "Measuring").

    python bench/launch_cost.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from ccoll.compressor.api import add, add_data, compress_abs, decompress
from ccoll.runtime import cpu_threads
from ccoll.speedindex import describe, speed_index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    x = (np.random.default_rng(0).laplace(size=256) * 1e-2).astype(np.float32)
    y = np.empty_like(x)
    layer = cpu_threads.counts()
    public = (numba.get_num_threads, numba.set_num_threads)
    ops = {}
    for v in (1, 2):
        s = compress_abs(x, 1e-4, version=v)
        ops[f"compress v{v}"] = lambda v=v: compress_abs(x, 1e-4, version=v)
        ops[f"decompress v{v}"] = lambda s=s: decompress(s, out=y)
        ops[f"add_data v{v}"] = lambda s=s: add_data(s, x)
        ops[f"add v{v}"] = lambda s=s: add(s, s)
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, fns in (("public", public), ("layer", layer)):
            cpu_threads._counts = fns
            for k, f in ops.items():
                f()
                best = 1e9
                for _ in range(args.calls):
                    t = time.perf_counter_ns()
                    f()
                    best = min(best, time.perf_counter_ns() - t)
                got.setdefault((k, name), []).append(best / 1e3)
    cpu_threads._counts = layer
    print(f"# 256 float32 values, one process; {describe(speed_index())}")
    print("| kernel | public (us) | layer (us) | layer / public |")
    print("|---|---:|---:|---:|")
    for k in ops:
        a = statistics.median(got[(k, "public")])
        b = statistics.median(got[(k, "layer")])
        print(f"| {k} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
