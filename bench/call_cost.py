"""Fixed cost of one compressor call: compress, decompress, add and add_data of small inputs.

The ring makes one call per chunk and step, so what a call costs whatever its size
(argument checks, header parsing, validation, thread-count changes, kernel dispatch)
adds up (docs/model.md, "Kernel calls"). One numba thread, thread CPU time, best of
``--repeat`` rounds of ``--calls`` calls each, on slices of the MiniLM concatenation
(``--sizes`` in KiB of float32 per operand), formats 1 and 2:

    python bench/call_cost.py
    python bench/call_cost.py --sizes 16,1024 --calls 500

docs/dev/compressor-kernels.md quotes its output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,256", help="KiB of float32 per operand, comma-separated")
    ap.add_argument("--calls", type=int, default=2000, help="calls per round")
    ap.add_argument("--repeat", type=int, default=5, help="rounds, the best counts")
    ap.add_argument("--rel", type=float, default=1e-3, help="REL bound (of the dump's range)")
    args = ap.parse_args(argv)
    import numba

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from compressor import DEFAULT_FILES, load_concat

    import ccoll
    from ccoll.compressor import add, add_data

    numba.set_num_threads(1)
    xx = load_concat(DEFAULT_FILES[0])
    eb = args.rel * (float(xx.max()) - float(xx.min()))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.2f}; one numba thread, thread CPU time, best of "
          f"{args.repeat} x {args.calls} calls; MiniLM REL {args.rel:g}; us per call")
    print("| KiB | format | compress | decompress | add | add_data |")
    print("|---:|---:|---:|---:|---:|---:|")
    mid = xx.size // 2
    for kib in (int(s) for s in args.sizes.split(",")):
        n = kib * 256
        x, z = xx[mid : mid + n].copy(), xx[mid + n : mid + 2 * n].copy()
        y = np.empty_like(x)
        for version in (1, 2):
            a = ccoll.compress(x, ccoll.ABS(eb), version=version)
            b = ccoll.compress(z, ccoll.ABS(eb), version=version)
            ops = {
                "compress": lambda x=x, v=version: ccoll.compress(x, ccoll.ABS(eb), version=v),
                "decompress": lambda a=a, y=y: ccoll.decompress(a, out=y),
                "add": lambda a=a, b=b: add(a, b),
                "add_data": lambda a=a, z=z: add_data(a, z),
            }
            best = dict.fromkeys(ops, float("inf"))
            for _ in range(args.repeat):
                for k, fn in ops.items():
                    fn()
                    t = time.thread_time()
                    for _ in range(args.calls):
                        fn()
                    best[k] = min(best[k], (time.thread_time() - t) / args.calls)
            print(f"| {kib} | {version} | " + " | ".join(f"{best[k] * 1e6:.1f}" for k in ops)
                  + " |", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
