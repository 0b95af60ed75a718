"""``ccoll.Communicator``: the collectives, bound to private duplicates of a communicator.

Creating one is the defined point where everything its calls will plan from is fixed and
checked across ranks: the options, the settings (:mod:`ccoll.settings`, read once here),
the node grouping, the kernels' threads, and the calibration
(:mod:`ccoll.collectives.policy.calibration`). Each call then runs on a
:class:`~ccoll.collectives.calls.Route` (blocking calls on one channel, ``iallreduce`` on
another), whose :class:`~ccoll.collectives.policy.plan.Planner` makes its plan
(docs/collectives.md, "Every call").
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import replace
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives.agreement import ALGORITHMS, POLICIES, SCHEDULES, Call, agree
from ccoll.collectives.calls import Route, report, run_call
from ccoll.collectives.channel import Channel, Stats
from ccoll.collectives.hier import TwoLevel
from ccoll.collectives.inputs import check_option, split_code
from ccoll.collectives.node import Grouping, node_comms, node_threads, rpn_problem
from ccoll.collectives.policy import calibration as _calibration
from ccoll.collectives.policy.plan import Options, Planner, _mix
from ccoll.collectives.report import LOGGER, CallReport, configure_logging
from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.errorbound import REL, ErrorBound
from ccoll.errors import CollectiveError, DTypeError, ErrorBoundError, InputError, MismatchError
from ccoll.runtime.mpilife import check_alive, watch
from ccoll.settings import Settings
from ccoll.settings import parse as parse_settings

__all__ = ["Communicator", "DEFAULT_EB", "dup_comm"]

DEFAULT_EB: ErrorBound = REL(1e-3)


# The largest chunk_elems taken: the agreement carries it as a float64, exact to 2**53 (a
# chunk larger than a call's ring block is cut to the block; ccoll.collectives.layout).
_MAX_CHUNK = 1 << 53


def _real(v: Any) -> float:
    """``float(v)``, and ``inf`` for an int beyond float64's range (which would raise)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


class Communicator:
    """ccoll's collectives on (private duplicates of) an mpi4py communicator.

    Creating one is collective over ``comm``. Options (identical on every rank; checked):

    - ``algorithm``: ``"homomorphic"`` (default: compress once, add compressed streams,
      decode once) or ``"dar"`` (decompress-add-recompress at every ring step, as C-Coll).
    - ``policy``: ``"auto"`` (default: per call, the cost model of docs/model.md and the
      measured times of earlier calls of the same signature decide whether compressing
      pays, and send raw when it does not), ``"compress"`` (always) or ``"raw"`` (never:
      plain MPI, same API).
    - ``chunk_elems``: elements per pipeline chunk (one stream, one message). Default
      ``None``: chosen per signature from the cost model (docs/collectives.md, "Chunk
      size"); an int fixes it for every compressed call.
    - ``timeout``: seconds a collective may wait without progress (no message from its
      peers, no step of its own completed) before it raises
      :class:`~ccoll.errors.CollectiveError` on every rank that waits: a rank that skips
      a call, fails or stops in one then turns into an error instead of a hang, while a
      large call that keeps moving runs as long as it needs. Default ``None``: the
      ``CCOLL_TIMEOUT`` setting, else :data:`ccoll.settings.DEFAULT_TIMEOUT` (600 s);
      ``math.inf`` (or ``CCOLL_TIMEOUT=none``): wait forever, as MPI (the waits then
      block in MPI's own calls). docs/collectives.md, "Faults".
    - ``split``: share of a homomorphic allreduce's bound ``eb`` that goes to the allgather
      phase: the reduce-scatter sums within ``e1 = (1 - split) eb``, the owner of each
      reduced block requantizes it within ``e2 = split * eb`` and the allgather forwards
      that, which does not widen with the number of ranks (docs/error-bound.md, "Split
      bound"). ``None`` (default): the share with the fewest bytes for the number of ranks
      (:func:`ccoll.collectives.ratios.split_fraction`), where the cost model predicts it
      faster than none; ``0``: no split. Host data only; ``reduce_scatter`` keeps the whole
      bound.
    - ``ranks_per_node``: the node grouping of hierarchical collectives. ``None`` (default):
      nodes are MPI's shared-memory domains; an int ``R``: consecutive blocks of ``R``
      ranks form a node. On at least 2 nodes of at least 2 ranks each, a compressed
      allreduce of host data may run in two levels (docs/collectives.md, "Hierarchical
      collectives"). The grouping is the attribute ``grouping``.
    - ``schedule``: how a homomorphic allreduce of host data moves its streams between
      ranks: ``"ring"``, ``"halving"`` (recursive halving and doubling) or ``"auto"``
      (default: the cost model picks per signature). Both give the same bound and identical
      results on every rank.
    - ``format_version``: the stream format of every compressed call's messages: ``1`` or
      ``2`` (docs/format.md; version 2 codes the same quantized values in fewer bytes).
      ``None`` (default): chosen per call by the cost model from each version's measured
      kernel rates and ratios against the link (docs/model.md, "Stream format"), for
      either schedule.

    Creating one also reads the settings (:func:`ccoll.settings.current`, once), sets the
    threads of ccoll's CPU kernels in this process (the attribute ``threads``) and
    calibrates (the attribute ``calibration``): from the settings, the calibration cache,
    a probe (``policy="auto"`` only, when nothing is cached) or the model's defaults.

    The Communicator holds two private duplicates of ``comm`` (one for blocking calls, one
    for ``iallreduce``, made at its first call), reusable receive buffers and traffic
    counters (:attr:`stats`). Release them with :meth:`close` (or a ``with`` block); one
    that is dropped unclosed releases them when it is garbage collected.
    """

    def __init__(
        self,
        comm: MPI.Intracomm | None = None,
        *,
        algorithm: str = "homomorphic",
        policy: str = "auto",
        chunk_elems: int | None = None,
        timeout: float | None = None,
        split: float | None = None,
        ranks_per_node: int | None = None,
        schedule: str = "auto",
        format_version: int | None = None,
    ) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise InputError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        check_alive("ccoll.Communicator(...)")
        watch()
        settings, problems = parse_settings()
        call = Call("Communicator")
        for problem in problems:
            call.problem(InputError, problem)
        call.algorithm = check_option(call, "algorithm", algorithm, ALGORITHMS)
        call.policy = check_option(call, "policy", policy, POLICIES)
        call.schedule = check_option(call, "schedule", schedule, SCHEDULES)
        if chunk_elems is not None and (
            isinstance(chunk_elems, bool) or not isinstance(chunk_elems, (int, np.integer))
            or not 1 <= chunk_elems <= _MAX_CHUNK
        ):
            call.problem(InputError, f"chunk_elems must be a positive integer up to 2**53 or "
                         f"None (chosen per call), got {chunk_elems!r}")
            chunk_elems = None
        if timeout is None:
            timeout = settings.timeout
        elif not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                  and not math.isnan(_real(timeout)) and timeout > 0):
            call.problem(InputError, f"timeout must be None (the CCOLL_TIMEOUT setting), "
                         f"seconds > 0 or math.inf (wait forever), got {timeout!r}")
            timeout = None
        if timeout is not None and math.isinf(_real(timeout)):
            timeout = None  # wait forever: MPI's blocking calls
        call.chunk = 0 if chunk_elems is None else int(chunk_elems)
        if split is not None and (
            isinstance(split, bool) or not isinstance(split, (int, float, np.integer, np.floating))
            or not 0 <= _real(split) < 1
        ):
            call.problem(InputError, f"split must be None (chosen by the model) or a number "
                         f"from 0 (no split) up to but not including 1, got {split!r}")
            split = None
        self.split: float | None = None if split is None else float(split)
        call.split = split_code(self.split)
        rpn_bad = rpn_problem(ranks_per_node, comm.Get_size())
        if rpn_bad is not None:
            call.problem(InputError, rpn_bad)
            ranks_per_node = None
        if format_version is not None and (
            isinstance(format_version, (bool, np.bool_))
            or not isinstance(format_version, (int, np.integer)) or format_version not in (1, 2)
        ):
            call.problem(InputError, f"format_version must be None (chosen per call), 1 or 2, "
                         f"got {format_version!r}")
            format_version = None
        self.format_version: int | None = (
            None if format_version is None else int(format_version))
        call.version = self.format_version or 0
        self.ranks_per_node: int | None = (
            None if ranks_per_node is None else int(ranks_per_node))
        call.rpn = -1 if self.ranks_per_node is None else self.ranks_per_node
        call.shown.update({"algorithm": algorithm, "policy": policy,
                           "chunk size": "chosen per call" if chunk_elems is None else chunk_elems,
                           "split": "chosen by the model" if split is None else split,
                           "ranks per node": ("MPI's shared-memory domains"
                                              if ranks_per_node is None else ranks_per_node),
                           "schedule": schedule,
                           "format version": ("chosen per call" if format_version is None
                                              else format_version)})
        self.algorithm = algorithm
        self.policy = policy
        self.schedule = schedule
        self.chunk_elems: int | None = None if chunk_elems is None else int(chunk_elems)
        self.timeout = None if timeout is None else float(timeout)
        # The timeout decides blocking or nonblocking MPI calls, which must match: agreed,
        # with the settings that decide which collectives run.
        settings = replace(settings, timeout=self.timeout)
        call.settings = settings.digest
        call.shown["settings"] = settings.overrides(agreed=True)
        self.settings: Settings = settings
        self._comm = comm
        # Kept so that rank and size still answer after close() (the duplicate is freed).
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        deadline = Deadline(self.timeout, "creating a ccoll Communicator")
        # The timeout is not agreed yet, and a blocking MPI call does not match its
        # nonblocking form: until the agreement, every rank takes the nonblocking forms
        # (an endless deadline waits in them as a finite one does, without end), so a
        # rank whose timeout differs gets the agreement's MismatchError, not a hang.
        if deadline.at is None:
            deadline.at = math.inf
        sync = dup_comm(comm, deadline)
        try:
            agree(sync, call, deadline)
            # After the agreement: a call with a bad argument exchanges nothing more.
            self.threads, self._threads_why = node_threads(sync, deadline, settings.threads)
            grouping, node_comm, inter_comm = node_comms(sync, self.ranks_per_node, deadline)
        except (MismatchError, InputError, DTypeError, ErrorBoundError):
            sync.Free()  # raised by the agreement on every rank: every rank frees it here
            raise
        except BaseException:
            # A timeout or a failure on some ranks: requests may be left pending on the
            # duplicate (waiting.abandon), and the other ranks may not be here. Like a
            # failed channel's (Channel.fail), it is never freed.
            from ccoll.collectives.channel import LEAKED

            LEAKED[0] += 1
            raise
        self.grouping: Grouping = grouping
        configure_logging(MPI.COMM_WORLD.Get_rank(), settings.log)
        LOGGER.debug("%d thread(s) per CPU kernel on this rank (%s)", self.threads,
                     self._threads_why)
        sync_ch = Channel(sync, "sync", self.timeout, lanes=settings.sched)
        self._channels: list[Channel] = [sync_ch]
        # The channels are released when the Communicator is dropped unclosed; the list
        # (not self) is what the finalizer holds, so it does not keep self alive. [free]:
        # set by close() (every rank: MPI_Comm_free is collective), never by the collector.
        self._free = [False]
        self._finalizer = weakref.finalize(self, _close_channels, self._channels, self._free)
        two = None
        if node_comm is not None and inter_comm is not None:
            node = Channel(node_comm, "node", self.timeout, lanes=settings.sched)
            inter = Channel(inter_comm, "inter", self.timeout, lanes=settings.sched)
            self._channels += [node, inter]
            two = TwoLevel(grouping, node, inter, settings.node_shm)
        try:
            self.calibration = _calibration.obtain(sync_ch, settings, probe=policy == "auto")
        except BaseException as exc:
            sync_ch.fail(f"the calibration raised {type(exc).__name__}")
            raise
        if self.calibration.seconds > 0.05:
            LOGGER.info("calibrated in %.2f s (link: %s, compressor: %s)",
                        self.calibration.seconds, self.calibration.link,
                        self.calibration.compressor)
        hier = (grouping.nodes, grouping.ranks_per_node) if two is not None else None
        self._sync = Route(sync_ch, self._planner(hier), two, algorithm, policy)
        self._async: Route | None = None
        self._async_lock = threading.Lock()

    def _planner(self, hier: tuple[int, int] | None) -> Planner:
        opts = Options(self.chunk_elems, self.split, self.schedule, hier, self.format_version)
        base = _mix(self.calibration.digest, float(self.settings.digest),
                    float(self.chunk_elems or 0), split_code(self.split),
                    float(SCHEDULES[self.schedule]), *(hier or (0, 0)),
                    float(self.format_version or 0))
        return Planner(self.calibration.params, opts, base, self.calibration.ratio,
                       self.calibration.formats)

    # -- properties ----------------------------------------------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The communicator this one was made from."""
        return self._comm

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    @property
    def rank(self) -> int:
        """Rank of this process."""
        return self._rank

    @property
    def stats(self) -> Stats:
        """Traffic counters of the blocking calls (``iallreduce`` counts in :attr:`async_stats`)."""
        return self._sync.ch.stats

    @property
    def async_stats(self) -> Stats:
        """Traffic counters of ``iallreduce``."""
        return self._async.ch.stats if self._async is not None else Stats()

    @property
    def last_call(self) -> CallReport | None:
        """What the last blocking call did and why (``None`` before the first one).

        A :class:`~ccoll.collectives.report.CallReport`: compressed or raw, the reason
        (the policy, ``eb=None``, the model's prediction or the measured times), the bytes
        this rank sent, the absolute bound and the elapsed seconds. A call that raised
        leaves the previous report.
        """
        return report(self, self._sync)

    @property
    def last_async_call(self) -> CallReport | None:
        """:attr:`last_call` of ``iallreduce`` (set when its request completes)."""
        return None if self._async is None else report(self, self._async)

    def plans(self) -> dict[str, Any]:
        """Return what the plans rest on, for logs and ``ccoll bench --json``.

        The calibration and, per signature, the calls, the agreed times and the current
        plan, of the blocking calls and of ``iallreduce``.
        """
        out: dict[str, Any] = {"calibration": self.calibration.describe(),
                               "sync": self._sync.planner.describe()}
        if self._async is not None:
            out["async"] = self._async.planner.describe()
        return out

    def __repr__(self) -> str:
        return (
            f"<ccoll.Communicator size={self.size} rank={self.rank} algorithm={self.algorithm!r} "
            f"policy={self.policy!r} chunk_elems={self.chunk_elems} timeout={self.timeout} "
            f"split={self.split} ranks_per_node={self.ranks_per_node} "
            f"schedule={self.schedule!r} format_version={self.format_version} "
            f"nodes={self.grouping.nodes} threads={self.threads} "
            f"lanes={any(ch.worker.used_lanes for ch in self._channels)}>"
        )

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _closed(self) -> bool:
        return self._sync.ch.closed

    def __reduce__(self) -> Any:
        # mpi4py refused with "cannot serialize 'mpi4py.MPI.Intracomm'", and copy.copy
        # made a second object over the same channels (closing either closed both).
        raise InputError("a ccoll.Communicator cannot be pickled or copied: it holds MPI "
                         "communicators and threads of this process; make a new one "
                         "(collectively, on every rank) where another is needed")

    def __copy__(self) -> Any:
        return self.__reduce__()

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__reduce__()

    def close(self) -> None:
        """Free the private communicators, stop the compute threads, drop the buffers.

        Every ``iallreduce`` request of this Communicator that has not finished fails with
        :class:`CollectiveError` (queued ones never start). Calling it again does nothing.

        ``MPI_Comm_free`` is collective: call ``close()`` on every rank, after the last
        call of the Communicator (MPICH and Open MPI free locally, so the ranks need not
        close at the same moment). A Communicator that is garbage collected unclosed stops
        its threads and drops its buffers, but leaves its private communicators to
        ``MPI_Finalize`` rather than free them at a point that differs from rank to rank
        (docs/collectives.md, "Ordering rules"): close the ones a long job makes.
        """
        if self._finalizer.alive:
            self._free[0] = True
        self._finalizer()
        self._async = None  # a later iallreduce raises (no new duplicate once closed)
        two = self._sync.two
        if two is not None:
            two.release()

    free = close  # the older name

    # -- collectives ---------------------------------------------------------------------

    def allreduce(self, x: Any, eb: Any = DEFAULT_EB, op: str = "sum", out: Any = None, *,
                  algorithm: str | None = None, policy: str | None = None) -> Any:
        """Sum (``op="sum"``) or mean (``"avg"``) of ``x`` over all ranks, within ``eb``.

        Every rank gets the same array bit for bit. See :func:`ccoll.allreduce`.
        """
        return run_call(self, self._sync, "allreduce", x, eb, op, out, algorithm, policy, None)

    def iallreduce(self, x: Any, eb: Any = DEFAULT_EB, op: str = "sum", out: Any = None, *,
                   algorithm: str | None = None, policy: str | None = None) -> Any:
        """Start :meth:`allreduce` on the progress engine; ``request.wait()`` returns ``y``.

        Do not modify ``x`` (or ``out``) until the request has finished. Every rank must
        start its ``iallreduce`` calls of one Communicator in the same order.
        """
        from ccoll.runtime import progress

        route = self._async_route()
        return progress.submit(run_call, self, route, "allreduce", x, eb, op, out, algorithm,
                               policy, None, comm=route.ch.comm)

    def reduce_scatter(self, x: Any, eb: Any = DEFAULT_EB, op: str = "sum", *,
                       algorithm: str | None = None, policy: str | None = None) -> Any:
        """Return ``numpy.array_split(reduced.ravel(), size)[rank]`` within ``eb``."""
        return run_call(self, self._sync, "reduce_scatter", x, eb, op, None, algorithm, policy,
                        None)

    def allgather(self, x: Any, eb: Any = DEFAULT_EB) -> Any:
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)``, within ``eb``."""
        return run_call(self, self._sync, "allgather", x, eb, None, None, None, None, None)

    def bcast(self, x: Any, eb: Any = DEFAULT_EB, root: int = 0) -> Any:
        """Return the root's ``x`` on every rank (the root too gets the decoded copy).

        Non-root ranks pass ``None`` (they get the root's shape and dtype) or an array of
        the root's shape and dtype, whose values are ignored.
        """
        return run_call(self, self._sync, "bcast", x, eb, None, None, None, None, root)

    # -- what the DDP hook asks ------------------------------------------------------------

    def _raw_settled(self, count: int, dtype: Any, eb: Any, op: str = "avg", *,
                     consume: bool = False) -> bool:
        """Whether the next ``allreduce`` of ``count`` host elements goes raw whatever the data.

        True where the blocking channel's plan for that signature is raw and settled (the
        fast path's test): the same on every rank that asks between the same calls. With
        ``consume`` the call is counted as if it ran (the DDP hook reduces such buckets
        through the process group), so the plan's schedule stays where the call would have
        left it.
        """
        from ccoll.collectives.agreement import BOUND_KINDS, COLLECTIVES, OPS
        from ccoll.collectives.fastpath import NATIVE_CODES

        code = NATIVE_CODES.get(np.dtype(dtype))
        if code is None:
            return False
        if eb is None:
            kind, value = 0, 0.0
        else:
            from ccoll.errorbound import as_bound

            b = as_bound(eb)
            kind, value = BOUND_KINDS[b.kind], b.value
        route = self._sync
        key = (COLLECTIVES["allreduce"], int(count), code, kind, value, OPS[op],
               route.algorithm, route.policy, 0, 0, 0)
        st = route.planner.fast(key)
        if st is None:
            return False
        if consume:
            assert st.cached is not None
            route.planner.end(st, st.cached, 0.0)
            st.unsent.pop("raw", None)  # not a time of ccoll's
        return True

    def _last_plan(self) -> Any:
        """Return the plan of the last blocking call (``None`` before one)."""
        got = self._sync.last
        return None if got is None else got[1]

    # -- channels ------------------------------------------------------------------------

    def _async_route(self) -> Route:
        # Created on the caller's thread at the first iallreduce (Dup is collective and
        # must be ordered like the caller's other collectives on comm).
        with self._async_lock:
            if self._async is None:
                if self._sync.ch.closed:  # no new duplicate for a closed Communicator
                    raise CollectiveError("this ccoll Communicator has been closed (freed)")
                check_alive("ccoll.iallreduce")
                try:
                    dup = dup_comm(self._comm, Deadline(self.timeout, "ccoll.iallreduce"))
                except MPI.Exception as exc:  # the user's communicator, freed since
                    why = exc.Get_error_string().split(", error stack")[0].strip()
                    raise CollectiveError(
                        f"ccoll.iallreduce duplicates the Communicator's MPI communicator at "
                        f"its first call, and MPI refused: {why} (was it "
                        "freed before this Communicator was closed?)") from None
                ch = Channel(dup, "async", self.timeout, lanes=self.settings.sched)
                self._channels.append(ch)
                self._async = Route(ch, self._planner(None), None, self.algorithm, self.policy)
            return self._async


# -- private duplicates and their release ------------------------------------------------


def dup_comm(comm: MPI.Intracomm, deadline: Deadline) -> MPI.Intracomm:
    """Return a duplicate of ``comm`` (collective), within ``deadline``.

    ``MPI_Comm_idup`` under a polled deadline, so that a rank that never joins raises
    :class:`CollectiveError` on the others instead of blocking them forever; the
    half-made duplicate is then left alone (freeing it would need the missing rank).
    """
    if deadline.at is None:
        return comm.Dup()
    dup, req = comm.Idup()
    wait_all([req], deadline, "duplicating the communicator")
    return dup


def _close_channels(channels: list[Channel], free: list[bool]) -> None:
    # Runs from close() (free[0] set: every rank frees its duplicates there) or, for a
    # Communicator dropped unclosed, at garbage collection, which runs at a point of its own
    # on each rank: it stops the threads and drops the buffers, and frees nothing (an
    # MPI_Comm_free there would be a collective call that the other ranks do not make).
    for ch in channels:
        ch.close(free=free[0])
    channels.clear()
