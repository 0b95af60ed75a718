"""A channel's buffer pools keep what recent calls needed and release the rest.

Calls are counted by ``Channel.check_usable`` (every call starts there); a buffer no call
needed for ``IDLE_CALLS`` calls goes, and a released receive buffer gives its pages back to
the system at once. The bench/pool_memory.py run measures the same at 2 ranks over 1,000
calls (docs/collectives.md, "Memory").
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from ccoll.collectives.channel import Channel

MiB = 1 << 20
# docs/collectives.md, "Memory": a buffer that no call needed for 32 calls goes within the
# next 8 calls; one needed again within 32 calls stays.
IDLE_CALLS = 32
GONE_AFTER = 40


@pytest.fixture
def ch():
    c = Channel(MPI.COMM_SELF.Dup(), "test", None)
    yield c
    c.close()


def call(ch: Channel, count: int = 0, nbytes: int = 0) -> list[np.ndarray]:
    """One call on the channel: it starts, and asks for ``count`` buffers of ``nbytes``."""
    ch.check_usable()
    return ch.recv_buffers(count, nbytes) if count else []


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_buffer_no_call_needs_is_released_and_its_pages_go_back(ch):
    (big,) = call(ch, 1, 64 * MiB)
    big[:] = 1  # resident now
    held = rss_kib()
    del big
    for _ in range(GONE_AFTER):
        call(ch)  # calls that need no buffer (raw ones, say)
    assert ch._pool == []
    assert held - rss_kib() > 48 * 1024, "the released buffer's pages stayed resident"


def test_sizes_that_recur_within_the_window_keep_their_buffers(ch):
    # Alternating sizes, as a DDP step's buckets: no reallocation, call after call.
    first = None
    for i in range(5 * IDLE_CALLS):
        bufs = call(ch, 4, 8 * MiB) if i % 7 == 0 else call(ch, 2, 64 << 10)
        ids = [id(b) for b in bufs]
        if first is None:
            first = ids
        assert ids == first[: len(ids)]
    assert len(ch._pool) == 4


def test_a_large_buffer_serving_small_requests_makes_way_for_a_small_one(ch):
    (big,) = call(ch, 1, 16 * MiB)
    big_id = id(big)
    del big
    for _ in range(GONE_AFTER):
        (b,) = call(ch, 1, 1 * MiB)  # served by the large one: it does not count as needed
    assert id(b) != big_id and b.size == 1 * MiB
    assert [x.size for x in ch._pool] == [1 * MiB]


def test_pinned_buffers_best_fit_and_release(ch, monkeypatch):
    from numba import cuda

    monkeypatch.setattr(cuda, "pinned_array", lambda n, dtype: np.empty(n, dtype))
    ch.check_usable()
    a, b = ch.pinned(8 * MiB), ch.pinned(1 * MiB)
    ch.unpin(a)
    ch.unpin(b)
    assert ch.pinned(512 << 10) is b  # the smallest that fits, not the first
    ch.unpin(b)
    for _ in range(GONE_AFTER):
        ch.check_usable()
        ch.unpin(ch.pinned(1 * MiB))  # keeps b needed; a is not
    assert [x.size for x in ch._pinned] == [1 * MiB]


def test_a_channel_whose_finalizer_ran_refuses_calls():
    # The finalizer runs from close() or at the interpreter's exit (weakref.finalize's
    # atexit): either way a later call must raise, not use a released communicator.
    from ccoll.errors import CollectiveError

    c = Channel(MPI.COMM_SELF.Dup(), "test", None)
    c.check_usable()
    assert not c.closed
    c._finalizer()  # as at exit: close() was never called
    assert c.closed
    with pytest.raises(CollectiveError, match="closed"):
        c.check_usable()
