"""``ccoll model``: the cost model's predictions and break-even points on the command line.

The arithmetic is :mod:`ccoll.collectives.model` (docs/model.md); this module only reads
the options and writes the report. :mod:`ccoll.cli` registers it.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import asdict, replace
from typing import Any

from ccoll.collectives.floor import break_even_bandwidth, break_even_size
from ccoll.collectives.model import DEFAULTS, Params, predict
from ccoll.collectives.ratios import DEFAULT_WIDTH
from ccoll.errors import InputError, UnitError
from ccoll.helpformat import DefaultsFormatter
from ccoll.units import format_iec, format_time, parse_rate, parse_size, parse_time

__all__ = ["add_parser", "add_tune_parser", "params_from_args", "run_model", "run_tune"]


def _number(low: float, high: float = math.inf, *, above: bool = True) -> Any:
    """Return an argparse type: a finite float above ``low`` (or at least it), at most ``high``."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise UnitError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or (v <= low if above else v < low) or v > high:
            where = f"> {low:g}" if above else f">= {low:g}"
            if high != math.inf:
                where += f" and <= {high:g}"
            raise UnitError(f"must be a finite number {where}, got {text!r}")
        return v
    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``ccoll model`` on the CLI's subparsers."""
    ap = subparsers.add_parser(
        "model",
        help="predict raw vs compressed allreduce times and the break-even points",
        description=(
            "Predict the time of a raw ring allreduce, ccoll's homomorphic ring and the "
            "decompress-add-recompress ring from link and compressor constants, and print "
            "where compression starts paying (docs/model.md). Constants not given come from "
            "the newest calibration in the cache (CCOLL_CACHE_DIR, default ~/.cache/ccoll: "
            "written when a policy=\"auto\" Communicator first probes, by ccoll bench, or by "
            "ccoll tune), else from defaults (--defaults: always)."
        ),
        formatter_class=DefaultsFormatter,
        epilog="units: b = bit, B = byte. Bandwidth: 10Gbit, 10Gb/s, 10Gbps or 1.25GB/s, "
        "1GiB/s; size: 64M = 64MiB (binary), 64MB = 64e6 bytes; time: 5us, 0.2ms, 1e-6.",
    )
    ap.add_argument("--ranks", type=int, default=2,
                    help="ranks N (default 2; 1 rank sends nothing: an allreduce is a copy)")
    ap.add_argument("--bandwidth", type=parse_rate, default=None,
                    help="link bandwidth per direction, e.g. 10Gbit or 1.25GB/s (default 1Gbit)")
    ap.add_argument("--latency", type=parse_time, default=None,
                    help="latency of one ring step, e.g. 5us (default 50us)")
    ap.add_argument("--size", type=parse_size, default=parse_size("64M"),
                    help="message size, e.g. 64M = 64 MiB (default)")
    ap.add_argument("--ratio", type=_number(0.0), default=16.0,
                    help="compression ratio of one rank's data (default 16)")
    ap.add_argument("--ratio-sum", type=_number(0.0), default=None,
                    help="ratio of the reduced stream (default: estimated from --ratio)")
    ap.add_argument("--width", type=_number(0.0, 64.0, above=False), default=DEFAULT_WIDTH,
                    help=f"mean code width in bits of non-zero blocks (default {DEFAULT_WIDTH:g})")
    ap.add_argument("--chunks", type=int, default=None,
                    help="pipeline chunks per ring block (default: the best)")
    for name, what in (("compress", "compression"), ("add", "homomorphic add"),
                       ("decompress", "decompression"), ("reduce", "plain float sum")):
        ap.add_argument(f"--{name}-gbps", type=_number(0.0), default=None,
                        help=f"{what} throughput in GB/s (1e9 bytes of float data per second)")
    ap.add_argument("--overhead", type=parse_time, default=None,
                    help="fixed cost of one compressed call (default 100us)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--cached", action="store_true",
                     help="require the cached calibration (exit 2, unusable input, without one)")
    src.add_argument("--defaults", action="store_true",
                     help="start from the model's defaults, not the cached calibration")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    ap.add_argument("-q", "--quiet", action="store_true", help="print nothing (exit code only)")
    ap.set_defaults(handler=run_model)
    return ap


def params_from_args(args: argparse.Namespace, base: Params = DEFAULTS) -> Params:
    """Model parameters: ``base`` overridden by whatever the command line gives."""
    kw: dict[str, float] = {}
    if args.bandwidth is not None:
        kw["beta"] = args.bandwidth
    if args.latency is not None:
        kw["alpha"] = args.latency
    for name in ("compress", "add", "decompress", "reduce"):
        v = getattr(args, f"{name}_gbps")
        if v is not None:
            kw[name] = v * 1e9
    if args.overhead is not None:
        kw["overhead"] = args.overhead
    return replace(base, **kw)


def _cached_params(required: bool) -> Params | None:
    from ccoll.collectives.policy.cache import cache_file, newest_cached_params
    from ccoll.settings import current

    folder = current().cache_dir
    cached = newest_cached_params(folder)
    if cached is None and required:
        path = cache_file(folder)
        if os.path.lexists(path):  # there, but no entry in it can be used
            raise InputError(f"the calibration cache {str(path)!r} holds no entry ccoll can "
                             "use (not JSON, or values edited out of range): run `mpiexec "
                             "-n N ccoll tune` to measure again and rewrite it")
        raise InputError("no calibration in the cache yet: run `mpiexec -n N ccoll tune` (or "
                         "ccoll bench) where you want to model")
    return cached


def _source(cached: Params | None) -> str:
    """Where the model's constants came from, as the header says it."""
    if cached is None:
        return "the defaults"
    names = ("compress", "add", "decompress")
    if all(getattr(cached, k) == getattr(DEFAULTS, k) for k in names):
        # An entry of a link calibration without the compressor's (or with the defaults').
        return "the calibration cache (link) and the defaults (compressor)"
    return "the calibration cache"


def run_model(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    """Body of ``ccoll model``: returns ``(document, text, exit code)`` for the CLI to print."""
    if args.ranks < 1:
        raise InputError(f"--ranks must be >= 1, got {args.ranks}")
    if args.chunks is not None and args.chunks < 1:
        raise InputError(f"--chunks must be >= 1, got {args.chunks}")
    cached = None if args.defaults else _cached_params(args.cached)
    base = DEFAULTS if cached is None else cached
    try:
        p = params_from_args(args, base)
    except ValueError as e:
        raise InputError(str(e)) from None
    n, s = args.ranks, args.size
    w = args.width
    pr = predict(s, n, p, args.ratio, ratio_sum=args.ratio_sum, chunks=args.chunks, width=w)
    head = (
        f"# {n} rank{'s' if n != 1 else ''}, {format_iec(s)} per rank, link "
        f"{p.beta * 8 / 1e9:g} Gbit/s, ring-step latency {format_time(p.alpha)}, fixed cost "
        f"{format_time(p.overhead)} per call; constants from {_source(cached)}"
    )
    doc: dict[str, Any] = {
        "params": asdict(p), "source": "cache" if cached is not None else "defaults",
        "size": s, "ranks": n, "ratio": pr.ratio, "ratio_sum": pr.ratio_sum, "chunks": pr.chunks,
        "raw_s": pr.raw, "homomorphic_s": pr.homomorphic, "dar_s": pr.dar,
    }
    if n == 1:
        # One rank: the sum is the rank's own data, nothing crosses a link, so there is no
        # time to save and no break-even point.
        doc.update(speedup=None, choice="raw", break_even_size=None,
                   break_even_bandwidth_bps=None)
        text = "\n".join([
            head,
            "one rank: an allreduce is a local copy; nothing is sent, so compression "
            "cannot pay",
            "choice: raw",
        ])
        return doc, text, 0
    be_size = break_even_size(n, p, args.ratio, ratio_sum=args.ratio_sum, width=w)
    be_bw = break_even_bandwidth(s, n, p, args.ratio, ratio_sum=args.ratio_sum, width=w)
    doc.update(
        speedup=pr.speedup, choice=pr.choice, break_even_size=be_size,
        break_even_bandwidth_bps=None if be_bw is None else be_bw * 8,
    )
    lines = [
        head,
        f"# compressor GB/s: compress {p.compress / 1e9:g}, add {p.add / 1e9:g}, "
        f"decompress {p.decompress / 1e9:g}; plain sum {p.reduce / 1e9:g}; "
        f"ratio {pr.ratio:g} (reduced stream {pr.ratio_sum:.3g})",
        f"raw ring allreduce      {format_time(pr.raw):>12}",
        f"homomorphic ring        {format_time(pr.homomorphic):>12}   ({pr.chunks} chunk(s) per "
        f"block, speedup {pr.speedup:.2f}x)",
        f"decompress-add-recompr. {format_time(pr.dar):>12}   (speedup {pr.raw / pr.dar:.2f}x)",
        f"choice: {pr.choice}",
    ]
    if be_size is None:
        lines.append("break-even size: none (compression never pays at this bandwidth)")
    else:
        lines.append(f"break-even size: compression pays from {format_iec(be_size)} "
                     f"({be_size:.0f} bytes)")
    if be_bw is None:
        lines.append(f"break-even bandwidth: none (compressing {format_iec(s)} never pays)")
    else:
        lines.append(f"break-even bandwidth: compression pays below {be_bw * 8 / 1e9:.3g} "
                     f"Gbit/s for {format_iec(s)}")
    return doc, "\n".join(lines), 0


def add_tune_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``ccoll tune`` on the CLI's subparsers."""
    ap = subparsers.add_parser(
        "tune",
        help="measure this launch's link and compressor and write the calibration cache",
        description=(
            "Run under MPI (mpiexec -n N ccoll tune) on the ranks, network and cores a job "
            "will use: probe the link (ring steps), time the compressor on a gradient-like "
            "sample and the fixed costs of a compressed call, agree on them over the ranks "
            "and write them to the calibration cache (CCOLL_CACHE_DIR, default "
            "~/.cache/ccoll). Communicators made later on the same ranks, hosts and network "
            "start from it (no probe), and ccoll model predicts from it (docs/model.md, "
            "\"Calibration\")."
        ),
        formatter_class=DefaultsFormatter,
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    ap.add_argument("-q", "--quiet", action="store_true", help="print nothing (exit code only)")
    ap.set_defaults(handler=run_tune)
    return ap


def run_tune(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    """Body of ``ccoll tune``: probe and cache on every rank; rank 0 reports."""
    from mpi4py import MPI

    from ccoll.collectives.communicator import Communicator
    from ccoll.collectives.policy.cache import cache_file
    from ccoll.settings import configure, current

    before = current().calibration
    if before == "off":
        raise InputError("CCOLL_CALIBRATION=off: ccoll tune would write nothing; unset it")
    path = cache_file(current().cache_dir)
    started = time.time()
    configure(calibration="refresh")
    try:
        with Communicator(MPI.COMM_WORLD, policy="auto") as cc:
            cal = cc.calibration
    finally:
        configure(calibration=None)
    doc = cal.describe()
    doc["ranks"] = MPI.COMM_WORLD.Get_size()
    if MPI.COMM_WORLD.Get_rank() != 0:
        args.silent = True  # neither the text nor --json's document: rank 0 prints them
        return doc, "", 0
    # Rank 0 writes the cache, and a folder it cannot write costs the library only a probe
    # per run (cache.py), so whether this run wrote it is read from the file itself.
    if doc["ranks"] == 1:
        outcome = "one rank has no link to measure: the cache was left as it was"
    elif path.is_file() and path.stat().st_mtime >= started - 2.0:
        outcome = f"written to the calibration cache ({path})"
    else:
        raise InputError(f"ccoll tune measured this launch but could not write the "
                         f"calibration cache {str(path)!r}: set CCOLL_CACHE_DIR to a "
                         "writable folder")
    doc["cache_file"] = str(path) if doc["ranks"] > 1 else None
    p = cal.params
    text = "\n".join([
        f"# {doc['ranks']} rank(s); link: {cal.link}, compressor: {cal.compressor}; "
        f"{cal.seconds:.2f} s; {outcome}",
        f"link latency per ring step  {format_time(p.alpha)}",
        f"link bandwidth              {p.beta * 8 / 1e9:.3g} Gbit/s "
        f"(MPI_Allreduce reaches {p.raw_efficiency:.0%} of it)",
        f"compress / add / decompress {p.compress / 1e9:.3g} / {p.add / 1e9:.3g} / "
        f"{p.decompress / 1e9:.3g} GB/s",
        f"plain float sum             {p.reduce / 1e9:.3g} GB/s",
        f"fixed cost per call         {format_time(p.overhead)} "
        f"(per further chunk {format_time(p.chunk_overhead)})",
        "next: ccoll model --size 64M --ranks N (predicts from these numbers)",
    ])
    return doc, text, 0
