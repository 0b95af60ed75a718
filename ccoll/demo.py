"""``make demo``: allreduce real MiniLM gradients with ccoll and with plain MPI, side by side.

``python -m ccoll.demo`` starts 4 ranks. As root, where network namespaces work, they run on
an emulated cluster: each rank in its own namespace behind a 1 Gbit/s link shaped with
``tc`` (``jobs/emulated_cluster.py``), MPICH over TCP, so that MPI pays for every byte it
sends as it would between nodes. Elsewhere (not root, no ``ip netns``, or ``--network
shm``) they run on shared memory, where MPI moves data at memory speed: compressing cannot
pay there, and the demo says so before its table.

Rank ``r`` loads training step ``r mod nsteps`` of ``datasets/minilm.h5``, so the ranks hold
different real gradients, as data-parallel workers do. Every tensor of that step is
allreduced with ``ccoll.allreduce`` (``REL`` bound, ccoll's default ``policy="auto"``:
compress only where the cost model predicts a gain) and with ``MPI_Allreduce``. Then one
bucket, the way PyTorch DDP concatenates gradients into buckets of up to 25 MiB before it
allreduces them: the dump holds a 4 MiB subset of the model's 87 MiB of gradients per step,
so the bucket joins the tensors of the dump's steps (the rank's own first) until it holds
``--bucket-mib``: real values in a message of the size DDP sends. Rank 0 prints, per
tensor, for the sum of those calls and for the bucket: the best time of each over
``--repeat`` runs, the speed-up, the bytes each rank sent (ccoll: counted; MPI: what a
bandwidth-optimal ring sends, ``2(N-1)/N`` of the tensor), whether ccoll compressed, the
largest error over the bound (against the exact float64 sum) and whether every rank got
identical bytes; then one line on what the numbers mean.

Under ``mpiexec`` (``mpiexec -n 4 python -m mpi4py -m ccoll.demo``) the ranks run on
whatever network that launch gives them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["main", "default_dataset", "choose_network"]

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "jobs" / "emulated_cluster.py"
# Environment of an MPI launcher's ranks (MPICH/Hydra, Open MPI, PMIx, Slurm's PMI2).
_RANK_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
SHM_NOTE = (
    "network: shared memory. MPI moves data between ranks of one machine at memory speed, "
    "faster than any compressor can shrink it, so compression cannot pay here: ccoll's "
    "policy \"auto\" sends nearly everything raw and its time is MPI's plus the cost of "
    "deciding. Expect no speed-up below; the bytes and the errors are what carries over to "
    "a real network. To see the speed-up, run `make demo` as root (4 ranks on an emulated "
    "1 Gbit/s network) or `make bench-cluster` (root)."
)


def default_dataset() -> Path:
    """``datasets/minilm.h5`` of the source tree (``CCOLL_DEMO_DATA`` overrides it)."""
    env = os.environ.get("CCOLL_DEMO_DATA")
    if env:
        return Path(env)
    return REPO / "datasets" / "minilm.h5"


# ------------------------------------------------------------------------------ launcher


def choose_network(wanted: str) -> tuple[str, str]:
    """``("emulated" | "shm", reason)`` for ``--network wanted`` on this machine."""
    if wanted == "shm":
        return "shm", "--network shm"
    why = None
    if os.geteuid() != 0:
        why = "not root (network namespaces and tc need root)"
    elif not CLUSTER.is_file():
        why = f"{CLUSTER} not found (the emulated cluster needs the source tree)"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        why = "`ip` or `tc` (iproute2) not installed"
    else:
        p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        if p.returncode != 0:
            why = f"`ip netns` does not work here ({p.stderr.strip() or p.returncode})"
    if why is None:
        return "emulated", "root and `ip netns` available"
    if wanted == "emulated":
        raise SystemExit(f"ccoll.demo: --network emulated is impossible here: {why}")
    return "shm", why


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if not found:
        raise SystemExit("ccoll.demo: mpiexec not found: run `make venv` (it installs MPICH)")
    return found


def launch(args: argparse.Namespace, rank_args: list[str]) -> int:
    """Start the ranks on the chosen network; return their exit code."""
    network, why = choose_network(args.network)
    prog = [sys.executable, "-m", "mpi4py", "-m", "ccoll.demo", "--rank", *rank_args]
    if network == "emulated":
        print(f"ccoll demo: {args.ranks} ranks on an emulated {args.rate} network "
              f"({why}); setting it up takes a few seconds", flush=True)
        cmd = [sys.executable, str(CLUSTER), "--ranks", str(args.ranks), "--rate", args.rate,
               "--timeout", str(args.timeout), "--", *prog]
        rc = subprocess.call(cmd)
        if rc == 0:
            return 0
        print(f"ccoll demo: the emulated cluster failed (exit {rc}); running on shared "
              "memory instead", flush=True)
        why = "the emulated cluster failed"
    print(f"ccoll demo: {args.ranks} ranks on shared memory ({why})", flush=True)
    cmd = ["timeout", str(args.timeout), _mpiexec(), "-n", str(args.ranks), *prog]
    return subprocess.call(cmd)


# --------------------------------------------------------------------------------- ranks


class Row(NamedTuple):
    name: str
    n: int
    mpi_bytes: float
    cc_bytes: float
    compressed: bool
    err_over_eb: float
    t_mpi: float
    t_cc: float
    same: bool


def _load(path: Path, rank: int, limit: int | None,
          ) -> tuple[list[str], list[list[tuple[str, np.ndarray]]]]:
    """Every step of the dump, starting at step ``rank mod nsteps``: (names, tensors)."""
    import h5py

    from ccoll.errors import InputError

    if not path.is_file():
        raise InputError(
            f"gradient dump {path} not found; the demo needs datasets/minilm.h5 of the "
            "source tree (or set CCOLL_DEMO_DATA)"
        )
    with h5py.File(path, "r") as f:
        steps = sorted(k for k in f if k.startswith("step_"))
        if not steps:
            raise InputError(f"{path} holds no step_XXXX groups")
        order = [steps[(rank + i) % len(steps)] for i in range(len(steps))]
        out: list[list[tuple[str, np.ndarray]]] = []
        for step in order:
            grads: list[tuple[str, np.ndarray]] = []

            def visit(name: str, obj: Any, grads: list[tuple[str, np.ndarray]] = grads) -> None:
                if isinstance(obj, h5py.Dataset):
                    grads.append((name, np.asarray(obj[()], dtype=np.float32)))

            f[step].visititems(visit)
            out.append(grads[:limit] if limit else grads)
    return order, out


def _best_time(comm: Any, fn: Any, repeat: int) -> tuple[float, Any]:
    """Return the best of ``repeat`` runs of ``fn`` (the slowest rank's time) and its result."""
    from mpi4py import MPI

    best = float("inf")
    out = None
    for _ in range(repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        best = min(best, dt)
    return best, out


def run_ranks(args: argparse.Namespace) -> int:
    """Run the ranks' part: every rank allreduces; rank 0 prints the table."""
    from mpi4py import MPI

    import ccoll

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rate = os.environ.get("CCOLL_CLUSTER_RATE_BPS")
    if rank == 0:
        print(f"network: emulated, {float(rate) / 1e9:g} Gbit/s per rank and direction "
              "(tc tbf), MPICH over TCP" if rate else SHM_NOTE, flush=True)
    order, per_step = _load(args.data or default_dataset(), rank, args.max_tensors)
    steps = comm.gather(order[0]) or []
    grads = per_step[0]
    # A DDP bucket: the tensors of this rank's step, then those of the dump's next steps
    # until the bucket holds --bucket-mib (or the whole dump).
    parts: list[np.ndarray] = []
    nbytes = 0
    for g in per_step:
        if parts and nbytes >= args.bucket_mib * 2**20:
            break
        parts += [x.ravel() for _, x in g]
        nbytes += sum(x.nbytes for _, x in g)
    bucket = np.concatenate(parts)
    nsteps = len(parts) // max(1, len(grads))
    label = (f"DDP bucket: the {len(grads)} tensors" if nsteps == 1
             else f"DDP bucket: {len(grads)} tensors x {nsteps} steps")
    items = [*grads, (label, bucket)]
    eb = ccoll.REL(args.rel)
    rows: list[Row] = []
    with ccoll.Communicator(comm, algorithm=args.algorithm, policy=args.policy) as cc:
        # Warm-up: numba loads the kernels, and each signature's first runs are not timed.
        for _, x in items:
            cc.allreduce(x, eb=eb)
        for name, x in items:
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
            rel = err / eb_abs if eb_abs > 0 else (0.0 if err == 0 else float("inf"))
            digest = hashlib.sha256(y.tobytes()).hexdigest()
            same = len(set(comm.allgather(digest))) == 1
            cc_bytes = comm.allreduce(sent[-1], op=MPI.SUM) / size
            mpi_bytes = 2 * (size - 1) * x.nbytes / size
            rows.append(Row(name, x.size, mpi_bytes, cc_bytes, modes[-1], rel, t_mpi, t_cc,
                            same))
    if rank == 0:
        print_table(rows, size, steps, args, emulated=bool(rate))
    return 0


def _speedup(t_mpi: float, t_cc: float) -> str:
    return f"{t_mpi / t_cc:.2f}x" if t_cc > 0 else "-"


def print_table(rows: list[Row], size: int, steps: list[str], args: argparse.Namespace,
                *, emulated: bool) -> None:
    """Rank 0's table: one row per tensor, the total of those calls, and the bucket."""
    from ccoll.units import format_iec

    print(
        f"ccoll demo: allreduce of real MiniLM gradients, {size} ranks "
        f"(rank r holds {', '.join(f'{r}:{s}' for r, s in enumerate(steps))}), "
        f"REL {args.rel:g}, policy {args.policy}"
        f"{' (ccoll default)' if args.policy == 'auto' else ''}, algorithm {args.algorithm}, "
        f"best of {args.repeat}"
    )
    head = (
        f"{'tensor':<44} {'elements':>9} {'MPI ms':>8} {'ccoll ms':>8} {'speed-up':>8} "
        f"{'MPI sent':>9} {'ccoll sent':>10} {'sent as':>10} {'err/eb':>6} {'same':>4}"
    )

    def line(name: str, n: int, tm: float, tc: float, mb: float, cb: float, how: str,
             rel: float, same: bool) -> str:
        short = name if len(name) <= 44 else "..." + name[-41:]
        return (
            f"{short:<44} {n:>9} {tm * 1e3:>8.2f} {tc * 1e3:>8.2f} {_speedup(tm, tc):>8} "
            f"{format_iec(mb):>9} {format_iec(cb):>10} {how:>10} {rel:>6.3f} "
            f"{'yes' if same else 'NO':>4}"
        )

    def how(r: Row) -> str:
        return f"comp {r.mpi_bytes / r.cc_bytes:.0f}:1" if r.compressed and r.cc_bytes else "raw"

    tensors, bucket = rows[:-1], rows[-1]
    step_elems = sum(r.n for r in tensors)
    joined = round(bucket.n / step_elems) if step_elems else 1
    why = (f"; one step of this dump holds {format_iec(step_elems * 4)}, so the bucket joins "
           f"{joined} steps: real values at DDP's message size" if joined > 1 else "")
    print(
        f"rows: each tensor of rank r's step alone; the total of those calls; one bucket of "
        f"{format_iec(bucket.n * 4)} per rank, as DDP allreduces a step's gradients (in "
        f"buckets of up to 25 MiB{why})"
    )
    print(head)
    print("-" * len(head))
    for r in tensors:
        print(line(r.name, r.n, r.t_mpi, r.t_cc, r.mpi_bytes, r.cc_bytes, how(r),
                   r.err_over_eb, r.same))
    print("-" * len(head))
    tm = sum(r.t_mpi for r in tensors)
    tc = sum(r.t_cc for r in tensors)
    ncomp = sum(r.compressed for r in tensors)
    print(line(f"total of the {len(tensors)} calls above", sum(r.n for r in tensors), tm, tc,
               sum(r.mpi_bytes for r in tensors), sum(r.cc_bytes for r in tensors),
               f"{ncomp}/{len(tensors)} comp", max(r.err_over_eb for r in tensors),
               all(r.same for r in tensors)))
    print(line(bucket.name, bucket.n, bucket.t_mpi, bucket.t_cc, bucket.mpi_bytes,
               bucket.cc_bytes, how(bucket), bucket.err_over_eb, bucket.same))
    print(
        "columns: best time of each over the runs (slowest rank); bytes each rank sent "
        "(MPI: 2(N-1)/N of the tensor, a ring's share; ccoll: counted); sent as: compressed "
        "(ratio) or raw through plain MPI; err/eb: max |ccoll - exact float64 sum| / bound "
        "(<= 1 holds the bound); same: identical bytes on every rank."
    )
    worst = max(r.err_over_eb for r in rows)
    ok = all(r.same for r in rows) and worst <= 1.0
    guarantee = ("every result within the bound and identical on every rank"
                 if ok else "SOME RESULT BROKE THE BOUND OR DIFFERS BETWEEN RANKS")
    b = bucket
    if emulated:
        meaning = (
            f"what it means: on this link ccoll allreduced the DDP-sized bucket "
            f"{_speedup(b.t_mpi, b.t_cc)} as fast as MPI ({b.t_cc * 1e3:.1f} against "
            f"{b.t_mpi * 1e3:.1f} ms), sending {format_iec(b.cc_bytes)} instead of "
            f"{format_iec(b.mpi_bytes)} per rank; one call per tensor ran at "
            f"{_speedup(tm, tc)} ({tc * 1e3:.1f} against {tm * 1e3:.1f} ms): ccoll sends small "
            "tensors raw, where compressing costs more than it saves, and each of its calls "
            "first agrees with the other ranks (one more small collective), so allreduce "
            f"gradients in buckets, as DDP does; {guarantee}."
        )
    else:
        meaning = (
            f"what it means: on shared memory there is nothing to gain (MPI {tm * 1e3:.1f} ms, "
            f"ccoll {tc * 1e3:.1f} ms for the tensors one by one; a raw call costs ccoll's "
            f"decision on top of MPI); {guarantee}. The speed-up needs a network slower than "
            "the compressor: run as root, or `make bench-cluster`."
        )
    print(meaning, flush=True)


# ---------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """Options of ``python -m ccoll.demo``."""
    from ccoll.helpformat import DefaultsFormatter

    ap = argparse.ArgumentParser(
        prog="python -m ccoll.demo", description=__doc__,
        formatter_class=DefaultsFormatter,
    )
    ap.add_argument("--network", choices=("auto", "emulated", "shm"), default="auto",
                    help="where the ranks run: auto = an emulated cluster where root and "
                    "`ip netns` allow it, else shared memory (default: auto)")
    ap.add_argument("--ranks", type=int, default=4, help="number of ranks (default: 4)")
    ap.add_argument("--rate", default="1gbit",
                    help="link rate of the emulated cluster (default: 1gbit)")
    ap.add_argument("--timeout", type=int, default=900,
                    help="stop the ranks after this many seconds, >= 1 (default: 900)")
    ap.add_argument("--data", type=Path, default=None,
                    help="HDF5 gradient dump (default: datasets/minilm.h5, or $CCOLL_DEMO_DATA)")
    ap.add_argument("--rel", type=float, default=1e-3,
                    help="REL error bound, finite and > 0 (default: 0.001)")
    ap.add_argument("--algorithm", choices=("homomorphic", "dar"), default="homomorphic",
                    help="ccoll's ring algorithm when it compresses (default: homomorphic)")
    ap.add_argument("--policy", choices=("auto", "compress", "raw"), default="auto",
                    help="ccoll's policy: auto = compress where the cost model predicts a "
                    "gain, compress = always (default: auto)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="timed runs per tensor, the best kept; >= 1 (default: 5)")
    ap.add_argument("--max-tensors", type=int, default=None,
                    help="only the first N tensors of the dump (default: all)")
    ap.add_argument("--bucket-mib", type=float, default=16,
                    help="size of the bucket row: the tensors of the rank's step, then those "
                    "of the dump's next steps until the bucket holds this many MiB; "
                    "finite and >= 0 (default: 16)")
    ap.add_argument("--rank", action="store_true",
                    help="run as one of the ranks (set by the launcher; implied when an MPI "
                    "launcher started this process)")
    return ap


_LAUNCH_ONLY = ("--network", "--ranks", "--rate", "--timeout")


def _rank_args(argv: Sequence[str]) -> list[str]:
    """Return the options the ranks need: ``argv`` without the launcher's own."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        key = a.split("=", 1)[0]
        if key in _LAUNCH_ONLY:
            if "=" not in a:
                next(it, None)
            continue
        if a != "--rank":
            out.append(a)
    return out


def check_options(args: argparse.Namespace) -> str | None:
    """Return what is wrong with the options (``None``: nothing), before anything starts.

    The launcher and every rank check the same options, so a bad one stops the demo with
    one usage error (exit 2) instead of a traceback on every rank, or a rank command that
    ``timeout`` or MPI refuses.
    """
    import math

    from ccoll.errorbound import REL
    from ccoll.errors import CCollError
    from ccoll.h5.output import check_input
    from ccoll.units import parse_rate

    for opt, v, low in (("--ranks", args.ranks, 1), ("--timeout", args.timeout, 1),
                        ("--repeat", args.repeat, 1), ("--max-tensors", args.max_tensors, 1)):
        if v is not None and v < low:
            return f"{opt} must be >= {low}, got {v}"
    if not math.isfinite(args.bucket_mib) or args.bucket_mib < 0:
        return f"--bucket-mib must be a finite number >= 0, got {args.bucket_mib}"
    try:
        REL(args.rel)
    except CCollError as exc:
        return f"--rel: {exc}"
    try:
        parse_rate(args.rate, what="rate")  # refuses rates <= 0 too
    except CCollError as exc:
        return f"--rate: {exc}"
    data = args.data or default_dataset()
    try:
        check_input(str(data))
    except (OSError, CCollError) as exc:
        return f"--data: {exc}" + (
            "; the demo needs datasets/minilm.h5 of the source tree (or set CCOLL_DEMO_DATA)"
            if args.data is None else "")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Launch the demo, or run as one of its ranks under an MPI launcher."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    why = check_options(args)
    if why is not None:
        ap.error(why)  # exit 2, as argparse's own usage errors
    if args.rank or any(k in os.environ for k in _RANK_ENV):
        return run_ranks(args)
    return launch(args, _rank_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
