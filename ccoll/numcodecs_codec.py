"""numcodecs codec ``"ccoll"``: error-bounded lossy compression of float32/float64 chunks.

``CCollCodec(eb="rel:1e-3")`` (or ``"abs:1e-5"``) follows the numcodecs contract
(``numcodecs/abc.py``): ``encode(buf)`` returns one ccoll stream as ``bytes``,
``decode(buf, out=None)`` restores the array, ``get_config()`` is JSON-only
(``{"id": "ccoll", "eb": "rel:0.001"}``) and ``from_config`` inverts it. numcodecs finds
the codec through the ``numcodecs.codecs`` entry point, so ``numcodecs.get_codec({"id":
"ccoll", "eb": "abs:1e-5"})`` works once ccoll is installed with the ``codec`` extra.

What a chunk is: a C-contiguous numpy array of float32 or float64 keeps its shape in the
stream; any other buffer (bytes, bytearray, a Fortran-ordered array) is read in memory
order as a 1-D array of ``dtype``, which must then be given (as for ``numcodecs.Quantize``).
A REL bound resolves per chunk: ``rel * (max - min)`` of the chunk's finite values. Every
finite value comes back within the bound; NaN and ±Inf come back as they were.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from types import ModuleType
from typing import Any

import numpy as np

from ccoll.compressor import compress, decompress
from ccoll.compressor.format import VERSIONS
from ccoll.errorbound import as_bound
from ccoll.errors import FormatError, InputError


def _zfpy_version_unreadable() -> bool:
    """Tell whether numcodecs' import would fail on zfpy's installed version string.

    numcodecs (0.13 to 0.16 at least) runs ``tuple(map(int, version("zfpy").split(".")))``
    when it is imported, and the zfpy wheel for numpy 2 is ``1.0.1.post0``.
    """
    try:
        v = importlib.metadata.version("zfpy")
    except importlib.metadata.PackageNotFoundError:
        return False
    return not re.fullmatch(r"\d+(\.\d+)*", v)


def import_numcodecs() -> ModuleType:
    """Import numcodecs, also next to a zfpy release with a suffix such as ``1.0.1.post0``.

    When numcodecs is already imported, or zfpy's version is plain numbers, this is a plain
    import. Otherwise, only while numcodecs is imported the first time,
    ``importlib.metadata.version("zfpy")`` reports the numeric release (``1.0.1``); every
    other distribution, and zfpy afterwards, reads as installed. Called once, by this
    module, to define :class:`CCollCodec` (docs/cli.md, "The numcodecs codec").
    """
    if "numcodecs" in sys.modules or not _zfpy_version_unreadable():
        return importlib.import_module("numcodecs")
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        v = original(distribution_name)
        if distribution_name.lower() == "zfpy":
            m = re.match(r"\d+(\.\d+)*", v)
            return m.group(0) if m else v
        return v

    importlib.metadata.version = version
    try:
        return importlib.import_module("numcodecs")
    finally:
        importlib.metadata.version = original


import_numcodecs()
from numcodecs.abc import Codec  # noqa: E402
from numcodecs.compat import ensure_contiguous_ndarray, ensure_ndarray, ndarray_copy  # noqa: E402

__all__ = ["CCollCodec"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class CCollCodec(Codec):
    """Error-bounded lossy codec for float32/float64 data (codec id ``"ccoll"``).

    Parameters
    ----------
    eb : str
        ``"rel:V"`` (``V`` times the value range of each chunk) or ``"abs:V"``.
    dtype : str, optional
        Data type of raw byte buffers given to ``encode`` (``"float32"`` or ``"float64"``).
        Not needed for numpy float arrays, which carry their dtype.
    version : int, optional
        Stream format version written by ``encode``: 1 (the default) or 2, which stores
        the same values in fewer bytes and is slower (docs/format.md). ``decode`` reads
        both, whatever this says.

    """

    codec_id = "ccoll"

    def __init__(self, eb: str = "rel:1e-3", dtype: str | None = None, version: int = 1) -> None:
        if not isinstance(eb, str):
            raise InputError(
                f"ccoll codec: eb must be a string like 'rel:1e-3' or 'abs:1e-5' (JSON config), "
                f"got {eb!r}"
            )
        bound = as_bound(eb)  # raises ccoll.ErrorBoundError (a ValueError) with the reason
        self.eb = f"{bound.kind}:{bound.value!r}"
        self._bound = bound
        if dtype is not None:
            try:
                dt = np.dtype(dtype)
            except TypeError:
                raise InputError(f"ccoll codec: dtype {dtype!r} is not a dtype") from None
            if dt not in _FLOATS:
                raise InputError(f"ccoll codec: dtype must be float32 or float64, got {dt}")
            self.dtype: str | None = dt.name
        else:
            self.dtype = None
        if isinstance(version, bool) or version not in VERSIONS:
            raise InputError(
                f"ccoll codec: version must be one of {', '.join(map(str, VERSIONS))}, "
                f"got {version!r}"
            )
        self.version = int(version)

    def get_config(self) -> dict[str, Any]:
        """Return ``{"id": "ccoll", "eb": ...}``, JSON only.

        Plus ``"dtype"`` when set and ``"version"`` when not 1 (so a version-1 codec's
        config is what it was before versions existed).
        """
        config: dict[str, Any] = {"id": self.codec_id, "eb": self.eb}
        if self.dtype is not None:
            config["dtype"] = self.dtype
        if self.version != 1:
            config["version"] = self.version
        return config

    def __repr__(self) -> str:
        extra = f", dtype={self.dtype!r}" if self.dtype is not None else ""
        if self.version != 1:
            extra += f", version={self.version}"
        return f"CCollCodec(eb={self.eb!r}{extra})"

    def _array(self, buf: Any) -> np.ndarray:
        if isinstance(buf, np.ndarray) and buf.dtype in _FLOATS and buf.flags.c_contiguous:
            if self.dtype is not None and buf.dtype != np.dtype(self.dtype):
                raise InputError(f"ccoll codec: configured for {self.dtype}, got {buf.dtype} data")
            return buf
        arr = ensure_contiguous_ndarray(buf)  # flat, in memory order
        if arr.dtype in _FLOATS:
            if self.dtype is not None and arr.dtype != np.dtype(self.dtype):
                raise InputError(f"ccoll codec: configured for {self.dtype}, got {arr.dtype} data")
            return arr
        if arr.dtype.itemsize != 1 and arr.dtype.kind not in "SV":
            # Typed data of another kind (float16, int32, ...): reading its bytes as floats
            # would code other numbers without an error.
            raise InputError(
                f"ccoll codec: got {arr.dtype} data; ccoll codes float32 and float64: "
                "convert it first (for example x.astype(numpy.float32))"
            )
        if self.dtype is None:
            raise InputError(
                f"ccoll codec: got a buffer of {arr.dtype}, expected float32 or float64 data; "
                "set dtype='float32' or 'float64' to encode raw bytes"
            )
        if arr.nbytes % np.dtype(self.dtype).itemsize:
            raise InputError(
                f"ccoll codec: a buffer of {arr.nbytes} bytes is not a whole number of {self.dtype}"
            )
        return arr.view(np.uint8).view(self.dtype)

    def encode(self, buf: Any) -> bytes:
        """Compress ``buf`` into one self-describing ccoll stream."""
        return compress(self._array(buf), self._bound, version=self.version).tobytes()

    def decode(self, buf: Any, out: Any = None) -> Any:
        """Decompress a stream; into ``out`` (any writable buffer of the right size) if given."""
        try:
            stream = ensure_ndarray(buf)
            stream = ensure_contiguous_ndarray(stream).view(np.uint8).reshape(-1)
        except (TypeError, ValueError) as exc:  # "abc", None, a list, an object array
            raise FormatError(f"buf must be a buffer of stream bytes (numpy array, bytes), "
                              f"got {type(buf).__name__}: {exc}") from None
        dec = decompress(stream)
        if out is not None:
            # numcodecs copies into out through a view of its bytes: a buffer of another
            # size gave numpy's reshape error, one of the same bytes and another dtype was
            # filled with the values' bit patterns (float32 read as float64).
            o = ensure_ndarray(out)
            if o.nbytes != dec.nbytes or (o.dtype.kind == "f" and o.dtype != dec.dtype):
                raise InputError(
                    f"out holds {o.nbytes} bytes of {o.dtype}; the stream decodes to "
                    f"{dec.size} {dec.dtype} values ({dec.nbytes} bytes): pass a buffer of "
                    f"that size (a {dec.dtype} array, or raw bytes)")
            if not o.flags.writeable:  # numpy's "assignment destination is read-only"
                raise InputError("out is read-only: pass a writable buffer, or out=None")
        return ndarray_copy(dec, out)
