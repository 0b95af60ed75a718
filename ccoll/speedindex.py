"""The session's speed index: SZ3's compress throughput on the MiniLM dump, and the CPU.

Machines of one kind differ several times in CPU speed from day to day, while an emulated
link keeps its rate, so a speed figure means little without the speed of the machine it
came from. ccoll's benchmarks print this index beside their results (DESIGN.md,
"Measuring"): SZ3's compress throughput (``pysz``, one thread, ABS mode at the bound that
``REL(1e-3)`` resolves to) on every tensor of the bundled MiniLM dump concatenated, and the
CPU as llvm names it (``znver3`` has no AVX-512, ``znver4`` has)::

    python -m ccoll.speedindex            # prints one line
    python -m ccoll.speedindex --json     # the same as JSON
    python -m ccoll.speedindex --data F   # on another dump (the line names it)

A ``--data`` file that is missing, not HDF5 or without float32 values is an error (one
line, exit status 2).

``pysz`` is a benchmark extra (``pip install pysz``); without it the throughput is
``None`` and the line says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DEFAULT_DATA", "load_dump", "speed_index", "speed_index_on_rank0", "describe"]

DEFAULT_DATA = str(Path(__file__).resolve().parent.parent / "datasets" / "minilm.h5")


def load_dump(path: str) -> np.ndarray:
    """Return every float32 dataset of an HDF5 gradient dump, in name order, concatenated.

    Raises ``FileNotFoundError`` for a missing file and :class:`~ccoll.errors.InputError`
    for one that is not HDF5 or holds no float32 value.
    """
    import h5py

    from ccoll.errors import InputError
    from ccoll.h5.output import check_input

    check_input(path)
    parts: list[np.ndarray] = []

    def take(_name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and obj.dtype == np.float32:
            parts.append(np.asarray(obj[()], dtype=np.float32).ravel())

    with h5py.File(path, "r") as f:
        f.visititems(take)
    if not parts:
        raise InputError(f"{path}: no float32 datasets")
    x = np.concatenate(parts)
    if x.size == 0:
        raise InputError(f"{path}: no float32 values (only zero-element datasets)")
    return x


def cpu_name() -> str:
    """Return the host CPU as llvm names it (the instruction set numba compiles for)."""
    import llvmlite.binding as llvm

    return str(llvm.get_host_cpu_name())


def speed_index(path: str = DEFAULT_DATA, rel: float = 1e-3, repeats: int = 3) -> dict[str, Any]:
    """Measure SZ3's compress throughput on ``path`` (best of ``repeats``), with the CPU.

    Returns ``{"cpu", "sz3_compress_gbps", "data", "elements", "rel"}``; the throughput
    is input bytes per second in 10^9 (``None`` without ``pysz`` or the data file).
    """
    out: dict[str, Any] = {"cpu": cpu_name(), "sz3_compress_gbps": None, "data": path,
                           "elements": 0, "rel": rel}
    try:
        import pysz
    except ImportError:
        out["why"] = "pysz is not installed (pip install pysz)"
        return out
    if not Path(path).is_file():
        out["why"] = f"{path}: no such file"
        return out
    x = load_dump(path)
    fin = x[np.isfinite(x)]
    eb = rel * float(fin.max() - fin.min()) if fin.size else rel
    cfg = pysz.szConfig()
    cfg.errorBoundMode = pysz.szErrorBoundMode.ABS
    cfg.absErrorBound = eb
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        pysz.sz.compress(x, cfg)
        best = min(best, time.perf_counter() - t0)
    out["elements"] = int(x.size)
    out["sz3_compress_gbps"] = x.nbytes / best / 1e9
    return out


def speed_index_on_rank0(comm: Any, path: str = DEFAULT_DATA) -> dict[str, Any] | None:
    """Measure :func:`speed_index` on rank 0 of ``comm`` while the other ranks sleep.

    Collective. The others wait in an ``MPI_Ibarrier`` tested with sleeps: MPI's blocking
    waits (a barrier, ``MPI_Finalize``) spin, and ranks that share rank 0's cores would
    lower the index (seen: 117-156 MB/s where a quiet machine gave 300). Returns the index
    on rank 0, ``None`` elsewhere.
    """
    index = speed_index(path) if comm.Get_rank() == 0 else None
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)
    return index


def describe(index: dict[str, Any]) -> str:
    """Return one line for a benchmark's header."""
    gbps = index.get("sz3_compress_gbps")
    speed = (f"SZ3 compress {gbps * 1e3:.0f} MB/s" if gbps is not None
             else f"SZ3 compress not measured ({index.get('why', '')})")
    data = index.get("data", DEFAULT_DATA)
    same = Path(data).resolve() == Path(DEFAULT_DATA).resolve()
    return (f"speed index: {speed} (one thread, {'MiniLM dump' if same else data}, "
            f"REL {index['rel']:g}), cpu {index['cpu']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ccoll.speedindex",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=DEFAULT_DATA, help="HDF5 gradient dump (default: "
                    "the bundled datasets/minilm.h5)")
    ap.add_argument("--json", action="store_true", help="print the index as JSON")
    args = ap.parse_args(argv)
    from ccoll.errors import InputError

    try:
        if not Path(args.data).is_file():  # the library says "not measured"; asked: an error
            raise InputError(f"--data {args.data}: no such file")
        index = speed_index(args.data)
    except (InputError, FileNotFoundError) as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(index) if args.json else describe(index))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
