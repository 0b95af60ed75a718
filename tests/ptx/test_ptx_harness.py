"""The PTX helper compiles kernels for sm_80 and sm_90 and ptxas assembles them."""

import pytest
from numba import cuda, float32
from ptxkit import ARCHS, assemble, compile_for, ptxas


@cuda.jit(device=True)
def _twice(v):
    return 2 * v


def _scale(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = _twice(x[i])


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_kernel_with_device_call_compiles(cc):
    ptx = compile_for(_scale, (float32[::1], float32[::1]), cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx


@pytest.mark.skipif(ptxas() is None, reason="ptxas is not installed")
def test_ptxas_reports_registers_and_no_spills():
    info = assemble(compile_for(_scale, (float32[::1], float32[::1]), (9, 0)), (9, 0))
    assert info.registers > 0
    assert info.spill_stores == 0 and info.spill_loads == 0
