"""``ccoll compress``: an HDF5 file with its floating-point datasets replaced by ccoll streams.

Groups, attributes, links and every dataset that is not selected (or not floating point)
are copied unchanged. Each selected dataset becomes a 1-D uint8 dataset at the same path
holding one ccoll stream, with the attributes of :mod:`ccoll.h5.attrs`. A REL bound resolves
per dataset: ``rel * (max - min)`` over that dataset's finite values (docs/cli.md).

A stream has a fixed cost (a 64-byte header, the shape, the block bitmap: docs/format.md),
so a dataset of a few elements would grow. As HDF5 does with its own optional filters, a
dataset whose stored stream (or zstd frame) would take at least as many bytes as keeping
the dataset as it is, is kept as it is (exact), marked ``ccoll_stored = "raw"``, unless
``always_stream`` is set.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

import ccoll
from ccoll.compressor.format import VERSIONS
from ccoll.errorbound import ErrorBound, as_bound, finite_range
from ccoll.errors import InputError
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
from ccoll.h5.tree import float_datasets, read_values, select, tracks_order, walk

__all__ = ["compress_file", "compress_array", "bound_label", "check_format_version"]

def check_format_version(version: int) -> int:
    """Return ``version`` if it is a stream format version (``format.VERSIONS``), else InputError.

    Version 1 is the default; version 2 codes the same quantized values (so the same decoded
    values and bound) in fewer bytes, slower to write and read (docs/format.md).
    """
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) \
            or int(version) not in VERSIONS:
        raise InputError(
            f"format version must be one of {', '.join(map(str, VERSIONS))}, "
            f"got {version!r}"
        )
    return int(version)


def bound_label(bound: ErrorBound) -> str:
    """Write the bound as the command line does: ``rel:0.001``, ``abs:1e-05``."""
    return f"{bound.kind}:{bound.value!r}"


def compress_array(
    x: np.ndarray, bound: ErrorBound, version: int = 1
) -> tuple[np.ndarray, float]:
    """Compress one host array; returns the stream and the absolute bound it guarantees.

    ``version``: the stream format version (1 or 2) written.

    Every dtype goes to :func:`ccoll.compress` as it is. float32/float64: the guarantee is
    the stream's own bound. float16: ``ccoll.compress`` compresses its exact float32 copy
    with what the rounding back to float16 leaves of the bound (its one rule for
    float16/bfloat16, :func:`ccoll.compressor.precision.stage_bound`), so the float16
    values ``ccoll decompress`` writes are within the resolved bound itself, which is what
    this returns.
    """
    from ccoll.compressor import header

    x = np.asarray(x, order="C")
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    stream = ccoll.compress(x, bound, version=version)
    if x.dtype == np.float16:
        return stream, bound.resolve(*finite_range(x))
    return stream, float(header(stream).eb)


def _dtype_label(dt: np.dtype) -> str:
    # Native byte order gets the readable name; a foreign one keeps its explicit code (">f4").
    return dt.name if dt.isnative else dt.str


def compress_file(
    src: str,
    dst: str,
    eb: Any,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    lossless: str = "none",
    version: int = 1,
    always_stream: bool = False,
    force: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Write ``dst``: ``src`` with its selected floating-point datasets compressed.

    ``version``: the stream format version of every dataset written (1 or 2);
    ``ccoll decompress`` reads either. A selected dataset whose stream would not be
    smaller than the dataset is kept as it is (module docstring), unless
    ``always_stream``.

    Returns a JSON-ready report (one record per selected dataset, its ``stored_as``
    ``"stream"`` or ``"raw"``; totals over them, with ``compressed`` streams and
    ``kept_raw`` datasets). Raises
    :class:`InputError`, ``FileNotFoundError`` or ``FileExistsError`` for unusable input,
    :class:`ccoll.ErrorBoundError` for a bad bound; ``dst`` is never left half-written.
    """
    bound = as_bound(eb)
    version = check_format_version(version)
    if lossless not in A.LOSSLESS_CHOICES:
        raise InputError(
            f"--lossless must be one of {', '.join(A.LOSSLESS_CHOICES)}, got {lossless!r}"
        )
    if lossless == "zstd":
        zstdframe.require()
    check_input(src)
    check_output(dst, force=force, inputs=(src,))
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    copied = 0
    with h5py.File(src, "r") as fin:
        if A.ROOT_VERSION in fin.attrs:
            raise InputError(
                f"{src!r} was already written by ccoll compress (root attribute "
                f"{A.ROOT_VERSION}); decompress it first"
            )
        floats = float_datasets(fin)
        chosen = set(select(floats, include, exclude))
        if not chosen:
            raise InputError(
                f"no floating-point dataset to compress in {src!r}"
                + (" after --include/--exclude" if (include or exclude) else "")
            )
        entries = list(walk(fin))
        _check_reserved(fin, entries)
        with h5_output(dst, fin) as fout:
            A.copy_attrs(fin, fout)
            fout.attrs[A.ROOT_VERSION] = ccoll.__version__
            with bar(len(chosen), enabled=progress, desc="compress") as pb:
                for e in entries:
                    check_stop()
                    if e.kind == "dataset" and e.path in chosen:
                        pb.set_postfix_str(e.path[-40:], refresh=False)
                        records.append(
                            _compress_dataset(
                                fin[e.path], fout[e.parent], e.name, bound, lossless, version,
                                always_stream,
                            )
                        )
                        pb.update(1)
                    elif copy_member(fin, fout, e) == "copied":
                        copied += 1
            carry_references(fin, fout, entries)
    orig = sum(r["original_bytes"] for r in records)
    stored = sum(r["stored_bytes"] for r in records)
    kept = sum(r["stored_as"] == "raw" for r in records)
    return {
        "command": "compress",
        "input": src,
        "output": dst,
        "bound": bound_label(bound),
        "lossless": lossless,
        "format_version": version,
        "always_stream": always_stream,
        "datasets": records,
        "copied_unchanged": copied,
        "totals": {
            "compressed": len(records) - kept,
            "kept_raw": kept,
            "original_bytes": orig,
            "stored_bytes": stored,
            "ratio": orig / stored if stored else None,
        },
        "seconds": time.perf_counter() - t0,
    }


def _check_reserved(fin: h5py.File, entries: list[Any]) -> None:
    """Refuse ``ccoll_`` attributes where decompress would drop or misread them.

    The root's are dropped by decompress (they mark a compressed file), a dataset's make
    it read as one of ccoll's streams; a group's come back as they were.
    """
    clash = [k for k in fin.attrs if k.startswith(A.PREFIX)]
    where = "the file's root"
    if not clash:
        for e in entries:
            if e.kind == "dataset":
                clash = [k for k in fin[e.path].attrs if k.startswith(A.PREFIX)]
                if clash:
                    where = f"dataset {e.path!r}"
                    break
    if clash:
        raise InputError(f"{where} has attribute(s) {clash} whose prefix {A.PREFIX!r} ccoll "
                         "reserves; rename them before compressing")


def _compress_dataset(
    ds: h5py.Dataset, parent: h5py.Group, name: str, bound: ErrorBound, lossless: str,
    version: int, always_stream: bool,
) -> dict[str, Any]:
    clash = [k for k in ds.attrs if k.startswith(A.PREFIX)]
    if clash:
        raise InputError(
            f"dataset {ds.name!r} has attribute(s) {clash} whose prefix {A.PREFIX!r} ccoll "
            "reserves; rename them before compressing"
        )
    x = read_values(ds)
    stream, eb_abs = compress_array(x, bound, version)
    stored = zstdframe.wrap(stream) if lossless == "zstd" else stream
    orig = int(x.nbytes)
    record = {
        "path": ds.name,
        "shape": list(ds.shape),
        "dtype": _dtype_label(ds.dtype),
        "original_bytes": orig,
        "stream_bytes": int(stream.size),
    }
    # Keeping the dataset as it is takes its data's bytes, or fewer where the input stores
    # it through an HDF5 compression filter (or never wrote it).
    as_is = min(orig, int(ds.id.get_storage_size()))
    if not always_stream and stored.size >= as_is:
        ensure_room(parent.file, copy_bytes(ds))
        ds.file.copy(ds, parent, name=name)  # dtype, shape, chunks, filters and attributes
        out = parent[name]
        out.attrs[A.STORED] = A.STORED_RAW
        kept = int(out.id.get_storage_size())
        return {
            **record,
            "stored_as": "raw",
            "stored_bytes": kept,
            "ratio": orig / kept if kept else math.nan,
            "eb_abs": 0.0,
        }
    ensure_room(parent.file, stored.size)
    out = parent.create_dataset(name, data=stored, track_order=tracks_order(ds))
    A.copy_attrs(ds, out)
    out.attrs[A.FORMAT_VERSION] = np.int64(version)
    out.attrs[A.DTYPE] = _dtype_label(ds.dtype)
    out.attrs[A.SHAPE] = np.asarray(ds.shape, dtype=np.int64)
    out.attrs[A.BOUND] = bound_label(bound)
    out.attrs[A.EB_ABS] = np.float64(eb_abs)
    out.attrs[A.LOSSLESS] = lossless
    out.attrs[A.CRC32] = np.int64(zlib.crc32(stored.tobytes()))
    # What a restored dataset needs to stay appendable and read its unwritten parts as
    # before (the stream's own dataset has neither).
    if ds.maxshape is not None and ds.maxshape != ds.shape:
        out.attrs[A.MAXSHAPE] = np.asarray([-1 if m is None else m for m in ds.maxshape],
                                           dtype=np.int64)
    fill = np.asarray(ds.fillvalue, dtype=ds.dtype)
    if fill.tobytes() != bytes(fill.nbytes):
        out.attrs.create(A.FILL, fill, dtype=ds.dtype)
    return {
        **record,
        "stored_as": "stream",
        "stored_bytes": int(stored.size),
        "ratio": orig / stored.size if stored.size else math.nan,
        "eb_abs": eb_abs,
    }
