"""A repeated raw call moves its data with the agreement (run with 1..5 ranks).

A call whose agreed fields equal the prediction from the agreed history (the last call's, or
what followed it last time) and that goes raw whatever the data runs its MPI collective
while the agreement is in flight. Its result must still be MPI's bit for bit, the call
report must say that it ran so, and a rank that changes its arguments (or passes bad ones)
after such calls must make every rank raise the same error, never hang, and leave the
Communicator usable.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import ccoll
from ccoll.collectives import communicator as comm_mod
from ccoll.errors import CollectiveError, DTypeError, InputError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
needs_two = pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
COLLECTIVES = ["allreduce", "reduce_scatter", "allgather", "bcast"]


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


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("opts, kw", [({}, {"eb": None}), ({"policy": "raw"}, {})],
                         ids=["exact", "policy-raw"])
def test_repeated_raw_call_moves_with_the_agreement_and_equals_mpi(comm, collective, opts,
                                                                   kw):
    x = data(comm.rank)
    want = mpi_result(comm, collective, x)
    with ccoll.Communicator(comm, **opts) as c:
        seen, sent = [], []
        for _ in range(4):
            y = call(c, collective, x, **kw)
            assert y.dtype == want.dtype and y.shape == want.shape
            assert y.tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
            sent.append(c.last_call.bytes_sent)
        # The report counts the bytes of a call that moved early as of any other.
        assert len(set(sent)) == 1, sent
        assert comm.allreduce(sent[0]) > 0 or SIZE == 1
        # The first call has nothing to repeat; every later one moved with the agreement.
        assert seen == [False, True, True, True]
        assert "moved with the agreement" in str(c.last_call)
        assert c.stats.calls == 4


def test_repeated_auto_call_that_goes_raw_moves_with_the_agreement(comm):
    x = data(comm.rank, 16)  # 64 B: raw on any link once the link is calibrated
    want = mpi_result(comm, "allreduce", x)
    with ccoll.Communicator(comm) as c:
        reports = []
        for _ in range(5):
            y = c.allreduce(x)
            assert y.tobytes() == want.tobytes()
            reports.append(c.last_call)
        assert all(r.mode == "raw" for r in reports), [str(r) for r in reports]
        assert reports[-1].overlapped and reports[-2].overlapped, [str(r) for r in reports]
        decisions = comm.allgather([r.decision() for r in reports])
        assert all(d == decisions[0] for d in decisions)


def test_avg_in_place_and_float16_repeated(comm):
    x = data(comm.rank, 257, np.float64)
    want = mpi_result(comm, "allreduce", x) / np.float64(SIZE)
    with ccoll.Communicator(comm) as c:
        for i in range(3):
            buf = x.copy()
            y = c.allreduce(buf, eb=None, op="avg", out=buf)
            assert y is buf and buf.tobytes() == want.tobytes()
            assert c.last_call.overlapped == (i > 0)
        h = data(comm.rank, 33, np.float16)
        want16 = mpi_result(comm, "allreduce", h.astype(np.float32)).astype(np.float16)
        for i in range(3):
            y = c.allreduce(h, eb=None)
            assert y.dtype == np.float16 and y.tobytes() == want16.tobytes()
            assert c.last_call.overlapped == (i > 0)


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
        assert seen == [False] * 4 + [True] * 5


def test_with_a_timeout_the_repeated_call_is_exact(comm):
    # The timeout's nonblocking path: integer-valued data, whose sum is exact in any order.
    x = np.arange(1000, dtype=np.float32) * (comm.rank + 1)
    want = np.arange(1000, dtype=np.float32) * (SIZE * (SIZE + 1) // 2)
    with ccoll.Communicator(comm, timeout=60.0) as c:
        for i in range(3):
            assert c.allreduce(x, eb=None).tobytes() == want.tobytes()
            assert c.last_call.overlapped == (i > 0)
        if SIZE > 1:
            # Nobody repeats: nobody starts.
            with pytest.raises(MismatchError) as info:
                c.allreduce(x[: 500 + (comm.rank == SIZE - 1)], eb=None)
            same_error_everywhere(comm, info, MismatchError, "element count")
            assert "repeated the arguments" not in str(info.value)
            # All but the last rank repeat: they start under the deadline, the last rank
            # completes their requests with zeros.
            with pytest.raises(MismatchError) as info:
                c.allreduce(x[: 999] if comm.rank == SIZE - 1 else x, eb=None)
            same_error_everywhere(comm, info, MismatchError, "element count")
            assert "repeated the arguments" in str(info.value)
        assert c.allreduce(x, eb=None).tobytes() == want.tobytes()
        assert c.last_call.overlapped


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
    ("allreduce", "collective", {"collective": "allgather"}, MismatchError,
     "different collectives"),
    ("reduce_scatter", "count", {"n": 1001}, MismatchError, "element count"),
    ("allgather", "count", {"n": 1}, MismatchError, "element count"),
    ("allgather", "shape", {"shape": (10, 100)}, MismatchError, "shape"),
    ("bcast", "root", {"root": SIZE - 1}, MismatchError, "root"),
    ("bcast", "count", {"n": 2000}, MismatchError, "element count"),
]


@needs_two
@pytest.mark.parametrize("collective, change, kw, exc, match", CHANGES,
                         ids=[f"{c[0]}-{c[1]}" for c in CHANGES])
def test_one_rank_changes_after_repeated_calls(comm, collective, change, kw, exc, match):
    x = data(comm.rank)
    want = mpi_result(comm, collective, x)
    with ccoll.Communicator(comm) as c:
        for _ in range(3):
            assert call(c, collective, x, eb=None).tobytes() == want.tobytes()
        assert c.last_call.overlapped
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
            collective_here = kw.pop("collective", collective)
            args.update(kw)
        else:
            collective_here = collective
        with pytest.raises(exc) as info:
            call(c, collective_here, arg, **args)
        same_error_everywhere(comm, info, exc, match)
        # The other ranks had started; the message says so, naming them.
        ranks = ", ".join(map(str, range(SIZE - 1)))
        assert f"{ranks} repeated the arguments of the previous call" in str(info.value)
        # Nothing is left in flight: the next well-formed call works, exactly, early again.
        for _ in range(2):
            assert call(c, collective, x, eb=None).tobytes() == want.tobytes()
            assert c.last_call.overlapped


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


@needs_two
def test_bcast_with_none_after_repeated_calls_moves_again(comm):
    # A rank that passes None cannot start early (it knows no shape): the ranks that did
    # start run the broadcast once more with it, and the result is the root's.
    x = data(comm.rank)
    want = mpi_result(comm, "bcast", x)
    with ccoll.Communicator(comm) as c:
        for _ in range(3):
            assert c.bcast(x, eb=None).tobytes() == want.tobytes()
        assert c.last_call.overlapped
        for _ in range(3):
            arg = None if comm.rank == SIZE - 1 else x
            y = c.bcast(arg, eb=None)
            assert y.tobytes() == want.tobytes()
            assert not c.last_call.overlapped
        # Last time this call was followed by one with None: the second one is not
        # predicted yet, the third is.
        seen = []
        for _ in range(3):
            assert c.bcast(x, eb=None).tobytes() == want.tobytes()
            seen.append(c.last_call.overlapped)
        assert seen == [False, False, True]


@needs_two
def test_start_that_ranks_disagree_on_fails_every_rank_without_hanging(comm, monkeypatch):
    # Whether a call starts early follows from agreed fields and agreed state only, so the
    # ranks cannot disagree on it; if they ever did, every rank raises instead of returning
    # a partial sum, and nothing is left in flight.
    x = data(comm.rank)
    with ccoll.Communicator(comm) as c:
        for _ in range(2):
            c.allreduce(x, eb=None)
        if comm.rank == 0:
            real = comm_mod.agree
            monkeypatch.setattr(comm_mod, "agree", lambda *a, **k: real(*a, **{**k, "run": None}))
        with pytest.raises(CollectiveError) as info:
            c.allreduce(x, eb=None)
        same_error_everywhere(comm, info, CollectiveError, "some ranks ran the data collective")
        with pytest.raises(CollectiveError, match="cannot be used after an earlier"):
            c.allreduce(x, eb=None)


def test_compressed_calls_never_start_early(comm):
    x = data(comm.rank, 2000)
    with ccoll.Communicator(comm, policy="compress") as c:
        for _ in range(3):
            c.allreduce(x, eb=ccoll.ABS(1e-2))
            assert c.last_call.compressed and not c.last_call.overlapped


def test_env_fingerprint_reads_the_environment_without_decoding_it(monkeypatch):
    # Every policy="auto" call fingerprints the CCOLL_* overrides: os.environ.get of an
    # unset variable decodes and raises a KeyError inside (tens of microseconds for all of
    # them on a loaded machine), so the fingerprint reads os.environ's bytes dict.
    import os

    from ccoll.collectives.agreement import env_code

    monkeypatch.delenv("CCOLL_RATIO", raising=False)
    before = env_code()

    decoded = []
    real = type(os.environ).__getitem__

    def getitem(self, key):
        decoded.append(key)
        return real(self, key)

    monkeypatch.setattr(type(os.environ), "__getitem__", getitem)
    try:
        again = env_code()
    finally:
        monkeypatch.undo()
    assert again == before
    assert decoded == [], f"os.environ decoded {decoded} on a call"
    monkeypatch.setenv("CCOLL_RATIO", "3")
    changed = env_code()
    assert changed[0] != before[0] and changed[1] == "CCOLL_RATIO=3"
    monkeypatch.delenv("CCOLL_RATIO")
    assert env_code() == before
