"""The compressed ring's allgather: chunks forwarded point to point as soon as they are final.

Run under mpiexec at 1-5 ranks. The allgather of the reduced streams starts chunk by chunk
while the reduce-scatter still runs, the driving thread decodes when the worker has only
decodes left, and chunks that arrive in any order still give every rank the same bytes.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from collkit import exact_sum, global_eb, gradient_like
from kit import assert_same_on_every_rank, assert_within

import ccoll
from ccoll.collectives import ring
from ccoll.collectives.layout import Layout

# Sizes not divisible by the ranks or the chunk; several chunks per block at 1-5 ranks.
N_ELEMS = 20_011
CHUNK = 1_003
GATE_S = 30.0


class _GatedOps:
    """Ring operations that hold rank 0's last combine until chunk 0 of the left
    neighbour's block has reached rank 0 in the allgather (its decode was queued), which
    only a pipelined allgather can have done by then."""

    def __init__(self, ops, layout: Layout, rank: int, arrived: threading.Event) -> None:
        self.ops, self.layout, self.rank = ops, layout, rank
        self.last = len(layout.chunks(rank)) - 1
        self.arrived = arrived
        self.seen: bool | None = None

    def first(self, block: int, chunk: int):
        return self.ops.first(block, chunk)

    def prepare(self, block: int, chunk: int) -> None:
        self.ops.prepare(block, chunk)

    def combine(self, block: int, chunk: int, received):
        # The last step's combines are those of this rank's own block.
        if self.rank == 0 and block == 0 and chunk == self.last:
            self.seen = self.arrived.wait(GATE_S)
        return self.ops.combine(block, chunk, received)


@pytest.mark.parametrize("algorithm", ["homomorphic", "dar"])
def test_allgather_starts_before_the_reduce_scatter_ends(comm, monkeypatch, algorithm):
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        pytest.skip("a single rank has no allgather")
    x = gradient_like(r, N_ELEMS, np.float32, seed=3)
    out = np.full(N_ELEMS, np.nan, dtype=np.float32)
    gates: list[_GatedOps] = []
    real = ring.ring_ops
    arrived = threading.Event()
    real_key = ring._decode_key

    def decode_key(t: int, c: int):
        if (t, c) == (0, 0):  # the first allgather step's chunk 0 was received
            arrived.set()
        return real_key(t, c)

    def gated(flat, layout, alg, eb_abs, place=ring.HOST, version=1):
        g = _GatedOps(real(flat, layout, alg, eb_abs, place, version), layout, r, arrived)
        gates.append(g)
        return g

    monkeypatch.setattr(ring, "ring_ops", gated)
    monkeypatch.setattr(ring, "_decode_key", decode_key)
    with ccoll.Communicator(comm, policy="compress", chunk_elems=CHUNK) as cc:
        y = cc.allreduce(x, ccoll.REL(1e-3), algorithm=algorithm, out=out)
    assert y is out
    assert len(gates) == 1
    seen = comm.bcast(gates[0].seen, root=0)
    # Rank 0's worker was held in its last combine: the left neighbour's chunk 0 reached
    # rank 0 in the allgather before that combine could finish.
    assert seen is True, "the allgather did not start before the reduce-scatter ended"
    assert_within(y, exact_sum(comm, x), global_eb(comm, x, ccoll.REL(1e-3)), roundings=1)
    assert_same_on_every_rank(comm, y)


@pytest.mark.many_ranks
@pytest.mark.parametrize("n_elems", [N_ELEMS, 7 * CHUNK + 5, 3])
def test_chunks_out_of_order_give_the_same_bytes(comm, monkeypatch, n_elems):
    """Odd ranks run their chunks last-first, so every neighbour receives them reversed."""
    r = comm.Get_rank()
    x = gradient_like(r, n_elems, np.float64, seed=5)
    with ccoll.Communicator(comm, policy="compress", chunk_elems=CHUNK) as cc:
        before = cc.allreduce(x, ccoll.REL(1e-3))
        if r % 2:
            monkeypatch.setattr(ring, "_compress_key", lambda c: (0, -c, 0))
            monkeypatch.setattr(ring, "_combine_key", lambda s, c: (0, s + 1 - c, -2 * s - 1))
            monkeypatch.setattr(ring, "_prepare_key", lambda s, c: (0, s + 1 - c, -2 * s - 2))
            monkeypatch.setattr(ring, "_decode_key", lambda t, c: (1, t, -c))
        after = cc.allreduce(x, ccoll.REL(1e-3))
        monkeypatch.undo()
        again = cc.allreduce(x, ccoll.REL(1e-3))
    # The order of the work changes no byte: every rank decodes the owner's streams.
    assert after.tobytes() == before.tobytes() == again.tobytes()
    assert_within(after, exact_sum(comm, x), global_eb(comm, x, ccoll.REL(1e-3)), roundings=1)
    assert_same_on_every_rank(comm, after)


def test_driving_thread_decodes_while_the_worker_is_busy(comm, monkeypatch):
    """The decodes of received chunks run on the driving thread too, not only the worker."""
    n, r = comm.Get_size(), comm.Get_rank()
    if n == 1:
        pytest.skip("a single rank receives no chunk")
    x = gradient_like(r, N_ELEMS, np.float32, seed=9)
    threads: set[str] = set()
    real = ring.decode_one
    driving = threading.current_thread()

    def traced(*args):
        threads.add(threading.current_thread().name)
        return real(*args)

    # Hold every other thread (the worker's lanes, whatever their names) in each decode, so
    # that the other decodes fall to the driving thread.
    def slow(*args):
        if threading.current_thread() is not driving:
            time.sleep(0.05)
        return traced(*args)

    monkeypatch.setattr(ring, "decode_one", slow)
    with ccoll.Communicator(comm, policy="compress", chunk_elems=CHUNK) as cc:
        y = cc.allreduce(x, ccoll.REL(1e-3))
    assert threading.current_thread().name in threads, threads
    assert_same_on_every_rank(comm, y)
