"""A one-line notice on stderr when ccoll's CPU kernels are compiled instead of loaded.

numba compiles a kernel the first time it is called with new argument types and keeps the
machine code in its on-disk cache (``cache=True``), so only the first run on a machine pays
for it: about 30 s for the kernels of one dtype on a small machine, against well under a
second to load them afterwards. A silent 30-second pause looks like a hang, so the first
real compilation of a ccoll kernel in a process prints::

    ccoll: compiling kernels for float32, once, about 30 s on 2 idle cores; later runs load
    them from numba's cache

once per dtype (cache hits print nothing), and once more per dtype for the kernels of stream
format version 2 (``compress(..., version=2)``), which take minutes to compile. The
listener is numba's ``"numba:compile"`` event, which numba triggers only on a cache miss;
it is registered at the first kernel launch (:func:`watch`), not at import, and ignores
every function outside ccoll.
``python -m ccoll.warmup`` (run by ``make venv`` and ``make demo``) fills the cache ahead.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from numba.core import event

__all__ = ["watch", "message"]

_lock = threading.Lock()
_registered = False
# (format, dtype) pairs announced; format 2 for the version-2 kernels, dtype "" for a kernel
# without float arrays (the homomorphic add), which any notice of its format covers.
_announced: set[tuple[int, str]] = set()
_V2_MODULES = ("ccoll.compressor.cpu.v2", "ccoll.compressor.cpu.v2blocks")
_depth = threading.local()  # nesting of ccoll compilations on this thread


def message(dtype: str | None, version: int = 1) -> str:
    """Return the notice for ``dtype`` (None: a kernel without float arrays, as the add).

    ``version`` 2 names the kernels of stream format version 2 and their longer compile.
    """
    what = "kernels" if version == 1 else "format-2 kernels"
    what += f" for {dtype}" if dtype else ""
    took = "about 30 s" if version == 1 else "about 1-3 minutes"
    return (
        f"ccoll: compiling {what}, once, {took} on 2 idle cores; "
        "later runs load them from numba's cache"
    )


def _dtype_of(args: Any) -> str | None:
    """Return the dtype of a kernel's first float array argument ("float32", ...)."""
    for t in args or ():
        name = str(getattr(t, "dtype", ""))
        if name.startswith("float"):
            return name
    return None


def _module_of(ev: Any) -> str:
    disp = (ev.data or {}).get("dispatcher")
    return getattr(getattr(disp, "py_func", None), "__module__", "") or ""


def _is_ccoll(ev: Any) -> bool:
    return _module_of(ev).startswith("ccoll.")


class _Notice(event.Listener):  # type: ignore[misc]
    def on_start(self, ev: Any) -> None:
        if not _is_ccoll(ev):
            return
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        if depth:  # a helper compiled inside a kernel: the kernel's dtype was announced
            return
        dtype = _dtype_of((ev.data or {}).get("args"))
        version = 2 if _module_of(ev) in _V2_MODULES else 1
        with _lock:
            done = {d for v, d in _announced if v == version}
            if (dtype or "") in done or (dtype is None and done):
                return
            _announced.add((version, dtype or ""))
        print(message(dtype, version), file=sys.stderr, flush=True)

    def on_end(self, ev: Any) -> None:
        if _is_ccoll(ev):
            _depth.n = max(0, getattr(_depth, "n", 1) - 1)


def watch() -> None:
    """Register the listener once per process (cheap after the first call)."""
    global _registered
    if _registered:
        return
    with _lock:
        if not _registered:
            event.register("numba:compile", _Notice())
            _registered = True
