"""The simulator runs kernels and device arrays behave as on hardware for small inputs."""

import numpy as np
import pytest
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


# warp_shim's syncthreads (gates instead of numba's polled events) keeps numba's rule: the
# block passes when every thread that has not returned waits there.


@cuda.jit
def _staged_sum(x, out):
    # Each stage reads what the other threads wrote before the barrier; threads past
    # half the block return early, the rest still meet at every later barrier.
    s = cuda.shared.array(64, np.int64)
    t = cuda.threadIdx.x
    s[t] = x[t]
    cuda.syncthreads()
    if t >= 32:
        return
    s[t] = s[t] + s[t + 32]
    cuda.syncthreads()
    k = 16
    while k > 0:
        v = s[t + k] if t < k else 0
        cuda.syncthreads()
        s[t] += v
        cuda.syncthreads()
        k //= 2
    if t == 0:
        out[0] = s[0]
    out[1] = cuda.syncthreads_count(t % 3 == 0)


def test_syncthreads_orders_shared_memory_and_lets_returned_threads_go():
    x = np.arange(64, dtype=np.int64) * 7 + 1
    out = cuda.device_array(2, np.int64)
    _staged_sum[1, 64](cuda.to_device(x), out)
    assert list(out.copy_to_host()) == [int(x.sum()), 11]  # t % 3 == 0 for 11 of t < 32


@cuda.jit
def _fails_in_one_thread(out):
    t = cuda.threadIdx.x
    if t == 5:
        raise ValueError("thread 5 fails")
    cuda.syncthreads()
    out[t] = 1


def test_an_exception_in_one_thread_is_the_launch_s_error():
    out = cuda.device_array(64, np.int64)
    with pytest.raises(ValueError, match="thread 5 fails"):
        _fails_in_one_thread[1, 64](out)
    _axpy[1, 32](np.float32(1), cuda.to_device(np.ones(32, np.float32)),
                 cuda.to_device(np.ones(32, np.float32)), cuda.device_array(32, np.float32))
