"""The ``ccoll`` command: compress, decompress, inspect and evaluate HDF5 gradient dumps.

Argument parsing, output formatting and exit codes live here; the work is in
:mod:`ccoll.h5`. docs/cli.md shows each command on the bundled dumps.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from ccoll.helpformat import DefaultsFormatter
from ccoll.units import format_bytes

__all__ = [
    "main",
    "build_parser",
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "EXIT_BROKEN_PIPE",
]

EXIT_OK = 0
EXIT_FAILURE = 1  # the work failed: a damaged stream, a dataset skipped, an I/O error
EXIT_USAGE = 2  # bad arguments or input: missing/non-HDF5 file, output exists, bad bound
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT); SIGTERM gives 143
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of stdout went away (`ccoll model | head -1`)

EXIT_CODES = """\
exit status:
  0    success
  1    the work failed: a damaged stream (decompress names the dataset; with
       --on-error skip the other datasets are written and the damaged ones listed;
       inspect lists every damaged one), an HDF5 or disk error
  2    usage error or unusable input: bad option or bound, missing input, input not
       HDF5, output exists (without --force) or is not a regular file, a pattern
       that matches no dataset
  130  interrupted (Ctrl-C; 143 for SIGTERM); no partial output file is left
  141  stdout was closed by its reader (`ccoll ... | head -1`), as for a tool
       stopped by SIGPIPE; nothing is printed about it
"""

MAIN_EPILOG = (
    """\
examples:
  ccoll compress datasets/minilm.h5 minilm.ccoll.h5 --eb rel:1e-3
  ccoll inspect minilm.ccoll.h5
  ccoll decompress minilm.ccoll.h5 minilm.back.h5
  ccoll eval datasets/minilm.h5 --eb rel:1e-2,1e-3,1e-4 --vs sz3,zfp --plot rd.png

Run `ccoll COMMAND --help` for the options of each command.

"""
    + EXIT_CODES
)


class _Formatter(DefaultsFormatter):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse's parser; a usage error keeps its message on the ``SystemExit`` it raises.

    So that ``_main`` can print the JSON document of a usage error under ``--json``
    (argparse's usage message still goes to stderr). Subcommands get this class too.
    """

    def error(self, message: str) -> NoReturn:
        try:
            super().error(message)
        except SystemExit as exc:
            exc.ccoll_usage_error = message  # type: ignore[attr-defined]
            raise


def _json_requested(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """Return the command of ``argv`` if it asks for a JSON document on stdout (``--json``).

    Read from the raw words, as parsing failed: the first word that is not an option is the
    command; ``--json`` (or an abbreviation argparse takes for it) must follow it, before a
    ``--``. ``ccoll bench --json FILE`` writes a file, not stdout: ``None`` for it.
    """
    cmd = next((t for t in argv if not t.startswith("-")), None)
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub = subs[0].choices.get(cmd) if subs and cmd is not None else None
    if sub is None:
        return None
    flag = next((a for a in sub._actions if "--json" in a.option_strings), None)
    if flag is None or flag.nargs != 0:
        return None
    rest = list(argv)[list(argv).index(cmd) + 1:]  # type: ignore[arg-type]
    if "--" in rest:
        rest = rest[:rest.index("--")]
    return cmd if any(len(t) >= 3 and "--json".startswith(t) for t in rest) else None


def _common(p: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    if json_flag:
        p.add_argument(
            "--json", action="store_true", help="print one JSON document on stdout (for scripts)"
        )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar and no summary (errors still go to stderr)",
    )


def _patterns(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="only datasets whose full HDF5 path matches (fnmatch, e.g. '/step_0000/*.weight'); "
        "repeatable",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out datasets whose full path matches (fnmatch); repeatable",
    )


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of the ``ccoll`` command (subcommands and their options)."""
    from ccoll._version import __version__

    parser = _Parser(
        prog="ccoll",
        description="Compress HDF5 gradient dumps with ccoll's error-bounded compressor, "
        "restore them, inspect them, and compare ccoll with SZ3 and ZFP.",
        epilog=MAIN_EPILOG,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"ccoll {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "compress",
        help="compress the floating-point datasets of an HDF5 file",
        description="Write OUT: IN with every selected float16/float32/float64 dataset replaced "
        "by a ccoll stream (a 1-D uint8 dataset at the same path, with ccoll_* attributes "
        "that make the file self-describing). Groups, attributes, links and other datasets "
        "are copied unchanged (hard links stay links, references point at the same objects, "
        "the user block is kept; docs/cli.md). A REL bound resolves per dataset: "
        "rel * (max - min) of that dataset's finite values. float16 is compressed as float32 "
        "with what the rounding back to float16 leaves of the bound, and restored to float16 "
        "within the full bound, as ccoll.compress does. A stream has a fixed cost (a 64-byte "
        "header and more), so a "
        "dataset whose stream would not be smaller than the dataset itself (a few elements) is "
        "kept as it is, exact, marked ccoll_stored=raw (--always-stream stores a stream "
        "anyway). Prints one line: how "
        "many datasets, the bytes before and after, the ratio and the time (--table adds a "
        "row per dataset).",
        epilog="""\
examples:
  ccoll compress datasets/minilm.h5 minilm.ccoll.h5 --eb rel:1e-3
  ccoll compress dump.h5 small.h5 --eb abs:1e-5 --include '/step_*/*.weight' --table
  ccoll compress dump.h5 small.h5 --eb abs:1e-5 --include '/step_*/*.weight' --lossless zstd
  ccoll compress dump.h5 small.h5 --eb rel:1e-2 --exclude '*LayerNorm*' --force --json
  ccoll compress datasets/minilm.h5 minilm.v2.h5 --eb rel:1e-3 --format-version 2

"""
        + EXIT_CODES,
        formatter_class=_Formatter,
    )
    p.add_argument("input", metavar="IN.h5", help="HDF5 file to compress")
    p.add_argument(
        "output", metavar="OUT.h5", help="file to write (refused if it exists, unless --force)"
    )
    p.add_argument(
        "--eb",
        required=True,
        metavar="BOUND",
        help="error bound: rel:V (V times each dataset's value range) or abs:V",
    )
    _patterns(p)
    p.add_argument(
        "--lossless",
        choices=("none", "zstd"),
        default="none",
        help="wrap each stream in a zstd frame (needs the zstd extra); default none",
    )
    p.add_argument(
        "--format-version",
        type=int,
        choices=(1, 2),
        default=1,
        help="stream format version (docs/format.md); default 1. Version 2 stores the same "
        "values (the same bound) in fewer bytes, is slower to write and read, and compiles "
        "its kernels once on first use; ccoll decompress reads both",
    )
    p.add_argument(
        "--always-stream",
        action="store_true",
        help="store every selected dataset as a ccoll stream, even where the stream is not "
        "smaller than the dataset (by default such a dataset is kept as it is), e.g. to "
        "measure the compressor on tiny tensors",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--table",
        action="store_true",
        help="after the one-line summary, print one row per selected dataset (path, shape, "
        "dtype, original and stored bytes, ratio, absolute bound, stored as a stream or kept "
        "raw); `ccoll inspect OUT` shows them later",
    )
    _common(p)

    p = sub.add_parser(
        "decompress",
        help="restore a file written by `ccoll compress`",
        description="Write OUT: IN with every ccoll dataset restored to its dtype, shape and "
        "attributes (ccoll_* attributes removed), each value within the recorded bound. "
        "Datasets that ccoll compress kept as they were (ccoll_stored=raw) are copied exact, "
        "without the marker.",
        epilog="""\
examples:
  ccoll decompress minilm.ccoll.h5 minilm.back.h5
  ccoll decompress damaged.h5 rescued.h5 --on-error skip --json

"""
        + EXIT_CODES,
        formatter_class=_Formatter,
    )
    p.add_argument("input", metavar="IN.h5", help="file written by ccoll compress")
    p.add_argument(
        "output", metavar="OUT.h5", help="file to write (refused if it exists, unless --force)"
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="a damaged dataset: stop (exit 1, no output) or skip it (write the others, list "
        "it, exit 1); default stop",
    )
    _common(p)

    p = sub.add_parser(
        "inspect",
        help="per-dataset sizes, ratios and bounds of a raw or compressed file",
        description="List every dataset: path, shape, dtype, stored bytes, original bytes, "
        "ratio and bound, then the totals. Works on raw and ccoll-compressed files; datasets "
        "that ccoll compress kept as they were show as 'raw (kept)', bound exact. Each "
        "ccoll dataset is verified (CRC-32, zstd frame, stream header) unless --no-verify; "
        "a damaged one is listed and the exit status is 1.",
        epilog="""\
examples:
  ccoll inspect datasets/digits_cnn.h5
  ccoll inspect minilm.ccoll.h5 --json

"""
        + EXIT_CODES,
        formatter_class=_Formatter,
    )
    p.add_argument("input", metavar="FILE.h5", help="HDF5 file")
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check (the default) each ccoll dataset's CRC-32, zstd frame and stream header, "
        "list the damaged ones and exit 1 if any; --no-verify only lists",
    )
    _common(p)

    p = sub.add_parser(
        "eval",
        help="compare ccoll with SZ3 and ZFP on a file's datasets",
        description="For each bound, resolve it per dataset to one absolute bound and run "
        "ccoll and each named peer at that bound; report, per dataset and in total, the "
        "compression ratio, bits per value, max |error| / bound, PSNR and compression and "
        "decompression throughput (original MB/s, best of --repeat runs). A peer that is not "
        "installed is reported as missing.",
        epilog="""\
examples:
  ccoll eval datasets/minilm.h5 --eb rel:1e-2,1e-3,1e-4 --vs sz3,zfp --plot rd.png
  ccoll eval datasets/digits_cnn.h5 --eb abs:1e-4,1e-5 --vs sz3 --include '/step_0000/*' --json
  ccoll eval datasets/minilm.h5 --eb rel:1e-3 --format-version 1,2 --summary

--eb takes a comma-separated list; a bare number keeps the kind before it
(rel:1e-2,1e-3,abs:1e-6 is two REL bounds and one ABS bound).

"""
        + EXIT_CODES,
        formatter_class=_Formatter,
    )
    p.add_argument("input", metavar="IN.h5", help="HDF5 file with floating-point datasets")
    p.add_argument("--eb", required=True, metavar="BOUNDS", help="bounds, e.g. rel:1e-2,1e-3,1e-4")
    p.add_argument(
        "--vs",
        default="sz3,zfp",
        metavar="PEERS",
        help="peers to compare against, comma-separated: sz3, zfp (default sz3,zfp); "
        "'none' for ccoll alone",
    )
    p.add_argument(
        "--format-version",
        default="1",
        metavar="VERSIONS",
        help="ccoll's stream format versions to run, comma-separated: 1, 2 (default 1); "
        "version 2 is reported as codec 'ccoll v2'",
    )
    p.add_argument(
        "--plot", metavar="PNG", help="write a rate-distortion plot (bits/value vs PSNR)"
    )
    p.add_argument("--force", action="store_true", help="replace the --plot file if it exists")
    p.add_argument(
        "--repeat", type=int, default=3, help="timed runs per measurement, best kept"
    )
    p.add_argument(
        "--summary", action="store_true", help="print only the totals, not one row per dataset"
    )
    _patterns(p)
    _common(p)

    # `ccoll bench` (run under mpiexec) and `ccoll model`: their parsers and handlers live
    # in ccoll/bench.py and ccoll/cli_model.py.
    from ccoll import bench, cli_model

    bench.add_parser(sub)
    cli_model.add_parser(sub)
    cli_model.add_tune_parser(sub)
    return parser


# ---------------------------------------------------------------------------------------------
# output



def _print_json(doc: dict[str, Any]) -> None:
    from ccoll.h5.output import json_ready

    sys.stdout.write(json.dumps(json_ready(doc), indent=2) + "\n")


def _num(v: float | None, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return format(v, fmt)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _shape(s: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in s) + ("," if len(s) == 1 else "") + ")"


def _report_compress(doc: dict[str, Any], table: bool) -> str:
    """Format the one-line summary, then (with ``table``) one row per compressed dataset."""
    t = doc["totals"]
    kept = (
        f", {t['kept_raw']} kept as they are (a stream would not be smaller)"
        if t["kept_raw"]
        else ""
    )
    summary = (
        f"{doc['output']}: {t['compressed']} dataset(s) compressed at {doc['bound']} "
        f"(format version {doc['format_version']}, lossless {doc['lossless']}){kept}, "
        f"{doc['copied_unchanged']} copied unchanged; "
        f"{format_bytes(t['original_bytes'])} -> {format_bytes(t['stored_bytes'])}, "
        f"ratio {_num(t['ratio'], '.2f')} in {doc['seconds']:.2f} s"
    )
    if not table:
        return summary
    rows = [
        [
            r["path"],
            _shape(r["shape"]),
            r["dtype"],
            format_bytes(r["original_bytes"]),
            format_bytes(r["stored_bytes"]),
            _num(r["ratio"], ".2f"),
            _num(r["eb_abs"], ".3g"),
            r["stored_as"],
        ]
        for r in doc["datasets"]
    ]
    head = _table(
        ["dataset", "shape", "dtype", "original", "stored", "ratio", "eb_abs", "as"],
        rows,
        [False, False, False, True, True, True, True, False],
    )
    return f"{summary}\n\n{head}"


def _report_decompress(doc: dict[str, Any]) -> str:
    t = doc["totals"]
    lines = [
        f"{doc['output']}: {t['restored']} dataset(s) restored ({format_bytes(t['bytes'])}), "
        + (f"{t['kept_raw']} kept as they were (exact), " if t["kept_raw"] else "")
        + f"{doc['copied_unchanged']} copied unchanged, in {doc['seconds']:.2f} s"
    ]
    if doc["failed"]:
        lines.append(f"{t['failed']} damaged dataset(s) left out:")
        lines += [f"  {f['path']}: {f['error']}" for f in doc["failed"]]
    return "\n".join(lines)


def _report_inspect(doc: dict[str, Any]) -> str:
    rows = [
        [
            r["path"],
            _shape(r["shape"]),
            r["dtype"],
            r["codec"] + (" (kept)" if r["kept_raw"] else ""),
            format_bytes(r["stored_bytes"]),
            format_bytes(r["original_bytes"]),
            _num(r["ratio"], ".2f"),
            r["bound"] if r["eb_abs"] is None else f"{r['bound']} (abs {_num(r['eb_abs'], '.3g')})",
        ]
        for r in doc["datasets"]
    ]
    t, c = doc["totals"], doc["compressed_totals"]
    head = _table(
        ["dataset", "shape", "dtype", "codec", "stored", "original", "ratio", "bound"],
        rows,
        [False, False, False, False, True, True, True, False],
    )
    kind = (
        f"written by ccoll {doc['ccoll_version']}"
        if doc["ccoll_version"]
        else "raw (not ccoll-compressed)"
    )
    lines = [
        head,
        "",
        f"{doc['file']}: {kind}; {doc['groups']} group(s), {t['datasets']} dataset(s), "
        f"file {format_bytes(doc['file_bytes'])}",
        f"total: {format_bytes(t['original_bytes'])} original, "
        f"{format_bytes(t['stored_bytes'])} stored, "
        f"ratio {_num(t['ratio'], '.2f')}",
    ]
    kept = doc["kept_raw"]
    if c["datasets"]:
        lines.append(
            f"ccoll datasets: {c['datasets']}, {format_bytes(c['original_bytes'])} -> "
            f"{format_bytes(c['stored_bytes'])}, ratio {_num(c['ratio'], '.2f')}"
        )
    if kept:
        lines.append(
            f"{kept} dataset(s) kept as they are by ccoll compress (exact): a stream would "
            "not have been smaller"
        )
    if c["datasets"] or kept:
        if not doc["verify"]:
            lines.append("not verified (--no-verify): damaged streams would not be noticed")
        elif doc["damaged"]:
            lines.append(f"{len(doc['damaged'])} damaged dataset(s):")
            lines += [f"  {d['path']}: {d['error']}" for d in doc["damaged"]]
        elif c["datasets"]:
            lines.append(f"verified: all {c['datasets']} ccoll dataset(s) intact "
                         "(CRC-32 and stream header)")
    return "\n".join(lines)


_EVAL_HEAD = [
    "bound",
    "codec",
    "ratio",
    "bits/val",
    "maxerr/eb",
    "PSNR dB",
    "comp MB/s",
    "decomp MB/s",
]


def _eval_cells(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [r["bound"], r["codec"], "failed: " + r["error"][:60], "", "", "", "", ""]
    return [
        r["bound"],
        r["codec"],
        _num(r["ratio"], ".2f"),
        _num(r["bits_per_value"], ".3f"),
        _num(r["max_err_over_eb"], ".3f"),
        _num(r["psnr_db"], ".1f"),
        _num(r["compress_mbps"], ".1f"),
        _num(r["decompress_mbps"], ".1f"),
    ]


_SKIP_WHY = {"constant data": "constant data: the bound resolves to 0",
             "no elements": "no elements: nothing to code"}


def _report_eval(doc: dict[str, Any], summary: bool) -> str:
    right = [False, False, True, True, True, True, True, True]
    out = []
    if not summary:
        rows = [[r["path"], *_eval_cells(r)] for r in doc["runs"]]
        out += [_table(["dataset", *_EVAL_HEAD], rows, [False, *right]), ""]
    n = len({r["path"] for r in doc["runs"]})
    out.append(f"totals over {n} dataset(s) of {doc['file']} (best of {doc['repeat']} timed runs):")
    rows = []
    for t in doc["totals"]:
        cells = _eval_cells(t)
        if t["failed"]:
            cells[1] += f" ({t['failed']} failed)"
        rows.append(cells)
    out.append(_table(_EVAL_HEAD, rows, right))
    for name, why in doc["missing"].items():
        out.append(f"{name}: missing ({why})")
    if doc["skipped"]:
        whys = sorted({s["why"] for s in doc["skipped"]})
        out.append(
            f"{len(doc['skipped'])} dataset/bound pair(s) skipped ("
            + "; ".join(_SKIP_WHY.get(w, w) for w in whys) + ")"
        )
    if doc.get("streams"):
        out.append(f"{len(doc['streams'])} ccoll stream(s) not evaluated: this file was "
                   "written by ccoll compress; decompress it to evaluate them")
    if doc.get("plot"):
        out.append(f"plot: {doc['plot']}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# commands


def _progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    """Do the command; returns (JSON document, human text, exit code)."""
    handler = getattr(args, "handler", None)
    if handler is not None:  # commands that bring their own handler (bench, model)
        return handler(args)
    if args.command == "compress":
        from ccoll.h5.compress import compress_file

        doc = compress_file(
            args.input,
            args.output,
            args.eb,
            include=args.include,
            exclude=args.exclude,
            lossless=args.lossless,
            version=args.format_version,
            always_stream=args.always_stream,
            force=args.force,
            progress=_progress(args),
        )
        return doc, _report_compress(doc, args.table), EXIT_OK
    if args.command == "decompress":
        from ccoll.h5.decompress import decompress_file

        doc = decompress_file(
            args.input,
            args.output,
            force=args.force,
            on_error=args.on_error,
            progress=_progress(args),
        )
        return doc, _report_decompress(doc), EXIT_FAILURE if doc["failed"] else EXIT_OK
    if args.command == "inspect":
        from ccoll.h5.inspect import inspect_file

        doc = inspect_file(args.input, verify=args.verify)
        return doc, _report_inspect(doc), EXIT_FAILURE if doc["damaged"] else EXIT_OK
    if args.command == "eval":
        from ccoll.h5.evaluate import evaluate_file, parse_bounds, parse_peers, parse_versions
        from ccoll.h5.output import check_image_name, check_output, write_atomically

        bounds = parse_bounds(args.eb)
        versions = parse_versions(args.format_version)
        peers = [] if args.vs.strip().lower() == "none" else parse_peers(args.vs)
        if args.plot:
            check_output(args.plot, force=args.force, inputs=(args.input,))
            check_image_name(args.plot)
        doc = evaluate_file(
            args.input,
            bounds,
            peers,
            include=args.include,
            exclude=args.exclude,
            repeat=args.repeat,
            versions=versions,
            progress=_progress(args),
        )
        if args.plot:
            from ccoll.h5.plot import rd_plot

            write_atomically(args.plot, lambda name: rd_plot(doc, name), default_suffix=".png")
            doc["plot"] = args.plot
        return doc, _report_eval(doc, args.summary), EXIT_OK
    raise AssertionError(args.command)  # argparse only lets known commands through


def _exit_code(exc: BaseException) -> int:
    from ccoll.errors import ErrorBoundError, InputError, MismatchError

    if isinstance(
        exc,
        (
            InputError,
            ErrorBoundError,
            MismatchError,  # ranks given other settings or arguments: as other options
            FileNotFoundError,
            FileExistsError,
            IsADirectoryError,
            NotADirectoryError,
            PermissionError,
        ),
    ):
        return EXIT_USAGE
    return EXIT_FAILURE


def _launched_ranks() -> int:
    """How many ranks the launcher started (mpiexec/srun's PMI, Open MPI, PMIx); 1 if none."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        v = os.environ.get(name, "")
        if v.isdigit():
            return int(v)
    return 1


def _end_the_job(code: Any) -> None:
    """End every rank of a launched job whose arguments this rank refused.

    The ranks whose arguments were fine wait in the command's first collective for this
    one, for ever (its MPI never started, so the launcher does not end them either).
    """
    if _launched_ranks() < 2:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code if isinstance(code, int) else EXIT_USAGE)
    except Exception:  # noqa: BLE001 - no MPI to abort with: exit as argparse would
        pass


def _install_stop_handlers(keep_sigterm: bool = False) -> dict[int, Any]:
    """SIGINT and SIGTERM record the signal and raise KeyboardInterrupt (ccoll.h5.output).

    ``keep_sigterm``: leave SIGTERM's default (end the process) as it is. A rank of a
    launched job can wait inside a blocking MPI call, where Python runs no handler: a
    handler that only records the signal left ``timeout`` and the launcher unable to end
    it.
    """
    from ccoll.h5.output import clear_stop, request_stop

    clear_stop()
    old: dict[int, Any] = {}
    for sig in (signal.SIGINT, None if keep_sigterm else getattr(signal, "SIGTERM", None)):
        if sig is None:
            continue
        try:
            old[sig] = signal.signal(sig, lambda signum, frame: request_stop(signum))
        except ValueError:  # not the main thread (main() called from a thread): keep defaults
            break
    return old


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ccoll`` command with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    try:
        return _main(argv)
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C before the command's handlers were in place
        print("ccoll: interrupted; no output was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit:  # argparse's --help, --version and usage errors
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _stdout_closed()
        raise


def _stdout_closed() -> int:
    """Stop quietly with 128 + SIGPIPE: the reader of stdout went away.

    Python ignores SIGPIPE and raises ``BrokenPipeError`` instead; a command line tool
    should end as one killed by SIGPIPE would, without a traceback. stdout is pointed at
    /dev/null so that the interpreter's final flush does not fail again (the recipe of the
    Python documentation's note on SIGPIPE, in the ``signal`` module).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a fd
        pass
    return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(words)  # exits 2 on a usage error, 0 for --help
    except SystemExit as exc:
        usage = getattr(exc, "ccoll_usage_error", None)
        command = _json_requested(parser, words) if usage is not None else None
        if command is not None:  # --json: a failed run still prints its document
            _print_json({"command": command, "error": usage, "error_type": "UsageError",
                         "exit_code": EXIT_USAGE})
        if exc.code not in (0, None):
            _end_the_job(exc.code)
        raise
    as_json = getattr(args, "json", False)
    old = _install_stop_handlers(keep_sigterm=_launched_ranks() > 1)
    try:
        doc, text, code = _run(args)
    except KeyboardInterrupt:
        from ccoll.h5.output import stop_signal

        sig = stop_signal() or signal.SIGINT
        what = "interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}"
        print(f"ccoll: {what}; no output was written", file=sys.stderr)
        code, doc = 128 + int(sig), {"error": what}
    except Exception as exc:
        if isinstance(exc, BrokenPipeError):  # a command's own output (bench's rows) hit it
            raise
        code = _exit_code(exc)
        msg = str(exc) or type(exc).__name__
        if _no_space(exc):  # HDF5 says "28", or blames the file it could not finish
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else None
            msg = (f"no space left on the device of the output "
                   f"({why or os.strerror(errno.ENOSPC)}); no output was written")
        elif _from_hdf5(exc):  # h5py's KeyError/RuntimeError of a damaged file: no traceback
            msg = f"HDF5 error (a damaged file?): {exc.args[0] if exc.args else msg}"
        elif code == EXIT_FAILURE and not _expected(exc):
            traceback.print_exc(file=sys.stderr)
        print(f"ccoll {args.command}: error: {msg}", file=sys.stderr)
        doc = {"error": msg, "error_type": type(exc).__name__}
    else:
        if getattr(args, "silent", False):
            pass  # a rank other than 0 of a command run under mpiexec: rank 0 reports
        elif as_json:
            _print_json({**doc, "exit_code": code})
        elif not getattr(args, "quiet", False):
            print(text)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        if args.command == "decompress" and doc["failed"]:
            paths = ", ".join(f["path"] for f in doc["failed"])
            print(
                f"ccoll decompress: error: {len(doc['failed'])} damaged dataset(s) left out of "
                f"{doc['output']}: {paths}",
                file=sys.stderr,
            )
        if args.command == "inspect" and doc["damaged"]:
            paths = ", ".join(d["path"] for d in doc["damaged"])
            print(
                f"ccoll inspect: error: {len(doc['damaged'])} damaged dataset(s) in "
                f"{doc['file']}: {paths}",
                file=sys.stderr,
            )
        return code
    finally:
        from ccoll.h5.output import clear_stop

        for sig, handler in old.items():
            signal.signal(sig, handler)
        # A stop belongs to this command only; later library calls in the process run on.
        clear_stop()
    if as_json:
        _print_json({"command": args.command, **doc, "exit_code": code})
        sys.stdout.flush()
    return code


def _from_hdf5(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside h5py (reading a file HDF5 could not read)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and "h5py" in frames[-1].filename.replace("\\", "/").split("/")


def _no_space(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it arose from, is a full device or quota."""
    full = (errno.ENOSPC, errno.EDQUOT)
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno in full) or (e.args and e.args[0] in full
                                                             and type(e.args[0]) is int):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _expected(exc: BaseException) -> bool:
    """Errors whose message says everything (no traceback needed)."""
    from ccoll.errors import CCollError

    return isinstance(exc, (CCollError, OSError))


if __name__ == "__main__":
    sys.exit(main())
