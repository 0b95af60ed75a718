"""A small crafted file cannot make ``ccoll decompress`` allocate what it claims.

Each file here is a few kilobytes on disk and claims gigabytes (a shape attribute, a zstd
frame header, an HDF5 dataspace with nothing stored). Decompressing or verifying it must
raise ``FormatError`` naming the claim, and the process must not allocate anywhere near
the claimed size (tracemalloc sees numpy's and python-zstandard's buffers).
"""

from __future__ import annotations

import os
import re
import struct
import tracemalloc

import h5py
import numpy as np
import pytest

import ccoll
from ccoll.errors import FormatError
from ccoll.h5 import attrs as A
from ccoll.h5.decompress import decompress_file, verify_dataset

zstd = pytest.importorskip("zstandard")

ALLOWED_PEAK = 16 << 20  # bytes; each claim below is 1 GiB or more
HUGE_SHAPE = [1 << 40]  # elements


def zstd_frame_claiming(nbytes: int, payload: bytes = b"\0") -> bytes:
    """A zstd frame whose header says ``nbytes`` of content, carrying ``payload`` only.

    RFC 8878: magic, a frame header descriptor with an 8-byte content size and a window
    descriptor, then one last raw block.
    """
    head = b"\x28\xb5\x2f\xfd" + bytes([0xC0, 0x00]) + struct.pack("<Q", nbytes)
    return head + ((len(payload) << 3) | 1).to_bytes(3, "little") + payload


def small_stream() -> bytes:
    return ccoll.compress(np.linspace(-1, 1, 64, dtype=np.float32), ccoll.ABS(1e-3)).tobytes()


def write_crafted(path, *, stored: bytes | None, shape, lossless: str,
                  dataspace: int | None = None) -> None:
    with h5py.File(path, "w") as f:
        f.attrs[A.ROOT_VERSION] = ccoll.__version__
        if stored is not None:
            ds = f.create_dataset("g", data=np.frombuffer(stored, np.uint8))
        else:  # a dataspace of `dataspace` bytes with nothing written
            ds = f.create_dataset("g", shape=(dataspace,), dtype=np.uint8)
        ds.attrs[A.FORMAT_VERSION] = 1
        ds.attrs[A.DTYPE] = "float32"
        ds.attrs[A.SHAPE] = np.asarray(shape, np.int64)
        ds.attrs[A.BOUND] = "abs:0.001"
        ds.attrs[A.LOSSLESS] = lossless


CRAFTED = {
    # A 19-byte frame that says it holds 2 GiB; the shape attribute allows it.
    "zstd frame claims 2 GiB": (
        dict(stored=zstd_frame_claiming(2 << 30), shape=HUGE_SHAPE, lossless="zstd"),
        "zstd frame says 2147483648 bytes"),
    # An honest frame of a 64-element stream under a shape of 2**40 elements.
    "shape claims 2**40 elements (zstd)": (
        dict(stored=zstd.ZstdCompressor(write_content_size=True).compress(small_stream()),
             shape=HUGE_SHAPE, lossless="zstd"),
        "attributes say float32"),
    "shape claims 2**40 elements (no zstd)": (
        dict(stored=small_stream(), shape=HUGE_SHAPE, lossless="none"),
        "attributes say float32"),
    # The HDF5 dataset itself: 1 GiB of bytes declared, none stored.
    "dataset declares 1 GiB, stores nothing": (
        dict(stored=None, dataspace=1 << 30, shape=[64], lossless="none"),
        "declares 1073741824 bytes but stores 0"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_claim_is_refused_without_allocating_it(tmp_path, case):
    kw, match = CRAFTED[case]
    src = tmp_path / "crafted.h5"
    write_crafted(src, **kw)
    assert os.path.getsize(src) < 64 << 10  # small on disk
    tracemalloc.start()
    errors = []
    try:
        try:
            decompress_file(str(src), str(tmp_path / "out.h5"))
        except Exception as exc:  # noqa: BLE001 - checked below, after the peak
            errors.append(exc)
        with h5py.File(src) as f:
            try:
                verify_dataset(f["g"])
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < ALLOWED_PEAK, f"{peak / 2**20:.0f} MiB allocated for a crafted file"
    assert len(errors) == 2, errors
    for exc in errors:
        assert isinstance(exc, FormatError), repr(exc)
        assert re.search(match, str(exc)), str(exc)


def test_a_frame_within_what_its_bytes_can_hold_still_decodes(tmp_path):
    # The cap follows the frame's size: the stream of 2**22 zeros (its bitmap: 16 KiB)
    # packs into a few dozen bytes and is still within what those bytes can hold (zstd
    # regenerates at most 128 KiB per 4-byte block), so it is not refused.
    x = np.zeros(1 << 22, np.float32)
    stream = ccoll.compress(x, ccoll.ABS(1e-3)).tobytes()
    frame = zstd.ZstdCompressor(write_content_size=True).compress(stream)
    assert len(frame) * 64 < len(stream)  # the frame is far smaller than its content
    src = tmp_path / "zeros.h5"
    write_crafted(src, stored=frame, shape=[x.size], lossless="zstd")
    rep = decompress_file(str(src), str(tmp_path / "out.h5"))
    assert rep["totals"]["restored"] == 1
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.array_equal(f["g"][()], x)
