"""A traced compressed allreduce: every rank's spans reach rank 0, every chunk is there.

Run under mpiexec at 1-5 ranks. The call is ``policy="compress"`` with small chunks, so
each block has several chunks and the ring's worker thread runs (not the inline path).
What is expected comes from the call's own settings (the ring, the chunk size, the split
it asks for), not from ccoll's decisions; which thread ran which task is not checked
(only that the trace names every thread it recorded).
"""

from __future__ import annotations

import numpy as np
import pytest
from collkit import gradient_like

import ccoll
from ccoll.collectives import trace

N_ELEMS = 5003
CHUNK = 700


def _spans(exp: dict, name: str) -> list[dict]:
    return [e[5] for e in exp["events"] if e[0] == name]


@pytest.mark.parametrize("split", [0.0, 0.5])
def test_traced_allreduce_has_every_chunk_on_every_rank(comm, split) -> None:
    n, r = comm.Get_size(), comm.Get_rank()
    x = gradient_like(r, N_ELEMS, np.float32, seed=14)
    cc = ccoll.Communicator(comm, policy="compress", chunk_elems=CHUNK, schedule="ring",
                            split=split)
    try:
        plain = cc.allreduce(x, ccoll.REL(1e-3))
        with trace.tracing(trace.start(comm)) as rec:
            traced = cc.allreduce(x, ccoll.REL(1e-3))
        assert trace.ACTIVE is None
        got = trace.gather(comm, rec)
        again = cc.allreduce(x, ccoll.REL(1e-3))
    finally:
        cc.close()
    # Tracing changes nothing in the result, and leaves nothing behind.
    assert traced.tobytes() == plain.tobytes() == again.tobytes()
    if r != 0:
        assert got is None
        return
    assert got is not None and len(got) == n
    # chunks of each ring block: numpy.array_split's blocks cut every CHUNK elements
    nch = [-(-len(b) // CHUNK) for b in np.array_split(np.arange(N_ELEMS), n)]
    for q, exp in enumerate(got):
        for e in exp["events"]:
            assert e[2] >= 0 and e[3] >= 0, (q, e)
        names = {e[0] for e in exp["events"]}
        assert {"check", "agree", "allreduce", "reduce-scatter", "allgather"} <= names, q
        # Every span's thread is named in the trace; every compute span names where it
        # was queued (docs/cli.md, "--trace").
        threads = exp["threads"]
        for e in exp["events"]:
            assert isinstance(threads.get(e[4]), str) and threads[e[4]], (q, e)
            if e[1] == "compute":
                assert isinstance(e[5].get("lane"), str), (q, e)
        first = (q - 1) % n
        # Step 0 compresses every chunk of the block this rank sends first.
        comp = {(a["block"], a["chunk"]) for a in _spans(exp, "compress")}
        assert comp == {(first, c) for c in range(nch[first])}, q
        want_rs = {(s, (q - s - 2) % n, c) for s in range(n - 1)
                   for c in range(nch[(q - s - 2) % n])}
        for kind in ("combine", "recv", "prepare"):
            seen = {(a["step"], a["block"], a["chunk"]) for a in _spans(exp, kind)}
            assert seen == want_rs, (q, kind)
        # Sends: step 0 carries the compressed chunks, steps 1.. the combined ones.
        want_send = {(s, (q - s - 1) % n, c) for s in range(n - 1)
                     for c in range(nch[(q - s - 1) % n])}
        assert {(a["step"], a["block"], a["chunk"]) for a in _spans(exp, "send")} == want_send
        # The allgather forwards the reduced chunks point to point, no size exchange:
        # at step t this rank sends block q-t and receives block q-t-1, every chunk.
        want_ag = {(t, (q - t) % n, c) for t in range(n - 1)
                   for c in range(nch[(q - t) % n])}
        assert {(a["step"], a["block"], a["chunk"]) for a in _spans(exp, "ag send")} == want_ag
        want_ag = {(t, (q - t - 1) % n, c) for t in range(n - 1)
                   for c in range(nch[(q - t - 1) % n])}
        assert {(a["step"], a["block"], a["chunk"]) for a in _spans(exp, "ag recv")} == want_ag
        assert not names & {"allgather sizes", "allgatherv"}, q
        kinds = ("send", "recv", "ag send", "ag recv")
        assert all(a["bytes"] > 0 for k in kinds for a in _spans(exp, k))
        # Every chunk of every block is decoded once on every rank; with a split bound
        # (asked for here; one rank has nothing to split) a rank's own chunks are decoded
        # as they are requantized.
        req = sorted((a["block"], a["chunk"]) for a in _spans(exp, "requantize"))
        requant = split > 0 and n > 1
        assert req == ([(q, c) for c in range(nch[q])] if requant else []), q
        dec = sorted([(a["block"], a["chunk"]) for a in _spans(exp, "decode")] + req)
        assert dec == [(b, c) for b in range(n) for c in range(nch[b])], q
    doc = trace.chrome([("allreduce", got)])
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"} == set(range(n))
