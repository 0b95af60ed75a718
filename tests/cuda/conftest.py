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
    # The longest tests go first, so that under `-n 2` (make test-cuda) the two workers
    # share them out and end together: in file order the GPU check script's run and the
    # two-tile v2 add came among the last, and one worker ran them while the other waited.
    # Only the order changes; a name missing from the list is merely not moved.
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.originalname, len(LONGEST)))


LONGEST = [  # longest first
    "test_equality_section_checks_version_2",  # a subprocess: the bench script
    "test_add_equals_reference",
    "test_many_thread_blocks_and_index_lookback",
    "test_every_kind_and_table_size",
    "test_capped_grid_writes_the_same_stream",
]
