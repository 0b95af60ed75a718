"""float16 and bfloat16 through ``ccoll.compress``/``decompress`` (docs/error-bound.md).

The stream is the float32 stream of the input's exact float32 copy: ``decompress`` returns
float32 within ``eb`` of the input; decoding into a float16/bfloat16 ``out`` rounds once
more, to ``|out - x| <= min(2 eb, eb + s/2)`` (``s``: the dtype's spacing at ``out``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from kit import assert_clear_error, assert_within, rel_bound

import ccoll
from ccoll.compressor.precision import Narrow, low_precision, widen


def _half(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size=n) * 3.0
    x[rng.random(n) < 0.2] = 0.0
    x[:3] = [np.nan, np.inf, -np.inf]
    return x.astype(np.float16)


def _bf16_spacing(y32: np.ndarray) -> np.ndarray:
    """bfloat16's spacing at float32 values that are bfloat16 values (8 bits of precision)."""
    return np.spacing(np.abs(y32).astype(np.float32)).astype(np.float64) * 2.0**16


@pytest.mark.parametrize("n", [0, 1, 31, 33, 1000])
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-2), ccoll.REL(1e-3)], ids=["abs", "rel"])
def test_float16_round_trip_is_float16_within_eb(n, eb):
    # The stream records float16 as the data's source dtype: decompress gives it back.
    x = _half(max(n, 3))[:n]
    buf = ccoll.compress(x, eb)
    y = ccoll.decompress(buf)
    assert y.dtype == np.float16 and y.shape == x.shape
    bound = eb.value if isinstance(eb, ccoll.ABS) else rel_bound(eb.value, x)
    assert_within(y, x, bound)
    y32 = ccoll.decompress(buf, out=np.empty(x.shape, np.float32))  # the float32 decode
    assert_within(y32, x, bound)


@pytest.mark.parametrize("eb", [1e-2, 1e-4, 0.5])
def test_float16_decoded_into_float16_rounds_once(eb):
    x = _half(2000).reshape(40, 50)
    out = np.empty_like(x)
    got = ccoll.decompress(ccoll.compress(x, ccoll.ABS(eb)), out=out)
    assert got is out
    assert_within(out, x, eb, roundings=1)  # eb + s/2
    assert_within(out, x, 2 * eb)  # x is a float16 itself: the rounding moves at most eb more


def test_bfloat16_tensor_round_trip():
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(_half(3000).astype(np.float32)).to(torch.bfloat16)
    x32 = x.float().numpy()
    buf = ccoll.compress(x, ccoll.REL(1e-3))
    eb = rel_bound(1e-3, x32)
    y = ccoll.decompress(buf.numpy(), out=np.empty(3000, np.float32))  # the float32 decode
    assert_within(y, x32, eb)
    z = ccoll.decompress(buf)  # a tensor stream of bfloat16 data: a bfloat16 tensor
    assert isinstance(z, torch.Tensor) and z.dtype == torch.bfloat16
    assert_within(z.float().numpy(), x32, eb)
    out = torch.empty(3000, dtype=torch.bfloat16)
    assert ccoll.decompress(buf, out=out) is out
    o32 = out.float().numpy()
    assert_within(o32, x32, eb, roundings=1, spacing=_bf16_spacing(o32))
    assert_within(o32, x32, 2 * eb)


def test_widen_is_exact_and_narrow_rounds_to_nearest():
    x = _half(5000)
    wide, narrow = widen(x)
    assert wide.dtype == np.float32 and narrow.name == "float16"
    np.testing.assert_array_equal(wide.astype(np.float16), x)
    y = np.float32(1.0) + np.float32(2.0**-11)  # a tie between two float16: to even
    assert narrow.result(np.array([y]))[0] == np.float16(1.0)
    assert widen(np.zeros(3, np.float32)) is None
    assert low_precision(np.zeros(1, np.float64)) is None
    assert Narrow.of(np.zeros(1, np.float16)) == Narrow("float16", np.dtype(np.float16), False)


def test_bfloat16_narrow_of_a_tensor():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    wide, narrow = widen(t)
    assert wide.dtype == np.float32 and narrow.torch and narrow.name == "bfloat16"
    back = narrow.result(np.array([1.0, 1.0 + 2.0**-8, 3.0], np.float32))  # a tie: to even
    assert back.dtype == torch.bfloat16 and back.tolist() == [1.0, 1.0, 3.0]


def test_decompress_float64_stream_into_float16_names_the_fix():
    buf = ccoll.compress(np.ones(10), ccoll.ABS(1e-3))
    assert_clear_error(ccoll.MismatchError, re.escape(
        "out has dtype float16 but the stream holds float64; decoding into float16 takes a "
        "float32 stream: pass an out of dtype float64"),
        ccoll.decompress, buf, np.empty(10, np.float16))
    buf32 = ccoll.compress(np.ones(10, np.float32), ccoll.ABS(1e-3))
    assert_clear_error(ccoll.MismatchError, r"out has 9 elements, the stream 10: pass an out "
                       r"of shape \(10,\)", ccoll.decompress, buf32, np.empty(9, np.float16))


def test_object_input_names_what_is_expected():
    assert_clear_error(ccoll.DTypeError, "x has dtype object; ccoll compresses float16",
                       ccoll.compress, np.array([object()]), ccoll.ABS(1e-3))
