"""Ring reduce-scatter on compressed streams, and the allgather that forwards its result.

Reduce-scatter (N ranks, N-1 steps): at step ``s`` rank ``r`` sends block ``r-s-1`` to
rank ``r+1`` and receives block ``r-s-2`` from rank ``r-1`` (indices mod N), which it
combines with its own contribution to that block; after the last step it holds block ``r``
fully reduced. Every block is cut into chunks, one stream and one message each; a chunk is
sent on as soon as its combine is done, so the combine of chunk ``k`` runs while chunk
``k+1`` is on the wire (the combine runs on the channel's worker thread while this thread
stays in MPI). Receive buffers are sized for the worst-case stream
(:func:`ccoll.compressor.format.max_nbytes`), so no message announces a size; the real
length is read from the stream header.

What "combine" means is the algorithm's business (:class:`RingOps`): a homomorphic add of
streams, or decompress-add-recompress. The allgather then forwards the reduced streams
unchanged and every rank decodes the same bytes, so every rank gets the same output bit
for bit. docs/collectives.md describes the algorithms, docs/error-bound.md the bounds.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from ccoll.collectives import trace as _trace
from ccoll.collectives.channel import Channel
from ccoll.collectives.codec import api, check_stream, max_nbytes, stream_nbytes
from ccoll.collectives.dar import DarOps, dar_bound
from ccoll.collectives.devices import HOST, HostPlace, device_add
from ccoll.collectives.homomorphic import HomomorphicOps, rank_bound
from ccoll.collectives.layout import Layout
from ccoll.collectives.waiting import Deadline, poll_pause, wait_all
from ccoll.errors import FormatError

__all__ = [
    "RingOps",
    "ring_ops",
    "ring_allreduce",
    "reduce_scatter_streams",
    "allgather_streams",
    "decode_chunks",
]

# While both a compute task and an MPI transfer are pending, the driving thread alternates
# between MPI_Testsome and a short wait for the worker; the wait grows up to this cap.
_POLL_MAX_S = 1e-3


class RingOps(Protocol):
    """What one algorithm does with the chunks of the ring."""

    def first(self, block: int, chunk: int) -> Any:
        """Stream of this rank's own data for ``block``/``chunk``, sent at step 0."""

    def prepare(self, block: int, chunk: int) -> None:
        """Work for ``block``/``chunk`` that can run before its partner arrives (or nothing)."""

    def combine(self, block: int, chunk: int, received: Any) -> Any:
        """Stream of the received partial result combined with this rank's own data."""


def ring_ops(flat: Any, layout: Layout, algorithm: str, eb_abs: float,
             place: HostPlace = HOST) -> RingOps:
    """Return the ring operations of ``algorithm`` on ``flat`` for a sum within ``eb_abs``."""
    if algorithm == "dar":
        add = device_add if place.device else _host_add
        return DarOps(flat, layout, dar_bound(eb_abs, layout.size), add)
    return HomomorphicOps(flat, layout, rank_bound(eb_abs, layout.size))


def _host_add(a: np.ndarray, b: np.ndarray) -> None:
    np.add(a, b, out=a)


def ring_allreduce(
    ch: Channel,
    flat: Any,
    flat_out: Any,
    dtype: np.dtype,
    eb_abs: float,
    *,
    algorithm: str,
    chunk_elems: int,
    deadline: Deadline,
    place: HostPlace = HOST,
) -> None:
    """Compressed ring allreduce of ``flat`` into ``flat_out``, within ``eb_abs`` of the sum.

    Collective over ``ch``: reduce-scatter of the compressed chunks, then the allgather that
    forwards the reduced streams; every rank decodes the same bytes. The Communicator's
    compressed allreduce and the calibration of ``policy="auto"`` both run this.
    """
    layout = Layout(flat.size, ch.comm.Get_size(), chunk_elems)
    ops = ring_ops(flat, layout, algorithm, eb_abs, place)
    mine = reduce_scatter_streams(ch, layout, dtype, ops, eb_abs, deadline, place)
    allgather_streams(ch, layout, dtype, mine, eb_abs, flat_out, deadline, place)


def reduce_scatter_streams(
    ch: Channel,
    layout: Layout,
    dtype: np.dtype,
    ops: RingOps,
    bound: float,
    deadline: Deadline,
    place: HostPlace = HOST,
) -> list[Any]:
    """Run the ring; return the streams of this rank's reduced block, one per chunk.

    ``place`` says where the streams live and how their bytes reach MPI
    (:mod:`ccoll.collectives.devices`).
    """
    rec = _trace.ACTIVE
    if rec is not None:
        t_rs = rec.clock()
        final = _reduce_scatter(ch, layout, dtype, ops, bound, deadline, place, rec)
        rec.span("reduce-scatter", t_rs, rec.clock())
        return final
    return _reduce_scatter(ch, layout, dtype, ops, bound, deadline, place, None)


def _reduce_scatter(
    ch: Channel,
    layout: Layout,
    dtype: np.dtype,
    ops: RingOps,
    bound: float,
    deadline: Deadline,
    place: HostPlace,
    rec: _trace.Recorder | None,
) -> list[Any]:
    comm = ch.comm
    n_ranks, r = comm.Get_size(), comm.Get_rank()
    nch = [len(layout.chunks(b)) for b in range(n_ranks)]
    if n_ranks == 1:
        if rec is not None:
            return [rec.task(partial(ops.first, 0, c), "compress", {"block": 0, "chunk": c})()
                    for c in range(nch[0])]
        return [ops.first(0, c) for c in range(nch[0])]
    inline = layout.max_chunks <= 1
    worker = ch.worker
    steps = n_ranks - 1
    right, left = (r + 1) % n_ranks, (r - 1) % n_ranks

    def send_block(s: int) -> int:
        return (r - s - 1) % n_ranks

    def recv_block(s: int) -> int:
        return (r - s - 2) % n_ranks

    max_c = max(nch)
    # The steps at which chunk index c arrives; chunk c's buffer is reposted for the next.
    arrivals = [[s for s in range(steps) if c < nch[recv_block(s)]] for c in range(max_c)]
    bufs = place.recv_buffers(ch, max_c, max_nbytes(layout.chunk_elems, dtype))
    posted = [0] * max_c
    final: list[Any] = [None] * nch[r]
    left_to_finish = nch[r]
    reqs: list[MPI.Request] = []
    # (kind, step, chunk, what to keep alive, when it was posted: traced calls only)
    meta: list[tuple[str, int, int, Any, float]] = []

    def post_recv(c: int) -> None:
        if posted[c] < len(arrivals[c]):
            s = arrivals[c][posted[c]]
            posted[c] += 1
            reqs.append(comm.Irecv([bufs[c], MPI.BYTE], source=left, tag=c))
            meta.append(("recv", s, c, None, rec.clock() if rec is not None else 0.0))

    def send(s: int, c: int, stream: Any) -> None:
        nb = stream_nbytes(stream)
        buf, token = place.for_send(stream, nb)
        reqs.append(comm.Isend([buf, MPI.BYTE], dest=right, tag=c))
        # keeps the buffers alive until sent
        meta.append(("send", s, c, (stream, token), rec.clock() if rec is not None else 0.0))
        ch.stats.bytes_sent += nb

    def on_mpi(i: int, status: MPI.Status) -> None:
        kind, s, c, keep, t_post = meta[i]
        if kind != "recv":
            place.sent(keep[1])
            if rec is not None:
                rec.span("send", t_post, rec.clock(), {"step": s, "chunk": c,
                         "block": send_block(s), "bytes": stream_nbytes(keep[0])})
            return
        b = recv_block(s)
        lo, hi = layout.chunks(b)[c]
        nb = check_stream(bufs[c], hi - lo, dtype, bound)
        if status.Get_count(MPI.BYTE) != nb:
            raise FormatError(
                f"ring step {s}: received {status.Get_count(MPI.BYTE)} bytes for a stream of "
                f"{nb} bytes"
            )
        if rec is not None:
            rec.span("recv", t_post, rec.clock(), {"step": s, "chunk": c, "block": b,
                     "bytes": nb})
        view = place.received(bufs[c], nb)
        fn: Callable[[], Any] = partial(ops.combine, b, c, view)
        if rec is not None:
            fn = rec.task(fn, "combine", {"step": s, "chunk": c, "block": b, "bytes": nb})
        worker.submit((s, c, 1), fn, ("combine", s, c), inline=inline)

    def on_task(tag: tuple[str, int, int], result: Any) -> None:
        nonlocal left_to_finish
        kind, s, c = tag
        if kind == "first":
            send(0, c, result)
        elif kind == "combine":
            if s + 1 < steps:
                send(s + 1, c, result)
            else:
                final[c] = result
                left_to_finish -= 1
            post_recv(c)

    def pump_tasks() -> bool:
        done = worker.drain()
        for tag, result, exc in done:
            if exc is not None:
                raise exc
            on_task(tag, result)
        return bool(done)

    def pump_mpi() -> bool:
        if not reqs:
            return False
        statuses = [MPI.Status() for _ in reqs]
        idx = MPI.Request.Testsome(reqs, statuses)
        if not idx:
            return False
        # MPI fills the statuses in completion order, not request order.
        for k, i in enumerate(idx):
            on_mpi(i, statuses[k])
        for i in sorted(idx, reverse=True):
            del reqs[i]
            del meta[i]
        return True

    for c in range(max_c):
        post_recv(c)
    b0 = send_block(0)
    for c in range(nch[b0]):
        fn: Callable[[], Any] = partial(ops.first, b0, c)
        if rec is not None:
            fn = rec.task(fn, "compress", {"step": 0, "chunk": c, "block": b0})
        worker.submit((-1, c, 0), fn, ("first", 0, c), inline=inline)
    pump_tasks()
    # Priority keys (step, chunk, kind): a step's chunks go in order, and chunk c's
    # "prepare" (compressing this rank's part ahead of its partner's arrival) runs just
    # before chunk c's combine, which in turn runs before chunk c+1's prepare, so every
    # combine that unblocks a send is done as early as possible.
    for s in range(steps):
        b = recv_block(s)
        for c in range(nch[b]):
            fn = partial(ops.prepare, b, c)
            if rec is not None:
                fn = rec.task(fn, "prepare", {"step": s, "chunk": c, "block": b})
            worker.submit((s, c, 0), fn, ("prepare", s, c), inline=inline)
            if inline:
                pump_mpi()
    pause = 20e-6
    while left_to_finish or reqs or worker.outstanding:
        progressed = pump_mpi()
        progressed = pump_tasks() or progressed
        if progressed:
            pause = 20e-6
            continue
        if deadline.expired():
            raise deadline.error("ring reduce-scatter")
        t_wait = rec.clock() if rec is not None else 0.0
        if worker.outstanding:
            # A compute task is running: wait for it, but come back to MPI often enough
            # that the transfers in flight keep moving.
            worker.wait(pause if reqs else min(0.05, deadline.remaining() or 0.05))
            if rec is not None:
                rec.span("wait worker", t_wait, rec.clock(), {"pause_us": pause * 1e6})
            pause = min(2 * pause, _POLL_MAX_S)
        elif reqs:
            # Poll with sleeps rather than block in MPI_Waitsome, which spins on a core
            # that this rank's worker or another rank's compressor needs.
            pause = poll_pause(pause, deadline)
            if rec is not None:
                rec.span("sleep", t_wait, rec.clock())
        else:
            raise AssertionError("ring reduce-scatter stalled with nothing in flight")
    if place.device and not place.cuda_aware:  # type: ignore[attr-defined]
        for b in bufs:
            place.sent(b)
    return final


def decode_chunks(
    host: np.ndarray,
    buf: Any,
    layout: Layout,
    block: int,
    dtype: np.dtype,
    bound: float,
    flat_out: Any,
) -> None:
    """Decode the streams of ``block``, packed back to back, into ``flat_out``.

    ``host`` holds the bytes in host memory (their headers are read there) and ``buf`` the
    same bytes where the decoder runs (``host`` itself, or a device copy).
    """
    dec = api().decompress
    rec = _trace.ACTIVE
    pos = 0
    for c, (lo, hi) in enumerate(layout.chunks(block)):
        t0 = rec.clock() if rec is not None else 0.0
        nb = check_stream(host[pos:], hi - lo, dtype, bound)
        dec(buf[pos : pos + nb], out=flat_out[lo:hi])
        if rec is not None:
            rec.span("decode", t0, rec.clock(), {"block": block, "chunk": c, "bytes": nb})
        pos += nb
    if pos != host.size:
        raise FormatError(
            f"block {block} holds {host.size} bytes but its streams end after {pos} bytes"
        )


def allgather_streams(
    ch: Channel,
    layout: Layout,
    dtype: np.dtype,
    mine: list[Any],
    bound: float,
    flat_out: Any,
    deadline: Deadline,
    place: HostPlace = HOST,
) -> None:
    """Gather every rank's reduced block (bytes unchanged) and decode all into ``flat_out``.

    The bytes travel through host memory whatever ``place`` is: they are compressed, so the
    copies are small, and one ``MPI_Allgatherv`` on host buffers works with any MPI.
    """
    rec = _trace.ACTIVE
    t_ag = rec.clock() if rec is not None else 0.0
    comm = ch.comm
    n_ranks, r = comm.Get_size(), comm.Get_rank()
    lens = [stream_nbytes(s) for s in mine]
    packed = np.empty(sum(lens), dtype=np.uint8)
    pos = 0
    for s, nb in zip(mine, lens, strict=True):
        packed[pos : pos + nb] = place.to_host(s, nb)
        pos += nb
    mine_n = np.array([packed.size], dtype=np.int64)
    counts = np.empty(n_ranks, dtype=np.int64)
    if rec is not None:
        t_sizes = rec.clock()
        rec.span("pack", t_ag, t_sizes, {"bytes": int(packed.size)})
    if deadline.at is None:
        comm.Allgather(mine_n, counts)
    else:
        wait_all([comm.Iallgather(mine_n, counts)], deadline, "exchange of stream sizes")
    if rec is not None:
        rec.span("allgather sizes", t_sizes, rec.clock())
    displs = np.zeros(n_ranks, dtype=np.int64)
    np.cumsum(counts[:-1], out=displs[1:])
    total = int(counts.sum())
    recv = np.empty(total, dtype=np.uint8)
    t_agv = rec.clock() if rec is not None else 0.0
    req = comm.Iallgatherv([packed, MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
    ch.stats.bytes_sent += total - int(counts[(r + 1) % n_ranks])

    # Decode this rank's block (from the very bytes the others receive) while the
    # allgather moves, then the others' blocks.
    worker = ch.worker
    inline = layout.max_chunks <= 1
    own = partial(decode_chunks, packed, place.to_place(packed), layout, r, dtype, bound,
                  flat_out)
    worker.submit(0, own, "own", inline=inline)
    wait_all([req], deadline, "allgather of the reduced blocks", poll=True)
    if rec is not None:
        rec.span("allgatherv", t_agv, rec.clock(), {"bytes": total})
    while worker.outstanding:
        for _, _, exc in worker.drain():
            if exc is not None:
                raise exc
        if worker.outstanding:
            if deadline.expired():
                raise deadline.error("decoding")
            t_wait = rec.clock() if rec is not None else 0.0
            worker.wait(0.05)
            if rec is not None:
                rec.span("wait worker", t_wait, rec.clock())
    everything = place.to_place(recv)
    for q in range(n_ranks):
        if q != r:
            a, b = int(displs[q]), int(displs[q]) + int(counts[q])
            decode_chunks(recv[a:b], everything[a:b], layout, q, dtype, bound, flat_out)
    if rec is not None:
        rec.span("allgather", t_ag, rec.clock())
