"""``policy="auto"``: decide per call whether compressing pays, from measured costs.

:func:`ccoll.collectives.policy._decide` hands ``"auto"`` calls to :class:`AutoPolicy`,
which feeds the cost model (:mod:`ccoll.collectives.model`, docs/model.md) with constants
measured on the communicator and on the data:

- link latency ``alpha`` and bandwidth ``beta``: a ring ``Sendrecv`` probe at first use on a
  communicator (about 0.1-0.3 s), cached in ``~/.cache/ccoll/links.json`` under a key made of
  every rank's host name and network namespace, the size, and the MPI transport settings;
- compressor throughputs (compress, homomorphic add, decompress): timed per communicator,
  backend, dtype and size class on the first message of the class that needs them (a
  64 MiB strided sample of larger ones), then scaled by the share of them that a real
  compressed allreduce of 4 Mi elements per rank reaches (fitted to the model); the
  ring's fixed and per-chunk costs: tiny compressed allreduces, timed once per
  communicator;
- the compression ratio: per call, from compressing a strided sample of the message's
  32-element blocks (its cost is kept near 1% of the predicted raw time).

Every input of the decision is identical on all ranks before it is taken: the probe's times
are maxima over ranks (rank 0 reads and writes the cache and broadcasts), the compressor
throughputs are minima over ranks, and the ratio comes from sampled sizes summed over ranks,
all through collectives; the decision itself uses only ``frexp`` and IEEE ``+ - * /``,
``min``, ``max`` on those numbers (:func:`ccoll.collectives.model.log2`), so every rank
takes the same one. Messages too small for compression to pay even with an infinitely fast
compressor at an infinite ratio are sent raw without any communication.

Environment overrides (any subset): ``CCOLL_ALPHA`` (``5us``), ``CCOLL_BANDWIDTH``
(``10Gbit``), ``CCOLL_COMPRESS_GBPS``, ``CCOLL_ADD_GBPS``, ``CCOLL_DECOMPRESS_GBPS``,
``CCOLL_REDUCE_GBPS``, ``CCOLL_OVERHEAD`` (``150us``), ``CCOLL_RATIO`` (skips sampling),
``CCOLL_EFFICIENCY`` (the share of the compressor rates reached inside a collective, which
is otherwise fitted on one real compressed allreduce per size class from 1 Mi elements up),
``CCOLL_CALIBRATION=refresh`` (probe again and overwrite the cache) or ``=off`` (neither
read nor write the cache), ``CCOLL_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ccoll`` or
``~/.cache/ccoll``).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll import units
from ccoll.collectives import model
from ccoll.collectives.model import Params, Prediction

__all__ = [
    "AutoDecision",
    "LinkCalibration",
    "CompressorCalibration",
    "AutoPolicy",
    "probe_link",
    "link_calibration",
    "calibrate_compressor",
    "measure_ring_costs",
    "size_class",
    "sample_blocks",
    "cache_dir",
    "newest_cached_params",
    "describe",
    "choose",
    "decide_call",
    "stream_bound",
]

Ops = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]

# Seconds of Python and bookkeeping in one compressed call besides its small collectives;
# fitted on the bench (docs/model.md, "Calibration").
# Compress only when the model predicts it at least this much faster: the fitted model
# was within about 10% of the measured compressed times on the bench, and a wrong
# "compress" near the break-even point costs more than a missed one (docs/model.md,
# "The decision").
DECISION_MARGIN = 0.15
# A lower bound of the fixed cost of a compressed call, used before the ring's own costs
# are measured (the size test that decides tiny messages without any communication).
PY_OVERHEAD = 150e-6
CACHE_MAX_AGE_S = 7 * 24 * 3600.0
_TRANSPORT_ENV = (
    "MPIR_CVAR_NOLOCAL", "MPIR_CVAR_CH4_NETMOD", "FI_PROVIDER", "FI_TCP_IFACE",
    "CCOLL_CLUSTER_RATE_BPS", "UCX_NET_DEVICES", "UCX_TLS",
)
_SAMPLE_BUDGET = 0.01  # share of the predicted raw time that ratio sampling may take
_MIN_SAMPLE_BLOCKS = 32
_MAX_SAMPLE_BLOCKS = 4096
# Elements timed for compressor throughputs: 64 MiB of float32, twice the last-level cache
# here, so that the rates are those of a large message streamed from memory (a 4 MiB sample
# ran 2-4x faster than a 64 MiB message, and a 16 MiB one still 10-30% faster).
_CAL_SAMPLE_ELEMS = 1 << 24
_CAL_RUN = 1 << 18  # elements per contiguous run of the calibration sample
_CAL_PIECE = 8192  # elements of the piece that measures the fixed cost of a call
_KNOWN_MAX = 4096  # known_raw answers kept per communicator (a job uses a few sizes)
STICKY_CALLS = 16  # calls that repeat a model's "raw" without sampling (AutoPolicy.sticky_raw)
# The compute-efficiency fit (measure_efficiency) times an allreduce of this many elements
# per rank, for size classes of at least _EFF_MIN elements (below, fixed costs dominate
# and the rates matter little).
_EFF_ELEMS = 1 << 22
_EFF_MIN = 1 << 20
_RAW_IDLE_S = 5e-3  # idle time before each timed MPI_Allreduce of measure_raw_efficiency


@dataclass(frozen=True)
class LinkCalibration:
    """Ring-step latency and bandwidth of one communicator, plus a plain sum's throughput."""

    alpha: float
    beta: float
    reduce: float
    source: str  # "probe", "cache", "env", or "single rank"
    raw_efficiency: float = 1.0  # share of beta that MPI_Allreduce itself reaches


@dataclass(frozen=True)
class CompressorCalibration:
    """Throughputs of one backend (bytes of float data per second) and the ring's fixed costs.

    ``call_overhead`` is what a tiny compressed allreduce takes end to end (Python, the
    agreement, the exchange of stream sizes, thread hand-offs, latencies); ``chunk_overhead``
    what each further pipeline chunk per ring block adds.
    """

    compress: float
    add: float
    decompress: float
    chunk_overhead: float
    source: str
    call_overhead: float = 0.0
    # Share of the rates above that the kernels reach inside a real compressed allreduce
    # (where MPI's polling, the network stack and the other ranks take their share of the
    # cores); the rates above already include it.
    efficiency: float = 1.0


@dataclass(frozen=True)
class AutoDecision:
    """What ``policy="auto"`` chose for one call, and why."""

    compress: bool
    chunk_elems: int  # elements per pipeline chunk (a whole ring block for one chunk)
    reason: str
    prediction: Prediction | None = None
    ratio: float | None = None


_KNOWN_RAW = AutoDecision(False, 0, "raw whatever the data, from the calibrations already made")


# --------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Folder of the calibration cache (``CCOLL_CACHE_DIR`` overrides it)."""
    env = os.environ.get("CCOLL_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ccoll"


def _cache_file() -> Path:
    return cache_dir() / "links.json"


def _read_cache() -> dict[str, Any]:
    try:
        with open(_cache_file()) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    """Atomically add one entry (rank 0 only); keeps the 64 newest entries."""
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = _read_cache()
        doc[key] = entry
        if len(doc) > 64:
            keep = sorted(doc, key=lambda k: doc[k].get("time", 0.0))[-64:]
            doc = {k: doc[k] for k in keep}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".links-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a probe per run


def newest_cached_params() -> Params | None:
    """Model parameters from the newest cache entry (for ``ccoll model --cached``)."""
    doc = _read_cache()
    if not doc:
        return None
    e = max(doc.values(), key=lambda v: v.get("time", 0.0))
    kw = {k: float(e[k]) for k in ("alpha", "beta", "reduce", "raw_efficiency") if k in e}
    comp = e.get("compressor") or {}
    kw.update({k: float(comp[k]) for k in ("compress", "add", "decompress", "chunk_overhead")
               if k in comp})
    if float(comp.get("call_overhead", 0.0)) > 0:
        kw["overhead"] = float(comp["call_overhead"])
    return replace(model.DEFAULTS, **kw)


def _netns_id() -> str:
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return "-"


def link_key(comm: MPI.Intracomm) -> str:
    """Cache key of a communicator's links (collective: every rank contributes its host).

    Host names alone do not tell two emulated clusters on one machine apart, so the key
    also holds each rank's network-namespace inode (a new one for every emulated cluster).
    """
    mine = f"{socket.gethostname()}/{_netns_id()}"
    hosts = comm.allgather(mine)
    env = [f"{k}={os.environ.get(k, '')}" for k in _TRANSPORT_ENV]
    raw = json.dumps([comm.Get_size(), hosts, env, MPI.Get_library_version()[:60]])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


# --------------------------------------------------------------------------------- probes


def _ring_time(comm: MPI.Intracomm, nbytes: int, reps: int) -> float:
    """Best over ``reps`` of the slowest rank's time for one ring ``Sendrecv`` of ``nbytes``."""
    n, r = comm.Get_size(), comm.Get_rank()
    a = np.ones(max(1, nbytes), np.uint8)
    b = np.empty_like(a)
    right, left = (r + 1) % n, (r - 1) % n
    best = np.inf
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Sendrecv([a[:nbytes], MPI.BYTE], right, 77, [b[:nbytes], MPI.BYTE], left, 77)
        best = min(best, time.perf_counter() - t0)
    return float(comm.allreduce(best, op=MPI.MAX))


def _sum_throughput() -> float:
    # 16 MiB: larger than caches, like the messages where the sum's cost matters.
    a = np.ones(4 << 20, np.float32)
    b = np.ones(4 << 20, np.float32)
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / max(best, 1e-9)


def probe_link(comm: MPI.Intracomm) -> LinkCalibration:
    """Measure ``alpha`` and ``beta`` with ring ``Sendrecv`` steps (collective, ~0.1-0.3 s).

    ``alpha`` is the best time of a 1-byte step; ``beta`` comes from the growth of the time
    between 1 byte and a message large enough to take about 30 ms (at most 32 MiB), so that
    a token-bucket shaper's burst does not inflate it. Every rank returns the same numbers.
    """
    if comm.Get_size() == 1:
        return LinkCalibration(0.0, 1e12, _sum_throughput(), "single rank")
    _ring_time(comm, 1, 3)  # connections are made lazily; keep that out of the timing
    alpha = _ring_time(comm, 1, 20)
    m = 256 << 10
    t = _ring_time(comm, m, 2)
    while t < 0.03 and m < (32 << 20):  # same t on every rank: the loop agrees
        m *= 4
        t = _ring_time(comm, m, 2)
    beta = m / max(t - alpha, 1e-9)
    red = float(comm.allreduce(_sum_throughput(), op=MPI.MIN))
    # MPI's own allreduce of a message whose ring blocks are m bytes: how much of the link
    # it reaches sets the baseline the compressed algorithms compete with.
    n = comm.Get_size()
    a = np.ones(m * n // 4, np.float32)
    y = np.empty_like(a)
    best = np.inf
    for _ in range(2):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(a, y, op=MPI.SUM)
        best = min(best, time.perf_counter() - t0)
    t_ar = float(comm.allreduce(best, op=MPI.MAX))
    wire = t_ar - 2 * (n - 1) * alpha - (n - 1) / n * a.nbytes / red
    eff = 2 * (n - 1) / n * a.nbytes / beta / max(wire, 1e-9)
    return LinkCalibration(alpha, beta, red, "probe", min(max(eff, 0.05), 1.0))


def _env_float(name: str, parse: Callable[[str], float]) -> float | None:
    v = os.environ.get(name)
    if not v:
        return None
    try:
        return float(parse(v))
    except ValueError as e:
        raise ValueError(f"environment variable {name}={v!r}: {e}") from None


def link_calibration(comm: MPI.Intracomm) -> tuple[LinkCalibration, str | None]:
    """Link constants for ``comm`` and their cache key (collective).

    Environment overrides first, else the cache, else a probe.
    """
    env_a = _env_float("CCOLL_ALPHA", units.parse_time)
    env_b = _env_float("CCOLL_BANDWIDTH", units.parse_rate)
    env_r = _env_float("CCOLL_REDUCE_GBPS", float)
    mode = os.environ.get("CCOLL_CALIBRATION", "").lower()
    if env_a is not None and env_b is not None:
        red = env_r * 1e9 if env_r is not None else model.DEFAULTS.reduce
        return LinkCalibration(env_a, env_b, red, "env"), None
    key = link_key(comm)
    entry = None
    if comm.Get_rank() == 0 and mode not in ("refresh", "off"):
        e = _read_cache().get(key)
        if e and time.time() - float(e.get("time", 0)) < CACHE_MAX_AGE_S:
            entry = e
    entry = comm.bcast(entry, root=0)
    if entry is not None:
        cal = LinkCalibration(float(entry["alpha"]), float(entry["beta"]),
                              float(entry["reduce"]), "cache",
                              float(entry.get("raw_efficiency", 1.0)))
    else:
        cal = probe_link(comm)
        if comm.Get_rank() == 0 and mode != "off":
            _write_cache(key, {"alpha": cal.alpha, "beta": cal.beta, "reduce": cal.reduce,
                               "raw_efficiency": cal.raw_efficiency, "time": time.time(),
                               "size": comm.Get_size()})
    cal = replace(
        cal,
        alpha=cal.alpha if env_a is None else env_a,
        beta=cal.beta if env_b is None else env_b,
        reduce=cal.reduce if env_r is None else env_r * 1e9,
    )
    return cal, key


def _remember_compressor(comm: MPI.Intracomm, key: str | None,
                         cal: CompressorCalibration) -> None:
    """Add the compressor's numbers to this communicator's cache entry (``ccoll model``)."""
    if key is None or comm.Get_rank() != 0:
        return
    if os.environ.get("CCOLL_CALIBRATION", "").lower() == "off":
        return
    entry = _read_cache().get(key)
    if entry is not None:
        _write_cache(key, {**entry, "compressor": asdict(cal)})


# ------------------------------------------------------------------------- compressor


def _calibration_sample(x: np.ndarray) -> np.ndarray:
    """16 Mi elements of ``x`` in evenly spaced runs of 256 Ki, or all of a smaller ``x``."""
    flat = x.reshape(-1)
    n = flat.size
    if n > _CAL_SAMPLE_ELEMS:
        runs = _CAL_SAMPLE_ELEMS // _CAL_RUN
        starts = np.arange(runs, dtype=np.int64) * ((n - _CAL_RUN) // max(runs - 1, 1))
        idx = (starts[:, None] + np.arange(_CAL_RUN)[None, :]).reshape(-1)
        return np.ascontiguousarray(flat[idx])
    return np.array(flat, copy=True)


def size_class(count: int) -> str:
    """Messages whose compressor costs are calibrated together: by powers of 4, or "large".

    Throughput depends on the size (cache) and on the data (zero blocks are cheap; the
    first tensors of a gradient are often mostly zero), so a small message's numbers are
    not used for a large one. From 16 Mi elements on, a strided 64 MiB sample stands for all.
    """
    return "large" if count >= _CAL_SAMPLE_ELEMS else str(count.bit_length() // 2)


def _best(f: Callable[[], Any], reps: int = 3) -> tuple[float, Any]:
    best, out = np.inf, None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t0)
    return best, out


def calibrate_compressor(x: np.ndarray, eb: float, ops: Ops) -> CompressorCalibration:
    """Time ``(compress_abs, add, decompress)`` on a sample of ``x`` at bound ``eb`` (local).

    Each throughput is the sample's size over its best time (so one call's fixed
    cost is included, which errs on the slow side); the fixed cost of a call
    (``chunk_overhead``) is what an 8 Ki-element piece takes beyond its share of that rate,
    capped at 2 ms so that one descheduled timing on a busy machine cannot dominate.
    """
    compress_abs, add, decompress = ops
    big = _calibration_sample(x)
    small = np.ascontiguousarray(big[:_CAL_PIECE])
    out = np.empty_like(big)
    s0 = compress_abs(small, eb)  # compile or load the kernels outside the timing
    add(s0, s0)
    decompress(s0, out=out[: small.size])
    tcb, sb = _best(lambda: compress_abs(big, eb), 2)
    tcs, ss = _best(lambda: compress_abs(small, eb), 5)
    tab, _ = _best(lambda: add(sb, sb), 2)
    tas, _ = _best(lambda: add(ss, ss), 5)
    tdb, _ = _best(lambda: decompress(sb, out=out), 2)
    tds, _ = _best(lambda: decompress(ss, out=out[: small.size]), 5)
    c, a, d = (big.nbytes / max(t, 1e-9) for t in (tcb, tab, tdb))
    sm = small.nbytes
    fixed = sum(max(0.0, ts - sm / r) for ts, r in ((tcs, c), (tas, a), (tds, d)))
    return CompressorCalibration(c, a, d, min(fixed, 2e-3), "measured")


def measure_ring_costs(comm: MPI.Intracomm, x: np.ndarray, eb: float) -> tuple[float, float]:
    """Time a compressed allreduce's fixed cost and each further chunk's cost (collective).

    Times tiny homomorphic allreduces (256 elements per rank and block, taken from ``x``)
    through the real collective on a private Communicator, the median of seven: one chunk
    per block, then 8.
    Returns this rank's ``(call, per_chunk)`` seconds; the caller takes the maximum.
    """
    from ccoll.collectives.communicator import Communicator
    from ccoll.errorbound import ABS

    n = comm.Get_size()
    blk = 256
    data = np.resize(sample_blocks(x, 8 * n), blk * n).astype(x.dtype)
    bound = ABS(eb * n)  # the ring quantizes each rank's streams with about eb
    times = []
    for chunk in (blk, blk // 8):
        with Communicator(comm, policy="compress", chunk_elems=chunk) as cc:
            cc.allreduce(data, bound)
            ts = []
            for _ in range(7):
                comm.Barrier()
                t0 = time.perf_counter()
                cc.allreduce(data, bound)
                ts.append(time.perf_counter() - t0)
        # The median, not the best: these costs recur on every call, and thread hand-offs
        # and polling vary from call to call.
        times.append(float(np.median(ts)))
    return times[0], max(0.0, (times[1] - times[0]) / 7)


def _slowest_median(comm: MPI.Intracomm, call: Callable[[], Any], reps: int = 3,
                    idle: float = 0.0) -> float:
    """Return the slowest rank's median time of ``call()`` after one untimed call.

    ``idle`` seconds pass before each timed call (with the ranks then synchronized).
    """
    call()
    ts = []
    for _ in range(reps):
        if idle:
            time.sleep(idle)
        comm.Barrier()
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    mine = np.array([float(np.median(ts))])
    worst = np.empty_like(mine)
    comm.Allreduce(mine, worst, op=MPI.MAX)
    return float(worst[0])


def measure_raw_efficiency(comm: MPI.Intracomm, x: np.ndarray, p: Params) -> float:
    """Share of the link's bandwidth that ``MPI_Allreduce`` reaches at ``x``'s size.

    Times ``MPI_Allreduce`` of (the first ``_EFF_ELEMS`` elements of) ``x`` and solves
    ``predict_raw = 2(N-1) alpha + 2(N-1)/N * S/(e beta) + (N-1)/N * S/reduce`` for ``e``,
    clamped to [1/16, 16]: small messages can beat the line rate (a NIC's or a traffic
    shaper's burst), large ones fall short of it. Each timed call follows ``_RAW_IDLE_S``
    of idle link, as gradient allreduces follow a step's computation (back to back, a
    burst allowance would be used up by the call before). Collective; the same ``e`` on
    every rank.
    """
    n = comm.Get_size()
    data = np.ascontiguousarray(x.reshape(-1)[:_EFF_ELEMS])
    out = np.empty_like(data)
    t = _slowest_median(comm, lambda: comm.Allreduce(data, out, op=MPI.SUM), idle=_RAW_IDLE_S)
    size = float(data.nbytes)
    wire = t - 2 * (n - 1) * p.alpha - (n - 1) / n * size / p.reduce
    ideal = 2 * (n - 1) / n * size / p.beta
    return min(max(ideal / wire, 1.0 / 16), 16.0) if wire > 0 else 16.0


def measure_efficiency(comm: MPI.Intracomm, x: np.ndarray, eb: float, p: Params,
                       compress_abs: Callable[..., Any]) -> float:
    """Fit the share of the calibrated compute rates that a real compressed allreduce reaches.

    Times a homomorphic allreduce (through the real collective, median of three, the
    slowest rank's) of the first ``_EFF_ELEMS`` elements of ``x`` on every rank and finds
    by bisection the factor ``e`` by which the model (``p``, with its compress, add and
    decompress rates times ``e``) predicts exactly that time, clamped to [1/16, 4].
    Collective; every input of the bisection is agreed, so every rank gets the same ``e``.
    """
    from ccoll.collectives.communicator import DEFAULT_CHUNK, Communicator
    from ccoll.errorbound import ABS

    n = comm.Get_size()
    data = np.ascontiguousarray(x.reshape(-1)[:_EFF_ELEMS])
    bound = ABS(eb * n)  # the ring quantizes each rank's streams with about eb
    with Communicator(comm, policy="compress") as cc:
        measured = _slowest_median(comm, lambda: cc.allreduce(data, bound))
    mine = np.array(estimate_stream(data, eb, _MAX_SAMPLE_BLOCKS, compress_abs))
    tot = np.empty_like(mine)
    comm.Allreduce(mine, tot, op=MPI.SUM)
    size = float(data.nbytes)
    ratio = n * size / max(float(tot[0]), 1.0)
    width = float(tot[2]) / float(tot[1]) if tot[1] > 0 else 1.0
    block = -(-data.size // n)
    chunks = -(-block // DEFAULT_CHUNK)

    def slower(e: float) -> bool:
        q = replace(p, compress=p.compress * e, add=p.add * e, decompress=p.decompress * e)
        return model.predict(size, n, q, ratio, width=width, chunks=chunks).homomorphic > measured

    lo, hi = 1.0 / 16, 4.0
    if not slower(lo):
        return lo
    if slower(hi):
        return hi
    return model._bisect(lambda e: not slower(e), lo, hi, 60)


def sample_blocks(x: np.ndarray, nsample: int) -> np.ndarray:
    """``nsample`` evenly spaced whole 32-element blocks of ``x``, contiguous (a copy)."""
    flat = x.reshape(-1)
    nblocks = flat.size // 32
    if nblocks == 0:
        return np.ascontiguousarray(flat)
    k = max(1, min(nsample, nblocks))
    sel = (np.arange(k, dtype=np.int64) * nblocks) // k
    return np.ascontiguousarray(flat[: nblocks * 32].reshape(nblocks, 32)[sel].reshape(-1))


def estimate_stream(x: np.ndarray, eb: float, nsample: int,
                    compress_abs: Callable[..., Any]) -> tuple[float, float, float]:
    """Estimated stream bytes of all of ``x``, its non-zero blocks and their summed widths.

    Compresses ``nsample`` evenly spaced blocks and scales the bitmap, code bytes and
    payload words up to the whole array (the 64-byte header counted once).
    """
    from ccoll.compressor.format import parse_header

    s = sample_blocks(x, nsample)
    hdr = parse_header(np.asarray(compress_abs(s, eb)))
    scale = -(-x.size // 32) / max(hdr.nblocks, 1)
    nb = -(-x.size // 32)
    nnz = hdr.nnz * scale
    words = hdr.payload_words * scale
    est = 64 + 4 * -(-nb // 32) + nnz + 4 * words
    widths = max(words - nnz, 0.0)  # a fixed-length block has 1 + width payload words
    return est, nnz, widths


# ----------------------------------------------------------------------------- policy


class AutoPolicy:
    """Calibration and per-call decisions of ``policy="auto"`` for one communicator.

    Every method that may communicate is collective and must be called by all ranks in the
    same order, which the collectives guarantee by calling :meth:`decide` after their
    agreement step (all ranks then hold the same policy, size, dtype and bound).
    """

    def __init__(self, comm: MPI.Intracomm, *, backend: str = "cpu",
                 ops: Ops | None = None) -> None:
        self.comm = comm
        self.backend = backend
        self._ops = ops
        self._link: LinkCalibration | None = None
        self._key: str | None = None
        self._comp: dict[str, CompressorCalibration] = {}
        self._thresholds: dict[tuple[str, ...], float] = {}
        self._ring: tuple[float, float] | None = None
        self._raw_eff: dict[tuple[int, int], float] = {}
        self._sticky: dict[Any, int] = {}
        # known_raw answers that the calibrations settled (they never change once made).
        self._known: dict[tuple[Any, ...], bool] = {}
        self.last: AutoDecision | None = None

    # -- calibration ------------------------------------------------------------------

    def ops(self) -> Ops:
        """``(compress_abs, add, decompress)`` of the compressor the collectives use."""
        if self._ops is None:
            from ccoll.collectives.codec import api

            mod = api()
            self._ops = (mod.compress_abs, mod.add, mod.decompress)
        return self._ops

    def link(self) -> LinkCalibration:
        """Link constants (collective on first use)."""
        if self._link is None:
            self._link, self._key = link_calibration(self.comm)
        return self._link

    def compressor(self, x: np.ndarray, eb: float) -> CompressorCalibration:
        """Compressor throughputs, agreed over ranks (collective on first use per dtype)."""
        key = f"{self.backend}/{x.dtype}/{size_class(x.size)}"
        cal = self._comp.get(key)
        if cal is not None:
            return cal
        env = {k: _env_float(f"CCOLL_{k.upper()}_GBPS", float)
               for k in ("compress", "add", "decompress")}
        given = [env[k] for k in ("compress", "add", "decompress")]
        if all(v is not None for v in given):
            mine = np.array([*(v * 1e9 for v in given if v is not None), -0.0, -PY_OVERHEAD])
            src = "env"
        else:
            m = calibrate_compressor(x, eb, self.ops())
            if self._ring is None:  # once per communicator: it does not depend on the data
                self._ring = measure_ring_costs(self.comm, x, eb)
            call, chunk = self._ring
            mine = np.array([m.compress, m.add, m.decompress, -chunk, -call])
            for i, v in enumerate(given):
                if v is not None:
                    mine[i] = v * 1e9
            src = "measured"
        agreed = np.empty_like(mine)
        # The slowest rank sets the pace: minimum rates, maximum costs.
        self.comm.Allreduce(mine, agreed, op=MPI.MIN)
        cal = CompressorCalibration(float(agreed[0]), float(agreed[1]), float(agreed[2]),
                                    float(-agreed[3]), src, float(-agreed[4]))
        e = _env_float("CCOLL_EFFICIENCY", float)
        if e is None and src == "measured" and x.size >= _EFF_MIN:
            e = measure_efficiency(self.comm, x, eb, self.params(cal), self.ops()[0])
        if e is not None and e > 0:
            cal = replace(cal, compress=cal.compress * e, add=cal.add * e,
                          decompress=cal.decompress * e, efficiency=e)
        self._comp[key] = cal
        _remember_compressor(self.comm, self._key, cal)
        return cal

    def params(self, comp: CompressorCalibration | None = None) -> Params:
        """Model parameters from the calibrations (``comp=None``: an infinitely fast one)."""
        link = self.link()
        n = self.comm.Get_size()
        # A compressed call's fixed cost, plus the small allreduce of this policy's ratio.
        mine = link.alpha * max(1, (n - 1).bit_length())
        over = _env_float("CCOLL_OVERHEAD", units.parse_time)
        if over is not None:
            overhead = over + mine
        elif comp is None or comp.call_overhead <= 0:
            overhead = PY_OVERHEAD + 3 * mine  # agreement, stream sizes, ratio
        else:
            overhead = comp.call_overhead + mine
        if comp is None:
            return Params(alpha=link.alpha, beta=link.beta, compress=1e30, add=1e30,
                          decompress=1e30, reduce=link.reduce, overhead=overhead,
                          chunk_overhead=0.0, raw_efficiency=link.raw_efficiency)
        return Params(alpha=link.alpha, beta=link.beta, compress=comp.compress, add=comp.add,
                      decompress=comp.decompress, reduce=link.reduce, overhead=overhead,
                      raw_efficiency=link.raw_efficiency,
                      chunk_overhead=comp.chunk_overhead)

    def raw_efficiency(self, x: np.ndarray) -> float:
        """MPI's share of the link at ``x``'s size (collective on first use per power of 2)."""
        if _env_float("CCOLL_BANDWIDTH", units.parse_rate) is not None:
            return self.link().raw_efficiency  # a given link speed is taken as it is
        key = (x.dtype.itemsize, x.size.bit_length())
        r = self._raw_eff.get(key)
        if r is None:
            r = measure_raw_efficiency(self.comm, x, self.params(None))
            self._raw_eff[key] = r
        return r

    def params_for(self, x: np.ndarray, comp: CompressorCalibration) -> Params:
        """Return :meth:`params` with MPI's share of the link measured at ``x``'s size.

        Collective on first use per power of 2 (:meth:`raw_efficiency`).
        """
        return replace(self.params(comp), raw_efficiency=self.raw_efficiency(x))

    # -- decision ---------------------------------------------------------------------

    def decide(self, x: np.ndarray, eb: float, *, collective: str = "allreduce",
               algorithm: str = "homomorphic", max_chunks: int = 64,
               root: int | None = None) -> AutoDecision:
        """Raw or compressed for one call on ``x`` whose streams use absolute bound ``eb``.

        Collective (all ranks, same ``x.size``, dtype and ``eb``). ``eb`` is the bound each
        rank's streams are quantized with (for a sum, the collective's share of the user's
        bound). For ``bcast`` only ``root``'s data is sampled.
        """
        n = self.comm.Get_size()
        size = float(x.size * x.itemsize)
        block_elems = max(1, -(-x.size // n))
        if n == 1 or x.size == 0:
            return self._done(AutoDecision(False, block_elems, "one rank or empty"))
        if not eb > 0:
            return self._done(AutoDecision(False, block_elems, "lossless bound: nothing to gain"))

        # 1. Clear-cut by size alone: even an infinitely fast compressor with an infinite
        #    ratio loses. Uses only agreed numbers, so it needs no communication, and the
        #    threshold is computed once, so that tiny messages cost a comparison.
        if size < self._threshold((collective, algorithm), lambda: self.params(None)):
            return self._done(AutoDecision(False, block_elems, "too small to gain"))
        comp = self.compressor(x, eb)
        p = self.params_for(x, comp) if collective != "bcast" else self.params(comp)
        best = model.predict(size, n, p, 1e30, collective=collective, chunks=1)
        if not _pays(best, algorithm):
            return self._done(AutoDecision(False, block_elems, "compressor slower than the link"))
        # 2. Ratio from a strided sample of blocks, summed over ranks.
        forced = _env_float("CCOLL_RATIO", float)
        if forced is not None:
            ratio, width = forced, model.DEFAULT_WIDTH
        else:
            t_raw = model.predict(size, n, p, 1.0, collective=collective, chunks=1).raw
            budget_bytes = _SAMPLE_BUDGET * t_raw * p.compress
            nsample = int(min(_MAX_SAMPLE_BLOCKS, max(_MIN_SAMPLE_BLOCKS, budget_bytes // 128)))
            mine = np.zeros(4, np.float64)
            if root is None or self.comm.Get_rank() == root:
                mine[:3] = estimate_stream(x, eb, nsample, self.ops()[0])
                mine[3] = 1.0
            tot = np.empty_like(mine)
            self.comm.Allreduce(mine, tot, op=MPI.SUM)
            ratio = float(tot[3]) * size / max(float(tot[0]), 1.0)
            width = float(tot[2]) / float(tot[1]) if tot[1] > 0 else 1.0
        return self._done(choose(x.size, x.itemsize, n, p, ratio, width, collective=collective,
                                 algorithm=algorithm, max_chunks=max_chunks))

    def known_raw(self, count: int, dtype: Any, *, collective: str = "allreduce",
                  algorithm: str = "homomorphic") -> bool:
        """Tell whether this call goes raw whatever the data, from calibrations already made.

        Local and free (no communication, no calibration): the collectives ask it before
        computing the value range that a ``REL`` bound needs, which a raw call does not,
        and which costs about 5% of a large raw allreduce; a call it settles goes raw
        without asking :meth:`decide`. Same answer on every rank that passes the same count
        and dtype (calibrations are agreed); a rank that passes another count fails the
        agreement anyway. Answers that the calibrations settle are remembered per
        (count, dtype, collective, algorithm): a raw call then costs one dict lookup here
        instead of a model prediction (~20 us).
        """
        key = (count, dtype, collective, algorithm)
        known = self._known.get(key)
        if known is not None:
            return known
        n = self.comm.Get_size()
        if n == 1 or count == 0:
            return True
        if self._link is None:
            return False  # not calibrated yet: the answer may change
        size = float(count * np.dtype(dtype).itemsize)
        t = self._thresholds.get((collective, algorithm))
        if t is not None and size < t:
            return self._remember(key, True)
        comp = self._comp.get(f"{self.backend}/{np.dtype(dtype)}/{size_class(count)}")
        if comp is None:
            return False
        best = model.predict(size, n, self.params(comp), 1e30, collective=collective, chunks=1)
        return self._remember(key, not _pays(best, algorithm))

    def note_known_raw(self, sticky_key: Any = None) -> None:
        """Record that the last call went raw because :meth:`known_raw` settled it.

        Called after the agreement, so on every rank alike: a call that went raw on a
        sticky decision (:meth:`sticky_raw`) uses one of its repetitions up.
        """
        self.last = _KNOWN_RAW
        left = self._sticky.get(sticky_key)
        if left is not None:
            if left <= 1:
                del self._sticky[sticky_key]
            else:
                self._sticky[sticky_key] = left - 1

    def sticky_raw(self, sticky_key: Any) -> bool:
        """Tell whether a recent model decision sends this call raw again (local, no change).

        A call that the model, with a sampled ratio, sent raw makes the next
        ``STICKY_CALLS`` calls with the same count, dtype, collective, algorithm and bound
        go raw without sampling the ratio or scanning the value range (a training job
        repeats its sizes every step, and a gradient's ratio drifts slowly); the call
        after them decides again. The state changes only after agreements (here
        :meth:`note_known_raw` and :meth:`note_decision`), so it is the same on every rank.
        """
        return self._sticky.get(sticky_key, 0) > 0

    def note_decision(self, sticky_key: Any) -> None:
        """After a model decision (every rank alike), make a "raw" sticky (:meth:`sticky_raw`)."""
        last = self.last
        if last is not None and not last.compress and last.prediction is not None:
            if len(self._sticky) >= _KNOWN_MAX:
                self._sticky.clear()
            self._sticky[sticky_key] = STICKY_CALLS

    def _remember(self, key: tuple[Any, ...], raw: bool) -> bool:
        if len(self._known) >= _KNOWN_MAX:  # a job that never repeats a size: start over
            self._known.clear()
        self._known[key] = raw
        return raw

    def decide_by_size(self, count: int, itemsize: int, *, collective: str = "allreduce",
                       algorithm: str = "homomorphic") -> AutoDecision:
        """Raw below the size at which an ideal compressor could pay, compressed above.

        Uses only the link calibration (collective on first use); ``chunk_elems`` 0 means
        the Communicator's own chunk size.
        """
        n = self.comm.Get_size()
        if n == 1 or count == 0:
            return self._done(AutoDecision(False, 0, "one rank or empty"))
        size = float(count * itemsize)
        if size < self._threshold((collective, algorithm), lambda: self.params(None)):
            return self._done(AutoDecision(False, 0, "too small to gain"))
        return self._done(AutoDecision(True, 0, "device data above the size threshold"))

    def _threshold(self, key: tuple[str, ...], params: Callable[[], Params]) -> float:
        """Smallest size at which compression could pay with an infinite ratio (cached).

        Both times are affine in the size for one chunk, so "compressed loses" holds
        exactly below one size; found by bisection on agreed numbers only.
        """
        t = self._thresholds.get(key)
        if t is not None:
            return t
        collective, algorithm = key[0], key[1]
        n = self.comm.Get_size()
        p = params()

        def wins(size: float) -> bool:
            best = model.predict(size, n, p, 1e30, collective=collective, chunks=1)
            return _pays(best, algorithm)

        lo, hi = 1.0, float(1 << 50)
        if not wins(hi):
            t = float("inf")
        else:
            for _ in range(100):
                mid = (lo + hi) / 2
                if wins(mid):
                    hi = mid
                else:
                    lo = mid
            t = hi
        self._thresholds[key] = t
        return t

    def _done(self, d: AutoDecision) -> AutoDecision:
        self.last = d
        return d


def _pays(pred: Prediction, algorithm: str) -> bool:
    """Whether compressing is predicted at least ``DECISION_MARGIN`` faster than raw.

    Every test of the decision (the size thresholds too) uses the same margin, so that a
    call the full decision would send raw is recognized as raw before any sampling.
    """
    t_comp = pred.homomorphic if algorithm == "homomorphic" else pred.dar
    return t_comp * (1 + DECISION_MARGIN) < pred.raw


def stream_bound(collective: str, algorithm: str, eb_abs: float, n_ranks: int) -> float:
    """Absolute bound of the streams one call compresses (what the ratio depends on)."""
    if collective in ("allreduce", "reduce_scatter"):
        if algorithm == "dar":
            from ccoll.collectives.dar import dar_bound

            return dar_bound(eb_abs, n_ranks)
        from ccoll.collectives.homomorphic import rank_bound

        return rank_bound(eb_abs, n_ranks)
    return eb_abs


def decide_call(d: Any) -> AutoDecision:
    """Decide one collective call (``d`` is a :class:`ccoll.collectives.policy.Decision`).

    Collective over the AutoPolicy's communicator; every rank calls it at the same point
    of the same call, after the agreement.
    """
    pol: AutoPolicy = d.auto
    if not isinstance(d.data, np.ndarray):
        # Device data: the CUDA compressor cannot be timed on a machine without a GPU, and a
        # host copy of samples would time the wrong backend. Decide by size alone: raw where
        # even an ideal compressor loses, compressed above (with the Communicator's chunks).
        return pol.decide_by_size(d.count, np.dtype(d.dtype).itemsize,
                                  collective=d.collective, algorithm=d.algorithm)
    x = d.data
    eb = stream_bound(d.collective, d.algorithm, d.eb_abs, d.n_ranks)
    # DAR's ratio is sampled at its own bound; the model takes the ratio at the
    # homomorphic per-rank bound and derives DAR's, so sample there for both.
    if d.algorithm == "dar" and d.collective in ("allreduce", "reduce_scatter"):
        eb = stream_bound(d.collective, "homomorphic", d.eb_abs, d.n_ranks)
    return pol.decide(x, eb, collective=d.collective, algorithm=d.algorithm, root=d.root)


def choose(count: int, itemsize: int, ranks: int, p: Params, ratio: float, width: float, *,
           collective: str = "allreduce", algorithm: str = "homomorphic",
           max_chunks: int = 64) -> AutoDecision:
    """Decide from agreed numbers: compressed iff the model predicts it faster.

    Pure arithmetic (the same on every rank for the same inputs); the chunk size is the
    model's best number of chunks per ring block.
    """
    size = float(count * itemsize)
    block_elems = max(1, -(-count // ranks))
    pred = model.predict(size, ranks, p, ratio, collective=collective, width=width,
                         max_chunks=max_chunks)
    t_comp = pred.homomorphic if algorithm == "homomorphic" else pred.dar
    if ranks > 1 and _pays(pred, algorithm):
        chunk = max(1, -(-block_elems // pred.chunks))
        return AutoDecision(True, chunk, f"predicted {pred.raw / t_comp:.2f}x faster compressed",
                            pred, ratio)
    return AutoDecision(False, block_elems, "predicted slower compressed", pred, ratio)


def describe(policy: AutoPolicy) -> dict[str, Any]:
    """Summarize the calibrations and the last decision (for logs and ``ccoll bench --json``)."""
    out: dict[str, Any] = {}
    if policy._link is not None:
        out["link"] = asdict(policy._link)
    out["compressor"] = {k: asdict(v) for k, v in policy._comp.items()}
    out["raw_efficiency"] = {f"{8 * item}-bit, {1 << (bits - 1)}+ elements": e
                             for (item, bits), e in sorted(policy._raw_eff.items())}
    if policy.last is not None:
        last = policy.last
        out["last"] = {"compress": last.compress, "chunk_elems": last.chunk_elems,
                       "reason": last.reason, "ratio": last.ratio}
        if last.prediction is not None:
            out["last"]["prediction"] = asdict(last.prediction)
    return out
