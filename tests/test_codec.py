"""numcodecs codec "ccoll": numcodecs' own contract checks, bounds, config, registry, errors."""

from __future__ import annotations

import importlib
import json
from fractions import Fraction

import numpy as np
import pytest
from kit import assert_within, rel_bound

codec_mod = pytest.importorskip("ccoll.numcodecs_codec")  # numcodecs is the optional `codec` extra
CCollCodec = codec_mod.CCollCodec
common = importlib.import_module("numcodecs.tests.common")
registry = importlib.import_module("numcodecs.registry")

from ccoll.errors import CCollError, ErrorBoundError, FormatError, InputError  # noqa: E402

RNG = np.random.default_rng(3)
ARRAYS = {
    "f4 1-d": RNG.standard_normal(1000).astype("f4"),
    "f4 2-d C": RNG.standard_normal((50, 33)).astype("f4"),
    "f4 2-d F": np.asfortranarray(RNG.standard_normal((20, 31)).astype("f4")),
    "f8 3-d": RNG.standard_normal((4, 5, 70)),
    "f8 odd": RNG.standard_normal(33) * 1e-3,
}


def exact_eb(spec: str, x: np.ndarray) -> Fraction:
    """The bound ``spec`` promises for ``x``, computed here from the data, exactly."""
    kind, _, value = spec.partition(":")
    return rel_bound(float(value), x) if kind == "rel" else Fraction(float(value))


def decimals_within(eb: Fraction) -> int:
    """The most decimals numpy's ``assert_array_almost_equal`` (``|d| < 1.5 * 10**-decimal``)
    can ask for that an error below ``eb`` always meets."""
    d = 0
    while Fraction(3, 2) / 10 ** (d + 1) >= eb:
        d += 1
    return d


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_numcodecs_check_encode_decode(name):
    arr = ARRAYS[name]
    spec = "abs:1e-4"
    codec = CCollCodec(eb=spec, dtype=arr.dtype.name)
    # numcodecs' helper: numpy, bytes, bytearray and array.array inputs, decode into `out`,
    # compared to as many decimals as the codec's bound guarantees (4 for 1e-4).
    precision = decimals_within(exact_eb(spec, arr))
    assert precision == 4
    common.check_encode_decode(arr, codec, precision=precision)
    dec = np.asarray(codec.decode(codec.encode(arr)))
    dec = dec.reshape(arr.shape, order="F" if arr.flags.f_contiguous and arr.ndim > 1 else "C")
    assert_within(dec, arr, exact_eb(spec, arr), strict=True)


@pytest.mark.parametrize("name", sorted(ARRAYS))
@pytest.mark.parametrize("eb", ["abs:1e-5", "rel:1e-3", "rel:1e-6"])
def test_every_value_within_bound(name, eb):
    arr = ARRAYS[name]
    codec = CCollCodec(eb=eb)
    dec = np.asarray(codec.decode(codec.encode(arr)))
    dec = dec.reshape(arr.shape, order="F" if arr.flags.f_contiguous and arr.ndim > 1 else "C")
    assert_within(dec, arr, exact_eb(eb, arr), strict=True)


def test_c_contiguous_arrays_keep_their_shape_and_specials():
    x = RNG.standard_normal((6, 7)).astype("f4")
    x[0, 0], x[1, 1], x[2, 2] = np.nan, np.inf, -np.inf
    y = CCollCodec("rel:1e-3").decode(CCollCodec("rel:1e-3").encode(x))
    assert y.shape == (6, 7) and y.dtype == np.float32
    assert np.isnan(y[0, 0]) and y[1, 1] == np.inf and y[2, 2] == -np.inf


def test_decode_into_out():
    x = ARRAYS["f8 3-d"]
    enc = CCollCodec("abs:1e-6").encode(x)
    out = np.empty_like(x)
    assert CCollCodec("abs:1e-6").decode(enc, out=out) is out
    assert_within(out, x, 1e-6, strict=True)
    with pytest.raises(InputError, match="out holds 80 bytes of float64; the stream decodes"):
        CCollCodec("abs:1e-6").decode(enc, out=np.empty(10))
    # The same bytes in another float dtype were filled with the values' bit patterns.
    f4 = ARRAYS["f4 2-d C"]
    enc4 = CCollCodec("abs:1e-6").encode(f4)
    with pytest.raises(InputError, match="of float64; the stream decodes to"):
        CCollCodec("abs:1e-6").decode(enc4, out=np.empty(f4.size // 2, np.float64))
    raw = bytearray(f4.nbytes)  # raw bytes of the right size stay a valid out
    CCollCodec("abs:1e-6").decode(enc4, out=raw)
    assert_within(np.frombuffer(raw, np.float32).reshape(f4.shape), f4, 1e-6)
    ro = np.empty_like(f4)
    ro.flags.writeable = False  # numpy's ValueError escaped
    with pytest.raises(InputError, match="out is read-only"):
        CCollCodec("abs:1e-6").decode(enc4, out=ro)


@pytest.mark.parametrize("buf", ["abc", None, [1, 2, 3], np.array([b"x", 1], dtype=object)])
def test_decode_of_what_is_no_buffer_is_a_format_error(buf):
    # numcodecs' TypeError/ValueError escaped ("abc", None, a list, an object array).
    with pytest.raises(FormatError, match="buf must be a buffer of stream bytes"):
        CCollCodec("rel:1e-3").decode(buf)


@pytest.mark.parametrize(
    "kw",
    [
        dict(eb="rel:1e-3"),
        dict(eb="abs:1e-05"),
        dict(eb="abs:2.5e-07", dtype="float64"),
        dict(eb="rel:1e-3", version=2),
    ],
)
def test_config_round_trips_through_json_and_the_registry(kw):
    codec = CCollCodec(**kw)
    common.check_config(codec)  # JSON round trip, then numcodecs.get_codec -> equal codec
    config = json.loads(json.dumps(codec.get_config()))
    assert config["id"] == "ccoll" and set(config) <= {"id", "eb", "dtype", "version"}
    assert ("version" in config) == (kw.get("version", 1) != 1)
    assert CCollCodec.from_config({k: v for k, v in config.items() if k != "id"}) == codec
    assert eval(repr(codec), {"CCollCodec": CCollCodec}) == codec


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_version_2_writes_version_2_and_decodes_to_version_1s_values(name):
    arr = ARRAYS[name]
    v1, v2 = CCollCodec("rel:1e-3"), CCollCodec("rel:1e-3", version=2)
    e1, e2 = v1.encode(arr), v2.encode(arr)
    assert e1[4] == 1 and e2[4] == 2  # the stream header's version byte
    # the same quantized values: the same decoded bytes, whichever codec decodes
    d1 = np.asarray(v1.decode(e1))
    assert np.asarray(v2.decode(e2)).tobytes() == d1.tobytes()
    assert np.asarray(v1.decode(e2)).tobytes() == d1.tobytes()


def test_registered_through_the_entry_point():
    assert "ccoll" in registry.entries  # the numcodecs.codecs entry point of pyproject.toml
    codec = registry.get_codec({"id": "ccoll", "eb": "rel:1e-3"})
    assert isinstance(codec, CCollCodec) and codec.get_config() == {
        "id": "ccoll",
        "eb": "rel:0.001",
    }


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(eb=1e-3), ValueError, "eb must be a string"),
        (dict(eb="rel:0"), ErrorBoundError, "> 0"),
        (dict(eb="1e-3"), ErrorBoundError, "rel:1e-3"),
        (dict(eb="rel:1e-3", dtype="int32"), ValueError, "float32 or float64"),
        (dict(eb="rel:1e-3", version=3), ValueError, "version must be one of 1, 2, got 3"),
        (dict(eb="rel:1e-3", version=True), ValueError, "version must be one of"),
        (dict(eb="rel:1e-3", dtype="nonsense"), ValueError, "is not a dtype"),  # TypeError
    ],
)
def test_bad_arguments(kw, exc, match):
    # ccoll's own errors, which are ValueErrors as numcodecs' codecs raise.
    with pytest.raises(exc, match=match) as info:
        CCollCodec(**kw)
    assert isinstance(info.value, CCollError), type(info.value)


@pytest.mark.parametrize(
    "data, dtype, match",
    [
        (np.arange(10, dtype=np.int32), None, "got int32 data; ccoll codes float32"),
        # Typed data of another kind is refused even with a dtype: its bytes read as floats
        # coded other numbers without an error (float16 [0, 1, 2, 3] came back as 8e-3,
        # 32.06, ...).
        (np.arange(8, dtype=np.float16), "float32", "got float16 data; ccoll codes"),
        (np.arange(4, dtype=np.int32), "float32", "convert it first"),
        (b"\x00" * 16, None, "set dtype"),
        (b"\x00" * 10, "float64", "whole number"),
        (np.ones(4, np.float64), "float32", "configured for float32"),
        (np.asfortranarray(np.ones((3, 3))), "float32", "configured for float32"),
    ],
)
def test_bad_encode_input(data, dtype, match):
    with pytest.raises(InputError, match=match):  # a ValueError, as numcodecs' codecs raise
        CCollCodec("rel:1e-3", dtype=dtype).encode(data)


@pytest.mark.parametrize("data", [b"", b"CCOL" + b"\x00" * 60, b"\xff" * 200])
def test_decode_rejects_foreign_bytes(data):
    with pytest.raises(FormatError):
        CCollCodec("rel:1e-3").decode(data)


def test_pyproject_entry_point_names_the_codec_class():
    # The registry test above reads the installed metadata; this reads pyproject.toml, so a
    # renamed module cannot leave the entry point behind unnoticed.
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'\[project\.entry-points\."numcodecs\.codecs"\]\s*ccoll = "([^"]+)"', text)
    assert m, "pyproject.toml has no numcodecs.codecs entry point named ccoll"
    module, _, attr = m.group(1).partition(":")
    assert getattr(importlib.import_module(module), attr) is CCollCodec


def test_importing_the_codec_leaves_importlib_metadata_as_it_was():
    import importlib.metadata
    import subprocess
    import sys

    script = (
        "import importlib.metadata as m; before = m.version\n"
        "import ccoll.numcodecs_codec, numcodecs\n"
        "assert m.version is before, m.version\n"
        "print(m.version('zfpy') if 'zfpy' in {d.metadata['Name'] for d in m.distributions()} "
        "else 'no zfpy')\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    try:
        installed = importlib.metadata.version("zfpy")
    except importlib.metadata.PackageNotFoundError:
        installed = "no zfpy"
    assert p.stdout.strip() == installed  # zfpy reads as installed once numcodecs is in
