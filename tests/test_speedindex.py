"""The speed index every benchmark prints beside its figures (ccoll/speedindex.py)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from ccoll import speedindex


def test_index_measures_sz3_on_every_float32_tensor_of_the_dump(tmp_path):
    pytest.importorskip("pysz")
    path = tmp_path / "dump.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["step_0000/a"] = rng.standard_normal(5000).astype(np.float32)
        f["step_0000/b"] = rng.standard_normal((30, 40)).astype(np.float32)
        f["step_0001/a"] = rng.standard_normal(700).astype(np.float32)
        f["step_0001/ints"] = np.arange(10, dtype=np.int64)  # not a gradient: left out
    got = speedindex.speed_index(str(path), repeats=1)
    assert got["elements"] == 5000 + 1200 + 700
    assert got["sz3_compress_gbps"] > 0
    assert got["cpu"] and got["cpu"] == speedindex.cpu_name()
    line = speedindex.describe(got)
    assert "SZ3 compress" in line and "MB/s" in line and got["cpu"] in line


def test_index_without_the_data_says_why(tmp_path):
    got = speedindex.speed_index(str(tmp_path / "missing.h5"))
    assert got["sz3_compress_gbps"] is None
    assert "no such file" in got["why"]
    assert "not measured" in speedindex.describe(got)


def test_on_rank0_measures_on_rank_0_only(tmp_path):
    # Collective: rank 0 gets the index, every other rank None (they wait asleep). One rank
    # here; tests/mpi/test_speedindex_ranks.py runs it on several.
    from mpi4py import MPI

    got = speedindex.speed_index_on_rank0(MPI.COMM_SELF, str(tmp_path / "missing.h5"))
    assert got is not None and got["sz3_compress_gbps"] is None


def test_main_refuses_data_it_cannot_measure(tmp_path, capsys):
    # A missing file printed "not measured" with exit 0; a non-HDF5 file and a dump of
    # zero-element datasets gave tracebacks.
    notes = tmp_path / "notes.txt"
    notes.write_text("not HDF5\n")
    empty = tmp_path / "empty.h5"
    with h5py.File(empty, "w") as f:
        f["step_0000/a"] = np.zeros(0, np.float32)
    for path, why in ((tmp_path / "missing.h5", "no such file"),
                      (notes, "is not an HDF5 file"), (empty, "no float32 values")):
        assert speedindex.main(["--data", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and why in err, err


def test_describe_names_the_data_measured():
    # Any file was called "MiniLM dump".
    index = {"cpu": "x", "rel": 1e-3, "sz3_compress_gbps": 0.2}
    assert "MiniLM dump" in speedindex.describe({**index, "data": speedindex.DEFAULT_DATA})
    line = speedindex.describe({**index, "data": "/d/other.h5"})
    assert "/d/other.h5" in line and "MiniLM" not in line
