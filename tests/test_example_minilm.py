"""examples/train_ddp.py --model minilm without its extra: one clear message, no MPI_Abort."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
INSTALLED = importlib.util.find_spec("sentence_transformers") is not None


@pytest.mark.skipif(INSTALLED, reason="sentence-transformers is installed (`make minilm` ran)")
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_missing_extra_names_make_minilm_and_exits_2(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "examples/train_ddp.py",
         "--model", "minilm", "--steps", "1", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert out.count("make minilm") == 1, out  # rank 0 alone says it
    assert "Traceback" not in out and "MPI_Abort" not in out, out
