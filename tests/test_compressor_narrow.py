"""float16 and bfloat16 through ``compress``/``decompress``: the bound holds in the dtype.

The bound asked for holds on what ``decompress(buf)`` (the stream's header records the
source dtype) and ``decompress(buf, like=x)`` return, in ``x``'s dtype, after its final
rounding (docs/error-bound.md, "float16 and bfloat16"): every element is checked exactly
(tests/kit.py) against the bound computed here from the data, with no allowance for the
rounding. The float32 decode (into a float32 ``out``) is within the stream's own bound,
which is never above the one asked for.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from kit import assert_within, rel_bound

import ccoll
from ccoll.compressor import header

torch = pytest.importorskip("torch")

BOUNDS = [ccoll.ABS(1e-3), ccoll.ABS(3e-2), ccoll.REL(1e-3), ccoll.REL(1e-2)]
SCALES = [1e-2, 1.0, 3.0, 200.0]


def _bid(b):
    return f"{type(b).__name__}{b.value:g}"


def _data(scale, n=20_000, seed=0):
    rng = np.random.default_rng([seed, int(scale * 1000)])
    x = rng.standard_normal(n) * scale
    x[rng.random(n) < 0.1] = 0.0
    return x


def _exact_eb(bound, x64):
    if isinstance(bound, ccoll.ABS):
        return Fraction(bound.value)
    return rel_bound(bound.value, x64)


def test_the_reported_float16_case():
    # decompress(compress(x16, REL(1e-3)), like=x16) gave 0.0078 against a bound of 0.00697.
    x16 = np.random.default_rng(0).standard_normal(100_000).astype(np.float16)
    z = ccoll.decompress(ccoll.compress(x16, ccoll.REL(1e-3)), like=x16)
    assert z.dtype == np.float16
    assert_within(z, x16, rel_bound(1e-3, x16))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("bound", BOUNDS, ids=_bid)
def test_float16_numpy_within_the_bound_in_float16(bound, scale):
    x = _data(scale).astype(np.float16)
    buf = ccoll.compress(x, bound)
    eb = _exact_eb(bound, x.astype(np.float64))
    z = ccoll.decompress(buf, like=x)
    assert z.dtype == np.float16 and z.shape == x.shape
    assert_within(z, x, eb)
    out = np.empty_like(x)
    assert ccoll.decompress(buf, out=out) is out
    assert np.array_equal(out.view(np.uint16), z.view(np.uint16))
    # The header records float16 (byte 7): decompress(buf) alone gives it back, as DESIGN.md's
    # "restores dtype and shape" says (it gave float32).
    assert header(buf).source_dtype == "float16" and header(buf).dtype == np.float32
    w = ccoll.decompress(buf)
    assert w.dtype == np.float16 and w.shape == x.shape
    assert np.array_equal(w.view(np.uint16), z.view(np.uint16))
    y = ccoll.decompress(buf, out=np.empty(x.shape, np.float32))  # the float32 decode
    assert Fraction(header(buf).eb) <= eb
    assert_within(y, x, header(buf).eb, strict=True)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("bound", BOUNDS, ids=_bid)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_within_the_bound_in_its_dtype(dtype, bound, scale):
    x = torch.from_numpy(_data(scale)).to(getattr(torch, dtype))
    x64 = x.double().numpy()
    buf = ccoll.compress(x, bound)
    z = ccoll.decompress(buf, like=x)
    assert isinstance(z, torch.Tensor) and z.dtype == x.dtype
    assert_within(z.double().numpy(), x64, _exact_eb(bound, x64))
    out = torch.empty_like(x)
    ccoll.decompress(buf, out=out)
    assert torch.equal(out, z)
    # Without like: the header's source dtype. A host stream decodes to numpy where numpy
    # has the dtype (float16, or bfloat16 with ml_dtypes), else to a tensor of it.
    assert header(buf).source_dtype == dtype
    w = ccoll.decompress(buf)
    assert str(w.dtype).removeprefix("torch.") == dtype and tuple(w.shape) == tuple(x.shape)
    w64 = w.double().numpy() if isinstance(w, torch.Tensor) else np.asarray(w, np.float64)
    assert np.array_equal(w64, z.double().numpy())


def test_float16_near_the_top_of_its_range_stays_finite():
    # A bound far above float16's gaps must not push a value past 65504 to +Inf.
    x = np.array([65504, -65504, 65000, 1000, 0.1, 6e-8, 0, 3.14] * 40, dtype=np.float16)
    for bound in (ccoll.ABS(100.0), ccoll.ABS(40.0), ccoll.REL(1e-3), ccoll.ABS(1e-2)):
        buf = ccoll.compress(x, bound)
        # float16's overflow threshold is 65520 (65504 plus half its last gap, 32): a
        # decoded value within the stream's bound of 65504 must stay strictly below it.
        assert 65504 + Fraction(header(buf).eb) < 65520
        z = ccoll.decompress(buf, like=x)
        assert np.all(np.isfinite(z))
        assert_within(z, x, _exact_eb(bound, x.astype(np.float64)))


def test_nan_inf_and_constant_float16():
    x = np.array([np.nan, np.inf, -np.inf, 1.5, -2.25, 0.0] * 11, dtype=np.float16)
    z = ccoll.decompress(ccoll.compress(x, ccoll.REL(1e-3)), like=x)
    assert_within(z, x, rel_bound(1e-3, x))
    c = np.full(100, 0.1, dtype=np.float16)  # REL of constant data: exact
    assert np.array_equal(ccoll.decompress(ccoll.compress(c, ccoll.REL(1e-3)), like=c), c)


def test_the_source_byte_of_a_stream():
    # Byte 7 of the header: 1 float16, 2 bfloat16 (float32 streams only), else 0.
    x = _data(1.0)
    assert ccoll.compress(x.astype(np.float32), ccoll.ABS(1e-3))[7] == 0
    assert ccoll.compress(x, ccoll.ABS(1e-3))[7] == 0
    for version in (1, 2):
        b16 = ccoll.compress(x.astype(np.float16), ccoll.ABS(1e-3), version=version)
        assert b16[7] == 1 and header(b16).version == version
        bb = ccoll.compress(torch.from_numpy(x).to(torch.bfloat16), ccoll.ABS(1e-3),
                            version=version)
        assert int(bb[7]) == 2
        # A sum of streams is a float32 sum (the final rounding of float16 data is not in
        # its bound): the byte is not carried.
        assert ccoll.compressor.add(b16, b16)[7] == 0
    # Streams of float32 data are the bytes they were before the byte had a meaning.
    b = ccoll.compress(x.astype(np.float32), ccoll.ABS(1e-3)).copy()
    assert ccoll.decompress(b).dtype == np.float32
    b[7] = 1  # the same stream, said to hold float16 data
    w = ccoll.decompress(b)
    assert w.dtype == np.float16
    y32 = ccoll.decompress(b, out=np.empty(x.shape, np.float32))
    assert np.array_equal(w.view(np.uint16), y32.astype(np.float16).view(np.uint16))
    for code in (3, 255):
        b[7] = code
        with pytest.raises(ccoll.FormatError, match=f"source dtype code {code} at byte 7"):
            ccoll.decompress(b)
    b64 = ccoll.compress(x, ccoll.ABS(1e-3)).copy()
    b64[7] = 1  # float64 streams hold float64 data only
    with pytest.raises(ccoll.FormatError, match="source dtype code 1 at byte 7 of a float64"):
        ccoll.decompress(b64)


def test_float32_data_is_unchanged_by_the_rule():
    # The split is for float16/bfloat16 only: float32 keeps the whole bound on its grid.
    x = _data(1.0).astype(np.float32)
    assert header(ccoll.compress(x, ccoll.ABS(1e-3))).eb == 1e-3


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_input_advice_keeps_the_imaginary_part(dtype):
    # astype(np.float32) would drop the imaginary part silently: the advice must not say it.
    z = (np.arange(8) + 1j * np.arange(8)).astype(dtype)
    with pytest.raises(ccoll.DTypeError) as info:
        ccoll.compress(z, ccoll.ABS(1e-3))
    msg = str(info.value)
    assert np.dtype(dtype).name in msg and "astype(np.float32)" not in msg, msg
    assert "imaginary" in msg and ".real" in msg and ".imag" in msg, msg
    t = torch.from_numpy(z)
    with pytest.raises(ccoll.DTypeError) as info:
        ccoll.compress(t, ccoll.ABS(1e-3))
    msg = str(info.value)
    assert "x.float()" not in msg and "view_as_real" in msg, msg
