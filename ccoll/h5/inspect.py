"""``ccoll inspect``: per-dataset sizes, ratios and bounds of a raw or compressed HDF5 file."""

from __future__ import annotations

import math
import os
from typing import Any

import h5py
import numpy as np

from ccoll.h5 import attrs as A
from ccoll.h5.output import check_input
from ccoll.h5.tree import walk

__all__ = ["inspect_file"]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _record(ds: h5py.Dataset) -> dict[str, Any]:
    stored = int(ds.id.get_storage_size())
    if A.FORMAT_VERSION in ds.attrs:
        shape = [int(d) for d in np.asarray(ds.attrs.get(A.SHAPE, [])).reshape(-1)]
        dtype = np.dtype(_s(ds.attrs.get(A.DTYPE, "uint8")))
        lossless = _s(ds.attrs.get(A.LOSSLESS, "none"))
        codec = "ccoll" if lossless == "none" else f"ccoll+{lossless}"
        bound = _s(ds.attrs.get(A.BOUND, "?"))
        eb_abs: float | None = float(ds.attrs.get(A.EB_ABS, math.nan))
    else:
        shape = list(ds.shape) if ds.shape is not None else []
        dtype = ds.dtype
        codec = ds.compression or "raw"
        bound = "exact"
        eb_abs = None
    n = math.prod(shape) if ds.shape is not None else 0
    original = n * dtype.itemsize
    return {
        "path": ds.name,
        "shape": shape,
        "dtype": dtype.name if dtype.isnative else dtype.str,
        "codec": codec,
        "stored_bytes": stored,
        "original_bytes": original,
        "ratio": original / stored if stored else None,
        "bound": bound,
        "eb_abs": eb_abs,
    }


def inspect_file(path: str) -> dict[str, Any]:
    """Describe (JSON-ready) every dataset of ``path`` and the totals."""
    check_input(path)
    with h5py.File(path, "r") as f:
        version = f.attrs.get(A.ROOT_VERSION)
        records = [_record(f[e.path]) for e in walk(f) if e.kind == "dataset"]
        groups = sum(1 for e in walk(f) if e.kind == "group")
    comp = [r for r in records if r["codec"].startswith("ccoll")]

    def totals(rs: list[dict[str, Any]]) -> dict[str, Any]:
        o = sum(r["original_bytes"] for r in rs)
        s = sum(r["stored_bytes"] for r in rs)
        return {
            "datasets": len(rs),
            "original_bytes": o,
            "stored_bytes": s,
            "ratio": o / s if s else None,
        }

    return {
        "command": "inspect",
        "file": path,
        "file_bytes": os.path.getsize(path),
        "ccoll_version": _s(version) if version is not None else None,
        "groups": groups,
        "datasets": records,
        "totals": totals(records),
        "compressed_totals": totals(comp),
    }
