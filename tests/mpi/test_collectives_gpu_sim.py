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
from collkit import (  # noqa: E402
    exact_sum,
    f32_rounding,
    global_eb,
    gradient_like,
    my_block,
)
from kit import assert_same_on_every_rank, assert_within  # noqa: E402
from mpi4py import MPI  # noqa: E402
from numba import cuda  # noqa: E402

import ccoll  # noqa: E402
from ccoll.errors import InputError, MismatchError  # noqa: E402

warp_shim.install()


@pytest.mark.parametrize(
    "dtype, algorithm, eb, op",
    [(np.float32, "homomorphic", ccoll.REL(1e-3), "sum"),
     (np.float64, "dar", ccoll.ABS(1e-4), "avg")],
    ids=["f32-h-rel-sum", "f64-dar-abs-avg"],
)
def test_device_ring_equals_host_ring_on_the_cuda_lanes(comm, monkeypatch, dtype, algorithm,
                                                        eb, op):
    # Two chunks per block: the worker thread and staged sends of a pipelined ring. The
    # device result equals the host ring's bytes, on every rank, within the bound; a spy on
    # the compressor sees every compression get the compress lane's stream and grid limit,
    # every add and decode the reduce lane's. One ring per algorithm does both (each ring
    # costs seconds in the simulator); REL takes its range from the device range kernel.
    from ccoll.compressor import api as capi
    from ccoll.gpu_sched import default_scheduler

    monkeypatch.delenv("CCOLL_SCHED", raising=False)
    calls: list[tuple[str, dict]] = []
    for name in ("compress_abs", "decompress", "add_data"):
        real = getattr(capi, name)

        def spy(*args, _name=name, _real=real, **kw):
            calls.append((_name, dict(kw)))
            return _real(*args, **kw)

        monkeypatch.setattr(capi, name, spy)
    x = gradient_like(comm.rank, 64 * comm.size + 7, dtype)
    with ccoll.Communicator(comm, algorithm=algorithm, chunk_elems=40, policy="compress") as c:
        want = c.allreduce(x, eb=eb, op=op)
        calls.clear()
        y = c.allreduce(cuda.to_device(x), eb=eb, op=op).copy_to_host()
    assert y.tobytes() == want.tobytes()
    exact = exact_sum(comm, x)
    assert_within(y, exact / comm.size if op == "avg" else exact, global_eb(comm, x, eb),
                  roundings=1)
    assert_same_on_every_rank(comm, y)
    sched = default_scheduler("cuda")
    comp = sched.lane("compress").stream
    red = sched.lane("reduce").stream
    kinds = {n for n, _ in calls}
    assert kinds == ({"compress_abs", "decompress", "add_data"} if algorithm == "homomorphic"
                     else {"compress_abs", "decompress"})
    for name, kw in calls:
        if name == "compress_abs":
            assert kw == {"stream": comp, "max_blocks": sched.grid_limit("compress"),
                          "version": 1}  # the plan's stream format
        else:  # decodes also pass out=
            assert kw["stream"] is red and "max_blocks" not in kw, name


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


def _device_f16(y):
    """The host copy of a numba device float16 result, after checking its kind and dtype."""
    assert cuda.devicearray.is_cuda_ndarray(y), type(y)
    assert y.dtype == np.float16
    return y.copy_to_host()


@pytest.mark.parametrize("policy", ["compress", "raw", "auto"])
def test_device_float16_allreduce_equals_host_float16_within_bound(comm, policy):
    # Widened on the device, reduced as float32, rounded once: the host float16 path's
    # bytes, on every rank, within eb plus the float32 and the float16 rounding. One chunk
    # per block (the float32 copy takes the pipelined ring of the test above).
    x = gradient_like(comm.rank, 64 * comm.size + 7, np.float16)
    eb = ccoll.ABS(1e-3)
    with ccoll.Communicator(comm, policy=policy) as c:
        want = c.allreduce(x, eb=eb)
        y = _device_f16(c.allreduce(cuda.to_device(x), eb=eb))
        compressed = c.last_call.compressed
    assert y.shape == x.shape
    assert y.tobytes() == want.tobytes()
    if compressed:
        assert_within(y, exact_sum(comm, x), global_eb(comm, x, eb), roundings=1,
                      extra=f32_rounding(y))
    else:  # MPI's float32 sum: within (N - 1) 2^-24 sum|x| (plus O(2^-48)), rounded once
        mag = np.sum(np.abs(np.stack(comm.allgather(x)).astype(np.float64)), axis=0)
        assert_within(y, exact_sum(comm, x), 0.0, roundings=1, extra=comm.size * 2.0**-24 * mag)
    assert_same_on_every_rank(comm, y)
    if policy == "compress":
        assert compressed


def test_device_float16_allreduce_avg_into_out_and_in_place(comm):
    # 240 elements: one thread block for each element-wise kernel (widen, range, divide,
    # narrow), which run 256 threads to a block.
    x = gradient_like(comm.rank, 240, np.float16).reshape(8, 30)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, policy="compress") as c:
        want = c.allreduce(x, eb=eb, op="avg")
        out = cuda.device_array((8, 30), np.float16)
        assert c.allreduce(cuda.to_device(x), eb=eb, op="avg", out=out) is out
        y = _device_f16(out)
        assert y.tobytes() == want.tobytes()
        # The bound is on the average (docs/error-bound.md, "avg").
        assert_within(y, exact_sum(comm, x) / comm.size, global_eb(comm, x, eb),
                      roundings=1, extra=f32_rounding(y, 3))
        d = cuda.to_device(x)  # out=x: the float32 copy moves, the result lands in x
        assert c.allreduce(d, eb=None, out=d) is d
        assert d.copy_to_host().tobytes() == c.allreduce(x, eb=None).tobytes()
    assert_same_on_every_rank(comm, y)


def test_device_float16_reduce_scatter_allgather_bcast(comm):
    x = gradient_like(comm.rank, 101, np.float16)
    d = cuda.to_device(x)
    eb = ccoll.ABS(1e-3)
    root = comm.size - 1
    with ccoll.Communicator(comm, policy="compress") as cc:
        rs = _device_f16(cc.reduce_scatter(d, eb=eb))
        assert rs.tobytes() == cc.reduce_scatter(x, eb=eb).tobytes()
        ag = _device_f16(cc.allgather(d, eb=eb))
        assert ag.shape == (comm.size, 101)
        assert ag.tobytes() == cc.allgather(x, eb=eb).tobytes()
        bc = _device_f16(cc.bcast(d, eb=eb, root=root))
        assert bc.shape == (101,)
        assert bc.tobytes() == cc.bcast(x, eb=eb, root=root).tobytes()
        assert cc.stats.compressed_calls == 6
    assert_within(rs, my_block(exact_sum(comm, x), comm), 1e-3, roundings=1,
                  extra=f32_rounding(rs))
    # The decoder's float32 is within eb of a float16 value; rounding adds at most s/2.
    assert_within(ag, np.stack(comm.allgather(x)), 1e-3, roundings=1)
    assert_within(bc, comm.bcast(x, root=root), 1e-3, roundings=1)
    for y in (ag, bc):
        assert_same_on_every_rank(comm, y)


def test_device_float16_with_a_wrong_out_is_refused_everywhere(comm):
    x = cuda.to_device(gradient_like(comm.rank, 50, np.float16))
    out = cuda.device_array(50, np.float32)
    with pytest.raises(InputError) as info:
        ccoll.allreduce(x, eb=ccoll.ABS(1e-3), comm=comm, out=out)
    _same_error_everywhere(comm, info, InputError, "dtype float32; expected (50,) and float16")


def test_non_contiguous_device_float16_is_refused_everywhere(comm):
    x = cuda.to_device(np.zeros((8, 8), np.float16))[:, ::2]
    with pytest.raises(InputError) as info:
        ccoll.allreduce(x, eb=ccoll.ABS(1e-3), comm=comm)
    _same_error_everywhere(comm, info, InputError, "must be C-contiguous")


@pytest.mark.parametrize("algorithm", ["homomorphic", "dar"])
def test_device_format_2_ring_equals_host(comm, algorithm):
    # Format 2 through the CUDA kernels: the same bytes on the wire as the host path (the
    # backends write identical streams), the same result bit for bit as the host ring and
    # as format 1 (both formats code the same quantized values), within the bound.
    x = gradient_like(comm.rank, 64 * comm.size + 7, np.float32)
    eb = ccoll.REL(1e-3)
    got = {}
    for v in (1, 2):
        with ccoll.Communicator(comm, algorithm=algorithm, chunk_elems=40, policy="compress",
                                format_version=v) as c:
            want = c.allreduce(x, eb=eb)
            host_sent = c.last_call.bytes_sent
            y = c.allreduce(cuda.to_device(x), eb=eb).copy_to_host()
            rep = c.last_call
        assert rep.format_version == v and rep.bytes_sent == host_sent
        assert y.tobytes() == want.tobytes()
        got[v] = y
    assert got[2].tobytes() == got[1].tobytes()
    assert_within(got[2], exact_sum(comm, x), global_eb(comm, x, eb), roundings=1)
    assert_same_on_every_rank(comm, got[2])


def test_device_format_2_reduce_scatter_allgather_bcast(comm):
    x = gradient_like(comm.rank, 101, np.float32)
    d = cuda.to_device(x)
    eb = ccoll.ABS(1e-4)
    with ccoll.Communicator(comm, policy="compress", format_version=2) as cc:
        rs = ccoll.reduce_scatter(d, eb=eb, comm=cc).copy_to_host()
        assert cc.last_call.format_version == 2
        assert rs.tobytes() == ccoll.reduce_scatter(x, eb=eb, comm=cc).tobytes()
        ag = ccoll.allgather(d, eb=eb, comm=cc).copy_to_host()
        assert ag.tobytes() == ccoll.allgather(x, eb=eb, comm=cc).tobytes()
        bc = ccoll.bcast(d, eb=eb, root=comm.size - 1, comm=cc).copy_to_host()
        assert bc.tobytes() == ccoll.bcast(x, eb=eb, root=comm.size - 1, comm=cc).tobytes()
        assert cc.last_call.format_version == 2
    assert_within(ag, np.stack(comm.allgather(x)), 1e-4)
    assert_same_on_every_rank(comm, bc)
