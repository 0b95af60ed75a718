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


def raw_ring_bytes(collective: str, n: int, nbytes: int) -> int:
    """Bytes one rank would send for the call raw: a ring's (bcast: the whole message).

    A compressed call's ``ratio`` is this over the bytes it sent (CallReport's docstring).
    """
    if n < 2:
        return 0
    return {"allreduce": 2 * (n - 1) * nbytes // n, "reduce_scatter": (n - 1) * nbytes // n,
            "allgather": (n - 1) * nbytes, "bcast": nbytes}[collective]


def measured_ratio(rep: CallReport) -> float | None:
    if not rep.compressed or rep.bytes_sent == 0:
        return None
    return raw_ring_bytes(rep.collective, SIZE, rep.bytes_input) / rep.bytes_sent


def test_compressed_call_reports_bytes_and_bound(comm):
    x = gradient_like(comm.rank, 100_003, np.float32)
    with ccoll.Communicator(comm, policy="compress") as cc:
        assert cc.last_call is None
        cc.allreduce(x, ccoll.ABS(1e-3))
        rep = cc.last_call
        cc.allreduce(x, ccoll.ABS(1e-3), policy="raw")
        raw = cc.last_call
    assert rep.collective == "allreduce" and rep.compressed and rep.mode == "compressed"
    assert rep.reason == 'policy="compress"' and rep.eb_abs == 1e-3
    assert rep.dtype == "float32" and rep.count == 100_003 and rep.bytes_input == 400_012
    assert rep.bytes_sent < rep.bytes_input
    assert rep.path == "flat" and not rep.trial and not rep.hierarchical
    # A fixed policy measures nothing: format 1 unless format_version says otherwise.
    assert rep.format_version == 1 and rep.format_reason == "format 2's rates not measured"
    assert not rep.overlapped  # a compressed call always takes the agreement
    assert rep.seconds > 0 and rep.predicted_raw_s is None and rep.predicted_compressed_s is None
    assert not raw.compressed and raw.reason == 'policy="raw"' and raw.eb_abs is None
    assert raw.path == "raw" and not raw.trial and raw.ratio is None
    if SIZE > 1:
        assert rep.bytes_sent < raw.bytes_sent
        # The measured ratio: what the raw ring would have sent over what this rank sent,
        # which is what the raw call of the same array did send.
        assert rep.ratio == raw_ring_bytes("allreduce", SIZE, 400_012) / rep.bytes_sent
        assert raw.bytes_sent == raw_ring_bytes("allreduce", SIZE, 400_012)
        assert rep.ratio == raw.bytes_sent / rep.bytes_sent and rep.ratio > 1
        assert (f"; format 1 (format 2's rates not measured), ratio {rep.ratio:.3g}); "
                "eb 0.001; sent") in str(rep)
    else:
        # Nothing sent: the ratio of the streams this rank holds (main's ad12a08)
        assert rep.bytes_sent == 0 and rep.ratio is not None and rep.ratio > 1
    same_decision_everywhere(comm, rep)
    same_decision_everywhere(comm, raw)
    assert str(rep).startswith('allreduce float32[100003] compressed (policy="compress"')
    assert "); eb 0.001; sent" in str(rep)
    assert str(raw).startswith('allreduce float32[100003] raw (policy="raw"); MPI\'s result; sent')


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "bcast"])
def test_every_compressed_collective_reports_its_measured_ratio(comm, collective):
    x = gradient_like(comm.rank, 20_011, np.float64)
    with ccoll.Communicator(comm, policy="compress") as cc:
        getattr(cc, collective)(x, ccoll.ABS(1e-4))
        rep = cc.last_call
    assert rep.compressed and rep.collective == collective and rep.path == "flat"
    assert rep.bytes_input == 20_011 * 8
    if rep.bytes_sent:
        assert rep.ratio == measured_ratio(rep)
        if SIZE > 1:
            assert rep.ratio > 1
    else:  # a rank that sent nothing: the ratio of the streams it holds (ad12a08)
        assert rep.ratio is not None and rep.ratio > 1
    same_decision_everywhere(comm, rep)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "bcast"])
def test_exact_call_reports_raw_and_why(comm, collective):
    x = gradient_like(comm.rank, 1000, np.float64)
    with ccoll.Communicator(comm) as cc:
        getattr(cc, collective)(x, None)
        rep = cc.last_call
    assert rep.collective == collective and not rep.compressed
    assert rep.reason == "eb=None: exact" and rep.eb_abs is None
    assert rep.path == "raw" and not rep.trial and rep.ratio is None
    assert "raw (eb=None: exact); MPI's result;" in str(rep)
    same_decision_everywhere(comm, rep)


@pytest.mark.skipif(SIZE < 2, reason="one rank never consults the model")
def test_auto_report_carries_the_predicted_times(comm, link):
    link(SLOW_LINK)
    x = gradient_like(comm.rank, 1 << 20, np.float32)
    with ccoll.Communicator(comm) as cc:
        cc.allreduce(x, ccoll.REL(1e-3))
        rep = cc.last_call
        plan = cc._last_plan()
    assert rep.compressed and rep.policy == "auto" and rep.path == "flat" and not rep.trial
    assert rep.reason == (f"predicted {rep.predicted_raw_s / rep.predicted_compressed_s:.2f}x "
                          "faster compressed")
    assert 0 < rep.predicted_compressed_s < rep.predicted_raw_s
    # The model priced the call at CCOLL_RATIO; the report gives the ratio measured.
    assert plan.ratio == 20.0
    assert rep.ratio == measured_ratio(rep) and rep.ratio > 1
    assert f"predicted raw {rep.predicted_raw_s * 1e3:.3g} ms" in str(rep)
    same_decision_everywhere(comm, rep)


@pytest.mark.skipif(SIZE < 2, reason="one rank never consults the model")
def test_auto_raw_report_says_too_small_to_gain(comm, link):
    link(FAST_LINK)
    x = gradient_like(comm.rank, 1 << 18, np.float32)
    with ccoll.Communicator(comm) as cc:
        cc.allreduce(x, ccoll.ABS(1e-3))
        first = cc.last_call
        cc.allreduce(x, ccoll.ABS(1e-3))
        second = cc.last_call
    # No ratio would make compressing pay on this link: raw whatever the data, and its
    # repeat runs without the agreement.
    assert not first.compressed and first.reason == "too small to gain"
    assert first.path == "raw" and not first.trial and first.ratio is None
    assert first.eb_abs is None and not first.overlapped
    assert first.predicted_raw_s is not None and first.predicted_compressed_s is None
    assert not second.compressed and second.overlapped
    assert second.reason == "too small to gain; repeated: ran without the agreement"
    assert second.eb_abs is None
    same_decision_everywhere(comm, first)
    same_decision_everywhere(comm, second)


def test_auto_reasons_that_need_no_model(comm, link):
    link(SLOW_LINK)  # a link where compressing 4 MiB pays
    x = gradient_like(comm.rank, 1 << 20, np.float32)
    with ccoll.Communicator(comm) as cc:
        cc.allreduce(x[:0], ccoll.REL(1e-3))
        empty = cc.last_call
        cc.allreduce(np.full(1 << 20, 0.25, np.float32), ccoll.REL(1e-3))
        lossless = cc.last_call
    if SIZE == 1:
        assert empty.reason == lossless.reason == "one rank"
    else:
        assert empty.reason == "empty"
        # REL of data without a range: the bound is 0, nothing to gain by compressing.
        assert lossless.reason == "lossless bound: nothing to gain"
    for rep in (empty, lossless):
        assert not rep.compressed and rep.path == "raw" and not rep.trial
        assert rep.eb_abs is None
        same_decision_everywhere(comm, rep)


@pytest.mark.skipif(SIZE < 2, reason="one rank never consults the model")
def test_trial_and_measured_reasons(comm, link, monkeypatch):
    # CCOLL_RATIO=1.05 on a slow link: compressing is predicted slower by the margin, and
    # raw runs. Its measured time is set to the model's raw prediction (the same on every
    # rank), within twice the compressed path's prediction: the compressed path gets a
    # trial (two: its first run is never measured), then its own measured time, faster
    # than the raw one's here by far, decides.
    from ccoll.collectives.policy.plan import Planner

    link({**SLOW_LINK, "CCOLL_RATIO": "1.05"})
    x = gradient_like(comm.rank, 1 << 20, np.float32)
    reports = []
    with ccoll.Communicator(comm) as cc:
        cc.allreduce(x, ccoll.REL(1e-3))
        reports.append(cc.last_call)
        raw_s = reports[0].predicted_raw_s
        real_end = Planner.end

        def end(self, st, plan, seconds):
            real_end(self, st, plan, raw_s if plan.variant == "raw" else seconds)

        monkeypatch.setattr(Planner, "end", end)
        for _ in range(4):
            cc.allreduce(x, ccoll.REL(1e-3))
            reports.append(cc.last_call)
    for rep in reports:
        same_decision_everywhere(comm, rep)
    first, second, trial1, trial2, measured = reports
    assert first.reason == second.reason == "predicted slower compressed", first
    assert not first.compressed and not second.compressed and not first.trial
    for t in (trial1, trial2):
        assert t.compressed and t.trial and t.path == "flat", t
        assert t.reason.startswith("trial of compressed (predicted "), t.reason
        assert f"measured raw {raw_s * 1e3:.3g} ms)" in t.reason, t.reason
        assert t.ratio == measured_ratio(t)
    assert measured.compressed and not measured.trial and measured.path == "flat"
    assert measured.reason.startswith("measured faster: compressed "), measured.reason
    assert measured.reason.endswith(f", raw {raw_s * 1e3:.3g} ms"), measured.reason


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
