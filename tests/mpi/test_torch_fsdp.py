"""ccoll.torch.FSDPReduceScatter under FSDP2 (gloo on CPU): bound, exemptions, parity, async.

Run: mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_torch_fsdp.py (K = 2 or 4 for the
training test; the others run at any K >= 2).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import sys
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

import torch.distributed as dist  # noqa: E402
from kit import (  # noqa: E402
    ExactSum,
    assert_clear_error,
    assert_failed_load_closes,
    assert_within,
    rel_bound,
)
from mpi4py import MPI  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torchkit import process_group  # noqa: E402, F401

import ccoll  # noqa: E402
import ccoll.torch as ct  # noqa: E402
from ccoll.errors import InputError, MismatchError  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import models  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.skipif(SIZE < 2, reason="a reduce-scatter needs 2 ranks or more")


@pytest.fixture
def made():
    objs: list[ct.FSDPReduceScatter] = []
    yield objs
    for o in objs:
        o.close()


def sharded_cnn(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = models.DigitsCNN()
    for sub in (m.conv1, m.conv2, m.fc):
        fully_shard(sub)
    fully_shard(m)
    return m


def spy(rs: ct.FSDPReduceScatter) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """Record (input, output, plan) of every reduction ``rs`` makes."""
    calls: list[tuple[torch.Tensor, torch.Tensor, object]] = []
    run = rs._run

    def recorded(out, inp, avg, scale, plan):  # type: ignore[no-untyped-def]
        x = inp.clone()
        run(out, inp, avg, scale, plan)
        calls.append((x, out.clone(), plan))

    rs._run = recorded  # type: ignore[method-assign]
    return calls


def rank_batch(step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * MPI.COMM_WORLD.Get_rank() + step)
    return torch.randn(16, 1, 8, 8, generator=g)


@pytest.mark.many_ranks
@pytest.mark.parametrize("eb", [ccoll.ABS(1e-4), ccoll.REL(1e-2)], ids=repr)
def test_bound_on_every_element_and_exempt_exact(comm, made, eb) -> None:
    model = sharded_cnn()
    rs = ct.FSDPReduceScatter(eb, policy="compress", exempt=("*bias", "conv1.*"), min_numel=0)
    made.append(rs)
    assert rs.attach(model) == 3  # conv1, conv2, fc (the root holds no parameters)
    calls = spy(rs)
    model(rank_batch()).square().mean().backward()
    assert len(calls) == 3
    n, r = comm.size, comm.rank
    seen_compressed = seen_exact = 0
    for inp, out, plan in calls:
        rows = comm.allgather(inp.double().numpy().reshape(n, -1))
        exact = ExactSum([x[r] for x in rows], Fraction(1, n))  # FSDP asks for AVG
        y = out.numpy()
        if plan.exact_only:  # conv1: weight and bias are exempt
            comp = np.zeros(y.size, dtype=bool)
        else:
            comp = np.zeros(y.size, dtype=bool)
            comp[plan.comp_idx.numpy()] = True
        if comp.any():
            eb_abs = (eb.value if isinstance(eb, ccoll.ABS)
                      else rel_bound(eb.value, *[x[:, comp] for x in rows]))
            # the bound, plus the float32 roundings of the average (sum, then quotient)
            assert_within(y[comp], exact[comp], eb_abs, roundings=2)
            err = np.abs(y[comp] - np.mean([x[r][comp] for x in rows], axis=0)).max()
            assert err > 1e-7, "the compressed columns should carry a visible error"
            seen_compressed += 1
        if (~comp).any():  # exempt and padding: plain MPI, float32 roundings only
            # any summation order: (n - 1) roundings of partial sums <= sum |x|, then / n
            mags = np.sum([np.abs(x[r][~comp]) for x in rows], axis=0)
            assert_within(y[~comp], exact[~comp], 0.0, roundings=1,
                          extra=1.01 * (n - 1) * 2.0**-24 * mags / n)
            seen_exact += 1
    assert seen_compressed == 2 and seen_exact == 3
    # fc and conv2 each: one compressed and one exact collective; conv1: one exact.
    assert (rs.compressed, rs.exact, rs.unknown_layout) == (2, 3, 0)
    # What FSDP wrote into the sharded gradients is the reduce-scatter's output, bit for bit
    # (backward reaches fc first); each parameter's shard sits at its padded offset.
    for module, (_, out, _) in zip((model.fc, model.conv2, model.conv1), calls, strict=True):
        off = 0
        for p in module.parameters():
            local = p.grad.to_local().reshape(-1)
            assert torch.equal(local, out[off : off + local.numel()])
            off += -(-p.shape[0] // n) * (p.numel() // p.shape[0])
        assert off == out.numel()


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_sum_reductions_through_attach_hold_the_bound(comm, made, dtype) -> None:
    # FSDP reduces float16 and float64 with SUM, dividing by `pre` before and `post` after
    # (pre * post = n): the gradient it writes must be within eb of the exact average.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    model = models.DigitsCNN()
    kw = {}
    if dt == torch.float64:
        model = model.double()
    else:
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=dt)
    for sub in (model.conv1, model.conv2, model.fc):
        fully_shard(sub, **kw)
    fully_shard(model, **kw)
    eb = 4e-3 if dt == torch.float16 else 1e-3
    rs = ct.FSDPReduceScatter(ccoll.ABS(eb), policy="compress", min_numel=0)
    made.append(rs)
    assert rs.attach(model) == 3
    calls = spy(rs)
    x = rank_batch().to(torch.float64 if dt == torch.float64 else torch.float32)
    (model(x).sum() / 16).backward()
    pre, post, op, _ = _get_gradient_divide_factors(dist.group.WORLD, None, dt, "cpu")
    assert op == dist.ReduceOp.SUM and pre * post == comm.size
    n, r = comm.size, comm.rank
    # round to nearest in the reduce dtype: |fl(v) - v| <= u |v| + tiny
    u, tiny = (2.0**-11, 2.0**-25) if dt == torch.float16 else (2.0**-53, 2.0**-1075)
    u_c, tiny_c = u, tiny
    assert len(calls) == 3
    for module, (inp, out, _) in zip((model.fc, model.conv2, model.conv1), calls, strict=True):
        rows = comm.allgather(inp.double().numpy().reshape(n, -1))
        exact = ExactSum([x[r] for x in rows], Fraction(pre) / n)  # each rank's gradient / n
        parts = []
        for p in module.parameters():
            local = p.grad.to_local().reshape(-1).double().numpy()
            width = -(-p.shape[0] // n) * (p.numel() // p.shape[0])
            parts.append(np.pad(local, (0, width - local.size), constant_values=np.nan))
        y = np.concatenate(parts)
        real = ~np.isnan(y)
        # float64: ccoll's own roundings of its output (two in its arithmetic), scaled by
        # FSDP's post-division; float16: none (the output in float16 holds ccoll's share
        # of the bound, its roundings included); then that division's rounding
        o = np.abs(out.double().numpy())
        mine = 0.0 if dt == torch.float16 else 2 * (u_c * o + tiny_c)
        extra = 1.01 * (mine / post + u * np.abs(np.nan_to_num(y)) + tiny)
        assert_within(y[real], exact[real], eb, extra=extra[real])
    assert rs.compressed == 3


def test_small_reduce_scatter_and_no_attach(comm, made) -> None:
    # Given to set_custom_reduce_scatter directly: the whole buffer is one collective.
    model = sharded_cnn()
    rs = ct.FSDPReduceScatter(ccoll.ABS(1e-3), policy="compress", min_numel=2000)
    made.append(rs)
    for sub in (model.conv1, model.conv2, model.fc):
        sub.set_custom_reduce_scatter(rs)
    calls = spy(rs)
    model(rank_batch()).square().mean().backward()
    # conv1 (160 elements, padded) is below min_numel: exact; conv2 and fc compressed.
    plans = [(p.exact_only, inp.numel()) for inp, _, p in calls]
    assert [e for e, _ in plans] == [False, False, True], plans
    assert (rs.compressed, rs.exact) == (2, 1)


def test_training_parity_and_identical_full_model(comm, made) -> None:
    if comm.size not in (2, 4):
        pytest.skip("the training comparison runs at 2 and 4 ranks")
    seed, steps = 3, 60
    xtr, ytr, xte, yte = models.digits_split(seed)
    accs, digests = {}, {}
    for mode in ("fsdp", "ccoll"):
        model = sharded_cnn(seed)
        rs = None
        if mode == "ccoll":
            rs = ct.FSDPReduceScatter(ccoll.REL(1e-3), policy="compress", min_numel=0)
            made.append(rs)
            rs.attach(model)
            calls = spy(rs)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        batches = models.shard_batches(len(ytr), 64, comm.rank, comm.size, seed)
        for step in range(steps):
            idx = torch.from_numpy(next(batches))
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if rs is not None and step % 20 == 0:  # the bound on every element, some steps
                n, r = comm.size, comm.rank
                for inp, out, _ in calls:
                    rows = comm.allgather(inp.double().numpy().reshape(n, -1))
                    exact = ExactSum([x[r] for x in rows], Fraction(1, n))
                    assert_within(out.numpy(), exact, rel_bound(1e-3, *rows), roundings=2)
            if rs is not None:
                calls.clear()
            opt.step()
        accs[mode] = models.accuracy(model, xte, yte)
        h = hashlib.sha256()
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.full_tensor().detach().numpy().tobytes())  # gathers the shards
        digests[mode] = h.hexdigest()
        if rs is not None:
            assert rs.compressed == 3 * steps and rs.exact == 0
    for mode, d in digests.items():
        assert len(set(comm.allgather(d))) == 1, f"{mode}: full models differ across ranks"
    assert abs(accs["ccoll"] - accs["fsdp"]) <= 0.01, accs
    assert accs["fsdp"] > 0.8, accs  # it learned


def test_async_op_returns_work_with_the_sync_result(comm, made) -> None:
    rs = ct.FSDPReduceScatter(ccoll.ABS(1e-3), policy="compress", min_numel=0)
    made.append(rs)
    g = torch.Generator().manual_seed(comm.rank)
    inp = torch.randn(comm.size * 3000, generator=g)
    sync_out = torch.empty(3000)
    assert rs(sync_out, inp.clone(), dist.group.WORLD, dist.ReduceOp.AVG) is None
    out = torch.empty(3000)
    work = rs(out, inp.clone(), dist.group.WORLD, dist.ReduceOp.AVG, async_op=True)
    assert isinstance(work, dist.Work)
    work.wait()
    assert torch.equal(out, sync_out)
    # SUM: the bound is on the sum (FSDP's post-division factor is 1 for float32)
    s = torch.empty(3000)
    rs(s, inp.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
    rows = comm.allgather(inp.double().numpy().reshape(comm.size, -1))
    assert_within(s.numpy(), ExactSum([x[comm.rank] for x in rows]), 1e-3, roundings=2)
    assert rs.compressed == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["AVG", "SUM"])
def test_low_precision_output_holds_the_bound_in_its_dtype(comm, made, dtype, op) -> None:
    # The output in the reduce dtype holds the bound, its rounding to that dtype included,
    # or every rank refuses it (the collectives' rule, docs/error-bound.md).
    dt, bits = (torch.bfloat16, 8) if dtype == "bfloat16" else (torch.float16, 11)
    g = torch.Generator().manual_seed(comm.rank)
    inp = (torch.randn(comm.size * 2048, generator=g) / 4).to(dt)
    out = torch.empty(2048, dtype=dt)
    rows = comm.allgather(inp.double().numpy().reshape(comm.size, -1))
    top = max(float(np.abs(x).max()) for x in rows)
    if op == "SUM":
        top *= comm.size  # the largest magnitude a sum can have
    # 0.6 of the dtype's gap at the largest magnitude the result can have (1.2 across a
    # binade): half a gap for the rounding to the dtype, the rest for ccoll's float32 stage
    gap = 2.0 ** (np.frexp(top)[1] - bits)
    eb = 0.6 * gap if np.frexp(top + 0.6 * gap)[1] == np.frexp(top)[1] else 1.2 * gap
    rs = ct.FSDPReduceScatter(ccoll.ABS(eb), policy="compress", min_numel=0)
    made.append(rs)
    rs(out, inp, dist.group.WORLD, getattr(dist.ReduceOp, op))
    scale = Fraction(1, comm.size) if op == "AVG" else 1
    exact = ExactSum([x[comm.rank] for x in rows], scale)
    assert_within(out.double().numpy(), exact, eb)  # no rounding allowance
    # A twentieth of the gap: even the exact result rounded to the dtype can miss it.
    rs2 = ct.FSDPReduceScatter(ccoll.ABS(gap / 20), policy="compress", min_numel=0)
    made.append(rs2)
    with pytest.raises(ccoll.ErrorBoundError, match="the smallest bound ccoll can hold") as info:
        rs2(out, inp, dist.group.WORLD, getattr(dist.ReduceOp, op))
    assert len(set(comm.allgather(str(info.value)))) == 1, "ranks differ in the refusal"


def test_bad_calls_raise_clear_errors(comm, made) -> None:
    rs = ct.FSDPReduceScatter(ccoll.ABS(1e-3), min_numel=0)
    made.append(rs)
    inp, out = torch.zeros(comm.size * 8), torch.zeros(8)
    assert_clear_error(InputError, "reduce op", rs, out, inp, dist.group.WORLD,
                       dist.ReduceOp.MAX)
    assert_clear_error(InputError, "float32, float64, float16 or bfloat16", rs,
                       torch.zeros(8, dtype=torch.int32),
                       torch.zeros(comm.size * 8, dtype=torch.int32), dist.group.WORLD,
                       dist.ReduceOp.AVG)
    assert_clear_error(InputError, "times as many", rs, torch.zeros(7), inp,
                       dist.group.WORLD, dist.ReduceOp.AVG)
    assert_clear_error(InputError, "exempt", ct.FSDPReduceScatter, exempt=[1, 2])
    assert_clear_error(InputError, re.escape("attach takes the model (a torch.nn.Module "
                       "with FSDP modules), got str"), rs.attach, "x")  # AttributeError before
    # settings that differ between ranks: an error on every rank, no hang
    mine = ccoll.ABS(1e-3 if comm.rank == 0 else 2e-3)
    assert_clear_error(MismatchError, "error-bound value", ct.FSDPReduceScatter, mine)
    if comm.size > 1:
        # Patterns that pick parameters of the same sizes: the columns met in the other
        # collective and one rank's a.bias was added to another's b.bias, without an error.
        pats = ("a.bias",) if comm.rank == 0 else ("b.bias",)
        assert_clear_error(MismatchError, re.escape("exempt=('a.bias',) on rank 0"),
                           ct.FSDPReduceScatter, ccoll.ABS(1e-3), exempt=pats)


def test_a_closed_reduce_scatter_says_so(comm, made) -> None:
    # backward() after close() raised mpi4py's "Invalid communicator".
    rs = ct.FSDPReduceScatter(ccoll.ABS(1e-3), min_numel=0)
    rs.close()
    inp, out = torch.zeros(comm.size * 8), torch.zeros(8)
    assert_clear_error(ccoll.CollectiveError, "has been closed", rs, out, inp,
                       dist.group.WORLD, dist.ReduceOp.AVG)


def test_state_dict_and_pickle(comm, made, monkeypatch) -> None:
    rs = ct.FSDPReduceScatter(ccoll.REL(1e-2), policy="compress", exempt=("*bias",),
                              min_numel=10)
    made.append(rs)
    inp = torch.ones(comm.size * 100) * (comm.rank + 1)
    rs(torch.empty(100), inp, dist.group.WORLD, dist.ReduceOp.AVG)
    sd = rs.state_dict()
    assert sd["compressed"] + sd["exact"] == 1
    back = pickle.loads(pickle.dumps(rs))  # collective: makes a new communicator
    made.append(back)
    assert back.state_dict() == sd
    assert MPI.Comm.Compare(back.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    other = ct.FSDPReduceScatter.from_state_dict(sd)
    made.append(other)
    assert other.state_dict() == sd
    wrong = ct.FSDPReduceScatter(ccoll.REL(1e-3), policy="compress", exempt=("*bias",),
                                 min_numel=10)
    made.append(wrong)
    assert_clear_error(InputError, "eb_value", wrong.load_state_dict, sd)
    assert_clear_error(InputError, "version", wrong.load_state_dict, {"version": 99})
    # A load that fails closes the object from_state_dict made.
    assert_failed_load_closes(monkeypatch, ct.FSDPReduceScatter, {**sd, "compressed": -3},
                              "compressed")


class _Twins(torch.nn.Module):
    """Two layers of the same shapes, named by the caller (``first``, ``second``)."""

    def __init__(self, first: str = "a", second: str = "b") -> None:
        super().__init__()
        self.add_module(first, torch.nn.Linear(64, 100))
        self.add_module(second, torch.nn.Linear(64, 100))
        self.names = (first, second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = (getattr(self, n) for n in self.names)
        return (a(x) + b(x)).square().mean()


def test_an_exempt_layer_stays_exact_when_other_layers_are_frozen_later(comm, made) -> None:
    # The plan of a row was cached by its width only: with `a` frozen at first and `b`
    # later (staged fine-tuning, same shapes), the row of exempt `b` went through the
    # plan made for `a` and was compressed.
    torch.manual_seed(0)
    m = _Twins()
    fully_shard(m)
    rs = ct.FSDPReduceScatter(ccoll.ABS(1e-2), policy="compress", exempt=("b.*",), min_numel=0)
    made.append(rs)
    rs.attach(m)
    calls = spy(rs)
    g = torch.Generator().manual_seed(100 * comm.rank)
    for frozen in (m.b, m.a):  # b frozen first (a compressed), then a (b exact)
        for p in m.parameters():
            p.requires_grad_(True)
        for p in frozen.parameters():
            p.requires_grad_(False)
        m.zero_grad()
        m(torch.randn(8, 64, generator=g)).backward()
    first, last = calls[0][2], calls[-1][2]
    assert not first.exact_only  # the whole row compressed
    assert last.exact_only, "the exempt layer's row was compressed"
    assert (rs.compressed, rs.exact) == (1, 1)


def test_ranks_whose_patterns_pick_other_columns_fail_attach_everywhere(comm, made) -> None:
    # The same patterns on models whose same-shaped layers are named in another order:
    # each rank exempted other columns, and ccoll added one rank's parameter to another's
    # (21-29 times the bound), without an error on any rank.
    torch.manual_seed(0)
    m = _Twins(*(("a", "z") if comm.rank == 0 else ("z", "a")))
    fully_shard(m)
    rs = ct.FSDPReduceScatter(ccoll.ABS(1e-3), policy="compress", exempt=("a.*",), min_numel=0)
    made.append(rs)
    assert_clear_error(MismatchError, "ranks disagree on which parameters of their FSDP "
                       "modules are exempt or small", rs.attach, m)
