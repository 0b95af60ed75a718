"""The full way of a call: check the arguments, agree on them with every rank, plan.

:func:`prepare` checks the arguments locally (problems are recorded, not raised), agrees
on them with every rank in one small allreduce (which also yields the global value range
for ``REL`` bounds, the agreed times of earlier calls and the sampled ratio, and raises the
same error on every rank when the call is invalid or the ranks disagree) and plans
(:class:`~ccoll.collectives.policy.plan.Planner`): the :class:`Prepared` call that
:mod:`~ccoll.collectives.calls` then runs. :class:`Route` is what a channel's calls keep.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ccoll.collectives import trace as _trace
from ccoll.collectives.agreement import (
    ALGORITHMS,
    COLLECTIVES,
    DTYPES,
    OPS,
    PLACES,
    POLICIES,
    Call,
    agree,
    shape_code,
    sig_field,
)
from ccoll.collectives.channel import Channel
from ccoll.collectives.devices import (
    HOST,
    DeviceData,
    DeviceLanes,
    DevicePlace,
    HostPlace,
    cuda_aware_mpi,
    device_lanes,
)
from ccoll.collectives.fastpath import Fast
from ccoll.collectives.hier import TwoLevel
from ccoll.collectives.homomorphic import rank_bound, sum_bound
from ccoll.collectives.inputs import (
    Input,
    as_array,
    bcast_header,
    check_option,
    check_out,
    in_place,
    resolve_bound,
    shape_of,
    valid_root,
    value_range,
)
from ccoll.collectives.policy.fits import Format2, estimate_stream, sampled_format2
from ccoll.collectives.policy.plan import (
    Facts,
    Plan,
    Planner,
    State,
    _mix,
)
from ccoll.collectives.waiting import Deadline
from ccoll.compressor.precision import DeviceNarrow, Narrow, stage_bound
from ccoll.errorbound import REL, ErrorBound
from ccoll.errors import CollectiveError, DTypeError, ErrorBoundError, InputError, MismatchError

__all__ = ["Route", "Prepared", "prepare", "call_key", "WHAT"]

WHAT = {c: f"ccoll.{c}" for c in COLLECTIVES}  # the deadlines' names, made once

# Blocks sampled per call for the ratio: at least this many, and at most MAX.
_MIN_SAMPLE_BLOCKS = 32
_MAX_SAMPLE_BLOCKS = 4096
_SAMPLE_BUDGET = 0.01  # share of the predicted raw time that ratio sampling may take


class Route:
    """One channel of a Communicator and what its calls keep: plans, history, report."""

    __slots__ = ("ch", "planner", "fast", "two", "last", "algorithm", "policy", "busy")

    def __init__(self, ch: Channel, planner: Planner, two: TwoLevel | None,
                 algorithm: str, policy: str) -> None:
        self.ch = ch
        self.planner = planner
        self.fast = Fast(ch, planner)
        self.two = two  # two levels (hierarchical groupings; blocking calls only)
        self.last: tuple[Any, ...] | None = None  # the last call's report fields
        self.algorithm = ALGORITHMS[algorithm]
        self.policy = POLICIES[policy]
        self.busy = False  # a blocking call is running on this route (calls.run_call)


@dataclass(slots=True)
class Prepared:
    """A call after its agreement and plan: what every rank knows, and this rank's data."""

    x: Any  # the caller's array
    shape: tuple[int, ...]
    dtype: np.dtype
    flat: Any  # 1-D host array, or 1-D numba view of device data
    eb_abs: float
    plan: Plan
    state: State
    algorithm: str
    policy: str
    avg: bool
    deadline: Deadline
    place: HostPlace = HOST
    dev: DeviceData | None = None
    in_place: bool = False  # out is x's very buffer (MPI_IN_PLACE on the raw path)
    # float16/bfloat16 input (host or device): reduced in float32, rounded once
    narrow: Narrow | DeviceNarrow | None = None
    as_torch: bool = False  # a CPU torch tensor came in: a tensor goes out
    out: Any = None  # the caller's out
    out_arr: Any = None  # the caller's out as the buffer the stage writes (numpy for host)
    collective: str = ""
    dtype_name: str = ""
    t_start: float = 0.0
    # float16/bfloat16 with a bound: the bound the result holds in that dtype (eb_abs is
    # the float32 stage's, what the rounding to it leaves; precision.stage_bound)
    eb_result: float | None = None


def call_key(call: Call) -> tuple[Any, ...]:
    """Return the planner's key of an agreed call (what :func:`fastpath.ready` makes too)."""
    return (COLLECTIVES[call.collective], call.count, call.dtype, call.bound_kind,
            call.bound_value, call.op, call.algorithm, call.policy, call.root, call.shape,
            call.place)


def prepare(cc: Any, route: Route, collective: str, x: Any, eb: Any, *, op: str | None = None,
            out: Any = None, algorithm: str | None = None, policy: str | None = None,
            root: int | None = None, repeatable: bool = False) -> Prepared:
    """Check, agree and plan one call (collective over the route's channel).

    ``repeatable``: the fast path could run this call on this rank; its signature is
    predicted for the next call only where every rank's could.
    """
    t_start = time.perf_counter()
    ch = route.ch
    rec = _trace.ACTIVE
    t_check = rec.clock() if rec is not None else 0.0
    ch.check_usable()
    n_ranks = ch.size
    g = cc.grouping
    call = Call(collective, chunk=cc.chunk_elems or 0, split=-1.0 if cc.split is None
                else cc.split, nodes=g.nodes, rpn=g.ranks_per_node)
    try:
        shown = call.shown
        shown["split"] = "chosen by the model" if cc.split is None else cc.split
        is_root = root is not None and ch.comm.Get_rank() == root
        # bcast(None) on a non-root rank: shape and dtype come from the root after the
        # agreement (which still checks the ranks that passed an array).
        wild = x is None and collective == "bcast" and not is_root and valid_root(root, n_ranks)
        if wild:
            call.wild = True
            inp = Input(np.empty(0, np.float32), None, None, False, "None")
            shown["dtype"] = shown["element count"] = shown["shape"] = "None (the root's)"
        else:
            inp = as_array(call, x, collective)
        arr, dev = inp.arr, inp.dev
        shape, dtype = shape_of(inp)
        size = arr.size if dev is None else math.prod(shape)
        call.place = PLACES["host" if dev is None else "device"]
        shown["data location"] = "host" if dev is None else "device"
        if not wild:
            call.count = size
            call.dtype = DTYPES.get(inp.dtype_name, 0) if dtype.isnative else 0
            shown["dtype"] = inp.dtype_name
            shown["element count"] = size
            if call.dtype == 0 and not call.problems:
                from ccoll.collectives.inputs import dtype_message

                call.problem(DTypeError, dtype_message(inp.dtype_name, dtype, dev is not None))
            if collective in ("allgather", "bcast"):
                call.shape = shape_code(shape)
                shown["shape"] = shape
        bound = resolve_bound(call, eb)
        if op is not None:
            call.op = OPS.get(op, 0) if isinstance(op, str) else 0
            shown["op"] = op
            if call.op == 0:
                call.problem(InputError, f"op {op!r} is not supported: pass op='sum' or 'avg'")
        else:
            call.op = OPS["sum"]
        if algorithm is None:
            algorithm = cc.algorithm
            call.algorithm = ALGORITHMS[algorithm]
        else:
            call.algorithm = check_option(call, "algorithm", algorithm, ALGORITHMS)
        if policy is None:
            policy = cc.policy
            call.policy = POLICIES[policy]
        else:
            call.policy = check_option(call, "policy", policy, POLICIES)
        shown["algorithm"] = algorithm
        shown["policy"] = policy
        if root is not None or collective == "bcast":  # bcast(root=None) too: a bad root
            if not valid_root(root, n_ranks):
                call.problem(
                    InputError,
                    f"root {root!r} is not a rank of a communicator of size {n_ranks}: pass "
                    f"an int from 0 to {n_ranks - 1}, the same on every rank",
                )
                call.root = -1
            else:
                call.root = int(root)  # type: ignore[arg-type]  # valid_root: an int
            shown["root"] = root
        out_arr = None
        if out is not None:
            out_arr = check_out(call, out, shape, dtype, arr if dev is None else dev, inp)
        avg = op == "avg"
        # A REL bound's range pass is the compressed plan's alone where nothing else needs it
        # (float16/bfloat16 find the range whatever the plan).
        ranged = isinstance(bound, REL) and dev is None and inp.narrow is None
        facts = _facts(call, collective, inp, dtype, policy or "", algorithm or "",
                       bound is None, False, avg, dev is not None, n_ranks, ranged)
        key = call_key(call)
        planner = route.planner
        st = planner.state(key, facts)
        # The state this call's plan depends on, and the history the fast way reads: ranks whose
        # states differ (they cannot, but for a bug) fail here, before any data moves.
        pred = route.fast.history.predicted
        call.plan = _mix(planner.digest(st), *(pred if pred is not None else ()))
        ok = not call.problems and not wild and policy in POLICIES and algorithm in ALGORITHMS
        may_compress = ok and bound is not None and not planner.raw_whatever(facts)
        # float16/bfloat16 with a bound: the range decides whether the dtype can hold the bound
        # (_narrow_bound), whatever the plan, so that no plan decides whether a call is refused.
        narrow = inp.narrow is not None and bound is not None and ok
        if (isinstance(bound, REL) and may_compress or narrow) and (root is None or is_root):
            call.lo, call.hi = value_range(arr, dev)
        if may_compress and planner.needs_ratio(st, facts) and (root is None or is_root):
            assert bound is not None
            call.ratio, call.width, f2 = _sample(cc, arr, bound, call, facts, inp.dtype_name)
            call.gain2, call.speed2 = f2.gain, f2.speed
        call.times = planner.unsent(st)
        # Such a call never repeats without the agreement (fastpath): it would skip that check.
        call.repeatable = repeatable and dev is None and not narrow
    except Exception as exc:  # noqa: BLE001 - a check that failed on this rank alone:
        # told to every rank by the agreement, which then raises on every rank (before any
        # of the names above is read) rather than leaving the others in a call this rank
        # never makes.
        call.problem(InputError, f"checking the arguments raised {type(exc).__name__}: {exc}")
    # One rank has no peer to wait for: MPI's blocking calls, which return at once.
    deadline = Deadline(ch.timeout if ch.size > 1 else None, WHAT[collective])
    if rec is not None:
        t_agree = rec.clock()
        rec.span("check", t_check, t_agree)
    try:
        agreed = agree(ch.comm, call, deadline)
    except (MismatchError, InputError, DTypeError, ErrorBoundError):
        route.fast.history.note(None)
        raise  # the same on every rank, every request complete: the channel is fine
    except BaseException as exc:
        what = ("timed out in" if isinstance(exc, CollectiveError)
                else f"raised {type(exc).__name__} in")
        ch.fail(f"ccoll.{collective} {what} its agreement step")
        raise
    if rec is not None:
        rec.span("agree", t_agree, rec.clock())
    # The agreement raises wherever a check failed: here the checks ran to their end.
    assert algorithm is not None and policy is not None
    eb_result = None
    if bound is not None:
        try:  # from agreed numbers only: every rank refuses, before any data moves
            eb_result = _narrow_bound(bound, agreed, collective, n_ranks, avg)
        except ErrorBoundError:
            route.fast.history.note(None)
            raise
    # From here on the other ranks go ahead: any failure leaves them waiting.
    try:
        if agreed.none:
            inp = bcast_header(ch, root, inp, deadline)
            if wild:
                arr = inp.arr
                shape, dtype, size = arr.shape, arr.dtype, arr.size
                facts = facts._replace(elements=size, itemsize=_moved_itemsize(inp, dtype))
                # This rank knew neither the signature nor its state: both are the others'.
                key = _agreed_key(agreed.sig)
                st = planner.state(key, facts)
        route.fast.history.note(key if agreed.repeatable and not agreed.none else None)
        eb_abs = 0.0
        if bound is not None and not planner.raw_whatever(facts):
            # REL: the range every rank (bcast: the root) put in the agreement.
            eb_abs = bound.resolve(agreed.lo, agreed.hi) if eb_result is None else eb_result[1]
            facts = facts._replace(lossless=eb_abs == 0.0)
        plan = planner.plan(st, facts, ratio=agreed.ratio if math.isfinite(agreed.ratio)
                            else None, width=agreed.width,
                            gain2=agreed.gain2 if math.isfinite(agreed.gain2) else None,
                            speed2=agreed.speed2,
                            times=agreed.times)
        if dev is None:
            flat = np.ascontiguousarray(arr).reshape(-1)
            place: HostPlace = HOST
        else:
            flat = dev.flat()
            place = DevicePlace(ch, cuda_aware_mpi(), device_lanes(ch.lanes))
            # A compressed call reads x on the lanes, which wait for x's stream on the
            # device; a raw one copies or hands x to MPI: the host waits for it.
            dev.ready(place.lanes if plan.compress else DeviceLanes(None))
        # check_out allowed only two cases: no overlap, or out is x's very buffer
        # (never for float16/bfloat16: their float32 copy is what moves).
        return Prepared(
            x, shape, dtype, flat, eb_abs if plan.compress else 0.0, plan, st, algorithm,
            policy, avg, deadline, place, dev, in_place(x, out, out_arr, inp.narrow, flat, dev),
            inp.narrow, inp.as_torch, out, out_arr, collective, inp.dtype_name, t_start,
            None if eb_result is None else eb_result[0])
    except BaseException as exc:
        ch.fail(f"ccoll.{collective} raised {type(exc).__name__} after its agreement")
        raise


_NARROW = {DTYPES["float16"]: "float16", DTYPES["bfloat16"]: "bfloat16"}


def _narrow_bound(bound: ErrorBound, agreed: Any, collective: str, n_ranks: int,
                  avg: bool) -> tuple[float, float] | None:
    """Return (the bound asked for, the float32 stage's) of a float16/bfloat16 call.

    ``None`` for other dtypes. From agreed numbers only (the dtype of the signature, the
    range every rank or the root put in the agreement), so every rank computes the same,
    and refuses (:class:`ErrorBoundError`) a bound the dtype cannot hold on the result the
    same way: :func:`ccoll.compressor.precision.stage_bound`, the one rule of ``compress``,
    the command line and the torch hooks too.
    """
    name = _NARROW.get(int(sig_field(agreed.sig, "dtype")))
    if name is None:
        return None
    eb = bound.resolve(agreed.lo, agreed.hi)
    reduces = collective in ("allreduce", "reduce_scatter") and n_ranks > 1
    return eb, stage_bound(eb, name, agreed.lo, agreed.hi, ranks=n_ranks if reduces else 0,
                           avg=avg, asked=bound, what=f"the result of this {collective}"
                           if not reduces else "")


def _agreed_key(sig: tuple[float, ...]) -> tuple[Any, ...]:
    """Return the planner's key of an agreed signature (:func:`call_key`'s of a call)."""
    return tuple(int(v) if float(v).is_integer() and name != "error-bound value" else v
                 for name, v in ((n, sig_field(sig, n)) for n in _KEY_FIELDS))


_KEY_FIELDS = ("collective", "element count", "dtype", "error-bound kind", "error-bound value",
               "op", "algorithm", "policy", "root", "shape", "data location")


def _moved_itemsize(inp: Input, dtype: np.dtype) -> int:
    return 4 if inp.narrow is not None else int(dtype.itemsize)


def _facts(call: Call, collective: str, inp: Input, dtype: np.dtype, policy: str,
           algorithm: str, exact_: bool, lossless: bool, avg: bool, device: bool,
           ranks: int, ranged: bool = False) -> Facts:
    return Facts(collective, call.count, _moved_itemsize(inp, dtype), policy, algorithm,
                 exact_, lossless, avg, device, ranks, ranged)


def _sample(cc: Any, arr: np.ndarray, bound: ErrorBound, call: Call,
            facts: Facts, dtype_name: str) -> tuple[float, float, Format2]:
    """Return the ratio, mean code width and format 2 against format 1 on this rank's data.

    A strided sample of whole 32-element blocks, about 1% of the predicted raw time of
    compressor work, at the streams' bound. ``REL``'s bound from this rank's own range (at
    most the global one: a finer grid, a lower ratio, the safe side); float16/bfloat16 at
    the float32 stage's bound on that range. The gain (format 2's ratio over format 1's on
    the same blocks) and the speed factors of its kernels (format 1's seconds over format
    2's on those blocks; :func:`~ccoll.collectives.policy.fits.sampled_format2`) only where
    the plan may choose format 2: host data, a calibration of format 2, no forced version
    (else all +inf: not sampled).
    """
    none = Format2(math.inf)
    if arr.size == 0:
        return math.inf, 0.0, none
    narrow = dtype_name in _NARROW.values()
    lo, hi = (call.lo, call.hi) if isinstance(bound, REL) or narrow else (0.0, 0.0)
    eb = bound.resolve(lo, hi)
    n = facts.ranks
    if narrow:
        reduces = facts.collective in ("allreduce", "reduce_scatter") and n > 1
        try:
            eb = stage_bound(eb, dtype_name, lo, hi, ranks=n if reduces else 0,
                             avg=facts.avg)
        except ErrorBoundError:
            return math.inf, 0.0, none  # refused after the agreement
    if facts.collective in ("allreduce", "reduce_scatter"):
        eb = rank_bound(sum_bound(eb, n, facts.avg), n)
    if not eb > 0:
        return math.inf, 0.0, none
    p = cc.calibration.params
    from ccoll.collectives import model

    t_raw = model.predict(float(arr.nbytes), n, p, 1.0, collective=facts.collective,
                          chunks=1).raw
    nsample = int(min(_MAX_SAMPLE_BLOCKS, max(_MIN_SAMPLE_BLOCKS,
                                              _SAMPLE_BUDGET * t_raw * p.compress // 128)))
    from ccoll.collectives.codec import api

    flat = np.ascontiguousarray(arr).reshape(-1)
    est, nnz, widths = estimate_stream(flat, eb, nsample, api().compress_abs)
    ratio = flat.nbytes / max(est, 1.0)
    width = widths / nnz if nnz > 0 else 1.0
    f2 = none
    if (facts.policy == "auto" and not facts.device and cc.calibration.formats is not None
            and cc.format_version is None):
        mod = api()
        f2 = sampled_format2(flat, eb, nsample,
                             (mod.compress_abs, mod.add, mod.decompress, mod.add_data))
    return ratio, width, f2
