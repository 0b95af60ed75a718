"""ccoll bench over several ranks: what differs between ranks stops every rank at once.

Before, options that differed between ranks (-n 2 on one, -n 3 on another; or other sizes)
left ranks waiting forever in a collective, or died in MPI ("Message truncated"), and a
step of the data that one rank could not time failed on that rank only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from ccoll import bench
from ccoll.errors import InputError

comm = MPI.COMM_WORLD
pytestmark = pytest.mark.skipif(comm.Get_size() < 2, reason="needs 2 or more ranks")


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers())
    return ap.parse_args(["bench", "allreduce", "-b", "4K", "-e", "4K", "-w", "0",
                          "--algorithms", "mpi", "--no-model", "-q", *argv])


@pytest.mark.parametrize(("rank0", "other", "match"), [
    (("-n", "2"), ("-n", "3"), "-n/--iters is 2 on rank 0 but 3 on rank 1"),
    (("-n", "1"), ("-n", "1", "-b", "8K", "-e", "8K"),
     "-e/--maxbytes is 4096 on rank 0 but 8192 on rank 1 \\(and 1 more option"),
])
def test_options_that_differ_between_ranks_stop_every_rank(rank0, other, match) -> None:
    args = _args(*(rank0 if comm.Get_rank() == 0 else other))
    with pytest.raises(InputError, match=f"^options differ between ranks: {match}"):
        bench.run_bench(args)


def test_the_same_options_run() -> None:
    doc, _, code = bench.run_bench(_args("-n", "1"))
    assert code == 0 and [r["algorithm"] for r in doc["rows"]] == ["mpi"]


def _shared_path(tmp_path: Path) -> str:
    """Rank 0's ``tmp_path / 'd.h5'`` on every rank (buffer-based broadcast)."""
    name = np.zeros(4096, np.uint8)
    if comm.Get_rank() == 0:
        raw = str(tmp_path / "d.h5").encode()
        name[:len(raw)] = np.frombuffer(raw, np.uint8)
    comm.Bcast([name, MPI.UINT8_T], root=0)
    return name.tobytes().rstrip(b"\0").decode()


def test_a_step_one_rank_cannot_time_stops_every_rank(tmp_path: Path) -> None:
    # Rank 0 takes step_0000 (fine), rank 1 step_0001 (zero elements only): before, rank 1
    # raised alone (or timed zeros) while rank 0 went on into the sweep.
    path = _shared_path(tmp_path)
    if comm.Get_rank() == 0:
        with h5py.File(path, "w") as f:
            f.create_group("step_0000").create_dataset("a", data=np.ones(100, np.float32))
            f.create_group("step_0001").create_dataset("a", data=np.zeros(0, np.float32))
    comm.Barrier()
    with pytest.raises(InputError, match=r"^--data .*d\.h5: step step_0001 holds no values"):
        bench.run_bench(_args("-n", "1", "--data", path))


def test_reduce_scatter_of_fewer_elements_than_ranks(capsys) -> None:
    # -b 4 is one float32: rank 1 holds no element of the result. The error check took the
    # maximum over rank 1's empty share (ValueError: zero-size array), and the header
    # named the collective "allreduce".
    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers())
    args = ap.parse_args(["bench", "reduce_scatter", "-b", "4", "-e", "4", "-n", "1", "-w",
                          "0", "--algorithms", "mpi", "--no-model"])
    doc, _, code = bench.run_bench(args)
    assert code == 0 and doc["rows"][0]["err_over_eb"] == 0.0
    if comm.Get_rank() == 0:
        out = capsys.readouterr().out
        assert "ranks (shared memory); reduce_scatter flat" in out, out
