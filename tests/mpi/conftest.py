"""MPI test harness: run under `mpiexec -n K python -m mpi4py -m pytest tests/mpi`.

A failure on any rank prints its report and aborts the whole MPI job at once, so the other
ranks never wait forever for a partner that gave up. A rank that hangs is stopped by
pytest-timeout (thread method: it exits the process, and mpiexec then ends the job).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

# Before any test module imports torch: torch loads the OpenMP runtime that numba's
# parallel kernels share, and OpenMP reads its wait policy only then. Spinning idle
# threads of ranks that share cores made an FSDP step 7x slower here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Each rank is its own pytest process: with one shared base folder, the ranks create
    # and prune numbered tmp_path folders in it at once, and pytest's scan of that folder
    # could meet one the other rank was removing (an unclosed scandir iterator, turned
    # into an error by filterwarnings at exit). A folder of its own per rank instead.
    if config.option.basetemp is None:
        rank = MPI.COMM_WORLD.Get_rank()
        config.option.basetemp = tempfile.mkdtemp(prefix=f"ccoll-pytest-rank{rank}-")
        config._ccoll_basetemp = config.option.basetemp  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    own = getattr(config, "_ccoll_basetemp", None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)


@pytest.fixture
def comm() -> MPI.Intracomm:
    """A private duplicate of COMM_WORLD for one test."""
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(
            f"\n[rank {rank}] {report.nodeid} FAILED ({report.when}); aborting all ranks\n"
            f"{report.longreprtext}\n"
        )
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every rank must run the same tests in the same order.
    items.sort(key=lambda it: it.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    terminalreporter.write_line(
        f"rank {MPI.COMM_WORLD.Get_rank()} of {MPI.COMM_WORLD.Get_size()} finished"
    )


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(thread name, numba's count) at every parallel launch of the CPU compressor."""
    import threading
    from contextlib import contextmanager

    import numba

    from ccoll.compressor.cpu import blocks
    from ccoll.runtime import cpu_threads

    seen: list[tuple[str, int]] = []
    real = blocks.parallel_launch

    @contextmanager
    def spy():  # type: ignore[no-untyped-def]
        with real():
            seen.append((threading.current_thread().name, numba.get_num_threads()))
            yield

    monkeypatch.setattr(blocks, "parallel_launch", spy)
    monkeypatch.setattr(cpu_threads, "_count", None)  # as in a fresh process
    monkeypatch.delenv("CCOLL_THREADS", raising=False)
    return seen


@pytest.fixture
def state_factory():  # type: ignore[no-untyped-def]
    """Make ``ccoll.torch.CCollHookState`` objects (``policy="compress"`` unless given) and
    close them all after the test (the hook's default policy sends small buckets raw: the
    tests of compression ask for it, the policy tests pass their own)."""
    import ccoll.torch as ct

    made: list = []

    def make(**kw):  # type: ignore[no-untyped-def]
        kw.setdefault("policy", "compress")
        s = ct.CCollHookState(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
