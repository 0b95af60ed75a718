"""Lane and event types shared by the scheduler and both lane implementations.

:class:`Lane` and :class:`Event` are the interface of docs/scheduler.md;
``thread_lanes`` (CPU worker threads) and ``cuda_lanes`` (prioritized CUDA streams)
implement them, and :class:`~ccoll.gpu_sched.scheduler.Scheduler` owns one lane per name in
:data:`LANES`. Kept apart from the scheduler so that the implementations need not import it.
"""

from __future__ import annotations

import abc
import contextvars
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["LANES", "Event", "Lane", "current_lane", "current_stream"]

LANES: tuple[str, ...] = ("compute", "compress", "reduce", "copy")

_current_lane: contextvars.ContextVar[Lane | None] = contextvars.ContextVar(
    "ccoll_current_lane", default=None
)


def current_lane() -> Lane | None:
    """Return the lane whose callable is running in this thread, or None."""
    return _current_lane.get()


def current_stream() -> Any:
    """Return the stream of the lane whose callable is running here (None on CPU lanes)."""
    lane = _current_lane.get()
    return None if lane is None else lane.stream


class Event(abc.ABC):
    """A point in a lane's work; completes with the submitted callable's result or error."""

    @abc.abstractmethod
    def query(self) -> bool:
        """Return True when the event has completed (successfully or not); never blocks."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; return the callable's result or raise its exception.

        Raises :class:`~ccoll.errors.CCollTimeoutError` after ``timeout`` seconds.
        """

    @property
    @abc.abstractmethod
    def error(self) -> BaseException | None:
        """The exception the event failed with, or None (also None while pending)."""


class Lane(abc.ABC):
    """An ordered queue of work on one device with a priority; see the module docstring."""

    name: str
    priority: int | None
    stream: Any

    @abc.abstractmethod
    def submit(
        self, fn: Callable[..., Any], *args: Any, after: Iterable[Event] = (), **kwargs: Any
    ) -> Event:
        """Run ``fn(*args, **kwargs)`` after earlier work on this lane and after ``after``."""

    @abc.abstractmethod
    def record(self) -> Event:
        """Return an event that completes when all work submitted so far has completed."""

    @abc.abstractmethod
    def wait(self, event: Event) -> None:
        """Make work submitted from now on start only after ``event`` has completed."""

    @abc.abstractmethod
    def wait_stream(self, user_stream: Any) -> Event:
        """Make this lane wait for all work queued so far on ``user_stream``; return the event."""

    @abc.abstractmethod
    def adopt(self, user_stream: Any) -> None:
        """Run this lane's future work on the caller's stream (see Scheduler.adopt_stream)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all submitted work completed; raise (and clear) the lane's error."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the lane's thread or stream; pending work still completes first."""

    def __repr__(self) -> str:
        return f"<ccoll {type(self).__name__} {self.name!r} priority={self.priority}>"
