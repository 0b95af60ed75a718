"""Names of the attributes that make a ccoll-compressed HDF5 file self-describing.

A compressed file has the root attribute ``ccoll_version``; each compressed dataset is a 1-D
uint8 dataset holding one ccoll stream (docs/format.md), optionally wrapped in a zstd frame,
with the attributes below next to the original dataset's own attributes. A selected dataset
whose stream would not be smaller than the dataset itself is kept as it is, marked only by
``ccoll_stored = "raw"``. docs/cli.md describes the layout.
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

__all__ = [
    "PREFIX",
    "ROOT_VERSION",
    "FORMAT_VERSION",
    "DTYPE",
    "SHAPE",
    "BOUND",
    "EB_ABS",
    "LOSSLESS",
    "CRC32",
    "STORED",
    "STORED_RAW",
    "MAXSHAPE",
    "FILL",
    "LOSSLESS_CHOICES",
    "STREAM_ATTRS",
    "copy_attrs",
]

PREFIX = "ccoll_"
ROOT_VERSION = "ccoll_version"  # root: version of ccoll that wrote the file
FORMAT_VERSION = "ccoll_format_version"  # dataset: stream format version (docs/format.md)
DTYPE = "ccoll_dtype"  # dataset: original dtype name ("float32", "float64", "float16")
SHAPE = "ccoll_shape"  # dataset: original shape, int64 array (empty for a scalar)
BOUND = "ccoll_bound"  # dataset: the bound as requested ("rel:1e-3", "abs:1e-05")
EB_ABS = "ccoll_eb_abs"  # dataset: the absolute bound it resolved to for this dataset
LOSSLESS = "ccoll_lossless"  # dataset: "none" or "zstd" (stream wrapped in a zstd frame)
CRC32 = "ccoll_crc32"  # dataset: CRC-32 of the stored bytes, to catch damage on decode
# dataset, only where the original had them: its maximum shape (-1 for an unlimited
# dimension) where that was not its shape, and its fill value (in its own dtype) where not 0
MAXSHAPE = "ccoll_maxshape"
FILL = "ccoll_fillvalue"
# dataset kept as it was (its own dtype, shape, chunks and filters; exact), because its stream
# would not have been smaller; such a dataset has no other ccoll_* attribute
STORED = "ccoll_stored"
STORED_RAW = "raw"  # the one value of STORED

LOSSLESS_CHOICES = ("none", "zstd")
# What every stream dataset carries (a kept dataset has none of them)
STREAM_ATTRS = (FORMAT_VERSION, DTYPE, SHAPE, BOUND, EB_ABS, LOSSLESS, CRC32)


def copy_attrs(src: Any, dst: Any, *, skip_prefix: str | None = None) -> None:
    """Copy every attribute of ``src`` to ``dst``, keeping each one's HDF5 type and shape.

    ``dst.attrs[k] = v`` would re-infer the type (a fixed-length string would become a
    variable-length one), so the attribute's stored dtype is passed explicitly.
    Attributes whose name starts with ``skip_prefix`` are left out.
    """
    for name in src.attrs:
        if skip_prefix is not None and name.startswith(skip_prefix):
            continue
        aid = src.attrs.get_id(name)
        tid = aid.get_type()
        if (isinstance(tid, h5py.h5t.TypeStringID) and not tid.is_variable_str()
                and aid.shape is not None):
            # A fixed-length string through numpy comes back null-padded whatever its
            # padding was: a dimension scale's null-terminated CLASS attribute then no
            # longer marks a scale. Its own HDF5 type keeps the padding and character set.
            data = np.empty(aid.shape, dtype=aid.dtype)
            aid.read(data)
            h5py.h5a.create(dst.id, name.encode("utf-8"), tid, aid.get_space()).write(data)
            continue
        dst.attrs.create(name, src.attrs[name], dtype=aid.dtype)
