"""Set up ``torch.distributed`` from the MPI world, so an ``mpiexec``/``srun`` launch is enough.

Rank and world size come from ``MPI.COMM_WORLD``. The ranks then agree, over MPI, on the
network they share with rank 0:

* every rank in the same network namespace of the same machine (``mpiexec -n 4`` on one
  node): the loopback interface, ``127.0.0.1``;
* otherwise the first IPv4 address of rank 0 that every rank reaches over a non-loopback
  interface (a directly connected subnet preferred over a routed one): the rendezvous
  store listens there and each rank's gloo binds to the interface that routes to it
  (``GLOO_SOCKET_IFNAME``), so gloo's traffic takes the same links as the other ranks'
  (on the emulated cluster of ``jobs/emulated_cluster.py``: the shaped ``veth0``);
* ``interface="eth1"`` (or ``GLOO_SOCKET_IFNAME`` set by the user) forces one interface on
  every rank; rank 0's address on it is the rendezvous address.

Rank 0 opens the rendezvous store on a port the operating system picks (port 0, so no other
process can race for it between the choice and the bind) and broadcasts it over MPI; the
other ranks connect to it. ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` and
``GLOO_SOCKET_IFNAME`` are exported as well, for code that reads them (and for process
groups created later). :func:`rendezvous_info` tells what was chosen.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import struct
import sys
from typing import Any

import numpy as np
import torch.distributed as dist

from ccoll.errors import CollectiveError, InputError

__all__ = ["init_process_group_from_mpi", "rendezvous_info"]

# The rendezvous store must outlive init_process_group: the process group keeps using it.
_STORE: Any = None
_INFO: dict[str, Any] = {}

# (name, IPv4 address, netmask) of an interface.
Iface = tuple[str, str, str]


def init_process_group_from_mpi(
    backend: str = "gloo",
    *,
    timeout_s: float = 300.0,
    comm: Any = None,
    interface: str | None = None,
) -> tuple[int, int]:
    """Initialise the default ``torch.distributed`` process group from MPI; return (rank, size).

    ``interface`` names the network interface that the store and gloo use on every rank
    (default: ``GLOO_SOCKET_IFNAME`` if set, else found as the module docstring says). A
    rank without an IPv4 address on it, or ranks that share no reachable address of rank
    0, raise :class:`ccoll.InputError` / :class:`ccoll.CollectiveError` on every rank.

    Idempotent: when a default group already exists it is kept, after checking that its rank
    and size equal the MPI ones (:class:`ccoll.CollectiveError` otherwise). Collective over
    ``comm`` (default ``MPI.COMM_WORLD``): every rank must call it.
    """
    from mpi4py import MPI

    global _STORE
    world = MPI.COMM_WORLD if comm is None else comm
    rank, size = world.Get_rank(), world.Get_size()
    if dist.is_initialized():
        got = (dist.get_rank(), dist.get_world_size())
        if got != (rank, size):
            raise CollectiveError(
                f"torch.distributed is already initialised as rank {got[0]} of {got[1]}, "
                f"but MPI says rank {rank} of {size}"
            )
        return rank, size
    if not isinstance(backend, str) or backend not in dist.Backend.backend_list:
        raise ValueError(
            f"backend must be one of {dist.Backend.backend_list}, got {backend!r}"
        )
    if interface is not None and (not isinstance(interface, str) or not interface):
        raise InputError(f"interface must be a network interface name, got {interface!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    forced = interface or os.environ.get("GLOO_SOCKET_IFNAME") or None
    host, ifname, how = _choose_network(world, forced)

    # Rank 0 binds first and reports the port (or its failure) so no rank waits forever.
    info: tuple[str, int, str] = (host, 0, "")
    store = None
    if rank == 0:
        try:
            store = dist.TCPStore(
                host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False
            )
            info = (host, int(store.port), "")
        except Exception as exc:  # reported to every rank below
            info = (host, 0, f"{type(exc).__name__}: {exc}")
    host, port, err = _bcast_info(world, info)
    if err:
        raise CollectiveError(f"rank 0 could not open the rendezvous store on {host}: {err}")
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)

    os.environ["MASTER_ADDR"] = host
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(size)
    if ifname:
        # gloo reads it when the group is created: without it gloo binds to the address the
        # host name resolves to, which in a network namespace may not exist or be loopback.
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    _STORE = store
    _INFO.clear()
    _INFO.update({"host": host, "port": port, "interface": ifname, "how": how})
    return rank, size


def rendezvous_info() -> dict[str, Any]:
    """Return what the last :func:`init_process_group_from_mpi` chose on this rank.

    ``{"host": rank 0's address, "port": ..., "interface": this rank's gloo interface (None
    when left to gloo), "how": "loopback" | "route" | "interface" | "hostname"}``; empty
    before the first call.
    """
    return dict(_INFO)


# --------------------------------------------------------------------------------------------
# Which network: decided from facts every rank gathers about itself, exchanged over MPI.


def _choose_network(world: Any, forced: str | None) -> tuple[str, str | None, str]:
    """Return (rendezvous host, this rank's gloo interface or None, how it was chosen).

    Collective; raises the same error on every rank when no choice works.
    """
    ifaces = local_interfaces()
    mine: dict[str, Any] = {"ns": _namespace_key(), "ifaces": ifaces, "err": "",
                            "forced": forced}
    if forced is not None and ifaces is not None:
        # gloo takes a comma-separated list; the rendezvous uses the first.
        for want in forced.split(","):
            if not any(name == want for name, _, _ in ifaces):
                have = ", ".join(sorted({n for n, _, _ in ifaces})) or "none"
                mine["err"] = f"no IPv4 address on interface {want!r} (interfaces: {have})"
    everyone = _allgather_json(world, mine)
    errors = [f"rank {r}: {e['err']}" for r, e in enumerate(everyone) if e["err"]]
    if errors:
        raise InputError(
            f"interface {forced!r} (GLOO_SOCKET_IFNAME or interface=) is not usable: "
            + "; ".join(errors) + ". Pass the name of an interface every rank has."
        )
    root = everyone[0]
    if ifaces is None or any(e["ifaces"] is None for e in everyone):
        # No interface list (not Linux): what the host name resolves to, as gloo does.
        return _resolve_hostname(world), forced, "hostname"
    root_ifaces: list[Iface] = [tuple(i) for i in root["ifaces"]]  # type: ignore[misc]
    if root["forced"] is not None:
        # Names may differ from node to node; rank 0's own first one holds its address.
        first = str(root["forced"]).split(",")[0]
        addr = next(a for n, a, _ in root_ifaces if n == first)
        return addr, forced, "interface"
    keys = [e["ns"] for e in everyone]
    if keys[0] is not None and all(k == keys[0] for k in keys):
        lo = next((n for n, a, _ in ifaces if ipaddress.ip_address(a).is_loopback), "lo")
        return "127.0.0.1", lo, "loopback"
    candidates = [i for i in root_ifaces if not ipaddress.ip_address(i[1]).is_loopback]
    scores = np.array(
        [reach_score(c[1], ifaces) for c in candidates] if world.Get_rank() else
        [2] * len(candidates), dtype=np.int64,
    )
    if scores.size:
        from mpi4py import MPI

        world.Allreduce(MPI.IN_PLACE, scores, op=MPI.MIN)
    best = int(scores.max()) if scores.size else 0
    if best <= 0:
        listed = ", ".join(f"{n} {a}" for n, a, _ in candidates) or "none"
        raise CollectiveError(
            f"no IPv4 address of rank 0 ({listed}) is reachable from every rank over a "
            "non-loopback interface; pass interface=<name> (or set GLOO_SOCKET_IFNAME)"
        )
    name, addr, _ = candidates[int(np.argmax(scores == best))]
    if world.Get_rank() == 0:
        return addr, name, "route"
    return addr, interface_towards(addr, ifaces), "route"


def reach_score(addr: str, ifaces: list[Iface]) -> int:
    """Score how this rank reaches rank 0's address ``addr`` from its ``ifaces``.

    2: ``addr`` is in a subnet of one of ``ifaces`` (not loopback); 1: routed there through
    a non-loopback interface; 0: unreachable, or one of our own addresses (then it is
    another machine's copy of a private address, such as docker0's).
    """
    ip = ipaddress.ip_address(addr)
    ours = {a for _, a, _ in ifaces}
    if addr in ours or ip.is_loopback:
        return 0
    for _, a, mask in ifaces:
        if ipaddress.ip_address(a).is_loopback:
            continue
        if ip in ipaddress.ip_network(f"{a}/{mask}", strict=False):
            return 2
    src = _route_source(addr)
    if src is None or src not in ours or ipaddress.ip_address(src).is_loopback:
        return 0
    return 1


def interface_towards(addr: str, ifaces: list[Iface]) -> str | None:
    """Name of our interface that sends to ``addr`` (subnet first, then the route)."""
    ip = ipaddress.ip_address(addr)
    for name, a, mask in ifaces:
        if not ipaddress.ip_address(a).is_loopback and ip in ipaddress.ip_network(
            f"{a}/{mask}", strict=False
        ):
            return name
    src = _route_source(addr)
    return next((n for n, a, _ in ifaces if a == src), None)


def _route_source(addr: str) -> str | None:
    """Return the local address the kernel sends from to ``addr`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def local_interfaces() -> list[Iface] | None:
    """(name, address, netmask) of every IPv4 interface that is up, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl

    siocgifflags, siocgifaddr, siocgifnetmask = 0x8913, 0x8915, 0x891B
    iff_up = 0x1
    out: list[Iface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), siocgifflags, req)[16:18])[0]
                if not flags & iff_up:
                    continue
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifnetmask, req)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            out.append((name, addr, mask))
    return out


def _namespace_key() -> str | None:
    """Return a key equal exactly for processes in one network namespace of one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


def _resolve_hostname(world: Any) -> str:
    return _bcast_info(world, (socket.gethostname(), 0, ""))[0]


def _allgather_json(world: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON), buffer-based for the reason given in :func:`_bcast_info`."""
    from mpi4py import MPI

    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
    counts = np.zeros(world.Get_size(), dtype=np.int64)
    world.Allgather(np.array([data.size], dtype=np.int64), counts)
    displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
    buf = np.empty(int(counts.sum()), dtype=np.uint8)
    world.Allgatherv(data, [buf, counts.tolist(), displs.tolist(), MPI.BYTE])
    pieces = zip(displs, counts, strict=True)
    return [json.loads(buf[d : d + c].tobytes().decode()) for d, c in pieces]


def _bcast_info(world: Any, info: tuple[str, int, str]) -> tuple[str, int, str]:
    """Broadcast rank 0's ``(host, port, error)``: its length, then its JSON bytes.

    Buffer-based on purpose: mpi4py's pickled ``bcast`` duplicates the communicator on its
    first use, with the GIL held, which deadlocks against another thread's first one.
    """
    data = json.dumps(list(info)).encode() if world.Get_rank() == 0 else b""
    n = np.array([len(data)], dtype=np.int64)
    world.Bcast(n, root=0)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if data else np.empty(int(n[0]), np.uint8)
    world.Bcast(buf, root=0)
    host, port, err = json.loads(buf.tobytes().decode())
    return str(host), int(port), str(err)
