"""Until the CUDA backend has format version 2, device data and streams of v2 get clear errors.

Reading a version-2 stream with the version-1 kernels would decode garbage, so the device
backend refuses it by its header; ``compress(..., version=2)`` of device data names
``version=1``.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import ccoll
from ccoll.compressor import _cuda
from ccoll.compressor import cpu as _cpu
from ccoll.errors import FormatError, InputError


def test_device_compress_with_version_2_names_version_1():
    x = cuda.to_device(np.linspace(-1, 1, 100).astype(np.float32))
    with pytest.raises(InputError, match="version=1"):
        ccoll.compress(x, ccoll.ABS(1e-3), version=2)
    with pytest.raises(InputError, match="version=1"):
        ccoll.compressor.compress_abs(x, 1e-3, version=2)


def test_device_v2_streams_are_refused_by_their_header():
    s2 = _cpu.compress_abs(np.linspace(-1, 1, 100).astype(np.float32), 1e-3, version=2)
    d = cuda.to_device(s2)
    for call in (lambda: _cuda.decompress(d), lambda: _cuda.add(d, d), lambda: _cuda.header(d)):
        with pytest.raises(FormatError, match="version 2.*version 1 only"):
            call()
