"""Compressed collectives in stream format 2 (run with 1..3 ranks; two levels at 4).

``Communicator(comm, format_version=2)`` sends format-2 streams in every compressed call:
checked exactly against the exact sum (the bound on every element), bitwise identical
results on every rank, the report's format, and the agreement on ``format_version``.
Format 2 codes the same quantized values as format 1 (docs/format.md), so a call with the
same chunking gives the same result bit for bit in either format: the comparison with
format 1 is a check from outside the new code paths.
"""

from __future__ import annotations

import numpy as np
import pytest
from collkit import (
    allowance,
    allreduce_reference,
    exact_sum,
    global_eb,
    gradient_like,
    my_block,
)
from kit import assert_same_on_every_rank, assert_within
from mpi4py import MPI

import ccoll
from ccoll.collectives import ring
from ccoll.compressor import format as fmt
from ccoll.errors import InputError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
N = 20_011


def _data(comm, dtype, n=N, seed=0):
    x = gradient_like(comm.rank, n, dtype, seed)
    x[7] = np.nan if comm.rank == 0 else x[7]
    x[100] = 1e30 if comm.rank == SIZE - 1 else x[100]  # a raw lane through the ring
    return x


@pytest.mark.parametrize("split", [None, 0])
@pytest.mark.parametrize("algorithm", ["homomorphic", "dar"])
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3)], ids=["abs", "rel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_allreduce_v2_within_bound_identical_and_equal_to_v1(comm, op, dtype, eb, algorithm,
                                                              split):
    x = _data(comm, dtype)
    ys = {}
    for v in (1, 2):
        with ccoll.Communicator(comm, policy="compress", algorithm=algorithm, split=split,
                                chunk_elems=3000, format_version=v) as c:
            ys[v] = c.allreduce(x, eb, op=op)
            rep = c.last_call
        assert rep is not None and rep.compressed
        assert rep.format_version == v and rep.format_reason == f"format_version={v}"
        assert f"format {v}" in str(rep)
    y = ys[2]
    ref = allreduce_reference(comm, x, op)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_within(y, ref, **allowance(global_eb(comm, x, eb), y, SIZE, op))
    assert_same_on_every_rank(comm, y)
    assert np.isnan(y[7])
    # The same quantized values in either format: the same result, bit for bit.
    assert ys[1].view(np.uint8).tobytes() == y.view(np.uint8).tobytes()


@pytest.mark.parametrize("chunk", [None, 777])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_allreduce_v2_sends_version_2_streams(comm, monkeypatch, dtype, chunk):
    seen = []
    real = ring.check_stream

    def spy(buf, n, dt, bound, version=None):
        seen.append(int(np.asarray(buf)[4]))  # the header's version byte
        return real(buf, n, dt, bound, version)

    monkeypatch.setattr(ring, "check_stream", spy)
    x = _data(comm, dtype)
    with ccoll.Communicator(comm, policy="compress", format_version=2, split=0,
                            chunk_elems=chunk) as c:
        y = c.allreduce(x, ccoll.REL(1e-3))
    assert_within(y, exact_sum(comm, x), **allowance(global_eb(comm, x, ccoll.REL(1e-3)), y,
                                                     SIZE, "sum"))
    if SIZE > 1:
        assert seen and set(seen) == {fmt.VERSION2}


def test_v2_sends_fewer_bytes_at_loose_bounds(comm):
    if SIZE < 2:
        pytest.skip("one rank sends nothing")
    x = gradient_like(comm.rank, 1 << 18, np.float32)
    sent = {}
    for v in (1, 2):
        with ccoll.Communicator(comm, policy="compress", format_version=v, split=0,
                                chunk_elems=1 << 16) as c:
            c.allreduce(x, ccoll.REL(1e-2))
            sent[v] = comm.allreduce(c.last_call.bytes_sent)
    assert sent[2] < sent[1], sent


def test_format_version_is_checked(comm):
    for bad in (0, 3, True, "2", 2.0):
        with pytest.raises(InputError, match="format_version"):
            ccoll.Communicator(comm, format_version=bad)
    with ccoll.Communicator(comm, format_version=2, schedule="halving") as c:  # both run it
        assert c.format_version == 2 and c.schedule == "halving"


def test_ranks_must_agree_on_format_version(comm):
    if SIZE < 2:
        pytest.skip("needs two ranks")
    with pytest.raises(MismatchError, match="format version"):
        ccoll.Communicator(comm, format_version=2 if comm.rank == 0 else None)


def test_v1_streams_still_decode(comm):
    x = gradient_like(comm.rank, 5000, np.float64)
    with ccoll.Communicator(comm, policy="compress", format_version=1) as c:
        y = c.allreduce(x, ccoll.ABS(1e-4))
        assert c.last_call.format_version == 1
    buf = ccoll.compress(x, ccoll.ABS(1e-4), version=1)
    assert ccoll.decompress(buf).shape == x.shape
    assert_same_on_every_rank(comm, y)



def _both(comm, call, **opts):
    """``call(c)`` on a format-1 and a format-2 Communicator: the results and reports."""
    out = {}
    for v in (1, 2):
        with ccoll.Communicator(comm, policy="compress", format_version=v, **opts) as c:
            y = call(c)
            rep = c.last_call
        assert rep.compressed and rep.format_version == v
        assert rep.format_reason == f"format_version={v}"
        out[v] = (y, rep)
    return out


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


@pytest.mark.parametrize("chunk", [None, 1000])
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3)], ids=["abs", "rel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_v2(comm, op, dtype, eb, chunk):
    x = _data(comm, dtype)
    got = _both(comm, lambda c: c.reduce_scatter(x, eb, op=op), chunk_elems=chunk)
    y = got[2][0]
    ref = my_block(allreduce_reference(comm, x, op), comm)
    assert_within(y, ref, **allowance(global_eb(comm, x, eb), y, SIZE, op))
    if chunk is not None:  # the same chunks: the same quantized values
        _same_bits(got[1][0], y)


@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-2)], ids=["abs", "rel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_allgather_v2(comm, dtype, eb):
    # REL: no outlier, so that the bound is loose against most values
    x = (_data(comm, dtype) if isinstance(eb, ccoll.ABS)
         else gradient_like(comm.rank, N, dtype)).reshape(-1, 1)
    got = _both(comm, lambda c: c.allgather(x, eb))
    y = got[2][0]
    assert y.shape == (SIZE, *x.shape)
    xs = np.stack(comm.allgather(x))
    assert_within(y, xs, global_eb(comm, x, eb))
    assert_same_on_every_rank(comm, y)
    _same_bits(got[1][0], y)
    if SIZE > 1 and isinstance(eb, ccoll.REL):  # fewer bytes at a loose bound
        assert got[2][1].bytes_sent < got[1][1].bytes_sent


@pytest.mark.parametrize("root", sorted({0, SIZE - 1}))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_bcast_v2(comm, dtype, root):
    x = _data(comm, dtype, seed=3)
    mine = x if comm.rank == root else None
    got = _both(comm, lambda c: c.bcast(mine, ccoll.REL(1e-3), root=root))
    y = got[2][0]
    xr = comm.bcast(x, root=root)
    assert_within(y, xr, global_eb(comm, xr, ccoll.REL(1e-3)))
    assert_same_on_every_rank(comm, y)
    _same_bits(got[1][0], y)


@pytest.mark.parametrize("split", [0.25, 0.5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_split_v2(comm, op, dtype, split):
    x = _data(comm, dtype)
    eb = ccoll.REL(1e-3)
    got = _both(comm, lambda c: c.allreduce(x, eb, op=op), split=split, chunk_elems=3000)
    y = got[2][0]
    allow = allowance(global_eb(comm, x, eb), y, SIZE, op)
    allow["roundings"] = 1  # a split rounds once to the dtype, the average too
    assert_within(y, allreduce_reference(comm, x, op), **allow)
    assert_same_on_every_rank(comm, y)
    _same_bits(got[1][0], y)


@pytest.mark.many_ranks
@pytest.mark.parametrize("split", [0.0, 0.5])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_two_levels_v2(comm, op, split):
    if SIZE != 4:
        pytest.skip("two nodes of two ranks: 4 ranks")
    x = _data(comm, np.float32)
    eb = ccoll.ABS(1e-3)
    got = _both(comm, lambda c: c.allreduce(x, eb, op=op), ranks_per_node=2, split=split,
                chunk_elems=2000)
    y, rep = got[2]
    assert rep.hierarchical
    allow = allowance(global_eb(comm, x, eb), y, SIZE, op)
    allow["roundings"] = 1  # two levels round once to the dtype
    assert_within(y, allreduce_reference(comm, x, op), **allow)
    assert_same_on_every_rank(comm, y)
    _same_bits(got[1][0], y)


def test_auto_measures_format_2_caches_it_and_picks_per_call(comm, tmp_path_factory):
    # policy="auto" measures both formats when the Communicator is made (a probe, then the
    # cache), and each call's plan names its format and why, the same on every rank.
    if SIZE < 2:
        pytest.skip("one rank never compresses")
    from ccoll.settings import configure

    folder = comm.bcast(str(tmp_path_factory.mktemp("cal")) if comm.rank == 0 else None)
    configure(cache_dir=folder)
    try:
        with ccoll.Communicator(comm) as c:  # probes the link and the compressor
            cal = c.calibration
            assert cal.compressor == "measured" and cal.format2 is not None
            assert cal.gain2 is not None and cal.gain2 > 1.0  # format 2: fewer bytes
        with ccoll.Communicator(comm) as c2:
            assert c2.calibration.compressor == "cache"
            assert (c2.calibration.format2, c2.calibration.gain2) == (cal.format2, cal.gain2)
        configure(alpha=5e-5, bandwidth=1.25e7)  # 100 Mbit/s in bytes/s: it compresses
        with ccoll.Communicator(comm) as c3:
            x = gradient_like(comm.rank, 1 << 20, np.float32)
            y = c3.allreduce(x, ccoll.REL(1e-2))
            rep = c3.last_call
    finally:
        configure(cache_dir=None, alpha=None, bandwidth=None)
    assert rep.compressed and rep.format_version in (1, 2)
    assert rep.format_reason.startswith("predicted ")
    assert f"format {3 - rep.format_version} " in rep.format_reason
    decisions = comm.allgather(rep.decision())
    assert all(d == decisions[0] for d in decisions)
    assert_within(y, exact_sum(comm, x), **allowance(global_eb(comm, x, ccoll.REL(1e-2)), y,
                                                     SIZE, "sum"))
    assert_same_on_every_rank(comm, y)


def test_auto_measures_both_formats_and_every_rank_runs_the_same(comm, monkeypatch,
                                                                 tmp_path_factory):
    # The measured loop times the best path in both formats, each call agreed on every
    # rank: the same format, the same bytes, within the bound. Stand-ins: every candidate
    # plausible (TRY_FACTOR made huge, so raw is tried too), and raw calls counted 100x
    # slower than they ran, so that the compressed path is the best on shared memory.
    if SIZE < 2:
        pytest.skip("one rank never compresses")
    from ccoll.collectives.policy import plan as plan_mod
    from ccoll.settings import configure

    monkeypatch.setattr(plan_mod, "TRY_FACTOR", 1e12)
    end = plan_mod.Planner.end

    def slow_raw(self, st, plan, seconds):
        end(self, st, plan, seconds * (100.0 if plan.key == "raw" else 1.0))

    monkeypatch.setattr(plan_mod.Planner, "end", slow_raw)
    folder = comm.bcast(str(tmp_path_factory.mktemp("cal2")) if comm.rank == 0 else None)
    configure(cache_dir=folder, alpha=5e-5, bandwidth=1.25e7)
    x = gradient_like(comm.rank, 1 << 18, np.float32)
    eb = ccoll.REL(1e-2)
    reps = []
    try:
        with ccoll.Communicator(comm) as c:
            for _ in range(12):
                y = c.allreduce(x, eb)
                rep = c.last_call
                reps.append((rep.compressed, rep.format_version if rep.compressed else 0,
                             rep.trial, rep.decision()))
                assert_same_on_every_rank(comm, y)
                allow = allowance(global_eb(comm, x, eb), y, SIZE, "sum")
                assert_within(y, exact_sum(comm, x), **allow)
    finally:
        configure(cache_dir=None, alpha=None, bandwidth=None)
    everyone = comm.allgather(reps)
    assert all(r == everyone[0] for r in everyone)
    versions = {v for comp, v, _, _ in reps if comp}
    assert versions == {1, 2}, reps  # both formats ran
    assert any(not comp for comp, _, _, _ in reps), reps  # raw was tried


class _Clock:
    """Stand-in readings ``reading(k)`` for ``k = 0, 1, ...``."""

    def __init__(self, reading) -> None:
        self.k, self.reading = -1, reading

    def __call__(self) -> float:
        self.k += 1
        return self.reading(self.k)


def _rising(k: int) -> float:
    """1, 2, 4, ...: every timed run lasts longer than the one before."""
    return 2.0 ** k


def _falling(k: int) -> float:
    """2 - 2**-k: every timed run lasts half as long as the one before."""
    return 2.0 - 2.0 ** -k


@pytest.mark.parametrize("forced, factor", [(_rising, 2.0 ** -16), (_falling, 2.0 ** 16)],
                         ids=["v2-slow", "v2-fast"])
def test_sampled_speed_factors_are_agreed_as_the_minimum(comm, monkeypatch,
                                                         tmp_path_factory, forced, factor):
    # The first auto call of a signature times both formats' kernels on its sample; each
    # rank's clock gives its own factors. The last rank's clock is a stand-in here:
    # format 1's kernels are timed first, so rising readings make format 2 look 65536x
    # slower on that rank (compress, add, decompress, add_data: 2 runs each; the add's
    # factor, add_data less compress, comes out the same), falling ones 65536x faster.
    # Every rank must plan with the minimum over ranks, the same numbers in the same
    # state, and make the same plan.
    if SIZE < 2:
        pytest.skip("one rank never compresses")
    from ccoll.collectives import prepare
    from ccoll.collectives.policy import fits
    from ccoll.settings import configure

    got = []

    def spy(*a, **k):
        got.append(fits.sampled_format2(*a, **k))
        return got[-1]

    monkeypatch.setattr(prepare, "sampled_format2", spy)
    monkeypatch.setattr(fits, "SPEED_REPS", 2)  # the factors below count 2 runs each
    if comm.rank == SIZE - 1:
        monkeypatch.setattr(fits, "_clock", _Clock(forced))
    folder = comm.bcast(str(tmp_path_factory.mktemp("cal")) if comm.rank == 0 else None)
    configure(cache_dir=folder, alpha=5e-5, bandwidth=1.25e7)  # 100 Mbit/s: it compresses
    try:
        with ccoll.Communicator(comm) as c:
            assert c.calibration.formats is not None  # format 2 measured: the plan may pick it
            x = gradient_like(comm.rank, 1 << 20, np.float32)
            y = c.allreduce(x, ccoll.REL(1e-2))
            rep = c.last_call
            (st,) = c._sync.planner._states.values()
            agreed = st.speed2
    finally:
        configure(cache_dir=None, alpha=None, bandwidth=None)
    assert len(got) == 1  # one sample, at the signature's first call
    mine = got[0].speed
    if comm.rank == SIZE - 1:
        assert mine == (factor,) * 3
    everyone = comm.allgather((mine, agreed, rep.decision(), rep.format_version))
    assert all(e[1:] == everyone[0][1:] for e in everyone)  # the same state and plan
    assert agreed == tuple(min(e[0][i] for e in everyone) for i in range(3))
    if factor < 1:  # format 2 priced 65536x slower than format 1's kernels: format 1
        assert agreed == (factor,) * 3 and rep.format_version == 1
    else:  # the other ranks' real timings are the minimum, not the forced ones
        assert all(agreed[i] < factor for i in range(3))
    assert_within(y, exact_sum(comm, x), **allowance(global_eb(comm, x, ccoll.REL(1e-2)), y,
                                                     SIZE, "sum"))
    assert_same_on_every_rank(comm, y)
