"""The Slurm job scripts in jobs/, submitted to a one-node Slurm cluster started on this machine.

jobs/local-slurm/up.sh installs slurm-wlm and munge when they are missing (root, apt-get) and
starts a private munged, slurmctld and slurmd; the module fixture stops them again with
down.sh, also when a test fails. Where Slurm cannot be installed (not root, no apt-get, no
package registry) the tests are skipped with up.sh's reason. Every job is submitted with
``timeout 300 sbatch --wait`` (Slurm clients retry for ever when something is wrong) and
checked for exit status 0, one communicator of the expected size, and result files that parse.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"
LOCAL = JOBS / "local-slurm"
DIGITS = REPO / "datasets" / "digits_cnn.h5"
SBATCH_TIMEOUT_S = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Bring-up may install Slurm (~20 s with a warm package cache, more without), then each job
# takes seconds to tens of seconds on 2 cores.
pytestmark = pytest.mark.timeout(900)


@dataclass
class Job:
    """A finished batch job: its id, exit status of ``sbatch --wait`` and its output."""

    job_id: str
    status: int
    output: str
    results: Path


@dataclass
class Cluster:
    """A running local Slurm cluster and the environment that points its clients at it."""

    folder: Path
    env: dict[str, str]

    def logs(self) -> str:
        text = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.folder / "log" / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-25:]
                text.append(f"---- {name}\n" + "\n".join(tail))
        return "\n".join(text)

    def sbatch(self, script: str, flags: list[str], env: dict[str, str], out: Path) -> Job:
        """Submit jobs/<script> with ``sbatch --wait`` and return when it has ended."""
        out.mkdir(parents=True, exist_ok=True)
        job_env = {
            **self.env,
            "CCOLL_VENV": sys.prefix,
            "CCOLL_REPO": str(REPO),
            "RESULTS_ROOT": str(out / "results"),
            "CCOLL_CACHE_DIR": str(out / "cache"),  # leave the user's calibration cache alone
            **env,
        }
        # One output file per job, or per element of a job array (%A_%a).
        name = "%x-%A_%a.out" if any(f.startswith("--array") for f in flags) else "%x-%j.out"
        cmd = [
            "timeout", str(SBATCH_TIMEOUT_S), "sbatch", "--wait", "--parsable",
            f"--output={out}/{name}", *flags, str(JOBS / script),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=job_env, cwd=REPO, capture_output=True, text=True)
        match = re.match(r"(\d+)", proc.stdout.strip())
        assert match, (
            f"sbatch {script} gave no job id (exit {proc.returncode}): "
            f"{proc.stdout}{proc.stderr}\n{self.logs()}"
        )
        job_id = match.group(1)
        outputs = sorted(out.glob(f"*-{job_id}*.out"))
        output = "\n".join(p.read_text(errors="replace") for p in outputs)
        # Shown with `pytest -s`, and with the failure report otherwise.
        print(f"\n==== {script} {' '.join(flags)} -> job {job_id}, exit {proc.returncode}")
        print(output)
        assert proc.returncode != 124, f"job {job_id} still running after {SBATCH_TIMEOUT_S} s"
        results = sorted((out / "results").glob(f"*-{job_id}"))
        return Job(job_id, proc.returncode, output, results[0] if results else Path("/nonexistent"))


@pytest.fixture(scope="module")
def cluster():
    if not sys.platform.startswith("linux") or shutil.which("bash") is None:
        pytest.skip("local Slurm needs Linux and bash")
    # A folder of its own (not the default /tmp/ccoll-slurm of `make slurm-up`) and free
    # ports picked by up.sh, so the test runs beside a cluster someone started by hand.
    # Not under pytest's private tmp folder: munged runs as user munge and must reach it.
    folder = Path(f"/tmp/ccoll-slurm-test-{os.getpid()}")
    env = {**os.environ, "CCOLL_SLURM_DIR": str(folder)}
    up = subprocess.run(
        ["timeout", "800", str(LOCAL / "up.sh")], env=env, capture_output=True, text=True
    )
    try:
        if up.returncode == 3:
            reason = [ln for ln in up.stderr.splitlines() if "cannot run Slurm" in ln]
            pytest.skip(reason[-1] if reason else f"local Slurm unavailable: {up.stderr[-500:]}")
        assert up.returncode == 0, f"up.sh failed ({up.returncode}):\n{up.stdout}{up.stderr}"
        conf = up.stdout.strip().splitlines()[-1]
        assert conf == f"SLURM_CONF={folder}/slurm.conf", up.stdout
        assert (folder / "env").read_text().strip() == f"export SLURM_CONF={folder}/slurm.conf"
        env["SLURM_CONF"] = str(folder / "slurm.conf")
        yield Cluster(folder, env)
    finally:
        pids = [p for p in folder.glob("**/*.pid")] if folder.exists() else []
        pids = [int(p.read_text()) for p in pids if p.read_text().strip().isdigit()]
        down = subprocess.run(
            ["timeout", "120", str(LOCAL / "down.sh")], env=env, capture_output=True, text=True
        )
        assert down.returncode == 0, f"down.sh failed:\n{down.stderr}"
        assert not folder.exists(), "down.sh left the cluster folder behind"
        running = [p for p in pids if Path(f"/proc/{p}").exists()]
        assert not running, f"daemons still running after down.sh: {running}"


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="needs POSIX users")
def test_up_without_root_says_why_and_starts_nothing() -> None:
    """Exit status 3 and a reason (what the cluster fixture turns into a visible skip)."""
    folder = Path(f"/tmp/ccoll-slurm-test-noroot-{os.getpid()}")
    env = {**os.environ, "CCOLL_SLURM_DIR": str(folder)}
    with tempfile.TemporaryDirectory(prefix="ccoll-slurm-scripts-", dir="/tmp") as tmp:
        cmd = [str(LOCAL / "up.sh")]
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                pytest.skip("runuser is missing: cannot drop root for this check")
            # `nobody` may not be able to enter the checkout (a clone under /root or under a
            # mode-700 folder), nor pytest's private tmp folder: run copies of the scripts
            # from a folder of /tmp that everyone can read.
            scripts = Path(tmp) / "local-slurm"
            shutil.copytree(LOCAL, scripts)
            # A checkout made under umask 077 has private files: open them up too.
            for f in scripts.iterdir():
                f.chmod(0o755 if f.stat().st_mode & 0o100 else 0o644)
            Path(tmp).chmod(0o755)
            scripts.chmod(0o755)
            cmd = ["runuser", "-u", "nobody", "--", str(scripts / "up.sh")]
        proc = subprocess.run(
            ["timeout", "60", *cmd], env=env, capture_output=True, text=True, cwd="/"
        )
    assert proc.returncode == 3, proc.stderr
    assert "cannot run Slurm here" in proc.stderr
    assert not folder.exists()


def read_png(path: Path) -> bytes:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000, f"{path} is not a PNG image"
    return data


def task_lines(output: str) -> list[tuple[int, int, str]]:
    """The ``task K/N on HOST...: WHAT`` lines that the job scripts print, one per task."""
    return [
        (int(m.group(1)), int(m.group(2)), m.group(3))
        for m in re.finditer(r"^task (\d+)/(\d+)[^:\n]*: (.*)$", output, re.M)
    ]


# (RANKS_PER_NODE, nodes, ranks per node, grouping, hierarchical) the job's report must show.
# One Slurm node: the hosts' grouping is one node, flat; RANKS_PER_NODE=2 makes ccoll see
# 2 nodes of 2 tasks and run its two levels, as on 2 real nodes with --ntasks-per-node=2.
# The flat grouping runs in `make test-slow`: the two-level one goes through the same job
# script, launch, report, CSV and plot, and also checks the grouping ccoll reports.
GROUPINGS = [pytest.param("", 1, 4, "shared memory", False, marks=pytest.mark.slow),
             ("2", 2, 2, "ranks_per_node=2", True)]


@pytest.mark.parametrize(("rpn", "nodes", "per_node", "source", "hier"), GROUPINGS)
def test_allreduce_scaling(cluster: Cluster, tmp_path: Path, rpn: str, nodes: int,
                           per_node: int, source: str, hier: bool) -> None:
    ranks = 4
    job = cluster.sbatch(
        "allreduce_scaling.sbatch",
        ["-N1", f"-n{ranks}", f"--ntasks-per-node={ranks}", "--cpus-per-task=1"],
        {"SIZES": "4:64K", "FACTOR": "16", "EB": "rel:1e-3", "BENCH_ARGS": "-n 2 -w 1",
         "RANKS_PER_NODE": rpn},
        tmp_path,
    )  # fmt: skip
    assert job.status == 0, f"job {job.job_id} failed:\n{job.output}\n{cluster.logs()}"
    assert sorted(t[:2] for t in task_lines(job.output)) == [(r, ranks) for r in range(ranks)]
    assert job.results.name == f"ccoll-allreduce-{job.job_id}"
    doc = json.loads((job.results / "allreduce.json").read_text())
    # The bench's own record of the communicator it ran on: all tasks in one.
    assert doc["meta"]["ranks"] == ranks and doc["meta"]["collective"] == "allreduce"
    # ... and of the nodes ccoll saw.
    meta = doc["meta"]
    assert (meta["nodes"], meta["ranks_per_node"], meta["grouping"], meta["hierarchical"]) == (
        nodes, per_node, source, hier)
    levels = "in two levels" if hier else "flat"
    assert f"# nodes: {nodes} x {per_node} ranks ({source}); allreduce {levels}" in job.output
    sizes = [4, 64, 1024, 16384]  # from 4 B up to 64 KiB, factor 16
    by_algo: dict[str, list[int]] = {}
    for row in doc["rows"]:
        by_algo.setdefault(row["algorithm"], []).append(row["size"])
        if row["err_over_eb"] is not None:
            assert row["err_over_eb"] <= 1.0, row
    # Plain MPI and ccoll measured in the same run, at every size.
    assert "mpi" in by_algo and len(by_algo) >= 2, sorted(by_algo)
    assert all(sorted(v) == sizes for v in by_algo.values()), by_algo
    with open(job.results / "allreduce.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["size"]), r["algorithm"]) for r in rows] == [
        (r["size"], r["algorithm"]) for r in doc["rows"]
    ]
    read_png(job.results / "allreduce.png")


def test_train_ddp(cluster: Cluster, tmp_path: Path) -> None:
    ranks, steps = 2, 3
    job = cluster.sbatch(
        "train_ddp.sbatch",
        ["-N1", f"-n{ranks}", f"--ntasks-per-node={ranks}", "--cpus-per-task=1"],
        {"MODEL": "cnn", "COMPRESS": "ccoll none", "STEPS": str(steps),
         "TRAIN_ARGS": "--eval-every 0"},
        tmp_path,
    )  # fmt: skip
    assert job.status == 0, f"job {job.job_id} failed:\n{job.output}\n{cluster.logs()}"
    lines = task_lines(job.output)
    # One srun step per method, each with every rank on the CPU (no GPUs here).
    assert sorted(t[:2] for t in lines) == sorted([(r, ranks) for r in range(ranks)] * 2)
    assert {t[2] for t in lines} == {"cpu"}
    assert job.results.name == f"ccoll-train-{job.job_id}"
    for method in ("ccoll", "none"):
        (path,) = job.results.glob(f"cnn_{method}_*n{ranks}_s0.json")
        log = json.loads(path.read_text())
        assert log["ranks"] == ranks and log["compress"] == method
        assert len(log["loss"]) == steps and all(0 < v < 10 for v in log["loss"])
        assert log["params_identical_on_all_ranks"] is True
    read_png(job.results / "loss_cnn.png")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three real dumps: one step of the bundled digits CNN gradients each."""
    folder = tmp_path_factory.mktemp("dumps")
    paths = []
    with h5py.File(DIGITS, "r") as src:
        for step in ("step_0000", "step_0001", "step_0002"):
            path = folder / f"digits_{step}.h5"
            with h5py.File(path, "w") as dst:
                src.copy(src[step], dst, name=step)
                dst.attrs.update(src.attrs)
            paths.append(path)
    return paths


@pytest.mark.parametrize(
    "mode,flags",
    [("tasks", ["-N1", "-n2", "--cpus-per-task=1"]), ("array", ["--array=0-2", "-n1"])],
)
def test_compress_dumps(
    cluster: Cluster, tmp_path: Path, dumps: list[Path], mode: str, flags: list[str]
) -> None:
    job = cluster.sbatch(
        "compress_dumps.sbatch",
        flags,
        {"DUMPS_DIR": str(dumps[0].parent), "EB": "rel:1e-3", "VS": "sz3,zfp",
         "EVAL_ARGS": "--repeat 1"},
        tmp_path,
    )  # fmt: skip
    assert job.status == 0, f"job {job.job_id} failed:\n{job.output}\n{cluster.logs()}"
    lines = task_lines(job.output)
    # Every dump done exactly once: by task i % 2 of one step, or by array element i.
    assert sorted(t[2] for t in lines) == [str(p) for p in dumps]
    if mode == "tasks":
        want = sorted((i % 2, str(p)) for i, p in enumerate(dumps))
        assert sorted((t[0], t[2]) for t in lines) == want
    else:
        assert all(t[:2] == (0, 1) for t in lines)
    assert job.results.name == f"ccoll-compress-{job.job_id}"
    for dump in dumps:
        name = dump.stem
        with h5py.File(dump, "r") as f:
            n_datasets = sum(len(g) for g in f.values())
        doc = json.loads((job.results / "eval" / f"{name}.json").read_text())
        assert doc["file"] == str(dump) and doc["exit_code"] == 0
        totals = {t["codec"]: t for t in doc["totals"]}
        assert set(totals) == {"ccoll", "sz3", "zfp"}, doc["missing"]
        assert totals["ccoll"]["datasets"] == n_datasets and totals["ccoll"]["failed"] == 0
        assert totals["ccoll"]["max_err_over_eb"] <= 1.0 and totals["ccoll"]["ratio"] > 1.0
        read_png(job.results / "eval" / f"{name}.png")
        comp = json.loads((job.results / "compressed" / f"{name}.json").read_text())
        t = comp["totals"]
        assert comp["exit_code"] == 0 and t["compressed"] + t["kept_raw"] == n_datasets
        with h5py.File(job.results / "compressed" / f"{name}.ccoll.h5", "r") as f:
            dtypes = {d.name: d.dtype for g in f.values() for d in g.values()}
        # Every weight is a stream; a bias of 10 to 32 values may be kept as it is, when its
        # stream would not be smaller (docs/cli.md, "Small datasets").
        assert len(dtypes) == n_datasets
        assert all(dt == "uint8" for p, dt in dtypes.items() if p.endswith(".weight"))
        kept = {p for p, dt in dtypes.items() if dt != "uint8"}
        assert len(kept) == t["kept_raw"] and all(p.endswith(".bias") for p in kept)
