"""The collectives' own device kernels (DAR add, average divide) compile to PTX for sm_80
and sm_90 with IEEE arithmetic: a correctly rounded division, as numpy's on the host."""

from __future__ import annotations

import re

import pytest
from numba import types
from ptxkit import ARCHS, compile_for

from ccoll.collectives import devkernels

FLOATS = [types.float32, types.float64]


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("ty", FLOATS, ids=str)
def test_add_and_divide_compile_with_exact_arithmetic(cc, ty):
    arr = types.Array(ty, 1, "C")
    add = compile_for(devkernels._add, (arr, arr), cc)
    div = compile_for(devkernels._divide, (arr, ty), cc)
    for ptx in (add, div):
        assert f".target sm_{cc[0]}{cc[1]}" in ptx and ".entry" in ptx
        assert not re.search(r"\bfma\.", ptx)
    bits = 32 if ty == types.float32 else 64
    assert re.search(rf"\badd\.(?:rn\.)?f{bits}\b", add)
    divs = re.findall(rf"\bdiv(?:\.\w+)*\.f{bits}\b", div)
    assert divs and set(divs) == {f"div.rn.f{bits}"}, divs
