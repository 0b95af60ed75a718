"""CUDA simulator harness: these tests run with NUMBA_ENABLE_CUDASIM=1 (see the Makefile).

The simulator lacks warp intrinsics; `warp_shim.install()` adds the ones ccoll's kernels use,
built on a per-warp barrier (lanes must not diverge around them, as on hardware).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(__file__))

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    import warp_shim

    warp_shim.install()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise pytest.UsageError("tests/cuda run in the CUDA simulator: set NUMBA_ENABLE_CUDASIM=1")
