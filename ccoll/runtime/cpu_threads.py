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
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ThreadingLayerWarning", "prepare", "parallel_launch", "threading_layer"]

# Threading layers whose pool may be entered by several threads at once (numba docs,
# "Selecting a threading layer for safe parallel execution").
SAFE_LAYERS = ("tbb", "omp")


class ThreadingLayerWarning(RuntimeWarning):
    """numba's threading layer is not thread-safe; ccoll serializes its parallel kernels."""


_prepare_lock = threading.Lock()
_layer: str | None = None
_serial = threading.RLock()  # held across each parallel launch when the layer is unsafe


def prepare() -> str:
    """Set the OpenMP wait policy, start numba's pool and return its threading layer.

    Idempotent and thread-safe; call it before anything that starts numba's thread pool
    (a parallel kernel, ``numba.get_num_threads``/``set_num_threads``).
    """
    global _layer
    layer = _layer
    if layer is not None:
        return layer
    with _prepare_lock:
        if _layer is not None:
            return _layer
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import numba
        from numba.np.ufunc import parallel

        parallel._launch_threads()  # what numba's first parallel launch does itself
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


@contextmanager
def parallel_launch() -> Iterator[None]:
    """Run the parallel kernel launches inside safely for the process's threading layer.

    Prepares the process on first use; with an unsafe layer (``workqueue``) the launches of
    all threads take turns on one lock.
    """
    if prepare() in SAFE_LAYERS:
        yield
        return
    with _serial:
        yield
