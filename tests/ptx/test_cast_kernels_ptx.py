"""The float16 <-> float32 kernels of device float16 data compile for sm_80 and sm_90, and
the narrowing is one round-to-nearest-even conversion (the host's numpy/torch rounding)."""

from __future__ import annotations

import pytest
from ptxkit import ARCHS, assemble, compile_for, ptxas

from ccoll.compressor import _cuda_cast as C

NAMES = sorted(C.SIGNATURES)


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("name", NAMES)
def test_cast_kernel_compiles_and_rounds_to_nearest(cc, name):
    kernel, sig = C.SIGNATURES[name]
    ptx = compile_for(kernel, sig, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx and ".entry" in ptx
    if name == "narrow":
        # float32 -> float16 rounds to nearest even, once; no other rounding mode.
        assert "cvt.rn.f16.f32" in ptx, ptx
        assert not any(f"cvt.{m}.f16.f32" in ptx for m in ("rz", "rm", "rp")), ptx
    else:
        assert "cvt.f32.f16" in ptx, ptx  # exact widening


@pytest.mark.skipif(ptxas() is None, reason="ptxas is not installed")
@pytest.mark.parametrize("name", NAMES)
def test_cast_kernel_assembles_for_sm90(name):
    kernel, sig = C.SIGNATURES[name]
    info = assemble(compile_for(kernel, sig, (9, 0)), (9, 0))
    assert info.spill_stores == 0 and info.spill_loads == 0, info.text
