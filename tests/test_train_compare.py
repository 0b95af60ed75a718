"""bench/train_compare.py: its table is the runs' own numbers, averaged over seeds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("train_compare", REPO / "bench" / "train_compare.py")
assert _spec is not None and _spec.loader is not None
tc = importlib.util.module_from_spec(_spec)
sys.modules["train_compare"] = tc
_spec.loader.exec_module(tc)


def _log(method: str, seed: int, step: float, tt: float | None, final: float,
         rank: int | None = None) -> dict:
    return {"model": "minilm", "ranks": 4, "method": method, "seed": seed, "steps": 24,
            "link_rate": "1gbit", "target_accuracy": 0.76, "step_time_s": [step] * 24,
            "median_step_time_s": step, "time_to_target_s": tt, "final_accuracy": final,
            "powersgd": None if rank is None else {"matrix_approximation_rank": rank},
            "eval": [{"step": 0, "accuracy": 0.7, "train_time_s": 0.0},
                     {"step": 24, "accuracy": final, "train_time_s": 24 * step}]}


def test_table_averages_over_seeds(tmp_path: Path, capsys) -> None:
    logs = [
        _log("none", 0, 2.0, 30.0, 0.78), _log("none", 1, 2.2, 10.0, 0.82),
        _log("bf16", 0, 1.5, 24.0, 0.79), _log("bf16", 1, 1.5, None, 0.75),
        _log("powersgd:8", 0, 1.2, 20.0, 0.77, rank=8),
        _log("ccoll", 0, 1.0, 18.0, 0.80), _log("ccoll", 1, 1.4, 22.0, 0.81),
        _log("ccoll-ef:rel:1e-2", 0, 0.9, 16.0, 0.79),
        {**_log("bf16@5", 0, 1.4, 19.0, 0.79), "bucket_cap_mb": 5.0},
        {**_log("ccoll@5", 0, 0.8, 15.0, 0.80), "bucket_cap_mb": 5.0},
    ]
    for i, log in enumerate(logs):
        (tmp_path / f"run{i}.json").write_text(json.dumps(log))
    (tmp_path / "other.json").write_text(json.dumps({"not": "a run"}))
    assert tc.main([str(tmp_path), "--png", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "method" not in line}
    # mean (range) over seeds; time to target over the seeds that reached it
    assert rows["none"] == ["2.10 (2.00-2.20)", "20.0 (10.0-30.0)", "2/2",
                            "0.8000 (0.7800-0.8200)", "-"]
    assert rows["bf16"] == ["1.50 (1.50-1.50)", "24.0", "1/2", "0.7700 (0.7500-0.7900)", "no"]
    assert rows["powersgd r8"] == ["1.20", "20.0", "1/1", "0.7700", "no"]
    assert rows["ccoll"][1:] == ["20.0 (18.0-22.0)", "2/2", "0.8050 (0.8000-0.8100)", "yes"]
    assert rows["ccoll-ef rel:1e-2"][:3] == ["0.90", "16.0", "1/1"]
    # a method@MB run (its own DDP bucket size) is a method of its own
    assert rows["ccoll @5MB"][:3] == ["0.80", "15.0", "1/1"]
    assert rows["bf16 @5MB"][:3] == ["1.40", "19.0", "1/1"]
    assert "best of bf16/fp16/PowerSGD to target: bf16 @5MB, 19.0 s" in out
    assert (tmp_path / "png" / "acc_time_1gbit.png").stat().st_size > 0


def test_no_logs_is_an_error(tmp_path: Path) -> None:
    assert tc.main([str(tmp_path)]) == 1
