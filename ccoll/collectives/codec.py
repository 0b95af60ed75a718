"""The compressor as the collectives use it: one place that imports ``ccoll.compressor``.

Streams are self-describing (docs/format.md), so a received buffer sized for the worst
case is trimmed to the length its header states. The compressor picks its CPU or CUDA
backend from where the array lives; the collectives never choose a backend themselves.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from ccoll.compressor.format import max_nbytes, parse_header
from ccoll.errors import FormatError

__all__ = ["api", "stream_nbytes", "max_nbytes", "check_stream"]

_api: ModuleType | None = None


def api() -> ModuleType:
    """Return the compressor module (imported on first use, so exact collectives never load it)."""
    global _api
    if _api is None:
        from ccoll.compressor import api as mod

        _api = mod
    return _api


def stream_nbytes(buf: Any) -> int:
    """Exact length of the stream at the start of ``buf`` (a host or device uint8 array)."""
    if isinstance(buf, np.ndarray):
        return parse_header(buf, exact=False).nbytes
    return int(api().header(buf).nbytes)


def check_stream(buf: Any, n: int, dtype: np.dtype, bound: float,
                 version: int | None = None) -> int:
    """Validate a received stream against what the collective expects; return its length.

    A stream of another count or dtype, of another format version than ``version`` (when
    given: the call's plan fixes it), or one whose accumulated bound exceeds ``bound``,
    means a peer sent something else than the algorithm prescribes: raise ``FormatError``.
    """
    hdr = parse_header(buf, exact=False) if isinstance(buf, np.ndarray) else api().header(buf)
    if hdr.n != n or hdr.dtype != dtype:
        raise FormatError(
            f"received a stream of {hdr.n} {hdr.dtype} elements where {n} {dtype} were expected"
        )
    if version is not None and hdr.version != version:
        raise FormatError(
            f"received a stream of format version {hdr.version} where the call's plan sends "
            f"version {version}"
        )
    if hdr.bound > bound:
        raise FormatError(
            f"received a stream whose bound {hdr.bound!r} exceeds the collective's bound {bound!r}"
        )
    return int(hdr.nbytes)
