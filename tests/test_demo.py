"""``python -m ccoll.demo``: the launcher's choice of network, and the table it prints.

The shared-memory run is the one every user without root gets; the emulated-cluster run
needs root and working ``ip netns`` and is skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ccoll import demo

REPO = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
COLUMNS = ["tensor", "elements", "MPI ms", "ccoll ms", "speed-up", "MPI sent", "ccoll sent",
           "sent as", "err/eb", "same"]
SMALL = ["--ranks", "2", "--max-tensors", "3", "--repeat", "1", "--bucket-mib", "0.5"]


def _env() -> dict[str, str]:
    # A child that sees an MPI launcher's variables would run as a rank instead of launching.
    env = {k: v for k, v in os.environ.items() if k not in demo._RANK_ENV}
    env["PYTHONPATH"] = str(REPO)
    return env


def _run_demo(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "ccoll.demo", *args], env=_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _check_table(out: str) -> list[str]:
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("tensor "))
    for col in COLUMNS:
        assert col in lines[head], col
    rows = lines[head + 2:]
    assert any(r.startswith("total of the 3 calls above") for r in rows), out
    bucket = next(r for r in rows if r.startswith("DDP bucket"))
    assert bucket.split()[-1] == "yes", bucket  # same on all ranks
    assert any(r.startswith("what it means:") for r in rows), out
    return lines[:head]


def test_non_root_never_tries_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)

    def no_subprocess(*a: object, **k: object) -> None:
        raise AssertionError("a non-root run must not call `ip`")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    network, why = demo.choose_network("auto")
    assert network == "shm" and "not root" in why
    with pytest.raises(SystemExit, match="not root"):
        demo.choose_network("emulated")


def test_forced_shared_memory_needs_no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert demo.choose_network("shm") == ("shm", "--network shm")


def test_rank_arguments_drop_the_launchers_own() -> None:
    argv = ["--network", "shm", "--ranks=2", "--rel", "1e-2", "--rate", "10gbit",
            "--timeout", "60", "--repeat", "1"]
    assert demo._rank_args(argv) == ["--rel", "1e-2", "--repeat", "1"]


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_shared_memory_run_explains_itself_before_the_table() -> None:
    out = _run_demo("--network", "shm", *SMALL)
    before = "\n".join(_check_table(out))
    assert "network: shared memory" in before
    assert "Expect no speed-up" in before
    assert "as root" in before and "make bench-cluster" in before


def _why_no_cluster() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (`ip`, `tc`) not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    if not MPIEXEC.exists():
        return f"{MPIEXEC} missing (run `make venv`)"
    return None


@pytest.mark.skipif(_why_no_cluster() is not None, reason=str(_why_no_cluster()))
def test_emulated_run_names_its_link() -> None:
    out = _run_demo("--network", "emulated", *SMALL)
    before = "\n".join(_check_table(out))
    assert "network: emulated, 1 Gbit/s" in before
    assert "shared memory" not in out


@pytest.mark.parametrize(("option", "why"), [
    (["--timeout", "-1"], "--timeout must be >= 1, got -1"),  # was passed to `timeout`
    (["--rel", "0"], "--rel: REL bound must be finite and > 0"),  # a traceback per rank
    (["--repeat", "0"], "--repeat must be >= 1, got 0"),  # AttributeError
    (["--data", "/nonexistent/d.h5"], "--data: input file '/nonexistent/d.h5' does not exist"),
    (["--ranks", "0"], "--ranks must be >= 1, got 0"),  # exit 1
    (["--bucket-mib", "-1"], "--bucket-mib must be a finite number >= 0, got -1.0"),  # ran
    (["--max-tensors", "0"], "--max-tensors must be >= 1, got 0"),
    (["--rate", "0gbit"], "--rate: rate must be > 0"),
])
def test_bad_options_are_usage_errors_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        option: list[str], why: str) -> None:
    def started(*_a: object) -> int:
        raise AssertionError("the demo started with a bad option")

    monkeypatch.setattr(demo, "launch", started)
    monkeypatch.setattr(demo, "run_ranks", started)
    for rank in ([], ["--rank"]):  # the launcher and each rank
        with pytest.raises(SystemExit) as e:
            demo.main(["--network", "shm", *rank, *option])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1].startswith(f"python -m ccoll.demo: error: {why}"), err
        assert "Traceback" not in err
