"""Format version 2 through the public API on device data, in the simulator: the CUDA and
CPU backends write the same v2 bytes, read each other's streams and add them alike."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import ccoll
from ccoll.compressor import cpu as _cpu
from ccoll.errors import FormatError, InputError


def _data(n: int = 100) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    x[n // 3 : n // 2] = 0.0
    x[5] = np.nan
    x[70] = -np.inf
    return x


def test_device_compress_version_2_equals_the_host_stream():
    x = _data()
    dev = ccoll.compress(cuda.to_device(x), ccoll.REL(1e-3), version=2)
    host = ccoll.compress(x, ccoll.REL(1e-3), version=2)
    assert int(host[4]) == 2
    assert dev.copy_to_host().tobytes() == host.tobytes()
    dev_abs = ccoll.compressor.compress_abs(cuda.to_device(x), 1e-3, version=2)
    assert dev_abs.copy_to_host().tobytes() == _cpu.compress_abs(x, 1e-3, version=2).tobytes()


def test_device_decodes_and_adds_host_v2_streams_like_the_host():
    x = _data()
    s = _cpu.compress_abs(x, 1e-3, version=2)
    y_dev = ccoll.decompress(cuda.to_device(s)).copy_to_host()
    assert y_dev.tobytes() == _cpu.decompress(s).tobytes()
    t = _cpu.compress_abs(x[::-1].copy(), 1e-3, version=2)
    sum_dev = ccoll.compressor.add(cuda.to_device(s), cuda.to_device(t)).copy_to_host()
    assert sum_dev.tobytes() == _cpu.add(s, t).tobytes()


def test_device_mixed_versions_and_bad_version_are_clear_errors():
    x = _data()
    v1 = cuda.to_device(_cpu.compress_abs(x, 1e-3, version=1))
    v2 = cuda.to_device(_cpu.compress_abs(x, 1e-3, version=2))
    with pytest.raises(FormatError, match="version"):
        ccoll.compressor.add(v1, v2)
    with pytest.raises(InputError, match="version=3"):
        ccoll.compress(cuda.to_device(x), ccoll.ABS(1e-3), version=3)
