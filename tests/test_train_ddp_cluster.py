"""examples/train_ddp.py on the emulated cluster (jobs/emulated_cluster.py): every byte of
DDP's own allreduce (gloo) and of ccoll's hook (MPI) crosses the shaped link.

Each rank sits in its own network namespace, so the interface counters in /proc/net/dev
are the rank's alone: the script reads them around its training loop. Needs root and
iproute2; elsewhere the test is skipped with the reason (pytest -ra lists it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

REPO = Path(__file__).resolve().parent.parent
MPIEXEC = REPO / ".venv" / "bin" / "mpiexec"
STEPS = 4


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces and tc"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if not MPIEXEC.exists():
        return f"{MPIEXEC} missing (run `make venv`)"
    return None


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_gloo_and_ccoll_traffic_cross_the_shaped_link(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GLOO_SOCKET_IFNAME", None)
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "emulated_cluster.py"), "--ranks", "2", "--rate",
         "1gbit", "--settle", "1", "--timeout", "540", "--",
         sys.executable, "-m", "mpi4py", str(REPO / "examples" / "train_ddp.py"),
         "--methods", "none,ccoll", "--steps", str(STEPS), "--eval-every", "0",
         "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    logs = {}
    for path in tmp_path.glob("*.json"):
        log = json.loads(path.read_text())
        logs[log["method"]] = log
    assert sorted(logs) == ["ccoll", "none"]
    for method, log in logs.items():
        # Rank 0's address on the ranks' link, reached through veth0 on every rank.
        assert log["rendezvous"]["how"] == "route", log["rendezvous"]
        assert log["rendezvous"]["host"] == "10.231.0.1" and log["interface"] == "veth0"
        assert log["link_rate"] == "1gbit" and log["params_identical_on_all_ranks"] is True
        # Nothing of the training went over the namespaces' loopback (gloo bound to veth0)...
        assert log["loopback_tx_bytes"] == 0, (method, log["loopback_tx_bytes"])
        # ...and at least the gradients each rank sent left through veth0.
        assert log["interface_tx_bytes"] >= log["hook_payload_bytes"] > 0, method
    grads = logs["none"]["parameters"] * 4 * STEPS * 2
    assert logs["none"]["hook_payload_bytes"] == grads
    assert logs["none"]["interface_tx_bytes"] < 2 * grads  # headers and MPI's small sums
