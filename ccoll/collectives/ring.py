"""Ring reduce-scatter on compressed streams, and the allgather that forwards its result.

Reduce-scatter (N ranks, N-1 steps): at step ``s`` rank ``r`` sends block ``r-s-1`` to
rank ``r+1`` and receives block ``r-s-2`` from rank ``r-1`` (indices mod N), which it
combines with its own contribution to that block; after the last step it holds block ``r``
fully reduced. Every block is cut into chunks, one stream and one message each; a chunk is
sent on as soon as its combine is done, so the combine of chunk ``k`` runs while chunk
``k+1`` is on the wire (the combine runs on the channel's worker thread while this thread
stays in MPI).

Allgather: each chunk of block ``r`` goes to rank ``r+1`` as soon as its last combine is
done, and every rank forwards what it receives (N-2 hops) and decodes it, so the
allgather of the first chunks runs while the reduce-scatter of the last ones still
computes. Decodes run on the worker and, whenever MPI leaves it nothing to do, on this
thread too. Receive buffers are sized for the worst-case stream
(:func:`ccoll.compressor.format.max_nbytes`), so no message announces a size; the real
length is read from the stream header.

What "combine" means is the algorithm's business (:class:`RingOps`): a homomorphic add of
streams, or decompress-add-recompress. Every rank decodes the same bytes (the streams the
owner of each block produced, forwarded unchanged), so every rank gets the same output bit
for bit. docs/collectives.md describes the algorithms, docs/error-bound.md the bounds.

With a split bound (:class:`~ccoll.collectives.requant.Requant`) the owner of a block
decodes each fully reduced chunk to its float64 values, divides them by ``N`` for an
average, re-compresses them with the allgather's bound into a float64 stream and forwards
that; every rank, the owner too, decodes those bytes and rounds them once to the dtype.
The allgather then moves streams that do not widen with ``N`` (docs/error-bound.md,
"Split bound"; :mod:`ccoll.collectives.requant`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from ccoll.collectives import trace as _trace
from ccoll.collectives.channel import Channel
from ccoll.collectives.codec import check_stream, max_nbytes, stream_nbytes
from ccoll.collectives.dar import DarOps, dar_bound
from ccoll.collectives.devices import HOST, HostPlace, device_add
from ccoll.collectives.homomorphic import HomomorphicOps, rank_bound
from ccoll.collectives.layout import Layout
from ccoll.collectives.requant import Requant, decode_one, requant_one
from ccoll.collectives.waiting import Deadline, drain_tasks, poll_pause, test_some
from ccoll.errors import CollectiveError, FormatError

__all__ = [
    "RingOps",
    "ring_ops",
    "ring_allreduce",
    "reduce_scatter_streams",
    "own_pieces",
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
             place: HostPlace = HOST, version: int = 1) -> RingOps:
    """Return the ring operations of ``algorithm`` on ``flat`` for a sum within ``eb_abs``.

    ``version``: the stream format of every stream the operations make (the plan's).
    """
    lanes = place.lanes
    if algorithm == "dar":
        add = partial(device_add, stream=lanes.stream("reduce")) if place.device else _host_add
        return DarOps(flat, layout, dar_bound(eb_abs, layout.size), add, lanes, version)
    return HomomorphicOps(flat, layout, rank_bound(eb_abs, layout.size), lanes, version)


def _host_add(a: np.ndarray, b: np.ndarray) -> None:
    # IEEE sums, as MPI's: Inf + (-Inf) is NaN and a sum past the largest value is ±Inf,
    # without numpy's warnings (which -W error would turn into an exception on one rank).
    with np.errstate(over="ignore", invalid="ignore"):
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
    requant: Requant | None = None,
    version: int = 1,
    divide: int = 1,
) -> None:
    """Compressed ring allreduce of ``flat`` into ``flat_out``, within ``eb_abs`` of the sum.

    Collective over ``ch``: reduce-scatter of the compressed chunks, then the allgather that
    forwards the reduced streams around the ring, chunk by chunk, as soon as each is final;
    every rank decodes the same bytes. The Communicator's compressed allreduce and the
    calibration of ``policy="auto"`` both run this. With ``requant`` (host data) the
    reduce-scatter is within ``eb_abs`` of the sum and each reduced chunk is requantized
    (:class:`Requant`) before the allgather: ``flat_out`` is then the sum (or the average)
    within ``eb_abs`` (``/ N``) plus ``requant.bound``. ``version`` is the stream format
    of every message (1 or 2; the plan's). ``divide`` (host data, no ``requant``): ``N``
    for an average, which each decode divides before its one rounding to the dtype
    (:func:`~ccoll.collectives.requant.decode_one`); ``flat_out`` is then the average.
    """
    layout = Layout(flat.size, ch.comm.Get_size(), chunk_elems)
    ops = ring_ops(flat, layout, algorithm, eb_abs, place, version)
    _traced(ch, layout, dtype, ops, None, eb_abs, flat_out, deadline, place, requant, version,
            divide)


def own_pieces(n: int, n_ranks: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Return the element ranges in which the homomorphic ring quantizes this rank's data.

    The ring of :func:`ring_allreduce` (``algorithm="homomorphic"``, ``chunk_elems``,
    ``n_ranks`` ranks, ``n`` elements) compresses each chunk of its :class:`Layout` once, on
    the per-rank grid of :func:`ring_ops` (``first``, or ``combine``'s ``add_data``, which
    adds the same stream to a received one in one pass): every chunk of every block, each
    on its own blocks.
    """
    layout = Layout(n, n_ranks, chunk_elems)
    return [lohi for b in range(n_ranks) for lohi in layout.chunks(b)]


def reduce_scatter_streams(
    ch: Channel,
    layout: Layout,
    dtype: np.dtype,
    ops: RingOps,
    bound: float,
    deadline: Deadline,
    place: HostPlace = HOST,
    version: int = 1,
) -> list[Any]:
    """Run the ring; return the streams of this rank's reduced block, one per chunk.

    ``place`` says where the streams live and how their bytes reach MPI
    (:mod:`ccoll.collectives.devices`); ``version`` is the format of ``ops``' streams.
    """
    return _traced(ch, layout, dtype, ops, None, bound, None, deadline, place, None, version)


def _traced(ch: Channel, layout: Layout, dtype: np.dtype, ops: RingOps | None,
            mine: list[Any] | None, bound: float, flat_out: Any, deadline: Deadline,
            place: HostPlace, requant: Requant | None = None, version: int = 1,
            divide: int = 1) -> list[Any]:
    rec = _trace.ACTIVE
    ring = _Ring(ch, layout, dtype, ops, mine, bound, flat_out, deadline, place, rec, requant,
                 version, divide)
    if rec is not None:
        t0 = rec.clock()
        final = ring.run()
        t1 = rec.clock()
        if ops is not None:
            rec.span("reduce-scatter", t0, ring.t_final or t1)
        if flat_out is not None:
            rec.span("allgather", ring.t_first_final or t0, t1)
        return final
    return ring.run()


# Priority keys of the worker's tasks (lowest first). The reduce-scatter's tasks come in
# pipeline waves: the data of step s, chunk c was produced by the left neighbour in wave
# c + s (its compress of chunk c at s = 0, its combine at step s - 1), so the combine of
# (s, c) belongs to wave c + s + 1 and is ordered with the compress of chunk c + s + 1.
# Within a wave, later steps go first (that chain, step s -> s + 1, is the critical path
# at N > 2), and a chunk's prepare just before its combine, compressions last. The
# decodes of the allgather unblock no transfer: they come after every ring task, and the
# driving thread takes host decodes too (Worker.help) when MPI leaves it nothing to do.
def _compress_key(c: int) -> tuple[int, int, int]:
    return (0, c, 0)


def _prepare_key(s: int, c: int) -> tuple[int, int, int]:
    return (0, c + s + 1, -2 * s - 2)


def _combine_key(s: int, c: int) -> tuple[int, int, int]:
    return (0, c + s + 1, -2 * s - 1)


def _requant_key(steps: int, c: int) -> tuple[int, int, int]:
    # Right after the chunk's last combine: the allgather waits for it.
    return _combine_key(steps, c)


_DECODE = (1,)


def _decode_key(t: int, c: int) -> tuple[int, int, int]:
    return (1, t, c)


class _Ring:
    """One call's ring: reduce-scatter, then (with ``flat_out``) the forwarding allgather.

    The two phases overlap chunk by chunk. Reduce-scatter (N ranks, N-1 steps): at step
    ``s`` rank ``r`` sends block ``r-s-1`` to rank ``r+1`` and receives block ``r-s-2``
    from rank ``r-1`` (indices mod N). As soon as the last combine of chunk ``c`` of block
    ``r`` is done, that stream goes to the right (allgather step 0) and is decoded here;
    at allgather step ``t`` rank ``r`` receives chunk ``c`` of block ``r-t-1``, forwards
    it (unless ``t`` is the last step) and decodes it. Every rank decodes the very bytes
    the block's owner produced, so every rank's output is identical.

    No message announces a size: every receive buffer has room for the worst-case stream
    (:func:`max_nbytes`) and the real length is read from the stream's header. Buffer
    ``c`` serves chunk ``c``'s reduce-scatter receives and then its even allgather steps;
    buffer ``max_c + c`` (N > 2) its odd ones. A buffer is reposted once its forward and
    its decode are done.

    Both phases use tag ``c`` for chunk ``c``: MPI matches messages of one sender, tag and
    communicator in the order they were sent, to receives in the order they were posted,
    and a rank sends chunk ``c``'s allgather message after all its reduce-scatter messages
    of chunk ``c``, and posts the allgather receives of chunk ``c`` after all its
    reduce-scatter receives of chunk ``c``.
    """

    def __init__(self, ch: Channel, layout: Layout, dtype: np.dtype, ops: RingOps | None,
                 mine: list[Any] | None, bound: float, flat_out: Any, deadline: Deadline,
                 place: HostPlace, rec: _trace.Recorder | None,
                 requant: Requant | None = None, version: int = 1, divide: int = 1) -> None:
        self.ch, self.layout, self.dtype, self.ops = ch, layout, dtype, ops
        self.divide = divide
        # The stream format of every message (the plan's), requantized chunks included.
        self.version = version
        self.bound, self.flat_out, self.deadline, self.place = bound, flat_out, deadline, place
        self.rec = rec
        self.requant = requant if flat_out is not None else None
        # The allgather's streams: the reduced ones, or requantized float64 ones.
        self.ag_bound = bound if self.requant is None else self.requant.bound
        self.ag_dtype = dtype if self.requant is None else np.dtype(np.float64)
        comm = self.comm = ch.comm
        n, r = self.n, self.r = comm.Get_size(), comm.Get_rank()
        self.steps = n - 1
        self.right, self.left = (r + 1) % n, (r - 1) % n
        self.nch = nch = [len(layout.chunks(b)) for b in range(n)]
        self.max_c = max_c = max(nch)
        self.worker = ch.worker
        self.inline = layout.max_chunks <= 1
        self.gather = flat_out is not None
        self.t_final = 0.0
        self.t_first_final = 0.0
        steps = self.steps
        # The reduce-scatter steps at which chunk c arrives, and the allgather ones.
        self.arrivals = [[s for s in range(steps) if c < nch[(r - s - 2) % n]]
                         if ops is not None else [] for c in range(max_c)]
        self.ag_arrivals = [[t for t in range(steps) if c < nch[(r - t - 1) % n]]
                            if self.gather else [] for c in range(max_c)]
        self.posted = [0] * max_c
        self.ag_posted = [0] * max_c
        # Chunks whose own requantized stream is not sent yet: their allgather receives
        # wait, so that this rank's first allgather message of a chunk (tag c) still goes
        # out before anything it forwards on that tag, as the receivers match them.
        self.requant_open = [False] * max_c
        # Allgather messages are forwarded in step order, whatever order their receives
        # complete in (two may be in flight per chunk): the next step to forward, and the
        # arrivals held until the ones before them have gone.
        self.ag_fwd = [0] * max_c
        self.ag_held: list[dict[int, tuple[Any, int, int]]] = [{} for _ in range(max_c)]
        # Reduce-scatter arrivals of chunk c not yet combined; then its buffer is free.
        self.rs_open = [len(a) for a in self.arrivals]
        nbuf = max_c * (2 if self.gather and steps > 1 else 1) if steps else 0
        # A buffer serves both phases: room for the larger worst case of their streams.
        nbytes = max(max_nbytes(layout.chunk_elems, dtype, 1, version),
                     max_nbytes(layout.chunk_elems, self.ag_dtype, 1, version))
        self.bufs = place.recv_buffers(ch, nbuf, nbytes)
        self.busy = [0] * nbuf  # pending users (receive, forward, decode) of each buffer
        self.final: list[Any] = [None] * nch[r] if mine is None else list(mine)
        self.finals_left = nch[r] if mine is None else 0
        self.decodes_left = sum(nch) if self.gather else 0
        self.reqs: list[MPI.Request] = []
        self.statuses: list[MPI.Status] = []
        # (kind, step, chunk, what to keep alive or the buffer index, when it was posted)
        self.meta: list[tuple[str, int, int, Any, float]] = []

    # -- posting -----------------------------------------------------------------------

    def _clock(self) -> float:
        rec = self.rec
        return rec.clock() if rec is not None else 0.0

    def post_recv(self, c: int) -> None:
        """Post chunk ``c``'s next reduce-scatter receive, if any."""
        arr = self.arrivals[c]
        if self.posted[c] < len(arr):
            s = arr[self.posted[c]]
            self.posted[c] += 1
            self.reqs.append(self.comm.Irecv([self.bufs[c], MPI.BYTE], source=self.left, tag=c))
            self.meta.append(("recv", s, c, c, self._clock()))

    def post_ag_recv(self, c: int) -> None:
        """Post chunk ``c``'s next allgather receives while their buffers are free."""
        arr = self.ag_arrivals[c]
        while self.ag_posted[c] < len(arr) and not self.rs_open[c] and not self.requant_open[c]:
            k = self.ag_posted[c]
            i = c + (k % 2) * self.max_c
            if self.busy[i]:
                return
            self.busy[i] += 1
            self.ag_posted[c] += 1
            self.reqs.append(self.comm.Irecv([self.bufs[i], MPI.BYTE], source=self.left, tag=c))
            self.meta.append(("ag recv", arr[k], c, i, self._clock()))

    def send(self, kind: str, s: int, c: int, stream: Any, keep: Any, nb: int = -1) -> None:
        """Send ``stream`` to the right; ``keep`` is the receive buffer it came in, if any.

        A received buffer is sent as it is (MPI wrote it, MPI can read it); a stream of
        this rank goes the way ``place`` says. ``nb``: the stream's length where the
        caller has it (a received stream's from its check, else -1: read from its header).
        """
        if keep is None:
            nb = stream_nbytes(stream) if nb < 0 else nb
            buf, token = self.place.for_send(stream, nb)
        else:
            buf, token = stream[:nb], None
        self.reqs.append(self.comm.Isend([buf, MPI.BYTE], dest=self.right, tag=c))
        # keeps the buffers alive until sent
        self.meta.append((kind, s, c, (stream, token, keep, nb), self._clock()))
        self.ch.stats.bytes_sent += nb

    def submit(self, key: Any, fn: Callable[[], Any], tag: Any, name: str,
               args: dict[str, Any], lane: str) -> None:
        # Device data keeps the worker's own thread (one launching thread per channel): its
        # tasks enqueue kernels on the CUDA lane's stream and wait for it before they end.
        on = None if self.place.device else lane
        fn = self.place.task(lane, fn)
        rec = self.rec
        if rec is not None:
            where = "inline" if self.inline else on or "worker"
            fn = rec.task(fn, name, {**args, "lane": where})
        self.worker.submit(key, fn, tag, inline=self.inline, lane=on)

    # -- events ------------------------------------------------------------------------

    def on_final(self, c: int, stream: Any) -> None:
        """Chunk ``c`` of this rank's block is fully reduced."""
        self.final[c] = stream
        nb = stream_nbytes(stream)  # once: a header parse is a few us of a small call
        self.ch.stats.bytes_coded += nb
        if not self.gather:
            return
        rec = self.rec
        if rec is not None:
            self.t_first_final = self.t_first_final or rec.clock()
        rq = self.requant
        if rq is not None:
            lo, hi = self.layout.chunks(self.r)[c]
            self.requant_open[c] = True
            fn = partial(requant_one, stream, self.flat_out, lo, hi, rq, self.version)
            self.submit(_requant_key(self.steps, c), fn, ("requant", -1, c, None), "requantize",
                        {"block": self.r, "chunk": c}, lane="compress")
            return
        if self.steps:
            self.send("ag send", 0, c, stream, None, nb)
        self._decode(-1, self.r, c, stream, nb, -1)

    def _decode(self, t: int, b: int, c: int, stream: Any, nb: int, buf: int) -> None:
        lo, hi = self.layout.chunks(b)[c]
        fn = partial(decode_one, stream, nb, self.flat_out, lo, hi,
                     self.requant is not None and self.dtype != self.ag_dtype,
                     self.place.lanes.kw("reduce"), self.divide)
        self.submit(_decode_key(t, c), fn, ("decode", t, c, buf), "decode",
                    {"block": b, "chunk": c, "bytes": nb}, lane="reduce")

    def release(self, i: int) -> None:
        """One user of buffer ``i`` is done; repost the chunk's receives if it is free."""
        self.busy[i] -= 1
        if not self.busy[i]:
            self.post_ag_recv(i % self.max_c)

    def on_mpi(self, i: int, status: MPI.Status) -> None:
        kind, s, c, keep, t_post = self.meta[i]
        rec = self.rec
        if kind == "send" or kind == "ag send":
            stream, token, buf, nb = keep
            self.place.sent(token)
            if rec is not None:
                b = (self.r - s - 1) % self.n if kind == "send" else (self.r - s) % self.n
                rec.span(kind, t_post, rec.clock(), {"step": s, "chunk": c, "block": b,
                         "bytes": nb})
            if buf is not None:
                self.release(buf)
            return
        b = (self.r - s - 2) % self.n if kind == "recv" else (self.r - s - 1) % self.n
        lo, hi = self.layout.chunks(b)[c]
        raw = self.bufs[keep]
        if kind == "recv":
            nb = check_stream(raw, hi - lo, self.dtype, self.bound, self.version)
        else:
            nb = check_stream(raw, hi - lo, self.ag_dtype, self.ag_bound, self.version)
        if status.Get_count(MPI.BYTE) != nb:
            what = f"ring step {s}" if kind == "recv" else f"allgather step {s}"
            raise FormatError(
                f"{what}: received {status.Get_count(MPI.BYTE)} bytes for a stream of "
                f"{nb} bytes"
            )
        if rec is not None:
            rec.span(kind, t_post, rec.clock(), {"step": s, "chunk": c, "block": b,
                     "bytes": nb})
        view = self.place.received(raw, nb)
        if kind == "recv":
            ops = self.ops
            assert ops is not None
            self.submit(_combine_key(s, c), partial(ops.combine, b, c, view),
                        ("combine", s, c, None), "combine",
                        {"step": s, "chunk": c, "block": b, "bytes": nb}, lane="reduce")
            return
        if s + 1 < self.steps:
            self.busy[keep] += 1
            self.ag_held[c][s] = (raw, keep, nb)
            self._forward_in_order(c)
        self.busy[keep] += 1
        self._decode(s, b, c, view, nb, keep)
        self.release(keep)  # the receive itself

    def _forward_in_order(self, c: int) -> None:
        """Forward chunk ``c``'s held allgather arrivals whose earlier steps have gone.

        Two receives of a chunk can be in flight and complete in either order; the right
        neighbour matches what it receives on tag ``c`` in the order it was sent.
        """
        arr, held = self.ag_arrivals[c], self.ag_held[c]
        while self.ag_fwd[c] < len(arr):
            s = arr[self.ag_fwd[c]]
            if s + 1 >= self.steps:  # the last step is not forwarded
                self.ag_fwd[c] += 1
                continue
            got = held.pop(s, None)
            if got is None:
                return
            raw, keep, nb = got
            self.ag_fwd[c] += 1
            self.send("ag send", s + 1, c, raw, keep, nb)

    def on_task(self, tag: tuple[str, int, int, Any], result: Any) -> None:
        kind, s, c, buf = tag
        if kind == "first":
            if self.steps:
                self.send("send", 0, c, result, None)
            else:
                self._finish(c, result)
        elif kind == "combine":
            if s + 1 < self.steps:
                self.send("send", s + 1, c, result, None)
            else:
                self._finish(c, result)
            self.rs_open[c] -= 1
            self.post_recv(c)
            if not self.rs_open[c]:
                self.post_ag_recv(c)
        elif kind == "decode":
            self.decodes_left -= 1
            if buf >= 0:
                self.release(buf)
        elif kind == "requant":  # this rank's chunk, requantized and already decoded here
            self.decodes_left -= 1
            if self.steps:
                self.send("ag send", 0, c, result, None)
            self.requant_open[c] = False
            self.post_ag_recv(c)

    def _finish(self, c: int, stream: Any) -> None:
        self.finals_left -= 1
        rec = self.rec
        if rec is not None:
            self.t_final = rec.clock()  # the last one stays
        self.on_final(c, stream)

    # -- the loop ----------------------------------------------------------------------

    def pump_tasks(self) -> bool:
        return drain_tasks(self.worker, self.on_task)

    def pump_mpi(self) -> bool:
        return test_some(self.reqs, self.meta, self.statuses, self.on_mpi)

    def start(self) -> None:
        r, ops = self.r, self.ops
        for c in range(self.max_c):
            self.post_recv(c)
            self.post_ag_recv(c)
        if ops is None:
            for c, stream in enumerate(self.final):
                self.on_final(c, stream)
            return
        b0 = (r - 1) % self.n
        for c in range(self.nch[b0]):
            self.submit(_compress_key(c), partial(ops.first, b0, c), ("first", 0, c, None),
                        "compress", {"step": 0, "chunk": c, "block": b0}, lane="compress")
        self.pump_tasks()
        for s in range(self.steps):
            b = (r - s - 2) % self.n
            for c in range(self.nch[b]):
                self.submit(_prepare_key(s, c), partial(ops.prepare, b, c),
                            ("prepare", s, c, None), "prepare",
                            {"step": s, "chunk": c, "block": b}, lane="compress")
                if self.inline:
                    self.pump_mpi()

    def run(self) -> list[Any]:
        try:
            with self.place.lanes.busy():
                return self._run()
        except BaseException:
            # MPI may still write into the receive buffers and read the streams of the
            # operations left pending: they must outlive this call (Channel.abandon).
            self.ch.abandon(self.reqs, self.meta, self.bufs)
            raise

    def _run(self) -> list[Any]:
        self.start()
        rec, worker, deadline = self.rec, self.worker, self.deadline
        stage = "ring allreduce" if self.gather else "ring reduce-scatter"
        pause = 20e-6
        while self.finals_left or self.decodes_left or self.reqs or worker.outstanding:
            progressed = self.pump_mpi()
            progressed = self.pump_tasks() or progressed
            if progressed:
                pause = 20e-6
                deadline.progress()  # the timeout bounds a wait without progress
                continue
            if deadline.expired():
                raise deadline.error(stage)
            if worker.closed:  # its queued tasks came back as errors; nothing more will
                raise CollectiveError(f"{stage}: this ccoll Communicator was closed during "
                                      "the call")
            # Nothing ready in MPI: decode here rather than wait for the worker. Host data
            # only: device decodes are kernel launches, which stay on the worker's thread
            # (one launching thread per channel; the CUDA simulator runs one at a time).
            if self.gather and not self.place.device and worker.help(_DECODE):
                continue
            t_wait = self._clock()
            if worker.outstanding:
                # A compute task is running: wait for it, but come back to MPI often
                # enough that the transfers in flight keep moving.
                worker.wait(pause if self.reqs else min(0.05, deadline.remaining() or 0.05))
                if rec is not None:
                    rec.span("wait worker", t_wait, rec.clock(), {"pause_us": pause * 1e6})
                pause = min(2 * pause, _POLL_MAX_S)
            elif self.reqs:
                # Poll with sleeps rather than block in MPI_Waitsome, which spins on a core
                # that this rank's worker or another rank's compressor needs.
                pause = poll_pause(pause, deadline)
                if rec is not None:
                    rec.span("sleep", t_wait, rec.clock())
            else:
                raise AssertionError(f"{stage} stalled with nothing in flight")
        place = self.place
        if place.device and not place.cuda_aware:  # type: ignore[attr-defined]
            for b in self.bufs:
                place.sent(b)
        return self.final
