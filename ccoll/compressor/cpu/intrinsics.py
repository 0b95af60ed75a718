"""numba intrinsics of the CPU backend: bit counts, bit casts, bit-plane gathers, rounding.

Each lowers to one or a few LLVM instructions (``ctlz``, ``ctpop``, ``bitcast``, a vector
shift and mask move), which numba has no portable spelling for. Used by the per-block
helpers in :mod:`ccoll.compressor.cpu.blocks`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = [
    "_bitlen",
    "_popcount",
    "_tzcnt",
    "_pext64",
    "_pdep64",
    "HAVE_BMI2",
    "_f64_from_bits",
    "_bits_from_f64",
    "_f32_from_bits",
    "_plane_of",
    "_or_plane",
    "_neg_mask",
    "_round_like",
    "_bits_at",
    "_planes_abs",
    "HAVE_AVX512",
    "LUT_BITS",
    "_lut_store",
    "_planes_abs8",
    "_costs8",
    "HAVE_AVX512DQ",
    "HAVE_VPOPCNT",
    "_q_int",
    "_q_float",
    "_costs8_32",
    "BITLEN8",
    "_pp_store2",
    "_pp_store4",
    "_pp_store8",
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


def _host_has_bmi2() -> bool:
    try:
        from llvmlite import binding as llb

        return bool(llb.get_host_cpu_features().get("bmi2", False))
    except Exception:  # noqa: BLE001 - no feature list: the portable loops
        return False


# pext/pdep are one instruction with BMI2 (x86 since 2013); elsewhere a loop over the mask.
HAVE_BMI2 = _host_has_bmi2()


def _bmi2(name):  # type: ignore[no-untyped-def]
    @intrinsic
    def op(typingctx, x, m):  # type: ignore[no-untyped-def]
        sig = types.int64(types.int64, types.int64)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            i64 = ir.IntType(64)
            fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(i64, [i64, i64]))
            return builder.call(fn, args)

        return sig, codegen

    return op


_pext_hw = _bmi2("llvm.x86.bmi.pext.64")
_pdep_hw = _bmi2("llvm.x86.bmi.pdep.64")


def _pext64(x, m):  # type: ignore[no-untyped-def]
    """Gather the bits of ``x`` at the set bits of ``m`` into the low bits (BMI2 ``pext``)."""
    raise NotImplementedError  # only called from numba code, see the overload below


def _pdep64(x, m):  # type: ignore[no-untyped-def]
    """Scatter the low bits of ``x`` to the set bits of ``m`` (BMI2 ``pdep``)."""
    raise NotImplementedError


@njit(nogil=True, cache=True, inline="always")
def _pext_sw(x, m):  # type: ignore[no-untyped-def]
    """Portable ``pext``: one step per set bit of ``m``."""
    r = np.int64(0)
    i = 0
    mm = np.int64(m)
    while mm:
        low = mm & -mm
        if x & low:
            r |= np.int64(1) << i
        i += 1
        mm &= mm - 1
    return r


@njit(nogil=True, cache=True, inline="always")
def _pdep_sw(x, m):  # type: ignore[no-untyped-def]
    """Portable ``pdep``: one step per set bit of ``m``."""
    r = np.int64(0)
    i = 0
    mm = np.int64(m)
    while mm:
        low = mm & -mm
        if (x >> i) & 1:
            r |= low
        i += 1
        mm &= mm - 1
    return r


@overload(_pext64)
def _pext64_impl(x, m):  # type: ignore[no-untyped-def]
    if HAVE_BMI2:
        return lambda x, m: _pext_hw(np.int64(x), np.int64(m))
    return lambda x, m: _pext_sw(np.int64(x), np.int64(m))


@overload(_pdep64)
def _pdep64_impl(x, m):  # type: ignore[no-untyped-def]
    if HAVE_BMI2:
        return lambda x, m: _pdep_hw(np.int64(x), np.int64(m))
    return lambda x, m: _pdep_sw(np.int64(x), np.int64(m))


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


_V64 = ir.VectorType(ir.IntType(64), 32)


@intrinsic
def _neg_mask(typingctx, q):  # type: ignore[no-untyped-def]
    """Word with bit ``l`` set where ``q[l] < 0``, for the 32 int32 or int64 lanes of ``q``.

    A vector compare and a mask move, where a loop of shifts and ORs does not vectorize
    into one; ``q`` must be a C-contiguous int32 or int64 array of at least 32 elements.
    """
    sig = types.int64(q)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        vt = _lanes_of(signature.args[0])
        vec = builder.load(builder.bitcast(arr.data, vt.as_pointer()), align=4)
        neg = builder.icmp_signed("<", vec, ir.Constant(vt, None))
        return builder.zext(builder.bitcast(neg, _I32), ir.IntType(64))

    return sig, codegen


_I64 = ir.IntType(64)


def _lanes_of(arr_t):  # type: ignore[no-untyped-def]
    """Return the 32-lane vector type of an int32 or int64 array's elements."""
    return ir.VectorType(ir.IntType(arr_t.dtype.bitwidth), 32)


def _abs_lanes(builder, arr, arr_t, to):  # type: ignore[no-untyped-def]
    """``|q|`` of the first 32 lanes of the int32 or int64 array ``arr``, narrowed to ``to``."""
    vt = _lanes_of(arr_t)
    vec = builder.load(builder.bitcast(arr.data, vt.as_pointer()), align=4)
    neg = builder.icmp_signed("<", vec, ir.Constant(vt, None))
    mag = builder.select(neg, builder.sub(ir.Constant(vt, None), vec), vec)
    return mag if vt.element.width == to.element.width else builder.trunc(mag, to)


@intrinsic
def _planes_abs(typingctx, q, T, S, w, o):  # type: ignore[no-untyped-def]
    """Bit-planes of ``|q|`` for the 32 int32/int64 lanes of ``q`` (``|q| < 2^31``), ``j < w``.

    ``T[o + j]`` (int64) receives bit ``j`` of the 32 magnitudes (bit ``l`` = lane ``l``)
    and ``S[o + j]`` the lanes with ``|q| >= 2^j``. ``q`` is loaded once, as the 64-byte vectors
    the quantizer stored (a 32-bit ``|q|`` array written by the quantizer's 32-byte
    truncating stores and read back as 64-byte vectors stalled store forwarding), and
    the plane loop runs on registers: a vector shift, a compare and two mask moves per
    plane. ``q``, ``T`` and ``S`` must be C-contiguous with at least 32, ``o + w`` and
    ``o + w`` elements.
    """
    sig = types.void(q, T, S, types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        qa = context.make_array(signature.args[0])(context, builder, args[0])
        mag = _abs_lanes(builder, qa, signature.args[0], _V32)
        tp = context.make_array(signature.args[1])(context, builder, args[1]).data
        sp = context.make_array(signature.args[2])(context, builder, args[2]).data
        tp = builder.gep(builder.bitcast(tp, _I64.as_pointer()), [args[4]])
        sp = builder.gep(builder.bitcast(sp, _I64.as_pointer()), [args[4]])
        w = args[3]
        entry = builder.basic_block
        loop = builder.append_basic_block("planes.loop")
        done = builder.append_basic_block("planes.done")
        builder.cbranch(builder.icmp_signed(">", w, ir.Constant(_I64, 0)), loop, done)
        builder.position_at_end(loop)
        j = builder.phi(_I64)
        j.add_incoming(ir.Constant(_I64, 0), entry)
        sh = builder.lshr(mag, _splat32(builder, builder.trunc(j, _I32)))
        t = builder.bitcast(builder.trunc(sh, _M32), _I32)
        s = builder.bitcast(builder.icmp_unsigned("!=", sh, ir.Constant(_V32, None)), _I32)
        builder.store(builder.zext(t, _I64), builder.gep(tp, [j]))
        builder.store(builder.zext(s, _I64), builder.gep(sp, [j]))
        nxt = builder.add(j, ir.Constant(_I64, 1))
        j.add_incoming(nxt, loop)
        builder.cbranch(builder.icmp_signed("<", nxt, w), loop, done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


_V8 = ir.VectorType(ir.IntType(8), 32)


@intrinsic
def _planes_abs8(typingctx, q, T, S, o):  # type: ignore[no-untyped-def]
    """:func:`_planes_abs` with ``w = 8`` for magnitudes below ``2^8``, in straight-line code.

    The 32 magnitudes are narrowed to bytes (one 32-byte vector), so a plane is a byte
    shift and a mask move, and a suffix OR a byte compare and a mask move: 8 planes cost
    fewer instructions than the 32-bit plane loop spends on the 3-6 planes that blocks
    need at REL 1e-3 and 1e-4, and no branch depends on how many planes a block has.
    ``T[o + j]`` and ``S[o + j]`` for ``j`` at or above the bit length of the maximum are
    0. ``q``, ``T`` and ``S`` must be C-contiguous with at least 32, ``o + 8`` and ``o + 8``
    elements, and every ``|q[l]| < 2^8``.
    """
    sig = types.void(q, T, S, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        qa = context.make_array(signature.args[0])(context, builder, args[0])
        mag = _abs_lanes(builder, qa, signature.args[0], _V8)
        tp = context.make_array(signature.args[1])(context, builder, args[1]).data
        sp = context.make_array(signature.args[2])(context, builder, args[2]).data
        tp = builder.gep(builder.bitcast(tp, _I64.as_pointer()), [args[3]])
        sp = builder.gep(builder.bitcast(sp, _I64.as_pointer()), [args[3]])
        for j in range(8):
            sh = builder.lshr(mag, ir.Constant(_V8, [j] * 32))
            t = builder.bitcast(builder.trunc(sh, _M32), _I32)
            s = builder.bitcast(builder.icmp_unsigned("!=", sh, ir.Constant(_V8, None)), _I32)
            builder.store(builder.zext(t, _I64), builder.gep(tp, [ir.Constant(_I64, j)]))
            builder.store(builder.zext(s, _I64), builder.gep(sp, [ir.Constant(_I64, j)]))
        return context.get_dummy_value()

    return sig, codegen


_V8I64 = ir.VectorType(_I64, 8)


@intrinsic
def _costs8(typingctx, S, o, m):  # type: ignore[no-untyped-def]
    """Find the cheapest patched-planes ``k`` of a block whose maximum is ``1 <= m < 2^8``.

    ``S[o + j]`` (int64, ``j < 8``) are the lanes with ``|q| >= 2^j``, 0 at and above
    ``bitlen(m)``, as :func:`_planes_abs8` leaves them. Returns ``(cost << 3) | k`` for the
    smallest cost over ``k < bitlen(m)``, the smallest ``k`` among equal costs: the cost of
    ``k = 0`` is ``32 + p_0 + p_0 * bitlen(m - 1)``, of ``k >= 1`` it is ``64 + 32k +
    p_k * bitlen((m >> k) - 1)``, with ``p_k`` the population count of ``S[k]`` (rules 3-4
    of docs/format.md, as :func:`v2blocks._choose_max` computes them with a loop that ends
    at a ``k`` which changes from block to block). All 8 costs in one vector: population
    counts, variable shifts, leading-zero counts, a multiply and a minimum reduction, and
    no branch.
    """
    sig = types.int64(S, types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        sa = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(builder.bitcast(sa.data, _I64.as_pointer()), [args[1]])
        sv = builder.load(builder.bitcast(ptr, _V8I64.as_pointer()), align=8)
        mod = builder.module
        ctpop = mod.declare_intrinsic("llvm.ctpop.v8i64", fnty=ir.FunctionType(_V8I64, [_V8I64]))
        ctlz = mod.declare_intrinsic("llvm.ctlz.v8i64",
                                     fnty=ir.FunctionType(_V8I64, [_V8I64, ir.IntType(1)]))
        umin = mod.declare_intrinsic("llvm.vector.reduce.umin.v8i64",
                                     fnty=ir.FunctionType(_I64, [_V8I64]))
        p = builder.call(ctpop, [sv])
        m = args[2]
        ms = builder.insert_element(ir.Constant(_V8I64, ir.Undefined), m, ir.Constant(_I32, 0))
        ms = builder.shuffle_vector(ms, ir.Constant(_V8I64, ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, 8), [0] * 8))
        ks = ir.Constant(_V8I64, list(range(8)))
        d = builder.sub(builder.lshr(ms, ks), ir.Constant(_V8I64, [1] * 8))
        bl = builder.sub(ir.Constant(_V8I64, [64] * 8),
                         builder.call(ctlz, [d, ir.Constant(ir.IntType(1), 0)]))
        base = ir.Constant(_V8I64, [32] + [64 + 32 * k for k in range(1, 8)])
        p0 = builder.and_(p, ir.Constant(_V8I64, [-1] + [0] * 7))
        cost = builder.add(builder.add(base, p0), builder.mul(p, bl))
        key = builder.or_(builder.shl(cost, ir.Constant(_V8I64, [3] * 8)), ks)
        w = builder.sub(ir.Constant(_I64, 64),
                        builder.ctlz(m, ir.Constant(ir.IntType(1), 0)))
        ws = builder.insert_element(ir.Constant(_V8I64, ir.Undefined), w, ir.Constant(_I32, 0))
        ws = builder.shuffle_vector(ws, ir.Constant(_V8I64, ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, 8), [0] * 8))
        key = builder.select(builder.icmp_unsigned("<", ks, ws), key,
                             ir.Constant(_V8I64, [(1 << 63) - 1] * 8))
        return builder.call(umin, [key])

    return sig, codegen


@intrinsic
def _bits_at(typingctx, W, bit, last):  # type: ignore[no-untyped-def]
    """Return the bits of ``W`` from bit ``bit`` on (at least 57), ``W`` read as a bit stream.

    One unaligned 8-byte load at byte ``min(bit >> 3, last)`` shifted right by the rest
    (a logical shift), with no branch. ``last = W.nbytes - 8`` (``W`` at least 8 bytes)
    keeps the load inside ``W``; a field that ends inside ``W`` is then whole in the result
    (near the end the shift is larger, and the bytes after ``W``'s end are never needed).
    Little-endian byte order, as the stream's.
    """
    sig = types.int64(W, types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        pos, last = args[1], args[2]
        q = builder.ashr(pos, ir.Constant(_I64, 3))
        q = builder.select(builder.icmp_signed("<", q, last), q, last)
        ptr = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()), [q])
        v = builder.load(builder.bitcast(ptr, _I64.as_pointer()), align=1)
        # The shift reaches 64 only for a width-0 read at or after W's end; the mask keeps
        # it defined (x86's shift masks its count the same way, so it costs nothing there).
        sh = builder.and_(builder.sub(pos, builder.shl(q, ir.Constant(_I64, 3))),
                          ir.Constant(_I64, 63))
        return builder.lshr(v, sh)

    return sig, codegen


def _host_has(feature: str) -> bool:
    """Whether numba compiles for this machine's CPU and that CPU has ``feature``."""
    try:
        import numba
        from llvmlite import binding as llb

        cfg = numba.config
        if getattr(cfg, "CPU_NAME", None) or getattr(cfg, "CPU_FEATURES", None):
            return False  # a target other than the host's: no x86-only intrinsics
        return bool(llb.get_host_cpu_features().get(feature, False))
    except Exception:  # noqa: BLE001 - no feature list: the portable loop
        return False


# The decoder's small-magnitude blocks (v2blocks._read_lut_at) map |q| to the output float
# through a table of 2^LUT_BITS float32 values, one permute per 16 lanes with AVX-512.
HAVE_AVX512 = _host_has("avx512f")
LUT_BITS = 6
_V16I = ir.VectorType(_I32, 16)
_V16F = ir.VectorType(ir.FloatType(), 16)


def _lut_store(out, base, tab, pl, k, neg):  # type: ignore[no-untyped-def]
    """Write 32 float32 values ``+-tab[lo + ((hi + f) << k)]`` to ``out[base:base+32]``.

    ``pl`` (int64) holds ``LUT_BITS - 1`` low planes (bit ``l`` of word ``j``: bit ``j``
    of lane ``l``'s ``lo``), then ``X0`` and ``X1``, the ``hi`` of lanes 0-15 and 16-31
    as 4-bit fields (lane ``l``'s at bit ``4 * (l % 16)``), then ``f``, a word with bit
    ``l`` set where 1 is added to ``hi``. Lane ``l`` is negative where bit ``l`` of
    ``neg`` is set and its index is not 0. The index must be below ``2^LUT_BITS``.
    """
    raise NotImplementedError  # only called from numba code, see the overload below


@njit(nogil=True, cache=True, inline="always")
def _lut_store_sw(out, base, tab, pl, k, neg):  # type: ignore[no-untyped-def]
    """Portable :func:`_lut_store` (any float ``out``), one lane at a time."""
    nlo = LUT_BITS - 1
    for l in range(32):
        lo = np.int64(0)
        for j in range(nlo):
            lo |= ((pl[j] >> l) & 1) << j
        hi = (pl[nlo + (l >> 4)] >> (4 * (l & 15))) & 15
        i = lo + ((hi + ((pl[nlo + 2] >> l) & 1)) << k)
        v = tab[i]
        out[base + l] = -v if (neg >> l) & 1 and i else v


def _lut_codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
    o = context.make_array(signature.args[0])(context, builder, args[0])
    t = context.make_array(signature.args[2])(context, builder, args[2])
    p = context.make_array(signature.args[3])(context, builder, args[3])
    pp = builder.bitcast(p.data, _I64.as_pointer())
    nlo = LUT_BITS - 1

    def word(i):  # type: ignore[no-untyped-def]
        return builder.load(builder.gep(pp, [ir.Constant(_I64, i)]))

    def plane(w):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.trunc(w, _I32), _M32)

    def splat(v):  # type: ignore[no-untyped-def]
        return ir.Constant(_V32, [v] * 32)

    zero = ir.Constant(_V32, None)
    lo = zero
    for j in range(nlo):  # a masked OR per plane
        lo = builder.or_(lo, builder.select(plane(word(j)), splat(1 << j), zero))
    # hi: the 4 words of 8 lanes' 4-bit fields, each broadcast to its 8 lanes and shifted
    x0, x1 = word(nlo), word(nlo + 1)
    c32 = ir.Constant(_I64, 32)
    parts = [x0, builder.lshr(x0, c32), x1, builder.lshr(x1, c32)]
    v = ir.Constant(_V32, ir.Undefined)
    for q in range(4):
        v = builder.insert_element(v, builder.trunc(parts[q], _I32), ir.Constant(_I32, 8 * q))
    v = builder.shuffle_vector(v, ir.Constant(_V32, ir.Undefined),
                               ir.Constant(_V32, [8 * (l // 8) for l in range(32)]))
    hi = builder.and_(builder.lshr(v, ir.Constant(_V32, [4 * (l % 8) for l in range(32)])),
                      splat(15))
    f = builder.select(plane(word(nlo + 2)), splat(1), zero)
    ks = _splat32(builder, builder.trunc(args[4], _I32))
    idx = builder.add(lo, builder.shl(builder.add(hi, f), ks))
    tp = builder.bitcast(t.data, _V16F.as_pointer())
    tabs = [builder.load(builder.gep(tp, [ir.Constant(_I64, i)]), align=4)
            for i in range(1 << (LUT_BITS - 4))]
    perm = builder.module.declare_intrinsic(
        "llvm.x86.avx512.vpermi2var.ps.512", fnty=ir.FunctionType(_V16F, [_V16F, _V16I, _V16F]))
    halves = []
    for hh in range(2):
        half = ir.Constant(_V16I, list(range(16 * hh, 16 * hh + 16)))
        ix = builder.shuffle_vector(idx, idx, half)
        res = [builder.call(perm, [tabs[2 * g], ix, tabs[2 * g + 1]])
               for g in range(1 << (LUT_BITS - 5))]  # one permute per 32 table entries
        bitn = 5
        while len(res) > 1:  # then a blend on each higher index bit
            hit = builder.and_(ix, ir.Constant(_V16I, [1 << bitn] * 16))
            sel = builder.icmp_unsigned("!=", hit, ir.Constant(_V16I, None))
            res = [builder.select(sel, res[2 * g + 1], res[2 * g]) for g in range(len(res) // 2)]
            bitn += 1
        halves.append(builder.bitcast(res[0], _V16I))
    r = builder.shuffle_vector(halves[0], halves[1], ir.Constant(_V32, list(range(32))))
    negm = builder.and_(builder.bitcast(builder.trunc(args[5], _I32), _M32),
                        builder.icmp_unsigned("!=", idx, zero))
    r = builder.or_(r, builder.select(negm, splat(0x80000000), zero))  # the table is >= +0.0
    op = builder.gep(builder.bitcast(o.data, ir.FloatType().as_pointer()), [args[1]])
    builder.store(r, builder.bitcast(op, _V32.as_pointer()), align=4)
    return context.get_dummy_value()


@intrinsic
def _lut_store_hw(typingctx, out, base, tab, pl, k, neg):  # type: ignore[no-untyped-def]
    """:func:`_lut_store` with AVX-512 (float32 ``out`` and ``tab``, int64 ``pl``, all C)."""
    sig = types.void(out, types.int64, tab, pl, types.int64, types.int64)
    return sig, _lut_codegen


@overload(_lut_store)
def _lut_store_impl(out, base, tab, pl, k, neg):  # type: ignore[no-untyped-def]
    if HAVE_AVX512 and out.dtype == types.float32 and tab.dtype == types.float32:
        return lambda out, base, tab, pl, k, neg: _lut_store_hw(out, np.int64(base), tab, pl,
                                                                np.int64(k), np.int64(neg))
    return lambda out, base, tab, pl, k, neg: _lut_store_sw(out, base, tab, pl, k, neg)


# Conversions between float64 and int64 are one vector instruction each with AVX-512DQ;
# without it (AVX2: Zen 3 and older, most Intel client cores) LLVM converts lane by lane
# (vcvttsd2si / vcvtsi2sd and moves between vector and general registers): 17% of format
# 1's compress on a Zen 3 core (docs/dev/avx2.md). A quantized value has |q| < 2^31, so it
# converts exactly through int32, which AVX2 does 4 lanes at a time.
HAVE_AVX512DQ = _host_has("avx512dq")
# A population count of every 64-bit lane in one instruction (AVX-512 VPOPCNTDQ).
HAVE_VPOPCNT = _host_has("avx512vpopcntdq")


@njit(nogil=True, cache=True, inline="always")
def _int_via_i32(d):  # type: ignore[no-untyped-def]
    """``int64(d)`` for an integer-valued float64 with ``|d| < 2^31``, through int32."""
    return np.int64(np.int32(d))


@njit(nogil=True, cache=True, inline="always")
def _float_via_i32(i):  # type: ignore[no-untyped-def]
    """``float64(i)`` for an int64 with ``|i| < 2^31``, through int32 (exact)."""
    return np.float64(np.int32(i))


@njit(nogil=True, cache=True, inline="always")
def _q_int(d):  # type: ignore[no-untyped-def]
    """``int64(d)`` of an integer-valued float64 with ``|d| < 2^31`` (a quantized value)."""
    if HAVE_AVX512DQ:
        return np.int64(d)
    return _int_via_i32(d)


@njit(nogil=True, cache=True, inline="always")
def _q_float(i):  # type: ignore[no-untyped-def]
    """``float64(i)`` of an int64 with ``|i| < 2^31`` (a quantized value), exactly."""
    if HAVE_AVX512DQ:
        return np.float64(i)
    return _float_via_i32(i)


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


# A patched-planes block of format 2 whose values fit 31 bits, built and stored in 32-bit
# lanes: AVX2 has 8-lane 32-bit shifts, adds and selects and converts 4 int32 lanes to
# float64 per instruction, where the same work in int64 lanes goes through memory twice
# and through 64-bit lanes (docs/dev/avx2.md, "The decoder in 32-bit lanes").
_PP_SLOTS = (2, 4, 8)  # slot widths in bits: 32 slots in 1, 2 or 4 int64 words


def _pp_store_codegen(slot):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        out_t = signature.args[0]
        o = context.make_array(out_t)(context, builder, args[0])
        lo_a = context.make_array(signature.args[2])(context, builder, args[2])
        sl_a = context.make_array(signature.args[3])(context, builder, args[3])
        base, m, k, sign, step = args[1], args[4], args[5], args[6], args[7]
        zero = ir.Constant(_V32, None)
        lo = builder.load(builder.bitcast(lo_a.data, _V32.as_pointer()), align=4)
        words = builder.load(builder.bitcast(sl_a.data, ir.VectorType(_I32, 8).as_pointer()),
                             align=4)
        # lane l's field: bits slot*l .. of the slot words, as 32-bit words read little-endian
        hi = builder.shuffle_vector(words, ir.Constant(ir.VectorType(_I32, 8), ir.Undefined),
                                    ir.Constant(_V32, [(slot * l) >> 5 for l in range(32)]))
        hi = builder.and_(builder.lshr(hi, ir.Constant(_V32, [(slot * l) & 31 for l in range(32)])),
                          ir.Constant(_V32, [(1 << slot) - 1] * 32))
        one = ir.Constant(_V32, [1] * 32)
        add = builder.shl(builder.add(hi, one), _splat32(builder, builder.trunc(k, _I32)))
        fm = builder.bitcast(builder.trunc(m, _I32), _M32)
        v = builder.add(lo, builder.select(fm, add, zero))
        neg = builder.bitcast(builder.trunc(sign, _I32), _M32)
        v = builder.select(neg, builder.sub(zero, v), v)
        v64 = ir.VectorType(ir.DoubleType(), 32)
        d = builder.sitofp(v, v64)
        sv = builder.insert_element(ir.Constant(v64, ir.Undefined), step, ir.Constant(_I32, 0))
        sv = builder.shuffle_vector(sv, ir.Constant(v64, ir.Undefined), ir.Constant(_V32, [0] * 32))
        d = builder.fmul(d, sv)
        if out_t.dtype == types.float32:
            ft = ir.FloatType()
            r = builder.fptrunc(d, ir.VectorType(ft, 32))
        else:
            ft = ir.DoubleType()
            r = d
        op = builder.gep(builder.bitcast(o.data, ft.as_pointer()), [base])
        builder.store(r, builder.bitcast(op, ir.VectorType(ft, 32).as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


_PP_STORE_DOC = """Store a patched-planes block of 32 lanes to ``out[base:base+32]``.

``out[base + l] = T(float64(v) * step)`` (``T`` the dtype of the float32/float64 C array
``out``), ``v = +-(lo[l] + ((f + 1) << k))`` where bit ``l`` of ``m`` is set (a high
lane), ``+-lo[l]`` elsewhere, negative where bit ``l`` of ``sign`` is set. ``lo`` is 32
uint32, ``sl`` 4 int64 words holding lane ``l``'s ``f`` at bit ``S * l`` (``S`` = 2, 4 or
8 for ``_pp_store2``, ``4``, ``8``; read as little-endian 32-bit words). Every ``v``
must have ``|v| < 2^31``.
"""


def _pp_store_intrinsic(slot):  # type: ignore[no-untyped-def]
    def typer(typingctx, out, base, lo, sl, m, k, sign, step):  # type: ignore[no-untyped-def]
        sig = types.void(out, types.int64, lo, sl, types.int64, types.int64, types.int64,
                         types.float64)
        return sig, _pp_store_codegen(slot)

    typer.__name__ = f"_pp_store{slot}"
    typer.__doc__ = _PP_STORE_DOC
    return intrinsic(typer)


_pp_store2, _pp_store4, _pp_store8 = (_pp_store_intrinsic(s) for s in _PP_SLOTS)


def _bitlen_table8() -> np.ndarray:
    """``T[m]``, byte ``k``: ``bitlen((m >> k) - 1)`` for ``m < 2^8`` (0 where ``m >> k = 0``)."""
    t = np.zeros(256, np.uint64)
    for m in range(256):
        t[m] = sum(max((m >> k) - 1, 0).bit_length() << (8 * k) for k in range(8))
    return t.view(np.int64)


# _costs8's 8 costs in 32-bit lanes, for machines without AVX-512 (docs/dev/avx2.md, "The
# choice in 32-bit lanes"): AVX2 has no 64-bit population count, leading-zero count,
# multiply or unsigned minimum, and LLVM builds each from several instructions per lane
# pair. Everything the costs need fits 32 bits, and the bit lengths come from a table.
BITLEN8 = _bitlen_table8()


@intrinsic
def _costs8_32(typingctx, S, o, m, tab):  # type: ignore[no-untyped-def]
    """:func:`_costs8` (the same result) in 32-bit lanes; ``tab`` is :data:`BITLEN8`."""
    sig = types.int64(S, types.int64, types.int64, tab)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        v8 = ir.VectorType(_I32, 8)
        sa = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(builder.bitcast(sa.data, _I64.as_pointer()), [args[1]])
        sv = builder.trunc(builder.load(builder.bitcast(ptr, _V8I64.as_pointer()), align=8), v8)
        mod = builder.module
        ctpop = mod.declare_intrinsic("llvm.ctpop.v8i32", fnty=ir.FunctionType(v8, [v8]))
        umin = mod.declare_intrinsic("llvm.vector.reduce.umin.v8i32",
                                     fnty=ir.FunctionType(_I32, [v8]))
        p = builder.call(ctpop, [sv])
        m = args[2]
        ta = context.make_array(signature.args[3])(context, builder, args[3])
        bw = builder.load(builder.gep(builder.bitcast(ta.data, _I64.as_pointer()), [m]))
        bl = builder.zext(builder.bitcast(bw, ir.VectorType(ir.IntType(8), 8)), v8)
        ks = ir.Constant(v8, list(range(8)))
        base = ir.Constant(v8, [32] + [64 + 32 * k for k in range(1, 8)])
        p0 = builder.and_(p, ir.Constant(v8, [-1] + [0] * 7))
        cost = builder.add(builder.add(base, p0), builder.mul(p, bl))
        key = builder.or_(builder.shl(cost, ir.Constant(v8, [3] * 8)), ks)
        w = builder.trunc(builder.sub(ir.Constant(_I64, 64),
                                      builder.ctlz(m, ir.Constant(ir.IntType(1), 0))), _I32)
        ws = builder.insert_element(ir.Constant(v8, ir.Undefined), w, ir.Constant(_I32, 0))
        ws = builder.shuffle_vector(ws, ir.Constant(v8, ir.Undefined), ir.Constant(v8, [0] * 8))
        key = builder.select(builder.icmp_unsigned("<", ks, ws), key,
                             ir.Constant(v8, [(1 << 31) - 1] * 8))
        return builder.zext(builder.call(umin, [key]), _I64)

    return sig, codegen
