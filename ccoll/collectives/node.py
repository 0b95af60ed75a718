"""Threads per rank: the cores of each rank's node, and this rank's share of them.

Called once when a :class:`~ccoll.Communicator` is created (collective over its
communicator): the ranks exchange their host and the cores they may run on, and
:func:`ccoll.runtime.cpu_threads.threads_per_rank` gives this rank's thread count from
those of the ranks on its host (see
docs/collectives.md, "Buffers and threads").

Also the node grouping of hierarchical collectives (:func:`node_comms`): nodes are MPI's
shared-memory domains, or consecutive blocks of ``ranks_per_node`` ranks when the
Communicator is given that override (docs/collectives.md, "Hierarchical collectives").
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import cast

import numpy as np
from mpi4py import MPI

from ccoll.collectives.waiting import Deadline, share_cores, wait_all
from ccoll.runtime import cpu_threads

__all__ = [
    "node_cpus", "node_threads", "Grouping", "rpn_problem", "grouping_of", "grouping_of_leaders",
    "node_comms",
]


def _host_key() -> int:
    """Return a 63-bit digest of this process's host name (``MPI_Get_processor_name``)."""
    name = MPI.Get_processor_name().encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little") >> 1


def node_cpus(comm: MPI.Intracomm, deadline: Deadline) -> list[frozenset[int]]:
    """Return the cores each rank of this rank's host may run on, in rank order.

    Collective: every rank of ``comm`` calls it. Ranks are grouped by host name, exchanged
    with nonblocking collectives under ``deadline`` (``MPI_Comm_split_type`` has no
    nonblocking form: a rank that stopped after the creation's agreement would leave the
    others in it past any timeout). The host, not MPI's shared-memory domain, is what
    shares the cores: on the emulated cluster (``MPIR_CVAR_NOLOCAL``) every rank is its own
    shared-memory domain, yet all run on one machine's cores.
    """
    mine = cpu_threads.allowed_cpus()
    width = np.array([max(mine) + 1], np.int64)
    wait_all([comm.Iallreduce(MPI.IN_PLACE, width, op=MPI.MAX)], deadline,
             "exchanging the cores of this node")
    row = np.zeros(8 + int(width[0]), np.uint8)
    row[:8] = np.frombuffer(np.int64(_host_key()).tobytes(), np.uint8)
    row[8 + np.array(sorted(mine), np.int64)] = 1
    every = np.empty((comm.Get_size(), row.size), np.uint8)
    wait_all([comm.Iallgather(row, every)], deadline, "exchanging the cores of this node")
    host = row[:8].tobytes()
    return [frozenset(np.flatnonzero(r[8:]).tolist()) for r in every if r[:8].tobytes() == host]


def node_threads(comm: MPI.Intracomm, deadline: Deadline,
                 threads: int | None = None) -> tuple[int, str]:
    """Return this rank's threads for ccoll's CPU kernels and where the number comes from.

    Collective over ``comm``; also makes the count the process's (``set_thread_count``).
    ``threads``: the ``CCOLL_THREADS`` setting (:class:`ccoll.settings.Settings`).
    """
    cpu_threads.use_setting(threads)
    node = node_cpus(comm, deadline)
    env = {"NUMBA_NUM_THREADS": os.environ.get("NUMBA_NUM_THREADS", "")}
    if threads is not None:
        env[cpu_threads.ENV_THREADS] = str(threads)
    mine = cpu_threads.allowed_cpus()
    n, why = cpu_threads.threads_per_rank(mine, node, env, cpu_threads.pool_size())
    users: dict[int, int] = {}
    for cpus in node:
        for c in cpus:
            users[c] = users.get(c, 0) + 1
    share_cores(sum(1 / users.get(c, 1) for c in mine) < 1)  # less than a core of its own
    return cpu_threads.set_thread_count(n, explicit=threads is not None), why


# -- node grouping for hierarchical collectives -------------------------------------------


@dataclass(frozen=True, slots=True)
class Grouping:
    """How the ranks of a communicator form nodes (the same on every rank).

    ``ranks_per_node`` is 0 when the nodes hold different numbers of ranks (no hierarchy:
    the inter-node rings need one member per local rank on every node).
    """

    nodes: int
    ranks_per_node: int
    node: int  # this rank's node, 0 .. nodes-1 (in the order of their lowest rank)
    local: int  # this rank's place in its node, 0 .. ranks_per_node-1 (in rank order)
    source: str  # "shared memory" (MPI_Comm_split_type) or "ranks_per_node=R"

    @property
    def hierarchical(self) -> bool:
        """Whether allreduce runs in two levels: at least 2 nodes of at least 2 ranks."""
        return self.nodes >= 2 and self.ranks_per_node >= 2


def rpn_problem(ranks_per_node: object, size: int) -> str | None:
    """Why ``ranks_per_node`` cannot group ``size`` ranks (with the fix), or ``None``."""
    if ranks_per_node is None:
        return None
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, (int, np.integer)):
        return (f"ranks_per_node must be None (nodes from MPI's shared-memory domains) or a "
                f"positive int, got {ranks_per_node!r}")
    r = int(ranks_per_node)
    if r < 1 or size % r:
        return (f"ranks_per_node={r} does not divide the {size} ranks of the communicator "
                "into whole nodes: pass a positive divisor of the communicator size, or None")
    return None


def grouping_of_leaders(leaders: list[int], rank: int, source: str) -> Grouping:
    """Return the grouping from each rank's node leader (its node's lowest rank), by rank.

    Pure arithmetic on numbers every rank has: the same answer everywhere.
    """
    order = sorted(set(leaders))
    members = [r for r, lead in enumerate(leaders) if lead == leaders[rank]]
    sizes = {leaders.count(lead) for lead in order}
    rpn = sizes.pop() if len(sizes) == 1 else 0
    return Grouping(len(order), rpn, order.index(leaders[rank]), members.index(rank), source)


def grouping_of(size: int, rank: int, ranks_per_node: int) -> Grouping:
    """Return the grouping of the override: consecutive blocks of ``ranks_per_node`` ranks."""
    r = int(ranks_per_node)
    return Grouping(size // r, r, rank // r, rank % r, f"ranks_per_node={r}")


def node_comms(
    comm: MPI.Intracomm, ranks_per_node: int | None, deadline: Deadline
) -> tuple[Grouping, MPI.Intracomm | None, MPI.Intracomm | None]:
    """Return the grouping, the node communicator and the inter-node one (local rank's).

    Collective over ``comm``; call it only after an agreement that the ranks passed the
    same ``ranks_per_node`` (valid: :func:`rpn_problem`). ``None``: nodes are MPI's
    shared-memory domains (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``), whose leaders
    are exchanged with ``MPI_Iallgather`` under ``deadline``. The communicators are made
    only when the grouping is hierarchical, else ``None``. ``MPI_Comm_split`` has no
    nonblocking form: it runs only after a completed exchange under the deadline, which
    every rank passed, so every rank reaches it.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    shm = None
    if ranks_per_node is None:
        # MPI_Comm_split_type blocks until every rank calls it: first make sure every
        # rank is here, under the deadline, so that a rank that failed or went elsewhere
        # makes the others raise instead of waiting forever.
        wait_all([comm.Ibarrier()], deadline, "grouping the ranks into nodes")
        shm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        lead = MPI.Group.Translate_ranks(shm.Get_group(), [0], comm.Get_group())[0]
        leaders = np.empty(size, np.int64)
        wait_all([comm.Iallgather(np.array([lead], np.int64), leaders)], deadline,
                 "exchanging the node grouping")
        g = grouping_of_leaders([int(v) for v in leaders], rank, "shared memory")
    else:
        g = grouping_of(size, rank, ranks_per_node)
    if not g.hierarchical:
        if shm is not None:
            shm.Free()
        return g, None, None
    # mpi4py types Split as returning a Comm; split from an intracommunicator it is one.
    node = cast(MPI.Intracomm, shm if shm is not None else comm.Split(g.node, key=rank))
    inter = cast(MPI.Intracomm, comm.Split(g.local, key=g.node))
    return g, node, inter
