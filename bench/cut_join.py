"""Cut and join of compressed streams (what recursive halving does to them), formats 1 and 2.

One numba thread, thread CPU time, best of ``--repeat`` rounds, each round timing every
operation once (interleaved): MiniLM gradients (the bundled dump's concatenation, tiled to
``--mib`` MiB of float32) compressed at ``--rel`` of their range; ``cut``: the stream's
two halves by blocks (``slice_blocks``, twice), ``join``: the halves joined again
(``concat``), ``compress``: the stream itself, for scale. Milliseconds per operation,
and the joined stream is checked to be the compressed one, byte for byte.

    python bench/cut_join.py                  # 16 MiB, REL 1e-3
    python bench/cut_join.py --rel 1e-2 --mib 64

docs/performance.md ("Recursive halving in format 2") quotes its output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=16.0, help="MiB of float32 (tiled)")
    ap.add_argument("--rel", type=float, default=1e-3, help="bound, relative to the range")
    ap.add_argument("--repeat", type=int, default=7, help="rounds (the best counts)")
    args = ap.parse_args(argv)

    import numba
    from compressor import DEFAULT_FILES, load_concat

    import ccoll
    from ccoll.compressor.cpu.slices import concat, slice_blocks
    from ccoll.compressor.format import parse_header
    from ccoll.speedindex import describe, speed_index

    numba.set_num_threads(1)
    base = load_concat(DEFAULT_FILES[0])
    n = int(args.mib * (1 << 20)) // 4
    x = np.resize(base, n).astype(np.float32)
    eb = args.rel * (float(x.max()) - float(x.min()))
    streams = {v: ccoll.compress(x, ccoll.ABS(eb), version=v) for v in (1, 2)}
    print(f"# {describe(speed_index())}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {x.nbytes / 2**20:.0f} MiB, "
          f"REL {args.rel:g}; one numba thread, thread CPU time, best of {args.repeat}; ms")
    print("| format | ratio | compress | cut (two halves) | join |")
    print("|---:|---:|---:|---:|---:|")
    for v, s in streams.items():
        nb = parse_header(s).nblocks
        half = nb // 2
        ops = {
            "compress": lambda v=v: ccoll.compress(x, ccoll.ABS(eb), version=v),
            "cut": lambda s=s, h=half, e=nb: (slice_blocks(s, 0, h), slice_blocks(s, h, e)),
            "join": None,
        }
        a, b = slice_blocks(s, 0, half), slice_blocks(s, half, nb)
        joined = concat([a, b])
        assert joined.tobytes() == s.tobytes(), f"format {v}: the joined halves differ"
        ops["join"] = lambda a=a, b=b: concat([a, b])
        best = {k: float("inf") for k in ops}
        for _ in range(args.repeat):
            for k, f in ops.items():
                t0 = time.thread_time()
                f()
                best[k] = min(best[k], time.thread_time() - t0)
        print(f"| {v} | {x.nbytes / s.nbytes:.2f} | {best['compress'] * 1e3:.2f} | "
              f"{best['cut'] * 1e3:.2f} | {best['join'] * 1e3:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
