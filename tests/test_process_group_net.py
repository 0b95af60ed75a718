"""How ccoll.torch.process_group picks the interface towards rank 0 (no MPI needed)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("torch")

from ccoll.torch import process_group as pg  # noqa: E402

# A rank of the emulated cluster: loopback, and veth0 on the ranks' /24.
RANK1 = [("lo", "127.0.0.1", "255.0.0.0"), ("veth0", "10.231.0.2", "255.255.255.0")]


def test_rank0_on_our_subnet_is_reached_directly() -> None:
    assert pg.reach_score("10.231.0.1", RANK1) == 2
    assert pg.interface_towards("10.231.0.1", RANK1) == "veth0"


@pytest.mark.parametrize("addr", ["127.0.0.1", "10.231.0.2"])
def test_loopback_and_our_own_address_are_not_rank0(addr: str) -> None:
    # Another machine's copy of an address we hold ourselves (docker0's 172.17.0.1 on every
    # node) would lead to ourselves, not to rank 0.
    assert pg.reach_score(addr, RANK1) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interface list is Linux-only")
def test_local_interfaces_lists_loopback() -> None:
    ifaces = pg.local_interfaces()
    assert ifaces is not None and ("lo", "127.0.0.1", "255.0.0.0") in ifaces
