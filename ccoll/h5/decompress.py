"""``ccoll decompress``: restore a file written by ``ccoll compress``.

Every ccoll dataset gets back its dtype, shape and attributes (the ``ccoll_*`` ones
removed), its values within the recorded bound; a dataset that ``ccoll compress`` kept as
it was (``ccoll_stored = "raw"``) is copied with its ``ccoll_*`` attribute removed;
everything else is copied unchanged. A damaged dataset (CRC-32 mismatch, malformed stream,
attributes that disagree with the stream, a bad keep marker, unreadable HDF5 data) either
stops the run with no output (``on_error="stop"``) or
is left out of the output and listed (``on_error="skip"``).
"""

from __future__ import annotations

import math
import time
import zlib
from typing import Any

import h5py
import numpy as np

import ccoll
from ccoll.compressor.format import VERSIONS, StreamHeader, max_nbytes, parse_header
from ccoll.errors import FormatError, InputError
from ccoll.h5 import attrs as A
from ccoll.h5 import zstdframe
from ccoll.h5.output import (
    check_input,
    check_output,
    check_stop,
    copy_bytes,
    copy_member,
    ensure_room,
    h5_output,
)
from ccoll.h5.progress import bar
from ccoll.h5.refs import carry_references
from ccoll.h5.tree import tracks_order, walk

__all__ = [
    "decompress_file",
    "restore_dataset",
    "verify_dataset",
    "is_ccoll_dataset",
    "is_stream_dataset",
    "is_kept",
    "ON_ERROR_CHOICES",
]

ON_ERROR_CHOICES = ("stop", "skip")


def _attr_str(ds: h5py.Dataset, name: str) -> str:
    v = ds.attrs.get(name)
    if v is None:
        raise FormatError(f"attribute {name} is missing")
    return v.decode() if isinstance(v, bytes) else str(v)


def _plain(v: Any) -> Any:
    """Return an attribute's value as Python shows it (``[40.5, 50.0]``, not numpy's repr)."""
    return v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v


def _whole(v: Any) -> int:
    """``v`` as an int where it is a whole number (``40.5`` and ``"40"`` are not), else raise."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                             np.floating)):
        raise TypeError(v)
    i = int(v)  # ValueError/OverflowError for NaN and ±Inf
    if i != v:
        raise ValueError(v)
    return i


def attr_shape(ds: h5py.Dataset) -> tuple[int, ...]:
    """Return the ``ccoll_shape`` attribute as a tuple (``(-1,)`` if missing), else raise."""
    raw = ds.attrs.get(A.SHAPE, [-1])
    try:
        shape = tuple(_whole(d) for d in np.asarray(raw).reshape(-1).tolist())
    except (TypeError, ValueError, OverflowError):
        raise FormatError(f"attribute {A.SHAPE}={_plain(raw)!r} is not a list of whole "
                          "numbers") from None
    if len(shape) > _MAX_RANK:
        raise FormatError(f"attribute {A.SHAPE} has {len(shape)} dimensions; an HDF5 dataset "
                          f"has at most {_MAX_RANK}")
    return shape


def restored_layout(ds: h5py.Dataset, shape: tuple[int, ...]) -> dict[str, Any]:
    """``create_dataset`` arguments for the original's maximum shape and fill value.

    From the ``ccoll_maxshape`` and ``ccoll_fillvalue`` attributes, where present; raises
    :class:`FormatError` for values no dataset of ``shape`` can have.
    """
    kw: dict[str, Any] = {}
    raw = ds.attrs.get(A.MAXSHAPE)
    if raw is not None:
        try:
            dims = [int(d) for d in np.asarray(raw).reshape(-1)]
        except (TypeError, ValueError):
            raise FormatError(f"attribute {A.MAXSHAPE}={raw!r} is not a list of whole "
                              "numbers") from None
        if len(dims) != len(shape) or any(
                d != -1 and d < s for d, s in zip(dims, shape, strict=True)):
            raise FormatError(f"attribute {A.MAXSHAPE}={dims} does not fit the shape "
                              f"{list(shape)} (one entry per dimension, -1 or at least it)")
        kw["maxshape"] = tuple(None if d == -1 else d for d in dims)
    if A.FILL in ds.attrs:
        fill = np.asarray(ds.attrs[A.FILL]).reshape(-1)
        if fill.size != 1 or fill.dtype.kind != "f":
            raise FormatError(f"attribute {A.FILL}={ds.attrs[A.FILL]!r} is not one float")
        kw["fillvalue"] = fill[0]
    return kw


# Dimensions of an HDF5 dataspace at most (H5S_MAX_RANK): a shape with more cannot be written.
_MAX_RANK = 32


def _read_stream(
    ds: h5py.Dataset,
) -> tuple[np.ndarray, np.dtype, tuple[int, ...], np.dtype, int]:
    """Check a ccoll dataset's attributes and CRC-32.

    Returns (stream, dtype, shape, stream dtype, format version); raises
    :class:`FormatError` naming the first problem.
    """
    if ds.dtype != np.uint8 or ds.ndim != 1:
        raise FormatError(f"a ccoll dataset is 1-D uint8, this one is {ds.dtype} {ds.shape}")
    if A.FORMAT_VERSION not in ds.attrs:  # its other ccoll_* attributes say it is a stream
        raise FormatError(f"attribute {A.FORMAT_VERSION} is missing")
    raw = ds.attrs[A.FORMAT_VERSION]
    try:
        version = _whole(np.asarray(raw).item())  # one value, a scalar or of one element
    except (TypeError, ValueError, OverflowError):
        raise FormatError(f"attribute {A.FORMAT_VERSION}={_plain(raw)!r} is not a whole "
                          "number") from None
    if version not in VERSIONS:
        raise FormatError(
            f"stream format version {version}; this ccoll reads versions "
            f"{' and '.join(map(str, VERSIONS))}"
        )
    try:
        dtype = np.dtype(_attr_str(ds, A.DTYPE))
    except TypeError:
        raise FormatError(f"attribute {A.DTYPE}={ds.attrs[A.DTYPE]!r} is not a dtype") from None
    if dtype.kind != "f" or dtype.itemsize not in (2, 4, 8):
        raise FormatError(f"attribute {A.DTYPE}={dtype} is not float16, float32 or float64")
    shape = attr_shape(ds)
    if any(d < 0 for d in shape):
        raise FormatError(f"attribute {A.SHAPE} is missing or negative: {shape}")
    lossless = _attr_str(ds, A.LOSSLESS)
    if lossless not in A.LOSSLESS_CHOICES:
        raise FormatError(f"attribute {A.LOSSLESS}={lossless!r} is not one of {A.LOSSLESS_CHOICES}")
    _check_stored_size(ds)
    try:
        stored = np.asarray(ds[()], dtype=np.uint8).reshape(-1)
    except OSError as exc:  # HDF5 could not read the bytes (damaged chunk, filter failure)
        raise FormatError(f"HDF5 cannot read the stored bytes: {exc}") from None
    crc = ds.attrs.get(A.CRC32)
    if crc is not None:
        try:  # as the format version's attribute above
            want = int(crc)
        except (TypeError, ValueError):
            raise FormatError(f"attribute {A.CRC32}={crc!r} is not a whole number") from None
        if zlib.crc32(stored.tobytes()) != want:
            raise FormatError("stored bytes fail their CRC-32 check (the dataset was altered)")
    stream_dtype = np.dtype(np.float32) if dtype.itemsize == 2 else dtype.newbyteorder("=")
    if lossless == "zstd":
        # What the stream can be: no longer than the worst case of its shape, and no longer
        # than the frame's own bytes can regenerate. The shape is only a claim of the file;
        # the frame's size is what is actually there.
        cap = min(max_nbytes(math.prod(shape), stream_dtype, len(shape), version),
                  ZSTD_MAX_EXPANSION * stored.size)
        stored = zstdframe.unwrap(stored, cap)
    return stored, dtype, shape, stream_dtype, version


# Most bytes one stored byte of a zstd frame can regenerate: every block regenerates at
# most 128 KiB (RFC 8878, Block_Maximum_Size) and takes at least 4 bytes (a 3-byte block
# header and the one byte of an RLE block).
ZSTD_MAX_EXPANSION = (128 << 10) // 4


def _check_stored_size(ds: h5py.Dataset) -> None:
    """Refuse a dataset that declares more bytes than the file stores for it, unfiltered.

    ``ccoll compress`` writes every byte of its datasets without HDF5 filters; HDF5 gives
    the unwritten part of a dataset its fill value, so an empty dataset of any declared
    size would otherwise be read into memory whole. (A file repacked with a compression
    filter stores fewer bytes than it declares; that is allowed.)
    """
    if ds.id.get_create_plist().get_nfilters():
        return
    stored = ds.id.get_storage_size()
    if stored < ds.nbytes:
        raise FormatError(
            f"the dataset declares {ds.nbytes} bytes but stores {stored}: it was not written "
            "by ccoll compress"
        )


def _check_kind(hdr: StreamHeader, stream_dtype: np.dtype, shape: tuple[int, ...],
                version: int) -> None:
    # The element count must agree; the shape attribute is authoritative (a 0-d dataset may
    # travel as a 1-element stream).
    if hdr.dtype != stream_dtype or hdr.n != math.prod(shape):
        raise FormatError(
            f"stream holds {hdr.dtype} {hdr.shape}, attributes say {stream_dtype} {shape}"
        )
    if hdr.version != version:
        raise FormatError(
            f"stream is format version {hdr.version}, its attribute {A.FORMAT_VERSION} "
            f"says {version}"
        )


def is_ccoll_dataset(ds: h5py.Dataset) -> bool:
    """Tell whether ``ccoll compress`` wrote ``ds``: a stream, or a dataset it kept as it was."""
    return is_stream_dataset(ds) or A.STORED in ds.attrs


def is_stream_dataset(ds: h5py.Dataset) -> bool:
    """Tell whether ``ds`` is a stream ``ccoll compress`` wrote: any of a stream's attributes.

    Any one, not only ``ccoll_format_version``: a stream that lost that attribute was
    copied as its bytes, exit 0, as if it were the user's data (``ccoll_*`` attributes are
    refused on the input of ``ccoll compress``, so only ccoll writes them).
    """
    return A.STORED not in ds.attrs and any(k in ds.attrs for k in A.STREAM_ATTRS)


def is_kept(ds: h5py.Dataset) -> bool:
    """Tell whether ``ds`` was kept as it was (``ccoll_stored = "raw"``) rather than a stream.

    Raises :class:`FormatError` for a marker that is not ``"raw"`` or that comes with
    stream attributes: such a dataset is neither, and must not be copied as if it were data.
    """
    if A.STORED not in ds.attrs:
        return False
    v = ds.attrs[A.STORED]
    v = v.decode() if isinstance(v, bytes) else v
    if not isinstance(v, str) or v != A.STORED_RAW:
        raise FormatError(f"attribute {A.STORED}={v!r} is not {A.STORED_RAW!r}")
    extra = sorted(k for k in ds.attrs if k.startswith(A.PREFIX) and k != A.STORED)
    if extra:
        raise FormatError(
            f"attribute {A.STORED}={A.STORED_RAW!r} marks a dataset kept as it was, but it "
            f"also has {', '.join(extra)}"
        )
    return True


def restore_dataset(ds: h5py.Dataset) -> np.ndarray:
    """Decode one ccoll dataset to the original array; :class:`FormatError` if damaged."""
    stored, dtype, shape, stream_dtype, version = _read_stream(ds)
    _check_kind(parse_header(stored), stream_dtype, shape, version)
    y = ccoll.decompress(stored)
    return y.reshape(shape).astype(dtype, copy=False)


def verify_dataset(ds: h5py.Dataset) -> None:
    """Check one ccoll dataset without decoding it; :class:`FormatError` if damaged.

    The checks are those of :func:`restore_dataset` short of decoding the values: the
    attributes, the CRC-32 of the stored bytes, the zstd frame, and the stream's header
    (magic, version, fields, exact length) against the attributes. For a dataset kept as it
    was, the marker (:func:`is_kept`).
    """
    if is_kept(ds):
        return
    stored, _, shape, stream_dtype, version = _read_stream(ds)
    _check_kind(parse_header(stored), stream_dtype, shape, version)


def _needs_zstd(f: h5py.File) -> bool:
    for e in walk(f):
        if e.kind == "dataset":
            v = f[e.path].attrs.get(A.LOSSLESS)
            if v is not None and (v.decode() if isinstance(v, bytes) else str(v)) == "zstd":
                return True
    return False


def decompress_file(
    src: str,
    dst: str,
    *,
    force: bool = False,
    on_error: str = "stop",
    progress: bool = False,
) -> dict[str, Any]:
    """Write ``dst``: ``src`` (from ``ccoll compress``) with every ccoll dataset restored.

    Datasets that ``ccoll compress`` kept as they were are copied without their marker and
    listed in the report's ``kept``.

    With ``on_error="stop"`` the first damaged dataset raises :class:`FormatError` naming it,
    and no output is written. With ``"skip"`` damaged datasets are left out of ``dst`` and
    listed in the report's ``failed``; the caller decides the exit status.
    """
    if on_error not in ON_ERROR_CHOICES:
        raise InputError(
            f"--on-error must be one of {', '.join(ON_ERROR_CHOICES)}, got {on_error!r}"
        )
    check_input(src)
    check_output(dst, force=force, inputs=(src,))
    t0 = time.perf_counter()
    restored: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    copied = 0
    with h5py.File(src, "r") as fin:
        if A.ROOT_VERSION not in fin.attrs:
            raise InputError(
                f"{src!r} has no root attribute {A.ROOT_VERSION}: it was not written by "
                "ccoll compress"
            )
        if _needs_zstd(fin):
            zstdframe.require()
        entries = list(walk(fin))
        targets = [e for e in entries if e.kind == "dataset" and is_ccoll_dataset(fin[e.path])]
        with h5_output(dst, fin) as fout:
            A.copy_attrs(fin, fout, skip_prefix=A.PREFIX)
            with bar(len(targets), enabled=progress, desc="decompress") as pb:
                for e in entries:
                    check_stop()
                    if e.kind == "dataset" and is_ccoll_dataset(fin[e.path]):
                        ds = fin[e.path]
                        try:
                            y = None if is_kept(ds) else restore_dataset(ds)
                            layout = {} if y is None else restored_layout(ds, y.shape)
                        except FormatError as exc:
                            if on_error == "stop":
                                raise FormatError(f"dataset {e.path!r} is damaged: {exc}") from exc
                            failed.append({"path": e.path, "error": str(exc)})
                        else:
                            if y is None:  # kept as it was by ccoll compress
                                kept.append(_copy_kept(fin, ds, fout[e.parent], e.name))
                            else:
                                ensure_room(fout, y.nbytes)
                                out = fout[e.parent].create_dataset(
                                    e.name, data=y, track_order=tracks_order(ds), **layout
                                )
                                A.copy_attrs(ds, out, skip_prefix=A.PREFIX)
                                restored.append(
                                    {
                                        "path": e.path,
                                        "shape": list(y.shape),
                                        "dtype": str(y.dtype),
                                        "stored_bytes": int(ds.size),
                                        "bytes": int(y.nbytes),
                                    }
                                )
                        pb.update(1)
                    else:
                        how = copy_member(fin, fout, e)
                        copied += how == "copied"
                        if how == "missing":  # its first name was left out (on_error="skip")
                            failed.append({"path": e.path,
                                           "error": f"a second name of {e.link!r}, left out"})
            carry_references(fin, fout, entries, skip_prefix=A.PREFIX)
    return {
        "command": "decompress",
        "input": src,
        "output": dst,
        "on_error": on_error,
        "datasets": restored,
        "kept": kept,
        "failed": failed,
        "copied_unchanged": copied,
        "totals": {
            "restored": len(restored),
            "kept_raw": len(kept),
            "failed": len(failed),
            "bytes": sum(r["bytes"] for r in restored),
        },
        "seconds": time.perf_counter() - t0,
    }


def _copy_kept(fin: h5py.File, ds: h5py.Dataset, parent: h5py.Group, name: str) -> dict[str, Any]:
    """Copy a dataset kept as it was (chunks, filters and all), less its ccoll_* marker."""
    ensure_room(parent.file, copy_bytes(ds))
    fin.copy(ds, parent, name=name)
    out = parent[name]
    for k in [k for k in out.attrs if k.startswith(A.PREFIX)]:
        del out.attrs[k]
    return {
        "path": ds.name,
        "shape": list(out.shape),
        "dtype": out.dtype.name if out.dtype.isnative else out.dtype.str,
        "stored_bytes": int(out.id.get_storage_size()),
        "bytes": int(out.size * out.dtype.itemsize),
    }
