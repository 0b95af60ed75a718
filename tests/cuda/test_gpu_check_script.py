"""bench/gpu/run.sh's script in the simulator: it must still run on the API as it is.

The GPU check runs only where a GPU is lent, so a rename in the package could break it
unnoticed until then (its imports once did). Here it runs with ``--tiny --simulator``:
the byte-equality section for stream version 2 in the default run (the script runs both
versions through the same code), both versions and the throughput section as slow tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu", "compressor_gpu.py")


def run_check(tmp_path, *args: str) -> dict:
    env = dict(os.environ, OUT=str(tmp_path), NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--tiny", "--simulator", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "compressor_gpu.json") as f:
        return json.load(f)


def check_equality(tmp_path, versions: str) -> None:
    res = run_check(tmp_path, "--sections", "equality", "--versions", versions)
    rows = res["equality"]
    assert {r["version"] for r in rows} == {int(v) for v in versions.split(",")}
    assert res["equality_failures"] == 0 and not res["errors"]
    for r in rows:
        assert r["stream_equal"] and r["decode_equal"] and r["within_bound"], r
    assert sum(r["add_equal"] is True for r in rows) >= 2  # one sum per file and version
    assert not res["throughput"]


def test_equality_section_checks_version_2(tmp_path):
    check_equality(tmp_path, "2")


@pytest.mark.slow
def test_equality_section_checks_both_versions(tmp_path):
    check_equality(tmp_path, "1,2")


@pytest.mark.slow
@pytest.mark.timeout(1000)  # 57 s in the simulator on 2 cores (load 2-15); 330 s before the
#                              simulator fixes in warp_shim.py: room for a slower machine
def test_throughput_section_times_both_versions(tmp_path):
    # The script's own budget ends before run_check's 900 s kill, and that before this
    # test's timeout: a slow machine reports what the budget skipped.
    res = run_check(tmp_path, "--sections", "throughput", "--budget", "800")
    ops = {(r["op"], r["version"]) for r in res["throughput"] if r["runs"] > 0}
    assert ops == {("compress", 1), ("compress kernel", 1), ("decompress", 1), ("add", 1),
                   ("compress", 2), ("decompress", 2), ("add", 2)}
