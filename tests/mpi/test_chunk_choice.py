"""A compressed call without a fixed chunk_elems pipelines with the model's chunks.

Run under mpiexec at 1-5 ranks. The message (20 MiB per rank) is one where the model's
choice differs from a constant 1 Mi-element chunk at 2-4 ranks (tests/test_chunk_rule.py
has the rule itself): the trace shows how many chunks the ring compressed per block.

The expected chunks are worked out by hand from docs/model.md ("Homomorphic ring") at the
model's defaults (``model.DEFAULTS``, ratio 16), not taken from the model's code. A ring
block is ``S/N`` of the ``S`` = 20 MiB; the model tries ``k`` = 1, 2, 4, ... chunks per
block of at least 4 MiB each, so from 3 ranks on (blocks under 8 MiB) only ``k = 1`` is
allowed, and one rank has no ring (one chunk). At 2 ranks (10 MiB blocks) ``k`` is 1 or 2:
``C = S/c + S/(2a) = 20.97 ms + 3.50 ms = 24.47 ms`` (c = 1 GB/s, a = 3 GB/s) and
``W = k alpha + S/(2 r beta) = k 0.05 ms + 5.24 ms`` (r = 16, beta = 125 MB/s); ``k = 1``
costs ``C + W = 29.76 ms``, ``k = 2`` costs ``C + W/2 + o_k = 24.47 + 2.67 + 0.03 =
27.17 ms`` (the allgather does not depend on ``k``): two chunks.
"""

from __future__ import annotations

import numpy as np
from collkit import gradient_like
from mpi4py import MPI

import ccoll
from ccoll.collectives import trace

COUNT = 5 << 20  # float32 elements per rank: 20 MiB
EB = ccoll.REL(1e-3)


def _chunks_per_block(n: int) -> int:
    """Chunks per ring block the model picks for COUNT at n ranks (module docstring)."""
    return 2 if n == 2 else 1


def _chunks_of_blocks(n: int, chunk: int) -> list[int]:
    """Chunks of at most ``chunk`` elements in each ring block (numpy.array_split's blocks)."""
    return [-(-len(b) // chunk) for b in np.array_split(np.arange(COUNT), n)]


def _compressed_chunks_per_block(comm, cc, x) -> tuple[np.ndarray, list[int] | None]:
    """Run one traced allreduce; return its result and, on rank 0, every rank's chunk count
    of the block it compressed first."""
    with trace.tracing(trace.start(comm)) as rec:
        y = cc.allreduce(x, EB)
    got = trace.gather(comm, rec)
    if got is None:
        return y, None
    n = comm.Get_size()
    counts = []
    for q, exp in enumerate(got):
        first = (q - 1) % n
        counts.append(len({e[5]["chunk"] for e in exp["events"]
                           if e[0] == "compress" and e[5]["block"] == first}))
    return y, counts


def _check_result(comm, x, y, eb_abs: float) -> None:
    exact = np.empty(x.size, np.float64)
    comm.Allreduce(x.astype(np.float64), exact, op=MPI.SUM)
    err = float(np.max(np.abs(y.astype(np.float64) - exact)))
    assert err <= eb_abs, (err, eb_abs)
    digests = comm.allgather(y.tobytes())
    assert all(d == digests[0] for d in digests)


def test_default_chunk_is_the_models(comm) -> None:
    n, r = comm.Get_size(), comm.Get_rank()
    x = gradient_like(r, COUNT, np.float32, seed=21)
    k = _chunks_per_block(n)
    block = -(-COUNT // n)  # the largest ring block
    want = -(-block // k)
    with ccoll.Communicator(comm, policy="compress") as cc:
        assert cc.chunk_elems is None
        y, counts = _compressed_chunks_per_block(comm, cc, x)
        rep = cc.last_call
    assert rep is not None and rep.compressed and rep.chunk_elems == want
    assert len(set(comm.allgather(rep.decision()))) == 1
    _check_result(comm, x, y, rep.eb_abs)
    if counts is not None and n > 1:
        assert _chunks_of_blocks(n, want) == [k] * n
        assert counts == [k] * n, (counts, k)


def test_explicit_chunk_wins(comm) -> None:
    n, r = comm.Get_size(), comm.Get_rank()
    x = gradient_like(r, COUNT, np.float32, seed=22)
    chunk = 700_000
    with ccoll.Communicator(comm, policy="compress", chunk_elems=chunk) as cc:
        y, counts = _compressed_chunks_per_block(comm, cc, x)
        rep = cc.last_call
    assert rep is not None and rep.chunk_elems == chunk
    _check_result(comm, x, y, rep.eb_abs)
    if counts is not None and n > 1:
        per_block = _chunks_of_blocks(n, chunk)
        assert counts == [per_block[(q - 1) % n] for q in range(n)], counts
