"""One collective call, stage by stage: checks, agreement, plan, data, report.

Every call of a :class:`~ccoll.collectives.communicator.Communicator` runs on a
:class:`Route` (one per channel: the blocking calls', ``iallreduce``'s) and takes one of
two ways:

- the fast way (:mod:`~ccoll.collectives.fastpath`): the signature that the agreed history
  predicts has a settled raw plan; the data collective carries the check;
- the full way: check the arguments locally, agree on them with every rank and plan
  (:mod:`~ccoll.collectives.prepare`), then move data (the data stages here; where the
  result goes: :mod:`~ccoll.collectives.outputs`).

A failure after the agreement (while data moves) may leave messages in flight or peers
waiting, so the channel then refuses further calls (docs/collectives.md, "Faults").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ccoll.collectives import exact, gather
from ccoll.collectives import trace as _trace
from ccoll.collectives.agreement import (
    ALGORITHMS,
    COLLECTIVES,
    POLICIES,
)
from ccoll.collectives.fastpath import Memo, Ready, ready
from ccoll.collectives.halving import halving_allreduce
from ccoll.collectives.homomorphic import sum_bound
from ccoll.collectives.layout import Layout
from ccoll.collectives.outputs import divide, new_output, on_mpi_buffers, result
from ccoll.collectives.policy.bounds import phase_bounds
from ccoll.collectives.policy.plan import State, skips_agreement
from ccoll.collectives.prepare import WHAT, Prepared, Route, prepare
from ccoll.collectives.report import LOGGER, CallReport
from ccoll.collectives.ring import reduce_scatter_streams, ring_allreduce, ring_ops
from ccoll.collectives.waiting import Deadline
from ccoll.errors import CollectiveError

__all__ = ["Route", "Prepared", "run_call", "report"]

# --------------------------------------------------------------------------- the fast way


def run_call(cc: Any, route: Route, collective: str, x: Any, eb: Any, op: str | None,
             out: Any, algorithm: str | None, policy: str | None,
             root: int | None) -> Any:
    """Run one call: the fast way if its signature's plan allows, else the full way."""
    if route.busy:  # another thread is inside this channel's call: MPI calls it erroneous
        raise CollectiveError(
            f"ccoll.{collective} was called while another thread is in a blocking call of "
            "this Communicator: like MPI's collectives on one communicator, its blocking "
            "calls must come from one thread at a time (other threads: iallreduce, whose "
            "requests run in order on ccoll's thread, or a Communicator of their own). The "
            "other thread's call goes on; a peer whose calls did not overlap may now wait "
            "for this one until the timeout")
    route.busy = True
    try:
        fast = route.fast
        m = fast.memo
        # The arguments of the last repeat, the very objects (a bound: one of the same kind and
        # value, as a loop that writes REL(1e-3) in its call makes a new one each time), while
        # its plan stands: the same key as ready()'s (fastpath.Memo). Every test is an
        # identity or a number's.
        if (m is not None and (eb is m.eb if m.eb_value is None else
                               type(eb) is m.eb_type and eb.value == m.eb_value)
                and out is m.out and op is m.op
                and collective is m.collective and algorithm is m.algorithm
                and policy is m.policy and type(x) is np.ndarray and x.dtype is m.dtype
                and x.size == m.size and fast.history.predicted is m.key
                and m.state.cached is m.plan and not m.state.awaiting
                and fast.planner.epoch == m.epoch
                and (out is None or (x is m.x and x.shape == m.shape and out.shape == m.shape
                                     and x.strides == m.strides and out.strides == m.out_strides
                                     and out.dtype is m.dtype and out.flags.writeable))):
            ch = route.ch
            ch.check_usable()
            try:
                y = fast.rerun(m, x)
            except BaseException as exc:
                ch.fail(f"ccoll.allreduce raised {type(exc).__name__} in a repeated call")
                raise
            if y is not None:
                route.last = ("allreduce", m.plan, m.policy_code, m.algorithm_code, m.dtype,
                              m.size, None, m.nbytes, True, m.sent, fast.last_seconds, 0)
                if LOGGER.isEnabledFor(logging.INFO):
                    LOGGER.info("%s", report(cc, route))
                return y
            # A rank deviated: every rank takes the full way (these arguments are ready()'s).
            p = prepare(cc, route, collective, x, eb, op=op, out=out, algorithm=algorithm,
                        policy=policy, root=root, repeatable=True)
            return guard(cc, route, p, _RUNS[collective], root)
        st = fast.due()
        alg = route.algorithm if algorithm is None else (
            ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else None)
        pol = route.policy if policy is None else (
            POLICIES.get(policy) if isinstance(policy, str) else None)
        try:
            r = ready(collective, x, eb, op, out, alg, pol, root, route.ch.size)
        except Exception:  # noqa: BLE001 - the full way checks the call and tells every rank
            r = None
        if st is not None:
            got = _fast(cc, route, st, collective, r, op, alg, pol)
            if got is not None:
                if (collective == "allreduce" and (out is None or type(out) is np.ndarray)
                        and type(x) is np.ndarray and r is not None and r.narrow is None
                        and alg is not None and pol is not None and skips_agreement(st)):
                    fast.memo = Memo(st, fast.planner.epoch, x, eb, op, algorithm, policy,
                                     collective, pol, alg, route.ch.size, out)
                return got
        # The full way (also after a repeat that some rank did not make: every rank is here).
        p = prepare(cc, route, collective, x, eb, op=op, out=out, algorithm=algorithm,
                    policy=policy, root=root, repeatable=r is not None)
        return guard(cc, route, p, _RUNS[collective], root)
    finally:
        route.busy = False


def _fast(cc: Any, route: Route, st: State, collective: str, r: Ready | None,
          op: str | None, alg: int | None, pol: int | None) -> Any:
    """Run the predicted call without the agreement; None: run this call the full way."""
    ch = route.ch
    ch.check_usable()
    fast = route.fast
    if r is None or r.key != st.key:
        fast.dummy(st)  # the others run the predicted call: join it, flagged
        return None
    deadline = _NO_DEADLINE if ch.size == 1 else Deadline(ch.timeout, WHAT[collective])
    t0 = time.perf_counter()
    sent0 = ch.stats.bytes_sent
    plan = st.cached  # what this call runs (counting it may make the next plan)
    try:
        if collective == "allreduce":
            y = fast.allreduce(st, r, op == "avg", deadline)
        else:
            y = fast.exact(st, COLLECTIVES[collective], r, deadline)
            if y is not None and collective == "reduce_scatter" and op == "avg":
                np.divide(y, y.dtype.type(ch.size), out=y)
    except BaseException as exc:
        ch.fail(f"ccoll.{collective} raised {type(exc).__name__} in a repeated call")
        raise
    if y is None:  # some rank's call differs: every rank takes the full way
        return None
    route.last = (collective, plan, pol, alg, r.narrow or r.x.dtype, r.x.size, None,
                  r.x.nbytes, True, ch.stats.bytes_sent - sent0, time.perf_counter() - t0, 0)
    if LOGGER.isEnabledFor(logging.INFO):
        LOGGER.info("%s", report(cc, route))
    return y


_POLICY_NAMES = {v: k for k, v in POLICIES.items()}
_NO_DEADLINE = Deadline(None, "a call on one rank")  # no peer to wait for
_ALGORITHM_NAMES = {v: k for k, v in ALGORITHMS.items()}


# ------------------------------------------------------------------------- data stages


def guard(cc: Any, route: Route, p: Prepared, fn: Callable[..., Any], *args: Any) -> Any:
    """Run the data-moving stage; on failure mark the channel unusable and re-raise.

    On success, count the call for its plan, leave its report and log it.
    """
    ch = route.ch
    t0 = time.perf_counter()
    sent0, coded0 = ch.stats.bytes_sent, ch.stats.bytes_coded
    try:
        y = fn(cc, route, p, *args)
    except BaseException as exc:
        ch.fail(f"ccoll.{p.collective} raised {type(exc).__name__}")
        raise
    t1 = time.perf_counter()
    stats = ch.stats
    sent = stats.bytes_sent - sent0
    coded = stats.bytes_coded - coded0
    stats.calls += 1
    nbytes = int(math.prod(p.shape)) * p.dtype.itemsize
    stats.bytes_input += nbytes
    if p.plan.compress:
        stats.compressed_calls += 1
    stats.last = {"seconds": t1 - t0, "bytes_sent": float(sent)}
    route.planner.end(p.state, p.plan, t1 - p.t_start)
    eb_shown = p.eb_abs if p.eb_result is None else p.eb_result
    route.last = (p.collective, p.plan, p.policy, p.algorithm, p.dtype_name,
                  int(math.prod(p.shape)), eb_shown if p.plan.compress else None, nbytes,
                  False, sent, t1 - p.t_start, coded)
    if LOGGER.isEnabledFor(logging.INFO):
        LOGGER.info("%s", report(cc, route))
    rec = _trace.ACTIVE
    if rec is not None:  # the clock is perf_counter, the tracer's own
        rec.span(p.collective, t0, t1, {"mode": "compress" if p.plan.compress else "raw",
                                        "bytes_sent": float(sent)})
    return y


def report(cc: Any, route: Route) -> CallReport | None:
    """Return the :class:`CallReport` of the route's last call (built when asked for)."""
    got = route.last
    if got is None:
        return None
    (collective, plan, policy, algorithm, dtype, count, eb_abs, nbytes, fast, sent,
     seconds, coded) = got
    if fast:  # kept as codes and objects: names cost more than a repeated call
        policy, algorithm = _POLICY_NAMES[policy], _ALGORITHM_NAMES[algorithm]
        dtype = dtype.name
    g = cc.grouping
    ratio = None
    if plan.compress and sent > 0:
        ratio = _raw_bytes(collective, route.ch.size, nbytes) / sent
    elif plan.compress and coded > 0:
        # Nothing sent (one rank: its streams code all of the data; a broadcast's last
        # rank: the root's stream codes it): the data over its streams.
        ratio = nbytes / coded
    reason = plan.reason + ("; repeated: ran without the agreement" if fast else "")
    return CallReport(collective, plan.compress, reason, policy, algorithm, dtype, count,
                      eb_abs, nbytes, sent, seconds, plan.predicted_raw,
                      plan.predicted if plan.compress else None,
                      ratio, fast, plan.chunk_elems,
                      plan.two_level, g.nodes, g.ranks_per_node, plan.version, plan.variant,
                      plan.trial, plan.format_reason if plan.compress else "")


def _raw_bytes(collective: str, n: int, nbytes: int) -> int:
    """Bytes one rank sends for a raw call (a ring's; bcast: a pipeline's)."""
    if n < 2:
        return 0
    if collective == "allreduce":
        return 2 * (n - 1) * nbytes // n
    if collective == "reduce_scatter":
        return (n - 1) * nbytes // n
    if collective == "allgather":
        return (n - 1) * nbytes
    return nbytes


def _decode_divisor(p: Prepared, n_ranks: int) -> int:
    """``N`` where the decode of a compressed average divides before its one rounding, else 1.

    float32 host data: its decoded sum rounded to float32 and then divided by ``N`` in
    float32 rounded twice (``eb`` plus up to three half spacings of the result), and a sum
    beyond float32's range became ±Inf although the average is not (at any ``N``, powers
    of two included); the sum's float64 values divided in float64 and rounded once leave
    ``eb`` plus one half spacing (docs/error-bound.md, "avg"). float64 data's decoded sum
    is already its float64 value, and device data keeps the device's decode and division.
    """
    if p.avg and n_ranks > 1 and p.dev is None and p.dtype == np.float32:
        return n_ranks
    return 1


def run_allreduce(cc: Any, route: Route, p: Prepared, _root: Any = None) -> Any:
    """Move an allreduce's data: MPI, the flat ring or halving, or two levels."""
    ch = route.ch
    n_ranks = ch.size
    plan = p.plan
    y = new_output(p, p.shape, p.out_arr)
    yflat = y.reshape(y.size)
    if not plan.compress:
        on_mpi_buffers(ch, p, p.flat, yflat, lambda xs, ys: exact.allreduce(
            ch, xs, ys, p.deadline, in_place=p.in_place and xs is p.flat))
    elif plan.two_level:
        assert route.two is not None
        route.two.allreduce(ch, p.flat, yflat, p.dtype, p.eb_abs, p.avg, p.algorithm, plan,
                            p.deadline)
        return result(p, y, p.out)
    elif p.flat.size:
        # The ring bounds the sum; avg's bound is on the sum divided by N.
        ring_eb, requant = phase_bounds(p.eb_abs, n_ranks, p.avg, plan.split)
        div = _decode_divisor(p, n_ranks) if requant is None else 1
        if plan.pieces:
            halving_allreduce(ch, p.flat, yflat, p.dtype, ring_eb, pieces=plan.pieces,
                              deadline=p.deadline, requant=requant, version=plan.version,
                              divide=div)
        else:
            ring_allreduce(ch, p.flat, yflat, p.dtype, ring_eb, algorithm=p.algorithm,
                           chunk_elems=plan.chunk_elems, deadline=p.deadline,
                           place=p.place, requant=requant, version=plan.version, divide=div)
        if requant is not None or div > 1:  # the owners (or the decodes) divided already
            return result(p, y, p.out)
    if p.avg:
        divide(p, yflat, n_ranks)
    return result(p, y, p.out)


def run_reduce_scatter(cc: Any, route: Route, p: Prepared, _root: Any = None) -> Any:
    """Move a reduce_scatter's data: MPI, or the ring's reduce-scatter half."""
    ch = route.ch
    n_ranks, r = ch.size, ch.comm.Get_rank()
    plan = p.plan
    # A raw call uses only the blocks: any chunk does.
    layout = Layout(p.flat.size, n_ranks, plan.chunk_elems or max(1, p.flat.size))
    blocks = layout.blocks
    lo, hi = blocks[r]
    y = new_output(p, (hi - lo,), None)
    if not plan.compress:
        counts = [b - a for a, b in blocks]
        on_mpi_buffers(ch, p, p.flat, y, lambda xs, ys: exact.reduce_scatter(
            ch, xs, counts, ys, p.deadline))
    elif p.flat.size:
        ring_eb = sum_bound(p.eb_abs, n_ranks, p.avg)
        ops = ring_ops(p.flat, layout, p.algorithm, ring_eb, p.place, plan.version)
        mine = reduce_scatter_streams(ch, layout, p.dtype, ops, ring_eb, p.deadline, p.place,
                                      plan.version)
        div = _decode_divisor(p, n_ranks)
        gather.decode_block(layout, r, p.dtype, mine, ring_eb, y, p.place.lanes, div)
        if div > 1:  # the decode divided
            return result(p, y, None)
    if p.avg:
        divide(p, y, n_ranks)
    return result(p, y, None)


def run_allgather(cc: Any, route: Route, p: Prepared, _root: Any = None) -> Any:
    """Move an allgather's data: MPI, or compress once and forward the streams."""
    ch = route.ch
    n_ranks = ch.size
    y = new_output(p, (n_ranks, *p.shape), None)
    yflat = y.reshape(n_ranks, p.flat.size)
    if not p.plan.compress:
        on_mpi_buffers(ch, p, p.flat, yflat, lambda xs, ys: exact.allgather(
            ch, xs, ys, p.deadline))
    elif p.flat.size:
        gather.allgather(ch, p.flat, p.eb_abs, yflat, p.deadline, p.place, p.plan.version)
    return result(p, y, None)


def run_bcast(cc: Any, route: Route, p: Prepared, root: int) -> Any:
    """Move a bcast's data: MPI, or the root's stream decoded everywhere."""
    ch = route.ch
    y = new_output(p, p.shape, None)
    yflat = y.reshape(y.size)
    if not p.plan.compress:
        is_root = ch.comm.Get_rank() == root

        def bcast(xs: Any, ys: Any) -> None:
            if is_root:
                if isinstance(ys, np.ndarray):
                    ys[...] = xs
                else:  # device buffers (CUDA-aware MPI): device-to-device copy
                    ys.copy_to_device(xs)
            exact.bcast(ch, ys, root, p.deadline)

        on_mpi_buffers(ch, p, p.flat if is_root else None, yflat, bcast)
    elif p.flat.size:
        gather.bcast(ch, p.flat, p.eb_abs, root, yflat, p.deadline, p.place, p.plan.version)
    return result(p, y, None)


_RUNS: dict[str, Callable[..., Any]] = {
    "allreduce": run_allreduce, "reduce_scatter": run_reduce_scatter,
    "allgather": run_allgather, "bcast": run_bcast,
}
