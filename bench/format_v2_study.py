"""Format v2 study: exact encoded sizes of candidate block layouts on the real gradient dumps.

A numpy model (no kernels): the data is quantized exactly as format v1 does it (same
``q``, same acceptance test, so the error bound is unchanged) and, for each candidate
layout, the exact size in bytes of the stream it defines is computed block by block, next
to the real v1 stream (``ccoll.compress``) and SZ3 (pysz, ABS mode, same bound). Every
candidate keeps the properties v2 needs: each block's size follows from its own
metadata, offsets are prefix sums, the homomorphic add stays a block-local integer sum.

Layouts (cumulative unless marked; see docs/format.md, "Format version 2"):

- ``v1 model``: v1 (must equal the real stream; checks the model), ``-lor`` without Lorenzo;
- ``sgn-nz (oracle)``: v1 planes with a sign bit only for non-zero values, bit-granular,
  metadata-free oracle (a decoder cannot size such a block without its non-zero count);
- ``P+M``: bit-granular payload, two kinds: planes (v1, sign word) and *masked* (a
  32-bit non-zero mask in its own section, then one sign bit and ``bitlen(max|q|-1)``
  bits of ``|q|-1`` per non-zero value);
- ``P+M+S``: and *sparse* blocks (1..4 non-zeros: 5-bit positions, signs, ``|q|-1``);
- ``+patch (oracle)``: masked blocks with exceptions (bulk width, outliers apart with
  a 5-bit index and their high bits; 8 more metadata bits per block), upper bound;
- ``code H0``: the code bytes at their empirical order-0 entropy (what any metadata
  compression could buy at most), ``nibble codes``: 4 bits per code (oracle: v1's codes do
  not fit 4 bits);
- ``byte-aligned``: ``P+M+S`` with every block rounded to whole bytes;
- ``B=64``/``B=128``: ``P+M+S`` with larger blocks (masks and positions scale);
- ``S+PP``: sparse and patched-planes blocks (``v2_size``), 16-bit codes, with the sign
  word always or only for ``k > 0``;
- ``v2``: the spec (docs/format.md, "Format version 2"), then variants of it one at a
  time (sign section, v1's kinds added, no sparse kind, byte-aligned blocks, codes at
  their entropy, a 4-bit index into the 15 most frequent codes with escapes, a two-level
  bitmap);
- ``H0 floor``: ``n * H0(q)`` bits, the order-0 entropy of the quantized values.

``--check`` also runs a slow pure-Python encoder and decoder of the v2 spec
(``encode_v2``, ``decode_v2_q``) and asserts that the bytes decode to the same ``q`` and
that their length equals ``v2_size``.

    python bench/format_v2_study.py                 # tables on stdout (about 1 minute)
    python bench/format_v2_study.py --check --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from compressor import DEFAULT_FILES, load_concat, load_tensors  # noqa: E402

import ccoll  # noqa: E402
from ccoll.compressor import compress_abs  # noqa: E402
from ccoll.compressor import cpu as _cpu  # noqa: E402


def quantize(x: np.ndarray, eb: float, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q per lane (padding 0), raw flag per block, valid-lane mask; as format v1."""
    n = x.size
    nb = (n + bs - 1) // bs
    pad = np.zeros(nb * bs, np.float64)
    pad[:n] = x.ravel()
    step = 2 * eb
    v = pad / step
    inr = np.abs(v) < 2147483647.0
    with np.errstate(invalid="ignore"):
        q = np.floor(np.where(inr, v, 0.0) + 0.5).astype(np.int64)
        y = (q.astype(np.float64) * step).astype(x.dtype).astype(np.float64)
        ok = inr & (np.abs(y - pad) < eb)
    ok[n:] = True
    q[n:] = 0
    valid = (np.arange(nb * bs) < n).reshape(nb, bs)
    return q.reshape(nb, bs), np.asarray(~ok.reshape(nb, bs).all(axis=1)), valid


def bitlen(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.int64)
    out = np.zeros(a.shape, np.int64)
    m = a.copy()
    while (m > 0).any():
        out += m > 0
        m >>= 1
    return out


def entropy_bits(vals: np.ndarray) -> float:
    if vals.size == 0:
        return 0.0
    _, c = np.unique(vals, return_counts=True)
    p = c / c.sum()
    return float(-(c * np.log2(p)).sum())


def r4(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


def sizes(x: np.ndarray, eb: float) -> dict[str, Any]:
    """Exact stream size in bytes of every layout (see the module doc)."""
    out: dict[str, Any] = {}
    head = 64 + 8 * max(x.ndim, 1)
    rawbits = 32 * 8 * x.dtype.itemsize
    for bs in (32, 64, 128):
        qb, raw, valid = quantize(x, eb, bs)
        nb = qb.shape[0]
        a = np.abs(qb)
        m = a.max(axis=1)
        zero = (~raw) & (m == 0)
        fx = (~raw) & (m > 0)
        nz = (a > 0).sum(axis=1)
        w = bitlen(m)
        w2 = bitlen(np.maximum(m - 1, 0))
        rawb = rawbits * bs // 32
        bmap = 4 * ((nb + 31) // 32)
        nnzb = int((~zero).sum())
        pbits = bs.bit_length() - 1
        # planes (v1): bs*(w+1) bits; masked: bs mask bits + nz*(1+w2); sparse: nz*(pos+1+w2)
        k_planes = bs * (w + 1)
        k_mask = bs + nz * (1 + w2)
        k_sparse = np.where(nz <= 4, nz * (pbits + 1 + w2), 1 << 30)
        if bs == 32:
            # v1 exactly, with and without Lorenzo
            prev = np.concatenate([np.zeros((nb, 1), np.int64), qb[:, :-1]], axis=1)
            d = np.where(valid, qb - prev, 0)
            wd = bitlen(np.abs(d).max(axis=1))
            wl = np.where(wd < w, wd, w)
            for name, ww in (("v1 model", wl), ("v1 -lor", w)):
                out[name] = (head + bmap + r4(nnzb)
                             + 4 * int((1 + ww[fx]).sum() + rawb // 32 * raw.sum()))
            # signs only for non-zero values, oracle (bit-granular, no extra metadata)
            bits = int((32 * w + nz)[fx].sum() + rawb * raw.sum())
            out["sgn-nz (oracle)"] = head + bmap + r4(nnzb) + r4((bits + 7) // 8)
            # planes + masked
            kpm = np.minimum(k_planes, k_mask)
            nmask = int((fx & (k_mask < k_planes)).sum())
            bits = int(kpm[fx].sum() - 32 * nmask + rawb * raw.sum())
            out["P+M"] = head + bmap + r4(nnzb) + 4 * nmask + r4((bits + 7) // 8)
        # planes + masked + sparse (the candidate), at this block size
        kind = np.where(k_sparse <= np.minimum(k_mask, k_planes), 2,
                        np.where(k_mask < k_planes, 1, 0))
        kbits = np.choose(kind, [k_planes, k_mask, k_sparse])
        nmask = int((fx & (kind == 1)).sum())
        pay = kbits - np.where(kind == 1, bs, 0)  # masks live in their own section
        bits = int(pay[fx].sum() + rawb * raw.sum())
        name = "P+M+S" if bs == 32 else f"P+M+S B={bs}"
        out[name] = head + bmap + r4(nnzb) + bs // 8 * nmask + r4((bits + 7) // 8)
        if bs != 32:
            continue
        out["counts"] = {"blocks": nb, "zero": int(zero.sum()), "raw": int(raw.sum()),
                         "planes": int((fx & (kind == 0)).sum()), "masked": nmask,
                         "sparse": int((fx & (kind == 2)).sum())}
        # byte-aligned blocks
        pb = (pay + 7) // 8 * 8
        bits_b = int(pb[fx].sum() + rawb * raw.sum())
        out["P+M+S byte-aligned"] = head + bmap + r4(nnzb) + 4 * nmask + r4(bits_b // 8)
        # code bytes: order-0 entropy and a 4-bit code
        code = np.where(raw, 32, np.where(kind == 0, w, np.where(kind == 1, 64 + w2,
                                                                  128 + 32 * (nz - 1) + w2)))
        hc = entropy_bits(code[~zero])
        out["P+M+S code H0"] = (out["P+M+S"] - r4(nnzb)) + hc / 8
        out["P+M+S nibble codes"] = out["P+M+S"] - r4(nnzb) + r4((nnzb + 1) // 2)
        out["code H0 bits/block"] = hc / max(nnzb, 1)
        # patched frame of reference on masked blocks (oracle upper bound): bulk width
        # wb <= w2, exceptions (|q|-1 >= 2^wb) stored with a 5-bit index into the
        # non-zero list and their w2-wb high bits; 8 more metadata bits per block.
        best = k_mask.copy()
        am1 = np.where(a > 0, a - 1, 0)
        for wb in range(0, 31):
            e = ((a > 0) & (am1 >= (1 << wb))).sum(axis=1)
            c = bs + nz * (1 + wb) + e * (5 + np.maximum(w2 - wb, 0)) + 8
            best = np.where(wb < w2, np.minimum(best, c), best)
        kp = np.minimum(np.minimum(k_planes, best), k_sparse)
        bits = int(kp[fx].sum() + rawb * raw.sum())
        # masks counted in the bits here (oracle)
        out["P+M+S +patch (oracle)"] = head + bmap + r4(nnzb) + r4((bits + 7) // 8)
        q = qb[valid]
        out["H0 floor"] = entropy_bits(q) / 8
    return out


def v2_size(x: np.ndarray, eb: float, signs: str = "hybrid", codes: str = "index",
            extra_kinds: bool = False, sparse: bool = True, align: int = 1,
            twolevel: bool = False, stats: dict[str, Any] | None = None) -> float:
    """Size of a format v2 stream (docs/format.md, "Format version 2") and its variants.

    Kinds: sparse (1..4 non-zeros), patched planes PP(k, h) (k low bit-planes of every
    lane, then ``(|q| >> k) - 1`` in h bits for each lane with ``|q| >= 2^k``, those lanes
    marked in a 32-bit mask in the mask section), raw. ``signs``: ``hybrid`` (the spec:
    one bit per marked lane when k = 0, else a 32-bit sign word), ``word`` (always the
    word), ``section`` (one bit per non-zero value in a section of its own; needs a second
    prefix sum in the decoder). ``codes``: ``table`` (the spec: a 4-bit index into a
    per-stream table of the 15 most frequent 16-bit codes, escape 15 -> a 16-bit code in
    the escape section), ``u16`` (a plain 16-bit code per non-zero block), ``H0`` (codes at
    their order-0 entropy). ``extra_kinds``: also v1's planes and Lorenzo planes.
    """
    qb, raw, valid = quantize(x, eb, 32)
    nb = qb.shape[0]
    a = np.abs(qb)
    m = a.max(axis=1)
    zero = (~raw) & (m == 0)
    fx = (~raw) & (m > 0)
    nz = (a > 0).sum(axis=1)
    w = bitlen(m)
    big_ = 1 << 40
    best = np.full(nb, big_, np.int64)
    bk = np.zeros(nb, np.int64)
    bh = np.zeros(nb, np.int64)
    for k in range(0, 31):
        nbig = (a >= (1 << k)).sum(axis=1)
        h = np.where(nbig > 0, bitlen(np.maximum((m >> k) - 1, 0)), 0)
        sg = {"hybrid": nz if k == 0 else np.full(nb, 32), "word": np.full(nb, 32),
              "section": nz}[signs]
        c = np.where(k < w, 32 + sg + 32 * k + nbig * h, big_)
        upd = c < best
        best, bk, bh = np.where(upd, c, best), np.where(upd, k, bk), np.where(upd, h, bh)
    wv = bitlen(np.maximum(m - 1, 0))
    ks = np.where(sparse & (nz <= 4), nz * (6 + wv), big_)
    kp = kl = np.full(nb, big_, np.int64)
    wd = w
    if extra_kinds:
        prev = np.concatenate([np.zeros((nb, 1), np.int64), qb[:, :-1]], axis=1)
        d = np.where(valid, qb - prev, 0)
        ad = np.abs(d)
        wd = bitlen(ad.max(axis=1))
        sgp = nz if signs == "section" else 32
        kp = 32 * w + sgp
        kl = np.where(wd <= 31, 32 * wd + (ad > 0).sum(axis=1) if signs == "section"
                      else 32 * wd + 32, big_)
    allk = np.stack([ks, best, kp, kl])
    kind = allk.argmin(axis=0)
    bits = allk.min(axis=0)
    if align > 1:
        bits = (bits + align - 1) // align * align
    code = np.select([raw, kind == 0, kind == 1, kind == 2, kind == 3],
                     [2 << 10, (1 << 10) | ((nz - 1) << 5) | wv, (bk << 5) | bh,
                      (4 << 10) | w, (5 << 10) | wd])
    cz = code[~zero]
    nnzb = cz.size
    if codes == "table":
        u, c = np.unique(cz, return_counts=True)
        top = set(u[np.lexsort((u, -c))[:15]].tolist())
        nesc = int(sum(cc for uu, cc in zip(u, c) if uu not in top))  # noqa: B905
        meta: float = r4(2 * min(15, u.size)) + r4((nnzb + 1) // 2) + r4(2 * nesc)
    elif codes == "index":
        u = np.unique(cz)
        meta = r4(2 * u.size) + r4((nnzb * int(max(u.size - 1, 0)).bit_length() + 7) // 8)
    elif codes == "u16":
        meta = r4(2 * nnzb)
    else:
        meta = entropy_bits(cz) / 8
    bmap = 4 * ((nb + 31) // 32)
    if twolevel:
        words = np.concatenate([~zero, np.zeros(-nb % 32, bool)]).reshape(-1, 32).any(axis=1)
        bmap = 4 * ((words.size + 31) // 32) + 4 * int(words.sum())
    rawbits = 32 * 8 * x.dtype.itemsize
    pay = int(bits[fx].sum()) + rawbits * int(raw.sum())
    if stats is not None:
        pp = fx & (kind == 1)
        stats.update(zero=int(zero.sum()), sparse=int((fx & (kind == 0)).sum()),
                     pp=int(pp.sum()), raw=int(raw.sum()), ntab=int(np.unique(cz).size),
                     k_hist=np.bincount(bk[pp], minlength=1).tolist())
    return 64 + 8 * max(x.ndim, 1) + bmap + meta + 4 * ((pay + 31) // 32)


def sz3_size(x: np.ndarray, eb: float) -> int:
    import pysz

    cfg = pysz.szConfig()
    cfg.errorBoundMode = pysz.szErrorBoundMode.ABS
    cfg.absErrorBound = eb
    return len(pysz.sz.compress(np.ascontiguousarray(x), cfg)[0])


def study(x: np.ndarray, eb: float) -> dict[str, Any]:
    s = sizes(x, eb)
    s["v1 real"] = compress_abs(x, eb).size
    assert s["v1 model"] == s["v1 real"], (s["v1 model"], s["v1 real"])
    s["S+PP u16 codes"] = v2_size(x, eb, codes="u16")
    s["S+PP u16 codes, sign word"] = v2_size(x, eb, codes="u16", signs="word")
    st: dict[str, Any] = {}
    s["v2"] = v2_size(x, eb, stats=st)
    s["v2 stats"] = st
    s["v2 sign section"] = v2_size(x, eb, signs="section")
    s["v2 sign word"] = v2_size(x, eb, signs="word")
    s["v2 +planes+Lorenzo"] = v2_size(x, eb, extra_kinds=True)
    s["v2 -sparse"] = v2_size(x, eb, sparse=False)
    s["v2 byte-aligned"] = v2_size(x, eb, align=8)
    s["v2 codes at H0"] = v2_size(x, eb, codes="H0")
    s["v2 top-15 nibbles + escapes"] = v2_size(x, eb, codes="table")
    s["v2 two-level bitmap"] = v2_size(x, eb, twolevel=True)
    s["SZ3"] = sz3_size(x, eb)
    return s


# --------------------------------------------------------------- slow reference of the spec


class _BitWriter:
    def __init__(self) -> None:
        self.acc = 0  # the bit stream as one Python integer, bit i = stream bit i
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


def encode_v2(x: np.ndarray, eb: float) -> bytes:
    """Version-2 stream of a float32/float64 array, lossy (eb > 0), block by block in Python."""
    import struct

    assert eb > 0 and x.dtype in (np.float32, np.float64)
    qb, raw, valid = quantize(x, eb, 32)
    nb = qb.shape[0]
    bitmap = [0] * ((nb + 31) // 32)
    blocks: list[tuple[int, int | None, list[tuple[int, int]]]] = []
    for b in range(nb):
        if raw[b]:
            vals = np.zeros(32, x.dtype)
            nv = int(valid[b].sum())
            vals[:nv] = x.ravel()[32 * b: 32 * b + nv]
            wbits = 8 * x.dtype.itemsize
            ints = vals.view(np.uint32 if wbits == 32 else np.uint64)
            blocks.append((2 << 10, None, [(int(u), wbits) for u in ints]))
        elif qb[b].any():
            blocks.append(encode_block_v2([int(v) for v in qb[b]]))
        else:
            continue
        bitmap[b // 32] |= 1 << (b % 32)
    table = sorted({c for c, _, _ in blocks})
    ib = _bl(len(table) - 1) if table else 0
    index, pay = _BitWriter(), _BitWriter()
    masks: list[int] = []
    for code, mask, fields in blocks:
        index.put(table.index(code), ib)
        if mask is not None:
            masks.append(mask)
        for val, wd in fields:
            pay.put(val, wd)
    dcode = 1 if x.dtype == np.float32 else 2
    shape = x.shape
    hdr = struct.pack("<4sBBBBIIQddQQII", b"CCOL", 2, dcode, len(shape), 0, 32, len(masks),
                      x.size, eb, eb, len(blocks), (pay.n + 31) // 32, 1, len(table))
    tab = b"".join(struct.pack("<H", c) for c in table)
    tab += b"\0" * (-len(tab) % 4)
    return (hdr + b"".join(struct.pack("<Q", s) for s in shape)
            + b"".join(struct.pack("<I", w) for w in bitmap) + tab
            + index.words() + b"".join(struct.pack("<I", mk) for mk in masks) + pay.words())


def decode_v2_q(buf: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(q per lane, raw flag per block) of a lossy version-2 stream with no raw blocks."""
    import struct

    (magic, ver, dcode, ndim, _r, bs, nmask, n, eb, bound, nnz, pw, nterms,
     ntab) = struct.unpack_from("<4sBBBBIIQddQQII", buf, 0)
    assert magic == b"CCOL" and ver == 2 and bs == 32
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
    q = np.zeros((nb, 32), np.int64)
    r = 0
    for b in range(nb):
        if not (bitmap >> b) & 1:
            continue
        code = table[index.get(ib)]
        kind, a, v = code >> 10, (code >> 5) & 31, code & 31
        if kind == 1:
            c = a + 1
            pos = [pay.get(5) for _ in range(c)]
            assert all(pos[i] < pos[i + 1] for i in range(c - 1))
            sg = [pay.get(1) for _ in range(c)]
            for i in range(c):
                mv = pay.get(v) + 1
                q[b, pos[i]] = -mv if sg[i] else mv
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
            for i in range(32):
                q[b, i] = -mag[i] if neg.get(i, 0) else mag[i]
        else:
            raise NotImplementedError("raw blocks: not needed on the bundled dumps")
    return q, np.zeros(nb, bool)


def check_reference(x: np.ndarray, eb: float) -> int:
    """Encode with the slow reference, decode, compare q and the size model; the size."""
    buf = encode_v2(x, eb)
    qb, raw, _ = quantize(x, eb, 32)
    assert not raw.any()
    q, _ = decode_v2_q(buf)
    assert np.array_equal(q, qb), "reference round trip"
    assert len(buf) == v2_size(x, eb), (len(buf), v2_size(x, eb))
    return len(buf)


ROWS = ["v1 real", "v1 -lor", "sgn-nz (oracle)", "P+M", "P+M+S", "P+M+S +patch (oracle)",
        "P+M+S code H0", "P+M+S nibble codes", "P+M+S byte-aligned", "P+M+S B=64",
        "P+M+S B=128", "S+PP u16 codes, sign word", "S+PP u16 codes", "v2",
        "v2 sign section", "v2 sign word",
        "v2 +planes+Lorenzo", "v2 -sparse", "v2 byte-aligned", "v2 codes at H0",
        "v2 top-15 nibbles + escapes",
        "v2 two-level bitmap", "H0 floor", "SZ3"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", nargs="+", default=DEFAULT_FILES)
    ap.add_argument("--rel", nargs="+", type=float, default=[1e-2, 1e-3, 1e-4])
    ap.add_argument("--no-tensors", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true",
                    help="also encode and decode with the slow reference of the v2 spec "
                         "(each dump's first 64 Ki values and its first 4 tensors)")
    args = ap.parse_args()
    res: dict[str, Any] = {"concat": [], "tensors": []}
    if args.check:
        for path in args.files:
            x = load_concat(path)
            lo, hi = _cpu.finite_range(x)
            for rel in args.rel:
                eb = ccoll.REL(rel).resolve(lo, hi)
                print(f"reference v2 {os.path.basename(path)} REL {rel:g}: "
                      f"{check_reference(x[:65536], eb)} bytes, round trip and size model "
                      "agree", flush=True)
            for name, t in load_tensors(path)[:4]:
                tlo, thi = _cpu.finite_range(t)
                for rel in args.rel:
                    check_reference(t, ccoll.REL(rel).resolve(tlo, thi))
                print(f"reference v2 {name} {t.shape}: round trip and size model agree")
    for path in args.files:
        data = os.path.splitext(os.path.basename(path))[0]
        x = load_concat(path)
        lo, hi = _cpu.finite_range(x)
        for rel in args.rel:
            eb = ccoll.REL(rel).resolve(lo, hi)
            s = study(x, eb)
            res["concat"].append({"data": data, "rel": rel, "eb": eb, "nbytes": x.nbytes, **s})
        if args.no_tensors:
            continue
        for name, t in load_tensors(path):
            tlo, thi = _cpu.finite_range(t)
            for rel in args.rel:
                eb = ccoll.REL(rel).resolve(tlo, thi)
                if eb == 0.0:
                    continue
                s = study(t, eb)
                res["tensors"].append({"data": data, "tensor": name, "rel": rel,
                                       "nbytes": t.nbytes, **s})
    # concatenations: ratio of each layout, and its ratio over SZ3's
    hdr = "| layout | " + " | ".join(f"{r['data']} {r['rel']:g}" for r in res["concat"]) + " |"
    print(hdr)
    print("|---" * (1 + len(res["concat"])) + "|")
    for k in ROWS:
        cells = []
        for r in res["concat"]:
            ratio = r["nbytes"] / r[k]
            cells.append(f"{ratio:.2f} ({r['SZ3'] / r[k]:.2f}x)")
        print(f"| {k} | " + " | ".join(cells) + " |")
    print("| code H0 bits/block | " + " | ".join(f"{r['code H0 bits/block']:.2f}"
                                                for r in res["concat"]) + " |")
    print("| P+M+S blocks zero/planes/masked/sparse | " + " | ".join(
        "{zero}/{planes}/{masked}/{sparse}".format(**r["counts"]) for r in res["concat"]) + " |")
    print("| v2 blocks zero/PP/sparse/raw, ntab | " + " | ".join(
        "{zero}/{pp}/{sparse}/{raw}, {ntab}".format(**r["v2 stats"]) for r in res["concat"])
        + " |")
    print("| v2 PP blocks by k = 0, 1, 2, ... | " + " | ".join(
        "/".join(map(str, r["v2 stats"]["k_hist"])) for r in res["concat"]) + " |")
    if res["tensors"]:
        print()
        print("Per tensor: layout ratio / SZ3 ratio, median (min..max); sum of sizes ratio")
        keys = sorted({(r["data"], r["rel"]) for r in res["tensors"]})
        print("| layout | " + " | ".join(f"{d} {rel:g}" for d, rel in keys) + " |")
        print("|---" * (1 + len(keys)) + "|")
        for k in ROWS:
            cells = []
            for d, rel in keys:
                rows = [r for r in res["tensors"] if r["data"] == d and r["rel"] == rel]
                qs = np.array([r["SZ3"] / r[k] for r in rows])
                tot = sum(r["SZ3"] for r in rows) / sum(r[k] for r in rows)
                cells.append(f"{np.median(qs):.2f} ({qs.min():.2f}..{qs.max():.2f}) "
                             f"sum {tot:.2f}")
            print(f"| {k} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=float)


if __name__ == "__main__":
    main()
