"""Fault behaviour of the collectives, each in its own 4-rank ``mpiexec`` job.

A rank that raises in the middle of a collective must end the whole job (``python -m
mpi4py`` aborts on an uncaught exception), and with ``Communicator(timeout=...)`` ranks
stuck behind a stalled peer raise ``CollectiveError`` instead of waiting forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

MPIEXEC = Path(sys.executable).parent / "mpiexec"

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the mpiexec of the venv")

PRELUDE = """
import os, sys, time
import numpy as np
from mpi4py import MPI
import ccoll
from ccoll.collectives import homomorphic
from ccoll.errors import CollectiveError

comm = MPI.COMM_WORLD
x = np.linspace(-1, 1, 200_000, dtype=np.float32) * (comm.rank + 1)
"""


def run_job(
    tmp_path: Path, body: str, limit: float = 240
) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "4", sys.executable, "-m", "mpi4py", str(script)],
        capture_output=True, text=True, timeout=limit, env=env,
    )
    return proc, time.monotonic() - t0


def test_exception_mid_collective_ends_the_job(tmp_path):
    proc, elapsed = run_job(tmp_path, """
        if comm.rank == 2:
            calls = [0]
            real = homomorphic.HomomorphicOps.combine

            def failing(self, *args):
                calls[0] += 1
                if calls[0] == 3:  # a few chunks into the ring
                    raise RuntimeError("injected failure on rank 2")
                return real(self, *args)

            homomorphic.HomomorphicOps.combine = failing
        with ccoll.Communicator(comm, chunk_elems=4096, policy="compress") as c:
            c.allreduce(x, eb=ccoll.REL(1e-3))
        print(f"rank {comm.rank} finished", flush=True)
    """)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "injected failure on rank 2" in proc.stderr
    assert proc.stdout.count("finished") < 4
    assert elapsed < 120, f"the job took {elapsed:.0f} s to end"


def test_timeout_turns_a_stalled_peer_into_collective_error(tmp_path):
    proc, elapsed = run_job(tmp_path, """
        c = ccoll.Communicator(comm, chunk_elems=4096, timeout=3.0, policy="compress")
        c.allreduce(x[:1000], eb=ccoll.REL(1e-3))  # warm-up: compile before timing
        if comm.rank == 2:
            real = homomorphic.HomomorphicOps.combine

            def stalled(self, *args):
                time.sleep(60)  # a peer that stops making progress mid-ring
                return real(self, *args)

            homomorphic.HomomorphicOps.combine = stalled
        t0 = time.monotonic()
        try:
            c.allreduce(x, eb=ccoll.REL(1e-3))
            print(f"rank {comm.rank} finished", flush=True)
        except CollectiveError as exc:
            print(f"rank {comm.rank} CollectiveError after {time.monotonic() - t0:.1f} s: {exc}",
                  flush=True)
        try:
            c.allreduce(x, eb=ccoll.REL(1e-3))
        except CollectiveError as exc:
            print(f"rank {comm.rank} refuses: {exc}", flush=True)
        comm.Barrier()
        if comm.rank == 0:
            comm.Abort(7)  # what an application does after a failed collective
        time.sleep(60)
    """)
    out = proc.stdout
    assert out.count("CollectiveError after") == 4, out + proc.stderr
    assert out.count("refuses: this ccoll Communicator cannot be used") == 4, out
    for line in out.splitlines():
        if "CollectiveError after" in line:
            waited = float(line.split("after ")[1].split(" s")[0])
            assert 2.9 <= waited < 15, line
    assert proc.returncode != 0
    assert elapsed < 120
