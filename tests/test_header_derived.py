"""A stream header's derived numbers (offsets, lengths) are cached per header, never stale."""

from __future__ import annotations

import dataclasses

import numpy as np

import ccoll
from ccoll.compressor import format as fmt


def test_derived_numbers_match_the_stream_and_a_fresh_header() -> None:
    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    for version in (1, 2):
        s = ccoll.compress(x, ccoll.ABS(1e-2), version=version)
        h = fmt.parse_header(s)
        assert h.nbytes == s.size
        assert vars(h)["nbytes"] == s.size  # kept on the instance after the first read
        # A changed copy computes its own numbers: nothing is carried over from h's cache.
        h2 = dataclasses.replace(h, nnz=0, payload_words=0, ntab=0, nmask=0)
        fresh = fmt.StreamHeader(**{f.name: getattr(h2, f.name)
                                    for f in dataclasses.fields(fmt.StreamHeader)})
        for name in ("nblocks", "codes_offset", "payload_offset", "nbytes"):
            assert getattr(h2, name) == getattr(fresh, name)
        assert h2.nbytes < h.nbytes
        assert fmt.StreamHeader.nbytes.__doc__  # the class attribute is the descriptor
