"""``ccoll eval``: ccoll against SZ3 and ZFP on the datasets of an HDF5 file, bound by bound.

Each bound resolves per dataset to one absolute bound (REL: ``rel * (max - min)`` of that
dataset's finite values), and every compressor runs at that same absolute bound. Measured
per dataset and in total: compression ratio, bits per value, max |error| / bound, PSNR,
compression and decompression throughput (original MB per second, best of ``repeat`` runs).
float16 datasets are evaluated as float32 (SZ3 and ZFP do not take float16).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from ccoll.errorbound import ErrorBound, as_bound, finite_range
from ccoll.errors import ErrorBoundError, InputError
from ccoll.h5 import attrs as A
from ccoll.h5.compress import bound_label, check_format_version
from ccoll.h5.output import check_input, check_stop
from ccoll.h5.peers import PEER_NAMES, Codec, ccoll_codec, load
from ccoll.h5.progress import bar
from ccoll.h5.tree import float_datasets, read_values, select

__all__ = ["parse_bounds", "parse_peers", "parse_versions", "evaluate_file", "evaluate_array"]


def parse_bounds(spec: str) -> list[ErrorBound]:
    """``"rel:1e-2,1e-3,abs:1e-5"`` -> bounds; a bare number takes the kind before it."""
    out: list[ErrorBound] = []
    kind = None
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise ErrorBoundError(f"empty item in bound list {spec!r}")
        if ":" in item:
            kind = item.partition(":")[0].strip().lower()
            out.append(as_bound(item))
        elif kind is None:
            raise ErrorBoundError(
                f"bound list {spec!r} must start with a kind, e.g. 'rel:1e-2,1e-3' or 'abs:1e-5'"
            )
        else:
            out.append(as_bound(f"{kind}:{item}"))
    return list(dict.fromkeys(out))  # drop repeats, keep order


def parse_peers(spec: str) -> list[str]:
    """``"sz3,zfp"`` -> names; an unknown name raises :class:`InputError`."""
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in PEER_NAMES]
    if bad:
        raise InputError(f"unknown compressor(s) {bad} in --vs; known: {', '.join(PEER_NAMES)}")
    return list(dict.fromkeys(names))


def parse_versions(spec: str) -> list[int]:
    """``"1,2"`` -> stream format versions; anything else raises :class:`InputError`."""
    out: list[int] = []
    for item in (s.strip() for s in spec.split(",")):
        try:
            v = int(item)
        except ValueError:
            raise InputError(
                f"--format-version takes format versions (1, 2), comma-separated; got {spec!r}"
            ) from None
        out.append(check_format_version(v))
    return list(dict.fromkeys(out))


def _best_time(fn: Any, repeat: int) -> tuple[Any, float]:
    best = math.inf
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def _nbytes(buf: Any) -> int:
    return int(buf.nbytes) if hasattr(buf, "nbytes") else len(buf)


def evaluate_array(codec: Codec, x: np.ndarray, eb: float, repeat: int = 1) -> dict[str, Any]:
    """Run one codec on one array at absolute bound ``eb``; raw sums for the totals included."""
    buf, tc = _best_time(lambda: codec.compress(x, eb), repeat)
    y, td = _best_time(lambda: codec.decompress(buf, x), repeat)
    y = np.asarray(y)
    if y.shape != x.shape:
        raise ValueError(f"{codec.name} returned shape {y.shape} for {x.shape}")
    fin = np.isfinite(x)
    xf = x[fin].astype(np.float64)
    yf = y[fin].astype(np.float64)
    err = np.abs(yf - xf)
    max_err = float(err.max()) if err.size else 0.0
    if (
        np.isnan(max_err)
        or not np.array_equal(np.isnan(y), np.isnan(x))
        or not np.array_equal(y[np.isinf(x)], x[np.isinf(x)])
    ):
        max_err = math.inf  # a non-finite value was not preserved, or a finite one became NaN
    sse = float(np.sum(np.square(err))) if err.size else 0.0
    lo, hi = (float(xf.min()), float(xf.max())) if xf.size else (0.0, 0.0)
    stored = _nbytes(buf)
    mb = x.nbytes / 1e6
    return {
        "codec": codec.name,
        "stored_bytes": stored,
        "original_bytes": int(x.nbytes),
        "ratio": x.nbytes / stored if stored else math.inf,
        "bits_per_value": 8.0 * stored / x.size if x.size else 0.0,
        "max_abs_error": max_err,
        "max_err_over_eb": max_err / eb if eb > 0 else (0.0 if max_err == 0 else math.inf),
        "psnr_db": _psnr(hi - lo, sse, int(xf.size)),
        "compress_mbps": mb / tc if tc > 0 else math.inf,
        "decompress_mbps": mb / td if td > 0 else math.inf,
        "_sse": sse,
        "_n": int(x.size),
        "_nfinite": int(xf.size),
        "_lo": lo,
        "_hi": hi,
        "_tc": tc,
        "_td": td,
    }


def _psnr(value_range: float, sse: float, n: int) -> float:
    if n == 0 or sse == 0.0:
        return math.inf
    mse = sse / n
    if value_range <= 0.0:
        return math.nan  # one distinct value: PSNR is undefined
    return 20.0 * math.log10(value_range) - 10.0 * math.log10(mse)


def _warm_up(codecs: Sequence[Codec], dtypes: set[np.dtype]) -> None:
    # The first ccoll call per dtype loads the numba kernels; keep that out of the timings.
    rng = np.random.default_rng(0)
    for dt in dtypes:
        x = rng.standard_normal(4096).astype(dt)
        for c in codecs:
            # A codec that fails here fails on the real data too, where it is reported.
            with contextlib.suppress(Exception):
                c.decompress(c.compress(x, 1e-3), x)


def evaluate_file(
    path: str,
    bounds: Sequence[ErrorBound],
    peers: Sequence[str] = PEER_NAMES,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    repeat: int = 3,
    versions: Sequence[int] = (1,),
    progress: bool = False,
) -> dict[str, Any]:
    """Evaluate ccoll and ``peers`` on the selected floating-point datasets of ``path``.

    ccoll runs once per stream format version in ``versions`` (codec ``ccoll`` for
    version 1, ``ccoll v2`` for version 2).

    Returns a JSON-ready report: ``runs`` (one per dataset, bound and codec), ``totals``
    (one per bound and codec), ``missing`` (peers not installed), ``skipped`` (datasets
    whose bound resolves to 0, i.e. constant data, which every codec stores exactly, and
    datasets without elements) and
    ``streams`` (ccoll streams of a file ``ccoll compress`` wrote: not float data, not
    evaluated).
    """
    if not bounds:
        raise ErrorBoundError("--eb needs at least one bound")
    if repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {repeat}")
    if not versions:
        raise InputError("--format-version needs at least one version")
    codecs: list[Codec] = [ccoll_codec(check_format_version(v)) for v in dict.fromkeys(versions)]
    check_input(path)
    missing: dict[str, str] = {}
    for name in peers:
        c, why = load(name)
        if c is None:
            missing[name] = why or "not available"
        else:
            codecs.append(c)
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    with h5py.File(path, "r") as f:
        # A file ccoll compress wrote: its streams are uint8 datasets, which no codec here
        # reads; the datasets it kept as they were are evaluated, and the streams counted.
        streams = float_datasets(f, lambda ds: A.FORMAT_VERSION in ds.attrs)
        paths = select(float_datasets(f), include, exclude)
        if not paths:
            hint = (f": its {len(streams)} ccoll stream(s) are not float data; decompress "
                    "it first (ccoll decompress)" if streams else "")
            raise InputError(f"no floating-point dataset to evaluate in {path!r}{hint}")
        dtypes = {
            np.dtype(np.float32) if f[p].dtype.itemsize == 2 else f[p].dtype.newbyteorder("=")
            for p in paths
        }
        _warm_up(codecs, dtypes)
        with bar(len(paths) * len(bounds), enabled=progress, desc="eval") as pb:
            for p in paths:
                check_stop()
                x = np.ascontiguousarray(read_values(f[p]))
                x = x.astype(
                    np.float32 if x.dtype.itemsize == 2 else x.dtype.newbyteorder("="), copy=False
                )
                if x.size == 0:  # nothing to code (and zfpy dies on an empty array)
                    skipped.extend({"path": p, "bound": bound_label(b), "why": "no elements"}
                                   for b in bounds)
                    pb.update(len(bounds))
                    continue
                rng = finite_range(x)
                for b in bounds:
                    eb = b.resolve(*rng)
                    if eb <= 0.0:
                        skipped.append({"path": p, "bound": bound_label(b), "why": "constant data"})
                        pb.update(1)
                        continue
                    for c in codecs:
                        try:
                            r = evaluate_array(c, x, eb, repeat)
                        except Exception as exc:  # a peer that fails on some data is a result
                            r = {"codec": c.name, "error": f"{type(exc).__name__}: {exc}"}
                        runs.append(
                            {
                                "path": p,
                                "shape": list(x.shape),
                                "bound": bound_label(b),
                                "eb_abs": eb,
                                **r,
                            }
                        )
                    pb.update(1)
    totals = [_total(runs, bound_label(b), c.name) for b in bounds for c in codecs]
    for r in runs:
        for k in [k for k in r if k.startswith("_")]:
            del r[k]
    return {
        "command": "eval",
        "file": path,
        "bounds": [bound_label(b) for b in bounds],
        "codecs": {c.name: c.version for c in codecs},
        "missing": missing,
        "repeat": repeat,
        "runs": runs,
        "totals": totals,
        "skipped": skipped,
        "streams": streams,
    }


def _total(runs: list[dict[str, Any]], bound: str, codec: str) -> dict[str, Any]:
    rs = [r for r in runs if r["bound"] == bound and r["codec"] == codec]
    ok = [r for r in rs if "error" not in r]
    orig = sum(r["original_bytes"] for r in ok)
    stored = sum(r["stored_bytes"] for r in ok)
    n = sum(r["_n"] for r in ok)
    nfin = sum(r["_nfinite"] for r in ok)
    sse = sum(r["_sse"] for r in ok)
    lo = min((r["_lo"] for r in ok), default=0.0)
    hi = max((r["_hi"] for r in ok), default=0.0)
    tc = sum(r["_tc"] for r in ok)
    td = sum(r["_td"] for r in ok)
    return {
        "bound": bound,
        "codec": codec,
        "datasets": len(ok),
        "failed": len(rs) - len(ok),
        "original_bytes": orig,
        "stored_bytes": stored,
        "ratio": orig / stored if stored else math.nan,
        "bits_per_value": 8.0 * stored / n if n else math.nan,
        "max_err_over_eb": max((r["max_err_over_eb"] for r in ok), default=math.nan),
        "psnr_db": _psnr(hi - lo, sse, nfin),
        "compress_mbps": orig / 1e6 / tc if tc > 0 else math.nan,
        "decompress_mbps": orig / 1e6 / td if td > 0 else math.nan,
    }
