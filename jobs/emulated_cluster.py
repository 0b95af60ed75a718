#!/usr/bin/env python3
"""Run an MPI command on an emulated bandwidth-limited cluster on one Linux machine (root).

Each node lives in its own network namespace with one NIC (``veth0``) and ``--ranks-per-node``
ranks (default 1). Every NIC is joined by a veth pair to a Linux bridge that lives in a
namespace of its own (the "switch"), and both directions of every link are shaped with
``tc ... tbf rate R``: a node sends at most R and receives at most R, like a node with an
R NIC on a non-blocking switch. Addresses (10.231.0.0/24) exist only inside the namespaces
this script creates, so no traffic leaves them.

``--ranks N`` (the default layout): N nodes of one rank each; MPICH talks TCP over the veth
links (``MPIR_CVAR_NOLOCAL=1``, OFI tcp provider). ``--nodes K --ranks-per-node R``: K nodes
of R ranks. MPICH is told about K hosts (``-hosts n0:R,n1:R,...`` with the ``fork``
launcher: one local process manager proxy per host), so its shared-memory domains
(``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``, ccoll's default node grouping) are the K
nodes: the R ranks of a node talk through shared memory, ranks on different nodes over
TCP through their node's shaped NIC. The proxies stay in this script's namespace and start
each node's ranks in the node's namespace (``ip netns exec``); the host names are labels
for MPICH only, and every rank still reports this machine's host name (ccoll divides the
machine's cores among all its ranks).

Everything created is removed afterwards, also when the command fails, times out, or the
launcher gets SIGINT/SIGTERM/SIGHUP. Names carry a per-run prefix ``ccoll-<pid>-<hex>``;
``--cleanup-stale`` removes namespaces of earlier runs whose launcher died by SIGKILL.

Examples::

    sudo .venv/bin/python jobs/emulated_cluster.py --ranks 2 --rate 1gbit -- \\
        ccoll bench allreduce -b 4 -e 64M
    sudo .venv/bin/python jobs/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate 10gbit -- \\
        ccoll bench allreduce -b 64M -e 64M
    sudo .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate 10gbit -- \\
        .venv/bin/python -m mpi4py my_script.py

A command that starts with ``ccoll`` runs as ``<python> -m mpi4py -m ccoll.cli ...`` (a
failing rank then aborts the whole job instead of leaving the others waiting).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
PREFIX = "ccoll-"
SUBNET = "10.231.0"  # private, only ever configured inside namespaces made here
RANK_DEV = "veth0"


class Interrupted(Exception):
    """A termination signal arrived; unwinds to the cleanup."""


def _load_units() -> ModuleType:
    """ccoll/units.py alone: importing the ccoll package would start MPI in this launcher."""
    spec = importlib.util.spec_from_file_location("_ccoll_units", REPO / "ccoll" / "units.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_units = _load_units()


def parse_rate(text: str) -> float:
    """Bits per second of a rate in ccoll's units (docs/cli.md): ``1Gbit``, ``500mbit``,
    ``10Gb/s``, ``1.25GB/s``; ``b`` is a bit, ``B`` a byte."""
    return 8 * _units.parse_rate(text, what="rate")


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def list_namespaces() -> list[str]:
    """Names of the network namespaces that ``ip netns`` knows."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(verbose: bool = True) -> list[str]:
    """Delete ``ccoll-<pid>-*`` namespaces whose launcher process no longer exists."""
    removed = []
    for ns in list_namespaces():
        m = re.match(rf"^{PREFIX}(\d+)-[0-9a-f]+-", ns)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    if verbose and removed:
        print(f"removed stale namespaces: {' '.join(removed)}", file=sys.stderr)
    return removed


class Cluster:
    """K node namespaces joined through a shaped bridge, R ranks in each; a context manager
    that always cleans up."""

    def __init__(
        self,
        nodes: int,
        rate_bps: float,
        *,
        ranks_per_node: int = 1,
        burst_bytes: int | None = None,
        queue_latency_ms: float = 50.0,
        mtu: int = 1500,
        verbose: bool = False,
    ) -> None:
        if not 1 <= nodes <= 64:
            raise ValueError(f"nodes must be 1..64, got {nodes}")
        if not 1 <= ranks_per_node <= 64:
            raise ValueError(f"ranks_per_node must be 1..64, got {ranks_per_node}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.ranks = nodes * ranks_per_node
        self.rate_bps = rate_bps
        # The bucket must hold a whole 64 KiB GSO segment plus headers (with 32 KiB a
        # 1 Gbit/s link carried 0.35 Gbit/s) and enough for the shaper to keep its rate on a
        # busy machine, but every byte of it passes at memory speed: with 250 KB, 512 KiB
        # messages crossed a "1 Gbit/s" link at 1.5 Gbit/s. 1 ms of traffic, >= 100 KB.
        self.burst = burst_bytes or max(100_000, int(rate_bps / 8 * 0.001))
        self.queue_latency_ms = queue_latency_ms
        self.mtu = mtu
        self.verbose = verbose
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.tag}-sw"
        self.node_ns = [f"{self.tag}-n{i}" for i in range(nodes)]
        self.created: list[str] = []

    @property
    def rank_ns(self) -> list[str]:
        """The namespace of every rank, in rank order (a node's ranks are consecutive)."""
        return [ns for ns in self.node_ns for _ in range(self.ranks_per_node)]

    def address(self, node: int) -> str:
        """IPv4 address of a node's NIC."""
        return f"{SUBNET}.{node + 1}"

    def _ns(self, ns: str, *cmd: str) -> None:
        if self.verbose:
            print(f"+ ip netns exec {ns} {' '.join(cmd)}", file=sys.stderr)
        _run(["ip", "netns", "exec", ns, *cmd])

    def _shape(self, ns: str, dev: str) -> None:
        rate = f"{int(self.rate_bps)}bit"
        self._ns(
            ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
            "burst", str(self.burst), "latency", f"{self.queue_latency_ms}ms",
        )

    def create(self) -> None:
        """Make the namespaces, links, addresses and shaping."""
        for ns in [self.bridge_ns, *self.node_ns]:
            _run(["ip", "netns", "add", ns])
            self.created.append(ns)
            self._ns(ns, "ip", "link", "set", "lo", "up")
        self._ns(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.bridge_ns, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.node_ns):
            port = f"p{i}"
            # Both ends are created directly inside their namespaces: nothing ever appears
            # in the namespace this script runs in.
            _run([
                "ip", "link", "add", RANK_DEV, "netns", ns, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", port, "netns", self.bridge_ns, "mtu", str(self.mtu),
            ])
            self._ns(self.bridge_ns, "ip", "link", "set", port, "master", "br0")
            self._ns(self.bridge_ns, "ip", "link", "set", port, "up")
            self._ns(ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", RANK_DEV)
            self._ns(ns, "ip", "link", "set", RANK_DEV, "up")
            self._shape(ns, RANK_DEV)  # node -> switch
            self._shape(self.bridge_ns, port)  # switch -> node

    def destroy(self) -> None:
        """Delete every namespace created (their veth pairs go with them)."""
        # A second Ctrl-C must not cut the cleanup short: hold signals until it is done.
        sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        try:
            for ns in reversed(self.created):
                _run(["ip", "netns", "del", ns], check=False)
            self.created.clear()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def __enter__(self) -> Cluster:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def rank_command(command: Sequence[str], python: str) -> list[str]:
    """The per-rank program: ``ccoll ...`` becomes ``python -m mpi4py -m ccoll.cli ...``."""
    cmd = list(command)
    if cmd and cmd[0] == "ccoll":
        return [python, "-m", "mpi4py", "-m", "ccoll.cli", *cmd[1:]]
    return cmd


def default_threads(ranks: int, pin: bool, cpus: Sequence[int]) -> int | None:
    """OpenMP threads per rank when ``--threads`` is not given (``None``: nothing to set).

    ccoll's kernels need nothing: ccoll shares cores among the ranks of a host name, not of
    MPI's shared-memory node (every rank is one under ``MPIR_CVAR_NOLOCAL``, R ranks with
    ``--ranks-per-node R``), so its default already divides this machine's cores among all
    the ranks. OpenMP (torch's intra-op pool)
    would give each unpinned rank every core: it gets the cores divided among the ranks.
    Pinned ranks need nothing: each may run on its own cores only.
    """
    if pin:
        return None
    return max(1, len(cpus) // ranks)


def mpmd_command(cluster: Cluster, command: Sequence[str], mpiexec: str, python: str,
                 extra_env: dict[str, str] | None = None, threads: int | None = None,
                 pin: bool = False, omp_threads: int | None = None) -> list[str]:
    """An MPICH ``mpiexec`` MPMD line that starts each rank in its node's namespace.

    One node per rank: ``MPIR_CVAR_NOLOCAL`` keeps MPICH off shared memory. Several ranks
    per node: ``-launcher fork -hosts node0:R,node1:R,...`` makes MPICH see the nodes as
    hosts (rank ``i`` on node ``i // R``), so its shared-memory domains are the nodes.

    ``threads`` sets each rank's compute threads (``CCOLL_THREADS`` for ccoll's kernels,
    ``OMP_NUM_THREADS``), ``omp_threads`` only ``OMP_NUM_THREADS``; ``pin`` binds rank ``i``
    to its share of the cores (``taskset``),
    so that ranks behave like separate nodes instead of migrating over each other's cores.
    """
    env = {
        **({"MPIR_CVAR_NOLOCAL": "1"} if cluster.ranks_per_node == 1 else {}),
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": RANK_DEV,
        "CCOLL_CLUSTER_RATE_BPS": str(int(cluster.rate_bps)),
        **(extra_env or {}),
    }
    if threads is not None:
        env["CCOLL_THREADS"] = env["OMP_NUM_THREADS"] = str(threads)
    elif omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    prog = rank_command(command, python)
    cpus = sorted(os.sched_getaffinity(0))
    line: list[str] = [mpiexec]
    if cluster.ranks_per_node > 1:
        # Hydra fills each host's slots in rank order and starts one proxy per host; with
        # the fork launcher they all run here, and no host name needs to resolve.
        line += ["-launcher", "fork", "-hosts", ",".join(
            f"node{k}:{cluster.ranks_per_node}" for k in range(cluster.nodes))]
    for i, ns in enumerate(cluster.rank_ns):
        if i:
            line.append(":")
        line += ["-n", "1"]
        for k, v in env.items():
            line += ["-env", k, v]
        line += ["ip", "netns", "exec", ns]
        if pin:
            line += ["taskset", "-c", ",".join(map(str, rank_cores(i, cluster.ranks, cpus)))]
        line += prog
    return line


def rank_cores(rank: int, ranks: int, cpus: Sequence[int]) -> list[int]:
    """The cores of rank ``rank`` when ``ranks`` ranks share the cores ``cpus`` evenly."""
    if ranks >= len(cpus):
        return [cpus[rank % len(cpus)]]
    per = len(cpus) // ranks
    return cpus[rank * per : (rank + 1) * per]


def _default_mpiexec() -> str:
    local = REPO / ".venv" / "bin" / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if not found:
        raise SystemExit("mpiexec not found: run `make venv` or pass --mpiexec")
    return found


def _kill_group(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_on_cluster(args: argparse.Namespace) -> int:
    """Create the cluster, run the command in it, clean up; return the command's exit code."""
    cluster = Cluster(
        args.nodes, args.rate, ranks_per_node=args.ranks_per_node, burst_bytes=args.burst,
        queue_latency_ms=args.queue_latency,
        mtu=args.mtu, verbose=args.verbose,
    )

    def on_signal(signum: int, frame: object) -> None:
        raise Interrupted(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    proc: subprocess.Popen[bytes] | None = None
    try:
        with cluster:
            try:
                print(
                    f"emulated cluster {cluster.tag}: {cluster.nodes} nodes x "
                    f"{cluster.ranks_per_node} ranks, "
                    f"{args.rate / 1e9:g} Gbit/s per direction per node "
                    f"(tbf burst {cluster.burst} B)",
                    file=sys.stderr, flush=True,
                )
                # OFI's tcp provider fails with "Bad file descriptor" on links younger than ~1 s.
                time.sleep(args.settle)
                line = mpmd_command(cluster, args.command, args.mpiexec, args.python,
                                    threads=args.threads, pin=args.pin,
                                    omp_threads=args.omp_threads)
                if args.verbose:
                    print("+ " + " ".join(line), file=sys.stderr, flush=True)
                proc = subprocess.Popen(line, start_new_session=True)
                try:
                    rc = proc.wait(timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    print(f"command ran past --timeout {args.timeout} s; stopping it",
                          file=sys.stderr, flush=True)
                    rc = 124
            finally:
                # Processes must leave the namespaces before they are deleted.
                if proc is not None:
                    _kill_group(proc)
            if args.keep:
                print(f"--keep: namespaces left in place: {' '.join(cluster.created)}",
                      file=sys.stderr)
                cluster.created.clear()
            return rc
    except Interrupted as e:
        print(f"got {e}; stopped the command and removed the cluster", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the launcher."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=None,
                   help="N nodes of one rank each (default 2); not with --nodes")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes = namespaces, each with one shaped NIC (with --ranks-per-node)")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks in each node, talking through shared memory; MPI sees the "
                   "nodes as hosts (default 1)")
    p.add_argument("--rate", type=parse_rate, default=parse_rate("1gbit"),
                   help="link rate per direction per node, e.g. 1gbit, 10Gbit, 1.25GB/s "
                   "(default 1gbit)")
    p.add_argument("--burst", type=int, default=None,
                   help="tbf burst in bytes, at least --mtu (default 1 ms of traffic, at "
                   "least 100 KB)")
    p.add_argument("--queue-latency", type=float, default=50.0,
                   help="tbf latency (max queueing) in ms, > 0 (default 50)")
    p.add_argument("--mtu", type=int, default=1500, help="link MTU, 68..65535 (default 1500)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds to wait after creating links before MPI starts, >= 0 "
                   "(default 2)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop the command after this many s, > 0 (default: no limit)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads per rank (CCOLL_THREADS, OMP_NUM_THREADS); default: "
                   "ccoll's own (the machine's cores divided among the ranks; with --pin each "
                   "rank's pinned cores), OpenMP's set to the cores divided among the ranks "
                   "unless --pin")
    p.add_argument("--pin", action="store_true",
                   help="bind each rank to its share of the cores (taskset), like a node")
    p.add_argument("--keep", action="store_true", help="leave the namespaces in place (debugging)")
    p.add_argument("--mpiexec", default=None, help="mpiexec to use (default .venv/bin/mpiexec)")
    p.add_argument("--python", default=sys.executable,
                   help="python for `ccoll ...` commands (default: the one running this script)")
    p.add_argument("--cleanup-stale", action="store_true",
                   help="remove namespaces of dead earlier runs, then exit if no command")
    p.add_argument("-v", "--verbose", action="store_true", help="print every ip/tc command")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run on every rank")
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the parsed options (``None``: nothing); only reads ``args``.

    Run before anything else, above all before any namespace is made: a value that
    ``ip``/``tc`` would refuse halfway through, or one that would be read as "not given"
    (``--ranks 0`` ran 2 ranks), stops the launcher with exit 2 instead.
    """
    import math

    if args.ranks is not None and (args.nodes is not None or args.ranks_per_node != 1):
        return ("--ranks N is N nodes of one rank: give either --ranks, or --nodes with "
                "--ranks-per-node")
    for opt, v in (("--ranks", args.ranks), ("--nodes", args.nodes),
                   ("--ranks-per-node", args.ranks_per_node)):
        if v is not None and not 1 <= v <= 64:
            return f"{opt} must be 1..64, got {v}"
    if not (math.isfinite(args.rate) and args.rate > 0):
        return f"--rate must be a finite rate above 0, got {args.rate:g} bit/s"
    if not 68 <= args.mtu <= 65535:
        return f"--mtu must be 68..65535 (IPv4's least MTU to a veth's most), got {args.mtu}"
    if args.burst is not None and args.burst < args.mtu:
        return (f"--burst must be at least the MTU ({args.mtu} bytes): a packet larger than "
                f"the bucket never passes, got {args.burst}")
    for opt, x, zero_ok in (("--queue-latency", args.queue_latency, False),
                            ("--settle", args.settle, True),
                            ("--timeout", args.timeout, False)):
        if x is not None and not (math.isfinite(x) and (x >= 0 if zero_ok else x > 0)):
            return f"{opt} must be a finite number {'>=' if zero_ok else '>'} 0, got {x:g}"
    if args.threads is not None and args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = build_parser().parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    why = check_args(args)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("emulated_cluster.py needs root (network namespaces and tc)", file=sys.stderr)
        return 2
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            print(f"`{tool}` (iproute2) not found on PATH", file=sys.stderr)
            return 2
    if args.cleanup_stale:
        cleanup_stale()
        if not args.command:
            return 0
    if not args.command:
        print("no command given (put it after --)", file=sys.stderr)
        return 2
    if args.nodes is None:  # --ranks N: N nodes of one rank (checked above); default 2
        args.nodes = args.ranks if args.ranks is not None else 2
    args.ranks = args.nodes * args.ranks_per_node
    args.mpiexec = args.mpiexec or _default_mpiexec()
    args.omp_threads = None
    if args.threads is None:
        args.omp_threads = default_threads(args.ranks, args.pin, sorted(os.sched_getaffinity(0)))
    if args.pin and shutil.which("taskset") is None:
        print("--pin needs `taskset` (util-linux)", file=sys.stderr)
        return 2
    return run_on_cluster(args)


if __name__ == "__main__":
    sys.exit(main())
