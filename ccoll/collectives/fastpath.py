"""Repeated calls whose plan is raw: the data collective carries the check, no agreement.

Every call on a channel first asks whether the signature that the agreed history predicts
(:class:`History`) has a settled raw plan (:meth:`ccoll.collectives.policy.plan.Planner.fast`).
That depends on agreed state only, so every rank gets the same answer. If it has, every
rank runs that signature's MPI collective at once, without the agreement:

- a rank whose own call has exactly the predicted signature runs it on its data;
- a rank whose call differs (another count, bound, collective, ...) runs the same
  collective (so that no rank waits for a partner that is elsewhere) and says so.

An allreduce (its ops are all sums) says so in the data itself: the rank whose call
differs sends NaN in every element, so the sum's first element is NaN on every rank (NaN
plus anything is NaN, in any order). A first element that is a number therefore proves
that no rank's call differed, and the sum, plain MPI's on the caller's buffers, is
returned: the check costs one comparison, no copy and no second collective. A NaN there
(a rank's call differed, or the data holds one) is told apart by a one-integer
``MPI_Allreduce`` of "deviates" flags, which every rank then runs, since every rank sees
the same first element. The other collectives (and an allreduce of no elements) sum the
flags in a one-integer ``MPI_Iallreduce`` beside the data collective, on zeros where the
rank's call differs. A zero sum of flags: every rank ran the predicted call on its own
data, and the result is returned. Not zero: no rank returns it (``x`` is untouched; an
``out`` other than ``x`` holds no result until then); every rank runs the call again
through the agreement, which then raises the same error on every rank where the
arguments differ (docs/collectives.md, "Every call"). A rank that never makes the call
leaves the others waiting in the data collective, as in MPI, until the Communicator's
timeout.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ccoll.collectives.agreement import (
    BOUND_KINDS,
    COLLECTIVES,
    DTYPES,
    OPS,
    shape_code,
)
from ccoll.collectives.channel import Channel
from ccoll.collectives.layout import block_bounds
from ccoll.collectives.policy.plan import Plan, Planner, State
from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.compressor._backend import is_torch
from ccoll.compressor.precision import Narrow, widen
from ccoll.errorbound import ErrorBound, as_bound
from ccoll.errors import ErrorBoundError
from ccoll.runtime.progress import current_request

__all__ = ["History", "Fast", "Memo", "Ready", "ready", "NATIVE_CODES"]

_HISTORY_MAX = 256
# The agreement's dtype codes of the host dtypes the fast path takes as they are.
NATIVE_CODES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}
_ALLREDUCE = COLLECTIVES["allreduce"]


class History:
    """Agreed signatures of a channel's calls, and the one predicted for the next call.

    The prediction is the signature that followed the last call's last time (a training
    step repeats its sequence of buckets), else the last call's own: the same on every
    rank, since only agreed signatures go in.
    """

    __slots__ = ("last", "following", "predicted")

    def __init__(self) -> None:
        self.last: tuple[Any, ...] | None = None
        self.following: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}
        self.predicted: tuple[Any, ...] | None = None

    def note(self, key: tuple[Any, ...] | None) -> None:
        """Record the agreed signature of a call (``None``: not to be predicted from)."""
        if key is self.last and key is self.predicted and key is not None:
            return  # the same call again, as predicted: nothing changes
        following = self.following
        if self.last is not None:
            if len(following) >= _HISTORY_MAX and self.last not in following:
                following.clear()  # a job that never repeats: start over
            following[self.last] = key
        self.last = key
        self.predicted = None if key is None else following.get(key, key)


class Ready(NamedTuple):
    """A call the fast path can run on this rank, as it runs it."""

    key: tuple[Any, ...]  # the planner's key, as the agreement would make it
    x: np.ndarray  # what moves: float32 or float64, C-contiguous, flat
    shape: tuple[int, ...]  # the caller's shape
    narrow: Narrow | None  # float16/bfloat16: moved in float32, rounded once at the end
    as_torch: bool  # a CPU tensor came in: one goes out
    out: Any  # the caller's out (None: a new array)


def _host(x: Any) -> tuple[np.ndarray, Narrow | None, bool] | None:
    """``x`` as a host array of what moves, or None where the full way must convert it."""
    if type(x) is np.ndarray:
        code = NATIVE_CODES.get(x.dtype)
        if code is not None:
            return x, None, False
        if x.dtype == np.float16:
            return x.astype(np.float32), Narrow("float16", x.dtype, False), False
        return None
    if not is_torch(x) or x.device.type != "cpu" or x.requires_grad:
        return None
    name = str(x.dtype).removeprefix("torch.")
    if name in ("float32", "float64"):
        return x.numpy(), None, True
    if name in ("float16", "bfloat16"):
        got = widen(x)
        return None if got is None else (got[0], got[1], True)
    return None


_BOUNDS: dict[tuple[type, Any], tuple[int, float]] = {}


def _bound(eb: Any) -> tuple[int, float] | None:
    """Return the kind and value of a ``"rel:1e-3"`` string or a float bound (None: invalid).

    Cached by value (parsing a string costs more than the rest of a repeated call); the
    full way parses anything else and raises its errors on every rank.
    """
    t = type(eb)
    if t is not str and t is not float:
        return None
    got = _BOUNDS.get((t, eb))
    if got is None:
        try:
            b = as_bound(eb)
        except ErrorBoundError:
            return None
        if len(_BOUNDS) >= _HISTORY_MAX:
            _BOUNDS.clear()
        got = _BOUNDS[(t, eb)] = (BOUND_KINDS[b.kind], b.value)
    return got


def _out_ok(x: Any, out: Any, arr: np.ndarray, narrow: Narrow | None) -> bool:
    """Whether the fast allreduce may write ``out`` (the full way checks any other)."""
    if type(out) is np.ndarray:
        return (out.shape == tuple(x.shape) and out.dtype == x.dtype
                and out.flags.c_contiguous and out.flags.writeable
                and (out is x or not np.may_share_memory(out, arr)))
    if is_torch(out) and is_torch(x):
        return (out.device.type == "cpu" and not out.requires_grad and out.dtype == x.dtype
                and tuple(out.shape) == tuple(x.shape) and out.is_contiguous()
                and (out is x or narrow is not None
                     or not np.may_share_memory(out.numpy(), arr)))
    return False


def ready(collective: str, x: Any, eb: Any, op: str | None, out: Any, algorithm: int | None,
          policy: int | None, root: Any, size: int) -> Ready | None:
    """Return the call as the fast path runs it, or None where it takes the full way.

    Host float32/float64 (and, for allreduce, float16/bfloat16) numpy arrays and CPU
    tensors, ``ABS``/``REL``/``None`` bounds and valid options only: the full way converts
    and checks anything else (and raises its errors on every rank). Every call asks, so
    the common case (a float32/float64 numpy array) is checked first and cheaply.
    """
    if algorithm is None or policy is None:
        return None
    if type(x) is np.ndarray and x.dtype in NATIVE_CODES:
        arr, narrow, as_torch = x, None, False
    else:
        got = _host(x)
        if got is None:
            return None
        arr, narrow, as_torch = got
        if narrow is not None and collective != "allreduce":
            return None
    if eb is None:
        kind, value = 0, 0.0
    elif isinstance(eb, ErrorBound):
        kind, value = BOUND_KINDS[eb.kind], eb.value
    else:
        got_eb = _bound(eb)
        if got_eb is None:
            return None
        kind, value = got_eb
    o = OPS.get(op) if isinstance(op, str) else (OPS["sum"] if op is None else None)
    if o is None:
        return None
    r, shape_c = 0, 0
    if collective != "allreduce":
        if collective in ("allgather", "bcast"):
            shape_c = shape_code(tuple(x.shape))
            o = OPS["sum"]  # what the full way records for a call without an op
            if collective == "bcast":
                if isinstance(root, bool) or not isinstance(root, (int, np.integer)) \
                        or not 0 <= root < size:
                    return None
                r = int(root)
    if out is not None and (collective != "allreduce" or not _out_ok(x, out, arr, narrow)):
        return None
    code = NATIVE_CODES[arr.dtype] if narrow is None else DTYPES[narrow.name]
    flat = arr.ravel()  # a view of C-contiguous data, else a contiguous copy
    key = (COLLECTIVES[collective], flat.size, code, kind, value, o, algorithm, policy, r,
           shape_c, 0)
    return Ready(key, flat, x.shape, narrow, as_torch, out)


class Memo:
    """The last repeated host allreduce, as its caller passed its arguments.

    A call whose arguments are these very objects (``eb``: an :class:`ErrorBound` of the
    same type and ``value``, the same object or not), on an array of the same dtype object
    and size, has the key that :func:`ready` made for it: ``calls.run_call`` then runs it
    without ready() (:meth:`Fast.rerun`), while its state still holds the plan ``plan`` it
    held then (raw and settled) and the planner's ``epoch`` is unchanged. With an ``out``, the
    very ``x`` and ``out`` objects again, of the same shapes and strides, ``out`` still
    writeable: what :func:`ready` checked of them (their dtypes, shapes and whether they
    overlap) is then unchanged, and so are the flat views of their memory made here.
    """

    __slots__ = ("state", "key", "plan", "epoch", "dtype", "size", "nbytes", "sent",
                 "divisor", "eb", "eb_type", "eb_value", "op", "avg", "algorithm", "policy",
                 "collective", "policy_code", "algorithm_code", "x", "out", "shape",
                 "strides", "out_strides", "through", "flat", "into")

    def __init__(self, state: State, epoch: int, x: np.ndarray, eb: Any, op: Any,
                 algorithm: Any, policy: Any, collective: str, policy_code: int,
                 algorithm_code: int, n_ranks: int, out: np.ndarray | None = None) -> None:
        self.state = state
        self.key = state.key
        plan = state.cached
        assert plan is not None  # made after a run of the settled raw plan
        self.plan: Plan = plan
        self.epoch = epoch
        self.out = out
        self.x = None if out is None else x  # kept only with an out, to compare with
        self.through = out is not None and (out is x or np.may_share_memory(out, x))
        # With an out: x's and out's memory as flat arrays, made once (views of the same
        # memory while their shapes stay those checked; a strided x is copied every call).
        self.flat: np.ndarray | None = (x.reshape(-1) if out is not None
                                        and x.flags.c_contiguous else None)
        self.into: np.ndarray | None = (None if out is None or self.through
                                        else out.reshape(-1))
        self.shape = x.shape
        self.strides = x.strides  # with an out, looked at again: the views below rely on them
        self.out_strides = None if out is None else out.strides
        self.dtype = x.dtype
        self.size = x.size
        self.nbytes = x.nbytes
        self.sent = 2 * (n_ranks - 1) * x.nbytes // n_ranks  # what _count counts
        self.eb = eb
        # An ErrorBound: any of the same type and value has the same key; else the object.
        self.eb_value = eb.value if isinstance(eb, ErrorBound) else None
        self.eb_type = type(eb)
        self.op = op
        self.avg = op == "avg"
        # avg's divisor as an array: a ufunc takes it faster than a scalar (1.0 against
        # 1.3 us on one element), the same float32/float64 division.
        self.divisor = np.array(n_ranks, x.dtype)
        self.algorithm = algorithm
        self.policy = policy
        self.collective = collective
        self.policy_code = policy_code
        self.algorithm_code = algorithm_code


class Fast:
    """The fast path of one channel: its history and the predicted call's collective."""

    __slots__ = ("ch", "planner", "history", "last_seconds", "memo")

    def __init__(self, ch: Channel, planner: Planner) -> None:
        self.memo: Memo | None = None  # the last repeated host allreduce's arguments
        self.ch = ch
        self.planner = planner
        self.history = History()
        self.last_seconds = 0.0

    def due(self) -> State | None:
        """Return the predicted signature's state if its call skips the agreement, else None."""
        pred = self.history.predicted
        return None if pred is None else self.planner.fast(pred)

    def allreduce(self, st: State, r: Ready, avg: bool, deadline: Deadline) -> Any:
        """Run the predicted allreduce on ``r``; None if a rank deviated.

        The sum goes straight into the caller's ``out`` where it is another buffer than
        ``x`` (after a deviation ``out`` then holds no result, and the call runs again
        the full way, which writes it or raises: as MPI's receive buffer, its contents are
        undefined after an error); in place (``out`` is ``x``), through the channel's
        pooled buffer, so that ``x`` is intact for that second run.
        """
        ch = self.ch
        n = ch.size
        x = r.x
        t0 = time.perf_counter()
        out = r.out
        dst = None  # out's memory as a flat array, where the sum may go straight there
        if out is not None and r.narrow is None:
            o = out if type(out) is np.ndarray else out.numpy()
            if not np.may_share_memory(o, x):
                dst = o.reshape(-1)
        if dst is not None:
            y = dst
        elif out is None:
            y = np.empty_like(x)
        else:  # in place: through the channel's buffer, so that x is intact on a deviation
            y = ch.recv_buffers(1, x.nbytes)[0][:x.nbytes].view(x.dtype)
        if n == 1:
            np.copyto(y, x)
        elif not _checked_sum(ch, x, y, deadline):
            return None
        if avg:
            np.divide(y, y.dtype.type(n), out=y)
        _count(ch, x.nbytes)
        self._end(st, t0)
        if y is dst:
            return out
        y = y.reshape(r.shape)
        if r.narrow is not None:
            if out is not None:
                r.narrow.into(out, y)
                return out
            return r.narrow.result(y)
        if out is not None:
            if type(out) is np.ndarray:
                np.copyto(out, y)
            else:
                out.numpy()[...] = y
            return out
        if r.as_torch:
            import torch

            return torch.from_numpy(y)
        return y

    def rerun(self, m: Memo, x: np.ndarray) -> np.ndarray | None:
        """Run the predicted allreduce on a host float32/float64 ``x``, into ``out`` or new.

        What :meth:`allreduce` does for such a call (the same collectives, so that ranks
        that take either meet), for a call whose arguments are those of the last repeat
        ``m`` (:attr:`memo`; where its ``out`` overlaps ``x``, the sum goes through the
        channel's buffer, so that ``x`` stays intact on a deviation); None if a rank
        deviated. What :meth:`_end` and :func:`_count` do, with what ``m`` holds: a
        repeated call's own time is a few attribute reads (docs/dev/repeated-calls.md).
        """
        ch = self.ch
        t0 = time.perf_counter()
        out = m.out
        if ch.size == 1:
            if out is None:
                y = x.copy()
            else:
                np.copyto(out, x)
                y = out
        else:
            if out is None:
                y = np.empty(x.shape, m.dtype)
                into = y if y.ndim == 1 else y.reshape(-1)
            elif m.into is not None:
                y = out
                into = m.into
            else:  # through the channel's buffer
                y = out
                into = ch.recv_buffers(1, m.nbytes)[0][:m.nbytes].view(m.dtype)
            flat = m.flat
            if flat is None:
                flat = x.ravel()  # MPI takes contiguous buffers only
            if not _checked_sum(ch, flat, into, None):
                return None
            if m.through:
                np.copyto(y.reshape(-1), into)
        if m.avg:
            np.divide(y, m.divisor, out=y)
        seconds = time.perf_counter() - t0
        st = m.state
        self.planner.end(st, m.plan, seconds)
        history = self.history
        if history.last is not m.key:
            history.note(m.key)
        self.last_seconds = seconds
        stats = ch.stats
        stats.bytes_sent += m.sent
        stats.bytes_input += m.nbytes
        stats.calls += 1
        return y

    def dummy(self, st: State) -> None:
        """Run the predicted call's collective on zeros, flagged: this rank's call differs."""
        ch = self.ch
        comm = ch.comm
        pred = st.key
        collective, count, code, root = pred[0], pred[1], pred[2], pred[8]
        dtype = np.dtype(np.float64 if code == 2 else np.float32)
        n, r = ch.size, comm.Get_rank()
        deadline = Deadline(ch.timeout, "a repeated call's check")
        sent = ch.stats.bytes_sent
        if n == 1:
            return
        if collective == _ALLREDUCE and count > 0:
            poison = np.full(count, np.nan, dtype)  # every element of the sum is NaN
            _run(comm.Allreduce, comm.Iallreduce, (poison, np.empty_like(poison)),
                 {"op": MPI.SUM}, deadline)
            _flags(comm, 1, deadline)  # every rank saw a NaN first: it tells them apart
            ch.stats.bytes_sent = sent
            return
        flag = np.ones(1, np.int32)
        req = comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.SUM)
        zeros = np.zeros(count, dtype)
        try:
            if collective == _ALLREDUCE:
                _run(comm.Allreduce, comm.Iallreduce, (zeros, np.empty_like(zeros)),
                     {"op": MPI.SUM}, deadline)
            elif collective == COLLECTIVES["reduce_scatter"]:
                counts = [b - a for a, b in block_bounds(count, n)]
                _run(comm.Reduce_scatter, comm.Ireduce_scatter,
                     (zeros, np.empty(counts[r], dtype)), {"recvcounts": counts,
                                                           "op": MPI.SUM}, deadline)
            elif collective == COLLECTIVES["allgather"]:
                _run(comm.Allgather, comm.Iallgather, (zeros, np.empty((n, count), dtype)),
                     {}, deadline)
            else:
                _run(comm.Bcast, comm.Ibcast, (zeros,), {"root": int(root)}, deadline)
        finally:
            wait_all([req], deadline, "the repeated call's check")
        ch.stats.bytes_sent = sent  # not the caller's traffic

    def exact(self, st: State, collective: int, r: Ready, deadline: Deadline) -> Any:
        """Run the predicted raw reduce_scatter, allgather or bcast on ``r``; None if flagged.

        The data collective is plain MPI's (bit for bit); the flag rides beside it.
        """
        ch = self.ch
        comm = ch.comm
        n, rank = ch.size, comm.Get_rank()
        t0 = time.perf_counter()
        flag = np.zeros(1, np.int32)
        req = comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.SUM) if n > 1 else None
        flat = r.x
        root = int(r.key[8])
        try:
            if collective == COLLECTIVES["reduce_scatter"]:
                counts = [b - a for a, b in block_bounds(flat.size, n)]
                y = np.empty(counts[rank], flat.dtype)
                _run(comm.Reduce_scatter, comm.Ireduce_scatter, (flat, y),
                     {"recvcounts": counts, "op": MPI.SUM}, deadline)
                sent = flat.nbytes - y.nbytes
            elif collective == COLLECTIVES["allgather"]:
                y = np.empty((n, *r.shape), flat.dtype)
                _run(comm.Allgather, comm.Iallgather, (flat, y.reshape(n, flat.size)), {},
                     deadline)
                sent = (n - 1) * flat.nbytes
            else:
                y = np.empty(r.shape, flat.dtype)
                if rank == root:
                    y.reshape(-1)[...] = flat
                _run(comm.Bcast, comm.Ibcast, (y.reshape(-1),), {"root": root}, deadline)
                sent = 0 if rank == (root - 1) % n else flat.nbytes
        finally:
            if req is not None:
                wait_all([req], deadline, "the repeated call's check")
        if flag[0] != 0:
            return None
        ch.stats.bytes_sent += sent
        ch.stats.bytes_input += flat.nbytes
        self._end(st, t0)
        if r.as_torch:
            import torch

            return torch.from_numpy(y)
        return y

    def _end(self, st: State, t0: float) -> None:
        seconds = time.perf_counter() - t0
        plan = st.cached
        assert plan is not None
        self.planner.end(st, plan, seconds)
        self.history.note(st.key)
        self.last_seconds = seconds
        self.ch.stats.calls += 1


def _checked_sum(ch: Channel, src: np.ndarray, dst: np.ndarray,
                 deadline: Deadline | None) -> bool:
    """``MPI_Allreduce(src, dst, SUM)`` on ``ch``, checking that every rank made this call.

    The check is the sum's first element (the module's text): a number proves it; a NaN
    takes one more collective of flags. Without elements, the flags' collective runs
    beside the sum. ``deadline``: made here where the call is not complete at its first
    test (small repeats often are), if None. Returns whether no rank deviated.
    """
    comm = ch.comm
    if src.size == 0:
        if deadline is None:
            deadline = Deadline(ch.timeout, "ccoll.allreduce")
        flag = np.zeros(1, np.int32)
        req = comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.SUM)
        try:
            _run(comm.Allreduce, comm.Iallreduce, (src, dst), {"op": MPI.SUM}, deadline)
        finally:
            wait_all([req], deadline, "the repeated call's check")
        return bool(flag[0] == 0)
    if ch.timeout is None and current_request() is None:
        comm.Allreduce(src, dst, op=MPI.SUM)
    else:
        req = comm.Iallreduce(src, dst, op=MPI.SUM)
        if not req.Test():
            if deadline is None:
                deadline = Deadline(ch.timeout, "ccoll.allreduce")
            wait_all([req], deadline, "the repeated call's collective", bulk=True)
    first = dst[0]
    if first == first:  # a number: no rank sent the NaNs of a call that differs
        return True
    return _flags(comm, 0, deadline or Deadline(ch.timeout, "ccoll.allreduce"))


def _flags(comm: MPI.Intracomm, mine: int, deadline: Deadline) -> bool:
    """Sum every rank's "deviates" flag (``mine``); return whether none was set."""
    flag = np.array([mine], np.int32)
    _run(comm.Allreduce, comm.Iallreduce, (MPI.IN_PLACE, flag), {"op": MPI.SUM}, deadline)
    return bool(flag[0] == 0)


def _count(ch: Channel, nbytes: int) -> int:
    """Count a repeated allreduce of ``nbytes`` in the channel's stats; return the bytes sent."""
    n = ch.size
    sent = 2 * (n - 1) * nbytes // n
    ch.stats.bytes_sent += sent
    ch.stats.bytes_input += nbytes
    return sent


def _run(blocking: Any, nonblocking: Any, args: tuple[Any, ...], kw: dict[str, Any],
         deadline: Deadline) -> None:
    """One MPI collective: blocking, or nonblocking waited for under ``deadline``.

    A small call is often complete at its first test: it then costs no more Python.
    """
    if deadline.at is None:
        blocking(*args, **kw)
    else:
        req = nonblocking(*args, **kw)
        if not req.Test():
            wait_all([req], deadline, "the repeated call's collective", bulk=True)
