"""The measurements every plan starts from, taken once, when a Communicator is made.

A :class:`Calibration` holds the cost model's constants (:class:`ccoll.collectives.model.Params`)
for one Communicator: the link's latency, bandwidth and MPI's share of it, the compressor's
rates and the fixed costs of a compressed call. :func:`obtain` gets them, collectively, in
one defined place (the Communicator's creation), never inside a later call:

1. the settings (``CCOLL_ALPHA``, ``CCOLL_BANDWIDTH``, ``CCOLL_*_GBPS``, ...) where given;
2. else the calibration cache (:mod:`~ccoll.collectives.policy.cache`, written by an earlier
   probe or by ``ccoll tune``), which rank 0 reads and broadcasts;
3. else, for a ``policy="auto"`` Communicator (``probe=True``), a probe on the channel: ring
   steps for the link (:func:`~ccoll.collectives.policy.probes.probe_link`), the compressor
   timed on a synthetic gradient-like sample (:func:`synthetic_sample`; both stream formats,
   and format 2's ratio over format 1's on it, and the pass that finds a REL bound's range),
   and tiny compressed ring allreduces for the fixed costs; written to the cache;
4. else the model's defaults (:data:`ccoll.collectives.model.DEFAULTS`).

Steps 2 and 3 are ``policy="auto"``'s: a Communicator of a fixed policy plans its chunks
and split from the settings and the defaults alone, so that its results never depend on
what a cache file holds.

Every number is the same on every rank (maxima of times, minima of rates, or rank 0's
cache entry broadcast), and the settings that choose between these steps are checked across
ranks when the Communicator is made, so every rank makes the same collectives here. The
result is frozen: plans of later calls are arithmetic on it (docs/model.md, "Calibration").
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives import model
from ccoll.collectives.channel import Channel
from ccoll.collectives.model import Params
from ccoll.collectives.policy import cache
from ccoll.collectives.policy.fits import _best, calibrate_compressor
from ccoll.collectives.policy.probes import (
    LinkCalibration,
    allreduce,
    measure_ring_costs,
    probe_link,
)
from ccoll.settings import Settings

__all__ = ["Calibration", "obtain", "synthetic_sample", "DEFAULT"]

# Elements of the synthetic sample the compressor is timed on (8 MiB of float32: larger
# than most last-level caches, as the messages whose compressor time matters).
_SAMPLE_ELEMS = 1 << 21
# The bound of the timing, relative to the sample's range (the collectives' default).
_SAMPLE_REL = 1e-3


@dataclass(frozen=True)
class Calibration:
    """The cost model's constants of one Communicator, and where they came from.

    ``params``: the model's constants; ``link`` and ``compressor``: how each part was
    obtained (``"settings"``, ``"cache"``, ``"probe"``, ``"measured"``, ``"single rank"``
    or ``"defaults"``); ``seconds``: what obtaining them took on this rank;
    ``ratio``: a ratio that the settings force (``CCOLL_RATIO``), else ``None``;
    ``format2``: the model's constants with stream format 2's kernel rates and ``gain2``
    format 2's ratio over format 1's, measured with format 1's rates (probe or cache;
    ``None`` where only format 1 was measured: the settings, the defaults).
    """

    params: Params
    link: str
    compressor: str
    seconds: float = 0.0
    ratio: float | None = None
    format2: Params | None = None
    gain2: float | None = None

    @property
    def formats(self) -> Any:
        """What the plans know of format 2 (:class:`~ccoll.collectives.policy.plan.Formats`)."""
        from ccoll.collectives.policy.plan import Formats

        if self.format2 is None or self.gain2 is None:
            return None
        return Formats(self.format2, self.gain2)

    @property
    def digest(self) -> int:
        """A 52-bit fingerprint of the numbers (exact in float64), for the agreement."""
        f2 = [-1.0] * 3 if self.format2 is None else [self.format2.compress, self.format2.add,
                                                      self.format2.decompress]
        vals = [*asdict(self.params).values(), -1.0 if self.ratio is None else self.ratio,
                *f2, -1.0 if self.gain2 is None else self.gain2]
        raw = struct.pack(f"={len(vals)}d", *vals)
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 12

    def describe(self) -> dict[str, Any]:
        """Return the numbers and their sources (``ccoll bench --json``, ``ccoll tune``)."""
        f2 = None if self.format2 is None else {
            "compress": self.format2.compress, "add": self.format2.add,
            "decompress": self.format2.decompress, "gain": self.gain2}
        return {"params": asdict(self.params), "link": self.link,
                "compressor": self.compressor, "seconds": self.seconds, "ratio": self.ratio,
                "format2": f2}


DEFAULT = Calibration(model.DEFAULTS, "defaults", "defaults")


def synthetic_sample(n: int = _SAMPLE_ELEMS) -> np.ndarray:
    """Return a deterministic gradient-like float32 sample: heavy tails, many near zero.

    Laplace-distributed magnitudes whose scale varies over runs of 4096 values (layers of
    different sizes), a tenth of the values exactly zero: at REL 1e-3 most blocks quantize
    to small widths and a few to wide ones, as real gradients do. The compressor's rates
    depend on that mix, not on any one model's values.
    """
    rng = np.random.default_rng(20261204)
    runs = -(-n // 4096)
    scale = np.exp(rng.normal(0.0, 1.5, runs)).repeat(4096)[:n]
    x = (rng.laplace(0.0, 1.0, n) * scale).astype(np.float32)
    x[rng.random(n) < 0.1] = 0.0
    return x


def _ops(version: int = 1) -> tuple[Any, Any, Any]:
    from ccoll.collectives.codec import api

    mod = api()
    return partial(mod.compress_abs, version=version), mod.add, mod.decompress


def _gain2(x: np.ndarray, eb: float) -> float:
    """Format 2's compression ratio over format 1's on ``x`` at bound ``eb`` (local)."""
    from ccoll.collectives.codec import api

    a = api()
    return float(a.compress_abs(x, eb, version=1).nbytes
                 / a.compress_abs(x, eb, version=2).nbytes)


def _scan_rate(x: np.ndarray) -> float:
    """Bytes/s of the pass that finds a REL bound's range (the best of 3 on ``x``; local)."""
    from ccoll.collectives.inputs import value_range

    best, _ = _best(partial(value_range, x, None), 3)
    return x.nbytes / max(best, 1e-9)


def _link(ch: Channel, s: Settings, key: str | None, probe: bool,
          entry: dict[str, float] | None) -> tuple[LinkCalibration, str]:
    if ch.comm.Get_size() == 1:
        return LinkCalibration(0.0, 1e12, model.DEFAULTS.reduce, "single rank"), "single rank"
    if s.alpha is not None and s.bandwidth is not None:
        red = s.reduce_gbps * 1e9 if s.reduce_gbps is not None else model.DEFAULTS.reduce
        return LinkCalibration(s.alpha, s.bandwidth, red, "settings"), "settings"
    if entry is not None:
        cal = LinkCalibration(entry["alpha"], entry["beta"], entry["reduce"], "cache",
                              entry["raw_efficiency"])
        src = "cache"
    elif probe:
        cal = probe_link(ch)
        src = "probe"
        if s.calibration != "off" and key is not None:
            cache.write_link(ch, key, cal, s.cache_dir)
    else:
        d = model.DEFAULTS
        cal = LinkCalibration(d.alpha, d.beta, d.reduce, "defaults", d.raw_efficiency)
        src = "defaults"
    cal = replace(
        cal,
        alpha=cal.alpha if s.alpha is None else s.alpha,
        beta=cal.beta if s.bandwidth is None else s.bandwidth,
        reduce=cal.reduce if s.reduce_gbps is None else s.reduce_gbps * 1e9,
    )
    return cal, src


def _compressor(ch: Channel, s: Settings, key: str | None, probe: bool,
                entry: dict[str, float] | None) -> tuple[dict[str, float], str]:
    """Rates (bytes/s) and fixed costs (s) of the compressor, the same on every rank."""
    given = (s.compress_gbps, s.add_gbps, s.decompress_gbps)
    d = model.DEFAULTS
    if all(v is not None for v in given):
        return ({"compress": s.compress_gbps * 1e9, "add": s.add_gbps * 1e9,  # type: ignore[operator]
                 "decompress": s.decompress_gbps * 1e9,  # type: ignore[operator]
                 "chunk_overhead": d.chunk_overhead, "call_overhead": d.overhead,
                 "scan": d.scan},
                "settings")
    if entry is not None and "compress" in entry:
        comp = {k: entry[k] for k in ("compress", "add", "decompress", "chunk_overhead",
                                      "call_overhead", "compress2", "add2", "decompress2",
                                      "gain2", "scan")}
        src = "cache"
    elif probe and ch.comm.Get_size() > 1:
        x = synthetic_sample()
        lo, hi = float(x.min()), float(x.max())
        eb = _SAMPLE_REL * (hi - lo)
        m = calibrate_compressor(x, eb, _ops())
        # Format 2 at the same point: its rates, and its ratio over format 1's.
        m2 = calibrate_compressor(x, eb, _ops(2))
        gain = _gain2(x, eb)
        scan = _scan_rate(x)
        n = ch.comm.Get_size()
        call, chunk = measure_ring_costs(ch, x[: 1 << 16], eb / n)
        mine = np.array([m.compress, m.add, m.decompress, -max(chunk, m.chunk_overhead), -call,
                         m2.compress, m2.add, m2.decompress, gain, scan])
        agreed = allreduce(ch, mine, MPI.MIN, "compressor calibration")
        comp = {"compress": float(agreed[0]), "add": float(agreed[1]),
                "decompress": float(agreed[2]), "chunk_overhead": float(-agreed[3]),
                "call_overhead": float(-agreed[4]), "compress2": float(agreed[5]),
                "add2": float(agreed[6]), "decompress2": float(agreed[7]),
                "gain2": float(agreed[8]), "scan": float(agreed[9])}
        src = "measured"
        if s.calibration != "off" and key is not None:
            cache.write_compressor(ch, key, comp, s.cache_dir)
    else:
        comp = {"compress": d.compress, "add": d.add, "decompress": d.decompress,
                "chunk_overhead": d.chunk_overhead, "call_overhead": d.overhead,
                "scan": d.scan}
        src = "defaults"
    for name, v in zip(("compress", "add", "decompress"), given, strict=True):
        if v is not None:
            comp[name] = v * 1e9
    return comp, src


def obtain(ch: Channel, s: Settings, *, probe: bool) -> Calibration:
    """Return the Communicator's calibration (collective over ``ch``; the module's text).

    ``probe``: ``policy="auto"``: read the cache, and measure what neither the settings nor
    the cache give; otherwise the settings and the model's defaults. The same on every
    rank.
    """
    t0 = time.perf_counter()
    n = ch.comm.Get_size()
    key: str | None = None
    entry: dict[str, float] | None = None
    if n > 1 and probe and s.calibration != "off":
        key = cache.link_key(ch)
        if s.calibration == "cache":
            entry = cache.read_entry(ch, key, s.cache_dir)
    link, link_src = _link(ch, s, key, probe, entry)
    comp, comp_src = _compressor(ch, s, key, probe, entry)
    eff = 1.0 if s.efficiency is None else s.efficiency
    over = comp["call_overhead"] if s.overhead is None else s.overhead
    params = Params(
        alpha=link.alpha, beta=link.beta, compress=comp["compress"] * eff,
        add=comp["add"] * eff, decompress=comp["decompress"] * eff, reduce=link.reduce,
        overhead=max(over, 0.0) + link.alpha * max(1, (n - 1).bit_length()),
        chunk_overhead=comp["chunk_overhead"], raw_efficiency=link.raw_efficiency,
        scan=comp["scan"],
    )
    format2 = gain2 = None
    if comp.get("gain2", 0.0) > 0 and all(comp.get(k, 0.0) > 0
                                          for k in ("compress2", "add2", "decompress2")):
        format2 = replace(params, compress=comp["compress2"] * eff, add=comp["add2"] * eff,
                          decompress=comp["decompress2"] * eff)
        gain2 = comp["gain2"]
    return Calibration(params, link_src, comp_src, time.perf_counter() - t0, s.ratio,
                       format2, gain2)
