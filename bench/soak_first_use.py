"""Soak: many fresh MPI jobs whose first ccoll calls are iallreduce and allreduce at once.

Each run starts a new ``mpiexec -n RANKS`` job. In every rank the first ccoll call is
``ccoll.iallreduce`` (the progress engine's thread then calibrates ``policy="auto"`` on the
asynchronous channel) and, while it runs, ``ccoll.allreduce`` on the calling thread (which
calibrates the blocking channel at the same moment), both with the default policy and bound.
The calibration cache is off (``CCOLL_CALIBRATION=off``, the same on every rank), so every
job measures the link again instead of reading the previous job's numbers.

A run passes when it ends within ``--timeout`` seconds and both results are within the
bound on every element (decided exactly: ``fractions.Fraction`` of the float inputs) and
bitwise identical on every rank. A run that times out is a hang: its process group is
killed and counted.

    .venv/bin/python bench/soak_first_use.py --runs 200 --ranks 4 --json build/soak.json

Exit status 0 only when every run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N_ELEMS = 1 << 18  # 1 MiB of float32 per rank: large enough that auto calibrates


def _inputs(rank: int, salt: int, n: int):
    import numpy as np

    rng = np.random.default_rng([salt, rank, n])
    x = rng.standard_t(3, size=n) * 1e-2
    x[rng.random(n) < 0.2] = 0.0
    return x.astype(np.float32)


def _exact_violations(y, xs, rel: float) -> tuple[int, float]:
    """Elements of ``y`` farther than the bound from the exact sum of ``xs`` (exact check).

    The bound is ``rel * (max - min)`` of every rank's finite inputs, computed here in exact
    rational arithmetic, plus the one rounding of the result to its dtype that the contract
    allows (half a spacing of ``y``). A float64 pre-screen computes the same quantities
    with float64 rounding; elements within 1e-9 of the limit there are decided again with
    Fractions, so no float64 rounding decides a verdict. Returns (violations, worst err/eb).
    """
    import numpy as np

    stack = np.stack(xs).astype(np.float64)
    lo, hi = float(stack.min()), float(stack.max())
    eb = Fraction(rel) * (Fraction(hi) - Fraction(lo))
    ebf = float(eb)
    yd = y.astype(np.float64)
    total = np.sum(stack, axis=0)
    half = 0.5 * np.spacing(np.abs(y)).astype(np.float64)
    approx = np.abs(yd - total)
    suspect = np.flatnonzero(approx > (ebf + half) * (1 - 1e-9))
    bad = 0
    for i in suspect:
        s = sum((Fraction(float(v)) for v in stack[:, i]), Fraction(0))
        if abs(Fraction(float(yd[i])) - s) > eb + Fraction(float(half[i])):
            bad += 1
    worst = float(np.max(approx) / ebf) if ebf > 0 else 0.0
    return bad, worst


def child(salt: int, n: int) -> int:
    """One rank of one run: iallreduce and allreduce at once on first use, then check."""
    import numpy as np
    from mpi4py import MPI

    import ccoll

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x1 = _inputs(rank, 2 * salt, n)
    x2 = _inputs(rank, 2 * salt + 1, n)
    t0 = time.perf_counter()
    req = ccoll.iallreduce(x1)  # the engine's thread calibrates the async channel...
    y2 = ccoll.allreduce(x2)  # ...while this thread calibrates the blocking one
    y1 = req.wait()
    seconds = time.perf_counter() - t0

    # Buffer-based gathers only: the check must not add the pickle path it soaks.
    def gather(a):
        out = np.empty((size, a.size), dtype=a.dtype)
        comm.Allgather(a, out)
        return out

    ok = np.zeros(1, dtype=np.int32)
    report: dict[str, object] = {}
    g1, g2 = gather(x1), gather(x2)
    r1, r2 = gather(np.ascontiguousarray(y1)), gather(np.ascontiguousarray(y2))
    if rank == 0:
        same = all(np.array_equal(r[0].view(np.uint32), r[k].view(np.uint32))
                   for r in (r1, r2) for k in range(size))
        bad1, worst1 = _exact_violations(r1[0], list(g1), 1e-3)
        bad2, worst2 = _exact_violations(r2[0], list(g2), 1e-3)
        ok[0] = int(same and bad1 == 0 and bad2 == 0)
        from ccoll.collectives.registry import default_communicator

        cc = default_communicator(comm)
        report = {
            "same_on_all_ranks": same, "violations": bad1 + bad2,
            "worst_err_over_eb": max(worst1, worst2), "seconds": seconds,
            "compressed_calls": cc.stats.compressed_calls + cc.async_stats.compressed_calls,
        }
        print("SOAK " + json.dumps(report), flush=True)
    comm.Bcast(ok, root=0)
    return 0 if ok[0] else 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", type=int, default=200, help="fresh MPI jobs to start")
    ap.add_argument("--ranks", type=int, default=4, help="ranks per job")
    ap.add_argument("--timeout", type=float, default=180.0,
                    help="seconds a job may take before it counts as a hang")
    ap.add_argument("--elems", type=int, default=N_ELEMS, help="float32 elements per rank")
    ap.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(args.child, args.elems)

    from tqdm import tqdm

    bindir = Path(sys.executable).parent
    mpiexec = bindir / "mpiexec"
    env = dict(os.environ, CCOLL_CALIBRATION="off")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    counts = {"passed": 0, "failed": 0, "hung": 0}
    failures: list[dict[str, object]] = []
    seconds: list[float] = []
    compressed = 0  # runs in which auto compressed at least one of the two calls
    t_start = time.time()
    bar = tqdm(range(args.runs), desc=f"soak {args.ranks} ranks", unit="job")
    for i in bar:
        cmd = [str(mpiexec), "-n", str(args.ranks), sys.executable, "-m", "mpi4py",
               str(Path(__file__).resolve()), "--child", str(i), "--elems", str(args.elems)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            counts["hung"] += 1
            failures.append({"run": i, "kind": "hang", "tail": out[-2000:]})
        else:
            if proc.returncode == 0:
                counts["passed"] += 1
                for line in out.splitlines():
                    if line.startswith("SOAK "):
                        rep = json.loads(line[5:])
                        seconds.append(rep["seconds"])
                        compressed += rep["compressed_calls"] > 0
            else:
                counts["failed"] += 1
                failures.append({"run": i, "kind": f"exit {proc.returncode}",
                                 "tail": out[-2000:]})
        bar.set_postfix(counts, refresh=False)
    summary = {
        "runs": args.runs, "ranks": args.ranks, "elems": args.elems, **counts,
        "runs_that_compressed": compressed,
        "first_calls_seconds_max": max(seconds) if seconds else None,
        "wall_seconds": time.time() - t_start, "failures": failures[:10],
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0 if counts["passed"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
