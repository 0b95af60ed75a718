"""Cutting streams at block boundaries and joining them (ccoll/compressor/cpu/slices.py).

Every 32-element block is encoded on its own, in format 1 and in format 2, so a block range
of a stream must be, byte for byte, the stream the encoder makes of the elements it covers,
and streams of consecutive ranges joined must be the stream of the whole; the same for
homomorphic sums. Recursive halving relies on both, in either format.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccoll.compressor import api
from ccoll.compressor.cpu.slices import concat, raw_blocks, slice_blocks
from ccoll.errors import FormatError, MismatchError


def _data(n: int, dtype: type, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size=n) * 1e-2
    x[rng.random(n) < 0.3] = 0.0  # zero blocks
    x[5 % n] = np.nan
    x[(n * 2) // 3] = 1e30  # a raw block
    x[n - 1] = -np.inf
    return x.astype(dtype)


VERSIONS = pytest.mark.parametrize("version", [1, 2])


@VERSIONS
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 50_003])
def test_slice_is_the_stream_of_its_elements(dtype: type, n: int, version: int) -> None:
    x = _data(n, dtype)
    eb = 1e-4
    s = api.compress_abs(x, eb, version=version)
    nb = -(-n // 32)
    cuts = {(0, nb), (0, 1), (nb - 1, nb), (nb // 3, nb // 3 + 1),
            (nb // 4, max(nb // 4 + 1, nb - 2)), (0, 0), (nb, nb), (nb // 2, nb // 2)}
    for b0, b1 in cuts:
        if not 0 <= b0 <= b1 <= nb:
            continue
        got = slice_blocks(s, b0, b1)
        want = api.compress_abs(x[32 * b0:min(n, 32 * b1)], eb, version=version)
        assert got.tobytes() == want.tobytes(), (b0, b1)
        assert api.header(got).version == version


@VERSIONS
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_concat_is_the_stream_of_the_whole(dtype: type, version: int) -> None:
    x = _data(40_001, dtype, seed=1)
    eb = 1e-3
    bounds = [0, 32, 32, 3200, 3232, 40_000, 40_001]  # an empty part too
    parts = [api.compress_abs(x[a:b], eb, version=version)
             for a, b in zip(bounds, bounds[1:], strict=False)]
    assert concat(parts).tobytes() == api.compress_abs(x, eb, version=version).tobytes()
    assert concat(parts[:1]).tobytes() == parts[0].tobytes()


@VERSIONS
def test_sums_cut_and_join_like_their_terms(version: int) -> None:
    x, y = _data(20_000, np.float32, 2), _data(20_000, np.float32, 3)
    eb = 1e-4
    sx, sy = (api.compress_abs(x, eb, version=version),
              api.compress_abs(y, eb, version=version))
    total = api.add(sx, sy)
    a = slice_blocks(total, 10, 400)
    b = api.add(slice_blocks(sx, 10, 400), slice_blocks(sy, 10, 400))
    assert a.tobytes() == b.tobytes()
    assert api.header(a).nterms == 2 and api.header(a).bound == api.header(total).bound
    nb = -(-20_000 // 32)
    joined = concat([slice_blocks(total, 0, 300), slice_blocks(total, 300, nb)])
    assert joined.tobytes() == total.tobytes()
    np.testing.assert_array_equal(api.decompress(a), api.decompress(total)[320:12_800])


def test_bad_ranges_and_mismatched_streams_are_clear_errors() -> None:
    x = _data(1000, np.float32)
    s = api.compress_abs(x, 1e-3)
    for b0, b1 in [(-1, 3), (5, 2), (0, 33), (33, 33)]:
        with pytest.raises(MismatchError, match="block range"):
            slice_blocks(s, b0, b1)
    with pytest.raises(MismatchError, match="at least one"):
        concat([])
    with pytest.raises(MismatchError, match="eb"):
        concat([api.compress_abs(x[:64], 1e-3), api.compress_abs(x[64:], 2e-3)])
    with pytest.raises(MismatchError, match="multiple of 32"):
        concat([api.compress_abs(x[:40], 1e-3), api.compress_abs(x[40:], 1e-3)])
    with pytest.raises(MismatchError, match="dtype"):
        concat([api.compress_abs(x[:64], 1e-3), api.compress_abs(x[64:].astype(np.float64), 1e-3)])
    v2 = api.compress_abs(x, 1e-3, version=2)
    with pytest.raises(FormatError, match="versions 1 and 2"):
        concat([api.compress_abs(x[:64], 1e-3), api.compress_abs(x[64:], 1e-3, version=2)])
    with pytest.raises(FormatError, match="versions 1 and 2"):
        concat([v2, s])
    broken = s.copy()
    broken[40] ^= 0xFF  # the header's nnz
    with pytest.raises(FormatError):
        slice_blocks(broken, 0, 1)


@VERSIONS
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 33, 1000, 50_003])
def test_raw_blocks_store_the_chosen_blocks_verbatim(dtype: type, n: int, version: int) -> None:
    x = _data(n, dtype, seed=3)
    eb = 1e-3
    s = api.compress_abs(x, eb, version=version)
    y = api.decompress(s)
    nb = -(-n // 32)
    chosen = np.unique(np.array([0, nb // 2, nb - 1, (n * 2) // 3 // 32], np.int64))
    r = raw_blocks(s, x, chosen)
    assert api.header(r).eb == eb and api.header(r).bound == api.header(s).bound
    assert api.header(r).version == version
    z = api.decompress(r)
    idx = np.arange(n)
    mine = np.isin(idx // 32, chosen)
    zeros = mine & (x == 0)
    same = mine & ~zeros
    assert np.array_equal(z[same].view(np.uint8), x[same].view(np.uint8))  # bit for bit
    assert np.all(z[zeros] == 0)
    assert np.array_equal(z[~mine].view(np.uint8), y[~mine].view(np.uint8))  # the rest kept
    # The other blocks keep their bytes: cut out, they are the original's slices.
    for b in range(nb):
        if b not in chosen:
            assert np.array_equal(slice_blocks(r, b, b + 1), slice_blocks(s, b, b + 1))
    assert np.array_equal(raw_blocks(s, x, np.zeros(0, np.int64)), s)


def test_raw_blocks_refuse_mismatched_data_and_blocks() -> None:
    x = _data(100, np.float32)
    s = api.compress_abs(x, 1e-3)
    with pytest.raises(MismatchError, match="raw_blocks"):
        raw_blocks(s, x.astype(np.float64), np.array([0]))
    with pytest.raises(MismatchError, match="raw_blocks"):
        raw_blocks(s, x[:99], np.array([0]))
    for bad in ([4], [-1], [2, 1], [1, 1]):
        with pytest.raises(MismatchError, match="sorted, distinct"):
            raw_blocks(s, x, np.array(bad))


def test_version_2_bad_ranges_and_damaged_streams_are_clear_errors() -> None:
    x = _data(1000, np.float32)
    s = api.compress_abs(x, 1e-3, version=2)
    for b0, b1 in [(-1, 3), (5, 2), (0, 33), (33, 33), (40, 41)]:
        with pytest.raises(MismatchError, match="block range"):
            slice_blocks(s, b0, b1)
    with pytest.raises(MismatchError, match="eb"):
        concat([api.compress_abs(x[:64], 1e-3, version=2),
                api.compress_abs(x[64:], 2e-3, version=2)])
    with pytest.raises(MismatchError, match="multiple of 32"):
        concat([api.compress_abs(x[:40], 1e-3, version=2),
                api.compress_abs(x[40:], 1e-3, version=2)])
    a = api.compress_abs(x, 1e-3, version=2)
    with pytest.raises(MismatchError, match="terms"):  # a sum and a fresh stream
        concat([slice_blocks(api.add(a, a), 0, 2), slice_blocks(a, 2, 32)])
    broken = s.copy()
    broken[40] ^= 0xFF  # the header's nnz
    with pytest.raises(FormatError):
        slice_blocks(broken, 0, 1)
    with pytest.raises(FormatError):
        concat([slice_blocks(s, 0, 2), broken])


def _kind_data(kind: str, n: int, dtype: type, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "zero":
        return np.zeros(n, dtype)
    if kind == "constant":
        return np.full(n, 0.3718, dtype)
    if kind == "sparse":  # mostly zero blocks, a few values: sparse codes
        x = np.zeros(n, dtype)
        k = max(1, n // 50)
        x[rng.integers(0, n, k)] = rng.standard_normal(k)
        return x
    return _data(n, dtype, seed)  # heavy tails, zeros, NaN, ±Inf, a raw block


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4000).filter(lambda v: v % 32 != 0) | st.sampled_from([32, 64, 4096]),
    dtype=st.sampled_from([np.float32, np.float64]),
    kind=st.sampled_from(["zero", "constant", "sparse", "mixed"]),
    eb=st.sampled_from([0.0, 1e-5, 1e-3, 0.1]),
    terms=st.integers(1, 3),
    cuts=st.lists(st.floats(0, 1), min_size=2, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_version_2_cuts_and_joins_are_the_encoders_streams(n, dtype, kind, eb, terms, cuts,
                                                          seed):
    # One random array (or a sum of up to three): every block range of its stream is the
    # stream of that range's elements (or the sum of those), and the ranges joined back
    # are the whole stream, byte for byte; the header's bound and nterms are kept.
    xs = [_kind_data(kind, n, dtype, seed + t) for t in range(terms)]
    nb = -(-n // 32)

    def stream(lo: int, hi: int) -> np.ndarray:
        out = api.compress_abs(xs[0][lo:hi], eb, version=2)
        for x in xs[1:]:
            out = api.add(out, api.compress_abs(x[lo:hi], eb, version=2))
        return out

    whole = stream(0, n)
    edges = sorted({0, nb, *(int(c * nb) for c in cuts)})
    pieces = []
    for b0, b1 in zip(edges, edges[1:], strict=False):
        got = slice_blocks(whole, b0, b1)
        assert got.tobytes() == stream(32 * b0, min(n, 32 * b1)).tobytes(), (b0, b1)
        h = api.header(got)
        assert (h.version, h.nterms, h.bound) == (2, terms, api.header(whole).bound)
        pieces.append(got)
    empty = slice_blocks(whole, edges[1], edges[1])
    assert empty.tobytes() == stream(0, 0).tobytes()
    assert concat([empty, *pieces]).tobytes() == whole.tobytes()
    np.testing.assert_array_equal(api.decompress(pieces[-1]),
                                  api.decompress(whole)[32 * edges[-2]:])
