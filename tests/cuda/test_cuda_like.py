"""``ccoll.decompress(buf, like=...)`` for device streams, in the CUDA simulator.

The result has ``like``'s kind on the device (numba here; CuPy and CUDA tensors in
tests/test_compressor_tensors.py where they are installed); a host ``like`` for a device
stream, and float16 ``like`` on the device, are refused with the fix.
"""

from __future__ import annotations

import numpy as np
from kit import assert_clear_error, assert_within
from numba import cuda
from numba.cuda.cudadrv import devicearray

import ccoll
from ccoll.errors import DTypeError, MismatchError

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
    _, buf = _stream()
    assert_clear_error(MismatchError, r"like lives on the host but the stream on the device",
                       ccoll.decompress, buf, like=np.zeros(1, np.float32))
    assert_clear_error(DTypeError, r"like has dtype float16.*float32 or float64 only",
                       ccoll.decompress, buf, like=cuda.to_device(np.zeros(1, np.float16)))
    assert_clear_error(MismatchError, r"like has dtype float64 but the stream holds float32",
                       ccoll.decompress, buf, like=cuda.to_device(np.zeros(1, np.float64)))
    host = ccoll.compress(np.zeros(40, np.float32), ccoll.ABS(EB))
    assert_clear_error(MismatchError, r"like lives on the device but the stream on the host",
                       ccoll.decompress, host, like=cuda.to_device(np.zeros(1, np.float32)))
