"""Training methods side by side over seeds: median step, time to a target, final accuracy.

Reads the run logs (JSON) that ``examples/train_ddp.py`` wrote into the folders given (one
folder per link is the usual layout, any mix works: the logs say their link and seed),
groups them by link and method, and prints per link one Markdown table:

- median step: each run's median step time (warm-up steps left out, as train_ddp.py's own
  figure), the mean over seeds and their range;
- time to target: each run's training time (evaluations left out) until its accuracy first
  reached the target the runs were started with, the mean and range over the seeds that
  reached it, and how many did;
- final accuracy: the mean and range over seeds, and whether the mean lies within the
  range of ``none``'s seeds (the methods' accuracy against the seed spread).

With ``--png DIR`` it also draws, per link, accuracy against training time: one colour per
method, one line per seed. Nothing is measured here.

Run (docs/training.md, "Against bf16 and PowerSGD")::

    .venv/bin/python bench/train_compare.py runs/compare/100mbit runs/compare/1gbit \\
        runs/compare/10gbit --png docs/img/training/compare
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ORDER = ("none", "bf16", "fp16", "powersgd", "ccoll", "ccoll-ef")
LINK_ORDER = ("100mbit", "1gbit", "10gbit", None)


def read(folders: Sequence[Path]) -> list[dict[str, Any]]:
    """Every train_ddp.py run log (a JSON dict with ``step_time_s``) in ``folders``."""
    logs = []
    for folder in folders:
        if not folder.is_dir():
            raise SystemExit(f"train_compare.py: {folder} is not a folder")
        for path in sorted(folder.glob("*.json")):
            try:
                log = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise SystemExit(f"train_compare.py: cannot read {path}: {exc}") from exc
            if isinstance(log, dict) and "step_time_s" in log and "method" in log:
                logs.append(log)
    return logs


def label(log: dict[str, Any]) -> str:
    """The method as a reader names it: ``powersgd r4``, ``ccoll``, ``ccoll-ef``, ..."""
    m, at, _ = str(log["method"]).partition("@")
    cap = f" @{log['bucket_cap_mb']:g}MB" if at else ""  # its own DDP bucket size
    if m.startswith("powersgd"):
        return f"powersgd r{log['powersgd']['matrix_approximation_rank']}{cap}"
    name, _, eb = m.partition(":")
    return (f"{name} {eb}" if eb else m) + cap  # ccoll:rel:1e-2 -> "ccoll rel:1e-2"


def _key(name: str) -> tuple[int, str]:
    base = name.split(" ")[0]
    return (ORDER.index(base) if base in ORDER else len(ORDER), name)


def _span(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def summarize(logs: list[dict[str, Any]]) -> dict[Any, dict[str, dict[str, Any]]]:
    """{link: {method: {seeds, median_step, time_to_target, reached, final}}}."""
    out: dict[Any, dict[str, dict[str, Any]]] = {}
    for log in logs:
        link = log.get("link_rate")
        row = out.setdefault(link, {}).setdefault(label(log), {
            "seeds": [], "median_step": [], "time_to_target": [], "final": [],
            "target": log.get("target_accuracy"), "steps": log.get("steps")})
        row["seeds"].append(log["seed"])
        row["median_step"].append(float(log["median_step_time_s"]))
        row["final"].append(float(log["final_accuracy"]))
        tt = log.get("time_to_target_s")
        if tt is not None:
            row["time_to_target"].append(float(tt))
    return out


def table(link: Any, rows: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of one link."""
    none = rows.get("none")
    lo = min(none["final"]) if none else -math.inf
    hi = max(none["final"]) if none else math.inf
    best_other = {}
    for name in rows:  # bf16, fp16 and PowerSGD, with any bucket size
        if name.split(" ")[0] in ("bf16", "fp16", "powersgd") and rows[name]["time_to_target"]:
            best_other[name] = statistics.fmean(rows[name]["time_to_target"])
    seeds = sorted({s for r in rows.values() for s in r["seeds"]})
    lines = [
        f"{link or 'no link shaping'}: seeds {', '.join(map(str, seeds))}, "
        f"target {next(iter(rows.values()))['target']}",
        "",
        "| method | median step (s) | time to target (s) | reached | final accuracy | "
        "within none's spread |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in sorted(rows, key=_key):
        r = rows[name]
        n = len(r["seeds"])
        mean_final = statistics.fmean(r["final"])
        within = "-" if none is None or name == "none" else (
            "yes" if lo <= mean_final <= hi else ("above" if mean_final > hi else "no"))
        lines.append(
            f"| {name} | {_span(r['median_step'], '.2f')} | {_span(r['time_to_target'], '.1f')} "
            f"| {len(r['time_to_target'])}/{n} | {_span(r['final'], '.4f')} | {within} |")
    if best_other:
        name = min(best_other, key=best_other.__getitem__)
        lines.append("")
        lines.append(f"best of bf16/fp16/PowerSGD to target: {name}, "
                     f"{best_other[name]:.1f} s (mean)")
    return "\n".join(lines)


def plot(logs: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Accuracy against training time, one PNG per link; return the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    links = sorted({log.get("link_rate") for log in logs},
                   key=lambda v: LINK_ORDER.index(v) if v in LINK_ORDER else len(LINK_ORDER))
    for link in links:
        fig, ax = plt.subplots(figsize=(7, 4.4))
        colors: dict[str, Any] = {}
        mine = sorted((g for g in logs if g.get("link_rate") == link),
                      key=lambda g: (_key(label(g)), g["seed"]))
        for log in mine:
            ev = [e for e in log.get("eval", []) if "train_time_s" in e]
            if not ev:
                continue
            name = label(log)
            (line,) = ax.plot([e["train_time_s"] for e in ev], [e["accuracy"] for e in ev],
                              marker=".", lw=1.0, alpha=0.8, color=colors.get(name),
                              label=None if name in colors else name)
            colors.setdefault(name, line.get_color())
        target = mine[0].get("target_accuracy") if mine else None
        if target is not None:
            ax.axhline(target, color="gray", ls="--", lw=0.8, label=f"target {target}")
        ax.set_xlabel("training time (s, evaluations left out)")
        ax.set_ylabel("retrieval accuracy" if mine and mine[0]["model"] == "minilm"
                      else "test accuracy")
        seeds = sorted({g["seed"] for g in mine})
        ax.set_title(f"{mine[0]['model'] if mine else ''}, {mine[0]['ranks'] if mine else ''} "
                     f"ranks, {link or 'no shaping'}: seeds {', '.join(map(str, seeds))}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"acc_time_{link or 'local'}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="folders of train_ddp.py logs")
    ap.add_argument("--png", type=Path, default=None, metavar="DIR",
                    help="also draw accuracy against time per link into DIR")
    args = ap.parse_args(argv)
    logs = read(args.folders)
    if not logs:
        print("train_compare.py: no run logs in the folders given", file=sys.stderr)
        return 1
    summary = summarize(logs)
    links = sorted(summary, key=lambda v: LINK_ORDER.index(v) if v in LINK_ORDER
                   else len(LINK_ORDER))
    print("\n\n".join(table(link, summary[link]) for link in links))
    if args.png is not None:
        for path in plot(logs, args.png):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
