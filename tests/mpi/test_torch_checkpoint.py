"""CCollHookState checkpoints: state_dict, pickling, and residuals that follow their parameters.

Run: mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_torch_checkpoint.py
(tests/test_torch_resume.py restarts a run in fresh processes.)
"""

from __future__ import annotations

import io
import pickle
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kit import assert_clear_error, assert_failed_load_closes  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torchkit import Net, process_group  # noqa: E402, F401

import ccoll  # noqa: E402
import ccoll.torch as ct  # noqa: E402
from ccoll.errors import InputError  # noqa: E402


@pytest.fixture
def made():
    objs: list[ct.CCollHookState] = []
    yield objs
    for o in objs:
        o.close()


def rank_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * MPI.COMM_WORLD.Get_rank() + 5)
    return torch.randn(32, 64, generator=g)


def ef_state(made: list, **kw) -> ct.CCollHookState:  # type: ignore[type-arg]
    kw.setdefault("eb", ccoll.REL(1e-1))
    s = ct.CCollHookState(error_feedback=True, policy="compress", min_numel=0, **kw)
    made.append(s)
    return s


class Deep(torch.nn.Module):
    """Five layers; with a small bucket cap DDP regroups them into other buckets later."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(64, 64) for _ in range(4)] + [torch.nn.Linear(64, 16)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


@pytest.mark.parametrize("net,cap", [(Net, None), (Deep, 0.02)], ids=["one-bucket", "buckets"])
def test_residuals_follow_their_parameters_when_ddp_rebuilds_buckets(comm, made, net,
                                                                      cap) -> None:
    """Error feedback telescopes: sum_t y_t = t * avg(g) - avg(r_T), up to float rounding.

    The gradients are the same every step (no optimizer step), while DDP lays its buckets
    out anew from the second iteration on; a residual added at the old offsets would break
    the identity by about the bound.
    """
    torch.manual_seed(0)
    model = net()
    x = rank_input()
    model(x).square().mean().backward()
    mine = {n: p.grad.double().numpy().copy() for n, p in model.named_parameters()}
    avg = {n: np.mean([g[n] for g in comm.allgather(mine)], axis=0) for n in mine}
    model.zero_grad()
    state = ef_state(made, start_iter=0)
    ddp = DDP(model, bucket_cap_mb=cap)
    ddp.register_comm_hook(state, ct.comm_hook)
    steps = 4
    total = {n: np.zeros_like(g) for n, g in avg.items()}
    orders = []
    for _ in range(steps):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        orders.append({i: [id(p) for p in ps] for i, ps in state._bucket_params.items()})
        for n, p in model.named_parameters():
            total[n] += p.grad.double().numpy()
    assert orders[0] != orders[1], "DDP kept its first bucket layout: nothing to test"
    if cap is not None:
        assert len(orders[-1]) > 1, orders  # several buckets
    res = state.state_dict(ddp)["residuals_by_param"]
    every = comm.allgather({n: r.double().numpy() for n, r in res.items()})
    for n in avg:
        last = np.mean([e[n] for e in every], axis=0)
        err = np.abs(total[n] - steps * avg[n] + last.reshape(avg[n].shape)).max()
        scale = max(np.abs(avg[n]).max(), np.abs(last).max())
        assert err <= 64 * steps * np.spacing(np.float32(scale)), (n, err)


def train(ddp: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * MPI.COMM_WORLD.Get_rank() + step)
        loss = ddp(torch.randn(16, 64, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_state_dict_resumes_exactly_in_process(comm, made) -> None:
    """N steps, save, a new model/DDP/state loaded from the save, M steps: as N + M steps."""
    n, m = 3, 3

    def fresh() -> tuple[Net, DDP, torch.optim.Optimizer, ct.CCollHookState]:
        torch.manual_seed(0)
        net = Net()
        ddp = DDP(net)
        state = ef_state(made)
        ddp.register_comm_hook(state, ct.comm_hook)
        return net, ddp, torch.optim.Adam(net.parameters(), lr=1e-2), state

    net, ddp, opt, _ = fresh()
    train(ddp, opt, range(n + m))
    full = [p.detach().clone() for p in net.parameters()]

    net, ddp, opt, state = fresh()
    train(ddp, opt, range(n))
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                "ccoll": state.state_dict()}, buf)
    assert state.iter == n and state.residuals
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # plain values and tensors only

    net, ddp, opt, state = fresh()
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["ccoll"])
    assert state.iter == n
    train(ddp, opt, range(n, n + m))
    for p, q in zip(net.parameters(), full, strict=True):
        assert torch.equal(p, q)
    assert state.residuals_reset == 0


def trained_two_steps(made: list) -> tuple[torch.nn.Module, ct.CCollHookState]:  # type: ignore[type-arg]
    """A DDP model trained two steps through a hook with error feedback, and its state."""
    torch.manual_seed(0)
    net = Net()
    ddp = DDP(net)
    state = ef_state(made, eb=ccoll.ABS(1e-3), start_iter=0)
    ddp.register_comm_hook(state, ct.comm_hook)
    train(ddp, torch.optim.SGD(net.parameters(), lr=0.1), range(2))
    return ddp, state


def test_pickle_and_settings(comm, made) -> None:
    ddp, state = trained_two_steps(made)
    back = pickle.loads(pickle.dumps(state))  # collective: a new communicator
    made.append(back)
    assert MPI.Comm.Compare(back.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    assert back.comm != state.comm
    assert (back.eb, back.iter, back.compressed) == (state.eb, state.iter, state.compressed)
    # The residuals wait, by parameter shape, for the next backward pass to place them.
    assert back.residuals == {} and len(back._pending) == 4
    sd = state.state_dict()
    wrong = ct.CCollHookState(eb=ccoll.ABS(1e-3), error_feedback=False, min_numel=0,
                              policy="compress")
    made.append(wrong)
    assert_clear_error(InputError, "error_feedback: this CCollHookState has False",
                       wrong.load_state_dict, sd)
    assert_clear_error(InputError, "version", wrong.load_state_dict, {"version": 0})
    other = ct.CCollHookState.from_state_dict(sd, ddp)
    made.append(other)
    assert other.iter == state.iter and other.error_feedback
    assert_clear_error(InputError, "torch.nn.Module", state.state_dict, "not a model")


def test_a_state_of_another_rank_or_with_bad_counters_is_refused(comm, made, monkeypatch) -> None:
    # Residuals are one rank's error not yet sent: another rank's (swapped files) or
    # those of another world size loaded without a word; counters that no state_dict()
    # writes (iter -5, 2.7, "x", None) loaded, were truncated or raised torch's errors.
    ddp, state = trained_two_steps(made)
    sd = state.state_dict(ddp)
    assert (sd["rank"], sd["ranks"]) == (comm.rank, comm.size) and sd["residuals"]
    for key, value in (("rank", comm.rank + 1), ("ranks", comm.size + 1)):
        assert_clear_error(InputError, rf"residuals of rank .* this is rank {comm.rank} of "
                           rf"{comm.size}: load each rank's own", state.load_state_dict,
                           {**sd, key: value}, ddp)
    # Without residuals (no error feedback) the counters and settings move anywhere.
    plain = {**sd, "rank": comm.rank + 1, "ranks": comm.size + 1, "residuals": {},
             "residual_shapes": {}}
    del plain["residuals_by_param"]
    state.load_state_dict(plain)
    assert state.iter == sd["iter"]
    for key in ("iter", "compressed", "exact"):
        for bad in (-5, 2.7, "x", None, True):
            assert_clear_error(InputError, rf"state dict's {key} is {re.escape(repr(bad))}: "
                               "expected a whole number >= 0", state.load_state_dict,
                               {**sd, key: bad}, ddp)
    for bad in (-1.0, float("nan"), "x"):
        assert_clear_error(InputError, "busy_s", state.load_state_dict, {**sd, "busy_s": bad})
    # A dict of the other kind, a truncated one, or containers of another type: a KeyError,
    # AttributeError or TypeError from deep inside before.
    fsdp_like = {k: sd[k] for k in ("version", "eb_kind", "eb_value", "policy", "min_numel")}
    for bad, match in (
        ({**sd, "kind": "FSDPReduceScatter"}, "a FSDPReduceScatter state dict, not a "
         "CCollHookState one"),
        ({k: v for k, v in sd.items() if k != "policy"}, "lacks policy"),
        ({**fsdp_like, "exempt": [], "compressed": 0}, "lacks error_feedback, start_iter"),
        ({**sd, "residuals": 5}, "residuals is a int, not the dict"),
        ({**sd, "residual_shapes": 7}, "residual_shapes is a int, not the dict"),
        ({**sd, "residual_shapes": {i: [5] for i in sd["residuals"]}},
         r"not what state_dict\(\) writes"),
    ):
        assert_clear_error(InputError, match, state.load_state_dict, bad)
        assert_clear_error(InputError, match, ct.CCollHookState.from_state_dict, bad)
    # The state from_state_dict made before its load failed is closed at once.
    assert_failed_load_closes(monkeypatch, ct.CCollHookState, {**sd, "busy_s": -1.0}, "busy_s")
    assert_clear_error(InputError, "a CCollHookState state dict, not a FSDPReduceScatter",
                       ct.FSDPReduceScatter.from_state_dict, sd)
    older = {k: v for k, v in sd.items() if k not in ("rank", "ranks", "kind")}  # before them
    state.load_state_dict(older, ddp)
    assert state.iter == sd["iter"]
    # Residuals by name whose sizes are not the model's (same names, other shapes): they
    # were dropped at the next step without a word.
    name = next(iter(sd["residuals_by_param"]))
    shorter = {**sd, "residuals_by_param": {**sd["residuals_by_param"],
                                            name: sd["residuals_by_param"][name][:-1]}}
    assert_clear_error(InputError, rf"residual of parameter '{re.escape(name)}' has .* "
                       "pass the model it was saved with", state.load_state_dict, shorter, ddp)


class _SameShapes(torch.nn.Module):
    """One DDP bucket whose first and last layers have parameters of the same shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 100)
        self.b = torch.nn.Linear(100, 64)
        self.c = torch.nn.Linear(64, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_a_bucket_with_repeated_shapes_keeps_its_distinct_pieces_and_counts_the_rest(
        comm, made) -> None:
    # Loaded without the model, a bucket with two parameters of one shape dropped every
    # piece, the distinct ones too, and residuals_reset stayed 0 (documented: the pieces
    # that cannot be told apart restart from zero, and the bucket is counted).
    def fresh() -> tuple[DDP, ct.CCollHookState]:
        torch.manual_seed(0)
        ddp = DDP(_SameShapes())
        state = ef_state(made, eb=ccoll.ABS(1e-3))
        ddp.register_comm_hook(state, ct.comm_hook)
        return ddp, state

    ddp, state = fresh()
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), range(3))
    saved = state.state_dict()  # without the model: pieces by shape
    shapes = [tuple(s) for s in saved["residual_shapes"][0]]
    assert len(saved["residual_shapes"]) == 1 and len(set(shapes)) < len(shapes)
    ddp, state = fresh()
    state.load_state_dict(saved)
    unique = {(0, sh) for sh in shapes if shapes.count(sh) == 1}
    assert unique and set(state._pending) == unique  # waiting for their parameters
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), range(3, 4))
    assert not state._pending and state.residuals_reset == 1
