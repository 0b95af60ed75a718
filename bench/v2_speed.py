"""Format v2 on the CPU against v1 and against an earlier revision of its own kernels.

One numba thread, thread CPU time (``time.thread_time``), best of ``--repeat`` rounds;
in each round every operation runs once for each variant, so the variants meet the same
machine load (interleaved A/B). GB/s of float32 input on the concatenation of each bundled
dump at REL 1e-2, 1e-3 and 1e-4 (``add``: of one half, the sum of the two halves;
``dec + add + enc``: the other way to the same stream, validating and decoding one v2 half,
adding the other half's floats and compressing the sum with version 2; ``2 dec + add``:
decoding both halves and adding the floats, no encode). ``--sz3`` adds SZ3's (pysz, ABS
mode, the same bound) compress and decompress of the same array, timed in the same rounds,
and v2's speed over SZ3's. With ``--baseline REV`` the v2 kernels of git revision ``REV``
(``ccoll/compressor/cpu/v2.py`` and ``v2blocks.py``) are timed beside the working tree's,
and the outputs are checked to be the same bytes. ``--passes`` prints where one v2 call of
each operation spends its time instead.

    python bench/v2_speed.py                       # v1 and v2 (about a minute, warm cache)
    python bench/v2_speed.py --baseline 1a86725    # and the kernels of 1a86725 (compiles them)
    python bench/v2_speed.py --passes
    python bench/v2_speed.py --baseline 1a86725 --compress   # compress only (a quick A/B)
    python bench/v2_speed.py --baseline 1a86725 --sz3        # and SZ3 in the same rounds
    python bench/v2_speed.py --baseline HEAD --v1            # v1's kernels of HEAD against these
    python bench/v2_speed.py --baseline e009e93 --add-data   # the ring's step (add_data) only

docs/performance.md ("Format v2 on the CPU") and docs/dev/format-v2.md quote its output.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELS = (1e-2, 1e-3, 1e-4)


def _kernels_of(rev: str, folder: str, names: tuple[str, ...], shared: tuple[str, ...],
                suffix: str) -> str:
    """Copy ``ccoll/compressor/cpu/{names}.py`` of git revision ``rev`` into ``bench/out``.

    Each copy is named ``{name}{suffix}.py`` and imports the modules ``shared`` from their
    sibling copies; returns the folder, put first on ``sys.path``. The folder is named after
    the commit ``rev`` resolves to: numba keys a cached kernel on its own file only, so a
    folder reused for another commit (``HEAD`` after a commit) whose ``v2.py`` did not
    change would load kernels compiled with the old ``v2blocks.py`` inlined.
    """
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", f"{rev}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    d = os.path.join(ROOT, "bench", "out", f"{folder}_{sha}")
    os.makedirs(d, exist_ok=True)
    for name in names:
        src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:ccoll/compressor/cpu/{name}.py"],
                             check=True, capture_output=True, text=True).stdout
        for m in shared:
            src = src.replace(f"from ccoll.compressor.cpu.{m} import", f"from {m}{suffix} import")
        path = os.path.join(d, f"{name}{suffix}.py")
        old = open(path).read() if os.path.exists(path) else None
        if old != src:  # keep the file (and so numba's cache of it) when unchanged
            with open(path, "w") as f:
                f.write(src)
    sys.path.insert(0, d)
    return d


def _baseline(rev: str) -> ModuleType:
    """Import the v2 kernels of git revision ``rev`` as a module of their own.

    The revision's ``intrinsics.py`` comes with them: the kernels call its intrinsics with
    the signatures of that revision.
    """
    _kernels_of(rev, "v2_kernels", ("v2", "v2blocks", "intrinsics"), ("v2blocks", "intrinsics"),
                "_base")
    return importlib.import_module("v2_base")


def _v1_baseline(rev: str) -> tuple[ModuleType, ModuleType]:
    """Import the v1 encoder and decoder of git revision ``rev`` (with its block helpers)."""
    _kernels_of(rev, "v1_kernels", ("blocks", "encode", "decode"), ("blocks",), "_v1base")
    return importlib.import_module("encode_v1base"), importlib.import_module("decode_v1base")


def v1_speeds(repeat: int, rev: str) -> None:
    """v1 compress and decompress: the kernels of ``rev`` against the working tree's (ms)."""
    from ccoll.compressor.cpu import decode, encode

    enc0, dec0 = _v1_baseline(rev)
    head = ["data", "REL", "compress v1 base", "compress v1", "new / base",
            "decompress v1 base", "decompress v1", "new / base"]

    def row_of(x: np.ndarray, rel: float) -> list[str]:
        eb = rel * (float(x.max()) - float(x.min()))
        s = encode.compress_abs(x, eb)
        assert enc0.compress_abs(x, eb).tobytes() == s.tobytes()
        y0, y1 = np.empty_like(x), np.empty_like(x)
        fns: dict[str, Callable[[], object]] = {
            "c0": lambda: enc0.compress_abs(x, eb), "c1": lambda: encode.compress_abs(x, eb),
            "d0": lambda: dec0.decompress(s, out=y0), "d1": lambda: decode.decompress(s, out=y1)}
        t = _best(fns, repeat)
        assert y0.tobytes() == y1.tobytes()
        ms = {k: f"{v * 1e3:.3f} ms ({x.nbytes / v / 1e9:.2f})" for k, v in t.items()}
        return [ms["c0"], ms["c1"], f"{t['c0'] / t['c1']:.3f}x",
                ms["d0"], ms["d1"], f"{t['d0'] / t['d1']:.3f}x"]

    _table(head, row_of)


def _best(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for key, fn in fns.items():
            t = time.thread_time()
            fn()
            best[key] = min(best[key], time.thread_time() - t)
    return best


def speeds(repeat: int, base: ModuleType | None, sz3: bool) -> None:
    from ccoll.compressor.cpu import v2

    variants = {"v2": v2} if base is None else {"v2 base": base, "v2": v2}
    head = ["data", "REL", "ratio v1", "ratio v2", "compress v1"]
    head += [f"compress {k}" for k in variants] + ["decompress v1"]
    head += [f"decompress {k}" for k in variants] + ["add v1"]
    head += [f"add {k}" for k in variants] + ["dec + add + enc v2", "2 dec + add v2"]
    if sz3:
        head += ["ratio SZ3", "compress SZ3", "decompress SZ3", "compress v2 / SZ3",
                 "decompress v2 / SZ3"]
    _table(head, lambda x, rel: _speed_row(x, rel, variants, base, repeat, sz3))


def _table(head: list[str], row_of: Callable[[np.ndarray, float], list[str]]) -> None:
    """Print a markdown table: ``head``, then ``row_of(x, rel)`` for each dump and REL."""
    from compressor import DEFAULT_FILES, load_concat

    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for path in DEFAULT_FILES:
        x = load_concat(path)
        name = os.path.splitext(os.path.basename(path))[0]
        for rel in RELS:
            print(f"| {name} | {rel:g} | " + " | ".join(row_of(x, rel)) + " |", flush=True)


def _sz3(x: np.ndarray, eb: float) -> tuple[Callable[[], object], Callable[[], object], float]:
    """SZ3's compress and decompress of ``x`` at absolute bound ``eb``, and its ratio."""
    from compressor import sz3_codec

    enc, dec = sz3_codec(eb)
    buf = enc(x)
    return (lambda: enc(x)), (lambda: dec(buf, x)), x.nbytes / len(buf)


def compress_speeds(repeat: int, base: ModuleType | None, sz3: bool) -> None:
    """Compress only: v1, the baseline's v2 and the working tree's v2 (ms and GB/s)."""
    import ccoll
    from ccoll.compressor.cpu import v2

    variants = {"v2": v2} if base is None else {"v2 base": base, "v2": v2}
    head = ["data", "REL", "compress v1"] + [f"compress {k}" for k in variants]
    head += ["compress SZ3"] if sz3 else []
    head += ["v2 / v1"] + (["v2 / base"] if base is not None else [])
    head += ["v2 / SZ3"] if sz3 else []

    def row_of(x: np.ndarray, rel: float) -> list[str]:
        eb = rel * (float(x.max()) - float(x.min()))
        fns: dict[str, Callable[[], object]] = {
            "v1": lambda x=x, eb=eb: ccoll.compress(x, ccoll.ABS(eb))}
        for k, m in variants.items():
            fns[k] = lambda m=m, x=x, eb=eb: m.compress_abs_v2(x, eb)
        if sz3:
            fns["SZ3"] = _sz3(x, eb)[0]
        if base is not None:
            assert base.compress_abs_v2(x, eb).tobytes() == v2.compress_abs_v2(x, eb).tobytes()
        t = _best(fns, repeat)
        row = [f"{t[k] * 1e3:.3f} ms ({x.nbytes / t[k] / 1e9:.2f})" for k in fns]
        row += [f"{t['v1'] / t['v2']:.3f}x"]
        row += [f"{t['v2 base'] / t['v2']:.3f}x"] if base is not None else []
        return row + ([f"{t['SZ3'] / t['v2']:.2f}x"] if sz3 else [])

    _table(head, row_of)


def add_data_speeds(repeat: int, base: ModuleType | None) -> None:
    """``add_data`` only (the ring's step): v1, the baseline's v2, the working tree's v2.

    Data ``xb`` (the dump's second half) added to the stream of ``xa`` (its first half) at
    the bound, GB/s of ``xb``; "c + add v2": the working tree's compress, validation and
    add of two streams, the same bytes by the other way; "dec + add + enc v2": the step
    without the homomorphic sum (decode the stream, add the floats, compress the sum: the
    sum's own grid, not the same bytes).
    """
    from ccoll.compressor import add_data
    from ccoll.compressor.cpu import v2

    variants = {"v2": v2} if base is None else {"v2 base": base, "v2": v2}
    head = ["data", "REL", "add_data v1"] + [f"add_data {k}" for k in variants]
    head += ["c + add v2", "dec + add + enc v2", "v2 / v1"]
    head += (["v2 / base"] if base is not None else []) + ["v2 / (dec + add + enc)"]

    def row_of(x: np.ndarray, rel: float) -> list[str]:
        import ccoll

        h = x.size // 2
        xa, xb = x[:h], x[h : 2 * h]
        eb = rel * (float(x.max()) - float(x.min()))
        a1 = ccoll.compress(xa, ccoll.ABS(eb))
        a2 = v2.compress_abs_v2(xa, eb)
        fns: dict[str, Callable[[], object]] = {"v1": lambda: add_data(a1, xb)}
        for k, m in variants.items():
            fns[k] = lambda m=m: m.add_data_v2(m.validate_v2(a2), xb, 2 * eb, 2)
        fns["ca"] = lambda: v2.add_v2(v2.validate_v2(a2),
                                      v2.validate_v2(v2.compress_abs_v2(xb, eb)), 2 * eb, 2)
        ya = np.empty_like(xa)

        def dec_add_enc() -> None:
            v2.decode_into(v2.validate_v2(a2), ya)
            np.add(ya, xb, out=ya)
            v2.compress_abs_v2(ya, eb)

        fns["dae"] = dec_add_enc
        want = fns["ca"]().tobytes()  # type: ignore[attr-defined]
        for k in variants:
            assert fns[k]().tobytes() == want  # type: ignore[attr-defined]
        t = _best(fns, repeat)
        row = [f"{t[k] * 1e3:.3f} ms ({xb.nbytes / t[k] / 1e9:.2f})" for k in fns]
        row += [f"{t['v1'] / t['v2']:.3f}x"]
        row += [f"{t['v2 base'] / t['v2']:.3f}x"] if base is not None else []
        return row + [f"{t['dae'] / t['v2']:.3f}x"]

    _table(head, row_of)


def _speed_row(x: np.ndarray, rel: float, variants: dict[str, ModuleType],
               base: ModuleType | None, repeat: int, sz3: bool) -> list[str]:
    import ccoll
    from ccoll.compressor import add as add1
    from ccoll.compressor.cpu import v2

    h = x.size // 2
    xa, xb = x[:h], x[h : 2 * h]
    eb = rel * (float(x.max()) - float(x.min()))
    s1 = ccoll.compress(x, ccoll.ABS(eb))
    a1, b1 = ccoll.compress(xa, ccoll.ABS(eb)), ccoll.compress(xb, ccoll.ABS(eb))
    s2 = v2.compress_abs_v2(x, eb)
    a2, b2 = v2.compress_abs_v2(xa, eb), v2.compress_abs_v2(xb, eb)
    y = np.empty_like(x)
    ya, yb = np.empty_like(xa), np.empty_like(xb)
    fns: dict[str, Callable[[], object]] = {
        "c v1": lambda: ccoll.compress(x, ccoll.ABS(eb)),
        "d v1": lambda: ccoll.decompress(s1, out=y),
        "a v1": lambda: add1(a1, b1),
    }
    for k, m in variants.items():
        fns["c " + k] = lambda m=m: m.compress_abs_v2(x, eb)
        fns["d " + k] = lambda m=m: m.decode_into(m.validate_v2(s2), y)
        fns["a " + k] = lambda m=m: m.add_v2(m.validate_v2(a2), m.validate_v2(b2), eb, 2)

    def dec_add() -> None:
        v2.decode_into(v2.validate_v2(a2), ya)
        v2.decode_into(v2.validate_v2(b2), yb)
        np.add(ya, yb, out=ya)

    def dec_add_enc() -> None:
        v2.decode_into(v2.validate_v2(a2), ya)
        np.add(ya, xb, out=ya)
        v2.compress_abs_v2(ya, eb)

    fns["da v2"] = dec_add
    fns["dae v2"] = dec_add_enc
    if sz3:
        fns["c SZ3"], fns["d SZ3"], ratio_sz3 = _sz3(x, eb)
    if base is not None:  # the same bytes from both revisions
        assert base.compress_abs_v2(x, eb).tobytes() == s2.tobytes()
        assert (base.add_v2(base.validate_v2(a2), base.validate_v2(b2), eb, 2).tobytes()
                == v2.add_v2(v2.validate_v2(a2), v2.validate_v2(b2), eb, 2).tobytes())
    t = _best(fns, repeat)

    def g(key: str, nbytes: int = x.nbytes) -> str:
        return f"{nbytes / t[key] / 1e9:.2f}"

    row = [f"{x.nbytes / s1.size:.2f}", f"{x.nbytes / s2.size:.2f}", g("c v1")]
    row += [g("c " + k) for k in variants] + [g("d v1")]
    row += [g("d " + k) for k in variants] + [g("a v1", xa.nbytes)]
    row += [g("a " + k, xa.nbytes) for k in variants]
    row += [g("dae v2", xa.nbytes), g("da v2", xa.nbytes)]
    if sz3:
        row += [f"{ratio_sz3:.2f}", g("c SZ3"), g("d SZ3"), f"{t['c SZ3'] / t['c v2']:.2f}x",
                f"{t['d SZ3'] / t['d v2']:.2f}x"]
    return row


_PASSES = ["_plan_lossy", "_write_v2", "validate_v2", "_check_v2", "_decode_v2", "_add_v2_chunks",
           "_finish_sum", "_place_v2"]


def passes(repeat: int) -> None:
    """Milliseconds of each pass of one v2 call (best of ``repeat``), MiniLM and digits."""
    from compressor import DEFAULT_FILES, load_concat

    from ccoll.compressor.cpu import v2

    spent: dict[str, float] = {}
    orig = {k: getattr(v2, k) for k in _PASSES}

    def timed(name: str) -> Callable[..., object]:
        def call(*a: object, **kw: object) -> object:
            t = time.thread_time()
            r = orig[name](*a, **kw)
            spent[name] = spent.get(name, 0.0) + time.thread_time() - t
            return r

        return call

    for k in _PASSES:
        setattr(v2, k, timed(k))
    try:
        for path in DEFAULT_FILES:
            x = load_concat(path)
            name = os.path.splitext(os.path.basename(path))[0]
            for rel in RELS:
                out = _pass_row(v2, x, rel * (float(x.max()) - float(x.min())), spent, repeat)
                print(f"{name} REL {rel:g} (ms) | " + " | ".join(out), flush=True)
    finally:
        for k in _PASSES:
            setattr(v2, k, orig[k])


def _pass_row(v2: ModuleType, x: np.ndarray, eb: float, spent: dict[str, float],
              repeat: int) -> list[str]:
    h = x.size // 2
    s = v2.compress_abs_v2(x, eb)
    a, b = v2.compress_abs_v2(x[:h], eb), v2.compress_abs_v2(x[h : 2 * h], eb)
    y = np.empty_like(x)
    ops: dict[str, Callable[[], object]] = {
        "compress": lambda: v2.compress_abs_v2(x, eb),
        "decompress": lambda: v2.decode_into(v2.validate_v2(s), y),
        "add": lambda: v2.add_v2(v2.validate_v2(a), v2.validate_v2(b), eb, 2),
    }
    out = []
    for op, fn in ops.items():
        best: dict[str, float] = {}
        for _ in range(repeat):
            spent.clear()
            t = time.thread_time()
            fn()
            spent["total"] = time.thread_time() - t
            for k, v in spent.items():
                best[k] = min(best.get(k, float("inf")), v)
        out.append(op + ": " + ", ".join(f"{k.strip('_')} {v * 1e3:.2f}"
                                         for k, v in best.items()))
    return out


def _load() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=11, help="rounds, the best counts")
    ap.add_argument("--baseline", metavar="REV", help="also time the v2 kernels of git REV")
    ap.add_argument("--passes", action="store_true", help="time the passes of each v2 call")
    ap.add_argument("--compress", action="store_true", help="time compress only")
    ap.add_argument("--add-data", action="store_true",
                    help="time add_data only (a stream plus data: the ring's step)")
    ap.add_argument("--sz3", action="store_true",
                    help="also time SZ3 (pysz) in the same rounds, and v2's speed over it")
    ap.add_argument("--v1", action="store_true",
                    help="with --baseline: v1's compress and decompress kernels of REV "
                         "against the working tree's instead")
    args = ap.parse_args(argv)
    import numba

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    numba.set_num_threads(1)
    from llvmlite import binding

    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, CPU "
          f"{binding.get_host_cpu_name()}, load average {_load()}; one numba thread, "
          f"thread CPU time, best of {args.repeat}")
    if args.v1:
        if not args.baseline:
            ap.error("--v1 needs --baseline REV")
        v1_speeds(args.repeat, args.baseline)
    elif args.passes:
        passes(args.repeat)
    elif args.add_data:
        add_data_speeds(args.repeat, _baseline(args.baseline) if args.baseline else None)
    elif args.compress:
        compress_speeds(args.repeat, _baseline(args.baseline) if args.baseline else None,
                        args.sz3)
    else:
        speeds(args.repeat, _baseline(args.baseline) if args.baseline else None, args.sz3)
    print(f"# load average at the end {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
