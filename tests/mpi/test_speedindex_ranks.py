"""ccoll.speedindex.speed_index_on_rank0 over several ranks: rank 0 measures, the others wait."""

from __future__ import annotations

from mpi4py import MPI

from ccoll import speedindex


def test_only_rank_0_measures(tmp_path_factory) -> None:
    comm = MPI.COMM_WORLD
    path = str(tmp_path_factory.mktemp("idx") / "missing.h5")
    got = speedindex.speed_index_on_rank0(comm, path)
    if comm.Get_rank() == 0:
        assert got is not None and "no such file" in got["why"]
    else:
        assert got is None
