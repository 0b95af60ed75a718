"""The ccoll command in-process (ccoll.cli.main): options, messages, exit codes, --json."""

from __future__ import annotations

import json
import os
import re

import h5py
import numpy as np
import pytest
from h5kit import DIGITS, flip_byte, make_sample, replace_stored

from ccoll import cli


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("cli") / "sample.h5")
    make_sample(p)
    return p


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_commands_examples_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("compress", "decompress", "inspect", "eval", "examples:", "exit status:", "130"):
        assert word in out


@pytest.mark.parametrize("command", ["compress", "decompress", "inspect", "eval"])
def test_each_command_help_has_examples_and_exit_codes(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"ccoll {command} " in out and "exit status:" in out and "--json" in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["compress", "a.h5"],
        ["compress", "a.h5", "b.h5"],
        ["frobnicate"],
        ["decompress", "a", "b", "--on-error", "ignore"],
        ["compress", "a", "b", "--eb", "rel:1", "--lossless", "lz4"],
        ["compress", "a", "b", "--eb", "rel:1", "--format-version", "3"],
    ],
)
def test_usage_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == cli.EXIT_USAGE
    assert "usage:" in capsys.readouterr().err


def test_compress_inspect_decompress_json(capsys, sample, tmp_path):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    code, out, err = run(capsys, "compress", sample, c, "--eb", "rel:1e-3", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    # 10 selected: the scalar, empty and constant ones are kept as they are (h5kit.make_sample)
    assert doc["exit_code"] == 0 and doc["totals"]["compressed"] == 7
    assert doc["totals"]["kept_raw"] == 3 and len(doc["datasets"]) == 10
    code, out, _ = run(capsys, "inspect", c, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["compressed_totals"]["datasets"] == 7 and doc["kept_raw"] == 3
    code, out, _ = run(capsys, "decompress", c, b, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["totals"]["restored"] == 7 and doc["failed"] == []
    assert doc["totals"]["kept_raw"] == 3


def test_human_output(capsys, sample, tmp_path):
    c = str(tmp_path / "c.h5")
    code, out, _ = run(capsys, "compress", sample, c, "--eb", "abs:1e-3")
    # One line: the summary, without a row per dataset (ccoll inspect or --table shows them).
    assert code == 0 and out.count("\n") == 1, out
    # Kept as they are: the scalar (4 bytes) and the empty dataset, which no stream undercuts;
    # the 40 equal values of const (two blocks of 11-bit codes, 2.5 / 2e-3, outweigh 160
    # bytes); and half, whose float16 spacing at its magnitude (0.0625 near 100) is far wider
    # than 2e-3, so its codes need more bits than the 16 of float16.
    assert out.startswith(
        f"{c}: 6 dataset(s) compressed at abs:0.001 (format version 1, lossless none), "
        "4 kept as they are (a stream would not be smaller), 3 copied unchanged; "
    ), out
    assert "ratio" in out and "/step_0000/" not in out
    code, table, _ = run(capsys, "compress", sample, c, "--eb", "abs:1e-3", "--force", "--table")
    lines = table.splitlines()
    assert code == 0 and lines[0].startswith(f"{c}: 6 dataset(s) compressed"), table
    assert lines[2].split() == ["dataset", "shape", "dtype", "original", "stored", "ratio",
                                "eb_abs", "as"]
    assert len(lines) == 2 + 2 + 10
    kept = {ln.split()[0] for ln in lines[4:] if ln.split()[-1] == "raw"}
    assert kept == {f"/step_0000/{n}" for n in ("scalar", "empty", "const", "half")}
    assert {ln.split()[-1] for ln in lines[4:]} == {"raw", "stream"}
    code, out, _ = run(capsys, "inspect", c)
    assert code == 0 and "written by ccoll" in out and "abs:0.001 (abs 0.001)" in out
    code, out, _ = run(capsys, "compress", sample, c, "--eb", "abs:1e-3", "--force", "--quiet")
    assert code == 0 and out == ""


@pytest.mark.parametrize(
    "case, argv, match",
    [
        (
            "missing input",
            ["compress", "{tmp}/none.h5", "{tmp}/o.h5", "--eb", "rel:1e-3"],
            "does not exist",
        ),
        (
            "not hdf5",
            ["compress", "{tmp}/t.txt", "{tmp}/o.h5", "--eb", "rel:1e-3"],
            "not an HDF5 file",
        ),
        ("output exists", ["compress", "{sample}", "{tmp}/t.txt", "--eb", "rel:1e-3"], "--force"),
        (
            "no match",
            ["compress", "{sample}", "{tmp}/o.h5", "--eb", "rel:1e-3", "--include", "x*"],
            "matches none",
        ),
        ("bad bound", ["compress", "{sample}", "{tmp}/o.h5", "--eb", "rel:2e"], "not a number"),
        ("not ccoll", ["decompress", "{sample}", "{tmp}/o.h5"], "not written by ccoll"),
        ("inspect missing", ["inspect", "{tmp}/none.h5"], "does not exist"),
        (
            "eval no match",
            ["eval", "{sample}", "--eb", "rel:1e-3", "--exclude", "nothing*"],
            "matches none",
        ),
        (
            "eval bad peer",
            ["eval", "{sample}", "--eb", "rel:1e-3", "--vs", "mgard"],
            "unknown compressor",
        ),
        ("eval bad list", ["eval", "{sample}", "--eb", "1e-3,rel:1e-4"], "must start with a kind"),
        (
            "eval bad format version",
            ["eval", "{sample}", "--eb", "rel:1e-3", "--format-version", "1,3"],
            "format version must be one of 1, 2, got 3",
        ),
        (
            "plot exists",
            ["eval", "{sample}", "--eb", "rel:1e-3", "--plot", "{tmp}/t.txt"],
            "--force",
        ),
        (  # ran the whole evaluation, then lost it to matplotlib's ValueError
            "plot kind",
            ["eval", "{sample}", "--eb", "rel:1e-3", "--plot", "{tmp}/rd.xyz"],
            "matplotlib cannot write .xyz files",
        ),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_bad_input_exits_2_with_a_clear_message(
    capsys, sample, tmp_path, case, argv, match, as_json
):
    (tmp_path / "t.txt").write_text("text")
    argv = [a.format(tmp=tmp_path, sample=sample) for a in argv] + (["--json"] if as_json else [])
    code, out, err = run(capsys, *argv)
    assert code == cli.EXIT_USAGE, (case, err)
    assert match in err and "Traceback" not in err
    if as_json:
        doc = json.loads(out)
        assert doc["exit_code"] == 2 and match in doc["error"]
    else:
        assert out == ""
    assert sorted(os.listdir(tmp_path)) == ["t.txt"] and (tmp_path / "t.txt").read_text() == "text"


@pytest.mark.parametrize("command", ["compress", "inspect", "eval"])
def test_a_damaged_hdf5_object_exits_1_with_one_line(capsys, tmp_path, command):
    # h5py's KeyError for an object it cannot open printed a traceback before the error.
    bad = str(tmp_path / "bad.h5")
    with h5py.File(bad, "w") as f:
        f["x"] = np.arange(1000, dtype=np.float32)
        addr = h5py.h5o.get_info(f["x"].id).addr
    with open(bad, "r+b") as fh:
        fh.seek(addr)
        fh.write(bytes(16))  # the dataset's object header
    argv = {"compress": [bad, str(tmp_path / "o.h5"), "--eb", "rel:1e-3"],
            "inspect": [bad], "eval": [bad, "--eb", "rel:1e-3", "--vs", "none"]}[command]
    code, out, err = run(capsys, command, *argv)
    assert code == cli.EXIT_FAILURE and "Traceback" not in err, err
    assert err.count("\n") == 1 and "cannot open '/x'" in err and "damaged" in err, err
    assert sorted(os.listdir(tmp_path)) == ["bad.h5"]


def test_any_error_raised_inside_h5py_exits_1_with_one_line(capsys, sample, tmp_path,
                                                            monkeypatch):
    # A flipped byte of a real file made h5py raise RuntimeError while compress copied the
    # attributes ('Error iterating over attributes (incorrect metadata checksum ...)'):
    # whatever h5py raises, and wherever, is the file's damage, not a ccoll bug.
    from ccoll.h5 import attrs

    def broken(src, dst):
        h5py.h5o.open(src.id, b"no such object")  # h5py's own KeyError, from its Cython

    monkeypatch.setattr(attrs, "copy_attrs", broken)
    code, out, err = run(capsys, "compress", sample, str(tmp_path / "o.h5"), "--eb", "rel:1e-3")
    assert code == cli.EXIT_FAILURE and "Traceback" not in err, err
    assert err.startswith("ccoll compress: error: HDF5 error (a damaged file?): ") and \
        err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []


# Written by h5py with hdf5plugin 7.1.0's Blosc filter (id 32001), which this venv lacks:
#   f["plain"] = np.linspace(-1, 1, 64, dtype=np.float32)
#   f.create_dataset("blosc", data=np.linspace(0, 2, 64, dtype=np.float32), chunks=(64,),
#                    **hdf5plugin.Blosc())
BLOSC_H5 = os.path.join(os.path.dirname(__file__), "fixtures", "h5", "blosc_filter.h5")


@pytest.mark.parametrize("command", ["compress", "eval"])
def test_a_dataset_behind_a_missing_filter_plugin_is_named_with_the_filter(
        capsys, tmp_path, command):
    # It read "HDF5 error (a damaged file?): Can't synchronously read data (can't open
    # directory (/usr/local/lib/plugin)...)": neither the dataset nor the filter.
    import importlib.util

    argv = {"compress": [BLOSC_H5, str(tmp_path / "o.h5"), "--eb", "rel:1e-3"],
            "eval": [BLOSC_H5, "--eb", "rel:1e-3", "--vs", "none"]}[command]
    code, out, err = run(capsys, command, *argv)
    if importlib.util.find_spec("hdf5plugin") is not None:  # its filters are registered
        assert code == 0, err
        return
    assert code == cli.EXIT_USAGE and "Traceback" not in err, err
    assert ("dataset '/blosc' was written through HDF5 filter(s) this HDF5 does not have: "
            "blosc (id 32001)") in err and "--exclude" in err, err
    assert os.listdir(tmp_path) == []
    if command == "compress":  # without it the file compresses
        o = str(tmp_path / "o.h5")
        assert cli.main(["compress", BLOSC_H5, o, "--eb", "rel:1e-3", "--exclude", "/blosc",
                         "-q"]) == 0
        with h5py.File(o) as f:
            assert f["plain"].dtype == np.uint8 and f["blosc"].dtype == np.float32


@pytest.mark.parametrize("raised", [
    OSError(28, "No space left on device"),  # Python's own writes
    RuntimeError(28),  # h5py's error of a full device: the errno alone
    KeyError("Unable to synchronously close file (file write failed: ..., error message = "
             "'No space left on device', ...)"),
])
def test_a_full_output_device_is_named_not_a_damaged_input(capsys, sample, tmp_path,
                                                           monkeypatch, raised):
    # A full disk printed "HDF5 error (a damaged file?): 28": it blamed the input.
    from ccoll.h5 import compress

    def full(*args, **kw):
        raise raised

    monkeypatch.setattr(compress, "_compress_dataset", full)
    code, out, err = run(capsys, "compress", sample, str(tmp_path / "o.h5"), "--eb", "rel:1e-3")
    assert code == cli.EXIT_FAILURE and "Traceback" not in err, err
    assert err == ("ccoll compress: error: no space left on the device of the output (No "
                   "space left on device); no output was written\n"), err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_damaged_stream_exits_1(capsys, sample, tmp_path, on_error):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    assert cli.main(["compress", sample, c, "--eb", "rel:1e-3", "-q"]) == 0
    flip_byte(c, "/step_0000/fc.bias", 80)
    code, out, err = run(capsys, "decompress", c, b, "--on-error", on_error, "--json")
    assert code == cli.EXIT_FAILURE
    doc = json.loads(out)
    if on_error == "stop":
        assert "'/step_0000/fc.bias' is damaged" in err and "CRC-32" in doc["error"]
        assert not os.path.exists(b)
    else:
        assert [f["path"] for f in doc["failed"]] == ["/step_0000/fc.bias"]
        with h5py.File(b) as f:
            assert "fc.bias" not in f["step_0000"] and "fc.weight" in f["step_0000"]
    code, out, err = run(capsys, "decompress", c, b, "--on-error", on_error, "--force")
    assert code == cli.EXIT_FAILURE and "fc.bias" in (out + err)


@pytest.mark.parametrize("command", ["compress", "decompress"])
def test_ctrl_c_exits_130_and_leaves_nothing(capsys, sample, tmp_path, monkeypatch, command):
    c = str(tmp_path / "c.h5")
    if command == "decompress":
        assert cli.main(["compress", sample, c, "--eb", "rel:1e-3", "-q"]) == 0
    import ccoll.h5.compress as cm
    import ccoll.h5.decompress as dm

    calls = []

    def interrupt(*a, **k):
        calls.append(1)
        raise KeyboardInterrupt

    if command == "compress":
        monkeypatch.setattr(cm, "compress_array", interrupt)
        argv = ["compress", sample, str(tmp_path / "o.h5"), "--eb", "rel:1e-3"]
    else:
        monkeypatch.setattr(dm, "restore_dataset", interrupt)
        argv = ["decompress", c, str(tmp_path / "o.h5")]
    code, out, err = run(capsys, *argv, "--json")
    assert calls and code == cli.EXIT_INTERRUPTED and "interrupted" in err
    assert json.loads(out)["exit_code"] == 130
    assert sorted(os.listdir(tmp_path)) == (["c.h5"] if command == "decompress" else [])


def test_ctrl_c_while_the_parser_is_built_exits_130_without_a_traceback(capsys, monkeypatch):
    # Ctrl-C in the command's first second (imports, the parser) printed a traceback.
    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupt)
    code = cli.main(["inspect", "x.h5"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INTERRUPTED and "ccoll: interrupted" in err
    assert "Traceback" not in err


def test_internal_error_exits_1_with_traceback(capsys, sample, tmp_path, monkeypatch):
    import ccoll.h5.compress as cm

    monkeypatch.setattr(cm, "compress_array", lambda *a: 1 / 0)
    code, out, err = run(capsys, "compress", sample, str(tmp_path / "o.h5"), "--eb", "rel:1e-3")
    assert code == cli.EXIT_FAILURE and "ZeroDivisionError" in err and "Traceback" in err
    assert os.listdir(tmp_path) == []


def test_eval_human_and_json(capsys, tmp_path):
    png = str(tmp_path / "rd.png")
    argv = [
        "eval",
        DIGITS,
        "--eb",
        "rel:1e-2,1e-3",
        "--vs",
        "sz3,zfp",
        "--include",
        "/step_0001/*",
        "--repeat",
        "1",
        "--plot",
        png,
    ]
    code, out, _ = run(capsys, *argv, "--summary")
    assert code == 0 and "totals over 6 dataset(s)" in out and "/step_0001/fc.weight" not in out
    assert f"plot: {png}" in out and os.path.getsize(png) > 10_000
    code, out, _ = run(capsys, *argv, "--json", "--force")
    doc = json.loads(out)
    assert code == 0 and len(doc["totals"]) == 6 and doc["plot"] == png
    assert all(r["psnr_db"] is None or r["psnr_db"] > 0 for r in doc["runs"])  # inf -> null
    assert sorted(os.listdir(tmp_path)) == ["rd.png"]


def test_a_stop_whose_exception_was_lost_still_stops(capsys, sample, tmp_path, monkeypatch):
    # A signal handler's exception is dropped when it lands in a weakref callback or __del__;
    # the recorded signal must still stop the run before the output is committed.
    import signal

    import ccoll.h5.compress as cm
    import ccoll.h5.output as out

    real = cm.compress_array

    def swallowed(x, bound, *args):
        out._stop.append(signal.SIGTERM)  # what request_stop records before its lost raise
        return real(x, bound, *args)

    monkeypatch.setattr(cm, "compress_array", swallowed)
    code, _, err = run(capsys, "compress", sample, str(tmp_path / "o.h5"), "--eb", "rel:1e-3")
    assert code == 143 and "stopped by SIGTERM; no output was written" in err
    assert os.listdir(tmp_path) == []
    assert out.stop_signal() is None  # the stop does not outlive the command


# -- inspect --verify -------------------------------------------------------------------


@pytest.fixture
def damaged(sample, tmp_path):
    c = str(tmp_path / "c.h5")
    assert cli.main(["compress", sample, c, "--eb", "rel:1e-3", "-q"]) == 0
    flip_byte(c, "/step_0000/fc.bias", 80)
    return c


def test_inspect_verifies_by_default_and_names_the_damaged_dataset(capsys, damaged):
    code, out, err = run(capsys, "inspect", damaged)
    assert code == cli.EXIT_FAILURE
    assert "1 damaged dataset(s):\n  /step_0000/fc.bias: stored bytes fail their CRC-32" in out
    assert f"ccoll inspect: error: 1 damaged dataset(s) in {damaged}: /step_0000/fc.bias" in err
    code, out, _ = run(capsys, "inspect", damaged, "--json")
    doc = json.loads(out)
    assert code == cli.EXIT_FAILURE and doc["exit_code"] == 1 and doc["verify"] is True
    assert [d["path"] for d in doc["damaged"]] == ["/step_0000/fc.bias"]
    verified = {r["path"]: r["verified"] for r in doc["datasets"] if r["codec"] == "ccoll"}
    assert verified.pop("/step_0000/fc.bias") is False and all(verified.values())


@pytest.mark.parametrize(("name", "value", "why"), [
    ("ccoll_crc32", "x", "ccoll_crc32='x' is not a whole number"),
    ("ccoll_shape", "hello", "ccoll_shape='hello' is not a list of whole numbers"),
    # Truncated to (40, 50) and 1 and accepted, exit 0:
    ("ccoll_shape", np.array([40.5, 50.0]), r"ccoll_shape=\[40.5, 50.0\] is not a list of "
     "whole numbers"),
    ("ccoll_format_version", 1.5, "ccoll_format_version=1.5 is not a whole number"),
    ("ccoll_dtype", "hello", "ccoll_dtype='hello' is not a dtype"),
    ("ccoll_eb_abs", "hello", "ccoll_eb_abs='hello' is not a number"),
])
def test_inspect_lists_an_attribute_of_the_wrong_type_as_damage(capsys, sample, tmp_path,
                                                                 name, value, why):
    # A string where a number belongs raised ValueError from int() through the CLI: a
    # traceback, and the rest of the file never listed.
    c = str(tmp_path / "c.h5")
    assert cli.main(["compress", sample, c, "--eb", "rel:1e-3", "-q"]) == 0
    with h5py.File(c, "r+") as f:
        f["/step_0000/fc.bias"].attrs[name] = value
    code, out, err = run(capsys, "inspect", c)
    assert code == cli.EXIT_FAILURE and re.search(f"/step_0000/fc.bias: attribute {why}",
                                                  out), (out, err)
    assert "Traceback" not in err and "/step_0000/fc.weight" in out
    code, out, err = run(capsys, "inspect", c, "--no-verify")  # listing alone
    assert "Traceback" not in err and "/step_0000/fc.weight" in out


@pytest.mark.parametrize("command", ["decompress", "inspect"])
def test_a_stream_without_its_format_version_is_damage_not_data(capsys, sample, tmp_path,
                                                                command):
    # Without ccoll_format_version a stream was copied as its uint8 bytes, exit 0, with its
    # other ccoll_* attributes, and inspect listed it as intact raw data.
    c = str(tmp_path / "c.h5")
    assert cli.main(["compress", sample, c, "--eb", "rel:1e-3", "-q"]) == 0
    with h5py.File(c, "r+") as f:
        del f["/step_0000/fc.bias"].attrs["ccoll_format_version"]
    o = str(tmp_path / "o.h5")
    args = (command, c) + ((o, "--on-error", "skip") if command == "decompress" else ())
    code, out, err = run(capsys, *args)
    assert code == cli.EXIT_FAILURE, (out, err)
    assert "/step_0000/fc.bias" in err and "Traceback" not in err
    if command == "inspect":
        assert "/step_0000/fc.bias: attribute ccoll_format_version is missing" in out
    else:
        with h5py.File(o) as f:
            assert "/step_0000/fc.bias" not in f  # left out, as a damaged stream is
            assert f["/step_0000/fc.weight"].dtype == np.float32
        code, out, err = run(capsys, "decompress", c, o, "--force")  # --on-error stop
        assert code == cli.EXIT_FAILURE and "attribute ccoll_format_version is missing" in err


def test_inspect_no_verify_only_lists_and_says_so(capsys, damaged):
    code, out, err = run(capsys, "inspect", damaged, "--no-verify")
    assert code == cli.EXIT_OK and err == ""
    assert "not verified (--no-verify)" in out


def test_inspect_verify_catches_a_stream_without_crc(capsys, sample, tmp_path):
    # Without its CRC attribute, a damaged stream is still caught by its header.
    c = str(tmp_path / "c.h5")
    assert cli.main(["compress", sample, c, "--eb", "rel:1e-3", "-q"]) == 0
    with h5py.File(c, "r+") as f:
        del f["/step_0000/fc.bias"].attrs["ccoll_crc32"]
    replace_stored(c, "/step_0000/fc.bias", lambda b: b[:-4])
    code, out, err = run(capsys, "inspect", c)
    assert code == cli.EXIT_FAILURE and "does not match its header" in out
    assert "/step_0000/fc.bias" in err


def test_inspect_of_an_intact_file_says_verified(capsys, sample, tmp_path):
    c = str(tmp_path / "c.h5")
    assert cli.main(["compress", sample, c, "--eb", "rel:1e-3", "-q"]) == 0
    code, out, err = run(capsys, "inspect", c)
    assert code == cli.EXIT_OK and err == ""
    assert "verified: all 7 ccoll dataset(s) intact" in out
    assert "3 dataset(s) kept as they are by ccoll compress (exact)" in out


# -- messages keep their useful part ----------------------------------------------------


@pytest.mark.parametrize(("argv", "match"), [
    (["model", "--bandwidth", "fast"], "must look like 10Gbit or 1.25GB/s"),
    (["model", "--bandwidth", "10G"], "has no unit: bits or bytes"),
    (["model", "--size", "64Mb"], "a size is in bytes, not bits"),
    (["model", "--latency", "5 parsecs"], "time must look like 5us"),
    (["bench", "allreduce", "-e", "64Q"], "size must look like 4, 64K, 64M"),
])
def test_option_type_errors_keep_their_hint(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert match in err and "invalid" not in err, err


def test_model_bandwidth_in_gigabytes(capsys):
    code, out, _ = run(capsys, "model", "--bandwidth", "10GB/s", "--json")
    assert code == 0 and json.loads(out)["params"]["beta"] == 1e10
    code, out, _ = run(capsys, "model", "--bandwidth", "10GB/s")
    assert "link 80 Gbit/s" in out


def test_model_one_rank_is_not_a_traceback(capsys):
    code, out, err = run(capsys, "model", "--ranks", "1")
    assert code == cli.EXIT_OK and err == ""
    assert "one rank: an allreduce is a local copy" in out and "choice: raw" in out


def test_unwritable_output_folder_is_named_not_its_temporary_file(
    capsys, sample, tmp_path, monkeypatch
):
    import tempfile

    def refuse(*, dir, prefix, suffix):  # what the OS says in a folder without write access
        raise PermissionError(13, "Permission denied", os.path.join(dir, prefix + "x1y2" + suffix))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    out_h5 = str(tmp_path / "o.h5")
    code, _, err = run(capsys, "compress", sample, out_h5, "--eb", "rel:1e-3")
    assert code == cli.EXIT_USAGE
    # Found by the check before any work (a file tried in the folder), named as the folder.
    assert f"output folder {str(tmp_path)!r} is not writable: Permission denied" in err
    assert ".tmp" not in err and "x1y2" not in err


def test_unwritable_output_folder_is_refused_before_the_work(capsys, sample, tmp_path, monkeypatch):
    import ccoll.h5.output as out_mod

    real = os.access
    monkeypatch.setattr(
        out_mod.os, "access",
        lambda p, mode: False if os.fspath(p) == str(tmp_path) else real(p, mode),
    )
    code, _, err = run(capsys, "compress", sample, str(tmp_path / "o.h5"), "--eb", "rel:1e-3")
    assert code == cli.EXIT_USAGE and f"output folder {str(tmp_path)!r} is not writable" in err


# -- a closed stdout (`ccoll model | head -1`) ------------------------------------------


class _ClosedPipe:
    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        raise OSError("no descriptor")


@pytest.mark.parametrize("argv", [["model"], ["model", "--json"], ["inspect", DIGITS]])
def test_closed_stdout_exits_141_quietly(capsys, monkeypatch, argv):
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == cli.EXIT_BROKEN_PIPE == 141 and err == ""


@pytest.mark.parametrize(("argv", "match"), [
    (["model", "--json", "--bandwidth", "10G"], "argument --bandwidth: bandwidth '10G' has no"),
    (["model", "--js", "--ratio", "0"], "argument --ratio: must be a finite number > 0"),
    (["compress", "a.h5", "--json"], "the following arguments are required: OUT.h5, --eb"),
    (["inspect", "a.h5", "--json", "--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_usage_errors_under_json_still_print_one_document(capsys, argv, match):
    # docs/cli.md: "With --json, a failed run still prints one JSON document"; a usage
    # error printed argparse's message only.
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["command"] == argv[0] and doc["exit_code"] == cli.EXIT_USAGE
    assert doc["error_type"] == "UsageError" and doc["error"].startswith(match), doc
    assert "usage:" in err and match in err


@pytest.mark.parametrize("argv", [
    ["model", "--bandwidth", "10G"],  # no --json
    ["bench", "allreduce", "--json", "b.json", "-e", "64Q"],  # bench's --json is a file
    ["model", "--", "--json"],
])
def test_usage_errors_without_json_print_nothing_on_stdout(capsys, argv):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert capsys.readouterr().out == ""


def test_model_cached_without_a_cache_exits_2_as_its_help_says(capsys, tmp_path, monkeypatch):
    # The help said "exit 1 without one"; a missing cache is unusable input: 2.
    with pytest.raises(SystemExit):
        cli.main(["model", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--cached require the cached calibration (exit 2, unusable input, without one)" \
        in help_text
    monkeypatch.setenv("CCOLL_CACHE_DIR", str(tmp_path / "empty"))
    code, _, err = run(capsys, "model", "--cached")
    assert code == cli.EXIT_USAGE and "no calibration in the cache yet" in err


@pytest.mark.parametrize("content", ["garbage", "[1, 2]", '{"k": {"alpha": "x"}}'])
def test_model_cached_with_an_unusable_cache_says_so(capsys, tmp_path, monkeypatch, content):
    # A cache file that is there but holds no usable entry read "no calibration in the
    # cache yet", as if there were none.
    (tmp_path / "links.json").write_text(content)
    monkeypatch.setenv("CCOLL_CACHE_DIR", str(tmp_path))
    code, _, err = run(capsys, "model", "--cached")
    assert code == cli.EXIT_USAGE and "holds no entry ccoll can use" in err, err
    assert str(tmp_path / "links.json") in err
