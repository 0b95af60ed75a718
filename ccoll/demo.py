"""``make demo``: allreduce real MiniLM gradients with ccoll and with plain MPI, side by side.

Run as ``mpiexec -n 4 python -m mpi4py -m ccoll.demo``. Rank ``r`` loads training step
``r mod nsteps`` of ``datasets/minilm.h5``, so the ranks hold different real gradients, as
data-parallel workers do. Every tensor is allreduced with ``ccoll.allreduce`` (``REL``
bound) and with ``MPI_Allreduce``; rank 0 prints, per tensor and in total, the bytes each
rank sent (ccoll: counted; MPI: what a bandwidth-optimal ring sends, ``2(N-1)/N`` of the
tensor), their ratio, whether ccoll compressed the tensor, the largest error over the
bound (against the exact float64 sum), the best time of each over ``--repeat`` runs, and
whether every rank got identical bytes.

The demo forces compression (``--policy compress``) to show what it does to real
gradients; ``--policy auto`` shows what ccoll's default chooses instead (on shared memory,
where MPI is fast, it sends most tensors raw).

On one machine the "network" is shared memory, so MPI's time is not what a cluster link
would give; the byte counts and the errors are what carries over (``ccoll bench`` and
``jobs/`` measure times on shaped links).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import ccoll
from ccoll.errors import InputError
from ccoll.units import format_iec

__all__ = ["main", "default_dataset"]


def default_dataset() -> Path:
    """``datasets/minilm.h5`` of the source tree (``CCOLL_DEMO_DATA`` overrides it)."""
    env = os.environ.get("CCOLL_DEMO_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "datasets" / "minilm.h5"


def _load(path: Path, rank: int, limit: int | None) -> tuple[str, list[tuple[str, np.ndarray]]]:
    import h5py

    if not path.is_file():
        raise InputError(
            f"gradient dump {path} not found; the demo needs datasets/minilm.h5 of the "
            "source tree (or set CCOLL_DEMO_DATA)"
        )
    with h5py.File(path, "r") as f:
        steps = sorted(k for k in f if k.startswith("step_"))
        if not steps:
            raise InputError(f"{path} holds no step_XXXX groups")
        step = steps[rank % len(steps)]
        grads: list[tuple[str, np.ndarray]] = []

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                grads.append((name, np.asarray(obj[()], dtype=np.float32)))

        f[step].visititems(visit)
    return step, grads[:limit] if limit else grads


def _best_time(comm: MPI.Intracomm, fn: Any, repeat: int) -> tuple[float, Any]:
    """Return the best of ``repeat`` runs of ``fn`` (the slowest rank's time) and its result."""
    best = float("inf")
    out = None
    for _ in range(repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        best = min(best, dt)
    return best, out


def main(argv: Sequence[str] | None = None, comm: MPI.Intracomm | None = None) -> int:
    """Run the demo on ``comm`` (default ``MPI.COMM_WORLD``); rank 0 prints the table."""
    ap = argparse.ArgumentParser(prog="python -m mpi4py -m ccoll.demo", description=__doc__)
    ap.add_argument("--data", type=Path, default=None, help="HDF5 gradient dump")
    ap.add_argument("--rel", type=float, default=1e-3, help="REL error bound (default 1e-3)")
    ap.add_argument("--algorithm", choices=("homomorphic", "dar"), default="homomorphic")
    ap.add_argument("--policy", choices=("compress", "auto", "raw"), default="compress",
                    help="ccoll's policy (default compress; auto: ccoll's own default)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per tensor (best kept)")
    ap.add_argument("--max-tensors", type=int, default=None, help="only the first N tensors")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    step, grads = _load(args.data or default_dataset(), rank, args.max_tensors)
    steps = comm.gather(step) or []
    eb = ccoll.REL(args.rel)
    rows = []
    with ccoll.Communicator(comm, algorithm=args.algorithm, policy=args.policy) as cc:
        # Warm-up: numba compiles (or loads from its cache) the kernels once.
        cc.allreduce(grads[0][1], eb=eb)
        for name, x in grads:
            y_mpi = np.empty_like(x)
            t_mpi, _ = _best_time(comm, lambda x=x, y=y_mpi: comm.Allreduce(x, y, op=MPI.SUM),
                                  args.repeat)
            sent: list[float] = []
            modes: list[bool] = []

            def run(x: np.ndarray = x, sent: list[float] = sent,
                    modes: list[bool] = modes) -> np.ndarray:
                before = cc.stats.compressed_calls
                y = cc.allreduce(x, eb=eb)
                sent.append(cc.stats.last["bytes_sent"])
                modes.append(cc.stats.compressed_calls > before)
                return y

            t_cc, y = _best_time(comm, run, args.repeat)
            exact = np.empty(x.shape, dtype=np.float64)
            comm.Allreduce(x.astype(np.float64), exact, op=MPI.SUM)
            lo = comm.allreduce(float(x.min()), op=MPI.MIN)
            hi = comm.allreduce(float(x.max()), op=MPI.MAX)
            eb_abs = eb.resolve(lo, hi)
            err = float(np.max(np.abs(y.astype(np.float64) - exact))) if x.size else 0.0
            err = comm.allreduce(err, op=MPI.MAX)
            digest = hashlib.sha256(y.tobytes()).hexdigest()
            same = len(set(comm.allgather(digest))) == 1
            cc_bytes = comm.allreduce(sent[-1], op=MPI.SUM) / size
            mpi_bytes = 2 * (size - 1) * x.nbytes / size
            rows.append((name, x.size, mpi_bytes, cc_bytes, modes[-1], err, eb_abs, t_mpi, t_cc,
                         same))
    if rank == 0:
        _print_table(rows, size, steps, args)
    return 0


def _print_table(rows: list[tuple], size: int, steps: list[str], args: argparse.Namespace) -> None:
    print(
        f"ccoll demo: allreduce of real MiniLM gradients, {size} ranks "
        f"(rank r holds {', '.join(f'{r}:{s}' for r, s in enumerate(steps))}), "
        f"REL {args.rel:g}, algorithm {args.algorithm}, policy {args.policy}, "
        f"best of {args.repeat}"
    )
    head = (
        f"{'tensor':<48} {'elements':>9} {'MPI sent':>10} {'ccoll sent':>10} {'ratio':>7} "
        f"{'comp':>5} {'err/eb':>7} {'MPI ms':>8} {'ccoll ms':>8} {'same':>5}"
    )
    print(head)
    print("-" * len(head))
    tot = [0, 0.0, 0.0, 0.0, 0.0]
    worst = 0.0
    all_same = True
    n_comp = 0
    for name, n, mb, cb, comp, err, eb_abs, tm, tc, same in rows:
        rel = err / eb_abs if eb_abs > 0 else (0.0 if err == 0 else float("inf"))
        worst = max(worst, rel)
        all_same &= same
        short = name if len(name) <= 48 else "..." + name[-45:]
        print(
            f"{short:<48} {n:>9} {format_iec(mb):>10} {format_iec(cb):>10} "
            f"{mb / cb if cb else float('inf'):>6.1f}x {'yes' if comp else 'raw':>5} "
            f"{rel:>7.3f} {tm * 1e3:>8.2f} "
            f"{tc * 1e3:>8.2f} {'yes' if same else 'NO':>5}"
        )
        tot[0] += n
        tot[1] += mb
        tot[2] += cb
        tot[3] += tm
        tot[4] += tc
        n_comp += comp
    print("-" * len(head))
    print(
        f"{'total (' + str(len(rows)) + ' tensors)':<48} {tot[0]:>9} {format_iec(tot[1]):>10} "
        f"{format_iec(tot[2]):>10} {tot[1] / tot[2] if tot[2] else float('inf'):>6.1f}x "
        f"{f'{n_comp}/{len(rows)}':>5} {worst:>7.3f} {tot[3] * 1e3:>8.2f} {tot[4] * 1e3:>8.2f} "
        f"{'yes' if all_same else 'NO':>5}"
    )
    print(
        "bytes: per rank; MPI = 2(N-1)/N of the tensor (ring allreduce), ccoll = counted. "
        "comp: ccoll compressed (raw: plain MPI). "
        "err/eb: max |ccoll - exact float64 sum| / bound. same: identical bytes on all ranks."
    )


if __name__ == "__main__":
    raise SystemExit(main())
