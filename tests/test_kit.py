"""The bound check of tests/kit.py decides exactly: one float64 ulp too many is caught."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from kit import ExactSum, assert_within, rel_bound

import ccoll


def test_error_that_float64_rounds_onto_the_bound_is_caught():
    # |y - x| = 1 + 2^-60 rounds to 1.0 in float64: a float64 `err > eb` passes it.
    y, x = np.array([1.0]), np.array([-(2.0**-60)])
    assert float(np.abs(y - x)[0]) == 1.0
    with pytest.raises(AssertionError, match="exceed the bound"):
        assert_within(y, x, 1.0)
    assert_within(y, x, 1.0 + 2.0**-52)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_one_ulp_of_the_bound_decides(dtype):
    eb = 2.0**-10 * 3
    x = np.zeros(4, dtype)
    y = np.full(4, eb, dtype)
    assert_within(y, x, eb)
    with pytest.raises(AssertionError):
        assert_within(y, x, eb, strict=True)
    with pytest.raises(AssertionError):
        assert_within(y, x, math.nextafter(eb, 0.0))
    assert_within(y, x, math.nextafter(eb, 1.0), strict=True)
    # A bound given exactly, one part in 2^80 below the error.
    with pytest.raises(AssertionError):
        assert_within(y, x, Fraction(eb) * (1 - Fraction(1, 2**80)))


def test_compressor_off_by_one_quantum_is_caught():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(1000) * 1e-2).astype(np.float32)
    eb = rel_bound(1e-3, x)
    y = ccoll.decompress(ccoll.compress(x, ccoll.REL(1e-3)))
    assert_within(y, x, eb, strict=True)
    step = np.float32(2 * float(eb))
    for i in (0, 517, 999):
        z = y.copy()
        z[i] += step if z[i] <= x[i] else -step  # one quantum away from x
        with pytest.raises(AssertionError, match="1 of 1000"):
            assert_within(z, x, eb)


def test_exact_sum_is_exact():
    terms = np.array([[1.0, 3.0], [2.0**-60, 0.5], [-1.0, 0.25]])
    ref = ExactSum(terms)
    assert ref.exact(0) == Fraction(1, 2**60) and ref.exact(1) == Fraction(15, 4)
    # The float64 sum loses 2^-60; the exact reference does not.
    assert float(np.sum(terms, axis=0)[0]) == 0.0
    with pytest.raises(AssertionError):
        assert_within(np.array([0.0, 3.75]), ref, 2.0**-61)
    assert_within(np.array([0.0, 3.75]), ref, 2.0**-60)
    assert_within(np.array([0.0, 1.25]), ref / 3, 2.0**-61)  # 2^-60 / 3 < 2^-61
    with pytest.raises(AssertionError):
        assert_within(np.array([0.0, 1.25]), ref / 3, 2.0**-62)


def test_roundings_allow_half_a_spacing_of_the_result_dtype():
    # v = 1 + 2^-24 rounds (ties to even) to y = 1.0f: an error of half a float32 spacing.
    x = np.array([1.0 + 2.0**-24])
    y = x.astype(np.float32)
    assert_within(y, x, 0.0, roundings=1)
    with pytest.raises(AssertionError):
        assert_within(y, x, 0.0)
    with pytest.raises(AssertionError):
        assert_within(y, x, 0.0, roundings=1, strict=True)


def test_special_values_and_shapes():
    x = np.array([np.nan, np.inf, -np.inf, 1.0])
    assert_within(np.array([np.nan, np.inf, -np.inf, 1.0]), x, 0.0)
    with pytest.raises(AssertionError, match="NaN"):
        assert_within(np.array([0.0, np.inf, -np.inf, 1.0]), x, 1.0)
    with pytest.raises(AssertionError, match="Inf"):
        assert_within(np.array([np.nan, -np.inf, -np.inf, 1.0]), x, 1.0)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_within(np.array([np.nan, np.inf, -np.inf, np.inf]), x, 1.0)
    with pytest.raises(AssertionError, match="shape"):
        assert_within(np.zeros(3), np.zeros(4), 1.0)


def test_rel_bound_is_exact_and_ignores_non_finite_values():
    x = np.array([np.nan, -0.1, np.inf, 0.3], np.float32)
    want = Fraction(1e-3) * (Fraction(float(np.float32(0.3))) - Fraction(float(np.float32(-0.1))))
    assert rel_bound(1e-3, x) == want
    assert rel_bound(1e-3, np.array([np.nan])) == 0
    assert rel_bound(0.5, np.array([1.0]), np.array([3.0])) == 1


@pytest.mark.parametrize(
    ("rel", "lo", "hi"),
    [(0.1, 0.0, 3.0), (1e-3, -0.7, 0.3), (1e-3, -1e-30, 5.0), (0.3, 1.0, 1.1), (1e-2, -3.0, 7.0)],
)
def test_rel_resolves_to_no_more_than_the_real_product(rel, lo, hi):
    eb = ccoll.REL(rel).resolve(lo, hi)
    exact = Fraction(rel) * (Fraction(hi) - Fraction(lo))
    # The largest float64 not above the real product: at most it, and its successor above it.
    assert Fraction(eb) <= exact
    assert Fraction(math.nextafter(eb, math.inf)) > exact
