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

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives import exact, gather
from ccoll.collectives import trace as _trace
from ccoll.collectives.agreement import (
    ALGORITHMS,
    BOUND_KINDS,
    DTYPES,
    OPS,
    PLACES,
    POLICIES,
    Call,
    agree,
    env_code,
    shape_code,
)
from ccoll.collectives.channel import Channel, Stats
from ccoll.collectives.devices import (
    HOST,
    DeviceData,
    DevicePlace,
    HostPlace,
    cuda_aware_mpi,
    device_divide,
    is_device,
)
from ccoll.collectives.layout import Layout
from ccoll.collectives.policy import Decision, _decide, _fixed
from ccoll.collectives.ring import reduce_scatter_streams, ring_allreduce, ring_ops
from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.errorbound import REL, ErrorBound, as_bound, finite_range
from ccoll.errors import CollectiveError, DTypeError, ErrorBoundError, InputError

__all__ = ["Communicator", "DEFAULT_EB", "default_communicator"]

DEFAULT_EB: ErrorBound = REL(1e-3)
DEFAULT_CHUNK = 1 << 20


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
    chunk_elems: int = 0  # chosen by policy="auto"; 0: the Communicator's chunk_elems
    place: HostPlace = HOST
    dev: DeviceData | None = None
    in_place: bool = False  # out is x's very buffer (MPI_IN_PLACE on the raw path)


class Communicator:
    """ccoll's collectives on (a private duplicate of) an mpi4py communicator.

    Creating one is collective over ``comm``. Options (identical on every rank; checked):

    - ``algorithm``: ``"homomorphic"`` (default: compress once, add compressed streams,
      decode once) or ``"dar"`` (decompress-add-recompress at every ring step, as C-Coll).
    - ``policy``: ``"auto"`` (default: the cost model of docs/model.md decides per call
      whether compressing pays, and sends raw when it does not), ``"compress"`` (always)
      or ``"raw"`` (never: plain MPI, same API).
    - ``chunk_elems``: elements per pipeline chunk (one stream, one message).
    - ``timeout``: seconds a collective may wait for its peers before it raises
      :class:`~ccoll.errors.CollectiveError` (default ``None``: wait forever, as MPI).

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
        chunk_elems: int = DEFAULT_CHUNK,
        timeout: float | None = None,
    ) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise InputError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        call = Call("Communicator")
        call.algorithm = _check_option(call, "algorithm", algorithm, ALGORITHMS)
        call.policy = _check_option(call, "policy", policy, POLICIES)
        if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, (int, np.integer)) or (
            chunk_elems < 1
        ):
            call.problem(InputError, f"chunk_elems must be a positive integer, got {chunk_elems!r}")
            chunk_elems = 0
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0
        ):
            call.problem(InputError, f"timeout must be None or seconds > 0, got {timeout!r}")
            timeout = None
        call.chunk = int(chunk_elems)
        call.shown.update({"algorithm": algorithm, "policy": policy, "chunk size": chunk_elems})
        self.algorithm = algorithm
        self.policy = policy
        self.chunk_elems = int(chunk_elems)
        self.timeout = None if timeout is None else float(timeout)
        self._comm = comm
        deadline = Deadline(self.timeout, "creating a ccoll Communicator")
        sync = dup_comm(comm, deadline)
        try:
            agree(sync, call, deadline)
        except BaseException:
            sync.Free()
            raise
        self._sync = Channel(sync, "sync", self.timeout)
        self._async: Channel | None = None
        self._async_lock = threading.Lock()
        self._auto: dict[str, Any] = {}
        # Both channels are released when the Communicator is dropped unclosed; the list
        # (not self) is what the finalizer holds, so it does not keep self alive.
        self._channels: list[Channel] = [self._sync]
        self._finalizer = weakref.finalize(self, _close_channels, self._channels)

    # -- properties ----------------------------------------------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The communicator this one was made from."""
        return self._comm

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._sync.comm.Get_size()

    @property
    def rank(self) -> int:
        """Rank of this process."""
        return self._sync.comm.Get_rank()

    @property
    def stats(self) -> Stats:
        """Traffic counters of the blocking calls (``iallreduce`` counts in :attr:`async_stats`)."""
        return self._sync.stats

    @property
    def async_stats(self) -> Stats:
        """Traffic counters of ``iallreduce``."""
        return self._async.stats if self._async is not None else Stats()

    def __repr__(self) -> str:
        return (
            f"<ccoll.Communicator size={self.size} rank={self.rank} algorithm={self.algorithm!r} "
            f"policy={self.policy!r} chunk_elems={self.chunk_elems} timeout={self.timeout}>"
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
        return self._guard(ch, "reduce_scatter", self._run_reduce_scatter, ch, p)

    def allgather(self, x: Any, eb: Any = DEFAULT_EB) -> np.ndarray:
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)``, within ``eb``."""
        ch = self._sync
        p = self._prepare(ch, "allgather", x, eb)
        return self._guard(ch, "allgather", self._run_allgather, ch, p)

    def bcast(self, x: Any, eb: Any = DEFAULT_EB, root: int = 0) -> np.ndarray:
        """Return the root's ``x`` on every rank (the root too gets the decoded copy).

        Non-root ranks pass an array of the same shape and dtype; its values are ignored.
        """
        ch = self._sync
        p = self._prepare(ch, "bcast", x, eb, root=root)
        return self._guard(ch, "bcast", self._run_bcast, ch, p, root)

    # -- stages --------------------------------------------------------------------------

    def _auto_policy(self, ch: Channel) -> Any:
        """Return the ``policy="auto"`` state (calibration) of a channel, made on first use."""
        pol = self._auto.get(ch.name)
        if pol is None:
            from ccoll.collectives.policy import AutoPolicy

            pol = self._auto[ch.name] = AutoPolicy(ch)
        return pol

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
        return self._guard(ch, "allreduce", self._run_allreduce, ch, p, out)

    def _guard(self, ch: Channel, name: str, fn: Any, *args: Any) -> np.ndarray:
        """Run the data-moving stage; on failure mark the channel unusable and re-raise."""
        t0 = time.perf_counter()
        sent0 = ch.stats.bytes_sent
        try:
            y = fn(*args)
        except BaseException as exc:
            ch.fail(f"ccoll.{name} raised {type(exc).__name__}")
            raise
        t1 = time.perf_counter()
        ch.stats.calls += 1
        ch.stats.last = {
            "seconds": t1 - t0,
            "bytes_sent": float(ch.stats.bytes_sent - sent0),
        }
        rec = _trace.ACTIVE
        if rec is not None:  # the clock is perf_counter, the tracer's own
            rec.span(name, t0, t1, {"mode": args[1].mode, "bytes_sent": ch.stats.last[
                "bytes_sent"]} if len(args) > 1 and isinstance(args[1], _Prepared) else None)
        return y

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
        rec = _trace.ACTIVE
        t_check = rec.clock() if rec is not None else 0.0
        ch.check_usable()
        call = Call(collective, chunk=self.chunk_elems)
        shown = call.shown
        arr, dev = _as_array(call, x)
        shape, dtype = (arr.shape, arr.dtype) if dev is None else (dev.shape, dev.dtype)
        size = arr.size if dev is None else math.prod(shape)
        call.count = size
        call.dtype = DTYPES.get(dtype, 0)
        call.place = PLACES["host" if dev is None else "device"]
        shown["data location"] = "host" if dev is None else "device"
        shown["dtype"] = dtype
        shown["element count"] = size
        if call.dtype == 0:
            call.problem(
                DTypeError, f"dtype {dtype} is not supported (expected float32 or float64)"
            )
        if collective in ("allgather", "bcast"):
            call.shape = shape_code(shape)
            shown["shape"] = shape
        bound = _bound(call, eb)
        if op is not None:
            call.op = OPS.get(op, 0) if isinstance(op, str) else 0
            shown["op"] = op
            if call.op == 0:
                call.problem(InputError, f"op {op!r} is not supported (expected 'sum' or 'avg')")
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
        n_ranks = ch.comm.Get_size()
        if root is not None:
            if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not (
                0 <= root < n_ranks
            ):
                call.problem(
                    InputError,
                    f"root {root!r} is not a rank of a communicator of size {n_ranks}",
                )
                call.root = -1
            else:
                call.root = int(root)
            shown["root"] = root
        if out is not None:
            _check_out(call, out, shape, dtype, arr if dev is None else dev)
        # A policy="auto" call that the calibrations already send raw skips the value range
        # (a raw call does not use the bound; the range costs ~5% of a large raw allreduce)
        # and the policy; so does policy="raw". Same answer on every rank (see known_raw).
        auto = None
        known_raw = False
        sticky_key: Any = None
        if policy == "auto" and bound is not None and not call.problems:
            auto = self._auto_policy(ch)
            sticky_key = (size, dtype, collective, algorithm, type(bound), bound.value)
            known_raw = auto.known_raw(
                size, dtype, collective=collective, algorithm=algorithm
            ) or auto.sticky_raw(sticky_key)
        mode = _fixed(policy, bound is None, known_raw)
        if isinstance(bound, REL) and mode != "raw" and not call.problems:
            if root is None or ch.comm.Get_rank() == root:
                call.lo, call.hi = _finite_range(arr, dev)
        deadline = Deadline(ch.timeout, f"ccoll.{collective}")
        if rec is not None:
            t_agree = rec.clock()
            rec.span("check", t_check, t_agree)
        try:
            agreed = agree(ch.comm, call, deadline)
        except CollectiveError:
            ch.fail(f"ccoll.{collective} timed out in its agreement step")
            raise
        if rec is not None:
            rec.span("agree", t_agree, rec.clock())
        # From here on the other ranks go ahead (the decision's calibrations are
        # collectives): any failure leaves them waiting, so it fails the channel.
        try:
            eb_abs = 0.0 if mode == "raw" or bound is None else bound.resolve(agreed.lo, agreed.hi)
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
                        eb_abs=eb_abs,
                        data=arr if dev is None else dev.flat(),
                        auto=auto,
                        root=root,
                    )
                )
                if auto is not None:
                    auto.note_decision(sticky_key)
                if rec is not None:
                    rec.span("decide", t_decide, rec.clock(), {"mode": mode})
            elif known_raw and auto is not None:
                auto.note_known_raw(sticky_key)
            chunk = auto.last.chunk_elems if auto is not None and mode == "compress" else 0
            if dev is None:
                flat = np.ascontiguousarray(arr).reshape(-1)
                place: HostPlace = HOST
            else:
                flat = dev.flat()
                place = DevicePlace(ch, cuda_aware_mpi())
            stats = ch.stats
            stats.bytes_input += size * dtype.itemsize
            if mode == "compress":
                stats.compressed_calls += 1
            # _check_out allowed only two cases: no overlap, or out is x's very buffer.
            in_place = out is not None and (
                out is x
                or (np.may_share_memory(flat, out) if dev is None
                    else _device_span(dev) == _device_span(DeviceData(out)))
            )
            return _Prepared(
                x, shape, dtype, flat, eb_abs, mode, algorithm, op == "avg", deadline, chunk,
                place, dev, in_place,
            )
        except BaseException as exc:
            ch.fail(f"ccoll.{collective} raised {type(exc).__name__} after its agreement")
            raise

    def _run_allreduce(self, ch: Channel, p: _Prepared, out: Any) -> Any:
        y = _new_output(p, p.shape, out)
        yflat = y.reshape(y.size)
        n_ranks = ch.comm.Get_size()
        if p.mode == "raw":
            _on_mpi_buffers(ch, p, p.flat, yflat, lambda xs, ys: exact.allreduce(
                ch, xs, ys, p.deadline, in_place=p.in_place and xs is p.flat))
        elif p.flat.size:
            ring_allreduce(ch, p.flat, yflat, p.dtype, p.eb_abs, algorithm=p.algorithm,
                           chunk_elems=p.chunk_elems or self.chunk_elems, deadline=p.deadline,
                           place=p.place)
        if p.avg:
            _divide(p, yflat, n_ranks)
        return _result(p, y, out)

    def _run_reduce_scatter(self, ch: Channel, p: _Prepared) -> Any:
        n_ranks, r = ch.comm.Get_size(), ch.comm.Get_rank()
        layout = Layout(p.flat.size, n_ranks, p.chunk_elems or self.chunk_elems)
        blocks = layout.blocks
        lo, hi = blocks[r]
        y = _new_output(p, (hi - lo,), None)
        if p.mode == "raw":
            counts = [b - a for a, b in blocks]
            _on_mpi_buffers(ch, p, p.flat, y, lambda xs, ys: exact.reduce_scatter(
                ch, xs, counts, ys, p.deadline))
        elif p.flat.size:
            ops = ring_ops(p.flat, layout, p.algorithm, p.eb_abs, p.place)
            mine = reduce_scatter_streams(ch, layout, p.dtype, ops, p.eb_abs, p.deadline, p.place)
            gather.decode_block(layout, r, p.dtype, mine, p.eb_abs, y)
        if p.avg:
            _divide(p, y, n_ranks)
        return _result(p, y, None)

    def _run_allgather(self, ch: Channel, p: _Prepared) -> Any:
        n_ranks = ch.comm.Get_size()
        y = _new_output(p, (n_ranks, *p.shape), None)
        yflat = y.reshape(n_ranks, p.flat.size)
        if p.mode == "raw":
            _on_mpi_buffers(ch, p, p.flat, yflat, lambda xs, ys: exact.allgather(
                ch, xs, ys, p.deadline))
        elif p.flat.size:
            gather.allgather(ch, p.flat, p.eb_abs, yflat, p.deadline, p.place)
        return _result(p, y, None)

    def _run_bcast(self, ch: Channel, p: _Prepared, root: int) -> Any:
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


# -- argument checks (problems are recorded, raised on every rank after agreement) ------


def _check_option(call: Call, name: str, value: Any, allowed: dict[str, int]) -> int:
    """Return the code of option ``value`` (0 and a recorded problem if it is not allowed)."""
    if not isinstance(value, str) or value not in allowed:
        call.problem(InputError, f"{name} {value!r} is not supported (expected one of "
                     f"{', '.join(map(repr, allowed))})")
        return 0
    return allowed[value]


def _as_array(call: Call, x: Any) -> tuple[np.ndarray, DeviceData | None]:
    """Return this rank's input as a host array, or as device data (array then empty)."""
    if type(x) is np.ndarray and not x.dtype.hasobject:  # the common case, checked cheaply
        return x, None
    empty = np.empty(0, dtype=np.float32)
    if is_device(x):
        try:
            dev = DeviceData(x)
        except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
            call.problem(InputError, f"x cannot be read as a device array ({exc})")
            return empty, None
        if not dev.contiguous:
            call.problem(InputError, "a device array x must be C-contiguous")
        return empty, dev
    try:
        arr = np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
        call.problem(InputError, f"x cannot be read as an array ({type(exc).__name__}: {exc})")
        return empty, None
    if arr.dtype == object:
        call.problem(InputError, f"x of type {type(x).__name__} is not a numeric array")
        return empty, None
    return arr, None


def _finite_range(arr: np.ndarray, dev: DeviceData | None) -> tuple[float, float]:
    if dev is None:
        return finite_range(arr)
    from ccoll.compressor._backend import cuda_module

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
    call: Call, out: Any, shape: tuple[int, ...], dtype: np.dtype, x: np.ndarray | DeviceData
) -> None:
    if isinstance(x, DeviceData):
        if not is_device(out):
            call.problem(InputError, "out must be a device array like x")
            return
        try:
            o = DeviceData(out)
        except Exception as exc:  # noqa: BLE001 - reported on every rank after agreement
            call.problem(InputError, f"out cannot be read as a device array ({exc})")
            return
        oshape, odtype, ok = o.shape, o.dtype, o.contiguous
        overlap = out is not x.obj and _device_overlap(x, o)
    elif not isinstance(out, np.ndarray):
        call.problem(InputError, f"out must be a numpy array like x, got {type(out).__name__}")
        return
    else:
        oshape, odtype = out.shape, out.dtype
        ok = out.flags.c_contiguous and out.flags.writeable
        overlap = out is not x and _host_overlap(x, out)
    if oshape != shape or odtype != dtype:
        call.problem(
            InputError,
            f"out has shape {oshape} and dtype {odtype}; expected {shape} and {dtype}",
        )
    elif not ok:
        call.problem(InputError, "out must be C-contiguous and writeable")
    elif overlap:
        # MPI_IN_PLACE (or reading x while out is written) would reduce shifted data.
        call.problem(
            InputError,
            "out overlaps x without being the same buffer: pass out=x (in place) or an "
            "array that shares no memory with x",
        )


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
    """Return the array to write the result to: ``out`` (numba for device data) or new."""
    if p.dev is None:
        return np.empty(shape, dtype=p.dtype) if out is None else out
    return p.dev.empty(shape) if out is None else DeviceData(out).arr


def _result(p: _Prepared, y: Any, out: Any) -> Any:
    """Return what the caller gets: ``out`` itself, or ``y`` in the kind of the input."""
    if out is not None:
        return out
    return y if p.dev is None else p.dev.export(y)


def _divide(p: _Prepared, y: Any, n: int) -> None:
    if p.dev is None:
        np.divide(y, y.dtype.type(n), out=y)
    else:
        device_divide(y, n)


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


def default_communicator(comm: Any) -> Communicator:
    """Return the Communicator that the module-level functions use for ``comm``.

    ``comm`` may be a :class:`Communicator` (returned as is), an mpi4py communicator (its
    default Communicator is cached on it as an MPI attribute and freed with it) or ``None``
    (``MPI.COMM_WORLD``). The first call for a communicator is collective over it.
    """
    global _keyval
    if isinstance(comm, Communicator):
        return comm
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise InputError(
            f"comm must be an mpi4py intracommunicator or a ccoll.Communicator, got {comm!r}"
        )
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
