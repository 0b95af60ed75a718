"""``ccoll inspect``: per-dataset sizes, ratios and bounds of a raw or compressed HDF5 file.

With ``verify`` (the command's default) every ccoll dataset is also checked as
``ccoll decompress`` would check it, short of decoding: attributes, the CRC-32 of the stored
bytes, the zstd frame and the stream header. Damaged datasets are listed in ``damaged``.
A dataset that ``ccoll compress`` kept as it was (its stream would not have been smaller)
is listed as the exact data it is, with ``kept_raw`` set; verifying checks its marker.
"""

from __future__ import annotations

import math
import os
from typing import Any

import h5py
import numpy as np

from ccoll.errors import FormatError, InputError
from ccoll.h5 import attrs as A
from ccoll.h5.decompress import attr_shape, is_kept, is_stream_dataset, verify_dataset
from ccoll.h5.output import check_input
from ccoll.h5.tree import walk

__all__ = ["inspect_file"]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _record(ds: h5py.Dataset, verify: bool) -> dict[str, Any]:
    stored = int(ds.id.get_storage_size())
    damage: str | None = None
    kept = A.STORED in ds.attrs
    if kept and verify:
        try:
            is_kept(ds)
        except FormatError as exc:
            damage = str(exc)
    if is_stream_dataset(ds):
        if verify:
            try:
                verify_dataset(ds)
            except FormatError as exc:
                damage = str(exc)
            except InputError as exc:  # zstandard missing: verifying needs it, listing does not
                raise InputError(
                    f"cannot verify {ds.name}: {exc}; pass --no-verify to list without checking"
                ) from None
        try:
            shape = list(attr_shape(ds)) if A.SHAPE in ds.attrs else []
        except FormatError as exc:  # listed as damaged, with the rest of the file
            shape, damage = [], damage or str(exc)
        try:
            dtype = np.dtype(_s(ds.attrs.get(A.DTYPE, "uint8")))
        except TypeError:
            dtype = np.dtype(np.uint8)
            damage = damage or f"attribute {A.DTYPE}={ds.attrs[A.DTYPE]!r} is not a dtype"
        lossless = _s(ds.attrs.get(A.LOSSLESS, "none"))
        version: int | None = _int_or_none(ds.attrs.get(A.FORMAT_VERSION))
        codec = "ccoll" if version == 1 else f"ccoll v{'?' if version is None else version}"
        if lossless != "none":
            codec += f"+{lossless}"
        bound = _s(ds.attrs.get(A.BOUND, "?"))
        try:
            eb_abs: float | None = float(ds.attrs.get(A.EB_ABS, math.nan))
        except (TypeError, ValueError):
            eb_abs = math.nan
            damage = damage or f"attribute {A.EB_ABS}={ds.attrs[A.EB_ABS]!r} is not a number"
    else:
        shape = list(ds.shape) if ds.shape is not None else []
        dtype = ds.dtype
        codec = ds.compression or "raw"
        bound = "exact"
        eb_abs = None
        version = None
    n = math.prod(shape) if ds.shape is not None else 0
    original = n * dtype.itemsize
    return {
        "path": ds.name,
        "shape": shape,
        "dtype": dtype.name if dtype.isnative else dtype.str,
        "codec": codec,
        "format_version": version,  # None: not a ccoll dataset
        "stored_bytes": stored,
        "original_bytes": original,
        "ratio": original / stored if stored else None,
        "bound": bound,
        "eb_abs": eb_abs,
        "kept_raw": kept,  # kept as it was by ccoll compress: exact
        # None: not checked (a raw dataset, or --no-verify)
        "verified": (damage is None) if verify and (kept or codec.startswith("ccoll")) else None,
        "damage": damage,
    }


def inspect_file(path: str, *, verify: bool = True) -> dict[str, Any]:
    """Describe (JSON-ready) every dataset of ``path`` and the totals.

    With ``verify`` each ccoll dataset is checked (module docstring); the damaged ones are
    listed in ``damaged`` as ``{"path", "error"}``. The caller decides the exit status.
    """
    check_input(path)
    with h5py.File(path, "r") as f:
        version = f.attrs.get(A.ROOT_VERSION)
        records = [_record(f[e.path], verify) for e in walk(f) if e.kind == "dataset"]
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
        "kept_raw": sum(r["kept_raw"] for r in records),
        "verify": verify,
        "damaged": [{"path": r["path"], "error": r["damage"]} for r in records if r["damage"]],
    }
