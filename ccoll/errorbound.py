"""Error-bound types: :class:`ABS` (absolute) and :class:`REL` (relative to the value range).

A bound resolves to one absolute number ``eb`` before compression: ``ABS(v)`` is ``v``;
``REL(v)`` is ``v * (max - min)`` over the finite values of the data (in the collectives,
over the global range of every rank's data). See docs/error-bound.md.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import SupportsFloat

import numpy as np

from ccoll.errors import ErrorBoundError

__all__ = ["ABS", "REL", "ErrorBound", "as_bound", "finite_range"]


class ErrorBound:
    """Base class of error bounds; ``value`` is a finite positive float.

    A bound is a value, like a number: it cannot change once made (``value`` cannot be
    set; a call that should use another bound passes a new one). Collectives compare
    bounds by kind and value, and a bound may be a dict key.
    """

    __slots__ = ("value",)
    value: float
    kind: str = ""

    def __init__(self, value: SupportsFloat) -> None:
        if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)
        ):
            raise ErrorBoundError(
                f"{type(self).__name__} bound must be a real number, got {type(value).__name__}"
            )
        try:
            v = float(value)
        except OverflowError:  # an int beyond float64's range
            raise ErrorBoundError(
                f"{type(self).__name__} bound must be finite and > 0, got an integer of "
                f"{len(str(abs(int(value))))} digits, beyond float64's range"
            ) from None
        if not math.isfinite(v) or v <= 0.0:
            raise ErrorBoundError(
                f"{type(self).__name__} bound must be finite and > 0, got {value!r}"
            )
        object.__setattr__(self, "value", v)

    def __setattr__(self, name: str, value: object) -> None:
        raise ErrorBoundError(
            f"{self!r} cannot change ({name} = {value!r}): pass a new bound, "
            f"ccoll.{type(self).__name__}(...)"
        )

    def __delattr__(self, name: str) -> None:
        raise ErrorBoundError(f"{self!r} cannot change (del {name})")

    def __reduce__(self) -> tuple[type, tuple[float]]:
        return type(self), (self.value,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.value == other.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.value))

    def resolve(self, lo: float, hi: float) -> float:
        """Absolute bound for data whose finite values span ``[lo, hi]``."""
        raise NotImplementedError


class ABS(ErrorBound):
    """Absolute bound: every finite element is reconstructed within ``value``."""

    __slots__ = ()
    kind = "abs"

    def resolve(self, lo: float, hi: float) -> float:
        """Return ``value``; the data range does not matter."""
        return self.value


class REL(ErrorBound):
    """Relative bound: ``value * (max - min)`` of the finite values.

    Constant (or empty, or all non-finite) data has a range of 0 and resolves to an absolute
    bound of 0, which ccoll stores losslessly.
    """

    __slots__ = ()
    kind = "rel"

    def resolve(self, lo: float, hi: float) -> float:
        """Return ``value * (hi - lo)`` (0 for an empty or constant range)."""
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
            return 0.0
        eb = self.value * (hi - lo)
        if not math.isfinite(eb):
            # The range itself overflowed float64; fall back to the largest finite bound.
            eb = self.value * (hi / 2 - lo / 2) * 2
        eb = eb if math.isfinite(eb) else float(np.finfo(np.float64).max)
        # The subtraction and the product each round to nearest, so eb may lie an ulp or two
        # above the real value * (hi - lo) that the contract promises; step down until it does
        # not (docs/error-bound.md, "Resolving REL").
        exact = Fraction(self.value) * (Fraction(hi) - Fraction(lo))
        while eb > 0 and Fraction(eb) > exact:
            eb = math.nextafter(eb, 0.0)
        return eb


def as_bound(eb: object) -> ErrorBound:
    """Turn ``ABS``/``REL``, a float (absolute) or ``"rel:1e-3"``/``"abs:1e-5"`` into a bound."""
    if isinstance(eb, ErrorBound):
        return eb
    if isinstance(eb, str):
        kind, sep, num = eb.partition(":")
        if not sep:
            raise ErrorBoundError(
                f"bound string must look like 'rel:1e-3' or 'abs:1e-5', got {eb!r}"
            )
        try:
            v = float(num)
        except ValueError:
            raise ErrorBoundError(f"bound value {num!r} in {eb!r} is not a number") from None
        k = kind.strip().lower()
        if k not in ("rel", "abs"):
            raise ErrorBoundError(f"bound kind must be 'rel' or 'abs', got {kind!r}")
        mantissa = num.strip().lower().partition("e")[0]
        if v == 0.0 and any(c in "123456789" for c in mantissa):  # 'abs:1e-400' reads as 0
            raise ErrorBoundError(f"bound value {num.strip()!r} in {eb!r} is below the "
                                  "smallest float64 and reads as 0; it must be > 0")
        return REL(v) if k == "rel" else ABS(v)
    if isinstance(eb, (int, float, np.integer, np.floating)) and not isinstance(eb, bool):
        return ABS(eb)
    raise ErrorBoundError(f"expected ccoll.ABS, ccoll.REL, a float or 'rel:…'/'abs:…', got {eb!r}")


def finite_range(x: np.ndarray) -> tuple[float, float]:
    """Min and max of the finite values of a host array, as floats; ``(inf, -inf)`` if none."""
    if x.size == 0:
        return math.inf, -math.inf
    flat = x.reshape(-1)
    lo = float(np.min(flat))
    hi = float(np.max(flat))
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    fin = flat[np.isfinite(flat)]
    if fin.size == 0:
        return math.inf, -math.inf
    return float(fin.min()), float(fin.max())
