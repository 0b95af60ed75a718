"""The REL check stage's value range: one parallel numba pass, the same range as numpy's.

``ccoll.errorbound.finite_range`` (numpy's min and max, then a filtered copy when either is
not finite) is the reference; the collectives use ``ccoll.compressor.cpu.finite_range``.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

import ccoll
from ccoll.collectives import inputs
from ccoll.compressor import cpu
from ccoll.compressor.cpu import encode
from ccoll.errorbound import finite_range as reference

F32_MAX = float(np.finfo(np.float32).max)


def _bits(v: float) -> bytes:
    return struct.pack("<d", v)


def _cases() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    big = rng.standard_normal(300_001)
    sprinkled = big.copy()
    sprinkled[rng.integers(0, big.size, 50)] = np.nan
    sprinkled[rng.integers(0, big.size, 5)] = np.inf
    sprinkled[rng.integers(0, big.size, 5)] = -np.inf
    zeros = np.where(rng.integers(0, 2, 100_003) == 1, -0.0, 0.0)
    signed = zeros.copy()
    signed[17] = 3.0
    neg = -np.abs(rng.standard_normal(70_001))
    neg[rng.integers(0, neg.size, 30)] = -0.0
    return [
        ("empty", np.array([])),
        ("nan", np.array([np.nan])),
        ("all non-finite", np.array([np.inf, -np.inf, np.nan] * 40_000)),
        ("+0,-0", np.array([0.0, -0.0])),
        ("-0,+0", np.array([-0.0, 0.0])),
        ("-0", np.array([-0.0])),
        ("zeros of both signs", zeros),
        ("zeros and 3", signed),
        ("negative up to -0", neg),
        ("one", np.array([1.0])),
        ("gaussian", big),
        ("gaussian with nan and inf", sprinkled),
        ("nan then finite", np.array([np.nan] * 70_000 + [2.5, -1.5])),
        ("float32 extremes", np.array([F32_MAX, -F32_MAX, 1e-45])),
        ("2-d", big[:300_000].reshape(600, 500)),
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("name", "values"), _cases(), ids=[c[0] for c in _cases()])
def test_same_range_as_numpy_and_a_zero_end_is_plus_zero(name, values, dtype):
    with np.errstate(over="ignore"):
        x = values.astype(dtype)
    got = cpu.finite_range(x)
    want = reference(x)
    for g, w in zip(got, want, strict=True):
        assert g == w or (math.isnan(g) and math.isnan(w)), (name, got, want)
        if w == 0.0:
            # numpy returns 0.0 or -0.0 for a zero end depending on its SIMD lanes; the
            # fused pass always returns 0.0.
            assert _bits(g) == _bits(0.0), (name, got)
        else:
            assert _bits(g) == _bits(w), (name, got, want)
    # The bound a REL call resolves to is the same, bit for bit.
    rel = ccoll.REL(1e-3)
    assert _bits(rel.resolve(*got)) == _bits(rel.resolve(*want))


def test_strided_input_gives_the_range_of_its_elements():
    x = np.arange(-50.0, 50.0, dtype=np.float32)
    x[::2] = np.nan
    v = x[1::2][::-1]  # non-contiguous, negative stride
    assert cpu.finite_range(v) == reference(v) == (-49.0, 49.0)
    assert inputs.value_range(v, None) == (-49.0, 49.0)


def test_the_collectives_check_stage_uses_the_fused_pass(monkeypatch):
    # The range of a large REL call: one parallel numba pass, not numpy's two passes plus
    # a filtered copy (docs/dev/collectives-timeline.md, "The REL check stage").
    calls = []
    kernel = encode._range_kernel

    def spy(*args):
        calls.append(args[0].size)
        return kernel(*args)

    monkeypatch.setattr(encode, "_range_kernel", spy)
    n = inputs._FUSED_RANGE_MIN
    x = np.linspace(-2.0, 3.0, n, dtype=np.float32)
    x[5] = np.nan
    assert inputs.value_range(x, None) == (-2.0, 3.0)
    assert calls == [n]
    # Below that size numpy's passes are cheaper than a parallel launch: the same range.
    assert inputs.value_range(x[: n // 4], None) == (-2.0, float(x[n // 4 - 1]))
    assert calls == [n]
