"""Speed-up over MPI_Allreduce against message size, from ``ccoll bench allreduce --csv`` files.

Draws one line per CSV for ``policy="auto"`` (what a default call gets) and, with
``--compress``, a dashed one for the homomorphic ring (``policy="compress"``), each over
``MPI_Allreduce`` of the same run, and with ``--table`` prints the Markdown rows of
docs/performance.md's headline table (``auto / compress`` at the chosen sizes). Nothing is
measured here: the numbers are the CSVs' ``speedup`` column (the means' ratio), or with
``--median`` their ``med_speedup`` (the medians': one stalled call does not move it).

Run (the figure of README.md and docs/performance.md):

    .venv/bin/python bench/plot_speedup.py docs/bench/floor/allreduce_1gbit_2.csv \\
        docs/bench/floor/allreduce_1gbit_4.csv docs/bench/floor/allreduce_10gbit_2.csv \\
        docs/bench/floor/allreduce_10gbit_4.csv docs/bench/floor/allreduce_shm_2.csv \\
        --png docs/img/speedup_vs_mpi.png --table

A CSV's label comes from its name (``allreduce_<link>_<ranks>.csv``) unless given as
``LABEL=PATH``. An existing PNG is replaced only with ``--force``.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

SIZES = ("64K", "1M", "4M", "16M", "64M")
LINKS = {
    "1gbit": "1 Gbit/s",
    "10gbit": "10 Gbit/s",
    "100mbit": "100 Mbit/s",
    "shm": "shared memory",
}


def _bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64K, 1M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def _label(path: Path) -> str:
    m = re.fullmatch(r"allreduce_([a-z0-9]+)_(\d+)", path.stem)
    if m is None:
        return path.stem
    return f"{LINKS.get(m.group(1), m.group(1))}, {m.group(2)} ranks"


def read(path: Path, column: str = "speedup") -> dict[str, dict[int, float]]:
    """``{algorithm: {size: speedup}}`` of one CSV (``column``: ``speedup``, ``med_speedup``)."""
    out: dict[str, dict[int, float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if column not in row:
                raise SystemExit(f"{path}: no column {column!r} (a CSV of an older ccoll bench)")
            if row.get("collective", "allreduce") != "allreduce" or not row[column]:
                continue
            out.setdefault(row["algorithm"], {})[int(row["size"])] = float(row[column])
    if "auto" not in out and "homomorphic" not in out:
        raise SystemExit(f"{path}: no 'auto' or 'homomorphic' rows with a {column}")
    return out


def _size_name(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def table(runs: list[tuple[str, dict[str, dict[int, float]]]], sizes: list[int]) -> str:
    head = "| link, ranks | " + " | ".join(_size_name(s) for s in sizes) + " |"
    lines = [head, "|---|" + "---:|" * len(sizes)]
    for label, algs in runs:
        cells = []
        for s in sizes:
            a, c = algs.get("auto", {}).get(s), algs.get("homomorphic", {}).get(s)
            cells.append(" / ".join("-" if v is None else f"{v:.2f}x" for v in (a, c)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[tuple[str, dict[str, dict[int, float]]]], png: Path, compress: bool,
         median: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, algs) in enumerate(runs):
        color = colors[i % len(colors)]
        for alg, style, name in (("auto", "-", "auto"), ("homomorphic", "--", "compress")):
            if alg == "homomorphic" and not compress:
                continue
            pts = sorted(algs.get(alg, {}).items())
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    color=color,
                    label=f"{label}, {name}" if compress else label,
                    linewidth=1.6 if alg == "auto" else 1.0,
                )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("speed-up over MPI_Allreduce" + (" (medians)" if median else ""))
    top = max(s for _, algs in runs for pts in algs.values() for s in pts)
    ticks = [1 << k for k in range(2, 31, 4) if 1 << k <= top]
    ax.set_xticks(ticks, [_size_name(t) for t in ticks])
    title = "ccoll allreduce against MPI_Allreduce, MiniLM gradients, REL 1e-3, policy auto"
    ax.set_title(title + (" (dashed: compress)" if compress else ""), fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="ccoll bench CSV files, or LABEL=PATH")
    ap.add_argument("--png", type=Path, help="write the plot here")
    ap.add_argument("--force", action="store_true", help="replace an existing --png")
    ap.add_argument(
        "--compress",
        action="store_true",
        help='also plot the homomorphic ring (policy="compress"), dashed',
    )
    ap.add_argument("--table", action="store_true", help="print the Markdown table")
    ap.add_argument("--median", action="store_true",
                    help="MPI's median call over the row's (med_speedup), not the means' ratio")
    ap.add_argument(
        "--sizes",
        default=",".join(SIZES),
        help=f"sizes of the table's columns (default {','.join(SIZES)})",
    )
    args = ap.parse_args(argv)
    runs = []
    for spec in args.csv:
        label, _, path = spec.rpartition("=")
        p = Path(path)
        runs.append((label or _label(p), read(p, "med_speedup" if args.median else "speedup")))
    if args.png is not None:
        if args.png.exists() and not args.force:
            print(f"{args.png} exists; --force replaces it", file=sys.stderr)
            return 1
        plot(runs, args.png, args.compress, args.median)
    if args.table:
        print(table(runs, [_bytes(s) for s in args.sizes.split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
