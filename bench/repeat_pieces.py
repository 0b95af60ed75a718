"""Where a repeated ccoll call's own time goes: each piece of the fast way timed alone.

One rank, ``float32[1]`` (what is left is Python: no peer to wait for): the whole call,
mpi4py's ``Allreduce`` on the same buffers, and the pieces that the fast way runs per call,
each in a loop of its own (best of ``--rounds``, ns per call), then ``cProfile``'s top
functions over the same calls. docs/dev/repeated-calls.md has its output:

    python bench/repeat_pieces.py --eb none
    python bench/repeat_pieces.py --eb rel:1e-3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def best_ns(f: Callable[[], Any], calls: int, rounds: int) -> float:
    """Best of ``rounds`` loops of ``calls`` calls of ``f``, in ns per call."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eb", default="none", help="none (exact) or rel:/abs:VALUE")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--top", type=int, default=15, help="cProfile rows")
    args = ap.parse_args(argv)

    from mpi4py import MPI

    import ccoll
    from ccoll.collectives.fastpath import ready
    from ccoll.collectives.waiting import Deadline

    comm = MPI.COMM_WORLD
    eb = None if args.eb.lower() == "none" else args.eb
    cc = ccoll.Communicator(comm)
    x = np.ones(1, np.float32)
    y = np.empty_like(x)
    for _ in range(100):
        cc.allreduce(x, eb)
    route = cc._sync
    fast = route.fast
    st = fast.due()
    assert st is not None, "the call does not repeat the fast way"
    ch = route.ch
    plan = st.cached
    key = st.key
    pieces: dict[str, Callable[[], Any]] = {
        "ccoll.allreduce (whole call)": lambda: cc.allreduce(x, eb),
        "mpi4py Allreduce": lambda: comm.Allreduce(x, y),
        "ready(): argument checks, key": lambda: ready("allreduce", x, eb, "sum", None,
                                                       route.algorithm, route.policy, None, 1),
        "Fast.due(): predicted state": fast.due,
        "Channel.check_usable()": ch.check_usable,
        "Deadline()": lambda: Deadline(600.0, "x"),
        "Planner.end(): count the call": lambda: fast.planner.end(st, plan, 1e-6),
        "History.note()": lambda: fast.history.note(key),
        "x.copy()": x.copy,
        "time.perf_counter()": time.perf_counter,
        "an empty Python call": lambda: None,
    }
    memo = getattr(fast, "memo", None)
    if memo is not None and hasattr(fast, "rerun"):  # the memo's own path (newer code)
        pieces["Fast.rerun(): the data and the accounting"] = lambda: fast.rerun(memo, x)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, eb={eb}, float32[1], "
          f"1 rank; best of {args.rounds} x {args.calls} calls, ns per call")
    print("| piece | ns |")
    print("|---|---:|")
    for name, f in pieces.items():
        print(f"| {name} | {best_ns(f, args.calls, args.rounds):.0f} |", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.calls):
        cc.allreduce(x, eb)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
    print(f"\n# cProfile, {args.calls} calls of ccoll.allreduce")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))
    cc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
