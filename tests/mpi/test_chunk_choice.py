"""A compressed call without a fixed chunk_elems pipelines with the model's chunks.

Run under mpiexec at 1-5 ranks. The message (20 MiB per rank) is one where the model's
choice differs from a constant 1 Mi-element chunk at 2-4 ranks (tests/test_chunk_rule.py
has the rule itself): the trace shows how many chunks the ring compressed per block.
"""

from __future__ import annotations

import numpy as np
from collkit import gradient_like
from mpi4py import MPI

import ccoll
from ccoll.collectives import model, trace
from ccoll.collectives.layout import Layout

COUNT = 5 << 20  # float32 elements per rank: 20 MiB
EB = ccoll.REL(1e-3)


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
    want = model.chunk_elems_for(COUNT, 4, n, model.DEFAULTS)
    with ccoll.Communicator(comm, policy="compress") as cc:
        assert cc.chunk_elems is None
        y, counts = _compressed_chunks_per_block(comm, cc, x)
        rep = cc.last_call
    assert rep is not None and rep.compressed and rep.chunk_elems == want
    assert len(set(comm.allgather(rep.decision()))) == 1
    _check_result(comm, x, y, rep.eb_abs)
    if counts is not None and n > 1:
        k = len(Layout(COUNT, n, want).chunks(0))
        assert k == model.best_chunks(COUNT * 4.0, n, model.DEFAULTS, model.DEFAULT_RATIO)
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
        lay = Layout(COUNT, n, chunk)
        assert counts == [len(lay.chunks((q - 1) % n)) for q in range(n)], counts
