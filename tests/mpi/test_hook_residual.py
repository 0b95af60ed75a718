"""Error feedback keeps ``x_ef`` minus exactly what the collective added for this rank.

The DDP hook with ``error_feedback=True`` stores ``r = x_ef - Q(x_ef)``, ``Q(x_ef)`` being this
rank's own contribution to the compressed sum. Here that contribution is recorded as the
collective makes it, not as the hook computes it: while the allreduce runs, a spy on the
compressor decodes every stream made from (a view of) this rank's input, at the offset of
that view (``compress_abs``: the stream itself; ``add_data``, which adds this rank's data to a
received stream in one pass: the stream ``compress_abs`` makes of the same view and bound).

The data has outliers that the compressor stores raw (their codes would not fit in 31 bits),
next to the ring's block boundaries (which are not multiples of 32 elements): a layout other
than the one of the schedule that ran puts other elements into the raw blocks, and gives
other values there. Recursive halving (``schedule="halving"``, or ``"auto"`` from 8 ranks)
cuts its pieces at multiples of 32 elements of the whole array, the ring at its blocks and
chunks. ``make test`` runs these at 1-5 ranks; tests/test_hook_residual_ranks.py runs them at 8
in ``make test-slow``.

Run: mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_hook_residual.py
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import ccoll  # noqa: E402
import ccoll.torch as ct  # noqa: E402
from ccoll.compressor import api as capi  # noqa: E402
from ccoll.torch import hook as hook_mod  # noqa: E402

EB = 1e-4  # ABS bound of the average: outliers of 1e6 are ~5e9 grid steps, stored raw
N = 10_000  # not a multiple of 32 per rank at 3, 4, 5 or 8 ranks


class OwnStreams:
    """Decodes what the compressor makes of this rank's input while ``active`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active: np.ndarray | None = None
        self.own: np.ndarray | None = None
        self.hits: np.ndarray | None = None
        real_compress, real_add_data = capi.compress_abs, capi.add_data
        decode = capi.decompress

        def offset(part: object) -> int | None:
            base = self.active
            if (base is None or not isinstance(part, np.ndarray) or part.dtype != base.dtype
                    or not np.shares_memory(part, base)):
                return None
            assert part.flags.c_contiguous and part.ndim == 1, part.shape
            delta = (part.__array_interface__["data"][0]
                     - base.__array_interface__["data"][0])
            assert delta % base.itemsize == 0
            return delta // base.itemsize

        def note(off: int, stream: np.ndarray) -> None:
            assert self.own is not None and self.hits is not None
            values = decode(stream)
            self.own[off:off + values.size] = values
            self.hits[off:off + values.size] += 1

        def compress_abs(x, eb_abs, **kw):
            stream = real_compress(x, eb_abs, **kw)
            off = offset(x)
            if off is not None:
                note(off, stream)
            return stream

        def add_data(received, x, eb_abs, **kw):
            off = offset(x)
            if off is not None:
                note(off, real_compress(x, eb_abs))
            return real_add_data(received, x, eb_abs, **kw)

        monkeypatch.setattr(capi, "compress_abs", compress_abs)
        monkeypatch.setattr(capi, "add_data", add_data)

    def watch(self, cc: ccoll.Communicator) -> None:
        """Record the contributions of ``cc.allreduce``'s input from now on."""
        real = cc.allreduce

        def allreduce(x, *args, **kw):
            flat = np.asarray(x).reshape(-1)
            self.active = flat
            self.own = np.full(flat.size, np.nan, flat.dtype)
            self.hits = np.zeros(flat.size, np.int64)
            try:
                return real(x, *args, **kw)
            finally:
                self.active = None

        cc.allreduce = allreduce  # type: ignore[method-assign]


def bucket(comm, step: int, n: int = N) -> np.ndarray:
    """Gradient-like values with raw-block outliers around the ring's block boundaries."""
    rng = np.random.default_rng([comm.rank, step])
    x = (rng.standard_normal(n) * 0.01).astype(np.float32)
    for b in range(1, comm.size):
        lo = b * (n // comm.size) + min(b, n % comm.size)  # numpy.array_split's boundary
        for d in (-33, -2, 1, 30):
            if 0 <= lo + d < n and rng.random() < 0.7:
                x[lo + d] = np.float32(1e6 * (1 + rng.random()))
    x[rng.integers(0, n, 3)] = np.float32(-2e6)
    return x


def check_residuals(comm, monkeypatch, schedule: str, n: int = N, steps: int = 3) -> list:
    """Run ``steps`` buckets through the hook; check each residual; return the plans."""
    spy = OwnStreams(monkeypatch)
    state = ct.CCollHookState(eb=ccoll.ABS(EB), error_feedback=True, start_iter=0,
                              min_numel=0, policy="compress", comm=comm)
    if schedule != "auto":
        # The hook's Communicator with the schedule under test (the state's own one has
        # schedule="auto"); error feedback's other settings as the state makes them.
        cc = ccoll.Communicator(state.comm, algorithm="homomorphic", policy="compress",
                                split=0.0, ranks_per_node=1, schedule=schedule)
        state.communicator.close()
        state.communicator = cc
    cc = state.communicator
    spy.watch(cc)
    plans = []
    try:
        residual = None
        for step in range(steps):
            x = bucket(comm, step, n)
            x_ef = x + residual if residual is not None else x.copy()
            hook_mod._reduce(state, x, 0, True)
            plan = cc._last_plan()
            plans.append(plan)
            assert plan.compress and not plan.two_level, plan
            if schedule == "halving":
                assert plan.pieces > 0, plan
            elif schedule == "ring":
                assert plan.pieces == 0, plan
            assert spy.hits is not None and spy.own is not None
            assert (spy.hits == 1).all(), np.flatnonzero(spy.hits != 1)[:10]
            want = x_ef - spy.own
            got = state.residuals[0]
            bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
            assert bad.size == 0, (
                f"step {step}, {schedule} (pieces={plan.pieces}): {bad.size} residual "
                f"elements differ, first {bad[:6].tolist()}: kept {got[bad[:3]].tolist()}, "
                f"x_ef - own contribution {want[bad[:3]].tolist()}")
            residual = got.copy()
            # The raw outliers went in exactly: nothing of them is left for the next step.
            assert (got[np.abs(x_ef) > 1e5] == 0).all()
    finally:
        if schedule != "auto":
            cc.close()
        state.close()
    return plans


@pytest.mark.many_ranks
@pytest.mark.parametrize("schedule", ["ring", "halving", "auto"])
def test_residual_is_input_minus_own_contribution(comm, monkeypatch, schedule) -> None:
    if comm.size == 1:
        pytest.skip("one rank sends its data raw: no residual")
    check_residuals(comm, monkeypatch, schedule)


@pytest.mark.slow
def test_auto_schedule_halves_a_large_bucket_at_eight_ranks(comm, monkeypatch) -> None:
    # schedule="auto" (the hook's own) picks recursive halving for a bucket of 1 M
    # elements at 8 ranks (the model's defaults); 8 ranks in `make test-slow` through
    # tests/test_hook_residual_ranks.py.
    if comm.size != 8:
        pytest.skip("runs at 8 ranks")
    plans = check_residuals(comm, monkeypatch, "auto", n=1_000_003, steps=2)
    assert all(p.pieces > 0 for p in plans), plans


@pytest.mark.parametrize("value", [0.0, 0.25])
def test_constant_bucket_under_rel_is_exact_and_keeps_no_residual(comm, value) -> None:
    # REL of a bucket whose values are all equal on every rank resolves to 0: the
    # collective averages it exactly (raw or lossless), and error feedback keeps nothing
    # (a residual pass with a bound of 0 would be refused). A later varying bucket
    # compresses and keeps a residual as usual.
    state = ct.CCollHookState(eb=ccoll.REL(1e-3), error_feedback=True, start_iter=0,
                              min_numel=0, policy="compress", comm=comm)
    try:
        x = np.full(N, value, np.float32)
        hook_mod._reduce(state, x, 0, True)
        assert (x == np.float32(value)).all()
        assert state.residuals == {}
        if comm.size > 1:
            y = bucket(comm, 0)
            hook_mod._reduce(state, y, 0, True)
            assert set(state.residuals) == {0}
            assert state.communicator.last_call.compressed
    finally:
        state.close()
