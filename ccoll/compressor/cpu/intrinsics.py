"""numba intrinsics of the CPU backend: bit counts, bit casts, bit-plane gathers, rounding.

Each lowers to one or a few LLVM instructions (``ctlz``, ``ctpop``, ``bitcast``, a vector
shift and mask move), which numba has no portable spelling for. Used by the per-block
helpers in :mod:`ccoll.compressor.cpu.blocks`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

__all__ = [
    "_bitlen",
    "_popcount",
    "_tzcnt",
    "_f64_from_bits",
    "_bits_from_f64",
    "_f32_from_bits",
    "_plane_of",
    "_or_plane",
    "_round_like",
]


@intrinsic
def _bitlen(typingctx, x):  # type: ignore[no-untyped-def]
    """Bit length of a non-negative int64 (0 for 0): ``64 - clz``."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        lz = builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))
        return builder.sub(ir.Constant(ir.IntType(64), 64), lz)

    return sig, codegen


@intrinsic
def _popcount(typingctx, x):  # type: ignore[no-untyped-def]
    """Count the set bits of an int64."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def _tzcnt(typingctx, x):  # type: ignore[no-untyped-def]
    """Index of the lowest set bit of a non-zero int64 (``cttz``)."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return sig, codegen


@intrinsic
def _f64_from_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """Reinterpret the 64 bits of an int64 as a float64."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.DoubleType())

    return sig, codegen


@intrinsic
def _bits_from_f64(typingctx, x):  # type: ignore[no-untyped-def]
    """Reinterpret a float64 as its 64-bit pattern (an int64)."""
    sig = types.int64(types.float64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(64))

    return sig, codegen


@intrinsic
def _f32_from_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """Reinterpret the low 32 bits of an int64 as a float32, widened to float64."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        lo = builder.trunc(args[0], ir.IntType(32))
        f = builder.bitcast(lo, ir.FloatType())
        return builder.fpext(f, ir.DoubleType())

    return sig, codegen


_I32 = ir.IntType(32)
_V32 = ir.VectorType(_I32, 32)
_M32 = ir.VectorType(ir.IntType(1), 32)


def _splat32(builder, val):  # type: ignore[no-untyped-def]
    v = builder.insert_element(ir.Constant(_V32, ir.Undefined), val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_V32, ir.Undefined), ir.Constant(_V32, [0] * 32))


@intrinsic
def _plane_of(typingctx, mag, j):  # type: ignore[no-untyped-def]
    """Gather bit ``j`` of the 32 uint32 lanes of ``mag`` into one word (bit l = lane l).

    One vector shift and a mask move on AVX-512 instead of a 32-step reduction; ``mag``
    must be a C-contiguous uint32 array of at least 32 elements.
    """
    sig = types.uint32(mag, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        vec = builder.load(builder.bitcast(arr.data, _V32.as_pointer()), align=4)
        shifted = builder.lshr(vec, _splat32(builder, builder.trunc(args[1], _I32)))
        return builder.bitcast(builder.trunc(shifted, _M32), _I32)

    return sig, codegen


@intrinsic
def _or_plane(typingctx, mag, p, j):  # type: ignore[no-untyped-def]
    """``mag[l] |= ((p >> l) & 1) << j`` for the 32 uint32 lanes of ``mag`` (a bit-plane)."""
    sig = types.void(mag, types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.bitcast(arr.data, _V32.as_pointer())
        vec = builder.load(ptr, align=4)
        mask = builder.bitcast(builder.trunc(args[1], _I32), _M32)
        bit = _splat32(builder, builder.shl(ir.Constant(_I32, 1), builder.trunc(args[2], _I32)))
        builder.store(builder.or_(vec, builder.select(mask, bit, ir.Constant(_V32, None))), ptr,
                      align=4)
        return context.get_dummy_value()

    return sig, codegen


def _round_like(d, arr):  # type: ignore[no-untyped-def]
    """``float64(T(d))`` where ``T`` is the dtype of ``arr`` (one rounding, nearest-even)."""
    raise NotImplementedError  # only called from numba code, see the overload below


@overload(_round_like)
def _round_like_impl(d, arr):  # type: ignore[no-untyped-def]
    if arr.dtype == types.float32:

        def impl(d, arr):  # type: ignore[no-untyped-def]
            return np.float64(np.float32(d))

    else:

        def impl(d, arr):  # type: ignore[no-untyped-def]
            return d

    return impl
