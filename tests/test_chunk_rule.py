"""The pipeline chunk of a compressed call when the Communicator does not fix it.

ccoll.collectives.model.chunk_elems_for (the rule), the chunk a compressed plan takes
(the rule with the Communicator's calibration and the signature's ratio) and the
Communicator's chunk_elems option.
tests/mpi/test_chunk_choice.py checks that the ring runs with the chosen chunks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from mpi4py import MPI

import ccoll
from ccoll.collectives import model
from ccoll.collectives.policy.plan import Facts, Options, Planner
from ccoll.errors import InputError

MiB = 1 << 20
F32 = 4
SHM = replace(model.DEFAULTS, alpha=2e-6, beta=5e9)  # a fast link: fewer, larger chunks


def _chunks(count: int, ranks: int, chunk: int) -> int:
    block = -(-count // ranks)
    return -(-block // chunk)


@pytest.mark.parametrize("p", [model.DEFAULTS, SHM], ids=["defaults", "shm"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_rule_is_best_chunks_of_the_block(p: model.Params, ranks: int) -> None:
    for nbytes in (4, 1000, 3 * MiB, 8 * MiB, 20 * MiB, 64 * MiB + 12, 256 * MiB, 1 << 30):
        count = nbytes // F32
        block = -(-count // ranks)
        chunk = model.chunk_elems_for(count, F32, ranks, p)
        k = model.best_chunks(float(count * F32), ranks, p, model.DEFAULT_RATIO)
        assert k & (k - 1) == 0 and 1 <= k <= 64, (nbytes, ranks, k)
        assert chunk == -(-block // k), (nbytes, ranks)
        assert _chunks(count, ranks, chunk) == k, (nbytes, ranks)
        # No chunk under MIN_CHUNK_BYTES, unless the whole block is one chunk.
        assert k == 1 or chunk * F32 >= model.MIN_CHUNK_BYTES, (nbytes, ranks, chunk)


def test_rule_follows_the_message_and_the_link() -> None:
    d = model.DEFAULTS
    # 2 ranks at the defaults (1 Gbit/s): one chunk per block while the block is under two
    # minimum chunks, then more chunks as the message grows.
    assert model.chunk_elems_for(4 * MiB // F32, F32, 2, d) == 2 * MiB // F32  # whole block
    assert _chunks(20 * MiB // F32, 2, model.chunk_elems_for(20 * MiB // F32, F32, 2, d)) == 2
    assert model.chunk_elems_for(64 * MiB // F32, F32, 2, d) == 4 * MiB // F32  # 8 chunks
    assert _chunks(1 << 28, 2, model.chunk_elems_for(1 << 28, F32, 2, d)) == 64
    # More ranks: smaller blocks, fewer chunks.
    assert _chunks(16 * MiB, 3, model.chunk_elems_for(16 * MiB, F32, 3, d)) == 4
    # A faster link: the wire hides less of the compute, so fewer, larger chunks.
    assert model.chunk_elems_for(256 * MiB // F32, F32, 2, SHM) == 16 * MiB // F32
    assert model.chunk_elems_for(256 * MiB // F32, F32, 2, d) == 4 * MiB // F32
    # A smaller minimum chunk lets a small message pipeline too.
    assert model.chunk_elems_for(2 * MiB, F32, 2, d, min_chunk_bytes=256 << 10) < MiB


def _plan_chunk(p: model.Params, count: int, ranks: int, *, ratio: float | None = None,
                fixed: int | None = None) -> int:
    """The chunk of a compressed allreduce plan of ``count`` float32 elements per rank."""
    planner = Planner(p, Options(fixed, 0.0, "ring", None), 0)
    f = Facts("allreduce", count, F32, "compress", "homomorphic", False, False, False, False,
              ranks)
    st = planner.state(("key",), f)
    return planner.plan(st, f, ratio=ratio).chunk_elems


def test_a_compressed_plan_takes_the_rule_with_the_calibration_and_the_ratio() -> None:
    count = 256 * MiB // F32
    # The model's defaults and default ratio.
    assert _plan_chunk(model.DEFAULTS, count, 2) == model.chunk_elems_for(
        count, F32, 2, model.DEFAULTS)
    # A calibrated fast link and compressor: the rule with those parameters.
    p = replace(model.DEFAULTS, alpha=2e-6, beta=5e9, reduce=4e9, compress=2e9, add=6e9,
                decompress=3e9, chunk_overhead=50e-6)
    want = model.chunk_elems_for(count, F32, 2, p)
    assert _plan_chunk(p, count, 2) == want
    assert want != model.chunk_elems_for(count, F32, 2, model.DEFAULTS)
    # policy="compress" plans with the default ratio, whatever is sampled: its bytes do not
    # change with what other calls measured.
    assert _plan_chunk(p, count, 2, ratio=200.0) == want
    # A fixed chunk wins.
    assert _plan_chunk(p, count, 2, fixed=4096) == 4096


def test_communicator_default_is_chosen_per_call_and_an_int_is_checked() -> None:
    with ccoll.Communicator(MPI.COMM_WORLD) as cc:
        assert cc.chunk_elems is None and "chunk_elems=None" in repr(cc)
    with ccoll.Communicator(MPI.COMM_WORLD, chunk_elems=4096) as cc:
        assert cc.chunk_elems == 4096
    for bad in (0, -3, 2.5, True, "1M", 2**53 + 1, 10**400):
        with pytest.raises(InputError, match="chunk_elems must be a positive integer up to"):
            ccoll.Communicator(MPI.COMM_WORLD, chunk_elems=bad)  # type: ignore[arg-type]
    # A timeout beyond float64's range waits forever, as math.inf (it raised OverflowError).
    with ccoll.Communicator(MPI.COMM_WORLD, timeout=10**400) as cc:
        assert cc.timeout is None
