"""A training job that checkpoints and resumes, for tests/test_torch_resume.py.

``python -m mpi4py tests/mpi/resume_job.py first DIR N M``: trains N + M steps without a
break (writes ``DIR/full_<kind>_<rank>.pt``), then N steps from the same start, and saves the
checkpoint (model, optimizer, ccoll state) of each rank to ``DIR/ckpt_<kind>_<rank>.pt``.
``... resume DIR N M``, in fresh processes: loads the checkpoint, trains M more steps and
writes ``DIR/resumed_<kind>_<rank>.pt``. ``kind`` is ``ddp`` (the comm hook with error
feedback, its residuals saved by parameter name), ``ddp_shapes`` (the same, saved without
the model: by bucket, with the parameters' shapes) and ``fsdp`` (FSDPReduceScatter). The
test compares the files bit for bit.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torchkit import Net  # noqa: E402

import ccoll  # noqa: E402
import ccoll.torch as ct  # noqa: E402

warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's data of ``step``: the same whether the run was interrupted or not."""
    g = torch.Generator().manual_seed(7919 * MPI.COMM_WORLD.Get_rank() + step)
    return torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)


def build(kind: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    net = Net()
    if kind.startswith("ddp"):
        state = ct.CCollHookState(eb=ccoll.REL(1e-2), error_feedback=True, policy="compress",
                                  min_numel=0)
        model = DDP(net)
        model.register_comm_hook(state, ct.comm_hook)
    else:
        fully_shard(net.a)
        fully_shard(net.b)
        fully_shard(net)
        state = ct.FSDPReduceScatter(ccoll.REL(1e-2), policy="compress", exempt=("*bias",),
                                     min_numel=0)
        state.attach(net)
        model = net
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    return net, model, opt, state


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, t = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def params(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters (its shards under FSDP)."""
    out = {}
    for name, p in net.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = local.detach().clone()
    return out


def main(mode: str, folder: str, n: int, m: int) -> None:
    torch.set_num_threads(1)
    rank, _ = ct.init_process_group_from_mpi()
    for kind in ("ddp", "ddp_shapes", "fsdp"):
        path = os.path.join(folder, f"{{}}_{kind}_{rank}.pt")
        if mode == "first":
            net, model, opt, state = build(kind)
            train(model, opt, range(n + m))
            torch.save(params(net), path.format("full"))
            state.close()  # type: ignore[attr-defined]
            net, model, opt, state = build(kind)
            train(model, opt, range(n))
            by_name = model if kind == "ddp" else None
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                        "ccoll": state.state_dict(by_name) if kind.startswith("ddp")  # type: ignore[attr-defined]
                        else state.state_dict()}, path.format("ckpt"))  # type: ignore[attr-defined]
        else:
            net, model, opt, state = build(kind)
            # DTensors (FSDP's shards) are not among weights_only's types
            ckpt = torch.load(path.format("ckpt"), weights_only=kind != "fsdp")
            net.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            if kind == "ddp":
                state.load_state_dict(ckpt["ccoll"], model)  # type: ignore[attr-defined]
            else:
                state.load_state_dict(ckpt["ccoll"])  # type: ignore[attr-defined]
            train(model, opt, range(n, n + m))
            torch.save(params(net), path.format("resumed"))
            if kind.startswith("ddp"):
                assert state.residuals_reset == 0  # type: ignore[attr-defined]
                assert state.iter == n + m, state.iter  # type: ignore[attr-defined]
        state.close()  # type: ignore[attr-defined]
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
