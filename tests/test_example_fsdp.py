"""examples/train_fsdp.py: a short CNN run under mpiexec, and --model minilm without its extra."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
MINILM = importlib.util.find_spec("sentence_transformers") is not None

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "examples/train_fsdp.py",
         *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


def test_help_shows_every_default_and_names_make_minilm() -> None:
    pytest.importorskip("torch")
    from ccoll.helpformat import shows_default

    sys.path.insert(0, str(REPO / "examples"))
    try:
        spec = importlib.util.spec_from_file_location("train_fsdp_example",
                                                      REPO / "examples" / "train_fsdp.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(REPO / "examples"))
    parser = mod.build_parser()
    fmt = parser._get_formatter()
    missing = [a.dest for a in parser._actions
               if shows_default(a) and "default" not in (fmt._get_help_string(a) or "").lower()]
    assert missing == []
    text = parser.format_help()
    assert "make minilm" in text and "(default: 300)" in text


def test_cnn_run_writes_its_log_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    p = _run("--model", "cnn", "--steps", "4", "--eval-every", "2", "--min-numel", "0",
             "--exempt", "*bias", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    log = json.loads((tmp_path / "fsdp_cnn_ccoll_rel1e-3_n2_s0.json").read_text())
    assert log["full_model_identical_on_all_ranks"] is True
    assert len(log["loss"]) == 4 and [e["step"] for e in log["eval"]] == [0, 2, 4]
    # conv1, conv2, fc: weights compressed, biases exact, every step
    assert (log["reduce_scatters_compressed"], log["reduce_scatters_exact"]) == (12, 12)
    assert (tmp_path / "fsdp_loss_cnn.png").stat().st_size > 0


@pytest.mark.skipif(MINILM, reason="sentence-transformers is installed (`make minilm` ran)")
def test_minilm_without_its_extra_names_make_minilm_and_exits_2(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    p = _run("--model", "minilm", "--steps", "1", "--out", str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert out.count("make minilm") == 1, out  # rank 0 alone says it
    assert "Traceback" not in out and "MPI_Abort" not in out, out
