"""What the checkpointable states of ccoll.torch share: the version and the settings check."""

from __future__ import annotations

from typing import Any

from ccoll.errorbound import ABS, REL, ErrorBound
from ccoll.errors import InputError

__all__ = ["STATE_VERSION", "bound_of", "check_settings", "check_version"]

# Version of the state dicts (CCollHookState, FSDPReduceScatter); bump on a change of keys.
STATE_VERSION = 1


def bound_of(state: dict[str, Any]) -> ErrorBound:
    """Return the error bound a state dict was saved with."""
    kind, value = state["eb_kind"], float(state["eb_value"])
    if kind == "abs":
        return ABS(value)
    if kind == "rel":
        return REL(value)
    raise InputError(f"checkpoint state has error-bound kind {kind!r}; expected 'abs' or 'rel'")


def check_version(state: Any, what: str) -> None:
    """Raise :class:`ccoll.InputError` unless ``state`` is a state dict of this version."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise InputError(f"not a {what} state dict of version {STATE_VERSION} (got {got!r}): "
                         f"pass what {what}.state_dict() returned")


def check_settings(mine: dict[str, Any], state: dict[str, Any], what: str) -> None:
    """Raise :class:`ccoll.InputError` naming every setting of ``state`` that differs."""
    diff = [f"{k}: this {what} has {mine[k]!r}, the state dict {state.get(k)!r}"
            for k in mine if state.get(k) != mine[k]]
    if diff:
        raise InputError(f"the state dict was saved with other settings ({'; '.join(diff)}); "
                         f"construct the {what} with the checkpoint's settings "
                         f"({what}.from_state_dict(state))")
