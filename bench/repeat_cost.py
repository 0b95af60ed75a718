"""What a repeated ccoll call costs next to mpi4py's own ``Allreduce``, interleaved call by call.

Each round times ``--calls`` calls of mpi4py's ``comm.Allreduce(x, y)`` and then as many
of ``ccoll.allreduce(x, eb=...)`` on the same buffers (the same signature every call, as a
training loop or an OSU latency sweep makes them), rounds alternating so that both see
the same machine; the median round per call counts, on the slowest rank. Run it at one
rank for ccoll's own time per call (no peer: what is left is Python and the plan lookup)
and at several ranks for the cost of the check that the ranks agree:

    python bench/repeat_cost.py                         # 1 rank, eb=None and REL 1e-3
    mpiexec -n 2 python -m mpi4py bench/repeat_cost.py --sizes 4,8K,64K,1M

For before/after figures, run it twice in one session with ``PYTHONPATH`` pointing at each
checkout. ``--out new,same`` times ccoll's call into a new array (its default) and into the
output buffer mpi4py's call writes (``out=y``) side by side. ``--timeout default,inf``
times Communicators of each timeout side by side, in the same rounds (a finite timeout
waits with nonblocking MPI calls, ``inf`` with blocking ones; docs/collectives.md,
"Faults"). x and y are page-aligned, as OSU's benchmarks allocate them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np


def parse_size(text: str) -> int:
    """``"4"``, ``"8K"``, ``"1M"`` in bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def _page_aligned(n: int) -> np.ndarray:
    """A new float32 array of ``n`` elements whose data starts on a 4 KiB boundary."""
    raw = np.empty(n * 4 + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + n * 4].view(np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4", help="message sizes in bytes (K, M), comma-separated")
    ap.add_argument("--eb", default="none,rel:1e-3",
                    help="bounds to time, comma-separated: none (exact) or rel:/abs:VALUE")
    ap.add_argument("--calls", type=int, default=2000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=15, help="rounds per variant (median counts)")
    ap.add_argument("--timeout", default="default",
                    help="Communicator timeouts to time, comma-separated: default "
                    "(CCOLL_TIMEOUT or 600 s), seconds, or inf (blocking MPI waits)")
    ap.add_argument("--out", default="new",
                    help="where ccoll's result goes, comma-separated: new (a new array, "
                    "ccoll.allreduce(x)'s default) and/or same (out=y, the buffer mpi4py's "
                    "call writes); each is a variant of its own")
    args = ap.parse_args(argv)
    outs = [o.strip() for o in args.out.split(",")]
    if not outs or any(o not in ("new", "same") for o in outs):
        ap.error(f"--out takes new and/or same, got {args.out!r}")

    from mpi4py import MPI

    import ccoll

    comm = MPI.COMM_WORLD
    bounds = [None if b.strip().lower() == "none" else b.strip() for b in args.eb.split(",")]
    rank, size = comm.Get_rank(), comm.Get_size()
    try:  # the same on every rank: measured on rank 0 while the others sleep
        from ccoll.speedindex import describe, speed_index_on_rank0
    except ImportError:  # an older checkout (before/after runs): the index from this one
        index_text = "speed index: run python -m ccoll.speedindex in the same session"
    else:
        index = speed_index_on_rank0(comm)
        index_text = describe(index) if index is not None else ""
    if rank == 0:
        print(f"# {index_text}")
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {size} rank(s), "
              f"load average {os.getloadavg()[0]:.2f}; "
              f"median of {args.rounds} rounds x {args.calls} calls, slowest rank; us per call")
        cols = "| size | eb | timeout | mpi4py | ccoll | ccoll - mpi4py | speed vs mpi4py |"
        print(cols)
        print("|" + "---:|" * (cols.count("|") - 1))
    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        # Page-aligned buffers, as OSU's benchmarks allocate them: where x and y lie
        # relative to each other changes the cost of copying one into the other by up to
        # 20x on some cores (docs/dev/repeated-calls.md, "Where the buffers lie").
        x = _page_aligned(max(1, nbytes // 4))
        x[:] = np.random.default_rng(rank).standard_normal(x.size)
        y = _page_aligned(x.size)
        for eb in bounds:
            def mpi(x: np.ndarray = x, y: np.ndarray = y) -> None:
                comm.Allreduce(x, y)

            timeouts = [t.strip() for t in args.timeout.split(",")]
            variants: dict[str, Any] = {"mpi4py": mpi}
            names = []
            for t in timeouts:
                cc = ccoll.Communicator(comm, timeout=None if t == "default" else float(t))
                for o in outs:
                    def call(cc: Any = cc, eb: Any = eb, x: np.ndarray = x,
                             out: np.ndarray | None = y if o == "same" else None) -> None:
                        cc.allreduce(x, eb, out=out)

                    name = t if o == "new" else f"{t}, out=y"
                    variants[name] = call
                    names.append(name)
            times: dict[str, list[float]] = {k: [] for k in variants}
            for f in variants.values():  # warm-up: first calls, plans, kernels
                for _ in range(50):
                    f()
            for _ in range(args.rounds):
                for name, f in variants.items():
                    comm.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        f()
                    t = (time.perf_counter() - t0) / args.calls
                    times[name].append(comm.allreduce(t, op=MPI.MAX))
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            if rank == 0:
                for t in names:
                    print(f"| {nbytes} | {eb or 'none'} | {t} | {med['mpi4py']:.2f} "
                          f"| {med[t]:.2f} | {med[t] - med['mpi4py']:.2f} | "
                          f"{med['mpi4py'] / med[t]:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
