"""ccoll.torch.init_process_group_from_mpi under MPI: the network it picks, and its errors.

Ranks started by one ``mpiexec`` on one machine share a network namespace: the store and
gloo must use the loopback interface. A named interface that a rank lacks is an
:class:`InputError` on every rank (none is left waiting). The choice across network
namespaces is checked on the emulated cluster (tests/test_train_ddp_cluster.py, root).

Run: mpiexec -n K python -m mpi4py -m pytest tests/mpi/test_process_group.py
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ccoll.errors import InputError  # noqa: E402
from ccoll.torch.process_group import init_process_group_from_mpi, rendezvous_info  # noqa: E402


@pytest.fixture(autouse=True)
def no_group(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        # gloo connects its mesh inside init: a rank that tears its group down while a
        # slower one is still connecting closes that connection under it.
        dist.barrier()
        dist.destroy_process_group()
    os.environ.pop("GLOO_SOCKET_IFNAME", None)


def test_ranks_on_one_namespace_use_loopback() -> None:
    rank, size = init_process_group_from_mpi(timeout_s=60)
    info = rendezvous_info()
    assert (info["how"], info["host"], info["interface"]) == ("loopback", "127.0.0.1", "lo")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)  # gloo works on the chosen interface
    assert t.tolist() == [size * (size + 1) / 2] * 3


def test_named_interface_is_used_on_every_rank() -> None:
    init_process_group_from_mpi(timeout_s=60, interface="lo")
    assert rendezvous_info() == {**rendezvous_info(), "how": "interface", "interface": "lo",
                                 "host": "127.0.0.1"}


def test_interface_missing_on_one_rank_fails_on_every_rank() -> None:
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    name = "nosuchif0" if comm.Get_rank() == last else "lo"
    with pytest.raises(InputError, match=rf"rank {last}: no IPv4 address on interface "
                       r"'nosuchif0'.*Pass the name of an interface every rank has"):
        init_process_group_from_mpi(timeout_s=60, interface=name)
    assert not dist.is_initialized()
    comm.Barrier()  # every rank got here: nobody waits in a rendezvous


def test_every_name_of_an_interface_list_is_checked() -> None:
    # GLOO_SOCKET_IFNAME may list several interfaces; gloo would fail on the missing one.
    with pytest.raises(InputError, match=r"no IPv4 address on interface 'nosuchif1'"):
        init_process_group_from_mpi(timeout_s=60, interface="lo,nosuchif1")
    assert not dist.is_initialized()


@pytest.mark.parametrize("bad", ["", 7])
def test_interface_must_be_a_name(bad: object) -> None:
    with pytest.raises(InputError, match="interface must be a network interface name"):
        init_process_group_from_mpi(interface=bad)  # type: ignore[arg-type]
