"""Datasets too small for a ccoll stream to pay: `ccoll compress` keeps them as they are.

A stream has a fixed header (docs/format.md), so a few-element dataset would be stored in
more bytes than its data; such a dataset must come back exact and take no more room in
the compressed file than its own bytes.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from h5kit import attrs_of

from ccoll.cli import main
from ccoll.errorbound import REL
from ccoll.h5 import attrs as A
from ccoll.h5.compress import compress_file
from ccoll.h5.decompress import decompress_file
from ccoll.h5.evaluate import evaluate_file
from ccoll.h5.inspect import inspect_file

TINY = {
    "/one": np.array([1.25], np.float32),  # 4 bytes
    "/three": np.array([0.1, -2.0, 3.5]),  # float64, 24 bytes
    "/scalar": np.float32(-7.5),
    "/half": np.array([1.5, -0.25, 3.0], np.float16),
    "/big_endian": np.array([2.0, 0.5], ">f4"),
    "/empty": np.zeros((0, 3), np.float32),
}
BIG = "/g/weight"  # large enough that a stream pays


@pytest.fixture
def small_file(tmp_path):
    p = str(tmp_path / "small.h5")
    rng = np.random.default_rng(3)
    with h5py.File(p, "w", track_order=True) as f:
        for path, x in TINY.items():
            f.create_dataset(path, data=x, track_order=True)
            f[path].attrs["note"] = "mine"
        f.create_dataset(BIG, data=rng.standard_normal((64, 40)).astype(np.float32))
    return p


def _stored(path):
    with h5py.File(path) as f:
        return {p: (int(f[p].id.get_storage_size()), f[p].dtype) for p in [*TINY, BIG]}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("lossless", ["none", "zstd"])
def test_tiny_datasets_come_back_exact_and_take_no_more_room(small_file, tmp_path, version,
                                                              lossless):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    rep = compress_file(small_file, c, "rel:1e-3", version=version, lossless=lossless)
    stored = _stored(c)
    for path, x in TINY.items():
        # Never more than the data's own bytes (HDF5 stores a plain dataset's bytes as is).
        assert stored[path][0] <= np.asarray(x).nbytes, (path, stored[path])
    assert stored[BIG][1] == np.uint8  # the large one is a stream
    by_path = {r["path"]: r for r in rep["datasets"]}
    assert set(by_path) == {*TINY, BIG}
    assert all(by_path[p]["stored_as"] == "raw" for p in TINY)
    assert by_path[BIG]["stored_as"] == "stream"
    t = rep["totals"]
    assert (t["compressed"], t["kept_raw"]) == (1, len(TINY))
    assert t["stored_bytes"] == sum(r["stored_bytes"] for r in rep["datasets"])
    with h5py.File(c) as f:
        for path in TINY:
            assert f[path].attrs[A.STORED] == "raw" and A.FORMAT_VERSION not in f[path].attrs
    drep = decompress_file(c, b)
    assert drep["totals"]["kept_raw"] == len(TINY) and drep["totals"]["restored"] == 1
    with h5py.File(small_file) as s, h5py.File(b) as f:
        for path, x in TINY.items():
            y = f[path]
            assert y.dtype == np.asarray(x).dtype and y.shape == np.shape(x), path
            assert np.asarray(y[()]).tobytes() == np.asarray(x).tobytes(), path  # exact
            assert attrs_of(y) == attrs_of(s[path]), path  # no ccoll_* attribute left
        assert list(f) == list(s)


def test_inspect_and_eval_report_kept_datasets_as_exact(small_file, tmp_path):
    c = str(tmp_path / "c.h5")
    compress_file(small_file, c, "rel:1e-3")
    rep = inspect_file(c)
    assert rep["damaged"] == []
    recs = {r["path"]: r for r in rep["datasets"]}
    for path, x in TINY.items():
        r = recs[path]
        assert r["kept_raw"] and r["bound"] == "exact" and r["eb_abs"] is None, r
        assert r["original_bytes"] == np.asarray(x).nbytes
        assert r["shape"] == list(np.shape(x))
    assert not recs[BIG]["kept_raw"] and recs[BIG]["codec"] == "ccoll"
    assert rep["kept_raw"] == len(TINY)
    # eval reads the kept datasets as the float data they are (the original values).
    ev = evaluate_file(c, [REL(1e-3)], [], include=["/three", "/half"], repeat=1)
    assert {r["path"] for r in ev["runs"]} == {"/three", "/half"}
    assert all("error" not in r and r["max_err_over_eb"] <= 1 for r in ev["runs"])


def test_a_damaged_keep_marker_is_reported(small_file, tmp_path):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    compress_file(small_file, c, "rel:1e-3")
    with h5py.File(c, "r+") as f:
        f["/one"].attrs[A.STORED] = "zipped"
    rep = inspect_file(c)
    assert [d["path"] for d in rep["damaged"]] == ["/one"]
    assert "ccoll_stored" in rep["damaged"][0]["error"]
    out = decompress_file(c, b, on_error="skip")
    assert [d["path"] for d in out["failed"]] == ["/one"]


def test_always_stream_keeps_every_dataset_a_stream(small_file, tmp_path):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    rep = compress_file(small_file, c, "rel:1e-3", always_stream=True)
    assert rep["totals"]["kept_raw"] == 0
    assert {r["stored_as"] for r in rep["datasets"]} == {"stream"}
    stored = _stored(c)
    assert all(stored[p][1] == np.uint8 for p in TINY)
    assert stored["/one"][0] > 4  # the fixed header alone is larger than one float32
    decompress_file(c, b)
    with h5py.File(b) as f:
        assert f["/one"][()].tobytes() == TINY["/one"].tobytes()  # constant: stored exactly


def test_cli_summary_and_table_name_the_kept_datasets(small_file, tmp_path, capsys):
    c = str(tmp_path / "c.h5")
    assert main(["compress", small_file, c, "--eb", "rel:1e-3", "--table"]) == 0
    out = capsys.readouterr().out
    summary, _, table = out.partition("\n\n")
    assert "1 dataset(s) compressed at rel:0.001" in summary
    assert f"{len(TINY)} kept as they are (a stream would not be smaller)" in summary
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert set(rows) == {*TINY, BIG}
    for path in TINY:
        assert rows[path].split()[-1] == "raw", rows[path]
    assert rows[BIG].split()[-1] == "stream"
    assert main(["inspect", c]) == 0
    out = capsys.readouterr().out
    assert f"{len(TINY)} dataset(s) kept as they are by ccoll compress (exact)" in out
    b = str(tmp_path / "b.h5")
    assert main(["decompress", c, b]) == 0
    out = capsys.readouterr().out
    assert "1 dataset(s) restored" in out and f"{len(TINY)} kept as they were" in out
    c2 = str(tmp_path / "c2.h5")
    assert main(["compress", small_file, c2, "--eb", "rel:1e-3", "--always-stream"]) == 0
    assert f"{len(TINY) + 1} dataset(s) compressed" in capsys.readouterr().out
