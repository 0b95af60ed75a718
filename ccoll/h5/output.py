"""Checked input paths and all-or-nothing output files.

An output file is written under a temporary name in its own folder and renamed into place
only when complete (``os.replace`` is atomic within a file system), so an error, Ctrl-C or
SIGTERM never leaves a half-written file under the requested name.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import h5py

from ccoll.errors import InputError

__all__ = [
    "check_input",
    "check_output",
    "check_image_name",
    "json_ready",
    "atomic_output",
    "write_atomically",
    "request_stop",
    "check_stop",
    "stop_signal",
    "clear_stop",
]

# Signals received during a run. A signal handler that raises can lose its exception: when
# the signal lands while Python runs a weakref callback or a __del__, the exception is
# printed and dropped. The handler therefore also records the signal here, and the work
# loops and atomic_output check it, so that a stop is never lost and never committed.
_stop: list[int] = []


def request_stop(signum: int) -> None:
    """Record ``signum`` and raise ``KeyboardInterrupt`` (a signal handler for INT/TERM)."""
    _stop.append(signum)
    raise KeyboardInterrupt


def check_stop() -> None:
    """Raise ``KeyboardInterrupt`` if a stop was requested (see :func:`request_stop`)."""
    if _stop:
        raise KeyboardInterrupt


def stop_signal() -> int | None:
    """Return the first signal that requested a stop, or ``None``."""
    return _stop[0] if _stop else None


def clear_stop() -> None:
    """Forget requested stops (at the start of a command)."""
    _stop.clear()


def check_input(path: str) -> None:
    """Raise ``FileNotFoundError`` or :class:`InputError` unless ``path`` is an HDF5 file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"input file {path!r} does not exist")
    if os.path.isdir(path):
        raise InputError(f"input {path!r} is a folder, expected an HDF5 file")
    try:
        ok = h5py.is_hdf5(path)
    except OSError as exc:  # unreadable (permissions, ...)
        raise InputError(f"cannot read input {path!r}: {exc}") from None
    if not ok:
        raise InputError(f"input {path!r} is not an HDF5 file (no HDF5 signature found)")


def json_ready(v: Any) -> Any:
    """Return ``v`` with non-finite floats as null: JSON has no inf/nan (docs/cli.md says where).

    Every JSON document of the ``ccoll`` command goes through it (``ccoll bench --json``'s
    file too).
    """
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: json_ready(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_ready(x) for x in v]
    return v


def check_image_name(path: str) -> None:
    """Refuse an image file name whose extension matplotlib cannot write (before any work).

    No extension is PNG (:func:`write_atomically`'s ``default_suffix`` for images).
    """
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if not ext:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if ext not in kinds:
        raise InputError(f"image {path!r}: matplotlib cannot write .{ext} files; use one of "
                         + ", ".join("." + k for k in sorted(kinds)))


def check_output(path: str, *, force: bool, inputs: tuple[str, ...] = ()) -> None:
    """Refuse an output that exists (unless ``force``), is an input, or has no folder.

    An existing output that is not a regular file is refused even with ``force``.
    """
    if not os.path.basename(path):
        raise InputError(f"output {path!r} ends in a folder separator, expected a file name")
    # The folder as the system will walk it when the file is renamed into place, not as
    # abspath() tidies it: in 'nosuchdir/../out.h5' or 'file.h5/../out.h5' the '..' is
    # reached only through a folder that must exist.
    written = os.path.dirname(path) or os.curdir
    if not os.path.isdir(written):
        raise InputError(f"output folder {written!r} does not exist (or is not a folder)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"output folder {folder!r} is not writable")
    try:  # as root os.access says yes to /proc and read-only mounts: try a file there
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".ccoll-", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"output folder {folder!r} is not writable: "
                         f"{exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)
    if os.path.isdir(path):
        raise InputError(f"output {path!r} is a folder, expected a file name")
    if os.path.islink(path) and not os.path.exists(path) and not force:
        # A link to nothing exists too: the rename into place would replace it.
        raise FileExistsError(f"output {path!r} exists (a link to a missing file); pass "
                              "--force to replace the link")
    if os.path.exists(path):
        if not stat.S_ISREG(os.stat(path).st_mode):  # --force would rename a file over it
            raise InputError(f"output {path!r} exists and is not a regular file (a device, "
                             "pipe or socket); ccoll writes a new file and renames it into "
                             "place: choose a file name")
        for src in inputs:
            if os.path.exists(src) and os.path.samefile(src, path):
                raise InputError(f"output {path!r} is the input file; choose another name")
        if not force:
            raise FileExistsError(f"output {path!r} exists; pass --force to replace it")


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary file name next to ``path``; rename it to ``path`` on success.

    On any exception, including ``KeyboardInterrupt`` and ``SystemExit``, the temporary file
    is deleted and the exception propagates; an existing ``path`` is left untouched.
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(
            dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp"
        )
    except OSError as exc:
        # The OS names the temporary file, which the user never asked for: name the folder.
        raise InputError(
            f"cannot write {os.path.basename(path)!r} in the output folder {folder!r}: "
            f"{exc.strerror or exc}"
        ) from None
    os.close(fd)
    try:
        yield tmp
        check_stop()  # a stop whose exception was lost must not commit the file
        # mkstemp creates the file 0600; give the result the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def h5_output(path: str, like: h5py.File) -> Iterator[h5py.File]:
    """Yield a new HDF5 file that appears as ``path`` once complete (:func:`atomic_output`).

    It tracks creation order where ``like`` does and gets ``like``'s user block (the bytes
    before the HDF5 data that other tools keep there, a shell header for instance), which
    ``h5py`` does not copy with the objects.
    """
    from ccoll.h5.tree import tracks_order

    size = like.userblock_size
    with atomic_output(path) as tmp:
        with h5py.File(tmp, "w", track_order=tracks_order(like["/"]),
                       userblock_size=size) as out:
            yield out
        if size:
            with open(like.filename, "rb") as src:
                block = src.read(size)
            with open(tmp, "r+b") as dst:
                dst.write(block)


# Free bytes kept beyond what a dataset about to be written takes: the metadata HDF5 writes
# when it closes the file (about 1/64 of the file is allowed for it, on top of this).
ROOM_MARGIN = 512 << 10


def ensure_room(out: h5py.File, nbytes: int) -> None:
    """Raise ``OSError(ENOSPC)`` unless ``out``'s device has room for ``nbytes`` more.

    HDF5 crashes (a bus error or a segmentation fault, in ``h5py``'s close of the files)
    after a write into a full device has failed; checking before each write ends the run
    with its clean error instead (the output is never renamed into place).
    """
    folder = os.path.dirname(os.path.abspath(out.filename))
    free = shutil.disk_usage(folder).free
    need = int(nbytes) + ROOM_MARGIN + out.id.get_filesize() // 64
    if free < need:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free} bytes free in "
                      f"{folder!r}, {need} needed for the next dataset and the file's metadata")


def copy_bytes(obj: Any) -> int:
    """Bytes an object copy of ``obj`` writes, about: a dataset's stored bytes, else none."""
    return int(obj.id.get_storage_size()) if isinstance(obj, h5py.Dataset) else 0


def copy_member(fin: h5py.File, fout: h5py.File, e: Any) -> str:
    """Write walk entry ``e`` of ``fin`` into ``fout`` as it is; return what was done.

    ``"copied"``: an object copy (a dataset, a named datatype); ``"linked"``: a group with
    its attributes, a soft or external link, or a second name of an object already written
    (a hard link to it); ``"missing"``: a second name of an object ``fout`` lacks (its first
    name was left out). What ``ccoll compress`` and ``ccoll decompress`` do with every
    entry they do not convert.
    """
    from ccoll.h5 import attrs as A
    from ccoll.h5.tree import tracks_order

    if e.kind == "group":
        g = fin[e.path]
        A.copy_attrs(g, fout.create_group(e.path, track_order=tracks_order(g)))
    elif e.kind == "softlink":
        fout[e.parent][e.name] = h5py.SoftLink(e.link.path)
    elif e.kind == "extlink":
        fout[e.parent][e.name] = h5py.ExternalLink(e.link.filename, e.link.path)
    elif e.kind == "hardlink":  # the object was written at its first name
        if e.link not in fout:
            return "missing"
        fout[e.parent][e.name] = fout[e.link]
    else:
        obj = fin[e.path]
        ensure_room(fout, copy_bytes(obj))
        fin.copy(obj, fout[e.parent], name=e.name)
        return "copied"
    return "linked"


def write_atomically(path: str, write: Callable[[str], None], *, default_suffix: str = "") -> None:
    """Have ``write(name)`` write a file that appears as ``path`` only once it is complete.

    The name handed to ``write`` is a temporary one next to ``path`` (see
    :func:`atomic_output`) that ends with ``path``'s extension, or ``default_suffix`` when
    ``path`` has none: matplotlib's ``savefig`` picks the file format from it.
    """
    suffix = os.path.splitext(path)[1] or default_suffix
    with atomic_output(path) as tmp:
        named = tmp + suffix
        try:
            write(named)
            os.replace(named, tmp)
        finally:
            if os.path.exists(named):
                os.unlink(named)
