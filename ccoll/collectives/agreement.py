"""The agreement step that starts every collective call: one small ``MPI_Allreduce``.

Before any data moves, every rank contributes a float64 vector
``[lo, f1, f2, ..., -hi, -f1, -f2, ...]`` to one ``MPI_Allreduce(MIN)``: ``lo``/``hi`` give
the global range of the finite values (for ``REL`` bounds), and each field ``f``
(collective, invalid-argument flag, count, dtype, bound kind and value, op, algorithm,
policy, root, shape, the Communicator's chunk size, split, node grouping, schedule and
stream format version, host
or device data, the DDP hook's settings, and the fingerprint of the state the call's plan
depends on, :meth:`ccoll.collectives.policy.plan.Planner.digest`) comes back as ``min f``
and ``-min(-f) = max f``. Where they differ the ranks disagree; every rank sees the same
vector and so raises the same error, before any rank plans or moves data. A non-root rank
of ``bcast`` that passes ``None`` puts ``+inf`` in both halves for count, dtype and shape
(it takes the root's, which the others are still checked against). The fields from "x is
None" on are not compared: the maximum of "x is None" tells every rank that the root must
send its shape and dtype; the maxima of the "seconds" fields are the slowest rank's times
of the signature's earlier calls, and the minimum ratio, maximum width, minimum format-2
gain and minimum format-2 speed factors are what the ranks sampled of their data, which
the plan takes in (docs/collectives.md, "Every call").

Only on the error path a second exchange (the lengths with ``MPI_Allgather``, then the
bytes with ``MPI_Allgatherv``, under the same deadline) collects what each rank passed, so
that the message (identical on every rank) says which rank passed what; the values it shows
are formatted only then, so that a valid call pays for none of that text. Only
buffer-based MPI calls are made: mpi4py's pickle-based collectives duplicate the
communicator on first use while holding the GIL, which can deadlock against another
thread's collective.

When a Communicator is made, the same step checks its options and its settings'
fingerprint (:attr:`ccoll.settings.Settings.digest`): ranks that would calibrate or plan
differently fail there. All fields are small integers or doubles that float64 holds
exactly (counts < 2**53, fingerprints < 2**52).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.errors import DTypeError, ErrorBoundError, InputError, MismatchError

__all__ = [
    "Call", "Agreed", "agree", "sig_field", "COLLECTIVES", "DTYPES", "OPS", "ALGORITHMS",
    "POLICIES", "SCHEDULES", "PLACES", "shape_code",
]

COLLECTIVES = {
    "allreduce": 1, "reduce_scatter": 2, "allgather": 3, "bcast": 4, "Communicator": 5,
    "CCollHookState": 6, "FSDPReduceScatter": 7,
}
# By dtype name ("bfloat16": torch's, or ml_dtypes'); float16/bfloat16 data is reduced in
# float32, but the ranks must still pass the same dtype (they get it back).
DTYPES = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4}
OPS = {"sum": 1, "avg": 2}
ALGORITHMS = {"homomorphic": 1, "dar": 2}
POLICIES = {"compress": 1, "raw": 2, "auto": 3}
SCHEDULES = {"auto": 1, "ring": 2, "halving": 3}
BOUND_KINDS = {"exact": 0, "abs": 1, "rel": 2}
PLACES = {"host": 0, "device": 1}
_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (DTypeError, ErrorBoundError, InputError)
}

# Field names in vector order; they also name the field in error messages. The compared
# fields come first; from "x is None" on every rank reads the minimum or the maximum.
_FIELDS = (
    "collective",
    "invalid arguments",
    "element count",
    "dtype",
    "error-bound kind",
    "error-bound value",
    "op",
    "algorithm",
    "policy",
    "root",
    "shape",
    "chunk size",
    "settings",
    "data location",
    "error_feedback",
    "start_iter",
    "min_numel",
    "split",
    "nodes",
    "ranks per node",
    "schedule",
    "format version",
    "plan state",
    "x is None",
    "seconds raw",
    "seconds compressed",
    "seconds two levels",
    "seconds compressed v2",
    "seconds two levels v2",
    "sampled ratio",
    "sampled width",
    "sampled gain2",
    "sampled speed2 compress",
    "sampled speed2 add",
    "sampled speed2 decompress",
    "repeatable",
)
# A bcast rank that passes None knows neither these nor the state of the call's signature.
_WILD = tuple(_FIELDS.index(f) for f in ("element count", "dtype", "shape", "plan state"))
# The fields from "x is None" on are not compared: every rank reads their min and max.
_ANY = _FIELDS.index("x is None")
_TIMES = _FIELDS.index("seconds raw")
_NTIMES = _FIELDS.index("sampled ratio") - _TIMES  # one per candidate of the measured loop
_RATIO = _FIELDS.index("sampled ratio")
_WIDTH = _FIELDS.index("sampled width")
_GAIN2 = _FIELDS.index("sampled gain2")
_SPEED2 = _FIELDS.index("sampled speed2 compress")
_REPEATABLE = _FIELDS.index("repeatable")
# Fields shown with str() in error messages (the others with repr()).
_SHOWN_AS_STR = frozenset({
    "dtype", "element count", "shape", "error-bound kind", "settings", "data location",
})
# The vector as native doubles: packing a list with struct costs less than a numpy array.
_VECTOR = struct.Struct(f"={2 * (len(_FIELDS) + 1)}d")


@dataclass(slots=True)
class Call:
    """What this rank passed to a collective, as numbers, plus any local argument problems."""

    collective: str
    count: int = 0
    dtype: int = 0
    bound_kind: int = 0
    bound_value: float = 0.0
    op: int = 0
    algorithm: int = 0
    policy: int = 0
    root: int = 0
    shape: int = 0
    chunk: int = 0
    settings: int = 0  # the Settings' digest (Communicator creation), else 0
    place: int = 0  # PLACES
    # CCollHookState only: settings that decide which collectives each bucket makes.
    feedback: int = 0
    start_iter: int = 0
    min_numel: int = 0
    # The Communicator's split of the allreduce bound (-1: chosen by the model).
    split: float = -1.0
    # The node grouping of hierarchical collectives: at creation the ranks_per_node setting
    # (-1: MPI's shared-memory domains) and nodes 0; per call the grouping in use.
    nodes: int = 0
    rpn: int = -1
    # The Communicator's schedule of compressed allreduces (SCHEDULES; 0 for calls).
    schedule: int = 0
    # The Communicator's format_version (1 or 2; 0: chosen per call, and 0 for calls).
    version: int = 0
    # The fingerprint of the state the call's plan depends on (Planner.digest).
    plan: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    # bcast only: this non-root rank passed None (count, dtype and shape are the root's).
    wild: bool = False
    # This rank's least seconds per candidate of the signature's calls not yet agreed
    # (plan.VARIANTS: raw, compressed, two levels, each path in format 2; 0: none): the
    # maximum over ranks comes back.
    times: tuple[float, ...] = (0.0,) * 5
    # This rank's sampled ratio and mean code width of its data (+inf: no sample): the
    # minimum ratio and the maximum width come back.
    ratio: float = math.inf
    width: float = 0.0
    # This rank's sampled ratio of format 2's stream over format 1's on the same blocks
    # (+inf: no sample): the minimum comes back.
    gain2: float = math.inf
    # This rank's format-1 seconds over format-2 seconds of compress, add and decompress on
    # that sample (+inf: not timed): the minimum of each comes back.
    speed2: tuple[float, float, float] = (math.inf, math.inf, math.inf)
    # This rank's call is one the fast path can run (ccoll.collectives.fastpath): its next
    # repeats may skip the agreement only where every rank's can.
    repeatable: bool = False
    # (exception class name, message) of each local problem; an invalid call still takes
    # part in the agreement so that the other ranks raise too instead of waiting.
    problems: list[tuple[str, str]] = field(default_factory=list)
    # What this rank passed, by field name, as passed: formatted for error messages only
    # when the call fails (repr() and str() of a dtype cost more than the agreement).
    shown: dict[str, Any] = field(default_factory=dict)

    def problem(self, exc: type[Exception], message: str) -> None:
        """Record an invalid argument of this rank."""
        self.problems.append((exc.__name__, message))

    def values(self) -> list[float]:
        """Return the fields in vector order (ints and floats, all exact in float64)."""
        return [
            COLLECTIVES[self.collective],
            1 if self.problems else 0,
            self.count,
            self.dtype,
            self.bound_kind,
            self.bound_value,
            self.op,
            self.algorithm,
            self.policy,
            self.root,
            self.shape,
            self.chunk,
            self.settings,
            self.place,
            self.feedback,
            self.start_iter,
            self.min_numel,
            self.split,
            self.nodes,
            self.rpn,
            self.schedule,
            self.version,
            self.plan,
            1 if self.wild else 0,
            *self.times,
            self.ratio,
            self.width,
            self.gain2,
            *self.speed2,
            1 if self.repeatable else 0,
        ]

    def show(self, name: str, value: float) -> str:
        """Return what this rank passed for field ``name`` (``value``: its code), as text."""
        if name == "collective":
            return self.collective
        if name not in self.shown:
            return repr(float(value))
        v = self.shown[name]
        return str(v) if name in _SHOWN_AS_STR else repr(v)


class Agreed(NamedTuple):
    """The result of a successful agreement: what every rank now holds identically."""

    lo: float  # the global range of the finite values
    hi: float
    none: bool = False  # some rank passed None to bcast
    # The agreed compared fields (equal on every rank): the call's signature.
    sig: tuple[float, ...] = ()
    times: tuple[float, ...] = (0.0,) * 5  # maxima over ranks of Call.times
    ratio: float = math.inf  # minimum over ranks of Call.ratio
    width: float = 0.0  # maximum over ranks of Call.width
    gain2: float = math.inf  # minimum over ranks of Call.gain2
    # minima over ranks of Call.speed2
    speed2: tuple[float, float, float] = (math.inf, math.inf, math.inf)
    repeatable: bool = False  # every rank's Call.repeatable


def sig_field(sig: tuple[float, ...], name: str) -> float:
    """Return the value of field ``name`` in an agreed signature (:attr:`Agreed.sig`)."""
    return sig[_FIELDS.index(name)]


def shape_code(shape: tuple[int, ...]) -> int:
    """Return a 52-bit code of a shape (exact in float64); different shapes differ."""
    h = 1469598103934665603
    for d in (len(shape), *shape):
        h = ((h ^ (int(d) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h >> 12


def agree(comm: MPI.Intracomm, call: Call, deadline: Deadline) -> Agreed:
    """Run the agreement allreduce; raise the same error on every rank if the call is bad."""
    vals = call.values()
    k = len(vals) + 1
    neg = [-v for v in vals]
    if call.wild:  # +inf in both halves: neither the min nor the max of the others moves
        for i in _WILD:
            vals[i] = neg[i] = math.inf
    vec = _VECTOR.pack(call.lo, *vals, -call.hi, *neg)
    res = bytearray(_VECTOR.size)
    if deadline.at is None:
        comm.Allreduce([vec, MPI.DOUBLE], [res, MPI.DOUBLE], op=MPI.MIN)
    else:
        req = comm.Iallreduce([vec, MPI.DOUBLE], [res, MPI.DOUBLE], op=MPI.MIN)
        wait_all([req], deadline, "agreement on the arguments")
    got = _VECTOR.unpack(res)
    mins = got[1:_ANY + 1]
    maxs = tuple([-v for v in got[k + 1:k + 1 + _ANY]])
    if mins != maxs or maxs[1] != 0.0:  # NaN never equals itself: a mismatch
        bad = [i for i in range(_ANY) if mins[i] != maxs[i]]
        _raise(comm, call, bad, maxs[1] != 0.0, deadline)
    times = tuple(-got[k + 1 + i] for i in range(_TIMES, _TIMES + _NTIMES))
    return Agreed(got[0], -got[k], -got[k + 1 + _ANY] > 0, sig=mins, times=times,
                  ratio=got[1 + _RATIO], width=-got[k + 1 + _WIDTH],
                  gain2=got[1 + _GAIN2],
                  speed2=(got[1 + _SPEED2], got[2 + _SPEED2], got[3 + _SPEED2]),
                  repeatable=got[1 + _REPEATABLE] > 0)


def _allgather_bytes(comm: MPI.Intracomm, data: bytes, deadline: Deadline) -> list[bytes]:
    """Every rank's ``data``, in rank order, through buffer-based MPI calls only."""
    n_ranks = comm.Get_size()
    mine = np.array([len(data)], dtype=np.int64)
    counts = np.empty(n_ranks, dtype=np.int64)
    if deadline.at is None:
        comm.Allgather(mine, counts)
    else:
        wait_all([comm.Iallgather(mine, counts)], deadline, "exchange of the error report sizes")
    displs = np.zeros(n_ranks, dtype=np.int64)
    np.cumsum(counts[:-1], out=displs[1:])
    recv = np.empty(int(counts.sum()), dtype=np.uint8)
    send = np.frombuffer(data, dtype=np.uint8)
    if deadline.at is None:
        comm.Allgatherv([send, MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
    else:
        req = comm.Iallgatherv([send, MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
        wait_all([req], deadline, "exchange of the error reports")
    raw = recv.tobytes()
    return [raw[int(a):int(a) + int(c)] for a, c in zip(displs, counts, strict=True)]


def _raise(
    comm: MPI.Intracomm, call: Call, bad: list[int], invalid: bool, deadline: Deadline,
) -> None:
    # Every rank reaches this point with the same `bad` and `invalid`, so this exchange is
    # matched on every rank; it runs only when the call fails.
    pairs = zip(_FIELDS, call.values(), strict=True)
    mine = {name: call.show(name, v) for name, v in pairs}
    report = json.dumps([mine, call.problems]).encode()
    everyone = [json.loads(b) for b in _allgather_bytes(comm, report, deadline)]
    name = f"ccoll.{call.collective}"
    note = ""
    # A rank in another collective makes every other field meaningless: report that first.
    if 0 in bad:
        who = _by_value(everyone, "collective")
        raise MismatchError(
            f"ranks called different collectives on one communicator: {who}{note}")
    if invalid:
        lines = [
            f"rank {r}: {msg}" for r, (_, probs) in enumerate(everyone) for _, msg in probs
        ]
        # The first problem (in rank order) picks the exception type, the same on every rank.
        kinds = [kind for _, probs in everyone for kind, _ in probs]
        exc = _ERRORS.get(kinds[0], InputError) if kinds else InputError
        raise exc(f"invalid arguments to {name}: " + "; ".join(lines) + note)
    plan = _FIELDS.index("plan state")
    if bad == [plan]:
        raise MismatchError(
            f"ranks would plan {name} differently: the state their plans depend on (the "
            "times and ratios earlier calls of this signature agreed on) differs between "
            f"ranks ({_by_value(everyone, 'plan state')}), which can happen when an earlier "
            "call failed on some ranks only; create a new ccoll.Communicator on every rank")
    fields = ", ".join(f"{_FIELDS[i]} ({_by_value(everyone, _FIELDS[i])})" for i in bad
                       if i != plan)
    raise MismatchError(f"ranks disagree on the arguments of {name}: {fields}{note}")


def _by_value(everyone: list, fld: str) -> str:
    groups: dict[str, list[int]] = {}
    for r, (shown, *_) in enumerate(everyone):
        groups.setdefault(shown[fld], []).append(r)
    return "; ".join(
        f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for v, rs in groups.items()
    )
