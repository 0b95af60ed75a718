"""numba's thread pool: set up right before the first parallel kernel, safe with any layer.

Each case runs in a fresh interpreter: the threading layer and the OpenMP wait policy are
fixed once per process, when numba's pool starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    full_env.update(PYTHONPATH=ROOT, **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )


def test_workqueue_layer_with_two_threads_compressing_at_once():
    # numba's workqueue pool aborts the process when two threads launch parallel kernels at
    # once ("Nested parallel kernel launch detected"); ccoll must serialize them and say so.
    p = _run(
        """
        import threading, warnings
        import numpy as np
        warnings.simplefilter("always")
        import ccoll
        from ccoll.compressor import compress_abs, decompress, add

        rng = np.random.default_rng(0)
        xs = [rng.standard_normal(1 << 20).astype(np.float32) for _ in range(2)]
        start = threading.Barrier(2)
        out = [[], []]
        errors = []

        def work(i):
            try:
                start.wait(30)
                for _ in range(20):
                    s = compress_abs(xs[i], 1e-3)
                    out[i].append((s.tobytes(), decompress(s).tobytes(), add(s, s).tobytes()))
            except BaseException as exc:
                errors.append(repr(exc))

        with warnings.catch_warnings(record=True) as caught:
            ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        assert not errors, errors
        import numba
        print("LAYER", numba.threading_layer())
        for i in range(2):
            s = compress_abs(xs[i], 1e-3)
            want = (s.tobytes(), decompress(s).tobytes(), add(s, s).tobytes())
            assert all(got == want for got in out[i]), "a concurrent result differs"
        mine = [w for w in caught if w.category.__name__ == "ThreadingLayerWarning"]
        print("WARNINGS", len(mine))
        print("MESSAGE", mine[0].message if mine else "")
        """,
        NUMBA_THREADING_LAYER="workqueue",
        NUMBA_NUM_THREADS="2",  # a pool of 2 on any runner: the launches must overlap
    )
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "LAYER workqueue" in p.stdout
    assert "WARNINGS 1\n" in p.stdout, p.stdout  # said once, not per launch
    assert "install tbb" in p.stdout and "NUMBA_THREADING_LAYER" in p.stdout, p.stdout


def test_omp_wait_policy_is_set_at_the_first_kernel_not_at_import():
    p = _run(
        """
        import os
        import numpy as np
        import ccoll
        print("IMPORT", os.environ.get("OMP_WAIT_POLICY"))
        ccoll.compress(np.ones(1 << 17, np.float32), ccoll.ABS(1e-3))
        print("KERNEL", os.environ.get("OMP_WAIT_POLICY"))
        """
    )
    assert p.returncode == 0, p.stderr
    assert "IMPORT None" in p.stdout and "KERNEL PASSIVE" in p.stdout, p.stdout


def test_omp_wait_policy_set_by_the_user_is_kept():
    p = _run(
        """
        import os
        import numpy as np
        import ccoll
        ccoll.compress(np.ones(1 << 17, np.float32), ccoll.ABS(1e-3))
        print("KERNEL", os.environ.get("OMP_WAIT_POLICY"))
        """,
        OMP_WAIT_POLICY="ACTIVE",
    )
    assert p.returncode == 0, p.stderr
    assert "KERNEL ACTIVE" in p.stdout, p.stdout


def test_cpu_lane_prepares_the_pool_before_sizing_it():
    # A CPU lane sets its numba thread count when it starts, which starts numba's pool: the
    # wait policy must be in place by then.
    p = _run(
        """
        import os
        from ccoll.gpu_sched import Scheduler
        with Scheduler("cpu", max_sm_fraction=0.5) as s:
            s.lane("compress").submit(lambda: None).wait(30)
            print("LANE", os.environ.get("OMP_WAIT_POLICY"))
        """,
        NUMBA_NUM_THREADS="2",  # half of a pool of 2 is 1: the lane sets its count
    )
    assert p.returncode == 0, p.stderr
    assert "LANE PASSIVE" in p.stdout, p.stdout


def test_a_first_kernel_leaves_torchs_thread_count_alone():
    # numba's OpenMP layer set the launching thread's OpenMP thread count to its pool's,
    # and PyTorch's intra-op count is that thread's too: a training thread whose first
    # ccoll kernel ran there went from OMP_NUM_THREADS=1 to 2 threads per backward pass.
    pytest.importorskip("torch")
    p = _run(
        """
        import numpy as np
        import torch
        import ccoll
        before = torch.get_num_threads()
        ccoll.compress(np.ones(1 << 17, np.float32), ccoll.ABS(1e-3))
        print("THREADS", before, torch.get_num_threads())
        """,
        OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="2",
    )
    assert p.returncode == 0, p.stderr
    assert "THREADS 1 1" in p.stdout, p.stdout


def test_the_layers_count_functions_read_and_set_what_numbas_public_ones_do():
    # cpu_threads.counts(): the threading layer's own get/set of this thread's count, which
    # ccoll's launches use instead of numba's checked public functions; the same count
    # either way, per thread, in a fresh process (the pool started by counts()).
    proc = _run("""
        import threading
        import numba
        from ccoll.runtime import cpu_threads
        get, put = cpu_threads.counts()
        pool = cpu_threads.pool_size()
        assert get() == numba.get_num_threads() == pool, (get(), pool)
        for n in range(1, pool + 1):
            put(n)
            assert numba.get_num_threads() == n == get()
            numba.set_num_threads(pool - n + 1)
            assert get() == pool - n + 1
        put(1)
        seen = []
        t = threading.Thread(target=lambda: seen.append((get(), numba.get_num_threads())))
        t.start(); t.join()
        assert seen == [(pool, pool)], seen  # another thread keeps its own count
        assert get() == 1
        print("ok")
    """, NUMBA_NUM_THREADS="2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
