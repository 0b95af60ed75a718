"""``Communicator.last_call`` and ``CCOLL_LOG``: every call says what it did and why.

Run at 1..5 ranks. The decision fields of a report come from agreed numbers, so they are
the same on every rank; bytes and seconds are each rank's own.
"""

from __future__ import annotations

import logging
import shutil
import tempfile

import numpy as np
import pytest
from collkit import gradient_like
from mpi4py import MPI

import ccoll
from ccoll.collectives import CallReport, last_call
from ccoll.collectives.registry import default_communicator
from ccoll.errors import InputError

SIZE = MPI.COMM_WORLD.Get_size()
SLOW_LINK = {  # 100 Mbit/s, fast compressor, a given ratio: a 4 MiB allreduce compresses
    "CCOLL_ALPHA": "50us", "CCOLL_BANDWIDTH": "100Mbit", "CCOLL_COMPRESS_GBPS": "5",
    "CCOLL_ADD_GBPS": "5", "CCOLL_DECOMPRESS_GBPS": "5", "CCOLL_RATIO": "20",
}
FAST_LINK = {  # 1 Tbit/s, slow compressor: compressing never pays
    "CCOLL_ALPHA": "1us", "CCOLL_BANDWIDTH": "1000Gbit", "CCOLL_COMPRESS_GBPS": "0.5",
    "CCOLL_ADD_GBPS": "0.5", "CCOLL_DECOMPRESS_GBPS": "0.5",
}


@pytest.fixture
def link(comm, monkeypatch):
    """Set calibration overrides (a fresh, unwritten cache) for one test."""
    path = tempfile.mkdtemp(prefix="ccoll-cache-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    monkeypatch.setenv("CCOLL_CACHE_DIR", path)
    monkeypatch.setenv("CCOLL_CALIBRATION", "off")

    def set_link(values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    yield set_link
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ccoll_logger():
    """Restore the "ccoll" logger (level and handlers) after a test that configures it."""
    log = logging.getLogger("ccoll")
    level, handlers = log.level, list(log.handlers)
    yield log
    log.setLevel(level)
    for h in list(log.handlers):
        if h not in handlers:
            log.removeHandler(h)
    from ccoll.collectives import report

    report._handler = None


def same_decision_everywhere(comm, rep: CallReport) -> None:
    every = comm.allgather(rep.decision())
    assert all(d == every[0] for d in every), every


def test_compressed_call_reports_bytes_and_bound(comm):
    x = gradient_like(comm.rank, 100_003, np.float32)
    with ccoll.Communicator(comm, policy="compress") as cc:
        assert cc.last_call is None
        cc.allreduce(x, ccoll.ABS(1e-3))
        rep = cc.last_call
        cc.allreduce(x, ccoll.ABS(1e-3), policy="raw")
        raw = cc.last_call
    assert rep.collective == "allreduce" and rep.compressed and rep.mode == "compressed"
    assert rep.reason == "policy='compress'" and rep.eb_abs == 1e-3
    assert rep.dtype == "float32" and rep.count == 100_003 and rep.bytes_input == 400_012
    assert rep.bytes_sent < rep.bytes_input
    if SIZE > 1:
        assert rep.bytes_sent < raw.bytes_sent
    assert rep.seconds > 0 and rep.predicted_raw_s is None
    assert not raw.compressed and raw.reason == "policy='raw'" and raw.eb_abs is None
    same_decision_everywhere(comm, rep)
    same_decision_everywhere(comm, raw)
    assert "allreduce float32[100003] compressed (policy='compress'); eb 0.001; sent" in str(rep)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "bcast"])
def test_exact_call_reports_raw_and_why(comm, collective):
    x = gradient_like(comm.rank, 1000, np.float64)
    with ccoll.Communicator(comm) as cc:
        getattr(cc, collective)(x, None)
        rep = cc.last_call
    assert rep.collective == collective and not rep.compressed
    assert rep.reason == "eb=None: exact" and rep.eb_abs is None
    assert "raw (eb=None: exact); exact;" in str(rep)
    same_decision_everywhere(comm, rep)


@pytest.mark.skipif(SIZE < 2, reason="one rank never consults the model")
def test_auto_report_carries_the_predicted_times(comm, link):
    link(SLOW_LINK)
    x = gradient_like(comm.rank, 1 << 20, np.float32)
    with ccoll.Communicator(comm) as cc:
        cc.allreduce(x, ccoll.REL(1e-3))
        rep = cc.last_call
    assert rep.compressed and rep.policy == "auto"
    assert rep.reason.startswith("predicted") and rep.reason.endswith("x faster compressed")
    assert 0 < rep.predicted_compressed_s < rep.predicted_raw_s
    assert rep.ratio == 20.0
    assert f"predicted raw {rep.predicted_raw_s * 1e3:.3g} ms" in str(rep)
    same_decision_everywhere(comm, rep)


@pytest.mark.skipif(SIZE < 2, reason="one rank never consults the model")
def test_auto_raw_report_says_known_raw(comm, link):
    link(FAST_LINK)
    x = gradient_like(comm.rank, 1 << 18, np.float32)
    with ccoll.Communicator(comm) as cc:
        cc.allreduce(x, ccoll.ABS(1e-3))
        first = cc.last_call
        cc.allreduce(x, ccoll.ABS(1e-3))
        second = cc.last_call
    # The model's size tests settle it (which one depends on the number of ranks).
    assert not first.compressed
    assert first.reason in ("too small to gain", "compressor slower than the link")
    assert not second.compressed and second.reason == "known raw from calibration"
    assert second.eb_abs is None
    same_decision_everywhere(comm, first)
    same_decision_everywhere(comm, second)


def test_module_functions_report_through_last_call(comm):
    assert last_call(comm) is None  # no default Communicator yet: none is made
    x = gradient_like(comm.rank, 100, np.float32)
    ccoll.allreduce(x, None, comm=comm)
    rep = last_call(comm)
    assert rep == default_communicator(comm).last_call and rep.reason == "eb=None: exact"
    ccoll.iallreduce(x, None, comm=comm).wait()
    assert last_call(comm, nonblocking=True).collective == "allreduce"


def test_iallreduce_reports_on_its_own_channel(comm):
    x = gradient_like(comm.rank, 5000, np.float32)
    with ccoll.Communicator(comm, policy="compress") as cc:
        cc.iallreduce(x, ccoll.ABS(1e-3)).wait()
        assert cc.last_call is None
        rep = cc.last_async_call
    assert rep.compressed and rep.eb_abs == 1e-3
    same_decision_everywhere(comm, rep)


def test_ccoll_log_info_logs_one_line_per_call(comm, monkeypatch, caplog, ccoll_logger):
    monkeypatch.setenv("CCOLL_LOG", "info")
    x = gradient_like(comm.rank, 1000, np.float32)
    with ccoll.Communicator(comm, policy="compress") as cc:
        cc.allreduce(x, ccoll.ABS(1e-3))
        first = str(cc.last_call)
        cc.allgather(x, None)
        cc.bcast(x, ccoll.ABS(1e-3))
        last = str(cc.last_call)
    lines = [r for r in caplog.records if r.name == "ccoll"]
    assert [r.levelno for r in lines] == [logging.INFO] * 3
    assert lines[0].getMessage() == first and lines[2].getMessage() == last


def test_no_log_lines_without_ccoll_log(comm, monkeypatch, caplog):
    monkeypatch.delenv("CCOLL_LOG", raising=False)
    assert logging.getLogger("ccoll").getEffectiveLevel() > logging.INFO
    x = gradient_like(comm.rank, 1000, np.float32)
    with ccoll.Communicator(comm, policy="compress") as cc:
        cc.allreduce(x, ccoll.ABS(1e-3))
    assert [r for r in caplog.records if r.name == "ccoll"] == []


def test_bad_ccoll_log_names_the_fix(comm, monkeypatch):
    monkeypatch.setenv("CCOLL_LOG", "loud")
    with pytest.raises(InputError, match="CCOLL_LOG='loud' is not a log level: set it to info"):
        ccoll.Communicator(comm)
