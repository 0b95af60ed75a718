"""Frozen v1 streams: today's compressor reproduces them byte for byte and decodes them.

A change that alters these bytes changes format version 1; it needs a new version number
(and new fixtures from tests/fixtures/make_fixtures.py), not an edit of the old ones.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

import ccoll

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402

NAMES = sorted(make_fixtures.CASES)


def test_every_case_is_frozen():
    assert sorted(p.stem for p in FIXTURES.glob("*.ccoll")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_compress_reproduces_the_frozen_stream(name):
    frozen = (FIXTURES / f"{name}.ccoll").read_bytes()
    assert make_fixtures.CASES[name]().tobytes() == frozen


@pytest.mark.parametrize("name", NAMES)
def test_frozen_stream_decodes_to_the_frozen_values(name):
    frozen = (FIXTURES / f"{name}.ccoll").read_bytes()
    want = np.load(FIXTURES / f"{name}.npy")
    got = ccoll.decompress(frozen)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_frozen_values_are_within_the_bound_of_the_inputs():
    from kit import assert_within_bound

    x = make_fixtures._gradient()
    buf = (FIXTURES / "f32_gradient_rel1e-3.ccoll").read_bytes()
    assert_within_bound(ccoll.decompress(buf), x, ccoll.compressor.header(buf).eb)
