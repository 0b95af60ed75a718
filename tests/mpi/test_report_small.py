"""Small API defects (issue 36, item 9), run at 1 to 3 ranks.

- ``CallReport.ratio`` is a number for every compressed call on every rank, also where the
  rank sent nothing (one rank; a broadcast's last rank): the data's bytes over its streams'.
- A mismatched bound is reported as the bound, not as settings nobody set.
- Complex input is refused with advice that keeps the imaginary part.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

import ccoll
from ccoll.errors import DTypeError, MismatchError

SIZE = MPI.COMM_WORLD.Get_size()
EB = ccoll.ABS(1e-3)


def _data(rank, n=20_000):
    return np.sin(np.arange(n) * 1e-3 + rank).astype(np.float32)


@pytest.mark.parametrize("coll", ["allreduce", "reduce_scatter", "allgather", "bcast"])
def test_ratio_of_every_compressed_call(comm, coll):
    x = _data(comm.rank)
    with ccoll.Communicator(comm, policy="compress") as cc:
        if coll == "bcast":
            cc.bcast(x, EB, root=0)
        else:
            getattr(cc, coll)(x, EB)
        rep = cc.last_call
    assert rep.compressed
    assert rep.ratio is not None and math.isfinite(rep.ratio) and rep.ratio > 1, rep
    if SIZE == 1 and coll in ("allgather", "bcast"):
        # One stream of the whole input: its ratio, from ccoll.compress at the same bound.
        buf = ccoll.compress(x, EB, version=rep.format_version)
        assert rep.ratio == x.nbytes / buf.nbytes
    if coll == "bcast" and SIZE > 1:
        # Every rank that sent nothing measures the root's stream, the same number.
        idle = [r for r in comm.allgather((rep.bytes_sent, rep.ratio)) if r[0] == 0]
        assert len({r[1] for r in idle}) <= 1


def test_mismatched_bound_names_the_bound(comm):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    with ccoll.Communicator(comm) as cc:
        with pytest.raises(MismatchError) as info:
            cc.allreduce(_data(comm.rank, 1000), ccoll.ABS(1e-3 * (1 + comm.rank)))
    msg = str(info.value)
    assert "error-bound value" in msg and "ABS(0.001) on rank 0" in msg, msg
    assert "CCOLL" not in msg and "setting" not in msg, msg


def test_complex_input_advice_keeps_the_imaginary_part(comm):
    z = (np.arange(8) + 1j * np.arange(8)).astype(np.complex64)
    with ccoll.Communicator(comm) as cc:
        with pytest.raises(DTypeError) as info:
            cc.allreduce(z, EB)
    msg = str(info.value)
    assert "complex64" in msg and "astype(np.float32)" not in msg, msg
    assert "imaginary" in msg and ".real" in msg and ".imag" in msg, msg
