"""The model's floor of a call (``floor.floor``) and ``ccoll bench``'s floor columns."""

from __future__ import annotations

import csv
import io

import pytest

from ccoll import bench
from ccoll.collectives import floor, model
from ccoll.collectives.model import Params

MiB = 1 << 20
# Round numbers so that the expected times can be written by hand.
P = Params(alpha=1e-4, beta=1e8, compress=1e9, add=2e9, decompress=4e9, reduce=8e9,
           overhead=1e-3, chunk_overhead=1e-4)
S = 64 * MiB


def test_raw_allreduce_floor_is_the_ring_at_the_link_rate():
    f = floor.floor(S, 4, P, 1.0, algorithm="raw")
    assert f.wire == pytest.approx(6 * 1e-4 + 1.5 * S / 1e8)
    assert f.compute == pytest.approx(0.75 * S / 8e9)
    assert f.seconds == f.wire


def test_homomorphic_allreduce_floor_by_hand():
    # 2 ranks, ratio 10, reduced ratio 8: compress all, add half, decode all; send half
    # at ratio 10 and half at ratio 8.
    f = floor.floor(S, 2, P, 10.0, algorithm="homomorphic", ratio_sum=8.0)
    assert f.compute == pytest.approx(S / 1e9 + 0.5 * S / 2e9 + S / 4e9)
    assert f.wire == pytest.approx(2 * 1e-4 + 0.5 * S / 1e8 * (1 / 10 + 1 / 8))
    assert f.seconds == max(f.compute, f.wire)


def test_dar_allreduce_floor_by_hand():
    f = floor.floor(S, 2, P, 10.0, algorithm="dar")
    blk = S / 2
    assert f.compute == pytest.approx(blk / 1e9 + blk * (1 / 4e9 + 1 / 8e9 + 1 / 1e9) + S / 4e9)


@pytest.mark.parametrize("algorithm", ["homomorphic", "dar"])
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("beta", [1.25e8, 1.25e9, 1e11])
@pytest.mark.parametrize("size", [4 * MiB, 64 * MiB, 1 << 30])
def test_no_prediction_beats_the_floor(algorithm, ranks, beta, size):
    # The model's own schedule of the call can only add to the floor (overlap is partial,
    # fixed costs and chunks add), whatever the chunking.
    p = Params(alpha=5e-5, beta=beta, compress=2e9, add=3e9, decompress=5e9, reduce=8e9,
               overhead=3e-4, chunk_overhead=5e-5)
    f = floor.floor(size, ranks, p, 12.0, algorithm=algorithm)
    raw = floor.floor(size, ranks, p, 12.0, algorithm="raw")
    for k in (1, 4, 64):
        pred = model.predict(size, ranks, p, 12.0, chunks=k)
        assert getattr(pred, algorithm) >= f.seconds * (1 - 1e-12)
        assert pred.raw >= raw.seconds * (1 - 1e-12)


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "bcast"])
def test_other_collectives_floor_below_their_prediction(collective):
    for alg, attr in (("raw", "raw"), ("homomorphic", "homomorphic")):
        f = floor.floor(S, 4, P, 10.0, algorithm=alg, collective=collective)
        pred = model.predict(S, 4, P, 10.0, collective=collective, chunks=1)
        assert 0 < f.seconds <= getattr(pred, attr)


def test_one_rank_has_no_floor():
    assert floor.floor(S, 1, P, 10.0, algorithm="homomorphic").seconds == 0.0


@pytest.mark.parametrize(("kw", "what"), [({"algorithm": "ring"}, "algorithm"),
                                          ({"collective": "gather"}, "collective")])
def test_floor_rejects_unknown_names(kw, what):
    with pytest.raises(ValueError, match=what):
        floor.floor(S, 2, P, 10.0, **kw)


def _row(alg: str, avg: float, floor: float | None) -> bench.Row:
    return bench.Row("allreduce", S, S // 4, alg, 5, avg, avg, avg, 1.0, 1.0, None, None, None,
                     floor_us=floor, of_floor=None if floor is None else avg / floor)


def test_bench_table_shows_floor_and_of_floor():
    text = bench._format_rows([_row("mpi", 80_000.0, 60_000.0), _row("auto", 90.0, None)],
                              header=True)
    head, mpi, auto = text.splitlines()
    assert head.split()[-2:] == ["floor(us)", "of-floor"]
    assert mpi.split()[-2:] == ["60000.0", "1.33"]
    assert auto.split()[-2:] == ["-", "-"]


def test_bench_csv_has_floor_columns():
    rows = list(csv.DictReader(io.StringIO(bench.to_csv([_row("mpi", 80_000.0, 60_000.0)]))))
    assert float(rows[0]["floor_us"]) == 60_000.0
    assert float(rows[0]["of_floor"]) == pytest.approx(4 / 3)
