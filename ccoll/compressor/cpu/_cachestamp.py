"""Drop numba's cached CPU kernels when any source file of this package changed.

numba keys a cached kernel on the stamp (modification time and size) of the one file that
defines it, but ccoll's kernels inline helpers from other files of this package
(:mod:`.intrinsics`, :mod:`.blocks`, :mod:`.v2blocks`): after an update that changes only
a helper's file (a ``git pull`` of a checkout, a copy that keeps modification times), numba
would load the old machine code for the new source. :func:`refresh` runs once at the
package's import, before any kernel is compiled or loaded: it hashes every ``*.py`` of the
package and, when the hash differs from the one stored beside the cache, deletes the
package's cache files (``<module>.<function>-<line>.pyXY.nbi`` / ``.nbc``), so the kernels
are compiled afresh once. A fresh install finds no cache and only writes the stamp.

It asks numba where the cache lives (beside the sources, or numba's user-wide folder when
the sources are read-only, or ``NUMBA_CACHE_DIR``), and does nothing when there is none or
it cannot be written; other processes that import at the same moment may delete the same
files or compile the same kernels, which only costs time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["refresh", "source_digest"]

STAMP = "ccoll-cpu-sources.sha256"
_HERE = Path(__file__).resolve().parent


def source_digest(folder: Path = _HERE) -> str:
    """SHA-256 over the names and bytes of the package's ``*.py`` files."""
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.py")):
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def cache_folder() -> Path | None:
    """Where numba keeps this package's cached kernels, or None when caching is off."""
    from ccoll.compressor.cpu import blocks

    cache = getattr(blocks._block_words, "_cache", None)
    path = getattr(cache, "_cache_path", None)
    return Path(path) if path else None


def refresh(folder: Path | None = None, digest: str | None = None) -> bool:
    """Delete the package's cached kernels if its sources changed; True when it did."""
    try:
        folder = cache_folder() if folder is None else folder
    except Exception:  # noqa: BLE001 - numba internals moved: keep numba's own behaviour
        return False
    if folder is None:
        return False
    digest = source_digest() if digest is None else digest
    stamp = folder / STAMP
    try:
        if stamp.read_text().strip() == digest:
            return False
    except OSError:
        pass
    modules = {p.stem for p in _HERE.glob("*.py")}
    dropped = False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            if f.suffix in (".nbi", ".nbc") and f.name.split(".", 1)[0] in modules:
                f.unlink(missing_ok=True)
                dropped = True
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ccoll-stamp-")
        with os.fdopen(fd, "w") as out:
            out.write(digest + "\n")
        os.replace(tmp, stamp)
    except OSError:
        pass  # a cache we cannot write to is one numba cannot write to either
    return dropped
