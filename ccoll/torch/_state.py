"""What the states of ccoll.torch share: their agreed construction, version and settings check."""

from __future__ import annotations

import math
from typing import Any

from ccoll.errorbound import ABS, REL, ErrorBound, as_bound
from ccoll.errors import ErrorBoundError, InputError

__all__ = [
    "POLICIES",
    "STATE_VERSION",
    "agreed_communicator",
    "bound_of",
    "check_settings",
    "check_version",
    "count_of",
    "start_call",
]

POLICIES = ("compress", "auto", "raw")

# Version of the state dicts (CCollHookState, FSDPReduceScatter); bump on a change of keys
# that an older reader cannot load (the hook's "rank" and "ranks", added later, are read
# where present and ignored by older readers: version 1 still).
STATE_VERSION = 1


def count_of(state: dict[str, Any], key: str) -> int:
    """``state[key]`` as a count (a whole number >= 0), else :class:`ccoll.InputError`."""
    v = state.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InputError(f"the state dict's {key} is {v!r}: expected a whole number >= 0, "
                         "as state_dict() saves it")
    return v


def bound_of(state: dict[str, Any]) -> ErrorBound:
    """Return the error bound a state dict was saved with."""
    kind, value = state["eb_kind"], float(state["eb_value"])
    if kind == "abs":
        return ABS(value)
    if kind == "rel":
        return REL(value)
    raise InputError(f"checkpoint state has error-bound kind {kind!r}; expected 'abs' or 'rel'")


# The keys each state dict has (state_dict() writes them; "kind" since 2026-12-06, checked
# where present), and those whose values are dicts.
KEYS = {
    "CCollHookState": ("eb_kind", "eb_value", "error_feedback", "start_iter", "min_numel",
                       "policy", "iter", "residuals", "compressed", "exact", "busy_s"),
    "FSDPReduceScatter": ("eb_kind", "eb_value", "policy", "min_numel", "exempt",
                          "compressed", "exact", "elements_compressed", "elements_exact",
                          "unknown_layout"),
}
_DICTS = ("residuals", "residual_shapes", "residuals_by_param")


def check_version(state: Any, what: str) -> None:
    """Raise :class:`ccoll.InputError` unless ``state`` is a ``what`` state dict of this version.

    Also checks its kind (where saved), that it has every key ``what.state_dict()`` writes
    and that the residuals' containers are dicts, so that a wrong or truncated dict is told
    apart from a setting that differs (a KeyError or AttributeError from deep inside before).
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise InputError(f"not a {what} state dict of version {STATE_VERSION} (got {got!r}): "
                         f"pass what {what}.state_dict() returned")
    kind = state.get("kind", what)
    if kind != what:
        raise InputError(f"this is a {kind} state dict, not a {what} one: pass what "
                         f"{what}.state_dict() returned")
    missing = [k for k in KEYS[what] if k not in state]
    if missing:
        raise InputError(f"the state dict lacks {', '.join(missing)}: not a {what} state "
                         f"dict, or a truncated one; pass what {what}.state_dict() returned")
    bad = [k for k in _DICTS if k in state and not isinstance(state[k], dict)]
    if bad:
        raise InputError(f"the state dict's {bad[0]} is a {type(state[bad[0]]).__name__}, not "
                         f"the dict {what}.state_dict() writes")
    if what == "FSDPReduceScatter" and not (
            isinstance(state["exempt"], (list, tuple))
            and all(isinstance(p, str) for p in state["exempt"])):
        raise InputError(f"the state dict's exempt is {state['exempt']!r}: expected a list of "
                         "name patterns (strings)")


def check_settings(mine: dict[str, Any], state: dict[str, Any], what: str) -> None:
    """Raise :class:`ccoll.InputError` naming every setting of ``state`` that differs."""
    diff = [f"{k}: this {what} has {mine[k]!r}, the state dict {state.get(k)!r}"
            for k in mine if state.get(k) != mine[k]]
    if diff:
        raise InputError(f"the state dict was saved with other settings ({'; '.join(diff)}); "
                         f"construct the {what} with the checkpoint's settings "
                         f"({what}.from_state_dict(state))")


def start_call(what: str, eb: Any, comm: Any, policy: Any) -> tuple[Any, Any, ErrorBound, str]:
    """Check the arguments every state takes; return (base comm, Call, bound, policy).

    A bad ``comm`` raises at once (there is nothing to agree over). A bad bound or policy
    is recorded on the returned agreement call, not raised: :func:`agreed_communicator`
    raises it on every rank, so the others never wait in a collective this rank skipped.
    """
    from mpi4py import MPI

    from ccoll.collectives.agreement import BOUND_KINDS, Call
    from ccoll.collectives.agreement import POLICIES as POLICY_CODES

    base = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(base, MPI.Intracomm) or base == MPI.COMM_NULL:
        raise InputError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
    call = Call(what)
    bound: ErrorBound = REL(1e-3)
    try:
        bound = REL(1e-3) if eb is None else as_bound(eb)
    except (ErrorBoundError, InputError) as exc:
        call.problem(type(exc), str(exc))
    if not isinstance(bound, (ABS, REL)):
        call.problem(InputError, f"eb must be ccoll.ABS or ccoll.REL, got {eb!r}")
        bound = REL(1e-3)
    if policy not in POLICIES:
        call.problem(InputError, f"policy must be one of {', '.join(map(repr, POLICIES))}, "
                     f"got {policy!r}")
        policy = "auto"
    call.bound_kind = BOUND_KINDS[bound.kind]
    call.bound_value = bound.value
    call.policy = POLICY_CODES[policy]
    call.shown.update({"error-bound kind": bound.kind, "error-bound value": bound,
                       "policy": policy})
    return base, call, bound, policy


def agreed_communicator(base: Any, call: Any, policy: str, timeout: Any,
                        what: str, split: float | None = None,
                        ranks_per_node: int | None = None) -> tuple[Any, Any]:
    """Duplicate ``base``, agree on ``call`` and build the homomorphic Communicator.

    Collective over ``base``; returns (duplicate, Communicator). Every rank raises the same
    error when a rank passed a bad argument or other settings (``MismatchError``).
    ``split`` is the Communicator's split of the allreduce bound (``None``: the model's);
    ``ranks_per_node`` its node grouping (``None``: MPI's shared-memory domains).
    """
    from ccoll.collectives import Communicator
    from ccoll.collectives.agreement import agree
    from ccoll.collectives.communicator import dup_comm
    from ccoll.collectives.waiting import Deadline
    from ccoll.gpu_sched.scheduler import yield_to_training
    from ccoll.settings import current

    # The Communicator's timeout (checked there): None is the CCOLL_TIMEOUT setting.
    seconds = current().timeout if timeout is None else timeout
    if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
            and math.isfinite(seconds) and seconds > 0):
        seconds = None  # forever (math.inf), or a bad value the Communicator refuses
    deadline = Deadline(seconds, f"creating a ccoll.torch.{what}")
    # Not agreed yet: the nonblocking forms on every rank until the agreements (a blocking
    # MPI_Comm_dup does not match MPI_Comm_idup), as ccoll.Communicator does.
    if deadline.at is None:
        deadline.at = math.inf
    comm = dup_comm(base, deadline)
    try:
        agree(comm, call, deadline)
        # Error feedback needs each rank's own quantized input, which only the homomorphic
        # ring defines (decompress-add-recompress mixes the ranks' errors); FSDP's shards
        # take the same ring.
        communicator = Communicator(comm, algorithm="homomorphic", policy=policy,
                                    timeout=timeout, split=split,
                                    ranks_per_node=ranks_per_node)
        yield_to_training()  # training runs in this process: ccoll's lanes go below it
    except BaseException:
        comm.Free()
        raise
    return comm, communicator
