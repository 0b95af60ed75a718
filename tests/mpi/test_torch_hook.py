"""ccoll.torch.comm_hook under MPI: bound against the exact average, error feedback, overflow.

Run: mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_torch_hook.py
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kit import ExactSum, assert_same_on_every_rank, assert_within, rel_bound  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torchkit import Net, process_group  # noqa: E402, F401

import ccoll  # noqa: E402
import ccoll.torch as ct  # noqa: E402
from ccoll.torch._stepgate import AUTO, RAW, StepGate  # noqa: E402

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def local_grads(model: torch.nn.Module, x: torch.Tensor) -> list[np.ndarray]:
    """This rank's own gradients (no DDP), as float64."""
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.double().numpy().copy() for p in model.parameters()]


def rank_input(dtype: torch.dtype, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * MPI.COMM_WORLD.Get_rank() + step)
    return torch.randn(32, 64, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-4), ccoll.REL(1e-3), ccoll.REL(1e-2)], ids=repr)
def test_hook_within_bound_of_exact_average(comm, state_factory, eb, dtype) -> None:
    dt = DTYPES[dtype]
    torch.manual_seed(0)
    model = Net().to(dt)
    x = rank_input(dt)
    # Exact reference: every rank's own gradients, averaged exactly.
    mine = local_grads(model, x)
    every = comm.allgather(mine)
    exact = [ExactSum([g[i] for g in every]) / comm.size for i in range(len(mine))]
    flat = np.concatenate([g.ravel() for r in every for g in r])
    # REL is relative to the global value range of the bucket's inputs (all ranks).
    eb_abs = eb.value if isinstance(eb, ccoll.ABS) else rel_bound(eb.value, flat)

    # No-hook baseline: DDP's own allreduce (gloo) of the same gradients.
    baseline = DDP(model)
    baseline.zero_grad()
    baseline(x).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]

    state = state_factory(eb=eb, start_iter=0, min_numel=0)
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    ddp.zero_grad()
    narrow = dt in (torch.float16, torch.bfloat16)
    if narrow and comm.size > 1 and eb_abs < _half_gap(dtype, float(np.abs(flat).max())):
        # Below half the dtype's gap at the inputs' magnitude, where the average can lie:
        # its final rounding alone can miss the bound, so every rank refuses it
        # (tests/mpi/test_narrow_hook.py checks bounds just above that, exactly).
        with pytest.raises(RuntimeError, match="ErrorBoundError: .* asks for less than"):
            ddp(x).square().mean().backward()
        return
    ddp(x).square().mean().backward()
    assert (state.compressed, state.exact, state.iter) == (1, 0, 1)
    if dt == torch.float32:  # the baseline's own float32 rounding is a few ulps
        for p, q in zip(model.parameters(), plain, strict=True):
            assert_within(p.grad.numpy(), q.numpy(), eb_abs, roundings=8)
    for p, ref in zip(model.parameters(), exact, strict=True):
        assert p.grad.dtype == dt
        if narrow:  # the bound holds in the bucket's own dtype, its rounding included
            assert_within(p.grad.double().numpy(), ref, eb_abs)
        else:  # the bound plus float32's (float64's) roundings of the sum and quotient
            assert_within(p.grad.numpy(), ref, eb_abs, roundings=2)
        assert_same_on_every_rank(comm, p.grad.float().numpy())


def _half_gap(dtype: str, a: float) -> float:
    """Half the gap between normal values of float16/bfloat16 in the binade of ``a``."""
    return 2.0 ** (math.frexp(a)[1] - {"float16": 11, "bfloat16": 8}[dtype] - 1)


def test_first_iterations_and_small_buckets_are_exact(comm, state_factory) -> None:
    torch.manual_seed(0)
    model = Net()
    state = state_factory(eb=ccoll.REL(1e-1), start_iter=2, min_numel=0)
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    for step in range(3):
        x = rank_input(torch.float32, step)
        twin = Net()
        twin.load_state_dict(model.state_dict())
        mine = local_grads(twin, x)
        exact = [np.mean(g, axis=0) for g in zip(*comm.allgather(mine), strict=True)]
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        errs = [
            np.abs(p.grad.double().numpy() - e).max()
            for p, e in zip(model.parameters(), exact, strict=True)
        ]
        if step < 2:  # exact: only float32 rounding of the sum
            assert max(errs) < 1e-6, errs
        else:  # REL 1e-1 is coarse: compression shows
            assert max(errs) > 1e-6, errs
    assert (state.exact, state.compressed, state.iter) == (2, 1, 3)

    small = state_factory(eb=ccoll.REL(1e-1), start_iter=0, min_numel=10**6)
    ddp2 = DDP(Net())
    ddp2.register_comm_hook(small, ct.comm_hook)
    ddp2(rank_input(torch.float32)).sum().backward()
    assert (small.exact, small.compressed) == (1, 0)


@pytest.mark.parametrize("policy", ["raw", "auto"])
def test_policy_choice_keeps_the_bound(comm, state_factory, policy) -> None:
    # "raw": the collective never compresses, so error feedback has nothing to keep.
    # "auto": whatever the cost model picks for this small bucket, the bound holds.
    torch.manual_seed(0)
    model = Net()
    x = rank_input(torch.float32)
    mine = local_grads(model, x)
    every = comm.allgather(mine)
    exact = [ExactSum([g[i] for g in every]) / comm.size for i in range(len(mine))]
    flat = np.concatenate([g.ravel() for r in every for g in r])
    eb = ccoll.REL(1e-2)
    eb_abs = rel_bound(eb.value, flat)
    state = state_factory(eb=eb, error_feedback=True, start_iter=0, min_numel=0, policy=policy)
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    for _ in range(2):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    assert state.compressed + state.exact == 2
    if policy == "raw":
        assert (state.exact, state.residuals) == (2, {})
    for p, ref in zip(model.parameters(), exact, strict=True):
        # Two steps on the same input: with error feedback the second step carries the
        # first one's residual, so its own error is within two bounds.
        assert_within(p.grad.numpy(), ref, 2 * eb_abs, roundings=2)
        assert_same_on_every_rank(comm, p.grad.numpy())


class Fixed(torch.nn.Module):
    """loss = sum(w * c): the gradient of w is the constant c, step after step."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


def step_grads(state: ct.CCollHookState, c: torch.Tensor, steps: int) -> list[np.ndarray]:
    """The averaged gradient of w that every step gives."""
    model = Fixed(c.numel())
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    out = []
    for _ in range(steps):
        ddp.zero_grad()
        ddp(c).backward()
        out.append(model.w.grad.numpy().copy())
    return out


def accumulated_error(grads: list[np.ndarray], every_c: list[np.ndarray]) -> list[float]:
    """max |sum_t y_t - t * exact average| after each step (float64, for the lower bounds)."""
    exact = np.mean(every_c, axis=0)
    total = np.cumsum(np.asarray(grads, np.float64), axis=0)
    return [float(np.abs(total[t - 1] - t * exact).max()) for t in range(1, len(grads) + 1)]


def accumulated(grads: list[np.ndarray], every_c: list[np.ndarray], t: int) -> ExactSum:
    """sum_{s<=t} y_s - t * (1/N) sum_r c_r, exactly: N y_s and t c_r are exact in float64
    (float32 values times integers of a few bits)."""
    n = len(every_c)
    terms = [n * g.astype(np.float64) for g in grads[:t]] + [-t * c for c in every_c]
    return ExactSum(terms, Fraction(1, n))


@pytest.mark.parametrize("eb", [ccoll.ABS(1e-3), ccoll.REL(1e-3)], ids=repr)
def test_error_feedback_keeps_accumulated_error_bounded(comm, state_factory, eb) -> None:
    g = torch.Generator().manual_seed(7 + comm.Get_rank())
    c = torch.randn(5000, generator=g)
    steps = 24
    every_c = [a.astype(np.float64) for a in comm.allgather(c.numpy())]
    flat = np.concatenate(every_c)
    eb_abs = eb.value if isinstance(eb, ccoll.ABS) else rel_bound(eb.value, flat)

    ef_grads = step_grads(state_factory(eb=eb, error_feedback=True, start_iter=0,
                                        min_numel=0), c, steps)
    with_ef = accumulated_error(ef_grads, every_c)
    without = accumulated_error(step_grads(state_factory(eb=eb, start_iter=0, min_numel=0),
                                           c, steps), every_c)
    # Error feedback: the accumulated error is the last residual (averaged over ranks), within
    # one per-rank bound (the residual's range grows the REL bound a little), plus float32
    # rounding of the gradients summed up over the steps.
    slack = steps * 4 * np.spacing(np.float32(np.abs(flat).max()))
    for t in range(1, steps + 1):
        assert_within(np.zeros(c.numel()), accumulated(ef_grads, every_c, t),
                      Fraction(3, 2) * Fraction(eb_abs) + Fraction(float(slack)))
    # Without it the bias of each element's rounding adds up step after step.
    assert without[-1] > 5 * eb_abs, without
    assert without[-1] > 10 * with_ef[-1]


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
def test_error_feedback_keeps_every_rank_its_own_node(comm, state_factory, error_feedback):
    # The residual is what this rank's own quantization dropped: a two-level allreduce
    # quantizes node sums instead, so error feedback runs with one rank per node (flat).
    s = state_factory(eb=ccoll.ABS(1e-3), error_feedback=error_feedback)
    g = s.communicator.grouping
    if error_feedback:
        assert s.communicator.ranks_per_node == 1
        assert (g.nodes, g.ranks_per_node, g.hierarchical) == (comm.size, 1, False)
    else:
        assert s.communicator.ranks_per_node is None and g.source == "shared memory"


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
def test_overflow_reaches_every_rank_and_gradscaler_skips(comm, state_factory,
                                                          error_feedback) -> None:
    torch.manual_seed(0)
    model = Net()
    state = state_factory(eb=ccoll.REL(1e-3), error_feedback=error_feedback, start_iter=0,
                          min_numel=0)
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def step(poison: bool) -> None:
        handle = None
        if poison and comm.Get_rank() == 0:
            # Overflow on one rank only: +inf in a few gradient entries, NaN in one.
            def inject(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad[0, :3] = float("inf")
                grad[1, 0] = float("nan")
                return grad

            handle = model.a.weight.register_hook(inject)
        opt.zero_grad()
        scaler.scale(ddp(rank_input(torch.float32)).square().mean()).backward()
        if handle is not None:
            handle.remove()

    step(False)
    scaler.step(opt)
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()

    step(True)
    ga = model.a.weight.grad
    assert torch.isinf(ga[0, :3]).all() and (ga[0, :3] > 0).all(), ga[0, :3]
    assert torch.isnan(ga[1, 0])
    assert torch.isfinite(model.b.weight.grad).all()  # the other entries stay finite
    scaler.step(opt)
    scaler.update()
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b), "the overflowed step was not skipped"
    assert scaler.get_scale() == scale / 2
    assert comm.allgather(scaler.get_scale()) == [scale / 2] * comm.Get_size()
    if error_feedback:
        assert all(np.isfinite(r).all() for r in state.residuals.values())

    step(False)  # training resumes
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.a.weight.detach(), before[0])
    for p in model.parameters():
        assert_same_on_every_rank(comm, p.detach().numpy())


def test_error_from_the_collective_reaches_backward_on_every_rank(comm, state_factory) -> None:
    # Ranks that disagree on the bound get a clear error from loss.backward(), never a hang.
    # (Different bounds passed to CCollHookState fail its creation; here one rank's state
    # is changed afterwards, so that the collective itself finds the difference.)
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks to disagree")
    state = state_factory(eb=ccoll.ABS(1e-3), start_iter=0, min_numel=0)
    state.eb = ccoll.ABS(1e-3 * (1 + comm.Get_rank()))
    ddp = DDP(Net())
    ddp.register_comm_hook(state, ct.comm_hook)
    # DDP turns the hook's failure into a RuntimeError that names ccoll's exception.
    with pytest.raises(RuntimeError, match="MismatchError: ranks disagree .*error-bound"):
        ddp(rank_input(torch.float32)).sum().backward()


def _ddp_step(comm, model: torch.nn.Module, ddp: DDP, step: int):  # type: ignore[no-untyped-def]
    """One DDP step on ``rank_input(step)``: the averaged gradients (checked to be the same
    on every rank) and every rank's own gradients, computed before the step."""
    x = rank_input(torch.float32, step)
    every = comm.allgather(local_grads(_copy(model), x))
    ddp.zero_grad()
    ddp(x).square().mean().backward()
    got = [p.grad.numpy() for p in model.parameters()]
    assert_same_on_every_rank(comm, np.concatenate([g.ravel() for g in got]))
    return got, every


def _assert_exact_average(comm, got, every) -> None:  # type: ignore[no-untyped-def]
    for i, g in enumerate(got):
        # Float32 sums of the ranks' gradients divided by N: a few roundings of the
        # summands' magnitudes, as any exact allreduce makes.
        parts = [e[i] for e in every]
        slack = np.sum(np.abs(parts), axis=0) * 2.0 ** -21
        assert_within(g, ExactSum(parts) / comm.size, 0.0, extra=slack)


class ScriptedGate(StepGate):
    """A step check whose modes are fixed (raw every other step); it records what it is fed."""

    def __init__(self) -> None:
        super().__init__()
        self.fed: list[float | None] = []
        self.floors: list[float | None] = []
        self.modes: list[str] = []

    def next(self, seconds: float | None, raw_floor: float | None = None) -> str:
        self.fed.append(seconds)
        self.floors.append(raw_floor)
        self.modes.append(RAW if len(self.fed) % 2 == 0 else AUTO)
        self._running = self.modes[-1]
        return self.modes[-1]


@pytest.mark.parametrize("raw_path", ["process group", "ccoll MPI"])
def test_step_check_runs_the_same_mode_on_every_rank(comm, state_factory, monkeypatch,
                                                     raw_path) -> None:
    # The hook feeds its step check the slowest rank's step time (the same number on every
    # rank) and runs each step's buckets as the check says: a raw step compresses nothing
    # and gives the exact average, through the process group's allreduce (DDP's own) or,
    # without a process group over the same ranks, through ccoll's plain MPI path.
    import ccoll.torch.hook as hook_module

    if raw_path == "ccoll MPI":
        monkeypatch.setattr(hook_module, "_raw_group", lambda state: None)
    state = state_factory(eb=ccoll.REL(1e-2), start_iter=1, min_numel=0, policy="auto")
    assert isinstance(state.gate, StepGate)
    state.gate = gate = ScriptedGate()
    # The collectives' own policy would send these small buckets raw: under the check's
    # "auto" steps they compress here, so that the raw steps show.
    state.communicator.policy = "compress"
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    compressed, exact = [], []
    for step in range(7):
        got, every = _ddp_step(comm, model, ddp, step)
        compressed.append(state.compressed)
        exact.append(state.exact)
        if step > 0 and gate.modes[step - 1] == RAW:
            _assert_exact_average(comm, got, every)
    # Step 0 is before start_iter: not gated. Steps 1-6 are. A step's time reaches the
    # gate at the next step's first bucket on both paths (one MPI reduction there).
    assert len(gate.fed) == 6 and gate.fed[0] is None
    assert all(t is not None and t > 0 for t in gate.fed[1:])
    assert comm.allgather(gate.fed) == [gate.fed] * comm.size
    # The least time of a raw step: the buckets' ring allreduce at the calibrated
    # bandwidth, halved; the same on every rank (one rank: no link, no floor).
    assert comm.allgather(gate.floors) == [gate.floors] * comm.size
    if comm.size == 1:
        assert gate.floors == [None] * 6
    else:
        nbytes = 4 * sum(p.numel() for p in model.parameters())
        beta = state.communicator.calibration.params.beta
        want = 0.5 * 2 * (comm.size - 1) / comm.size * nbytes / beta
        assert gate.floors == pytest.approx([want] * 6, rel=1e-12)
    for i, mode in enumerate(gate.modes, start=1):
        assert (compressed[i] > compressed[i - 1]) == (mode == AUTO), (i, mode, compressed)
        assert (exact[i] > exact[i - 1]) == (mode == RAW), (i, mode, exact)


def test_unused_parameters_and_the_step_check_keep_the_group_in_step(comm, state_factory):
    # With find_unused_parameters=True DDP queues a collective of its own on the group (the
    # map of used parameters) right after the last bucket's hook call; the hook queued the
    # step's time on the same group when the last bucket's average was done, from another
    # thread, so ranks met the two in either order: gloo aborted the job ("Received data
    # size doesn't match expected size. 8 vs 4") in about half of 40-step runs, or it hung.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
        torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ddp = DDP(model, bucket_cap_mb=0.05, find_unused_parameters=True)  # several buckets
    state = state_factory(eb=ccoll.REL(1e-3), policy="auto", timeout=60)
    ddp.register_comm_hook(state, ct.comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + comm.Get_rank())
    for _ in range(40):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert sum(state.gate.steps.values()) == 40
    assert_same_on_every_rank(comm, np.concatenate(
        [p.detach().numpy().ravel() for p in model.parameters()]))


class AutoGate(ScriptedGate):
    """A step check that runs every step "auto"."""

    def next(self, seconds: float | None, raw_floor: float | None = None) -> str:
        self.fed.append(seconds)
        self.floors.append(raw_floor)
        self.modes.append(AUTO)
        self._running = AUTO
        return AUTO


@pytest.mark.parametrize("raw_path", ["process group", "ccoll MPI"])
def test_steps_before_start_iter_take_the_raw_steps_path(comm, state_factory, monkeypatch,
                                                         raw_path) -> None:
    # With the step check (policy="auto"), the exact steps before start_iter go the way
    # its raw steps go: the process group's allreduce (DDP's own) where every rank has
    # one, else ccoll's MPI path. The exact average either way, identical on every rank.
    import ccoll.torch.hook as hook_module

    if raw_path == "ccoll MPI":
        monkeypatch.setattr(hook_module, "_raw_group", lambda state: None)
    state = state_factory(eb=ccoll.REL(1e-2), start_iter=3, min_numel=0, policy="auto")
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    for step in range(3):
        _assert_exact_average(comm, *_ddp_step(comm, model, ddp, step))
    assert state.compressed == 0 and state.exact > 0
    through_ccoll = state.communicator.stats.calls
    if raw_path == "process group":
        assert through_ccoll == 0  # every bucket went through the group
    else:
        assert through_ccoll > 0


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("why", ["min_numel", "calibration"])
def test_auto_steps_send_settled_buckets_through_the_process_group(comm, state_factory,
                                                                   monkeypatch, why,
                                                                   error_feedback) -> None:
    # In a step the check runs "auto", a bucket that ccoll would average exactly whatever
    # its data (smaller than min_numel, or whose plan is raw and settled: the fast path's
    # test, Communicator._raw_settled) goes through the process group's allreduce, as in a
    # raw step, not through ccoll's MPI path: the same exact average, identical on every
    # rank. With error feedback too: its calls carry the hook's own bound (REL, resolved by
    # the collective), so their signature settles as without it; a diverted bucket keeps
    # its residual for the next compressed step, as in a raw step.
    diverted = True
    if comm.Get_size() == 1:
        pytest.skip("one rank has no process group to send through")
    min_numel = 10**9 if why == "min_numel" else 0
    state = state_factory(eb=ccoll.REL(1e-2), start_iter=1, min_numel=min_numel,
                          policy="auto", error_feedback=error_feedback)
    state.gate = AutoGate()
    sent: list[int] = []
    orig = torch.distributed.all_reduce

    def counting(t, *a, **kw):  # type: ignore[no-untyped-def]
        sent.append(t.numel())
        return orig(t, *a, **kw)

    monkeypatch.setattr(torch.distributed, "all_reduce", counting)
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    ddp.register_comm_hook(state, ct.comm_hook)
    nparams = sum(p.numel() for p in model.parameters())
    for step in range(6):
        x = rank_input(torch.float32, step)
        every = comm.allgather(local_grads(_copy(model), x))
        calls, exact, n_sent = state.communicator.stats.calls, state.exact, len(sent)
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        got = [p.grad.numpy() for p in model.parameters()]
        assert_same_on_every_rank(comm, np.concatenate([g.ravel() for g in got]))
        if step < 3:  # the layout and, for the policy, its signatures' plans come first
            continue
        if diverted:
            # Every bucket went through the group (sizes summing to the parameters; the
            # step times' one-float reductions besides), none through ccoll.
            assert state.communicator.stats.calls == calls, step
            assert sum(n for n in sent[n_sent:] if n > 1) == nparams, (step, sent[n_sent:])
            assert state.exact > exact and state._divert
        else:
            # Every bucket through ccoll (one DDP bucket here), raw, none through the group.
            assert state.communicator.stats.calls == calls + 1, step
            assert not state.communicator.last_call.compressed
            assert sum(n for n in sent[n_sent:] if n > 1) == 0, (step, sent[n_sent:])
            assert state.exact > exact and not state._divert
        for i, g in enumerate(got):
            parts = [e[i] for e in every]
            slack = np.sum(np.abs(parts), axis=0) * 2.0 ** -21
            assert_within(g, ExactSum(parts) / comm.size, 0.0, extra=slack)
    assert state.compressed == 0
    assert gate_modes(state) == [AUTO] * 5


def gate_modes(state: ct.CCollHookState) -> list[str]:
    return list(state.gate.modes)


def test_raw_settled(comm) -> None:
    # Communicator._raw_settled: whether the next allreduce of a signature goes raw
    # whatever its data, from agreed state alone (the fast path's test): its plan must be
    # raw and settled, which takes one call of that signature through the agreement.
    n = comm.Get_size()
    x = np.random.default_rng(comm.Get_rank()).standard_normal(1000).astype(np.float32)
    cc = ccoll.Communicator(comm, policy="auto")
    try:
        asked = []
        # REL last: the history then predicts it for the call after consume=True below.
        for eb in (None, ccoll.ABS(1e-3), ccoll.REL(1e-3)):
            before = cc._raw_settled(1000, np.float32, eb)  # nothing agreed yet
            cc.allreduce(x, eb, op="avg")  # 4 kB: raw whatever the data, at any size
            after = cc._raw_settled(1000, np.float32, eb)
            assert cc.last_call.reason == ("eb=None: exact" if eb is None else
                                           "one rank" if n == 1 else "too small to gain")
            asked.append((before, after))
        assert asked == [(False, True)] * 3
        # Another signature (count, dtype, op, bound) has its own plan: not settled yet.
        assert not cc._raw_settled(999, np.float32, ccoll.REL(1e-3))
        assert not cc._raw_settled(1000, np.float64, ccoll.REL(1e-3))
        assert not cc._raw_settled(1000, np.float32, ccoll.REL(1e-3), op="sum")
        assert not cc._raw_settled(1000, np.float32, ccoll.REL(2e-3))
        assert not cc._raw_settled(1000, np.float16, None)  # not a dtype the fast path takes
        # consume=True counts the call as if it ran: the ranks' plan states stay alike,
        # the next real call runs the fast way, and ccoll's own traffic is unchanged.
        calls = cc.stats.calls
        for _ in range(3):
            assert cc._raw_settled(1000, np.float32, ccoll.REL(1e-3), consume=True)
        assert cc.stats.calls == calls
        y = cc.allreduce(x, ccoll.REL(1e-3), op="avg")
        assert cc.last_call.overlapped and not cc.last_call.compressed
        assert_same_on_every_rank(comm, y)
        assert comm.allgather(cc._raw_settled(1000, np.float32, None)) == [True] * n
    finally:
        cc.free()
    fixed = ccoll.Communicator(comm, policy="compress")
    try:
        fixed.allreduce(x, ccoll.REL(1e-3), op="avg")
        assert fixed.last_call.compressed
        assert not fixed._raw_settled(1000, np.float32, ccoll.REL(1e-3))
        assert not fixed._raw_settled(1000, np.float32, None)
        fixed.allreduce(x, None, op="avg")
        assert fixed._raw_settled(1000, np.float32, None)
    finally:
        fixed.free()


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    twin = Net()
    twin.load_state_dict(model.state_dict())
    return twin


def test_step_check_only_with_policy_auto(state_factory) -> None:
    assert state_factory(policy="compress").gate is None
    assert state_factory(policy="raw").gate is None


def test_step_check_ranks_that_disagree_on_the_process_group(comm, state_factory,
                                                            monkeypatch) -> None:
    # Rank 0 finds no process group for its raw steps, the others do: every rank gets the
    # MismatchError at the first gated step instead of waiting in different collectives.
    import ccoll.torch.hook as hook_module

    if comm.rank == 0:
        monkeypatch.setattr(hook_module, "_raw_group", lambda state: None)
    state = state_factory(start_iter=0, min_numel=0, policy="auto")
    ddp = DDP(Net())
    ddp.register_comm_hook(state, ct.comm_hook)
    if comm.size == 1:  # one rank agrees with itself
        ddp(rank_input(torch.float32)).square().mean().backward()
        return
    with pytest.raises(Exception, match="disagree on the process group"):
        ddp(rank_input(torch.float32)).square().mean().backward()


def test_step_check_ranks_with_different_groups_of_the_same_ranks(comm, state_factory) -> None:
    # The last rank's own group of every rank, the others torch's default group: the same
    # ranks, but gloo collectives on two groups never meet (the first backward() hung).
    group = torch.distributed.new_group(list(range(comm.size)))  # collective: every rank
    state = state_factory(start_iter=0, min_numel=0, policy="auto",
                          process_group=group if comm.rank == comm.size - 1 else None)
    ddp = DDP(Net())
    ddp.register_comm_hook(state, ct.comm_hook)
    if comm.size == 1:  # one rank agrees with itself
        ddp(rank_input(torch.float32)).square().mean().backward()
        return
    with pytest.raises(Exception, match="others none or another group"):
        ddp(rank_input(torch.float32)).square().mean().backward()


def test_a_timeout_without_end_on_one_rank_fails_the_state_everywhere(comm) -> None:
    # The hook's duplicate was made with MPI's blocking form on that rank and the
    # nonblocking one on the others: both waited for ever, before any agreement.
    import math

    from ccoll.errors import MismatchError

    if comm.size == 1:
        ct.CCollHookState(timeout=math.inf).close()
        return
    with pytest.raises(MismatchError) as info:
        ct.CCollHookState(timeout=math.inf if comm.rank == comm.size - 1 else 30.0)
    assert "timeout" in str(info.value)
    assert len(set(comm.allgather(str(info.value)))) == 1


def test_sparse_gradients_are_refused_on_every_rank(comm, state_factory) -> None:
    # nn.EmbeddingBag(sparse=True): numpy's TypeError from the engine thread, wrapped by
    # torch's callback error; now the hook's InputError, naming the fix.
    from ccoll.errors import InputError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(50, 8, mode="sum", sparse=True),
                                torch.nn.Linear(8, 4))
    ddp = DDP(model)
    ddp.register_comm_hook(state_factory(min_numel=0), ct.comm_hook)
    x = torch.randint(0, 50, (6, 3), generator=torch.Generator().manual_seed(comm.rank))
    with pytest.raises(InputError, match="sparse_coo tensor; ccoll averages dense") as info:
        ddp(x).square().mean().backward()
    assert len(set(comm.allgather(str(info.value)))) == 1


def test_process_group_is_checked_when_the_state_is_made(comm, state_factory) -> None:
    # A process_group that is none was taken, and the first raw step raised torch's own
    # ValueError in backward(); it is an argument error on every rank at construction.
    from ccoll.errors import InputError
    from ccoll.torch.hook import _raw_group

    with pytest.raises(InputError) as info:
        ct.CCollHookState(process_group="not a group", policy="auto")
    msg = str(info.value)
    assert "process_group must be a torch.distributed process group or None, got str" in msg
    assert len(set(comm.allgather(msg))) == 1
    group = torch.distributed.new_group(list(range(comm.size)))
    state = state_factory(process_group=group, start_iter=0, min_numel=0, policy="auto")
    assert _raw_group(state) is group
    ddp = DDP(Net())
    ddp.register_comm_hook(state, ct.comm_hook)
    for step in range(3):
        ddp.zero_grad()
        ddp(rank_input(torch.float32, step)).square().mean().backward()
        grads = np.concatenate([p.grad.numpy().ravel() for p in ddp.parameters()])
        assert_same_on_every_rank(comm, grads)
