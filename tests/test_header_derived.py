"""A stream header's derived numbers (offsets, lengths) are cached per header, never stale.

The expected numbers come from the layout in docs/format.md ("Overview" and "Overview
(version 2)"), written out below, not from ccoll.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import ccoll
from ccoll.compressor import format as fmt


def _roundup4(v: int) -> int:
    return -(-v // 4) * 4


def _spec(version: int, shape: tuple[int, ...], nnz: int, payload_words: int, ntab: int,
          nmask: int) -> dict[str, int]:
    """nblocks, section offsets and total length as docs/format.md lays them out."""
    nblocks = -(-math.prod(shape) // 32)
    h = 64 + 8 * len(shape)  # header, then the shape
    codes = h + 4 * -(-nblocks // 32)  # after the bitmap: v1's codes, v2's table
    if version == 1:
        payload = codes + _roundup4(nnz)
    else:
        ib = (ntab - 1).bit_length() if ntab > 1 else 0
        index = codes + 4 * -(-ntab // 2)
        payload = index + 4 * -(-(nnz * ib) // 32) + 4 * nmask
    return {"nblocks": nblocks, "codes_offset": codes, "payload_offset": payload,
            "nbytes": payload + 4 * payload_words}


def _derived(h: fmt.StreamHeader) -> dict[str, int]:
    return {name: getattr(h, name)
            for name in ("nblocks", "codes_offset", "payload_offset", "nbytes")}


@pytest.mark.parametrize("version", [1, 2])
def test_derived_numbers_follow_the_fields_of_each_header(version: int) -> None:
    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    s = ccoll.compress(x, ccoll.ABS(1e-2), version=version)
    h = fmt.parse_header(s)
    assert h.nnz > 0 and h.payload_words > 0  # so that the changes below change the layout
    assert _derived(h) == _spec(version, (5000,), h.nnz, h.payload_words, h.ntab, h.nmask)
    assert h.nbytes == s.size
    assert vars(h)["nbytes"] == s.size  # kept on the instance after the first read
    # Each copy with other fields computes its own numbers, after h's are cached: none of
    # h's carries over, whichever the first read of the copy is.
    changes = [
        {"nnz": 0, "payload_words": 0, "ntab": 0, "nmask": 0},
        {"shape": (70, 3000)},  # more blocks, two dimensions
        {"nnz": h.nnz + 5, "ntab": 3, "nmask": 2, "payload_words": h.payload_words + 7},
    ]
    for change in changes:
        h2 = dataclasses.replace(h, **change)
        want = _spec(version, h2.shape, h2.nnz, h2.payload_words, h2.ntab, h2.nmask)
        assert want != _derived(h), change
        assert _derived(h2) == want, change
        assert dataclasses.replace(h, **change).nbytes == want["nbytes"], change
    assert _derived(h) == _spec(version, (5000,), h.nnz, h.payload_words, h.ntab, h.nmask)
