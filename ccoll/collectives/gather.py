"""Compressed allgather and bcast: compress once, move bytes, every rank decodes them.

allgather: every rank compresses its array once (``REL`` bounds resolve against the
global range), the sizes are exchanged, ``MPI_Allgatherv`` moves the bytes, and every rank
decodes every stream, its own included, so all ranks hold identical arrays.

bcast: the root compresses, broadcasts the length and then the bytes, and every rank,
the root included, returns the decoded bytes.

A length announced by a peer is checked before anything is allocated for it: no stream of
the call's element count and dtype is longer than the format's worst case
(:func:`ccoll.compressor.format.max_nbytes`, every block raw, the largest of the format
versions), which the ring's receive buffers are sized by too. Every rank sees the same
lengths, so every rank raises the same :class:`~ccoll.errors.CollectiveError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives import trace as _trace
from ccoll.collectives.channel import Channel
from ccoll.collectives.codec import api, check_stream, max_nbytes, stream_nbytes
from ccoll.collectives.devices import HOST, DeviceLanes, HostPlace
from ccoll.collectives.layout import Layout
from ccoll.collectives.requant import decode_one
from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.compressor.format import VERSIONS
from ccoll.errors import CollectiveError

__all__ = ["allgather", "bcast", "decode_block", "check_announced", "largest_stream"]


def allgather(
    ch: Channel,
    flat: Any,
    eb: float,
    out: Any,
    deadline: Deadline,
    place: HostPlace = HOST,
    version: int = 1,
) -> None:
    """Fill ``out[q]`` with rank ``q``'s ``flat`` compressed within ``eb`` (format ``version``)."""
    comm = ch.comm
    n_ranks, r = comm.Get_size(), comm.Get_rank()
    a = api()
    rec = _trace.ACTIVE
    t0 = rec.clock() if rec is not None else 0.0
    lanes = place.lanes
    stream = a.compress_abs(flat, eb, version=version, **lanes.compress_kw())
    lanes.finish("compress")
    nb = stream_nbytes(stream)
    ch.stats.bytes_coded += nb
    if rec is not None:
        rec.span("compress", t0, rec.clock(), {"bytes": nb})
    mine = np.ascontiguousarray(place.to_host(stream, nb))
    counts = np.empty(n_ranks, dtype=np.int64)
    mine_n = np.array([nb], dtype=np.int64)
    if deadline.at is None:
        comm.Allgather(mine_n, counts)
    else:
        try:
            wait_all([comm.Iallgather(mine_n, counts)], deadline, "exchange of stream sizes")
        except BaseException:
            ch.abandon(mine_n, counts)  # MPI may still use them
            raise
    for q in range(n_ranks):
        check_announced(f"rank {q}", int(counts[q]), flat.size, flat.dtype)
    displs = np.zeros(n_ranks, dtype=np.int64)
    np.cumsum(counts[:-1], out=displs[1:])
    recv = np.empty(int(counts.sum()), dtype=np.uint8)
    req = comm.Iallgatherv([mine, MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
    ch.stats.bytes_sent += int(counts.sum()) - int(counts[(r + 1) % n_ranks])
    try:
        wait_all([req], deadline, "allgather of the compressed arrays", bulk=True)
    except BaseException:
        ch.abandon(mine, recv, counts, displs)  # MPI may still use them
        raise
    everything = place.to_place(recv)
    for q in range(n_ranks):
        lo, hi = int(displs[q]), int(displs[q]) + int(counts[q])
        got = check_stream(recv[lo:hi], flat.size, flat.dtype, eb, version)
        if got != hi - lo:
            raise_size(q, got, hi - lo)
        t0 = rec.clock() if rec is not None else 0.0
        a.decompress(everything[lo:hi], out=out[q], **lanes.kw("reduce"))
        lanes.finish("reduce")
        if rec is not None:
            rec.span("decode", t0, rec.clock(), {"block": q, "bytes": got})


def bcast(
    ch: Channel,
    flat: Any,
    eb: float,
    root: int,
    out: Any,
    deadline: Deadline,
    place: HostPlace = HOST,
    version: int = 1,
) -> None:
    """Fill ``out`` with the root's ``flat`` compressed within ``eb`` (on every rank).

    ``version``: the stream format the root compresses to (the plan's).
    """
    comm = ch.comm
    a = api()
    n = np.zeros(1, dtype=np.int64)
    host: np.ndarray | None = None
    if comm.Get_rank() == root:
        stream = a.compress_abs(flat, eb, version=version, **place.lanes.compress_kw())
        place.lanes.finish("compress")
        n[0] = stream_nbytes(stream)
        host = np.ascontiguousarray(place.to_host(stream, int(n[0])))
    try:
        _bcast(comm, n, root, deadline, "broadcast of the stream size")
    except BaseException:
        ch.abandon(n)  # MPI may still write it
        raise
    check_announced(f"the root, rank {root},", int(n[0]), flat.size, flat.dtype)
    ch.stats.bytes_coded += int(n[0])
    buf = host if host is not None else np.empty(int(n[0]), dtype=np.uint8)
    try:
        _bcast(comm, buf, root, deadline, "broadcast of the stream")
    except BaseException:
        ch.abandon(buf)
        raise
    if comm.Get_rank() != (root - 1) % comm.Get_size():
        ch.stats.bytes_sent += buf.nbytes
    got = check_stream(buf, flat.size, flat.dtype, eb, version)
    if got != buf.size:
        raise_size(root, got, buf.size)
    a.decompress(place.to_place(buf), out=out, **place.lanes.kw("reduce"))
    place.lanes.finish("reduce")


def largest_stream(count: int, dtype: np.dtype) -> int:
    """Bytes of the longest valid stream of ``count`` elements of ``dtype``, any version."""
    return max(max_nbytes(count, dtype, 1, v) for v in VERSIONS)


def check_announced(who: str, nbytes: int, count: int, dtype: np.dtype) -> None:
    """Raise :class:`CollectiveError` if no stream of ``count`` ``dtype`` has ``nbytes``."""
    cap = largest_stream(count, dtype)
    if not 0 <= nbytes <= cap:
        raise CollectiveError(
            f"{who} announced a stream of {nbytes} bytes for {count} {np.dtype(dtype)} "
            f"elements, where the longest possible is {cap} bytes; nothing was allocated for "
            "it. A peer runs another ccoll version or is corrupted; this ccoll Communicator "
            "cannot be used any more"
        )


def decode_block(
    layout: Layout, block: int, dtype: np.dtype, streams: list[Any], bound: float, out: Any,
    lanes: DeviceLanes | None = None, divide: int = 1,
) -> None:
    """Decode the chunk streams of ``block`` into ``out`` (the block's elements only).

    ``lanes``: device data decodes on the ``reduce`` lane's stream and waits for it.
    ``divide`` (host data): ``N`` for an average, divided before the one rounding to the
    dtype (:func:`~ccoll.collectives.requant.decode_one`).
    """
    dec = api().decompress
    ln = lanes if lanes is not None else DeviceLanes(None)
    kw = ln.kw("reduce")
    base = layout.blocks[block][0]
    for (lo, hi), s in zip(layout.chunks(block), streams, strict=True):
        nb = check_stream(s, hi - lo, dtype, bound)
        if divide > 1:
            decode_one(s, nb, out, lo - base, hi - base, False, None, divide)
        else:
            dec(s[:nb], out=out[lo - base : hi - base], **kw)
    ln.finish("reduce")


def _bcast(comm: MPI.Intracomm, buf: np.ndarray, root: int, deadline: Deadline, what: str) -> None:
    if deadline.at is None:
        comm.Bcast([buf, MPI.BYTE], root=root)
    else:
        wait_all([comm.Ibcast([buf, MPI.BYTE], root=root)], deadline, what, bulk=True)


def raise_size(rank: int, got: int, size: int) -> None:
    """Raise FormatError for a stream from ``rank`` whose length disagrees with its header."""
    from ccoll.errors import FormatError

    raise FormatError(f"the stream of rank {rank} is {size} bytes but its header says {got}")
