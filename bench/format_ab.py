"""Stream format 1 against format 2 against the plan's choice, and MPI_Allreduce: interleaved.

Run under MPI (any rank count; on the emulated cluster too, as ``ccoll bench`` is)::

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py bench/format_ab.py --iters 7
    .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate 100mbit -- \\
        python bench/format_ab.py --rel 1e-2 --json build/bench/format_100mbit_4.json
    .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate 100mbit -- \
        python bench/format_ab.py --schedule halving --policy compress

Every rank loads one MiniLM gradient step of ``datasets/minilm.h5`` (rank ``i``: step
``i mod 4``), cut or tiled to ``--mib`` MiB of float32 (64 by default), and times
``allreduce(x, REL(--rel), op="avg")`` on three Communicators of one ``--policy``
(``auto`` by default: each may also send raw): ``format_version=1``, ``format_version=2``
and ``None`` (the plan picks per call), all with one ``--schedule`` (``auto`` by default;
``ring`` or ``halving`` forces one), and ``MPI_Allreduce`` of the same array, rotating
the order call by call after one untimed call of each. Rank 0 prints, per variant, the
median and best of the slowest rank's seconds, the bytes all ranks sent in the last call
(the wire ratio: a raw ring's bytes over them), the error over the bound, the formats the
timed calls sent and why the last one did, and the speed index of the run
(:mod:`ccoll.speedindex`: SZ3's one-thread compress throughput on the dump at REL 1e-3,
and the CPU); ``--json`` writes the same.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import abkit  # bench/ is on sys.path when a script here runs
from mpi4py import MPI

import ccoll
from ccoll.speedindex import describe, speed_index_on_rank0

VARIANTS = ("format 1", "format 2", "auto", "MPI_Allreduce")
_FORMAT = {"format 1": 1, "format 2": 2, "auto": None}


def main() -> None:
    ap = abkit.parser(__doc__.split("\n")[0], "variant")
    ap.add_argument("--policy", default="auto", choices=("compress", "auto"))
    ap.add_argument("--schedule", default="auto", choices=("auto", "ring", "halving"),
                    help="the Communicators' schedule (docs/collectives.md, \"Schedules\")")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    x, exact = abkit.gradients(args)
    ccs = {v: ccoll.Communicator(comm, policy=args.policy, format_version=f,
                                 schedule=args.schedule)
           for v, f in _FORMAT.items()}
    runs = abkit.interleave(comm, ccs, x, exact, VARIANTS, args.iters, args.rel)
    times, sent, err, compressed = runs.times, runs.sent, runs.err, runs.compressed
    formats = {v: {rep.format_version for rep in runs.reports[v] if rep.compressed}
               for v in VARIANTS}
    why = {v: rs[-1].format_reason for v, rs in runs.reports.items()
           if rs and rs[-1].compressed}
    for c in ccs.values():
        c.close()
    index = speed_index_on_rank0(comm, args.data)  # the others asleep, not spinning
    if r or index is None:
        return
    raw = 2 * (n - 1) * x.nbytes
    print(f"# {n} ranks, {args.mib:g} MiB float32 per rank, REL {args.rel:g}, avg, policy "
          f"{args.policy}, schedule {args.schedule}; {args.iters} calls each, rotating; "
          f"slowest rank's seconds; "
          f"{describe(index)}")
    print("variant        median_ms  best_ms  bytes_all_ranks  wire_ratio  err/eb  "
          "compressed  formats  why")
    rows = []
    for v in VARIANTS:
        fm = ",".join(map(str, sorted(formats[v]))) or "-"
        row = {"variant": v, "ranks": n, "mib": args.mib, "rel": args.rel,
               "policy": args.policy, "schedule": args.schedule,
               "median_s": statistics.median(times[v]),
               "best_s": min(times[v]), "bytes": sent[v], "wire_ratio": raw / sent[v],
               "err_over_eb": err[v], "compressed_calls": compressed.get(v, 0),
               "formats": fm, "format_reason": why.get(v, ""), "times_s": times[v]}
        rows.append(row)
        print(f"{v:13s}  {row['median_s'] * 1e3:9.1f}  {row['best_s'] * 1e3:7.1f}  "
              f"{sent[v]:15d}  {row['wire_ratio']:10.2f}  {err[v]:6.3f}  "
              f"{compressed.get(v, 0):>4}/{args.iters:<5}  {fm:7s}  {why.get(v, '')}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "speed_index": index}, indent=1))


if __name__ == "__main__":
    main()
