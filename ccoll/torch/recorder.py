"""Record gradients of a training run to HDF5, in the layout of the files in datasets/.

One group per recorded step (``step_0000``, ...), one uncompressed float32 dataset per
parameter named as in ``model.named_parameters()`` (a DDP wrapper's ``module.`` prefix is
dropped, so the names match the plain model), attributes ``loss``, ``learning_rate``,
``batch_size``, ``step`` on each step group and provenance (``model``, ``seed``, library
versions, ``date_utc``, ``command``, ...) on the file. ``ccoll`` reads these files
(datasets/README.md describes the layout).
"""

from __future__ import annotations

import datetime
import fnmatch
import importlib.metadata
import os
import pathlib
import platform
import shlex
import sys
from collections.abc import Iterable
from typing import Any

import h5py
import numpy as np
import torch

__all__ = ["GradientRecorder"]

_VERSIONED = ("torch", "numpy", "h5py", "ccoll", "sentence-transformers", "transformers",
              "scikit-learn", "mpi4py")  # fmt: skip


def _versions() -> dict[str, str]:
    out = {"python_version": platform.python_version(), "hdf5_version": h5py.version.hdf5_version}
    for dist in _VERSIONED:
        # Not "ccoll_version": the ccoll_ names of a file are the compressed format's, and
        # that root attribute says "written by ccoll compress" (a recorded file was refused).
        key = "recorder_ccoll_version" if dist == "ccoll" else f"{dist}_version"
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = "not installed"
    return out


class GradientRecorder:
    """Write the gradients of selected parameters every ``every`` steps to an HDF5 file.

    Call :meth:`record` after ``loss.backward()`` (after DDP has averaged the gradients) and
    before ``optimizer.step()``; it writes only on steps that are multiples of ``every``.
    Use it as a context manager or call :meth:`close`.

    Args:
        path: the HDF5 file to create (overwritten).
        every: record steps 0, every, 2*every, ...
        params: ``fnmatch`` patterns of parameter names to keep (``"encoder.layer.0.*"``);
            ``None`` keeps every parameter.
        model: description stored as the file's ``model`` attribute.
        seed: the run's seed (file attribute ``seed``).
        enabled: ``False`` makes every call a no-op (e.g. ``enabled=(rank == 0)`` under DDP,
            where every rank holds the same averaged gradients).
        attrs: more file attributes (str, numbers, numpy arrays).

    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        every: int = 1,
        params: Iterable[str] | None = None,
        model: str = "",
        seed: int | None = None,
        enabled: bool = True,
        attrs: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if isinstance(params, str):
            raise TypeError(f"params must be a list of name patterns, got the string {params!r}")
        self.patterns = None if params is None else list(params)
        if self.patterns is not None and not all(isinstance(p, str) for p in self.patterns):
            raise TypeError(f"params must hold str patterns, got {self.patterns!r}")
        self.every = every
        self.path = pathlib.Path(path)
        self.enabled = bool(enabled)
        self.steps_recorded = 0
        self._file: h5py.File | None = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = h5py.File(self.path, "w", track_order=True)
        base: dict[str, Any] = {
            "model": model,
            "seed": -1 if seed is None else int(seed),
            "date_utc": datetime.datetime.now(datetime.timezone.utc)
            .replace(microsecond=0)
            .isoformat(),
            "command": shlex.join([os.path.basename(sys.executable)] + sys.argv),
            "platform": platform.platform(),
            "torch_num_threads": torch.get_num_threads(),
            "recorded_every": every,
            "params_selected": "*" if self.patterns is None else ",".join(self.patterns),
            "description": f"gradients recorded every {every} step(s) after backward, "
            "before the optimizer step",
        }
        base.update(_versions())
        base.update(attrs or {})
        for k, v in base.items():
            # str() because e.g. torch.__version__ is a str subclass h5py cannot store.
            self._file.attrs[k] = str(v) if isinstance(v, str) else v

    def _selected(self, name: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def record(
        self,
        model: torch.nn.Module,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        lr: float | None = None,
        batch_size: int | None = None,
        **attrs: Any,
    ) -> bool:
        """Write this step's gradients if ``step % every == 0``; return whether it wrote.

        Parameters without a gradient are listed in the group's ``params_without_grad``.
        """
        if not self.enabled:
            return False
        if self._file is None:
            raise ValueError(f"GradientRecorder for {self.path} is closed")
        if step % self.every:
            return False
        name = f"step_{step:04d}"
        if name in self._file:
            raise ValueError(f"step {step} is already recorded in {self.path}")
        module = getattr(model, "module", model)  # DistributedDataParallel wraps the model
        g = self._file.create_group(name, track_order=True)
        g.attrs["step"] = int(step)
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach().item())
        g.attrs["loss"] = float(loss) if loss is not None else float("nan")
        g.attrs["learning_rate"] = float(lr) if lr is not None else float("nan")
        g.attrs["batch_size"] = int(batch_size) if batch_size is not None else -1
        for k, v in attrs.items():
            g.attrs[k] = v
        no_grad = []
        for pname, p in module.named_parameters():
            if not self._selected(pname):
                continue
            if p.grad is None:
                no_grad.append(pname)
                continue
            arr = p.grad.detach().to(device="cpu", dtype=torch.float32).numpy()
            g.create_dataset(pname, data=np.ascontiguousarray(arr))
        g.attrs["params_without_grad"] = ",".join(no_grad)
        self.steps_recorded += 1
        return True

    def close(self, **attrs: Any) -> None:
        """Write ``attrs`` on the file and close it (a second call does nothing)."""
        if self._file is None:
            return
        for k, v in attrs.items():
            self._file.attrs[k] = v
        self._file.attrs["steps_recorded"] = self.steps_recorded
        self._file.close()
        self._file = None

    def __enter__(self) -> GradientRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
