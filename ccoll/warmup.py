"""``python -m ccoll.warmup``: compile ccoll's CPU kernels into numba's on-disk cache now.

numba compiles each kernel at its first call with new argument types (about 30 s for one
dtype on a small machine) and caches the result on disk, so later processes load it in
well under a second. ``make venv`` and ``make demo`` run this once after installing, so
that no training step, test or MPI rank waits for the compiler (four ranks that start
cold compile the same kernels side by side). A kernel compiled here or at any other first
call says so on stderr (:mod:`ccoll.compressor.cpu.notice`); with a warm cache the run is
silent and takes a second or two.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["main", "warm", "build_parser"]

DTYPES = ("float32", "float64")


def warm(dtype: str) -> float:
    """Run every CPU kernel once on a small array of ``dtype``; return the seconds taken."""
    from ccoll.compressor import cpu

    t0 = time.perf_counter()
    x = np.random.default_rng(0).standard_normal(4096).astype(dtype)
    lo, hi = cpu.finite_range(x)
    eb = 1e-3 * (hi - lo)
    a = cpu.compress_abs(x, eb)  # lossy
    cpu.decompress(a, out=np.empty_like(x))
    b = cpu.compress_abs(x[::-1].copy(), eb)
    cpu.decompress(cpu.add(a, b))
    cpu.add_data(a, x)
    cpu.decompress(cpu.compress_abs(x, 0.0))  # lossless
    return time.perf_counter() - t0


def build_parser() -> argparse.ArgumentParser:
    """Options of ``python -m ccoll.warmup``."""
    from ccoll.helpformat import DefaultsFormatter

    ap = argparse.ArgumentParser(
        prog="python -m ccoll.warmup", description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsFormatter,
    )
    ap.add_argument("dtypes", nargs="*", default=list(DTYPES), metavar="DTYPE",
                    help=f"dtypes whose kernels to compile, of {', '.join(DTYPES)}")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Warm the kernels of the given dtypes."""
    ap = build_parser()
    args = ap.parse_args(argv)
    for dt in args.dtypes:
        if dt not in DTYPES:
            ap.error(f"unknown dtype {dt!r}: ccoll's CPU kernels take {' or '.join(DTYPES)}")
    for dt in args.dtypes:
        s = warm(dt)
        print(f"ccoll kernels for {dt}: ready ({s:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
