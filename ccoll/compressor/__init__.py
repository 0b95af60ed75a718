"""Error-bounded compressor of float32/float64 arrays into self-describing v1 streams.

``compress``/``decompress`` are the public entry points (also exported as ``ccoll.compress``
and ``ccoll.decompress``); ``compress_abs`` takes an absolute bound already resolved, ``add``
sums two streams without decompressing them, ``add_data`` adds an array to a stream (as
``add`` of its compressed form, in one pass), ``header`` parses a stream's header and
``max_nbytes`` bounds a stream's size. docs/format.md specifies the bytes and
docs/error-bound.md proves the bound.
"""

from ccoll.compressor.api import add, add_data, compress, compress_abs, decompress, header
from ccoll.compressor.format import StreamHeader, max_nbytes

__all__ = [
    "compress", "compress_abs", "decompress", "add", "add_data", "header", "max_nbytes",
    "StreamHeader",
]
