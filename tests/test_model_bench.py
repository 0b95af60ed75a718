"""`ccoll bench` on a small size range under mpiexec (2 ranks), and its helpers.

The timings are not judged (the machine is shared); the test checks the sweep's shape, that
every compressed result met its bound, that traffic shrank where data compresses, and the
CSV/JSON/plot outputs.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from ccoll import bench
from ccoll.errors import InputError

REPO = Path(__file__).resolve().parent.parent
MPIEXEC = REPO / ".venv" / "bin" / "mpiexec"


@pytest.mark.parametrize(
    ("lo", "hi", "f", "expect"),
    [(4, 64, 2, [4, 8, 16, 32, 64]), (4, 4096, 16, [4, 64, 1024]), (6, 6, 2, [4]),
     (1, 16, 4, [4, 16]), (5, 9, 2, [8]), (5, 40, 2, [8, 20, 40])],
)
def test_sizes_are_whole_float32_multiples(lo: int, hi: int, f: float, expect: list[int]) -> None:
    assert bench.sizes(lo, hi, f, 4) == expect


def test_gradients_differ_by_rank_and_cycle() -> None:
    data = REPO / "datasets" / "minilm.h5"
    a, b = bench.load_gradients(data, 0), bench.load_gradients(data, 1)
    assert a.dtype.name == "float32" and a.size == b.size > 100_000
    assert not (a == b).all()
    import h5py

    with h5py.File(data) as f:
        steps = len([k for k in f if k.startswith("step_")])
    assert (bench.load_gradients(data, steps) == a).all()


@pytest.mark.parametrize("size", ["16K", "64K", "256K", "1M"])
def test_small_sizes_compress_like_the_whole_dump(size: str) -> None:
    # MiniLM's dump starts with the word-embedding gradient, almost all zeros: its first
    # 64 KiB-1 MiB compress 55-130x at the bound where the whole step compresses 13x. The
    # data of a size must come from the whole dump, so that its ratio says what real
    # gradients do. (The same absolute bound for both: a REL bound would follow the range of
    # each sample, and a sample need not hold the dump's extremes.)
    import ccoll
    from ccoll.units import parse_size

    base = bench.load_gradients(REPO / "datasets" / "minilm.h5", 0)
    eb = ccoll.ABS(1e-3 * float(base.max() - base.min()))
    count = parse_size(size) // 4
    x = bench.data_for_size(base, count)
    assert x.dtype == base.dtype and x.shape == (count,)
    whole = base.nbytes / ccoll.compress(base, eb).nbytes
    got = x.nbytes / ccoll.compress(x, eb).nbytes
    assert 10 < whole < 16
    assert whole / 1.15 < got < whole * 1.15, (size, got, whole)
    zeros = float(np.mean(base == 0))
    assert abs(float(np.mean(x == 0)) - zeros) < 0.05, (size, float(np.mean(x == 0)), zeros)


def test_data_for_size_spreads_whole_blocks_over_the_dump() -> None:
    n = 1_000_003
    base = np.arange(n, dtype=np.float64) + 0.5  # each value says where it came from
    for count in (1, 31, 33, 1024, 4096, 16384, 65536, 262144, n // 32 * 32, n - 1):
        pos = (bench.data_for_size(base, count) - 0.5).astype(np.int64)
        assert pos.shape == (count,) and (np.diff(pos) > 0).all(), count  # distinct, in order
        # the same positions on every call (every rank takes the same places of its step)
        assert (bench.data_for_size(base, count) == pos + 0.5).all()
        # whole 32-value blocks of the dump (the compressor's block size)
        starts = pos[np.r_[0, np.flatnonzero(np.diff(pos) > 1) + 1]]
        assert (starts % 32 == 0).all(), count
        if count >= 16 * 32:  # from the first to the last sixteenth of the dump
            assert pos[0] < n // 16 and pos[-1] >= n - n // 16, count
    # at least the whole dump: the dump itself, repeated
    x = bench.data_for_size(base, 2 * n + 5)
    assert (x[:n] == base).all() and (x[n:2 * n] == base).all() and (x[2 * n:] == base[:5]).all()


def test_allreduce_rows_write_one_output_array_and_get_the_sum() -> None:
    # Where an output array lies changed MPI's own call on it by up to 2x (256 KiB, shared
    # memory), so every allreduce row of a size writes the same array: the rows differ only
    # in the call. One rank: the sum is x itself, in every row.
    from mpi4py import MPI

    import ccoll

    x = np.arange(1000, dtype=np.float32)
    with ccoll.Communicator(MPI.COMM_SELF) as cc:
        run = bench._runners("allreduce", MPI.COMM_SELF, {"auto": cc}, x, None,
                             ["mpi", "auto"])
        got = [run[a]() for a in ("mpi", "auto")]
        assert got[0] is got[1]
        assert got[1].tobytes() == x.tobytes()


@pytest.mark.parametrize(("iters", "blocks"), [(30, 3), (6, 3), (5, 3), (2, 3), (1, 1), (7, 1)])
def test_every_timed_call_follows_a_call_of_its_own_row(iters: int, blocks: int) -> None:
    # A raw MPI call right after a compressed one found a shaped link's burst unspent (1.3
    # against 2.1 ms back to back at 256 KiB, 1 Gbit/s): a row's calls must follow its own.
    rows = ["mpi", "auto", "homomorphic"]
    order = bench.call_order(rows, iters, blocks)
    for a in rows:
        timed = [it for r, it in order if r == a and it is not None]
        assert timed == list(range(iters))  # each timed call once, in order
    for k, (a, it) in enumerate(order):
        if it is not None:
            assert k > 0 and order[k - 1][0] == a
    runs = [a for k, (a, it) in enumerate(order) if it is None]
    assert len(runs) == len(rows) * min(blocks, iters)
    assert runs[:len(rows)] == rows  # the rows take turns, run by run


def test_blocks_must_be_positive() -> None:
    with pytest.raises(InputError, match="--blocks must be >= 1, got 0"):
        bench.run_bench(_bench_args("--blocks", "0"))


@pytest.mark.parametrize(("argv", "match"), [
    (("-b", "1", "-e", "3"), r"-e 3 holds no float32"),
    (("-b", "4", "-e", "1K", "-f", "1"), r"-f 1 never grows the size"),
    # Ran sizes() for minutes building about 1.7e8 sizes before timing any.
    (("-b", "4", "-e", "64M", "-f", "1.0000001"), r"makes about 1\.66e\+08 sizes; at most 1000"),
])
def test_sizes_that_would_time_nothing_or_one_size_are_refused(argv, match) -> None:
    # Both ran and exited 0: -e below 4 bytes printed the header and no row; -f 1 timed
    # only -b's size.
    with pytest.raises(InputError, match=match):
        bench.run_bench(_bench_args(*argv))
    assert bench.sizes(4, 4, 1.0, 4) == [4]  # -b equal to -e: one size, any -f


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
@pytest.mark.parametrize(
    ("collective", "lo"),
    [("allreduce", "16"),
     pytest.param("reduce_scatter", "64K", marks=pytest.mark.slow),
     pytest.param("allgather", "64K", marks=pytest.mark.slow)],
)
def test_small_sweep_under_mpi(tmp_path: Path, collective: str, lo: str) -> None:
    out = tmp_path / "b.json"
    csv_out = tmp_path / "b.csv"
    png = tmp_path / "b.png"
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "ccoll.cli", "bench",
           collective, "-b", lo, "-e", "64K", "-f", "16", "-n", "2", "-w", "1",
           "--json", str(out), "--csv", str(csv_out), "--plot", str(png)]
    env = {k: v for k, v in os.environ.items() if k != "CCOLL_THREADS"}
    env["CCOLL_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    algos = ["mpi", "homomorphic", "auto"] + (["dar"] if collective != "allgather" else [])
    assert sorted({r["algorithm"] for r in rows}) == sorted(algos)
    expect = [16, 256, 4096, 65536] if lo == "16" else [65536]
    assert sorted({r["size"] for r in rows}) == expect
    for r in rows:
        assert r["avg_us"] > 0 and r["min_us"] <= r["avg_us"] <= r["max_us"]
        assert r["min_us"] <= r["med_us"] <= r["max_us"]
        # The model's floor of every call, and the measured time over it.
        assert r["floor_us"] > 0, r
        assert r["of_floor"] == pytest.approx(r["avg_us"] / r["floor_us"])
        if r["algorithm"] != "mpi":
            assert r["err_over_eb"] <= 1.0, r
        else:
            assert r["speedup"] == pytest.approx(1.0)
            assert r["med_speedup"] == pytest.approx(1.0)
        mpi = next(m for m in rows if m["algorithm"] == "mpi" and m["size"] == r["size"])
        assert r["med_speedup"] == pytest.approx(mpi["med_us"] / r["med_us"])
    big = [r for r in rows if r["size"] == 65536 and r["algorithm"] == "homomorphic"]
    assert big[0]["ratio"] > 2, "MiniLM gradients at REL 1e-3 compress"
    assert doc["meta"]["ranks"] == 2 and doc["meta"]["collective"] == collective
    # One host: MPI's shared-memory grouping makes one node, so every call is flat.
    meta = doc["meta"]
    assert (meta["nodes"], meta["ranks_per_node"], meta["grouping"], meta["hierarchical"]) == (
        1, 2, "shared memory", False)
    assert f"# nodes: 1 x 2 ranks (shared memory); {collective} flat" in p.stdout
    # What auto's plans rest on, per signature: calls, agreed times, the current plan.
    plans = doc["meta"]["auto_plans"]
    assert isinstance(plans, dict) and plans
    assert all({"calls", "seconds", "plan", "reason"} <= set(v) for v in plans.values())
    # Two ranks on one node share its cores (unless NUMBA_NUM_THREADS sized the pool).
    cores = len(os.sched_getaffinity(0))
    pool = int(os.environ.get("NUMBA_NUM_THREADS") or cores)
    share = pool if os.environ.get("NUMBA_NUM_THREADS") else max(1, min(pool, cores // 2))
    assert doc["meta"]["threads_per_rank"] == share
    with csv_out.open() as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and all(float(g["of_floor"]) > 0 for g in got)
    assert "floor(us)" in p.stdout and "of-floor" in p.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    # rank 0 printed the table, once
    assert p.stdout.count("algorithm") == 1
    # `ccoll model --cached` starts from this run's calibration (README.md, "On a cluster").
    m = subprocess.run([sys.executable, "-m", "ccoll", "model", "--cached", "--ranks", "64",
                        "--json"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert m.returncode == 0, m.stderr
    params, cal = json.loads(m.stdout)["params"], doc["meta"]["calibration"]
    assert cal["link"] in ("probe", "cache") and cal["compressor"] in ("measured", "cache")
    for key in ("alpha", "beta", "reduce", "compress", "add", "decompress"):
        assert params[key] == cal["params"][key], key


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_sweep_in_two_levels(tmp_path: Path) -> None:
    """--ranks-per-node groups the ranks into nodes; the report says so, results hold."""
    out = tmp_path / "b.json"
    cmd = [str(MPIEXEC), "-n", "4", sys.executable, "-m", "mpi4py", "-m", "ccoll.cli", "bench",
           "allreduce", "-b", "64K", "-e", "64K", "-n", "2", "-w", "1",
           "--algorithms", "mpi,homomorphic", "--ranks-per-node", "2", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "CCOLL_THREADS"}
    env["CCOLL_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert (meta["ranks"], meta["nodes"], meta["ranks_per_node"], meta["grouping"],
            meta["hierarchical"]) == (4, 2, 2, "ranks_per_node=2", True)
    assert "# nodes: 2 x 2 ranks (ranks_per_node=2); allreduce in two levels" in p.stdout
    assert p.stdout.count("# nodes:") == 1
    rows = {r["algorithm"]: r for r in doc["rows"]}
    assert sorted(rows) == ["homomorphic", "mpi"]  # one grouping: plain row names
    assert rows["homomorphic"]["err_over_eb"] <= 1.0
    # Predicted in two levels; the floors are the flat ring's, so none are given.
    assert rows["mpi"]["model_us"] > 0 and rows["homomorphic"]["model_us"] > 0
    assert rows["homomorphic"]["floor_us"] is None


def test_ranks_per_node_must_be_positive() -> None:
    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers())
    args = ap.parse_args(["bench", "allreduce", "--ranks-per-node", "0"])
    with pytest.raises(InputError, match="--ranks-per-node must be >= 1, got 0"):
        bench.run_bench(args)


@pytest.mark.parametrize(("text", "want"), [
    ("shm", [None]), ("1,shm", [1, None]), ("2", [2]), (" 1 , 2 ", [1, 2]),
])
def test_parse_ranks_per_node(text: str, want: list[int | None]) -> None:
    assert bench.parse_ranks_per_node(text) == want


@pytest.mark.parametrize(("text", "match"), [
    ("0", "must be >= 1, got 0"), ("1,-2", "must be >= 1, got -2"),
    ("two", "'two' is neither 'shm' nor a positive int"),
    ("1,,2", "'' is neither"), ("2,2", "each grouping once"),
])
def test_parse_ranks_per_node_rejects(text: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        bench.parse_ranks_per_node(text)


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_sweep_per_node_grouping(tmp_path: Path) -> None:
    # 4 ranks: the flat ring (rpn=1) and the two-level one (2 nodes of 2) side by side.
    out = tmp_path / "b.json"
    cmd = [str(MPIEXEC), "-n", "4", sys.executable, "-m", "mpi4py", "-m", "ccoll.cli", "bench",
           "allreduce", "-b", "64K", "-e", "64K", "-n", "2", "-w", "1", "--algorithms",
           "mpi,homomorphic", "--ranks-per-node", "1,2", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "CCOLL_THREADS"}
    env["CCOLL_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["algorithm"]: r for r in doc["rows"]}
    assert sorted(rows) == ["homomorphic/rpn=1", "homomorphic/rpn=2", "mpi"]
    meta = doc["meta"]
    g = meta["groupings"]
    assert "nodes=4, ranks_per_node=1" in g["homomorphic/rpn=1"]
    assert "nodes=2, ranks_per_node=2" in g["homomorphic/rpn=2"]
    # The top-level fields are the first grouping's; rank 0 prints every grouping's line.
    assert (meta["nodes"], meta["ranks_per_node"], meta["grouping"], meta["hierarchical"]) == (
        4, 1, "ranks_per_node=1", False)
    assert "# nodes: 4 x 1 ranks (ranks_per_node=1); allreduce flat" in p.stdout
    assert "# nodes: 2 x 2 ranks (ranks_per_node=2); allreduce in two levels" in p.stdout
    for a in ("homomorphic/rpn=1", "homomorphic/rpn=2"):
        assert rows[a]["err_over_eb"] <= 1.0, rows[a]
    # (The two-level row's bytes include the exact intra-node ones: no wire ratio there.)
    assert rows["homomorphic/rpn=1"]["ratio"] > 2
    # Each row is predicted as it ran: flat with its floor, in two levels without one
    # (the floors are the flat ring's); MPI like the first grouping (flat).
    assert rows["homomorphic/rpn=1"]["model_us"] > 0
    assert rows["homomorphic/rpn=1"]["floor_us"] > 0
    assert rows["homomorphic/rpn=2"]["model_us"] > 0
    assert rows["homomorphic/rpn=2"]["floor_us"] is None
    assert rows["mpi"]["model_us"] > 0 and rows["mpi"]["floor_us"] > 0
    assert rows["homomorphic/rpn=1"]["model_us"] != rows["homomorphic/rpn=2"]["model_us"]
    assert "homomorphic/rpn=2" in p.stdout


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_sweep_with_halving(tmp_path: Path) -> None:
    # 3 ranks: recursive halving with one rank folded; the result holds, the meta says so.
    out = tmp_path / "b.json"
    cmd = [str(MPIEXEC), "-n", "3", sys.executable, "-m", "mpi4py", "-m", "ccoll.cli", "bench",
           "allreduce", "-b", "64K", "-e", "64K", "-n", "2", "-w", "1", "--algorithms",
           "mpi,homomorphic", "--schedule", "halving", "--no-model", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "CCOLL_THREADS"}
    env["CCOLL_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["schedule"] == "halving"
    rows = {r["algorithm"]: r for r in doc["rows"]}
    assert rows["homomorphic"]["err_over_eb"] <= 1.0


def test_schedule_must_be_known() -> None:
    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers())
    with pytest.raises(SystemExit):
        ap.parse_args(["bench", "allreduce", "--schedule", "tree"])


def _bench_args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers())
    return ap.parse_args(["bench", "allreduce", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0",
                          "--algorithms", "mpi", "--no-model", *argv])


@pytest.mark.parametrize("option", ["--plot", "--json", "--csv"])
def test_existing_output_is_refused_without_force(tmp_path: Path, option: str) -> None:
    # As ccoll eval --plot (and compress, decompress): an existing file is kept, the run
    # refused before it starts, unless --force.
    out = tmp_path / "out.png"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match=rf"{option}: output '.*out.png' exists; pass "
                       "--force to replace it"):
        bench.run_bench(_bench_args(option, str(out)))
    assert out.read_bytes() == b"keep me"
    bench.run_bench(_bench_args(option, str(out), "--force", "-q"))  # one rank: MPI only
    assert out.read_bytes() != b"keep me" and sorted(os.listdir(tmp_path)) == ["out.png"]
    if option == "--plot":
        assert out.read_bytes()[:4] == b"\x89PNG"


def test_output_over_the_data_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "d.h5"
    data.write_bytes((REPO / "datasets" / "digits_cnn.h5").read_bytes())
    with pytest.raises(InputError, match="is the input file"):
        bench.run_bench(_bench_args("--data", str(data), "--json", str(data), "--force"))


def test_cli_exit_status_2_names_the_option(tmp_path: Path, capsys) -> None:
    from ccoll import cli

    png = tmp_path / "b.png"
    png.write_bytes(b"keep me")
    code = cli.main(["bench", "allreduce", "-b", "4K", "-e", "4K", "--plot", str(png)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE and f"ccoll bench: error: --plot: output '{png}' exists" in err


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_every_rank_stops_on_an_existing_output(tmp_path: Path) -> None:
    # Rank 0 checks the files; every rank learns the verdict and stops, none waits in a
    # collective of the sweep.
    png = tmp_path / "b.png"
    png.write_bytes(b"keep me")
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "ccoll.cli", "bench",
           "allreduce", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "--plot", str(png)]
    env = {**os.environ, "CCOLL_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.count(f"ccoll bench: error: --plot: output '{png}' exists") == 2, p.stderr
    assert png.read_bytes() == b"keep me" and "algorithm" not in p.stdout


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_a_usage_error_on_one_rank_ends_the_job(tmp_path: Path) -> None:
    # The rank whose options argparse refused exited 2 before MPI started; the other waited
    # in the options' agreement for ever, and ignored timeout's SIGTERM (its handler only
    # recorded the signal, which Python runs no handler for inside a blocking MPI call).
    run = [sys.executable, "-m", "mpi4py", "-m", "ccoll.cli", "bench", "allreduce", "-b", "4",
           "-e", "4", "-w", "0", "--algorithms", "mpi", "-n"]
    cmd = [str(MPIEXEC), "-n", "1", *run, "2", ":", "-n", "1", *run, "abc"]
    env = {**os.environ, "CCOLL_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "argument -n/--iters: invalid int value: 'abc'" in p.stderr


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_settings_that_differ_between_ranks_exit_2_as_options_do(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "mpi4py", "-m", "ccoll.cli", "bench", "allreduce", "-b", "4",
           "-e", "1K", "-n", "2", "-w", "1", "--algorithms", "mpi,auto", "--no-model"]
    cmd = [str(MPIEXEC), "-n", "1", "env", "CCOLL_RATIO=3", *run, ":",
           "-n", "1", "env", "CCOLL_RATIO=4", *run]
    env = {**os.environ, "CCOLL_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "ratio=3 on rank 0" in p.stderr and "ratio=4 on rank 1" in p.stderr


def test_two_outputs_on_one_file_are_refused(tmp_path: Path) -> None:
    out = str(tmp_path / "b.out")
    with pytest.raises(InputError, match="--csv and --json name the same file"):
        bench.run_bench(_bench_args("--csv", out, "--json", out))
    assert os.listdir(tmp_path) == []


def test_an_algorithm_named_twice_is_refused() -> None:
    # It ran each row twice (comp 2.00: the two rows shared one Communicator's counters).
    with pytest.raises(InputError, match="--algorithms: homomorphic given more than once"):
        bench.run_bench(_bench_args("--algorithms", "mpi,homomorphic,homomorphic"))


@pytest.mark.parametrize("f", ["nan", "inf"])
def test_a_non_finite_step_factor_is_refused(f: str) -> None:
    # -f nan passed `< 1` and timed one size where -e asked for more.
    with pytest.raises(InputError, match=f"-f must be a finite number >= 1, got {f}"):
        bench.run_bench(_bench_args("-f", f, "-e", "64K"))


def _h5(path: Path, steps: dict[str, dict[str, np.ndarray]]) -> str:
    import h5py

    with h5py.File(path, "w") as f:
        for step, datasets in steps.items():
            g = f.create_group(step)
            for name, data in datasets.items():
                g.create_dataset(name, data=data)
    return str(path)


@pytest.mark.parametrize(("steps", "match"), [
    ({}, "no step groups"),
    ({"step_0000": {}}, "step step_0000 holds no datasets"),
    ({"step_0000": {"a": np.zeros(0, np.float32)}}, "step step_0000 holds no values"),
    ({"step_0000": {"a": np.array([b"abc"])}}, "step_0000/a holds \\|S3 values, not real"),
    ({"step_0000": {"a": np.zeros(3, [("x", "<f4"), ("y", "<i4")])}}, "not real numbers"),
    ({"step_0000": {"a": np.ones(3, np.complex64)}}, "holds complex64 values"),
])
def test_data_that_cannot_be_timed_is_refused(tmp_path: Path, steps, match: str) -> None:
    # Before: tracebacks (no steps, strings, compound), or zeros timed (np.resize of an
    # empty step), or the imaginary parts dropped with a warning.
    path = _h5(tmp_path / "d.h5", steps)
    with pytest.raises(InputError, match=f"^--data {path}: .*{match}"):
        bench.run_bench(_bench_args("--data", path))


def test_data_that_is_not_hdf5_exits_2(tmp_path: Path, capsys) -> None:
    from ccoll import cli

    notes = tmp_path / "notes.txt"
    notes.write_text("not HDF5\n")
    code = cli.main(["bench", "allreduce", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0",
                     "--algorithms", "mpi", "--no-model", "--data", str(notes)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert err.strip().splitlines() == [
        f"ccoll bench: error: --data input {str(notes)!r} is not an HDF5 file (no HDF5 "
        "signature found)"]


def test_non_finite_data_is_checked_where_the_sum_is_finite(tmp_path: Path) -> None:
    # A NaN and an Inf in the data: err/eb was nan (with RuntimeWarnings), and the JSON
    # held a bare NaN, which is not JSON.
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    x[5], x[7] = np.nan, np.inf
    path = _h5(tmp_path / "d.h5", {"step_0000": {"a": x}})
    out = tmp_path / "b.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        doc, _, _ = bench.run_bench(_bench_args("--data", path, "--json", str(out), "-q",
                                                "-b", "16K", "-e", "16K"))
    assert doc["rows"][0]["err_over_eb"] == 0.0

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in the JSON")

    json.loads(out.read_text(), parse_constant=no_constants)


def test_max_error_of_no_elements_and_of_nan() -> None:
    empty = np.zeros(0)
    assert bench._max_error(empty.astype(np.float32), empty) == 0.0
    assert bench._max_error(np.array([np.nan, 1], np.float32), np.ones(2)) == math.inf
    from ccoll.h5.output import json_ready

    assert json_ready({"a": [math.nan, 1.5, math.inf], "b": None}) == {
        "a": [None, 1.5, None], "b": None}


@pytest.mark.parametrize("option", ["-n", "--iters-large", "-w", "--warmup-large"])
def test_iteration_counts_too_large_to_hold_are_refused(option: str) -> None:
    # -n 1000000000000 died of MemoryError (or was killed) on every rank.
    with pytest.raises(InputError, match=f"^{option} 1000000000000: at most 1000000 calls"):
        bench.run_bench(_bench_args(option, "1000000000000"))


@pytest.mark.parametrize("n, dtype", [(1, np.float32), (16_384, np.float32), (5, np.float64)])
def test_bench_buffers_start_on_a_page(n: int, dtype: type) -> None:
    # numpy put the output made right after x 16 bytes (mod 4 KiB) after it, where MPI's
    # own allreduce of 64 KiB ran 1.9x slower (docs/dev/repeated-calls.md).
    a, b = bench.page_aligned(n, dtype), bench.page_aligned(n, dtype)
    assert a.shape == (n,) and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % 4096 == 0 and b.ctypes.data % 4096 == 0
    assert not np.shares_memory(a, b)


def test_a_buffer_beyond_memory_is_an_input_error() -> None:
    # -b 1T -e 1T ended in numpy's _ArrayMemoryError traceback.
    from ccoll.bench import page_aligned

    with pytest.raises(InputError, match="cannot allocate 4503599627370496 bytes .* lower -e"):
        page_aligned(2**50, np.float32)
