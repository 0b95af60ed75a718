"""CPU backend of the ccoll compressor: numba kernels for stream formats v1 and v2 (docs/format.md).

The modules, by job: :mod:`.intrinsics` (LLVM-level bit operations), :mod:`.blocks` (the
per-block codec, chunking and kernel launches), :mod:`.encode` (``compress_abs``,
``finite_range``, ``residual_abs``), :mod:`.decode` (``decompress``, ``header``, ``as_stream``) and
:mod:`.add` (``add``, ``add_data``, ``sum_bound``); format version 2 is in :mod:`.v2blocks`
(bit streams, the block codec) and :mod:`.v2` (its kernels; the functions above dispatch on
the version).

The arithmetic is exactly the one of docs/format.md (float64 division, ``floor(v + 0.5)``,
one float64 multiplication, rounding to the dtype). The kernels are compiled without
fastmath so that no contraction or reassociation changes a bit; the CUDA backend makes
the same choices and produces byte-identical streams. Kernels are cached on disk
(``cache=True``); numba checks only the cached function's own file for changes, so the
package drops its cached kernels at import when any of its source files changed
(:mod:`._cachestamp`).
"""

from ccoll.compressor.cpu import _cachestamp
from ccoll.compressor.cpu.add import add, add_data, sum_bound
from ccoll.compressor.cpu.decode import as_stream, decompress, decompress_wide, header
from ccoll.compressor.cpu.encode import compress_abs, finite_range, residual_abs

_cachestamp.refresh()

__all__ = [
    "compress_abs",
    "decompress",
    "decompress_wide",
    "add",
    "add_data",
    "header",
    "finite_range",
    "residual_abs",
    "as_stream",
    "sum_bound",
]
