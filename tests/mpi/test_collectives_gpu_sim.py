"""The device path of the ring with several ranks, in the CUDA simulator.

Runs only with NUMBA_ENABLE_CUDASIM=1 (`make test-cuda` starts it under mpiexec with 2
ranks). Device streams cross MPI through pinned host staging (the simulator, like the pip
MPI wheels, is not CUDA-aware); results must equal the host path's bit for bit on every
rank and stay within the bound.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("device collectives run in the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)",
                allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "cuda"))

import warp_shim  # noqa: E402
from collkit import exact_sum, global_eb, gradient_like  # noqa: E402
from kit import assert_same_on_every_rank, assert_within  # noqa: E402
from mpi4py import MPI  # noqa: E402
from numba import cuda  # noqa: E402

import ccoll  # noqa: E402
from ccoll.errors import DTypeError, InputError, MismatchError  # noqa: E402

warp_shim.install()


@pytest.mark.parametrize(
    "dtype, algorithm", [(np.float32, "homomorphic"), (np.float64, "dar")], ids=["f32-h", "f64-dar"]
)
def test_device_ring_equals_host_ring(comm, dtype, algorithm):
    # Two chunks per block: the worker thread and staged sends of a pipelined ring.
    x = gradient_like(comm.rank, 64 * comm.size + 7, dtype)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, algorithm=algorithm, chunk_elems=40, policy="compress") as c:
        want = c.allreduce(x, eb=eb)
        y = c.allreduce(cuda.to_device(x), eb=eb).copy_to_host()
    assert y.tobytes() == want.tobytes()
    assert_within(y, exact_sum(comm, x), global_eb(comm, x, eb), roundings=1)
    assert_same_on_every_rank(comm, y)


def test_device_reduce_scatter_allgather_bcast(comm):
    x = gradient_like(comm.rank, 101, np.float32)
    d = cuda.to_device(x)
    eb = ccoll.ABS(1e-4)
    with ccoll.Communicator(comm, policy="compress") as cc:
        rs = ccoll.reduce_scatter(d, eb=eb, comm=cc).copy_to_host()
        assert rs.tobytes() == ccoll.reduce_scatter(x, eb=eb, comm=cc).tobytes()
        ag = ccoll.allgather(d, eb=eb, comm=cc).copy_to_host()
        assert ag.tobytes() == ccoll.allgather(x, eb=eb, comm=cc).tobytes()
        bc = ccoll.bcast(d, eb=eb, root=comm.size - 1, comm=cc).copy_to_host()
        assert bc.tobytes() == ccoll.bcast(x, eb=eb, root=comm.size - 1, comm=cc).tobytes()
        assert cc.stats.compressed_calls == 6
    assert_same_on_every_rank(comm, bc)


def test_device_exact_equals_mpi(comm):
    x = gradient_like(comm.rank, 57, np.float64)
    y = ccoll.allreduce(cuda.to_device(x), eb=None, comm=comm).copy_to_host()
    assert y.tobytes() == ccoll.allreduce(x, eb=None, comm=comm).tobytes()


def _same_error_everywhere(comm, info, exc_type, match):
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    assert match in str(info.value), str(info.value)
    assert len(set(comm.allgather(str(info.value)))) == 1


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs two ranks to disagree")
def test_host_data_on_one_rank_and_device_data_on_another_fail_everywhere(comm):
    x = gradient_like(comm.rank, 500, np.float32)
    arg = cuda.to_device(x) if comm.rank == 0 else x
    with pytest.raises(MismatchError) as info:
        ccoll.allreduce(arg, eb=ccoll.ABS(1e-3), comm=comm, policy="compress")
    _same_error_everywhere(comm, info, MismatchError, "data location (device on rank 0; host on")


def test_out_partly_overlapping_device_x_is_refused_everywhere(comm):
    d = cuda.to_device(np.arange(11, dtype=np.float32))
    with pytest.raises(InputError) as info:
        ccoll.allreduce(d[:-1], eb=None, comm=comm, out=d[1:])
    _same_error_everywhere(comm, info, InputError, "out overlaps x")
    assert np.array_equal(d.copy_to_host(), np.arange(11, dtype=np.float32))


@pytest.mark.parametrize("policy", ["compress", "raw", "auto"])
def test_device_float16_is_refused_everywhere_and_the_communicator_still_works(comm, policy):
    # The device compressor takes float32/float64: refused in the agreement, before any
    # data moves, whatever the policy, so the default Communicator stays usable.
    x = cuda.to_device(gradient_like(comm.rank, 500, np.float16))
    with pytest.raises(DTypeError) as info:
        ccoll.allreduce(x, eb=ccoll.ABS(1e-3), comm=comm, policy=policy)
    _same_error_everywhere(comm, info, DTypeError, "device array of dtype float16")
    assert "x.astype(cupy.float32)" in str(info.value)
    y = ccoll.allreduce(cuda.to_device(np.ones(8, np.float32)), eb=None, comm=comm)
    assert np.array_equal(y.copy_to_host(), np.full(8, comm.size, np.float32))
