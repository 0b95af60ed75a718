"""The first call that compiles ccoll's kernels says so once on stderr; a warm cache is silent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTICE = "ccoll: compiling kernels for float32, once"

PROG = r"""
import sys
import numpy as np
from ccoll.compressor import cpu
x = np.linspace(-1, 1, 1000, dtype=np.float32)
cpu.compress_abs(x, 1e-3)
print("FIRST DONE", file=sys.stderr, flush=True)
cpu.compress_abs(x, 1e-3)
print("SECOND DONE", file=sys.stderr, flush=True)
"""


def _run(cache: Path) -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", PROG], env=env, capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr
    return p.stderr


@pytest.fixture(scope="module")
def cold_then_warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    cache = tmp_path_factory.mktemp("numba-cache")
    return _run(cache), _run(cache)


def test_empty_cache_prints_the_notice_once_before_the_first_call_returns(
    cold_then_warm: tuple[str, str],
) -> None:
    cold, _ = cold_then_warm
    assert cold.count("ccoll: compiling") == 1, cold
    first, second = cold.split("FIRST DONE")
    assert NOTICE in first and "numba's cache" in first
    assert "ccoll:" not in second


def test_warm_cache_prints_nothing(cold_then_warm: tuple[str, str]) -> None:
    _, warm = cold_then_warm
    assert "ccoll:" not in warm, warm


def test_format_2_kernels_get_a_notice_of_their_own(monkeypatch, capsys):
    # The listener on fake compile events: v1 and v2 kernels are announced once per dtype
    # each, a kernel without float arrays is covered by its format's notice, and a helper
    # compiled inside a kernel (nested event) says nothing.
    import types

    from numba import types as nt

    from ccoll.compressor.cpu import notice

    monkeypatch.setattr(notice, "_announced", set())

    def event(module: str, *args: object) -> types.SimpleNamespace:
        disp = types.SimpleNamespace(py_func=types.SimpleNamespace(__module__=module))
        return types.SimpleNamespace(data={"dispatcher": disp, "args": args})

    f32 = nt.Array(nt.float32, 1, "C")
    u32 = nt.Array(nt.uint32, 1, "C")
    listener = notice._Notice()
    calls = [event("ccoll.compressor.cpu.encode", f32), event("ccoll.compressor.cpu.v2", f32),
             event("ccoll.compressor.cpu.v2", u32), event("ccoll.compressor.cpu.encode", f32),
             event("ccoll.compressor.cpu.v2", f32), event("numpy.other", f32)]
    for ev in calls:
        listener.on_start(ev)
        listener.on_end(ev)
    outer = event("ccoll.compressor.cpu.v2", nt.Array(nt.float64, 1, "C"))
    listener.on_start(outer)
    listener.on_start(event("ccoll.compressor.cpu.v2blocks", f32))  # nested helper
    listener.on_end(outer)
    listener.on_end(outer)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [notice.message("float32"), notice.message("float32", 2),
                     notice.message("float64", 2)]
    assert "format-2 kernels for float32" in lines[1] and "minutes" in lines[1]
    assert lines[0].startswith(NOTICE)
