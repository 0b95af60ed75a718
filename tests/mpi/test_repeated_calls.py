"""A repeated raw call runs without the agreement: the fast path (run with 1..5 ranks).

Once the agreed history predicts a call's signature (the last call's, or what followed it
last time) and that signature's plan is raw and settled (``eb=None``, ``policy="raw"``, or
``policy="auto"`` raw whatever the data), every rank runs the MPI collective at once and the
data collective carries the check (ccoll/collectives/fastpath.py). The result of a repeat
must be MPI's bit for bit (an allreduce's check is its sum's first element: a rank whose
call differs sends NaNs), the call report must say that it ran so; a rank that changes its
arguments (or passes bad ones) after such calls must make every rank raise the same error,
never hang, and leave the Communicator usable, also where the data's own first element is
a NaN.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest
from collkit import allowance, allreduce_reference, global_eb
from kit import assert_same_on_every_rank, assert_within
from mpi4py import MPI

import ccoll
from ccoll.errors import DTypeError, ErrorBoundError, InputError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
needs_two = pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
COLLECTIVES = ["allreduce", "reduce_scatter", "allgather", "bcast"]
REPEATED = "; repeated: ran without the agreement"


class NotFast(AssertionError):
    """A repeated call that should have run without the agreement did not."""


def fast_marks(collective: str) -> list:
    return []


def expect_fast(seen: list[bool], want: list[bool]) -> None:
    """``seen`` (overlapped per call) is ``want``; raise :class:`NotFast` otherwise."""
    if seen != want:
        raise NotFast(f"overlapped per call {seen}, expected {want}")


def data(rank: int, n: int = 1000, dtype: type = np.float32, seed: int = 0) -> np.ndarray:
    """Values whose float sums depend on the order of the additions."""
    rng = np.random.default_rng([seed, rank, n])
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)


def mpi_result(comm, collective: str, x: np.ndarray, root: int = 0) -> np.ndarray:
    """Plain MPI's answer (blocking calls on a duplicate of comm, as ccoll makes them)."""
    d = comm.Dup()
    try:
        if collective == "allreduce":
            y = np.empty_like(x)
            d.Allreduce(x, y, op=MPI.SUM)
        elif collective == "reduce_scatter":
            counts = [len(b) for b in np.array_split(np.arange(x.size), d.size)]
            y = np.empty(counts[d.rank], x.dtype)
            d.Reduce_scatter(x, y, recvcounts=counts, op=MPI.SUM)
        elif collective == "allgather":
            y = np.empty((d.size, *x.shape), x.dtype)
            d.Allgather(x, y)
        else:
            y = x.copy()
            d.Bcast(y, root=root)
        return y
    finally:
        d.Free()


def call(c: ccoll.Communicator, collective: str, x, **kw):
    if collective in ("allreduce", "reduce_scatter"):
        return getattr(c, collective)(x, **kw)
    kw.pop("op", None)
    return getattr(c, collective)(x, **kw)


def same_error_everywhere(comm, exc_info, exc_type, match):
    err = exc_info.value
    assert type(err) is exc_type, f"{type(err).__name__}: {err}"
    assert match in str(err), str(err)
    msgs = comm.allgather(str(err))
    assert len(set(msgs)) == 1, msgs


def same_report(a, b) -> None:
    """Two reports of the same call, one through the agreement and one without it."""
    keep = ("collective", "compressed", "policy", "algorithm", "dtype", "count", "eb_abs",
            "bytes_input", "bytes_sent", "chunk_elems", "hierarchical", "format_version",
            "path", "trial", "predicted_raw_s", "predicted_compressed_s", "ratio")
    assert {k: getattr(a, k) for k in keep} == {k: getattr(b, k) for k in keep}, (a, b)
    assert b.reason == a.reason + REPEATED, (a.reason, b.reason)


@pytest.mark.parametrize("collective", [pytest.param(c, marks=fast_marks(c))
                                        for c in COLLECTIVES])
@pytest.mark.parametrize("opts, kw", [({}, {"eb": None}), ({"policy": "raw"}, {})],
                         ids=["exact", "policy-raw"])
def test_repeated_raw_call_runs_without_the_agreement_and_equals_mpi(comm, collective, opts,
                                                                     kw):
    x = data(comm.rank)
    want = mpi_result(comm, collective, x)
    with ccoll.Communicator(comm, **opts) as c:
        seen, reports = [], []
        for _ in range(4):
            y = call(c, collective, x, **kw)
            assert type(y) is np.ndarray
            assert y.dtype == want.dtype and y.shape == want.shape
            assert y.tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
            reports.append(c.last_call)
        assert c.stats.calls == 4
        assert comm.allreduce(reports[0].bytes_sent) > 0 or SIZE == 1
        # The same decision on every rank, call by call.
        every = comm.allgather([r.decision() for r in reports])
        assert all(d == every[0] for d in every), every
        # The first call has nothing to repeat; every later one ran without the agreement
        # and reports what the first did (the same bytes counted, the same reason).
        expect_fast(seen, [False, True, True, True])
        for r in reports[1:]:
            same_report(reports[0], r)
        assert str(c.last_call).startswith(f"{collective} float32[1000] raw (")
        assert REPEATED + ")" in str(c.last_call)


def test_repeated_auto_call_that_goes_raw_runs_without_the_agreement(comm):
    # 64 B: raw whatever the data on any link. The first call moves its data with the
    # agreement (one collective of more elements: within the bound, identical on every
    # rank); its repeats run the data's own MPI_Allreduce: MPI's result bit for bit.
    x = data(comm.rank, 16)
    eb = ccoll.REL(1e-3)
    want = mpi_result(comm, "allreduce", x)
    with ccoll.Communicator(comm) as c:
        reports = []
        for i in range(5):
            y = c.allreduce(x)  # the default bound: REL(1e-3)
            assert y.dtype == x.dtype and y.shape == x.shape
            assert_within(y, allreduce_reference(comm, x, "sum"),
                          **allowance(global_eb(comm, x, eb), y, SIZE, "sum"))
            assert_same_on_every_rank(comm, y)
            if i:
                assert y.tobytes() == want.tobytes()
            reports.append(c.last_call)
        assert all(r.mode == "raw" and r.path == "raw" for r in reports), [str(r) for r in
                                                                           reports]
        assert [r.overlapped for r in reports] == [False] + [True] * 4, [str(r) for r in
                                                                         reports]
        assert reports[0].reason == ("one rank" if SIZE == 1 else "too small to gain")
        for r in reports[1:]:
            same_report(reports[0], r)
        decisions = comm.allgather([r.decision() for r in reports])
        assert all(d == decisions[0] for d in decisions)


@pytest.mark.parametrize("eb, same", [("rel:1e-3", ccoll.REL(1e-3)), (1e-3, ccoll.ABS(1e-3))],
                         ids=["string", "float"])
def test_a_bound_given_as_a_string_or_a_float_repeats_without_the_agreement(comm, eb, same):
    # The API takes "rel:1e-3" and plain floats as bounds; their repeats must run the
    # fast way as ccoll.REL/ABS do, and plan, report and result as those.
    x = data(comm.rank, 16)
    with ccoll.Communicator(comm) as c, ccoll.Communicator(comm) as ref:
        reports, ref_reports = [], []
        for _ in range(4):
            y = c.allreduce(x, eb)
            assert_within(y, allreduce_reference(comm, x, "sum"),
                          **allowance(global_eb(comm, x, same), y, SIZE, "sum"))
            assert_same_on_every_rank(comm, y)
            reports.append(c.last_call)
            ref.allreduce(x, same)
            ref_reports.append(ref.last_call)
        assert [r.overlapped for r in reports] == [False] + [True] * 3, [str(r) for r in
                                                                         reports]
        keep = ("compressed", "reason", "overlapped", "eb_abs", "bytes_sent", "path")
        assert [[getattr(r, k) for k in keep] for r in reports] == [
            [getattr(r, k) for k in keep] for r in ref_reports]
        # A rank that changes the string's bound after the repeats: the same error
        # everywhere, never a hang.
        if SIZE > 1:
            other = "rel:1e-2" if comm.rank == SIZE - 1 else "rel:1e-3"
            with pytest.raises(MismatchError) as info:
                c.allreduce(x, other if eb == "rel:1e-3" else
                            (2e-3 if comm.rank == SIZE - 1 else 1e-3))
            same_error_everywhere(comm, info, MismatchError, "error-bound value")


def test_avg_in_place_and_float16_repeated(comm):
    x = data(comm.rank, 257, np.float64)
    want = mpi_result(comm, "allreduce", x) / np.float64(SIZE)
    with ccoll.Communicator(comm) as c:
        for i in range(3):
            buf = x.copy()
            y = c.allreduce(buf, eb=None, op="avg", out=buf)
            assert y is buf and buf.tobytes() == want.tobytes()
            assert c.last_call.overlapped == (i > 0)
        # float16 moves as float32: MPI's float32 sum, rounded once to float16.
        h = data(comm.rank, 33, np.float16)
        want16 = mpi_result(comm, "allreduce", h.astype(np.float32)).astype(np.float16)
        for i in range(3):
            y = c.allreduce(h, eb=None)
            assert y.dtype == np.float16 and y.tobytes() == want16.tobytes()
            assert c.last_call.overlapped == (i > 0)
            assert c.last_call.bytes_input == 33 * 4  # its float32 copy, whichever way
        for _ in range(3):
            out = np.empty_like(h)
            y = c.allreduce(h, eb=None, out=out)
            assert y is out and out.tobytes() == want16.tobytes()
            assert c.last_call.overlapped  # out does not change the signature


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_torch_tensors_repeated(comm, dtype):
    # CPU tensors in, tensors out, the fast way too; float16 and bfloat16 move as float32
    # and are rounded once to their dtype (torch's own rounding to nearest).
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    t = torch.from_numpy(data(comm.rank, 301, np.float32)).to(tdt)
    wide = t.to(torch.float64 if dtype == "float64" else torch.float32).numpy()
    want = torch.from_numpy(mpi_result(comm, "allreduce", wide)).to(tdt)
    with ccoll.Communicator(comm) as c:
        seen = []
        for i in range(4):
            out = torch.empty_like(t) if i == 3 else None
            y = c.allreduce(t, eb=None, out=out)
            assert isinstance(y, torch.Tensor) and y.dtype == tdt and y.shape == t.shape
            assert bits(y) == bits(want)
            if out is not None:
                assert y is out
            seen.append(c.last_call.overlapped)
            assert c.last_call.dtype == dtype
        assert seen == [False, True, True, True]
        # reduce_scatter of a tensor the fast way: a tensor of this rank's block.
        t32 = torch.from_numpy(data(comm.rank, 301, np.float32))
        want_rs = mpi_result(comm, "reduce_scatter", t32.numpy())
        for i in range(3):
            y = c.reduce_scatter(t32, eb=None)
            assert isinstance(y, torch.Tensor) and y.numpy().tobytes() == want_rs.tobytes()
            assert c.last_call.overlapped == (i > 0)


def bits(t) -> bytes:
    """The bytes of a CPU tensor (bfloat16 has no numpy dtype)."""
    import torch

    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_a_repeating_sequence_of_calls_is_predicted(comm):
    # A training step's buckets: the same few calls in the same order, every step.
    sizes = [300, 7, 4096]
    xs = [data(comm.rank, n) for n in sizes]
    wants = [mpi_result(comm, "allreduce", x) for x in xs]
    with ccoll.Communicator(comm) as c:
        seen = []
        for _step in range(3):
            for x, want in zip(xs, wants, strict=True):
                assert c.allreduce(x, eb=None).tobytes() == want.tobytes()
                seen.append(c.last_call.overlapped)
        # The first step teaches what follows what; the second call of the second step
        # is the first one predicted (the first followed nothing yet).
        expect_fast(seen, [False] * 4 + [True] * 5)


@pytest.mark.parametrize("eb", [None, ccoll.REL(1e-3)], ids=["exact", "auto-raw"])
def test_with_a_timeout_the_repeated_call_is_exact(comm, eb):
    # The timeout's nonblocking path: integer-valued data, whose sum is exact in any order
    # (with a bound too: the auto call that goes raw carries its flag in the data).
    x = np.arange(1000, dtype=np.float32) * (comm.rank + 1)
    want = np.arange(1000, dtype=np.float32) * (SIZE * (SIZE + 1) // 2)
    with ccoll.Communicator(comm, timeout=60.0) as c:
        for i in range(3):
            assert c.allreduce(x, eb=eb).tobytes() == want.tobytes()
            assert c.last_call.overlapped == (i > 0)
            assert not c.last_call.compressed
        if SIZE > 1:
            # Nobody repeats.
            with pytest.raises(MismatchError) as info:
                c.allreduce(x[: 500 + (comm.rank == SIZE - 1)], eb=eb)
            same_error_everywhere(comm, info, MismatchError, "element count")
            for i in range(3):  # after an error: predicted again from its third call
                assert c.allreduce(x, eb=eb).tobytes() == want.tobytes()
                assert c.last_call.overlapped == (i == 2)
            # All but the last rank repeat: they run the data collective under the
            # deadline, the last rank joins it with zeros and its flag.
            with pytest.raises(MismatchError) as info:
                c.allreduce(x[: 999] if comm.rank == SIZE - 1 else x, eb=eb)
            same_error_everywhere(comm, info, MismatchError, "element count")
        seen = []
        for _ in range(3):
            assert c.allreduce(x, eb=eb).tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        assert seen == ([False, False, True] if SIZE > 1 else [True, True, True])


# What the last rank changes after three identical calls: (collective, change, kwargs of
# the changed call on that rank, expected error type, text the message must contain).
CHANGES = [
    ("allreduce", "count", {"n": 999}, MismatchError, "element count"),
    ("allreduce", "dtype", {"dtype": np.float64}, MismatchError, "dtype"),
    ("allreduce", "op", {"op": "avg"}, MismatchError, "op"),
    ("allreduce", "eb", {"eb": ccoll.ABS(1e-3)}, MismatchError, "error-bound kind"),
    ("allreduce", "policy", {"policy": "compress", "eb": ccoll.ABS(1e-3)}, MismatchError,
     "policy"),
    ("allreduce", "bad op", {"op": "max"}, InputError, "op 'max' is not supported"),
    ("allreduce", "bad dtype", {"dtype": np.int32}, DTypeError, "dtype int32"),
    ("allreduce", "bad out", {"out": "short"}, InputError, "out has shape"),
    ("allreduce", "strided out", {"out": "strided"}, InputError, "C-contiguous"),
    ("allreduce", "collective", {"collective": "allgather"}, MismatchError,
     "different collectives"),
    ("reduce_scatter", "count", {"n": 1001}, MismatchError, "element count"),
    ("allgather", "count", {"n": 1}, MismatchError, "element count"),
    ("allgather", "shape", {"shape": (10, 100)}, MismatchError, "shape"),
    ("bcast", "root", {"root": SIZE - 1}, MismatchError, "root"),
    ("bcast", "count", {"n": 2000}, MismatchError, "element count"),
]


@needs_two
@pytest.mark.parametrize("collective, change, kw, exc, match", [
    pytest.param(*c, marks=fast_marks(c[0]), id=f"{c[0]}-{c[1]}") for c in CHANGES])
def test_one_rank_changes_after_repeated_calls(comm, collective, change, kw, exc, match):
    x = data(comm.rank)
    want = mpi_result(comm, collective, x)
    with ccoll.Communicator(comm) as c:
        seen = []
        for _ in range(3):
            assert call(c, collective, x, eb=None).tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        changer = comm.rank == SIZE - 1
        args = {"eb": None}
        arg = x
        if changer:
            kw = dict(kw)
            n = kw.pop("n", x.size)
            dtype = kw.pop("dtype", np.float32)
            shape = kw.pop("shape", None)
            arg = data(comm.rank, n, dtype)
            if shape is not None:
                arg = arg.reshape(shape)
            if kw.get("out") == "short":
                kw["out"] = np.empty(3, np.float32)
            elif kw.get("out") == "strided":
                kw["out"] = np.empty(2 * x.size, np.float32)[::2]
            collective_here = kw.pop("collective", collective)
            args.update(kw)
        else:
            collective_here = collective
        with pytest.raises(exc) as info:
            call(c, collective_here, arg, **args)
        same_error_everywhere(comm, info, exc, match)
        # Nothing is left in flight: the next well-formed calls work, exactly, and run
        # without the agreement again once the history predicts them again (the failed
        # call went in as "not to be predicted from" after this signature: from the third).
        for _ in range(3):
            assert call(c, collective, x, eb=None).tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        expect_fast(seen, [False, True, True, False, False, True])


@needs_two
def test_out_or_in_place_on_one_rank_only_is_fine(comm):
    x = data(comm.rank)
    want = mpi_result(comm, "allreduce", x)
    with ccoll.Communicator(comm) as c:
        for i in range(4):
            buf = x.copy()
            kw = {}
            if comm.rank == 0 and i == 2:
                kw["out"] = buf  # in place on rank 0 only
            elif comm.rank == 0 and i == 3:
                kw["out"] = np.empty_like(x)
            y = c.allreduce(buf, eb=None, **kw)
            assert y.tobytes() == want.tobytes()
            if "out" in kw:
                assert y is kw["out"]
            assert c.last_call.overlapped == (i > 0)


class Sub(np.ndarray):
    """A numpy subclass: a valid input that only the full way converts."""


@needs_two
def test_a_call_one_rank_cannot_run_the_fast_way_is_never_predicted(comm):
    # Rank 0 passes valid arguments the fast path does not take (a numpy subclass, a
    # tensor as out of a numpy x): its agreement says so, and no rank runs those calls
    # without the agreement (no rank waits in a data collective that another skipped).
    torch = pytest.importorskip("torch")
    x = data(comm.rank)
    want = mpi_result(comm, "allreduce", x)
    with ccoll.Communicator(comm, timeout=60.0) as c:
        seen = []
        for _ in range(4):
            arg = x.view(Sub) if comm.rank == 0 else x
            y = c.allreduce(arg, eb=None)
            assert np.asarray(y).tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        # Now every rank can: predicted from the second repeat on.
        for _ in range(3):
            assert c.allreduce(x, eb=None).tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        # Rank 0 breaks the repeats with a call it cannot run the fast way: every rank
        # runs it the full way (the others' data collective is joined, flagged), exactly.
        out = torch.empty(x.size, dtype=torch.float32) if comm.rank == 0 else None
        y = c.allreduce(x, eb=None, out=out)
        assert np.asarray(y).tobytes() == want.tobytes()
        seen.append(c.last_call.overlapped)
        assert seen == [False] * 5 + [True, True, False], seen
        assert len(set(comm.allgather(tuple(seen)))) == 1


@needs_two
def test_bcast_none_after_arrays_of_the_same_signature(comm):
    # The root and the others pass arrays, then some rank passes None (the root's shape
    # and dtype): the same broadcast, exactly, every time.
    x = data(comm.rank)
    want = mpi_result(comm, "bcast", x)
    with ccoll.Communicator(comm, policy="compress") as c:
        for i in range(4):
            arg = None if comm.rank == SIZE - 1 and i >= 2 else x
            assert c.bcast(arg, eb=None).tobytes() == want.tobytes()


@needs_two
@pytest.mark.parametrize("kind", ["None", "array"])
def test_bcast_with_none_after_repeated_calls(comm, kind):
    # A rank that passes None cannot run the fast way (it knows no shape): every rank
    # runs the broadcast the full way, and the result is the root's.
    x = data(comm.rank)
    want = mpi_result(comm, "bcast", x)
    with ccoll.Communicator(comm) as c:
        seen = []
        for _ in range(3):
            assert c.bcast(x, eb=None).tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        for _ in range(3):
            arg = None if comm.rank == SIZE - 1 and kind == "None" else x
            y = c.bcast(arg, eb=None)
            assert y.tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        # A call with None is never predicted from: the repeats are learned again.
        for _ in range(3):
            assert c.bcast(x, eb=None).tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        if kind == "None":
            expect_fast(seen, [False, True, True] + [False] * 3 + [False, False, True])
        else:
            expect_fast(seen, [False] + [True] * 8)


def test_compressed_calls_never_go_the_fast_way(comm):
    x = data(comm.rank, 2000)
    with ccoll.Communicator(comm, policy="compress") as c:
        for _ in range(3):
            c.allreduce(x, eb=ccoll.ABS(1e-2))
            assert c.last_call.compressed and not c.last_call.overlapped
            assert not c.last_call.reason.endswith(REPEATED)
        for _ in range(3):
            c.allgather(x, eb=ccoll.ABS(1e-2))
            assert c.last_call.compressed and not c.last_call.overlapped


# ---------------------------------------------------------------- agreed state only



def _record_environment_reads(monkeypatch) -> list[str]:
    """Record the reads of os.environ made by ccoll's code.

    By key, by iteration, by ``in`` and through os.environ's bytes dict. Other packages'
    reads are not ccoll's (scipy's variables when numba first imports it, numba's scan of
    the whole environment when it compiles).
    """

    reads: list[str] = []
    ccoll_dir = os.path.dirname(ccoll.__file__)

    def note(what: str, key: object) -> None:
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename.endswith(
                ("os.py", "_collections_abc.py", "<frozen os>", "<frozen _collections_abc>")):
            f = f.f_back
        if f is not None and f.f_code.co_filename.startswith(ccoll_dir):
            text = key.decode() if isinstance(key, bytes) else str(key)
            reads.append(f"{what}({text}) at {f.f_code.co_filename}:{f.f_lineno}")

    env_type = type(os.environ)
    real_getitem, real_get, real_iter, real_contains = (
        env_type.__getitem__, env_type.get, env_type.__iter__, env_type.__contains__)

    def getitem(self, key):
        note("[]", key)
        return real_getitem(self, key)

    def get(self, key, default=None):
        note("get", key)
        return real_get(self, key, default)

    def iterate(self):
        note("iter", "")
        return real_iter(self)

    def contains(self, key):
        note("in", key)
        return real_contains(self, key)

    class Recording(dict):
        def __getitem__(self, key):
            note("_data[]", key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            note("_data.get", key)
            return super().get(key, default)

        def __contains__(self, key):
            note("_data in", key)
            return super().__contains__(key)

    monkeypatch.setattr(env_type, "__getitem__", getitem)
    monkeypatch.setattr(env_type, "get", get)
    monkeypatch.setattr(env_type, "__iter__", iterate)
    monkeypatch.setattr(env_type, "__contains__", contains)
    monkeypatch.setattr(os.environ, "_data", Recording(os.environ._data))
    return reads


def test_no_call_reads_the_environment(comm, monkeypatch):
    # Settings are read once, when the Communicator is made: no call reads os.environ,
    # whatever its kind or path.
    from ccoll.runtime import cpu_threads

    eb = ccoll.REL(1e-3)
    x = data(comm.rank, 3000)
    big = data(comm.rank, 1 << 16)
    # numba's thread pool is prepared once per process, by the first kernel (or here):
    # see test_the_first_kernel_reads_no_setting for what that step reads.
    cpu_threads.prepare()
    with ccoll.Communicator(comm) as c, ccoll.Communicator(comm, policy="compress") as cz:
        kinds = {
            "allreduce exact": lambda: c.allreduce(x, None),
            "allreduce raw": lambda: c.allreduce(x, eb, policy="raw"),
            "allreduce auto": lambda: c.allreduce(x, eb),
            "allreduce auto large": lambda: c.allreduce(big, eb, op="avg"),
            "allreduce compress": lambda: cz.allreduce(x, eb),
            "reduce_scatter exact": lambda: c.reduce_scatter(x, None),
            "reduce_scatter compress": lambda: cz.reduce_scatter(x, eb),
            "allgather exact": lambda: c.allgather(x, None),
            "allgather compress": lambda: cz.allgather(x, eb),
            "bcast exact": lambda: c.bcast(x, None),
            # its own signature (see test_bcast_none_after_arrays_of_the_same_signature)
            "bcast None": lambda: c.bcast(big if comm.rank == 0 else None, None),
            "bcast compress": lambda: cz.bcast(x, eb),
            "iallreduce auto": lambda: c.iallreduce(x, eb).wait(timeout=120),
            "iallreduce compress": lambda: cz.iallreduce(x, eb).wait(timeout=120),
        }
        reads = _record_environment_reads(monkeypatch)
        found = {}
        try:
            for name, fn in kinds.items():
                for _ in range(20):
                    fn()
                if reads:
                    found[name] = sorted(set(reads))
                    reads.clear()
        finally:
            monkeypatch.undo()
    assert found == {}, found


def test_the_first_kernel_reads_no_setting(comm, monkeypatch):
    # CCOLL_THREADS is one of the settings a Communicator reads when it is made; a value
    # set afterwards must not change its kernels' threads, even at the process's first
    # kernel (numba's pool not prepared yet, as in a fresh process).
    from ccoll.runtime import cpu_threads

    monkeypatch.setattr(cpu_threads, "_layer", None)
    monkeypatch.setattr(cpu_threads, "_count", None)
    monkeypatch.delenv("CCOLL_THREADS", raising=False)
    x = data(comm.rank, 50_000)
    with ccoll.Communicator(comm, policy="compress") as c:
        made = cpu_threads.thread_count()
        assert made == c.threads
        monkeypatch.setenv("CCOLL_THREADS", "1" if made != 1 else "2")
        reads = _record_environment_reads(monkeypatch)
        c.allreduce(x, ccoll.ABS(1e-3))
        got = cpu_threads.thread_count()
        monkeypatch.undo()
    # (The first kernel sets OMP_WAIT_POLICY for OpenMP, as documented: not a setting read.)
    ccoll_reads = [r for r in reads if "(CCOLL_" in r]
    assert (got, ccoll_reads) == (made, [])


@needs_two
@pytest.mark.parametrize("n, eb", [(16, ccoll.REL(1e-3)), (300_000, None)],
                         ids=["auto-small", "exact-large"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_a_deviation_after_repeats_into_out_leaves_x_intact(comm, n, eb, in_place):
    # Repeats write the sum straight into out (or, in place, through a buffer of the
    # channel): when a rank's call then differs, every rank raises, x is what the caller
    # passed on every rank, and the next well-formed call writes out in full.
    x0 = data(comm.rank, n)
    want = allreduce_reference(comm, x0, "sum")
    exact = mpi_result(comm, "allreduce", x0)

    def check(y):
        if eb is None:  # plain MPI's result, bit for bit
            assert y.tobytes() == exact.tobytes()
        else:
            assert_within(y, want, **allowance(global_eb(comm, x0, eb), y, SIZE, "sum"))
    with ccoll.Communicator(comm) as c:
        for _ in range(4):
            x = x0.copy()
            out = x if in_place else np.full_like(x0, np.nan)
            got = c.allreduce(x, eb, out=out)
            assert got is out
            check(out)
        assert c.last_call.overlapped
        x = x0.copy()
        out = x if in_place else np.full_like(x0, np.nan)
        changed = data(comm.rank, n + 1) if comm.rank == SIZE - 1 else x
        with pytest.raises(MismatchError) as info:
            c.allreduce(changed, eb, out=None if comm.rank == SIZE - 1 else out)
        same_error_everywhere(comm, info, MismatchError, "element count")
        if in_place or comm.rank == SIZE - 1:
            assert x.tobytes() == x0.tobytes()  # the input survives the failed call
        y = c.allreduce(x, eb, out=out)
        assert y is out
        check(out)
        assert_same_on_every_rank(comm, out)


@pytest.mark.parametrize("eb", [None, "rel:1e-3", "REL"], ids=["exact", "string", "REL"])
def test_the_same_argument_objects_again_repeat_as_any_call(comm, eb):
    # A repeat whose arguments are the very objects of the last repeat skips their checks
    # (calls.run_call's memo): it must return what any repeat returns, in the caller's
    # shape, and a rank whose call then differs in a way those objects hide (another
    # shape or view of the same size) must be caught; an ErrorBound cannot change.
    n = 1000 if eb is None else 16  # sizes whose plan is raw and settled (fast way)
    bound = ccoll.REL(1e-3) if eb == "REL" else eb  # an object of this test's own
    x0 = data(comm.rank, n)
    exact = mpi_result(comm, "allreduce", x0)
    ref = allreduce_reference(comm, x0, "sum")

    def check(y, x):
        assert y.shape == x.shape and y.flags.c_contiguous
        if eb is None:  # plain MPI's result, bit for bit
            assert y.tobytes() == exact.tobytes()
        else:
            assert_within(y.reshape(-1), ref, **allowance(
                global_eb(comm, x0, ccoll.REL(1e-3)), y.reshape(-1), SIZE, "sum"))
        assert_same_on_every_rank(comm, y)
    with ccoll.Communicator(comm) as c:
        seen = []
        for _ in range(4):
            check(c.allreduce(x0, bound), x0)
            seen.append(c.last_call.overlapped)
        # The same size and dtype in another shape, and as a strided view.
        for x in (x0.reshape(n // 8, 8), np.repeat(x0, 2)[::2]):
            check(c.allreduce(x, bound), x)
            seen.append(c.last_call.overlapped)
            check(c.allreduce(x0, bound), x0)
            seen.append(c.last_call.overlapped)
        expect_fast(seen, [False] + [True] * 7)
        assert x0.tobytes() == data(comm.rank, n).tobytes()  # never written
        if eb == "REL":
            # The memo keeps the bound's value, and the bound object cannot change under
            # it (a bound is a value): setting it is refused and leaves the bound as it was.
            with pytest.raises(ErrorBoundError, match="cannot change"):
                bound.value = 1e-2
            assert bound.value == 1e-3
            check(c.allreduce(x0, bound), x0)


@pytest.mark.parametrize("change", ["none", "value", "kind"])
def test_a_new_bound_of_the_same_kind_and_value_repeats_through_the_memo(comm, monkeypatch,
                                                                        change):
    # A loop that writes REL(1e-3) in its call passes a new object every time. Of the same
    # kind and value, it must take the memo's repeat (no ready(): 12 against 3 us a call at
    # one rank) and give what any repeat gives; a rank whose new bound has another value or
    # kind must still be caught, on every rank.
    from ccoll.collectives import calls

    n = 16  # a size whose plan is raw and settled
    x0 = data(comm.rank, n)
    ref = allreduce_reference(comm, x0, "sum")
    readies = []
    real = calls.ready
    monkeypatch.setattr(calls, "ready", lambda *a, **k: (readies.append(1), real(*a, **k))[1])

    def check(y):
        assert_within(y, ref, **allowance(global_eb(comm, x0, ccoll.REL(1e-3)), y, SIZE, "sum"))
        assert_same_on_every_rank(comm, y)
    with ccoll.Communicator(comm) as c:
        seen = []
        for i in range(5):
            if i == 2:
                before = len(readies)  # the memo is made by the second call
            check(c.allreduce(x0, ccoll.REL(1e-3)))
            seen.append(c.last_call.overlapped)
        expect_fast(seen, [False] + [True] * 4)
        assert len(readies) == before, "a new equal bound missed the memo"
        if change == "none" or SIZE < 2:
            return
        other = ccoll.REL(1e-2) if change == "value" else ccoll.ABS(1e-3)
        with pytest.raises(MismatchError) as info:
            c.allreduce(x0, other if comm.rank == SIZE - 1 else ccoll.REL(1e-3))
        same_error_everywhere(comm, info, MismatchError,
                              "error-bound value" if change == "value" else "error-bound kind")
        check(c.allreduce(x0, ccoll.REL(1e-3)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", ["new", "out", "in-place"])
def test_the_same_objects_averaged_again_equal_mpi_divided(comm, dtype, where):
    # The memo's repeat (calls.run_call) divides by the rank count itself: its mean must be
    # MPI's sum divided by N in the array's dtype, bit for bit, into a new array of x's
    # shape, into out, or in place, on every repeat.
    x0 = data(comm.rank, 96, dtype).reshape(12, 8)
    want = mpi_result(comm, "allreduce", x0) / dtype(SIZE)
    out = None if where == "new" else np.empty_like(x0)
    x = out if where == "in-place" else x0
    with ccoll.Communicator(comm) as c:
        seen = []
        for _ in range(5):
            if where == "in-place":
                x[...] = x0
            y = c.allreduce(x, None, op="avg", out=out)
            assert y.shape == x0.shape and y.dtype == dtype
            assert y is out or out is None
            assert y.tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        expect_fast(seen, [False] + [True] * 4)
        assert where == "in-place" or x0.tobytes() == data(comm.rank, 96, dtype).tobytes()


@pytest.mark.parametrize("eb", [None, "rel:1e-3"], ids=["exact", "auto"])
@pytest.mark.parametrize("out", [False, True], ids=["new", "out"])
def test_a_nan_first_element_is_told_apart_from_a_call_that_differs(comm, eb, out):
    # A repeated allreduce proves that no rank's call differed by its sum's first element
    # (a rank whose call differs sends NaNs). Data whose own first element is a NaN makes
    # every rank ask the flags' collective instead: the result is still MPI's, the call
    # still repeats; and a rank that then changes its call is caught as any other.
    x = data(comm.rank, 64)
    if comm.rank == 0:
        x[0] = np.nan
    want = mpi_result(comm, "allreduce", x)
    assert np.isnan(want[0])
    with ccoll.Communicator(comm) as c:
        seen = []
        for _ in range(4):
            dst = np.empty_like(x) if out else None
            y = c.allreduce(x, eb, out=dst)
            assert y is dst or not out
            np.testing.assert_array_equal(y[1:], want[1:])
            assert np.isnan(y[0])
            assert_same_on_every_rank(comm, y[1:])
            seen.append(c.last_call.overlapped)
        expect_fast(seen, [False, True, True, True])
        if SIZE < 2:
            return
        arg = data(comm.rank, 65) if comm.rank == SIZE - 1 else x
        with pytest.raises(MismatchError) as info:
            c.allreduce(arg, eb)
        same_error_everywhere(comm, info, MismatchError, "element count")
        y = c.allreduce(x, eb)
        np.testing.assert_array_equal(y[1:], want[1:])


@needs_two
def test_a_call_that_differs_is_caught_by_the_first_element_alone(comm, monkeypatch):
    # The NaNs of the rank whose call differs reach every rank's first element: the flags'
    # collective then runs on every rank, and every rank raises (counted here: one flags'
    # collective per rank for the one call that differs, none for the repeats around it).
    from ccoll.collectives import fastpath

    flags = []
    real = fastpath._flags

    def counted(comm_, mine, deadline):
        flags.append(mine)
        return real(comm_, mine, deadline)

    monkeypatch.setattr(fastpath, "_flags", counted)
    x = data(comm.rank, 256)
    want = mpi_result(comm, "allreduce", x)
    with ccoll.Communicator(comm) as c:
        for _ in range(3):
            assert c.allreduce(x, None).tobytes() == want.tobytes()
        assert flags == []
        changer = comm.rank == SIZE - 1
        with pytest.raises(MismatchError) as info:
            c.allreduce(x.astype(np.float64) if changer else x, None)
        same_error_everywhere(comm, info, MismatchError, "dtype")
        assert flags == [1 if changer else 0]
        for _ in range(3):
            assert c.allreduce(x, None).tobytes() == want.tobytes()
        assert c.last_call.overlapped
        assert flags == [1 if changer else 0]


@pytest.mark.parametrize("change", ["none", "read-only", "out-shape", "x-shape", "out-dtype",
                                    "x-dtype", "x-strides"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_the_same_x_and_out_again_repeat_and_a_change_to_them_is_caught(comm, change,
                                                                        in_place):
    # A repeat into out whose x and out are the very objects of the last repeat skips
    # their checks (calls.run_call's memo). What those objects can change in place (out
    # made read-only, a shape or dtype assigned) must still be caught on every rank.
    x0 = data(comm.rank, 1000)
    exact = mpi_result(comm, "allreduce", x0)
    x = x0.copy()
    out = x if in_place else np.full_like(x0, np.nan)
    with ccoll.Communicator(comm) as c:
        seen = []
        for _ in range(4):
            if in_place:
                x[...] = x0
            assert c.allreduce(x, None, out=out) is out
            assert out.tobytes() == exact.tobytes()
            seen.append(c.last_call.overlapped)
        expect_fast(seen, [False, True, True, True])
        if change == "none" or SIZE < 2:
            return
        if in_place:
            x[...] = x0
        changer = comm.rank == SIZE - 1
        if changer:
            if change == "read-only":
                out.flags.writeable = False
            elif change == "out-shape":
                out.shape = (100, 10)
            elif change == "x-shape":
                x.shape = (10, 100)
            elif change == "out-dtype":
                out.dtype = np.int32
            elif change == "x-strides":  # the same shape, every element x[0] now
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    x.strides = (0,)
            else:
                x.dtype = np.int32
        exc, match = {
            "read-only": (InputError, "writeable"),
            "out-shape": (InputError, "out has shape"),
            "x-shape": (InputError, "out has shape"),
            "out-dtype": (InputError, "and dtype int32"),
            "x-dtype": (DTypeError, "dtype int32"),
            "x-strides": (InputError, "C-contiguous"),  # in place: out is x
        }[change]
        if change == "x-strides" and not in_place:
            # A valid call on the changed rank, of the values x shows now (not the memory
            # its last repeat read).
            want = mpi_result(comm, "allreduce", np.ascontiguousarray(x))
            assert c.allreduce(x, None, out=out) is out
            assert out.tobytes() == want.tobytes()
            return
        if in_place and change in ("out-shape", "x-shape"):
            # x is out: another shape of the same size is the same call (the result takes
            # the caller's shape), on the changed rank as on the others.
            y = c.allreduce(x, None, out=out)
            assert y is out and out.tobytes() == exact.tobytes()
            return
        if in_place and change in ("out-dtype", "x-dtype"):
            exc, match = DTypeError, "dtype int32"
        with pytest.raises(exc) as info:
            c.allreduce(x, None, out=out)
        same_error_everywhere(comm, info, exc, match)
