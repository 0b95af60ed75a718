"""Random data at the edges: CUDA and CPU backends write, decode and add the same bytes.

Each trial draws a dtype, a count around the kernels' boundaries (32-element blocks, 1024
per thread block), data of one of the shapes that break codecs (scales across the
dtype's range, mixed scales in one array, lone spikes among zeros, constants, subnormals,
values near the dtype's largest, NaN and ±Inf, signed zeros, integers) and an absolute
bound (REL-sized, anywhere in the dtype's range, or 0: lossless), in stream format 1 and
2. The GPU stream must
equal the CPU stream byte for byte, both decoders must give the same bytes within the
bound, and the homomorphic add of two such streams must be the same on both backends:
ranks on GPUs and on CPUs then get identical results. The simulator takes several
seconds a trial, so all but the first two of each format are marked slow (``make test-slow``).
"""

from __future__ import annotations

import numpy as np
import pytest
from kit import EDGE_SHAPES, assert_within, edge_data, rel_bound
from numba import cuda

from ccoll.compressor import _cuda
from ccoll.compressor import cpu as _cpu

TRIALS = 24
QUICK = 2
COUNTS = (0, 1, 5, 31, 32, 33, 64, 100, 257, 1023, 1025)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("trial", [
    t if t < QUICK else pytest.param(t, marks=pytest.mark.slow) for t in range(TRIALS)])
def test_random_streams_equal_across_backends(trial, version):
    rng = np.random.default_rng([7, version, trial])
    dt = (np.float32, np.float64)[rng.integers(2)]
    n = int(rng.choice(COUNTS))
    shape = str(rng.choice(EDGE_SHAPES))
    x = edge_data(rng, shape, n, dt)
    kind = int(rng.integers(3))
    if kind == 0:
        eb = float(rel_bound(10.0 ** rng.uniform(-7, -1), x))
    elif kind == 1:
        top = 300 if dt == np.float64 else 38
        eb = float(10.0 ** rng.uniform(-top, top))
    else:
        eb = 0.0
    c = _cpu.compress_abs(x, eb, version)
    g = _cuda.compress_abs(cuda.to_device(x), eb, version=version).copy_to_host()
    assert g.tobytes() == c.tobytes(), f"streams differ ({g.size} vs {c.size} bytes)"
    y = _cuda.decompress(cuda.to_device(c)).copy_to_host()
    assert y.tobytes() == _cpu.decompress(c).tobytes()
    if eb > 0:
        assert_within(y, x, eb, strict=True)
    else:
        np.testing.assert_array_equal(y, x)  # lossless (NaN == NaN here)
    x2 = edge_data(np.random.default_rng([7, version, trial, 2]), shape, n, dt)
    c2 = _cpu.compress_abs(x2, eb, version)
    s = _cuda.add(cuda.to_device(c), cuda.to_device(c2)).copy_to_host()
    assert s.tobytes() == _cpu.add(c, c2).tobytes(), "sum streams differ"
