"""Bytes and time of the ring in format 1 and 2 at several split shares: interleaved.

Run under MPI (any rank count; on the emulated cluster too)::

    .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate 100mbit -- \\
        .venv/bin/python -m mpi4py bench/format_split.py --rel 1e-3 --iters 6

Every rank loads one gradient step of ``--data`` (``datasets/minilm.h5``; rank ``i``:
step ``i mod`` its steps), cut or tiled to ``--mib`` MiB of float32, and times ``allreduce(x,
REL(--rel), op="avg")`` on Communicators with ``policy="compress"``, ``schedule="ring"``
and each (format, split) of ``--variants`` (``2:0.5`` is format 2 with half the bound
given to the allgather's requantization; ``auto`` for the split is the plan's choice),
rotating the order call by call after one untimed call of each. Rank 0 prints, per
variant, the median and best of the slowest rank's seconds, the bytes all ranks sent in
the last call and the first variant's bytes over them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import ccoll
from ccoll.bench import load_gradients
from ccoll.speedindex import describe, speed_index_on_rank0


def _variant(text: str) -> tuple[int, float | None]:
    fv, _, share = text.partition(":")
    return int(fv), None if share in ("", "auto") else float(share)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="datasets/minilm.h5")
    ap.add_argument("--rel", type=float, default=1e-3)
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--variants", default="1:auto,1:0.5,2:auto,2:0.4,2:0.5,2:0.6")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    count = int(args.mib * (1 << 20)) // 4
    x = np.resize(load_gradients(args.data, comm.rank), count).astype(np.float32)
    names = args.variants.split(",")
    ccs = {}
    for name in names:
        fv, share = _variant(name)
        ccs[name] = ccoll.Communicator(comm, policy="compress", format_version=fv,
                                       split=share, schedule="ring")
    eb = ccoll.REL(args.rel)
    for cc in ccs.values():
        cc.allreduce(x, eb, op="avg")
    seconds: dict[str, list[float]] = {k: [] for k in names}
    sent: dict[str, int] = {}
    for i in range(args.iters):
        for name in names[i % len(names):] + names[: i % len(names)]:
            cc = ccs[name]
            before = cc.stats.bytes_sent
            comm.Barrier()
            t = time.perf_counter()
            cc.allreduce(x, eb, op="avg")
            seconds[name].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
            sent[name] = comm.allreduce(cc.stats.bytes_sent - before)
    for cc in ccs.values():
        cc.close()
    index = speed_index_on_rank0(comm)
    if comm.rank != 0:
        return
    print(f"# {args.data}, {comm.size} ranks, {args.mib:g} MiB float32 per rank, "
          f"REL {args.rel:g}, avg, "
          f"policy compress, ring; {args.iters} calls each, rotating; {describe(index)}")
    print("variant      median_ms  best_ms  bytes_all_ranks  first/this")
    for name in names:
        print(f"{name:12s} {statistics.median(seconds[name]) * 1e3:9.1f} "
              f"{min(seconds[name]) * 1e3:8.1f} {sent[name]:16d} "
              f"{sent[names[0]] / sent[name]:10.3f}")


if __name__ == "__main__":
    main()
