"""How compression ratios change with sums, finer bounds and the split bound.

Pure arithmetic on agreed numbers, the same bits on every rank (:func:`log2` uses no
libm): the cost model (:mod:`ccoll.collectives.model`) prices messages with it and the plan
(:mod:`ccoll.collectives.policy.plan`) chooses the split bound with it. docs/model.md
derives every formula ("Ratio of a sum", "Split bound").
"""

from __future__ import annotations

import functools
import math

__all__ = [
    "SUM_GROWTH",
    "DEFAULT_WIDTH",
    "SPLIT_CANDIDATES",
    "log2",
    "ratio_of_sum",
    "ratio_at_finer_bound",
    "split_multiple",
    "split_reduce_share",
    "split_bits",
    "split_ratios",
    "split_fraction",
]

# Code widths of a sum of k streams grow by about SUM_GROWTH * log2(k) bits.
SUM_GROWTH = 0.5
# Mean code width (bits) of the non-zero blocks of a MiniLM gradient at REL 1e-3 / N.
DEFAULT_WIDTH = 3.0


def log2(x: float) -> float:
    """``log2(x)`` for ``x > 0`` from ``frexp`` and ``+ - * /`` only.

    The result is the same bit pattern on every IEEE-754 host (a libm's ``log2`` may differ
    in the last bit between versions), so decisions computed from it agree across ranks.
    """
    if not x > 0:
        raise ValueError(f"log2 needs x > 0, got {x!r}")
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= m < 1: exact
    m, e = m * 2.0, e - 1  # 1 <= m < 2, so a power of two gives z = 0 and an exact result
    z = (m - 1.0) / (m + 1.0)  # ln m = 2 atanh z, 0 <= z < 1/3
    z2 = z * z
    term, acc = z, 0.0
    for i in range(14):
        acc += term / (2 * i + 1)
        term *= z2
    return e + 2.0 * acc / 0.6931471805599453


def ratio_of_sum(ratio: float, terms: float, width: float = DEFAULT_WIDTH,
                 growth: float = SUM_GROWTH) -> float:
    """Compression ratio of the sum of ``terms`` streams that each have ratio ``ratio``.

    Summing ``k`` streams widens each non-zero block's codes by about ``growth * log2(k)``
    bits (``growth`` 1 for identical data, 1/2 for independent data of one scale; 1/2 fits
    MiniLM gradients of different steps within 2%, docs/model.md) while zero blocks stay
    zero; a fixed-length block costs ``1 + width`` words, so the payload grows by the factor
    ``(1 + w + growth * log2 k) / (1 + w)``. ``width`` is the mean code width of the
    non-zero blocks of one stream.
    """
    if terms <= 1:
        return ratio
    return ratio * (1.0 + width) / (1.0 + width + growth * log2(terms))


def ratio_at_finer_bound(ratio: float, factor: float, width: float = DEFAULT_WIDTH) -> float:
    """Ratio after dividing the bound by ``factor`` (> 1): codes widen by ``log2(factor)`` bits."""
    if factor <= 1:
        return ratio
    return ratio * (1.0 + width) / (1.0 + width + log2(factor))


# Shares of the bound the split may give the allgather phase (0: no requantization); the
# model also tries the shares where the aligned grid gains most (:func:`split_fraction`).
SPLIT_CANDIDATES = tuple(j / 16 for j in range(16))

# A share counts as reaching an odd multiple this close below it (its float64 quotient
# may land an ulp or two above an integer); the owner's check keeps the bound regardless.
_MULTIPLE_SLACK = 1e-9


def split_multiple(ranks: int, share: float) -> int:
    """Odd multiple ``k`` of the reduced sum's grid that the allgather's grid is; 0: none.

    The reduce-scatter's sum of ``K = ranks`` streams, each on a grid ``2 e1 / K`` (in
    units of the result: the average's grid for ``avg``), lies on that grid too. The
    allgather's grid is ``2 f eb`` (``f = share``). When it is ``k`` times the sum's grid
    for an odd ``k``, rounding a value of the sum's grid to it moves it by at most
    ``(k - 1) / 2`` of the sum's steps, ``(k - 1) e1 / K``, not ``f eb``; so ``e1 = f eb K / k``
    keeps the total within ``eb`` whenever ``k >= f (K - 1) / (1 - f)``. ``k`` is the least
    odd number (at least 3) with that property, used where it gives a larger ``e1`` than the
    plain ``(1 - f) eb``; 0 otherwise (docs/error-bound.md, "Split bound"). A pure function
    of agreed numbers: the same on every rank.
    """
    if ranks < 2 or not 0.0 < share < 1.0:
        return 0
    need = share * (ranks - 1) / (1.0 - share)
    k = max(3, math.ceil(need - _MULTIPLE_SLACK))
    k += 1 - k % 2
    reduce_share = share * ranks / k
    if reduce_share <= 1.0 - share or reduce_share < 2.0**-20:
        return 0
    return k


def split_reduce_share(ranks: int, share: float) -> float:
    """``e1 / eb`` of a split with allgather share ``share`` among ``ranks`` streams.

    ``share * K / k`` with ``k`` from :func:`split_multiple`, else ``1 - share`` (1 without
    a split).
    """
    if share <= 0.0:
        return 1.0
    k = split_multiple(ranks, share)
    return share * ranks / k if k else 1.0 - share


def _split_words(ranks: int, share: float, width: float,
                 growth: float) -> tuple[float, float]:
    """Words per non-zero block of the reduce-scatter's and the allgather's messages (sums)."""
    n = ranks
    finer = -log2(split_reduce_share(n, share))
    rs = sum(1.0 + width + growth * log2(k) + finer for k in range(1, n))
    if share <= 0:
        ag = (n - 1) * (1.0 + width + growth * log2(n))
    else:
        ag = (n - 1) * (1.0 + max(0.0, width + (growth - 1.0) * log2(n) - log2(share)))
    return rs, ag


def split_bits(ranks: int, share: float, width: float = DEFAULT_WIDTH,
               growth: float = SUM_GROWTH) -> float:
    """Words per non-zero block over the ring's messages of one chunk, given ``share``.

    Without a split (``share`` 0) the reduce-scatter sends partial sums of ``k = 1 .. N-1``
    streams (``1 + w + g log2 k`` words a block) and the allgather forwards the full sum
    ``N - 1`` times (``1 + w + g log2 N``). With ``share = e2 / eb`` the reduce-scatter's
    grid is ``e1 / eb`` times finer (``log2(eb / e1)`` more bits; ``e1`` by
    :func:`split_reduce_share`: ``1 - share``, or more on an aligned grid) and the allgather
    forwards the reduced block requantized at ``e2``: a value about ``N^g`` times one rank's
    on a grid ``N * share`` times coarser than one rank's (``eb / N`` for a sum; for an
    average both are ``N`` times smaller), so ``w + (g - 1) log2 N + log2(1 / share)`` bits,
    never below 0 (docs/model.md, "Split bound").
    """
    if ranks < 2:
        return 0.0
    rs, ag = _split_words(ranks, share, width, growth)
    return rs + ag


def split_ratios(ratio: float, ranks: int, share: float, width: float = DEFAULT_WIDTH,
                 growth: float = SUM_GROWTH) -> tuple[float, float]:
    """Mean ratios of the reduce-scatter's and the allgather's messages, by :func:`split_bits`.

    ``ratio`` is one rank's fresh stream (a block of ``1 + width`` words); the phases' words
    are those :func:`split_bits` counts, so the reduce-scatter's partial sums and the
    (requantized) allgather blocks are priced as the split makes them. Pass them to
    :func:`predict_homomorphic` as ``ratio`` and ``ratio_sum``.
    """
    if ranks < 2:
        return ratio, ratio
    rs, ag = _split_words(ranks, share, width, growth)
    m = ranks - 1
    return ratio * (1.0 + width) * m / rs, ratio * (1.0 + width) * m / ag


def split_fraction(ranks: int, width: float = DEFAULT_WIDTH) -> float:
    """Share of the bound the allgather phase gets (``e2 = share * eb``); 0: no split.

    The candidate with the fewest words by :func:`split_bits` (the first of equals, so no
    split where it gains nothing), among :data:`SPLIT_CANDIDATES` and the shares
    ``k / (K + k - 1)`` for odd ``k`` from 3 to ``2K + 1``, where the allgather's grid is
    exactly ``k`` times the reduced sum's with the largest ``e1`` (:func:`split_multiple`).
    A pure function of agreed numbers computed with :func:`log2`: the same on every rank.
    """
    return _split_fraction(int(ranks), float(width))


@functools.lru_cache(maxsize=256)
def _split_fraction(ranks: int, width: float) -> float:
    aligned = (k / (ranks + k - 1) for k in range(3, 2 * ranks + 2, 2))
    candidates = sorted({*SPLIT_CANDIDATES[1:], *aligned})
    best, best_bits = 0.0, split_bits(ranks, 0.0, width)
    for share in candidates:
        bits = split_bits(ranks, share, width)
        if bits < best_bits * (1 - 1e-9):
            best, best_bits = share, bits
    return best
