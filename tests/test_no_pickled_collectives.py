"""The library makes no pickle-based (lowercase) mpi4py communication call.

mpi4py duplicates a communicator, collectively and with the GIL held, on the first pickled
collective made on it. Two threads that make their first such call at once on two
communicators (the progress engine's ``iallreduce`` and the caller's ``allreduce``, each
calibrating its channel) then deadlock: one rank's thread waits in one duplicate holding
the GIL that its other thread needs to join the other duplicate, where the peers wait.
Buffer-based calls (``Allreduce``, ``Bcast`` ... on numpy arrays) do not do that.

The check reads the sources with ``ast``: a call ``<receiver>.<name>(...)`` where
``<name>`` is one of mpi4py's lowercase communication methods and the receiver is named
like a communicator (``comm``, ``self._comm``, ``ch.comm``, ``world``, ``MPI.COMM_WORLD``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ccoll"

# mpi4py's pickle-based methods of Comm (not the uppercase buffer ones).
PICKLED = frozenset({
    "send", "recv", "isend", "irecv", "sendrecv", "bsend", "ssend", "ibsend", "issend",
    "mprobe", "improbe", "bcast", "gather", "scatter", "allgather", "alltoall", "reduce",
    "allreduce", "scan", "exscan", "neighbor_allgather", "neighbor_alltoall",
})
_COMM_NAME = re.compile(r"^_*(\w+_)?comm$|^world$|^COMM_\w+$", re.IGNORECASE)

# Files allowed to keep such calls, with the reason. Each entry must still be needed.
ALLOWED = {
    # An example program run on its own (python -m ccoll.demo), not a library path.
    "ccoll/demo.py": "demo program",
}


def _receiver_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def pickled_calls(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every lowercase mpi4py communication call on a communicator."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in PICKLED:
            continue
        name = _receiver_name(node.func.value)
        if name is not None and _COMM_NAME.match(name):
            out.append((node.lineno, ast.unparse(node.func)))
    return out


def test_detector_finds_pickled_calls_and_only_those():
    found = pickled_calls(
        "comm.allgather(x)\n"
        "self._comm.bcast(x, root=0)\n"
        "ch.comm.allreduce(1.0, op=MPI.MAX)\n"
        "world.bcast(info, root=0)\n"
        "MPI.COMM_WORLD.gather(x)\n"
        "sync_comm.sendrecv(x, 1)\n"
    )
    assert [line for line, _ in found] == [1, 2, 3, 4, 5, 6]
    assert pickled_calls(
        "comm.Allgather(a, b)\n"
        "comm.Allreduce(a, b, op=MPI.MAX)\n"
        "cc.allreduce(x, eb)\n"  # a ccoll Communicator
        "default_communicator(comm).allreduce(x)\n"
        "exact.allreduce(ch, a, b, d)\n"
        "np.add.reduce(x)\n"
        "gather.allgather(ch, x, eb, out, d)\n"
    ) == []


def test_library_makes_no_pickled_mpi_calls():
    bad = []
    hits_in_allowed = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        calls = pickled_calls(path.read_text())
        if rel in ALLOWED:
            if calls:
                hits_in_allowed.add(rel)
            continue
        bad += [f"{rel}:{line}: {text}(...)" for line, text in calls]
    assert not bad, (
        "pickle-based mpi4py calls on library paths (use Allreduce/Allgather/Bcast on numpy "
        "buffers; they cannot deadlock two threads on mpi4py's communicator duplication):\n"
        + "\n".join(bad)
    )
    stale = sorted(set(ALLOWED) - hits_in_allowed)
    assert not stale, f"ALLOWED entries no longer needed, remove them: {stale}"
