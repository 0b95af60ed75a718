"""bench/project_scaleout.py: its numbers are the cost model's, and where docs/model.md
("Projection to many nodes") says the projected speedup does not fall, it does not."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ccoll.collectives import model, ratios

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("project_scaleout",
                                               REPO / "bench" / "project_scaleout.py")
assert _spec is not None and _spec.loader is not None
ps = importlib.util.module_from_spec(_spec)
sys.modules["project_scaleout"] = ps  # its dataclasses look their module up
_spec.loader.exec_module(ps)

# docs/model.md claims a non-decreasing speedup (policy="auto"'s) from 2 up to this many
# nodes in every series, and up to 512 in all but this one, which falls by under 1.5% past
# its best.
MONOTONE_UP_TO = 16
FALLING = {("64 MiB", 400, "gpu")}


@pytest.fixture(scope="module")
def ratio() -> float:
    rows = json.loads((REPO / "docs" / "bench" / "scaleout.json").read_text())
    return ps.calibrate_ratio(rows)[0]


def test_calibrated_ratio_reproduces_the_measured_wire_ratio(ratio: float) -> None:
    rows = json.loads((REPO / "docs" / "bench" / "scaleout.json").read_text())
    last = max(rows, key=lambda r: r["ranks"])
    assert ps.wire_ratio(ratio, last["ranks"], last["auto_share"]) == pytest.approx(
        last["avg_auto_ratio"], rel=1e-12)


def test_one_point_equals_the_model_functions(ratio: float) -> None:
    k, r, size = 64, 8, 1 << 30
    pt = ps.project(ratio, k, 100, "gpu", "1 GiB", schedules=("ring",))
    share = ratios.split_fraction(k)
    assert share == 0.5
    # Words per block by the split, written out from docs/model.md "Split bound".
    w, g = ratios.DEFAULT_WIDTH, ratios.SUM_GROWTH
    # The allgather's grid is 63 times the sum's (ratios.split_multiple): e1 = eb 64/126.
    assert ratios.split_multiple(k, share) == k - 1
    finer = math.log2(2 * (k - 1) / k)  # log2(eb / e1)
    rs_words = sum(1 + w + g * math.log2(j) + finer for j in range(1, k))
    ag_words = (k - 1) * (1 + max(0.0, w + (g - 1) * math.log2(k) + 1))
    assert pt.ratio_rs == pytest.approx(ratio * (1 + w) * (k - 1) / rs_words, rel=1e-9)
    assert pt.ratio_ag == pytest.approx(ratio * (1 + w) * (k - 1) / ag_words, rel=1e-9)
    p = replace(model.DEFAULTS, alpha=5e-6, beta=100e9 / 8, compress=300e9, add=500e9,
                decompress=500e9, reduce=1000e9)
    want = model.predict_hierarchical(size, k, r, p, pt.ratio_rs, ratio_sum=pt.ratio_ag)
    assert (pt.mpi_s, pt.ccoll_s, pt.chunks) == (want.raw, want.homomorphic, want.chunks)
    # MPI's time is the two-level raw formula, term by term.
    intra = 2 * (r - 1) / r * size / model.SHM_BANDWIDTH + (r - 1) / r * size / 1000e9
    ring = 2 * (k - 1) * 5e-6 + 2 * (k - 1) / k * (size / r) / (100e9 / 8 / r)
    ring += (k - 1) / k * (size / r) / 1000e9
    assert pt.mpi_s == pytest.approx(intra + ring, rel=1e-12)


def test_halving_point_equals_the_model_functions(ratio: float) -> None:
    # Past HALVING_MIN_RANKS nodes both sides may halve: ccoll's time is then the node
    # phases plus predict_halving on the share, MPI's the node phases plus Rabenseifner's.
    k, r, size = 512, 8, 64 << 20
    pt = ps.project(ratio, k, 25, "gpu", "64 MiB")
    assert (pt.schedule, pt.mpi_schedule) == ("halving", "halving")
    share = ratios.split_fraction(k)
    p = replace(model.DEFAULTS, alpha=5e-6, beta=25e9 / 8, compress=300e9, add=500e9,
                decompress=500e9, reduce=1000e9, chunk_overhead=10e-6)
    pi = replace(p, beta=p.beta / r)
    intra = model.predict_node_phases(size, r, p)
    pieces = model.best_halving_pieces(size / r, k, pi, ratio, share=share)
    assert pt.ccoll_s == pytest.approx(
        intra + model.predict_halving(size / r, k, pi, ratio, share=share, pieces=pieces),
        rel=1e-12)
    assert pt.mpi_s == pytest.approx(intra + model.predict_raw_halving(size / r, k, pi),
                                     rel=1e-12)
    ring = ps.project(ratio, k, 25, "gpu", "64 MiB", schedules=("ring",))
    assert pt.ccoll_s < ring.ccoll_s and pt.mpi_s < ring.mpi_s


def test_speedup_does_not_fall_where_the_doc_says(ratio: float) -> None:
    points = ps.project_all(ratio)
    series: dict[tuple[str, int, str], list[float]] = {}
    for pt in points:
        if pt.nodes <= MONOTONE_UP_TO:
            series.setdefault((pt.size, pt.link_gbit, pt.compressor), []).append(
                pt.auto_speedup)
    assert len(series) == len(ps.SIZES) * len(ps.LINKS_GBIT) * len(ps.COMPRESSORS)
    for key, sp in series.items():
        assert len(sp) == 4 and all(b >= a for a, b in zip(sp, sp[1:], strict=False)), (key, sp)
    falls = {k for k, ok in ps.monotone(points).items() if not ok}
    assert falls == FALLING
    for key in FALLING:
        sp = [pt.speedup for pt in points if (pt.size, pt.link_gbit, pt.compressor) == key]
        assert sp[-1] >= 0.985 * max(sp), (key, sp)
    doc = " ".join((REPO / "docs" / "model.md").read_text().split())
    assert f"from 2 to {MONOTONE_UP_TO} nodes in any of the twelve series" in doc
    assert "from 2 to 512 nodes in eleven of them" in doc


def test_gpu_rows_follow_from_the_stated_assumptions(ratio: float) -> None:
    # docs/model.md "Projection on GPUs against NCCL's ring", 128 GPUs (16 nodes) at
    # 100 Gbit/s, with the constants that section states.
    n, k, size, beta = 128, 16, 64 << 20, 100e9 / 8
    pt = ps.project_gpu(ratio, n, 100)
    # NCCL's ring by hand: 2(K-1) steps between nodes at 5 us, 2(N-K) over NVLink at
    # 3.4 us, every byte twice across the node's whole link.
    assert pt.nccl_s == pytest.approx(2 * 15 * 5e-6 + 2 * 112 * 3.4e-6
                                      + 2 * 127 / 128 * size / beta, rel=1e-12)
    # On one node NCCL's ring runs at NVLink's 235 GB/s.
    one = ps.project_gpu(ratio, 8, 100)
    assert one.nodes == 1 and one.nccl_s == pytest.approx(
        2 * 7 * 3.4e-6 + 2 * 7 / 8 * size / 235e9, rel=1e-12)
    # Format 2 sends every message 1.44x smaller than format 1 ...
    assert pt.v2_ratio_rs == pytest.approx(1.44 * pt.v1_ratio_rs, rel=1e-12)
    assert pt.v2_ratio_ag == pytest.approx(1.44 * pt.v1_ratio_ag, rel=1e-12)
    # ... with the cuSZp-class GPU rates scaled by the CPU's measured format-2 / format-1
    # rates, the node phases over NVLink, on the ring: the two-level model's time.
    p2 = replace(model.DEFAULTS, alpha=5e-6, beta=beta, reduce=1000e9, shm=235e9,
                 chunk_overhead=10e-6, compress=300e9 * 2.52 / 2.84,
                 add=500e9 * 1.70 / 3.04, decompress=500e9 * 6.56 / 7.80)
    want = model.predict_hierarchical(size, k, 8, p2, pt.v2_ratio_rs,
                                      ratio_sum=pt.v2_ratio_ag)
    assert pt.v2_s == pytest.approx(want.homomorphic, rel=1e-9)
    assert pt.speedup_v2 == pytest.approx(pt.nccl_s / want.homomorphic, rel=1e-9)
    # The tables of docs/model.md are the script's, row by row.
    doc = (REPO / "docs" / "model.md").read_text()
    rows = [line for line in ps.gpu_table(ps.project_gpu_all(ratio)).splitlines()
            if line[:3] in ("| 8", "| 1", "| 5", "| 6")]
    assert len(rows) == 10
    missing = [row for row in rows if row not in doc]
    assert not missing, missing

def test_monotone_flags_a_fall() -> None:
    pts = [ps.Point("x", k, 25, "cpu", 0.0, 1.0, 1.0, 1, mpi, 1.0)
           for k, mpi in ((2, 2.0), (4, 3.0), (8, 2.5))]
    assert [pt.auto_speedup for pt in pts] == [2.0, 3.0, 2.5]
    assert ps.monotone(pts) == {("x", 25, "cpu"): False}


def test_outputs(tmp_path: Path) -> None:
    md, js, png = tmp_path / "p.md", tmp_path / "p.json", tmp_path / "p.png"
    assert ps.main(["--md", str(md), "--json", str(js), "--png", str(png)]) == 0
    doc = json.loads(js.read_text())
    assert len(doc["points"]) == 9 * 3 * 2 * 2
    assert "| 512 |" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
