"""Format v2 on the CPU: what its first use costs in compile time, and its one-thread speed.

Part 1 compiles from an empty numba cache (a fresh directory in ``NUMBA_CACHE_DIR``, so
the repository's own cache is neither used nor touched) and reports the seconds of each
operation's first call on a small input (wall clock, and the process's CPU time, which
other load on the machine does not inflate): ``compress``, ``decompress``, ``add`` and
``add_data`` of version-2 streams, float32 then float64 (v1's kernels, which the same
first call also compiles, are warmed up before each timed call). Part 2 (``--speed``)
times v1 and v2 on the concatenation of each bundled dump at REL 1e-2, 1e-3 and 1e-4 with
one numba thread, best of 5: GB/s of float32 input, and the ratio.

    python bench/v2_compile.py            # compile times (about 4 minutes on 2 cores)
    python bench/v2_compile.py --speed    # and the speeds (another minute)

docs/dev/format-v2.md ("Compile time and inlining") quotes its output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMPILE = r"""
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import ccoll
from ccoll.compressor import api
for dt in (np.float32, np.float64):
    x = (np.random.default_rng(0).standard_normal(5000) * 1e-2).astype(dt)
    ccoll.decompress(api.add(ccoll.compress(x, ccoll.ABS(1e-3)), api.add_data(
        ccoll.compress(x, ccoll.ABS(1e-3)), x)))  # v1 kernels, outside the timings
    t, c = time.perf_counter(), time.process_time()
    s = ccoll.compress(x, ccoll.ABS(1e-3), version=2)
    print(f"{np.dtype(dt).name:8s} compress   {time.perf_counter() - t:7.1f} s"
          f"  ({time.process_time() - c:6.1f} s CPU)", flush=True)
    for name, fn in [("decompress", lambda: ccoll.decompress(s)), ("add", lambda: api.add(s, s)),
                     ("add_data", lambda: api.add_data(s, x))]:
        t, c = time.perf_counter(), time.process_time()
        fn()
        print(f"{np.dtype(dt).name:8s} {name:10s} {time.perf_counter() - t:7.1f} s"
              f"  ({time.process_time() - c:6.1f} s CPU)", flush=True)
"""


def compile_times() -> None:
    with tempfile.TemporaryDirectory(prefix="ccoll-v2-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", _COMPILE, ROOT], env=env, check=True)
        print(f"total (v1 warm-up included) {time.perf_counter() - t:.1f} s")


def speeds() -> None:
    import numba

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from compressor import DEFAULT_FILES, load_concat

    import ccoll
    from ccoll.compressor import api

    numba.set_num_threads(1)
    print("| data | REL | ratio v1 | ratio v2 | compress v1 | compress v2 | decompress v1 "
          "| decompress v2 | add v1 | add v2 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in DEFAULT_FILES:
        x = load_concat(path)
        span = float(x.max()) - float(x.min())
        for rel in (1e-2, 1e-3, 1e-4):
            eb = ccoll.ABS(rel * span)
            cols: dict[str, list[str]] = {"r": [], "c": [], "d": [], "a": []}
            for ver in (1, 2):
                s = ccoll.compress(x, eb, version=ver)
                cols["r"].append(f"{x.nbytes / len(s):.2f}")
                cols["c"].append(_rate(x.nbytes, ccoll.compress, x, eb, version=ver))
                cols["d"].append(_rate(x.nbytes, ccoll.decompress, s))
                cols["a"].append(_rate(x.nbytes, api.add, s, s))
            name = os.path.splitext(os.path.basename(path))[0]
            print(f"| {name} | {rel:g} | " + " | ".join(" | ".join(v) for v in cols.values())
                  + " |", flush=True)


def _rate(nbytes: int, fn, *args, **kw) -> str:  # type: ignore[no-untyped-def]
    """GB/s of ``nbytes`` for the best of 5 calls of ``fn(*args, **kw)``."""
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        fn(*args, **kw)
        best = min(best, time.perf_counter() - t)
    return f"{nbytes / best / 1e9:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--speed", action="store_true",
                    help="also time v1 and v2 on the bundled dumps (one numba thread)")
    args = ap.parse_args(argv)
    compile_times()
    if args.speed:
        speeds()
    return 0


if __name__ == "__main__":
    sys.exit(main())
