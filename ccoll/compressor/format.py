"""Header of the ccoll stream, format versions 1 and 2 (docs/format.md specifies every byte).

This module is pure Python and numpy: it packs, parses and validates headers and computes
the layout of the sections. Both backends use it, so the layout is defined once.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from ccoll.errors import FormatError

__all__ = [
    "MAGIC",
    "VERSION",
    "VERSION2",
    "VERSIONS",
    "MAX_N_V2",
    "NCODES_V2",
    "bitlen",
    "BLOCK",
    "HEADER_NBYTES",
    "MAX_NDIM",
    "CODE_RAW",
    "CODE_RAW64",
    "LORENZO_BIT",
    "StreamHeader",
    "dtype_code",
    "SOURCE_CODES",
    "SOURCE_NAMES",
    "parse_header",
    "header_prefix_nbytes",
    "max_nbytes",
]

MAGIC = b"CCOL"
VERSION = 1
VERSION2 = 2
VERSIONS = (VERSION, VERSION2)
BLOCK = 32
HEADER_NBYTES = 64
MAX_NDIM = 32
MAX_N = 1 << 48
MAX_N_V2 = 1 << 37  # version 2: block and mask counts fit u32
NCODES_V2 = 1122  # valid 16-bit block codes of version 2 (docs/format.md, "Block codes")
CODE_RAW = 32
CODE_RAW64 = 33
LORENZO_BIT = 0x80

_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.float32), 2: np.dtype(np.float64)}
_CODES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}
# Byte 7, the source dtype: what a float32 stream's data was before it became its exact
# float32 copy (0: float32 itself), so that decompress gives that dtype back.
SOURCE_CODES = {"float16": 1, "bfloat16": 2}
SOURCE_NAMES = {v: k for k, v in SOURCE_CODES.items()}
# magic, version, dtype, ndim, source, block_size, reserved (v2: nmask), n, eb, bound,
# nnz, payload_words, nterms, reserved (v2: ntab)
_FIXED = struct.Struct("<4sBBBBIIQddQQII")
assert _FIXED.size == HEADER_NBYTES


def dtype_code(dtype: np.dtype) -> int:
    """Code of a supported dtype (1 = float32, 2 = float64); ``FormatError`` otherwise."""
    try:
        return _CODES[np.dtype(dtype)]
    except KeyError:
        raise FormatError(f"ccoll streams hold float32 or float64, not {np.dtype(dtype)}") from None


def _roundup4(k: int) -> int:
    return (k + 3) & ~3


def bitlen(v: int) -> int:
    """Return the number of bits of the non-negative integer ``v`` (``bitlen(0) = 0``)."""
    return int(v).bit_length()


_T = TypeVar("_T")


class _derived(Generic[_T]):
    """A header's derived number: every one of them computed at the first read of any.

    ``StreamHeader._lay`` computes them all at once and writes them into the instance's
    ``__dict__``, where later reads find them as plain attributes (this is a non-data
    descriptor). One call of straight arithmetic: the offsets follow from one another
    (``nbytes`` through eight of them), and one property computing the next took 3-4 us
    per header, a few percent of a small ring step (docs/performance.md, "A small call's
    fixed cost"). Two threads that read a header first both compute the same numbers
    from its frozen fields, so either write is right.
    """

    def __init__(self, doc: str) -> None:
        self.name = ""
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> _T:
        if obj is None:
            return self  # type: ignore[return-value]
        obj._lay()
        return obj.__dict__[self.name]  # type: ignore[no-any-return]


@dataclass(frozen=True, init=False)
class StreamHeader:
    """Parsed header of a stream, with the offsets of its sections.

    The derived numbers (element count, offsets) are computed once per header, all at
    once: the validation and kernels of one call read them dozens of times.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    eb: float
    bound: float
    nnz: int
    payload_words: int
    nterms: int = 1
    version: int = VERSION
    nmask: int = 0  # version 2: patched-planes blocks (words of the mask section)
    ntab: int = 0  # version 2: codes in the table
    source: int = 0  # byte 7: the data's dtype before its float32 copy (SOURCE_CODES), or 0

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], eb: float, bound: float,
                 nnz: int, payload_words: int, nterms: int = 1, version: int = VERSION,
                 nmask: int = 0, ntab: int = 0, source: int = 0) -> None:
        # The fields at once: a frozen dataclass's own __init__ sets each through
        # object.__setattr__, 2.3 us for the ten against 0.6 (every stream call makes one
        # or two headers).
        self.__dict__.update(dtype=dtype, shape=shape, eb=eb, bound=bound, nnz=nnz,
                             payload_words=payload_words, nterms=nterms, version=version,
                             nmask=nmask, ntab=ntab, source=source)

    @property
    def source_dtype(self) -> str | None:
        """``"float16"`` or ``"bfloat16"`` where the data was that before its float32 copy."""
        return SOURCE_NAMES.get(self.source)

    n = _derived[int]("Element count.")
    ndim = _derived[int]("Number of dimensions.")
    nblocks = _derived[int]("Number of 32-element blocks.")
    bitmap_words = _derived[int]("Length of the non-zero-block bitmap in words.")
    bitmap_offset = _derived[int]("Byte offset of the bitmap.")
    codes_offset = _derived[int](
        "Byte offset of the section after the bitmap: v1's code bytes, v2's table.")
    table_offset = _derived[int](
        "Version 2: byte offset of the code table (``ntab`` u16, padded to 4 bytes).")
    index_bits = _derived[int](
        "Version 2: width ``ib`` of an index field, ``bitlen(ntab - 1)`` (0 if ntab <= 1).")
    index_offset = _derived[int]("Version 2: byte offset of the index bit stream.")
    index_words = _derived[int]("Version 2: length of the index section in words.")
    mask_offset = _derived[int]("Version 2: byte offset of the mask words (``nmask`` of them).")
    payload_offset = _derived[int]("Byte offset of the payload (a multiple of 4).")
    nbytes = _derived[int]("Total length of the stream in bytes.")

    def _lay(self) -> None:
        """Compute every derived number (docs/format.md, "Overview" and its version 2)."""
        n = math.prod(self.shape)
        ndim = len(self.shape)
        nblocks = (n + BLOCK - 1) // BLOCK
        bitmap_words = (nblocks + 31) // 32
        bitmap_offset = HEADER_NBYTES + 8 * ndim
        codes_offset = bitmap_offset + 4 * bitmap_words
        ntab = self.ntab
        index_bits = bitlen(ntab - 1) if ntab > 1 else 0
        index_offset = codes_offset + 4 * ((ntab + 1) // 2)
        index_words = (self.nnz * index_bits + 31) // 32
        mask_offset = index_offset + 4 * index_words
        if self.version == VERSION2:
            payload_offset = mask_offset + 4 * self.nmask
        else:
            payload_offset = codes_offset + _roundup4(self.nnz)
        self.__dict__.update(
            n=n, ndim=ndim, nblocks=nblocks, bitmap_words=bitmap_words,
            bitmap_offset=bitmap_offset, codes_offset=codes_offset, table_offset=codes_offset,
            index_bits=index_bits, index_offset=index_offset, index_words=index_words,
            mask_offset=mask_offset, payload_offset=payload_offset,
            nbytes=payload_offset + 4 * self.payload_words,
        )

    def pack(self) -> np.ndarray:
        """Pack the 64-byte header and the shape into a uint8 array (nothing after them)."""
        res = np.empty(HEADER_NBYTES + 8 * len(self.shape), np.uint8)
        self.pack_into(res)
        return res

    def pack_into(self, res: np.ndarray) -> None:
        """Write what :meth:`pack` returns into the first bytes of the uint8 array ``res``."""
        v2 = self.version == VERSION2
        buf = memoryview(res)  # type: ignore[arg-type]  # numpy's stubs lack the buffer protocol
        _FIXED.pack_into(
            buf,
            0,
            MAGIC,
            self.version,
            dtype_code(self.dtype),
            self.ndim,
            self.source,
            BLOCK,
            self.nmask if v2 else 0,
            self.n,
            float(self.eb),
            float(self.bound),
            self.nnz,
            self.payload_words,
            self.nterms,
            self.ntab if v2 else 0,
        )
        struct.pack_into(f"<{self.ndim}Q", buf, HEADER_NBYTES, *self.shape)


def _check_magic_and_version(buf: np.ndarray) -> None:
    """Refuse foreign bytes before reading any field: magic first, then version.

    Fields of a foreign file mean nothing; reporting one ("ndim=119") would hide that the
    bytes are not a ccoll stream at all.
    """
    head = buf[: len(MAGIC)].tobytes()
    if head != MAGIC[: len(head)] or buf.size == 0:
        what = f"starts with {head!r}" if head else "is empty"
        raise FormatError(f"not a ccoll stream: it {what}, expected the magic {MAGIC!r}")
    if buf.size > 4 and int(buf[4]) not in VERSIONS:
        raise FormatError(
            f"unsupported ccoll stream version {int(buf[4])} (this build reads versions 1 and 2)"
        )


def header_prefix_nbytes(buf: np.ndarray) -> int:
    """How many leading bytes ``parse_header`` needs (64 plus the shape), read from ``buf``.

    ``buf`` must hold at least the 64-byte fixed header; a device backend copies those
    first, then the shape. The magic and the version are checked before anything else.
    """
    _check_magic_and_version(buf)
    if buf.size < HEADER_NBYTES:
        raise FormatError(
            f"stream too short: {buf.size} bytes, a header alone is {HEADER_NBYTES} bytes"
        )
    ndim = int(buf[6])
    if ndim > MAX_NDIM:
        raise FormatError(f"stream header says ndim={ndim}, at most {MAX_NDIM} is allowed")
    return HEADER_NBYTES + 8 * ndim


def parse_header(
    buf: np.ndarray, total_nbytes: int | None = None, *, exact: bool = True
) -> StreamHeader:
    """Parse and validate a header from the first bytes of a host uint8 array.

    ``total_nbytes`` is the length of the whole stream (``buf.size`` when ``None``). With
    ``exact`` the length must equal the header's total; otherwise it must be at least that.
    Raises :class:`ccoll.FormatError` naming the first problem found.
    """
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        raise FormatError("a ccoll stream is a 1-D uint8 array")
    total = buf.size if total_nbytes is None else int(total_nbytes)
    # One copy of the bytes a header can take, read at once; a stream that fails the first
    # checks goes through header_prefix_nbytes, which names its first problem in the order
    # docs/format.md checks them (magic, version, length, ndim). A ring call parses each
    # of its streams' headers several times (docs/performance.md, "A small call's fixed
    # cost").
    raw = buf[: HEADER_NBYTES + 8 * MAX_NDIM].tobytes()
    fields = _FIXED.unpack_from(raw, 0) if len(raw) >= HEADER_NBYTES else None
    if fields is None or fields[0] != MAGIC or fields[1] not in VERSIONS or fields[3] > MAX_NDIM:
        header_prefix_nbytes(buf)  # raises
        raise FormatError("stream header is not readable")  # not reached: the line above raises
    (magic, version, dcode, ndim, r0, block, r1, n, eb, bound, nnz, pwords, nterms, r2) = fields
    prefix = HEADER_NBYTES + 8 * ndim
    if buf.size < prefix:
        raise FormatError(f"stream truncated inside its header ({buf.size} < {prefix} bytes)")
    v2 = version == VERSION2
    if dcode not in _DTYPES:
        raise FormatError(f"unknown dtype code {dcode} in stream header (1=float32, 2=float64)")
    if r0 and (r0 not in SOURCE_NAMES or dcode != 1):
        raise FormatError(
            f"source dtype code {r0} at byte 7 of a {_DTYPES[dcode]} stream header: 0, or in "
            "a float32 stream 1 (float16) or 2 (bfloat16)")
    if not v2 and (r1 or r2):
        raise FormatError("reserved header fields are not zero")
    if block != BLOCK:
        raise FormatError(f"block size {block} in stream header, version {version} uses {BLOCK}")
    shape = struct.unpack_from(f"<{ndim}Q", raw, HEADER_NBYTES)  # a tuple of ints
    if n >= MAX_N:
        raise FormatError(f"element count {n} in stream header is implausibly large")
    # Every dimension, and the product of the non-zero ones: numpy refuses to make an
    # array whose dimensions multiply beyond its address space, even with a zero among them.
    if ndim and math.prod(d for d in shape if d) >= MAX_N:
        raise FormatError(f"stream header shape {shape} is implausibly large")
    if math.prod(shape) != n:
        raise FormatError(f"stream header count {n} does not match its shape {shape}")
    if v2 and n >= MAX_N_V2:
        raise FormatError(
            f"element count {n} in a version-2 stream header: version 2 holds fewer than "
            f"2^37 elements"
        )
    if not (math.isfinite(eb) and eb >= 0.0):
        raise FormatError(f"stream header error bound {eb!r} is not finite and >= 0")
    if not (math.isfinite(bound) and bound >= 0.0):
        raise FormatError(f"stream header bound {bound!r} is not finite and >= 0")
    if nterms < 1:
        raise FormatError("stream header nterms is 0")
    hdr = StreamHeader(
        dtype=_DTYPES[dcode],
        shape=shape,
        eb=eb,
        bound=bound,
        nnz=nnz,
        payload_words=pwords,
        nterms=nterms,
        version=version,
        nmask=r1 if v2 else 0,
        ntab=r2 if v2 else 0,
        source=r0,
    )
    if hdr.nnz > hdr.nblocks:
        raise FormatError(f"stream says {nnz} non-zero blocks but has only {hdr.nblocks} blocks")
    if v2:
        if hdr.nmask > hdr.nnz:
            raise FormatError(
                f"stream header nmask {hdr.nmask} exceeds its {nnz} non-zero blocks"
            )
        top = min(hdr.nnz, NCODES_V2)
        if (hdr.ntab != 0) if hdr.nnz == 0 else not (1 <= hdr.ntab <= top):
            raise FormatError(
                f"stream header ntab {hdr.ntab} is not allowed for {nnz} non-zero blocks "
                f"(0 without any, else 1..{top})"
            )
    max_words = hdr.nnz * 64
    if hdr.payload_words > max_words:
        raise FormatError(
            f"stream payload of {pwords} words exceeds the maximum {max_words} for {nnz} blocks"
        )
    need = hdr.nbytes
    if (exact and total != need) or total < need:
        raise FormatError(
            f"stream length {total} bytes does not match its header ({need} bytes): "
            "truncated or trailing data"
        )
    return hdr


def max_nbytes(n: int, dtype: np.dtype | type, ndim: int = 1, version: int = VERSION) -> int:
    """Largest possible stream for ``n`` elements of ``dtype`` with ``ndim`` dimensions.

    Every block raw, and float32 blocks possibly raw float64 (after a homomorphic add).
    Used to size receive buffers without exchanging sizes. ``version`` is the stream
    format (2 adds the table and an 11-bit index field per block; no block of version 2
    is longer than 2048 payload bits, and a patched-planes block with its mask word stays
    below that).
    """
    dtype_code(np.dtype(dtype))
    nblocks = (n + BLOCK - 1) // BLOCK
    head = HEADER_NBYTES + 8 * ndim + 4 * ((nblocks + 31) // 32)
    if version == VERSION2:
        ntab = min(nblocks, NCODES_V2)
        return head + 4 * ((ntab + 1) // 2) + 4 * ((nblocks * 11 + 31) // 32) + 256 * nblocks
    return head + _roundup4(nblocks) + 256 * nblocks
