"""Preparing the process for numba's parallel CPU kernels, once, right before the first one.

ccoll launches parallel (``prange``) kernels from several threads at once: the caller's,
the progress engine's (:mod:`ccoll.runtime.progress`) and the CPU lanes' workers
(:mod:`ccoll.gpu_sched.thread_lanes`). Two things must be settled before numba starts its
thread pool, and :func:`prepare` does both, the first time any of those threads is about to
launch a kernel or size the pool (nothing happens at ``import ccoll``):

- ``OMP_WAIT_POLICY=PASSIVE`` is set unless the user set it: numba's OpenMP pool otherwise
  spins while idle, and MPI ranks that share cores (several ranks per node, or the progress
  thread beside training) then steal each other's cores, so a 2 ms kernel can take a second.
  Passive waiting costs nothing measurable when cores are free. OpenMP reads the variable
  once, when its runtime loads with the pool; set later, it has no effect.
- The threading layer is read. ``tbb`` and ``omp`` accept launches from many threads at
  once. ``workqueue`` (what numba falls back to when neither TBB nor an OpenMP runtime is
  found, or what ``NUMBA_THREADING_LAYER=workqueue`` asks for) does not: two concurrent
  launches abort the process ("Terminating: Nested parallel kernel launch detected").
  With it, ccoll serializes its parallel launches on one process-wide lock and says so once
  with a :class:`ThreadingLayerWarning` that names the fix (install ``tbb``, or use an
  OpenMP runtime, and leave ``NUMBA_THREADING_LAYER`` unset or set it to ``safe``).

Every parallel kernel launch in ccoll runs inside :func:`parallel_launch`.

Threads per kernel. numba sizes its pool from the cores the process may run on, which is
right for one process per machine and wrong for several MPI ranks on one node: each rank's
kernels then ask for every core, and the ranks' threads wait for each other's time slices.
A :class:`~ccoll.Communicator` therefore sets the number of threads ccoll's kernels use in
this process (:func:`set_thread_count`, from :func:`threads_per_rank`) when it is created:
the rank's fair share of the cores it may run on, among the ranks of its node that may run
on them too (``os.sched_getaffinity`` and the ranks' host names). ``CCOLL_THREADS=N``
sets the count outright (also for ``ccoll.compress`` without any Communicator);
``NUMBA_NUM_THREADS`` in the environment sizes numba's pool and then wins over the share.
:func:`parallel_launch` applies the count in whichever thread launches the kernel (numba's
count is per thread), unless that thread chose its own with ``numba.set_num_threads``; on
a CPU lane of :mod:`ccoll.gpu_sched` the smaller of the count and the lane's ``grid_limit``
applies.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Collection, Mapping, Sequence
from fractions import Fraction
from typing import Any

from ccoll.errors import InputError
from ccoll.gpu_sched.lanes import current_lane

__all__ = [
    "ThreadingLayerWarning",
    "prepare",
    "parallel_launch",
    "threading_layer",
    "allowed_cpus",
    "threads_per_rank",
    "env_threads",
    "set_thread_count",
    "use_setting",
    "thread_count",
    "pool_size",
]

ENV_THREADS = "CCOLL_THREADS"

# Threading layers whose pool may be entered by several threads at once (numba docs,
# "Selecting a threading layer for safe parallel execution").
SAFE_LAYERS = ("tbb", "omp")


class ThreadingLayerWarning(RuntimeWarning):
    """numba's threading layer is not thread-safe; ccoll serializes its parallel kernels."""


_prepare_lock = threading.Lock()
_layer: str | None = None
_serial = threading.RLock()  # held across each parallel launch when the layer is unsafe
# Threads per parallel kernel for the whole process (None: numba's own count per thread)
# and numba's pool size, fixed when numba loads (NUMBA_NUM_THREADS, else the cores).
_count: int | None = None
_count_lock = threading.Lock()
_UNSET: Any = object()
_setting: Any = _UNSET  # CCOLL_THREADS as the latest Communicator's settings read it
_pool = 0


def prepare() -> str:
    """Set the OpenMP wait policy, start numba's pool and return its threading layer.

    Idempotent and thread-safe; call it before anything that starts numba's thread pool
    (a parallel kernel, ``numba.get_num_threads``/``set_num_threads``).
    """
    global _layer, _pool, _count
    layer = _layer
    if layer is not None:
        return layer
    with _prepare_lock:
        if _layer is not None:
            return _layer
        # CCOLL_THREADS: a Communicator's settings where one was made (they were read when
        # it was made), else the environment, read once, here.
        if _setting is not _UNSET:
            explicit = _setting
        else:
            explicit, problem = env_threads(os.environ)
            if problem is not None:
                raise InputError(problem)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import numba
        from numba.np.ufunc import parallel

        # What numba's first parallel launch does itself, on a thread of its own: with the
        # OpenMP layer the launch sets the calling thread's OpenMP thread count to the
        # pool's, which is PyTorch's intra-op count too where torch shares the runtime
        # (seen: torch.get_num_threads() went from OMP_NUM_THREADS=1 to 2 in a training
        # thread that ran a first kernel; 4 ranks on 2 cores then ran each backward pass
        # with 2 spinning threads, 80% of the CPU in the kernel).
        failed: list[BaseException] = []

        def launch() -> None:
            try:
                parallel._launch_threads()
            except BaseException as exc:  # raised below, in the caller's thread
                failed.append(exc)

        starter = threading.Thread(target=launch, name="ccoll-numba-pool")
        starter.start()
        starter.join()
        if failed:
            raise failed[0]
        _pool = pool_size()
        if explicit is not None:
            with _count_lock:
                _count = min(explicit, _pool)
        layer = str(numba.threading_layer())
        if layer not in SAFE_LAYERS:
            warnings.warn(
                f"numba's {layer!r} threading layer is not thread-safe, so ccoll runs its "
                "parallel CPU kernels one at a time (threads that compress at once wait for "
                "each other). For concurrent kernels install tbb (pip install tbb) or an "
                "OpenMP runtime (libgomp), and leave NUMBA_THREADING_LAYER unset or set it "
                "to 'safe'",
                ThreadingLayerWarning,
                stacklevel=3,
            )
        _layer = layer
        return layer


def threading_layer() -> str:
    """Return numba's threading layer, preparing the process first (see :func:`prepare`)."""
    return prepare()


class parallel_launch:  # noqa: N801 - used as a function: ``with parallel_launch():``
    """Run the parallel kernel launches inside safely for the process's threading layer.

    Prepares the process on first use; with an unsafe layer (``workqueue``) the launches of
    all threads take turns on one lock. Inside, the calling thread's numba count is
    :func:`thread_count` (restored on exit), unless the thread set a count of its own.
    A class, not a generator-based context manager: it runs around every kernel launch,
    and a generator's set-up cost about 1.5 us of a few-element kernel's 60.
    """

    __slots__ = ("prev", "lock")

    def __enter__(self) -> None:
        safe = prepare() in SAFE_LAYERS
        n = _count
        self.prev = 0
        if n is not None:
            get, put = counts()
            cur = get()
            # Every thread starts at the pool size; a lower count is the thread's own
            # choice (numba.set_num_threads: a caller's), which stays. A CPU lane's count is
            # its grid_limit, a cap of its own: the rank's share applies below it too.
            if (cur == _pool or current_lane() is not None) and n < cur:
                self.prev = cur
                put(n)
        self.lock = None if safe else _serial
        if self.lock is not None:
            self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        try:
            if self.lock is not None:
                self.lock.release()
        finally:
            if self.prev:
                counts()[1](self.prev)


_counts: tuple[Any, Any] | None = None


def counts() -> tuple[Any, Any]:
    """``(get, put)`` of this thread's numba thread count, without the Python API's checks.

    ``numba.get_num_threads()`` and ``set_num_threads()`` make sure the pool is up (a lock)
    and check their argument on every call: 1-2.5 us each, and ccoll's launches make up to
    four of them around each kernel (a few-element kernel then cost more in them than in
    its work). Once :func:`prepare` has started the pool, the threading layer's own
    functions that they call (``numba.np.ufunc.parallel._get_num_threads`` and
    ``_set_num_threads``, 0.2-0.5 us) read and set the same thread-local count; where a
    numba lacks them, the public functions. ccoll only passes counts in
    ``1..pool_size()``.
    """
    global _counts
    got = _counts
    if got is None:
        prepare()
        import numba
        from numba.np.ufunc import parallel

        get = getattr(parallel, "_get_num_threads", None)
        put = getattr(parallel, "_set_num_threads", None)
        if not (callable(get) and callable(put)):
            get, put = numba.get_num_threads, numba.set_num_threads
        got = _counts = (get, put)
    return got


def pool_size() -> int:
    """Return numba's pool size: ``NUMBA_NUM_THREADS``, else the cores the process may use."""
    from numba import config

    cfg: Any = config  # attributes set at numba import from the environment
    return int(cfg.NUMBA_NUM_THREADS)


def allowed_cpus() -> frozenset[int]:
    """Return the cores this process may run on (its affinity; all where that is unknown)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def env_threads(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    """Read ``CCOLL_THREADS``: ``(count, None)``, ``(None, None)`` if unset, or a problem."""
    raw = env.get(ENV_THREADS, "").strip()
    if not raw:
        return None, None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        return None, (
            f"{ENV_THREADS}={env[ENV_THREADS]!r} is not a thread count: set it to a whole "
            f"number >= 1 (threads per rank for ccoll's CPU kernels), or unset it to use the "
            "rank's share of its node's cores"
        )
    return n, None


def threads_per_rank(mine: Collection[int], node: Sequence[Collection[int]],
                     env: Mapping[str, str], pool: int) -> tuple[int, str]:
    """Threads for this rank's kernels, and where the number comes from.

    ``mine``: the cores this rank may run on; ``node``: the same for every rank of its node
    (this one included). In order: ``CCOLL_THREADS`` (capped at numba's ``pool``);
    ``NUMBA_NUM_THREADS`` set in ``env`` (the pool it sized); else this rank's fair share:
    each of its cores counts ``1/k`` when ``k`` ranks of the node may run on it, rounded
    down, at least 1, at most ``pool``. Ranks that share all cores split them evenly;
    ranks pinned to separate cores keep theirs.
    """
    explicit, problem = env_threads(env)
    if problem is not None:
        raise InputError(problem)
    if explicit is not None:
        if explicit > pool:
            return pool, f"{ENV_THREADS}={explicit}, capped at numba's pool of {pool}"
        return explicit, ENV_THREADS
    if env.get("NUMBA_NUM_THREADS", "").strip():
        return pool, "NUMBA_NUM_THREADS"
    users: dict[int, int] = {}
    for cpus in node:
        for c in cpus:
            users[c] = users.get(c, 0) + 1
    share = sum((Fraction(1, users.get(c, 1)) for c in mine), Fraction(0))
    n = max(1, min(pool, int(share)))
    return n, f"{len(mine)} cores shared by {len(node)} rank(s) on this node"


def use_setting(threads: int | None) -> None:
    """Take ``CCOLL_THREADS`` from a Communicator's settings (the latest one made).

    The process's first parallel kernel then uses it instead of reading the environment.
    """
    global _setting
    with _count_lock:
        _setting = threads


def set_thread_count(n: int, *, explicit: bool = False) -> int:
    """Make ``n`` the threads of ccoll's parallel kernels in this process; return the count.

    With several Communicators the smallest share wins (the most ranks seen sharing the
    node); ``explicit`` (``CCOLL_THREADS``) sets it outright.
    """
    global _count
    if n < 1:
        raise InputError(f"a thread count must be >= 1, got {n}")
    with _count_lock:
        _count = n if explicit or _count is None else min(_count, n)
        return _count


def thread_count() -> int | None:
    """Threads of ccoll's parallel kernels in this process (``None``: numba's own count)."""
    return _count
