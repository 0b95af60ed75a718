"""What launching ccoll's CPU kernels costs on a tiny array, three ways, in one process.

Times ``compress``, ``decompress``, ``add_data`` and ``add`` of 256 float32 values (both
stream formats) with ccoll's launch set-up (``blocks._threads_for`` around
``cpu_threads.parallel_launch``) as it was and as it is:

- "public": numba's thread count read and set through numba's public
  ``get_num_threads``/``set_num_threads``, inside generator-based context managers
  (before 2026-12-06);
- "layer": through the threading layer's own functions (``cpu_threads.counts()``), still
  inside generators (59575c2);
- "class": the same calls in class-based context managers (ccoll's code now).

The variants alternate round by round; the least of ``--calls`` calls per round, the
median over ``--rounds``. Prints the speed index of the run (docs/performance.md,
"Measuring").

    python bench/launch_cost.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numba
import numpy as np

from ccoll.compressor.api import add, add_data, compress_abs, decompress
from ccoll.compressor.cpu import add as add_mod
from ccoll.compressor.cpu import blocks, decode, encode, notice, v2
from ccoll.runtime import cpu_threads
from ccoll.speedindex import describe, speed_index

_USERS = (add_mod, blocks, decode, encode, v2)  # modules that bound _threads_for


@contextmanager
def _generator_launch() -> Iterator[None]:
    """``cpu_threads.parallel_launch`` as a generator (before the class)."""
    safe = cpu_threads.prepare() in cpu_threads.SAFE_LAYERS
    n = cpu_threads._count
    prev = 0
    if n is not None:
        get, put = cpu_threads.counts()
        cur = get()
        if (cur == cpu_threads._pool or cpu_threads.current_lane() is not None) and n < cur:
            prev = cur
            put(n)
    try:
        if safe:
            yield
        else:
            with cpu_threads._serial:
                yield
    finally:
        if prev:
            cpu_threads.counts()[1](prev)


@contextmanager
def _generator_threads_for(n: int) -> Iterator[None]:
    """``blocks._threads_for`` as a generator (before the class)."""
    notice.watch()
    with _generator_launch():
        if n >= blocks.SERIAL_BELOW:
            yield
            return
        get, put = cpu_threads.counts()
        prev = get()
        if prev == 1:
            yield
            return
        put(1)
        try:
            yield
        finally:
            put(prev)


def _use(counts: tuple[Any, Any], threads_for: Any) -> None:
    cpu_threads._counts = counts
    for mod in _USERS:
        mod._threads_for = threads_for  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    x = (np.random.default_rng(0).laplace(size=256) * 1e-2).astype(np.float32)
    y = np.empty_like(x)
    layer = cpu_threads.counts()
    public = (numba.get_num_threads, numba.set_num_threads)
    classes = blocks._threads_for
    variants = {"public": (public, _generator_threads_for),
                "layer": (layer, _generator_threads_for),
                "class": (layer, classes)}
    ops = {}
    for v in (1, 2):
        s = compress_abs(x, 1e-4, version=v)
        ops[f"compress v{v}"] = lambda v=v: compress_abs(x, 1e-4, version=v)
        ops[f"decompress v{v}"] = lambda s=s: decompress(s, out=y)
        ops[f"add_data v{v}"] = lambda s=s: add_data(s, x)
        ops[f"add v{v}"] = lambda s=s: add(s, s)
    got: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for name, (counts, threads_for) in variants.items():
                _use(counts, threads_for)
                for k, f in ops.items():
                    f()
                    best = 1e9
                    for _ in range(args.calls):
                        t = time.perf_counter_ns()
                        f()
                        best = min(best, time.perf_counter_ns() - t)
                    got.setdefault((k, name), []).append(best / 1e3)
    finally:
        _use(layer, classes)
    print(f"# 256 float32 values, one process; {describe(speed_index())}")
    print("| kernel | public (us) | layer (us) | class (us) | class / public |")
    print("|---|---:|---:|---:|---:|")
    for k in ops:
        a, b, c = (statistics.median(got[(k, v)]) for v in variants)
        print(f"| {k} | {a:.1f} | {b:.1f} | {c:.1f} | {c / a:.2f} |")


if __name__ == "__main__":
    main()
