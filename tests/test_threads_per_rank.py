"""Threads per rank: the arithmetic, the precedence of the environment, and where it applies.

The cases that need numba's pool at a known size run in a fresh interpreter with
``NUMBA_NUM_THREADS=2`` (the pool is sized once, when numba loads; this fixes it at 2 even
on a one-core runner, so that a count of 1 is distinguishable from the pool).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ccoll.errors import CCollError, InputError
from ccoll.runtime import cpu_threads
from ccoll.runtime.cpu_threads import env_threads, threads_per_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EIGHT = frozenset(range(8))


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("CCOLL_THREADS", "NUMBA_NUM_THREADS", "OMP_WAIT_POLICY")}
    full.update(PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=300, env=full, cwd=ROOT)


@pytest.mark.parametrize(
    ("mine", "node", "pool", "want"),
    [
        (EIGHT, [EIGHT] * 4, 8, 2),  # 4 ranks share 8 cores
        (EIGHT, [EIGHT] * 3, 8, 2),  # 8/3 rounds down
        (EIGHT, [EIGHT], 8, 8),  # alone on the node
        (EIGHT, [EIGHT], 4, 4),  # capped at numba's pool
        (frozenset({0, 1}), [frozenset({0, 1})] * 5, 2, 1),  # more ranks than cores: 1
        (frozenset({0}), [frozenset({0})] * 3, 1, 1),
        # pinned ranks (taskset, srun --cpu-bind) keep their own cores
        (frozenset(range(4)), [frozenset(range(4)), frozenset(range(4, 8))], 8, 4),
        # one rank on 0-3, one on 0-7: 0-3 are shared, 4-7 are the second rank's alone
        (frozenset(range(4)), [frozenset(range(4)), EIGHT], 8, 2),
        (EIGHT, [frozenset(range(4)), EIGHT], 8, 6),
    ],
)
def test_share_of_the_cores(mine, node, pool, want):
    n, why = threads_per_rank(mine, node, {}, pool)
    assert n == want
    assert f"{len(mine)} cores shared by {len(node)} rank(s)" in why


def test_numba_num_threads_in_the_environment_wins_over_the_share():
    # The user sized numba's pool: ccoll uses all of it, whatever the node looks like.
    assert threads_per_rank(EIGHT, [EIGHT] * 4, {"NUMBA_NUM_THREADS": "6"}, 6) == (
        6, "NUMBA_NUM_THREADS")
    # Unset or empty: the share.
    assert threads_per_rank(EIGHT, [EIGHT] * 4, {"NUMBA_NUM_THREADS": ""}, 8)[0] == 2


def test_ccoll_threads_wins_over_everything_and_is_capped_at_the_pool():
    env = {"CCOLL_THREADS": "3", "NUMBA_NUM_THREADS": "8"}
    assert threads_per_rank(EIGHT, [EIGHT] * 4, env, 8) == (3, "CCOLL_THREADS")
    assert threads_per_rank(EIGHT, [EIGHT], {"CCOLL_THREADS": " 1 "}, 8) == (1, "CCOLL_THREADS")
    n, why = threads_per_rank(EIGHT, [EIGHT], {"CCOLL_THREADS": "16"}, 8)
    assert n == 8 and "capped at numba's pool of 8" in why


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_ccoll_threads_is_an_input_error_that_names_it(value):
    n, problem = env_threads({"CCOLL_THREADS": value})
    assert n is None and problem is not None
    assert f"CCOLL_THREADS={value!r}" in problem and "whole number >= 1" in problem
    with pytest.raises(InputError, match="CCOLL_THREADS") as info:
        threads_per_rank(EIGHT, [EIGHT], {"CCOLL_THREADS": value}, 8)
    assert isinstance(info.value, CCollError)


def test_the_process_count_is_the_smallest_share_unless_set_outright(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_count", None)
    assert cpu_threads.set_thread_count(4) == 4
    assert cpu_threads.set_thread_count(2) == 2  # more ranks on the node seen: fewer threads
    assert cpu_threads.set_thread_count(8) == 2  # a communicator with fewer ranks: kept
    assert cpu_threads.set_thread_count(3, explicit=True) == 3  # CCOLL_THREADS
    assert cpu_threads.thread_count() == 3
    with pytest.raises(InputError, match=">= 1"):
        cpu_threads.set_thread_count(0)


def test_the_count_reaches_the_thread_that_launches_the_kernel():
    # numba's count is per thread: a new thread (a worker, the progress engine) starts at the
    # pool size, so the count must be applied where the kernel is launched, and undone after.
    p = _run(
        """
        import threading
        import numba
        from ccoll.runtime import cpu_threads

        @numba.njit(parallel=True)
        def inside():
            return numba.get_num_threads()  # what the kernel itself runs with

        cpu_threads.set_thread_count(1)
        out = {}
        def work(name, own=None):
            if own is not None:
                numba.set_num_threads(own)
            with cpu_threads.parallel_launch():
                out[name] = (numba.get_num_threads(), inside())
            out[name + " after"] = numba.get_num_threads()
        for args in (("worker",), ("own", 1)):
            t = threading.Thread(target=work, args=args)
            t.start()
            t.join()
        work("caller")
        print("POOL", numba.config.NUMBA_NUM_THREADS)
        for k in sorted(out):
            print(k.upper().replace(" ", "_"), out[k])
        """,
        NUMBA_NUM_THREADS="2",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "POOL 2\n" in p.stdout
    assert "WORKER (1, 1)\n" in p.stdout and "WORKER_AFTER 2\n" in p.stdout, p.stdout
    assert "CALLER (1, 1)\n" in p.stdout and "CALLER_AFTER 2\n" in p.stdout, p.stdout
    assert "OWN (1, 1)\n" in p.stdout and "OWN_AFTER 1\n" in p.stdout, p.stdout


def test_a_thread_that_chose_a_lower_count_keeps_it():
    p = _run(
        """
        import numba
        from ccoll.runtime import cpu_threads
        cpu_threads.set_thread_count(2)
        numba.set_num_threads(1)  # e.g. a CPU lane's share
        with cpu_threads.parallel_launch():
            print("INSIDE", numba.get_num_threads())
        """,
        NUMBA_NUM_THREADS="3",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "INSIDE 1\n" in p.stdout, p.stdout


def test_ccoll_threads_applies_without_a_communicator():
    p = _run(
        """
        import numpy as np
        import numba
        import ccoll
        from ccoll.runtime import cpu_threads
        print("BEFORE", cpu_threads.thread_count())
        ccoll.compress(np.ones(1 << 17, np.float32), ccoll.REL(1e-3))
        print("AFTER", cpu_threads.thread_count())
        with cpu_threads.parallel_launch():
            print("INSIDE", numba.get_num_threads())
        """,
        NUMBA_NUM_THREADS="2",
        CCOLL_THREADS="1",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "BEFORE None\nAFTER 1\nINSIDE 1\n" in p.stdout, p.stdout


def test_a_bad_ccoll_threads_fails_the_first_kernel_with_the_fix():
    p = _run(
        """
        import numpy as np
        import ccoll
        try:
            ccoll.compress(np.ones(1 << 17, np.float32), ccoll.ABS(1e-3))
        except ccoll.CCollError as exc:
            print("RAISED", type(exc).__name__, exc)
        """,
        CCOLL_THREADS="many",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RAISED InputError CCOLL_THREADS='many' is not a thread count" in p.stdout, p.stdout
