"""A slow, independent reading of docs/format.md, and tests that ccoll matches it byte for byte.

The reference below uses only Python floats (IEEE float64), ``math.floor``, ``struct`` and a
numpy cast for rounding to float32; it shares no code with ccoll. Tests compare ccoll's
streams, decoded values and homomorphic sums with it, and parse a stream by hand to check
the layout section by section.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ccoll.compressor import add, add_data, compress_abs, decompress

HEADER = struct.Struct("<4sBBBBIIQddQQII")
QLIM = 2**31 - 1
NAN64 = 0x7FF8000000000000


def _to_dtype(d: float, is32: bool) -> float:
    """float64 value after rounding ``d`` to the stream dtype (nearest-even)."""
    return float(np.float32(d)) if is32 else d


def _bits(v: float | np.floating, is32: bool) -> int:
    a = np.array(v, np.float32 if is32 else np.float64)
    return int(a.view(np.uint32 if is32 else np.uint64))


def _bitlen(v: int) -> int:
    return v.bit_length()


def _fixed_code(q: list[int], m: int) -> tuple[int, list[int]]:
    """Rule 4: code byte and the codes c of the chosen predictor."""
    cq = list(q)
    cl = [q[i] - (q[i - 1] if i else 0) if i < m else 0 for i in range(32)]
    wq = _bitlen(max(abs(c) for c in cq))
    wl = _bitlen(max(abs(c) for c in cl))
    if wl < wq:
        return 0x80 | wl, cl
    return wq, cq


def _fixed_words(c: list[int], w: int) -> list[int]:
    sign = sum(1 << i for i in range(32) if c[i] < 0)
    planes = [sum(((abs(c[i]) >> j) & 1) << i for i in range(32)) for j in range(w)]
    return [sign] + planes


def _raw_words(vals: list[float], is32_values: bool,
               bits_list: list[int] | None = None) -> list[int]:
    words: list[int] = []
    for i in range(32):
        if i < len(vals):
            b = bits_list[i] if bits_list is not None else _bits(vals[i], is32_values)
        else:
            b = 0
        if is32_values:
            words.append(b)
        else:
            words += [b & 0xFFFFFFFF, b >> 32]
    return words


def ref_blocks(x: np.ndarray, eb: float) -> list[tuple[int, list[int]]]:
    """(code, payload words) of every block of ``x`` (C order), following format.md."""
    flat = np.ascontiguousarray(x).reshape(-1)
    is32 = flat.dtype == np.float32
    all_bits = flat.view(np.uint32 if is32 else np.uint64).tolist()
    all_vals = flat.astype(np.float64).tolist()  # exact
    out = []
    step = 2.0 * eb
    for b0 in range(0, flat.size, 32):
        vals = all_vals[b0 : b0 + 32]
        m = len(vals)
        bits = all_bits[b0 : b0 + 32]
        sign_mask = (1 << 31) if is32 else (1 << 63)
        if eb == 0.0:
            if all((bb & ~sign_mask) == 0 for bb in bits):
                out.append((0, []))
            else:
                out.append((32, _raw_words(vals, is32, bits)))
            continue
        q: list[int] = []
        ok = True
        for xd in vals:
            t = xd / step
            if not abs(t) < QLIM:
                ok = False
                break
            qi = math.floor(t + 0.5)
            y = _to_dtype(float(qi) * step, is32)
            if not abs(y - xd) < eb:
                ok = False
                break
            q.append(qi)
        if not ok:
            out.append((32, _raw_words(vals, is32, bits)))
            continue
        q += [0] * (32 - m)
        if not any(q):
            out.append((0, []))
            continue
        code, c = _fixed_code(q, m)
        out.append((code, _fixed_words(c, code & 0x7F)))
    return out


def ref_assemble(blocks: list[tuple[int, list[int]]], dtype: np.dtype, shape: tuple[int, ...],
                 eb: float, bound: float, nterms: int) -> bytes:
    n = math.prod(shape)
    nblocks = (n + 31) // 32
    bitmap = [0] * ((nblocks + 31) // 32)
    codes = bytearray()
    payload: list[int] = []
    for b, (code, words) in enumerate(blocks):
        if code:
            bitmap[b // 32] |= 1 << (b % 32)
            codes.append(code)
            payload += words
    nnz = len(codes)
    codes += b"\0" * ((-nnz) % 4)
    head = HEADER.pack(b"CCOL", 1, 1 if dtype == np.float32 else 2, len(shape), 0, 32, 0, n,
                       eb, bound, nnz, len(payload), nterms, 0)
    return (head + struct.pack(f"<{len(shape)}Q", *shape) + struct.pack(f"<{len(bitmap)}I", *bitmap)
            + bytes(codes) + struct.pack(f"<{len(payload)}I", *payload))


def ref_compress(x: np.ndarray, eb: float) -> bytes:
    with np.errstate(over="ignore"):  # float32 rounding may overflow to inf (then raw)
        return ref_assemble(ref_blocks(x, eb), x.dtype, x.shape, eb, eb, 1)


def ref_parse(buf: bytes) -> dict:
    """Split a stream into its sections by hand (format.md, "Overview")."""
    (magic, version, dcode, ndim, r0, block, r1, n, eb, bound, nnz, pwords, nterms, r2) = (
        HEADER.unpack_from(buf, 0))
    shape = struct.unpack_from(f"<{ndim}Q", buf, 64)
    nblocks = (n + 31) // 32
    bw = (nblocks + 31) // 32
    off = 64 + 8 * ndim
    bitmap = struct.unpack_from(f"<{bw}I", buf, off)
    off += 4 * bw
    codes = buf[off : off + nnz]
    pad = buf[off + nnz : off + nnz + (-nnz) % 4]
    off += nnz + (-nnz) % 4
    payload = struct.unpack_from(f"<{pwords}I", buf, off)
    is32 = dcode == 1
    blocks = []
    k = 0
    pos = 0
    for b in range(nblocks):
        if not (bitmap[b // 32] >> (b % 32)) & 1:
            blocks.append((0, []))
            continue
        code = codes[k]
        k += 1
        size = (32 if is32 else 64) if code == 32 else 64 if code == 33 else 1 + (code & 0x7F)
        blocks.append((code, list(payload[pos : pos + size])))
        pos += size
    return dict(magic=magic, version=version, dcode=dcode, ndim=ndim, reserved=(r0, r1, r2),
                block=block, n=n, eb=eb, bound=bound, nnz=nnz, payload_words=pwords,
                nterms=nterms, shape=shape, bitmap=bitmap, codes=bytes(codes), pad=bytes(pad),
                payload_end=off + 4 * pwords, blocks=blocks, is32=is32)


def ref_block_values(code: int, words: list[int], m: int, step: float, is32: bool,
                     unrounded: bool = False) -> list[float]:
    """float64 values of the m valid lanes; fixed lanes rounded to the dtype unless asked."""
    if code == 0:
        return [0.0] * m
    if code == 32 and is32:
        return [float(np.array(w, np.uint32).view(np.float32)) for w in words[:m]]
    if code in (32, 33):
        return [float(np.array(words[2 * i] | (words[2 * i + 1] << 32), np.uint64)
                      .view(np.float64)) for i in range(m)]
    w = code & 0x7F
    mags = [sum(((words[1 + j] >> i) & 1) << j for j in range(w)) for i in range(32)]
    c = [-mags[i] if (words[0] >> i) & 1 else mags[i] for i in range(32)]
    if code & 0x80:
        c = [sum(c[: i + 1]) for i in range(32)]
    vals = [float(ci) * step for ci in c[:m]]
    if unrounded:
        return vals
    with np.errstate(over="ignore"):
        return [_to_dtype(v, is32) for v in vals]


def ref_decompress(buf: bytes) -> np.ndarray:
    s = ref_parse(buf)
    is32 = s["is32"]
    step = 2.0 * s["eb"]
    vals: list[float] = []
    for b, (code, words) in enumerate(s["blocks"]):
        m = min(32, s["n"] - 32 * b)
        if code == 32:
            # raw blocks of the stream dtype: bit patterns, NaN payloads included
            dt = np.uint32 if is32 else np.uint64
            bits = (words[:m] if is32
                    else [words[2 * i] | (words[2 * i + 1] << 32) for i in range(m)])
            vals += list(np.array(bits, dt).view(np.float32 if is32 else np.float64))
        else:
            vals += ref_block_values(code, words, m, step, is32)
    dt = np.float32 if is32 else np.float64
    with np.errstate(all="ignore"):
        return np.array(vals, dt).reshape(s["shape"])


def _up(a: float, b: float) -> float:
    s = a + b
    from fractions import Fraction

    if Fraction(s) < Fraction(a) + Fraction(b):
        s = math.nextafter(s, math.inf)
    return s


def ref_add(bufa: bytes, bufb: bytes) -> bytes:
    sa, sb = ref_parse(bufa), ref_parse(bufb)
    is32 = sa["is32"]
    step = 2.0 * sa["eb"]
    n = sa["n"]
    blocks = []
    for b, ((ca, wa), (cb, wb)) in enumerate(zip(sa["blocks"], sb["blocks"], strict=True)):
        m = min(32, n - 32 * b)
        if ca == 0 or cb == 0:
            blocks.append((ca, wa) if cb == 0 else (cb, wb))
            continue
        if ca not in (32, 33) and cb not in (32, 33):
            qa = ref_block_values(ca, wa, m, 1.0, is32, unrounded=True)
            qb = ref_block_values(cb, wb, m, 1.0, is32, unrounded=True)
            q = [int(u) + int(v) for u, v in zip(qa, qb, strict=True)] + [0] * (32 - m)
            if all(abs(v) < QLIM for v in q):
                if not any(q):
                    blocks.append((0, []))
                else:
                    code, c = _fixed_code(q, m)
                    blocks.append((code, _fixed_words(c, code & 0x7F)))
                continue
        va = ref_block_values(ca, wa, m, step, is32, unrounded=True)
        vb = ref_block_values(cb, wb, m, step, is32, unrounded=True)
        bits = []
        for u, v in zip(va, vb, strict=True):
            s = u + v
            bits.append(NAN64 if s != s else _bits(s, False))
        blocks.append((33 if is32 else 32, _raw_words([0.0] * m, False, bits)))
    return ref_assemble(blocks, np.dtype(np.float32 if is32 else np.float64), sa["shape"],
                        sa["eb"], _up(sa["bound"], sb["bound"]), sa["nterms"] + sb["nterms"])


# ------------------------------------------ version 2 (docs/format.md, "Format version 2")
#
# Bit streams are Python integers here (bit i of the integer = bit i of the section), so
# fields are shifts and masks; blocks are kept as (code, mask or None, payload int, bits).


def ref_q_blocks(x: np.ndarray, eb: float) -> list[tuple[str, list[int]]]:
    """Each block of ``x`` as ("zero", []), ("raw", bit patterns) or ("q", 32 values)."""
    flat = np.ascontiguousarray(x).reshape(-1)
    out: list[tuple[str, list[int]]] = []
    for code, words in ref_blocks(x, eb):
        b = len(out)
        m = min(32, flat.size - 32 * b)
        if code == 0:
            out.append(("zero", []))
        elif code == 32:
            is32 = flat.dtype == np.float32
            bits = (words[:m] if is32
                    else [words[2 * i] | (words[2 * i + 1] << 32) for i in range(m)])
            out.append(("raw", bits))
        else:
            w = code & 0x7F
            mags = [sum(((words[1 + j] >> i) & 1) << j for j in range(w)) for i in range(32)]
            c = [-mags[i] if (words[0] >> i) & 1 else mags[i] for i in range(32)]
            if code & 0x80:
                c = [sum(c[: i + 1]) for i in range(32)]
            out.append(("q", [c[i] if i < m else 0 for i in range(32)]))  # padding q = 0
    return out


def ref_v2_block(q: list[int]) -> tuple[int, int | None, int, int]:
    """Rules 3-4 of version 2: (code, mask or None, payload bits as an int, their count)."""
    a = [abs(v) for v in q]
    m = max(a)
    w = _bitlen(m)
    c = sum(v != 0 for v in q)
    best = None
    for k in range(w):
        p = sum(v >= (1 << k) for v in a)
        h = _bitlen((m >> k) - 1)
        cost = 32 + (p if k == 0 else 32) + 32 * k + p * h
        if best is None or cost < best[0]:
            best = (cost, k, h)
    assert best is not None
    cost, k, h = best
    fields: list[tuple[int, int]] = []
    v = _bitlen(m - 1)
    if c <= 4 and c * (6 + v) <= cost:
        lanes = [i for i in range(32) if q[i] != 0]
        fields = ([(i, 5) for i in lanes] + [(int(q[i] < 0), 1) for i in lanes]
                  + [(a[i] - 1, v) for i in lanes])
        code, mask = (1 << 10) | ((c - 1) << 5) | v, None
    else:
        high = [i for i in range(32) if a[i] >= (1 << k)]
        mask = sum(1 << i for i in high)
        if k == 0:
            fields = [(int(q[i] < 0), 1) for i in high]
        else:
            fields = [(sum(1 << i for i in range(32) if q[i] < 0), 32)]
        for j in range(k):
            fields.append((sum(((a[i] >> j) & 1) << i for i in range(32)), 32))
        fields += [((a[i] >> k) - 1, h) for i in high]
        code = (k << 5) | h
    val, nb = 0, 0
    for f, wd in fields:
        assert 0 <= f < (1 << wd) or (wd == 0 and f == 0)
        val |= f << nb
        nb += wd
    return code, mask, val, nb


def ref_v2_raw(bits: list[int], width: int, kind: int) -> tuple[int, None, int, int]:
    val = 0
    for i, b in enumerate(bits):
        val |= b << (width * i)
    return kind << 10, None, val, 32 * width


def ref_assemble_v2(blocks: list[tuple[int, int | None, int, int] | None], dtype: np.dtype,
                    shape: tuple[int, ...], eb: float, bound: float, nterms: int) -> bytes:
    n = math.prod(shape)
    nblocks = (n + 31) // 32
    bitmap = [0] * ((nblocks + 31) // 32)
    nz = [(b, blk) for b, blk in enumerate(blocks) if blk is not None]
    for b, _ in nz:
        bitmap[b // 32] |= 1 << (b % 32)
    table = sorted({blk[0] for _, blk in nz})
    ib = _bitlen(len(table) - 1) if table else 0
    index = sum(table.index(blk[0]) << (ib * j) for j, (_, blk) in enumerate(nz))
    masks = [blk[1] for _, blk in nz if blk[1] is not None]
    pay, nbits = 0, 0
    for _, (_, _, val, nb) in nz:
        pay |= val << nbits
        nbits += nb
    tab = struct.pack(f"<{len(table)}H", *table)
    tab += b"\0" * (-len(tab) % 4)
    head = HEADER.pack(b"CCOL", 2, 1 if dtype == np.float32 else 2, len(shape), 0, 32,
                       len(masks), n, eb, bound, len(nz), (nbits + 31) // 32, nterms, len(table))
    return (head + struct.pack(f"<{len(shape)}Q", *shape) + struct.pack(f"<{len(bitmap)}I", *bitmap)
            + tab + index.to_bytes(4 * ((len(nz) * ib + 31) // 32), "little")
            + struct.pack(f"<{len(masks)}I", *masks) + pay.to_bytes(4 * ((nbits + 31) // 32),
                                                                     "little"))


def ref_compress_v2(x: np.ndarray, eb: float) -> bytes:
    is32 = x.dtype == np.float32
    blocks: list[tuple[int, int | None, int, int] | None] = []
    with np.errstate(over="ignore"):
        for kind, vals in ref_q_blocks(x, eb):
            if kind == "zero":
                blocks.append(None)
            elif kind == "raw":
                blocks.append(ref_v2_raw(vals, 32 if is32 else 64, 2))
            else:
                blocks.append(ref_v2_block(vals))
    return ref_assemble_v2(blocks, x.dtype, x.shape, eb, eb, 1)


def ref_parse_v2(buf: bytes) -> dict:
    """Split a version-2 stream into its blocks by hand: (code, mask, payload int, bits)."""
    (magic, version, dcode, ndim, r0, block, nmask, n, eb, bound, nnz, pwords, nterms,
     ntab) = HEADER.unpack_from(buf, 0)
    assert (magic, version, r0, block) == (b"CCOL", 2, 0, 32)
    is32 = dcode == 1
    shape = struct.unpack_from(f"<{ndim}Q", buf, 64)
    nblocks = (n + 31) // 32
    off = 64 + 8 * ndim
    bw = (nblocks + 31) // 32
    bitmap = int.from_bytes(buf[off : off + 4 * bw], "little")
    off += 4 * bw
    table = struct.unpack_from(f"<{ntab}H", buf, off)
    off += 4 * ((ntab + 1) // 2)
    ib = _bitlen(ntab - 1) if ntab else 0
    nidx = 4 * ((nnz * ib + 31) // 32)
    index = int.from_bytes(buf[off : off + nidx], "little")
    off += nidx
    masks = struct.unpack_from(f"<{nmask}I", buf, off)
    off += 4 * nmask
    pay = int.from_bytes(buf[off : off + 4 * pwords], "little")
    assert off + 4 * pwords == len(buf)
    blocks: list[tuple[int, int | None, int, int] | None] = []
    j = r = pos = 0
    for b in range(nblocks):
        if not (bitmap >> b) & 1:
            blocks.append(None)
            continue
        code = table[(index >> (j * ib)) & ((1 << ib) - 1)]
        j += 1
        kind, a, v = code >> 10, (code >> 5) & 31, code & 31
        mask = None
        if kind == 0:
            mask = masks[r]
            r += 1
            p = bin(mask).count("1")
            size = (p if a == 0 else 32) + 32 * a + p * v
        elif kind == 1:
            size = (a + 1) * (6 + v)
        else:
            size = 1024 if kind == 2 and is32 else 2048
        blocks.append((code, mask, (pay >> pos) & ((1 << size) - 1), size))
        pos += size
    assert (pwords * 32 - pos) < 32 and pay >> pos == 0
    return dict(n=n, eb=eb, bound=bound, nterms=nterms, shape=shape, is32=is32, blocks=blocks,
                table=table)


def ref_v2_values(blk: tuple[int, int | None, int, int] | None, is32: bool
                  ) -> tuple[str, list]:
    """("q", 32 ints) for a quantized or zero block, ("raw", float64 values) for raw ones."""
    if blk is None:
        return "q", [0] * 32
    code, mask, val, _ = blk
    kind, a, v = code >> 10, (code >> 5) & 31, code & 31
    pos = 0

    def get(w: int) -> int:
        nonlocal pos
        f = (val >> pos) & ((1 << w) - 1)
        pos += w
        return f

    if kind == 1:
        c = a + 1
        lanes = [get(5) for _ in range(c)]
        assert all(lanes[i] < lanes[i + 1] for i in range(c - 1))
        sg = [get(1) for _ in range(c)]
        q = [0] * 32
        for i in range(c):
            mv = get(v) + 1
            q[lanes[i]] = -mv if sg[i] else mv
        return "q", q
    if kind == 0:
        assert mask is not None
        high = [i for i in range(32) if (mask >> i) & 1]
        if a == 0:
            neg = {i: get(1) for i in high}
        else:
            sw = get(32)
            neg = {i: (sw >> i) & 1 for i in range(32)}
        lo = [0] * 32
        for j in range(a):
            pl = get(32)
            for i in range(32):
                lo[i] |= ((pl >> i) & 1) << j
        mag = list(lo)
        for i in high:
            mag[i] = ((get(v) + 1) << a) + lo[i]
        return "q", [-mag[i] if neg.get(i, 0) else mag[i] for i in range(32)]
    if kind == 2 and is32:
        return "raw", [float(np.array(get(32), np.uint32).view(np.float32)) for _ in range(32)]
    return "raw", [float(np.array(get(64), np.uint64).view(np.float64)) for _ in range(32)]


def ref_decompress_v2(buf: bytes) -> np.ndarray:
    s = ref_parse_v2(buf)
    is32 = s["is32"]
    step = 2.0 * s["eb"]
    dt = np.float32 if is32 else np.float64
    out: list = []
    for b, blk in enumerate(s["blocks"]):
        m = min(32, s["n"] - 32 * b)
        kind, vals = ref_v2_values(blk, is32)
        if kind == "q":
            with np.errstate(over="ignore"):
                out += [dt(float(v) * step) for v in vals[:m]]
        elif blk is not None and blk[0] >> 10 == 2:
            # raw in the stream's dtype: bit patterns, NaN payloads included
            w = 32 if is32 else 64
            bits = [(blk[2] >> (w * i)) & ((1 << w) - 1) for i in range(m)]
            out += list(np.array(bits, np.uint32 if is32 else np.uint64).view(dt))
        else:
            with np.errstate(over="ignore"):
                out += [dt(v) for v in vals[:m]]
    with np.errstate(all="ignore"):
        return np.array(out, dt).reshape(s["shape"])


def ref_add_v2(bufa: bytes, bufb: bytes) -> bytes:
    sa, sb = ref_parse_v2(bufa), ref_parse_v2(bufb)
    is32 = sa["is32"]
    step = 2.0 * sa["eb"]
    n = sa["n"]
    blocks: list[tuple[int, int | None, int, int] | None] = []
    for b, (ba, bb) in enumerate(zip(sa["blocks"], sb["blocks"], strict=True)):
        m = min(32, n - 32 * b)
        if ba is None or bb is None:
            blocks.append(ba if bb is None else bb)
            continue
        ka, va = ref_v2_values(ba, is32)
        kb, vb = ref_v2_values(bb, is32)
        if ka == kb == "q":
            q = [va[i] + vb[i] if i < m else 0 for i in range(32)]
            if all(abs(v) < QLIM for v in q):
                blocks.append(ref_v2_block(q) if any(q) else None)
                continue
        fa = [float(v) * step for v in va] if ka == "q" else va
        fb = [float(v) * step for v in vb] if kb == "q" else vb
        bits = []
        for i in range(32):
            t = fa[i] + fb[i] if i < m else 0.0
            bits.append(0 if i >= m else NAN64 if t != t else _bits(t, False))
        blocks.append(ref_v2_raw(bits, 64, 3 if is32 else 2))
    return ref_assemble_v2(blocks, np.dtype(np.float32 if is32 else np.float64), sa["shape"],
                           sa["eb"], _up(sa["bound"], sb["bound"]), sa["nterms"] + sb["nterms"])


# -------------------------------------------------------------------------------- tests

_FLOAT_DTYPES = [np.float32, np.float64]
_SPECIALS = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-38, 3.4028235e38, -3.4028235e38, 1e38,
             math.inf, -math.inf, math.nan, 2.5e-3, -7.5e-3, 5e-3]


@st.composite
def arrays_and_bounds(draw, max_n: int = 200):  # type: ignore[no-untyped-def]
    dtype = draw(st.sampled_from(_FLOAT_DTYPES))
    n = draw(st.integers(0, max_n))
    kind = draw(st.sampled_from(["smooth", "noise", "any", "sparse"]))
    if kind == "any":
        elems = st.floats(width=32 if dtype == np.float32 else 64)
        x = draw(hnp.arrays(dtype, n, elements=elems))
    else:
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if kind == "smooth":
            x = np.cumsum(rng.standard_normal(n) * 1e-3).astype(dtype)
        elif kind == "noise":
            x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3)).astype(dtype)
        else:
            x = np.where(rng.random(n) < 0.9, 0.0, rng.standard_normal(n)).astype(dtype)
        if n and draw(st.booleans()):
            idx = draw(st.lists(st.integers(0, n - 1), max_size=4))
            for i in idx:
                x[i] = draw(st.sampled_from(_SPECIALS))
    eb = draw(st.one_of(
        st.sampled_from([0.0, 1e-30, 1e-7, 1e-4, 1e-3, 0.01, 0.5, 1e30, 5e-324, 1e308]),
        st.floats(1e-12, 10.0),
    ))
    return x, eb


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_bounds())
def test_stream_bytes_equal_the_reference(case):
    x, eb = case
    ours = compress_abs(x, eb)
    assert ours.tobytes() == ref_compress(x, eb)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_bounds(max_n=120))
def test_decoded_values_equal_the_reference(case):
    x, eb = case
    buf = compress_abs(x, eb)
    ours = decompress(buf)
    ref = ref_decompress(buf.tobytes())
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert ours.tobytes() == ref.tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_bounds(max_n=120), st.integers(0, 2**32 - 1), st.sampled_from([1.0, 1e3, 1e9]))
def test_homomorphic_sum_bytes_equal_the_reference(case, seed, scale):
    x, eb = case
    assume(eb < 1e307)  # larger bounds overflow the sum of bounds (tested elsewhere)
    rng = np.random.default_rng(seed)
    x2 = (rng.standard_normal(x.shape) * scale).astype(x.dtype)
    a, b = compress_abs(x, eb), compress_abs(x2, eb)
    assert add(a, b).tobytes() == ref_add(a.tobytes(), b.tobytes())


def test_hand_parsed_layout_matches_format_md():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((7, 23)) * 1e-2).astype(np.float32)  # 161 elements, 6 blocks
    x[0, :5] = 0.0
    x[1, 3] = np.nan
    x.reshape(-1)[64:96] = 0.0  # block 2 is a zero block
    x.reshape(-1)[96:128] = np.arange(32) * 1e-3  # a smooth block: Lorenzo
    eb = 1e-4
    buf = compress_abs(x, eb).tobytes()
    s = ref_parse(buf)
    assert s["magic"] == b"CCOL" and s["version"] == 1 and s["dcode"] == 1
    assert s["ndim"] == 2 and s["shape"] == (7, 23) and s["n"] == 161
    assert s["reserved"] == (0, 0, 0) and s["block"] == 32 and s["nterms"] == 1
    assert s["eb"] == eb and s["bound"] == eb
    assert s["payload_end"] == len(buf)  # the stream is exactly its sections
    assert len(s["bitmap"]) == 1 and s["bitmap"][0] == 0b111011  # 6 blocks, block 2 zero
    assert s["nnz"] == 5 and s["pad"] == b"\0\0\0"
    codes = s["codes"]
    assert codes[0] == 32  # block 0 holds the NaN: raw
    assert codes[2] & 0x80 and codes[2] & 0x7F <= 6  # Lorenzo on the smooth ramp
    # Block 5 is partial (1 valid lane); its raw or fixed payload zeroes the padding lanes.
    code5, words5 = s["blocks"][5]
    assert code5 not in (32, 33) and words5[0] >> 1 == 0
    assert all(w >> 1 == 0 for w in words5[1:])
    # Raw block words are the float32 bit patterns, in lane order.
    assert s["blocks"][0][1][:32] == list(x.reshape(-1)[:32].view(np.uint32))
    assert buf == ref_compress(x, eb)


def test_float64_raw_words_are_low_then_high_halves():
    x = np.array([1.0, -2.5, np.inf, 1e-310], np.float64)
    buf = compress_abs(x, 1e-300).tobytes()
    s = ref_parse(buf)
    code, words = s["blocks"][0]
    assert code == 32 and len(words) == 64
    for i, v in enumerate(x):
        bits = int(np.array(v).view(np.uint64))
        assert words[2 * i] == bits & 0xFFFFFFFF and words[2 * i + 1] == bits >> 32
    assert words[8:] == [0] * 56


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES)
def test_lossless_stream_reference(dtype):
    x = np.array([0.0, -0.0, 0.0, 1.5, np.nan] + [0.0] * 40, dtype)
    buf = compress_abs(x, 0.0)
    assert buf.tobytes() == ref_compress(x, 0.0)
    # The first block is raw (bit patterns kept, -0.0 and NaN included); the second is zero.
    assert decompress(buf).tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES)
@pytest.mark.parametrize("eb", [1e-3, 3 * 5e-324, 5e-324, 1e-40, 1e308, 1e38, 0.1])
def test_zero_block_shortcut_matches_the_full_rule(eb, dtype):
    # Full blocks of values around eb/2 (the compressor's shortcut threshold) and eb.
    with np.errstate(over="ignore", under="ignore"):
        around = np.array([eb / 2, eb * 0.49, eb * 0.51, eb * 0.99, eb, -eb / 2, 0.0, -0.0])
        cands = np.concatenate([np.nextafter(around, np.inf), around,
                                np.nextafter(around, -np.inf)]).astype(dtype)
    rng = np.random.default_rng(0)
    x = np.concatenate([np.full(32, cands[i % cands.size]) if i % 3 == 0
                        else rng.choice(cands, 32) for i in range(24)]).astype(dtype)
    assert compress_abs(x, eb).tobytes() == ref_compress(x, eb)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_bounds(max_n=120), st.integers(0, 2**32 - 1), st.sampled_from([1.0, 1e3, 1e9]))
def test_add_data_equals_add_of_the_compressed_data(case, seed, scale):
    # add_data(a, x) must be add(a, compress_abs(x, eb)) byte for byte, whatever mix of
    # zero, fixed, Lorenzo and raw blocks either side has (the strategy's specials make
    # raw blocks on both sides, the scales overflowing sums).
    x, eb = case
    assume(eb < 1e307)
    rng = np.random.default_rng(seed)
    x2 = (rng.standard_normal(x.shape) * scale).astype(x.dtype)
    if x.size and rng.random() < 0.3:
        x2[rng.integers(x.size)] = [math.nan, math.inf, -0.0][rng.integers(3)]
    a = compress_abs(x, eb)
    expect = add(a, compress_abs(x2, eb)).tobytes()
    assert add_data(a, x2).tobytes() == expect
    assert add_data(a, x).tobytes() == add(a, a).tobytes()


# -------------------------------------------------------------------- version-2 tests


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_bounds())
def test_v2_stream_bytes_equal_the_reference(case):
    x, eb = case
    assert compress_abs(x, eb, version=2).tobytes() == ref_compress_v2(x, eb)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_bounds(max_n=120))
def test_v2_decoded_values_equal_the_reference(case):
    x, eb = case
    buf = compress_abs(x, eb, version=2)
    ours = decompress(buf)
    ref = ref_decompress_v2(buf.tobytes())
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert ours.tobytes() == ref.tobytes()
    # the same quantized values as version 1 (same rules): identical decoded bytes
    assert ours.tobytes() == decompress(compress_abs(x, eb)).tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_bounds(max_n=120), st.integers(0, 2**32 - 1), st.sampled_from([1.0, 1e3, 1e9]))
def test_v2_homomorphic_sum_bytes_equal_the_reference(case, seed, scale):
    x, eb = case
    assume(eb < 1e307)
    rng = np.random.default_rng(seed)
    x2 = (rng.standard_normal(x.shape) * scale).astype(x.dtype)
    a, b = compress_abs(x, eb, version=2), compress_abs(x2, eb, version=2)
    s = add(a, b)
    assert s.tobytes() == ref_add_v2(a.tobytes(), b.tobytes())
    assert add(s, a).tobytes() == ref_add_v2(s.tobytes(), a.tobytes())  # raw64 blocks too
    assert add_data(a, x2).tobytes() == s.tobytes()
    # decodes exactly as v1's sum (same integers, same raw rule)
    s1 = add(compress_abs(x, eb), compress_abs(x2, eb))
    assert decompress(s).tobytes() == decompress(s1).tobytes()


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES)
def test_v2_codes_of_many_chunks_equal_the_reference(dtype):
    # Three chunks of 256 blocks and a partial block, so that the plan pass's groups of 32
    # blocks, its chunks and its scratch regions are all crossed. Each block has its own
    # maximum magnitude (1 to 511, on both sides of the 2^8 where the choice of k switches
    # from all 8 costs at once to a loop) and its own density, so that every patched-planes
    # k and h below 9 and every sparse count occur; some blocks are zero and some raw.
    rng = np.random.default_rng(20261205)
    eb = 0.5
    nb = 3 * 256 + 40
    q = np.zeros((nb, 32))
    for b in range(nb):
        kind = rng.integers(0, 8)
        if kind == 0:
            continue  # a zero block
        m = int(rng.integers(1, 512 if kind > 1 else 256))
        vals = rng.integers(-m, m + 1, 32)
        vals[rng.integers(0, 32)] = m * rng.choice([-1, 1])
        keep = rng.random(32) < rng.choice([0.05, 0.15, 0.5, 1.0])
        q[b] = np.where(keep, vals, 0)
        q[b, rng.integers(0, 32)] = m
    x = (q * (2 * eb) + rng.uniform(-0.45, 0.45, q.shape) * (2 * eb)).astype(dtype).ravel()
    x[rng.integers(0, x.size, 3)] = np.inf  # raw blocks
    x = x[: x.size - 13]  # a partial last block
    assert compress_abs(x, eb, version=2).tobytes() == ref_compress_v2(x, eb)


def _fields(fields: list[tuple[int, int]]) -> tuple[int, int]:
    val = nb = 0
    for f, w in fields:
        val |= f << nb
        nb += w
    return val, nb


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_v2_blocks_with_values_of_2_to_the_31_and_more_decode_as_the_reference(dtype):
    # The compressor keeps |q| < 2^31, but the format allows patched planes up to k + h = 61
    # bits and sparse values of 2^31; decoders that convert |q| < 2^31 through int32 (cores
    # without AVX-512DQ, v2._q_narrow) must take the 64-bit way for these, on each side of it.
    rng = np.random.default_rng(8)
    blocks: list[tuple[int, int | None, int, int] | None] = []
    for k, h in [(29, 1), (30, 0), (30, 1), (29, 2), (30, 2), (15, 16), (30, 31), (0, 31)]:
        mask = int(rng.integers(1, 2**32))
        high = [i for i in range(32) if (mask >> i) & 1]
        sign = int(rng.integers(0, 2**32))
        lo = [int(rng.integers(0, 1 << k)) if k else 0 for _ in range(32)]
        fl = [(sign, 32)] if k else [((sign >> i) & 1, 1) for i in high]
        fl += [(sum(((lo[i] >> j) & 1) << i for i in range(32)), 32) for j in range(k)]
        fl += [((1 << h) - 1 - int(rng.integers(0, 2)) if h else 0, h) for _ in high]
        val, nb = _fields(fl)
        blocks.append(((k << 5) | h, mask, val, nb))
    for v in (29, 30, 31):
        lanes = sorted(int(i) for i in rng.choice(32, 3, replace=False))
        fl = [(i, 5) for i in lanes] + [(int(s), 1) for s in rng.integers(0, 2, 3)]
        fl += [((1 << v) - 1, v), ((1 << v) - 2, v), (0, v)]
        val, nb = _fields(fl)
        blocks.append(((1 << 10) | (2 << 5) | v, None, val, nb))
    eb = 2.0**-80
    buf = ref_assemble_v2(blocks, np.dtype(dtype), (32 * len(blocks),), eb, eb, 1)
    ref = ref_decompress_v2(buf)
    ours = decompress(np.frombuffer(buf, np.uint8))
    assert np.abs(ref).max() >= 2.0**31 * 2 * eb  # values beyond int32 are there
    assert ours.tobytes() == ref.tobytes()
