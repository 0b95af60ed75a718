"""The public compressor API: arguments, out=, headers, sizes, and the backend choice."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from kit import assert_clear_error

import ccoll
from ccoll.compressor import _backend, add, compress_abs, header, max_nbytes
from ccoll.errors import CCollError, MismatchError


def sample(shape=(6, 50), dtype=np.float32, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 1e-2).astype(dtype)


def test_stream_is_a_flat_uint8_numpy_array():
    buf = ccoll.compress(sample(), ccoll.REL(1e-3))
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1


@pytest.mark.parametrize("eb, relative", [
    ("rel:1e-3", True), ("abs:1e-3", False), (1e-3, False), (ccoll.ABS(1e-3), False),
    (ccoll.REL(1e-3), True),
])
def test_bound_spellings(eb, relative):
    x = sample()
    h = header(ccoll.compress(x, eb))
    want = 1e-3 * (float(x.max()) - float(x.min())) if relative else 1e-3
    assert h.eb == want


@pytest.mark.parametrize("eb, match", [
    # float() of them raised OverflowError, or read as 0 and the message said "got 0.0"
    (10**400, "an integer of 401 digits, beyond float64's range"),
    ("abs:1e-400", r"'1e-400' in 'abs:1e-400' is below the smallest float64"),
    ("rel:2.5E-999", r"'2.5E-999' in 'rel:2.5E-999' is below the smallest float64"),
    ("abs:0e5", r"got 0.0"),  # a zero written with an exponent is a zero
])
def test_bounds_beyond_float64_name_what_was_passed(eb, match):
    from ccoll.errorbound import as_bound
    from ccoll.errors import ErrorBoundError

    assert_clear_error(ErrorBoundError, match, as_bound, eb)


@pytest.mark.parametrize("kind", [ccoll.ABS, ccoll.REL])
def test_a_bound_is_a_value_that_cannot_change(kind):
    # A bound set to -1 or 0 after it was checked once reached the ring's kernels
    # (ErrorBoundError mid-collective, the Communicator unusable after) or compressed
    # losslessly without a word: a bound cannot change once made.
    import copy
    import pickle

    from ccoll.errors import ErrorBoundError

    eb = kind(1e-3)
    for bad in (-1.0, 0.0, 1e-2):
        with pytest.raises(ErrorBoundError, match=rf"{kind.__name__}\(0.001\) cannot change"):
            eb.value = bad
    with pytest.raises(ErrorBoundError, match="cannot change"):
        del eb.value
    assert eb.value == 1e-3 and eb == kind(1e-3) and hash(eb) == hash(kind(1e-3))
    for again in (copy.copy(eb), copy.deepcopy(eb), pickle.loads(pickle.dumps(eb))):
        assert type(again) is kind and again.value == 1e-3
    x = sample()
    assert ccoll.compress(x, eb).tobytes() == ccoll.compress(x, kind(1e-3)).tobytes()
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ErrorBoundError):
            kind(bad)


def test_header_fields():
    x = sample((3, 4, 5), np.float64)
    buf = compress_abs(x, 1e-3)
    h = header(buf)
    assert (h.dtype, h.shape, h.n, h.eb, h.bound, h.nterms) == (
        np.dtype(np.float64), (3, 4, 5), 60, 1e-3, 1e-3, 1)
    assert h.nbytes == buf.size
    assert header(buf.tobytes()) == h


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (31,), (32,), (33,), (4, 0, 3), (7, 13, 5)])
def test_streams_fit_max_nbytes(shape, dtype):
    x = sample(shape, dtype)
    for eb in (0.0, 1e-9, 1e-3):
        buf = compress_abs(x, eb)
        assert buf.size <= max_nbytes(x.size, dtype, len(shape))
        s = add(buf, buf)
        assert s.size <= max_nbytes(x.size, dtype, len(shape))


# ----------------------------------------------------------------------------------- out=


def test_decompress_into_out():
    x = sample()
    buf = ccoll.compress(x, ccoll.ABS(1e-3))
    ref = ccoll.decompress(buf)
    out = np.empty_like(x)
    assert ccoll.decompress(buf, out=out) is out
    assert np.array_equal(out, ref)
    flat = np.empty(x.size, x.dtype)  # same element count, other shape
    ccoll.decompress(buf, out=flat)
    assert np.array_equal(flat, ref.ravel())


@pytest.mark.parametrize("make, match", [
    (lambda x: np.empty(x.shape, np.float64), "dtype"),
    (lambda x: np.empty(x.size + 1, x.dtype), "shape"),
    (lambda x: np.empty((x.shape[0], x.shape[1] * 2), x.dtype)[:, ::2], "contiguous"),
    (lambda x: np.frombuffer(bytes(x.nbytes), x.dtype).reshape(x.shape), "read-only"),
    (lambda x: [0.0] * x.size, "numpy"),
])
def test_bad_out(make, match):
    x = sample()
    buf = ccoll.compress(x, ccoll.ABS(1e-3))
    assert_clear_error(MismatchError, match, ccoll.decompress, buf, out=make(x))


def test_decompress_into_a_torch_tensor_and_from_a_torch_stream():
    torch = pytest.importorskip("torch")
    x = sample()
    buf = ccoll.compress(x, ccoll.ABS(1e-3))
    out = torch.empty(x.shape, dtype=torch.float32)
    assert ccoll.decompress(buf, out=out) is out
    assert np.array_equal(out.numpy(), ccoll.decompress(buf))
    y = ccoll.decompress(torch.from_numpy(buf))
    assert isinstance(y, np.ndarray) and np.array_equal(y, out.numpy())


# ------------------------------------------------------------------------------- backends


class FakeDeviceArray:
    """Looks like device memory: only ``__cuda_array_interface__``."""

    def __init__(self, dtype="<f4", shape=(8,)):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": dtype, "data": (0, False),
                                         "version": 3}


class FakeDLPackCuda:
    def __dlpack_device__(self):
        return (2, 0)


def test_backend_of():
    assert _backend.backend_of(np.zeros(3)) == "cpu"
    assert _backend.backend_of(b"abc") == "cpu"
    assert _backend.backend_of(memoryview(b"abc")) == "cpu"
    assert _backend.backend_of(FakeDeviceArray()) == "cuda"
    assert _backend.backend_of(FakeDLPackCuda()) == "cuda"


def test_backend_of_torch():
    torch = pytest.importorskip("torch")
    assert _backend.backend_of(torch.zeros(3)) == "cpu"
    with pytest.raises(CCollError, match="meta"):
        _backend.backend_of(torch.zeros(3, device="meta"))


def test_missing_cuda_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ccoll.compressor._cuda", None)  # import fails
    assert_clear_error(CCollError, "CUDA backend .* unavailable", ccoll.compress,
                       FakeDeviceArray(), ccoll.ABS(1e-3))
    assert_clear_error(CCollError, "CUDA backend .* unavailable", ccoll.decompress,
                       FakeDeviceArray("|u1"))


def test_device_arrays_go_to_the_cuda_backend(monkeypatch):
    calls = []
    fake = types.ModuleType("ccoll.compressor._cuda")
    caps = []
    versions = []
    fake.compress_abs = lambda x, eb, stream=None, max_blocks=None, version=1, source=0: (
        calls.append(("compress_abs", eb, stream)) or caps.append(max_blocks)
        or versions.append(version) or "s"
    )
    fake.decompress = lambda buf, out=None, stream=None: calls.append(("decompress", out)) or "y"
    fake.add = lambda a, b, out=None, stream=None: calls.append(("add", out)) or "sum"
    h = types.SimpleNamespace(source_dtype=None)  # a float32 or float64 stream's header
    fake.header = lambda buf, stream=None: calls.append(("header",)) or h
    fake.finite_range = lambda x, stream=None: (-1.0, 3.0)
    monkeypatch.setitem(sys.modules, "ccoll.compressor._cuda", fake)
    monkeypatch.setattr(sys.modules["ccoll.compressor"], "_cuda", fake, raising=False)
    dev = FakeDeviceArray()
    assert ccoll.compress(dev, ccoll.REL(0.25)) == "s"
    assert ccoll.compress(dev, ccoll.ABS(0.5), stream=7) == "s"
    assert compress_abs(dev, 0.0) == "s"
    assert compress_abs(dev, 0.0, max_blocks=3) == "s"
    assert caps == [None, None, None, 3]  # the grid cap reaches the CUDA backend
    assert ccoll.compress(dev, ccoll.ABS(0.5), version=2) == "s"
    assert versions == [1, 1, 1, 1, 2]  # and so does the stream format
    assert ccoll.decompress(dev) == "y"
    assert add(dev, dev) == "sum"
    assert header(dev) is h
    assert calls[:3] == [("compress_abs", 1.0, None), ("compress_abs", 0.5, 7),
                         ("compress_abs", 0.0, None)]
    with pytest.raises(MismatchError, match="same device"):
        add(dev, np.zeros(8, np.uint8))
    with pytest.raises(MismatchError, match="same device"):
        ccoll.decompress(np.zeros(8, np.uint8), out=dev)
    with pytest.raises(ccoll.DTypeError):
        ccoll.compress(FakeDeviceArray("<i4"), ccoll.ABS(1e-3))


def test_concurrent_calls_from_python_threads():
    # Kernels release the GIL; parallel kernels may be entered from several threads at once
    # (the collectives compress and add while a transfer is in flight).
    from concurrent.futures import ThreadPoolExecutor

    xs = [sample((300_000,), np.float32, seed=s) for s in range(4)]
    want = [compress_abs(x, 1e-4).tobytes() for x in xs]

    def work(i):
        buf = compress_abs(xs[i], 1e-4)
        return buf.tobytes(), ccoll.decompress(add(buf, buf))

    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(work, range(4)))
    for i, (buf, y) in enumerate(got):
        assert buf == want[i]
        assert np.array_equal(y, ccoll.decompress(add(want[i], want[i])))
