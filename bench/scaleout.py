"""Scale out: wire ratio of the compressed allreduce as ranks grow, op="avg" and op="sum".

Wire ratio = bytes of a raw ring allreduce (``2 (N - 1) / N`` times the array, per rank)
over the bytes ccoll sent (``CallReport.bytes_sent``), summed over all ranks. Each rank holds
one MiniLM gradient step of ``datasets/minilm.h5`` (rank ``i`` step ``i mod 4``, as
docs/model.md); the bound is ``REL(1e-3)`` of the global range; shared memory, so only bytes
count here, not time.

Columns, all from the same run:

- ``avg``: ``op="avg"``, whose bound is on the average (each rank quantizes on the grid of
  ``eb``);
- ``sum``: ``op="sum"`` (each rank on the grid of ``eb / N``). This is also exactly what
  ``op="avg"`` sent before its bound moved to the average: it ran the ring with ``eb`` as
  the bound of the sum, then divided by ``N``;
- ``max err / eb`` of the average against a float64 reference (must be <= 1 up to the
  float32 roundings, docs/error-bound.md).

Run: ``.venv/bin/python bench/scaleout.py --ranks 2 3 4 6 8`` (starts ``mpiexec -n N`` per
count; writes a markdown table and, with ``--png``, a plot). A rank count above the cores
oversubscribes them, which is fine for bytes. ``--schedule halving`` measures recursive
halving and doubling instead of the ring (``Communicator(schedule=...)``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "datasets" / "minilm.h5"


SPLITS = {"off": 0.0, "auto": None}


def worker(path: str, rel: float, share: float | None, schedule: str = "ring") -> None:
    """One rank count: run under mpiexec; rank 0 prints one JSON line."""
    from mpi4py import MPI

    import ccoll
    from ccoll.bench import load_gradients
    from ccoll.collectives import ratios

    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x = load_gradients(path, r)
    raw = 2 * (n - 1) * x.nbytes  # all ranks together
    total = np.empty(x.size, np.float64)
    comm.Allreduce(x.astype(np.float64), total, op=MPI.SUM)
    row: dict[str, float | str] = {"ranks": n, "elements": x.size,
                                   "auto_share": ratios.split_fraction(n), "schedule": schedule}
    splits = dict(SPLITS)
    if share is not None:
        splits["fixed"] = share
        row["fixed_share"] = share
    for name, split in splits.items():
        with ccoll.Communicator(comm, policy="compress", split=split, schedule=schedule) as c:
            for op in ("avg", "sum"):
                y = c.allreduce(x, ccoll.REL(rel), op=op)
                rep = c.last_call
                assert rep is not None and rep.compressed and rep.eb_abs
                sent = comm.allreduce(rep.bytes_sent, op=MPI.SUM)
                row[f"{op}_{name}_ratio"] = raw / sent if sent else float("inf")
                row[f"{op}_{name}_bytes"] = sent
                ref = total / n if op == "avg" else total
                err = float(np.max(np.abs(y.astype(np.float64) - ref)))
                row[f"{op}_{name}_err_over_eb"] = err / rep.eb_abs
    if r == 0:
        print("ROW " + json.dumps(row), flush=True)


def run(ranks: list[int], rel: float, path: str, share: float | None,
        schedule: str = "ring") -> list[dict[str, float]]:
    rows = []
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    for n in ranks:
        cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", __file__, "--worker",
               "--rel", repr(rel), "--data", path, "--schedule", schedule]
        if share is not None:
            cmd += ["--share", repr(share)]
        env = dict(os.environ, CCOLL_THREADS="1")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                             timeout=1800).stdout
        got = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
        rows.append(got[0])
        print(json.dumps(got[0]), flush=True)
    return rows


def table(rows: list[dict[str, float]]) -> str:
    if not rows:
        return ""
    base = {k: rows[0][f"{k}_ratio"] for k in ("avg_off", "avg_auto", "sum_off", "sum_auto")}
    fixed = "fixed_share" in rows[0]
    extra = f" avg, split {rows[0]['fixed_share']:g} | its / before |" if fixed else ""
    lines = ["| N | auto split share | avg, before (= sum, no split) | avg, no split | "
             "avg, split auto | avg auto / before | avg auto / avg auto at 2 | "
             "sum, split auto | sum auto / no split | max err / eb (avg, sum) |" + extra,
             "|---:" * 10 + "|" + ("---:|---:|" if fixed else "")]
    for row in rows:
        before = row["sum_off_ratio"]
        a0, a1, s1 = row["avg_off_ratio"], row["avg_auto_ratio"], row["sum_auto_ratio"]
        err = max(row[k] for k in row if k.startswith("avg_") and k.endswith("_err_over_eb"))
        errs = max(row[k] for k in row if k.startswith("sum_") and k.endswith("_err_over_eb"))
        lines.append(
            f"| {row['ranks']} | {row['auto_share']:g} | {before:.2f} | {a0:.2f} | {a1:.2f} | "
            f"{a1 / before:.2f} | {a1 / base['avg_auto']:.2f} | {s1:.2f} | "
            f"{s1 / before:.2f} | {err:.3f}, {errs:.3f} |"
            + (f" {row['avg_fixed_ratio']:.2f} | {row['avg_fixed_ratio'] / before:.2f} |"
               if fixed else ""))
    return "\n".join(lines)


def plot(rows: list[dict[str, float]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["ranks"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(ns, [r["avg_auto_ratio"] for r in rows], "o-", label='avg, split auto')
    ax.plot(ns, [r["avg_off_ratio"] for r in rows], "o:", label='avg, no split')
    ax.plot(ns, [r["sum_auto_ratio"] for r in rows], "s-", label='sum, split auto')
    ax.plot(ns, [r["sum_off_ratio"] for r in rows], "s--",
            label='sum, no split (= avg before)')
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("ranks")
    ax.set_ylabel("wire ratio (raw ring bytes / bytes sent)")
    ax.set_title("MiniLM gradients, REL 1e-3, shared memory")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    p.add_argument("--rel", type=float, default=1e-3)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--share", type=float, default=None,
                   help="also measure this fixed split share (a column 'avg, split X')")
    p.add_argument("--schedule", choices=("ring", "halving"), default="ring",
                   help="the Communicators' schedule (default: ring, as measured before "
                        "halving existed)")
    p.add_argument("--png", default=None, help="write the plot here")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.data, args.rel, args.share, args.schedule)
        return
    rows = run(args.ranks, args.rel, args.data, args.share, args.schedule)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
