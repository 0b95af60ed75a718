"""The ccoll command as a separate process: the installed script, python -m, exit codes,
--json on stdout, and SIGINT in the middle of a run leaving no partial file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from h5kit import DIGITS, assert_restored, flip_byte

SCRIPT = os.path.join(os.path.dirname(sys.executable), "ccoll")
PY_M = [sys.executable, "-m", "ccoll"]


def ccoll(*argv, cmd=None, timeout=120):
    p = subprocess.run([*(cmd or PY_M), *argv], capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.skipif(not os.path.exists(SCRIPT), reason="console script not installed")
def test_installed_script_round_trip(tmp_path):
    c, b = str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    code, out, err = ccoll("compress", DIGITS, c, "--eb", "abs:1e-5", "--json", cmd=[SCRIPT])
    assert code == 0, err
    doc = json.loads(out)  # one JSON document, nothing else on stdout
    # Every weight is a stream; only biases (10 to 32 values, against the 76 bytes or more
    # that a 1-D stream spends besides its codes) may be kept as they are.
    t = doc["totals"]
    kept = {r["path"] for r in doc["datasets"] if r["stored_as"] == "raw"}
    assert kept and all(p.endswith(".bias") for p in kept)
    assert t["compressed"] + t["kept_raw"] == 30 and t["kept_raw"] == len(kept)
    assert t["ratio"] > 1.5
    code, out, err = ccoll("inspect", c, "--json", cmd=[SCRIPT])
    assert code == 0 and json.loads(out)["compressed_totals"]["datasets"] == t["compressed"]
    code, out, err = ccoll("decompress", c, b, cmd=[SCRIPT])
    assert code == 0 and f"{t['compressed']} dataset(s) restored" in out and err == ""
    assert f"{t['kept_raw']} kept as they were (exact)" in out
    assert assert_restored(DIGITS, b, lambda p, x: 1e-5) == 30


def test_python_m_exit_codes(tmp_path):
    code, out, _ = ccoll("--version")
    assert code == 0 and out.startswith("ccoll ")
    (tmp_path / "t.txt").write_text("x")
    code, out, err = ccoll(
        "compress", str(tmp_path / "t.txt"), str(tmp_path / "o.h5"), "--eb", "rel:1e-3", "--json"
    )
    assert code == 2 and "not an HDF5 file" in err and json.loads(out)["exit_code"] == 2
    code, _, err = ccoll("compress", DIGITS, str(tmp_path / "t.txt"), "--eb", "rel:1e-3")
    assert code == 2 and "exists" in err
    c = str(tmp_path / "c.h5")
    assert (
        ccoll("compress", DIGITS, c, "--eb", "rel:1e-3", "--include", "/step_0002/*", "-q")[0] == 0
    )
    flip_byte(c, "/step_0002/conv2.weight", 64)
    code, _, err = ccoll("decompress", c, str(tmp_path / "b.h5"))
    assert code == 1 and "'/step_0002/conv2.weight' is damaged" in err
    assert sorted(os.listdir(tmp_path)) == ["c.h5", "t.txt"]


@pytest.fixture
def big(tmp_path):
    # ~64 MB in 64 datasets: long enough for a signal to land mid-run on any machine.
    p = str(tmp_path / "big.h5")
    rng = np.random.default_rng(0)
    block = rng.standard_normal(1 << 18).astype(np.float32)
    with h5py.File(p, "w") as f:
        for i in range(64):
            f.create_dataset(f"step/t{i:03d}", data=np.roll(block, i))
    return p


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_run_leaves_no_partial_file(big, tmp_path, sig, code):
    out = tmp_path / "out.h5"
    proc = subprocess.Popen(
        [*PY_M, "compress", big, str(out), "--eb", "rel:1e-4", "--lossless", "zstd"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        # Wait until the temporary output exists and holds data: the run is under way.
        while time.monotonic() < deadline and proc.poll() is None:
            tmp = [n for n in os.listdir(tmp_path) if n.startswith(".out.h5.")]
            if tmp and os.path.getsize(tmp_path / tmp[0]) > (2 << 20):
                break
            time.sleep(0.005)
        assert proc.poll() is None, "compress ended before the signal could be sent"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "no output was written" in err
    assert sorted(os.listdir(tmp_path)) == ["big.h5"]


@pytest.mark.parametrize("argv", [["model"], ["inspect", DIGITS], ["--help"]])
def test_reader_closing_the_pipe_exits_quietly(argv):
    # --help: argparse ignores a failed write of its own, so a help text larger than the
    # output buffer ends with 0 and a shorter one with 141 at the final flush (the length
    # follows COLUMNS); quiet either way (docs/cli.md).
    # `ccoll model | head -1`: the reader is gone before ccoll writes (it is closed here
    # before the interpreter has even started), so every write meets EPIPE.
    with subprocess.Popen([*PY_M, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        p.stdout.close()
        err = p.stderr.read().decode()
        code = p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == "", err
    assert code in ((0, 141) if argv == ["--help"] else (141,))
