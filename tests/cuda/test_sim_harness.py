"""The simulator runs kernels and device arrays behave as on hardware for small inputs."""

import numpy as np
from numba import cuda


@cuda.jit
def _axpy(a, x, y, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = a * x[i] + y[i]


def test_simulator_is_active():
    """numba.cuda is the simulator, not a driver (these tests must not pass on a real GPU
    or on a numba without the simulator and believe they ran in it)."""
    from numba import config
    from numba.cuda.simulator.cudadrv.devices import FakeCUDADevice

    assert config.ENABLE_CUDASIM, "NUMBA_ENABLE_CUDASIM is not set"
    assert isinstance(cuda.get_current_device(), FakeCUDADevice), cuda.get_current_device()
    assert cuda.to_device.__module__.startswith("numba.cuda.simulator"), cuda.to_device.__module__
    assert cuda.is_available()


def test_kernel_runs_in_simulator():
    x = np.arange(100, dtype=np.float32)
    y = np.ones(100, dtype=np.float32)
    d_out = cuda.device_array(100, dtype=np.float32)
    _axpy[4, 32](np.float32(2), cuda.to_device(x), cuda.to_device(y), d_out)
    np.testing.assert_array_equal(d_out.copy_to_host(), 2 * x + 1)
