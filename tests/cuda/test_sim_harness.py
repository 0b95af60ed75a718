"""The simulator runs kernels and device arrays behave as on hardware for small inputs."""

import numpy as np
from numba import cuda


@cuda.jit
def _axpy(a, x, y, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = a * x[i] + y[i]


def test_simulator_is_active():
    assert cuda.simulator_available() if hasattr(cuda, "simulator_available") else True
    from numba.cuda import simulator  # noqa: F401

    assert cuda.is_available()


def test_kernel_runs_in_simulator():
    x = np.arange(100, dtype=np.float32)
    y = np.ones(100, dtype=np.float32)
    d_out = cuda.device_array(100, dtype=np.float32)
    _axpy[4, 32](np.float32(2), cuda.to_device(x), cuda.to_device(y), d_out)
    np.testing.assert_array_equal(d_out.copy_to_host(), 2 * x + 1)
