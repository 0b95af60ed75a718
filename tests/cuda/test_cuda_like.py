"""``ccoll.decompress(buf, like=...)`` for device streams, in the CUDA simulator.

The result has ``like``'s kind on the device (numba here; CuPy and CUDA tensors in
tests/test_compressor_tensors.py where they are installed); a host ``like`` for a device
stream is refused with the fix. float16 device data compresses as its exact float32 copy
and decodes (``like=``/``out=`` of float16) to the float32 result rounded once, as on the
host.
"""

from __future__ import annotations

import numpy as np
from kit import assert_clear_error, assert_within
from numba import cuda
from numba.cuda.cudadrv import devicearray

import ccoll
import ccoll.compressor
from ccoll.errors import MismatchError

EB = 1e-3


def _stream(n=300):
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    return x, ccoll.compress(cuda.to_device(x), ccoll.ABS(EB))


def test_device_like_gives_a_device_array():
    x, buf = _stream()
    y = ccoll.decompress(buf, like=cuda.to_device(np.zeros(1, np.float32)))
    assert devicearray.is_cuda_ndarray(y) and y.dtype == np.float32 and y.shape == x.shape
    assert_within(y.copy_to_host(), x, EB)


def test_device_like_errors_name_the_fix():
    # A device stream made on the host: the checks refuse it before any kernel runs.
    buf = cuda.to_device(ccoll.compress(np.ones(300, np.float32), ccoll.ABS(EB)))
    assert_clear_error(MismatchError, r"like lives on the host but the stream on the device",
                       ccoll.decompress, buf, like=np.zeros(1, np.float32))
    assert_clear_error(MismatchError, r"like has dtype float64 but the stream holds float32",
                       ccoll.decompress, buf, like=cuda.to_device(np.zeros(1, np.float64)))
    host = ccoll.compress(np.zeros(40, np.float32), ccoll.ABS(EB))
    assert_clear_error(MismatchError, r"like lives on the device but the stream on the host",
                       ccoll.decompress, host, like=cuda.to_device(np.zeros(1, np.float32)))


def test_device_float16_round_trip_equals_the_host_one():
    x = (np.random.default_rng(1).standard_normal(300) * 3).astype(np.float16)
    d = cuda.to_device(x)
    buf = ccoll.compress(d, ccoll.ABS(EB))
    assert ccoll.compressor.header(buf).dtype == np.float32  # its exact float32 copy
    y = ccoll.decompress(buf, like=d)
    assert devicearray.is_cuda_ndarray(y) and y.dtype == np.float16 and y.shape == x.shape
    host = ccoll.decompress(ccoll.compress(x, ccoll.ABS(EB)), like=x)
    assert y.copy_to_host().tobytes() == host.tobytes()
    # A float32 value within eb, rounded once to float16 (docs/error-bound.md).
    assert_within(y.copy_to_host(), x, EB, roundings=1)
    out = cuda.device_array(x.shape, np.float16)
    assert ccoll.decompress(buf, out=out) is out
    assert out.copy_to_host().tobytes() == host.tobytes()
    # The header records float16 (byte 7), as the host stream's does, byte for byte:
    # decompress(buf) alone gives float16 back.
    for version in (1, 2):
        dbuf = ccoll.compress(d, ccoll.ABS(EB), version=version)
        hbuf = ccoll.compress(x, ccoll.ABS(EB), version=version)
        assert dbuf.copy_to_host().tobytes() == hbuf.tobytes() and hbuf[7] == 1
        z = ccoll.decompress(dbuf)
        assert devicearray.is_cuda_ndarray(z) and z.dtype == np.float16
        assert z.copy_to_host().tobytes() == ccoll.decompress(hbuf).tobytes()


def test_device_float16_like_of_a_float64_stream_is_refused():
    buf = ccoll.compress(cuda.to_device(np.zeros(8, np.float64)), ccoll.ABS(EB))
    assert_clear_error(MismatchError, r"stream holds float64; decoding to float16 takes a "
                       r"float32 stream", ccoll.decompress, buf,
                       like=cuda.to_device(np.zeros(1, np.float16)))


def test_device_add_data_takes_float16_as_the_host_does():
    # The device's add_data compressed x itself and refused float16 (DTypeError) where the
    # host takes its float32 copy; now both, the same bytes.
    import ccoll.compressor as C

    x = np.linspace(-1, 1, 100).astype(np.float16)
    a = C.compress_abs(np.zeros(100, np.float32), EB)
    host = C.add_data(a, x)
    dev = C.add_data(cuda.to_device(a), cuda.to_device(x))
    assert dev.copy_to_host().tobytes() == host.tobytes()
