"""Error feedback's residual at 8 ranks, where ``schedule="auto"`` picks recursive halving.

``make test`` runs tests/mpi/test_hook_residual.py at 1-5 ranks (the ring, and recursive
halving asked for by name); the hook's own ``schedule="auto"`` switches to halving only from
about 8 ranks, so ``make test-slow`` runs the whole file, its slow test included, in one
``mpiexec -n 8`` job.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.mark.slow
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_hook_residual_at_eight_ranks() -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    env.update(PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE")
    p = subprocess.run(
        [str(MPIEXEC), "-n", "8", sys.executable, "-m", "mpi4py", "-m", "pytest",
         "tests/mpi/test_hook_residual.py", "-q", "-p", "no:cacheprovider", "--timeout=900",
         "--timeout-method=thread"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-4000:]
    # Every rank ran the whole file and passed it: eight summaries "N passed in ...", the
    # same N (the file's tests, its slow one included), nothing failed, errored or skipped.
    # (The ranks' outputs interleave: a summary need not start a line.)
    passed = re.findall(r"(\d+) passed in [0-9.]+s", p.stdout)
    assert len(passed) == 8 and len(set(passed)) == 1, p.stdout[-6000:]
    assert not re.search(r"\d+ (failed|errors?|skipped|deselected)", p.stdout), p.stdout[-6000:]
