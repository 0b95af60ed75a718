"""policy="auto" under MPI: calibration agrees, the cache works, decisions agree on all ranks.

Run with 1..5 ranks (the Makefile's test-mpi). Calibrations are forced through environment
variables where a test needs a clear-cut case, so the outcome does not depend on how busy
the machine is; the probe itself is checked only for agreement and sanity.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from collkit import exact_sum, global_eb, gradient_like, my_block
from kit import assert_same_on_every_rank, assert_within
from mpi4py import MPI

import ccoll
from ccoll.collectives import communicator
from ccoll.collectives.channel import Channel
from ccoll.collectives.registry import default_communicator
from ccoll.collectives.policy import auto
from ccoll.collectives.policy.auto import AutoPolicy, link_calibration
from ccoll.collectives.policy.cache import cache_dir
from ccoll.collectives.policy.fits import measure_efficiency
from ccoll.collectives.policy.probes import measure_raw_efficiency

SLOW_LINK = {  # 100 Mbit/s, fast compressor: compressing big messages clearly pays
    "CCOLL_ALPHA": "50us", "CCOLL_BANDWIDTH": "100Mbit", "CCOLL_COMPRESS_GBPS": "5",
    "CCOLL_ADD_GBPS": "5", "CCOLL_DECOMPRESS_GBPS": "5",
}
FAST_LINK = {  # 1 Tbit/s, slow compressor: compressing never pays
    "CCOLL_ALPHA": "1us", "CCOLL_BANDWIDTH": "1000Gbit", "CCOLL_COMPRESS_GBPS": "0.5",
    "CCOLL_ADD_GBPS": "0.5", "CCOLL_DECOMPRESS_GBPS": "0.5",
}


@pytest.fixture
def shared_cache(comm, monkeypatch):
    """One fresh cache folder that every rank uses (rank 0 makes it)."""
    path = tempfile.mkdtemp(prefix="ccoll-cache-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    monkeypatch.setenv("CCOLL_CACHE_DIR", path)
    for k in ("CCOLL_ALPHA", "CCOLL_BANDWIDTH", "CCOLL_CALIBRATION", "CCOLL_RATIO"):
        monkeypatch.delenv(k, raising=False)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ch(comm):
    """A channel of its own (a private duplicate of comm), as a Communicator's calls use."""
    c = Channel(comm.Dup(), "test", None)
    yield c
    c.close()


def _env(monkeypatch, values):
    for k, v in values.items():
        monkeypatch.setenv(k, v)


def test_probe_agrees_and_is_cached(comm, ch, shared_cache):
    cal, key = link_calibration(ch)
    assert cal.source == ("single rank" if comm.size == 1 else "probe")
    assert comm.allgather((cal.alpha, cal.beta, cal.reduce, key)) == [
        (cal.alpha, cal.beta, cal.reduce, key)
    ] * comm.size
    if comm.size > 1:
        assert 0 < cal.alpha < 0.1 and cal.beta > 1e6
        assert 0 < cal.raw_efficiency <= 1
    again, key2 = link_calibration(ch)
    assert (again.source, again.alpha, again.beta, key2) == ("cache", cal.alpha, cal.beta, key)
    if comm.rank == 0:
        doc = json.loads((cache_dir() / "links.json").read_text())
        assert doc[key]["size"] == comm.size


def test_calibration_off_neither_reads_nor_writes(comm, ch, shared_cache, monkeypatch):
    monkeypatch.setenv("CCOLL_CALIBRATION", "off")
    cal, _ = link_calibration(ch)
    assert cal.source in ("probe", "single rank")
    comm.Barrier()
    assert not os.path.exists(os.path.join(shared_cache, "links.json"))


def test_environment_overrides_the_probe(comm, ch, shared_cache, monkeypatch):
    _env(monkeypatch, SLOW_LINK)
    cal, _ = link_calibration(ch)
    assert cal.source == "env"
    assert (cal.alpha, cal.beta) == pytest.approx((50e-6, 100e6 / 8))


def test_tiny_message_goes_raw_without_calibrating_the_compressor(comm, ch, shared_cache,
                                                                  monkeypatch):
    _env(monkeypatch, SLOW_LINK)
    pol = AutoPolicy(ch)
    d = pol.decide(np.ones(1, np.float32), 1e-3)
    assert not d.compress
    assert pol._comp == {}, "a 4-byte message must not time the compressor"


def test_big_message_on_slow_link_compresses_on_every_rank(comm, ch, shared_cache, monkeypatch):
    _env(monkeypatch, SLOW_LINK)
    pol = AutoPolicy(ch)
    x = gradient_like(comm.rank, 1 << 20, np.float32)
    d = pol.decide(x, 1e-4)
    assert d.compress == (comm.size > 1)
    assert len(set(comm.allgather((d.compress, d.chunk_elems)))) == 1


def test_efficiency_fit_is_agreed_and_bounded(comm, ch, shared_cache):
    # The fit times real allreduces, so its values vary; what must hold is that every rank
    # gets the same numbers (they feed the decision) and that they stay in their clamps.
    pol = AutoPolicy(ch)
    x = gradient_like(comm.rank, 1 << 16, np.float32)
    p = pol.params(None)
    p = type(p)(**{**p.__dict__, "compress": 2e9, "add": 2e9, "decompress": 4e9})
    e = measure_efficiency(ch, x, 1e-4, p, pol.ops()[0], 1 << 20)
    r = measure_raw_efficiency(ch, x, p)
    assert 1 / 16 <= e <= 4 and 1 / 16 <= r <= 16
    assert len(set(comm.allgather((e, r)))) == 1


def test_a_sampled_raw_decision_is_reused_then_renewed(comm, shared_cache, monkeypatch):
    # Ratio 1: compressing cannot pay, but only the sampled ratio says so (the size tests
    # pass on this slow link), so each full decision samples; STICKY_CALLS calls follow
    # without sampling, then the next one decides again. Results stay MPI's exact sum.
    if comm.size == 1:
        pytest.skip("one rank never compresses")
    _env(monkeypatch, {**SLOW_LINK, "CCOLL_RATIO": "1"})
    decided = []
    real = auto.AutoPolicy.decide
    monkeypatch.setattr(auto.AutoPolicy, "decide",
                        lambda self, *a, **k: decided.append(1) or real(self, *a, **k))
    x = gradient_like(comm.rank, 1 << 16, np.float32)
    expect = np.empty_like(x)
    comm.Allreduce(x, expect, op=MPI.SUM)
    with ccoll.Communicator(comm) as cc:
        for _ in range(auto.STICKY_CALLS + 2):
            y = cc.allreduce(x, ccoll.REL(1e-3))
            assert np.array_equal(y, expect)
        assert cc.stats.compressed_calls == 0
        # Another bound is another decision.
        cc.allreduce(x, ccoll.REL(1e-2))
    assert len(decided) == 3
    assert_same_on_every_rank(comm, len(decided))


def test_fast_link_goes_raw(comm, ch, shared_cache, monkeypatch):
    _env(monkeypatch, FAST_LINK)
    pol = AutoPolicy(ch)
    d = pol.decide(gradient_like(comm.rank, 1 << 20, np.float32), 1e-4)
    assert not d.compress


@pytest.mark.parametrize("count", [1, 1000, 30_000, 100_000, 400_000])
def test_decision_agrees_when_the_ranks_data_differ(comm, ch, shared_cache, monkeypatch, count):
    # Near break-even, with data whose ratio differs wildly by rank (zeros, gradients,
    # noise): a rank-local estimate would split the ranks, the agreed one never does.
    _env(monkeypatch, {**SLOW_LINK, "CCOLL_BANDWIDTH": "2Gbit"})
    kind = comm.rank % 3
    rng = np.random.default_rng(comm.rank)
    if kind == 0:
        x = np.zeros(count, np.float32)
    elif kind == 1:
        x = gradient_like(comm.rank, count, np.float32)
    else:
        x = rng.standard_normal(count).astype(np.float32)
    pol = AutoPolicy(ch)
    d = pol.decide(x, 1e-3)
    assert len(set(comm.allgather((d.compress, d.chunk_elems, d.ratio)))) == 1


@pytest.mark.parametrize("env", [SLOW_LINK, FAST_LINK], ids=["slow", "fast"])
@pytest.mark.parametrize("count", [1, 33, 300_001])
def test_auto_allreduce_is_within_bound_and_identical(comm, shared_cache, monkeypatch, env,
                                                      count):
    _env(monkeypatch, env)
    x = gradient_like(comm.rank, count, np.float32)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, policy="auto") as cc:
        y = cc.allreduce(x, eb)
        compressed = cc.stats.compressed_calls
    assert_within(y, exact_sum(comm, x), global_eb(comm, x, eb), roundings=1)
    assert_same_on_every_rank(comm, y)
    assert len(set(comm.allgather(compressed))) == 1
    if env is SLOW_LINK and count == 300_001 and comm.size > 1:
        assert compressed == 1
    if env is FAST_LINK or count == 1:
        assert compressed == 0


def test_auto_allgather_and_reduce_scatter(comm, shared_cache, monkeypatch):
    _env(monkeypatch, SLOW_LINK)
    x = gradient_like(comm.rank, 200_000, np.float32)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, policy="auto") as cc:
        g = cc.allgather(x, eb)
        r = cc.reduce_scatter(x, eb)
    assert_same_on_every_rank(comm, g)
    xs = np.stack(comm.allgather(x))
    assert_within(g, xs, global_eb(comm, x, eb))
    assert_within(r, my_block(exact_sum(comm, x), comm), global_eb(comm, x, eb), roundings=1)


def test_device_data_is_decided_by_size(comm, ch, shared_cache, monkeypatch):
    _env(monkeypatch, SLOW_LINK)
    pol = AutoPolicy(ch)
    small = pol.decide_by_size(1, 4)
    big = pol.decide_by_size(16 << 20, 4)
    assert not small.compress
    assert big.compress == (comm.size > 1) and big.chunk_elems == 0
    assert len(set(comm.allgather((small.compress, big.compress)))) == 1


def test_known_raw_uses_only_calibrations_already_made(comm, ch, shared_cache, monkeypatch):
    _env(monkeypatch, FAST_LINK)
    pol = AutoPolicy(ch)
    big = gradient_like(comm.rank, 1 << 20, np.float32)
    if comm.size > 1:
        assert not pol.known_raw(big.size, big.dtype)  # nothing calibrated yet: compute range
    assert not pol.decide(big, 1e-4).compress
    assert pol.known_raw(big.size, big.dtype)  # same class, compressor known to be too slow
    assert pol.known_raw(1, np.float32)
    assert len(set(comm.allgather(pol.known_raw(1 << 22, np.float32)))) == 1


def test_auto_is_the_default_policy(comm):
    with ccoll.Communicator(comm) as cc:
        assert cc.policy == "auto"
    assert default_communicator(comm).policy == "auto"  # what ccoll.allreduce & co. use


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_default_call_on_a_tiny_message_is_plain_mpi(comm, shared_cache, monkeypatch, dtype):
    # A link on which compressing large messages pays: the tiny one still goes raw.
    _env(monkeypatch, SLOW_LINK)
    x = gradient_like(comm.rank, 100, dtype)
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    eb = ccoll.REL(1e-3)
    stats = default_communicator(comm).stats
    y = ccoll.allreduce(x, eb=eb, comm=comm)
    assert y.tobytes() == want.tobytes()
    assert stats.compressed_calls == 0
    z = ccoll.allreduce(x, eb=eb, comm=comm, policy="compress")
    assert stats.compressed_calls == 1
    assert_within(z, exact_sum(comm, x), global_eb(comm, x, eb), roundings=1)
    assert_same_on_every_rank(comm, z)


@pytest.mark.parametrize("policy", ["auto", "raw"])
def test_raw_calls_do_not_scan_the_data(comm, shared_cache, monkeypatch, policy):
    # A raw call needs no bound, so no value range: MPI alone reads the data.
    _env(monkeypatch, FAST_LINK)
    x = gradient_like(comm.rank, 1 << 18, np.float32)
    eb = ccoll.REL(1e-3)
    with ccoll.Communicator(comm, policy=policy) as cc:
        cc.allreduce(x, eb)  # calibrates: this size goes raw whatever the data
        assert cc.stats.compressed_calls == 0

        def no_scan(*args):
            raise AssertionError("a raw call computed the value range")

        monkeypatch.setattr(communicator, "_finite_range", no_scan)
        y = cc.allreduce(x, eb)
        assert cc.stats.compressed_calls == 0
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    assert y.tobytes() == want.tobytes()
