"""ccoll.h5 inspect and eval: sizes, ratios, bounds, peers, metrics and the plot."""

from __future__ import annotations

import math
from fractions import Fraction

import h5py
import numpy as np
import pytest
from h5kit import DIGITS, make_sample
from kit import rel_bound

from ccoll.errorbound import ABS, REL
from ccoll.errors import ErrorBoundError, InputError
from ccoll.h5 import evaluate as ev
from ccoll.h5.compress import compress_file
from ccoll.h5.evaluate import evaluate_file, parse_bounds, parse_peers, parse_versions
from ccoll.h5.inspect import inspect_file
from ccoll.h5.peers import load


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("h5") / "sample.h5")
    make_sample(p)
    return p


def test_inspect_raw_file():
    rep = inspect_file(DIGITS)
    assert rep["ccoll_version"] is None
    assert len(rep["datasets"]) == 30 and rep["groups"] == 5
    r = next(d for d in rep["datasets"] if d["path"] == "/step_0000/fc.weight")
    assert r["shape"] == [10, 512] and r["dtype"] == "float32" and r["codec"] == "raw"
    assert r["stored_bytes"] == r["original_bytes"] == 20480 and r["ratio"] == 1.0
    assert r["bound"] == "exact"
    assert rep["totals"]["original_bytes"] == sum(d["original_bytes"] for d in rep["datasets"])


def test_inspect_compressed_file_matches_compress_report(sample, tmp_path):
    c = str(tmp_path / "c.h5")
    crep = compress_file(sample, c, "rel:1e-2", lossless="zstd")
    rep = inspect_file(c)
    assert rep["ccoll_version"]
    by_path = {d["path"]: d for d in rep["datasets"]}
    for r in crep["datasets"]:
        d = by_path[r["path"]]
        assert d["shape"] == r["shape"] and d["dtype"] == r["dtype"]
        assert d["original_bytes"] == r["original_bytes"]
        assert d["stored_bytes"] == r["stored_bytes"] or r["stored_bytes"] == 0
        assert d["kept_raw"] == (r["stored_as"] == "raw")
        if r["stored_as"] == "stream":
            assert d["codec"] == "ccoll+zstd" and d["bound"] == "rel:0.01"
            assert d["eb_abs"] == r["eb_abs"]
        else:  # kept as it was: exact
            assert d["codec"] == "raw" and d["bound"] == "exact" and d["eb_abs"] is None
            assert r["eb_abs"] == 0.0 and d["verified"] is True
    assert {r["path"] for r in crep["datasets"] if r["stored_as"] == "raw"} == {
        "/step_0000/scalar", "/step_0000/empty"  # 4 and 0 bytes: no stream is smaller
    }
    assert (
        by_path["/labels"]["codec"] == "raw" and not by_path["/labels"]["kept_raw"]
        and by_path["/step_0000/chunked"]["codec"] == "ccoll+zstd"
    )
    assert rep["compressed_totals"]["datasets"] == crep["totals"]["compressed"] == 8
    assert rep["kept_raw"] == crep["totals"]["kept_raw"] == 2
    assert by_path["/step_0000/fc.weight"]["format_version"] == 1
    assert by_path["/labels"]["format_version"] is None


def test_inspect_names_format_version_2(sample, tmp_path):
    c = str(tmp_path / "c.h5")
    crep = compress_file(sample, c, "rel:1e-3", version=2)
    rep = inspect_file(c)
    comp = [d for d in rep["datasets"] if d["format_version"] is not None]
    assert len(comp) == crep["totals"]["compressed"] and rep["damaged"] == []
    assert {d["codec"] for d in comp} == {"ccoll v2"}
    assert {d["format_version"] for d in comp} == {2}


@pytest.mark.parametrize("spec, expect", [("1", [1]), ("2,1", [2, 1]), (" 1 , 2,2", [1, 2])])
def test_parse_versions(spec, expect):
    assert parse_versions(spec) == expect


@pytest.mark.parametrize("spec", ["", "3", "1,x", "v2", "1,,2"])
def test_parse_versions_rejects(spec):
    with pytest.raises(InputError, match="format version"):
        parse_versions(spec)


def test_eval_runs_each_format_version_at_the_same_bound():
    rep = evaluate_file(DIGITS, [REL(1e-3)], [], include=["/step_0000/*"], repeat=1,
                        versions=[1, 2])
    assert list(rep["codecs"]) == ["ccoll", "ccoll v2"]
    by = {(r["path"], r["codec"]): r for r in rep["runs"]}
    for (path, _), r in by.items():
        assert r["max_err_over_eb"] <= 1.0
        # the same quantized values: the same error, whatever the version
        assert r["max_abs_error"] == by[(path, "ccoll")]["max_abs_error"]
    t = {r["codec"]: r for r in rep["totals"]}
    assert t["ccoll v2"]["datasets"] == t["ccoll"]["datasets"] == 6
    assert t["ccoll v2"]["psnr_db"] == t["ccoll"]["psnr_db"]
    with pytest.raises(InputError, match="at least one version"):
        evaluate_file(DIGITS, [REL(1e-3)], [], versions=[])


@pytest.mark.parametrize(
    "spec, expect",
    [
        ("rel:1e-2,1e-3", [REL(1e-2), REL(1e-3)]),
        ("rel:1e-2, abs:1e-5,1e-6", [REL(1e-2), ABS(1e-5), ABS(1e-6)]),
        ("abs:1e-4,1e-4", [ABS(1e-4)]),
    ],
)
def test_parse_bounds(spec, expect):
    assert parse_bounds(spec) == expect


@pytest.mark.parametrize("spec", ["1e-3", "rel:1e-3,,1e-4", "rel:1e-3,x", "abs:0"])
def test_parse_bounds_rejects(spec):
    with pytest.raises(ErrorBoundError):
        parse_bounds(spec)


def test_parse_peers():
    assert parse_peers("sz3, ZFP,sz3") == ["sz3", "zfp"]
    with pytest.raises(InputError, match="unknown compressor"):
        parse_peers("sz3,mgard")


@pytest.mark.parametrize("name", ["ccoll", "sz3", "zfp"])
@pytest.mark.parametrize("shape", [(1000,), (37, 29), (2, 3, 4, 5, 6), ()])
def test_codec_adapters_round_trip(name, shape):
    codec, why = load(name)
    if codec is None:
        pytest.skip(why)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    r = ev.evaluate_array(codec, x, 1e-3)
    assert r["stored_bytes"] > 0 and (r["psnr_db"] > 40 or x.size == 1)
    assert r["max_err_over_eb"] <= (1.0 if name != "zfp" else 2.0)


def test_evaluate_array_metrics_are_exact_for_a_known_codec():
    x = np.array([0.0, 1.0, 2.0, 4.0], np.float32)
    fake = ev.Codec("fake", lambda x, eb: b"12345678", lambda b, x: x + np.float32(0.5), "0")
    r = ev.evaluate_array(fake, x, eb=1.0)
    assert r["ratio"] == 2.0 and r["bits_per_value"] == 16.0
    assert r["max_err_over_eb"] == 0.5
    assert r["psnr_db"] == pytest.approx(20 * math.log10(4.0) - 10 * math.log10(0.25))


def test_eval_digits_compares_at_the_same_absolute_bound():
    rep = evaluate_file(
        DIGITS, parse_bounds("rel:1e-2,1e-3"), ["sz3", "zfp"], include=["/step_0000/*"], repeat=1
    )
    assert rep["missing"] == {} and set(rep["codecs"]) == {"ccoll", "sz3", "zfp"}
    assert len(rep["runs"]) == 6 * 2 * 3 and len(rep["totals"]) == 2 * 3
    with h5py.File(DIGITS) as f:
        for r in rep["runs"]:
            x = f[r["path"]][()]
            e = rel_bound(float(r["bound"][4:]), x)  # the same absolute bound for every codec
            assert abs(Fraction(r["eb_abs"]) - e) <= e * Fraction(1, 2**51), (r, float(e))
            if r["codec"] in ("ccoll", "sz3"):  # bounded compressors stay within it
                assert r["max_err_over_eb"] <= 1.0, r
    for t in rep["totals"]:
        assert t["datasets"] == 6 and t["failed"] == 0
        assert t["ratio"] > 1 and t["psnr_db"] > 40
    ccoll_tot = {t["bound"]: t for t in rep["totals"] if t["codec"] == "ccoll"}
    assert ccoll_tot["rel:0.01"]["ratio"] > ccoll_tot["rel:0.001"]["ratio"]


def test_eval_reports_a_missing_peer(monkeypatch):
    import ccoll.h5.peers as peers

    def no_sz3():
        raise ImportError("No module named 'pysz'")

    monkeypatch.setitem(peers._LOADERS, "sz3", no_sz3)
    rep = evaluate_file(DIGITS, [REL(1e-2)], ["sz3"], include=["/step_0000/fc.*"], repeat=1)
    assert "pysz is not installed" in rep["missing"]["sz3"]
    assert {r["codec"] for r in rep["runs"]} == {"ccoll"}


def test_eval_records_a_peer_failure_and_goes_on(monkeypatch):
    import ccoll.h5.peers as peers

    def broken():
        return ev.Codec("zfp", lambda x, eb: 1 / 0, lambda b, x: x, "0")

    monkeypatch.setitem(peers._LOADERS, "zfp", broken)
    rep = evaluate_file(DIGITS, [REL(1e-2)], ["zfp"], include=["/step_0000/fc.*"], repeat=1)
    bad = [r for r in rep["runs"] if r["codec"] == "zfp"]
    assert len(bad) == 2 and all("ZeroDivisionError" in r["error"] for r in bad)
    t = next(t for t in rep["totals"] if t["codec"] == "zfp")
    assert t["failed"] == 2 and t["datasets"] == 0


def test_eval_skips_constant_data(sample):
    rep = evaluate_file(sample, [REL(1e-3)], [], include=["*/const", "*/fc.weight"], repeat=1)
    assert rep["skipped"] == [
        {"path": "/step_0000/const", "bound": "rel:0.001", "why": "constant data"}
    ]
    assert [r["path"] for r in rep["runs"]] == ["/step_0000/fc.weight"]


def test_eval_counts_the_streams_of_a_file_ccoll_compress_wrote(sample, tmp_path):
    # Its streams are uint8 datasets: eval measured only the datasets kept as they were
    # and said nothing of the rest (or "no floating-point dataset" where all were streams).
    c = str(tmp_path / "c.h5")
    compress_file(sample, c, "rel:1e-3")
    with h5py.File(c, "r") as f:
        streams = []
        f.visititems(lambda n, o: streams.append("/" + n) if "ccoll_format_version" in o.attrs
                     else None)
    assert streams
    rep = evaluate_file(c, [REL(1e-3)], [], repeat=1)  # the datasets kept as they were
    assert sorted(rep["streams"]) == sorted(streams)
    assert not set(r["path"] for r in rep["runs"]) & set(streams)
    only = str(tmp_path / "only.h5")  # streams and nothing else
    with h5py.File(only, "w") as f:
        f["g"] = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    compress_file(only, str(tmp_path / "only_c.h5"), "rel:1e-3")
    with pytest.raises(InputError, match=r"1 ccoll stream\(s\) are not float data; "
                       "decompress it first"):
        evaluate_file(str(tmp_path / "only_c.h5"), [REL(1e-3)], [], repeat=1)


def test_eval_handles_every_float_kind(sample):
    # The empty dataset too: zfpy dies of SIGBUS on an empty array (a whole `ccoll eval`
    # at an ABS bound did), so no codec gets one; it is listed as skipped.
    rep = evaluate_file(sample, [ABS(1e-2)], ["sz3", "zfp"], repeat=1)
    ok = [r for r in rep["runs"] if r["codec"] == "ccoll"]
    assert all("error" not in r and r["max_err_over_eb"] <= 1.0 for r in ok), ok
    empty = [r for r in rep["runs"] if r["path"].endswith("/empty")]
    assert not empty, empty
    assert {"path": "/step_0000/empty", "bound": "abs:0.01", "why": "no elements"} in \
        rep["skipped"], rep["skipped"]


def test_rd_plot(tmp_path):
    from ccoll.h5.plot import rd_plot

    rep = evaluate_file(
        DIGITS, parse_bounds("rel:1e-2,1e-3"), ["sz3"], include=["*/fc.weight"], repeat=1
    )
    png = tmp_path / "rd.png"
    rd_plot(rep, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
