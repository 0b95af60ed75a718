"""What keeps ranks from hanging or computing wrong answers (run with 1..5 ranks).

Settings that decide which collectives a rank makes are agreed (a difference on one rank
raises ``MismatchError`` on every rank), the agreement's error path makes buffer-based MPI
calls only, ``out`` that partly overlaps ``x`` is refused, and Communicators release their
duplicates and threads on ``close()``, on ``with`` and when dropped.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from collkit import allowance, allreduce_reference, exact_sum, global_eb, gradient_like
from kit import assert_same_on_every_rank, assert_within
from mpi4py import MPI

import ccoll
from ccoll.collectives import layout
from ccoll.collectives.agreement import Call, agree
from ccoll.collectives.waiting import Deadline
from ccoll.errors import CollectiveError, InputError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
needs_two = pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")


def same_error_everywhere(comm, exc_info, exc_type, match):
    err = exc_info.value
    assert type(err) is exc_type, f"{type(err).__name__}: {err}"
    assert match in str(err), str(err)
    msgs = comm.allgather(str(err))
    assert len(set(msgs)) == 1, msgs


# -- the agreement's error path --------------------------------------------------------


class _NoPickle(MPI.Intracomm):
    """The same communicator, with mpi4py's pickle-based collectives forbidden."""

    def _pickled(self, *args, **kwargs):
        raise AssertionError("a pickle-based collective was called")

    allgather = allreduce = bcast = gather = alltoall = _pickled


@needs_two
def test_agreement_error_path_makes_no_pickled_call(comm):
    call = Call("allreduce", count=10 + (comm.rank == 1), dtype=1, policy=2, algorithm=1, op=1)
    call.shown["element count"] = call.count
    with pytest.raises(MismatchError) as info:
        agree(_NoPickle(comm), call, Deadline(60.0, "test"))
    same_error_everywhere(comm, info, MismatchError, "element count (10 on rank")
    # Without a deadline (blocking MPI calls) as well.
    with pytest.raises(MismatchError) as info:
        agree(_NoPickle(comm), call, Deadline(None, "test"))
    same_error_everywhere(comm, info, MismatchError, "element count")


def test_agreement_error_path_reports_problems_without_pickle(comm):
    call = Call("allreduce", count=4, dtype=1, policy=2, algorithm=1, op=1)
    if comm.rank == comm.size - 1:
        call.problem(InputError, "op 'max' is not supported")
    with pytest.raises(InputError) as info:
        agree(_NoPickle(comm), call, Deadline(60.0, "test"))
    same_error_everywhere(comm, info, InputError, f"rank {comm.size - 1}: op 'max'")


# -- settings that decide the collectives a rank makes ---------------------------------


# A calibration setting on one rank only: (variable, value, the setting as the message
# shows it).
ONE_RANK_SETTINGS = [
    ("CCOLL_ALPHA", "5us", "alpha=5e-06"),
    ("CCOLL_RATIO", "3", "ratio=3"),
    ("CCOLL_CALIBRATION", "off", "calibration='off'"),
    ("CCOLL_BANDWIDTH", "10Gbit", "bandwidth=1.25e+09"),
]


@needs_two
@pytest.mark.parametrize("name, value, shown", ONE_RANK_SETTINGS,
                         ids=[s[0] for s in ONE_RANK_SETTINGS])
def test_calibration_setting_on_one_rank_fails_the_communicator_everywhere(
        comm, monkeypatch, name, value, shown):
    # Settings are read when a Communicator is made and agreed there (they decide which
    # calibration collectives run and what every plan rests on): the same MismatchError
    # on every rank, naming the rank and its setting, before anything calibrates.
    if comm.rank == comm.size - 1:
        monkeypatch.setenv(name, value)
    with pytest.raises(MismatchError) as info:
        ccoll.Communicator(comm, policy="auto", timeout=60)
    same_error_everywhere(comm, info, MismatchError, "settings (")
    assert f"{shown}" in str(info.value) and f"on rank {comm.size - 1}" in str(info.value)
    # Nothing was left in flight: with the same settings everywhere, calls work.
    monkeypatch.delenv(name, raising=False)
    with ccoll.Communicator(comm, policy="auto", timeout=60) as c:
        x = gradient_like(comm.rank, 50_000, np.float32)
        y = c.allreduce(x, eb=None)
        assert_same_on_every_rank(comm, y)


@needs_two
@pytest.mark.parametrize("how", ["argument", "CCOLL_TIMEOUT"])
def test_a_timeout_without_end_on_one_rank_fails_the_communicator_everywhere(
        comm, monkeypatch, how):
    # The timeout decides blocking or nonblocking MPI calls, and is agreed with the other
    # settings; before that agreement every rank must make the same kind of call (the
    # communicator's duplicate, the agreement itself), or a rank without a timeout waits
    # in MPI_Comm_dup for the others' MPI_Comm_idup forever.
    last = comm.rank == comm.size - 1
    if how == "CCOLL_TIMEOUT":
        monkeypatch.setenv("CCOLL_TIMEOUT", "none" if last else "30")
        kwargs = {}
    else:
        kwargs = {"timeout": float("inf") if last else 30}
    with pytest.raises(MismatchError) as info:
        ccoll.Communicator(comm, policy="raw", **kwargs)
    same_error_everywhere(comm, info, MismatchError, "settings (")
    assert f"timeout=None on rank {comm.size - 1}" in str(info.value), str(info.value)
    monkeypatch.delenv("CCOLL_TIMEOUT", raising=False)
    with ccoll.Communicator(comm, policy="raw", timeout=30) as c:
        x = gradient_like(comm.rank, 1000, np.float32)
        want = np.empty_like(x)
        comm.Allreduce(x, want)
        assert c.allreduce(x, eb=None).tobytes() == want.tobytes()


@needs_two
def test_settings_changed_on_one_rank_after_creation_change_nothing(comm, monkeypatch):
    # A Communicator keeps the settings it was made with: CCOLL_* variables set later on
    # one rank (the calibration's, the timeout, the ratio) change no call's plan, so every
    # rank keeps planning alike (no MismatchError, the same reports and results).
    x = gradient_like(comm.rank, 1 << 18, np.float32)
    with ccoll.Communicator(comm, policy="auto", timeout=60) as c:
        settings = c.settings
        reports = []
        ref, eb = exact_sum(comm, x), global_eb(comm, x, ccoll.REL(1e-3))
        c.allreduce(x, eb=ccoll.REL(1e-3))
        reports.append(c.last_call)
        if comm.rank == comm.size - 1:
            for name, value, _ in ONE_RANK_SETTINGS:
                monkeypatch.setenv(name, value)
            monkeypatch.setenv("CCOLL_TIMEOUT", "0.001")
            monkeypatch.setenv("CCOLL_COMPRESS_GBPS", "0.001")
        for _ in range(6):
            y = c.allreduce(x, eb=ccoll.REL(1e-3))
            reports.append(c.last_call)
            assert_same_on_every_rank(comm, y)
            assert_within(y, ref, **allowance(eb, y, SIZE, "sum"))
        assert c.settings is settings
        every = comm.allgather([r.decision() for r in reports])
        assert all(d == every[0] for d in every), every


def test_settings_digest_is_exact_in_float64():
    # The settings' fingerprint travels in the agreement as a float64: it must be exact,
    # and settings that change which collectives run must change it.
    from ccoll.settings import parse

    none, problems = parse(environ={})
    assert problems == [] and none.overrides() == "none set"
    ratio, _ = parse(environ={"CCOLL_RATIO": "3"})
    assert ratio.overrides() == "ratio=3" and ratio.digest != none.digest
    # A mismatch message shows only the settings the ranks agree on: a rank's own cache
    # folder (CCOLL_CACHE_DIR, not agreed) was listed beside the one that differed.
    both, _ = parse(environ={"CCOLL_RATIO": "3", "CCOLL_CACHE_DIR": "/tmp/x"})
    assert both.overrides() == "cache_dir='/tmp/x' ratio=3" and both.digest == ratio.digest
    assert both.overrides(agreed=True) == "ratio=3"
    for s in (none, ratio, parse(environ={"CCOLL_ALPHA": "5us"})[0],
              parse(environ={"CCOLL_CALIBRATION": "off"})[0]):
        assert 0 <= s.digest < 2**52 and float(s.digest) == s.digest
    assert len({none.digest, ratio.digest, parse(environ={"CCOLL_ALPHA": "5us"})[0].digest,
                parse(environ={"CCOLL_CALIBRATION": "off"})[0].digest}) == 4


@needs_two
def test_hook_error_feedback_on_one_rank_fails_everywhere(comm):
    torch = pytest.importorskip("torch")  # noqa: F841
    import ccoll.torch as ct

    with pytest.raises(MismatchError) as info:
        ct.CCollHookState(error_feedback=comm.rank == 1, comm=comm)
    same_error_everywhere(comm, info, MismatchError, "error_feedback (False on rank")


@needs_two
@pytest.mark.parametrize("kw", [{"start_iter": 3}, {"min_numel": 10}, {"eb": "abs:1e-3"}])
def test_hook_settings_on_one_rank_fail_everywhere(comm, kw):
    pytest.importorskip("torch")
    import ccoll.torch as ct

    with pytest.raises(MismatchError) as info:
        ct.CCollHookState(comm=comm, **(kw if comm.rank == comm.size - 1 else {}))
    name = {"start_iter": "start_iter", "min_numel": "min_numel", "eb": "error-bound kind"}
    same_error_everywhere(comm, info, MismatchError, name[next(iter(kw))])


@needs_two
@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [({"start_iter": -1}, "InputError", "start_iter must be an int >= 0"),
     ({"eb": "bogus"}, "ErrorBoundError", "bound string must look like"),
     ({"policy": "fast"}, "InputError", "policy must be one of"),
     ({"error_feedback": "yes"}, "InputError", "error_feedback must be True or False")],
)
def test_hook_bad_argument_on_one_rank_fails_everywhere(comm, kw, exc, match):
    # The rank with the bad argument must not raise before the agreement, or the others
    # would wait for it there.
    pytest.importorskip("torch")
    import ccoll.errors
    import ccoll.torch as ct

    exc_type = getattr(ccoll.errors, exc)
    with pytest.raises(exc_type) as info:
        ct.CCollHookState(comm=comm, timeout=30,
                          **(kw if comm.rank == comm.size - 1 else {}))
    same_error_everywhere(comm, info, exc_type, match)


# -- out that overlaps x ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["raw", "compress"])
@pytest.mark.parametrize("eb", [None, ccoll.ABS(1e-3)], ids=["exact", "abs"])
def test_out_partly_overlapping_x_is_refused_everywhere(comm, policy, eb):
    a = np.arange(11, dtype=np.float64) + comm.rank
    before = a.copy()
    with pytest.raises(InputError) as info:
        ccoll.allreduce(a[:-1], eb=eb, comm=comm, out=a[1:], policy=policy)
    same_error_everywhere(comm, info, InputError, "out overlaps x")
    assert np.array_equal(a, before)  # nothing written


def test_out_on_the_same_buffer_as_x_is_in_place_and_exact(comm):
    a = np.arange(10, dtype=np.float64) + comm.rank
    want = np.arange(10, dtype=np.float64) * comm.size + sum(range(comm.size))
    x = a[:]
    out = a.reshape(2, 5).reshape(10)  # another view object on the very same buffer
    y = ccoll.allreduce(x, eb=None, comm=comm, out=out)
    assert y is out
    assert np.array_equal(a, want), (a, want)


# -- resources -------------------------------------------------------------------------------


def _used(c: ccoll.Communicator) -> list[MPI.Intracomm]:
    """Run a pipelined compressed call on both channels; return the channels' duplicates."""
    x = gradient_like(c.rank, 4000 * c.size, np.float32)
    c.allreduce(x, eb=ccoll.ABS(1e-3))
    c.iallreduce(x, eb=ccoll.ABS(1e-3)).wait(timeout=60)
    return [c._sync.ch.comm, c._async.ch.comm]


def test_close_frees_duplicates_and_is_idempotent(comm):
    c = ccoll.Communicator(comm, policy="compress", chunk_elems=512)
    dups = _used(c)
    assert all(d != MPI.COMM_NULL for d in dups)
    c.close()
    assert all(d == MPI.COMM_NULL for d in dups)
    c.close()  # again: nothing
    c.free()  # the older name
    assert (c.rank, c.size) == (comm.Get_rank(), comm.Get_size())  # still answer
    with pytest.raises(CollectiveError, match="closed"):
        c.allreduce(np.zeros(3, np.float32), eb=None)


def test_dropped_communicator_is_released_by_gc(comm):
    # Its threads stop and its buffers go; its duplicates stay with MPI_Finalize, since
    # MPI_Comm_free is collective and a collector runs at a point of its own on each rank
    # (tests/mpi/test_comm_free.py).
    from ccoll.collectives import channel

    c = ccoll.Communicator(comm, policy="compress", chunk_elems=512)
    dups = _used(c)
    workers = [c._sync.ch.worker, c._async.ch.worker]
    # Host tasks ran on the shared lanes (or a private thread with CCOLL_SCHED=off).
    assert any(w._thread is not None or w.used_lanes for w in workers)
    leaked = channel.LEAKED[0]
    del c
    gc.collect()
    assert all(w._thread is None and not w._lane_heap for w in workers)
    assert channel.LEAKED[0] == leaked + 2
    for d in dups:  # not freed: still a communicator of every rank
        assert d != MPI.COMM_NULL and d.allreduce(1) == comm.size
        d.Free()


def test_with_block_closes(comm):
    with ccoll.Communicator(comm, policy="compress", chunk_elems=512) as c:
        dups = _used(c)
    assert all(d == MPI.COMM_NULL for d in dups)


def test_hook_state_close_with_and_gc(comm):
    pytest.importorskip("torch")
    import ccoll.torch as ct

    with ct.CCollHookState(comm=comm) as s:
        dups = [s.comm, s._gate_comm, s.communicator._sync.ch.comm]
    assert all(d == MPI.COMM_NULL for d in dups)
    s.close()  # again: nothing
    s = ct.CCollHookState(comm=comm)
    dups = [s.comm, s._gate_comm, s.communicator._sync.ch.comm]
    worker = s.communicator._sync.ch.worker
    del s
    gc.collect()
    assert worker.closed
    for d in dups:  # left to MPI_Finalize, as a dropped Communicator's
        assert d != MPI.COMM_NULL and d.allreduce(1) == comm.size
        d.Free()


def test_fsdp_reduce_scatter_close_with_and_gc(comm):
    # As the hook state: close() frees (on every rank); a collected one frees nothing.
    pytest.importorskip("torch")
    import ccoll.torch as ct

    with ct.FSDPReduceScatter(comm=comm) as rs:
        dups = [rs.comm, rs.communicator._sync.ch.comm]
    assert all(d == MPI.COMM_NULL for d in dups)
    rs.close()  # again: nothing
    rs = ct.FSDPReduceScatter(comm=comm)
    dups = [rs.comm, rs.communicator._sync.ch.comm]
    worker = rs.communicator._sync.ch.worker
    del rs
    gc.collect()
    assert worker.closed
    for d in dups:  # left to MPI_Finalize, as a dropped Communicator's
        assert d != MPI.COMM_NULL and d.allreduce(1) == comm.size
        d.Free()


def test_ring_with_more_chunks_than_tags_stays_within_tag_limit(comm, monkeypatch):
    # A small tag limit stands for a message whose chunk indices would pass MPI_TAG_UB.
    monkeypatch.setattr(layout, "MAX_CHUNKS", 3)
    n = 1000 * comm.size
    x = gradient_like(comm.rank, n, np.float32)
    with ccoll.Communicator(comm, policy="compress", chunk_elems=16) as c:
        lay = layout.Layout(n, comm.size, 16)
        assert lay.max_chunks <= 3 and lay.chunk_elems > 16
        y = c.allreduce(x, eb=ccoll.ABS(1e-3))
    monkeypatch.setattr(layout, "MAX_CHUNKS", 1 << 15)
    with ccoll.Communicator(comm, policy="compress", chunk_elems=lay.chunk_elems) as c:
        want = c.allreduce(x, eb=ccoll.ABS(1e-3))
    assert y.tobytes() == want.tobytes()
    assert layout.MAX_CHUNKS - 1 <= comm.Get_attr(MPI.TAG_UB)


# IEEE outcomes in the sums (Inf + -Inf is NaN, a sum past the dtype's largest is ±Inf)
# are results, not errors: numpy's RuntimeWarnings for them, which pytest here (and any
# user running with -W error) turns into exceptions, must not escape from one rank's
# collective. Element 3: +Inf on rank 0, -Inf on rank 1. Element 5: a value of about 0.6
# of the dtype's largest on every rank, so that a sum of two or more overflows.
def _ieee_input(comm, dtype) -> np.ndarray:
    x = gradient_like(comm.rank, 4000, dtype)
    if comm.rank == 0:
        x[3] = np.inf
    elif comm.rank == 1:
        x[3] = -np.inf
    x[5] = dtype(float(np.finfo(dtype).max) * 0.6)
    return x


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("opts", [
    {"algorithm": "dar"},
    {"algorithm": "homomorphic", "split": 0.0},
    {"algorithm": "homomorphic", "split": 0.5},
    {"algorithm": "homomorphic", "ranks_per_node": 2},
], ids=["dar", "homomorphic", "split", "two-levels"])
def test_inf_and_overflow_in_sums_give_nan_and_inf_without_warnings(comm, opts, dtype):
    if "ranks_per_node" in opts and SIZE % 2:
        opts = {**opts, "ranks_per_node": 1}
    x = _ieee_input(comm, dtype)
    # float16 sums of values near its largest are 32 apart: a bound the dtype can hold on
    # a result of that magnitude (a smaller one is refused on every rank, test_narrow_bound).
    eb = ccoll.ABS(64.0 if dtype == np.float16 else 1e-3)
    with ccoll.Communicator(comm, policy="compress", chunk_elems=1000, **opts) as c:
        y = c.allreduce(x, eb)
        assert c.last_call.compressed
    assert y.dtype == x.dtype
    if SIZE >= 2:
        assert np.isnan(y[3])
        assert np.isposinf(y[5])
    else:
        assert np.isposinf(y[3]) and y[5] == x[5]
    rest = np.r_[0:3, 6:4000]
    assert np.all(np.isfinite(y[rest]))
    assert_same_on_every_rank(comm, y)


# -- a check that fails on one rank alone ------------------------------------------------


@pytest.mark.parametrize("where", ["range", "fast way"])
def test_a_check_that_raises_on_one_rank_is_told_to_every_rank(comm, monkeypatch, where):
    # Any exception of the checks before the agreement (here injected on the last rank:
    # the REL bound's range pass, or the fast way's look at the arguments) used to leave
    # that rank alone with it while the others went on into the agreement: their call then
    # met that rank's next one (wrong sums, then a hang). The agreement now carries it.
    from ccoll.collectives import calls, prepare

    x = gradient_like(comm.rank, 50_000, np.float32, seed=41)
    with ccoll.Communicator(comm, timeout=30) as cc:
        for _ in range(3):  # a repeat: the fast way looks at it first
            cc.allreduce(x, eb=None)

        def boom(*args, **kwargs):
            raise ZeroDivisionError("injected")

        if comm.rank == comm.size - 1:
            monkeypatch.setattr(prepare, "value_range", boom)
            if where == "fast way":
                monkeypatch.setattr(calls, "ready", boom)
        with pytest.raises(InputError) as info:
            cc.allreduce(x, eb=ccoll.REL(1e-3), policy="compress")
        same_error_everywhere(comm, info, InputError, "raised ZeroDivisionError: injected")
        assert f"rank {comm.size - 1}:" in str(info.value)
        monkeypatch.undo()
        # Nothing was left in flight: the same call now runs, within its bound, everywhere.
        y = cc.allreduce(x, eb=ccoll.REL(1e-3), policy="compress")
        ref, eb = exact_sum(comm, x), global_eb(comm, x, ccoll.REL(1e-3))
        assert_within(y, ref, **allowance(eb, y, SIZE, "sum"))
        assert_same_on_every_rank(comm, y)


def test_a_blocking_call_while_another_thread_is_in_one_is_refused(comm):
    # Two threads in blocking calls of one Communicator at once (erroneous in MPI) froze
    # until the timeout, raised a bare AssertionError from the ring or a misleading
    # MismatchError, or failed on one rank only. The second call is now refused at once,
    # before it takes part in anything; here the first call is held inside by a thread.
    import threading

    from ccoll.collectives import calls

    x = gradient_like(comm.rank, 5_000, np.float32, seed=43)
    with ccoll.Communicator(comm, timeout=30) as cc:
        inside, leave = threading.Event(), threading.Event()
        real = calls.prepare
        errors: list[BaseException] = []

        def held(*args, **kwargs):  # the first thread waits inside its call
            inside.set()
            leave.wait(30)
            return real(*args, **kwargs)

        def first():
            try:
                cc.allreduce(x, eb=ccoll.ABS(1e-3), policy="compress")
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        calls.prepare = held
        try:
            t = threading.Thread(target=first)
            t.start()
            assert inside.wait(30)
            with pytest.raises(CollectiveError, match="another thread is in a blocking call"):
                cc.allreduce(x, eb=None)
        finally:
            calls.prepare = real
            leave.set()
            t.join(60)
        assert not errors, errors
        # The first call ran to its end on every rank, and the Communicator goes on.
        y = cc.allreduce(x, eb=ccoll.ABS(1e-3), policy="compress")
        ref = exact_sum(comm, x)
        assert_within(y, ref, **allowance(ccoll.ABS(1e-3).value, y, SIZE, "sum"))
        assert_same_on_every_rank(comm, y)


# -- bounds at the ends of float64's range ------------------------------------------------


@pytest.mark.parametrize("opts", [
    {}, {"split": 0.0}, {"schedule": "halving"}, {"format_version": 2},
], ids=["auto-split", "ring", "halving", "format2"])
@pytest.mark.parametrize("eb", [2.6e-322, 1e-320, 5e-324, 3e-310], ids=repr)
def test_a_subnormal_bound_is_met_on_every_rank(comm, opts, eb):
    # A bound among float64's subnormals: each rank's share eb/N rounded up there (the
    # margin's product rounds back), N shares exceeded eb, and the ring's check of a
    # received stream's bound raised FormatError on one rank while another hung.
    rng = np.random.default_rng(comm.Get_rank())
    x = rng.integers(-40, 40, 1000) * 5e-324  # subnormal data, on eb's scale
    # Ordinary values beside it (raw lanes: their float64 sums may round, by 2^-53 of a
    # partial sum, docs/error-bound.md "Lanes with a raw input"; these sum exactly).
    x[::7] = rng.integers(-1000, 1000, x[::7].size) * 2.0**-10
    bound = ccoll.ABS(eb)
    with ccoll.Communicator(comm, policy="compress", timeout=60, **opts) as c:
        for op in ("sum", "avg"):
            y = c.allreduce(x, bound, op=op)
            assert_within(y, allreduce_reference(comm, x, op),
                          **allowance(global_eb(comm, x, bound), y, SIZE, op))
            assert_same_on_every_rank(comm, y)
            part = c.reduce_scatter(x, bound, op=op)
            lo, hi = _my_block(comm, x.size)
            assert_within(part, allreduce_reference(comm, x, op)[lo:hi],
                          **allowance(global_eb(comm, x, bound), part, SIZE, op))


@pytest.mark.parametrize("n", [1, 1000])
@pytest.mark.parametrize("eb", [1e308, float(np.finfo(np.float64).max)], ids=["1e308", "max"])
def test_an_average_whose_sum_bound_overflows_is_met_everywhere(comm, n, eb):
    # op="avg" runs the ring with the sum's bound N * eb: beyond float64's range that was
    # inf, refused inside the ring ("absolute bound must be finite ..., got inf") on the
    # ranks that own a block, while the others waited for the timeout; the Communicator
    # was then unusable.
    x = np.linspace(-1e300, 1e300, n) * (comm.Get_rank() + 1)
    with ccoll.Communicator(comm, policy="compress", timeout=60) as c:
        for _ in range(2):  # usable again after the first
            y = c.allreduce(x, ccoll.ABS(eb), op="avg")
            assert np.all(np.isfinite(y))
            assert_within(y, allreduce_reference(comm, x, "avg"),
                          **allowance(global_eb(comm, x, ccoll.ABS(eb)), y, SIZE, "avg"))
            assert_same_on_every_rank(comm, y)
            part = c.reduce_scatter(x, ccoll.ABS(eb), op="avg")
            lo, hi = _my_block(comm, n)
            assert_within(part, allreduce_reference(comm, x, "avg")[lo:hi],
                          **allowance(global_eb(comm, x, ccoll.ABS(eb)), part, SIZE, "avg"))


def _my_block(comm, n):
    """This rank's block of ``reduce_scatter`` over ``n`` elements (lo, hi)."""
    counts = [len(b) for b in np.array_split(np.empty(n), comm.Get_size())]
    lo = sum(counts[:comm.Get_rank()])
    return lo, lo + counts[comm.Get_rank()]

