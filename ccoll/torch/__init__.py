"""PyTorch DDP integration: a comm hook that averages gradient buckets with ccoll.

``import ccoll`` never imports this package (nor torch); import ``ccoll.torch`` explicitly::

    import ccoll, ccoll.torch
    ccoll.torch.init_process_group_from_mpi()          # under mpiexec / srun, nothing else needed
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = ccoll.torch.CCollHookState(eb=ccoll.REL(1e-3), error_feedback=True)
    ddp.register_comm_hook(state, ccoll.torch.comm_hook)

For FSDP2 (``fully_shard``), :class:`FSDPReduceScatter` reduce-scatters the gradients::

    rs = ccoll.torch.FSDPReduceScatter(eb=ccoll.REL(1e-3), exempt=("*bias", "*norm*"))
    rs.attach(model)                                    # every FSDP module of the model

docs/training.md describes the hook, the reduce-scatter, their error bounds and measured runs.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ccoll.torch needs PyTorch; install it with `pip install ccoll[torch]`"
    ) from exc

from ccoll.torch.fsdp import FSDPReduceScatter
from ccoll.torch.hook import CCollHookState, comm_hook
from ccoll.torch.process_group import init_process_group_from_mpi
from ccoll.torch.recorder import GradientRecorder

__all__ = [
    "CCollHookState",
    "FSDPReduceScatter",
    "GradientRecorder",
    "comm_hook",
    "init_process_group_from_mpi",
]
