"""Where a collective's compute runs: compress, add and decode, by priority.

The thread that drives MPI (the caller's, or the progress engine's for ``iallreduce``)
must stay in MPI calls for transfers to progress (MPICH has no progress thread by
default), so the compressor kernels run elsewhere; they are numba functions that release
the GIL, so both run at once. Tasks carry a priority key: the ring submits the add that
unblocks the next send ahead of compressions needed only at later steps.

A task goes either to a lane of the process-wide CPU scheduler
(:func:`ccoll.gpu_sched.default_scheduler`, shared by every channel of the process:
compression on ``compress``, adds and decodes on ``reduce``) or, without a lane (device
data, ``CCOLL_SCHED=off``, ``configure(enabled=False)``), to the worker's private thread.
The worker keeps its lane tasks in one heap and hands the lowest-key one to its lane when
the previous one has finished (one task of a worker at a time, as on the private thread),
so the priority keys hold on the shared lanes too; every error is caught into the worker's
outcomes, so a collective's failure never leaves a shared lane failed.

With ``inline=True`` tasks run at once on the submitting thread; the ring uses that when
there is nothing to overlap (one chunk per block), which saves two thread hand-offs per
task. :meth:`Worker.help` lets the driving thread take a queued task when it has nothing
to do in MPI (the ring's decodes run on both threads at once that way).

:meth:`Worker.close` (its Communicator was closed) refuses new tasks and hands every queued
task back from :meth:`drain` as a :class:`~ccoll.errors.CollectiveError`, so a collective
that still waits for them sees the error instead of waiting for outcomes that never come.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ccoll.errors import CCollError, CollectiveError
from ccoll.gpu_sched import scheduler as _sched

__all__ = ["Worker", "Done"]

Done = tuple[Any, Any, BaseException | None]  # (tag, result, exception)

_CLOSED = ("this ccoll Communicator was closed while one of its collectives was running: "
           "its remaining compute tasks were dropped")


class Worker:
    """Runs submitted callables, lowest priority key first, on lanes or a private thread.

    ``lanes``: return the scheduler whose lanes take tasks submitted with a ``lane`` (None:
    no lanes now); without it (the default) every task goes to the private thread.
    """

    def __init__(self, name: str = "ccoll-worker", *,
                 lanes: Callable[[], Any] | None = None) -> None:
        self._name = name
        self._lanes_of = lanes
        self._heap: list[tuple[Any, int, Callable[[], Any], Any]] = []
        # Tasks for the lanes: (key, seq, fn, tag, lane). One at a time is handed to its
        # lane, lowest key first (see _dispatch); its key is in _dispatched meanwhile.
        self._lane_heap: list[tuple[Any, int, Callable[[], Any], Any, Any]] = []
        self._dispatched: Any = None
        # The lane's event of the dispatched task, and the task (see _check_lane).
        self._dispatched_ev: Any = None
        self._dispatched_item: Any = None
        self._done: deque[Done] = deque()
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._outstanding = 0
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False
        # Key of the task the thread is running (None: idle), read by help().
        self._running: Any = None
        #: Whether a task of this worker has gone to a lane (shown by Communicator repr).
        self.used_lanes = False
        self._device = "cpu"  # of the scheduler whose lanes the queued lane tasks are on

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: no task is accepted any more."""
        return self._closed

    @property
    def outstanding(self) -> int:
        """Tasks submitted and not yet collected with :meth:`drain`."""
        return self._outstanding

    def lanes(self) -> Any:
        """Return the scheduler that tasks with a ``lane`` go to now (None: private thread)."""
        if self._lanes_of is None:
            return None
        return self._lanes_of()

    def submit(self, key: Any, fn: Callable[[], Any], tag: Any, *, inline: bool = False,
               lane: str | None = None) -> None:
        """Run ``fn()``; its outcome comes back from :meth:`drain` as ``(tag, result, exc)``.

        ``lane``: the scheduler lane to run on (``"compress"`` or ``"reduce"``) when the
        worker has lanes; else the private thread runs it. Raises
        :class:`~ccoll.errors.CollectiveError` after :meth:`close`.
        """
        if self._closed:
            raise CollectiveError(_CLOSED)
        if inline:
            self._outstanding += 1
            try:
                self._done.append((tag, fn(), None))
            except Exception as exc:  # noqa: BLE001 - handed to the driving thread
                self._done.append((tag, None, exc))
            return
        sched = self.lanes() if lane is not None else None
        if sched is not None and lane is not None:
            ln = sched.lane(lane)  # raises before anything is queued
            self._device = sched.device
            _sched.task_started(self._device)
            self._outstanding += 1
            self.used_lanes = True
            with self._cv:
                heapq.heappush(self._lane_heap, (key, next(self._seq), fn, tag, ln))
            self._dispatch()
            return
        self._outstanding += 1
        with self._cv:
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (key, next(self._seq), fn, tag))
            self._cv.notify_all()

    def _dispatch(self) -> None:
        """Hand the lowest-key lane task to its lane unless one of this worker's runs.

        One task of a worker at a time, as on the private thread: the kernels of a task
        already use the rank's share of the cores, so a second one beside it would only
        slow the critical path (the add that unblocks the next send) that the keys put
        first. Other workers' tasks share the lanes meanwhile.
        """
        while True:
            with self._cv:
                if self._dispatched is not None or not self._lane_heap:
                    return
                item = heapq.heappop(self._lane_heap)
                self._dispatched = item[0]
            try:
                ev = item[4].submit(self._run_lane_task, item)
                with self._cv:
                    if self._dispatched is item[0] and self._dispatched_item is None:
                        self._dispatched_ev, self._dispatched_item = ev, item
                return
            except BaseException as exc:  # noqa: BLE001 - a closed lane: the collective fails
                self._record((item[3], None, exc))

    def _run_lane_task(self, item: tuple[Any, int, Callable[[], Any], Any, Any]) -> None:
        """Run one task on its lane's thread; every error goes to the outcomes."""
        try:
            outcome: Done = (item[3], item[2](), None)
        except BaseException as exc:  # noqa: BLE001 - to the driving thread, never the lane
            outcome = (item[3], None, exc)
        self._record(outcome)
        self._dispatch()

    def _check_lane(self) -> None:
        """Fail the dispatched task if its lane skipped it (the lane failed earlier).

        A lane that some other work left failed runs nothing until it is synchronized;
        the task's outcome is then an error that says so, not a wait until the timeout.
        """
        ev = self._dispatched_ev
        if ev is None or ev.error is None:  # ccoll's runner never raises: error = skipped
            return
        with self._cv:
            if self._dispatched_ev is not ev:
                return
            item = self._dispatched_item
        self._record((item[3], None, CCollError(
            f"the scheduler's {item[4].name!r} lane failed earlier ({ev.error!r}) and runs "
            "nothing until it is synchronized: call lane.synchronize() on work you submitted "
            "to ccoll.gpu_sched.default_scheduler()'s lanes, or use a Scheduler of your own")))
        self._dispatch()

    def _record(self, outcome: Done) -> None:
        _sched.task_finished(self._device)
        with self._cv:
            self._dispatched_ev = self._dispatched_item = None
            self._dispatched = None
            self._done.append(outcome)
            self._cv.notify_all()

    def drain(self) -> list[Done]:
        """Outcomes of finished tasks since the last call (never blocks)."""
        self._check_lane()
        out: list[Done] = []
        with self._cv:
            while self._done:
                out.append(self._done.popleft())
        self._outstanding -= len(out)
        return out

    def help(self, min_key: Any) -> bool:
        """Run the lowest-key queued task whose key is ``>= min_key`` here; False if none.

        Only while no task below ``min_key`` is queued or running on the worker's thread
        or its lanes: those are on the critical path, and where a rank has one core (the
        default share when ranks fill a node) a second thread computing beside them only
        slows them down. Its outcome comes back from :meth:`drain` like the others'.
        """
        with self._cv:
            for k in (self._running, self._dispatched):
                if k is not None and k < min_key:
                    return False
            best_heap: list[Any] | None = None
            best = -1
            for heap in (self._heap, self._lane_heap):
                for i, item in enumerate(heap):
                    if item[0] < min_key:
                        return False
                    if best_heap is None or item[:2] < best_heap[best][:2]:
                        best_heap, best = heap, i
            if best_heap is None:
                return False
            fn, tag = best_heap[best][2], best_heap[best][3]
            best_heap[best] = best_heap[-1]
            best_heap.pop()
            heapq.heapify(best_heap)
            on_lane = best_heap is self._lane_heap
        try:
            outcome: Done = (tag, fn(), None)
        except Exception as exc:  # noqa: BLE001 - handed to the driving thread
            outcome = (tag, None, exc)
        finally:
            if on_lane:
                _sched.task_finished(self._device)
        with self._cv:
            self._done.append(outcome)
        return True

    def wait(self, timeout: float | None) -> None:
        """Block until some task has finished (or ``timeout`` seconds pass)."""
        with self._cv:
            if not self._done:
                self._cv.wait(timeout)

    def _drop_queued(self) -> list[Any]:
        # Called with self._cv held; a task already handed to its lane still finishes.
        # Returns the tags of the dropped tasks.
        tags = [item[3] for item in self._heap] + [item[3] for item in self._lane_heap]
        self._heap.clear()
        for _ in self._lane_heap:
            _sched.task_finished(self._device)
        self._lane_heap.clear()
        return tags

    def discard(self) -> None:
        """Drop queued tasks and finished outcomes (after a failed collective)."""
        with self._cv:
            self._drop_queued()
            self._done.clear()
        self._outstanding = 0

    def close(self) -> None:
        """Refuse new tasks, fail the queued ones, stop the private thread.

        Each queued task comes back from :meth:`drain` as ``(tag, None, CollectiveError)``,
        so :attr:`outstanding` still falls to zero; a task already running (on the private
        thread or a lane) finishes and comes back as usual. The private thread stops after
        it; this waits for that only when the thread is idle (a task may wait for MPI).
        """
        with self._cv:
            self._closed = self._stop = True
            for tag in self._drop_queued():
                self._done.append((tag, None, CollectiveError(_CLOSED)))
            self._cv.notify_all()
            t, self._thread = self._thread, None
            idle = self._running is None
        if t is not None and idle and t is not threading.current_thread():
            t.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                key, _, fn, tag = heapq.heappop(self._heap)
                self._running = key
            try:
                outcome: Done = (tag, fn(), None)
            except Exception as exc:  # noqa: BLE001 - handed to the driving thread
                outcome = (tag, None, exc)
            with self._cv:
                self._running = None
                self._done.append(outcome)
                self._cv.notify_all()
