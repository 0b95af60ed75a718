"""Compressors that ``ccoll eval`` compares at one absolute error bound: ccoll, SZ3, ZFP.

ccoll runs once per stream format version asked for (``ccoll`` for version 1, ``ccoll v2``).

Each adapter compresses a host float32/float64 array with an absolute bound and returns the
compressed bytes; decompression returns the array. A peer whose Python package is absent is
reported as missing, not as an error. SZ3 and ZFP take at most 4 dimensions, so a tensor
with more is given to them with its leading dimensions merged (the values do not change).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import ccoll
from ccoll.errorbound import ABS

__all__ = ["Codec", "PEER_NAMES", "ccoll_codec", "load"]

PEER_NAMES = ("sz3", "zfp")


@dataclass(frozen=True)
class Codec:
    """A compressor under evaluation: ``compress(x, eb) -> buf``, ``decompress(buf, x) -> y``."""

    name: str
    compress: Callable[[np.ndarray, float], Any]
    decompress: Callable[[Any, np.ndarray], np.ndarray]
    version: str


def _at_most_4d(x: np.ndarray) -> np.ndarray:
    if x.ndim == 0:
        return x.reshape(1)
    if x.ndim > 4:
        return x.reshape((-1, *x.shape[-3:]))
    return x


def ccoll_codec(version: int = 1) -> Codec:
    """Return ccoll writing stream format ``version``: ``ccoll`` (1) or ``ccoll v2`` (2)."""
    return Codec(
        "ccoll" if version == 1 else f"ccoll v{version}",
        lambda x, eb: ccoll.compress(x, ABS(eb), version=version),
        lambda buf, x: ccoll.decompress(buf).reshape(x.shape),
        ccoll.__version__,
    )


def _ccoll() -> Codec:
    return ccoll_codec(1)


def _sz3() -> Codec:
    from importlib.metadata import version

    import pysz

    def compress(x: np.ndarray, eb: float) -> Any:
        cfg = pysz.szConfig()
        cfg.errorBoundMode = pysz.szErrorBoundMode.ABS
        cfg.absErrorBound = eb
        buf, _ratio = pysz.sz.compress(_at_most_4d(x), cfg)
        return buf

    def decompress(buf: Any, x: np.ndarray) -> np.ndarray:
        y, _cfg = pysz.sz.decompress(buf, x.dtype, _at_most_4d(x).shape)
        return np.asarray(y).reshape(x.shape)

    return Codec("sz3", compress, decompress, version("pysz"))


def _zfp() -> Codec:
    from importlib.metadata import version

    import zfpy

    def compress(x: np.ndarray, eb: float) -> Any:
        # ZFP's fixed-accuracy mode; its error can exceed the tolerance, so eval reports it.
        return zfpy.compress_numpy(np.ascontiguousarray(_at_most_4d(x)), tolerance=eb)

    def decompress(buf: Any, x: np.ndarray) -> np.ndarray:
        return np.asarray(zfpy.decompress_numpy(buf)).reshape(x.shape)

    return Codec("zfp", compress, decompress, version("zfpy"))


_LOADERS: dict[str, Callable[[], Codec]] = {"ccoll": _ccoll, "sz3": _sz3, "zfp": _zfp}
_PACKAGES = {"sz3": "pysz", "zfp": "zfpy"}


def load(name: str) -> tuple[Codec | None, str | None]:
    """Return the codec ``name`` and ``None``, or ``None`` and why it is missing."""
    try:
        return _LOADERS[name](), None
    except ImportError as exc:
        return None, f"{_PACKAGES.get(name, name)} is not installed ({exc})"
