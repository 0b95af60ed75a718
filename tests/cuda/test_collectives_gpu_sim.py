"""Collectives on device arrays, in the CUDA simulator, on one rank (COMM_WORLD of size 1).

Device inputs go through the compressor's CUDA backend and, since neither MPI wheel is
CUDA-aware (nor is the simulator), through pinned host staging. The results must equal the
host path's bit for bit (the two backends make identical streams and decode them alike)
and come back as device arrays. tests/mpi/test_collectives_gpu_sim.py runs the ring with
several ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from kit import assert_within, rel_bound
from mpi4py import MPI
from numba import cuda
from numba.cuda.cudadrv import devicearray

import ccoll
from ccoll.collectives.devices import cuda_aware_mpi

COMM = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def compressing():
    """Forced compression: the default policy sends a single rank's data raw."""
    with ccoll.Communicator(COMM, policy="compress") as c:
        yield c


def data(n: int, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 1e-2
    x[rng.random(n) < 0.3] = 0
    return x.astype(dtype)


def test_simulator_mpi_is_not_cuda_aware():
    assert COMM.Get_size() == 1
    assert cuda_aware_mpi() is False


# Each dtype and each algorithm once (as tests/mpi/test_collectives_gpu_sim.py pairs them):
# on one rank both algorithms launch the same kernels (range, compress, decode).
@pytest.mark.parametrize("dtype, algorithm", [(np.float32, "homomorphic"), (np.float64, "dar")],
                         ids=["float32-homomorphic", "float64-dar"])
def test_allreduce_device_equals_host(compressing, dtype, algorithm):
    x = data(200, dtype)
    eb = ccoll.REL(1e-3)
    before = compressing.stats.compressed_calls
    want = ccoll.allreduce(x, eb=eb, comm=compressing, algorithm=algorithm)
    y = ccoll.allreduce(cuda.to_device(x), eb=eb, comm=compressing, algorithm=algorithm)
    assert compressing.stats.compressed_calls == before + 2
    assert devicearray.is_cuda_ndarray(y)
    got = y.copy_to_host()
    assert got.dtype == x.dtype and got.shape == x.shape
    assert got.tobytes() == want.tobytes()
    assert_within(got, x, rel_bound(eb.value, x), roundings=1)  # one rank: the sum is x


def test_allreduce_device_out_avg_and_nan(compressing):
    x = data(120, np.float32, seed=1).reshape(4, 30)
    x[2, 3] = np.nan
    out = cuda.device_array_like(x)
    y = ccoll.allreduce(cuda.to_device(x), eb=ccoll.ABS(1e-4), op="avg", comm=compressing,
                        out=out)
    assert y is out
    got = out.copy_to_host()
    assert np.isnan(got[2, 3])
    want = ccoll.allreduce(x, eb=ccoll.ABS(1e-4), op="avg", comm=compressing)
    assert got.tobytes() == want.tobytes()


def test_reduce_scatter_allgather_bcast_on_device(compressing):
    x = data(90, np.float64, seed=2)
    d = cuda.to_device(x)
    eb = ccoll.ABS(1e-5)
    cc = compressing
    before = cc.stats.compressed_calls
    rs = ccoll.reduce_scatter(d, eb=eb, comm=cc).copy_to_host()
    assert rs.tobytes() == ccoll.reduce_scatter(x, eb=eb, comm=cc).tobytes()
    ag = ccoll.allgather(d, eb=eb, comm=cc).copy_to_host()
    assert ag.shape == (1, 90)
    assert ag.tobytes() == ccoll.allgather(x, eb=eb, comm=cc).tobytes()
    bc = ccoll.bcast(d, eb=eb, comm=cc).copy_to_host()
    assert bc.tobytes() == ccoll.bcast(x, eb=eb, comm=cc).tobytes()
    assert cc.stats.compressed_calls == before + 6
    assert_within(bc, x, 1e-5)


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "allgather", "bcast"])
def test_exact_on_device_equals_mpi(name):
    x = data(100, np.float32, seed=3)
    fn = getattr(ccoll, name)
    got = fn(cuda.to_device(x), eb=None, comm=COMM).copy_to_host()
    assert got.tobytes() == fn(x, eb=None, comm=COMM).tobytes()


@pytest.mark.parametrize("policy", ["auto", "compress", "raw"])
def test_zero_length_device(policy):
    y = ccoll.allreduce(cuda.device_array(0, np.float32), comm=COMM, policy=policy)
    assert y.copy_to_host().size == 0
