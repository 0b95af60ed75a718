"""CPU lanes: one worker thread per lane, running its callables in submission order.

Cross-lane dependencies are :class:`ThreadEvent` objects (a ``threading.Event`` plus the
callable's outcome). The CPU has no stream priorities; a lane below ``compute`` raises its
worker thread's nice value instead (Linux applies ``setpriority`` on a thread id to that
thread only; threads it starts, such as numba's OpenMP team, inherit it), and limits the
numba threads it uses to ``Scheduler.grid_limit(lane)``.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ccoll.errors import CCollError, CCollTimeoutError
from ccoll.gpu_sched.lanes import LANES, Event, Lane, _current_lane

__all__ = ["ThreadEvent", "ThreadLane", "cpu_thread_count", "make_thread_lanes"]

_log = logging.getLogger(__name__)

# Nice value added per priority rank below "compute" (rank 2 -> +10 of 19).
NICE_PER_RANK = 5


def cpu_thread_count() -> int:
    """Return the number of threads numba's parallel kernels may use in this process."""
    from numba import config

    cfg: Any = config  # attributes set at numba import from the environment
    return int(cfg.NUMBA_NUM_THREADS)


class ThreadEvent(Event):
    """Completion of one item of a CPU lane, with the callable's result or exception."""

    __slots__ = ("lane", "_done", "_result", "_exc")

    def __init__(self, lane: ThreadLane | None) -> None:
        self.lane = lane
        self._done = threading.Event()
        self._result: Any = None
        self._exc: BaseException | None = None

    def _set(self, result: Any, exc: BaseException | None) -> None:
        self._result = result
        self._exc = exc
        self._done.set()

    def query(self) -> bool:
        """Return True when the event has completed (successfully or not); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; return the callable's result or raise its exception."""
        if not self._done.is_set():
            lane = self.lane
            if lane is not None and threading.current_thread() is lane._thread:
                raise CCollError(
                    f"waiting on lane {lane.name!r}'s own worker thread for its later work "
                    "would deadlock; use after=[event] or lane.wait(event)"
                )
            if not self._done.wait(timeout):
                raise CCollTimeoutError(f"event did not complete within {timeout} s")
        if self._exc is not None:
            raise self._exc
        return self._result

    @property
    def error(self) -> BaseException | None:
        """The exception the event failed with, or None (also None while pending)."""
        return self._exc if self._done.is_set() else None

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._exc else "done")
        name = self.lane.name if self.lane is not None else "-"
        return f"<ccoll ThreadEvent lane={name} {state}>"


def _check_events(events: Iterable[Any]) -> tuple[ThreadEvent, ...]:
    out = tuple(events)
    for e in out:
        if not isinstance(e, ThreadEvent):
            raise TypeError(
                f"a CPU lane can wait only on events of CPU lanes, got {type(e).__name__}"
            )
    return out


class ThreadLane(Lane):
    """A worker thread that runs submitted callables one at a time, in order."""

    def __init__(self, name: str, nice: int = 0, numba_threads: int | None = None) -> None:
        self.name = name
        self.priority: int | None = nice
        self.stream = None
        self._nice = nice
        self._numba_threads = numba_threads
        self._q: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        # First unreported error; read and written by the worker thread only.
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"ccoll-lane-{name}", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------

    def _put(self, item: tuple[Any, ...]) -> None:
        with self._lock:
            if self._closed:
                raise CCollError(f"lane {self.name!r} is closed")
            self._q.put(item)

    def submit(
        self, fn: Callable[..., Any], *args: Any, after: Iterable[Event] = (), **kwargs: Any
    ) -> ThreadEvent:
        """Run ``fn(*args, **kwargs)`` after earlier work on this lane and after ``after``."""
        if not callable(fn):
            raise TypeError(f"submit expects a callable, got {type(fn).__name__}")
        deps = _check_events(after)
        ev = ThreadEvent(self)
        self._put(("task", fn, args, kwargs, deps, ev))
        return ev

    def record(self) -> ThreadEvent:
        """Return an event that completes when all work submitted so far has completed."""
        ev = ThreadEvent(self)
        self._put(("record", ev))
        return ev

    def wait(self, event: Event) -> None:
        """Make work submitted from now on start only after ``event`` has completed."""
        (ev,) = _check_events([event])
        self._put(("wait", ev))

    def wait_stream(self, user_stream: Any) -> ThreadEvent:
        """Accept only None: the calling thread's work is complete when it calls this."""
        self.adopt(user_stream)
        ev = ThreadEvent(self)
        ev._set(None, None)
        return ev

    def adopt(self, user_stream: Any) -> None:
        """Accept only None (the calling thread); CPU lanes have no streams to adopt."""
        if user_stream is not None:
            raise ValueError(
                "a device='cpu' scheduler has no streams; pass None for the calling thread "
                f"(got {type(user_stream).__name__})"
            )

    def synchronize(self) -> None:
        """Block until all submitted work completed; raise (and clear) the lane's error."""
        if threading.current_thread() is self._thread:
            raise CCollError(f"synchronize() on lane {self.name!r}'s own worker would deadlock")
        done = threading.Event()
        box: list[BaseException | None] = [None]
        self._put(("sync", done, box))
        done.wait()
        if box[0] is not None:
            raise box[0]

    def close(self) -> None:
        """Finish pending work, then stop the worker thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._q.put(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # -- worker side ----------------------------------------------------------------------

    def _tune_thread(self) -> None:
        if self._nice > 0 and sys.platform.startswith("linux"):
            tid = threading.get_native_id()
            try:
                cur = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, min(19, cur + self._nice))
            except OSError as exc:  # e.g. a sandbox that forbids it: run at normal priority
                _log.info("lane %r keeps its priority: setpriority failed: %s", self.name, exc)
                self.priority = 0
        elif self._nice > 0:
            self.priority = 0
        if self._numba_threads is not None and self._numba_threads < cpu_thread_count():
            import numba

            from ccoll.runtime.cpu_threads import prepare

            prepare()  # before numba's pool starts (OpenMP wait policy, threading layer)
            numba.set_num_threads(self._numba_threads)  # thread-local in numba

    def _absorb(self, ev: ThreadEvent) -> None:
        ev._done.wait()
        if ev._exc is not None and self._error is None:
            self._error = ev._exc

    def _loop(self) -> None:
        _current_lane.set(self)
        self._tune_thread()
        while True:
            item = self._q.get()
            kind = item[0]
            if kind == "task":
                _, fn, args, kwargs, deps, ev = item
                for d in deps:
                    self._absorb(d)
                if self._error is not None:
                    ev._set(None, self._error)
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - goes to the event's waiters
                    self._error = exc
                    ev._set(None, exc)
                else:
                    ev._set(result, None)
                del item, fn, args, kwargs, deps, ev  # free arguments before blocking again
            elif kind == "record":
                item[1]._set(None, self._error)
            elif kind == "wait":
                self._absorb(item[1])
            elif kind == "sync":
                item[2][0], self._error = self._error, None
                item[1].set()
            else:  # "stop"
                return


def make_thread_lanes(
    ranks: Mapping[str, int], fractions: Mapping[str, float]
) -> dict[str, Lane]:
    """Create the CPU lanes with nice values from ``ranks`` and numba threads from ``fractions``."""
    units = cpu_thread_count()
    lanes: dict[str, Lane] = {}
    for name in LANES:
        nice = NICE_PER_RANK * ranks[name]
        threads = max(1, int(units * fractions[name]))
        lanes[name] = ThreadLane(name, nice=nice, numba_threads=threads)
    return lanes
