"""ccoll.h5 compress/decompress on files: round trips, layout, selection, bad input, damage."""

from __future__ import annotations

import errno
import os
import stat
from fractions import Fraction

import h5py
import numpy as np
import pytest
from h5kit import DIGITS, MINILM, assert_restored, flip_byte, make_sample, replace_stored
from kit import assert_within, rel_bound

import ccoll
from ccoll.compressor import header
from ccoll.errors import ErrorBoundError, FormatError, InputError
from ccoll.h5 import attrs as A
from ccoll.h5.compress import compress_file
from ccoll.h5.decompress import decompress_file


def exact_eb(spec, x):
    """The bound ``spec`` ("rel:1e-3", "abs:1e-4") promises for ``x``, computed exactly here."""
    kind, _, value = spec.partition(":")
    return rel_bound(float(value), x) if kind == "rel" else Fraction(float(value))


def rel_eb(rel):
    return lambda path, x: exact_eb(f"rel:{rel}", x)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("h5") / "sample.h5")
    make_sample(p)
    return p


def leftovers(folder, keep):
    return sorted(set(os.listdir(folder)) - set(keep))


def stored_stream_bytes(x, eb, lossless, version):
    """Bytes the stream of ``x`` (in a zstd frame with ``lossless="zstd"``) takes, made here
    with the compressor's own API and the zstandard package."""
    stream = ccoll.compress(np.ascontiguousarray(x).astype(x.dtype.newbyteorder("=")), eb,
                            version=version)
    if lossless == "zstd":
        import zstandard

        frame = zstandard.ZstdCompressor(level=3, write_content_size=True)
        return len(frame.compress(stream.tobytes()))
    return stream.size


@pytest.mark.parametrize("always_stream", [False, True])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("eb", ["rel:1e-3", "abs:1e-4", "rel:1e-6"])
@pytest.mark.parametrize("lossless", ["none", "zstd"])
def test_sample_round_trip(sample, tmp_path, eb, lossless, version, always_stream):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    rep = compress_file(sample, c, eb, lossless=lossless, version=version,
                        always_stream=always_stream)
    assert rep["format_version"] == version
    names = {r["path"] for r in rep["datasets"]}
    assert names == {
        "/step_0000/fc.weight",
        "/step_0000/fc.bias",
        "/step_0000/half",
        "/step_0000/big_endian",
        "/step_0000/scalar",
        "/step_0000/empty",
        "/step_0000/const",
        "/step_0000/special",
        "/step_0000/chunked",
        "/step_0000/sub/deep.weight",
    }
    # Kept as it is: exactly the datasets whose stream is not smaller than the data as stored
    # in the input (the chunked one through gzip); never with always_stream.
    with h5py.File(sample) as s:
        kept = set() if always_stream else {
            p for p in names
            if stored_stream_bytes(s[p][()], eb, lossless, version)
            >= min(s[p].nbytes, s[p].id.get_storage_size())
        }
    if not always_stream:  # 4 bytes, 0 bytes; REL stores constant data raw (zstd shrinks it)
        tiny = {"/step_0000/scalar", "/step_0000/empty"}
        if eb.startswith("rel") and lossless == "none":
            tiny.add("/step_0000/const")
        assert tiny <= kept
    assert "/step_0000/fc.weight" not in kept
    assert {r["path"] for r in rep["datasets"] if r["stored_as"] == "raw"} == kept
    with h5py.File(c) as f, h5py.File(sample) as s:
        for name in names - kept:
            ds = f[name]
            assert ds.attrs[A.FORMAT_VERSION] == version and A.STORED not in ds.attrs
            if lossless == "none":  # the stream's own header says the same
                assert header(ds[()]).version == version
        for name in kept:  # the input's dataset as it was, plus the marker
            ds = f[name]
            assert ds.dtype == s[name].dtype and ds.shape == s[name].shape
            assert ds.compression == s[name].compression
            assert [k for k in ds.attrs if k.startswith(A.PREFIX)] == [A.STORED]
        if always_stream and eb.startswith("rel"):
            assert f["/step_0000/const"].attrs[A.EB_ABS] == 0.0  # stored exactly
    decompress_file(c, b)
    n = assert_restored(sample, b, lambda path, x: 0 if path in kept else exact_eb(eb, x))
    assert n == len(names)
    assert leftovers(tmp_path, ["c.h5", "b.h5"]) == []


@pytest.mark.parametrize("src, eb", [("sample", "rel:1e-3"), (MINILM, "rel:1e-4")])
def test_format_versions_restore_the_same_values_and_v2_stores_fewer_bytes(
    sample, tmp_path, src, eb
):
    # Version 2 codes the values version 1 quantizes: restored files are equal bit for bit.
    src = sample if src == "sample" else src
    include = ["/step_0000/*"] if src == MINILM else []
    out = {}
    for v in (1, 2):
        c, b = str(tmp_path / f"c{v}.h5"), str(tmp_path / f"b{v}.h5")
        out[v] = compress_file(src, c, eb, include=include, version=v)
        decompress_file(c, b)
    with h5py.File(tmp_path / "b1.h5") as f1, h5py.File(tmp_path / "b2.h5") as f2:
        for r in out[1]["datasets"]:
            y1, y2 = f1[r["path"]][()], f2[r["path"]][()]
            assert y1.dtype == y2.dtype and y1.tobytes() == y2.tobytes(), r["path"]
    if src == MINILM:  # real gradients: fewer bytes in total
        assert out[2]["totals"]["stored_bytes"] < out[1]["totals"]["stored_bytes"]

def test_compressed_layout_is_self_describing(sample, tmp_path):
    c = str(tmp_path / "c.h5")
    compress_file(sample, c, "rel:1e-3")
    with h5py.File(sample) as src, h5py.File(c) as f:
        assert f.attrs[A.ROOT_VERSION] == ccoll.__version__
        assert f.attrs["model"] == "sample"
        for path, dtype in [
            ("/step_0000/fc.weight", "float32"),
            ("/step_0000/fc.bias", "float64"),
            ("/step_0000/half", "float16"),
            ("/step_0000/big_endian", ">f4"),
        ]:
            ds, x = f[path], src[path][()]
            assert ds.dtype == np.uint8 and ds.ndim == 1
            assert ds.attrs[A.FORMAT_VERSION] == 1
            assert ds.attrs[A.DTYPE] == dtype
            assert tuple(ds.attrs[A.SHAPE]) == x.shape
            assert ds.attrs[A.BOUND] == "rel:0.001"
            assert ds.attrs[A.LOSSLESS] == "none"
            # REL resolves per dataset, over that dataset's own finite values
            # REL's product, rounded to float64 (at most two roundings).
            e = rel_bound(1e-3, x)
            assert abs(Fraction(float(ds.attrs[A.EB_ABS])) - e) <= e * Fraction(1, 2**51)
        assert f["/step_0000/fc.weight"].attrs["rows"] == "0:64"
        # Constant data resolves REL to 0: its lossless stream (raw blocks) is larger than the
        # data, and so are the streams of a scalar and an empty dataset: kept as they are.
        for path in ["/step_0000/const", "/step_0000/scalar", "/step_0000/empty"]:
            ds = f[path]
            assert ds.dtype == src[path].dtype and ds.shape == src[path].shape, path
            assert ds.attrs[A.STORED] == "raw" and A.FORMAT_VERSION not in ds.attrs, path
        assert f["labels"].dtype == np.int32 and f["text"].dtype.kind == "O"


def test_float16_stays_within_the_full_bound_after_rounding(tmp_path):
    # Values at the top of the float16 range and a bound much larger than its spacing.
    x = np.array([65504, -65504, 1000, 0.1, 6e-8, 0, 3.14], dtype=np.float16)
    src, c, b = (str(tmp_path / n) for n in ("h.h5", "c.h5", "b.h5"))
    with h5py.File(src, "w") as f:
        f["x"] = x
    for eb in ["abs:40", "abs:0.01", "rel:1e-3"]:
        compress_file(src, c, eb, force=True)
        decompress_file(c, b, force=True)
        with h5py.File(b) as f:
            y = f["x"][()]
        assert y.dtype == np.float16 and np.all(np.isfinite(y))
        assert_within(y, x, exact_eb(eb, x))


def test_hard_links_stay_one_object_and_a_group_inside_itself_is_walked_once(tmp_path):
    # A dataset under two names came back as two independent copies (twice the bytes), and
    # a group that holds a hard link to itself recursed until Python's limit, reported as
    # "a damaged HDF5 file". Both are valid HDF5 (h5repack keeps them).
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    src, c, b = (str(tmp_path / n) for n in ("h.h5", "c.h5", "b.h5"))
    with h5py.File(src, "w") as f:
        g = f.create_group("a")
        g["x"] = x
        g["self"] = g  # the group inside itself
        f["b"] = g["x"]  # the same dataset under a second name
        f["y"] = np.arange(5, dtype=np.int16)
        g["y_too"] = f["y"]  # a dataset copied unchanged, twice named
    rep = compress_file(src, c, "rel:1e-3")
    assert [r["path"] for r in rep["datasets"]] == ["/a/x"]  # compressed once
    decompress_file(c, b)
    for fn in (c, b):
        with h5py.File(fn) as f:
            assert f["b"].id == f["a/x"].id and f["a/self"].id == f["a"].id, fn
            assert f["a/y_too"].id == f["y"].id, fn
            assert sorted(f) == ["a", "b", "y"] and sorted(f["a"]) == ["self", "x", "y_too"]
    with h5py.File(b) as f:
        assert f["a/x"].dtype == np.float32
        assert_within(f["b"][()], x, rel_bound(1e-3, x))
        assert f["a/y_too"][()].tolist() == [0, 1, 2, 3, 4]


def test_groups_nested_deeper_than_the_python_stack_round_trip(tmp_path):
    # The walk recursed once per level: 1,200 nested groups failed at Python's limit of
    # 1,000 frames ("a damaged HDF5 file?"). The limit is lowered here to keep the file small.
    src, c, b = (str(tmp_path / n) for n in ("h.h5", "c.h5", "b.h5"))
    x = np.linspace(0, 1, 300, dtype=np.float32)
    with h5py.File(src, "w") as f:
        f.create_dataset("/".join(["g"] * 120) + "/x", data=x)
    import sys

    flat = str(tmp_path / "flat.h5")
    with h5py.File(flat, "w") as f:
        f["x"] = x
    compress_file(flat, c, "rel:1e-3")  # kernels and imports loaded on the full stack
    decompress_file(c, b)
    os.remove(c), os.remove(b)
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 80)  # fewer frames than the file's 120 levels
    try:
        compress_file(src, c, "rel:1e-3")
        decompress_file(c, b)
    finally:
        sys.setrecursionlimit(limit)
    with h5py.File(b) as f:
        assert_within(f["/".join(["g"] * 120) + "/x"][()], x, rel_bound(1e-3, x))


def test_user_block_virtual_datasets_maximum_shape_and_fill_value_come_back(tmp_path):
    # All four were lost without a word: the user block's bytes, a float virtual dataset
    # (kept "as it is" though it holds no values, counted as 80 kB against 0 stored), and a
    # compressed dataset's unlimited dimension and fill value (no longer appendable, NaN -> 0).
    rng = np.random.default_rng(5)
    x = rng.standard_normal(2000).astype(np.float32)
    src, c, b = (str(tmp_path / n) for n in ("h.h5", "c.h5", "b.h5"))
    with h5py.File(src, "w", userblock_size=512) as f:
        f["src"] = x
        lay = h5py.VirtualLayout(shape=(2000,), dtype="f4")
        lay[:] = h5py.VirtualSource(".", "src", shape=(2000,))
        f.create_virtual_dataset("vds", lay, fillvalue=-9)
        f.create_dataset("log", data=x[::-1], maxshape=(None,), chunks=(100,), fillvalue=np.nan)
        f.create_dataset("grid", data=np.ones((30, 40)), maxshape=(60, None), fillvalue=-1.5)
    with open(src, "r+b") as fh:
        fh.write(b"#!my-tool header\n")
    rep = compress_file(src, c, "abs:1e-3")
    assert sorted(r["path"] for r in rep["datasets"]) == ["/grid", "/log", "/src"]
    assert rep["copied_unchanged"] == 1  # the virtual dataset, as a map
    decompress_file(c, b)
    for fn in (c, b):
        with open(fn, "rb") as fh:
            assert fh.read(17) == b"#!my-tool header\n", fn
    with h5py.File(b) as f:
        assert f.userblock_size == 512 and f["vds"].is_virtual
        assert_within(f["vds"][()], x, Fraction(1, 1000))
        log, grid = f["log"], f["grid"]
        assert log.maxshape == (None,) and np.isnan(log.fillvalue)
        assert grid.maxshape == (60, None) and grid.fillvalue == -1.5
        assert_within(log[()], x[::-1], Fraction(1, 1000))
        assert_within(grid[()], np.ones((30, 40)), Fraction(1, 1000))
    with h5py.File(b, "r+") as f:  # appendable as the original was
        f["log"].resize((2100,))
        assert np.isnan(f["log"][2050])
    with h5py.File(c, "r+") as f:
        f["grid"].attrs[A.MAXSHAPE] = np.array([20, -1], np.int64)  # below the shape
    with pytest.raises(FormatError, match="ccoll_maxshape=.20, -1. does not fit the shape"):
        decompress_file(c, b, force=True)


def test_references_and_dimension_scales_point_at_the_same_objects_after_both_steps(tmp_path):
    # References were copied as addresses of the input file (pointing nowhere, or at
    # whatever lay there), a dataset of references came back all NULL, and dimension scales
    # came back detached ("Unspecified error in H5DSiterate_scales").
    rng = np.random.default_rng(1)
    t = rng.standard_normal((50, 30)).astype(np.float32)
    src, c, b = (str(tmp_path / n) for n in ("h.h5", "c.h5", "b.h5"))
    with h5py.File(src, "w") as f:
        f["g/temp"] = t
        f["x"] = np.arange(50, dtype=np.float64)  # a float scale: compressed itself
        f["label"] = np.arange(30, dtype=np.int32)
        f["x"].make_scale("x")
        f["label"].make_scale("label")
        f["g/temp"].dims[0].attach_scale(f["x"])
        f["g/temp"].dims[1].attach_scale(f["label"])
        f.attrs["main"] = f["g/temp"].ref
        f["g"].attrs["refs"] = np.array([f["label"].ref, f["g"].ref], dtype=h5py.ref_dtype)
        f["g/temp"].attrs["mask"] = f["label"].ref
        r = f.create_dataset("refs", shape=(3,), dtype=h5py.ref_dtype)
        r[0], r[1] = f["g/temp"].ref, f["label"].ref  # r[2] stays NULL
        reg = f.create_dataset("regions", shape=(1,), dtype=h5py.regionref_dtype)
        reg[0] = f["label"].regionref[5:9]
        pair = np.dtype([("obj", h5py.ref_dtype), ("n", np.int32)])
        f.attrs.create("pair", np.array((f["x"].ref, 7), dtype=pair), dtype=pair)
    compress_file(src, c, "rel:1e-3")
    decompress_file(c, b)
    for fn in (c, b):
        with h5py.File(fn) as f:
            assert f[f.attrs["main"]].name == "/g/temp", fn
            assert [f[r].name for r in f["g"].attrs["refs"]] == ["/label", "/g"], fn
            assert f[f["g/temp"].attrs["mask"]].name == "/label", fn
            refs = f["refs"][()]
            assert [f[r].name for r in refs[:2]] == ["/g/temp", "/label"] and not refs[2], fn
            region = f["regions"][0]
            assert f[region].name == "/label", fn
            assert f["label"][region].tolist() == [5, 6, 7, 8], fn
            pair = f.attrs["pair"]
            assert f[pair["obj"]].name == "/x" and pair["n"] == 7, fn
    with h5py.File(b) as f:
        temp = f["g/temp"]
        assert temp.dims[0][0].name == "/x" and temp.dims[1][0].name == "/label"
        assert f["x"].is_scale and h5py.h5ds.is_attached(temp.id, f["x"].id, 0)
        assert_within(temp[()], t, rel_bound(1e-3, t))


def test_a_second_name_of_a_damaged_dataset_is_left_out_with_it(tmp_path):
    x = np.linspace(-1, 1, 500, dtype=np.float32)
    src, c, b = (str(tmp_path / n) for n in ("h.h5", "c.h5", "b.h5"))
    with h5py.File(src, "w") as f:
        f["x"] = x
        f["z"] = x + 1
        f["w"] = f["x"]
    compress_file(src, c, "rel:1e-3")
    with h5py.File(c, "r+") as f:  # in place: the object keeps both names
        f["x"][40] ^= 0xFF
    rep = decompress_file(c, b, on_error="skip")
    assert sorted(r["path"] for r in rep["failed"]) == ["/w", "/x"]
    with h5py.File(b) as f:
        assert sorted(f) == ["z"]


def test_minilm_round_trip_every_value_within_bound(tmp_path):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    rep = compress_file(MINILM, c, "rel:1e-3", include=["/step_0000/*"])
    assert rep["totals"]["ratio"] > 3
    decompress_file(c, b)
    with h5py.File(MINILM) as f:
        chosen = {p for p in (r["path"] for r in rep["datasets"])}
        assert len(chosen) == len(f["step_0000"])
    n = assert_restored(MINILM, b, rel_eb(1e-3), check=chosen)
    assert n == len(chosen)


def test_digits_round_trip_abs_bound(tmp_path):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    compress_file(DIGITS, c, "abs:1e-5")
    decompress_file(c, b)
    assert assert_restored(DIGITS, b, lambda p, x: 1e-5) == 30


@pytest.mark.parametrize(
    "include, exclude, expect",
    [
        (["/step_0000/fc.*"], [], {"/step_0000/fc.weight", "/step_0000/fc.bias"}),
        (["step_0000/fc.*"], ["*bias"], {"/step_0000/fc.weight"}),
        (["*deep*", "*/half"], [], {"/step_0000/sub/deep.weight", "/step_0000/half"}),
    ],
)
def test_patterns_select_by_full_path(sample, tmp_path, include, exclude, expect):
    c = str(tmp_path / "c.h5")
    rep = compress_file(sample, c, "rel:1e-3", include=include, exclude=exclude)
    assert {r["path"] for r in rep["datasets"]} == expect
    with h5py.File(c) as f, h5py.File(sample) as s:
        for p in ["/step_0000/fc.weight", "/step_0000/chunked"]:
            if p not in expect:  # not selected: copied as it was, filters included
                assert f[p].dtype == s[p].dtype and np.array_equal(f[p][()], s[p][()])
                assert f[p].compression == s[p].compression


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(include=["/nope/*"]), "--include pattern '/nope/\\*' matches none"),
        (dict(exclude=["*.nothing"]), "--exclude pattern"),
        (dict(include=["/labels"]), "matches none of the .* floating-point"),
        (dict(include=["*fc*"], exclude=["*fc*"]), "no floating-point dataset to compress"),
        (dict(lossless="lz4"), "--lossless must be one of"),
        (dict(version=3), "format version must be one of 1, 2, got 3"),
        (dict(version="2"), "format version must be one of 1, 2, got '2'"),
    ],
)
def test_bad_selection_or_option_is_an_input_error(sample, tmp_path, kw, match):
    with pytest.raises(InputError, match=match):
        compress_file(sample, str(tmp_path / "c.h5"), "rel:1e-3", **kw)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("eb", ["rel:0", "1e-3", "abs:nan", "rel:-1", "xyz:1", "abs:1e-400"])
def test_bad_bound(sample, tmp_path, eb):
    with pytest.raises(ErrorBoundError):
        compress_file(sample, str(tmp_path / "c.h5"), eb)


def test_bad_files(sample, tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("not hdf5")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        compress_file(str(tmp_path / "missing.h5"), str(tmp_path / "c.h5"), "rel:1e-3")
    with pytest.raises(InputError, match="not an HDF5 file"):
        compress_file(str(txt), str(tmp_path / "c.h5"), "rel:1e-3")
    with pytest.raises(InputError, match="is a folder"):
        compress_file(str(tmp_path), str(tmp_path / "c.h5"), "rel:1e-3")
    with pytest.raises(InputError, match="output folder"):
        compress_file(sample, str(tmp_path / "no" / "c.h5"), "rel:1e-3")
    # Folders that a tidied path hides: these ran the whole job and then failed at the
    # rename with a message naming the temporary file.
    for bad, match in ((tmp_path / "no" / ".." / "c.h5", r"no/..' does not exist"),
                       (f"{sample}/../c.h5", r"\.h5/..' does not exist"),
                       (f"{tmp_path}/c.h5/", "ends in a folder separator")):
        with pytest.raises(InputError, match=match):
            compress_file(sample, str(bad), "rel:1e-3")
    with pytest.raises(InputError, match="not written by ccoll compress"):
        decompress_file(sample, str(tmp_path / "b.h5"))
    c = str(tmp_path / "c.h5")
    compress_file(sample, c, "rel:1e-3")
    with pytest.raises(InputError, match="already written by ccoll"):
        compress_file(c, str(tmp_path / "cc.h5"), "rel:1e-3")
    with pytest.raises(InputError, match="is the input file"):
        compress_file(c, c, "rel:1e-3", force=True)
    assert leftovers(tmp_path, ["t.txt", "c.h5"]) == []


def test_existing_output_needs_force(sample, tmp_path):
    c = tmp_path / "c.h5"
    c.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="--force"):
        compress_file(sample, str(c), "rel:1e-3")
    assert c.read_bytes() == b"keep me"
    compress_file(sample, str(c), "rel:1e-3", force=True)
    assert h5py.is_hdf5(str(c))
    assert oct(c.stat().st_mode & 0o777) != oct(0o600)  # not the temporary file's mode
    # A pipe (or a device: as root, --force replaced /dev/null by the file) is not a file
    # to replace: refused before any work, left as it was.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for force in (False, True):
        with pytest.raises(InputError, match="not a regular file"):
            compress_file(sample, str(fifo), "rel:1e-3", force=force)
        with pytest.raises(InputError, match="not a regular file"):
            decompress_file(str(c), str(fifo), force=force)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert leftovers(tmp_path, ["c.h5", "pipe"]) == []
    # A link to a missing file exists as well: replaced without --force before.
    link = tmp_path / "dangling.h5"
    link.symlink_to(tmp_path / "nowhere" / "t.h5")
    with pytest.raises(FileExistsError, match="a link to a missing file.*--force"):
        compress_file(sample, str(link), "rel:1e-3")
    with pytest.raises(FileExistsError, match="a link to a missing file"):
        decompress_file(str(c), str(link))
    assert link.is_symlink()
    decompress_file(str(c), str(link), force=True)
    assert not link.is_symlink() and h5py.is_hdf5(str(link))


@pytest.mark.parametrize("step", ["compress", "decompress"])
def test_an_output_device_without_room_stops_before_hdf5_writes_into_it(
        sample, tmp_path, monkeypatch, step):
    # HDF5 crashed (bus error, segmentation fault) in h5py's close of the files after a
    # write into a full device had failed: each write now first checks for room.
    import shutil

    from ccoll.h5 import output

    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    if step == "decompress":
        compress_file(sample, c, "rel:1e-3")
    real = shutil.disk_usage
    free = {"left": 300 << 10}  # below the margin kept for the metadata

    def usage(path):
        u = real(path)
        return type(u)(u.total, u.total - free["left"], free["left"])

    monkeypatch.setattr(output.shutil, "disk_usage", usage)
    with pytest.raises(OSError, match="No space left on device: .* bytes free in") as info:
        compress_file(sample, c, "rel:1e-3") if step == "compress" else decompress_file(c, b)
    assert info.value.errno == errno.ENOSPC
    assert leftovers(tmp_path, [] if step == "compress" else ["c.h5"]) == []
    free["left"] = 1 << 40
    if step == "compress":
        compress_file(sample, c, "rel:1e-3")
    else:
        decompress_file(c, b)


def test_an_output_folder_nothing_can_be_written_in_is_refused_before_any_work(sample):
    # As root os.access says yes to /proc: the whole run was done, then refused at the end.
    with pytest.raises(InputError, match="output folder '/proc' is not writable"):
        compress_file(sample, "/proc/ccoll-test.h5", "rel:1e-3")


def test_reserved_attribute_prefix_is_refused(tmp_path):
    src = str(tmp_path / "s.h5")
    with h5py.File(src, "w") as f:
        f["x"] = np.ones(10, np.float32)
        f["x"].attrs["ccoll_dtype"] = "mine"
    with pytest.raises(InputError, match="reserves"):
        compress_file(src, str(tmp_path / "c.h5"), "rel:1e-3")
    # A root's (dropped by decompress) and a dataset's that is not compressed (a uint8
    # dataset with ccoll_format_version was copied, then failed its own decompress).
    for where in ("root", "uint8"):
        with h5py.File(src, "w") as f:
            f["x"] = np.ones(10, np.float32)
            f["g"] = np.arange(4, dtype=np.uint8)
            (f if where == "root" else f["g"]).attrs["ccoll_format_version"] = 1
        with pytest.raises(InputError, match="root has attribute|'/g' has attribute"):
            compress_file(src, str(tmp_path / "c.h5"), "rel:1e-3")
        assert sorted(os.listdir(tmp_path)) == ["s.h5"]
    with h5py.File(src, "w") as f:  # a group's come back as they were
        f.create_group("grp").attrs["ccoll_note"] = "mine"
        f["grp/x"] = np.ones(100, np.float32)
    compress_file(src, str(tmp_path / "c.h5"), "rel:1e-3")
    decompress_file(str(tmp_path / "c.h5"), str(tmp_path / "b.h5"))
    with h5py.File(str(tmp_path / "b.h5"), "r") as f:
        assert f["grp"].attrs["ccoll_note"] == "mine"


# --- damaged files --------------------------------------------------------------------------


@pytest.fixture
def compressed(sample, tmp_path):
    c = str(tmp_path / "c.h5")
    compress_file(sample, c, "rel:1e-3")
    return c


def _drop_attr(path, ds, name):
    with h5py.File(path, "r+") as f:
        del f[ds].attrs[name]


def _truncate_without_crc(path, ds):
    # Without its CRC the damage reaches the stream parser, which must reject it.
    replace_stored(path, ds, lambda b: b[: len(b) // 2])
    _drop_attr(path, ds, A.CRC32)


def _set_attr(name, value):
    def damage(path, ds):
        with h5py.File(path, "r+") as f:
            f[ds].attrs[name] = value

    return damage


DAMAGE = {
    "flipped byte (CRC)": (lambda p, d: flip_byte(p, d, 70), "CRC-32"),
    "truncated, no CRC": (_truncate_without_crc, "stream"),
    "dtype attribute": (_set_attr(A.DTYPE, "float64"), "attributes say float64"),
    "shape attribute": (_set_attr(A.SHAPE, np.array([3, 3])), "attributes say"),
    "format version": (_set_attr(A.FORMAT_VERSION, 9), "format version 9"),
    "format version of the other kind": (
        _set_attr(A.FORMAT_VERSION, 2),
        "stream is format version 1, its attribute ccoll_format_version says 2",
    ),
    "format version not a number": (_set_attr(A.FORMAT_VERSION, "two"), "is not a whole number"),
    "lossless attribute": (_set_attr(A.LOSSLESS, "lz4"), "lz4"),
    # Attributes of the wrong type raised ValueError from int() through the CLI (a traceback).
    "CRC not a number": (_set_attr(A.CRC32, "x"), "ccoll_crc32='x' is not a whole number"),
    "shape not numbers": (_set_attr(A.SHAPE, "hello"), "is not a list of whole numbers"),
    # More dimensions than HDF5 holds: h5py's ValueError when the output was created.
    "shape of 34 dimensions": (_set_attr(A.SHAPE, np.ones(34, np.int64)),
                               "has 34 dimensions; an HDF5 dataset has at most 32"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_stream_stop_names_dataset_and_writes_nothing(compressed, tmp_path, damage):
    fn, match = DAMAGE[damage]
    fn(compressed, "/step_0000/fc.weight")
    out = str(tmp_path / "b.h5")
    with pytest.raises(FormatError, match=r"dataset '/step_0000/fc.weight' is damaged: .*" + match):
        decompress_file(compressed, out)
    assert leftovers(tmp_path, ["c.h5"]) == []


def test_damaged_stream_skip_writes_the_rest(sample, compressed, tmp_path):
    flip_byte(compressed, "/step_0000/fc.weight", 100)
    _truncate_without_crc(compressed, "/step_0000/sub/deep.weight")
    out = str(tmp_path / "b.h5")
    rep = decompress_file(compressed, out, on_error="skip")
    assert sorted(f["path"] for f in rep["failed"]) == [
        "/step_0000/fc.weight",
        "/step_0000/sub/deep.weight",
    ]
    # 7 streams less the 2 damaged ones; the scalar, empty and constant datasets were kept
    # as they are (test_compressed_layout_is_self_describing).
    assert (rep["totals"]["restored"], rep["totals"]["kept_raw"]) == (5, 3)
    with h5py.File(out) as f:
        assert "fc.weight" not in f["step_0000"] and "deep.weight" not in f["step_0000/sub"]
        assert f["step_0000/fc.bias"].dtype == np.float64
    with h5py.File(sample) as s, h5py.File(out) as f:
        x, y = s["step_0000/chunked"][()], f["step_0000/chunked"][()]
        assert_within(y, x, rel_bound(1e-3, x))
    assert leftovers(tmp_path, ["c.h5", "b.h5"]) == []


def test_damaged_zstd_frame(sample, tmp_path):
    c = str(tmp_path / "c.h5")
    compress_file(sample, c, "rel:1e-3", lossless="zstd")
    replace_stored(c, "/step_0000/fc.weight", lambda b: b[:-9])
    _drop_attr(c, "/step_0000/fc.weight", A.CRC32)
    with pytest.raises(FormatError, match="fc.weight.*zstd"):
        decompress_file(c, str(tmp_path / "b.h5"))


def test_bytes_after_a_zstd_frame_are_damage(sample, tmp_path):
    # Bytes after a plain stream are refused; after a zstd frame they were ignored (exit 0;
    # without the CRC attribute, which would catch them first).
    c = str(tmp_path / "c.h5")
    compress_file(sample, c, "rel:1e-3", lossless="zstd")
    replace_stored(c, "/step_0000/fc.weight", lambda b: np.concatenate([b, np.ones(4, np.uint8)]))
    _drop_attr(c, "/step_0000/fc.weight", A.CRC32)
    with pytest.raises(FormatError, match="fc.weight.*(4 bytes|unused data)"):
        decompress_file(c, str(tmp_path / "b.h5"))


# --- interruptions: no partial output -------------------------------------------------------


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_interrupted_compress_leaves_no_file(sample, tmp_path, monkeypatch, exc):
    import ccoll.h5.compress as mod

    real, calls = mod.compress_array, []

    def failing(x, bound, *args):
        calls.append(1)
        if len(calls) == 3:
            raise exc()
        return real(x, bound, *args)

    monkeypatch.setattr(mod, "compress_array", failing)
    out = tmp_path / "c.h5"
    out.write_bytes(b"old")
    with pytest.raises(exc):
        compress_file(sample, str(out), "rel:1e-3", force=True)
    assert out.read_bytes() == b"old"  # the previous file is untouched
    assert leftovers(tmp_path, ["c.h5"]) == []


def test_interrupted_decompress_leaves_no_file(compressed, tmp_path, monkeypatch):
    import ccoll.h5.decompress as mod

    real, calls = mod.restore_dataset, []

    def failing(ds):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(ds)

    monkeypatch.setattr(mod, "restore_dataset", failing)
    with pytest.raises(KeyboardInterrupt):
        decompress_file(compressed, str(tmp_path / "b.h5"))
    assert leftovers(tmp_path, ["c.h5"]) == []
