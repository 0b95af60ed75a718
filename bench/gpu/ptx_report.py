"""Registers, spills, stack and shared memory of every compressor kernel, from ptxas -v.

No GPU needed: each kernel is compiled to PTX with numba-cuda for the signatures that
ccoll.compressor._cuda launches (``signatures()`` of ccoll.compressor._cuda_kernels for
format v1 and of ccoll.compressor._cuda_kernels_v2 for format v2) and assembled
with ptxas for each architecture. Prints a markdown table; with --update FILE, replaces the
table between the markers ``<!-- ptx-report:begin -->`` and ``<!-- ptx-report:end -->``.

    .venv/bin/python bench/gpu/ptx_report.py --update docs/cuda.md
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "ptx"))

BEGIN = "<!-- ptx-report:begin -->"
END = "<!-- ptx-report:end -->"


def report(archs: list[tuple[int, int]]) -> str:
    import numba
    from ptxkit import ptxas

    from ccoll.compressor import _cuda_kernels as K
    from ccoll.compressor import _cuda_kernels_v2 as K2

    exe = ptxas()
    ver = "?"
    if exe:
        import subprocess

        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release (\S+)", out)
        ver = m.group(1).rstrip(",") if m else "?"
    rows = [
        f"numba {numba.__version__}, numba-cuda {_version('numba-cuda')}, ptxas {ver}; "
        f"{K.TPB} threads per thread block.",
        "",
        "| kernel | data | arch | registers | spill stores | spill loads | stack frame | "
        "shared memory |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for mod in (K, K2):
        for name, sigs in mod.signatures().items():
            for label, sig in sigs:
                for cc in archs:
                    rows.append(_row(mod.KERNELS[name], name, label, sig, cc))
    return "\n".join(rows) + "\n"


def _row(kernel: object, name: str, label: str, sig: tuple, cc: tuple[int, int]) -> str:
    from ptxkit import assemble, compile_for

    info = assemble(compile_for(kernel, sig, cc), cc)
    stack = _max_int(r"(\d+) bytes stack frame", info.text)
    smem = _max_int(r"(\d+) bytes smem", info.text)
    return (
        f"| {name} | {label} | sm_{cc[0]}{cc[1]} | {info.registers} | "
        f"{info.spill_stores} B | {info.spill_loads} B | {stack} B | {smem} B |"
    )


def _max_int(pattern: str, text: str) -> int:
    return max((int(m) for m in re.findall(pattern, text)), default=0)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", action="append", default=None,
                    help="sm_XY to report (repeatable; default sm_80 and sm_90)")
    ap.add_argument("--update", metavar="FILE", help="replace the table in FILE between markers")
    args = ap.parse_args()
    archs = [(int(a[3]), int(a[4:])) for a in (args.arch or ["sm_80", "sm_90"])]
    table = report(archs)
    print(table, end="")
    if args.update:
        with open(args.update) as f:
            text = f.read()
        if BEGIN not in text or END not in text:
            sys.exit(f"{args.update} has no {BEGIN} ... {END} markers")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(args.update, "w") as f:
            f.write(f"{head}{BEGIN}\n{table}{END}{tail}")


if __name__ == "__main__":
    main()
