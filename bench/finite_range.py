"""The REL check stage: numpy's finite range against ccoll's fused numba pass, same process.

``ccoll.errorbound.finite_range`` (numpy: a min pass, a max pass and, when either is not
finite, a filtered copy and two more passes) against ``ccoll.compressor.cpu.finite_range``
(one parallel pass), on 64 MiB float32 Gaussian data with and without NaN, at 1 and 2 numba
threads. The two alternate call by call (15 rounds, best of 3 per round); printed: the
median and the best round of each, and the load average before and after.

Run: .venv/bin/python bench/finite_range.py [--mib 64]
"""

from __future__ import annotations

import argparse
import os
import timeit

import numba
import numpy as np

from ccoll.compressor.cpu import finite_range as fused
from ccoll.errorbound import finite_range as numpy_range


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="float32 MiB per array (default 64)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    args = p.parse_args()
    x = np.random.default_rng(0).standard_normal((args.mib << 20) // 4).astype(np.float32)
    xn = x.copy()
    xn[::4096] = np.nan
    fused(x)  # compile or load from numba's cache
    print(f"load before {os.getloadavg()[0]:.1f}; numba pool {numba.config.NUMBA_NUM_THREADS}")
    for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
        numba.set_num_threads(threads)
        for label, data in (("finite", x), ("1 NaN per 4096", xn)):
            best: dict[str, list[float]] = {"numpy": [], "fused": []}
            for _ in range(args.rounds):
                for name, f in (("numpy", numpy_range), ("fused", fused)):
                    best[name].append(min(timeit.repeat(lambda f=f, d=data: f(d), number=1,
                                                        repeat=3)))
            a, b = (np.array(best[k]) * 1e3 for k in ("numpy", "fused"))
            print(f"{threads} thread(s), {args.mib} MiB, {label}: numpy {np.median(a):.2f} ms "
                  f"(best {a.min():.2f}), fused {np.median(b):.2f} ms (best {b.min():.2f}), "
                  f"{np.median(a) / np.median(b):.2f}x", flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
