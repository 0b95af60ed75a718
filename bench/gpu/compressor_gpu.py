"""GPU check of the ccoll compressor: byte equality with the CPU backend, then throughput.

1. Versions and the GPU.
2. Real gradients (datasets/*.h5, every step_XXXX group, tensors concatenated): at REL
   1e-2, 1e-3, 1e-4 and for each stream format version (``--versions``, 1 and 2) the CUDA
   stream must equal the CPU stream byte for byte, decode to the same bytes on both
   backends (each decoding the other's stream), stay within the bound, and the homomorphic
   sum of two steps must equal the CPU sum. CuPy and PyTorch inputs must give the same
   bytes as numba device arrays.
3. Throughput on >= 1 GiB of float32 tiled from the dumps (several input buffers, so L2
   holds none of them), per REL and format version: compress (end to end, and for version
   1 the compression kernel alone), decompress (into a preallocated output), add; CUDA
   events, warm-up, median of --reps runs. A device-to-device copy gives the bandwidth
   floor of each figure: the bytes it must move (read input + write output) at copy
   bandwidth.

Everything prints as it is measured, and the results go to $OUT/compressor_gpu.json (if
OUT is set) after every section, so a failure or timeout still leaves partial results.
Exit status 1 if any equality check failed.

Run with bench/gpu/run.sh on a GPU machine. Without one, ``--tiny --simulator`` runs the
same code on the numba CUDA simulator with tiny sizes (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELS = (1e-2, 1e-3, 1e-4)
T0 = time.monotonic()
RESULTS: dict[str, Any] = {"versions": {}, "gpu": {}, "equality": [], "throughput": [],
                           "errors": []}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of float32 per input buffer")
    ap.add_argument("--buffers", type=int, default=3, help="distinct input buffers, rotated")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per figure (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget", type=float, default=270.0,
                    help="seconds; later sections are skipped once it is spent")
    ap.add_argument("--versions", default="1,2",
                    help="stream format versions to check and time, comma-separated")
    ap.add_argument("--sections", default="equality,throughput",
                    help="which of equality and throughput to run, comma-separated")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (for the simulator)")
    ap.add_argument("--simulator", action="store_true",
                    help="run on the numba CUDA simulator (sets NUMBA_ENABLE_CUDASIM=1)")
    return ap.parse_args()


ARGS = parse_args()
try:
    VERSIONS = tuple(int(v) for v in ARGS.versions.split(","))
except ValueError:
    VERSIONS = ()
if not VERSIONS or any(v not in (1, 2) for v in VERSIONS):
    sys.exit(f"--versions: a comma-separated list of 1 and 2, got {ARGS.versions!r}")
SECTIONS = set(ARGS.sections.split(","))
if not SECTIONS or not SECTIONS <= {"equality", "throughput"}:
    sys.exit(f"--sections: a comma-separated list of equality and throughput, got "
             f"{ARGS.sections!r}")
if ARGS.simulator:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
if ARGS.tiny:
    # The simulator runs ~1 ms per warp intrinsic: a few thread blocks per operation.
    ARGS.gib = 2048 * 4 / 2**30
    ARGS.reps, ARGS.warmup, ARGS.buffers = 2, 1, 2
    RELS = (1e-3,)
TINY_N = 64
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def say(*a: Any) -> None:
    print(*a, flush=True)


def left() -> float:
    return ARGS.budget - (time.monotonic() - T0)


def save() -> None:
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "compressor_gpu.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def section(name: str, fn: Callable[[], None], need_s: float = 0.0) -> None:
    say(f"\n== {name} (t={time.monotonic() - T0:.0f}s)")
    if left() < need_s:
        say(f"skipped: {left():.0f}s of the budget left, {need_s:.0f}s needed")
        RESULTS["errors"].append(f"{name}: skipped (budget)")
        save()
        return
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - report and go on to the next section
        say(f"FAILED: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        RESULTS["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
    save()


def import_ccoll() -> Any:
    """ccoll's compressor; without mpi4py, load the package without its MPI parts."""
    try:
        import ccoll  # noqa: F401
    except ImportError as exc:
        if "mpi4py" not in str(exc):
            raise
        import types

        say(f"note: `import ccoll` failed ({exc}); loading ccoll.compressor alone")
        for k in [k for k in sys.modules if k == "ccoll" or k.startswith("ccoll.")]:
            del sys.modules[k]
        pkg = types.ModuleType("ccoll")
        pkg.__path__ = [os.path.join(ROOT, "ccoll")]  # type: ignore[attr-defined]
        sys.modules["ccoll"] = pkg
    from ccoll.compressor import _cuda
    from ccoll.compressor import cpu as _cpu

    return _cpu, _cuda


# ------------------------------------------------------------------------------ sections


def versions() -> None:
    v = RESULTS["versions"]
    v["python"] = sys.version.split()[0]
    v["platform"] = platform.platform()
    v["numpy"] = np.__version__
    for mod in ("numba", "numba_cuda", "cupy", "torch", "h5py"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            v[mod] = f"unavailable ({type(exc).__name__})"
    if not ARGS.simulator:
        from numba import cuda

        for key, get in (("cuda_driver", lambda: cuda.cudadrv.driver.driver.get_version()),
                         ("cuda_runtime", lambda: cuda.runtime.get_version())):
            try:
                v[key] = get()
            except Exception as exc:  # noqa: BLE001
                v[key] = f"unknown ({type(exc).__name__})"
    for k, val in v.items():
        say(f"{k:>14}: {val}")


def gpu_info() -> None:
    from numba import cuda

    g = RESULTS["gpu"]
    if ARGS.simulator:
        g["name"] = "numba CUDA simulator"
    else:
        dev = cuda.get_current_device()
        free, total = cuda.current_context().get_memory_info()
        g.update(name=dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
                 cc=f"{dev.compute_capability[0]}.{dev.compute_capability[1]}",
                 sms=dev.MULTIPROCESSOR_COUNT, mem_total_gib=total / 2**30,
                 mem_free_gib=free / 2**30)
    for k, val in g.items():
        say(f"{k:>14}: {val}")


DUMPS: list[tuple[str, np.ndarray]] = []


def load_dumps() -> None:
    files = sorted(glob.glob(os.path.join(ROOT, "datasets", "*.h5")))
    try:
        import h5py
    except ImportError:
        h5py = None
    if h5py is None or not files:
        say("no real dumps readable (h5py missing or no datasets/*.h5): synthetic gradients")
        rng = np.random.default_rng(0)
        for i in range(2):
            x = (rng.standard_t(3, 1 << 20) * 1e-3).astype(np.float32)
            x[rng.random(x.size) < 0.3] = 0
            DUMPS.append((f"synthetic/{i}", x))
        RESULTS["data"] = "synthetic (h5py missing)"
        return
    for f in files:
        with h5py.File(f, "r") as h:
            for step in sorted(k for k in h.keys() if k.startswith("step_")):
                parts: list[np.ndarray] = []

                def visit(name: str, obj: Any, parts: list[np.ndarray] = parts) -> None:
                    if isinstance(obj, h5py.Dataset) and obj.dtype == np.float32:
                        parts.append(np.asarray(obj[()], np.float32).reshape(-1))

                h[step].visititems(visit)
                if parts:
                    DUMPS.append((f"{os.path.basename(f)}/{step}", np.concatenate(parts)))
    RESULTS["data"] = [(name, int(x.size)) for name, x in DUMPS]
    for name, x in DUMPS:
        say(f"{name}: {x.size} float32")


def equality(_cpu: Any, _cuda: Any) -> None:
    from numba import cuda

    import ccoll.errorbound as ebm

    bad = 0
    # Per file: every step at every bound; the sum of the first two steps.
    by_file: dict[str, list[tuple[str, np.ndarray]]] = {}
    for name, x in DUMPS:
        if ARGS.tiny:
            x = x[:TINY_N]
        by_file.setdefault(name.split("/")[0], []).append((name, x))
    say(f"{'data':<28} {'rel':>6} {'v':>2} {'ratio':>7} {'max|err|/eb':>11}  "
        "compress decode add")
    for steps, rel, v in [(st, r, v) for st in by_file.values() for r in RELS for v in VERSIONS]:
        if left() < 20:
            raise TimeoutError("budget spent during the equality checks")
        eb = ebm.REL(rel).resolve(*_cpu.finite_range(steps[0][1]))
        streams = []
        for name, x in steps[: 2 if ARGS.tiny else len(steps)]:
            d = cuda.to_device(x)
            g = _cuda.compress_abs(d, eb, version=v).copy_to_host()
            c = _cpu.compress_abs(x, eb, version=v)
            ok_c = g.tobytes() == c.tobytes()
            y_g = _cuda.decompress(cuda.to_device(c)).copy_to_host()  # GPU decodes CPU's
            y_c = _cpu.decompress(g)  # CPU decodes GPU's
            ok_d = y_g.tobytes() == y_c.tobytes()
            err = float(np.max(np.abs(y_g.astype(np.float64) - x))) if x.size else 0.0
            ok_b = err <= eb
            streams.append((g, c))
            ok_a = None
            if len(streams) == 2:
                s_g = _cuda.add(cuda.to_device(streams[0][0]),
                                cuda.to_device(streams[1][0])).copy_to_host()
                s_c = _cpu.add(streams[0][1], streams[1][1])
                ok_a = s_g.tobytes() == s_c.tobytes()
            ratio = x.nbytes / max(g.size, 1)
            flags = " ".join("ok" if ok else ("-" if ok is None else "DIFF")
                             for ok in (ok_c, ok_d, ok_a))
            say(f"{name:<28} {rel:>6.0e} {v:>2} {ratio:>7.2f} {err / eb:>11.4f}  {flags}"
                + ("" if ok_b else "  BOUND EXCEEDED"))
            row = dict(data=name, rel=rel, version=v, eb=eb, ratio=ratio, max_err_over_eb=err / eb,
                       stream_equal=ok_c, decode_equal=ok_d, add_equal=ok_a,
                       within_bound=ok_b)
            RESULTS["equality"].append(row)
            bad += (not ok_c) + (not ok_d) + (ok_a is False) + (not ok_b)
    RESULTS["equality_failures"] = bad
    if bad:
        raise AssertionError(f"{bad} equality/bound check(s) failed")


def interop(_cuda: Any) -> None:
    """CuPy arrays and PyTorch tensors give the bytes numba device arrays give."""
    from numba import cuda

    x = DUMPS[0][1][: 1 << 16]
    ref = _cuda.compress_abs(cuda.to_device(x), 1e-4).copy_to_host()
    for mod in ("cupy", "torch"):
        try:
            m = __import__(mod)
        except ImportError:
            say(f"{mod}: not installed, skipped")
            continue
        if mod == "cupy":
            arr = m.asarray(x)
            got = m.asnumpy(_cuda.compress_abs(arr, 1e-4))
            y = m.asnumpy(_cuda.decompress(m.asarray(ref)))
        else:
            arr = m.from_numpy(x).cuda()
            got = _cuda.compress_abs(arr, 1e-4).cpu().numpy()
            y = _cuda.decompress(m.from_numpy(ref).cuda()).cpu().numpy()
        ok = got.tobytes() == ref.tobytes() and y.tobytes() == _cpu_decode(ref)
        say(f"{mod}: {'ok' if ok else 'DIFF'} (type out: {type(_cuda.compress_abs(arr, 1e-4))})")
        RESULTS.setdefault("interop", {})[mod] = ok
        if not ok:
            raise AssertionError(f"{mod} input gives different bytes")


def _cpu_decode(buf: np.ndarray) -> bytes:
    from ccoll.compressor import cpu as _cpu

    return _cpu.decompress(buf).tobytes()


class Timer:
    """CUDA events on a stream (wall clock in the simulator, whose events carry no time)."""

    def __init__(self, stream: Any) -> None:
        self.s = stream

    def __call__(self, fn: Callable[[int], Any], reps: int, warmup: int) -> list[float]:
        from numba import cuda

        for i in range(warmup):
            fn(i)
        self.s.synchronize()
        ms = []
        for i in range(reps):
            if left() < 5:
                break
            if ARGS.simulator:
                t = time.perf_counter()
                fn(i)
                ms.append((time.perf_counter() - t) * 1e3)
                continue
            e0, e1 = cuda.event(), cuda.event()
            e0.record(self.s)
            fn(i)
            e1.record(self.s)
            e1.synchronize()
            ms.append(cuda.event_elapsed_time(e0, e1))
        return ms


def throughput(_cuda: Any) -> None:
    from numba import cuda

    import ccoll.errorbound as ebm

    n = int(ARGS.gib * 2**30) // 4
    n -= n % 1024
    base = np.concatenate([x for _, x in DUMPS])
    say(f"input: {ARGS.buffers} buffers of {n} float32 ({n * 4 / 2**30:.3f} GiB), tiled from "
        f"{base.size} gradient values")
    s = cuda.stream()
    d_base = cuda.to_device(base, stream=s)
    bufs = []
    for k in range(ARGS.buffers):
        b = cuda.device_array(n, np.float32, stream=s)
        pos, off = 0, (k * 7919) % base.size  # each buffer starts elsewhere in the data
        while pos < n:
            m = min(n - pos, base.size - off)
            b[pos : pos + m].copy_to_device(d_base[off : off + m], stream=s)
            pos += m
            off = 0
        bufs.append(b)
    s.synchronize()
    timer = Timer(s)
    nbytes = n * 4

    dst = cuda.device_array(n, np.float32, stream=s)
    t_copy = statistics.median(timer(lambda i: dst.copy_to_device(bufs[i % len(bufs)], stream=s),
                                     ARGS.reps, ARGS.warmup))
    copy_bw = 2 * nbytes / (t_copy * 1e-3)  # bytes/s, read + write
    RESULTS["copy"] = dict(bytes=nbytes, ms=t_copy, GBps_moved=copy_bw / 1e9)
    say(f"device-to-device copy of {nbytes / 2**30:.3f} GiB: {t_copy:.3f} ms, "
        f"{copy_bw / 1e9:.1f} GB/s moved (read + write)")
    lo, hi = _cuda.finite_range(bufs[0], stream=s)

    rows = []
    hdr = (f"{'op':<16} {'rel':>6} {'v':>2} {'ratio':>7} {'median ms':>10} {'GB/s':>8} "
           f"{'floor ms':>9} {'x floor':>8} {'runs':>5}")
    say(hdr)

    def emit(op: str, rel: float, v: int, ratio: float, ms: list[float], moved: float) -> None:
        med = statistics.median(ms) if ms else math.nan
        floor = moved / copy_bw * 1e3
        row = dict(op=op, rel=rel, version=v, ratio=ratio, median_ms=med,
                   GBps=nbytes / (med * 1e-3) / 1e9, floor_ms=floor, x_floor=med / floor,
                   runs=len(ms), bytes_moved_floor=moved,
                   min_ms=min(ms) if ms else math.nan, max_ms=max(ms) if ms else math.nan)
        rows.append(row)
        RESULTS["throughput"].append(row)
        say(f"{op:<16} {rel:>6.0e} {v:>2} {ratio:>7.2f} {med:>10.3f} {row['GBps']:>8.1f} "
            f"{floor:>9.3f} {row['x_floor']:>8.2f} {len(ms):>5}")
        save()

    work = _cuda._work(s)
    flats = [b.view(np.int32) for b in bufs]
    nb = len(bufs)
    for rel, v in [(r, v) for r in RELS for v in VERSIONS]:
        if left() < 30:
            say(f"budget: skipping REL {rel:g} version {v} and what follows")
            RESULTS["errors"].append(f"throughput: REL {rel:g} version {v} on skipped (budget)")
            break
        eb = ebm.REL(rel).resolve(lo, hi)
        cs = [_cuda.compress_abs(b, eb, stream=s, version=v) for b in bufs]
        c_mean = sum(int(c.size) for c in cs) / nb
        ratio = nbytes / c_mean

        def comp(i: int, eb: float = eb, v: int = v) -> Any:
            return _cuda.compress_abs(bufs[i % nb], eb, stream=s, version=v)

        def comp_kernel(i: int, eb: float = eb) -> None:
            _cuda._launch_compress(work, flats[i % nb], n, eb, s)

        def decomp(i: int, cs: list[Any] = cs) -> Any:
            return _cuda.decompress(cs[i % nb], out=dst, stream=s)

        def add(i: int, cs: list[Any] = cs) -> Any:
            return _cuda.add(cs[i % nb], cs[(i + 1) % nb], stream=s)

        emit("compress", rel, v, ratio, timer(comp, ARGS.reps, ARGS.warmup), nbytes + c_mean)
        if v == 1:  # the version-1 kernel alone (version 2 runs more than one kernel)
            emit("compress kernel", rel, v, ratio, timer(comp_kernel, ARGS.reps, ARGS.warmup),
                 nbytes + c_mean)
        emit("decompress", rel, v, ratio, timer(decomp, ARGS.reps, ARGS.warmup),
             c_mean + nbytes)
        s_mean = sum(int(add(i).size) for i in range(nb)) / nb
        emit("add", rel, v, nbytes / s_mean, timer(add, ARGS.reps, ARGS.warmup),
             2 * c_mean + s_mean)
        cs.clear()  # free this bound's streams before the next one

    say("\n" + hdr)
    for r in rows:
        say(f"{r['op']:<16} {r['rel']:>6.0e} {r['version']:>2} {r['ratio']:>7.2f} "
            f"{r['median_ms']:>10.3f} {r['GBps']:>8.1f} {r['floor_ms']:>9.3f} "
            f"{r['x_floor']:>8.2f} {r['runs']:>5}")
    say("GB/s: uncompressed float32 bytes per second. floor: bytes the operation must move "
        "(compress: input + stream; decompress: stream + output; add: two streams + sum) at the "
        "device-to-device copy bandwidth.")


def main() -> int:
    say(f"ccoll compressor GPU check ({'simulator, ' if ARGS.simulator else ''}"
        f"{'tiny' if ARGS.tiny else f'{ARGS.gib:g} GiB x {ARGS.buffers}'}, budget "
        f"{ARGS.budget:.0f}s)")
    if ARGS.simulator:
        sys.path.insert(0, os.path.join(ROOT, "tests", "cuda"))
        import warp_shim

        warp_shim.install()
    section("versions", versions)
    section("gpu", gpu_info)
    mods: list[Any] = []
    section("import ccoll", lambda: mods.extend(import_ccoll()))
    if not mods:
        return 2
    _cpu, _cuda = mods
    section("gradient dumps", load_dumps)
    if not DUMPS:
        return 2
    if "equality" in SECTIONS:
        section("GPU vs CPU byte equality on real gradients", lambda: equality(_cpu, _cuda), 30)
        if not ARGS.simulator:
            section("CuPy / PyTorch inputs", lambda: interop(_cuda), 20)
    if "throughput" in SECTIONS:
        section("throughput", lambda: throughput(_cuda), 40)
    RESULTS["elapsed_s"] = time.monotonic() - T0
    save()
    failed = RESULTS.get("equality_failures", 0) or any(
        v is False for v in RESULTS.get("interop", {}).values())
    say(f"\ndone in {RESULTS['elapsed_s']:.0f}s; {len(RESULTS['errors'])} section error(s); "
        f"equality {'FAILED' if failed else 'ok'}")
    return 1 if failed or RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
