"""Slow pure-Python reference of stream format version 2 (docs/format.md), for the CUDA tests.

The block encoder (``encode_block_v2``), the bit writer/reader and the stream layout are
bench/format_v2_study.py's reference (whose bytes are the spec's worked example), copied
here so that the tests do not import the study's data loaders. Added for the tests: lossless
(``eb = 0``) and raw blocks, full decoding to values, and the homomorphic add, all written
from the spec's text, block by block, with Python integers.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

CANON_NAN64 = 0x7FF8000000000000


class _BitWriter:
    def __init__(self) -> None:
        self.acc = 0
        self.n = 0

    def put(self, value: int, width: int) -> None:
        assert 0 <= value < (1 << width) or (width == 0 and value == 0)
        self.acc |= value << self.n
        self.n += width

    def words(self) -> bytes:
        nw = (self.n + 31) // 32
        return self.acc.to_bytes(4 * nw, "little")


class _BitReader:
    def __init__(self, data: bytes) -> None:
        self.acc = int.from_bytes(data, "little")
        self.pos = 0

    def get(self, width: int) -> int:
        v = (self.acc >> self.pos) & ((1 << width) - 1)
        self.pos += width
        return v


def _bl(v: int) -> int:
    return int(v).bit_length()


def quantize(x: np.ndarray, eb: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q per lane (padding 0), raw flag per block, valid-lane mask (format.md, v1 rules)."""
    n = x.size
    nb = (n + 31) // 32
    pad = np.zeros(nb * 32, np.float64)
    pad[:n] = x.ravel()
    valid = np.arange(nb * 32) < n
    if eb == 0:
        bits = np.zeros(nb * 32, np.uint64)
        bits[:n] = x.ravel().view(np.uint32 if x.dtype == np.float32 else np.uint64)
        sign = np.uint64(0x80000000 if x.dtype == np.float32 else 0x8000000000000000)
        nonzero = (bits & ~sign) != 0
        return (np.zeros((nb, 32), np.int64), nonzero.reshape(nb, 32).any(axis=1),
                valid.reshape(nb, 32))
    step = 2 * eb
    with np.errstate(all="ignore"):
        v = pad / step
        inr = np.abs(v) < 2147483647.0
        q = np.floor(np.where(inr, v, 0.0) + 0.5).astype(np.int64)
        y = (q.astype(np.float64) * step).astype(x.dtype).astype(np.float64)
        ok = inr & (np.abs(y - pad) < eb)
    ok[n:] = True
    q[n:] = 0
    return q.reshape(nb, 32), np.asarray(~ok.reshape(nb, 32).all(axis=1)), valid.reshape(nb, 32)


def encode_block_v2(q: list[int]) -> tuple[int, int | None, list[tuple[int, int]]]:
    """(code, mask or None, payload fields) of a non-zero quantized block, rules 3-4."""
    a = [abs(v) for v in q]
    m = max(a)
    w = _bl(m)
    c = sum(v != 0 for v in q)
    best = None
    for k in range(w):
        p = sum(v >= (1 << k) for v in a)
        h = _bl((m >> k) - 1)
        cost = 32 + (p if k == 0 else 32) + 32 * k + p * h
        if best is None or cost < best[0]:
            best = (cost, k, h)
    assert best is not None
    cost, k, h = best
    v = _bl(m - 1)
    if c <= 4 and c * (6 + v) <= cost:
        lanes = [i for i in range(32) if q[i] != 0]
        fields = ([(i, 5) for i in lanes] + [(int(q[i] < 0), 1) for i in lanes]
                  + [(a[i] - 1, v) for i in lanes])
        return (1 << 10) | ((c - 1) << 5) | v, None, fields
    high = [i for i in range(32) if a[i] >= (1 << k)]
    mask = sum(1 << i for i in high)
    if k == 0:
        fields = [(int(q[i] < 0), 1) for i in high]
    else:
        fields = [(sum(1 << i for i in range(32) if q[i] < 0), 32)]
    for j in range(k):
        fields.append((sum(((a[i] >> j) & 1) << i for i in range(32)), 32))
    fields += [((a[i] >> k) - 1, h) for i in high]
    return (k << 5) | h, mask, fields


# A block, as the reference holds it: None (zero), ("q", [32 ints]) or ("raw", kind, [32 bit
# patterns]) with kind 2 (the stream's dtype) or 3 (float64 in a float32 stream).
Block = Any


def _raw_block(kind: int, bits: list[int], is32: bool) -> tuple[int, None, list[tuple[int, int]]]:
    width = 32 if kind == 2 and is32 else 64
    return kind << 10, None, [(int(u), width) for u in bits]


def write_stream(blocks: list[Block], dtype: Any, shape: tuple[int, ...], eb: float,
                 bound: float, nterms: int = 1) -> bytes:
    """The version-2 stream of a list of blocks (encoding quantized blocks by rules 3-4)."""
    is32 = np.dtype(dtype) == np.float32
    nb = len(blocks)
    bitmap = [0] * ((nb + 31) // 32)
    coded: list[tuple[int, int | None, list[tuple[int, int]]]] = []
    for b, blk in enumerate(blocks):
        if blk is None:
            continue
        if blk[0] == "q":
            coded.append(encode_block_v2(blk[1]))
        else:
            coded.append(_raw_block(blk[1], blk[2], is32))
        bitmap[b // 32] |= 1 << (b % 32)
    table = sorted({c for c, _, _ in coded})
    ib = _bl(len(table) - 1) if table else 0
    index, pay = _BitWriter(), _BitWriter()
    masks: list[int] = []
    for code, mask, fields in coded:
        index.put(table.index(code), ib)
        if mask is not None:
            masks.append(mask)
        for val, wd in fields:
            pay.put(val, wd)
    n = int(np.prod(shape)) if shape else 1
    hdr = struct.pack("<4sBBBBIIQddQQII", b"CCOL", 2, 1 if is32 else 2, len(shape), 0, 32,
                      len(masks), n, eb, bound, len(coded), (pay.n + 31) // 32, nterms,
                      len(table))
    tab = b"".join(struct.pack("<H", c) for c in table)
    tab += b"\0" * (-len(tab) % 4)
    return (hdr + b"".join(struct.pack("<Q", s) for s in shape)
            + b"".join(struct.pack("<I", w) for w in bitmap) + tab
            + index.words() + b"".join(struct.pack("<I", mk) for mk in masks) + pay.words())


def blocks_of(x: np.ndarray, eb: float) -> list[Block]:
    """The blocks "Encoding a block (version 2)" makes of ``x`` (lossy or lossless)."""
    qb, raw, valid = quantize(x, eb)
    flat = x.ravel()
    out: list[Block] = []
    for b in range(qb.shape[0]):
        if raw[b]:
            vals = np.zeros(32, x.dtype)
            nv = int(valid[b].sum())
            vals[:nv] = flat[32 * b: 32 * b + nv]
            ints = vals.view(np.uint32 if x.dtype == np.float32 else np.uint64)
            out.append(("raw", 2, [int(u) for u in ints]))
        elif qb[b].any():
            out.append(("q", [int(v) for v in qb[b]]))
        else:
            out.append(None)
    return out


def encode_v2(x: np.ndarray, eb: float) -> bytes:
    """Version-2 stream of a float32/float64 array (``eb = 0``: lossless)."""
    x = np.ascontiguousarray(x)
    return write_stream(blocks_of(x, eb), x.dtype, x.shape, eb, eb)


def parse(buf: bytes) -> dict[str, Any]:
    """Header fields and the blocks of a valid version-2 stream (asserts what it relies on)."""
    (magic, ver, dcode, ndim, _r, bs, nmask, n, eb, bound, nnz, pw, nterms,
     ntab) = struct.unpack_from("<4sBBBBIIQddQQII", buf, 0)
    assert magic == b"CCOL" and ver == 2 and bs == 32
    shape = struct.unpack_from(f"<{ndim}Q", buf, 64)
    is32 = dcode == 1
    nb = (n + 31) // 32
    off = 64 + 8 * ndim
    bw = (nb + 31) // 32
    bitmap = int.from_bytes(buf[off: off + 4 * bw], "little")
    off += 4 * bw
    table = list(struct.unpack_from(f"<{ntab}H", buf, off))
    off += 4 * ((ntab + 1) // 2)
    ib = _bl(ntab - 1) if ntab else 0
    nidx = 4 * ((nnz * ib + 31) // 32)
    index = _BitReader(buf[off: off + nidx])
    off += nidx
    masks = struct.unpack_from(f"<{nmask}I", buf, off)
    off += 4 * nmask
    pay = _BitReader(buf[off: off + 4 * pw])
    assert off + 4 * pw == len(buf)
    blocks: list[Block] = []
    r = 0
    for b in range(nb):
        if not (bitmap >> b) & 1:
            blocks.append(None)
            continue
        code = table[index.get(ib)]
        kind, a, v = code >> 10, (code >> 5) & 31, code & 31
        q = [0] * 32
        if kind == 1:
            c = a + 1
            pos = [pay.get(5) for _ in range(c)]
            assert all(pos[i] < pos[i + 1] for i in range(c - 1))
            sg = [pay.get(1) for _ in range(c)]
            for i in range(c):
                mv = pay.get(v) + 1
                q[pos[i]] = -mv if sg[i] else mv
            blocks.append(("q", q))
        elif kind == 0:
            k, h, mask = a, v, masks[r]
            r += 1
            high = [i for i in range(32) if (mask >> i) & 1]
            if k == 0:
                neg = {i: pay.get(1) for i in high}
            else:
                sw = pay.get(32)
                neg = {i: (sw >> i) & 1 for i in range(32)}
            lo = [0] * 32
            for j in range(k):
                pl = pay.get(32)
                for i in range(32):
                    lo[i] |= ((pl >> i) & 1) << j
            mag = list(lo)
            for i in high:
                mag[i] = ((pay.get(h) + 1) << k) + lo[i]
            blocks.append(("q", [-mag[i] if neg.get(i, 0) else mag[i] for i in range(32)]))
        else:
            width = 32 if kind == 2 and is32 else 64
            blocks.append(("raw", kind, [pay.get(width) for _ in range(32)]))
    assert r == nmask
    return dict(dtype=np.float32 if is32 else np.float64, shape=tuple(shape), n=n, eb=eb,
                bound=bound, nterms=nterms, blocks=blocks, table=table, nmask=nmask)


def decode_v2(buf: bytes) -> np.ndarray:
    """Decoded array of a version-2 stream (the spec's "Values" and raw rules)."""
    s = parse(buf)
    dt, n, step = s["dtype"], s["n"], 2 * s["eb"]
    out = np.zeros(len(s["blocks"]) * 32, dt)
    for b, blk in enumerate(s["blocks"]):
        seg = slice(32 * b, 32 * b + 32)
        if blk is None:
            continue
        if blk[0] == "q":
            with np.errstate(all="ignore"):
                out[seg] = (np.array(blk[1], np.int64).astype(np.float64) * step).astype(dt)
        elif blk[1] == 2:
            out[seg] = np.array(blk[2], np.uint32 if dt == np.float32 else np.uint64).view(dt)
        else:
            with np.errstate(all="ignore"):
                out[seg] = np.array(blk[2], np.uint64).view(np.float64).astype(dt)
    return out[:n].reshape(s["shape"])


def _lane_values(blk: Block, is32: bool, step: float) -> list[float]:
    if blk[0] == "q":
        return [float(np.float64(v) * np.float64(step)) for v in blk[1]]
    if blk[1] == 2 and is32:
        return [float(np.array([u], np.uint32).view(np.float32)[0]) for u in blk[2]]
    return [float(np.array([u], np.uint64).view(np.float64)[0]) for u in blk[2]]


def add_v2(a: bytes, b: bytes) -> bytes:
    """Homomorphic sum of two version-2 streams, block by block (format.md)."""
    sa, sb = parse(a), parse(b)
    assert sa["dtype"] == sb["dtype"] and sa["n"] == sb["n"] and sa["eb"] == sb["eb"]
    is32 = sa["dtype"] == np.float32
    n, step = sa["n"], 2 * sa["eb"]
    out: list[Block] = []
    for bi, (x, y) in enumerate(zip(sa["blocks"], sb["blocks"], strict=True)):
        nv = min(32, n - 32 * bi)
        if x is None or y is None:
            out.append(y if x is None else x)
            continue
        if x[0] == "q" and y[0] == "q":
            s = [x[1][i] + y[1][i] if i < nv else 0 for i in range(32)]
            if all(abs(v) < 2147483647 for v in s):
                out.append(("q", s) if any(s) else None)
                continue
        va, vb = _lane_values(x, is32, step), _lane_values(y, is32, step)
        bits = []
        for i in range(32):
            if i >= nv:
                bits.append(0)
                continue
            with np.errstate(all="ignore"):
                sm = np.float64(va[i]) + np.float64(vb[i])
            bits.append(CANON_NAN64 if sm != sm else int(np.array([sm]).view(np.uint64)[0]))
        out.append(("raw", 3 if is32 else 2, bits))
    from ccoll.compressor.cpu.add import sum_bound  # the bound rule is v1's, unchanged

    bound = sum_bound(sa["bound"], sb["bound"])
    return write_stream(out, sa["dtype"], sa["shape"], sa["eb"], bound,
                        sa["nterms"] + sb["nterms"])
