"""jobs/emulated_cluster.py: namespaces, shaped links, MPI across them, and cleanup.

Needs root and iproute2 (`ip`, `tc`); without them every test here is skipped with the
reason (pytest -ra lists it), never passed silently.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "jobs" / "emulated_cluster.py"
MPIEXEC = REPO / ".venv" / "bin" / "mpiexec"

_spec = importlib.util.spec_from_file_location("emulated_cluster", SCRIPT)
assert _spec is not None and _spec.loader is not None
ec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ec)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces and tc"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if not MPIEXEC.exists():
        return f"{MPIEXEC} missing (run `make venv`)"
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`ip netns` does not work here: {p.stderr.strip()}"
    return None


needs_root = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))

# A rank program: checks it sits alone in its namespace with one shaped NIC, then times a
# 2 MiB exchange with its ring neighbours and prints the rate rank 0 saw.
PROG = r"""
import socket, time
import numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
names = sorted(n for _, n in socket.if_nameindex())
assert names == ["lo", "veth0"], names
m = 2 << 20
a = np.ones(m, np.uint8); b = np.empty_like(a)
best = 1e9
for _ in range(2):
    c.Barrier(); t = time.perf_counter()
    c.Sendrecv(a, (c.rank + 1) % c.size, 0, b, (c.rank - 1) % c.size, 0)
    best = min(best, c.allreduce(time.perf_counter() - t, op=MPI.MAX))
assert b.all()
if c.rank == 0:
    print(f"SIZE {c.size} RATE {m * 8 / best:.0f}", flush=True)
"""


# A rank program for 2 nodes x 2 ranks: MPI's shared-memory domains and ccoll's grouping are
# the 2 nodes, a hierarchical compressed allreduce is within its bound and the same on every
# rank, and only inter-node bytes cross the node's shaped NIC.
NODES_PROG = r"""
import hashlib, json, os
import numpy as np
from mpi4py import MPI
import ccoll
def tx(dev="veth0"):
    with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
        return int(f.read())
c = MPI.COMM_WORLD
shm = c.Split_type(MPI.COMM_TYPE_SHARED, key=c.rank)
ns = os.readlink("/proc/self/ns/net")
same_ns = c.allgather(ns)
# Intra-node traffic: 4 MiB from local rank 0 to local rank 1 of each node.
a = np.ones(4 << 20, np.uint8); b = np.empty_like(a)
c.Barrier(); t0 = tx() + tx("lo")
if shm.rank == 0:
    shm.Send(a, 1)
else:
    shm.Recv(b, 0)
shm.Barrier(); intra = tx() + tx("lo") - t0
cc = ccoll.Communicator(c)
g = cc.grouping
x = np.random.default_rng(c.rank).standard_normal(1 << 20).astype(np.float32)
exact = np.zeros(x.size, np.float64)
c.Allreduce(x.astype(np.float64), exact)
eb = 1e-3
c.Barrier(); t0 = tx()
y = cc.allreduce(x, ccoll.ABS(eb), op="sum", policy="compress")
c.Barrier(); inter = tx() - t0
r = cc.last_call
# The bound, plus one rounding of the two-level result to float32 (half a spacing).
err = float(np.max(np.abs(y.astype(np.float64) - exact) - 0.5 * np.spacing(np.abs(y))))
digests = c.allgather(hashlib.sha256(y.tobytes()).hexdigest())
row = {
    "rank": c.rank, "shm": shm.size, "ns": same_ns.index(ns), "grouping": [g.nodes,
    g.ranks_per_node, g.node, g.local], "report": [r.hierarchical, r.nodes, r.ranks_per_node],
    "err": err / eb, "same": len(set(digests)) == 1, "intra": intra, "inter": inter,
    "sent": r.bytes_sent}
# One line from rank 0: ranks of one node share the launcher's stdout, and their lines can
# interleave.
rows = c.gather(row, root=0)
if c.rank == 0:
    print("ROWS " + json.dumps(rows), flush=True)
"""


def _ns_with(prefix: str) -> list[str]:
    return [ns for ns in ec.list_namespaces() if ns.startswith(prefix)]


@pytest.mark.parametrize(
    ("text", "bps"),
    [("1gbit", 1e9), ("10Gbit", 1e10), ("500mbit", 5e8), ("2.5gbit", 2.5e9), ("100Mbps", 1e8),
     ("100MB/s", 8e8), ("1.25GB/s", 1e10)],
)
def test_parse_rate(text: str, bps: float) -> None:
    assert ec.parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize(("text", "match"), [
    ("fast", "must look like"), ("-1gbit", "must be > 0"), ("0gbit", "must be > 0"),
    ("1 gigabit", "unknown unit"), ("10g", "no unit"),
    ("100mbps", "ambiguous"),  # tc reads it as megabytes/s, most tools as megabits/s
])
def test_parse_rate_rejects(text: str, match: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        ec.parse_rate(text)


def test_mpmd_line_puts_each_rank_in_its_namespace() -> None:
    cl = ec.Cluster(3, 1e9)
    line = ec.mpmd_command(cl, ["ccoll", "bench", "allreduce"], "mpiexec", "py")
    assert line.count(":") == 2
    for ns in cl.rank_ns:
        i = line.index(ns)
        assert line[i - 3 : i] == ["ip", "netns", "exec"]
        assert line[i + 1 : i + 6] == ["py", "-m", "mpi4py", "-m", "ccoll.cli"]
    assert line.count("FI_TCP_IFACE") == 3 and line.count("MPIR_CVAR_NOLOCAL") == 3


def test_nodes_line_makes_mpich_see_hosts() -> None:
    # 2 nodes x 2 ranks: MPICH is told about 2 hosts of 2 slots (its shared-memory domains),
    # ranks 0-1 start in node 0's namespace, 2-3 in node 1's, and shared memory stays on.
    cl = ec.Cluster(2, 1e9, ranks_per_node=2)
    assert cl.ranks == 4 and len(cl.node_ns) == 2
    assert cl.rank_ns == [cl.node_ns[0]] * 2 + [cl.node_ns[1]] * 2
    line = ec.mpmd_command(cl, ["python", "x.py"], "mpiexec", "py")
    assert line[1:5] == ["-launcher", "fork", "-hosts", "node0:2,node1:2"]
    assert line.count(":") == 3 and "MPIR_CVAR_NOLOCAL" not in line
    execs = [line[i + 3] for i, w in enumerate(line) if w == "ip"]
    assert execs == cl.rank_ns


@pytest.mark.parametrize(("argv", "match"), [
    (["--ranks", "2", "--nodes", "2"], "either --ranks"),
    (["--ranks", "2", "--ranks-per-node", "2"], "either --ranks"),
    (["--nodes", "0", "--ranks-per-node", "2"], "--nodes must be 1..64, got 0"),
    (["--nodes", "2", "--ranks-per-node", "0"], "--ranks-per-node must be 1..64, got 0"),
])
def test_bad_layouts_are_refused(argv: list[str], match: str,
                                 capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ec.os, "geteuid", lambda: 0)
    monkeypatch.setattr(ec, "run_on_cluster", lambda args: pytest.fail("must not run"))
    assert ec.main([*argv, "--", "true"]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    ("ranks", "cpus", "expect"),
    [(2, [0, 1], [[0], [1]]), (4, [0, 1], [[0], [1], [0], [1]]),
     (2, list(range(8)), [[0, 1, 2, 3], [4, 5, 6, 7]]), (3, [2, 3, 4, 5, 6, 7], [[2, 3], [4, 5],
                                                                               [6, 7]])],
)
def test_rank_cores_share_the_cores_evenly(ranks: int, cpus: list[int],
                                           expect: list[list[int]]) -> None:
    assert [ec.rank_cores(i, ranks, cpus) for i in range(ranks)] == expect


def test_threads_and_pinning_reach_every_rank() -> None:
    cl = ec.Cluster(2, 1e9)
    line = ec.mpmd_command(cl, ["python", "x.py"], "mpiexec", "py", threads=3, pin=True)
    assert line.count("CCOLL_THREADS") == 2 and line.count("taskset") == 2
    assert "NUMBA_NUM_THREADS" not in line  # numba's pool keeps its size; ccoll uses 3
    i = line.index("CCOLL_THREADS")
    assert line[i + 1] == "3"
    assert line[line.index("OMP_NUM_THREADS") + 1] == "3"


@pytest.mark.parametrize(("ranks", "pin", "cpus", "want"), [
    (2, False, [0, 1], 1), (4, False, [0, 1], 1), (2, False, list(range(8)), 4),
    (3, False, list(range(8)), 2), (2, True, list(range(8)), None), (4, True, [0, 1], None),
])
def test_default_threads(ranks: int, pin: bool, cpus: list[int], want: int | None) -> None:
    # ccoll's own default divides the host's cores (it groups ranks by host name, not by
    # MPI's shared-memory node, which MPIR_CVAR_NOLOCAL makes one per rank): the launcher
    # sets no thread count for it, only OpenMP's for unpinned ranks.
    assert ec.default_threads(ranks, pin, cpus) == want
    line = ec.mpmd_command(ec.Cluster(ranks, 1e9), ["python", "x.py"], "mpiexec", "py",
                           pin=pin, omp_threads=want)
    assert "CCOLL_THREADS" not in line and "NUMBA_NUM_THREADS" not in line
    assert ("OMP_NUM_THREADS" in line) == (want is not None)


@needs_root
@pytest.mark.parametrize("ranks", [2, 3])
def test_runs_mpi_over_shaped_links_and_cleans_up(tmp_path: Path, ranks: int) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    rate = 80e6
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--ranks", str(ranks), "--rate", "80mbit", "--settle", "1",
         "--timeout", "90", "--", sys.executable, "-m", "mpi4py", str(prog)],
        capture_output=True, text=True, timeout=150,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("SIZE"))
    size, measured = int(line.split()[1]), float(line.split()[3])
    assert size == ranks
    # tbf lets the first burst through at full speed, so allow a little above the rate;
    # far above it would mean the link is not shaped, far below that MPI did not use it.
    assert 0.3 * rate < measured < 1.3 * rate, f"measured {measured / 1e6:.1f} Mbit/s at 80"
    tag = p.stderr.split("emulated cluster ", 1)[1].split(":", 1)[0]
    assert tag.startswith("ccoll-")
    assert _ns_with(tag) == [], "namespaces left behind"


@needs_root
def test_failing_command_still_cleans_up() -> None:
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--ranks", "2", "--settle", "0.5", "--timeout", "60", "--",
         sys.executable, "-c", "raise SystemExit(3)"],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode != 0
    tag = p.stderr.split("emulated cluster ", 1)[1].split(":", 1)[0]
    assert _ns_with(tag) == []


@needs_root
def test_sigterm_stops_the_command_and_cleans_up() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--ranks", "2", "--settle", "0.2", "--",
         sys.executable, "-c", "import time; time.sleep(120)"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    prefix = f"ccoll-{proc.pid}-"
    deadline = time.monotonic() + 30
    while len(_ns_with(prefix)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_ns_with(prefix)) == 3, "switch + 2 rank namespaces never appeared"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert _ns_with(prefix) == []


@needs_root
def test_cleanup_stale_removes_namespaces_of_dead_launchers() -> None:
    # A pid that cannot be alive: larger than pid_max.
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 7
    ns = f"ccoll-{dead}-abc123-r0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert ns in ec.cleanup_stale(verbose=False)
        assert ns not in ec.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@needs_root
def test_bench_and_probe_across_the_cluster(tmp_path: Path) -> None:
    # The whole path: ccoll bench in two namespaces over an 80 Mbit/s link; the auto policy's
    # probe must see that link's bandwidth, and every compressed result its bound.
    out = tmp_path / "b.json"
    env = {**os.environ, "CCOLL_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--ranks", "2", "--rate", "80mbit", "--settle", "1",
         "--timeout", "150", "--", "ccoll", "bench", "allreduce", "-b", "256K", "-e", "256K",
         "-n", "2", "-w", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=200, env=env, cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    beta = doc["meta"]["calibration"]["params"]["beta"]
    assert 0.5 * 10e6 < beta < 1.3 * 10e6, f"probe saw {beta * 8 / 1e6:.1f} Mbit/s at 80"
    rows = {r["algorithm"]: r for r in doc["rows"]}
    assert set(rows) == {"mpi", "homomorphic", "dar", "auto"}
    for a in ("homomorphic", "dar", "auto"):
        assert rows[a]["err_over_eb"] <= 1.0
    assert rows["homomorphic"]["ratio"] > 2


@needs_root
def test_two_nodes_of_two_ranks(tmp_path: Path) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(NODES_PROG)
    env = {**os.environ, "CCOLL_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", "2", "--ranks-per-node", "2", "--rate",
         "1gbit", "--settle", "1", "--timeout", "100", "--", sys.executable, "-m", "mpi4py",
         str(prog)],
        capture_output=True, text=True, timeout=150, env=env, cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {}
    for ln in p.stdout.splitlines():
        if ln.startswith("ROWS "):
            rows = {row["rank"]: row for row in json.loads(ln[5:])}
    assert sorted(rows) == [0, 1, 2, 3], p.stdout[-3000:]
    for rank, r in rows.items():
        assert r["shm"] == 2, r  # MPI sees nodes of 2 ranks
        assert r["ns"] == 2 * (rank // 2), r  # ranks 0-1 in node 0's namespace, 2-3 in 1's
        assert r["grouping"] == [2, 2, rank // 2, rank % 2], r
        assert r["report"] == [True, 2, 2], r
        assert r["err"] <= 1.0, r
        assert r["same"], r
        # Shared memory inside a node: neither its NIC nor its loopback (TCP to its own
        # address) carries the 4 MiB.
        assert r["intra"] < 64 << 10, r
        # The allreduce: the compressed inter-node rings cross the node's NIC (1M values at
        # 1e-3 are far more than 100 KB, a raw exchange of the node's two 2 MiB shares would
        # be 4 MiB), the exact intra-node reduction does not (it is most of what the node's
        # ranks sent).
        node_sent = sum(rows[q]["sent"] for q in rows if q // 2 == rank // 2)
        assert 100_000 < r["inter"] < min(4 << 20, node_sent // 2), r
    tag = p.stderr.split("emulated cluster ", 1)[1].split(":", 1)[0]
    assert _ns_with(tag) == [], "namespaces left behind"


@pytest.mark.parametrize(("argv", "match"), [
    (["--ranks", "0"], "--ranks must be 1..64, got 0"),  # was read as "not given": 2 ranks
    (["--ranks", "-1"], "--ranks must be 1..64, got -1"),
    (["--ranks", "65"], "--ranks must be 1..64, got 65"),
    (["--settle", "-1"], "--settle must be a finite number >= 0, got -1"),
    (["--settle", "nan"], "--settle must be a finite number >= 0, got nan"),
    (["--timeout", "0"], "--timeout must be a finite number > 0, got 0"),
    (["--timeout", "inf"], "--timeout must be a finite number > 0, got inf"),
    (["--queue-latency", "0"], "--queue-latency must be a finite number > 0, got 0"),
    (["--mtu", "0"], "--mtu must be 68..65535"),
    (["--mtu", "70000"], "--mtu must be 68..65535"),
    (["--burst", "0"], "--burst must be at least the MTU (1500 bytes)"),
    (["--burst", "1000"], "--burst must be at least the MTU (1500 bytes)"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
])
def test_bad_values_are_refused_before_any_namespace(argv: list[str], match: str,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # check_args reads the options only; main refuses before its root check, and the
    # cluster and the command are stubbed out, so nothing here can touch the network.
    args = ec.build_parser().parse_args([*argv, "--", "true"])
    assert match in (ec.check_args(args) or "")
    monkeypatch.setattr(ec.os, "geteuid", lambda: 0)
    monkeypatch.setattr(ec, "run_on_cluster", lambda args: pytest.fail("must not run"))
    monkeypatch.setattr(ec.Cluster, "create", lambda self: pytest.fail("must not create"))
    assert ec.main([*argv, "--", "true"]) == 2
    assert match in capsys.readouterr().err


def test_good_values_pass_the_check() -> None:
    for argv in ([], ["--ranks", "4", "--settle", "0", "--timeout", "30", "--mtu", "9000",
                      "--burst", "9000", "--threads", "1"],
                 ["--nodes", "2", "--ranks-per-node", "2"]):
        assert ec.check_args(ec.build_parser().parse_args([*argv, "--", "true"])) is None
