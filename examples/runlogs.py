"""What examples/train_ddp.py and examples/train_fsdp.py share: reading run logs, drawing them.

A run log is one JSON dict per run (loss per step, evaluations, timings); see
docs/training.md for their keys.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections.abc import Callable
from typing import Any

import models
import numpy as np

__all__ = ["draw_run", "missing_minilm", "read_logs", "style_accuracy", "style_loss"]


def missing_minilm() -> list[str]:
    """The modules that ``--model minilm`` needs and that are not installed."""
    return [m for m in ("sentence_transformers", models.MINILM_PACKAGE)
            if importlib.util.find_spec(m) is None]


Runs = dict[str, list[tuple[str, dict[str, Any]]]]


def save_figure(fig: Any, path: pathlib.Path) -> pathlib.Path:
    """Lay out ``fig``, write it to ``path`` (PNG, 100 dpi), close it; return ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def read_logs(out: pathlib.Path, pattern: str, accept: Callable[[dict[str, Any]], bool]) -> Runs:
    """{model: [(file stem, log), ...]} of the readable logs in ``out`` that ``accept`` takes."""
    runs: Runs = {}
    for path in sorted(out.glob(pattern)):
        try:
            log = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(log, dict) and accept(log):
            runs.setdefault(log["model"], []).append((path.stem, log))
    return runs


def draw_run(ax: Any, bx: Any, name: str, log: dict[str, Any]) -> Any:
    """Draw a run's smoothed loss on ``ax`` and its evaluations on ``bx``; return the line."""
    loss = np.asarray(log["loss"], dtype=float)
    win = max(1, min(10, len(loss) // 10))
    smooth = np.convolve(loss, np.ones(win) / win, mode="valid")
    t = log.get("median_step_time_s")
    label = name if t is None else f"{name} ({t * 1e3:.0f} ms/step)"
    (line,) = ax.plot(np.arange(len(smooth)) + win - 1, smooth, label=label, lw=1.2)
    ev = log.get("eval", [])
    bx.plot([e["step"] for e in ev], [e["accuracy"] for e in ev], "o-", ms=3,
            color=line.get_color(), lw=1.2)
    return line


def style_loss(ax: Any, title: str) -> None:
    """Axes labels, title and legend of the loss panel."""
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks, moving average)")
    ax.set_title(title)
    ax.legend(fontsize=7)


def style_accuracy(bx: Any, model: str, title: str) -> None:
    """Axes labels and title of the accuracy panel."""
    bx.set_xlabel("step")
    bx.set_ylabel("test accuracy" if model == "cnn" else "in-batch retrieval accuracy")
    bx.set_title(title)
