"""What the cost model implies for one call: its floor and the break-even points.

:func:`floor` is the least time a call can take on the calibrated hardware (``ccoll
bench``'s "floor" column); :func:`break_even_size` and :func:`break_even_bandwidth` are
where compression starts to pay (``ccoll model``). Pure arithmetic on
:mod:`ccoll.collectives.model`'s predictions (docs/model.md, "The floor", "Break-even").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from ccoll.collectives.model import COLLECTIVES, Params, predict, predict_raw_bcast
from ccoll.collectives.ratios import DEFAULT_WIDTH, ratio_at_finer_bound, ratio_of_sum

__all__ = ["Floor", "floor", "break_even_size", "break_even_bandwidth"]


def _bisect(f: Callable[[float], bool], lo: float, hi: float, steps: int = 80) -> float:
    """Boundary between ``f(lo) == False`` and ``f(hi) == True`` on a log scale."""
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if f(mid):
            hi = mid
        else:
            lo = mid
    return hi


def break_even_size(ranks: int, p: Params, ratio: float, *, ratio_sum: float | None = None,
                    width: float = DEFAULT_WIDTH, lo: float = 4.0,
                    hi: float = float(1 << 44)) -> float | None:
    """Smallest message (bytes) from which the homomorphic ring beats raw; ``None`` if never.

    Past the latency and overhead terms both times grow linearly in ``S``, so compression
    pays for all large enough messages exactly when its cost per byte is lower (see
    :func:`break_even_bandwidth`); the crossing is found by bisection.
    """

    def pays(s: float) -> bool:
        return predict(s, ranks, p, ratio, ratio_sum=ratio_sum, width=width).choice == "homomorphic"

    if not pays(hi):
        return None
    if pays(lo):
        return lo
    return _bisect(pays, lo, hi)


def break_even_bandwidth(size: float, ranks: int, p: Params, ratio: float, *,
                         ratio_sum: float | None = None,
                         width: float = DEFAULT_WIDTH) -> float | None:
    """Highest link bandwidth (bytes/s) at which compressing ``size`` bytes still pays.

    For large messages, one chunk, and the own block's decoding hidden under the allgather,
    the closed form (docs/model.md) is ``beta* = (N-1)/N (2 - 1/r - 1/r_sum) /
    (1/c + (N-1)/N (1/a + 1/d - 1/reduce))``; here it is found by bisection on the full
    model. ``None`` if it does not pay even on a
    1 bit/s link.
    """

    def pays_at(beta: float) -> bool:
        q = replace(p, beta=beta)
        return predict(size, ranks, q, ratio, ratio_sum=ratio_sum, width=width).choice == (
            "homomorphic"
        )

    lo, hi = 1.0 / 8, 1e15
    if not pays_at(lo):
        return None
    if pays_at(hi):
        return hi
    # pays_at is True at low bandwidth: bisect on the negation.
    return _bisect(lambda b: not pays_at(b), lo, hi)


@dataclass(frozen=True)
class Floor:
    """The least time one call can take on this hardware (``ccoll bench``'s "floor").

    ``compute``: the kernels one rank must run for the call, one after another (its compute
    critical path); ``wire``: the latencies and the bytes one rank must send, at the link's
    full bandwidth ``beta``. Neither can hide the other, so no schedule of the call beats
    ``seconds = max(compute, wire)``.
    """

    compute: float
    wire: float

    @property
    def seconds(self) -> float:
        """``max(compute, wire)``."""
        return max(self.compute, self.wire)


def floor(size: float, ranks: int, p: Params, ratio: float, *, algorithm: str = "raw",
          collective: str = "allreduce", ratio_sum: float | None = None,
          width: float = DEFAULT_WIDTH) -> Floor:
    """Return the floor of one call of ``algorithm`` ``"raw"``, ``"homomorphic"`` or ``"dar"``.

    Rates are the compressor's own (give ``p`` without the in-collective efficiency
    ``η``); no fixed costs, no chunking. Allreduce (docs/model.md, "The floor"):

    - raw: compute ``(N-1)/N · S/ρ``, wire ``2(N-1) α + 2(N-1)/N · S/β``;
    - homomorphic: compute ``S/c + (N-1)/N · S/a + S/d``, wire
      ``2(N-1) α + (N-1)/N · S/β · (1/r + 1/r_Σ)``;
    - DAR: compute ``S/(N c) + (N-1)/N · S (1/d + 1/ρ + 1/c) + S/d``, wire as the
      homomorphic ring's with DAR's ratios.

    The other collectives take the matching phases (reduce-scatter: the first half and
    one block's decoding; allgather: compress once, decode ``N`` streams, ``(N-1)`` streams
    received; bcast: compress and decode once, the bcast of the stream).
    """
    if algorithm not in ("raw", "homomorphic", "dar"):
        raise ValueError(f"algorithm must be raw, homomorphic or dar, got {algorithm!r}")
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    n = ranks
    if n <= 1:
        return Floor(0.0, 0.0)
    part = (n - 1) / n * size  # bytes of the other ranks' blocks
    raw = algorithm == "raw"
    if collective in ("allgather", "bcast"):
        if collective == "allgather":
            wire = (n - 1) * (p.alpha + size / (1.0 if raw else ratio) / p.beta)
            compute = 0.0 if raw else size / p.compress + n * size / p.decompress
        else:
            wire = predict_raw_bcast(size if raw else size / ratio, n, p)
            compute = 0.0 if raw else size / p.compress + size / p.decompress
        return Floor(compute, wire)
    if algorithm == "dar":
        r1 = ratio_of_sum(ratio_at_finer_bound(ratio, (2 * n - 1) / n, width),
                          max(1.0, n / 2), width)
        r2 = ratio_of_sum(ratio_at_finer_bound(ratio, (2 * n - 1) / n, width), n, width)
        rs_compute = size / n / p.compress + part * (1 / p.decompress + 1 / p.reduce
                                                     + 1 / p.compress)
    elif algorithm == "homomorphic":
        r1 = ratio
        r2 = ratio_of_sum(ratio, n, width) if ratio_sum is None else ratio_sum
        rs_compute = size / p.compress + part / p.add
    else:
        r1 = r2 = 1.0
        rs_compute = part / p.reduce
    rs_wire = (n - 1) * p.alpha + part / (r1 * p.beta)
    if collective == "reduce_scatter":
        return Floor(rs_compute + (0.0 if raw else size / n / p.decompress), rs_wire)
    ag_wire = (n - 1) * p.alpha + part / (r2 * p.beta)
    return Floor(rs_compute + (0.0 if raw else size / p.decompress), rs_wire + ag_wire)
