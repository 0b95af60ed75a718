"""Set up ``torch.distributed`` from the MPI world, so an ``mpiexec``/``srun`` launch is enough.

Rank and world size come from ``MPI.COMM_WORLD``. Rank 0 opens the rendezvous store on a
port the operating system picks (port 0, so no other process can race for it between the
choice and the bind), and broadcasts its host name and that port over MPI; the other ranks
connect to it. ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` are exported as well,
for code that reads them.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from typing import Any

import numpy as np
import torch.distributed as dist

from ccoll.errors import CollectiveError

__all__ = ["init_process_group_from_mpi"]

# The rendezvous store must outlive init_process_group: the process group keeps using it.
_STORE: Any = None


def init_process_group_from_mpi(
    backend: str = "gloo", *, timeout_s: float = 300.0, comm: Any = None
) -> tuple[int, int]:
    """Initialise the default ``torch.distributed`` process group from MPI; return (rank, size).

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
    timeout = datetime.timedelta(seconds=timeout_s)

    # Rank 0 binds first and reports the port (or its failure) so no rank waits forever.
    info: tuple[str, int, str] = ("", 0, "")
    store = None
    if rank == 0:
        host = socket.gethostname()
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
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    _STORE = store
    return rank, size


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
