"""Frozen v1 streams: today's compressor reproduces them byte for byte and decodes them.

The inputs are frozen too (``NAME.in.npy``, read back, never drawn again). A change that
alters these bytes changes format version 1; it needs a new version number (and new
fixtures from tests/fixtures/make_fixtures.py), not an edit of the old ones.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from kit import assert_within, rel_bound

import ccoll

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402

NAMES = make_fixtures.CASES


def test_every_case_is_frozen():
    assert sorted(p.stem for p in FIXTURES.glob("*.ccoll")) == NAMES
    assert sorted(p.name[: -len(".in.npy")] for p in FIXTURES.glob("*.in.npy")) == NAMES
    # Small files only: the fixtures travel with every clone.
    assert sum(p.stat().st_size for p in FIXTURES.iterdir()) < 200_000


@pytest.mark.parametrize("name", NAMES)
def test_compress_reproduces_the_frozen_stream(name):
    frozen = (FIXTURES / f"{name}.ccoll").read_bytes()
    x = np.load(FIXTURES / f"{name}.in.npy")
    assert make_fixtures.stream(name, x).tobytes() == frozen


@pytest.mark.parametrize("name", NAMES)
def test_frozen_stream_decodes_to_the_frozen_values(name):
    frozen = (FIXTURES / f"{name}.ccoll").read_bytes()
    want = np.load(FIXTURES / f"{name}.npy")
    got = ccoll.decompress(frozen)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", sorted(set(NAMES) - make_fixtures.SUMS))
def test_frozen_values_are_within_the_bound_of_the_inputs(name):
    x = np.load(FIXTURES / f"{name}.in.npy")
    y = ccoll.decompress((FIXTURES / f"{name}.ccoll").read_bytes())
    eb = make_fixtures.BOUNDS[name]
    e = rel_bound(eb.value, x) if isinstance(eb, ccoll.REL) else eb.value
    assert_within(y, x, e, strict=e > 0)
