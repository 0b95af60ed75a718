"""Recursive halving and doubling on compressed streams: ``2 log2 N`` steps, not ``2(N-1)``.

The ring (:mod:`ccoll.collectives.ring`) takes ``N - 1`` steps to reduce-scatter and
``N - 1`` to allgather; between many nodes their latency, which compression cannot
shorten, and the ever wider partial sums that the ring forwards (a sum of ``k`` streams is
about ``g log2 k`` bits wider per value, docs/model.md) take over. This schedule is
Rabenseifner's, on streams:

- **Reduce-scatter by recursive halving.** ``Q = 2**m`` ranks, ``Q`` owner blocks (the
  32-element blocks of the format, split as ``numpy.array_split`` does). At step ``j``
  (``mask = Q >> (j + 1)``) rank ``v`` holds partial sums of ``2 * mask`` owner blocks; it
  sends the half its partner ``v ^ mask`` keeps and adds the partner's streams of its own
  half (``add_data`` of its own data at step 0, ``add`` of two partial sums later). After
  ``m`` steps it holds owner block ``v`` summed over all ranks. Half of the bytes go at
  step 0, as fresh streams, a quarter as sums of two, and so on.
- **Allgather by recursive doubling.** At step ``k`` each rank sends the one stream of the
  ``2**k`` final blocks it holds to ``v ^ 2**k``, decodes the one it receives and joins
  the two (:func:`~ccoll.compressor.cpu.slices.concat`). The final streams travel
  unchanged, so every rank decodes the very bytes each block's owner produced and every
  rank's output is identical. With a split bound the owner requantizes its block first
  (as the ring does, :class:`~ccoll.collectives.requant.Requant`).
- **Other rank counts.** With ``N = Q + rest`` (``0 < rest < Q``) the first ``2 rest``
  ranks pair up: each even one sends its compressed input to the odd one after it, which
  adds it to its own and takes part for both; at the end it sends the result back (one
  stream). That costs one whole message each way, which the cost model prices.

**Pieces.** The data moves in *pieces*: step 0 cuts the array into ``P`` pieces (about
one pipeline chunk each), one stream and one message each, so that compressing, sending
and adding overlap. A later step sends and adds the pieces the step before produced, as
they are; only a piece that straddles the step's halving point is cut there
(:func:`~ccoll.compressor.cpu.slices.slice_blocks`, no decoding: in either stream format
a block's bytes depend on its own values only, so a cut or a join copies them). So a
rank makes about ``P + 5 log2 N`` compress, add, cut, join and decode calls per allreduce
whatever ``N``, where one call per block and step would make ``O(N)`` (each costs tens of
microseconds of fixed cost, docs/model.md "Projection to many nodes").

Messages of one step go from one rank to one peer in a fixed order on one tag per step,
and each receive is matched with ``MPI_Improbe`` at the head of its (source, tag) queue,
so MPI's in-order matching pairs them and every receive gets a buffer of the message's
exact size. Integer sums of codes are exact and order-free, so the reduced codes, and
the bound (docs/error-bound.md, "Collectives"), are the ring's: without a split bound both
schedules give the same output bytes. Host data and the homomorphic algorithm only; the
streams are of the plan's format version, 1 or 2 (docs/format.md), every message of a call
the same version (a requantized block too: its raw blocks are stored in that version).
Both formats code the same quantized values, so the output does not depend on the version.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives import trace as _trace
from ccoll.collectives.channel import Channel
from ccoll.collectives.codec import api, check_stream, stream_nbytes
from ccoll.collectives.homomorphic import rank_bound
from ccoll.collectives.layout import block_bounds
from ccoll.collectives.model import halving_shape
from ccoll.collectives.requant import Requant, decode_one, requant_one
from ccoll.collectives.ring import _POLL_MAX_S
from ccoll.collectives.waiting import Deadline, drain_tasks, poll_pause, test_some
from ccoll.compressor.cpu.slices import concat, slice_blocks
from ccoll.compressor.format import BLOCK
from ccoll.errors import FormatError

__all__ = ["halving_allreduce", "own_pieces"]

_DECODE = (1,)
_RAW = "raw"  # a piece whose content is this rank's own data, not compressed yet


def halving_allreduce(
    ch: Channel,
    flat: np.ndarray,
    flat_out: np.ndarray,
    dtype: np.dtype,
    eb_abs: float,
    *,
    pieces: int,
    deadline: Deadline,
    requant: Requant | None = None,
    version: int = 1,
    divide: int = 1,
) -> None:
    """Compressed allreduce of ``flat`` into ``flat_out`` by recursive halving and doubling.

    Collective over ``ch``; the same contract as
    :func:`~ccoll.collectives.ring.ring_allreduce` with ``algorithm="homomorphic"``
    (within ``eb_abs`` of the sum; with ``requant``, the sum or average within ``eb_abs``
    (``/ N``) plus ``requant.bound``), host data only. ``pieces``: how many pieces the
    first step cuts the array into (:func:`ccoll.collectives.model.halving_pieces`).
    ``version``: the stream format of every message (1 or 2; the plan's). ``divide``: as
    :func:`~ccoll.collectives.ring.ring_allreduce`'s (the average, one rounding).
    """
    run = _Halving(ch, flat, flat_out, dtype, eb_abs, pieces, deadline, requant, version,
                   divide)
    rec = _trace.ACTIVE
    if rec is None:
        run.run()
        return
    t0 = rec.clock()
    run.run()
    rec.span("halving allreduce", t0, rec.clock(),
             {"steps": run.m, "fold": run.rest, "pieces": run.npieces, "calls": run.calls})


class _Piece:
    """A range of 32-element blocks ``[c0, c1)`` at one stage, and what it holds.

    ``base``: its content before the stage (``_RAW`` for this rank's own data), derived
    from ``parent``'s ``out`` (the same range, or cut from it). ``out``: after the stage
    (a kept piece: the received stream added to ``base``; a piece to send: ``base``,
    compressed if raw).
    """

    __slots__ = ("c0", "c1", "parent", "base", "out", "children", "busy", "stage", "pos")

    def __init__(self, c0: int, c1: int, parent: _Piece | None, stage: int, pos: int) -> None:
        self.c0, self.c1, self.parent = c0, c1, parent
        self.base: Any = None
        self.out: Any = None
        self.children: list[_Piece] = []
        self.busy = False
        self.stage, self.pos = stage, pos
        if parent is not None:
            parent.children.append(self)


class _Tree:
    """The pieces of one call on one rank, stage by stage: what the schedule sends and adds.

    Geometry only (no MPI, no task): :class:`_Halving` runs it, :func:`own_pieces`
    reads which pieces this rank quantizes its own data in. ``raw``: the pieces whose
    ``base`` is this rank's own data, each compressed (``_compress``) or added to a
    received stream (``add_data``) exactly once; they partition the array.
    """

    def __init__(self, n_ranks: int, r: int, n: int, pieces: int) -> None:
        self.m, self.rest = m, rest = halving_shape(n_ranks)
        q = 1 << m
        if r < 2 * rest:
            self.v = r // 2 if r % 2 else -1  # -1: folds into r + 1
        else:
            self.v = r - rest
        self.r, self.n = r, n
        ncell = -(-self.n // BLOCK)
        self.owner = block_bounds(ncell, q)  # the cells (32-element blocks) of owner blocks
        k = max(1, int(pieces))
        self.npieces = k
        # Per (source, tag): the messages still to come from there, in order.
        self.expect: dict[tuple[int, int], deque[tuple[str, Any]]] = {}
        # Per stage: (destination, tag, pieces to send in order); the next index to send.
        self.sends: list[tuple[int, int, list[_Piece]]] = []
        self.sent: list[int] = []
        self.decodes_left = 0
        self.final_pieces: list[_Piece] = []
        self.held_range = (0, 0)
        self.raw: list[_Piece] = []
        self._build(r, q, [(a, b) for a, b in block_bounds(ncell, k) if b > a], ncell)

    # -- geometry ------------------------------------------------------------------------

    def _real(self, v: int) -> int:
        return 2 * v + 1 if v < self.rest else v + self.rest

    def _cells(self, lo: int, hi: int) -> tuple[int, int]:
        """Cells of owner blocks ``[lo, hi)``."""
        return self.owner[lo][0], self.owner[hi - 1][1]

    def _elems(self, c0: int, c1: int) -> tuple[int, int]:
        return BLOCK * c0, min(self.n, BLOCK * c1)

    def _expect(self, src: int, tag: int, kind: str, arg: Any) -> None:
        self.expect.setdefault((src, tag), deque()).append((kind, arg))

    def _build(self, r: int, q: int, start: list[tuple[int, int]], ncell: int) -> None:
        m, v = self.m, self.v
        roots = [_Piece(a, b, None, 0, i) for i, (a, b) in enumerate(start)]
        if v < 0:  # fold into r + 1, then receive the whole result
            for p in roots:
                p.base = _RAW
            self.raw = roots
            self.sends.append((r + 1, 0, roots))
            self.sent = [0]
            if ncell:
                self._expect(r + 1, 2 * m + 1, "out", (0, ncell))
                self.decodes_left = 1
            return
        if v < self.rest:  # add the even rank's streams to this rank's own data first
            for p in roots:
                p.base = _RAW
                self._expect(r - 1, 0, "piece", p)
            self.raw = roots
        cur, lo = roots, 0
        for j in range(m):
            mask = q >> (j + 1)
            mid = self.owner[lo + mask][0]
            left: list[_Piece] = []
            right: list[_Piece] = []
            for p in cur:
                if p.c1 <= mid:
                    left.append(_Piece(p.c0, p.c1, p, j + 1, len(left)))
                elif p.c0 >= mid:
                    right.append(_Piece(p.c0, p.c1, p, j + 1, len(right)))
                else:  # straddles the halving point: cut there
                    left.append(_Piece(p.c0, mid, p, j + 1, len(left)))
                    right.append(_Piece(mid, p.c1, p, j + 1, len(right)))
            keep, give = (right, left) if v & mask else (left, right)
            peer = self._real(v ^ mask)
            self.sends.append((peer, j + 1, give))
            for p in keep:
                self._expect(peer, j + 1, "piece", p)
            cur = keep
            lo = lo + mask if v & mask else lo
        self.sent = [0] * len(self.sends)
        self.final_pieces = cur
        self.held_range = self._cells(v, v + 1)
        if self.held_range[1] > self.held_range[0]:
            self.decodes_left += 1
        for kk in range(m):
            theirs = self._peer_range(kk)
            if theirs[1] > theirs[0]:
                self._expect(self._real(v ^ (1 << kk)), m + 1 + kk, "ag", (kk, theirs))
                self.decodes_left += 1
        if v >= self.rest:  # this rank's own data is where its pieces start
            for p in roots:
                p.out = _RAW
                # Its children (the first step's halves) start from it, uncompressed; with
                # no step (one rank) the root itself is final, compressed by _final.
                for c in p.children:
                    c.base = _RAW
                self.raw.extend(p.children or [p])

    def _peer_range(self, kk: int) -> tuple[int, int]:
        """Cells the partner of doubling step ``kk`` holds (and sends) at that step."""
        mask = 1 << kk
        base = (self.v ^ mask) & ~(mask - 1)
        return self._cells(base, base + mask)


def _own_stream(flat: np.ndarray, lo: int, hi: int, eb_rank: float, version: int = 1) -> Any:
    """Compress this rank's own data ``flat[lo:hi]`` on the per-rank grid ``eb_rank``.

    What a raw piece is sent as (a stream of format ``version``); ``add_data`` adds the
    same stream to a received one.
    """
    return api().compress_abs(flat[lo:hi], eb_rank, version=version)


def own_pieces(n: int, n_ranks: int, rank: int, pieces: int) -> list[tuple[int, int]]:
    """Return the element ranges in which :func:`halving_allreduce` quantizes this rank's data.

    The schedule on ``n_ranks`` ranks with ``pieces`` quantizes ``rank``'s data once, in the
    pieces of :class:`_Tree` whose base is that data (the first step's halves, or whole
    pieces on ranks that fold), on the per-rank grid (:func:`_own_stream`), each on its own
    blocks. Both stream formats code the same quantized values (docs/format.md, "Format
    version 2"), so this holds for either.
    """
    tree = _Tree(n_ranks, rank, n, pieces)
    return [tree._elems(p.c0, p.c1) for p in tree.raw]


class _Halving(_Tree):
    """One call: the pieces of every stage (:class:`_Tree`) and the event loop that runs them.

    Tags: the fold of an even rank into the odd one after it (0), halving steps
    ``1 .. m``, doubling steps ``m + 1 .. 2m``, the result back to a folded rank ``2m + 1``.
    """

    def __init__(self, ch: Channel, flat: np.ndarray, flat_out: np.ndarray, dtype: np.dtype,
                 eb_abs: float, pieces: int, deadline: Deadline,
                 requant: Requant | None, version: int = 1, divide: int = 1) -> None:
        self.ch, self.flat, self.flat_out, self.dtype = ch, flat, flat_out, dtype
        self.divide = divide
        self.deadline, self.requant = deadline, requant
        self.version = version
        self.comm = comm = ch.comm
        self.worker = ch.worker
        self.rec = _trace.ACTIVE
        n_ranks, r = comm.Get_size(), comm.Get_rank()
        self.bound = eb_abs
        self.eb_rank = rank_bound(eb_abs, n_ranks)
        self.ag_bound = eb_abs if requant is None else requant.bound
        self.ag_dtype = dtype if requant is None else np.dtype(np.float64)
        self._api = api()
        self.calls = 0
        self.reqs: list[MPI.Request] = []
        self.statuses: list[MPI.Status] = []
        self.meta: list[tuple[str, Any]] = []
        self.arrived: dict[int, tuple[Any, int]] = {}  # id(kept piece) -> (stream, bytes)
        self.final_done = False
        # The allgather: the one stream of the blocks this rank holds, their cells, the
        # step, whether its send went, what each step received, a join in flight.
        self.held: Any = None
        self.ag_step = 0
        self.ag_sent = False
        self.ag_recv: dict[int, Any] = {}
        self.joining = False
        self.out_sent = False
        super().__init__(n_ranks, r, flat.size, pieces)

    # -- tasks ---------------------------------------------------------------------------

    def submit(self, key: Any, fn: Callable[[], Any], tag: Any, name: str,
               args: dict[str, Any], lane: str) -> None:
        self.calls += 1
        rec = self.rec
        if rec is not None:
            fn = rec.task(fn, name, {**args, "lane": lane})
        self.worker.submit(key, fn, tag, lane=lane)

    def _compress(self, p: _Piece) -> Any:
        lo, hi = self._elems(p.c0, p.c1)
        return _own_stream(self.flat, lo, hi, self.eb_rank, self.version)

    def _combine(self, p: _Piece, received: Any) -> Any:
        if p.base is _RAW:
            lo, hi = self._elems(p.c0, p.c1)
            return self._api.add_data(received, self.flat[lo:hi], self.eb_rank)
        return self._api.add(received, p.base)

    @staticmethod
    def _key(p: _Piece, combine: int) -> tuple[int, int, int]:
        """Return a task's priority: step by step, and within a step interleaved.

        The ``pos``-th piece sent and the ``pos``-th piece kept alternate, so additions
        start as soon as the partner's first pieces arrive.
        """
        return (0, p.stage, 2 * p.pos + combine)

    def _derive(self, p: _Piece) -> None:
        """``p`` has its ``out``: give each child its ``base``, cut from it where needed."""
        for c in p.children:
            if p.out is _RAW or (c.c0, c.c1) == (p.c0, p.c1):
                c.base = p.out
                self._ready(c)
            else:
                c.busy = True
                self.submit(self._key(c, 0),
                            partial(slice_blocks, p.out, c.c0 - p.c0, c.c1 - p.c0),
                            ("base", c), "cut", {"step": c.stage, "piece": c.pos}, "reduce")

    def _ready(self, p: _Piece) -> None:
        """``p`` has its ``base``: add the partner's piece if it is there."""
        got = self.arrived.pop(id(p), None)
        if got is not None:
            self._start_combine(p, got)

    def _start_combine(self, p: _Piece, got: tuple[Any, int]) -> None:
        stream, nb = got
        p.busy = True
        self.submit(self._key(p, 1), partial(self._combine, p, stream), ("out", p),
                    "combine", {"step": p.stage, "piece": p.pos, "bytes": nb}, "reduce")

    def _to_send(self, p: _Piece) -> Any:
        """Return the stream to send for ``p``; None while not ready (compressed if raw)."""
        if p.base is None or p.busy:
            return None
        if p.base is _RAW:
            p.busy = True
            self.submit(self._key(p, 0), partial(self._compress, p), ("sendable", p),
                        "compress", {"step": p.stage, "piece": p.pos}, "compress")
            return None
        return p.base

    def on_task(self, tag: tuple[str, Any], result: Any) -> None:
        kind, p = tag
        if kind == "base":  # a cut piece
            p.busy = False
            p.base = result
            self._ready(p)
        elif kind == "sendable":  # a raw piece, compressed to be sent
            p.busy = False
            p.base = result
        elif kind == "out":  # a kept piece, with the partner's added
            p.busy = False
            p.out = result
            p.base = None
            self._derive(p)
            self._check_final()
        elif kind == "final":  # this rank's block: (stream, whether it is decoded here)
            stream, decoded = result
            self.held = stream
            if decoded:
                self.decodes_left -= 1
            else:
                self._decode(stream, stream_nbytes(stream), *self.held_range)
        elif kind == "join":
            self.held = result
            self.joining = False
        elif kind == "decode":
            self.decodes_left -= 1

    def _check_final(self) -> None:
        """Once this rank's owner block is reduced: join its pieces (and requantize)."""
        if self.final_done or any(p.out is None for p in self.final_pieces):
            return
        self.final_done = True
        if not self.final_pieces:  # an empty owner block
            return
        pieces = list(self.final_pieces)
        self.submit((0, self.m + 1, 0), partial(self._final, pieces), ("final", None),
                    "final", {"pieces": len(pieces)}, "compress")

    def _final(self, pieces: list[_Piece]) -> tuple[Any, bool]:
        # (Raw pieces only on one rank, where nothing was added.)
        streams = [self._compress(p) if p.out is _RAW else p.out for p in pieces]
        stream = streams[0] if len(streams) == 1 else concat(streams)
        rq = self.requant
        if rq is None:
            return stream, False
        lo, hi = self._elems(*self.held_range)
        return requant_one(stream, self.flat_out, lo, hi, rq, self.version), True

    def _decode(self, stream: Any, nb: int, c0: int, c1: int) -> None:
        lo, hi = self._elems(c0, c1)
        wide = self.requant is not None and self.dtype != self.ag_dtype
        self.submit((1, c0, 0), partial(decode_one, stream, nb, self.flat_out, lo, hi, wide,
                                        None, self.divide),
                    ("decode", None), "decode", {"blocks": c1 - c0, "bytes": nb}, "reduce")

    # -- MPI -----------------------------------------------------------------------------

    def _isend(self, stream: Any, dest: int, tag: int) -> None:
        nb = stream_nbytes(stream)
        self.reqs.append(self.comm.Isend([stream[:nb], MPI.BYTE], dest=dest, tag=tag))
        self.meta.append(("send", stream))  # keeps the stream alive until sent
        self.ch.stats.bytes_sent += nb

    def pump_sends(self) -> None:
        for s, (dest, tag, pieces) in enumerate(self.sends):
            while self.sent[s] < len(pieces):
                p = pieces[self.sent[s]]
                stream = self._to_send(p)
                if stream is None:
                    break
                self.sent[s] += 1
                p.base = None
                self._isend(stream, dest, tag)
        if self.v >= 0 and self.final_done:
            self._pump_allgather()

    def _pump_allgather(self) -> None:
        """Run the doubling steps as far as what they need is there."""
        m = self.m
        while self.ag_step < m and not self.joining:
            kk = self.ag_step
            lo, hi = self.held_range
            mine = hi > lo
            if not self.ag_sent:
                if mine:
                    if self.held is None:
                        return  # this rank's final stream is still being made
                    self._isend(self.held, self._real(self.v ^ (1 << kk)), m + 1 + kk)
                self.ag_sent = True
            c0, c1 = self._peer_range(kk)
            if c1 > c0:
                stream = self.ag_recv.pop(kk, None)
                if stream is None:
                    return
                if mine:
                    parts = [self.held, stream] if c0 >= hi else [stream, self.held]
                    self.held, self.joining = None, True
                    self.submit((0, m + 2 + kk, 0), partial(concat, parts), ("join", None),
                                "join", {"step": kk}, "compress")
                else:
                    self.held = stream
                self.held_range = (min(lo, c0) if mine else c0, max(hi, c1) if mine else c1)
            self.ag_step += 1
            self.ag_sent = False
        if (self.ag_step == m and not self.joining and not self.out_sent
                and self.v < self.rest):
            if self.held is None and self.held_range[1] > self.held_range[0]:
                return
            self.out_sent = True
            if self.held is not None:
                self._isend(self.held, self.r - 1, 2 * m + 1)

    def post_recvs(self) -> bool:
        """Match the next expected message of each (source, tag); False if none arrived."""
        got = False
        st = MPI.Status()
        for (src, tag), q in self.expect.items():
            while q:
                msg = self.comm.Improbe(source=src, tag=tag, status=st)
                if msg is None:
                    break
                kind, arg = q.popleft()
                count = st.Get_count(MPI.BYTE)
                buf = np.empty(max(count, 1), np.uint8)
                self.reqs.append(msg.Irecv([buf, MPI.BYTE]))
                self.meta.append((kind, (arg, buf, count, tag)))
                got = True
        return got

    def on_mpi(self, i: int, status: MPI.Status) -> None:
        kind, info = self.meta[i]
        if kind == "send":
            return
        arg, buf, count, tag = info
        if kind == "piece":
            p = arg
            lo, hi = self._elems(p.c0, p.c1)
            nb = check_stream(buf, hi - lo, self.dtype, self.bound, self.version)
            _check_count(count, nb, tag)
            if p.base is None or p.busy:
                self.arrived[id(p)] = (buf, nb)
            else:
                self._start_combine(p, (buf, nb))
            return
        kk, (c0, c1) = arg if kind == "ag" else (-1, arg)
        lo, hi = self._elems(c0, c1)
        nb = check_stream(buf, hi - lo, self.ag_dtype, self.ag_bound, self.version)
        _check_count(count, nb, tag)
        self._decode(buf, nb, c0, c1)
        if kind == "ag":
            self.ag_recv[kk] = buf[:nb]

    def pump_mpi(self) -> bool:
        return test_some(self.reqs, self.meta, self.statuses, self.on_mpi)

    def pump_tasks(self) -> bool:
        return drain_tasks(self.worker, self.on_task)

    # -- the loop ------------------------------------------------------------------------

    def _done(self) -> bool:
        if self.decodes_left or self.reqs or self.worker.outstanding:
            return False
        if any(self.expect.values()):
            return False
        if any(self.sent[s] < len(p) for s, (_d, _t, p) in enumerate(self.sends)):
            return False
        if self.v >= 0 and (self.ag_step < self.m or self.joining
                            or (self.v < self.rest and not self.out_sent)):
            return False
        return True

    def run(self) -> None:
        worker, deadline = self.worker, self.deadline
        self._check_final()  # an empty owner block is final at once
        pause = 20e-6
        while True:
            progressed = self.post_recvs()
            self.pump_sends()
            progressed = self.pump_mpi() or progressed
            progressed = self.pump_tasks() or progressed
            if progressed:
                pause = 20e-6
                deadline.progress()  # the timeout bounds a wait without progress
                continue
            if self._done():
                return
            if deadline.expired():
                raise deadline.error("halving allreduce")
            if worker.help(_DECODE):
                continue
            if worker.outstanding:
                worker.wait(pause)
                pause = min(2 * pause, _POLL_MAX_S)
            else:
                pause = poll_pause(pause, deadline)


def _check_count(count: int, nb: int, tag: int) -> None:
    if count != nb:
        raise FormatError(f"halving message (tag {tag}): received {count} bytes for a "
                          f"stream of {nb} bytes")
