"""Progress engine: FIFO order, errors delivered to the waiter, timeouts, callbacks, shutdown.

Interpreter-exit and MPI thread-level behaviour run in subprocesses (a hang there would
otherwise hang pytest; each has a hard timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from ccoll.errors import CCollError, CCollTimeoutError, CollectiveError
from ccoll.runtime import progress
from ccoll.runtime.progress import ProgressEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocked(eng):
    """Submit a request that runs until the returned gate is set; return once it started."""
    started, gate = threading.Event(), threading.Event()
    r = eng.submit(lambda: (started.set(), gate.wait())[1])
    assert started.wait(10)
    return r, gate


@pytest.fixture
def eng():
    e = ProgressEngine(name="ccoll-progress-test")
    yield e
    e.shutdown(wait=True, timeout=10)


@pytest.mark.parametrize("n", [1, 2, 500])
def test_requests_run_in_submission_order(eng, n):
    ran = []
    reqs = [eng.submit(lambda i: (ran.append(i), i * i)[1], i) for i in range(n)]
    assert [r.wait(timeout=30) for r in reqs] == [i * i for i in range(n)]
    assert ran == list(range(n))


def test_args_and_kwargs_reach_the_function(eng):
    assert eng.submit(lambda a, b, *, c: (a, b, c), 1, 2, c=3).wait(timeout=10) == (1, 2, 3)


def test_one_thread_runs_everything(eng):
    names = [eng.submit(lambda: threading.current_thread().name) for _ in range(20)]
    assert {r.wait(timeout=10) for r in names} == {"ccoll-progress-test"}
    assert eng.thread is not None and eng.thread.daemon


@pytest.mark.parametrize("exc_type", [ValueError, KeyError, CollectiveError, MemoryError])
def test_error_is_delivered_to_the_waiter_and_engine_continues(eng, exc_type):
    err = exc_type("boom in task")

    def fail():
        raise err

    r = eng.submit(fail)
    after = eng.submit(lambda: "still running")
    with pytest.raises(exc_type) as info:
        r.wait(timeout=10)
    assert info.value is err
    assert r.exception() is err
    assert after.wait(timeout=10) == "still running"


def test_timeout_raises_ccoll_timeout_and_request_keeps_running(eng):
    gate = threading.Event()
    r = eng.submit(gate.wait)
    # The gate stays closed until after the wait: a wait that ignored its timeout would
    # never return (pytest's timeout then fails the test).
    with pytest.raises(CCollTimeoutError, match=r"did not finish within 0\.05 s") as info:
        r.wait(timeout=0.05)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, CCollError)
    assert not r.test() and not r.done()
    gate.set()
    assert r.wait(timeout=10) is True
    assert r.test() and r.done()


def test_test_never_blocks(eng):
    gate = threading.Event()
    r = eng.submit(gate.wait)
    # The gate opens only afterwards: a test() that waited for the request would never return.
    assert [r.test() for _ in range(1000)] == [False] * 1000
    gate.set()
    r.wait(timeout=10)


def test_exception_before_finish_is_an_error(eng):
    gate = threading.Event()
    r = eng.submit(gate.wait)
    with pytest.raises(CCollError, match="has not finished"):
        r.exception()
    gate.set()
    r.wait(timeout=10)


def test_done_callback_runs_on_engine_thread_after_finish(eng):
    seen = []
    gate = threading.Event()
    r = eng.submit(lambda: (gate.wait(), 42)[1])
    r.add_done_callback(lambda req: seen.append((threading.current_thread().name, req.wait())))
    assert seen == []
    gate.set()
    r.wait(timeout=10)
    eng.submit(lambda: None).wait(timeout=10)  # the callback ran before the next request
    assert seen == [("ccoll-progress-test", 42)]


def test_done_callback_on_finished_request_runs_at_once(eng):
    r = eng.submit(lambda: 7)
    r.wait(timeout=10)
    seen = []
    r.add_done_callback(lambda req: seen.append(req.wait()))
    assert seen == [7]


def test_failing_callback_does_not_break_the_engine(eng, caplog):
    r = eng.submit(lambda: 1)
    r.add_done_callback(lambda req: 1 / 0)
    assert r.wait(timeout=10) == 1
    assert eng.submit(lambda: 2).wait(timeout=10) == 2
    assert "raised; ignored" in caplog.text


def test_wait_on_engine_thread_for_unfinished_request_is_refused(eng):
    gate = threading.Event()
    later_box = []

    def waits_for_later():
        gate.wait()
        return later_box[0].wait()

    r = eng.submit(waits_for_later)
    later_box.append(eng.submit(lambda: "later"))
    gate.set()
    with pytest.raises(CCollError, match="would deadlock"):
        r.wait(timeout=10)
    assert later_box[0].wait(timeout=10) == "later"


def test_shutdown_fails_pending_requests_and_finishes_running_one(eng):
    running, gate = _blocked(eng)
    pending = [eng.submit(lambda: "never") for _ in range(3)]
    eng.shutdown(wait=False)
    for r in pending:
        with pytest.raises(CollectiveError, match="pending at shutdown"):
            r.wait(timeout=1)
    gate.set()
    assert running.wait(timeout=10) is True
    with pytest.raises(CollectiveError, match="shut down"):
        eng.submit(lambda: None)


def test_shutdown_timeout_abandons_a_stuck_request(eng):
    stuck, gate = _blocked(eng)
    eng.shutdown(wait=True, timeout=0.1)  # the gate is closed: only the timeout ends this
    with pytest.raises(CollectiveError, match="still running"):
        stuck.wait(timeout=1)
    gate.set()


def test_submit_rejects_non_callables(eng):
    with pytest.raises(TypeError, match="callable"):
        eng.submit(42)


def test_module_engine_restarts_after_shutdown():
    assert progress.submit(lambda: 1).wait(timeout=10) == 1
    first = progress.engine()
    progress.shutdown()
    assert first.closed
    assert progress.submit(lambda: 2).wait(timeout=10) == 2
    assert progress.engine() is not first


def _run(script: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )


def test_exit_with_pending_requests_fails_them_and_does_not_hang():
    p = _run(
        """
        import sys, threading
        from ccoll.runtime import progress
        started, release = threading.Event(), threading.Event()
        reqs = [progress.submit(lambda: (started.set(), release.wait(60)))]
        started.wait(10)
        reqs += [progress.submit(print, i) for i in range(4)]
        for r in reqs:
            r.add_done_callback(lambda r: sys.stderr.write(f"DONE {r.name}: {r.exception()}\\n"))
        # The running request returns once exit has failed the queued ones (their callbacks
        # run on the exiting thread, before it waits for the running one).
        reqs[-1].add_done_callback(lambda r: release.set())
        """,
        CCOLL_SHUTDOWN_TIMEOUT="20",
    )
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("pending at shutdown") == 4, p.stderr
    assert "DONE request#0: None" in p.stderr  # the running one was allowed to finish


def test_exit_with_a_stuck_request_gives_up_after_the_timeout():
    p = _run(
        """
        import sys, threading
        from ccoll.runtime import progress
        started = threading.Event()
        r = progress.submit(lambda: (started.set(), threading.Event().wait()))
        started.wait(10)
        r.add_done_callback(lambda r: sys.stderr.write(f"FAILED: {r.exception()}\\n"))
        """,
        CCOLL_SHUTDOWN_TIMEOUT="0.5",
    )
    assert p.returncode == 0, p.stderr
    # The request never returns: exit gave up after the configured timeout, not the default.
    assert "FAILED: request#0 was still running 0.5 s after shutdown" in p.stderr, p.stderr


def test_exit_with_queued_mpi_work_stops_engine_before_mpi_finalize():
    p = _run(
        """
        import sys
        import numpy as np
        from mpi4py import MPI
        from ccoll.runtime import progress
        c = MPI.COMM_WORLD
        def ar(n):
            x = np.arange(n, dtype=np.float64)
            y = np.empty_like(x)
            c.Allreduce(x, y)
            return y
        first = progress.submit(ar, 1000, comm=c)
        assert first.wait(timeout=30)[999] == 999.0 * c.size
        import threading
        started, release = threading.Event(), threading.Event()
        progress.submit(lambda: (started.set(), release.wait(60)))
        started.wait(10)
        for _ in range(3):
            last = progress.submit(ar, 10, comm=c)
            last.add_done_callback(lambda r: sys.stderr.write(f"{r.exception()}\\n"))
        last.add_done_callback(lambda r: release.set())  # as above: once exit failed them
        """,
        CCOLL_SHUTDOWN_TIMEOUT="20",
    )
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("pending at shutdown") == 3, p.stderr


@pytest.mark.parametrize("level", ["single", "funneled", "serialized"])
def test_thread_level_below_multiple_is_a_clear_error(level):
    p = _run(
        f"""
        import mpi4py
        mpi4py.rc.thread_level = {level!r}
        from mpi4py import MPI
        from ccoll.errors import CCollError
        from ccoll.runtime import progress
        assert progress.submit(lambda: 5).wait(timeout=10) == 5  # no MPI: always fine
        try:
            progress.submit(lambda: None, comm=MPI.COMM_WORLD)
        except CCollError as e:
            print("ERR", e)
        else:
            print("NO ERROR")
        """
    )
    assert p.returncode == 0, p.stderr
    assert "ERR" in p.stdout and "needs MPI_THREAD_MULTIPLE" in p.stdout, p.stdout
    assert f"MPI_THREAD_{level.upper()}" in p.stdout
    assert 'mpi4py.rc.thread_level = "multiple"' in p.stdout


def test_thread_level_multiple_is_accepted():
    p = _run(
        """
        from mpi4py import MPI
        from ccoll.runtime import progress
        print("OK", progress.submit(MPI.COMM_WORLD.allreduce, 3, comm=MPI.COMM_WORLD).wait(30))
        """
    )
    assert p.returncode == 0, p.stderr
    assert "OK 3" in p.stdout


class _Overlap:
    """Records whether two requests on one communicator ever ran at the same time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inside = 0
        self.most = 0

    def run(self, gate=None, started=None):
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        if started is not None:
            started.set()
        if gate is not None:
            assert gate.wait(10)
        with self.lock:
            self.inside -= 1
        return threading.current_thread().ident


@pytest.mark.parametrize("how", ["no_wait", "expired"])
def test_new_engine_waits_for_the_old_one_on_the_same_comm(monkeypatch, how):
    # After shutdown(wait=False), or a shutdown whose timeout expired, the old thread still
    # runs its request; a new engine must not start another request on that communicator
    # beside it (two threads in one channel's collectives would mix their messages).
    monkeypatch.setattr(progress, "check_thread_level", lambda: None)
    comm = object()  # stands for a communicator; requests on it must not overlap
    ov = _Overlap()
    started, gate = threading.Event(), threading.Event()
    first = progress.submit(ov.run, gate, started, comm=comm)
    assert started.wait(10)
    if how == "no_wait":
        progress.shutdown(wait=False)
    else:
        progress.shutdown(wait=True, timeout=0.1)  # expires: the gate is still closed
        with pytest.raises(CollectiveError, match="still running"):
            first.wait(timeout=10)
    # Whichever comes first: the new engine's thread holds back (the seam in
    # progress._comm_in_use reports it), or it runs the request beside the old one.
    seen, sign = [], threading.Event()

    def note(what):
        seen.append(what)
        sign.set()

    monkeypatch.setattr(progress, "_on_comm_wait",
                        lambda c: note("held back") if c is comm else None)
    second = progress.submit(lambda: (note("ran"), ov.run())[1], comm=comm)
    assert sign.wait(10)
    assert seen[0] == "held back", "the new engine ran a request on comm beside the old thread"
    assert not second.done()
    gate.set()
    assert second.wait(timeout=10) != first._engine.thread.ident  # the new engine's thread
    assert ov.most == 1, "two engine threads ran requests on one communicator at once"
    progress.shutdown(wait=True, timeout=10)
