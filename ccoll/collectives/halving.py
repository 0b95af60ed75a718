"""Recursive halving and doubling on compressed streams: ``2 log2 N`` steps, not ``2(N-1)``.

The ring (:mod:`ccoll.collectives.ring`) takes ``N - 1`` steps to reduce-scatter and
``N - 1`` to allgather; between many nodes their latency, which compression cannot
shorten, and the ever wider partial sums that the ring forwards (a sum of ``k`` streams is
about ``g log2 k`` bits wider per value, docs/model.md) take over. This schedule is
Rabenseifner's, on streams:

- **Reduce-scatter by recursive halving.** ``Q = 2**m`` ranks, ``Q`` blocks. At step ``j``
  (``mask = Q >> (j + 1)``) rank ``v`` holds partial sums of ``2 * mask`` blocks; it sends
  the half its partner ``v ^ mask`` keeps and adds the partner's streams of its own half to
  its partial sums (``add_data`` of its own data at step 0, ``add`` of two partial sums
  later). After ``m`` steps it holds block ``v`` summed over all ranks. A block's messages
  are sums of ``1, 2, 4, ...`` streams, and most of the bytes go at the first steps, where
  the sums are narrowest.
- **Allgather by recursive doubling.** At step ``k`` (``mask = 1 << k``) each rank sends
  every final stream it holds (``mask`` blocks) to ``v ^ mask`` and receives as many; the
  streams travel unchanged, so every rank decodes the very bytes each block's owner
  produced and every rank's output is identical. With a split bound the owner requantizes
  its block first (as the ring does, :class:`~ccoll.collectives.ring.Requant`).
- **Other rank counts.** With ``N = Q + rest`` (``0 < rest < Q``) the first ``2 rest``
  ranks pair up: each even one sends its compressed input to the odd one after it, which
  adds it to its own and takes part for both; at the end it sends the ``Q`` final streams
  back. That costs one full message each way, which the cost model prices.

Each stream is one chunk of a block and one message; a chunk moves on as soon as what it
needs is done, so steps overlap chunk by chunk. Messages of one step go in a fixed order
(block, then chunk) on one tag per step, and receives are posted in that order, so MPI's
in-order matching pairs them without any size or index on the wire. Receive buffers are
sized for the worst-case stream and come from a bounded pool, handed out in step order
(which keeps the schedule free of deadlock: the lowest pending step can always move).

Integer sums of codes are exact and order-free, so the reduced codes, and the bound
(docs/error-bound.md, "Collectives"), are the ring's. Host data and the homomorphic
algorithm only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives import trace as _trace
from ccoll.collectives.channel import Channel
from ccoll.collectives.codec import api, check_stream, max_nbytes, stream_nbytes
from ccoll.collectives.homomorphic import rank_bound
from ccoll.collectives.layout import Layout
from ccoll.collectives.model import halving_shape
from ccoll.collectives.ring import Requant, _decode_one, _requant_one
from ccoll.collectives.waiting import Deadline, drain_tasks, poll_pause, test_some
from ccoll.errors import FormatError

__all__ = ["halving_allreduce"]

_POLL_MAX_S = 1e-3
_DECODE = (1,)


def halving_allreduce(
    ch: Channel,
    flat: np.ndarray,
    flat_out: np.ndarray,
    dtype: np.dtype,
    eb_abs: float,
    *,
    chunk_elems: int,
    deadline: Deadline,
    requant: Requant | None = None,
) -> None:
    """Compressed allreduce of ``flat`` into ``flat_out`` by recursive halving and doubling.

    Collective over ``ch``; the same contract as
    :func:`~ccoll.collectives.ring.ring_allreduce` with ``algorithm="homomorphic"``
    (within ``eb_abs`` of the sum; with ``requant``, the sum or average within ``eb_abs``
    (``/ N``) plus ``requant.bound``), host data only.
    """
    run = _Halving(ch, flat, flat_out, dtype, eb_abs, chunk_elems, deadline, requant)
    rec = _trace.ACTIVE
    if rec is None:
        run.run()
        return
    t0 = rec.clock()
    run.run()
    rec.span("halving allreduce", t0, rec.clock(), {"steps": run.m, "fold": run.rest})


class _SendQueue:
    """One step's messages to one peer, sent in item order as each becomes ready."""

    __slots__ = ("dest", "tag", "items", "next", "ready", "stream", "kind")

    def __init__(self, dest: int, tag: int, items: list[int], ready: Callable[[int], bool],
                 stream: Callable[[int], Any], kind: str) -> None:
        self.dest, self.tag, self.items = dest, tag, items
        self.next = 0
        self.ready, self.stream, self.kind = ready, stream, kind


class _Halving:
    """One call: the stages, the items (chunks of blocks) and the event loop that runs them.

    Stages, each on its own tag: the fold of an even rank into the odd one after it (tag
    0), the ``m`` halving steps (tags ``1 .. m``), the ``m`` doubling steps (``m + 1 ..
    2m``) and the results back to the folded ranks (``2m + 1``).
    """

    def __init__(self, ch: Channel, flat: np.ndarray, flat_out: np.ndarray, dtype: np.dtype,
                 eb_abs: float, chunk_elems: int, deadline: Deadline,
                 requant: Requant | None) -> None:
        self.ch, self.flat, self.flat_out, self.dtype = ch, flat, flat_out, dtype
        self.deadline, self.requant = deadline, requant
        self.comm = comm = ch.comm
        self.worker = ch.worker
        self.rec = _trace.ACTIVE
        n_ranks, r = comm.Get_size(), comm.Get_rank()
        self.bound = eb_abs
        self.eb_rank = rank_bound(eb_abs, n_ranks)
        self.ag_bound = eb_abs if requant is None else requant.bound
        self.ag_dtype = dtype if requant is None else np.dtype(np.float64)
        self.m, self.rest = m, rest = halving_shape(n_ranks)
        q = 1 << m
        if r < 2 * rest:
            self.v = r // 2 if r % 2 else -1  # -1: folds into r + 1
        else:
            self.v = r - rest
        self.layout = layout = Layout(flat.size, q, chunk_elems)
        # Items: every chunk of every block, block-major; item order is message order.
        self.span: list[tuple[int, int]] = []
        self.block_items: list[list[int]] = []
        for b in range(q):
            ids = []
            for lo, hi in layout.chunks(b):
                ids.append(len(self.span))
                self.span.append((lo, hi))
            self.block_items.append(ids)
        nitems = len(self.span)
        self._api = api()
        # An item's partial sum (None: this rank's own data, not compressed yet), and its
        # events in order: ("combine", tag) ... then ("send", tag) or ("final", -1).
        self.part: list[Any] = [None] * nitems
        self.events: list[list[tuple[str, int]]] = [[] for _ in range(nitems)]
        self.pos = [0] * nitems
        self.busy = [False] * nitems
        self.arrived: dict[tuple[int, int], tuple[int, int]] = {}
        # Final streams this rank holds for the allgather (own block's, and received ones).
        self.held: list[Any] = [None] * nitems
        self.sends: list[_SendQueue] = []
        # Receives in posting order: (tag, source, item, kind).
        self.plan: list[tuple[int, int, int, str]] = []
        # Position of an item in its step's message order, for the task keys: (tag, item).
        self.pos_in: dict[tuple[int, int], int] = {}
        self.decodes_left = nitems
        self._build(r, q)
        nbuf = min(len(self.plan), max(8, 2 * layout.max_chunks))
        nbytes = max(max_nbytes(layout.chunk_elems, dtype),
                     max_nbytes(layout.chunk_elems, self.ag_dtype))
        self.bufs = ch.recv_buffers(nbuf, nbytes) if nbuf else []
        self.free = list(range(nbuf))[::-1]
        self.posted = 0
        self.reqs: list[MPI.Request] = []
        self.statuses: list[MPI.Status] = []
        self.meta: list[tuple[str, int, int, Any]] = []

    def _real(self, v: int) -> int:
        return 2 * v + 1 if v < self.rest else v + self.rest

    def _build(self, r: int, q: int) -> None:
        m, v = self.m, self.v
        every = list(range(len(self.span)))
        out_tag = 2 * m + 1
        if v < 0:  # fold in, then receive the results
            for p, i in enumerate(every):
                self.events[i].append(("send", 0))
                self.plan.append((out_tag, r + 1, i, "out"))
                self.pos_in[(0, i)] = p
            self.sends.append(_SendQueue(r + 1, 0, every, self._can_send, self._own_stream,
                                         "fold"))
            return
        folded = v < self.rest
        if folded:  # add the even rank's streams first
            for p, i in enumerate(every):
                self.events[i].append(("combine", 0))
                self.plan.append((0, r - 1, i, "combine"))
                self.pos_in[(0, i)] = p
        lo, size = 0, q
        for j in range(m):
            mask = q >> (j + 1)
            peer = self._real(v ^ mask)
            low = list(range(lo, lo + mask))
            high = list(range(lo + mask, lo + 2 * mask))
            keep, give = (high, low) if v & mask else (low, high)
            kept = [i for b in keep for i in self.block_items[b]]
            given = [i for b in give for i in self.block_items[b]]
            for p, i in enumerate(given):
                self.events[i].append(("send", j + 1))
                self.pos_in[(j + 1, i)] = p
            for p, i in enumerate(kept):
                self.events[i].append(("combine", j + 1))
                self.plan.append((j + 1, peer, i, "combine"))
                self.pos_in[(j + 1, i)] = p
            self.sends.append(_SendQueue(peer, j + 1, given, self._can_send, self._own_stream,
                                         "send"))
            lo = keep[0]
            size = mask
        assert size == 1 and lo == v
        for i in self.block_items[v]:
            self.events[i].append(("final", -1))
        for k in range(m):
            mask = 1 << k
            peer_v = v ^ mask
            mine = [i for b in range(v & ~(mask - 1), (v & ~(mask - 1)) + mask)
                    for i in self.block_items[b]]
            theirs = [i for b in range(peer_v & ~(mask - 1), (peer_v & ~(mask - 1)) + mask)
                      for i in self.block_items[b]]
            tag = m + 1 + k
            self.sends.append(_SendQueue(self._real(peer_v), tag, mine, self._is_held,
                                         self._held_stream, "ag send"))
            for i in theirs:
                self.plan.append((tag, self._real(peer_v), i, "ag"))
        if folded:
            self.sends.append(_SendQueue(r - 1, out_tag, every, self._is_held,
                                         self._held_stream, "out send"))

    # -- readiness -----------------------------------------------------------------------

    def _can_send(self, i: int) -> bool:
        ev = self.events[i]
        return (self.pos[i] < len(ev) and ev[self.pos[i]][0] == "send" and not self.busy[i]
                and self.part[i] is not None)

    def _own_stream(self, i: int) -> Any:
        return self.part[i]

    def _is_held(self, i: int) -> bool:
        return self.held[i] is not None

    def _held_stream(self, i: int) -> Any:
        return self.held[i]

    # -- tasks ---------------------------------------------------------------------------

    def submit(self, key: Any, fn: Callable[[], Any], tag: Any, name: str,
               args: dict[str, Any], lane: str) -> None:
        rec = self.rec
        if rec is not None:
            fn = rec.task(fn, name, {**args, "lane": lane})
        self.worker.submit(key, fn, tag, lane=lane)

    def _compress(self, i: int) -> Any:
        lo, hi = self.span[i]
        return self._api.compress_abs(self.flat[lo:hi], self.eb_rank)

    def _combine(self, i: int, received: Any) -> Any:
        lo, hi = self.span[i]
        part = self.part[i]
        if part is None:
            return self._api.add_data(received, self.flat[lo:hi], self.eb_rank)
        return self._api.add(received, part)

    def _key(self, tag: int, i: int, combine: int) -> tuple[int, int, int]:
        """Return a task's priority key: step by step, and within a step interleaved.

        The ``p``-th compression of what a step sends and the ``p``-th addition of what it
        receives alternate, so additions start as soon as the partner's first streams
        arrive instead of after every compression.
        """
        return (0, tag, 2 * self.pos_in[(tag, i)] + combine)

    def advance(self, i: int) -> None:
        """Start item ``i``'s next event if what it needs is there."""
        if self.busy[i]:
            return
        ev = self.events[i]
        if self.pos[i] >= len(ev):
            return
        what, tag = ev[self.pos[i]]
        if what == "combine":
            got = self.arrived.pop((tag, i), None)
            if got is None:
                return
            buf, nb = got
            self.busy[i] = True
            view = self.bufs[buf][:nb]
            self.submit(self._key(tag, i, 1), partial(self._combine, i, view),
                        ("combine", tag, i, buf), "combine", {"step": tag, "item": i,
                                                              "bytes": nb}, "reduce")
        elif what == "send":
            if self.part[i] is None:
                self.busy[i] = True
                self.submit(self._key(tag, i, 0), partial(self._compress, i),
                            ("compress", tag, i, -1),
                            "compress", {"item": i}, "compress")
        else:  # final: this rank's block
            self.pos[i] += 1
            self._on_final(i)

    def _on_final(self, i: int) -> None:
        stream = self.part[i]
        if stream is None:  # one rank: nothing was added
            self.busy[i] = True
            self.pos[i] -= 1
            self.submit((0, 0, i), partial(self._compress, i), ("first", -1, i, -1),
                        "compress", {"item": i}, "compress")
            return
        self.part[i] = None
        lo, hi = self.span[i]
        rq = self.requant
        if rq is not None:
            self.submit((0, 2 + self.m, i), partial(_requant_one, stream, self.flat_out, lo,
                                                   hi, rq),
                        ("requant", -1, i, -1), "requantize", {"item": i}, "compress")
            return
        self.held[i] = stream
        self._decode(i, stream, stream_nbytes(stream), -1)

    def _decode(self, i: int, stream: Any, nb: int, buf: int) -> None:
        lo, hi = self.span[i]
        wide = self.requant is not None and self.dtype != self.ag_dtype
        self.submit((1, 0, i), partial(_decode_one, stream, nb, self.flat_out, lo, hi, wide),
                    ("decode", -1, i, buf), "decode", {"item": i, "bytes": nb}, "reduce")

    def on_task(self, tag: tuple[str, int, int, int], result: Any) -> None:
        kind, step, i, buf = tag
        if kind == "combine":
            self.busy[i] = False
            self.part[i] = result
            self.pos[i] += 1
            self._free(buf)
            self.advance(i)
        elif kind == "compress":
            self.busy[i] = False
            self.part[i] = result
        elif kind == "first":
            self.busy[i] = False
            self.part[i] = result
            self.advance(i)
        elif kind == "requant":  # own block, requantized and decoded here
            self.held[i] = result
            self.decodes_left -= 1
        elif kind == "decode":
            self.decodes_left -= 1
            if buf >= 0:
                self._free(buf)

    # -- MPI -----------------------------------------------------------------------------

    def _free(self, buf: int) -> None:
        self.free.append(buf)

    def post_recvs(self) -> None:
        plan = self.plan
        while self.posted < len(plan) and self.free:
            tag, src, i, kind = plan[self.posted]
            self.posted += 1
            buf = self.free.pop()
            self.reqs.append(self.comm.Irecv([self.bufs[buf], MPI.BYTE], source=src, tag=tag))
            self.meta.append((kind, tag, i, buf))

    def pump_sends(self) -> None:
        for q in self.sends:
            while q.next < len(q.items) and q.ready(q.items[q.next]):
                i = q.items[q.next]
                q.next += 1
                stream = q.stream(i)
                nb = stream_nbytes(stream)
                self.reqs.append(self.comm.Isend([stream[:nb], MPI.BYTE], dest=q.dest,
                                                 tag=q.tag))
                self.meta.append((q.kind, q.tag, i, stream))
                self.ch.stats.bytes_sent += nb
                if q.kind in ("fold", "send"):
                    self.pos[i] += 1  # the item is done here; the request keeps it alive
                    self.part[i] = None

    def on_mpi(self, k: int, status: MPI.Status) -> None:
        kind, tag, i, keep = self.meta[k]
        if kind in ("fold", "send", "ag send", "out send"):
            return
        buf = keep
        lo, hi = self.span[i]
        raw = self.bufs[buf]
        if kind == "combine":
            nb = check_stream(raw, hi - lo, self.dtype, self.bound)
        else:
            nb = check_stream(raw, hi - lo, self.ag_dtype, self.ag_bound)
        got = status.Get_count(MPI.BYTE)
        if got != nb:
            raise FormatError(f"halving step {tag}: received {got} bytes for a stream of "
                              f"{nb} bytes")
        if kind == "combine":
            self.arrived[(tag, i)] = (buf, nb)
            self.advance(i)
        elif kind == "ag":  # kept for the later steps; the buffer goes back at once
            stream = raw[:nb].copy()
            self._free(buf)
            self.held[i] = stream
            self._decode(i, stream, nb, -1)
        else:  # "out": the results, on a folded rank
            self._decode(i, raw, nb, buf)

    def pump_mpi(self) -> bool:
        return test_some(self.reqs, self.meta, self.statuses, self.on_mpi)

    def pump_tasks(self) -> bool:
        return drain_tasks(self.worker, self.on_task)

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        for i in range(len(self.span)):
            self.advance(i)
        worker, deadline = self.worker, self.deadline
        pause = 20e-6
        while True:
            self.post_recvs()
            self.pump_sends()
            progressed = self.pump_mpi()
            progressed = self.pump_tasks() or progressed
            if progressed:
                pause = 20e-6
                continue
            if not (self.decodes_left or self.reqs or worker.outstanding
                    or self.posted < len(self.plan)
                    or any(q.next < len(q.items) for q in self.sends)):
                return
            if deadline.expired():
                raise deadline.error("halving allreduce")
            if worker.help(_DECODE):
                continue
            if worker.outstanding:
                worker.wait(pause if self.reqs else min(0.05, deadline.remaining() or 0.05))
                pause = min(2 * pause, _POLL_MAX_S)
            elif self.reqs:
                pause = poll_pause(pause, deadline)
            else:
                raise AssertionError("halving allreduce stalled with nothing in flight")
