"""ccoll.torch.FSDPReduceScatter under HSDP (FSDP2 on a 2x2 device mesh, gloo on CPU).

Run: mpiexec -n 4 python -m mpi4py -m pytest tests/mpi/test_torch_hsdp.py (needs exactly 4
ranks: two replicas of a two-rank shard group; it skips at any other count).

Under HSDP, FSDP2 reduce-scatters each module's gradients inside a shard group (ccoll), then
all-reduces the outputs across the replicas (gloo) and divides by its post-division
factor. The bound must hold on what the user gets: every element of the sharded gradient
FSDP writes is within ``eb`` of the exact average of all ranks' gradients (the sum over
every rank divided by FSDP's gradient divide factor). The table below lists the divide
factors torch 2.13's FSDP2 uses (``_get_gradient_divide_factors`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, read by hand) for each reduce
dtype, with and without ``set_force_sum_reduction_for_comms`` and
``set_gradient_divide_factor``; the test checks that torch still computes them, then
trains one step and checks every element of the final gradient. The exact average is
computed in float64 from every rank's gradient as FSDP handed it to the reduce-scatter (times
the pre-division factor, a power of two).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from kit import ExactSum, assert_within, rel_bound  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torchkit import Net, process_group  # noqa: E402, F401

import ccoll  # noqa: E402
import ccoll.torch as ct  # noqa: E402

WORLD = MPI.COMM_WORLD
SHARD, REPLICAS = 2, 2  # mesh (replicate, shard): rank = SHARD * replica + shard index
pytestmark = [
    pytest.mark.many_ranks,
    pytest.mark.skipif(WORLD.Get_size() != SHARD * REPLICAS,
                       reason="HSDP on a 2x2 mesh needs exactly 4 ranks"),
]

AVG, SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# Round to nearest in dtype t: |fl(v) - v| <= U[t] |v| + TINY[t] (TINY: half the smallest
# subnormal).
U = {F16: 2.0**-11, BF16: 2.0**-8, F32: 2.0**-24, F64: 2.0**-53}
TINY = {F16: 2.0**-25, BF16: 2.0**-134, F32: 2.0**-150, F64: 2.0**-1075}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype  # FSDP's reduce dtype
    pre: float | None  # FSDP divides every rank's gradient by this before the reduce-scatter
    post: float | None  # ... and the replicas' all-reduced output by this after
    rs_op: object  # what FSDP asks the reduce-scatter (ccoll) for
    ar_op: object  # how the replicas' outputs are combined (FSDP's all-reduce, or the hook's)
    divide: float  # the user's gradient: the sum over all 4 ranks divided by this
    force_sum: bool = False
    factor: float | None = None  # set_gradient_divide_factor
    wiring: str = "hsdp"  # "hsdp": attach on a 2-D mesh; "bare": set_custom_reduce_scatter by
    # hand; "hook": 1-D FSDP on the shard dimension, replicas averaged by set_all_reduce_hook
    eb: ccoll.ABS | ccoll.REL | None = None


def _eb(dtype: torch.dtype) -> ccoll.ABS:
    # Large enough against the roundings of a 16-bit all-reduce (the allowance below), so an
    # error of twice the bound cannot hide in them.
    return ccoll.ABS({F32: 1e-3, F64: 1e-3, F16: 4e-3, BF16: 2e-2}[dtype])


CASES = [
    # FSDP's defaults: float32/bfloat16 average in both collectives, float16/float64 sum,
    # divided by ~sqrt(4) = 2 before and 2 after.
    Case("f32-default", F32, None, None, AVG, AVG, 4),
    Case("bf16-default", BF16, None, None, AVG, AVG, 4),
    Case("f16-default", F16, 2, 2, SUM, SUM, 4),
    Case("f64-default", F64, 2, 2, SUM, SUM, 4),
    # set_force_sum_reduction_for_comms: sums, all of the division after.
    Case("f32-force-sum", F32, None, 4, SUM, SUM, 4, force_sum=True),
    Case("bf16-force-sum", BF16, None, 4, SUM, SUM, 4, force_sum=True),
    Case("f32-force-sum-factor-1", F32, None, 1, SUM, SUM, 1, force_sum=True, factor=1),
    # set_gradient_divide_factor: equal to the shard size, float32/bfloat16 average in the
    # reduce-scatter and SUM the replicas; float16/float64 split the factor as above.
    Case("f32-factor-2", F32, None, None, AVG, SUM, 2, factor=2),
    Case("bf16-factor-2", BF16, None, None, AVG, SUM, 2, factor=2),
    Case("f16-factor-2", F16, 2, 1, SUM, SUM, 2, factor=2),
    Case("f64-factor-1", F64, 1, 1, SUM, SUM, 1, factor=1),
    Case("f16-factor-8", F16, 4, 2, SUM, SUM, 8, factor=8),
    Case("f32-factor-2-rel", F32, None, None, AVG, SUM, 2, factor=2, eb=ccoll.REL(1e-3)),
    Case("f16-default-rel", F16, 2, 2, SUM, SUM, 4, eb=ccoll.REL(2e-3)),
    # Without attach ccoll does not know the module's mesh or divide factor.
    Case("bare-f32-default", F32, None, None, AVG, AVG, 4, wiring="bare"),
    Case("bare-f64-factor-1", F64, 1, 1, SUM, SUM, 1, factor=1, wiring="bare"),
    # 1-D FSDP over the shard dimension; the replicas are averaged by the user's hook.
    Case("hook-f32-default", F32, None, None, AVG, AVG, 4, wiring="hook"),
    Case("hook-f16-default", F16, 2, 1, SUM, AVG, 4, wiring="hook"),
]


class Recorder:
    """A reduce-scatter for FSDP that records what the wrapped one got and gave."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls: list[tuple[torch.Tensor, torch.Tensor, object]] = []

    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
        x = input_tensor.clone()
        work = self.inner(output_tensor, input_tensor, group, op, async_op)
        self.calls.append((x, output_tensor.clone(), op))
        return work


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (REPLICAS, SHARD), mesh_dim_names=("replicate", "shard"))


@pytest.fixture(scope="module")
def shard_comm():
    # The MPI ranks of this rank's shard group, in the mesh's order (torch rank = MPI rank).
    rank = WORLD.Get_rank()
    c = WORLD.Split(color=rank // SHARD, key=rank % SHARD)
    yield c
    c.Free()


def _model(case: Case, mesh) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    torch.manual_seed(7)
    model = Net()
    if case.dtype == F64:
        model = model.double()  # float64 parameters: float64 gradients, reduced as they are
    kw: dict[str, object] = {"mesh": mesh["shard"] if case.wiring == "hook" else mesh}
    if case.dtype in (F16, BF16):
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=case.dtype)
    for sub in (model.a, model.b):
        fully_shard(sub, **kw)
    fully_shard(model, **kw)
    for sub in (model.a, model.b):
        sub.set_force_sum_reduction_for_comms(case.force_sum)
        if case.factor is not None:
            sub.set_gradient_divide_factor(case.factor)
    if case.wiring == "hook":
        group = mesh.get_group("replicate")
        for sub in (model.a, model.b):
            sub.set_all_reduce_hook(lambda t: dist.all_reduce(t, op=AVG, group=group))
    return model


def _check_factors(case: Case, mesh) -> None:  # type: ignore[no-untyped-def]
    """Torch computes the factors this table was written from."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    ar_group = None if case.wiring == "hook" else mesh.get_group("replicate")
    got = _get_gradient_divide_factors(mesh.get_group("shard"), ar_group, case.dtype, "cpu",
                                       case.factor, case.force_sum)
    assert got[:3] == (case.pre, case.post, case.rs_op), (case.name, got)
    if ar_group is not None:  # with the hook, the replicas are combined by the hook's op
        assert got[3] == case.ar_op, (case.name, got)


def _final_grad(module: torch.nn.Module) -> np.ndarray:
    """This rank's sharded gradient of the module, laid out as FSDP's reduce-scatter output."""
    parts = []
    for p in module.parameters():
        local = p.grad.to_local().reshape(-1).double().numpy()
        width = -(-p.shape[0] // SHARD) * (p.numel() // p.shape[0])
        parts.append(np.pad(local, (0, width - local.size), constant_values=np.nan))
    return np.concatenate(parts)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hsdp_bound_on_the_average_the_user_gets(case: Case, mesh, shard_comm) -> None:
    _check_factors(case, mesh)
    rank = WORLD.Get_rank()
    me = rank % SHARD  # the shard this rank keeps (its row of every reduce-scatter)
    eb = case.eb if case.eb is not None else _eb(case.dtype)
    model = _model(case, mesh)
    rs = ct.FSDPReduceScatter(eb, policy="compress", min_numel=0, comm=shard_comm)
    try:
        recorders = {}
        if case.wiring == "bare":
            for sub in (model.a, model.b):
                recorders[sub] = Recorder(rs)
                sub.set_custom_reduce_scatter(recorders[sub])
        else:
            assert rs.attach(model) == 2
            for sub in (model.a, model.b):
                view = sub._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
                recorders[sub] = Recorder(view)
                sub.set_custom_reduce_scatter(recorders[sub])
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(8, 64, generator=g, dtype=torch.float64 if case.dtype == F64 else None)
        (model(x).sum() / 64).backward()

        worst = 0.0
        for sub in (model.a, model.b):
            (inp, out, op), = recorders[sub].calls
            assert op == case.rs_op, (case.name, op)
            rows = WORLD.allgather(inp.double().numpy().reshape(SHARD, -1))
            outs = WORLD.allgather(out.double().numpy())
            # every rank's contribution to this shard: its row, times FSDP's pre-division
            terms = [r[me] for r in rows]
            exact = ExactSum(terms, Fraction(case.pre or 1) / Fraction(case.divide))
            if isinstance(eb, ccoll.ABS):
                bound: float | Fraction = eb.value
            else:  # v times the range of what was handed in, over every rank (>= each group's)
                bound = rel_bound(eb.value, *rows)
            # The roundings outside ccoll's bound, as floats do them (allowance, decided
            # exactly by assert_within): ccoll's own (two in its float32/float64 arithmetic,
            # one to a 16-bit dtype) on each replica's output, the replicas' all-reduce in
            # the reduce dtype (R - 1 sums and, for AVG, a quotient), all scaled by what
            # follows them, then FSDP's post-division.
            t = case.dtype
            c = F64 if t == F64 else F32
            reps = np.abs(np.array([o for i, o in enumerate(outs) if i % SHARD == me]))
            per = 2 * (U[c] * reps + TINY[c])
            if t in (F16, BF16):
                per = per + U[t] * reps + TINY[t]
            after = (case.post or 1) * (REPLICAS if case.ar_op == AVG else 1)
            y = _final_grad(sub)
            real = ~np.isnan(y)
            extra = (per.sum(axis=0) + REPLICAS * (U[t] * reps.sum(axis=0) + TINY[t])) / after
            extra = 1.01 * (extra + U[t] * np.abs(np.nan_to_num(y)) + TINY[t])
            assert_within(y[real], exact[real], bound, extra=extra[real])
            # the replicas of a shard hold the same gradient, bit for bit
            ys = WORLD.allgather(y)
            assert all(np.array_equal(ys[i], y, equal_nan=True)
                       for i in range(me, WORLD.Get_size(), SHARD)), case.name
            err = np.abs(y[real] - exact.approx()[real]).max()
            worst = max(worst, err / float(bound))
        # the check saw compression at work
        assert worst > 0.05, f"{case.name}: max error {worst:.3g} of the bound"
        assert rs.compressed == 2 and rs.exact == 0
    finally:
        rs.close()
