"""The owner's requantization of a split allreduce on an aligned grid (no MPI traffic).

Where the allgather's grid is an odd multiple ``k`` of the reduced sum's
(``ratios.split_multiple``), rounding a reduced value to it moves it by at most
``(k - 1) / 2`` of the sum's steps, which is what lets the reduce-scatter keep the larger
bound ``e1 = f eb K / k``. The owner checks that on every element and stores a block raw
where a value is off the sum's grid (a raw lane). Checked exactly here: the allowance on
every element, the total against the exact sum, and which blocks the owner stores raw
(docs/error-bound.md, "Split bound").
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from kit import assert_within

from ccoll.collectives import ratios
from ccoll.collectives.codec import api, stream_nbytes
from ccoll.collectives.homomorphic import rank_bound, sum_bound
from ccoll.collectives.requant import Requant, requant_one
from ccoll.compressor.cpu import decompress_wide

N_ELEMS = 4099
EB = 1e-3


def _setup(ranks: int, share: float, avg: bool) -> tuple[float, Requant]:
    """The ring's bound of the sum and the Requant, as ``Communicator.ring_bounds`` makes them."""
    k = ratios.split_multiple(ranks, share)
    assert k >= 3 and k % 2 == 1
    e1 = EB * ratios.split_reduce_share(ranks, share)
    assert e1 > EB * (1 - share)  # the aligned grid leaves the reduce-scatter more
    ring_eb = sum_bound(e1, ranks, avg)
    divide = ranks if avg else 1
    return ring_eb, Requant(k * rank_bound(ring_eb, ranks) / divide, divide, EB - e1, share)


def _reduce(xs: list[np.ndarray], ring_eb: float) -> np.ndarray:
    """The fully reduced stream of ``xs`` as the ring builds it (homomorphic adds)."""
    a, eb_r = api(), rank_bound(ring_eb, len(xs))
    s = a.compress_abs(xs[0], eb_r)
    for x in xs[1:]:
        s = a.add_data(s, x, eb_r)
    return s


def _inputs(ranks: int) -> list[np.ndarray]:
    rng = np.random.default_rng(ranks)
    return [(rng.standard_normal(N_ELEMS) * 0.02).astype(np.float32) for _ in range(ranks)]


def _exact(xs: list[np.ndarray], divide: int) -> list[Fraction]:
    return [sum((Fraction(float(x[i])) for x in xs), Fraction(0)) / divide
            for i in range(N_ELEMS)]


@pytest.mark.parametrize("avg", [True, False], ids=["avg", "sum"])
@pytest.mark.parametrize(("ranks", "share"), [(3, 0.6), (4, 0.5), (5, 5 / 9), (8, 0.5)])
def test_aligned_requantization_moves_values_less(ranks, share, avg):
    ring_eb, rq = _setup(ranks, share, avg)
    xs = _inputs(ranks)
    s = _reduce(xs, ring_eb)
    v = decompress_wide(s[:stream_nbytes(s)]) / rq.divide
    out = np.empty(N_ELEMS, np.float64)
    got = requant_one(s, out, 0, N_ELEMS, rq)
    assert api().header(got).bound == rq.bound  # on the sum's grid: no fallback
    w = decompress_wide(got[:stream_nbytes(got)])
    assert np.array_equal(out, w)
    k = ratios.split_multiple(ranks, share)
    step = 2 * rank_bound(ring_eb, ranks) / rq.divide  # the sum's grid, in the result's units
    assert_within(w, v, Fraction(step) * (k - 1) / 2 * (1 + Fraction(1, 2**30)))
    assert_within(w, v, rq.accept, strict=True)
    # Rounding to that grid could move a value by up to e2, beyond the allowance: only the
    # alignment keeps these within it (off the grid it does not: the raw-lane test below).
    assert rq.bound > rq.accept
    # And the total, against the exact sum (or average) of the inputs, in rationals.
    for i, exact in enumerate(_exact(xs, rq.divide)):
        assert abs(Fraction(float(w[i])) - exact) < Fraction(EB), i


def _off_grid(avg: bool) -> tuple[Requant, np.ndarray, np.ndarray]:
    """4 ranks, share 0.5: the reduced stream with one value too large for 31-bit codes on
    the ring's grid (input 1, element 100), and its float64 values over ``rq.divide``."""
    ranks = 4
    ring_eb, rq = _setup(ranks, 0.5, avg)
    xs = _inputs(ranks)
    xs[1][100] = np.float32(3 * 2**31 * rank_bound(ring_eb, ranks))
    s = _reduce(xs, ring_eb)
    return rq, s, decompress_wide(s[:stream_nbytes(s)]) / rq.divide


@pytest.mark.parametrize("avg", [True, False], ids=["avg", "sum"])
def test_off_grid_values_fall_back_to_the_allowance(avg):
    # A value too large for 31-bit codes on the ring's grid (not on the k = 3 times coarser
    # one) makes its block of one input raw, so the reduced lane holds float64 sums off the
    # grid; rounding those to the coarse grid would move some beyond the allowance, so the
    # owner stores that block raw (and only that one).
    rq, s, v = _off_grid(avg)
    plain = api().compress_abs(v, rq.bound)
    moved = np.abs(decompress_wide(plain[:stream_nbytes(plain)]) - v)
    assert moved.max() >= rq.accept  # the coarse grid alone would break the allowance
    out = np.empty(N_ELEMS, np.float64)
    got = requant_one(s, out, 0, N_ELEMS, rq)
    assert api().header(got).bound == rq.bound  # same header: the owners' streams still join
    w = decompress_wide(got[:stream_nbytes(got)])
    assert_within(w, v, rq.accept, strict=True)
    far = np.unique(np.flatnonzero(moved >= rq.accept) // 32)
    assert far.size and np.array_equal(far, [100 // 32])  # only the raw lane's block
    raw = np.arange(N_ELEMS) // 32 == far[0]
    assert np.array_equal(w[raw], v[raw])  # stored raw: the reduced values bit for bit
    assert np.array_equal(w[~raw], decompress_wide(plain[:stream_nbytes(plain)])[~raw])


@pytest.mark.parametrize("avg", [False, True])
def test_off_grid_blocks_stay_in_format_2(avg):
    # The same off-grid block with the reduced sum in format 2: the requantized stream
    # stores it raw in format 2 too (every message of a format-2 call is format 2), and
    # decodes to format 1's values bit for bit (both code the same quantized values).
    rq, s1, v = _off_grid(avg)
    out1, out2 = np.empty(N_ELEMS, np.float64), np.empty(N_ELEMS, np.float64)
    got1 = requant_one(s1, out1, 0, N_ELEMS, rq, 1)
    got2 = requant_one(s1, out2, 0, N_ELEMS, rq, 2)
    h2 = api().header(got2)
    assert h2.version == 2 and h2.bound == rq.bound
    w1 = decompress_wide(got1[:stream_nbytes(got1)])
    w2 = decompress_wide(got2[:stream_nbytes(got2)])
    assert np.array_equal(w1.view(np.uint64), w2.view(np.uint64))
    assert np.array_equal(out1.view(np.uint64), out2.view(np.uint64))
    raw = np.arange(N_ELEMS) // 32 == 100 // 32
    assert np.array_equal(w2[raw], v[raw])  # the off-grid block: raw, bit for bit


def test_non_finite_values_pass_the_check_bit_for_bit():
    ranks, share = 4, 0.5
    ring_eb, rq = _setup(ranks, share, True)
    xs = _inputs(ranks)
    xs[0][7], xs[2][2000] = np.nan, np.inf
    s = _reduce(xs, ring_eb)
    v = decompress_wide(s[:stream_nbytes(s)]) / rq.divide
    out = np.empty(N_ELEMS, np.float64)
    got = requant_one(s, out, 0, N_ELEMS, rq)
    w = decompress_wide(got[:stream_nbytes(got)])
    assert np.isnan(w[7]) and w[2000] == np.inf
    assert_within(w, v, rq.accept, strict=True)


WARM_PROG = r"""
import importlib, json, pkgutil, sys
import numpy as np
from ccoll import warmup
for d in warmup.DTYPES:  # what `python -m ccoll.warmup` runs
    warmup.warm(d)
import ccoll.compressor.cpu as cpu
kernels = {}
for m in pkgutil.iter_modules(cpu.__path__, "ccoll.compressor.cpu."):
    if "v2" in m.name:
        continue
    mod = importlib.import_module(m.name)
    for k, v in vars(mod).items():
        if hasattr(v, "signatures") and hasattr(v, "py_func"):
            kernels[f"{m.name}.{k}"] = v
before = {k: len(v.signatures) for k, v in kernels.items()}
from ccoll.collectives import ratios
from ccoll.collectives.codec import api, stream_nbytes
from ccoll.collectives.homomorphic import rank_bound, sum_bound
from ccoll.collectives.requant import Requant, decode_one, requant_one
dtype = np.dtype(sys.argv[1])
ranks, share, n = 4, 0.5, 5000
k = ratios.split_multiple(ranks, share)
e1 = 1e-3 * ratios.split_reduce_share(ranks, share)
ring_eb = sum_bound(e1, ranks, True)
eb_r = rank_bound(ring_eb, ranks)
rq = Requant(k * eb_r / ranks, ranks, 1e-3 - e1, share)
rng = np.random.default_rng(0)
xs = [(rng.standard_normal(n) * 0.02).astype(dtype) for _ in range(ranks)]
xs[1][100] = 3 * 2**31 * eb_r  # a raw lane: its block goes raw in the requantized stream
s = api().compress_abs(xs[0], eb_r)
for x in xs[1:]:
    s = api().add_data(s, x, eb_r)
out = np.empty(n, dtype)
r = requant_one(s, out, 0, n, rq)
decode_one(r, stream_nbytes(r), out, 0, n, dtype != np.float64)
print(json.dumps(sorted(k for k, v in kernels.items() if len(v.signatures) > before[k])))
"""


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_warmup_compiles_what_the_requantization_runs(dtype):
    # In a process of its own: numba compiles (or loads) a kernel's signature on first use
    # in a process, and a fresh cache compiles then, on every rank side by side, inside a
    # collective's timeout. `python -m ccoll.warmup` must leave nothing to the split.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    p = subprocess.run([sys.executable, "-c", WARM_PROG, dtype], env=env, capture_output=True,
                       text=True, timeout=900, cwd=repo)
    assert p.returncode == 0, p.stderr
    added = json.loads(p.stdout.strip().splitlines()[-1])
    assert added == [], f"warm() left these kernels' signatures for the split: {added}"
