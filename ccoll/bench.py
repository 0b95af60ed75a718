"""``ccoll bench``: OSU / nccl-tests style sweep of ccoll's collectives against plain MPI.

:data:`DESCRIPTION` and :data:`EPILOG` are its ``--help`` (plain text, read in a terminal):
what is timed, every column of the output, and how the data of each size is chosen
(:func:`data_for_size`). docs/cli.md, "ccoll bench", shows a run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ccoll import speedindex
from ccoll.runtime.cpu_threads import thread_count

__all__ = [
    "add_parser", "run_bench", "Row", "bench", "load_gradients", "data_for_size", "COLUMNS",
    "DESCRIPTION", "EPILOG",
]

ALGORITHMS = ("mpi", "homomorphic", "dar", "auto")
MAX_ITERS = 1_000_000  # timed (or warm-up) calls per size and algorithm, at most
MAX_SIZES = 1000  # sizes of one sweep, at most (-f close to 1 over a wide -b..-e)
_DEFAULT_DATA = Path(__file__).resolve().parent.parent / "datasets" / "minilm.h5"
_BUSBW = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: float(n - 1),
}


@dataclass
class Row:
    """One (size, algorithm) measurement."""

    collective: str
    size: int
    count: int
    algorithm: str
    iters: int
    avg_us: float
    min_us: float
    max_us: float
    algbw_gbs: float
    busbw_gbs: float
    ratio: float | None
    err_over_eb: float | None
    speedup: float | None
    compressed_calls: float | None = None  # share of timed calls that compressed (auto)
    model_us: float | None = None
    floor_us: float | None = None  # the model's floor: max(compute critical path, wire)
    of_floor: float | None = None  # avg_us / floor_us
    # Stream formats the compressed timed calls sent ("1", "2", "1,2"; None: none compressed)
    formats: str | None = None
    # The median call, and mpi's median over this row's: single slow calls (a 30 ms stall
    # among 30 calls of 10 us on 2 shared cores) move the mean, not these.
    med_us: float | None = None
    med_speedup: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------- data


def load_gradients(path: str | os.PathLike[str], rank: int) -> np.ndarray:
    """Every tensor of step ``rank mod steps`` of an HDF5 dump as float32, concatenated.

    Raises :class:`~ccoll.errors.InputError` (``FileNotFoundError`` for a missing file)
    where there is nothing to time: a file that is not HDF5, no step groups, a step
    without datasets or without values (zero-element datasets only), a dataset that does
    not hold real numbers (strings, compound or complex values).
    """
    import h5py

    from ccoll.errors import InputError
    from ccoll.h5.output import check_input

    check_input(os.fspath(path))
    with h5py.File(path, "r") as f:
        steps = sorted(k for k in f if isinstance(f[k], h5py.Group))
        if not steps:
            raise InputError(f"{path}: no step groups (expected step_0000, ...)")
        step = steps[rank % len(steps)]
        g = f[step]
        names = sorted(k for k in g if isinstance(g[k], h5py.Dataset))
        if not names:
            raise InputError(f"{path}: step {step} holds no datasets")
        parts = []
        for k in names:
            ds = g[k]
            if ds.dtype.kind not in "fiu":
                raise InputError(f"{path}: {step}/{k} holds {ds.dtype} values, not real "
                                 "numbers (expected float or integer datasets)")
            if ds.shape is None:  # an HDF5 null dataspace: no values
                continue
            parts.append(np.asarray(ds[()], dtype=np.float32).ravel())
    x = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if x.size == 0:
        raise InputError(f"{path}: step {step} holds no values (only zero-element "
                         "datasets): nothing to time")
    return x


SAMPLE_BLOCK = 32  # values per sampled piece: the compressor's block (docs/format.md)


def page_aligned(n: int, dtype: Any) -> np.ndarray:
    """Return a new 1-D array of ``n`` ``dtype`` elements whose data starts on a 4 KiB page."""
    dt = np.dtype(dtype)
    try:
        raw = np.empty(n * dt.itemsize + 4096, np.uint8)
    except MemoryError:  # numpy's _ArrayMemoryError and its traceback before
        from ccoll.errors import InputError

        raise InputError(f"cannot allocate {n * dt.itemsize} bytes for a buffer of this rank "
                         "(a size beyond the memory: lower -e)") from None
    start = -raw.ctypes.data % 4096
    return raw[start:start + n * dt.itemsize].view(dt)


def data_for_size(base: np.ndarray, count: int) -> np.ndarray:
    """Return the ``count`` values that ``bench`` times at one size, taken from ``base``.

    Up to the size of ``base``: ``ceil(count / 32)`` whole 32-value blocks of ``base``
    spread evenly over all of it (the middle block of each of as many equal stretches), so
    that a small size holds the same mix of tensors as the whole dump, not only its first
    tensor; the last block is cut to ``count``. Above it: ``base`` repeated. The positions
    depend only on ``base.size`` and ``count``: every rank takes the same places of its own
    step.
    """
    n = base.size
    full = n // SAMPLE_BLOCK
    if count > full * SAMPLE_BLOCK:  # more than the whole blocks: all of it, repeated
        return np.resize(base, count)
    k = -(-count // SAMPLE_BLOCK)
    # block indices floor((i + 1/2) * full / k): increasing by at least 1, as full >= k
    blocks = ((2 * np.arange(k, dtype=np.int64) + 1) * full) // (2 * k)
    pos = (blocks[:, None] * SAMPLE_BLOCK + np.arange(SAMPLE_BLOCK)).ravel()[:count]
    return base[pos]


def call_order(rows: Sequence[str], iters: int,
               blocks: int) -> list[tuple[str, int | None]]:
    """Return the calls of one size: ``(row, timed index)``, ``None`` for a lead call.

    Each row's ``iters`` timed calls are cut into ``blocks`` runs (fewer if there are
    fewer calls) and the rows take turns run by run; every run starts with one untimed
    call of its row. So every timed call follows a call of its own row, as in a job that
    repeats it: what a call leaves behind (a shaped link's spent burst, the TCP window,
    the caches) is its own row's, never another's. Call by call, a raw MPI call after a
    compressed call found the emulated 1 Gbit/s link's token bucket full and took 1.3 ms
    at 256 KiB where back to back it takes 2.1 ms (docs/performance.md).
    """
    k = max(1, min(blocks, iters))
    edges = [iters * b // k for b in range(k + 1)]
    order: list[tuple[str, int | None]] = []
    for b in range(k):
        for a in rows:
            order.append((a, None))
            order.extend((a, it) for it in range(edges[b], edges[b + 1]))
    return order


def sizes(minbytes: int, maxbytes: int, factor: float, itemsize: int) -> list[int]:
    """Message sizes from ``minbytes`` to ``maxbytes`` multiplied by ``factor``, whole items.

    A size is rounded down to whole items, or up where that would fall below ``minbytes``
    and stay within ``maxbytes`` (``-b 5 -e 9`` times 8 bytes, not 4).
    """
    out: list[int] = []
    s = float(max(minbytes, itemsize))
    while s <= maxbytes * (1 + 1e-9):
        b = max(itemsize, int(round(s)) // itemsize * itemsize)
        if b < minbytes and b + itemsize <= maxbytes:
            b += itemsize
        if not out or b != out[-1]:
            out.append(b)
        if factor <= 1:
            break
        s *= factor
    return out


# ----------------------------------------------------------------------------- bench


def rpn_label(rpn: int | None) -> str:
    """Name of a node grouping in row names: ``shm`` (MPI's shared-memory domains) or ``rpn=R``."""
    return "shm" if rpn is None else f"rpn={rpn}"


def parse_ranks_per_node(text: str) -> list[int | None]:
    """``--ranks-per-node``: comma-separated ``shm`` or positive ints, e.g. ``1,shm``."""
    from ccoll.errors import InputError

    out: list[int | None] = []
    for tok in (t.strip() for t in text.split(",")):
        if tok == "shm":
            out.append(None)
        elif tok.lstrip("+-").isdigit() and int(tok) >= 1:
            out.append(int(tok))
        elif tok.lstrip("+-").isdigit():
            raise InputError(f"--ranks-per-node must be >= 1, got {int(tok)} (a node holds at "
                             "least one rank); give 'shm', a positive int or a "
                             "comma-separated list such as 1,shm")
        else:
            raise InputError(f"--ranks-per-node: {tok!r} is neither 'shm' nor a positive int; "
                             "give a comma-separated list such as 1,shm or 2")
    if len(set(out)) != len(out):
        raise InputError(f"--ranks-per-node {text}: each grouping once")
    return out


def _runners(collective: str, comm: Any, ccs: dict[str, Any], x: np.ndarray, eb: Any,
             algos: Sequence[str]) -> dict[str, Callable[[], np.ndarray]]:
    """One zero-argument callable per algorithm, each returning its output array.

    An allreduce's rows all write one output array: where a buffer lies changes MPI's own
    call on it by up to 2x (seen: 256 KiB on shared memory, 2 ranks, whichever row had the
    array allocated second; docs/dev/repeated-calls.md), so the rows differ only in the call.
    It and ``x`` start on a page, as OSU's benchmarks allocate theirs: numpy put an output
    made right after ``x`` 16 bytes (mod 4 KiB) after it, where every copy between them
    runs 10x slower ("Where the buffers lie").
    """
    from mpi4py import MPI

    n, r = comm.Get_size(), comm.Get_rank()
    counts = [len(b) for b in np.array_split(np.empty(x.size, np.int8), n)]
    out: dict[str, Callable[[], np.ndarray]] = {}
    shared = page_aligned(x.size, x.dtype)  # every allreduce row's output
    for a in algos:
        if a == "mpi":
            if collective == "allreduce":
                y = shared
                out[a] = lambda y=y: (comm.Allreduce(x, y, op=MPI.SUM), y)[1]  # type: ignore[misc]
            elif collective == "reduce_scatter":
                y = np.empty(counts[r], x.dtype)
                out[a] = lambda y=y: (comm.Reduce_scatter(x, y, recvcounts=counts,  # type: ignore[misc]
                                                          op=MPI.SUM), y)[1]
            else:
                y = np.empty((n, x.size), x.dtype)
                out[a] = lambda y=y: (comm.Allgather(x, y), y)[1]  # type: ignore[misc]
            continue
        cc = ccs[a]
        if collective == "allreduce":
            y = shared
            out[a] = lambda cc=cc, y=y: cc.allreduce(x, eb, out=y)  # type: ignore[misc]
        elif collective == "reduce_scatter":
            out[a] = lambda cc=cc: cc.reduce_scatter(x, eb)  # type: ignore[misc]
        else:
            out[a] = lambda cc=cc: cc.allgather(x, eb)  # type: ignore[misc]
    return out


def _reference(collective: str, comm: Any, x: np.ndarray) -> np.ndarray:
    """Compute the exact result in float64 (exact enough to judge bounds of 1e-3 of range)."""
    from mpi4py import MPI

    n, r = comm.Get_size(), comm.Get_rank()
    x64 = x.astype(np.float64)
    if collective == "allgather":
        y = np.empty((n, x.size), np.float64)
        comm.Allgather(x64, y)
        return y
    y = np.empty_like(x64)
    comm.Allreduce(x64, y, op=MPI.SUM)
    if collective == "reduce_scatter":
        return np.array_split(y, n)[r]
    return y


def _raw_bytes(collective: str, n: int, size: int) -> float:
    """Bytes one rank sends in a raw ring algorithm (the ratio's numerator)."""
    if collective == "allreduce":
        return 2 * (n - 1) * size / n
    if collective == "reduce_scatter":
        return (n - 1) * size / n
    return float((n - 1) * size)


def bench(
    collective: str,
    size_list: Sequence[int],
    *,
    eb: Any,
    iters: int,
    warmup: int,
    iters_large: int,
    warmup_large: int,
    large: int,
    algos: Sequence[str],
    data: str | os.PathLike[str],
    check: bool = True,
    predict: bool = True,
    comm: Any = None,
    log: Callable[[str], None] | None = None,
    trace: bool = False,
    ranks_per_node: int | None | Sequence[int | None] = None,
    schedule: str = "auto",
    format_version: int | None = None,
    blocks: int = 3,
    base: np.ndarray | None = None,
) -> tuple[list[Row], dict[str, Any]]:
    """Run the sweep (collective over ``comm``); return rows (rank 0's are complete) and meta.

    ``ranks_per_node`` is the ccoll Communicators' node grouping (``None``: MPI's
    shared-memory domains, so ranks on different hosts are different nodes), or a list of
    them: every ccoll algorithm then runs once per grouping, its rows named
    ``homomorphic/rpn=1``, ``homomorphic/shm``, ... The meta's ``nodes``,
    ``ranks_per_node``, ``grouping`` and ``hierarchical`` say what the first (or only)
    grouping had; ``groupings`` gives every ccoll row's. ``schedule`` is the ccoll
    Communicators' (``"auto"``, ``"ring"`` or ``"halving"``; the meta's ``schedule``),
    ``format_version`` their stream format (``None``: chosen per call; the meta's
    ``format_version``). A ccoll row's ``formats`` says which formats its compressed timed
    calls sent; its extra ``format_reason`` why the last one did. ``blocks``: runs each
    row's timed calls are cut into (:func:`call_order`). ``base``: this rank's data, as
    :func:`load_gradients` reads it from ``data`` (read here when not given).

    With ``trace``, rank 0's meta holds ``"trace"``: the trace-event document
    (:func:`ccoll.collectives.trace.chrome`) of one extra call per size and ccoll algorithm.
    """
    from mpi4py import MPI

    from ccoll.collectives import trace as _trace
    from ccoll.collectives.communicator import Communicator
    from ccoll.collectives.homomorphic import rank_bound
    from ccoll.errorbound import REL, as_bound, finite_range

    comm = MPI.COMM_WORLD if comm is None else comm
    comm = comm.Dup()
    n, r = comm.Get_size(), comm.Get_rank()
    bound = as_bound(eb)
    if base is None:
        base = load_gradients(data, r)
    ccs: dict[str, Any] = {}
    rpns: list[int | None] = (
        [ranks_per_node] if ranks_per_node is None or isinstance(ranks_per_node, int)
        else list(ranks_per_node))
    base_of: dict[str, str] = {}  # row name -> algorithm
    rpn_of: dict[str, int | None] = {}  # row name -> its node grouping
    named: list[str] = []
    for a in algos:
        if a == "mpi":
            named.append(a)
            base_of[a] = a
            continue
        for rpn in rpns:
            name = a if len(rpns) == 1 else f"{a}/{rpn_label(rpn)}"
            algorithm, policy = ("dar", "compress") if a == "dar" else (
                "homomorphic", "auto" if a == "auto" else "compress")
            ccs[name] = Communicator(comm, algorithm=algorithm, policy=policy,
                                     ranks_per_node=rpn, schedule=schedule,
                                     format_version=format_version)
            named.append(name)
            base_of[name] = a
            rpn_of[name] = rpn
    algos = named
    groupings: dict[int | None, Any] = {}
    for name, cc in ccs.items():
        groupings.setdefault(rpn_of[name], cc.grouping)
    for rpn in rpns:
        if rpn not in groupings:  # MPI only: the grouping ccoll's calls would have had
            with Communicator(comm, ranks_per_node=rpn) as probe:
                groupings[rpn] = probe.grouping
    # A compressed allreduce of host data runs in two levels on such a grouping.
    hier_of_rpn = {rpn: (g.nodes, g.ranks_per_node)
                   if g.hierarchical and collective == "allreduce" else None
                   for rpn, g in groupings.items()}
    # MPI's row is predicted like the first grouping (the top-level one of the meta).
    hier_of = {a: hier_of_rpn[rpn_of.get(a, rpns[0])] for a in algos}
    if log is not None and r == 0:
        for rpn in rpns:
            g = groupings[rpn]
            log(f"# nodes: {g.nodes} x {g.ranks_per_node or 'unequal'} ranks "
                f"({g.source}); {collective} "
                f"{'in two levels' if hier_of_rpn[rpn] is not None else 'flat'}")
    # The model's calibration runs on a channel of its own (it keeps its own counters).
    # The model's constants: a policy="auto" Communicator's calibration (the cache, else a
    # probe when it is made), as every auto row's plans use.
    model_cc = Communicator(comm, policy="auto") if predict else None
    rows: list[Row] = []
    traced: list[tuple[str, list[dict[str, Any]]]] = []
    try:
        for size in size_list:
            count = size // 4
            x = page_aligned(count, np.float32)
            x[:] = data_for_size(base, count)
            lo, hi = finite_range(x)
            glo = _allreduce_float(comm, lo, MPI.MIN)
            ghi = _allreduce_float(comm, hi, MPI.MAX)
            eb_abs = bound.resolve(glo, ghi)
            run = _runners(collective, comm, ccs, x, bound, algos)
            big = size > large
            nit, nwarm = (iters_large, warmup_large) if big else (iters, warmup)
            for _ in range(nwarm):
                for a in algos:
                    run[a]()
            times = {a: np.zeros(nit) for a in algos}
            sent = {a: 0.0 for a in algos}
            compressed = {a: 0 for a in algos}
            # Per timed call of a ccoll row: T two levels, C the flat compressed ring, R raw.
            paths = {a: "" for a in algos}
            formats: dict[str, set[int]] = {a: set() for a in algos}
            why: dict[str, str] = {}
            outs: dict[str, np.ndarray] = {}
            for a, it in call_order(algos, nit, blocks):
                if it is None:  # a run's lead call: untimed, not counted
                    comm.Barrier()
                    run[a]()
                    continue
                st = ccs[a].stats if a in ccs else None
                s0 = (st.bytes_sent, st.compressed_calls) if st is not None else (0, 0)
                comm.Barrier()
                t0 = time.perf_counter()
                y = run[a]()
                times[a][it] = time.perf_counter() - t0
                if st is not None:
                    sent[a] += st.bytes_sent - s0[0]
                    compressed[a] += st.compressed_calls - s0[1]
                    rep = ccs[a].last_call
                    if rep is not None:
                        paths[a] += ("T" if rep.hierarchical else
                                     "C" if rep.compressed else "R")
                        if rep.compressed:
                            formats[a].add(rep.format_version)
                            why[a] = rep.format_reason
                if it == nit - 1:
                    outs[a] = y.copy()  # an allreduce's rows share their output array
            errs: dict[str, float | None] = {}
            if check:
                ref = _reference(collective, comm, x)
                exact = np.isfinite(ref)  # a NaN or Inf of the data has no error to measure
                for a in algos:
                    e = _max_error(outs[a].reshape(ref.shape)[exact], ref[exact])
                    e = _allreduce_float(comm, e, MPI.MAX)
                    errs[a] = e / eb_abs if eb_abs > 0 else (0.0 if e == 0 else math.inf)
            if trace:
                for a in algos:
                    if a in ccs:
                        # After the timed loop: tracing never touches the timed numbers.
                        with _trace.tracing(_trace.start(comm)) as rec:
                            run[a]()
                        got = _trace.gather(comm, rec)
                        if got is not None:
                            traced.append((f"{collective} {a} {size} B", got))
            # One prediction per kind of row (flat, two levels), in the same order on every
            # rank (_predict is collective).
            preds: dict[tuple[int, int] | None, tuple[Any, dict[str, float] | None]] = {}
            if model_cc is not None and n > 1:
                share = rank_bound(eb_abs, n) if collective != "allgather" else eb_abs
                for h in dict.fromkeys(hier_of[a] for a in algos):
                    preds[h] = _predict(model_cc, collective, x, share, h,
                                        ranged=isinstance(bound, REL))
            mpi_avg = mpi_med = None
            for a in algos:
                t = np.empty_like(times[a])
                comm.Allreduce(times[a], t, op=MPI.MAX)
                avg = float(t.mean())
                if a == "mpi":
                    mpi_avg, mpi_med = avg, float(np.median(t))
                tot_sent = _allreduce_float(comm, sent[a], MPI.SUM) / n / nit
                rb = _raw_bytes(collective, n, size)
                ratio = (rb / tot_sent if tot_sent > 0 else None) if a in ccs else None
                algbw = size / avg / 1e9 if avg > 0 else 0.0
                model_us = None
                # Two-level rows: predicted in two levels, no floors (those are the flat ring's).
                pred, floors = preds.get(hier_of[a], (None, None))
                if pred is not None:
                    key = {"mpi": "raw", "homomorphic": "homomorphic", "dar": "dar"}.get(
                        base_of[a])
                    if key is not None:
                        model_us = getattr(pred, key) * 1e6
                    elif base_of[a] == "auto" and compressed[a] == nit:
                        model_us = pred.homomorphic * 1e6
                    elif base_of[a] == "auto" and compressed[a] == 0:
                        model_us = pred.raw * 1e6
                floor_us = None
                if floors is not None:
                    if base_of[a] == "auto":  # the floor of what it did, call by call
                        c = compressed[a] / nit
                        floor_us = (c * floors["homomorphic"] + (1 - c) * floors["raw"]) * 1e6
                    else:
                        floor_us = floors["raw" if a == "mpi" else base_of[a]] * 1e6
                rows.append(Row(
                    collective=collective, size=size, count=count, algorithm=a, iters=nit,
                    avg_us=avg * 1e6, min_us=float(t.min()) * 1e6, max_us=float(t.max()) * 1e6,
                    algbw_gbs=algbw, busbw_gbs=algbw * _BUSBW[collective](n),
                    ratio=ratio, err_over_eb=errs.get(a) if a != "mpi" else
                    (errs.get(a) if check else None),
                    speedup=None, compressed_calls=(compressed[a] / nit) if a in ccs else None,
                    model_us=model_us, floor_us=floor_us,
                    of_floor=avg * 1e6 / floor_us if floor_us else None,
                    formats=",".join(map(str, sorted(formats[a]))) or None,
                    med_us=float(np.median(t)) * 1e6,
                    extra={"calls": paths[a], "format_reason": why.get(a, "")}
                    if a in ccs else {},
                ))
            for row in rows[-len(algos):]:
                if mpi_avg is not None and row.avg_us > 0:
                    row.speedup = mpi_avg * 1e6 / row.avg_us
                if mpi_med is not None and row.med_us:
                    row.med_speedup = mpi_med * 1e6 / row.med_us
            if log is not None and r == 0:
                log(_format_rows(rows[-len(algos):], header=len(rows) == len(algos)))
        meta = _meta(collective, n, bound, data, iters, warmup, iters_large, warmup_large, large)
        meta["blocks"] = blocks
        top = groupings[rpns[0]]
        meta.update(nodes=top.nodes, ranks_per_node=top.ranks_per_node, grouping=top.source,
                    hierarchical=hier_of_rpn[rpns[0]] is not None)
        # Every ccoll row's node grouping (the same on every rank: agreed by its Communicator).
        meta["groupings"] = {a: str(cc.grouping) for a, cc in ccs.items()}
        meta["schedule"] = schedule
        meta["format_version"] = format_version
        if model_cc is not None:
            meta["calibration"] = model_cc.calibration.describe()
        autos = [a for a in ccs if base_of[a] == "auto"]
        if autos:  # what auto's calls measured, per signature (docs/model.md)
            meta["auto_plans"] = ccs[autos[0]].plans()["sync"]
            meta["auto_plans_by_row"] = {a: ccs[a].plans()["sync"] for a in autos}
        if trace and r == 0:
            meta["trace"] = _trace.chrome(traced, {k: meta[k] for k in (
                "collective", "ranks", "eb", "host", "loadavg", "date_utc", "argv")})
    finally:
        for cc in ccs.values():
            cc.free()
        if model_cc is not None:
            model_cc.close()
        comm.Free()
    return rows, meta


def _predict(cc: Any, collective: str, x: np.ndarray, eb_share: float,
             hier: tuple[int, int] | None = None,
             ranged: bool = False) -> tuple[Any, dict[str, float] | None]:
    """Predict this size with this run's calibration and a sampled ratio; and its floors.

    ``ranged``: the bound is REL, so a compressed call finds the data's range first (priced
    in the compressed predictions as the plan prices it, not in the floors).

    Collective over ``cc``'s communicator (the ratio is summed over ranks). The floors
    (seconds, by algorithm: ``raw``, ``homomorphic``, ``dar``) use the same rates.
    ``hier`` (nodes, ranks per node): predicted in two levels
    (:func:`model.predict_hierarchical`); the floors are the flat ring's, so none then.
    """
    from mpi4py import MPI

    from ccoll.collectives import floor, model
    from ccoll.collectives.codec import api
    from ccoll.collectives.policy.fits import estimate_stream

    comm = cc.comm
    n = comm.Get_size()
    p = cc.calibration.params
    mine = np.array(estimate_stream(x, eb_share, 4096, api().compress_abs) if eb_share > 0
                    else (x.nbytes, 0.0, 0.0))
    tot = np.empty_like(mine)
    comm.Allreduce(mine, tot, op=MPI.SUM)
    ratio = n * x.nbytes / max(float(tot[0]), 1.0)
    width = float(tot[2]) / float(tot[1]) if tot[1] > 0 else 1.0
    # The chunks of the measured rows: a policy="compress" Communicator plans them with its
    # calibration and the default ratio.
    if hier is None:
        block = -(-x.size // n)
        k = max(1, -(-block // model.chunk_elems_for(x.size, x.itemsize, n, p)))
    else:  # the inter-node ring's share and ranks, as the Communicator cuts them
        share = -(-x.size // hier[1])
        block = -(-share // hier[0])
        k = max(1, -(-block // model.chunk_elems_for(share, x.itemsize, hier[0], p)))
    pred = model.predict(x.nbytes, n, p, ratio, collective=collective, width=width, chunks=k,
                         hier=hier, ranged=ranged)
    if hier is not None:
        return pred, None
    floors = {a: floor.floor(x.nbytes, n, p, ratio, algorithm=a, collective=collective,
                             ratio_sum=pred.ratio_sum, width=width).seconds
              for a in ("raw", "homomorphic", "dar")}
    return pred, floors


def _max_error(got: np.ndarray, exact: np.ndarray) -> float:
    """Largest ``|got - exact|`` (inf where ``got`` is NaN); 0 where no element is held.

    A reduce_scatter of fewer elements than ranks leaves some ranks none.
    """
    if exact.size == 0:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(got.astype(np.float64) - exact)
    e = float(np.max(d))
    return math.inf if math.isnan(e) else e


def _allreduce_float(comm: Any, v: float, op: Any) -> float:
    """``op`` of one float over the ranks (buffer-based: no pickled mpi4py collective)."""
    mine = np.array([float(v)])
    out = np.empty_like(mine)
    comm.Allreduce(mine, out, op=op)
    return float(out[0])


def _meta(collective: str, n: int, bound: Any, data: Any, iters: int, warmup: int,
          iters_large: int, warmup_large: int, large: int) -> dict[str, Any]:
    from mpi4py import MPI

    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan, math.nan, math.nan)
    return {
        "collective": collective, "ranks": n, "eb": repr(bound), "data": str(data),
        "iters": iters, "warmup": warmup, "iters_large": iters_large,
        "warmup_large": warmup_large, "large_from_bytes": large,
        "host": socket.gethostname(), "cpus": os.cpu_count(), "loadavg": list(load),
        "mpi": MPI.Get_library_version().splitlines()[0],
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv, "link_rate_bps": os.environ.get("CCOLL_CLUSTER_RATE_BPS"),
        "transport": {k: os.environ.get(k) for k in ("MPIR_CVAR_NOLOCAL", "FI_PROVIDER")},
        # rank 0's threads per CPU kernel, as its Communicators chose (docs/collectives.md)
        "threads_per_rank": thread_count(),
    }


# ---------------------------------------------------------------------------- output

DESCRIPTION = """\
Time ccoll's collectives against plain MPI over a range of sizes, as the OSU
micro-benchmarks and nccl-tests do. Run it under MPI, on all ranks of MPI_COMM_WORLD:

  mpiexec -n 2 python -m mpi4py -m ccoll.cli bench allreduce -b 4 -e 64M -f 2

Every rank must be given the same options: they are compared before anything is
timed, and a difference stops every rank (exit status 2).

For each size, the algorithms of --algorithms run side by side in one job, taking
turns in runs (--blocks runs per algorithm, each run one untimed call then its share
of the timed calls, so that every timed call follows a call of its own algorithm):
  mpi          plain MPI (MPI_Allreduce, MPI_Reduce_scatter or MPI_Allgather through
               mpi4py's buffers)
  homomorphic  ccoll's ring that adds compressed streams without decoding them
  dar          ccoll's decompress-add-recompress ring (not for allgather)
  auto         ccoll with policy="auto": compresses only where its cost model expects
               a gain, else sends the data raw through MPI
Each timed call starts after a barrier; its time is the slowest rank's. Sizes up to
--large run -w warm-up and -n timed calls, larger ones --warmup-large and --iters-large.

Rank 0 prints one row per size and algorithm:
  size         bytes of the float32 array each rank passes
  count        values per rank (size / 4)
  algorithm    as above; with several --ranks-per-node groupings, e.g. homomorphic/rpn=1
  avg(us)      mean time per call in microseconds, over the timed calls
  min(us)      fastest timed call
  max(us)      slowest timed call
  med(us)      median timed call
  algbw(GB/s)  size / avg(us), in 10^9 bytes per second
  busbw(GB/s)  algbw times 2(N-1)/N for allreduce, (N-1)/N for reduce_scatter and N-1
               for allgather (N ranks), as nccl-tests defines it: comparable across N
  ratio        bytes a raw ring would send / bytes the algorithm sent (ccoll rows; a
               two-level row counts its exact intra-node bytes too)
  err/eb       largest |result - exact float64 result| over the resolved bound, every
               element of the last timed call whose exact result is finite (a NaN or
               Inf of the data has no error to measure): at most 1 for ccoll; inf where
               a result is NaN or Inf but the exact one is finite (--no-check: -)
  speedup      avg(us) of mpi / avg(us) of this row
  x(med)       med(us) of mpi / med(us) of this row (one slow call moves the mean, not it)
  comp         share of the timed calls that compressed (ccoll rows): 1.00 all, 0.00 none
               (sent raw through MPI), in between for auto, which decides call by call
  fmt          stream formats the compressed timed calls sent (1, 2 or 1,2; --format-version;
               the JSON row's extra.format_reason says why)
  model(us)    the cost model's prediction from this run's calibration (docs/model.md);
               for auto only when all or none of its calls compressed
  floor(us)    the least time the call could take by that calibration: the larger of
               its compute critical path and its wire time (docs/model.md, "The floor");
               none for a row that ran in two levels
  of-floor     avg(us) / floor(us); 1 would be the hardware's limit
A "-" marks a value that does not apply; --no-model, or one rank, leaves out the last
three.

Data: the tensors of one training step of a gradient dump (--data, default
datasets/minilm.h5) concatenated, rank r taking step r mod steps. A size smaller than
the step takes whole 32-value blocks (the compressor's block) spread evenly over the
whole step, the same places on every rank, so that a small size holds the step's mix of
tensors and not only its first one; a larger size repeats the step. The bound (--eb)
resolves over the data of each size on all ranks: a REL bound follows its value range.
Every dataset of the step must hold real numbers (float or integer; read as float32),
and the step at least one value; other files are refused before the sweep (exit 2).

--trace FILE adds, after each size's timed calls (so the timed numbers never include
it), one traced call of every ccoll algorithm, and writes their timelines as
Chrome/Perfetto trace-event JSON (open it in https://ui.perfetto.dev); --trace-png
draws them. Times count from a barrier that starts each traced call.
"""

EPILOG = """\
examples:
  mpiexec -n 2 python -m mpi4py -m ccoll.cli bench allreduce -b 64K -e 64M -f 4
  mpiexec -n 4 python -m mpi4py -m ccoll.cli bench allreduce -b 64M -e 64M \\
      --algorithms mpi,homomorphic --json ar.json --plot ar.png
  mpiexec -n 4 python -m mpi4py -m ccoll.cli bench reduce_scatter --eb abs:1e-5 --csv rs.csv

The model's calibration of the links and the compressor goes to the calibration cache
(~/.cache/ccoll/links.json, or CCOLL_CACHE_DIR; rank 0 writes it): `ccoll model --cached`
starts from its newest entry to predict other sizes, rank counts, ratios or links.
"""

_COLS = [
    ("size", ">12", lambda r: f"{r.size}"),
    ("count", ">11", lambda r: f"{r.count}"),
    ("algorithm", "<17", lambda r: r.algorithm),
    ("avg(us)", ">11", lambda r: f"{r.avg_us:.1f}"),
    ("min(us)", ">11", lambda r: f"{r.min_us:.1f}"),
    ("max(us)", ">11", lambda r: f"{r.max_us:.1f}"),
    ("med(us)", ">11", lambda r: "-" if r.med_us is None else f"{r.med_us:.1f}"),
    ("algbw(GB/s)", ">11", lambda r: f"{r.algbw_gbs:.3f}"),
    ("busbw(GB/s)", ">11", lambda r: f"{r.busbw_gbs:.3f}"),
    ("ratio", ">7", lambda r: "-" if r.ratio is None else f"{r.ratio:.2f}"),
    ("err/eb", ">7", lambda r: "-" if r.err_over_eb is None else f"{r.err_over_eb:.3f}"),
    ("speedup", ">7", lambda r: "-" if r.speedup is None else f"{r.speedup:.2f}"),
    ("x(med)", ">7", lambda r: "-" if r.med_speedup is None else f"{r.med_speedup:.2f}"),
    ("comp", ">5", lambda r: "-" if r.compressed_calls is None else f"{r.compressed_calls:.2f}"),
    ("fmt", ">4", lambda r: r.formats or "-"),
    ("model(us)", ">11", lambda r: "-" if r.model_us is None else f"{r.model_us:.1f}"),
    ("floor(us)", ">11", lambda r: "-" if r.floor_us is None else f"{r.floor_us:.1f}"),
    ("of-floor", ">8", lambda r: "-" if r.of_floor is None else f"{r.of_floor:.2f}"),
]


COLUMNS = tuple(name for name, _, _ in _COLS)


def _format_rows(rows: Sequence[Row], header: bool) -> str:
    lines = []
    if header:
        lines.append("  ".join(f"{name:{fmt}}" for name, fmt, _ in _COLS))
    for r in rows:
        lines.append("  ".join(f"{get(r):{fmt}}" for _, fmt, get in _COLS))
    return "\n".join(lines)


def to_csv(rows: Sequence[Row]) -> str:
    """Format the rows as CSV (one line per size and algorithm)."""
    buf = io.StringIO()
    names = [f for f in Row.__dataclass_fields__ if f != "extra"]
    w = csv.writer(buf)
    w.writerow(names)
    for r in rows:
        w.writerow(["" if getattr(r, f) is None else getattr(r, f) for f in names])
    return buf.getvalue()


def plot(rows: Sequence[Row], meta: dict[str, Any], path: str) -> None:
    """Time, speedup over MPI and time over the floor against size, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))
    algos = list(dict.fromkeys(r.algorithm for r in rows))
    colors = {"mpi": "tab:blue", "homomorphic": "tab:orange", "dar": "tab:green",
              "auto": "tab:red"}
    for a in algos:
        rs = [r for r in rows if r.algorithm == a]
        style = {"marker": "o", "ms": 3, "label": a, "color": colors.get(a)}
        ax1.plot([r.size for r in rs], [r.avg_us for r in rs], **style)
        if a != "mpi":
            ax2.plot([r.size for r in rs], [r.speedup or math.nan for r in rs], **style)
        ax3.plot([r.size for r in rs], [r.of_floor or math.nan for r in rs], **style)
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("time per call (us)")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_ylabel("speedup over MPI (x, log scale)")
    if any(a != "mpi" for a in algos):
        ax2.legend()
    ax1.legend()
    ax3.axhline(1.0, color="k", lw=0.8)
    ax3.set_ylabel("time over the model's floor (x, log scale)")
    if any(r.of_floor for r in rows):
        ax3.set_yscale("log")
        ax3.legend()
    else:
        ax3.text(0.5, 0.5, "no floor (--no-model, or one rank)", ha="center",
                 transform=ax3.transAxes)
    rate = meta.get("link_rate_bps")
    link = f", link {float(rate) / 1e9:g} Gbit/s" if rate else ", shared memory"
    idx = meta.get("speed_index") or {}
    sz3 = idx.get("sz3_compress_gbps")
    index = f", SZ3 {sz3 * 1e3:.0f} MB/s on {idx.get('cpu')}" if sz3 else ""
    fig.suptitle(f"ccoll {meta['collective']}: {meta['ranks']} ranks, eb {meta['eb']}{link}, "
                 f"load {meta['loadavg'][0]:.1f}{index}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ccoll bench`` on the CLI's subparsers."""
    from ccoll.helpformat import DefaultsFormatter
    from ccoll.units import parse_size

    p = subparsers.add_parser(
        "bench",
        help="OSU-style sweep of ccoll's collectives against plain MPI (run under mpiexec)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("collective", choices=sorted(_BUSBW), help="collective to time")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4"),
                   help="smallest size in bytes per rank (default 4; K/M/G = 2^10/2^20/2^30)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                   help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0,
                   help="multiply the size by this between steps: a finite number >= 1, "
                   f"at most {MAX_SIZES} sizes in all; sizes are whole float32 elements "
                   "(default 2)")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help=f"timed iterations, at most {MAX_ITERS} as every iteration count "
                   "(default 20)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="warm-up iterations (default 5)")
    p.add_argument("--iters-large", type=int, default=5,
                   help="timed iterations above --large (default 5)")
    p.add_argument("--warmup-large", type=int, default=1,
                   help="warm-up iterations above --large (default 1)")
    p.add_argument("--large", type=parse_size, default=parse_size("1M"),
                   help="sizes above this use the -large counts (default 1M)")
    p.add_argument("--blocks", type=int, default=3,
                   help="runs each algorithm's timed calls are cut into; the algorithms take "
                   "turns run by run, each run led by one untimed call of its own (default 3)")
    p.add_argument("--eb", default="rel:1e-3",
                   help="error bound, rel:V or abs:V (default rel:1e-3)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help=f"comma-separated subset of {','.join(ALGORITHMS)}, each named at "
                   "most once (default all)")
    p.add_argument("--ranks-per-node", default="shm", metavar="LIST",
                   help="node grouping of ccoll's Communicators: 'shm' (MPI's shared-memory "
                   "domains, i.e. the real hosts) or R (consecutive blocks of R ranks; 1: "
                   "every rank its own node, a flat allreduce); a comma-separated list runs "
                   "every ccoll algorithm once per grouping, rows named e.g. "
                   "homomorphic/rpn=1, homomorphic/shm (default shm)")
    p.add_argument("--schedule", choices=("auto", "ring", "halving"), default="auto",
                   help="how ccoll's homomorphic allreduce moves streams between ranks (or "
                   "nodes): the ring, recursive halving and doubling, or auto (the ring "
                   "below 8, else the model's choice; default auto)")
    p.add_argument("--format-version", choices=("auto", "1", "2"), default="auto",
                   help="stream format of ccoll's compressed calls: 1, 2, or auto (chosen per "
                   "call by the cost model; default auto)")
    p.add_argument("--data", default=str(_DEFAULT_DATA),
                   help="HDF5 gradient dump (default datasets/minilm.h5)")
    p.add_argument("--no-check", action="store_true", help="skip the error check")
    p.add_argument("--no-model", action="store_true",
                   help="skip the model's predictions and floors")
    p.add_argument("--csv", metavar="FILE", help="also write the rows as CSV")
    p.add_argument("--json", dest="json_out", metavar="FILE",
                   help="also write rows and run metadata as JSON")
    p.add_argument("--plot", metavar="FILE",
                   help="also write a PNG of time, speedup and time over the floor")
    p.add_argument("--force", action="store_true",
                   help="replace output files (--csv, --json, --plot, --trace, --trace-png) "
                   "that exist; without it the run is refused before it starts")
    p.add_argument("--trace", metavar="FILE",
                   help="after each size's timed loop, trace one more call of every ccoll "
                        "algorithm and write the timelines as Chrome/Perfetto JSON")
    p.add_argument("--trace-png", metavar="FILE",
                   help="draw the traced calls' timelines (PNG; implies tracing)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing (files only)")
    p.set_defaults(handler=run_bench)
    return p


def run_bench(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    """Body of ``ccoll bench``: returns ``(document, text, exit code)``; rank 0 reports."""
    from mpi4py import MPI

    from ccoll.errorbound import as_bound
    from ccoll.errors import InputError

    comm = MPI.COMM_WORLD
    # First of all, and before any other collective: every rank must sweep the same sizes,
    # counts and algorithms, or one rank waits in a call that the others never make.
    _agree_options(comm, args)
    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algos if a not in ALGORITHMS]
    if bad or not algos:
        raise InputError(f"--algorithms: unknown {bad}; expected a subset of {ALGORITHMS}")
    dup = list(dict.fromkeys(a for a in algos if algos.count(a) > 1))
    if dup:
        raise InputError(f"--algorithms: {', '.join(dup)} given more than once; name each "
                         "algorithm once")
    if args.collective == "allgather":
        algos = [a for a in algos if a != "dar"]  # nothing is summed: one compressed algorithm
    if "mpi" in algos:
        algos = ["mpi"] + [a for a in algos if a != "mpi"]
    if args.iters < 1 or args.iters_large < 1 or args.warmup < 0 or args.warmup_large < 0:
        raise InputError("iteration counts must be >= 1 (warm-up >= 0)")
    for opt, v in (("-n", args.iters), ("--iters-large", args.iters_large),
                   ("-w", args.warmup), ("--warmup-large", args.warmup_large)):
        if v > MAX_ITERS:  # its call list and times would not fit in memory (MemoryError)
            raise InputError(f"{opt} {v}: at most {MAX_ITERS} calls per size")
    if args.blocks < 1:
        raise InputError(f"--blocks must be >= 1, got {args.blocks}")
    if not math.isfinite(args.stepfactor):
        raise InputError(f"-f must be a finite number >= 1, got {args.stepfactor}")
    if args.minbytes < 1 or args.maxbytes < args.minbytes or args.stepfactor < 1:
        raise InputError("need 1 <= -b <= -e and -f >= 1")
    if args.maxbytes < 4:
        raise InputError(f"-e {args.maxbytes} holds no float32 (4 bytes), the data's "
                         "smallest element: pass -e 4 or more")
    if args.stepfactor == 1 and args.minbytes != args.maxbytes:
        raise InputError("-f 1 never grows the size from -b to -e: pass -f > 1 (2 is "
                         "nccl-tests' and OSU's), or -b equal to -e for one size")
    if args.stepfactor > 1:
        span = max(args.maxbytes, 4) / max(args.minbytes, 4)
        steps = math.log(span) / math.log(args.stepfactor)
        if steps + 1 > MAX_SIZES:
            raise InputError(f"-f {args.stepfactor:g} from -b {args.minbytes} to -e "
                             f"{args.maxbytes} makes about {steps + 1:.3g} sizes; at most "
                             f"{MAX_SIZES}: pass a larger -f or a narrower range")
    if not Path(args.data).is_file():
        raise InputError(f"--data {args.data}: no such file")
    if (args.trace or args.trace_png) and algos == ["mpi"]:
        raise InputError("--trace/--trace-png trace ccoll's calls: add a ccoll algorithm to "
                         "--algorithms (homomorphic, dar or auto)")
    as_bound(args.eb)
    rpns = parse_ranks_per_node(args.ranks_per_node)
    rank0 = comm.Get_rank() == 0
    outputs = [(opt, path) for opt, path in (
        ("--trace", args.trace), ("--trace-png", args.trace_png), ("--csv", args.csv),
        ("--json", args.json_out), ("--plot", args.plot)) if path]
    _check_outputs(comm, outputs, force=args.force, data=args.data)
    # Each rank reads its own step: a step that cannot be timed stops every rank.
    base = None
    why = None
    try:
        base = load_gradients(args.data, comm.Get_rank())
    except InputError as exc:
        why = f"--data {exc}"
    _raise_on_any_rank(comm, why)
    live = rank0 and not args.quiet
    size_list = sizes(args.minbytes, args.maxbytes, args.stepfactor, 4)
    if live:
        print(f"# ccoll bench {args.collective}: {comm.Get_size()} ranks, eb {args.eb}, data "
              f"{args.data}, iters {args.iters}/{args.iters_large} (large > {args.large} B), "
              f"warmup {args.warmup}/{args.warmup_large}", flush=True)
    # The session's speed index (ccoll.speedindex): rank 0 measures it while the others
    # wait, so that every figure of this run has it beside it. They wait asleep: MPI's
    # blocking barrier spins, and ranks that share rank 0's cores would halve the index.
    index = speedindex.speed_index_on_rank0(comm)
    if live and index is not None:
        print(f"# {speedindex.describe(index)}", flush=True)
    rows, meta = bench(
        args.collective, size_list, eb=args.eb, iters=args.iters, warmup=args.warmup,
        iters_large=args.iters_large, warmup_large=args.warmup_large, large=args.large,
        algos=algos, data=args.data, check=not args.no_check, predict=not args.no_model,
        log=(lambda s: print(s, flush=True)) if live else None,
        trace=bool(args.trace or args.trace_png), ranks_per_node=rpns,
        schedule=args.schedule,
        format_version=None if args.format_version == "auto" else int(args.format_version),
        blocks=args.blocks, base=base,
    )
    timeline = meta.pop("trace", None)
    meta["speed_index"] = index
    doc = {"meta": meta, "rows": [asdict(r) for r in rows]}
    if rank0:
        from ccoll.h5.output import json_ready, write_atomically

        def text(content: str) -> Callable[[str], None]:
            def write(name: str) -> None:
                Path(name).write_text(content)

            return write

        if timeline is not None and args.trace:
            write_atomically(args.trace, text(json.dumps(timeline)))
        if timeline is not None and args.trace_png:
            from ccoll.collectives.trace import plot as plot_trace

            rate = meta.get("link_rate_bps")
            link = f"link {float(rate) / 1e9:g} Gbit/s" if rate else "shared memory"
            title = (f"ccoll {args.collective}, {meta['ranks']} ranks, eb {meta['eb']}, "
                     f"{link}, load {meta['loadavg'][0]:.1f}, {meta['date_utc']}")
            write_atomically(args.trace_png, lambda name: plot_trace(timeline, name, title),
                             default_suffix=".png")
        if args.csv:
            write_atomically(args.csv, text(to_csv(rows)))
        if args.json_out:
            write_atomically(args.json_out, text(json.dumps(json_ready(doc), indent=1,
                                                            default=str, allow_nan=False)))
        if args.plot:
            write_atomically(args.plot, lambda name: plot(rows, meta, name),
                             default_suffix=".png")
    # Rows were printed as they came; the CLI prints nothing more (other ranks: nothing).
    args.quiet = True
    return doc, "", 0


# Option names of the parsed arguments whose flag is not ``--`` + the name.
_FLAGS = {"collective": "the collective", "minbytes": "-b/--minbytes",
          "maxbytes": "-e/--maxbytes", "stepfactor": "-f/--stepfactor", "iters": "-n/--iters",
          "warmup": "-w/--warmup", "json_out": "--json", "quiet": "-q/--quiet",
          "no_check": "--no-check", "no_model": "--no-model"}


def _agree_options(comm: Any, args: argparse.Namespace) -> None:
    """Refuse options that differ between ranks, on every rank, before any timing.

    Rank 0 broadcasts its parsed options (buffer-based); every rank compares them with its
    own. If any rank differs, every rank raises the same :class:`InputError`, naming the
    first differing option and its values on rank 0 and on the lowest rank that differs.
    """
    from mpi4py import MPI

    mine = {k: repr(v) for k, v in sorted(vars(args).items())
            if v is None or isinstance(v, (str, int, float, bool, list, tuple))}
    text = json.dumps(mine, sort_keys=True).encode()
    length = np.array([len(text)], np.int64)
    comm.Bcast([length, MPI.INT64_T], root=0)
    buf = (np.frombuffer(text, np.uint8).copy() if comm.Get_rank() == 0
           else np.empty(int(length[0]), np.uint8))
    comm.Bcast([buf, MPI.UINT8_T], root=0)
    theirs = json.loads(buf.tobytes().decode())
    diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    why = None
    if diff:
        k = diff[0]
        more = f" (and {len(diff) - 1} more option(s))" if len(diff) > 1 else ""
        why = (f"options differ between ranks: {_FLAGS.get(k, '--' + k.replace('_', '-'))} "
               f"is {theirs.get(k, 'not set')} on rank 0 but {mine.get(k, 'not set')} on "
               f"rank {comm.Get_rank()}{more}; give every rank the same options")
    _raise_on_any_rank(comm, why)


def _raise_on_any_rank(comm: Any, why: str | None) -> None:
    """Raise :class:`InputError` on every rank if any rank has a ``why`` (collective).

    The message is the lowest such rank's, broadcast (buffer-based), so every rank stops
    with the same error and none waits in a collective the others left.
    """
    from mpi4py import MPI

    from ccoll.errors import InputError

    n, r = comm.Get_size(), comm.Get_rank()
    who = np.array([r if why is not None else n], np.int64)
    low = np.empty_like(who)
    comm.Allreduce(who, low, op=MPI.MIN)
    root = int(low[0])
    if root == n:
        return
    msg = (why or "").encode() if r == root else b""
    length = np.array([len(msg)], np.int64)
    comm.Bcast([length, MPI.INT64_T], root=root)
    buf = np.frombuffer(msg, np.uint8).copy() if r == root else np.empty(int(length[0]),
                                                                          np.uint8)
    comm.Bcast([buf, MPI.UINT8_T], root=root)
    raise InputError(buf.tobytes().decode())


def _check_outputs(comm: Any, outputs: Sequence[tuple[str, str]], *, force: bool,
                   data: str) -> None:
    """Refuse output files that exist (unless ``force``) or are the data, on every rank.

    Rank 0 writes the files, so rank 0 checks them (:func:`ccoll.h5.output.check_output`,
    as ``ccoll eval --plot`` does) and broadcasts the verdict: every rank raises the same
    error before the sweep, and none waits in one of its collectives.
    """
    from mpi4py import MPI

    from ccoll.errors import InputError
    from ccoll.h5.output import check_image_name, check_output

    verdict = np.zeros(2, np.int64)  # kind (0 fine, 1 exists, 2 other), message bytes
    msg = b""
    if comm.Get_rank() == 0:
        seen: dict[str, str] = {}
        try:
            for opt, path in outputs:
                key = os.path.abspath(path)
                if key in seen:
                    raise InputError(f"{seen[key]} and {opt} name the same file {path!r}")
                seen[key] = opt
                try:
                    check_output(path, force=force, inputs=(data,))
                    if opt in ("--plot", "--trace-png"):
                        check_image_name(path)
                except (FileExistsError, InputError) as exc:
                    raise type(exc)(f"{opt}: {exc}") from None
        except FileExistsError as exc:
            verdict[0], msg = 1, str(exc).encode()
        except InputError as exc:
            verdict[0], msg = 2, str(exc).encode()
        verdict[1] = len(msg)
    comm.Bcast([verdict, MPI.INT64_T], root=0)
    if verdict[0] == 0:
        return
    buf = np.frombuffer(msg, np.uint8).copy() if comm.Get_rank() == 0 else np.empty(
        int(verdict[1]), np.uint8)
    comm.Bcast([buf, MPI.UINT8_T], root=0)
    text = buf.tobytes().decode()
    raise (FileExistsError if verdict[0] == 1 else InputError)(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ccoll bench`` without the rest of the CLI (``python -m ccoll.bench ...``)."""
    ap = argparse.ArgumentParser(prog="ccoll")
    add_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    _, _, code = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
