"""Where the CPU kernels spend their time, instruction by instruction (Linux ``perf``).

numba's machine code has no symbols that ``perf`` can see. This script compiles the
kernels afresh (an empty numba cache in a temporary folder, so their LLVM modules are at
hand: about 1-2 minutes), writes ``/tmp/perf-PID.map`` naming every compiled function of
``ccoll.compressor.cpu`` (a parfor's body is named after the kernel that holds it), then
samples itself with ``perf record`` while it runs one operation in a loop on one numba
thread, and prints the share of each function and the hottest stretches of the hottest
one, disassembled from the process's own memory with ``objdump``.

    sudo python bench/perf_kernels.py compress --rel 1e-4            # MiniLM, format v2
    python bench/perf_kernels.py decompress --rel 1e-3 --version 1 --asm /tmp/dec.txt
    python bench/perf_kernels.py add_data --rel 1e-3     # the ring's step: x added to a stream

A function's extent is taken as up to the next known address (at most 1 MiB), so a share
can include code numba placed after it. The samples are of the CPU clock (a virtual
machine may offer no hardware counters); an instruction's count includes the skid of the
instruction before it. docs/dev/format-v2.md quotes what it showed.
"""

from __future__ import annotations

import argparse
import bisect
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _symbols() -> dict[int, str]:
    """Address -> readable name of every function numba compiled for ccoll's CPU kernels."""
    import importlib
    import pkgutil

    from numba.core.dispatcher import Dispatcher

    import ccoll.compressor.cpu as pkg

    names: dict[int, str] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for attr in dir(mod):
            d = getattr(mod, attr)
            if not isinstance(d, Dispatcher):
                continue
            for cres in d.overloads.values():
                lib = cres.library
                for f in lib._final_module.functions:
                    if f.is_declaration:
                        continue
                    try:
                        addr = lib.get_pointer_to_function(f.name)
                    except Exception:  # noqa: BLE001 - not every symbol is addressable
                        continue
                    if not addr:
                        continue
                    wrapper = re.match(r"(cpython\.|cfunc\.|_ZN7cpython|__gufunc__)", f.name)
                    what = (" (parfor body)" if "numba_parfor_gufunc" in f.name
                            else " (wrapper)" if wrapper else "")
                    if f.name.startswith("NRT_"):
                        names[addr] = f.name
                    else:
                        names.setdefault(addr, f"{info.name}.{attr}{what}")
    return names


def _write_map(names: dict[int, str]) -> list[tuple[int, int, str]]:
    spans = []
    addrs = sorted(names)
    for i, a in enumerate(addrs):
        size = min((addrs[i + 1] - a) if i + 1 < len(addrs) else 1 << 16, 1 << 20)
        spans.append((a, size, names[a]))
    with open(f"/tmp/perf-{os.getpid()}.map", "w") as f:
        for a, size, name in spans:
            f.write(f"{a:x} {size:x} {name.replace(' ', '_')}\n")
    return spans


def _operation(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from compressor import DEFAULT_FILES, load_concat

    import ccoll
    from ccoll.compressor import add, add_data

    path = next(p for p in DEFAULT_FILES if args.data in os.path.basename(p))
    x = load_concat(path)
    eb = args.rel * (float(x.max()) - float(x.min()))
    h = x.size // 2
    s = ccoll.compress(x, ccoll.ABS(eb), version=args.version)
    a = ccoll.compress(x[:h], ccoll.ABS(eb), version=args.version)
    b = ccoll.compress(x[h : 2 * h], ccoll.ABS(eb), version=args.version)
    y = np.empty_like(x)
    return {
        "compress": lambda: ccoll.compress(x, ccoll.ABS(eb), version=args.version),
        "decompress": lambda: ccoll.decompress(s, out=y),
        "add": lambda: add(a, b),
        "add_data": lambda: add_data(a, x[h : 2 * h]),
    }[args.op]


def _annotate(span: tuple[int, int, str], ips: Counter[int], out: str, top: int) -> None:
    """Disassemble ``span`` from this process's memory and put the sample counts beside it."""
    a, size, name = span
    used = [ip for ip in ips if a <= ip < a + size]
    size = min(size, max(used) - a + 64) if used else min(size, 4096)
    with tempfile.NamedTemporaryFile(suffix=".bin", delete=False) as f:
        f.write(ctypes.string_at(a, size))
    dis = subprocess.run(["objdump", "-D", "-b", "binary", "-mi386:x86-64", "--no-show-raw-insn",
                          f"--adjust-vma={a:#x}", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    rows = []
    for line in dis.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s*(.*)", line)
        if m:
            rows.append((int(m.group(1), 16), m.group(2)))
    total = sum(ips.values())
    with open(out, "w") as f:
        for ip, ins in rows:
            f.write(f"{ips.get(ip, 0):7d} {100 * ips.get(ip, 0) / total:6.2f}%  {ip:x}  {ins}\n")
    window = 24
    sums = [(sum(ips.get(ip, 0) for ip, _ in rows[i : i + window]), i)
            for i in range(0, len(rows), window)]
    print(f"\n# hottest stretches of {window} instructions in {name} (of all samples; "
          f"full listing: {out})")
    for n, i in sorted(sums, reverse=True)[:top]:
        print(f"{100 * n / total:6.2f}%  {rows[i][0]:x}  {rows[i][1]} ...")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("op", choices=["compress", "decompress", "add", "add_data"])
    ap.add_argument("--rel", type=float, default=1e-3, help="REL bound (of the dump's range)")
    ap.add_argument("--data", default="minilm", help="bundled dump: minilm or digits_cnn")
    ap.add_argument("--version", type=int, default=2, choices=[1, 2], help="stream format")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long to sample")
    ap.add_argument("--top", type=int, default=8, help="hot stretches to print")
    ap.add_argument("--asm", default="/tmp/perf_kernels.txt", help="annotated listing")
    args = ap.parse_args(argv)
    for tool in ("perf", "objdump"):
        if shutil.which(tool) is None:
            ap.error(f"{tool} is not installed")
    cache = tempfile.mkdtemp(prefix="ccoll-perf-cache-")
    os.environ["NUMBA_CACHE_DIR"] = cache  # compile afresh: cached code has no LLVM module
    import numba

    sys.path.insert(0, ROOT)
    numba.set_num_threads(1)
    print(f"# compiling the kernels into {cache} (1-2 minutes)", flush=True)
    fn = _operation(args)
    fn()
    spans = _write_map(_symbols())
    data = os.path.join(cache, "perf.data")
    rec = subprocess.Popen(["perf", "record", "-q", "-F", "5000", "-p", str(os.getpid()),
                            "-o", data], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    t0, calls = time.time(), 0
    while time.time() - t0 < args.seconds:
        fn()
        calls += 1
    rec.send_signal(signal.SIGINT)
    rec.wait()
    print(f"# {args.op} v{args.version} {args.data} REL {args.rel:g}: {calls} calls in "
          f"{args.seconds:g} s, one numba thread")
    ips: Counter[int] = Counter()
    script = subprocess.run(["perf", "script", "-i", data, "-F", "ip"], capture_output=True,
                            text=True).stdout
    for line in script.split():
        ips[int(line, 16)] += 1
    total = sum(ips.values())
    share: Counter[str] = Counter()
    per_span: Counter[int] = Counter()
    starts = [s[0] for s in spans]
    for ip, n in ips.items():
        i = bisect.bisect_right(starts, ip) - 1
        inside = i >= 0 and ip < spans[i][0] + spans[i][1]
        share[spans[i][2] if inside else "(other: Python, numpy, libc, kernel)"] += n
        if inside:
            per_span[i] += n
    print(f"# {total} samples")
    for name, n in share.most_common(12):
        print(f"{100 * n / total:6.2f}%  {name}")
    rep = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym",
                          "--stdio"], capture_output=True, text=True).stdout
    other = [ln.strip() for ln in rep.splitlines()
             if ln.strip() and not ln.startswith("#") and "[JIT]" not in ln]
    print("# outside the kernels, by library and symbol:")
    for ln in other[:8]:
        print("  " + re.sub(r"\s+", " ", ln)[:110])
    if per_span:
        _annotate(spans[per_span.most_common(1)[0][0]], ips, args.asm, args.top)
    os.unlink(f"/tmp/perf-{os.getpid()}.map")
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
