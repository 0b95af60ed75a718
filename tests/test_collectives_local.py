"""Single-process pieces of the collectives: layout, bounds, agreement codes, worker, policy."""

from __future__ import annotations

import threading
import time
from fractions import Fraction

import numpy as np
import pytest

from ccoll.collectives import model
from ccoll.collectives.agreement import shape_code
from ccoll.collectives.dar import dar_bound
from ccoll.collectives.homomorphic import rank_bound
from ccoll.collectives.layout import Layout, block_bounds
from ccoll.collectives.policy.plan import Facts, Options, Planner
from ccoll.collectives.worker import Worker


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("n", [0, 1, 2, 6, 31, 33, 1000])
def test_blocks_are_numpy_array_split(n, size):
    want = [(int(a[0]), int(a[-1]) + 1) if a.size else None
            for a in np.array_split(np.arange(n), size)]
    got = block_bounds(n, size)
    assert [hi - lo for lo, hi in got] == [len(a) for a in np.array_split(np.arange(n), size)]
    assert all(w is None or w == g for w, g in zip(want, got, strict=True))


@pytest.mark.parametrize("chunk", [1, 7, 32, 1 << 20])
def test_chunks_tile_each_block(chunk):
    lay = Layout(1003, 4, chunk)
    for b, (lo, hi) in enumerate(lay.blocks):
        ch = lay.chunks(b)
        assert ch[0][0] == lo and ch[-1][1] == hi
        assert all(c1[1] == c2[0] for c1, c2 in zip(ch, ch[1:], strict=False))
        assert all(0 < h - l <= chunk for l, h in ch)
    assert lay.max_chunks == len(lay.chunks(0))


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 5, 64, 1000])
def test_rank_bound_leaves_the_documented_margin(n_ranks):
    eb = 1e-3
    r = rank_bound(eb, n_ranks)
    m = (n_ranks + 8) * 2.0**-22
    # Quantization, conversions and additions of docs/error-bound.md stay below eb (exactly).
    q, e, u = Fraction(r), Fraction(eb), Fraction(1, 2**22)
    total = n_ranks * q * (1 + 2 * u) + 2 * u * e + u * (n_ranks + 1) * e
    assert total < e
    assert r == pytest.approx(eb / n_ranks * (1 - m), rel=1e-15)
    assert rank_bound(0.0, n_ranks) == 0.0
    assert dar_bound(eb, n_ranks) * (2 * n_ranks - 1) == pytest.approx(eb)


@pytest.mark.parametrize("n_ranks", [2, 3, 4, 5, 7, 64, 1000])
@pytest.mark.parametrize("units", [1, 2, 52, 53, 101, 2**20 + 7, 2**40 + 3, 2**52 - 1])
def test_n_rank_shares_of_a_subnormal_bound_stay_within_it(n_ranks, units):
    # Among subnormals eb/N rounded up and the margin's product rounded back to it: N shares,
    # which add exactly there, exceeded eb, and the ring's check of a received stream's
    # bound failed on some ranks (eb = 53 units, N = 3: 3 * 18 > 53).
    eb = units * 5e-324  # an exact multiple of the smallest subnormal
    r = rank_bound(eb, n_ranks)
    assert 0 <= r and n_ranks * Fraction(r) <= Fraction(eb)
    # and no more than one subnormal below the documented share (the grid is not coarser)
    low = Fraction(eb) / n_ranks * (1 - Fraction(n_ranks + 9, 2**22)) - Fraction(5e-324)
    assert Fraction(r) >= low


def test_an_average_s_sum_bound_stays_finite():
    from ccoll.collectives.homomorphic import sum_bound

    big = float(np.finfo(np.float64).max)
    assert sum_bound(1e308, 3, True) == big and sum_bound(big, 2, True) == big
    assert sum_bound(1e308, 3, False) == 1e308 and sum_bound(1e-3, 4, True) == 4e-3


def test_a_communicator_is_neither_pickled_nor_copied():
    import copy
    import pickle

    import ccoll
    from ccoll.errors import InputError

    with ccoll.Communicator() as c:
        for make in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(InputError, match="cannot be pickled or copied"):
                make(c)
        assert c.allreduce(np.ones(3, np.float32), None).tolist() == [1.0, 1.0, 1.0]


def test_shape_codes_differ_and_fit_float64():
    shapes = [(), (0,), (1,), (4, 5), (5, 4), (20,), (2, 10), (1, 20), (20, 1)]
    codes = [shape_code(s) for s in shapes]
    assert len(set(codes)) == len(codes)
    assert all(float(c) == c and c < 2**53 for c in codes)


def test_worker_runs_by_priority_and_reports_errors():
    w = Worker("test-worker")
    gate = threading.Event()
    order = []
    w.submit((0,), gate.wait, "gate")  # holds the thread while the others queue up
    for key in [(3, 0), (1, 5), (2, 0), (1, 1)]:
        w.submit(key, lambda k=key: order.append(k), key)
    w.submit((9,), lambda: 1 / 0, "boom")
    gate.set()
    done = []
    while w.outstanding:
        w.wait(1.0)
        done.extend(w.drain())
    w.close()
    assert order == [(1, 1), (1, 5), (2, 0), (3, 0)]
    errors = [exc for tag, _, exc in done if tag == "boom"]
    assert isinstance(errors[0], ZeroDivisionError)


def test_worker_help_runs_the_lowest_eligible_task_on_the_caller():
    w = Worker("test-worker")
    gate = threading.Event()
    ran: list[tuple[tuple[int, int], str]] = []
    w.submit((1, 0), gate.wait, "gate")  # an eligible task holds the worker's thread
    while w._heap:  # the worker took the gate
        time.sleep(1e-3)
    for key in [(1, 7), (1, 2), (2, 0)]:
        w.submit(key, lambda k=key: ran.append((k, threading.current_thread().name)), key)
    try:
        assert w.help((1,)) is True
        assert w.help((1,)) is True
        assert w.help((1,)) is True
        assert w.help((1,)) is False  # nothing left to take
        me = threading.current_thread().name
        assert ran == [((1, 2), me), ((1, 7), me), ((2, 0), me)]
        assert sorted(tag for tag, _, _ in w.drain()) == [(1, 2), (1, 7), (2, 0)]
    finally:
        gate.set()
        w.close()


@pytest.mark.parametrize("where", ["running", "queued"])
def test_worker_help_leaves_the_core_to_a_critical_task(where):
    # A task below min_key (the ring's compress/combine) running or waiting on the worker:
    # the caller takes nothing, so that it does not compete with it for the rank's core.
    w = Worker("test-worker")
    gate = threading.Event()
    ran: list[str] = []
    w.submit((0, 0) if where == "running" else (1, 0), gate.wait, "gate")
    while w._heap:
        time.sleep(1e-3)
    if where == "queued":
        w.submit((0, 5), lambda: ran.append(threading.current_thread().name), "ring")
    w.submit((1, 7), lambda: ran.append(threading.current_thread().name), "decode")
    try:
        assert w.help((1,)) is False
        gate.set()
        done = []
        while w.outstanding:
            w.wait(1.0)
            done.extend(w.drain())
        assert set(ran) == {"test-worker"}
    finally:
        gate.set()
        w.close()


def test_worker_help_hands_errors_to_drain():
    w = Worker("test-worker")
    gate = threading.Event()
    w.submit((1,), gate.wait, "gate")
    while w._heap:
        time.sleep(1e-3)
    w.submit((1,), lambda: 1 / 0, "boom")
    try:
        assert w.help((1,)) is True
        ((tag, result, exc),) = w.drain()
        assert tag == "boom" and result is None and isinstance(exc, ZeroDivisionError)
    finally:
        gate.set()
        w.close()


def test_worker_inline():
    w = Worker()
    w.submit(0, lambda: 42, "a", inline=True)
    assert w.drain() == [("a", 42, None)]
    assert w.outstanding == 0


@pytest.mark.parametrize(
    "policy, exact, want", [("compress", False, True), ("raw", False, False),
                            ("compress", True, False), ("auto", True, False)]
)
@pytest.mark.parametrize("ranks", [1, 4])
def test_fixed_rules_need_no_model(policy, exact, want, ranks):
    planner = Planner(model.DEFAULTS, Options(None, None, "auto", None), 0)
    f = Facts("allreduce", 100, 4, policy, "homomorphic", exact, False, False, False, ranks)
    p = planner.plan(planner.state(("k",), f), f)
    assert p.compress is want
    # A plan that never compresses repeats without its agreement from the next call on.
    assert p.fast is (not want)


def test_layout_builds_its_lists_once():
    lay = Layout(100_003, 5, 1000)
    assert lay.blocks is lay.blocks
    assert all(lay.chunks(b) is lay.chunks(b) for b in range(5))
    # The tiling is still array_split's and the chunk size as asked.
    assert list(lay.blocks) == block_bounds(100_003, 5)
    assert lay.chunk_elems == 1000 and lay.max_chunks == 21


@pytest.mark.parametrize("chunk", [250, 251, 2**31, 2**53])
def test_a_chunk_larger_than_a_block_is_the_block(chunk):
    # Buffers are sized from the layout's chunk: chunk_elems=2**31 mapped 17 GB per rank
    # for a 1000-element call, 2**32 failed in mmap.
    lay = Layout(1000, 4, chunk)
    assert lay.chunk_elems == 250
    assert [lay.chunks(b) for b in range(4)] == [(b,) for b in lay.blocks]
    assert Layout(0, 3, chunk).chunk_elems == 1 and Layout(0, 3, chunk).max_chunks == 0


@pytest.mark.parametrize("n, size", [(1 << 40, 4), (10**12 + 7, 3), (1 << 20, 1)])
def test_chunk_indices_stay_valid_mpi_tags(n, size):
    # The chunk index is the ring's MPI tag; MPI guarantees tags up to 32767 only.
    from ccoll.collectives.layout import MAX_CHUNKS

    lay = Layout(n, size, 1)
    assert MAX_CHUNKS - 1 <= 32767
    assert lay.max_chunks <= MAX_CHUNKS
    lo, hi = lay.blocks[0]
    ch = lay.chunks(0)
    assert len(ch) == lay.max_chunks and ch[0][0] == lo and ch[-1][1] == hi
    assert all(c1[1] == c2[0] for c1, c2 in zip(ch, ch[1:], strict=False))


def test_chunk_size_grows_to_a_small_tag_limit(monkeypatch):
    from ccoll.collectives import layout

    monkeypatch.setattr(layout, "MAX_CHUNKS", 4)
    lay = Layout(1003, 2, 7)
    assert lay.max_chunks <= 4 and lay.chunk_elems == 126  # ceil(502 / 4)
    for b, (lo, hi) in enumerate(lay.blocks):
        ch = lay.chunks(b)
        assert ch[0][0] == lo and ch[-1][1] == hi and len(ch) <= 4
