"""``python -m ccoll.warmup``: compile ccoll's CPU kernels into numba's on-disk cache now.

numba compiles each kernel at its first call with new argument types (about 30 s for one
dtype on a small machine) and caches the result on disk, so later processes load it in
well under a second. ``make venv`` and ``make demo`` run this once after installing, so
that no training step, test or MPI rank waits for the compiler (four ranks that start
cold compile the same kernels side by side). A kernel compiled here or at any other first
call says so on stderr (:mod:`ccoll.compressor.cpu.notice`); with a warm cache the run is
silent and takes a second or two.

``--v2`` also compiles the kernels of stream format version 2 (``compress(...,
version=2)``, docs/format.md), which inline their block helpers and take about 130 s
more of CPU time for float32 and 65 s for float64 (bench/v2_compile.py); ``--jobs 2``
compiles the dtypes side by side in two processes (numba compiles on one core).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["main", "warm", "build_parser"]

DTYPES = ("float32", "float64")


def warm(dtype: str, versions: Sequence[int] = (1,)) -> float:
    """Run every CPU kernel of the stream ``versions`` once on a small array of ``dtype``.

    Also the wide decoder (:func:`ccoll.compressor.cpu.decompress_wide`, which the split
    allreduce's requantization runs on sums and on float64 streams, and an average's decode
    before its division, :func:`ccoll.collectives.requant.divide_into`) and the node
    sum of a two-level allreduce (:func:`ccoll.collectives.nodesum.sum_slots`, with the
    argument types the Communicator passes), which need no MPI to compile, and error
    feedback's residual (:func:`ccoll.compressor.cpu.residual_abs`).
    Returns the seconds taken.
    """
    from ccoll.collectives.nodesum import sum_slots
    from ccoll.collectives.requant import divide_into
    from ccoll.compressor import cpu
    from ccoll.compressor.cpu.slices import concat, raw_blocks, slice_blocks

    t0 = time.perf_counter()
    x = np.random.default_rng(0).standard_normal(4096).astype(dtype)
    lo, hi = cpu.finite_range(x)
    eb = 1e-3 * (hi - lo)
    for v in versions:
        a = cpu.compress_abs(x, eb, version=v)  # lossy
        cpu.decompress(a, out=np.empty_like(x))
        b = cpu.compress_abs(x[::-1].copy(), eb, version=v)
        cpu.decompress(cpu.add(a, b))
        if v == 1:  # the split allreduce's requantization (ccoll.collectives.requant)
            cpu.decompress_wide(cpu.add(a, b), out=np.empty(x.size))
        # The wide decode: the split's requantization, and an average's one rounding.
        w = cpu.decompress_wide(a, out=np.empty(x.size))
        divide_into(w, 3.0, np.empty_like(x))
        cpu.add_data(a, x)
        cpu.decompress(cpu.compress_abs(x, 0.0, version=v))  # lossless
        # Recursive halving's cut and join, and the split's raw blocks (format 2: kernels).
        nb = (x.size + 31) // 32
        concat([slice_blocks(a, 0, nb // 2), slice_blocks(a, nb // 2, nb)])
        raw_blocks(a, x, np.array([1]))
    cpu.residual_abs(x, eb, np.empty_like(x))  # error feedback's residual (the DDP hook)
    slots = np.stack([x, x[::-1], x])
    sum_slots(x, slots[:2], 0, 0, np.empty(x.size // 2, np.float64))
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
    ap.add_argument("--v2", action="store_true",
                    help="also compile the kernels of stream format version 2 "
                         "(compress(..., version=2)); minutes more")
    ap.add_argument("-j", "--jobs", type=int, default=1, metavar="N",
                    help="compile up to N dtypes side by side, each in its own process")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Warm the kernels of the given dtypes."""
    ap = build_parser()
    args = ap.parse_args(argv)
    for dt in args.dtypes:
        if dt not in DTYPES:
            ap.error(f"unknown dtype {dt!r}: ccoll's CPU kernels take {' or '.join(DTYPES)}")
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.jobs > 1 and len(args.dtypes) > 1:
        return _side_by_side(args.dtypes, args.v2, args.jobs)
    versions = (1, 2) if args.v2 else (1,)
    for dt in args.dtypes:
        s = warm(dt, versions)
        print(f"ccoll kernels for {dt}: ready ({s:.1f} s)", file=sys.stderr)
    return 0


def _side_by_side(dtypes: Sequence[str], v2: bool, jobs: int) -> int:
    """One ``python -m ccoll.warmup DTYPE`` process per dtype, ``jobs`` at a time.

    Then every dtype once more in this process. numba keeps one index file per kernel for
    all its compiled signatures and rewrites it (read, add, write) without a lock, so two
    processes that compile the same kernel for different dtypes at once can each drop the
    other's entry (seen: a kernel shared by both dtypes compiled again by the first test
    that used float64). The second pass loads what is there and compiles, once, what was
    dropped; with nothing dropped it takes a second or two.
    """
    # Importing the CPU package here first drops a stale cache and writes its stamp
    # (ccoll/compressor/cpu/_cachestamp.py) before the jobs start, so that no job drops
    # what another one has just compiled.
    import ccoll.compressor.cpu  # noqa: F401

    pending = list(dtypes)
    running: list[subprocess.Popen[bytes]] = []
    rc = 0
    while pending or running:
        while pending and len(running) < jobs:
            cmd = [sys.executable, "-m", "ccoll.warmup", pending.pop(0)] + (["--v2"] * v2)
            running.append(subprocess.Popen(cmd))
        p = running.pop(0)
        rc = max(rc, p.wait())
    if rc == 0:
        versions = (1, 2) if v2 else (1,)
        t0 = time.perf_counter()
        for dt in dtypes:
            warm(dt, versions)
        print(f"ccoll kernels for {', '.join(dtypes)}: checked in one process "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
