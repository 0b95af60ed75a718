"""``ccoll.compress``/``decompress`` return the caller's array type and dtype.

A torch tensor gives a uint8 tensor stream; ``decompress(buf, like=t)`` gives a tensor of
``t``'s dtype (float16/bfloat16 rounded once from the float32 stream, within ``eb``:
docs/error-bound.md, "float16 and bfloat16"); numpy stays numpy. CuPy is
checked where it is installed (a visible skip otherwise).
"""

from __future__ import annotations

import numpy as np
import pytest
from kit import assert_clear_error, assert_within

import ccoll
from ccoll.errors import DTypeError, InputError, MismatchError

torch = pytest.importorskip("torch")

EB = 1e-3


def _data(dtype, shape=(40, 50), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size=shape) * 1e-1
    x[rng.random(shape) < 0.2] = 0.0
    return torch.from_numpy(x).to(dtype)


def _host64(t):
    """The tensor's values as float64 (exact for every float dtype)."""
    return t.detach().to(torch.float64).numpy()


CASES = {
    "float32": lambda: _data(torch.float32),
    "float64": lambda: _data(torch.float64),
    "float16": lambda: _data(torch.float16),
    "bfloat16": lambda: _data(torch.bfloat16),
    "noncontiguous": lambda: _data(torch.float32, (40, 100))[:, ::2],
    "noncontiguous-bf16": lambda: _data(torch.bfloat16, (50, 40)).T,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_in_tensor_out(case):
    x = CASES[case]()
    buf = ccoll.compress(x, ccoll.ABS(EB))
    assert isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8
    assert buf.device == x.device and buf.dim() == 1
    low = x.dtype in (torch.float16, torch.bfloat16)
    # The same bytes as the numpy path (float16/bfloat16: their exact float32 copy, at the
    # bound the final rounding leaves, which the stream's header records, with the source
    # dtype in byte 7).
    x_np = x.float().numpy() if low else x.numpy()
    eb = ccoll.compressor.header(buf.numpy()).eb
    assert eb <= EB and (eb == EB) == (not low)
    same = ccoll.compress(x_np, ccoll.ABS(eb))
    same[7] = {torch.float16: 1, torch.bfloat16: 2}.get(x.dtype, 0)
    assert np.array_equal(buf.numpy(), same)
    if x.dtype == torch.float16:
        assert np.array_equal(buf.numpy(), ccoll.compress(x.numpy(), ccoll.ABS(EB)))
    y = ccoll.decompress(buf, like=x)
    assert isinstance(y, torch.Tensor)
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device
    assert y.is_contiguous()
    # float16/bfloat16 too: the bound holds after the rounding to the dtype.
    assert_within(_host64(y), _host64(x), EB)
    # Without like= a host stream decodes to numpy, in the data's dtype (the header's source
    # dtype for float16/bfloat16); bfloat16, which numpy lacks without ml_dtypes, to a
    # tensor of it.
    plain = ccoll.decompress(buf)
    if x.dtype == torch.bfloat16 and not isinstance(plain, np.ndarray):
        assert plain.dtype == torch.bfloat16 and torch.equal(plain, y)
    else:
        assert isinstance(plain, np.ndarray) and plain.shape == tuple(x.shape)
        assert plain.dtype.name == str(x.dtype).removeprefix("torch.")
        assert np.array_equal(plain.astype(np.float64), _host64(y))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_zero_dimensional_tensor_keeps_its_shape(dtype):
    x = torch.tensor(1.25, dtype=getattr(torch, dtype))
    y = ccoll.decompress(ccoll.compress(x, ccoll.ABS(EB)), like=x)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.shape == ()
    assert float(y) == 1.25  # exactly representable: a constant block decodes exactly


def test_float16_like_rounds_once_to_nearest():
    x = _data(torch.float16)
    buf = ccoll.compress(x, ccoll.REL(1e-2))
    y = ccoll.decompress(buf, like=x)
    # Exactly the float32 decode rounded once to nearest (torch's .half() rounds to nearest).
    assert torch.equal(y, torch.from_numpy(ccoll.decompress(buf)).half())


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_like_stays_numpy(dtype):
    x = _data(torch.float64).numpy().astype(dtype)
    buf = ccoll.compress(x, ccoll.ABS(EB))
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8
    y = ccoll.decompress(buf, like=x)
    assert type(y) is np.ndarray and y.dtype == dtype and y.shape == x.shape
    assert_within(y, x, EB)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_out_tensor_is_honoured(dtype):
    x = _data(getattr(torch, dtype))
    buf = ccoll.compress(x, ccoll.ABS(EB))
    out = torch.empty_like(x)
    y = ccoll.decompress(buf, out=out)
    assert y is out
    assert torch.equal(out, ccoll.decompress(buf, like=x))


def test_requires_grad_is_read_detached():
    # compress reads x; its stream and decode are no part of an autograd graph.
    x = _data(torch.float32).requires_grad_(True)
    buf = ccoll.compress(x, ccoll.ABS(EB))
    assert isinstance(buf, torch.Tensor) and not buf.requires_grad
    assert torch.equal(buf, ccoll.compress(x.detach(), ccoll.ABS(EB)))
    y = ccoll.decompress(buf, like=x)
    assert isinstance(y, torch.Tensor) and not y.requires_grad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_out_that_requires_grad_is_refused_and_left_alone(dtype):
    # A float32 out was written in place behind autograd's back, a bfloat16 one raised
    # torch's own RuntimeError: both are refused as the collectives refuse them.
    x = _data(torch.float32)
    buf = ccoll.compress(x, ccoll.ABS(EB))
    out = torch.zeros(x.shape, dtype=getattr(torch, dtype)).requires_grad_(True)
    assert_clear_error(InputError, r"out is a torch tensor that requires grad: pass "
                       r"out.detach\(\)", ccoll.decompress, buf, out=out)
    assert not out.detach().any()
    y = ccoll.decompress(buf, out=out.detach())
    assert torch.equal(y, ccoll.decompress(buf, like=out.detach())) and y.any()


def test_like_errors_name_the_fix():
    x = _data(torch.float32)
    buf = ccoll.compress(x, ccoll.ABS(EB))
    assert_clear_error(MismatchError, r"stream holds float32.*like= an array of dtype float32",
                       ccoll.decompress, buf, like=torch.zeros(1, dtype=torch.float64))
    assert_clear_error(DTypeError, r"like has dtype torch.int32", ccoll.decompress, buf,
                       like=torch.zeros(1, dtype=torch.int32))
    assert_clear_error(InputError, r"out= or like=, not both", ccoll.decompress, buf,
                       out=torch.empty_like(x), like=x)
    b64 = ccoll.compress(x.double(), ccoll.ABS(EB))
    assert_clear_error(MismatchError, r"decoding to float16 takes a float32 stream",
                       ccoll.decompress, b64, like=np.zeros(1, np.float16))


def test_cupy_in_cupy_out():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed here")
    x = cupy.asarray(_data(torch.float32).numpy())
    buf = ccoll.compress(x, ccoll.ABS(EB))
    assert isinstance(buf, cupy.ndarray) and buf.dtype == cupy.uint8
    y = ccoll.decompress(buf, like=x)
    assert isinstance(y, cupy.ndarray) and y.dtype == x.dtype and y.shape == x.shape
    assert y.device == x.device
    assert_within(cupy.asnumpy(y), cupy.asnumpy(x), EB)
