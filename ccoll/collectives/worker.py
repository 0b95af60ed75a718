"""The compute thread of a collective: compress, add and decode run here, by priority.

The thread that drives MPI (the caller's, or the progress engine's for ``iallreduce``)
must stay in MPI calls for transfers to progress (MPICH has no progress thread by
default), so the compressor kernels run on this worker instead; they are numba functions
that release the GIL, so both run at once. Tasks carry a priority key: the ring submits the
add that unblocks the next send ahead of compressions needed only at later steps.

With ``inline=True`` tasks run at once on the submitting thread; the ring uses that when
there is nothing to overlap (one chunk per block), which saves two thread hand-offs per
task. :meth:`Worker.help` lets the driving thread take a queued task when it has nothing
to do in MPI (the ring's decodes run on both threads at once that way).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Worker", "Done"]

Done = tuple[Any, Any, BaseException | None]  # (tag, result, exception)


class Worker:
    """A daemon thread running submitted callables, lowest priority key first."""

    def __init__(self, name: str = "ccoll-worker") -> None:
        self._name = name
        self._heap: list[tuple[Any, int, Callable[[], Any], Any]] = []
        self._done: deque[Done] = deque()
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._outstanding = 0
        self._thread: threading.Thread | None = None
        self._stop = False
        # Key of the task the thread is running (None: idle), read by help().
        self._running: Any = None

    @property
    def outstanding(self) -> int:
        """Tasks submitted and not yet collected with :meth:`drain`."""
        return self._outstanding

    def submit(self, key: Any, fn: Callable[[], Any], tag: Any, *, inline: bool = False) -> None:
        """Run ``fn()``; its outcome comes back from :meth:`drain` as ``(tag, result, exc)``."""
        self._outstanding += 1
        if inline:
            try:
                self._done.append((tag, fn(), None))
            except Exception as exc:  # noqa: BLE001 - handed to the driving thread
                self._done.append((tag, None, exc))
            return
        with self._cv:
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (key, next(self._seq), fn, tag))
            self._cv.notify_all()

    def drain(self) -> list[Done]:
        """Outcomes of finished tasks since the last call (never blocks)."""
        out: list[Done] = []
        with self._cv:
            while self._done:
                out.append(self._done.popleft())
        self._outstanding -= len(out)
        return out

    def help(self, min_key: Any) -> bool:
        """Run the lowest-key queued task whose key is ``>= min_key`` here; False if none.

        Only while no task below ``min_key`` is queued or running on the worker: those are
        on the critical path, and where a rank has one core (the default share when ranks
        fill a node) a second thread computing beside them only slows them down. Its
        outcome comes back from :meth:`drain` like the worker's own.
        """
        with self._cv:
            heap = self._heap
            if self._running is not None and self._running < min_key:
                return False
            best = -1
            for i, item in enumerate(heap):
                if item[0] < min_key:
                    return False
                if best < 0 or item[:2] < heap[best][:2]:
                    best = i
            if best < 0:
                return False
            _, _, fn, tag = heap[best]
            heap[best] = heap[-1]
            heap.pop()
            heapq.heapify(heap)
        try:
            outcome: Done = (tag, fn(), None)
        except Exception as exc:  # noqa: BLE001 - handed to the driving thread
            outcome = (tag, None, exc)
        with self._cv:
            self._done.append(outcome)
        return True

    def wait(self, timeout: float | None) -> None:
        """Block until some task has finished (or ``timeout`` seconds pass)."""
        with self._cv:
            if not self._done:
                self._cv.wait(timeout)

    def discard(self) -> None:
        """Drop queued tasks and finished outcomes (after a failed collective)."""
        with self._cv:
            self._heap.clear()
            self._done.clear()
        self._outstanding = 0

    def close(self) -> None:
        """Stop the thread after the task it is running."""
        with self._cv:
            self._stop = True
            self._heap.clear()
            self._cv.notify_all()
            t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
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
