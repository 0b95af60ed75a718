"""Cost model arithmetic (ccoll.collectives.model), the auto policy's pure decision and the
`ccoll model` command (ccoll.cli_model). Unit parsing is in tests/test_units.py."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from ccoll import cli_model
from ccoll.collectives import floor, model, ratios
from ccoll.collectives.model import Params
from ccoll.errors import InputError

MiB = 1 << 20
# Round numbers so that the expected times can be written by hand.
P = Params(alpha=1e-4, beta=1e8, compress=1e9, add=2e9, decompress=4e9, reduce=8e9,
           overhead=1e-3, chunk_overhead=1e-4)


@pytest.mark.parametrize("x", [1.0, 2.0, 3.0, 0.75, 1e-9, 7.0, 1234.5, 2.0**40 + 1, 1.5])
def test_log2_matches_libm(x: float) -> None:
    assert ratios.log2(x) == pytest.approx(math.log2(x), abs=1e-13)


@pytest.mark.parametrize("e", [-3, 0, 1, 2, 10, 52])
def test_log2_exact_at_powers_of_two(e: int) -> None:
    assert ratios.log2(2.0**e) == e


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_log2_rejects_non_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="x > 0"):
        ratios.log2(bad)


def test_raw_ring_formula() -> None:
    # N = 4, S = 4 MB: 2*3*alpha + 2*3/4*S/beta + 3/4*S/reduce
    t = model.predict_raw(4e6, 4, P)
    assert t == pytest.approx(6e-4 + 0.06 + 3.75e-4)
    assert model.predict_raw(4e6, 1, P) == 0.0


def test_homomorphic_one_chunk_is_the_sum_of_its_parts() -> None:
    s, n, r, rs = 4e6, 2, 10.0, 8.0
    compute = s / 1e9 + 0.5 * s / 2e9  # compress all, add half
    wire = 1e-4 + 0.5 * s / (r * 1e8)
    gather = max(1e-4 + 0.5 * s / (rs * 1e8), 0.5 * s / 4e9) + 0.5 * s / 4e9
    expect = 1e-3 + compute + wire + gather  # the fixed cost includes the first chunk
    got = model.predict_homomorphic(s, n, P, r, ratio_sum=rs, chunks=1)
    assert got == pytest.approx(expect)


def test_chunks_overlap_compute_and_network() -> None:
    s, n, r = 64 * MiB, 2, 10.0
    p = replace(P, alpha=0.0, chunk_overhead=0.0)
    t1 = model.predict_homomorphic(s, n, p, r, ratio_sum=r, chunks=1)
    t64 = model.predict_homomorphic(s, n, p, r, ratio_sum=r, chunks=64)
    compute = s / 1e9 + 0.5 * s / 2e9
    wire = 0.5 * s / (r * 1e8)
    # With many chunks the reduce-scatter phase tends to the longer of the two resources.
    assert t1 - t64 == pytest.approx(min(compute, wire) * (1 - 1 / 64))


def test_best_chunks_is_the_minimum_over_powers_of_two() -> None:
    s, n, r = 64 * MiB, 4, 12.0
    k = model.best_chunks(s, n, P, r)
    times = {c: model.predict_homomorphic(s, n, P, r, chunks=c) for c in (1, 2, 4, 8, 16, 32, 64)
             if c == 1 or s / n / c >= model.MIN_CHUNK_BYTES}
    assert k in times and times[k] == min(times.values())


def test_ratio_of_sum_widens_codes() -> None:
    assert ratios.ratio_of_sum(10.0, 1, 3.0) == 10.0
    # 4 terms, growth 1/2: +1 bit on 1 + 3 words -> 10 * 4 / 5
    assert ratios.ratio_of_sum(10.0, 4, 3.0) == pytest.approx(8.0)
    assert ratios.ratio_of_sum(10.0, 8, 3.0) < ratios.ratio_of_sum(10.0, 4, 3.0)
    assert ratios.ratio_at_finer_bound(10.0, 2.0, 3.0) == pytest.approx(8.0)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_dar_trades_the_compressed_add_for_decompress_and_add(n: int) -> None:
    # Both compress every byte once; DAR decompresses and adds raw where the homomorphic
    # ring adds streams. With the network out of the way that is the whole difference.
    p = replace(P, beta=1e15)
    s = 64 * MiB
    pr = model.predict(s, n, p, 10.0, chunks=1)
    diff = (n - 1) / n * s * (1 / p.decompress + 1 / p.reduce - 1 / p.add)
    assert pr.dar - pr.homomorphic == pytest.approx(diff, rel=1e-6)


def test_dar_sends_more_bytes_than_homomorphic() -> None:
    # Its finer per-step bound widens the codes: on a slow link DAR is slower.
    p = replace(P, beta=1e6, compress=1e15, add=1e15, decompress=1e15, reduce=1e15)
    for n in (2, 3, 4, 8):
        pr = model.predict(64 * MiB, n, p, 10.0, chunks=1)
        assert pr.dar > pr.homomorphic, n


@pytest.mark.parametrize("collective", model.COLLECTIVES)
def test_one_rank_costs_nothing_to_move(collective: str) -> None:
    pr = model.predict(MiB, 1, P, 10.0, collective=collective)
    assert pr.raw == 0.0 and pr.choice == "raw"


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "bcast"])
def test_other_collectives_pay_on_slow_links_only(collective: str) -> None:
    slow = model.predict(64 * MiB, 4, replace(P, beta=1e7), 16.0, collective=collective)
    fast = model.predict(64 * MiB, 4, replace(P, beta=1e11), 16.0, collective=collective)
    assert slow.homomorphic < slow.raw
    assert fast.homomorphic > fast.raw


def test_break_even_size_is_where_the_times_cross() -> None:
    s = floor.break_even_size(4, P, 16.0)
    assert s is not None
    below = model.predict(s * 0.98, 4, P, 16.0)
    above = model.predict(s * 1.02, 4, P, 16.0)
    assert below.choice == "raw" and above.choice == "homomorphic"


def test_break_even_bandwidth_is_where_the_times_cross() -> None:
    b = floor.break_even_bandwidth(64 * MiB, 2, P, 16.0)
    assert b is not None
    assert model.predict(64 * MiB, 2, replace(P, beta=b * 0.98), 16.0).choice == "homomorphic"
    assert model.predict(64 * MiB, 2, replace(P, beta=b * 1.02), 16.0).choice == "raw"


def test_break_even_bandwidth_large_message_closed_form() -> None:
    # Without latencies and fixed costs, and with one chunk, compression pays exactly when
    # the bytes it saves take longer than the compressor's work (docs/model.md).
    p = replace(P, alpha=0.0, overhead=0.0, chunk_overhead=0.0, decompress=1e12)
    n, r, rs = 2, 16.0, 12.0
    per_byte = 1 / p.compress + (n - 1) / n * (1 / p.add - 1 / p.reduce + 1 / p.decompress)
    closed = (n - 1) / n * (2 - 1 / r - 1 / rs) / per_byte
    pr = model.predict(64 * MiB, n, replace(p, beta=closed), r, ratio_sum=rs, chunks=1)
    assert pr.homomorphic == pytest.approx(pr.raw, rel=1e-9)


def test_no_break_even_when_the_compressor_is_too_slow() -> None:
    p = replace(P, compress=1e6, beta=1e10)
    assert floor.break_even_size(2, p, 16.0) is None


@pytest.mark.parametrize("name", ["alpha", "beta", "compress"])
def test_params_reject_nonsense(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        replace(P, **{name: -1.0})


# -- the first plan of a signature, from agreed numbers ---------------------------------


def choose(count: int, itemsize: int, ranks: int, p: model.Params, ratio: float,
           width: float) -> object:
    from kit import first_plan

    return first_plan(count, itemsize, ranks, p, ratio, width)


def test_tiny_message_goes_raw() -> None:
    d = choose(1, 4, 4, P, 1e6, 3.0)
    assert not d.compress


def test_huge_message_on_slow_link_with_good_ratio_compresses() -> None:
    d = choose(64 * MiB // 4, 4, 4, replace(P, beta=1.25e8), 16.0, 3.0)
    assert d.compress
    assert d.predicted is not None and d.predicted_raw / d.predicted > 3
    assert 1 <= d.chunk_elems <= 64 * MiB // 4 // 4


def test_incompressible_data_goes_raw() -> None:
    d = choose(64 * MiB // 4, 4, 4, replace(P, beta=1.25e8), 1.0, 31.0)
    assert not d.compress


def test_fast_link_goes_raw() -> None:
    d = choose(64 * MiB // 4, 4, 2, replace(P, beta=1e11), 16.0, 3.0)
    assert not d.compress


def test_one_rank_never_compresses() -> None:
    assert not choose(64 * MiB // 4, 4, 1, replace(P, beta=1e6), 100.0, 3.0).compress


# -- `ccoll model` --------------------------------------------------------------------


def _model_cmd(*argv: str) -> tuple[dict, str, int]:
    ap = argparse.ArgumentParser()
    cli_model.add_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["model", *argv])
    return args.handler(args)


def test_model_command_prints_times_and_break_even() -> None:
    doc, text, code = _model_cmd("--defaults", "--ranks", "2", "--bandwidth", "1Gbit",
                                 "--size", "64M", "--ratio", "16", "--compress-gbps", "2",
                                 "--add-gbps", "4", "--decompress-gbps", "4")
    assert code == 0
    assert "raw ring allreduce" in text and "break-even size" in text
    assert doc["choice"] == "homomorphic" and doc["speedup"] > 1
    assert doc["raw_s"] == pytest.approx(model.predict_raw(64 * MiB, 2, replace(
        model.DEFAULTS, beta=1.25e8, compress=2e9, add=4e9, decompress=4e9)))
    json.dumps(doc)


@pytest.mark.parametrize("option, value, why", [
    ("--ratio", "nan", "finite number > 0"), ("--ratio", "inf", "finite number > 0"),
    ("--ratio", "0", "finite number > 0"), ("--ratio-sum", "nan", "finite number > 0"),
    ("--width", "nan", ">= 0 and <= 64"), ("--width", "65", ">= 0 and <= 64"),
    ("--compress-gbps", "nan", "finite number > 0"), ("--add-gbps", "-1", "finite number > 0"),
    ("--ratio", "x", "'x' is not a number"),
])
def test_model_command_refuses_numbers_it_cannot_model(capsys, option, value, why) -> None:
    # NaN slipped past `ratio <= 0` and printed "nan s (speedup nanx)" with exit code 0.
    with pytest.raises(SystemExit) as info:
        _model_cmd("--defaults", option, value)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and why in err, err


def test_model_command_fast_link_says_raw() -> None:
    doc, text, _ = _model_cmd("--ranks", "4", "--bandwidth", "400Gbit", "--latency", "5us")
    assert doc["choice"] == "raw"
    assert doc["break_even_bandwidth_bps"] is not None and doc["break_even_bandwidth_bps"] < 4e11


def test_raw_efficiency_scales_only_the_raw_bandwidth_term() -> None:
    half = replace(P, raw_efficiency=0.5)
    s, n = 4e6, 4
    assert model.predict_raw(s, n, half) - model.predict_raw(s, n, P) == pytest.approx(
        2 * (n - 1) / n * s / P.beta)
    pr, ph = model.predict(s, n, P, 10.0, chunks=1), model.predict(s, n, half, 10.0, chunks=1)
    assert ph.homomorphic == pr.homomorphic  # the compressed ring's own messages are unaffected


def test_model_command_reads_gigabytes_as_bytes() -> None:
    doc, text, _ = _model_cmd("--bandwidth", "10GB/s")
    assert doc["params"]["beta"] == 1e10 and "link 80 Gbit/s" in text
    doc, text, _ = _model_cmd("--bandwidth", "10Gbit")
    assert doc["params"]["beta"] == 1.25e9 and "link 10 Gbit/s" in text


def test_model_command_one_rank_is_a_copy() -> None:
    doc, text, code = _model_cmd("--ranks", "1")
    assert code == 0
    assert doc["choice"] == "raw" and doc["raw_s"] == doc["homomorphic_s"] == doc["dar_s"] == 0
    assert doc["speedup"] is None and doc["break_even_size"] is None
    assert doc["break_even_bandwidth_bps"] is None
    assert "one rank: an allreduce is a local copy" in text and "choice: raw" in text
    json.dumps(doc, allow_nan=False)


def test_model_command_cached_starts_from_the_cache(monkeypatch) -> None:
    cached = replace(model.DEFAULTS, alpha=7e-6, beta=3e9)
    fake = types.ModuleType("ccoll.collectives.policy.cache")
    fake.newest_cached_params = lambda folder=None: cached  # type: ignore[attr-defined]
    fake.cache_file = lambda folder=None: Path("/nonexistent/links.json")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ccoll.collectives.policy.cache", fake)
    doc, text, _ = _model_cmd("--cached", "--latency", "9us")
    assert doc["params"]["beta"] == 3e9 and doc["params"]["alpha"] == pytest.approx(9e-6)
    assert doc["source"] == "cache" and "constants from the calibration cache" in text
    # That entry has no compressor rates of its own: the header said they came from the
    # cache too.
    assert text.splitlines()[0].endswith(
        "the calibration cache (link) and the defaults (compressor)")
    cached = replace(cached, compress=5e9)
    _, text, _ = _model_cmd("--cached")
    assert text.splitlines()[0].endswith("constants from the calibration cache")
    # Without --cached the cache is still where the constants start from, if it has some.
    doc, _, _ = _model_cmd()
    assert doc["params"]["beta"] == 3e9 and doc["source"] == "cache"
    # --defaults ignores it.
    doc, text, _ = _model_cmd("--defaults")
    assert doc["params"]["beta"] == model.DEFAULTS.beta and doc["source"] == "defaults"
    assert "constants from the defaults" in text
    fake.newest_cached_params = lambda folder=None: None  # type: ignore[attr-defined]
    with pytest.raises(InputError, match="no calibration in the cache"):
        _model_cmd("--cached")
    doc, _, _ = _model_cmd()  # none cached: the defaults
    assert doc["source"] == "defaults"



def test_damaged_cache_entries_are_skipped(tmp_path) -> None:
    # An entry that is not an object raised AttributeError in every policy="auto"
    # Communicator and in `ccoll model`; a beta of -5 or a string alpha raised the model's
    # ValueError with a traceback. Such entries count as none; a good older one is used.
    import time

    from ccoll.collectives.policy.cache import _read_cache, newest_cached_params

    now = time.time()
    good = {"alpha": 3e-6, "beta": 2e9, "reduce": 5e9, "raw_efficiency": 1.0, "time": now - 60}
    doc = {"a": "hello", "b": [1, 2], "c": {**good, "beta": -5.0, "time": now},
           "d": {**good, "alpha": "x", "time": now}, "e": {**good, "time": "soon"},
           "f": {**good, "compressor": "fast", "time": now}, "g": good,
           # JSON's true was read as 1.0: an alpha of 1 s, a whole plan made on it
           "h": {**good, "alpha": True, "time": now}}
    (tmp_path / "links.json").write_text(json.dumps(doc))
    assert set(_read_cache(str(tmp_path))) == {"c", "d", "e", "f", "g", "h"}
    p = newest_cached_params(str(tmp_path))
    assert p is not None and p.beta == 2e9 and p.alpha == 3e-6
    (tmp_path / "links.json").write_text(json.dumps({"a": "hello", "c": doc["c"]}))
    assert newest_cached_params(str(tmp_path)) is None


def test_cache_files_no_rank_0_can_read_count_as_none(tmp_path) -> None:
    # Only rank 0 reads the cache: a RecursionError from JSON nested 200,000 deep, or an
    # open() waiting for a FIFO's writer, stopped rank 0 while the others waited for it.
    from ccoll.collectives.policy.cache import _read_cache, newest_cached_params

    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "links.json").write_text("[" * 200_000 + "]" * 200_000)
    assert _read_cache(str(deep)) == {} and newest_cached_params(str(deep)) is None
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "links.json")
    assert _read_cache(str(fifo)) == {}  # at once: no writer is waited for
    big = tmp_path / "big"
    big.mkdir()
    (big / "links.json").write_text(" " * (5 << 20) + "{}")
    assert _read_cache(str(big)) == {}


def test_writing_a_full_cache_with_damaged_times_keeps_the_newest(tmp_path) -> None:
    # Past 64 entries the write sorts them by time: a null, a string or a 400-digit time
    # raised TypeError/OverflowError on rank 0 (the others waited for it).
    import time

    from ccoll.collectives.policy.cache import _MAX_ENTRIES, _read_cache, _write_cache

    now = time.time()
    entry = {"alpha": 3e-6, "beta": 2e9, "reduce": 5e9, "raw_efficiency": 1.0}
    doc = {f"k{i:03d}": {**entry, "time": now - 1000 + i} for i in range(70)}
    doc["k000"]["time"] = None
    doc["k001"]["time"] = "yesterday"
    doc["k002"]["time"] = 10**400
    doc["k003"]["time"] = float("nan")
    (tmp_path / "links.json").write_text(json.dumps(doc))
    _write_cache("new", {**entry, "time": now}, str(tmp_path))
    kept = _read_cache(str(tmp_path))
    assert len(kept) == _MAX_ENTRIES and "new" in kept
    assert not {"k000", "k001", "k002", "k003"} & set(kept)  # the damaged ones go first


# -- recursive halving and doubling (model.predict_halving, docs/model.md) ------------------


@pytest.mark.parametrize("n, shape", [(1, (0, 0)), (2, (1, 0)), (3, (1, 1)), (4, (2, 0)),
                                      (5, (2, 1)), (8, (3, 0)), (12, (3, 4)), (512, (9, 0))])
def test_halving_shape(n: int, shape: tuple[int, int]) -> None:
    assert model.halving_shape(n) == shape


def test_halving_power_of_two_term_by_term() -> None:
    n, size, ratio, w, g = 8, 64 * MiB, 10.0, ratios.DEFAULT_WIDTH, ratios.SUM_GROWTH
    per_word = size / (ratio * (1 + w) * P.beta)
    rs_words = sum(0.5 ** (j + 1) * (1 + w + g * j) for j in range(3))
    ag_words = 1 + w + g * 3  # the full sum of 8 streams, no split
    compute = size / P.compress + 7 / 8 * size / P.add
    network = 3 * P.alpha + rs_words * per_word
    rs = max(compute, network) + min(compute, network) / 4  # 8 pieces: 4 per half
    wire = 3 * P.alpha + 7 / 8 * ag_words * per_word
    ag = max(wire, size / 8 / P.decompress) + 7 / 8 * size / P.decompress
    calls = (8 - 1 + 5 * 3) * P.chunk_overhead  # the pieces, and five calls per step
    assert model.predict_halving(size, n, P, ratio, pieces=8) == pytest.approx(
        P.overhead + calls + rs + ag, rel=1e-12)


@pytest.mark.parametrize(("count", "chunk", "fixed", "want"), [
    (1 << 24, 1 << 20, False, 16), (1 << 24, 1000, False, 16), (1 << 24, 1000, True, 256),
    (10_000, 997, True, 11), (100, 1 << 20, False, 2), (1 << 30, 1 << 20, False, 256),
])
def test_halving_pieces(count: int, chunk: int, fixed: bool, want: int) -> None:
    # About the call's chunk, at least 4 MiB unless fixed by the Communicator, 2 to 256.
    assert model.halving_pieces(count, 4, chunk, fixed=fixed) == want


def test_halving_fold_costs_a_whole_message_each_way() -> None:
    size, ratio = 64 * MiB, 10.0
    fast = replace(P, compress=1e15, add=1e15, decompress=1e15, alpha=0.0, overhead=0.0)
    four = model.predict_halving(size, 4, fast, ratio)
    five = model.predict_halving(size, 5, fast, ratio)
    per_word = size / (ratio * (1 + ratios.DEFAULT_WIDTH) * fast.beta)
    assert five - four > 2 * (1 + ratios.DEFAULT_WIDTH) * per_word * 0.99


def test_halving_partial_sums_stay_narrow() -> None:
    # The ring's reduce-scatter forwards sums of up to N-1 streams; halving sends half of
    # its bytes at step 0 (one stream) and a quarter at step 1 (sums of two) ...
    steps, _ = model.halving_words(512)
    mean = sum(f * w for f, w in steps) / sum(f for f, _ in steps)
    rs, _ = ratios._split_words(512, 0.0, ratios.DEFAULT_WIDTH, ratios.SUM_GROWTH)
    assert mean < 1 + ratios.DEFAULT_WIDTH + ratios.SUM_GROWTH * 1.01
    assert rs / 511 > 1 + ratios.DEFAULT_WIDTH + ratios.SUM_GROWTH * 6


def test_raw_halving_formula() -> None:
    n, size = 16, 64 * MiB
    want = 2 * 4 * P.alpha + 2 * 15 / 16 * size / P.beta + 15 / 16 * size / P.reduce
    assert model.predict_raw_halving(size, n, P) == pytest.approx(want, rel=1e-12)
    assert model.predict_raw_halving(size, 1, P) == 0.0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_few_ranks_keep_the_ring(n: int) -> None:
    slow = replace(P, alpha=1e-2)  # latency that halving would save
    assert model.choose_schedule(64 * MiB, n, slow, 10.0) == "ring"


def test_many_ranks_on_a_latency_bound_link_halve() -> None:
    slow = replace(P, alpha=1e-3)
    assert model.choose_schedule(1 * MiB, 64, slow, 10.0) == "halving"
    # Without latency and with the compressor far faster than the link the bytes decide:
    # halving's partial sums are narrower, so it still sends fewer.
    fast = replace(P, alpha=0.0, compress=1e15, add=1e15, decompress=1e15, overhead=0.0)
    rs, ag = ratios.split_ratios(10.0, 64, ratios.split_fraction(64))
    ring = model.predict_homomorphic(64 * MiB, 64, fast, rs, ratio_sum=ag)
    halv = model.predict_halving(64 * MiB, 64, fast, 10.0, share=ratios.split_fraction(64))
    assert halv < ring
