"""Split bound on against off, and MPI_Allreduce: one allreduce, interleaved A/B/C.

Run under MPI (any rank count; on the emulated cluster too)::

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py bench/split_ab.py --iters 7

Every rank loads one MiniLM gradient step of ``datasets/minilm.h5`` (rank ``i``: step
``i mod 4``), cut or tiled to ``--mib`` MiB of float32, and times ``allreduce(x,
REL(--rel), op="avg")`` on two Communicators (``policy="compress"``: ``split=None``, the
model's choice, and ``split=0``, none; ``--policy auto`` lets each choose raw or
compressed) and ``MPI_Allreduce`` of the same array, rotating the order call by call after
one untimed call of each. Rank 0 prints, per variant, the median and best of the slowest
rank's seconds, the bytes all ranks sent in the last call (the wire ratio: a raw ring's
bytes over them), the error over the bound (over ``2^-24`` of the largest result for a
raw call) and how many timed calls were compressed; ``--json`` writes the same.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import abkit  # bench/ is on sys.path when a script here runs
from mpi4py import MPI

import ccoll
from ccoll.collectives import ratios

VARIANTS = ("split auto", "no split", "MPI_Allreduce")


def main() -> None:
    ap = abkit.parser(__doc__.split("\n")[0], "variant")
    ap.add_argument("--policy", default="compress", choices=("compress", "auto"))
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x, exact = abkit.gradients(args)
    ccs = {"split auto": ccoll.Communicator(comm, policy=args.policy, split=None),
           "no split": ccoll.Communicator(comm, policy=args.policy, split=0)}
    share = ratios.split_fraction(n) if n > 1 else 0.0  # what split=None may use
    runs = abkit.interleave(comm, ccs, x, exact, VARIANTS, args.iters, args.rel)
    times, sent, err, compressed = runs.times, runs.sent, runs.err, runs.compressed
    for c in ccs.values():
        c.close()
    if r:
        return
    raw = 2 * (n - 1) * x.nbytes
    rows = []
    print(f"# {n} ranks, {args.mib:g} MiB float32 per rank, REL {args.rel:g}, avg, model's "
          f"split share {share:g}; {args.iters} calls each, rotating; slowest rank's seconds")
    print("variant        median_ms  best_ms  bytes_all_ranks  wire_ratio  err/eb  compressed")
    for v in VARIANTS:
        row = {"variant": v, "ranks": n, "mib": args.mib, "share": share,
               "median_s": statistics.median(times[v]), "best_s": min(times[v]),
               "bytes": sent[v], "wire_ratio": raw / sent[v], "err_over_eb": err[v],
               "compressed_calls": compressed[v], "times_s": times[v]}
        rows.append(row)
        print(f"{v:13s}  {row['median_s'] * 1e3:9.1f}  {row['best_s'] * 1e3:7.1f}  "
              f"{sent[v]:15d}  {row['wire_ratio']:10.2f}  {err[v]:6.3f}  "
              f"{compressed[v]}/{args.iters}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
