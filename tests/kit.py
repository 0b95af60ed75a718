"""Shared test kit: bound checks, rank agreement, clear errors.

Used by every part's tests so that "within the bound on every element", "bitwise equal on
every rank" and "clear error on bad input" mean the same thing everywhere.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
import pytest


def assert_within_bound(
    y: np.ndarray, x: np.ndarray, eb: float, *, slack_ulps: float = 0.0
) -> None:
    """Every finite ``x`` is matched within ``eb`` (plus ``slack_ulps`` of y's dtype); NaN
    stays NaN and ±Inf stays the same infinity; shape and dtype equal."""
    y = np.asarray(y)
    x = np.asarray(x)
    assert y.shape == x.shape, f"shape {y.shape} != {x.shape}"
    fin = np.isfinite(x)
    nan = np.isnan(x)
    inf = np.isinf(x)
    assert np.all(np.isnan(y[nan])), "NaN not preserved"
    assert np.array_equal(y[inf], x[inf]), "±Inf not preserved"
    if fin.any():
        xf = x[fin].astype(np.float64)
        yf = y[fin].astype(np.float64)
        err = np.abs(yf - xf)
        tol = eb
        if slack_ulps:
            tol = eb + slack_ulps * np.spacing(np.abs(y[fin])).astype(np.float64)
        bad = err > tol
        if np.any(bad):
            i = int(np.argmax(err - tol))
            raise AssertionError(
                f"{int(bad.sum())} element(s) exceed the bound {eb!r}: worst x={xf[i]!r} "
                f"y={yf[i]!r} |err|={err[i]!r}"
            )


def digest(a: Any) -> str:
    """SHA-256 of an array's bytes, dtype and shape (for bitwise comparisons across ranks)."""
    a = np.ascontiguousarray(np.asarray(a))
    h = hashlib.sha256()
    h.update(str(a.dtype).encode())
    h.update(str(a.shape).encode())
    h.update(a.view(np.uint8).tobytes() if a.size else b"")
    return h.hexdigest()


def assert_same_on_every_rank(comm: Any, a: Any) -> None:
    """The array is bitwise identical on every rank of ``comm``."""
    d = digest(a)
    all_d = comm.allgather(d)
    assert len(set(all_d)) == 1, f"ranks disagree: {all_d}"


def assert_clear_error(
    exc_type: type[BaseException], match: str, fn: Any, *args: Any, **kw: Any
) -> None:
    """``fn`` raises ``exc_type`` (a ccoll error) whose message matches ``match``."""
    from ccoll.errors import CCollError

    with pytest.raises(exc_type, match=match) as info:
        fn(*args, **kw)
    assert isinstance(info.value, CCollError), f"{type(info.value).__name__} is not a CCollError"
    assert re.search(match, str(info.value))
