"""HDF5 references in a file that ``ccoll compress`` or ``ccoll decompress`` writes anew.

An object or region reference is an address in its own file: copied as bytes into another
file it points nowhere (or at whatever lies there), and ``h5py``'s object copy writes the
references of a copied dataset as NULL. Dimension scales are references too (the
``DIMENSION_LIST`` and ``REFERENCE_LIST`` attributes). So once every object is written,
:func:`carry_references` writes every attribute and dataset that holds references again,
each reference pointing at the same path in the new file (with a region reference's
selection), where the walk wrote the object (a second name of an object is a hard link to
the first: :func:`ccoll.h5.tree.walk`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from ccoll.h5.tree import Entry

__all__ = ["has_references", "carry_references"]


def has_references(dt: np.dtype) -> bool:
    """Whether values of ``dt`` hold HDF5 references (in fields, arrays or vlen too)."""
    if h5py.check_ref_dtype(dt) is not None:
        return True
    if dt.fields:
        return any(has_references(f[0]) for f in dt.fields.values())
    if dt.subdtype is not None:
        return has_references(dt.subdtype[0])
    base = h5py.check_vlen_dtype(dt)  # str or bytes for strings, else a dtype
    return isinstance(base, np.dtype) and has_references(base)


class _Mapper:
    """References of ``fin`` turned into references of ``fout`` to the same paths."""

    def __init__(self, fin: h5py.File, fout: h5py.File, entries: Sequence[Entry]) -> None:
        self.fin, self.fout = fin, fout
        self.path: dict[Any, str] = {fin.id: "/"}
        for e in entries:
            if e.kind in ("group", "dataset", "datatype"):
                self.path[fin[e.path].id] = e.path

    def _target(self, ref: Any) -> str | None:
        """Return the path in ``fout`` of what ``ref`` points at (None: NULL, or lost)."""
        if not ref:
            return None
        try:
            obj = self.fin[ref]
        except (KeyError, OSError, ValueError):  # a dangling reference stays a NULL one
            return None
        path = self.path.get(obj.id)
        return path if path is not None and path in self.fout else None

    def one(self, ref: Any, region: bool) -> Any:
        path = self._target(ref)
        if region:
            if path is None:
                return h5py.RegionReference()
            space = h5py.h5r.get_region(ref, self.fin.id)
            return h5py.h5r.create(self.fout.id, path.encode(), h5py.h5r.DATASET_REGION,
                                   space)
        return self.fout[path].ref if path is not None else h5py.Reference()

    def value(self, v: Any, dt: np.dtype) -> Any:
        """``v`` (as ``h5py`` reads values of ``dt``) with every reference mapped."""
        kind = h5py.check_ref_dtype(dt)
        if kind is not None:
            region = kind is h5py.RegionReference
            if isinstance(v, np.ndarray):
                out = np.empty(v.shape, dtype=v.dtype)
                for i in np.ndindex(v.shape):
                    out[i] = self.one(v[i], region)
                return out
            return self.one(v, region)
        if dt.fields:
            out = np.array(v, copy=True)  # a 0-d array for one compound value
            for name, (fdt, *_) in dt.fields.items():
                if has_references(fdt):
                    out[name] = self.value(out[name], fdt)
            return out
        if dt.subdtype is not None:
            sub = dt.subdtype[0]
            arr = np.asarray(v)
            flat = arr.reshape(-1)
            mapped = np.empty(flat.shape, dtype=arr.dtype)
            for i in range(flat.size):
                mapped[i] = self.value(flat[i], sub)
            return mapped.reshape(arr.shape)
        base = h5py.check_vlen_dtype(dt)
        if base is not None:  # each element a 1-D array of base values
            if isinstance(v, np.ndarray) and v.dtype == object:
                out = np.empty(v.shape, dtype=object)
                for i in np.ndindex(v.shape):
                    out[i] = self._vlen(v[i], base)
                return out
            return self._vlen(v, base)
        return v

    def _vlen(self, seq: Any, base: np.dtype) -> np.ndarray:
        arr = np.asarray(seq, dtype=object if h5py.check_ref_dtype(base) else None)
        out = np.empty(arr.shape, dtype=arr.dtype)
        for i in np.ndindex(arr.shape):
            out[i] = self.value(arr[i], base)
        return out


def carry_references(fin: h5py.File, fout: h5py.File, entries: Sequence[Entry], *,
                     skip_prefix: str | None = None) -> int:
    """Write again, in ``fout``, every attribute and dataset of ``fin`` that holds references.

    Each is written with its own HDF5 type, every reference mapped to the same path in
    ``fout`` (NULL where the object is not there: a dataset left out as damaged, a dangling
    reference). Attributes named with ``skip_prefix`` are left alone. Objects missing from
    ``fout`` are skipped. Returns how many attributes and datasets were written.
    """
    mapper: _Mapper | None = None
    written = 0
    paths = ["/"] + [e.path for e in entries if e.kind in ("group", "dataset", "datatype")]
    for path in paths:
        if path not in fout:
            continue
        src, dst = fin[path], fout[path]
        for name in src.attrs:
            if skip_prefix is not None and name.startswith(skip_prefix):
                continue
            dt = src.attrs.get_id(name).dtype
            if not has_references(dt):
                continue
            mapper = mapper or _Mapper(fin, fout, entries)
            dst.attrs.create(name, mapper.value(src.attrs[name], dt), dtype=dt)
            written += 1
        if (isinstance(src, h5py.Dataset) and has_references(src.dtype)
                and src.shape is not None and src.size):
            mapper = mapper or _Mapper(fin, fout, entries)
            dst[()] = mapper.value(src[()], src.dtype)
            written += 1
    return written
