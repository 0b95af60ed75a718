"""The tracer of ccoll's collectives on one process: on/off, spans, trace-event JSON, PNG."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ccoll.collectives import trace

REPO = Path(__file__).resolve().parent.parent


def test_off_by_default_and_restored_after_an_error() -> None:
    assert trace.ACTIVE is None
    with pytest.raises(RuntimeError, match="boom"), trace.tracing() as rec:
        assert trace.ACTIVE is rec
        raise RuntimeError("boom")
    assert trace.ACTIVE is None


def test_nested_tracing_restores_the_outer_recorder() -> None:
    with trace.tracing() as outer:
        with trace.tracing() as inner:
            assert trace.ACTIVE is inner and inner is not outer
        assert trace.ACTIVE is outer
    assert trace.ACTIVE is None


def test_spans_record_thread_times_and_args() -> None:
    with trace.tracing() as rec:
        t0 = rec.clock()
        rec.span("sleep", t0, t0 + 1e-3)
        fn = rec.task(lambda: 42, "compress", {"chunk": 3, "step": 0})
        out: list[int] = []
        th = threading.Thread(target=lambda: out.append(fn()), name="side")
        th.start()
        th.join()
    assert out == [42]
    exp = rec.export()
    (sleep,) = [e for e in exp["events"] if e[0] == "sleep"]
    (comp,) = [e for e in exp["events"] if e[0] == "compress"]
    assert sleep[1] == "wait" and sleep[3] == pytest.approx(1000.0)
    assert comp[1] == "compute" and comp[5]["chunk"] == 3 and comp[5]["queued_us"] >= 0
    assert exp["threads"][sleep[4]] == threading.current_thread().name
    assert exp["threads"][comp[4]] == "side"
    assert sleep[2] >= 0 and comp[2] >= sleep[2]


def test_a_task_that_raises_is_still_recorded() -> None:
    def bad() -> None:
        raise ValueError("no")

    with trace.tracing() as rec:
        with pytest.raises(ValueError):
            rec.task(bad, "combine", {"chunk": 0})()
    assert [e[0] for e in rec.events] == ["combine"]


def _exports() -> list[dict]:
    """Two ranks' exports with nested stages, a worker and overlapping transfers."""
    ranks = []
    for r in range(2):
        with trace.tracing() as rec:
            o = rec.origin
            rec.span("allreduce", o + 0.001, o + 0.010)
            rec.span("reduce-scatter", o + 0.001, o + 0.006)
            rec.span("sleep", o + 0.002, o + 0.003)
            # three sends in flight at once: not nested, they must go on separate tracks
            for c in range(3):
                rec.span("send", o + 0.001 + c * 1e-3, o + 0.004 + c * 1e-3,
                         {"step": 0, "chunk": c, "bytes": 100})
            fn = rec.task(lambda: None, "decode", {"chunk": r})
            th = threading.Thread(target=fn, name="ccoll-sync-worker")
            th.start()
            th.join()
        ranks.append(rec.export())
    return ranks


def test_chrome_document_is_valid_trace_event_json() -> None:
    doc = json.loads(json.dumps(trace.chrome([("call a", _exports()), ("call b", _exports())])))
    evs = doc["traceEvents"]
    xs = [e for e in evs if e["ph"] == "X"]
    meta = [e for e in evs if e["ph"] == "M"]
    assert len(xs) == 2 * 2 * 7
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    for e in xs:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["ts"] >= 0 and e["dur"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert (e["pid"], e["tid"]) in threads, e
    assert {threads[(e["pid"], e["tid"])] for e in xs if e["name"] == "decode"} == {
        "ccoll-sync-worker"}
    # Complete events on one track nest properly or do not overlap.
    by_track: dict[tuple[int, int], list[dict]] = {}
    for e in xs:
        by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs_t in by_track.values():
        stack: list[float] = []
        for e in sorted(evs_t, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-6, evs_t
            stack.append(e["ts"] + e["dur"])
    sends = [e for e in xs if e["name"] == "send" and e["pid"] == 0]
    assert len({e["tid"] for e in sends if e["args"]["call"] == "call a"}) == 3
    # The second call is laid after the first.
    calls = doc["otherData"]["calls"]
    assert [c["call"] for c in calls] == ["call a", "call b"]
    assert calls[1]["start_us"] > calls[0]["end_us"]
    assert min(e["ts"] for e in xs if e["args"]["call"] == "call b") >= calls[1]["start_us"]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "t.png"
    trace.plot(trace.chrome([("call", _exports())]), str(out), "title")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_tracing_off_costs_no_clock_read_at_any_span_site() -> None:
    """Every clock read and span of the instrumented modules sits behind a recorder test.

    Read from the source: a call of ``rec.clock()``, ``rec.span()`` or ``rec.task()`` must
    be inside an ``if rec is not None`` (or the ``... if rec is not None else ...``
    expression), so with tracing off none of them runs.
    """
    files = ["ring.py", "waiting.py", "gather.py", "calls.py", "prepare.py", "hier.py"]
    for name in files:
        tree = ast.parse((REPO / "ccoll" / "collectives" / name).read_text())
        guarded: set[int] = set()
        for node in ast.walk(tree):
            test = getattr(node, "test", None)
            if isinstance(node, (ast.If, ast.IfExp)) and isinstance(test, ast.Compare) and (
                isinstance(test.left, ast.Name) and test.left.id == "rec"
                and isinstance(test.ops[0], ast.IsNot)
            ):
                body = node.body if isinstance(node, ast.If) else [node.body]
                for part in body:
                    guarded.update(id(n) for n in ast.walk(part))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                 and n.func.value.id == "rec"]
        assert calls, name
        loose = [ast.unparse(c) for c in calls if id(c) not in guarded]
        assert not loose, f"{name}: unguarded tracer calls {loose}"


MPIEXEC = REPO / ".venv" / "bin" / "mpiexec"


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (run `make venv`)")
def test_bench_trace_cli_at_two_ranks(tmp_path: Path) -> None:
    out, png, rows = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "b.json"
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "ccoll.cli", "bench",
           "allreduce", "-b", "4K", "-e", "64K", "-f", "16", "-n", "2", "-w", "1",
           "--no-model", "--algorithms", "mpi,homomorphic", "--json", str(rows),
           "--trace", str(out), "--trace-png", str(png)]
    env = {**os.environ, "CCOLL_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    calls = doc["otherData"]["calls"]
    assert [c["call"] for c in calls] == [f"allreduce homomorphic {s} B" for s in (4096, 65536)]
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for c in calls:
        mine = [e for e in xs if e["args"]["call"] == c["call"]]
        for pid in (0, 1):
            names = {e["name"] for e in mine if e["pid"] == pid}
            assert {"agree", "allreduce", "compress", "combine", "decode", "send",
                    "recv"} <= names, (c, pid, names)
        assert all(c["start_us"] <= e["ts"] and e["dur"] >= 0 for e in mine)
    assert png.read_bytes()[:4] == b"\x89PNG"
    # The bench's own JSON keeps rows and metadata only, not the trace.
    assert "trace" not in json.loads(rows.read_text())["meta"]
    bad = subprocess.run(cmd[:10] + ["-b", "4K", "-e", "4K", "--algorithms", "mpi",
                                   "--trace", str(out)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert bad.returncode == 2 and "add a ccoll algorithm" in bad.stderr, bad.stderr[-2000:]
