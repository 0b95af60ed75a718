"""Every compressor kernel compiles to PTX for sm_80 and sm_90, keeps IEEE arithmetic
(no FMA contraction, correctly rounded division) and assembles for sm_90 without spills."""

from __future__ import annotations

import functools
import re

import pytest
from ptxkit import ARCHS, assemble, compile_for, ptxas

from ccoll.compressor import _cuda_kernels as K

CASES = [(name, label, sig) for name, sigs in K.signatures().items() for label, sig in sigs]
IDS = [f"{name}-{label}" for name, label, _ in CASES]
# The kernels that quantize, v = fl(x / step): the only float64 division of the format.
DIVIDES = {"compress_kernel"}


@functools.cache
def ptx_of(name: str, label: str, cc: tuple[int, int]) -> str:
    sig = dict(K.signatures()[name])[label]
    return compile_for(K.KERNELS[name], sig, cc)


def test_every_kernel_has_signatures():
    assert set(K.signatures()) == set(K.KERNELS)


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("name, label, sig", CASES, ids=IDS)
def test_kernel_compiles_with_exact_float64_arithmetic(cc, name, label, sig):
    ptx = ptx_of(name, label, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx
    # A fused multiply-add rounds once where the format rounds twice.
    assert not re.search(r"\bfma\.", ptx), "FMA contraction in a kernel"
    # v = x / step is one correctly rounded float64 division (docs/format.md), in the
    # compressor only: no other rounding mode, no reciprocal standing in for it.
    divs = re.findall(r"\bdiv(?:\.\w+)*\.f64\b", ptx)
    assert set(divs) <= {"div.rn.f64"}, f"float64 divisions that do not round to nearest: {divs}"
    assert bool(divs) == (name in DIVIDES), f"float64 divisions in {name}: {divs}"
    assert not re.search(r"\brcp(?:\.\w+)*\.f64\b", ptx), "float64 reciprocal in a kernel"
    if name in ("compress_kernel", "decode_kernel", "add_kernel"):
        assert "mul.rn.f64" in ptx  # the one multiplication of docs/format.md, unfused


@pytest.mark.skipif(ptxas() is None, reason="ptxas is not installed")
@pytest.mark.parametrize("name, label, sig", CASES, ids=IDS)
def test_kernel_assembles_for_sm90_without_spills(name, label, sig):
    info = assemble(ptx_of(name, label, (9, 0)), (9, 0))
    assert 0 < info.registers <= 64, info.text  # 256 threads x 64 registers: full occupancy
    assert info.spill_stores == 0 and info.spill_loads == 0, info.text
