"""Compile numba-cuda kernels to PTX without a GPU, and assemble the PTX with ptxas.

`numba.cuda.compile_ptx` works without a driver, except that kernels calling other device
functions ask the current device for its compute capability; `compile_for` patches that
lookup for the duration of the compilation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

ARCHS = ((8, 0), (9, 0))


@contextmanager
def fake_device(cc: tuple[int, int]) -> Iterator[None]:
    import numba.cuda.dispatcher as disp

    class _Dev:
        compute_capability = cc

    old = disp.get_current_device
    disp.get_current_device = lambda: _Dev()  # type: ignore[assignment]
    try:
        yield
    finally:
        disp.get_current_device = old  # type: ignore[assignment]


def compile_for(pyfunc: Any, sig: Any, cc: tuple[int, int]) -> str:
    """PTX text of ``pyfunc`` (a plain Python function or a cuda.jit dispatcher) for ``cc``."""
    from numba import cuda

    fn = getattr(pyfunc, "py_func", pyfunc)
    with fake_device(cc):
        ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
    return ptx


@dataclass
class PtxasInfo:
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    text: str


def ptxas() -> str | None:
    """Path of a ptxas that reads the PTX numba-cuda's NVRTC writes, or None.

    The pip package nvidia-cuda-nvcc (the `test` extra) matches NVRTC's PTX version; a
    system ptxas from an older toolkit rejects newer PTX, so it is only the fallback.
    """
    import pathlib
    import sys

    venv = pathlib.Path(sys.prefix) / "lib"
    for p in sorted(venv.glob("python3*/site-packages/nvidia/cu*/bin/ptxas")):
        return str(p)
    return shutil.which("ptxas")


def assemble(ptx: str, cc: tuple[int, int]) -> PtxasInfo:
    """Run ``ptxas -v`` on the PTX for ``sm_XY`` and parse registers and spills."""
    exe = ptxas()
    if exe is None:
        raise RuntimeError("ptxas not found (install the CUDA toolkit or nvidia-cuda-nvcc)")
    arch = f"sm_{cc[0]}{cc[1]}"
    with tempfile.TemporaryDirectory() as d:
        src = f"{d}/k.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run(
            [exe, "-v", f"-arch={arch}", src, "-o", f"{d}/k.cubin"],
            capture_output=True,
            text=True,
            check=False,
        )
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed for {arch}:\n{r.stderr}")
    text = r.stderr + r.stdout
    regs = max((int(m) for m in re.findall(r"Used (\d+) registers", text)), default=0)
    st = sum(int(m) for m in re.findall(r"(\d+) bytes spill stores", text))
    ld = sum(int(m) for m in re.findall(r"(\d+) bytes spill loads", text))
    return PtxasInfo(arch, regs, st, ld, text)
