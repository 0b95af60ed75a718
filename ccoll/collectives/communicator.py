"""``ccoll.Communicator``: the collectives, bound to a private duplicate of a communicator.

Each public collective runs the same stages: check the arguments locally (problems are not
raised yet), agree on them with every rank in one small allreduce (which also yields the
global value range for ``REL`` bounds and raises the same error on every rank when the
call is invalid or the ranks disagree), resolve the bound, let the policy choose
compressed or raw, then move data. A failure after the agreement (in the decision, whose
calibrations are collectives too, or while data moves) may leave messages in flight or
peers waiting, so the Communicator refuses further calls (see docs/collectives.md, "Faults").
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ccoll.collectives import exact, gather, model
from ccoll.collectives import trace as _trace
from ccoll.collectives.agreement import (
    _FIELDS,
    ALGORITHMS,
    BOUND_KINDS,
    COLLECTIVES,
    DTYPES,
    OPS,
    PLACES,
    POLICIES,
    SCHEDULES,
    Call,
    agree,
    env_code,
    shape_code,
)
from ccoll.collectives.channel import Channel, Stats
from ccoll.collectives.devices import (
    HOST,
    DeviceData,
    DeviceLanes,
    DevicePlace,
    HostPlace,
    cuda_aware_mpi,
    device_divide,
    device_lanes,
    is_device,
)
from ccoll.collectives.halving import halving_allreduce
from ccoll.collectives.homomorphic import rank_bound, sum_bound
from ccoll.collectives.layout import Layout, block_bounds
from ccoll.collectives.node import Grouping, node_comms, node_threads, rpn_problem
from ccoll.collectives.nodeshm import NodeShm
from ccoll.collectives.nodesum import sum_slots
from ccoll.collectives.policy import Decision, _decide, _fixed
from ccoll.collectives.policy.feedback import FeedbackCall
from ccoll.collectives.report import (
    LOGGER,
    CallReport,
    configure_logging,
    log_level_problem,
)
from ccoll.collectives.ring import Requant, reduce_scatter_streams, ring_allreduce, ring_ops
from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.compressor._backend import is_torch
from ccoll.compressor.cpu import finite_range as cpu_range
from ccoll.compressor.precision import (
    DeviceNarrow,
    Narrow,
    device_low_precision,
    widen,
    widen_device,
)
from ccoll.errorbound import REL, ErrorBound, as_bound, finite_range
from ccoll.errors import CollectiveError, DTypeError, ErrorBoundError, InputError, MismatchError
from ccoll.gpu_sched.scheduler import lanes_enabled
from ccoll.runtime.cpu_threads import env_threads

__all__ = ["Communicator", "DEFAULT_EB", "default_communicator", "existing_default"]

DEFAULT_EB: ErrorBound = REL(1e-3)


@dataclass(slots=True)
class _Prepared:
    """A call after agreement: what every rank knows identically, and this rank's data."""

    x: Any  # the caller's array
    shape: tuple[int, ...]
    dtype: np.dtype
    flat: Any  # 1-D host array, or 1-D numba view of device data
    eb_abs: float
    mode: str  # "compress" | "raw"
    algorithm: str
    avg: bool
    deadline: Deadline
    chunk_elems: int = 0  # elements per pipeline chunk of a compressed call (_chunk); 0: raw
    place: HostPlace = HOST
    dev: DeviceData | None = None
    in_place: bool = False  # out is x's very buffer (MPI_IN_PLACE on the raw path)
    # float16/bfloat16 input (host or device): reduced in float32, rounded once
    narrow: Narrow | DeviceNarrow | None = None
    as_torch: bool = False  # a CPU torch tensor came in: a tensor goes out
    out: Any = None  # the caller's out
    out_arr: Any = None  # the caller's out as the buffer the stage writes (numpy for host)
    # What the report says (Communicator.last_call): see _prepare.
    info: tuple[Any, ...] = ()
    t_start: float = 0.0
    # policy="auto"'s measured feedback: (Feedback, agreed seconds of the previous call,
    # FeedbackCall of this call or None), taken in at the end of the call (_guard).
    feedback: tuple[Any, float, Any] | None = None
    # The raw result when the data collective already ran with the agreement (see agree),
    # and the bytes it sent.
    started: Any = None
    sent_early: int = 0


class _Input(NamedTuple):
    """The input of this rank, as the stages use it."""

    arr: np.ndarray  # host data (float32 for float16/bfloat16); empty for device data
    dev: DeviceData | None  # device data (its float32 copy for float16/bfloat16)
    narrow: Narrow | DeviceNarrow | None
    as_torch: bool
    dtype_name: str  # the caller's dtype, by name ("float16", "bfloat16", ...)


class Communicator:
    """ccoll's collectives on (a private duplicate of) an mpi4py communicator.

    Creating one is collective over ``comm``. Options (identical on every rank; checked):

    - ``algorithm``: ``"homomorphic"`` (default: compress once, add compressed streams,
      decode once) or ``"dar"`` (decompress-add-recompress at every ring step, as C-Coll).
    - ``policy``: ``"auto"`` (default: the cost model of docs/model.md decides per call
      whether compressing pays, and sends raw when it does not), ``"compress"`` (always)
      or ``"raw"`` (never: plain MPI, same API).
    - ``chunk_elems``: elements per pipeline chunk (one stream, one message). Default
      ``None``: chosen per compressed call from the cost model for the message size, the
      rank count and the channel's calibration (docs/collectives.md, "Chunk size"); an
      int fixes it for every compressed call, ``policy="auto"``'s too.
    - ``timeout``: seconds a collective may wait for its peers before it raises
      :class:`~ccoll.errors.CollectiveError` (default ``None``: wait forever, as MPI).
    - ``split``: share of a homomorphic allreduce's bound ``eb`` that goes to the allgather
      phase: the reduce-scatter sums within ``e1 = (1 - split) eb``, the owner of each
      reduced block requantizes it within ``e2 = split * eb`` and the allgather forwards
      that, which does not widen with the number of ranks (docs/error-bound.md, "Split
      bound"). Where the allgather's grid is then an odd multiple ``k`` of the reduced
      sum's, the reduce-scatter keeps more, ``e1 = split * eb * N / k``
      (:func:`ccoll.collectives.model.split_multiple`). ``None`` (default): chosen by the
      cost model from the number of ranks, the share with the fewest bytes
      (:func:`ccoll.collectives.model.split_fraction`), which ``policy="auto"`` uses only
      where :func:`ccoll.collectives.model.split_pays` predicts it faster; ``0``: no
      split (every rank decodes the reduced sum). Host data only (device data runs
      without a split); ``reduce_scatter`` has no allgather and keeps the whole bound.
    - ``ranks_per_node``: the node grouping of hierarchical collectives. ``None`` (default):
      nodes are MPI's shared-memory domains (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``);
      an int ``R``: consecutive blocks of ``R`` ranks form a node (emulated clusters, or a
      user who knows better; the size must be a multiple of ``R``). On at least 2 nodes of
      at least 2 ranks each (all nodes the same size), a compressed allreduce of host data
      sums exactly inside each node, runs the compressed ring between nodes (one ring per
      local rank, on its share) and shares the result inside the node (docs/collectives.md,
      "Hierarchical collectives"); else every call is flat. The grouping is the attribute
      ``grouping`` (:class:`~ccoll.collectives.node.Grouping`).
    - ``schedule``: how a homomorphic allreduce of host data moves its streams between
      ranks (between nodes, for a hierarchical call): ``"ring"`` (``2(N-1)`` steps,
      pipelined chunk by chunk), ``"halving"`` (recursive halving and doubling,
      ``2 log2 N`` steps, partial sums of ``1, 2, 4, ...`` streams;
      :mod:`ccoll.collectives.halving`) or ``"auto"`` (default: the cost model picks per
      call, :func:`ccoll.collectives.model.predict_halving`). Both give the same bound and
      identical results on every rank; ``dar``, device data and ``reduce_scatter`` use the
      ring.

    Creating one also sets the threads of ccoll's CPU kernels in this process (the
    attribute ``threads``, also in the repr): the rank's share of the cores it may run on
    among the ranks of its node, unless ``CCOLL_THREADS`` or ``NUMBA_NUM_THREADS`` says
    otherwise.

    The Communicator holds two private duplicates of ``comm`` (one for blocking calls, one
    for ``iallreduce``), reusable receive buffers and a compute thread for each, and
    traffic counters (:attr:`stats`). Release them with :meth:`close` (or a ``with``
    block); a Communicator that is dropped unclosed releases them when it is garbage
    collected (``MPI_Comm_free`` is local in MPICH, so that makes no collective call).
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
    ) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise InputError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        call = Call("Communicator")
        call.algorithm = _check_option(call, "algorithm", algorithm, ALGORITHMS)
        call.policy = _check_option(call, "policy", policy, POLICIES)
        call.schedule = _check_option(call, "schedule", schedule, SCHEDULES)
        if chunk_elems is not None and (
            isinstance(chunk_elems, bool) or not isinstance(chunk_elems, (int, np.integer))
            or chunk_elems < 1
        ):
            call.problem(InputError, f"chunk_elems must be a positive integer or None (chosen "
                         f"per call), got {chunk_elems!r}")
            chunk_elems = None
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0
        ):
            call.problem(InputError, f"timeout must be None or seconds > 0, got {timeout!r}")
            timeout = None
        call.chunk = 0 if chunk_elems is None else int(chunk_elems)
        if split is not None and (
            isinstance(split, bool) or not isinstance(split, (int, float, np.integer, np.floating))
            or not 0 <= float(split) < 1
        ):
            call.problem(InputError, f"split must be None (chosen by the model) or a number "
                         f"from 0 (no split) up to but not including 1, got {split!r}")
            split = None
        self.split: float | None = None if split is None else float(split)
        call.split = _split_code(self.split)
        rpn_bad = rpn_problem(ranks_per_node, comm.Get_size())
        if rpn_bad is not None:
            call.problem(InputError, rpn_bad)
            ranks_per_node = None
        self.ranks_per_node: int | None = (
            None if ranks_per_node is None else int(ranks_per_node))
        call.rpn = -1 if self.ranks_per_node is None else self.ranks_per_node
        log_problem = log_level_problem()
        if log_problem is not None:
            call.problem(InputError, log_problem)
        threads_problem = env_threads(os.environ)[1]
        if threads_problem is not None:
            call.problem(InputError, threads_problem)
        try:
            lanes_enabled()
        except InputError as exc:
            call.problem(InputError, str(exc))
        call.shown.update({"algorithm": algorithm, "policy": policy,
                           "chunk size": "chosen per call" if chunk_elems is None else chunk_elems,
                           "split": "chosen by the model" if split is None else split,
                           "ranks per node": ("MPI's shared-memory domains"
                                              if ranks_per_node is None else ranks_per_node),
                           "schedule": schedule})
        self.algorithm = algorithm
        self.policy = policy
        self.schedule = schedule
        self.chunk_elems: int | None = None if chunk_elems is None else int(chunk_elems)
        self.timeout = None if timeout is None else float(timeout)
        self._comm = comm
        # Kept so that rank and size still answer after close() (the duplicate is freed).
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        deadline = Deadline(self.timeout, "creating a ccoll Communicator")
        sync = dup_comm(comm, deadline)
        try:
            agree(sync, call, deadline)
            # After the agreement: a call with a bad argument exchanges nothing more.
            self.threads, self._threads_why = node_threads(sync, deadline)
            grouping, node_comm, inter_comm = node_comms(sync, self.ranks_per_node, deadline)
        except BaseException:
            sync.Free()
            raise
        self.grouping: Grouping = grouping
        configure_logging(MPI.COMM_WORLD.Get_rank())
        LOGGER.debug("%d thread(s) per CPU kernel on this rank (%s)", self.threads,
                     self._threads_why)
        self._sync = Channel(sync, "sync", self.timeout)
        self._async: Channel | None = None
        self._async_lock = threading.Lock()
        self._auto: dict[str, Any] = {}
        # Per channel name: agreed signatures of its calls, which predict the next one.
        self._history: dict[str, _History] = {}
        # Per channel name: (decision fields, bytes sent, seconds) of its last call.
        self._last: dict[str, tuple[tuple[Any, ...], int, float]] = {}
        # Both channels are released when the Communicator is dropped unclosed; the list
        # (not self) is what the finalizer holds, so it does not keep self alive.
        self._channels: list[Channel] = [self._sync]
        # The node's and the inter-node (same local rank) communicators of blocking
        # allreduce calls, when the grouping is hierarchical.
        self._node: Channel | None = None
        self._inter: Channel | None = None
        # The node's shared memory of the two-level allreduce (made at its first call).
        self._shm: NodeShm | None = None
        self._shm_failed = False
        self._hier_bufs: np.ndarray | None = None
        if node_comm is not None and inter_comm is not None:
            self._node = Channel(node_comm, "node", self.timeout)
            self._inter = Channel(inter_comm, "inter", self.timeout)
            self._channels += [self._node, self._inter]
        self._finalizer = weakref.finalize(self, _close_channels, self._channels)

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
        return self._sync.stats

    @property
    def async_stats(self) -> Stats:
        """Traffic counters of ``iallreduce``."""
        return self._async.stats if self._async is not None else Stats()

    @property
    def last_call(self) -> CallReport | None:
        """What the last blocking call did and why (``None`` before the first one).

        A :class:`~ccoll.collectives.report.CallReport`: compressed or raw, the reason
        (the policy, ``eb=None``, or ``policy="auto"``'s predicted times and ratio), the
        bytes this rank sent, the absolute bound and the elapsed seconds. A call that
        raised leaves the previous report.
        """
        return self._report("sync")

    @property
    def last_async_call(self) -> CallReport | None:
        """:attr:`last_call` of ``iallreduce`` (set when its request completes)."""
        return self._report("async")

    def __repr__(self) -> str:
        return (
            f"<ccoll.Communicator size={self.size} rank={self.rank} algorithm={self.algorithm!r} "
            f"policy={self.policy!r} chunk_elems={self.chunk_elems} timeout={self.timeout} "
            f"split={self.split} ranks_per_node={self.ranks_per_node} "
            f"schedule={self.schedule!r} "
            f"nodes={self.grouping.nodes} threads={self.threads} "
            f"lanes={any(ch.worker.used_lanes for ch in self._channels)}>"
        )

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the private communicators, stop the compute threads, drop the buffers.

        Wait for every ``iallreduce`` request first: a closed Communicator fails them.
        Calling it again does nothing. ``MPI_Comm_free`` is formally collective but local
        in MPICH (it only drops a reference), so ranks may close at different times.
        """
        self._finalizer()
        self._async = None
        self._shm = None  # unmapped when the last view goes
        self._hier_bufs = None

    free = close  # the older name

    # -- collectives ---------------------------------------------------------------------

    def allreduce(
        self,
        x: Any,
        eb: Any = DEFAULT_EB,
        op: str = "sum",
        out: np.ndarray | None = None,
        *,
        algorithm: str | None = None,
        policy: str | None = None,
    ) -> np.ndarray:
        """Sum (``op="sum"``) or mean (``"avg"``) of ``x`` over all ranks, within ``eb``.

        Every rank gets the same array bit for bit. See :func:`ccoll.allreduce`.
        """
        return self._allreduce(self._sync, x, eb, op, out, algorithm, policy)

    def iallreduce(
        self,
        x: Any,
        eb: Any = DEFAULT_EB,
        op: str = "sum",
        out: np.ndarray | None = None,
        *,
        algorithm: str | None = None,
        policy: str | None = None,
    ) -> Any:
        """Start :meth:`allreduce` on the progress engine; ``request.wait()`` returns ``y``.

        Do not modify ``x`` (or ``out``) until the request has finished. Every rank must
        start its ``iallreduce`` calls of one Communicator in the same order.
        """
        from ccoll.runtime import progress

        ch = self._async_channel()
        return progress.submit(
            self._allreduce, ch, x, eb, op, out, algorithm, policy, comm=ch.comm
        )

    def reduce_scatter(
        self,
        x: Any,
        eb: Any = DEFAULT_EB,
        op: str = "sum",
        *,
        algorithm: str | None = None,
        policy: str | None = None,
    ) -> np.ndarray:
        """Return ``numpy.array_split(reduced.ravel(), size)[rank]`` within ``eb``."""
        ch = self._sync
        p = self._prepare(ch, "reduce_scatter", x, eb, op=op, out=None,
                          algorithm=algorithm, policy=policy)
        return self._guard(ch, p, self._run_reduce_scatter)

    def allgather(self, x: Any, eb: Any = DEFAULT_EB) -> np.ndarray:
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)``, within ``eb``."""
        ch = self._sync
        p = self._prepare(ch, "allgather", x, eb)
        return self._guard(ch, p, self._run_allgather)

    def bcast(self, x: Any, eb: Any = DEFAULT_EB, root: int = 0) -> np.ndarray:
        """Return the root's ``x`` on every rank (the root too gets the decoded copy).

        Non-root ranks pass ``None`` (they get the root's shape and dtype) or an array of
        the root's shape and dtype, whose values are ignored.
        """
        ch = self._sync
        p = self._prepare(ch, "bcast", x, eb, root=root)
        return self._guard(ch, p, self._run_bcast, root)

    # -- stages --------------------------------------------------------------------------

    def _auto_policy(self, ch: Channel) -> Any:
        """Return the ``policy="auto"`` state (calibration) of a channel, made on first use."""
        pol = self._auto.get(ch.name)
        if pol is None:
            from ccoll.collectives.policy import AutoPolicy

            pol = self._auto[ch.name] = AutoPolicy(ch)
            if self._hier_channel(ch):
                pol.hier = (self.grouping.nodes, self.grouping.ranks_per_node)
        return pol

    def _hier_channel(self, ch: Channel) -> bool:
        """Whether ``ch``'s allreduce calls may run in two levels (blocking calls only)."""
        return ch is self._sync and self._inter is not None

    def _async_channel(self) -> Channel:
        # Created on the caller's thread at the first iallreduce (Dup is collective and
        # must be ordered like the caller's other collectives on comm).
        with self._async_lock:
            if self._async is None:
                if self._sync.closed:  # no new duplicate for a closed Communicator
                    raise CollectiveError("this ccoll Communicator has been closed (freed)")
                dup = dup_comm(self._comm, Deadline(self.timeout, "ccoll.iallreduce"))
                self._async = Channel(dup, "async", self.timeout)
                self._channels.append(self._async)
            return self._async

    def _allreduce(
        self,
        ch: Channel,
        x: Any,
        eb: Any,
        op: str,
        out: np.ndarray | None,
        algorithm: str | None,
        policy: str | None,
    ) -> np.ndarray:
        p = self._prepare(ch, "allreduce", x, eb, op=op, out=out,
                          algorithm=algorithm, policy=policy)
        return self._guard(ch, p, self._run_allreduce)

    def _guard(self, ch: Channel, p: _Prepared, fn: Any, *args: Any) -> Any:
        """Run the data-moving stage; on failure mark the channel unusable and re-raise.

        On success, leave the call's report (:attr:`last_call`) and log it.
        """
        name = p.info[0]
        t0 = time.perf_counter()
        # A call that moved its data with the agreement counted its bytes then.
        sent0 = ch.stats.bytes_sent - p.sent_early
        try:
            y = fn(ch, p, *args)
        except BaseException as exc:
            ch.fail(f"ccoll.{name} raised {type(exc).__name__}")
            raise
        t1 = time.perf_counter()
        sent = ch.stats.bytes_sent - sent0
        ch.stats.calls += 1
        ch.stats.last = {"seconds": t1 - t0, "bytes_sent": float(sent)}
        # The report is built when asked for (or logged): a raw call stays cheap.
        self._last[ch.name] = (p.info, sent, t1 - p.t_start)
        if p.feedback is not None:  # after the data moved: the next call's decision uses it
            fb, agreed_s, fb_call = p.feedback
            fb.end_call(agreed_s, fb_call, t1 - p.t_start)
        if LOGGER.isEnabledFor(logging.INFO):
            LOGGER.info("%s", self._report(ch.name))
        rec = _trace.ACTIVE
        if rec is not None:  # the clock is perf_counter, the tracer's own
            rec.span(name, t0, t1, {"mode": p.mode, "bytes_sent": float(sent)})
        return y

    def _report(self, channel: str) -> CallReport | None:
        got = self._last.get(channel)
        if got is None:
            return None
        info, sent, seconds = got
        (collective, compressed, reason, policy, algorithm, dtype, count, eb_abs, nbytes,
         t_raw, t_comp, ratio, started, chunk, hier) = info
        g = self.grouping
        return CallReport(collective, compressed, reason, policy, algorithm, dtype, count,
                          eb_abs, nbytes, sent, seconds, t_raw, t_comp, ratio, started, chunk,
                          hier, g.nodes, g.ranks_per_node)

    def _prepare(
        self,
        ch: Channel,
        collective: str,
        x: Any,
        eb: Any,
        *,
        op: str | None = None,
        out: Any = None,
        algorithm: str | None = None,
        policy: str | None = None,
        root: int | None = None,
    ) -> _Prepared:
        # Every call passes through here, raw ones too: keep it cheap. Values for error
        # messages are stored as passed and formatted only if the agreement fails.
        t_start = time.perf_counter()
        rec = _trace.ACTIVE
        t_check = rec.clock() if rec is not None else 0.0
        ch.check_usable()
        g = self.grouping
        call = Call(collective, chunk=self.chunk_elems or 0, split=_split_code(self.split),
                    nodes=g.nodes, rpn=g.ranks_per_node)
        shown = call.shown
        shown["split"] = "chosen by the model" if self.split is None else self.split
        n_ranks = ch.comm.Get_size()
        is_root = root is not None and ch.comm.Get_rank() == root
        # bcast(None) on a non-root rank: shape and dtype come from the root after the
        # agreement (which still checks the ranks that passed an array).
        wild = x is None and collective == "bcast" and not is_root and _valid_root(root, n_ranks)
        if wild:
            call.wild = True
            inp = _Input(np.empty(0, np.float32), None, None, False, "None")
            shown["dtype"] = shown["element count"] = shown["shape"] = "None (the root's)"
        else:
            inp = _as_array(call, x, collective)
        arr, dev = inp.arr, inp.dev
        shape, dtype = (arr.shape, arr.dtype) if dev is None else (dev.shape, dev.dtype)
        size = arr.size if dev is None else math.prod(shape)
        call.place = PLACES["host" if dev is None else "device"]
        shown["data location"] = "host" if dev is None else "device"
        if not wild:
            call.count = size
            call.dtype = DTYPES.get(inp.dtype_name, 0) if dtype.isnative else 0
            shown["dtype"] = inp.dtype_name
            shown["element count"] = size
            if call.dtype == 0 and not call.problems:
                call.problem(DTypeError, _dtype_message(inp.dtype_name, dtype, dev is not None))
            if collective in ("allgather", "bcast"):
                call.shape = shape_code(shape)
                shown["shape"] = shape
        bound = _bound(call, eb)
        if op is not None:
            call.op = OPS.get(op, 0) if isinstance(op, str) else 0
            shown["op"] = op
            if call.op == 0:
                call.problem(InputError, f"op {op!r} is not supported: pass op='sum' or 'avg'")
        # The Communicator's own options were checked when it was made.
        if algorithm is None:
            algorithm = self.algorithm
            call.algorithm = ALGORITHMS[algorithm]
        else:
            call.algorithm = _check_option(call, "algorithm", algorithm, ALGORITHMS)
        if policy is None:
            policy = self.policy
            call.policy = POLICIES[policy]
        else:
            call.policy = _check_option(call, "policy", policy, POLICIES)
        shown["algorithm"] = algorithm
        shown["policy"] = policy
        if policy == "auto" and bound is not None:
            # The call may calibrate, and the CCOLL_* overrides decide with which collectives.
            call.env, shown["CCOLL_* settings"] = env_code()
        if root is not None:
            if not _valid_root(root, n_ranks):
                call.problem(
                    InputError,
                    f"root {root!r} is not a rank of a communicator of size {n_ranks}: pass "
                    f"an int from 0 to {n_ranks - 1}, the same on every rank",
                )
                call.root = -1
            else:
                call.root = int(root)
            shown["root"] = root
        out_arr = None
        if out is not None:
            out_arr = _check_out(call, out, shape, dtype, arr if dev is None else dev, inp)
        mode: str | None = None
        auto = None
        sticky_key: Any = None
        why = ""
        if not wild:
            mode, auto, sticky_key, why = self._before_agreement(
                ch, call, collective, size, dtype, algorithm, policy, bound)
        if isinstance(bound, REL) and mode != "raw" and not call.problems and not wild:
            if root is None or is_root:
                call.lo, call.hi = _finite_range(arr, dev)
        deadline = Deadline(ch.timeout, f"ccoll.{collective}")
        pol = self._auto.get(ch.name)
        if pol is not None:  # this rank's time of the previous call, for the feedback
            call.elapsed = pol.feedback.outgoing()
        # A call that repeats the predicted signature and is raw whatever the data (known
        # before the agreement, from agreed state only) runs its MPI collective while the
        # agreement is in flight: no latency of its own for the check.
        hist = self._history.get(ch.name)
        predicted = hist.predicted if hist is not None else None
        run = dummy = None
        start: _Start | None = None
        if predicted is not None:
            dummy = _Dummy(ch, predicted, deadline).run
            if mode == "raw" and dev is None and not wild and not call.problems:
                start = _Start(ch, collective, arr, shape, out, out_arr, x, inp.narrow, root,
                               deadline)
                run = start.run
        if rec is not None:
            t_agree = rec.clock()
            rec.span("check", t_check, t_agree)
        try:
            agreed = agree(ch.comm, call, deadline, predicted=predicted, run=run,
                           dummy=dummy)
        except (MismatchError, InputError, DTypeError, ErrorBoundError):
            raise  # the same on every rank, every request complete: the channel is fine
        except BaseException as exc:
            what = ("timed out in" if isinstance(exc, CollectiveError)
                    else f"raised {type(exc).__name__} in")
            ch.fail(f"ccoll.{collective} {what} its agreement step")
            raise
        if rec is not None:
            rec.span("agree", t_agree, rec.clock(), {"data started": agreed.started})
        if hist is None:
            hist = self._history[ch.name] = _History()
        hist.note(None if agreed.none else agreed.sig)
        if agreed.mixed and collective != "bcast":
            # Cannot happen: whether a call starts early depends only on its agreed fields
            # and agreed state. Its result may be partial, so no rank returns it.
            ch.fail(f"ccoll.{collective}: ranks disagreed on starting early")
            raise CollectiveError(
                f"ccoll.{collective}: some ranks ran the data collective with the agreement "
                "and some did not although they agreed on every argument; this ccoll "
                "Communicator cannot be used any more")
        # From here on the other ranks go ahead (the decision's calibrations are
        # collectives): any failure leaves them waiting, so it fails the channel.
        try:
            if agreed.none:
                inp = _bcast_header(ch, root, inp, deadline)
                if wild:
                    arr = inp.arr
                    shape, dtype, size = arr.shape, arr.dtype, arr.size
                    # The calibrations are the same on every rank: so is this answer.
                    mode, auto, sticky_key, why = self._before_agreement(
                        ch, call, collective, size, dtype, algorithm, policy, bound)
            eb_abs = 0.0 if mode == "raw" or bound is None else bound.resolve(agreed.lo, agreed.hi)
            t_raw = t_comp = ratio = None
            n_cal = auto.calibrations if auto is not None else 0
            if mode is None:
                t_decide = rec.clock() if rec is not None else 0.0
                mode = _decide(
                    Decision(
                        collective=collective,
                        policy=policy,
                        algorithm=algorithm,
                        exact=bound is None,
                        count=size,
                        dtype=dtype,
                        n_ranks=n_ranks,
                        # The ring's streams, which the ratio depends on, bound the sum.
                        eb_abs=sum_bound(eb_abs, n_ranks, op == "avg"),
                        data=arr if dev is None else dev.flat(),
                        auto=auto,
                        root=root,
                    )
                )
                if auto is not None:
                    auto.note_decision(sticky_key)
                    d = auto.last
                    why = d.reason
                    if d.prediction is not None:
                        pr = d.prediction
                        t_raw = pr.raw
                        t_comp = pr.homomorphic if algorithm == "homomorphic" else pr.dar
                        ratio = d.ratio
                if rec is not None:
                    rec.span("decide", t_decide, rec.clock(), {"mode": mode})
            elif why.startswith(("known raw", "sticky raw")) and auto is not None:
                auto.note_known_raw(sticky_key)
            # Two levels: a compressed allreduce of host data on a hierarchical grouping.
            hier = (mode == "compress" and collective == "allreduce" and dev is None
                    and self._hier_channel(ch))
            paths = hier  # both the flat ring and two levels could run this call
            chunk_auto = auto
            if hier and auto is not None and sticky_key is not None:
                # policy="auto": the model's path until both are measured, then the faster
                # (agreed times only: the same on every rank).
                model_two = auto.last is not None and auto.last.two_level
                hier, path_why = auto.feedback.path(sticky_key, model_two)
                if path_why:
                    why = f"{why}; {path_why}" if why else path_why
                if hier != model_two:  # the model's chunk was for the other path
                    chunk_auto = None
            if hier:  # the inter-node ring's share and ranks
                chunk = self._chunk(ch, chunk_auto, mode, -(-size // g.ranks_per_node), dtype,
                                    g.nodes)
            else:
                chunk = self._chunk(ch, chunk_auto, mode, size, dtype, n_ranks)
            if start is not None:
                flat = start.flat
                place: HostPlace = HOST
            elif dev is None:
                flat = np.ascontiguousarray(arr).reshape(-1)
                place = HOST
            else:
                flat = dev.flat()
                place = DevicePlace(ch, cuda_aware_mpi(), device_lanes())
                # A compressed call reads x on the lanes, which wait for x's stream on the
                # device; a raw one copies or hands x to MPI: the host waits for it.
                dev.ready(place.lanes if mode == "compress" else DeviceLanes(None))
            stats = ch.stats
            nbytes = size * dtype.itemsize
            stats.bytes_input += nbytes
            if mode == "compress":
                stats.compressed_calls += 1
            # _check_out allowed only two cases: no overlap, or out is x's very buffer
            # (never for float16/bfloat16: their float32 copy is what moves).
            in_place = _in_place(x, out, out_arr, inp.narrow, flat, dev)
            compressed = mode == "compress"
            info = (collective, compressed, why, policy, algorithm, inp.dtype_name, size,
                    eb_abs if compressed else None, nbytes, t_raw, t_comp, ratio,
                    agreed.started, chunk, hier)
            feedback = None
            pol = self._auto.get(ch.name)
            if pol is not None:
                fb_call = None
                if auto is not None and sticky_key is not None and not why.startswith(
                        "known raw"):
                    fb_call = FeedbackCall(sticky_key, compressed, auto.calibrations == n_cal,
                                           t_raw, hier if paths else None)
                feedback = (pol.feedback, agreed.elapsed, fb_call)
            return _Prepared(
                x, shape, dtype, flat, eb_abs, mode, algorithm, op == "avg", deadline, chunk,
                place, dev, in_place, inp.narrow, inp.as_torch, out, out_arr, info, t_start,
                feedback,
                *((start.y, start.sent) if agreed.started and start is not None else ()),
            )
        except BaseException as exc:
            ch.fail(f"ccoll.{collective} raised {type(exc).__name__} after its agreement")
            raise

    def _chunk(self, ch: Channel, auto: Any, mode: str, count: int, dtype: np.dtype,
               n_ranks: int) -> int:
        """Elements per pipeline chunk of a compressed call (0 for a raw one).

        An explicit ``chunk_elems`` wins; else ``policy="auto"``'s choice when the model
        decided this call; else the model's rule (:func:`model.chunk_elems_for`) with the
        channel's calibrations if ``policy="auto"`` made some (no collective: only what is
        already agreed), else with its defaults. Every input is agreed: so is the chunk.
        """
        if mode != "compress":
            return 0
        if self.chunk_elems is not None:
            return self.chunk_elems
        if auto is not None and auto.last is not None and auto.last.chunk_elems > 0:
            return int(auto.last.chunk_elems)
        pol = self._auto.get(ch.name)
        if pol is not None:
            return int(pol.model_chunk(count, dtype, n_ranks))
        return model.chunk_elems_for(count, dtype.itemsize, n_ranks, model.DEFAULTS)

    def raw_settled(self, count: int, dtype: Any, eb: Any, *, consume: bool = False) -> bool:
        """Tell whether an ``allreduce`` of ``count`` elements goes raw whatever the data.

        True where a call with this count, dtype and bound would be sent raw from agreed
        state alone, before its agreement: by the calibrations (``known_raw``) or by a
        recent model decision that repeats (``sticky_raw``); for ``eb=None`` and
        ``policy="raw"`` always. Local and free, and the same on every rank that asks
        between the same collective calls of this Communicator (the state it reads changes
        only inside them). With ``consume``, a sticky decision counts the call as one of
        its repetitions, as a call that went raw on it would: a caller that reduces such a
        call some other way (the DDP hook, through the process group) keeps the policy's
        state where the call itself would have left it. Calls that the policy's measured
        feedback sends raw answer False: that state changes only through ccoll's calls.
        """
        if eb is None or self.policy == "raw":
            return True
        if self.policy != "auto":
            return False
        bound = as_bound(eb)
        dt = np.dtype(dtype)
        ch = self._sync
        auto = self._auto_policy(ch)
        if auto.known_raw(count, dt, collective="allreduce", algorithm=self.algorithm):
            return True
        key = (count, dt, "allreduce", self.algorithm, type(bound), bound.value)
        if not auto.sticky_raw(key):
            return False
        if consume:
            auto.use_sticky(key)
        return True

    def _before_agreement(
        self, ch: Channel, call: Call, collective: str, size: int, dtype: np.dtype,
        algorithm: str, policy: str, bound: ErrorBound | None,
    ) -> tuple[str | None, Any, Any, str]:
        """Return the mode that needs no model (or None), the AutoPolicy, sticky key, reason.

        A policy="auto" call that the calibrations already send raw skips the value range
        (a raw call does not use the bound; the range costs ~5% of a large raw allreduce)
        and the policy; so does policy="raw". Same answer on every rank (see known_raw).
        """
        if bound is None:
            return "raw", None, None, "eb=None: exact"
        if policy != "auto" or call.problems:
            mode = _fixed(policy, False, False)
            return mode, None, None, f"policy={policy!r}" if mode is not None else ""
        auto = self._auto_policy(ch)
        sticky_key = (size, dtype, collective, algorithm, type(bound), bound.value)
        if auto.known_raw(size, dtype, collective=collective, algorithm=algorithm):
            return "raw", auto, sticky_key, "known raw from calibration"
        if auto.sticky_raw(sticky_key):
            return ("raw", auto, sticky_key,
                    "sticky raw: the model sent this call raw on a recent call")
        measured = auto.feedback.raw_reason(sticky_key)
        if measured is not None:  # earlier calls of this key measured raw faster
            return "raw", auto, sticky_key, measured
        return None, auto, sticky_key, ""

    def _run_allreduce(self, ch: Channel, p: _Prepared) -> Any:
        n_ranks = ch.comm.Get_size()
        y = p.started if p.started is not None else _new_output(p, p.shape, p.out_arr)
        yflat = y.reshape(y.size)
        if p.started is not None:
            pass  # moved with the agreement
        elif p.mode == "raw":
            _on_mpi_buffers(ch, p, p.flat, yflat, lambda xs, ys: exact.allreduce(
                ch, xs, ys, p.deadline, in_place=p.in_place and xs is p.flat))
        elif p.info[-1]:
            self._hier_allreduce(ch, p, yflat)
            return _result(p, y, p.out)
        elif p.flat.size:
            # The ring bounds the sum; avg's bound is on the sum divided by N.
            ring_eb, requant = self.ring_bounds(
                p.eb_abs, n_ranks, p.avg, p.algorithm, p.dev is not None,
                timing=self._timing(ch, p.flat.size, p.dtype),
                size=float(p.flat.size * p.dtype.itemsize))
            pieces = self._halving(ch, p, p.flat.size, n_ranks, requant, p.dtype.itemsize)
            if pieces:
                halving_allreduce(ch, p.flat, yflat, p.dtype, ring_eb, pieces=pieces,
                                  deadline=p.deadline, requant=requant)
            else:
                ring_allreduce(ch, p.flat, yflat, p.dtype, ring_eb, algorithm=p.algorithm,
                               chunk_elems=p.chunk_elems, deadline=p.deadline,
                               place=p.place, requant=requant)
            if requant is not None:  # the owners divided before they requantized
                return _result(p, y, p.out)
        if p.avg:
            _divide(p, yflat, n_ranks)
        return _result(p, y, p.out)

    def _halving(self, ch: Channel, p: _Prepared, count: int, n_ranks: int,
                 requant: Requant | None, itemsize: int) -> int:
        """First-step pieces if this allreduce moves its streams by halving; 0: the ring.

        ``schedule="halving"`` or ``"ring"`` decide; ``"auto"`` asks the cost model
        (:func:`model.choose_schedule`) with the channel's calibrations and last sampled
        ratio (``policy="auto"``'s, else the defaults). Host data and the homomorphic
        algorithm only. The pieces are about the call's chunk (at least
        ``model.MIN_CHUNK_BYTES`` unless the Communicator fixes ``chunk_elems``). Every
        input is agreed, so every rank takes the same schedule and pieces.
        """
        if p.algorithm != "homomorphic" or p.dev is not None or n_ranks < 2:
            return 0
        pieces = model.halving_pieces(count, itemsize, p.chunk_elems,
                                      fixed=self.chunk_elems is not None)
        if self.schedule != "auto":
            return pieces if self.schedule == "halving" else 0
        pol = self._auto.get(ch.name) or self._auto.get(self._sync.name)
        if pol is not None:
            params, ratio = pol.model_params(count, p.dtype)
        else:
            params, ratio = model.DEFAULTS, model.DEFAULT_RATIO
        share = 0.0 if requant is None else requant.share
        size = float(count * itemsize)
        block = -(-count // n_ranks)
        chunks = max(1, -(-block // max(1, p.chunk_elems)))
        choice = model.choose_schedule(size, n_ranks, params, ratio, share=share,
                                       chunks=chunks, pieces=pieces)
        return pieces if choice == "halving" else 0

    def _timing(self, ch: Channel, count: int,
                dtype: np.dtype) -> tuple[model.Params, float] | None:
        """Return the ``policy="auto"`` state's model constants and ratio; None without one.

        The same agreed calibrations as the schedule's choice (:meth:`_halving`): the state
        exists on every rank of the channel once a call on it ran with ``policy="auto"``
        (all ranks make the same calls), so every rank gets the same answer.
        """
        pol = self._auto.get(ch.name) or self._auto.get(self._sync.name)
        return None if pol is None else pol.model_params(count, dtype)

    def split_share(self, n_ranks: int, algorithm: str, device: bool) -> float:
        """Share of an allreduce's bound that its allgather phase gets (0: no split).

        The Communicator's ``split``, or the model's choice for ``n_ranks`` when it is
        ``None``; 0 for one rank, for DAR and for device data. Agreed inputs only: the same
        on every rank.
        """
        if n_ranks < 2 or algorithm != "homomorphic" or device:
            return 0.0
        return model.split_fraction(n_ranks) if self.split is None else self.split

    def _hier_allreduce(self, ch: Channel, p: _Prepared, yflat: np.ndarray) -> None:
        """Two-level compressed allreduce of host data into ``yflat`` (docs/collectives.md).

        (1) Local rank ``l`` gets the node's float64 sum of share ``l``
        (``numpy.array_split(x, R)[l]``): through the node's shared memory
        (:mod:`~ccoll.collectives.nodeshm`: every rank writes its input, one node barrier,
        each rank adds its share of the ``R`` inputs in local rank order), else
        ``MPI_Reduce_scatter`` of float64 copies; (2) the compressed ring of the ranks with
        local rank ``l`` on all nodes reduces those node sums (op="sum" with the bound of
        the whole result: ``N eb`` for an average, divided by ``N`` once); (3) every rank
        gets all shares, the same bytes: the owners write them into the shared result, a
        barrier, every rank copies it out (else ``MPI_Allgatherv``).
        """
        node, inter = self._node, self._inter
        assert node is not None and inter is not None
        if p.flat.size == 0:  # agreed: every rank skips
            return
        g = self.grouping
        n_ranks, r = ch.comm.Get_size(), g.ranks_per_node
        bounds = block_bounds(p.flat.size, r)
        counts = [b - a for a, b in bounds]
        lo, hi = bounds[g.local]
        sent = node.stats.bytes_sent + inter.stats.bytes_sent
        rec = _trace.ACTIVE
        t0 = rec.clock() if rec is not None else 0.0
        shm = self._node_memory(node, p.flat.size, p.dtype, p.deadline)
        # The float64 share and its reduced copy, reused across calls: fresh 100 MB arrays
        # would page-fault on every call (measured: as long as the node phases themselves).
        k = hi - lo
        if self._hier_bufs is None or self._hier_bufs.size < 2 * k:
            self._hier_bufs = None
            self._hier_bufs = np.empty(2 * k, np.float64)
        share, reduced = self._hier_bufs[:k], self._hier_bufs[k:2 * k]
        if shm is not None:
            slots = shm.slots
            mine = slots[g.local]
            for m, (a, b) in enumerate(bounds):  # the other ranks read only their shares
                if m != g.local:
                    mine[a:b] = p.flat[a:b]
            wait_all([node.comm.Ibarrier()], p.deadline, "node barrier (inputs written)",
                     poll=True)
            sum_slots(p.flat, slots[:r], g.local, lo, share)
            # What the other ranks read of this rank's input (an MPI ring's bytes).
            node.stats.bytes_sent += (p.flat.size - (hi - lo)) * p.dtype.itemsize
        else:
            wide = p.flat.astype(np.float64)  # the node sums in float64: one rounding at the end
            exact.reduce_scatter(node, wide, counts, share, p.deadline)
            del wide
        if rec is not None:
            t1 = rec.clock()
            rec.span("node reduce", t0, t1, {"shared memory": shm is not None})
        if share.size:  # the same size on every node's rank l: all skip, or none
            ring_eb, requant = self.ring_bounds(
                p.eb_abs, n_ranks, p.avg, p.algorithm, ring_ranks=g.nodes,
                timing=self._timing(inter, share.size, p.dtype),
                size=float(share.size * p.dtype.itemsize))
            pieces = self._halving(inter, p, share.size, g.nodes, requant, share.itemsize)
            if pieces:
                halving_allreduce(inter, share, reduced, np.dtype(np.float64), ring_eb,
                                  pieces=pieces, deadline=p.deadline, requant=requant)
            else:
                ring_allreduce(inter, share, reduced, np.dtype(np.float64), ring_eb,
                               algorithm=p.algorithm, chunk_elems=p.chunk_elems,
                               deadline=p.deadline, requant=requant)
            if requant is None and p.avg:  # requant's owners divided before requantizing
                np.divide(reduced, float(n_ranks), out=reduced)
        t2 = rec.clock() if rec is not None else 0.0
        if shm is not None:
            result = shm.slots[r]
            # The one rounding to the dtype, before sharing. Only this rank touches
            # [lo, hi) of the regions, and every rank copied the previous call's result
            # out before it passed this call's first barrier.
            with np.errstate(over="ignore"):  # beyond the dtype's range: ±Inf
                result[lo:hi] = reduced
            wait_all([node.comm.Ibarrier()], p.deadline, "node barrier (result written)",
                     poll=True)
            np.copyto(yflat, result[:p.flat.size])
            node.stats.bytes_sent += (r - 1) * (hi - lo) * p.dtype.itemsize
        else:
            with np.errstate(over="ignore"):  # the one rounding to the dtype, before sharing
                mine = reduced.astype(p.dtype)
            displs = [a for a, _ in bounds]
            if p.deadline.at is None:
                node.comm.Allgatherv(mine, [yflat, (counts, displs)])
            else:
                req = node.comm.Iallgatherv(mine, [yflat, (counts, displs)])
                wait_all([req], p.deadline, "MPI_Iallgatherv in the node")
            node.stats.bytes_sent += (r - 1) * mine.nbytes
        if rec is not None:
            rec.span("node share", t2, rec.clock(), {"shared memory": shm is not None})
        ch.stats.bytes_sent += node.stats.bytes_sent + inter.stats.bytes_sent - sent

    def _node_memory(self, node: Channel, count: int, dtype: np.dtype,
                     deadline: Deadline) -> NodeShm | None:
        """Return the node's shared memory for ``count`` elements of ``dtype``, or ``None``.

        Made at the first call that needs it (collective over the node: every rank of the
        node gets the same answer from agreed arguments) and reused while calls fit; a
        node where it could not be made uses MPI's collectives from then on.
        """
        shm = self._shm
        if self._shm_failed or (shm is not None and shm.fits(count, dtype)):
            return shm
        self._shm = None  # drop the old mapping before making a larger one
        shm = NodeShm.create(node.comm, count, dtype, deadline)
        self._shm = shm
        self._shm_failed = shm is None
        return shm

    def ring_bounds(self, eb_abs: float, n_ranks: int, avg: bool, algorithm: str = "homomorphic",
                    device: bool = False, ring_ranks: int | None = None, *,
                    timing: tuple[model.Params, float] | None = None, size: float = 0.0,
                    ) -> tuple[float, Requant | None]:
        """Bound of the reduce-scatter's sum and the requantization of an allreduce.

        ``eb_abs`` bounds the result (the average for ``avg``). With a split share ``f``,
        ``e2 = fl(f eb)`` and ``e1 = fl(eb - e2)``: the sum is bounded by ``e1`` (``N e1``
        for an average) and each reduced block is requantized within ``e2``. Where ``f``
        makes the allgather's grid an odd multiple ``k`` of the reduced sum's
        (:func:`model.split_multiple`), ``e1 = fl(eb f K / k)``, the grid is ``k`` times the
        sum's (``e2 = fl(k eb_r / D)``, ``eb_r`` one stream's grid bound, ``D`` the divisor)
        and the requantization may move a value by ``fl(eb - e1)`` at most, which the owner
        checks. Without a split the sum is bounded by ``eb`` (``N eb``) and nothing is
        requantized (docs/error-bound.md, "Split bound"). ``ring_ranks``: the ranks of the
        ring when it is not all ``n_ranks`` (the inter-node ring of a hierarchical call,
        whose split the model chooses for its own size); ``N`` stays the number of ranks the
        average divides by. ``timing`` (the ``policy="auto"`` state's agreed model constants
        and ratio) and ``size`` (bytes per rank of the ring): with ``split=None`` the model's
        share is used only where :func:`model.split_pays` predicts it faster than no split
        (its requantization costs compute); without ``timing`` it is used as it minimizes
        bytes.
        """
        streams = n_ranks if ring_ranks is None else ring_ranks
        share = self.split_share(streams, algorithm, device)
        if share > 0.0 and self.split is None and timing is not None:
            params, ratio = timing
            if not model.split_pays(size, streams, params, ratio, share):
                share = 0.0
        if share <= 0.0 or eb_abs == 0.0:
            return sum_bound(eb_abs, n_ranks, avg), None
        divide = n_ranks if avg else 1
        k = model.split_multiple(streams, share)
        if k:  # the allgather's grid is k times the reduced sum's
            e1 = eb_abs * model.split_reduce_share(streams, share)
            accept = eb_abs - e1
            ring_eb = sum_bound(e1, n_ranks, avg)
            e2 = k * rank_bound(ring_eb, streams) / divide
            if 0.0 < accept < e2 and 0.0 < e1 < eb_abs:
                return ring_eb, Requant(e2, divide, accept, share)
        e2 = eb_abs * share
        e1 = eb_abs - e2
        return sum_bound(e1, n_ranks, avg), Requant(e2, divide, None, share)

    def _run_reduce_scatter(self, ch: Channel, p: _Prepared) -> Any:
        n_ranks, r = ch.comm.Get_size(), ch.comm.Get_rank()
        if p.started is not None:
            y = p.started
            if p.avg:
                _divide(p, y, n_ranks)
            return _result(p, y, None)
        # A raw call uses only the blocks: any chunk does.
        layout = Layout(p.flat.size, n_ranks, p.chunk_elems or max(1, p.flat.size))
        blocks = layout.blocks
        lo, hi = blocks[r]
        y = _new_output(p, (hi - lo,), None)
        if p.mode == "raw":
            counts = [b - a for a, b in blocks]
            _on_mpi_buffers(ch, p, p.flat, y, lambda xs, ys: exact.reduce_scatter(
                ch, xs, counts, ys, p.deadline))
        elif p.flat.size:
            ring_eb = sum_bound(p.eb_abs, n_ranks, p.avg)
            ops = ring_ops(p.flat, layout, p.algorithm, ring_eb, p.place)
            mine = reduce_scatter_streams(ch, layout, p.dtype, ops, ring_eb, p.deadline, p.place)
            gather.decode_block(layout, r, p.dtype, mine, ring_eb, y, p.place.lanes)
        if p.avg:
            _divide(p, y, n_ranks)
        return _result(p, y, None)

    def _run_allgather(self, ch: Channel, p: _Prepared) -> Any:
        n_ranks = ch.comm.Get_size()
        if p.started is not None:
            return _result(p, p.started, None)
        y = _new_output(p, (n_ranks, *p.shape), None)
        yflat = y.reshape(n_ranks, p.flat.size)
        if p.mode == "raw":
            _on_mpi_buffers(ch, p, p.flat, yflat, lambda xs, ys: exact.allgather(
                ch, xs, ys, p.deadline))
        elif p.flat.size:
            gather.allgather(ch, p.flat, p.eb_abs, yflat, p.deadline, p.place)
        return _result(p, y, None)

    def _run_bcast(self, ch: Channel, p: _Prepared, root: int) -> Any:
        if p.started is not None:
            return _result(p, p.started, None)
        y = _new_output(p, p.shape, None)
        yflat = y.reshape(y.size)
        if p.mode == "raw":
            is_root = ch.comm.Get_rank() == root

            def bcast(xs: Any, ys: Any) -> None:
                if is_root:
                    if isinstance(ys, np.ndarray):
                        ys[...] = xs
                    else:  # device buffers (CUDA-aware MPI): device-to-device copy
                        ys.copy_to_device(xs)
                exact.bcast(ch, ys, root, p.deadline)

            _on_mpi_buffers(ch, p, p.flat if is_root else None, yflat, bcast)
        elif p.flat.size:
            gather.bcast(ch, p.flat, p.eb_abs, root, yflat, p.deadline, p.place)
        return _result(p, y, None)


# -- raw calls that start with their agreement ------------------------------------------

_HISTORY_MAX = 256
_BY_CODE = {v: k for k, v in COLLECTIVES.items()}


class _History:
    """Agreed signatures of a channel's calls, and the one predicted for the next call.

    The prediction is the signature that followed the last call's last time (a training
    step repeats its sequence of buckets), else the last call's own: the same on every
    rank, since only agreed signatures go in. ``None`` after a bcast with a None rank.
    """

    __slots__ = ("last", "following", "predicted")

    def __init__(self) -> None:
        self.last: tuple[float, ...] | None = None
        self.following: dict[tuple[float, ...], tuple[float, ...] | None] = {}
        self.predicted: tuple[float, ...] | None = None

    def note(self, sig: tuple[float, ...] | None) -> None:
        """Record the agreed signature of a call (``None``: not to be repeated early)."""
        following = self.following
        if self.last is not None:
            if len(following) >= _HISTORY_MAX and self.last not in following:
                following.clear()  # a job that never repeats: start over
            following[self.last] = sig
        self.last = sig
        self.predicted = None if sig is None else following.get(sig, sig)


def _sig_field(sig: tuple[float, ...], name: str) -> int:
    return int(sig[_FIELD_INDEX[name]])


def _mpi_dtype(code: int) -> np.dtype:
    """Return the dtype a raw call moves for a dtype code (float16/bfloat16: float32)."""
    return np.dtype(np.float64 if code == DTYPES["float64"] else np.float32)


class _Start:
    """A raw host call's buffers, set up before the agreement, and its MPI collective."""

    __slots__ = ("ch", "collective", "flat", "y", "in_place", "root", "deadline", "sent")

    def __init__(self, ch: Channel, collective: str, arr: np.ndarray, shape: tuple[int, ...],
                 out: Any, out_arr: Any, x: Any, narrow: Narrow | DeviceNarrow | None,
                 root: Any,
                 deadline: Deadline) -> None:
        self.ch = ch
        self.collective = collective
        self.flat = flat = np.ascontiguousarray(arr).reshape(-1)
        self.deadline = deadline
        self.root = root
        self.in_place = False
        self.sent = 0
        n_ranks = ch.comm.Get_size()
        dtype = flat.dtype
        if collective == "allreduce":
            self.in_place = _in_place(x, out, out_arr, narrow, flat, None)
            self.y = np.empty(shape, dtype) if out_arr is None else out_arr
        elif collective == "reduce_scatter":
            base, extra = divmod(flat.size, n_ranks)
            self.y = np.empty(base + (ch.comm.Get_rank() < extra), dtype)
        elif collective == "allgather":
            self.y = np.empty((n_ranks, *shape), dtype)
        else:
            self.y = np.empty(shape, dtype)

    def run(self) -> None:
        """Run the raw MPI collective (what the stage would do after the agreement)."""
        ch, flat, y, deadline = self.ch, self.flat, self.y, self.deadline
        c = self.collective
        sent = ch.stats.bytes_sent
        if c == "allreduce":
            exact.allreduce(ch, flat, y.reshape(y.size), deadline, in_place=self.in_place)
        elif c == "reduce_scatter":
            counts = [b - a for a, b in block_bounds(flat.size, ch.comm.Get_size())]
            exact.reduce_scatter(ch, flat, counts, y, deadline)
        elif c == "allgather":
            exact.allgather(ch, flat, y.reshape(y.shape[0], flat.size), deadline)
        else:
            yflat = y.reshape(y.size)
            if ch.comm.Get_rank() == self.root:
                yflat[...] = flat
            exact.bcast(ch, yflat, self.root, deadline)
        self.sent = ch.stats.bytes_sent - sent


class _Dummy:
    """The predicted call's MPI collective on zeros and scratch buffers.

    A rank that did not start early runs it when others did and the call fails (or, for
    bcast, must move its data again), so that their requests complete.
    """

    __slots__ = ("ch", "sig", "deadline")

    def __init__(self, ch: Channel, sig: tuple[float, ...], deadline: Deadline) -> None:
        self.ch, self.sig, self.deadline = ch, sig, deadline

    def run(self) -> None:
        sig, ch, deadline = self.sig, self.ch, self.deadline
        count = _sig_field(sig, "element count")
        dtype = _mpi_dtype(_sig_field(sig, "dtype"))
        collective = _BY_CODE[_sig_field(sig, "collective")]
        n_ranks, r = ch.comm.Get_size(), ch.comm.Get_rank()
        sent = ch.stats.bytes_sent
        zeros = np.zeros(count, dtype)
        if collective == "allreduce":
            exact.allreduce(ch, zeros, np.empty(count, dtype), deadline)
        elif collective == "reduce_scatter":
            counts = [b - a for a, b in block_bounds(count, n_ranks)]
            exact.reduce_scatter(ch, zeros, counts, np.empty(counts[r], dtype), deadline)
        elif collective == "allgather":
            exact.allgather(ch, zeros, np.empty((n_ranks, count), dtype), deadline)
        else:
            exact.bcast(ch, zeros, _sig_field(sig, "root"), deadline)
        ch.stats.bytes_sent = sent  # not the caller's traffic


def _in_place(x: Any, out: Any, out_arr: Any, narrow: Narrow | DeviceNarrow | None, flat: Any,
              dev: DeviceData | None) -> bool:
    """Whether ``out`` is x's very buffer (MPI_IN_PLACE); _check_out allowed no other overlap.

    Never for float16/bfloat16: their float32 copy is what moves.
    """
    return out_arr is not None and narrow is None and (
        out is x
        or (np.may_share_memory(flat, out_arr) if dev is None
            else _device_span(dev) == _device_span(DeviceData(out)))
    )


# -- argument checks (problems are recorded, raised on every rank after agreement) ------


def _split_code(split: float | None) -> float:
    """Return the agreement's code of a ``split`` setting: -1 for the model's choice."""
    return -1.0 if split is None else split


def _check_option(call: Call, name: str, value: Any, allowed: dict[str, int]) -> int:
    """Return the code of option ``value`` (0 and a recorded problem if it is not allowed)."""
    if not isinstance(value, str) or value not in allowed:
        call.problem(InputError, f"{name} {value!r} is not supported (expected one of "
                     f"{', '.join(map(repr, allowed))})")
        return 0
    return allowed[value]


_NATIVE = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}
_FIELD_INDEX = {name: i for i, name in enumerate(_FIELDS)}


def _valid_root(root: Any, n_ranks: int) -> bool:
    return bool(not isinstance(root, bool) and isinstance(root, (int, np.integer))
                and 0 <= root < n_ranks)


def _dtype_message(name: str, dtype: np.dtype, device: bool) -> str:
    """Return the message for an input dtype the collectives do not take, with the fix."""
    if device:
        return (f"x is a device array of dtype {name}; ccoll's collectives take float16, "
                "bfloat16 (torch, CuPy), float32 or float64 device arrays: pass x.float() "
                "(torch) or x.astype(cupy.float32)")
    if dtype.kind == "f" and name in DTYPES:  # a float of non-native byte order
        return (f"x has dtype {dtype.str} (not the machine's byte order); pass "
                f"x.astype(np.{name})")
    return (f"x has dtype {name}; ccoll reduces float16, bfloat16, float32 or float64 "
            "arrays: pass x.astype(np.float32) (a torch tensor: x.float())")


def _as_array(call: Call, x: Any, collective: str) -> _Input:
    """Return this rank's input: a host array, or device data (the array then empty)."""
    if type(x) is np.ndarray:  # the common case, checked cheaply (dtype.name costs ~2 us)
        name = _NATIVE.get(x.dtype)
        if name is not None:
            return _Input(x, None, None, False, name)
    empty = np.empty(0, dtype=np.float32)
    if x is None:
        fix = (" (None is allowed on the non-root ranks of bcast only)"
               if collective == "bcast" else "")
        call.problem(InputError, f"x is None; pass a numpy array or a torch tensor{fix}")
        return _Input(empty, None, None, False, "None")
    torch_in = is_torch(x)
    if torch_in and bool(getattr(x, "requires_grad", False)):
        call.problem(InputError, "x is a torch tensor that requires grad; ccoll reduces data, "
                     "not autograd graphs: pass x.detach()")
        return _Input(empty, None, None, False, str(x.dtype).removeprefix("torch."))
    if is_device(x):
        half = device_low_precision(x)
        narrow = None
        if half is not None:
            # The device kernels take float32/float64: reduce an exact float32 device copy
            # and round the result once at the end (Narrow's contract, on the device).
            try:
                x, narrow = widen_device(x)  # type: ignore[misc]
            except (DTypeError, InputError) as exc:
                call.problem(type(exc), str(exc))
                return _Input(empty, None, None, False, half)
            except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
                call.problem(InputError, f"x cannot be widened to float32 on its device "
                             f"({type(exc).__name__}: {exc}); pass x as float32")
                return _Input(empty, None, None, False, half)
        try:
            dev = DeviceData(x)
        except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
            call.problem(InputError, f"x cannot be read as a device array ({exc}); pass a "
                         "CUDA tensor, a CuPy array or a numba device array")
            return _Input(empty, None, None, False, "unknown")
        if not dev.contiguous:
            call.problem(InputError, "a device array x must be C-contiguous: pass "
                         "x.contiguous() (torch) or cupy.ascontiguousarray(x)")
        return _Input(empty, dev, narrow, False, half or dev.dtype.name)
    low = widen(x)
    if low is not None:
        return _Input(low[0], None, low[1], torch_in, low[1].name)
    try:
        arr = x.numpy() if torch_in else np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
        call.problem(InputError, f"x cannot be read as an array ({type(exc).__name__}: {exc}); "
                     "pass a numpy array or a CPU torch tensor")
        return _Input(empty, None, None, False, "unknown")
    if arr.dtype == object:
        call.problem(InputError, f"x of type {type(x).__name__} is not a numeric array; pass "
                     "a numpy array of float32 or float64")
        return _Input(empty, None, None, False, "object")
    return _Input(arr, None, None, torch_in, arr.dtype.name)


def _bcast_header(ch: Channel, root: Any, inp: _Input, deadline: Deadline) -> _Input:
    """Send the root's dtype, array kind and shape to every rank (bcast with a None rank).

    Returns this rank's input, with an empty array of the root's shape on a rank that
    passed None (the values are the root's after the broadcast). Buffer-based.
    """
    head = np.zeros(3 + 64, np.int64)
    comm = ch.comm
    if comm.Get_rank() == root:
        shape = inp.arr.shape if inp.dev is None else inp.dev.shape
        head[0] = DTYPES[inp.dtype_name]
        head[1] = int(inp.as_torch)
        head[2] = len(shape)
        head[3:3 + len(shape)] = shape
    if deadline.at is None:
        comm.Bcast(head, root=root)
    else:
        wait_all([comm.Ibcast(head, root=root)], deadline, "the bcast header")
    if inp.dtype_name != "None":
        return inp
    name = {v: k for k, v in DTYPES.items()}[int(head[0])]
    as_torch = bool(head[1])
    shape = tuple(int(d) for d in head[3:3 + int(head[2])])
    narrow = None
    if name in ("float16", "bfloat16"):
        if as_torch:
            import torch

            narrow = Narrow(name, getattr(torch, name), True)
        else:
            narrow = Narrow(name, np.dtype(name), False)  # float16, or ml_dtypes' bfloat16
    compute = np.float64 if name == "float64" else np.float32
    return _Input(np.empty(shape, compute), None, narrow, as_torch, name)


# Elements from which the fused range pass beats numpy's (docs/performance.md, "The REL
# check stage": 4 Mi float32 elements took 0.40 ms both ways, 1 Mi 0.13 ms fused, 0.07 numpy).
_FUSED_RANGE_MIN = 1 << 22


def _finite_range(arr: np.ndarray, dev: DeviceData | None) -> tuple[float, float]:
    if dev is None:
        if arr.dtype in _NATIVE and arr.size >= _FUSED_RANGE_MIN:
            # One parallel pass (numba, the rank's threads) instead of numpy's min, max and,
            # with non-finite values, a filtered copy: same range (docs/performance.md).
            # Below this size the parallel launch costs more than numpy's passes.
            return cpu_range(arr)
        return finite_range(arr)
    from ccoll.compressor._backend import cuda_module

    dev.ready(DeviceLanes(None))  # the range goes to the host anyway: wait there
    lo, hi = cuda_module().finite_range(dev.flat())
    return float(lo), float(hi)


def _bound(call: Call, eb: Any) -> ErrorBound | None:
    if eb is None:
        call.bound_kind = BOUND_KINDS["exact"]
        call.shown["error-bound kind"] = "exact (None)"
        return None
    try:
        bound = as_bound(eb)
    except ErrorBoundError as exc:
        call.problem(ErrorBoundError, str(exc))
        call.bound_kind = -1
        call.shown["error-bound kind"] = repr(eb)
        return None
    call.bound_kind = BOUND_KINDS[bound.kind]
    call.bound_value = bound.value
    call.shown["error-bound kind"] = bound.kind
    call.shown["error-bound value"] = bound
    return bound


def _check_out(
    call: Call, out: Any, shape: tuple[int, ...], dtype: np.dtype, x: np.ndarray | DeviceData,
    inp: _Input,
) -> Any:
    """Check ``out``; return the buffer the stage writes.

    ``None`` for float16/bfloat16, whose float32 result is rounded into ``out`` at the end.
    """
    target: Any = out
    oname = inp.dtype_name
    if isinstance(x, DeviceData):
        if not is_device(out):
            call.problem(InputError, "out must be a device array like x: pass out=None or "
                         "a device array of x's shape and dtype")
            return None
        try:
            if inp.narrow is not None and is_torch(out):  # numba cannot view bfloat16
                oshape, odtype = tuple(out.shape), str(out.dtype).removeprefix("torch.")
                ok = bool(out.is_contiguous())
            else:
                o = DeviceData(out)
                oshape, odtype, ok = o.shape, o.dtype.name, o.contiguous
        except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
            call.problem(InputError, f"out cannot be read as a device array ({exc})")
            return None
        # float16/bfloat16: x's float32 copy is what moves, so out may be any buffer.
        overlap = inp.narrow is None and out is not x.obj and _device_overlap(x, o)
    elif is_torch(out) and out.device.type == "cpu":
        if out.requires_grad:
            call.problem(InputError, "out is a torch tensor that requires grad: pass "
                         "out.detach() or out=None")
            return None
        oshape, odtype = tuple(out.shape), str(out.dtype).removeprefix("torch.")
        ok = out.is_contiguous()
        if inp.narrow is None and odtype in ("float32", "float64"):
            target = out.detach().numpy()
        overlap = inp.narrow is None and out is not x and isinstance(target, np.ndarray) and (
            _host_overlap(x, target))
    elif not isinstance(out, np.ndarray):
        call.problem(InputError, f"out must be a numpy array or CPU tensor like x, got "
                     f"{type(out).__name__}: pass out=None or an array of x's shape and dtype")
        return None
    else:
        oshape, odtype = out.shape, out.dtype.name if out.dtype.isnative else out.dtype.str
        ok = out.flags.c_contiguous and out.flags.writeable
        overlap = inp.narrow is None and out is not x and _host_overlap(x, out)
    if oshape != shape or odtype != oname:
        call.problem(
            InputError,
            f"out has shape {oshape} and dtype {odtype}; expected {shape} and {oname}: pass "
            "out=None or an array like x",
        )
    elif not ok:
        call.problem(InputError, "out must be C-contiguous and writeable: pass out=None or "
                     "a fresh array like x")
    elif overlap:
        # MPI_IN_PLACE (or reading x while out is written) would reduce shifted data.
        call.problem(
            InputError,
            "out overlaps x without being the same buffer: pass out=x (in place) or an "
            "array that shares no memory with x",
        )
    return None if inp.narrow is not None else target


def _host_overlap(x: np.ndarray, out: np.ndarray) -> bool:
    """Whether ``out`` shares memory with ``x`` but is not exactly x's buffer."""
    if not np.may_share_memory(x, out):
        return False
    same = (
        x.flags.c_contiguous
        and x.__array_interface__["data"][0] == out.__array_interface__["data"][0]
        and x.nbytes == out.nbytes
    )
    return not same and bool(np.shares_memory(x, out))


def _device_span(d: DeviceData) -> tuple[int, int]:
    """``(address, bytes)`` of C-contiguous device data."""
    iface = getattr(d.arr, "__cuda_array_interface__", None)
    if iface is None:  # numba's CUDA simulator: a wrapped host array
        iface = d.arr._ary.__array_interface__
    return int(iface["data"][0]), d.size * d.dtype.itemsize


def _device_overlap(x: DeviceData, out: DeviceData) -> bool:
    """Whether device array ``out`` overlaps ``x``'s bytes without being the same buffer."""
    (a0, na), (b0, nb) = _device_span(x), _device_span(out)
    if (a0, na) == (b0, nb):
        return False
    return a0 < b0 + nb and b0 < a0 + na and na > 0 and nb > 0


# -- outputs and staging ------------------------------------------------------------------


def _new_output(p: _Prepared, shape: tuple[int, ...], out: Any) -> Any:
    """Return the array to write the result to: ``out`` (numba for device data) or new.

    float16/bfloat16 input: always a new float32 array (rounded into ``out`` at the end).
    """
    if p.dev is None:
        return np.empty(shape, dtype=p.dtype) if out is None else out
    return p.dev.empty(shape) if out is None else DeviceData(out).arr


def _result(p: _Prepared, y: Any, out: Any) -> Any:
    """Return what the caller gets: ``out`` itself, or ``y`` in the kind of the input.

    float16/bfloat16: ``y`` (float32) rounded once to the caller's dtype; a CPU tensor in
    gives a CPU tensor out.
    """
    if p.narrow is not None:
        if out is not None:
            p.narrow.into(out, y)
            return out
        return p.narrow.result(y)
    if out is not None:
        return out
    if p.dev is not None:
        return p.dev.export(y)
    if p.as_torch:
        import torch

        return torch.from_numpy(y)
    return y


def _divide(p: _Prepared, y: Any, n: int) -> None:
    if p.dev is None:
        np.divide(y, y.dtype.type(n), out=y)
    else:
        device_divide(y, n, p.place.lanes)


def _on_mpi_buffers(
    ch: Channel, p: _Prepared, src: Any, dst: Any, call: Callable[[Any, Any], None]
) -> None:
    """Run a plain MPI call, ``call(src, dst)``, on buffers MPI can use.

    Host arrays are passed as they are (no context manager: a raw call should cost little
    more than its MPI call); device data goes through :func:`_mpi_buffers`.
    """
    if p.dev is None:
        call(src, dst)
        return
    with _mpi_buffers(ch, p, src, dst) as (xs, ys):
        call(xs, ys)


@contextmanager
def _mpi_buffers(ch: Channel, p: _Prepared, src: Any, dst: Any) -> Iterator[tuple[Any, Any]]:
    """Yield the buffers for a plain MPI call on device data ``src``/``dst``.

    They are ``src``/``dst`` themselves with CUDA-aware MPI, else pinned host copies
    (``dst`` is copied back to the device afterwards).
    """
    from numba import cuda

    if p.place.cuda_aware:  # type: ignore[attr-defined]
        cuda.synchronize()  # MPI does not wait for CUDA streams
        yield src, dst
        return
    tokens = []

    def host_of(arr: Any) -> np.ndarray:
        raw = ch.pinned(max(arr.nbytes, 1))
        tokens.append(raw)
        return raw[: arr.nbytes].view(p.dtype).reshape(arr.shape)

    hsrc = None if src is None else host_of(src)
    if src is not None and src.size:  # an empty copy fails on strides (numba's simulator)
        src.copy_to_host(hsrc)
    hdst = host_of(dst)
    try:
        yield hsrc, hdst
        if dst.size:
            dst.copy_to_device(hdst)
    finally:
        for t in tokens:
            ch.unpin(t)


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


def _close_channels(channels: list[Channel]) -> None:
    # Runs from close() or, for a Communicator dropped unclosed, at garbage collection:
    # it must not block on other ranks, and MPI_Comm_free is local in MPICH.
    for ch in channels:
        ch.close()
    channels.clear()


# -- default Communicator per mpi4py communicator ---------------------------------------

_keyval_lock = threading.Lock()
_keyval: int | None = None
# One lock per communicator being given its default: the collective creation runs under
# it, never under _keyval_lock, so threads creating defaults for different communicators
# do not wait for each other (in whatever order the ranks run them).
_creating: dict[int, threading.Lock] = {}


def _on_comm_free(comm: MPI.Comm, keyval: int, attr: Any) -> None:
    # Runs inside the user's Comm.Free (collective): free our duplicates with it. The
    # predefined communicators only lose their attributes inside MPI_Finalize, where
    # freeing is pointless.
    if isinstance(attr, Communicator) and comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
        attr.free()


def _mpi_comm(comm: Any) -> MPI.Intracomm:
    """``comm`` checked as an mpi4py intracommunicator (``None``: ``MPI.COMM_WORLD``)."""
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise InputError(
            f"comm must be an mpi4py intracommunicator or a ccoll.Communicator, got {comm!r}"
        )
    return comm


def default_communicator(comm: Any) -> Communicator:
    """Return the Communicator that the module-level functions use for ``comm``.

    ``comm`` may be a :class:`Communicator` (returned as is), an mpi4py communicator (its
    default Communicator is cached on it as an MPI attribute and freed with it) or ``None``
    (``MPI.COMM_WORLD``). The first call for a communicator is collective over it.
    """
    global _keyval
    if isinstance(comm, Communicator):
        return comm
    comm = _mpi_comm(comm)
    with _keyval_lock:
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval(delete_fn=_on_comm_free)
        keyval = _keyval
        found = comm.Get_attr(keyval)
        if isinstance(found, Communicator):
            return found
        handle = MPI._handleof(comm)
        lock = _creating.setdefault(handle, threading.Lock())
    with lock:  # two threads of one rank asking for the same default make one
        found = comm.Get_attr(keyval)
        if not isinstance(found, Communicator):
            found = Communicator(comm)
            comm.Set_attr(keyval, found)
    with _keyval_lock:
        if _creating.get(handle) is lock:
            del _creating[handle]
    return found


def existing_default(comm: Any) -> Communicator | None:
    """Return the default Communicator of ``comm`` if one was made, else ``None`` (local).

    ``comm`` as for :func:`default_communicator`; unlike it, this never creates one.
    """
    if isinstance(comm, Communicator):
        return comm
    comm = _mpi_comm(comm)
    with _keyval_lock:
        if _keyval is None:
            return None
        found = comm.Get_attr(_keyval)
    return found if isinstance(found, Communicator) else None
