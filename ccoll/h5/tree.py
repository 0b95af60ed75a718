"""Walking an HDF5 file and choosing the datasets to work on.

Patterns are shell-style (``fnmatch``, case-sensitive) and match the full HDF5 path of a
dataset, which starts with ``/`` (``/step_0000/fc.weight``). A pattern without a leading
``/`` is matched against the path without it, so ``step_*/fc.*`` and ``/step_*/fc.*`` mean
the same. ``*`` also matches ``/``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from ccoll.errors import FormatError, InputError

__all__ = [
    "Entry",
    "walk",
    "float_datasets",
    "select",
    "is_float_dataset",
    "matches",
    "tracks_order",
]

# Item sizes of the IEEE floats ccoll compresses (either byte order); float16 is upcast to
# float32 (docs/cli.md says how). Wider types (long double) are copied unchanged.
FLOAT_ITEMSIZES = (2, 4, 8)


@dataclass(frozen=True)
class Entry:
    """One member of a group: a group, a dataset, a named datatype, or a link.

    Links are soft, external, or a second name of an object already walked
    (``"hardlink"``).
    """

    path: str
    kind: str  # "group" | "dataset" | "datatype" | "softlink" | "extlink" | "hardlink"
    parent: str
    name: str
    # The h5py link object for "softlink" and "extlink"; for "hardlink" the path under
    # which the walk first met the object.
    link: Any = None


def walk(f: h5py.File) -> Iterator[Entry]:
    """Every member of the file, parents before children, in h5py's (name) order.

    An object that HDF5 hard links put under several names (a dataset in two groups, a
    group that contains itself) is walked once, at the first name met; every later name
    is a ``"hardlink"`` entry to that path, as ``h5repack`` keeps them. Without that a
    dataset came back as two independent copies and a group inside itself recursed until
    Python's limit.
    """
    first: dict[Any, str] = {f.id: "/"}  # object -> the path it was first walked at
    # Depth first without recursion: a file may nest groups deeper than Python's stack.
    stack: list[tuple[h5py.Group, str, Iterator[str]]] = [(f, "/", iter(f))]
    while stack:
        group, parent, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        link = group.get(name, getlink=True)
        path = (parent + "/" + name) if parent != "/" else "/" + name
        if isinstance(link, h5py.SoftLink):
            yield Entry(path, "softlink", parent, name, link)
            continue
        if isinstance(link, h5py.ExternalLink):
            yield Entry(path, "extlink", parent, name, link)
            continue
        try:
            obj = group[name]
        except (KeyError, OSError, RuntimeError, ValueError) as exc:  # h5py: KeyError
            why = exc.args[0] if exc.args else type(exc).__name__
            raise FormatError(f"cannot open {path!r}: {why} (a damaged HDF5 file?)") from None
        seen = first.get(obj.id)
        if seen is not None:
            yield Entry(path, "hardlink", parent, name, seen)
            continue
        first[obj.id] = path
        if isinstance(obj, h5py.Group):
            yield Entry(path, "group", parent, name)
            stack.append((obj, path, iter(obj)))
        elif isinstance(obj, h5py.Dataset):
            yield Entry(path, "dataset", parent, name)
        else:
            yield Entry(path, "datatype", parent, name)


def is_float_dataset(ds: h5py.Dataset) -> bool:
    """Tell whether ``ds`` is a float dataset ccoll can compress.

    That is float16/32/64 with a shape (not an HDF5 null dataspace), holding its own values:
    a virtual dataset maps other datasets' values and is copied as such a map.
    """
    dt = ds.dtype
    return (dt.kind == "f" and dt.itemsize in FLOAT_ITEMSIZES and ds.shape is not None
            and not ds.is_virtual)


def read_values(ds: h5py.Dataset) -> np.ndarray:
    """All of ``ds``'s values; an :class:`InputError` naming the filter HDF5 lacks to read them.

    A dataset written through a filter plugin (Blosc, LZ4, Zstd, ...) that this HDF5 does
    not have reads as "can't open directory (/usr/local/lib/plugin)". Where the
    ``hdf5plugin`` package is installed, importing it registers its filters, and the read is
    tried once more.
    """
    try:
        return np.asarray(ds[()])
    except OSError as exc:
        missing = _missing_filters(ds)
        if not missing:
            raise
        why = exc.args[0] if exc.args else type(exc).__name__
    try:
        import hdf5plugin  # noqa: F401  (registers its filters with HDF5)
    except ImportError:
        pass
    else:
        if not _missing_filters(ds):
            return np.asarray(ds[()])
    raise InputError(
        f"dataset {ds.name!r} was written through HDF5 filter(s) this HDF5 does not have: "
        f"{', '.join(missing)} ({why}); install them (pip install hdf5plugin has the common "
        "ones, or set HDF5_PLUGIN_PATH) or leave the dataset out with --exclude"
    )


def _missing_filters(ds: h5py.Dataset) -> list[str]:
    dcpl = ds.id.get_create_plist()
    out = []
    for i in range(dcpl.get_nfilters()):
        fid, _, _, name = dcpl.get_filter(i)
        if not h5py.h5z.filter_avail(fid):
            out.append(f"{name.decode(errors='replace') or 'unnamed'} (id {fid})")
    return out


def float_datasets(
    f: h5py.File, keep: Callable[[h5py.Dataset], bool] = is_float_dataset
) -> list[str]:
    """Paths of the datasets ``keep`` accepts (floating-point ones by default), in walk order."""
    return [e.path for e in walk(f) if e.kind == "dataset" and keep(f[e.path])]


def matches(path: str, pattern: str) -> bool:
    """Whether ``pattern`` matches the dataset ``path`` (see the module docstring)."""
    if pattern.startswith("/"):
        return fnmatch.fnmatchcase(path, pattern)
    return fnmatch.fnmatchcase(path.lstrip("/"), pattern)


def select(
    paths: Sequence[str], include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[str]:
    """Paths that match some ``include`` pattern (all when none is given) and no ``exclude``.

    A pattern that matches none of ``paths`` raises :class:`InputError`: a typo would
    otherwise silently change what is compressed.
    """
    for kind, pats in (("--include", include), ("--exclude", exclude)):
        for p in pats:
            if not any(matches(path, p) for path in paths):
                sample = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
                raise InputError(
                    f"{kind} pattern {p!r} matches none of the {len(paths)} floating-point "
                    f"dataset(s) (e.g. {sample or 'none'}); patterns match full paths like "
                    "'/step_0000/fc.weight' (fnmatch)"
                )
    chosen = [p for p in paths if not include or any(matches(p, pat) for pat in include)]
    return [p for p in chosen if not any(matches(p, pat) for pat in exclude)]


def tracks_order(obj: Any) -> bool:
    """Tell whether a group or dataset keeps its links or attributes in creation order.

    Copies are created with the same setting, so that members and attributes list in the
    same order as in the source (h5py lists by name otherwise).
    """
    plist = obj.id.get_create_plist()
    flags = plist.get_attr_creation_order()
    if isinstance(obj, h5py.Group):
        flags |= plist.get_link_creation_order()
    return bool(flags)
