"""``residual_abs``: what compression drops, bit for bit numpy's ``x - decode(compress(x))``.

Error feedback keeps this residual (ccoll/torch/hook.py); the kernel takes it in one pass
instead of compressing and decoding again, so it must agree with the streams of both
format versions on every element: coded, zero (the small-value shortcut and all-zero
codes), raw (values off the grid, ±inf, NaN) and partial blocks, in place and not.
"""

from __future__ import annotations

import numpy as np
import pytest

from ccoll.compressor import compress_abs, decompress
from ccoll.compressor.cpu import residual_abs


def _data(dtype, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 0.01).astype(dtype)
    x[: 32 * 3] = 0.0                      # zero blocks
    x[32 * 3: 32 * 4] = 1e-9               # below half the bound: the zero shortcut
    x[32 * 4: 32 * 4 + 8] = -0.0
    for i in rng.integers(0, n, 12):       # raw blocks: off the int32 grid
        x[i] = dtype(3e12 * (1 + rng.random()))
    x[rng.integers(0, n, 3)] = np.inf
    x[rng.integers(0, n, 3)] = -np.inf
    x[rng.integers(0, n, 3)] = np.nan
    k = x[n // 2: n // 2 + 40].size
    x[n // 2: n // 2 + k] = np.linspace(-0.05, 0.05, k)  # a Lorenzo-friendly ramp
    return x


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 31, 32, 1000, 8192 * 3 + 17])
@pytest.mark.parametrize("eb", [1e-3, 3.7e-6, 0.5])
def test_residual_equals_input_minus_decoded_stream(dtype, n, eb) -> None:
    x = _data(dtype, n, seed=n)
    got = residual_abs(x, eb, np.empty_like(x))
    for version in (1, 2):
        decoded = decompress(compress_abs(x, eb, version=version))
        with np.errstate(invalid="ignore"):  # inf - inf in raw blocks: NaN, as the kernel's
            want = x - decoded
        bad = np.flatnonzero(_bits(got) != _bits(want))
        assert bad.size == 0, (version, bad[:5], got[bad[:3]], want[bad[:3]], x[bad[:3]])
    # Where nothing was dropped (raw blocks of finite values) the residual is exactly 0,
    # and every finite residual is within the bound.
    fin = np.isfinite(got)
    assert (np.abs(got[fin].astype(np.float64)) < eb).all()


def test_in_place_and_a_huge_bound() -> None:
    x = _data(np.float32, 5000, seed=7)
    with np.errstate(invalid="ignore"):
        want = x - decompress(compress_abs(x, 1e-3))
    y = x.copy()
    assert residual_abs(y, 1e-3, y) is y
    assert (_bits(y) == _bits(want)).all()
    # 2 * eb overflows: every block raw, nothing dropped from finite values.
    big = float(np.finfo(np.float64).max)
    z = residual_abs(x, big, np.empty_like(x))
    with np.errstate(invalid="ignore"):
        zw = x - decompress(compress_abs(x, big))
    assert (_bits(z) == _bits(zw)).all()


@pytest.mark.parametrize(
    ("x", "out", "eb", "exc", "match"),
    [
        (np.zeros(4, np.int32), np.zeros(4, np.int32), 1e-3, TypeError, "float32/float64"),
        (np.zeros(4, np.float32), np.zeros(4, np.float64), 1e-3, TypeError, "dtype"),
        (np.zeros(4, np.float32), np.zeros(5, np.float32), 1e-3, ValueError, "one size"),
        (np.zeros(8, np.float32)[::2], np.zeros(4, np.float32), 1e-3, ValueError, "contiguous"),
        (np.zeros((4, 4), np.float32), np.zeros((4, 4), np.float32).T, 1e-3, ValueError,
         "contiguous"),
        (np.zeros(4, np.float32), np.zeros(4, np.float32), 0.0, ValueError, "bound > 0"),
        (np.zeros(4, np.float32), np.zeros(4, np.float32), np.nan, ValueError, "bound > 0"),
    ],
)
def test_bad_arguments_are_refused(x, out, eb, exc, match) -> None:
    with pytest.raises(exc, match=match):
        residual_abs(x, eb, out)
