"""The agreement step that starts every collective: one small ``MPI_Iallreduce``.

Before any data moves, every rank contributes a float64 vector
``[lo, f1, f2, ..., -hi, -f1, -f2, ...]`` to one ``MPI_Allreduce(MIN)``: ``lo``/``hi`` give
the global range of the finite values (for ``REL`` bounds), and each field ``f``
(collective, invalid-argument flag, count, dtype, bound kind and value, op, algorithm,
policy, root, shape, chunk size, and the settings that decide which collectives a rank
makes: a fingerprint of the ``CCOLL_*`` calibration overrides, host or device data, the
DDP hook's error feedback and iteration settings) comes back as ``min f`` and
``-min(-f) = max f``. Where they differ the ranks disagree; every rank sees the same vector
and so raises the same error. A non-root rank of ``bcast`` that passes ``None`` puts
``+inf`` in both halves for count, dtype and shape (it takes the root's, which the others
are still checked against); the fields from "x is None" on are not compared: the maximum
of "x is None" tells every rank that the root must send its shape and dtype, the maximum of
"previous call's seconds" is the slowest rank's time of the channel's previous
``policy="auto"`` call, which the auto policy's measured feedback takes in at the end of
this call (:mod:`ccoll.collectives.policy.feedback`), and the minimum and maximum of "data
started" say whether all, some or none of the ranks ran the call's data collective while
the agreement was in flight (see :func:`agree`: a repeated raw call pays no latency of its
own for the check). The allreduce is always the nonblocking one, so that it matches on
every rank either way. Only on the error path a
second exchange (the lengths with ``MPI_Allgather``, then the bytes with
``MPI_Allgatherv``, under the same deadline) collects
what each rank passed, so that the message (identical on every rank) says which rank
passed what; the values it shows are formatted only then, so that a valid call pays for
none of that text. Only buffer-based MPI calls are made: mpi4py's pickle-based collectives
duplicate the communicator on first use while holding the GIL, which can deadlock against
another thread's collective.

The Communicator's ``split`` of the allreduce bound is a compared field too: ranks that
split differently would forward streams of different bounds. So are its node grouping
("nodes", "ranks per node": the ``ranks_per_node`` setting when a Communicator is made, the
grouping in use on every call): ranks that group differently would run different rings.

All fields are small integers or doubles that float64 holds exactly (counts < 2**53,
fingerprints < 2**52).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ccoll.collectives.waiting import Deadline, wait_all
from ccoll.errors import DTypeError, ErrorBoundError, InputError, MismatchError

__all__ = [
    "Call", "Agreed", "agree", "COLLECTIVES", "DTYPES", "OPS", "ALGORITHMS", "POLICIES",
    "SCHEDULES", "ENV_SETTINGS", "PLACES", "env_code", "shape_code",
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
# Environment overrides of policy="auto" that skip calibration collectives (or change
# which ones run): a rank that sets one alone would leave the others waiting in them.
ENV_SETTINGS = (
    "CCOLL_ALPHA", "CCOLL_BANDWIDTH", "CCOLL_COMPRESS_GBPS", "CCOLL_ADD_GBPS",
    "CCOLL_DECOMPRESS_GBPS", "CCOLL_REDUCE_GBPS", "CCOLL_OVERHEAD", "CCOLL_RATIO",
    "CCOLL_EFFICIENCY", "CCOLL_CALIBRATION", "CCOLL_CACHE_DIR",
)

_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (DTypeError, ErrorBoundError, InputError)
}

# Field names in vector order; they also name the field in error messages.
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
    "CCOLL_* settings",
    "data location",
    "error_feedback",
    "start_iter",
    "min_numel",
    "split",
    "nodes",
    "ranks per node",
    "schedule",
    "x is None",
    "previous call's seconds",
    "data started",
)
_WILD = tuple(_FIELDS.index(f) for f in ("element count", "dtype", "shape"))
# The fields from "x is None" on are not compared: every rank reads their min and max.
_ANY = _FIELDS.index("x is None")
# Not compared either: each rank's seconds of its previous measured call (the feedback of
# policy="auto", ccoll.collectives.policy.feedback); only the maximum is read.
_ELAPSED = _FIELDS.index("previous call's seconds")
_STARTED = _FIELDS.index("data started")
# Fields shown with str() in error messages (the others with repr()).
_SHOWN_AS_STR = frozenset({
    "dtype", "element count", "shape", "error-bound kind", "CCOLL_* settings", "data location",
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
    env: int = 0  # env_code() for policy="auto" calls, else 0
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
    lo: float = math.inf
    hi: float = -math.inf
    # bcast only: this non-root rank passed None (count, dtype and shape are the root's).
    wild: bool = False
    # Seconds this rank measured for the channel's previous policy="auto" call (0: none).
    elapsed: float = 0.0
    # This rank started the call's data collective before the agreement finished (see agree).
    started: bool = False
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
            self.env,
            self.place,
            self.feedback,
            self.start_iter,
            self.min_numel,
            self.split,
            self.nodes,
            self.rpn,
            self.schedule,
            1 if self.wild else 0,
            self.elapsed,
            1 if self.started else 0,
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
    """The result of a successful agreement: the global range of the finite values."""

    lo: float
    hi: float
    none: bool = False  # some rank passed None to bcast
    elapsed: float = 0.0  # the maximum over ranks of Call.elapsed
    # The agreed compared fields (equal on every rank): what the next call may repeat.
    sig: tuple[float, ...] = ()
    # Every rank ran the data collective with the agreement (agree's ``run``): done.
    started: bool = False
    # Some ranks did and some did not (only bcast, where a rank passed None): the
    # others ran ``dummy``; every request is complete and the data must move again.
    mixed: bool = False


def shape_code(shape: tuple[int, ...]) -> int:
    """Return a 52-bit code of a shape (exact in float64); different shapes differ."""
    h = 1469598103934665603
    for d in (len(shape), *shape):
        h = ((h ^ (int(d) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h >> 12


_env_cache: tuple[tuple[Any, ...], int, str] = ((), 0, "")
_ENV_KEYS = tuple(os.fsencode(k) for k in ENV_SETTINGS)


def env_code() -> tuple[int, str]:
    """Return a 52-bit fingerprint of the ``CCOLL_*`` overrides, and their text.

    The fingerprint is exact in float64; the text (``name=value`` pairs, sorted, or
    ``"none set"``) is what error messages show.
    """
    global _env_cache
    # Every policy="auto" call reads these: os.environ's bytes dict (POSIX) costs a tenth of
    # os.environ.get, which decodes every key and value.
    data = getattr(os.environ, "_data", None)
    if type(data) is dict and os.name == "posix":
        raw = tuple(map(data.get, _ENV_KEYS))
    else:
        raw = tuple([os.environ.get(k) for k in ENV_SETTINGS])
    cached = _env_cache
    if cached[0] == raw:
        return cached[1], cached[2]
    vals = [os.environ.get(k) for k in ENV_SETTINGS]
    pairs = sorted(zip(ENV_SETTINGS, vals, strict=True))
    text = " ".join(f"{k}={v}" for k, v in pairs if v is not None)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    code = int.from_bytes(digest, "little") >> 12
    _env_cache = (raw, code, text or "none set")
    return code, _env_cache[2]


def agree(
    comm: MPI.Intracomm,
    call: Call,
    deadline: Deadline,
    *,
    predicted: tuple[float, ...] | None = None,
    run: Callable[[], None] | None = None,
    dummy: Callable[[], None] | None = None,
) -> Agreed:
    """Run the agreement allreduce; raise the same error on every rank if the call is bad.

    ``predicted`` is the signature (the compared fields, as :attr:`Agreed.sig`) that every
    rank expects this call to have, from agreed history only, so the same on every rank.
    A rank whose own fields equal it and that passes ``run`` (the call's raw data
    collective on buffers already set up) runs ``run`` right after posting the agreement,
    so that a repeated call pays no latency of its own for the check. Every rank passes
    ``dummy`` with a prediction: the same collective as ``run`` on scratch buffers, which a
    rank that did not start runs once the agreement shows that others did, so that their
    requests complete before every rank raises the same error.
    """
    vals = call.values()
    call.started = run is not None and predicted is not None and (
        tuple(vals[:_ANY]) == predicted)
    vals[_STARTED] = 1 if call.started else 0
    k = len(vals) + 1
    neg = [-v for v in vals]
    if call.wild:  # +inf in both halves: neither the min nor the max of the others moves
        for i in _WILD:
            vals[i] = neg[i] = math.inf
    vec = _VECTOR.pack(call.lo, *vals, -call.hi, *neg)
    res = bytearray(_VECTOR.size)
    # Always nonblocking, so that it matches on every rank whether or not a rank runs the
    # data collective while it is in flight (a blocking and a nonblocking collective do
    # not match each other in MPI).
    req = comm.Iallreduce([vec, MPI.DOUBLE], [res, MPI.DOUBLE], op=MPI.MIN)
    if call.started:
        run()  # type: ignore[misc]
    if deadline.at is None:
        req.Wait()
    else:
        wait_all([req], deadline, "agreement on the arguments")
    got = _VECTOR.unpack(res)
    mins = got[1:_ANY + 1]
    maxs = tuple([-v for v in got[k + 1:k + 1 + _ANY]])
    some_started = -got[k + 1 + _STARTED] > 0
    all_started = got[1 + _STARTED] > 0
    failed = mins != maxs or maxs[1] != 0.0  # NaN never equals itself: a mismatch
    if some_started and not call.started and (failed or not all_started):
        dummy()  # type: ignore[misc]
    if failed:
        bad = [i for i in range(_ANY) if mins[i] != maxs[i]]
        _raise(comm, call, bad, maxs[1] != 0.0, deadline, some_started)
    return Agreed(got[0], -got[k], -got[k + 1 + _ANY] > 0, elapsed=-got[k + 1 + _ELAPSED],
                  sig=mins, started=all_started, mixed=some_started and not all_started)


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
    started: bool = False,
) -> None:
    # Every rank reaches this point with the same `bad`, `invalid` and `started`, so this
    # exchange is matched on every rank; it runs only when the call fails.
    pairs = zip(_FIELDS, call.values(), strict=True)
    mine = {name: call.show(name, v) for name, v in pairs}
    report = json.dumps([mine, call.problems, call.started]).encode()
    everyone = [json.loads(b) for b in _allgather_bytes(comm, report, deadline)]
    name = f"ccoll.{call.collective}"
    note = ""
    if started:
        ranks = [r for r, (_, _, s) in enumerate(everyone) if s]
        note = (
            f"; rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} repeated "
            "the arguments of the previous call and had already run its data collective "
            "(with zeros from the others): there an allreduce's out buffer, or x itself "
            "with out=x, may hold a partial result"
        )
    # A rank in another collective makes every other field meaningless: report that first.
    if 0 in bad:
        who = _by_value(everyone, "collective")
        raise MismatchError(
            f"ranks called different collectives on one communicator: {who}{note}")
    if invalid:
        lines = [
            f"rank {r}: {msg}" for r, (_, probs, _) in enumerate(everyone) for _, msg in probs
        ]
        # The first problem (in rank order) picks the exception type, the same on every rank.
        kinds = [kind for _, probs, _ in everyone for kind, _ in probs]
        exc = _ERRORS.get(kinds[0], InputError) if kinds else InputError
        raise exc(f"invalid arguments to {name}: " + "; ".join(lines) + note)
    fields = ", ".join(f"{_FIELDS[i]} ({_by_value(everyone, _FIELDS[i])})" for i in bad)
    raise MismatchError(f"ranks disagree on the arguments of {name}: {fields}{note}")


def _by_value(everyone: list, fld: str) -> str:
    groups: dict[str, list[int]] = {}
    for r, (shown, *_) in enumerate(everyone):
        groups.setdefault(shown[fld], []).append(r)
    return "; ".join(
        f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for v, rs in groups.items()
    )
