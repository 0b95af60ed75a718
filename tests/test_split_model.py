"""The split bound's pieces that need no MPI: the model's choice and the wide decoder."""

from __future__ import annotations

import numpy as np
import pytest

from ccoll.collectives import model, ratios
from ccoll.compressor import cpu


def test_split_fraction_splits_where_the_allgather_saves_more_than_the_ring_pays():
    # docs/model.md, "Split bound": with g = 1/2 a plain share s costs log2(1/(1-s)) bits in
    # the reduce-scatter and saves log2(N) - 1 - log2(1/(2s)) in the allgather; both
    # phases have N - 1 messages, so s = 1/2 is best among plain shares and pays from
    # N = 5 (a tie at N = 4). On an aligned grid (allgather grid k times the sum's, k odd)
    # the reduce-scatter keeps e1 = s eb N / k, which breaks the tie at 4 and pays at 3.
    for n in (1, 2):
        assert ratios.split_fraction(n) == 0.0
    assert ratios.split_fraction(3) == pytest.approx(0.6)  # k = 3: e1 = 0.6 eb
    for n in (4, 6, 8, 16, 64):
        assert ratios.split_fraction(n) == 0.5
        assert ratios.split_multiple(n, 0.5) == n - 1
        assert ratios.split_reduce_share(n, 0.5) == pytest.approx(n / (2 * (n - 1)))
    # Odd N: the shares k / (N + k - 1) are the aligned ones (5: k = 5, e1 = 5/9 eb).
    assert ratios.split_fraction(5) == pytest.approx(5 / 9)
    assert ratios.split_multiple(5, 5 / 9) == 5
    # Far out the requantized block's width reaches 0 bits (clamped): the reduce-scatter
    # then gets more of the bound.
    assert 0 < ratios.split_fraction(512) < 0.5
    # Plain shares: the tie at 4, and the order at 8 (neither 0.25 at 8 nor 0.5 at odd N
    # is an odd multiple of the sum's grid with a gain).
    assert ratios.split_multiple(8, 0.25) == 0 and ratios.split_multiple(5, 0.5) == 0
    assert ratios.split_bits(8, 0.5) < ratios.split_bits(8, 0.25) < ratios.split_bits(8, 0.0)
    # A plain share 1/2 at 4 ranks (e1 = eb/2: one bit more in each of the 3 reduce-scatter
    # messages, one less in each allgather one) ties with no split; aligned (e1 = 2/3 eb)
    # it pays log2(3/2) bits instead of 1 in each reduce-scatter message.
    tie4 = sum(1 + 3 + 0.5 * ratios.log2(k) + 1 for k in (1, 2, 3)) + 3 * (1 + 3 - 1 + 1)
    assert tie4 == pytest.approx(ratios.split_bits(4, 0.0))
    assert ratios.split_bits(4, 0.5) == pytest.approx(tie4 - 3 * ratios.log2(4 / 3))


def test_split_multiple_keeps_the_total_within_the_bound():
    # e1 + (k - 1) e1 / K <= eb: the sum's bound plus what rounding to the aligned grid
    # moves a value by; and the aligned share is used only where e1 beats 1 - f.
    for ranks in (2, 3, 4, 5, 7, 8, 16, 100, 512):
        for share in [j / 64 for j in range(1, 64)] + [0.999]:
            k = ratios.split_multiple(ranks, share)
            e1 = ratios.split_reduce_share(ranks, share)
            if not k:
                assert e1 == pytest.approx(1 - share)
                continue
            assert k >= 3 and k % 2 == 1
            assert e1 > 1 - share
            assert e1 * (1 + (k - 1) / ranks) <= 1 + 1e-9
            assert e1 == pytest.approx(share * ranks / k)  # the grid is k times the sum's


def test_split_bits_never_counts_a_negative_width():
    # A huge N would make the requantized width negative; it is clamped at 0 bits.
    assert ratios.split_bits(1 << 20, 0.5) > 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decompress_wide_gives_the_values_before_rounding(dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_t(3, 312 * 32) * 1e-2).astype(dtype)  # whole 32-blocks
    x[:40] = 0
    x[50], x[51], x[52] = np.nan, np.inf, 1e30  # raw blocks
    eb = 1e-4
    s = cpu.compress_abs(x, eb)
    s = cpu.add(s, cpu.compress_abs(x[::-1].copy(), eb))  # a sum: wider codes, raw sums
    wide = cpu.decompress_wide(s)
    assert wide.dtype == np.float64 and wide.shape == (x.size,)
    y = cpu.decompress(s)
    # decompress is exactly wide rounded once to the dtype, NaN and Inf included.
    assert np.array_equal(wide.astype(dtype), y, equal_nan=True)
    # Fixed-length lanes are integer multiples of the step, one float64 product each.
    # (Blocks with a raw lane in either input are raw sums: left out.)
    raw = ~np.isfinite(x) | (np.abs(x) > 1.0)
    fixed = ~np.repeat((raw | raw[::-1]).reshape(-1, 32).any(axis=1), 32)
    q = wide[fixed] / (2 * eb)
    assert fixed.sum() > 9000
    assert np.all(np.abs(q - np.round(q)) <= 1e-9)
    if dtype == np.float32:
        assert not np.array_equal(wide[fixed], y[fixed].astype(np.float64))  # not widened y


def test_split_time_counts_the_requantization():
    from dataclasses import replace

    p = replace(model.DEFAULTS, compress=1e9, decompress=2e9)
    size, n = 64e6, 4
    want = size / n * (4 / 2e9 + 1 / 1e9) + (n - 1) / n * size * 1 / 2e9
    assert model.split_time(size, n, p) == pytest.approx(want)
    assert model.split_time(size, 1, p) == 0.0


def test_split_pays_where_the_link_bounds_the_call():
    from dataclasses import replace

    def pays(gbit: float, n: int) -> bool:
        p = replace(model.DEFAULTS, beta=gbit * 1e9 / 8)
        return model.split_pays(64 << 20, n, p, 10.0, ratios.split_fraction(n))

    # The compressor at its CPU defaults: the few percent of bytes a split saves at 4 ranks
    # pay only on a very slow link; at 16 ranks it saves a quarter.
    assert not pays(10, 4) and not pays(1, 4) and pays(0.01, 4)
    assert not pays(10, 16) and pays(0.1, 16)
    for n in (4, 8, 16, 64):  # a slower link never makes it pay less
        got = [pays(g, n) for g in (100, 10, 1, 0.1, 0.01)]
        assert got == sorted(got), (n, got)
    assert not model.split_pays(64 << 20, 4, model.DEFAULTS, 10.0, 0.0)


def test_plans_take_the_split_only_where_it_pays():
    from dataclasses import replace

    from kit import first_plan

    from ccoll.collectives.policy.bounds import phase_bounds

    slow = replace(model.DEFAULTS, beta=0.01e9 / 8)
    fast = replace(model.DEFAULTS, beta=10e9 / 8)
    count = (64 << 20) // 4
    for policy in ("compress", "auto"):
        # A slow link: the split's bytes pay for its requantization.
        p = first_plan(count, 4, 4, slow, 10.0, policy=policy)
        assert p.compress and p.split == ratios.split_fraction(4) > 0
        assert phase_bounds(1e-3, 4, True, p.split).requant is not None
    # A fast link: no split, the whole bound goes to the sum.
    p = first_plan(count, 4, 4, fast, 10.0, policy="compress")
    assert p.compress and p.split == 0.0
    ring_eb, rq = phase_bounds(1e-3, 4, True, p.split)
    assert rq is None and ring_eb == 4e-3
    # A split the Communicator asks for is taken whatever the model says.
    p = first_plan(count, 4, 4, fast, 10.0, policy="compress", split=0.5)
    assert p.split == 0.5 and phase_bounds(1e-3, 4, True, p.split).requant is not None
