"""What the torch tests under MPI share: the process group and a small two-layer net.

Import after ``pytest.importorskip("torch")``; a test module takes the fixture by importing
it (``from torchkit import process_group  # noqa: F401``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ccoll.torch as ct

__all__ = ["Net", "process_group"]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """One gloo process group over MPI's ranks for the module's tests."""
    torch.set_num_threads(1)
    ct.init_process_group_from_mpi()
    yield
    dist.destroy_process_group()


class Net(torch.nn.Module):
    """Two layers, 12,810 parameters: one DDP bucket (under the 1 MiB first-bucket cap),
    whose parameter order DDP reverses when it rebuilds its buckets after the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 160)
        self.b = torch.nn.Linear(160, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))
