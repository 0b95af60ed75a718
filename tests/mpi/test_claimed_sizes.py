"""A peer that announces an impossible stream size: every rank refuses it, none allocates it.

Run with 2 or 3 ranks. The compressed allgather and bcast exchange the lengths of their
streams before moving the bytes. One rank here announces a length no stream of the call's
element count and dtype can have (the format's worst case, every block stored raw, is far
below it): every rank must raise the same ``CollectiveError`` before allocating a receive
buffer of that size.
"""

from __future__ import annotations

import numpy as np
import pytest
from collkit import gradient_like

import ccoll
from ccoll.collectives import gather
from ccoll.errors import CollectiveError

CLAIM = 1 << 44  # bytes: 16 TiB, for a stream of 1000 elements
N = 1000


def _announce(monkeypatch, comm, rank: int) -> None:
    """Make ``rank`` announce ``CLAIM`` bytes for its stream (its bytes stay the real ones)."""
    if comm.rank == rank:
        monkeypatch.setattr(gather, "stream_nbytes", lambda stream: CLAIM)


def _same_everywhere(comm, exc: BaseException, *parts: str) -> None:
    assert type(exc) is CollectiveError, f"{type(exc).__name__}: {exc}"
    for p in parts:
        assert p in str(exc), str(exc)
    msgs = comm.allgather(str(exc))
    assert len(set(msgs)) == 1, msgs


@pytest.mark.parametrize("collective", ["allgather", "bcast"])
def test_an_oversized_announcement_is_refused_on_every_rank(comm, monkeypatch, collective):
    culprit = comm.size - 1
    x = gradient_like(comm.rank, N, np.float32)
    # A timeout only so that a failure here cannot hang the job.
    with ccoll.Communicator(comm, policy="compress", timeout=60) as c:
        _announce(monkeypatch, comm, culprit)
        with pytest.raises(Exception) as info:
            if collective == "allgather":
                c.allgather(x, eb=ccoll.ABS(1e-3))
            else:
                c.bcast(x, eb=ccoll.ABS(1e-3), root=culprit)
        _same_everywhere(comm, info.value, f"rank {culprit}", f"{CLAIM} bytes",
                         f"{N} float32 elements")
    monkeypatch.undo()
    # The job goes on: a new Communicator works on every rank.
    with ccoll.Communicator(comm, policy="compress") as c:
        y = c.allgather(x, eb=ccoll.ABS(1e-3))
    assert y.shape == (comm.size, N)
