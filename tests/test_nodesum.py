"""The node sum of a two-level allreduce, and that ``python -m ccoll.warmup`` compiles it.

Every rank of a node sums its share of the node's input slots (docs/collectives.md,
"Hierarchical collectives"); without the warm-up each rank compiled this kernel at its
first two-level call, side by side with the node's other ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ccoll.collectives import nodesum

REPO = Path(__file__).resolve().parent.parent


def _inputs(dtype: str, ranks: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    # Magnitudes far apart, so that the order of the additions changes the float64 sum.
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-8, 9, n)).astype(dtype)
            for _ in range(ranks)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_each_rank_gets_the_sum_in_local_rank_order(dtype: str, ranks: int) -> None:
    n = 1000
    xs = _inputs(dtype, ranks, n)
    lo, hi = 123, 777
    expect = np.zeros(hi - lo, np.float64)
    for x in xs:  # local rank order, one rounding per addition
        expect += x[lo:hi].astype(np.float64)
    got = []
    for local in range(ranks):
        slots = np.stack(xs + [np.zeros(n, dtype)])  # the mapped regions: R inputs, 1 result
        slots[local] = np.nan  # a rank's own slot is not read for its own input
        out = np.empty(hi - lo, np.float64)
        nodesum.sum_slots(xs[local].copy(), slots[:ranks], local, lo, out)
        got.append(out)
    for out in got:
        assert out.tobytes() == expect.tobytes()


PROG = r"""
import sys
import numpy as np
from ccoll import warmup
from ccoll.collectives import nodesum
dtype = sys.argv[1]
warmup.warm(dtype)
kernel = nodesum._sum_share
before = set(kernel.signatures)
# The types of the Communicator's call: its flat input, a 2-D view of the mapped slots,
# the local rank and offset as ints, and a slice of its float64 buffers.
raw = bytearray(3 * 64 * np.dtype(dtype).itemsize)
slots = np.frombuffer(raw, dtype=dtype).reshape(3, 64)
bufs = np.empty(64, np.float64)
nodesum.sum_slots(np.ones(64, dtype), slots[:2], 1, 32, bufs[:32])
print(len(before), len(set(kernel.signatures) - before))
"""


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_warmup_compiles_the_node_sum_for_the_communicators_arguments(dtype: str) -> None:
    # In a process of its own: the other tests here compile the same types.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", PROG, dtype], env=env, capture_output=True,
                       text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr
    warmed, added = map(int, p.stdout.split())
    assert warmed >= 1 and added == 0, "warm() left the node sum's argument types uncompiled"
