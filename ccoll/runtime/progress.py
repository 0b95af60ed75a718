"""Progress engine: one background thread that runs ccoll's asynchronous collectives.

``submit(fn, *args, comm=comm, **kwargs)`` queues ``fn(*args, **kwargs)`` on a single
daemon thread and returns a :class:`Request` at once; ``request.wait()`` returns what ``fn``
returned or re-raises what it raised. ``ccoll.iallreduce`` and the PyTorch DDP comm hook
are built on it.

Ordering. There is one queue, so requests run one at a time in the order they were
submitted (global FIFO, hence FIFO per communicator too). MPI requires every rank to start
the collectives of one communicator in the same order; with the engine that means every
rank must *submit* them in the same order. Two user threads submitting collectives on the
same communicator concurrently break that rule unless they agree on an order themselves.

Threads and MPI. The engine thread calls MPI while the user's threads may call it too, so
MPI must run at ``MPI_THREAD_MULTIPLE``. ``submit(..., comm=c)`` checks
``MPI.Query_thread()`` and raises :class:`~ccoll.errors.CCollError` with the fix when it is
lower. Passing ``comm`` is how a caller says "``fn`` calls MPI"; with ``comm=None`` the
engine runs any callable and never touches MPI itself (it then works without mpi4py).

Cancelling. :func:`cancel` (``ccoll.Communicator.close()`` calls it for each of its private
communicators) fails with :class:`~ccoll.errors.CollectiveError` every request that has not
finished and belongs to what is being closed: the queued ones (whose ``comm`` is that
communicator) never start, and the running one (which named it as ``comm`` or called
:func:`uses` on it) finishes with the error at once, while every wait it makes from then on
(a :class:`~ccoll.collectives.waiting.Deadline` made on the engine thread) ends with the
same error, so the engine thread leaves it and runs the next request.

Shutdown. :func:`shutdown` (also run at interpreter exit, before mpi4py's
``MPI_Finalize``) stops accepting work, fails every request that has not started with
:class:`~ccoll.errors.CollectiveError` ("... pending at shutdown ..."), and waits a bounded
time for the request that is running. A waiter never hangs on a request the engine will
not run. The next :func:`submit` starts a fresh engine; while the old thread is still inside
a request on a communicator (``shutdown(wait=False)``, or a wait that expired), the new
thread starts no request on that same communicator until the old one has returned.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ccoll.errors import CCollError, CCollTimeoutError, CollectiveError

__all__ = ["Request", "ProgressEngine", "submit", "engine", "shutdown", "check_thread_level",
           "cancel", "current_request", "uses"]

_log = logging.getLogger(__name__)

# How long interpreter exit waits for a request that is already running (an MPI collective
# whose peers never arrive would otherwise block exit forever).
def _exit_timeout() -> float:
    """Return the ``CCOLL_SHUTDOWN_TIMEOUT`` setting (:mod:`ccoll.settings`), at exit."""
    from ccoll.settings import current

    return current().shutdown_timeout

_PENDING, _RUNNING, _FINISHED = "pending", "running", "finished"


class Request:
    """Handle of one submitted call; finishes once, with a result or an exception."""

    __slots__ = (
        "name",
        "comm",
        "_fn",
        "_args",
        "_kwargs",
        "_engine",
        "_state",
        "_result",
        "_exc",
        "_done",
        "_lock",
        "_callbacks",
        "cancelled",
        "_uses",
        "_wake",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        comm: Any,
        engine: ProgressEngine,
        name: str,
    ) -> None:
        self.name = name
        self.comm = comm
        self._fn: Callable[..., Any] | None = fn
        self._args = args
        self._kwargs = kwargs
        self._engine = engine
        self._state = _PENDING
        self._result: Any = None
        self._exc: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Request], Any]] = []
        #: Why :func:`cancel` stopped the request (None: not cancelled).
        self.cancelled: str | None = None
        # What the request said it uses (see uses()); cancel() matches it by identity.
        self._uses: list[Any] = []
        # [MPI request, tag, sent] of the receive that cancel() completes to end a blocking
        # wait of this request (see wake_handle), or None.
        self._wake: list[Any] | None = None

    def __repr__(self) -> str:
        return f"<ccoll Request {self.name} {self._state}>"

    def test(self) -> bool:
        """True when the request has finished (with a result or an error); never blocks."""
        return self._done.is_set()

    def done(self) -> bool:
        """Return True when the request has finished; same as :meth:`test`."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the request finishes; return its result or raise its exception.

        Raises :class:`~ccoll.errors.CCollTimeoutError` if ``timeout`` seconds pass first
        (the request keeps running), and :class:`~ccoll.errors.CCollError` when called on
        the engine thread for a request that has not finished (it could never finish).
        """
        if not self._done.is_set():
            if threading.current_thread() is self._engine.thread:
                raise CCollError(
                    f"{self.name}: wait() on the progress engine thread for a request that has "
                    "not finished would deadlock (requests run one at a time on that thread); "
                    "use add_done_callback instead"
                )
            if not self._done.wait(timeout):
                raise CCollTimeoutError(
                    f"{self.name} did not finish within {timeout} s (state: {self._state}); "
                    "it is still queued or running"
                )
        if self._exc is not None:
            raise self._exc
        return self._result

    def exception(self) -> BaseException | None:
        """Return the exception the request finished with, or None; raise if not finished."""
        if not self._done.is_set():
            raise CCollError(f"{self.name} has not finished; exception() needs a finished request")
        return self._exc

    def add_done_callback(self, fn: Callable[[Request], Any]) -> None:
        """Call ``fn(request)`` when the request finishes.

        The call happens on the engine thread right after the request finishes, at once on
        the calling thread when it has already finished, or on the thread that shut the
        engine down for a request failed by :func:`shutdown`. An exception from ``fn`` is logged
        and otherwise ignored; it does not change the request's outcome.
        """
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    # -- engine side --------------------------------------------------------------------

    def wake_handle(self) -> Any:
        """Return the MPI receive that :func:`cancel` completes; wait on it beside yours.

        Posted on a private duplicate of ``MPI_COMM_SELF`` at the first call, cancelled when
        the request ends. A wait that includes it (``MPI_Waitsome``) blocks in MPI as a
        plain wait does, and still returns when the request is cancelled. Check
        :attr:`cancelled` after this call, before waiting: a cancel that came first sent
        nothing.
        """
        with self._lock:
            if self._wake is None:
                from mpi4py import MPI

                comm, tag = _self_comm(), next(_wake_tags) % 32768
                self._wake = [comm.Irecv([bytearray(1), 0, MPI.BYTE], source=0, tag=tag),
                              tag, False]
            return self._wake[0]

    def _ring_wake(self) -> None:
        # Complete the wake receive if it is posted (under the lock: never after _drop_wake).
        with self._lock:
            w = self._wake
            if w is not None and not w[2]:
                from mpi4py import MPI

                w[2] = True
                _self_comm().Send([bytearray(1), 0, MPI.BYTE], dest=0, tag=w[1])

    def _drop_wake(self) -> None:
        with self._lock:
            w, self._wake = self._wake, None
        if w is None:
            return
        from mpi4py import MPI

        if w[0] != MPI.REQUEST_NULL:
            if not w[2]:
                w[0].Cancel()
            w[0].Wait()

    def _run(self) -> None:
        with self._lock:
            if self._done.is_set():  # failed by shutdown while queued
                return
            self._state = _RUNNING
        fn, args, kwargs = self._fn, self._args, self._kwargs
        assert fn is not None
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter, never lost
            self._finish(None, exc)
        else:
            self._finish(result, None)

    def _finish(self, result: Any, exc: BaseException | None) -> bool:
        """Set the outcome once; later calls are ignored. Returns True if this call set it."""
        with self._lock:
            if self._done.is_set():
                return False
            self._result = result
            self._exc = exc
            self._state = _FINISHED
            # Drop references to arguments (gradient buffers) as soon as they are not needed.
            self._fn = None
            self._args = ()
            self._kwargs = {}
            callbacks, self._callbacks = self._callbacks, []
            self._done.set()
        for cb in callbacks:
            self._call(cb)
        return True

    def _call(self, cb: Callable[[Request], Any]) -> None:
        try:
            cb(self)
        except Exception:
            _log.exception("done-callback %r of %s raised; ignored", cb, self.name)


# Requests that an engine thread is running. An engine shut down without waiting (or whose
# wait expired) leaves its thread inside its last request; the next engine's thread must not
# enter a collective on the same communicator beside it, or the two threads' messages would
# mix. Requests on other communicators, or on none, go ahead. cancel() finds the running
# requests here too.
_busy_cv = threading.Condition()
_busy: list[Request] = []
# The request the engine thread is running (None on other threads): see current_request().


class _Current(threading.local):
    """The engine request that a thread runs (None on other threads).

    The class default answers there without the exception that a missing attribute of a
    plain ``threading.local`` costs.
    """

    req: Request | None = None


_current = _Current()


def _same(a: Any, b: Any) -> bool:
    return a is b or (a is not None and b is not None and a == b)

# Test seam: when set, called with the communicator each time an engine thread finds it held
# by another engine's thread and is about to wait (with ``_busy_cv`` held, so it must not
# block). The tests use it to wait for that moment instead of sleeping; None otherwise.
_on_comm_wait: Callable[[Any], None] | None = None


@contextlib.contextmanager
def _comm_in_use(req: Request) -> Iterator[None]:
    """Hold ``req.comm`` for one request, after any other engine thread has let it go."""
    comm = req.comm
    with _busy_cv:
        while comm is not None and any(_same(r.comm, comm) for r in _busy):
            if _on_comm_wait is not None:
                _on_comm_wait(comm)
            _busy_cv.wait()
        _busy.append(req)
    _current.req = req
    try:
        yield
    finally:
        _current.req = None
        with _busy_cv:
            for i, r in enumerate(_busy):
                if r is req:
                    del _busy[i]
                    break
            _busy_cv.notify_all()


class ProgressEngine:
    """A FIFO queue of calls and the daemon thread that runs them one at a time."""

    def __init__(self, name: str = "ccoll-progress") -> None:
        self.name = name
        self._queue: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._running: Request | None = None
        self._ids = itertools.count()
        self.thread: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` has been called; no more submits are accepted."""
        return self._closed

    def pending(self) -> int:
        """Return the number of requests queued or running."""
        with self._cv:
            return len(self._queue) + (self._running is not None)

    def submit(
        self, fn: Callable[..., Any], *args: Any, comm: Any = None, **kwargs: Any
    ) -> Request:
        """Queue ``fn(*args, **kwargs)``; see :func:`submit`."""
        if not callable(fn):
            raise TypeError(f"submit expects a callable, got {type(fn).__name__}")
        if comm is not None:
            check_thread_level()
        with self._cv:
            if self._closed:
                raise CollectiveError(
                    f"the progress engine {self.name!r} is shut down; no more requests accepted"
                )
            req = Request(fn, args, kwargs, comm, self, f"request#{next(self._ids)}")
            self._queue.append(req)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self.thread.start()
            self._cv.notify()
        return req

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                req = self._running = self._queue.popleft()
            try:
                with _comm_in_use(req):
                    try:
                        req._run()
                    finally:
                        req._drop_wake()
            finally:
                with self._cv:
                    self._running = None
                    self._cv.notify_all()

    def _cancel(self, objs: tuple[Any, ...], reason: str) -> tuple[list[Request], Request | None]:
        """Take the queued requests whose ``comm`` is one of ``objs`` off the queue.

        Returns them, and the running request (popped, perhaps not started yet) if it
        belongs to ``objs`` and has not finished; that one is marked cancelled.
        """
        with self._cv:
            dropped = [r for r in self._queue if _matches(r, objs)]
            if dropped:
                self._queue = collections.deque(r for r in self._queue if not _matches(r, objs))
            running = self._running
            if running is None or not _matches(running, objs) or running.done():
                return dropped, None
            running.cancelled = reason
        return dropped, running

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop accepting work, fail queued requests, and optionally wait for the running one.

        Requests that have not started finish with :class:`~ccoll.errors.CollectiveError`.
        With ``wait``, block until the running request (if any) finishes, at most ``timeout``
        seconds; if it is still running then, its waiters get a CollectiveError too (its
        eventual result is discarded) and the thread is left behind as a daemon.
        """
        with self._cv:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for req in pending:
            req._finish(
                None,
                CollectiveError(
                    f"{req.name} was still pending at shutdown of the progress engine and never "
                    "ran; wait for asynchronous collectives before the program exits"
                ),
            )
        t = self.thread
        if not wait or t is None or t is threading.current_thread():
            return
        t.join(timeout)
        if t.is_alive():
            with self._cv:
                running = self._running
            if running is not None and running._finish(
                None,
                CollectiveError(
                    f"{running.name} was still running {timeout} s after shutdown of the "
                    "progress engine began (a collective whose peers never arrived?); "
                    "abandoned"
                ),
            ):
                _log.error("progress engine shut down while %s was still running", running.name)


_lock = threading.Lock()
_engine: ProgressEngine | None = None
_exiting = False
_thread_level_ok = False


def engine() -> ProgressEngine:
    """Return the process-wide engine, created on first use (again after :func:`shutdown`)."""
    global _engine
    with _lock:
        if _engine is None:
            if _exiting:
                raise CollectiveError(
                    "the progress engine is shut down because the interpreter is exiting"
                )
            _engine = ProgressEngine()
        return _engine


def submit(fn: Callable[..., Any], *args: Any, comm: Any = None, **kwargs: Any) -> Request:
    """Run ``fn(*args, **kwargs)`` on the engine thread, after everything submitted before.

    Pass ``comm`` (the communicator ``fn`` uses) whenever ``fn`` calls MPI: it makes submit
    check that MPI runs at ``MPI_THREAD_MULTIPLE`` and records the communicator on the
    request. Every rank must submit the collectives of one communicator in the same order.
    """
    return engine().submit(fn, *args, comm=comm, **kwargs)


def shutdown(wait: bool = True, timeout: float | None = None) -> None:
    """Shut the process-wide engine down (see :meth:`ProgressEngine.shutdown`).

    A later :func:`submit` starts a fresh engine, except during interpreter exit.
    """
    global _engine
    with _lock:
        eng, _engine = _engine, None
    if eng is not None:
        eng.shutdown(wait=wait, timeout=timeout)


def current_request() -> Request | None:
    """Return the request this thread runs for the engine (None on any other thread)."""
    return _current.req


def uses(obj: Any) -> None:
    """Note that the request running on this thread uses ``obj`` (nothing on other threads).

    :func:`cancel` of ``obj`` then cancels the request. A collective's channel calls this
    when a call starts, so that closing a Communicator stops a request that runs a call on
    it (the DDP hook's requests name the user's communicator, not the channel's).
    """
    req = _current.req
    if req is not None and not any(o is obj for o in req._uses):
        req._uses.append(obj)


def _matches(req: Request, objs: tuple[Any, ...]) -> bool:
    return any(req.comm is o for o in objs) or any(u is o for u in req._uses for o in objs)


def cancel(objs: tuple[Any, ...], reason: str) -> bool:
    """Fail every unfinished request that belongs to one of ``objs``; True if one was running.

    A request belongs to ``obj`` when it was submitted with ``comm=obj`` or called
    :func:`uses` with it (both by identity). Queued ones are taken off the queue and never
    run; a running one finishes at once; each with ``CollectiveError(name + ": " +
    reason)``. The running one is marked cancelled, so that its waits end with that error
    too (:class:`~ccoll.collectives.waiting.Deadline`) and the engine goes on with the next
    request. The return value tells the caller that MPI operations of the running request
    may still be pending on its communicator (which must then not be freed).
    """
    with _lock:
        eng = _engine
    dropped: list[Request] = []
    hits: list[Request] = []
    if eng is not None:
        dropped, hit = eng._cancel(objs, reason)
        if hit is not None:
            hits.append(hit)
    with _busy_cv:  # also the running requests of engines shut down without waiting
        for r in _busy:
            if _matches(r, objs) and not r.done() and all(r is not h for h in hits):
                r.cancelled = reason
                hits.append(r)
    for r in hits:
        r._ring_wake()  # a blocking wait of the request returns
    for r in [*dropped, *hits]:
        r._finish(None, CollectiveError(f"{r.name}: {reason}"))
    return bool(hits)


_self_lock = threading.Lock()
_self_dup: Any = None
_wake_tags = itertools.count()


def _self_comm() -> Any:
    """Return the private duplicate of ``MPI_COMM_SELF`` for wake receives (made once)."""
    global _self_dup
    with _self_lock:
        if _self_dup is None:
            from mpi4py import MPI

            _self_dup = MPI.COMM_SELF.Dup()
        return _self_dup


def check_thread_level() -> None:
    """Raise :class:`~ccoll.errors.CCollError` unless MPI runs at ``MPI_THREAD_MULTIPLE``.

    Also raises :class:`~ccoll.errors.CollectiveError` when MPI is not initialized yet or
    already finalized, since the engine cannot run a collective then.
    """
    global _thread_level_ok
    from mpi4py import MPI

    if MPI.Is_finalized():
        raise CollectiveError("MPI is already finalized; no collective can be submitted")
    if _thread_level_ok:
        return
    if not MPI.Is_initialized():
        raise CollectiveError("MPI is not initialized; import mpi4py.MPI (or call MPI.Init_thread)")
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        names = {
            MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
            MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
            MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
        }
        raise CCollError(
            "ccoll's progress engine calls MPI from a background thread and needs "
            f"MPI_THREAD_MULTIPLE, but MPI was initialized with {names.get(level, level)}. "
            'Set mpi4py.rc.thread_level = "multiple" (mpi4py\'s default) before the first '
            "`from mpi4py import MPI`, or call MPI.Init_thread(MPI.THREAD_MULTIPLE) yourself "
            "with mpi4py.rc.initialize = False"
        )
    _thread_level_ok = True
    # mpi4py finalizes MPI from Py_AtExit, after every atexit handler; should a version
    # register MPI_Finalize with atexit instead, moving ours last (atexit runs LIFO) still
    # stops the engine before MPI goes away.
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _at_exit() -> None:
    global _exiting
    with _lock:
        _exiting = True
    shutdown(wait=True, timeout=_exit_timeout())


atexit.register(_at_exit)
