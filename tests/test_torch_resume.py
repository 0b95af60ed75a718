"""A run resumed from a checkpoint in fresh processes ends bit for bit where an unbroken run ends.

tests/mpi/resume_job.py trains N + M steps without a break, then N steps and a checkpoint
(model, optimizer, ccoll state) on every rank; a second ``mpiexec`` (new processes, new
communicators, DDP's first bucket layout again) loads it and trains M more. Checked for the
DDP comm hook with error feedback (residuals saved by parameter name, and by bucket with
shapes) and for FSDPReduceScatter, at 2 and 4 ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
JOB = REPO / "tests" / "mpi" / "resume_job.py"
N, M = 4, 3


def _run(ranks: int, mode: str, folder: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run(
        [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(JOB), mode,
         str(folder), str(N), str(M)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
# 4 ranks in `make test-slow`; 2 ranks show the same resume (every rank's residuals and
# state restored bitwise) in `make test`.
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_resume_in_fresh_processes_is_bitwise_the_unbroken_run(tmp_path: Path, ranks: int) -> None:
    torch = pytest.importorskip("torch")
    _run(ranks, "first", tmp_path)
    _run(ranks, "resume", tmp_path)
    for kind in ("ddp", "ddp_shapes", "fsdp"):
        for rank in range(ranks):
            full = torch.load(tmp_path / f"full_{kind}_{rank}.pt")
            resumed = torch.load(tmp_path / f"resumed_{kind}_{rank}.pt")
            assert full.keys() == resumed.keys()
            for name in full:
                assert torch.equal(full[name], resumed[name]), (kind, rank, name)
