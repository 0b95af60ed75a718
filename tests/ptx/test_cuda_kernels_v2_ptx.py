"""Every format-v2 compressor kernel compiles to PTX for sm_80 and sm_90, keeps IEEE
arithmetic (no FMA contraction, correctly rounded division) and assembles for sm_90 without
spills, like the v1 kernels (test_cuda_kernels_ptx.py)."""

from __future__ import annotations

import functools
import re

import pytest
from ptxkit import ARCHS, assemble, compile_for, ptxas

from ccoll.compressor import _cuda_kernels_v2 as K2

CASES = [(name, label, sig) for name, sigs in K2.signatures().items() for label, sig in sigs]
IDS = [f"{name}-{label}" for name, label, _ in CASES]
DIVIDES = {"compress2_kernel"}  # v = fl(x / step), the only float64 division of the format
MULTIPLIES = {"compress2_kernel", "decode2_kernel", "add2_kernel"}


@functools.cache
def ptx_of(name: str, label: str, cc: tuple[int, int]) -> str:
    sig = dict(K2.signatures()[name])[label]
    return compile_for(K2.KERNELS[name], sig, cc)


def test_every_kernel_has_signatures():
    assert set(K2.signatures()) == set(K2.KERNELS)


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("name, label, sig", CASES, ids=IDS)
def test_kernel_compiles_with_exact_float64_arithmetic(cc, name, label, sig):
    ptx = ptx_of(name, label, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx
    assert not re.search(r"\bfma\.", ptx), "FMA contraction in a kernel"
    divs = re.findall(r"\bdiv(?:\.\w+)*\.f64\b", ptx)
    assert set(divs) <= {"div.rn.f64"}, f"float64 divisions that do not round to nearest: {divs}"
    assert bool(divs) == (name in DIVIDES), f"float64 divisions in {name}: {divs}"
    assert not re.search(r"\brcp(?:\.\w+)*\.f64\b", ptx), "float64 reciprocal in a kernel"
    if name in MULTIPLIES:
        assert "mul.rn.f64" in ptx  # the one multiplication of docs/format.md, unfused
    if name in ("compress2_kernel", "add2_kernel"):
        # shared payload words are combined with an atomic OR (docs/format.md, v2 offsets)
        assert re.search(r"\b(?:atom|red)(?:\.\w+)*\.or\.b32\b", ptx)


@pytest.mark.skipif(ptxas() is None, reason="ptxas is not installed")
@pytest.mark.parametrize("name, label, sig", CASES, ids=IDS)
def test_kernel_assembles_for_sm90_without_spills(name, label, sig):
    info = assemble(ptx_of(name, label, (9, 0)), (9, 0))
    assert 0 < info.registers <= 64, info.text  # 256 threads x 64 registers: full occupancy
    assert info.spill_stores == 0 and info.spill_loads == 0, info.text
