"""Compressor benchmark: ccoll (CPU) against SZ3 and ZFP on the real gradient dumps.

For every tensor of the HDF5 dumps (groups ``step_XXXX`` of float32 datasets) and for each
dump's concatenation, at each REL bound (resolved to one absolute bound, used by every
codec): compression ratio, max |err| / eb, PSNR, compress and decompress throughput with
1 and 2 numba threads, side by side with SZ3 (pysz, ABS mode, same bound) and ZFP (zfpy,
tolerance = same bound; its measured max error is reported, it may exceed the bound),
plus ccoll followed by zstd (level 1) as a separate row. Peak extra memory of compress and
decompress is measured in a fresh subprocess per codec as the ru_maxrss increase over the
process's resident size just before the call (data read with ``read_direct`` into one
preallocated array, kernels warmed up on a small input first, so no earlier peak hides
the call's). Also the predictor study: how often per-block Lorenzo is chosen and the
ratio with Lorenzo disabled or forced, computed from the quantized values in numpy.

Writes ``compressor.md`` (tables), ``compressor.json`` (every number) and
``compressor_rd.png`` (rate-distortion) to ``--out`` (default bench/out/).

    python bench/compressor.py                  # everything (a few minutes on 2 cores)
    python bench/compressor.py --quick          # fewer repeats, no per-tensor timings
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import h5py
import numba
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ccoll  # noqa: E402
from ccoll.compressor import compress_abs, decompress  # noqa: E402
from ccoll.compressor import cpu as _cpu  # noqa: E402
from ccoll.compressor import format as fmt  # noqa: E402

DEFAULT_FILES = [os.path.join(ROOT, "datasets", "minilm.h5"),
                 os.path.join(ROOT, "datasets", "digits_cnn.h5")]
RD_RELS = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5]


# ----------------------------------------------------------------------------- data


def tensor_names(path: str) -> list[str]:
    names: list[str] = []
    with h5py.File(path, "r") as f:
        for step in sorted(k for k in f if k.startswith("step_")):
            for k, d in f[step].items():
                if isinstance(d, h5py.Dataset) and d.dtype == np.float32:
                    names.append(f"{step}/{k}")
    return names


def load_concat(path: str) -> np.ndarray:
    """Every tensor of a dump, flattened and concatenated, read straight into one array."""
    names = tensor_names(path)
    with h5py.File(path, "r") as f:
        sizes = [f[k].size for k in names]
        out = np.empty(sum(sizes), np.float32)
        pos = 0
        for k, sz in zip(names, sizes):  # noqa: B905
            if sz:
                f[k].read_direct(out[pos : pos + sz].reshape(f[k].shape))
            pos += sz
    return out


def load_tensors(path: str) -> list[tuple[str, np.ndarray]]:
    with h5py.File(path, "r") as f:
        return [(k, f[k][()]) for k in tensor_names(path)]


# --------------------------------------------------------------------------- codecs


def sz3_codec(eb: float) -> tuple[Callable, Callable]:
    import pysz

    cfg = pysz.szConfig()
    cfg.errorBoundMode = pysz.szErrorBoundMode.ABS
    cfg.absErrorBound = eb

    def enc(x: np.ndarray) -> Any:
        return pysz.sz.compress(x, cfg)[0]

    def dec(buf: Any, like: np.ndarray) -> np.ndarray:
        return pysz.sz.decompress(buf, like.dtype, like.shape)[0]

    return enc, dec


def zfp_codec(eb: float) -> tuple[Callable, Callable]:
    import zfpy

    return (lambda x: zfpy.compress_numpy(x, tolerance=eb),
            lambda buf, like: zfpy.decompress_numpy(buf))


def ccoll_codec(eb: float) -> tuple[Callable, Callable]:
    return (lambda x: compress_abs(x, eb), lambda buf, like: decompress(buf))


def ccoll_v2_codec(eb: float) -> tuple[Callable, Callable]:
    """Stream format version 2 (docs/format.md): v1's values in fewer bytes."""
    return (lambda x: compress_abs(x, eb, version=2), lambda buf, like: decompress(buf))


def ccoll_zstd_codec(eb: float) -> tuple[Callable, Callable]:
    import zstandard

    cz = zstandard.ZstdCompressor(level=1)
    dz = zstandard.ZstdDecompressor()
    return (lambda x: cz.compress(compress_abs(x, eb).data),
            lambda buf, like: decompress(np.frombuffer(dz.decompress(buf), np.uint8)))


CODECS: dict[str, Callable[[float], tuple[Callable, Callable]]] = {
    "ccoll": ccoll_codec,
    "ccoll v2": ccoll_v2_codec,
    "ccoll+zstd": ccoll_zstd_codec,
    "SZ3": sz3_codec,
    "ZFP": zfp_codec,
}
THREADED = {"ccoll", "ccoll v2", "ccoll+zstd"}


def nbytes(buf: Any) -> int:
    return buf.nbytes if isinstance(buf, np.ndarray) else len(buf)


def best_time(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Best wall-clock time and best CPU time of the calling thread over ``repeat`` runs.

    The CPU time (``time.thread_time``) of a single-threaded call does not count time the
    thread spent waiting for a core, so it stays meaningful on a loaded machine; it counts
    only the calling thread, so it is used for 1-thread figures only.
    """
    fn()  # warm-up (and numba compilation on the first call)
    wall = cpu = math.inf
    for _ in range(repeat):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        cpu = min(cpu, time.thread_time() - c)
        wall = min(wall, time.perf_counter() - t)
    return wall, cpu


def quality(x: np.ndarray, y: np.ndarray, eb: float) -> dict[str, float]:
    xf = x.astype(np.float64).ravel()
    yf = np.asarray(y, np.float64).ravel()
    fin = np.isfinite(xf)
    err = np.abs(yf[fin] - xf[fin])
    maxerr = float(err.max()) if err.size else 0.0
    rng = float(xf[fin].max() - xf[fin].min()) if err.size else 0.0
    mse = float(np.mean(err**2)) if err.size else 0.0
    psnr = math.inf if mse == 0 or rng == 0 else 20 * math.log10(rng) - 10 * math.log10(mse)
    return {"max_err_over_eb": maxerr / eb if eb else 0.0, "psnr_db": psnr}


def measure(codec: str, x: np.ndarray, eb: float, threads: list[int], repeat: int,
            timing: bool = True) -> dict[str, Any]:
    enc, dec = CODECS[codec](eb)
    buf = enc(x)
    y = dec(buf, x)
    row: dict[str, Any] = {"codec": codec, "ratio": x.nbytes / nbytes(buf),
                           "bytes": nbytes(buf), "input_bytes": x.nbytes, **quality(x, y, eb)}
    if timing:
        merge_times(row, times(codec, x, eb, buf, threads, repeat))
    return row


def times(codec: str, x: np.ndarray, eb: float, buf: Any, threads: list[int],
          repeat: int) -> dict[str, float]:
    """Best wall (and 1-thread CPU) seconds of compress and decompress per thread count."""
    enc, dec = CODECS[codec](eb)
    out: dict[str, float] = {}
    for t in threads if codec in THREADED else [1]:
        numba.set_num_threads(t)
        wc, cc = best_time(lambda: enc(x), repeat)
        wd, cd = best_time(lambda: dec(buf, x), repeat)
        out[f"comp_{t}t"], out[f"decomp_{t}t"] = wc, wd
        if t == 1:  # CPU time of the calling thread: meaningful for one thread only
            out["comp_1t_cpu"], out["decomp_1t_cpu"] = cc, cd
    numba.set_num_threads(max(threads))
    return out


def merge_times(row: dict[str, Any], secs: dict[str, float]) -> None:
    """Keep the best time of each figure in ``row["secs"]`` and the GB/s derived from it."""
    best = row.setdefault("secs", {})
    for k, v in secs.items():
        best[k] = min(best.get(k, math.inf), v)
        kind, threads = k.split("_", 1)
        row[f"{kind}_gbs_{threads}"] = row["input_bytes"] / max(best[k], 1e-9) / 1e9


# --------------------------------------------------------------------- memory probe


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def probe(codec: str, op: str, path: str, eb: float) -> None:
    """Child process: print the peak extra memory of one call as JSON.

    The kernel's high-water mark of resident memory (VmHWM) is reset just before the call
    (``/proc/self/clear_refs``), so earlier peaks (imports, loading) do not hide it.
    """
    x = load_concat(path)
    enc, dec = CODECS[codec](eb)
    small = x[:4096].copy()
    dec(enc(small), small)  # load kernels and libraries
    buf = enc(x) if op == "decompress" else None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    rss0 = _status_kib("VmRSS") * 1024
    out = enc(x) if op == "compress" else dec(buf, x)
    peak = _status_kib("VmHWM") * 1024
    print(json.dumps({"extra_bytes": peak - rss0, "input_bytes": x.nbytes,
                      "rss_before": rss0, "out_bytes": nbytes(out)}))


def memory(codec: str, op: str, path: str, eb: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", codec, op, path, repr(eb)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(res.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------- predictor study


def predictor_study(x: np.ndarray, eb: float) -> dict[str, Any]:
    """Stream sizes with per-block choice (format v1), Lorenzo never, Lorenzo always.

    Blocks are decided as in docs/format.md, in numpy; the per-block size must equal the
    real stream's, which checks the model.
    """
    n = x.size
    nblocks = (n + 31) // 32
    pad = np.zeros(nblocks * 32, np.float64)
    pad[:n] = x
    step = 2 * eb
    v = pad / step
    inr = np.abs(v) < 2147483647.0
    with np.errstate(invalid="ignore"):
        q = np.floor(np.where(inr, v, 0.0) + 0.5).astype(np.int64)
        y = (q.astype(np.float64) * step).astype(x.dtype).astype(np.float64)
        ok = inr & (np.abs(y - pad) < eb)
    ok[n:] = True
    q[n:] = 0
    qb = q.reshape(nblocks, 32)
    raw = ~ok.reshape(nblocks, 32).all(axis=1)
    prev = np.concatenate([np.zeros((nblocks, 1), np.int64), qb[:, :-1]], axis=1)
    d = qb - prev
    valid = (np.arange(nblocks * 32) < n).reshape(nblocks, 32)
    d[~valid] = 0

    def bitlen(a: np.ndarray) -> np.ndarray:
        orv = np.bitwise_or.reduce(np.abs(a), axis=1)
        return np.where(orv > 0, np.floor(np.log2(np.maximum(orv, 1))).astype(np.int64) + 1, 0)

    wq, wd = bitlen(qb), bitlen(d)
    zero = (~raw) & (wq == 0)
    fixed = (~raw) & (~zero)
    rawwords = 32 if x.dtype == np.float32 else 64
    head = fmt.HEADER_NBYTES + 8 + 4 * ((nblocks + 31) // 32)

    def total(widths: np.ndarray) -> int:
        nnz = int(fixed.sum() + raw.sum())
        return head + (nnz + 3) // 4 * 4 + 4 * int((1 + widths[fixed]).sum() + rawwords * raw.sum())

    choose = np.where(wd < wq, wd, wq)
    lor_chosen = int((fixed & (wd < wq)).sum())
    real = compress_abs(x, eb).size
    per_block = total(choose)
    assert per_block == real, (per_block, real)
    return {
        "blocks": nblocks, "zero": int(zero.sum()), "raw": int(raw.sum()),
        "fixed": int(fixed.sum()), "lorenzo_chosen": lor_chosen,
        "ratio_per_block": x.nbytes / per_block,
        "ratio_no_lorenzo": x.nbytes / total(wq),
        "ratio_always_lorenzo": x.nbytes / total(np.where(wd <= 31, wd, 10**6)),
    }


# ------------------------------------------------------------------------- reporting


def fmt_num(v: Any, nd: int = 2) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.{nd}f}" if abs(v) >= 0.01 or v == 0 else f"{v:.2e}"
    return str(v)


def summary_table(rows: list[dict[str, Any]], threads: list[int]) -> str:
    cols = ["data", "REL", "codec", "ratio", "max err/eb", "PSNR dB", "comp GB/s 1t cpu",
            "decomp GB/s 1t cpu"]
    for t in threads:
        cols += [f"comp GB/s {t}t wall", f"decomp GB/s {t}t wall"]
    cols += ["comp extra mem", "decomp extra mem"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        vals = [r["data"], f"{r['rel']:g}", r["codec"], fmt_num(r["ratio"]),
                f"{r['max_err_over_eb']:.7f}", fmt_num(r["psnr_db"], 1),
                fmt_num(r.get("comp_gbs_1t_cpu", float("nan"))),
                fmt_num(r.get("decomp_gbs_1t_cpu", float("nan")))]
        for t in threads:
            vals += [fmt_num(r.get(f"comp_gbs_{t}t", float("nan"))),
                     fmt_num(r.get(f"decomp_gbs_{t}t", float("nan")))]
        for op in ("compress", "decompress"):
            m = r.get(f"mem_{op}")
            vals.append(f"{m['extra_bytes'] / m['input_bytes']:.2f}x" if m else "")
        vals = ["" if v == "nan" else v for v in vals]
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


def speedup_table(rows: list[dict[str, Any]], threads: list[int]) -> str:
    """ccoll over SZ3 and ZFP, same data and bound: ratio quotient and throughput speedups.

    "1t cpu" compares thread CPU times of single-threaded runs; "Nt wall" compares ccoll's
    wall time on N threads with SZ3's single-threaded wall time.
    """
    head = ["data", "REL", "ratio vs SZ3", "ratio vs ZFP", "comp vs SZ3 1t cpu",
            "decomp vs SZ3 1t cpu"]
    for t in threads:
        head += [f"comp vs SZ3 {t}t wall", f"decomp vs SZ3 {t}t wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keyed = {(r["data"], r["rel"], r["codec"]): r for r in rows}
    for (data, rel, codec), r in keyed.items():
        if codec not in THREADED:
            continue
        sz, zf = keyed.get((data, rel, "SZ3")), keyed.get((data, rel, "ZFP"))
        if not sz or not zf or "comp_gbs_1t" not in r:
            continue
        vals = [f"{data} ({codec})", f"{rel:g}", f"{r['ratio'] / sz['ratio']:.2f}",
                f"{r['ratio'] / zf['ratio']:.2f}",
                f"{r['comp_gbs_1t_cpu'] / sz['comp_gbs_1t_cpu']:.1f}x",
                f"{r['decomp_gbs_1t_cpu'] / sz['decomp_gbs_1t_cpu']:.1f}x"]
        for t in threads:
            vals += [f"{r[f'comp_gbs_{t}t'] / sz['comp_gbs_1t']:.1f}x",
                     f"{r[f'decomp_gbs_{t}t'] / sz['decomp_gbs_1t']:.1f}x"]
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


def rd_plot(rd: dict[str, dict[str, list[tuple[float, float]]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rd), figsize=(6 * len(rd), 4.5), squeeze=False)
    for ax, (data, curves) in zip(axes[0], rd.items()):  # noqa: B905
        for codec, pts in curves.items():
            pts = [(b, p) for b, p in pts if math.isfinite(p)]
            ax.plot([b for b, _ in pts], [p for _, p in pts], marker="o", label=codec)
        ax.set_xscale("log")
        ax.set_xlabel("bits per value (32 / ratio)")
        ax.set_ylabel("PSNR (dB)")
        ax.set_title(f"{data}: REL {RD_RELS[0]:g} .. {RD_RELS[-1]:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__,
                            "numba": numba.__version__,
                            "numba_threads": numba.config.NUMBA_NUM_THREADS,
                            "threading_layer": None, "ccoll": ccoll.__version__}
    try:
        info["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True,
                                       timeout=10).stdout.splitlines()[:20]
    except (OSError, subprocess.SubprocessError):
        info["lscpu"] = []
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    for mod in ("pysz", "zfpy", "zstandard"):
        try:
            from importlib.metadata import version

            info[mod] = version(mod)
        except Exception:  # noqa: BLE001
            info[mod] = None
    return info


# ------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="HDF5 dumps")
    ap.add_argument("--rel", nargs="+", type=float, default=[1e-2, 1e-3, 1e-4])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeat", type=int, default=30,
                    help="timed runs per figure on the concatenations, split over the rounds")
    ap.add_argument("--rounds", type=int, default=6, help="timing rounds over all figures")
    ap.add_argument("--tensor-repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    ap.add_argument("--quick", action="store_true", help="2 repeats, no per-tensor timing")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    ap.add_argument("--probe", nargs=4, metavar=("CODEC", "OP", "FILE", "EB"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        codec, op, path, eb = args.probe
        probe(codec, op, path, float(eb))
        return
    if args.quick:
        args.repeat, args.rounds = 2, 1
    threads = [t for t in args.threads if t <= numba.config.NUMBA_NUM_THREADS]
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {"machine": machine(), "args": vars(args), "summary": [],
                              "tensors": [], "predictor": [], "rd": {}}
    numba.set_num_threads(max(threads))
    t_start = time.time()

    for path in args.files:
        data = os.path.splitext(os.path.basename(path))[0]
        x = load_concat(path)
        lo, hi = _cpu.finite_range(x)
        print(f"== {data}: {x.size} values ({x.nbytes / 1e6:.1f} MB), range [{lo:.3g}, {hi:.3g}]",
              flush=True)
        rows = []
        for rel in args.rel:
            eb = ccoll.REL(rel).resolve(lo, hi)
            for codec in CODECS:
                row = {"data": f"{data} (all)", "rel": rel, "eb": eb,
                       **measure(codec, x, eb, threads, 0, timing=False)}
                if not args.no_memory and x.nbytes >= 1 << 20 and codec != "ccoll+zstd":
                    for op in ("compress", "decompress"):
                        row[f"mem_{op}"] = memory(codec, op, path, eb)
                rows.append(row)
            result["predictor"].append({"data": data, "rel": rel, **predictor_study(x, eb)})
        result.setdefault("add", {})[data] = add_study(x, lo, hi, args.rel, threads,
                                                        args.repeat)
        # Timings in rounds over every figure, keeping the best of each: on a shared
        # machine a round that meets a busy core is outvoted by the others, and the
        # samples of one figure are spread over minutes instead of one burst.
        for _ in range(args.rounds):
            for row in rows:
                enc = CODECS[row["codec"]](row["eb"])[0]
                merge_times(row, times(row["codec"], x, row["eb"], enc(x), threads,
                                       max(1, args.repeat // args.rounds)))
        for row in rows:
            result["summary"].append(row)
            print(f"  REL {row['rel']:g} {row['codec']:10s} ratio {row['ratio']:8.2f} "
                  f"err/eb {row['max_err_over_eb']:.7f} "
                  + " ".join(f"{k}={v:.2f}" for k, v in row.items() if "gbs" in k),
                  flush=True)
        # Rate-distortion points (ratio and PSNR only).
        curves: dict[str, list[tuple[float, float]]] = {c: [] for c in CODECS}
        for rel in RD_RELS:
            eb = ccoll.REL(rel).resolve(lo, hi)
            for codec in CODECS:
                r = measure(codec, x, eb, threads, 0, timing=False)
                curves[codec].append((32.0 / r["ratio"], r["psnr_db"]))
        result["rd"][data] = curves
        # Every tensor.
        for name, t in load_tensors(path):
            tlo, thi = _cpu.finite_range(t)
            for rel in args.rel:
                eb = ccoll.REL(rel).resolve(tlo, thi)
                if eb == 0.0:
                    continue  # constant tensor: lossless, nothing to compare
                for codec in ("ccoll", "SZ3", "ZFP"):
                    r = measure(codec, t, eb, threads, args.tensor_repeat,
                                timing=not args.quick)
                    result["tensors"].append({"data": data, "tensor": name, "n": t.size,
                                              "rel": rel, "eb": eb, **r})
        print(f"   {data} done at {time.time() - t_start:.0f} s", flush=True)

    result["elapsed_s"] = time.time() - t_start
    result["machine"]["threading_layer"] = numba.threading_layer()
    try:
        result["machine"]["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    with open(os.path.join(args.out, "compressor.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    rd_plot(result["rd"], os.path.join(args.out, "compressor_rd.png"))
    md = [f"# Compressor benchmark ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
          "Command: `" + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]) + "`", "",
          summary_table(result["summary"], threads), "", "Ratios and speedups (same run):", "",
          speedup_table(result["summary"], threads), "", "Predictor choice:", "",
          predictor_table(result["predictor"]), "", "Homomorphic add (two halves of each dump):",
          "", add_table(result.get("add", {}), threads), "",
          tensor_digest(result["tensors"], args.rel)]
    with open(os.path.join(args.out, "compressor.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


def add_study(x: np.ndarray, lo: float, hi: float, rels: list[float], threads: list[int],
              repeat: int) -> list[dict[str, Any]]:
    """Time the homomorphic add of two halves of a dump against decode + float add.

    The halves hold different training steps (a dump concatenates its steps in order), so
    their sum is the kind a ring step computes. Throughput is in bytes of one half's
    float32 data per second; "decompress + add" is what a decompress-add-recompress ring
    step does instead of the add (its recompression not counted). The two ring steps in
    full: "add_data" (the homomorphic ring's: ``add_data(received, own half)``) and
    "DAR step" (decompress, float add, compress the sum).
    """
    from ccoll.compressor import add, add_data, compress_abs, decompress

    h = x.size // 2
    a, b = np.ascontiguousarray(x[:h]), np.ascontiguousarray(x[h : 2 * h])
    rows = []
    for rel in rels:
        eb = ccoll.REL(rel).resolve(lo, hi)
        sa, sb = compress_abs(a, eb), compress_abs(b, eb)
        y = np.empty_like(a)

        def dec_add(sb: Any = sb, y: np.ndarray = y) -> None:
            decompress(sb, out=y)
            np.add(y, a, out=y)

        def dar_step(sb: Any = sb, y: np.ndarray = y, eb: float = eb) -> None:
            decompress(sb, out=y)
            np.add(y, a, out=y)
            compress_abs(y, eb)

        row: dict[str, Any] = {"rel": rel, "bytes": a.nbytes,
                               "ratio_sum": a.nbytes / add(sa, sb).nbytes}
        for t in threads:
            numba.set_num_threads(t)
            wa, ca = best_time(lambda sa=sa, sb=sb: add(sa, sb), repeat)
            wd, cd = best_time(dec_add, repeat)
            row[f"add_{t}t"] = a.nbytes / wa / 1e9
            row[f"decadd_{t}t"] = a.nbytes / wd / 1e9
            if t == 1:
                row["add_1t_cpu"] = a.nbytes / ca / 1e9
                row["decadd_1t_cpu"] = a.nbytes / cd / 1e9
                _, cf = best_time(lambda sb=sb, eb=eb: add_data(sb, a, eb), repeat)
                _, cs = best_time(dar_step, repeat)
                row["adddata_1t_cpu"] = a.nbytes / cf / 1e9
                row["darstep_1t_cpu"] = a.nbytes / cs / 1e9
        numba.set_num_threads(max(threads))
        rows.append(row)
    return rows


def add_table(by_data: dict[str, list[dict[str, Any]]], threads: list[int]) -> str:
    cols = ["add_1t_cpu", "decadd_1t_cpu"] + [f"{k}_{t}t" for t in threads if t > 1
                                               for k in ("add", "decadd")]
    cols += ["adddata_1t_cpu", "darstep_1t_cpu"]
    head = ("| data | REL | ratio of the sum | add GB/s 1t cpu | decompress + add GB/s 1t cpu"
            + "".join(f" | add GB/s {t}t wall | decompress + add GB/s {t}t wall"
                      for t in threads if t > 1)
            + " | add_data step GB/s 1t cpu | DAR step GB/s 1t cpu |")
    lines = [head, "|---|---|---|" + "---|" * len(cols)]
    for data, rows in by_data.items():
        for r in rows:
            lines.append(f"| {data} | {r['rel']:g} | {r['ratio_sum']:.2f} | "
                         + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    return "\n".join(lines)


def predictor_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| data | REL | blocks | zero | raw | fixed | Lorenzo chosen | ratio per-block | "
             "ratio no Lorenzo | ratio always Lorenzo |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = 100 * r["lorenzo_chosen"] / max(1, r["fixed"])
        lines.append(
            f"| {r['data']} | {r['rel']:g} | {r['blocks']} | {r['zero']} | {r['raw']} | "
            f"{r['fixed']} | {r['lorenzo_chosen']} ({share:.1f}% of fixed) | "
            f"{r['ratio_per_block']:.2f} | {r['ratio_no_lorenzo']:.2f} | "
            f"{r['ratio_always_lorenzo']:.2f} |")
    return "\n".join(lines)


def tensor_digest(rows: list[dict[str, Any]], rels: list[float]) -> str:
    """Per-tensor results, summarized: how often ccoll's ratio reaches SZ3's and ZFP's."""
    lines = ["Per tensor (every tensor of every step; the JSON has each one):", "",
             "| data | REL | tensors | ccoll ratio / SZ3 ratio: median (min..max) | "
             "ccoll ratio / ZFP ratio: median | worst ccoll err/eb | worst ZFP err/eb |",
             "|---|---|---|---|---|---|---|"]
    by: dict[tuple[str, float], dict[str, dict[str, dict[str, Any]]]] = {}
    for r in rows:
        by.setdefault((r["data"], r["rel"]), {}).setdefault(r["tensor"], {})[r["codec"]] = r
    for (data, rel), tens in sorted(by.items()):
        q_sz = [t["ccoll"]["ratio"] / t["SZ3"]["ratio"] for t in tens.values()]
        q_zf = [t["ccoll"]["ratio"] / t["ZFP"]["ratio"] for t in tens.values()]
        worst = max(t["ccoll"]["max_err_over_eb"] for t in tens.values())
        worst_zfp = max(t["ZFP"]["max_err_over_eb"] for t in tens.values())
        lines.append(f"| {data} | {rel:g} | {len(tens)} | {np.median(q_sz):.2f} "
                     f"({min(q_sz):.2f}..{max(q_sz):.2f}) | {np.median(q_zf):.2f} | "
                     f"{worst:.9f} | {worst_zfp:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
