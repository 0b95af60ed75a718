"""``policy="auto"``: decide per call whether compressing pays, from measured costs.

:func:`ccoll.collectives.policy.decision._decide` hands ``"auto"`` calls to the call's
:class:`AutoPolicy` (one per channel), which feeds the cost model
(:mod:`ccoll.collectives.model`, docs/model.md) with constants measured on the channel and
on the data:

- link latency ``alpha`` and bandwidth ``beta``: a ring probe at first use on a channel
  (about 0.1-0.3 s, :mod:`~ccoll.collectives.policy.probes`), cached in
  ``~/.cache/ccoll/links.json`` under a key made of every rank's host name and network
  namespace, the size, and the MPI transport settings
  (:mod:`~ccoll.collectives.policy.cache`);
- compressor throughputs (compress, homomorphic add, decompress): timed per channel,
  backend, dtype and size class on the first message of the class that needs them (a
  64 MiB strided sample of larger ones), then scaled by the share of them that a real
  compressed allreduce of 4 Mi elements per rank reaches (fitted to the model;
  :mod:`~ccoll.collectives.policy.fits`); the ring's fixed and per-chunk costs: tiny
  compressed ring allreduces on the channel, timed once per channel;
- MPI_Allreduce's share of the link, measured per power of 2 of the message size;
- the compression ratio: per call, from compressing a strided sample of the message's
  32-element blocks (its cost is kept near 1% of the predicted raw time).

Every input of the decision is identical on all ranks before it is taken: the probe's times
are maxima over ranks (rank 0 reads and writes the cache and broadcasts), the compressor
throughputs are minima over ranks, and the ratio comes from sampled sizes summed over ranks,
all through buffer-based collectives that honour the channel's timeout; the decision itself
uses only ``frexp`` and IEEE ``+ - * /``, ``min``, ``max`` on those numbers
(:func:`ccoll.collectives.model.log2`), so every rank takes the same one. Messages too
small for compression to pay even with an infinitely fast compressor at an infinite ratio
are sent raw without any communication. A calibration that raises (or times out) marks the
channel failed, so that the Communicator refuses further calls instead of hanging.

What the calls then take is checked against the model: a size whose compressed calls
measured slower than raw goes raw, and is re-probed now and then
(:mod:`~ccoll.collectives.policy.feedback`, :attr:`AutoPolicy.feedback`); the times are
agreed over ranks in the agreement of a later call, so that too is the same on every rank.

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

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll import units
from ccoll.collectives import model
from ccoll.collectives.channel import Channel
from ccoll.collectives.dar import dar_bound
from ccoll.collectives.homomorphic import rank_bound
from ccoll.collectives.model import Params, Prediction
from ccoll.collectives.policy.cache import (
    link_key,
    read_link,
    remember_compressor,
    write_link,
)
from ccoll.collectives.policy.decision import Decision
from ccoll.collectives.policy.feedback import Feedback
from ccoll.collectives.policy.fits import (
    MAX_SAMPLE_BLOCKS,
    CompressorCalibration,
    Ops,
    calibrate_compressor,
    estimate_stream,
    measure_efficiency,
    sample_blocks,
    size_class,
)
from ccoll.collectives.policy.probes import (
    LinkCalibration,
    allreduce,
    measure_raw_efficiency,
    measure_ring_costs,
    probe_link,
)

__all__ = [
    "AutoDecision",
    "AutoPolicy",
    "link_calibration",
    "describe",
    "choose",
    "best_path",
    "decide_call",
    "stream_bound",
    "DECISION_MARGIN",
    "STICKY_CALLS",
]

# Compress only when the model predicts it at least this much faster: the fitted model
# was within about 10% of the measured compressed times on the bench, and a wrong
# "compress" near the break-even point costs more than a missed one (docs/model.md,
# "The decision").
DECISION_MARGIN = 0.15
# A lower bound of the fixed cost of a compressed call, used before the ring's own costs
# are measured (the size test that decides tiny messages without any communication).
PY_OVERHEAD = 150e-6
# Chunk of the ring that the efficiency fit times: the Communicator's default.
DEFAULT_CHUNK = 1 << 20
_SAMPLE_BUDGET = 0.01  # share of the predicted raw time that ratio sampling may take
_MIN_SAMPLE_BLOCKS = 32
_KNOWN_MAX = 4096  # known_raw answers kept per channel (a job uses a few sizes)
STICKY_CALLS = 16  # calls that repeat a model's "raw" without sampling (AutoPolicy.sticky_raw)
# The compute-efficiency fit (measure_efficiency) runs for size classes of at least this
# many elements (below, fixed costs dominate and the rates matter little).
_EFF_MIN = 1 << 20


@dataclass(frozen=True)
class AutoDecision:
    """What ``policy="auto"`` chose for one call, and why."""

    compress: bool
    chunk_elems: int  # elements per pipeline chunk (a whole ring block for one chunk)
    reason: str
    prediction: Prediction | None = None
    ratio: float | None = None
    # On a hierarchical grouping: the model predicted the two-level allreduce faster than
    # the flat ring (the prediction and the chunk are then the two-level ones).
    two_level: bool = False


_KNOWN_RAW = AutoDecision(False, 0, "raw whatever the data, from the calibrations already made")


def _env_float(name: str, parse: Callable[[str], float]) -> float | None:
    v = os.environ.get(name)
    if not v:
        return None
    try:
        return float(parse(v))
    except ValueError as e:
        raise ValueError(f"environment variable {name}={v!r}: {e}") from None


def link_calibration(ch: Channel) -> tuple[LinkCalibration, str | None]:
    """Link constants for the channel and their cache key (collective).

    Environment overrides first, else the cache, else a probe.
    """
    env_a = _env_float("CCOLL_ALPHA", units.parse_time)
    env_b = _env_float("CCOLL_BANDWIDTH", units.parse_rate)
    env_r = _env_float("CCOLL_REDUCE_GBPS", float)
    mode = os.environ.get("CCOLL_CALIBRATION", "").lower()
    if env_a is not None and env_b is not None:
        red = env_r * 1e9 if env_r is not None else model.DEFAULTS.reduce
        return LinkCalibration(env_a, env_b, red, "env"), None
    key = link_key(ch)
    cal = read_link(ch, key, use_cache=mode not in ("refresh", "off"))
    if cal is None:
        cal = probe_link(ch)
        if mode != "off":
            write_link(ch, key, cal)
    cal = replace(
        cal,
        alpha=cal.alpha if env_a is None else env_a,
        beta=cal.beta if env_b is None else env_b,
        reduce=cal.reduce if env_r is None else env_r * 1e9,
    )
    return cal, key


# ----------------------------------------------------------------------------- policy


class AutoPolicy:
    """Calibration and per-call decisions of ``policy="auto"`` for one channel.

    Every method that may communicate is collective and must be called by all ranks in the
    same order, which the collectives guarantee by calling :meth:`decide_call` after their
    agreement step (all ranks then hold the same policy, size, dtype and bound). Those
    methods wait for their peers at most the channel's timeout, and an exception in any of
    them (a timeout too) marks the channel failed (:meth:`Channel.fail`): peers may still
    be inside the calibration, so the channel's later calls must raise, not hang.

    ``chunk_elems``: the pipeline chunk with which the efficiency fit times the ring (the
    Communicator's default; a call that ``"auto"`` compresses uses the model's chunks).
    """

    def __init__(self, ch: Channel, *, backend: str = "cpu", ops: Ops | None = None,
                 chunk_elems: int = DEFAULT_CHUNK) -> None:
        self.ch = ch
        self.backend = backend
        self.chunk_elems = chunk_elems
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
        self._ratio: float | None = None  # the last sampled ratio (agreed), for model_chunk
        # What the calls measured, checked against the model (docs/model.md, "Measured
        # feedback"); the Communicator feeds it.
        self.feedback = Feedback(DECISION_MARGIN)
        # Collective calibrations made so far: a call during which this grew is not timed
        # for the feedback (its time is the calibration's). The same on every rank.
        self.calibrations = 0
        # (nodes, ranks per node) of a hierarchical Communicator's channel: its allreduce
        # is predicted in two levels (model.predict_hierarchical). None: flat.
        self.hier: tuple[int, int] | None = None

    @property
    def comm(self) -> MPI.Intracomm:
        """The channel's communicator."""
        return self.ch.comm

    @contextmanager
    def _collective(self) -> Iterator[None]:
        """Refuse a failed channel; mark the channel failed if the calibration raises."""
        self.ch.check_usable()
        try:
            yield
        except BaseException as exc:
            if self.ch.failed is None:
                self.ch.fail(f'the calibration of policy="auto" raised {type(exc).__name__}')
            raise

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
            with self._collective():
                self._link, self._key = link_calibration(self.ch)
            self.calibrations += 1
        return self._link

    def compressor(self, x: np.ndarray, eb: float) -> CompressorCalibration:
        """Compressor throughputs, agreed over ranks (collective on first use per dtype)."""
        key = f"{self.backend}/{x.dtype}/{size_class(x.size)}"
        cal = self._comp.get(key)
        if cal is not None:
            return cal
        with self._collective():
            cal = self._calibrate_compressor(x, eb)
        self.calibrations += 1
        self._comp[key] = cal
        remember_compressor(self.ch, self._key, asdict(cal))
        return cal

    def _calibrate_compressor(self, x: np.ndarray, eb: float) -> CompressorCalibration:
        env = {k: _env_float(f"CCOLL_{k.upper()}_GBPS", float)
               for k in ("compress", "add", "decompress")}
        given = [env[k] for k in ("compress", "add", "decompress")]
        if all(v is not None for v in given):
            mine = np.array([*(v * 1e9 for v in given if v is not None), -0.0, -PY_OVERHEAD])
            src = "env"
        else:
            m = calibrate_compressor(x, eb, self.ops())
            if self._ring is None:  # once per channel: it does not depend on the data
                n = self.ch.comm.Get_size()
                self._ring = measure_ring_costs(self.ch, sample_blocks(x, 8 * n), eb)
            call, chunk = self._ring
            mine = np.array([m.compress, m.add, m.decompress, -chunk, -call])
            for i, v in enumerate(given):
                if v is not None:
                    mine[i] = v * 1e9
            src = "measured"
        # The slowest rank sets the pace: minimum rates, maximum costs.
        agreed = allreduce(self.ch, mine, MPI.MIN, "compressor calibration")
        cal = CompressorCalibration(float(agreed[0]), float(agreed[1]), float(agreed[2]),
                                    float(-agreed[3]), src, float(-agreed[4]))
        e = _env_float("CCOLL_EFFICIENCY", float)
        if e is None and src == "measured" and x.size >= _EFF_MIN:
            e = measure_efficiency(self.ch, x, eb, self.params(cal), self.ops()[0],
                                   self.chunk_elems)
        if e is not None and e > 0:
            cal = replace(cal, compress=cal.compress * e, add=cal.add * e,
                          decompress=cal.decompress * e, efficiency=e)
        return cal

    def params(self, comp: CompressorCalibration | None = None) -> Params:
        """Model parameters from the calibrations (``comp=None``: an infinitely fast one).

        MPI's share of the link is the probe's; :meth:`call_params` gives it at a size.
        """
        link = self.link()
        n = self.ch.comm.Get_size()
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

    def _known_raw_efficiency(self, count: int, itemsize: int) -> float | None:
        """MPI's share of the link at this size if known without communication, else None."""
        if _env_float("CCOLL_BANDWIDTH", units.parse_rate) is not None:
            return self.link().raw_efficiency  # a given link speed is taken as it is
        return self._raw_eff.get((itemsize, count.bit_length()))

    def raw_efficiency(self, x: np.ndarray) -> float:
        """MPI's share of the link at ``x``'s size (collective on first use per power of 2)."""
        r = self._known_raw_efficiency(x.size, x.itemsize)
        if r is None:
            with self._collective():
                r = measure_raw_efficiency(self.ch, x, self.params(None))
            self.calibrations += 1
            self._raw_eff[(x.itemsize, x.size.bit_length())] = r
        return r

    def call_params(self, count: int, itemsize: int, collective: str,
                    comp: CompressorCalibration) -> Params | None:
        """Model parameters of one call: what :meth:`decide` and :meth:`known_raw` both use.

        Local. MPI's share of the link is the one measured at the call's size (for
        ``bcast`` the probe's); ``None`` while that is not measured yet
        (:meth:`raw_efficiency` measures it). One function for both, so that a size that
        :meth:`decide` compresses is never settled as raw by :meth:`known_raw`.
        """
        p = self.params(comp)
        if collective == "bcast":
            return p
        r = self._known_raw_efficiency(count, itemsize)
        return None if r is None else replace(p, raw_efficiency=r)

    def params_for(self, x: np.ndarray, comp: CompressorCalibration,
                   collective: str = "allreduce") -> Params:
        """Return :meth:`call_params` for ``x``, measuring MPI's share of the link if needed.

        Collective on first use per power of 2 (:meth:`raw_efficiency`).
        """
        if collective != "bcast":
            self.raw_efficiency(x)
        p = self.call_params(x.size, x.itemsize, collective, comp)
        assert p is not None  # measured just above
        return p

    # -- decision ---------------------------------------------------------------------

    def decide_call(self, d: Decision) -> AutoDecision:
        """Decide one collective call after its agreement (collective; see :func:`decide_call`)."""
        return decide_call(d)

    def decide(self, x: np.ndarray, eb: float, *, collective: str = "allreduce",
               algorithm: str = "homomorphic", max_chunks: int = 64,
               root: int | None = None) -> AutoDecision:
        """Raw or compressed for one call on ``x`` whose streams use absolute bound ``eb``.

        Collective (all ranks, same ``x.size``, dtype and ``eb``). ``eb`` is the bound each
        rank's streams are quantized with (for a sum, the collective's share of the user's
        bound). For ``bcast`` only ``root``'s data is sampled.
        """
        with self._collective():
            return self._decide(x, eb, collective, algorithm, max_chunks, root)

    def _decide(self, x: np.ndarray, eb: float, collective: str, algorithm: str,
                max_chunks: int, root: int | None) -> AutoDecision:
        n = self.ch.comm.Get_size()
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
        p = self.params_for(x, comp, collective)
        if self._loses(size, p, collective, algorithm):
            return self._done(AutoDecision(False, block_elems, "compressor slower than the link"))
        # 2. Ratio from a strided sample of blocks, summed over ranks.
        forced = _env_float("CCOLL_RATIO", float)
        if forced is not None:
            ratio, width = forced, model.DEFAULT_WIDTH
        else:
            t_raw = best_path(size, n, p, 1.0, collective=collective, algorithm=algorithm,
                              hier=self.hier, chunks=1)[0].raw
            budget_bytes = _SAMPLE_BUDGET * t_raw * p.compress
            nsample = int(min(MAX_SAMPLE_BLOCKS, max(_MIN_SAMPLE_BLOCKS, budget_bytes // 128)))
            mine = np.zeros(4, np.float64)
            if root is None or self.ch.comm.Get_rank() == root:
                mine[:3] = estimate_stream(x, eb, nsample, self.ops()[0])
                mine[3] = 1.0
            tot = allreduce(self.ch, mine, MPI.SUM, "ratio sampling")
            ratio = float(tot[3]) * size / max(float(tot[0]), 1.0)
            width = float(tot[2]) / float(tot[1]) if tot[1] > 0 else 1.0
        return self._done(choose(x.size, x.itemsize, n, p, ratio, width, collective=collective,
                                 algorithm=algorithm, max_chunks=max_chunks, hier=self.hier))

    def _loses(self, size: float, p: Params, collective: str, algorithm: str) -> bool:
        """Whether compressing loses even at an infinite ratio (decide and known_raw)."""
        best = best_path(size, self.ch.comm.Get_size(), p, 1e30, collective=collective,
                         algorithm=algorithm, hier=self.hier, chunks=1)[0]
        return not _pays(best, algorithm)

    def known_raw(self, count: int, dtype: Any, *, collective: str = "allreduce",
                  algorithm: str = "homomorphic") -> bool:
        """Tell whether this call goes raw whatever the data, from calibrations already made.

        Local and free (no communication, no calibration): the collectives ask it before
        computing the value range that a ``REL`` bound needs, which a raw call does not,
        and which costs about 5% of a large raw allreduce; a call it settles goes raw
        without asking :meth:`decide`. It answers True only where :meth:`decide` would
        send the call raw before sampling, from the same numbers (:meth:`call_params`).
        Same answer on every rank that passes the same count and dtype (calibrations are
        agreed); a rank that passes another count fails the agreement anyway. Answers that
        the calibrations settle are remembered per (count, dtype, collective, algorithm):
        a raw call then costs one dict lookup here instead of a model prediction (~20 us).
        """
        key = (count, dtype, collective, algorithm)
        known = self._known.get(key)
        if known is not None:
            return known
        n = self.ch.comm.Get_size()
        if n == 1 or count == 0:
            return True
        if self._link is None:
            return False  # not calibrated yet: the answer may change
        itemsize = np.dtype(dtype).itemsize
        size = float(count * itemsize)
        t = self._thresholds.get((collective, algorithm))
        if t is not None and size < t:
            return self._remember(key, True)
        comp = self._comp.get(f"{self.backend}/{np.dtype(dtype)}/{size_class(count)}")
        if comp is None:
            return False
        p = self.call_params(count, itemsize, collective, comp)
        if p is None:
            return False  # MPI's share of the link at this size is not measured yet
        return self._remember(key, self._loses(size, p, collective, algorithm))

    def note_known_raw(self, sticky_key: Any = None) -> None:
        """Record that the last call went raw because :meth:`known_raw` settled it.

        Called after the agreement, so on every rank alike: a call that went raw on a
        sticky decision (:meth:`sticky_raw`) uses one of its repetitions up.
        """
        self.last = _KNOWN_RAW
        self.use_sticky(sticky_key)

    def use_sticky(self, sticky_key: Any) -> None:
        """Count one call against a sticky raw decision (:meth:`sticky_raw`), if any."""
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
        n = self.ch.comm.Get_size()
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
        n = self.ch.comm.Get_size()
        p = params()

        def wins(size: float) -> bool:
            best = best_path(size, n, p, 1e30, collective=collective, algorithm=algorithm,
                             hier=self.hier, chunks=1)[0]
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

    def model_chunk(self, count: int, dtype: Any, ranks: int) -> int:
        """Pipeline chunk (elements) for a compressed call that the model did not decide.

        Local, no communication and no calibration: :func:`model.chunk_elems_for` with the
        calibrations this channel already made (agreed, so the same on every rank; the
        defaults where none was made) and the ratio last sampled here (else the default).
        """
        dt = np.dtype(dtype)
        p, ratio = self.model_params(count, dt)
        return model.chunk_elems_for(count, dt.itemsize, ranks, p, ratio)

    def model_params(self, count: int, dtype: Any) -> tuple[model.Params, float]:
        """Return the model's constants and one rank's ratio for ``count`` ``dtype`` elements.

        Local: the calibrations this channel already made (agreed, the same on every rank;
        the defaults where none was made) and the ratio last sampled here (else the
        default).
        """
        dt = np.dtype(dtype)
        p = model.DEFAULTS
        link = self._link
        if link is not None:
            p = replace(p, alpha=link.alpha, beta=link.beta, reduce=link.reduce)
            comp = self._comp.get(f"{self.backend}/{dt}/{size_class(count)}")
            if comp is not None:
                p = replace(p, compress=comp.compress, add=comp.add,
                            decompress=comp.decompress, chunk_overhead=comp.chunk_overhead)
        ratio = self._ratio if self._ratio is not None else model.DEFAULT_RATIO
        return p, ratio

    def _done(self, d: AutoDecision) -> AutoDecision:
        self.last = d
        if d.ratio is not None and d.ratio > 0:
            self._ratio = d.ratio
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
            return dar_bound(eb_abs, n_ranks)
        return rank_bound(eb_abs, n_ranks)
    return eb_abs


def decide_call(d: Decision) -> AutoDecision:
    """Decide one collective call, ``d.auto`` being its channel's :class:`AutoPolicy`.

    Collective over the AutoPolicy's channel; every rank calls it at the same point
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
           max_chunks: int = 64, hier: tuple[int, int] | None = None) -> AutoDecision:
    """Decide from agreed numbers: compressed iff the model predicts it faster.

    Pure arithmetic (the same on every rank for the same inputs); the chunk size is the
    model's best number of chunks per ring block. ``hier`` (nodes, ranks per node): a
    two-level allreduce, whose ring blocks are ``count / (nodes * ranks per node)``
    elements of one local rank's share, on the node's link shared by its rings.
    """
    size = float(count * itemsize)
    block_elems = max(1, -(-count // ranks))
    pred, two = best_path(size, ranks, p, ratio, collective=collective, algorithm=algorithm,
                          hier=hier, width=width, max_chunks=max_chunks)
    if two and hier is not None:
        share = -(-count // hier[1])  # one local rank's share, split over the nodes' ring
        block_elems = max(1, -(-share // hier[0]))
    t_comp = pred.homomorphic if algorithm == "homomorphic" else pred.dar
    if ranks > 1 and _pays(pred, algorithm):
        chunk = max(1, -(-block_elems // pred.chunks))
        how = " in two levels" if two else ""
        return AutoDecision(True, chunk, f"predicted {pred.raw / t_comp:.2f}x faster "
                            f"compressed{how}", pred, ratio, two)
    return AutoDecision(False, block_elems, "predicted slower compressed", pred, ratio, two)


def best_path(size: float, ranks: int, p: Params, ratio: float, *, collective: str,
              algorithm: str, hier: tuple[int, int] | None,
              **kw: Any) -> tuple[Prediction, bool]:
    """Return the prediction of the faster compressed path and whether it has two levels.

    ``hier`` (nodes, ranks per node) where a two-level allreduce applies: the flat ring's
    and the two-level prediction, whichever compresses faster; else the flat prediction.
    The raw time is the flat one either way: what a raw call runs is ``MPI_Allreduce``
    over all ranks (on the emulated 2 x 2 cluster it took 184-205 ms where the two-level
    raw model said 85 ms, and the feedback then measured compressed calls against that).
    Pure arithmetic on agreed numbers.
    """
    flat = model.predict(size, ranks, p, ratio, collective=collective, **kw)
    if hier is None or not model.hierarchical_applies(hier, collective):
        return flat, False
    two = replace(model.predict(size, ranks, p, ratio, collective=collective, hier=hier, **kw),
                  raw=flat.raw)
    if algorithm == "homomorphic":
        return (two, True) if two.homomorphic <= flat.homomorphic else (flat, False)
    return (two, True) if two.dar <= flat.dar else (flat, False)


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
    fb = policy.feedback.describe()
    if fb:
        out["feedback"] = fb
    return out
