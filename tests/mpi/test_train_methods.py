"""examples/train_ddp.py's methods under MPI: every baseline trains, ccoll stays in lockstep.

One job runs DDP's own allreduce, PyTorch's fp16 / bf16 / PowerSGD hooks and ccoll's hook
(policy "auto", with and without error feedback) one after another from the same seed, as
``--methods`` does, for a few steps of the digits CNN. Checked per method: finite losses,
parameters bitwise identical on every rank (required of ccoll; the baselines too, as
their allreduces give every rank the same bytes), and the bytes each hook handed over.

Run: mpiexec -n 2 python -m mpi4py -m pytest tests/mpi/test_train_methods.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from kit import load_example  # noqa: E402
from mpi4py import MPI  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 6

pytestmark = [
    pytest.mark.skipif(MPI.COMM_WORLD.Get_size() not in (2, 4),
                       reason="the global batch of 64 splits evenly at 2 and 4 ranks"),
]


def _example() -> Any:
    return load_example("train_ddp")


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    ex = _example()
    out = tmp_path_factory.mktemp("runs")
    args = ex.parse_args([
        "--methods", ",".join(ex.METHODS), "--steps", str(STEPS), "--eval-every", "3",
        "--powersgd-start-iter", "2", "--target-accuracy", "0.1", "--out", str(out),
    ])
    return {log["method"]: log for log in ex.run(args)}


def test_every_method_ran_in_order(logs: dict[str, dict[str, Any]]) -> None:
    assert list(logs) == ["none", "allreduce", "fp16", "bf16", "powersgd", "ccoll", "ccoll-ef"]


@pytest.mark.parametrize("method", ["none", "allreduce", "fp16", "bf16", "powersgd", "ccoll",
                                    "ccoll-ef"])
def test_method_trains_and_ranks_agree(logs: dict[str, dict[str, Any]], method: str) -> None:
    log = logs[method]
    assert len(log["loss"]) == STEPS and all(math.isfinite(v) for v in log["loss"])
    assert log["params_identical_on_all_ranks"] is True
    digests = MPI.COMM_WORLD.allgather(log["param_digest"])
    assert len(set(digests)) == 1
    # Time and steps to accuracy come from the evaluations (the target is low on purpose).
    assert log["steps_to_target"] == 0 or log["steps_to_target"] in (3, STEPS)
    assert log["time_to_target_s"] is not None and log["median_step_time_s"] > 0
    assert [e["step"] for e in log["eval"]] == [0, 3, STEPS]


def test_ccoll_runs_start_from_the_same_weights_as_ddp(logs: dict[str, dict[str, Any]]) -> None:
    # Same seed, same data: the first step's loss (before any averaging) is the same.
    first = {m: lg["loss"][0] for m, lg in logs.items()}
    assert len(set(first.values())) == 1, first


def test_python_allreduce_hook_trains_as_ddp_does(logs: dict[str, dict[str, Any]]) -> None:
    # The same average (divide by N, then the group's sum) from a Python hook: the same
    # parameters, bit for bit, as DDP's own allreduce.
    assert logs["allreduce"]["param_digest"] == logs["none"]["param_digest"]
    assert logs["allreduce"]["loss"] == logs["none"]["loss"]


def test_interleaved_runs_train_as_runs_alone(logs: dict[str, dict[str, Any]],
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    # --interleave: one step of each method in turn, each with torch's random state of its
    # own. The deterministic methods end with the very parameters of their runs alone;
    # ccoll's (whose policy follows timings) with the same parameters on every rank.
    ex = _example()
    out = tmp_path_factory.mktemp("interleaved")
    methods = ["none", "allreduce", "fp16", "ccoll"]
    args = ex.parse_args([
        "--methods", ",".join(methods), "--interleave", "--steps", str(STEPS),
        "--eval-every", "3", "--target-accuracy", "0.1", "--out", str(out),
    ])
    mixed = {log["method"]: log for log in ex.run(args)}
    assert list(mixed) == methods
    for m in ("none", "allreduce", "fp16"):
        assert mixed[m]["param_digest"] == logs[m]["param_digest"], m
        assert mixed[m]["loss"] == logs[m]["loss"], m
        assert mixed[m]["hook_payload_bytes"] == logs[m]["hook_payload_bytes"], m
        assert mixed[m]["interleaved_with"] == [x for x in methods if x != m]
    assert mixed["ccoll"]["params_identical_on_all_ranks"] is True
    assert len(mixed["ccoll"]["step_time_s"]) == STEPS
    assert len({mixed[m]["interleave_group"] for m in methods}) == 1
    if MPI.COMM_WORLD.Get_rank() == 0:  # rank 0 writes the logs
        assert sorted(p.name.split("_")[1] for p in out.glob("*.json")) == sorted(methods)
        paired = out / f"paired_cnn_n{MPI.COMM_WORLD.Get_size()}.png"
        assert paired in ex.plot(out) and paired.stat().st_size > 0


def test_interleave_starts_step_0_with_the_seeds_method(monkeypatch) -> None:
    # Step s starts with method (s + seed) mod M: which method takes step 0 first (the
    # dearest step) moves with the seed instead of being method 0 in every seed.
    ex = _example()
    order: list[tuple[int, str]] = []

    class Recorded:
        def __init__(self, args: Any, method: str) -> None:
            self.method, self.log = method, {"date_utc": "now"}

        def step(self, step: int, counter: Any, rec: Any = None) -> None:
            order.append((step, self.method))

        def finish(self, *_: Any) -> dict[str, Any]:
            return self.log

    monkeypatch.setattr(ex, "Run", Recorded)
    methods = ["none", "bf16", "ccoll"]
    for seed in (0, 1, 2, 4):
        order.clear()
        args = ex.parse_args(["--methods", ",".join(methods), "--interleave", "--steps", "2",
                              "--seed", str(seed)])
        ex.train_interleaved(args, methods)
        for step in (0, 1):
            k = (step + seed) % 3
            assert [m for s, m in order if s == step] == methods[k:] + methods[:k], (seed, order)


def test_interleave_refuses_record() -> None:
    ex = _example()
    with pytest.raises(SystemExit):
        ex.parse_args(["--methods", "none,ccoll", "--interleave", "--record", "g.h5"])


def test_bytes_each_hook_handed_over(logs: dict[str, dict[str, Any]]) -> None:
    size = MPI.COMM_WORLD.Get_size()
    grads = logs["none"]["parameters"]
    full = grads * 4 * STEPS * size  # float32 gradients, every step, every rank
    assert logs["none"]["hook_payload_bytes"] == full
    assert logs["allreduce"]["hook_payload_bytes"] == full
    assert logs["fp16"]["hook_payload_bytes"] == full // 2
    assert logs["bf16"]["hook_payload_bytes"] == full // 2
    # PowerSGD: step 0 and 1 plain, then rank-4 factors (and the small tensors) only.
    assert grads * 4 * 2 * size < logs["powersgd"]["hook_payload_bytes"] < full * 0.7
    for m in ("ccoll", "ccoll-ef"):
        assert logs[m]["hook_payload_bytes"] > 0 and logs[m]["policy"] == "auto"
    assert logs["ccoll-ef"]["error_feedback"] is True and logs["ccoll"]["error_feedback"] is False


def test_powersgd_with_several_buckets(tmp_path_factory: pytest.TempPathFactory) -> None:
    # PowerSGD chains each bucket's allreduces through completion callbacks: with several
    # buckets in flight on one gloo group the ranks issued them in different orders and gloo
    # aborted ("Received data size doesn't match expected size"). One group per bucket.
    ex = _example()
    out = tmp_path_factory.mktemp("psgd")
    args = ex.parse_args([
        "--methods", "powersgd", "--steps", "4", "--eval-every", "0", "--bucket-cap-mb",
        "0.01", "--powersgd-start-iter", "2", "--target-accuracy", "0.1", "--out", str(out),
    ])
    (log,) = ex.run(args)
    assert log["powersgd_buckets"] > 2
    assert all(math.isfinite(v) for v in log["loss"])
    assert log["params_identical_on_all_ranks"] is True


def test_powersgd_of_two_ranks_in_one_job(tmp_path_factory: pytest.TempPathFactory) -> None:
    # --methods powersgd,powersgd:8: PowerSGD of the default rank (4) and of rank 8, side by
    # side; each logs its own rank and file, and the higher rank hands over more bytes.
    ex = _example()
    out = tmp_path_factory.mktemp("psgd_ranks")
    args = ex.parse_args([
        "--methods", "powersgd,powersgd:8", "--interleave", "--steps", "4", "--eval-every",
        "0", "--powersgd-start-iter", "2", "--target-accuracy", "0.1", "--out", str(out),
    ])
    low, high = ex.run(args)
    assert (low["method"], high["method"]) == ("powersgd", "powersgd:8")
    assert low["powersgd"]["matrix_approximation_rank"] == 4
    assert high["powersgd"]["matrix_approximation_rank"] == 8
    assert low["hook_payload_bytes"] < high["hook_payload_bytes"]
    if MPI.COMM_WORLD.Get_rank() == 0:
        names = sorted(p.name for p in out.glob("*.json"))
        assert [n.split("_")[2] for n in names] == ["r4", "r8"], names
    with pytest.raises(SystemExit):
        ex.parse_args(["--methods", "powersgd:0"])
    with pytest.raises(SystemExit):
        ex.parse_args(["--methods", "powersgd:x"])


def test_ccoll_methods_with_their_own_bounds(tmp_path_factory: pytest.TempPathFactory) -> None:
    # --methods ccoll,ccoll-ef:rel:1e-1: one job compares bounds; each run's hook uses the
    # bound its name gives (the logged one, the file name's), the plain name --eb's.
    ex = _example()
    out = tmp_path_factory.mktemp("ccoll_bounds")
    args = ex.parse_args([
        "--methods", "ccoll,ccoll-ef:rel:1e-1", "--interleave", "--steps", "2",
        "--eval-every", "0", "--eb", "rel:1e-3", "--target-accuracy", "0.1", "--out", str(out),
    ])
    plain, loose = ex.run(args)
    assert (plain["eb"], plain["error_feedback"]) == ("rel:1e-3", False)
    assert (loose["eb"], loose["error_feedback"]) == ("rel:1e-1", True)
    assert loose["params_identical_on_all_ranks"] is True
    if MPI.COMM_WORLD.Get_rank() == 0:
        names = sorted(p.name for p in out.glob("*.json"))
        assert [n.split("_")[2:4] for n in names] == [["rel1e-1", "ef"], ["rel1e-3", "auto"]], \
            names
    for bad in ("ccoll:", "ccoll:rel:x", "ccoll-ef:bogus:1"):
        with pytest.raises(SystemExit):
            ex.parse_args(["--methods", bad])


def test_methods_with_their_own_bucket_size(tmp_path_factory: pytest.TempPathFactory) -> None:
    # --methods ccoll,ccoll@0.01: the @MB suffix gives that run DDP buckets of its own size
    # (the CNN's 40 KB of gradients in several buckets), the plain name --bucket-cap-mb's.
    ex = _example()
    out = tmp_path_factory.mktemp("bucket_caps")
    args = ex.parse_args([
        "--methods", "ccoll,ccoll@0.01,none@0.01", "--interleave", "--steps", "3",
        "--eval-every", "0", "--min-numel", "0", "--policy", "compress",
        "--target-accuracy", "0.1", "--out", str(out),
    ])
    plain, small, none = ex.run(args)
    assert (plain["bucket_cap_mb"], small["bucket_cap_mb"], none["bucket_cap_mb"]) == \
        (25.0, 0.01, 0.01)
    assert (plain["method"], small["method"], none["method"]) == \
        ("ccoll", "ccoll@0.01", "none@0.01")
    # After DDP's rebuild at step 1 every step of the small buckets has several of them.
    assert plain["step_buckets_compressed"][1:] == [1, 1]
    assert min(small["step_buckets_compressed"][1:]) >= 3, small["step_buckets_compressed"]
    assert small["params_identical_on_all_ranks"] is True
    if MPI.COMM_WORLD.Get_rank() == 0:
        names = sorted(p.name for p in out.glob("*.json"))
        assert [n for n in names if "_b0.01_" in n] == [
            n for n in names if n.startswith(("cnn_ccoll_rel1e-3_b0.01", "cnn_none_b0.01"))]
        assert len([n for n in names if "_b0.01_" in n]) == 2, names
    for bad in ("ccoll@0", "ccoll@x", "ccoll@", "bogus@5", "ccoll@-1"):
        with pytest.raises(SystemExit):
            ex.parse_args(["--methods", bad])


def test_trace_records_the_steps_asked_for(tmp_path_factory: pytest.TempPathFactory) -> None:
    # --trace 1: step 1's timeline of every rank (ccoll's collectives, the backward pass,
    # each bucket in flight, the optimizer's step) in trace_<run>.json and a PNG; other
    # steps are not recorded.
    ex = _example()
    out = tmp_path_factory.mktemp("trace")
    args = ex.parse_args([
        "--methods", "ccoll", "--steps", "3", "--eval-every", "0", "--min-numel", "0",
        "--policy", "compress", "--trace", "1", "--target-accuracy", "0.1", "--out", str(out),
    ])
    (log,) = ex.run(args)
    assert log["params_identical_on_all_ranks"] is True
    if MPI.COMM_WORLD.Get_rank() == 0:
        (path,) = out.glob("trace_*.json")
        doc = json.loads(path.read_text())
        assert [c["call"] for c in doc["otherData"]["calls"]] == ["ccoll step 1"]
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        size = MPI.COMM_WORLD.Get_size()
        for name in ("forward+backward", "bucket 0 in flight", "allreduce",
                     "backward() returns", "optimizer step"):
            assert {e["pid"] for e in spans if e["name"] == name} == set(range(size)), name
        # one compressed allreduce per rank: the CNN's one bucket of step 1
        assert len([e for e in spans if e["name"] == "allreduce"]) == size
        assert (out / path.name.replace(".json", "_step1.png")).stat().st_size > 0
    with pytest.raises(SystemExit):
        ex.parse_args(["--trace", "1,x"])


def test_shared_namespace_counters_count_once() -> None:
    # Ranks that share a network namespace (here all: plain mpiexec; on the emulated cluster
    # the ranks of one node) read the same interface counters: they count once, not per rank.
    ex = _example()
    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    net0 = {"eth9": (0, 0), "lo": (0, 0)}
    net1 = {"eth9": (0, 1000 + r), "lo": (0, 7)}
    out = ex.wire_bytes(comm, "none", None, 0, 1, 1, net0, net1,
                        {"how": "route", "interface": "eth9"})
    assert out["interface_tx_bytes"] == 1000  # rank 0's reading alone
    assert out["loopback_tx_bytes"] == 7
    assert out["wire_bytes"] == 1000
    assert out["wire_bytes_source"] == "tx counters of eth9, summed over the 1 network namespaces"


@pytest.mark.parametrize("method", ["ccoll", "ccoll-ef"])
def test_ccoll_logs_say_what_it_did(logs: dict[str, dict[str, Any]], method: str) -> None:
    # Per step, the buckets that went compressed; in all, compressed and exact; the first
    # compressed step and its time (kept out of the median step); what the console and the
    # accuracy-against-time legend print from them.
    ex = _example()
    log = logs[method]
    per_step = log["step_buckets_compressed"]
    assert len(per_step) == STEPS and all(c >= 0 for c in per_step)
    assert sum(per_step) == log["buckets_compressed"]
    first = log["first_compressed_step"]
    if first is None:
        assert log["buckets_compressed"] == 0 and log["first_compressed_step_time_s"] is None
    else:
        assert per_step[first] > 0 and all(c == 0 for c in per_step[:first])
        assert log["first_compressed_step_time_s"] == log["step_time_s"][first]
    line = ex._what_ccoll_did(log)
    assert f"buckets {log['buckets_compressed']} compressed, {log['buckets_exact']} exact" in line
    assert ("no step compressed" in line) == (first is None)
    if log.get("step_check_winner") is not None:
        assert f"step check chose {log['step_check_winner']}" in line
