"""Shared test kit: bound checks, rank agreement, clear errors.

Used by every part's tests so that "within the bound on every element", "bitwise equal on
every rank" and "clear error on bad input" mean the same thing everywhere. Bounds are
decided exactly (float64 only filters, Fractions decide the close calls) and computed by
the tests from the data (:func:`rel_bound`), never taken from the code under test.
"""

from __future__ import annotations

import hashlib
import re
from fractions import Fraction
from typing import Any

import numpy as np
import pytest


class ExactSum:
    """A reference value known exactly: ``scale`` times the real sum of ``terms`` along axis 0.

    ``terms`` holds float values (every rank's input, converted to float64 exactly); nothing
    is rounded until a comparison needs it. ``approx`` is the float64 sum, ``err`` an upper
    bound on its distance from the exact value, ``exact(i)`` the exact value of flat
    element ``i`` (a Fraction). Slicing and ``ravel`` act on the element axes.
    """

    def __init__(self, terms: Any, scale: Fraction | int = 1) -> None:
        self.terms = np.asarray(terms, dtype=np.float64)
        assert self.terms.ndim >= 1, "terms need a leading axis to sum over"
        self.scale = Fraction(scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.terms.shape[1:]

    def __getitem__(self, idx: Any) -> ExactSum:
        if not isinstance(idx, tuple):
            idx = (idx,)
        return ExactSum(self.terms[(slice(None), *idx)], self.scale)

    def ravel(self) -> ExactSum:
        return ExactSum(self.terms.reshape(self.terms.shape[0], -1), self.scale)

    def __truediv__(self, n: int) -> ExactSum:
        return ExactSum(self.terms, self.scale / n)

    def approx(self) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.sum(self.terms, axis=0) * float(self.scale)

    def err(self) -> np.ndarray:
        # Recursive float64 summation of k terms is within (k - 1) 2^-53 sum|t| of the exact
        # sum (Higham, Accuracy and Stability, 4.2), the scaling adds one more rounding of
        # 2^-53 relative; (k + 2) 2^-51 is four times that, which also covers the rounding
        # of this estimate itself. 2^-1070 covers subnormal results.
        k = self.terms.shape[0]
        with np.errstate(all="ignore"):
            mag = np.sum(np.abs(self.terms), axis=0) * abs(float(self.scale))
        return (k + 2) * 2.0**-51 * mag + 2.0**-1070

    def exact(self, i: int) -> Fraction:
        col = self.terms.reshape(self.terms.shape[0], -1)[:, i]
        return self.scale * sum((Fraction(float(t)) for t in col), Fraction(0))


def _up(v: np.ndarray) -> np.ndarray:
    return np.nextafter(v, np.inf)


def _down(v: np.ndarray) -> np.ndarray:
    return np.nextafter(v, -np.inf)


def assert_within(
    y: Any,
    x: Any,
    eb: float | Fraction,
    *,
    strict: bool = False,
    roundings: int = 0,
    extra: Any = 0.0,
    spacing: Any = None,
) -> None:
    """Every finite element of ``x`` is matched by ``y`` within the allowance, decided exactly.

    The allowance is ``eb + roundings * s / 2 + extra``, where ``s`` is the spacing of y's
    dtype at ``|y|`` (np.spacing, the larger of the two gaps around ``y``), so ``roundings=1``
    allows one rounding of the result to its dtype. ``eb`` is a real number (float or
    Fraction, taken exactly); ``extra`` a float64 scalar or per-element array (taken
    exactly); ``spacing`` replaces ``s`` for dtypes numpy lacks (bfloat16). ``strict`` asks
    for ``<`` instead of ``<=``. ``x`` is an array (any float dtype; compared exactly) or an
    :class:`ExactSum`. NaN in ``x`` must be NaN in ``y``, ±Inf the same infinity.

    Why this is exact: float64 arithmetic only filters. Each float64 operation rounds to
    nearest, so ``nextafter(fl(r), +inf) >= r >= nextafter(fl(r), -inf)`` for the exact
    result ``r`` of one operation; chaining these gives for every element a float64 interval
    that contains the true ``|y - x|`` and one that contains the true allowance. Where the
    intervals decide the comparison it is decided; every other element is compared in
    ``fractions.Fraction``.
    """
    y = np.asarray(y)
    ref = x if isinstance(x, ExactSum) else None
    if ref is None:
        x = np.asarray(x)
        assert x.dtype.kind == "f", f"reference dtype {x.dtype} is not a float dtype"
        xa = x.astype(np.float64)
        xerr = np.zeros(xa.shape)
    else:
        xa, xerr = ref.approx(), ref.err()
    assert y.shape == xa.shape, f"shape {y.shape} != {xa.shape}"
    nan, inf = np.isnan(xa), np.isinf(xa)
    assert np.all(np.isnan(y[nan])), "NaN not preserved"
    assert np.array_equal(y[inf], xa[inf]), "±Inf not preserved"
    fin = np.flatnonzero(~nan & ~inf)
    if fin.size == 0:
        return
    yv = y.reshape(-1)[fin]
    yf = yv.astype(np.float64)
    assert np.all(np.isfinite(yf)), (
        f"non-finite result for a finite reference at flat index {fin[~np.isfinite(yf)][:5]}")
    xf, ef = xa.reshape(-1)[fin], xerr.reshape(-1)[fin]
    if spacing is None:
        with np.errstate(over="ignore"):
            ay = np.abs(yv)
            sp = np.spacing(ay)
        top = ~np.isfinite(sp)  # the largest finite value: the gap below it
        sp[top] = ay[top] - np.nextafter(ay[top], ay.dtype.type(0))
        sp = sp.astype(np.float64)
    else:
        sp = np.asarray(spacing, np.float64).reshape(-1)[fin]
    ex = np.broadcast_to(np.asarray(extra, np.float64), y.shape).reshape(-1)[fin]
    assert np.all(ex >= 0) and np.all(sp >= 0) and roundings >= 0 and eb >= 0
    ebq = Fraction(eb) if isinstance(eb, Fraction) else Fraction(float(eb))
    with np.errstate(all="ignore"):
        d = np.abs(yf - xf)
        d_hi = _up(_up(d) + ef)
        d_lo = np.maximum(_down(_down(d) - ef), 0.0)
        s = sp * (roundings / 2)
        e64 = float(ebq)
        t_hi = _up(_up(_up(e64) + _up(s)) + ex)
        t_lo = _down(_down(_down(e64) + np.maximum(_down(s), 0.0)) + ex)
    if strict:
        ok, bad = d_hi < t_lo, d_lo >= t_hi
    else:
        ok, bad = d_hi <= t_lo, d_lo > t_hi
    undecided = np.flatnonzero(~ok & ~bad)
    for j in undecided:
        xq = ref.exact(int(fin[j])) if ref is not None else Fraction(float(xf[j]))
        dq = abs(Fraction(float(yf[j])) - xq)
        tq = ebq + roundings * Fraction(float(sp[j])) / 2 + Fraction(float(ex[j]))
        bad[j] = dq >= tq if strict else dq > tq
    if np.any(bad):
        worst = int(np.argmax(np.where(bad, d - t_hi, -np.inf)))
        raise AssertionError(
            f"{int(bad.sum())} of {fin.size} element(s) exceed the bound "
            f"{'<' if strict else '<='} {float(ebq)!r} (+{roundings} half spacing(s) of "
            f"{y.dtype}, +extra): worst at flat index {int(fin[worst])}: x~{xf[worst]!r} "
            f"y={yf[worst]!r} |y-x|~{d[worst]!r} allowed~{t_lo[worst]!r}"
        )


def assert_within_bound(
    y: np.ndarray, x: Any, eb: float | Fraction, *, slack_ulps: float = 0.0
) -> None:
    """:func:`assert_within` with ``slack_ulps`` whole spacings of y's dtype."""
    roundings = 2 * slack_ulps
    assert roundings == int(roundings), "slack_ulps must be a multiple of 1/2"
    assert_within(y, x, eb, roundings=int(roundings))


def rel_bound(rel: float, *arrays: Any) -> Fraction:
    """``rel * (max - min)`` over the finite values of ``arrays``, exactly (0 if none)."""
    vals = [np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays]
    fin = np.concatenate(vals) if vals else np.zeros(0)
    fin = fin[np.isfinite(fin)]
    if fin.size == 0:
        return Fraction(0)
    return Fraction(float(rel)) * (Fraction(float(fin.max())) - Fraction(float(fin.min())))


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


# Shapes of data that break codecs, for the random tests (tests/mpi/test_random_calls.py,
# tests/cuda/test_cuda_random.py).
EDGE_SHAPES = ("normal", "mixed", "spiky", "const", "subnormal", "nearmax", "nonfinite",
               "signed zeros", "ints")


def edge_data(rng: np.random.Generator, shape: str, n: int, dtype: Any, *,
              top: float | None = None) -> np.ndarray:
    """``n`` values of ``dtype`` of one of :data:`EDGE_SHAPES`, drawn from ``rng``.

    Scales reach far into the dtype's range (``10**±20`` for float64, ``10**±12`` for
    float32, ``10**±3`` for float16); "mixed" spreads 18 decades over one array, "spiky"
    puts lone values a million times the scale among zeros, "nearmax" draws around a
    quarter of ``top`` (default: the dtype's largest; values beyond it become ±Inf),
    "nonfinite" puts NaN and ±Inf among normal values. ``top`` also clips every finite
    value to ``[-top, top]`` (so that sums stay finite).
    """
    fi = np.finfo(dtype)
    decades = {2: 3, 4: 12, 8: 20}[np.dtype(dtype).itemsize]
    scale = 10.0 ** rng.uniform(-decades, decades)
    big = float(fi.max) if top is None else float(top)
    with np.errstate(all="ignore"):
        if shape == "normal" or shape == "nonfinite":
            x = rng.standard_normal(n) * scale
        elif shape == "mixed":
            x = rng.standard_normal(n) * scale * 10.0 ** rng.integers(-9, 10, n)
        elif shape == "spiky":
            x = np.zeros(n)
            k = max(1, n // 100)
            if n:
                x[rng.integers(0, n, k)] = rng.standard_normal(k) * scale * 1e6
        elif shape == "const":
            x = np.full(n, scale)
        elif shape == "subnormal":
            x = rng.standard_normal(n) * float(fi.tiny) * rng.uniform(1e-3, 100)
        elif shape == "nearmax":
            x = rng.standard_normal(n) * big / 4
        elif shape == "signed zeros":
            x = np.where(rng.random(n) < 0.5, -0.0, 0.0) + (rng.random(n) < 0.05) * scale
        elif shape == "ints":
            x = rng.integers(-50, 50, n).astype(np.float64) * scale
        else:
            raise ValueError(f"unknown shape {shape!r}")
        if top is not None:
            x = np.clip(x, -top, top)
        if shape == "nonfinite" and n:
            at = rng.integers(0, n, max(1, n // 50))
            x[at] = rng.choice([np.nan, np.inf, -np.inf], at.size)
        return x.astype(dtype)


def first_plan(count: int, itemsize: int, ranks: int, p: Any, ratio: float,
               width: float = 3.0, *, hier: tuple[int, int] | None = None,
               algorithm: str = "homomorphic", collective: str = "allreduce",
               policy: str = "auto", split: float | None = None,
               schedule: str = "auto") -> Any:
    """The plan of the first call of a signature, with ``ratio`` and ``width`` sampled.

    The same arithmetic every rank runs after the agreement
    (:class:`ccoll.collectives.policy.plan.Planner`), from the model constants ``p``.
    """
    from ccoll.collectives.policy.plan import Facts, Options, Planner

    planner = Planner(p, Options(None, split, schedule, hier), 0)
    f = Facts(collective, count, itemsize, policy, algorithm, False, False, False, False,
              ranks)
    st = planner.state(("first",), f)
    return planner.plan(st, f, ratio=ratio, width=width)


def load_example(name: str) -> Any:
    """Import ``examples/<name>.py`` as a module (its folder on ``sys.path``, as when run)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "examples"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"example_{name}", folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def decoded_dtypes(h: Any) -> tuple[str, ...]:
    """Names of the dtypes ``decompress(buf)`` may return for a stream of header ``h``.

    The header's dtype, or the source dtype it records (byte 7): float16, or bfloat16,
    which numpy holds only with ml_dtypes (else float32 for a numpy stream).
    """
    return {None: (h.dtype.name,), "float16": ("float16",),
            "bfloat16": ("bfloat16", "float32")}[h.source_dtype]


def assert_failed_load_closes(monkeypatch: Any, cls: Any, state: dict[str, Any],
                              match: str) -> None:
    """``cls.from_state_dict(state)`` fails (``InputError`` matching ``match``) and closes
    the object it made: its communicators were left to the garbage collector."""
    from ccoll.errors import InputError

    closed: list[Any] = []
    real_close = cls.close
    monkeypatch.setattr(cls, "close", lambda self: (closed.append(self), real_close(self))[1])
    assert_clear_error(InputError, match, cls.from_state_dict, state)
    assert len(closed) == 1 and not closed[0]._finalizer.alive

