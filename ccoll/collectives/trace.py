"""A timeline of ccoll's collectives: spans per rank and thread, off unless asked for.

While :func:`tracing` is active, the collectives record *spans* (a name, a kind, a start
and an end on ``time.perf_counter``, the thread, and a few numbers such as the ring step,
the chunk and the bytes): every compute task of the ring (``compress``, ``prepare``,
``combine``, ``decode``), every transfer from the moment it was posted to the moment the
driving thread saw it complete (``send``, ``recv``, the allgathers), every wait of the
driving thread (``sleep`` and ``wait worker`` in the ring's polling loop, ``wait`` in the
other MPI waits) and the stages of a call (``check``, ``agree``, ``decide``, the data
stage and its ``reduce-scatter`` / ``allgather`` parts).

Off, which is the default, it costs nothing measurable: every instrumented function reads
the module attribute :data:`ACTIVE` once and each span site tests that local for ``None``;
no clock is read and nothing is allocated (docs/dev/collectives-timeline.md, "What tracing
costs", measures it).

:func:`gather` brings every rank's spans to rank 0 with buffer-based MPI calls, times
relative to each rank's own moment of leaving the barrier that started the traced call
(:func:`start`), so ranks' clocks need not agree; :func:`chrome` turns them into
Chrome/Perfetto trace-event JSON and :func:`plot` into a PNG.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "ACTIVE",
    "Recorder",
    "tracing",
    "start",
    "gather",
    "chrome",
    "plot",
    "KINDS",
]

# Kinds of span, by name: what the PNG colours and the JSON's "cat" say.
KINDS: dict[str, str] = {
    "compress": "compute", "prepare": "compute", "combine": "compute", "decode": "compute",
    "pack": "compute", "cut": "compute", "join": "compute", "final": "compute",
    "send": "transfer", "recv": "transfer", "ag send": "transfer", "ag recv": "transfer",
    "allgather sizes": "transfer",
    "allgatherv": "transfer",
    "sleep": "wait", "wait worker": "wait", "wait": "wait",
}

_clock = time.perf_counter


class Recorder:
    """The spans of one process, recorded from any thread (``list.append`` is atomic)."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = _clock() if origin is None else origin
        self.events: list[tuple[str, str, float, float, int, dict[str, Any] | None]] = []
        self.threads: dict[int, str] = {}

    clock = staticmethod(_clock)

    def span(self, name: str, t0: float, t1: float, args: dict[str, Any] | None = None,
             cat: str | None = None) -> None:
        """Record that ``name`` ran from ``t0`` to ``t1`` (``perf_counter`` seconds) here."""
        ident = threading.get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        self.events.append((name, cat or KINDS.get(name, "stage"), t0, t1, ident, args))

    def task(self, fn: Callable[[], Any], name: str, args: dict[str, Any]) -> Callable[[], Any]:
        """``fn`` wrapped to record its run as ``name`` on whichever thread runs it.

        ``args["queued_us"]`` is how long it waited between submission and start.
        """
        submitted = _clock()

        def run() -> Any:
            t0 = _clock()
            try:
                return fn()
            finally:
                self.span(name, t0, _clock(), {**args, "queued_us": (t0 - submitted) * 1e6})

        return run

    def export(self) -> dict[str, Any]:
        """Return the spans as plain data, times in microseconds since :attr:`origin`."""
        o = self.origin
        return {
            "threads": {str(k): v for k, v in self.threads.items()},
            "events": [
                [name, cat, (t0 - o) * 1e6, (t1 - t0) * 1e6, str(ident), args or {}]
                for name, cat, t0, t1, ident, args in self.events
            ],
        }


# The recorder of the traced call in progress, or None (tracing off).
ACTIVE: Recorder | None = None


@contextmanager
def tracing(origin: float | None = None) -> Iterator[Recorder]:
    """Record spans in this process until the block ends; yields the :class:`Recorder`."""
    global ACTIVE
    rec = Recorder(origin)
    before, ACTIVE = ACTIVE, rec
    try:
        yield rec
    finally:
        ACTIVE = before


def start(comm: Any) -> float:
    """Barrier on ``comm``; return this rank's clock as it left it (the trace's time zero).

    The ranks leave a barrier within about one message latency of each other, so spans
    measured from there line up across ranks to that precision, whatever their clocks say.
    """
    comm.Barrier()
    return _clock()


def gather(comm: Any, rec: Recorder, root: int = 0) -> list[dict[str, Any]] | None:
    """Every rank's :meth:`Recorder.export` on ``root`` (a list by rank), ``None`` elsewhere.

    Collective over ``comm``; buffer-based calls only (no pickled mpi4py collective).
    """
    import numpy as np
    from mpi4py import MPI

    data = np.frombuffer(json.dumps(rec.export()).encode(), dtype=np.uint8)
    n = comm.Get_size()
    counts = np.zeros(n, dtype=np.int64)
    comm.Gather(np.array([data.size], dtype=np.int64), counts, root=root)
    displs = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=displs[1:])
    is_root = comm.Get_rank() == root
    recv = np.empty(int(counts.sum()) if is_root else 0, dtype=np.uint8)
    comm.Gatherv([data, MPI.BYTE], [recv, (counts, displs), MPI.BYTE] if is_root else None,
                 root=root)
    if not is_root:
        return None
    raw = recv.tobytes()
    return [json.loads(raw[int(a):int(a) + int(c)]) for a, c in zip(displs, counts, strict=True)]


# ------------------------------------------------------------------- trace-event JSON


def _pack(spans: list[tuple[float, float]]) -> list[int]:
    """Lane of each span (sorted by start) so that spans in one lane never overlap."""
    ends: list[float] = []
    lanes = []
    for ts, dur in spans:
        for i, e in enumerate(ends):
            if e <= ts:
                ends[i] = ts + dur
                lanes.append(i)
                break
        else:
            ends.append(ts + dur)
            lanes.append(len(ends) - 1)
    return lanes


# The allgather's point-to-point transfers share the ring's send and recv tracks.
_TRACK = {"send": "send", "ag send": "send", "recv": "recv", "ag recv": "recv"}


def chrome(calls: list[tuple[str, list[dict[str, Any]]]],
           meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Chrome/Perfetto trace-event JSON of traced calls, laid out one after another.

    ``calls`` holds ``(label, per-rank exports)`` of each traced call. Ranks are processes
    (``pid`` = rank), threads are threads; transfers, which overlap one another, go on
    tracks of their own per rank (``MPI send k`` / ``MPI recv k`` / ``MPI collective k``),
    packed so that spans on one track never overlap, as the format's complete events need.
    """
    events: list[dict[str, Any]] = []
    offset = 0.0
    tids: dict[tuple[int, str], int] = {}
    names: dict[tuple[int, int], str] = {}
    placed: list[dict[str, Any]] = []
    for label, ranks in calls:
        end = offset
        for pid, exp in enumerate(ranks):
            threads = exp["threads"]
            by_track: dict[str, list[tuple[float, float, dict[str, Any]]]] = {}
            for name, cat, ts, dur, ident, args in exp["events"]:
                ev = {"name": name, "cat": cat, "ph": "X", "ts": ts + offset, "dur": dur,
                      "pid": pid, "args": {**args, "call": label}}
                end = max(end, ts + dur + offset)
                if cat == "transfer":
                    group = _TRACK.get(name, "collective")
                    by_track.setdefault(f"MPI {group}", []).append((ev["ts"], dur, ev))
                else:
                    tname = threads.get(ident, ident)
                    key = (pid, tname)
                    if key not in tids:
                        tids[key] = len([k for k in tids if k[0] == pid]) + 1
                        names[(pid, tids[key])] = tname
                    ev["tid"] = tids[key]
                    events.append(ev)
            for track, spans in by_track.items():
                spans.sort(key=lambda s: s[0])
                for lane, (_, _, ev) in zip(_pack([(s[0], s[1]) for s in spans]), spans,
                                            strict=True):
                    tname = f"{track} {lane}"
                    key = (pid, tname)
                    if key not in tids:
                        tids[key] = 1000 + len([k for k in tids if k[0] == pid])
                        names[(pid, tids[key])] = tname
                    ev["tid"] = tids[key]
                    events.append(ev)
        placed.append({"call": label, "start_us": offset, "end_us": end})
        offset = end + max(100.0, 0.05 * (end - offset))
    n_ranks = max((len(r) for _, r in calls), default=0)
    header: list[dict[str, Any]] = []
    for pid in range(n_ranks):
        header.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {pid}"}})
        header.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
    for (pid, tid), tname in sorted(names.items()):
        header.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": tname}})
        header.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    return {"traceEvents": header + events, "displayTimeUnit": "ms",
            "otherData": {**(meta or {}), "calls": placed}}


# ------------------------------------------------------------------------------ PNG

_COLOURS = {
    "compress": "#e6550d", "prepare": "#fdae6b", "combine": "#d62728", "decode": "#2ca02c",
    "pack": "#8c564b", "send": "#1f77b4", "recv": "#17becf", "ag send": "#6baed6",
    "ag recv": "#9edae5", "allgather sizes": "#9467bd",
    "allgatherv": "#9467bd", "sleep": "#c7c7c7", "wait worker": "#7f7f7f", "wait": "#bcbd22",
}
_STAGE_COLOUR = "#dadaeb"


def plot(doc: dict[str, Any], path: str, title: str = "") -> None:
    """Draw the spans of a :func:`chrome` document: one row per rank and thread (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tnames: dict[tuple[int, int], str] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name":
            tnames[(e["pid"], e["tid"])] = e["args"]["name"]
    # One row per rank and thread; all of a rank's send (recv, collective) tracks share one.
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] != "X":
            continue
        t = tnames.get((e["pid"], e["tid"]), str(e["tid"]))
        label = t.rsplit(" ", 1)[0] if t.startswith("MPI ") else t
        rows.setdefault((e["pid"], label), []).append(e)

    def order(k: tuple[int, str]) -> tuple[int, int, str]:
        return (k[0], 1 if k[1].startswith("MPI ") else 0, k[1])

    keys = sorted(rows, key=order)
    fig_h = 1.2 + 0.55 * len(keys)
    fig, ax = plt.subplots(figsize=(13, fig_h))
    used: set[str] = set()
    yticks, ylabels = [], []
    labels: list[tuple[dict[str, Any], float]] = []
    for i, key in enumerate(keys):
        y = len(keys) - 1 - i
        evs = sorted(rows[key], key=lambda e: (e["ts"], -e["dur"]))
        stages = [e for e in evs if e["cat"] == "stage"]
        leaves = [e for e in evs if e["cat"] != "stage"]
        # Stages (check, agree, the data stage and its parts) as thin bands on top of the
        # row, nested ones below their parent; the leaf spans fill the rest.
        slanes = _pack([(e["ts"], e["dur"]) for e in stages])
        top = 0.45
        for e, lane in zip(stages, slanes, strict=True):
            y0 = y + top - (lane + 1) * 0.13
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y0, 0.11),
                           facecolors=_STAGE_COLOUR, edgecolors="#54278f", linewidth=0.5)
            labels.append((e, y0 + 0.055))
        bottom = y + top - (max(slanes, default=-1) + 1) * 0.13 - 0.02
        lanes = _pack([(e["ts"], e["dur"]) for e in leaves])
        nl = max(lanes, default=0) + 1
        h = (bottom - (y - 0.45)) / nl
        for e, lane in zip(leaves, lanes, strict=True):
            used.add(e["name"])
            ax.broken_barh([(e["ts"] / 1e3, max(e["dur"], 0.5) / 1e3)],
                           (y - 0.45 + lane * h, h * 0.9),
                           facecolors=_COLOURS.get(e["name"], "#333333"), linewidth=0)
        yticks.append(y)
        ylabels.append(f"rank {key[0]} · {key[1]}")
    span_ms = max((e["ts"] + e["dur"] for e in doc["traceEvents"] if e["ph"] == "X"),
                  default=1.0) / 1e3
    ax.set_xlim(0, span_ms * 1.01)
    for e, yt in labels:  # name the stages wide enough to hold it
        if e["dur"] / 1e3 > span_ms * 0.06:
            ax.text((e["ts"] + e["dur"] / 2) / 1e3, yt, e["name"], ha="center", va="center",
                    fontsize=7, color="#3f007d")
    for c in doc.get("otherData", {}).get("calls", [])[1:]:
        ax.axvline(c["start_us"] / 1e3, color="k", lw=0.6, ls=":")
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_ylim(-0.6, len(keys) - 0.4)
    ax.set_xlabel("time since the barrier that started the call (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=_COLOURS[k], label=k) for k in _COLOURS if k in used]
    handles.append(Patch(facecolor=_STAGE_COLOUR, edgecolor="#54278f", label="stage"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / fig_h * 2.2),
              ncol=min(len(handles), 8), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
