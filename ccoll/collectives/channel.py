"""A private communicator plus what its collectives reuse: buffers, a compute thread, stats.

A :class:`~ccoll.collectives.communicator.Communicator` has two channels, one for blocking
calls (the caller's thread) and one for ``iallreduce`` (the progress engine's thread), so
the two never share a buffer, a worker or MPI messages.

A channel owns its duplicate communicator, its worker (whose host tasks run on the lanes of
the process-wide CPU scheduler, see docs/scheduler.md) and its receive buffers
(sized for worst-case streams): :meth:`Channel.close` releases them and frees the
communicator. Garbage collection of a channel that was never closed (a
``weakref.finalize``) stops the worker and drops the buffers but leaves the communicator
to ``MPI_Finalize``: ``MPI_Comm_free`` is collective in the MPI standard, and a garbage
collector runs at a point of its own on each rank (or on one rank only, where another
still holds the object), possibly on a thread that is inside another collective. MPICH and
Open MPI free locally (the call only drops a reference), but ccoll does not rely on it:
:meth:`close` is the one place that frees, and every rank calls it (docs/collectives.md,
"Ordering rules"). :data:`LEAKED` counts the communicators left that way.

Pooled buffers do not stay for life: a buffer that no call of the channel has needed for
:data:`IDLE_CALLS` calls is released (one "needs" a buffer when it asks for at least half
of it), and host receive buffers are anonymous mappings, so that releasing one gives its
pages back to the system at once. The choice is local to the rank and changes no
collective (docs/collectives.md, "Memory").

Closing a channel while a request of the progress engine runs a call on it (an
``iallreduce``, a DDP hook bucket) or waits in the engine's queue fails those requests
with :class:`~ccoll.errors.CollectiveError` (:func:`ccoll.runtime.progress.cancel`): the
running one stops at its next wait, the queued ones never start, the engine goes on with
the next request. The communicator of a call stopped that way is not freed, as after a
failure (:meth:`Channel.fail`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import weakref
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ccoll.collectives import waiting
from ccoll.collectives.worker import Worker
from ccoll.errors import CollectiveError
from ccoll.gpu_sched.scheduler import Scheduler, configured_on, default_scheduler
from ccoll.runtime import progress
from ccoll.runtime.mpilife import FINALIZED, finalized_error

__all__ = ["Channel", "Stats", "IDLE_CALLS", "LEAKED"]

#: Calls of a channel after which a pooled buffer that none of them needed is released.
IDLE_CALLS = 32
# Pools are trimmed every this many calls (a buffer goes after IDLE_CALLS to that + this).
_TRIM_EVERY = 8
# Receive buffers from this size on are anonymous mappings of their own (released to the
# system when dropped); smaller ones come from numpy's allocator.
_MAP_FROM = 1 << 16
# Releasing at least this much also asks the C allocator to return its free memory.
_HEAP_TRIM_FROM = 1 << 20

#: Private communicators of channels garbage-collected unclosed in this process, left to
#: ``MPI_Finalize`` (``[count]``; see the module's docstring).
LEAKED = [0]


@dataclass
class Stats:
    """Counters of one channel; ``bytes_sent`` counts payload this rank put on the wire.

    Point-to-point sends are counted exactly. For MPI collectives called inside ccoll
    (``Allgatherv``, ``Bcast``, the exact path) the count is what a ring (for bcast: a
    pipeline) algorithm sends from this rank, since MPI does not report its traffic.
    ``bytes_input`` is the size of the input data of each call. ``bytes_coded`` counts the
    compressed streams that a call's report measures its ratio on where this rank sent
    nothing (one rank, a broadcast's last rank): this rank's reduced blocks, its own
    allgather stream, the broadcast stream.
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_input: int = 0
    bytes_coded: int = 0
    compressed_calls: int = 0
    last: dict[str, float] = field(default_factory=dict)


class Channel:
    """One private duplicate of the user's communicator and the state its calls reuse."""

    def __init__(self, comm: MPI.Intracomm, name: str, timeout: float | None, *,
                 lanes: bool = True) -> None:
        self.comm = comm
        self.name = name
        self.timeout = timeout
        # Fixed for the channel's life: the communicator's size (asked on every call).
        self.size = comm.Get_size()
        # Host tasks run on the lanes of the process-wide CPU scheduler (CCOLL_SCHED).
        self.lanes = lanes
        self.worker = Worker(f"ccoll-{name}-worker",
                             lanes=_process_lanes if lanes else _no_lanes)
        self.stats = Stats()
        self.failed: str | None = None
        self._closing = False
        self._calls = 0  # calls started on this channel (check_usable)
        self._trim_at = _TRIM_EVERY
        # Receive buffers, and the call that last needed each.
        self._pool: list[np.ndarray] = []
        self._pool_seen: list[int] = []
        # Pinned buffers not lent out; the call that last needed each pinned buffer of the
        # channel (pooled or lent), by id.
        self._pinned: list[np.ndarray] = []
        self._pinned_seen: dict[int, int] = {}
        self._lent: dict[int, np.ndarray] = {}  # pinned buffers handed out, by id
        # [failed]: shared with the finalizer, which must not free a failed communicator;
        # [free]: set by close(), the one caller that may free it (collectively: every
        # rank closes), never garbage collection.
        self._failed_flag = [False]
        self._free = [False]
        # [released]: set by the finalizer when it runs (close(), or at the interpreter's
        # exit), read by every call (cheaper than asking the finalizer whether it is alive).
        self._released = [False]
        self._finalizer = weakref.finalize(self, _release, comm, self.worker,
                                           self._failed_flag, self._free, self._released)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the communicator was freed)."""
        return self._closing or self._released[0]

    def check_usable(self) -> None:
        """Raise :class:`CollectiveError` if an earlier call on this channel failed midway.

        Every call starts here (a repeated call too: kept to a few attribute reads): on the
        progress engine's thread it also notes that the request uses this channel, so that
        :meth:`close` can stop it.
        """
        progress.uses(self)
        calls = self._calls = self._calls + 1
        if calls >= self._trim_at:
            self._trim_at = calls + _TRIM_EVERY
            self.trim()
        if self._closing or self._released[0] or FINALIZED[0]:
            if FINALIZED[0]:
                raise finalized_error("a collective of this ccoll Communicator")
            raise CollectiveError("this ccoll Communicator has been closed (freed)")
        if self.failed is not None:
            raise CollectiveError(
                f"this ccoll Communicator cannot be used after an earlier collective failed on "
                f"this rank ({self.failed}); its messages may still be in flight. Create a new "
                "ccoll.Communicator (and make sure every rank does)"
            )

    def fail(self, reason: str) -> None:
        """Mark the channel unusable: receives may still land in its buffers.

        Its communicator is then never freed: messages of the failed call may still be on
        their way to it, and MPI reuses a freed communicator's context for the next one
        made, where they would be matched by that one's receives (seen: a ring receiving
        a stream of a halving call that had timed out). One leaked communicator per
        failed call is the price.
        """
        self.failed = reason
        self._failed_flag[0] = True
        # Never hand these buffers out again, and never free them: MPI may still write
        # into them (an operation of the failed call left pending).
        self.abandon(self._pool, self._pinned, list(self._lent.values()))
        self._drop_pools()
        self.worker.discard()

    def abandon(self, *objs: object) -> None:
        """Keep ``objs`` alive for good: see :func:`ccoll.collectives.waiting.abandon`."""
        waiting.abandon(*objs)

    def recv_buffers(self, count: int, nbytes: int) -> list[np.ndarray]:
        """``count`` host byte buffers of at least ``nbytes`` each, reused across calls."""
        pool, seen, now = self._pool, self._pool_seen, self._calls
        for i in range(count):
            if i == len(pool):
                pool.append(_host_buffer(nbytes))
                seen.append(now)
            elif pool[i].size < nbytes:
                pool[i] = _host_buffer(nbytes)
                seen[i] = now
            elif 2 * nbytes >= pool[i].size:
                seen[i] = now
        return pool[:count]

    def pinned(self, nbytes: int) -> np.ndarray:
        """Return a pinned host buffer of at least ``nbytes`` from this channel's pool.

        The smallest pooled one that is large enough, else a new one.
        """
        best = -1
        for i, buf in enumerate(self._pinned):
            if buf.size >= nbytes and (best < 0 or buf.size < self._pinned[best].size):
                best = i
        if best >= 0:
            buf = self._pinned.pop(best)
        else:
            from numba import cuda

            buf = cuda.pinned_array(max(nbytes, 4096), dtype=np.uint8)
        if 2 * nbytes >= buf.size or id(buf) not in self._pinned_seen:
            self._pinned_seen[id(buf)] = self._calls
        self._lent[id(buf)] = buf
        return buf

    def unpin(self, buf: np.ndarray) -> None:
        """Return a buffer from :meth:`pinned` to the pool."""
        self._lent.pop(id(buf), None)
        if self.failed is None and not self._closing:
            self._pinned.append(buf)
        else:
            self._pinned_seen.pop(id(buf), None)

    def trim(self) -> int:
        """Release pooled buffers that no call needed for :data:`IDLE_CALLS` calls.

        Local to this rank: which buffers a rank keeps changes no collective. Returns
        the bytes released.
        """
        oldest = self._calls - IDLE_CALLS
        freed = 0
        if any(t < oldest for t in self._pool_seen):
            keep = [i for i, t in enumerate(self._pool_seen) if t >= oldest]
            freed += sum(b.size for b in self._pool) - sum(self._pool[i].size for i in keep)
            self._pool = [self._pool[i] for i in keep]
            self._pool_seen = [self._pool_seen[i] for i in keep]
        pinned_seen = self._pinned_seen
        kept: list[np.ndarray] = []
        for buf in self._pinned:
            if pinned_seen.get(id(buf), oldest) < oldest:
                del pinned_seen[id(buf)]
                freed += buf.size
            else:
                kept.append(buf)
        self._pinned = kept
        if freed >= _HEAP_TRIM_FROM:
            _trim_heap()
        return freed

    def _drop_pools(self) -> None:
        self._pool, self._pool_seen = [], []
        self._pinned, self._pinned_seen, self._lent = [], {}, {}

    def close(self, *, free: bool = True) -> None:
        """Stop the worker, drop the buffers and free the private communicator (once).

        ``MPI_Comm_free`` is collective: call it with ``free=True`` (the default) on every
        rank; ``free=False`` leaves the communicator to ``MPI_Finalize`` (what garbage
        collection does, see the module's docstring). Requests of the progress engine on
        this channel fail with :class:`CollectiveError`; if one was running, its MPI
        operations may still be pending, and the communicator is left unfreed (see
        :meth:`fail`).
        """
        if free and self._finalizer.alive:
            self._free[0] = True
        if not self._closing:
            self._closing = True
            if progress.cancel((self, self.comm), _CLOSED):
                self._failed_flag[0] = True
                self.abandon(self._pool, self._pinned, list(self._lent.values()))
        self._drop_pools()
        self._finalizer()


_CLOSED = ("its ccoll Communicator was closed before the request finished (wait for "
           "every request before close())")


def _host_buffer(nbytes: int) -> np.ndarray:
    """Return a host byte buffer: from ``_MAP_FROM`` bytes on, an anonymous mapping.

    Its pages go back to the system as soon as the last reference goes (``munmap``), where
    memory from the C allocator could stay with the process; and dropping it does not raise
    the allocator's threshold for mapping later allocations.
    """
    if nbytes < _MAP_FROM:
        return np.empty(nbytes, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


_libc: list[object] = []


def _trim_heap() -> None:
    """Ask glibc to return the free memory of its heaps to the system (else nothing)."""
    if not _libc:
        name = ctypes.util.find_library("c")
        lib: object = None
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            pass
        _libc.append(getattr(lib, "malloc_trim", None))
    fn = _libc[0]
    if fn is not None:
        fn(0)  # type: ignore[operator]


def _process_lanes() -> Scheduler | None:
    """Return the process-wide CPU scheduler whose lanes run host tasks (None: off)."""
    return default_scheduler("cpu") if configured_on() else None


def _no_lanes() -> Scheduler | None:
    """No lanes: the channel's worker runs its host tasks on a thread of its own."""
    return None


def _release(comm: MPI.Intracomm, worker: Worker, failed: list[bool],
             free: list[bool], released: list[bool]) -> None:
    # Holds no reference to the Channel (weakref.finalize would then never run). Runs from
    # close() (free[0] set: every rank frees here) or at garbage collection (not set).
    released[0] = True
    worker.close()
    if failed[0]:
        return  # see Channel.fail: a failed call's messages must not reach a later one
    if comm == MPI.COMM_NULL or MPI.Is_finalized():
        return
    if not free[0]:
        LEAKED[0] += 1  # see the module's docstring: no MPI_Comm_free from a collector
        return
    comm.Free()
