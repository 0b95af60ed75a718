"""DDP communication hook that averages gradient buckets with ``ccoll.allreduce``.

``comm_hook(state, bucket)`` queues the bucket on ccoll's progress engine (one background
thread that owns the asynchronous MPI calls, ``ccoll.runtime.progress``) and returns a
``torch.futures.Future`` at once, so the allreduce of this bucket overlaps the backward pass
of the buckets after it. The engine thread completes the future with the averaged bucket.

What a bucket goes through (docs/training.md has the reasoning and the bound):

1. iterations ``< start_iter`` and buckets of fewer than ``min_numel`` elements: exact
   average (``eb=None``: plain MPI allreduce, then a division by the number of ranks);
2. otherwise the bucket goes through the homomorphic ring of ``ccoll.allreduce`` with
   ``op="avg"`` and the hook's bound (which that function puts on the average), so the
   averaged bucket is within ``eb`` of the exact average on every element, up to the
   roundings to float32, and bitwise identical on every rank; with ``policy="auto"`` the
   collective may send it raw, and the hook's step check averages a whole step's buckets
   exactly while steps measure faster that way (ccoll/torch/_stepgate.py);
3. float16 / bfloat16 buckets follow the rule of ccoll's collectives (docs/error-bound.md,
   "float16 and bfloat16"): the averaged bucket, in its own dtype, is within ``eb`` of the
   exact average, the final rounding to that dtype included, or a bound the dtype cannot
   hold at the average's magnitude is refused with ``ErrorBoundError`` on every rank (the
   collective decides it from agreed numbers; with error feedback the hook does, from the
   bucket's agreed range). CUDA buckets go to ccoll's device path (compressed, added and
   decoded on the GPU); with error feedback they are staged through a host copy;
4. with ``error_feedback``, the residual of the previous step is added before compression
   and the new residual is kept per bucket, and follows its parameters when DDP lays the
   buckets out anew (see :class:`CCollHookState`).

``CCollHookState.state_dict()`` / ``load_state_dict()`` (and pickling) checkpoint the
iteration, the residuals and the settings, so a resumed run continues bit for bit.

NaN and ±Inf pass through as NaN and ±Inf, so ``torch.amp.GradScaler`` still sees overflow
and skips the step on every rank.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.

import math
import time
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ccoll.compressor.precision import stage_bound, widen
from ccoll.errorbound import ABS, ErrorBound
from ccoll.errors import InputError, MismatchError
from ccoll.torch._state import (
    STATE_VERSION,
    agreed_communicator,
    bound_of,
    check_settings,
    check_version,
    count_of,
    start_call,
)
from ccoll.torch._stepgate import RAW, StepGate

__all__ = ["CCollHookState", "comm_hook"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float32, torch.float64, *_LOW_PRECISION)


def _checked_int(call: Any, name: str, value: object, lo: int) -> int:
    """Return ``value`` as an int, or ``lo`` with a problem recorded on ``call``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        call.problem(InputError, f"{name} must be an int >= {lo}, got {value!r}")
        return lo
    return int(value)


class CCollHookState:
    """Settings and per-bucket memory of :func:`comm_hook`.

    Args:
        eb: error bound of the *averaged* gradient: ``ccoll.ABS(e)`` (every element of the
            average within ``e`` of the exact average) or ``ccoll.REL(v)`` (within
            ``v * (max - min)``, the range of the bucket's values over all ranks), or a string
            ``"rel:1e-3"``. Default ``REL(1e-3)``. (The hook passes this bound to
            ``ccoll.allreduce`` with ``op="avg"``, which bounds the average by it, so each
            rank quantizes on a grid that does not shrink as ranks are added.)
        error_feedback: keep what compression dropped and add it back next step (see below).
        start_iter: iterations before this one use the exact average. The default ``0``
            compresses from the first iteration on (residuals follow their parameters when
            DDP lays the buckets out anew after it).
        min_numel: buckets with fewer elements are averaged exactly; compressing a small
            message costs more than the bytes it saves.
        comm: mpi4py intracommunicator of the DDP ranks (default ``MPI.COMM_WORLD``). The state
            works on a duplicate of it (``Dup`` is collective: construct the state on every
            rank), so the hook's traffic never mixes with the caller's messages.
        policy: what the collective does with a bucket the hook hands it for compression:
            ``"auto"`` (default: ccoll's cost model decides per bucket from measured link
            and compressor speeds, docs/model.md), ``"compress"`` (always) or ``"raw"``
            (never: plain MPI through the same path, for comparisons).
        timeout: seconds a bucket's collective may wait without progress (nothing from its
            peers) before it fails with :class:`ccoll.CollectiveError` on every rank that
            waits (default ``None``: the ``CCOLL_TIMEOUT`` setting, else 600 s;
            ``math.inf``: wait forever, as MPI does). See ``ccoll.Communicator``.
        process_group: the ``torch.distributed`` process group of the DDP model, through
            whose allreduce the step check's exact steps go (as DDP averages without a
            hook). Default: the default group when it is initialised and ``comm`` spans
            ``MPI.COMM_WORLD``; otherwise those steps take ccoll's plain MPI path.

    Creating the state is collective over ``comm`` and checks that every rank passed the
    same ``eb``, ``error_feedback``, ``start_iter``, ``min_numel`` and ``policy`` (they
    decide which collectives each bucket makes): a difference raises
    :class:`ccoll.MismatchError` on every rank. Release the duplicated communicators and
    threads with :meth:`close` on every rank (or a ``with`` block): ``MPI_Comm_free`` is
    collective. A state dropped unclosed stops its threads when it is garbage collected
    but leaves its communicators to ``MPI_Finalize`` (a collector runs at a point of its
    own on each rank).

    Error feedback (per ``bucket.index()``, as PowerSGD keeps its residuals): with ``x`` the
    bucket (float32) and ``r`` the stored residual of that bucket, the hook reduces
    ``x_ef = x + r`` and stores ``r_new = x_ef - Q(x_ef)``, where ``Q(x_ef)`` is exactly this
    rank's own contribution to the reduced sum: its input quantized on the per-rank grid
    of the homomorphic allreduce, in the ring's chunks or recursive halving's pieces,
    whichever the call ran (recomputed locally from the call's plan, an extra compress and
    decompress of the bucket). Summed over steps, the applied gradients then differ from
    the true ones by the average of the last residuals only, which stays within the bound:
    the error does not accumulate. A step whose reduced bucket holds NaN or Inf (skipped by
    GradScaler) keeps the old residual; a bucket whose size changed starts from zero.
    Residuals are in the units of the gradients the hook sees (with GradScaler: scaled).
    The hook remembers each bucket's parameters: when DDP lays its buckets out anew (after
    the first iteration, and in a process resumed from a checkpoint), each residual is cut
    into per-parameter pieces that go back to their parameters at their new offsets.

    Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` / :meth:`from_state_dict`
    (settings, iteration, residuals, counters; pass the DDP model to store residuals per
    parameter name), and pickling, which stores no communicator: unpickling constructs the
    state again over ``MPI.COMM_WORLD``, collectively.

    Attributes:
        iter: iterations seen (incremented after the last bucket of each backward pass).
        residuals: ``{bucket index: float32 numpy array}`` when error feedback is on.
        compressed: buckets that went through compression so far; ``exact``: buckets
            averaged exactly (first iterations, small buckets, the policy's raw choices).
        busy_s: seconds the engine thread spent averaging buckets (overlaps the backward
            pass; compare with the step time to see how much of it stays exposed).
        residuals_reset: buckets where a loaded checkpoint's residual pieces could not all
            be placed (parameters of equal shape in a bucket, saved without the model).
        communicator: the :class:`ccoll.Communicator` the buckets go through (its ``stats``
            count bytes in and out).
        gate: with ``policy="auto"``, the step check (:class:`ccoll.torch._stepgate.StepGate`):
            besides the collectives' choice per bucket, the hook times whole steps (from the
            first bucket queued to the last one averaged, the slowest rank's time, agreed
            over the ranks in the background while the next step runs) with compression and
            without (``"raw"``: every bucket of the step through the process group's
            allreduce; an ``"auto"`` step sends there too the buckets that ccoll would
            average exactly whatever their data), and runs the faster way, trying the
            other again after 6, 12, 24, ... steps, unless compressed steps already beat
            the least time a raw step can take at the calibrated link bandwidth
            (``gate.raw_skipped`` counts such tries not made); ``gate.steps`` counts the
            steps of each way, ``gate.mode`` is the current step's. ``None`` with the
            other policies.

    """

    __slots__ = (
        "eb",
        "error_feedback",
        "start_iter",
        "min_numel",
        "comm",
        "communicator",
        "iter",
        "residuals",
        "compressed",
        "exact",
        "busy_s",
        "policy",
        "_finalizer",
        "_free",
        "_bucket_params",
        "_pending",
        "_ckpt_buckets",
        "_seen",
        "_ef_input",
        "residuals_reset",
        "gate",
        "process_group",
        "_gate_comm",
        "_fresh",
        "_gate_t0",
        "_gate_done",
        "_gate_open",
        "_gate_group",
        "_gate_agreed",
        "_shapes",
        "_divert",
        "__weakref__",
    )

    def __init__(
        self,
        eb: ErrorBound | str | None = None,
        *,
        error_feedback: bool = False,
        start_iter: int = 0,
        min_numel: int = 4096,
        comm: Any = None,
        policy: str = "auto",
        timeout: float | None = None,
        process_group: Any = None,
    ) -> None:
        # A bad argument on one rank is recorded, not raised: the agreement raises it on
        # every rank, so the others never wait in a collective this rank skipped.
        base, call, bound, policy = start_call("CCollHookState", eb, comm, policy)
        if not isinstance(error_feedback, (bool, np.bool_)):
            call.problem(InputError,
                         f"error_feedback must be True or False, got {error_feedback!r}")
            error_feedback = False
        start = _checked_int(call, "start_iter", start_iter, 0)
        min_n = _checked_int(call, "min_numel", min_numel, 0)
        if process_group is not None and not (
                dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
            call.problem(InputError, "process_group must be a torch.distributed process "
                         f"group or None, got {type(process_group).__name__}")
            process_group = None
        self.eb = bound
        self.error_feedback = bool(error_feedback)
        self.start_iter = start
        self.min_numel = min_n
        # A rank with other settings would make other collectives per bucket (error
        # feedback adds one for the range of REL bounds): agree on them before any bucket.
        call.feedback = int(self.error_feedback)
        call.start_iter = start
        call.min_numel = min_n
        call.shown.update({"error_feedback": self.error_feedback, "start_iter": start,
                           "min_numel": min_n})
        self.policy = policy
        # Error feedback keeps what this rank's quantization dropped; the requantization of
        # a split bound would drop more, at the block's owner, which no residual keeps:
        # with error feedback the sum is decoded whole (no split), so the identity
        # sum_t y_t = t avg(g) - avg(r_T) holds (docs/training.md). For the same reason
        # every rank is its own node then (ranks_per_node=1): a two-level allreduce
        # quantizes node sums, not each rank's own input.
        self.comm, self.communicator = agreed_communicator(
            base, call, policy, timeout, "CCollHookState",
            split=0.0 if self.error_feedback else None,
            ranks_per_node=1 if self.error_feedback else None)
        self.iter = 0
        self.residuals: dict[int, np.ndarray] = {}
        self.compressed = 0
        self.exact = 0
        self.busy_s = 0.0
        # Error feedback: the parameters of each bucket (their residuals' layout), and
        # residuals of a loaded checkpoint waiting for their bucket (see load_state_dict).
        self._bucket_params: dict[int, tuple[Any, ...]] = {}
        self._pending: dict[Any, np.ndarray] = {}
        # Buckets a checkpoint loaded without the model held residuals of: one whose pieces
        # find no place is counted in residuals_reset even where none of them fits.
        self._ckpt_buckets: set[int] = set()
        self._seen: set[int] = set()  # buckets queued in the current iteration
        # Error feedback's x + r, one array per bucket, kept from step to step (the engine
        # thread's only): a new 60 MB array a step cost page faults, not just the sum.
        self._ef_input: dict[int, np.ndarray] = {}
        self.residuals_reset = 0
        # policy="auto" also compares whole steps with and without compression (the
        # collectives' policy prices each allreduce, not what compressing costs the backward
        # pass): ccoll/torch/_stepgate.py. The steps' times are agreed on a communicator of
        # their own, from the training thread, while the engine thread uses self.comm.
        self.gate = StepGate() if policy == "auto" else None
        self.process_group = process_group
        self._gate_comm = None
        if self.gate is not None:
            from ccoll.collectives.communicator import dup_comm
            from ccoll.collectives.waiting import Deadline

            try:
                self._gate_comm = dup_comm(self.comm, Deadline(self.communicator.timeout,
                                                               "creating a CCollHookState"))
            except BaseException:
                _close_state(self.comm, self.communicator)
                raise
        self._fresh = True  # the next bucket queued is the first of an iteration
        self._gate_t0 = 0.0  # when the current gated step's first bucket was queued
        self._gate_done: float | None = None  # when its last bucket was averaged
        self._gate_open = False  # a gated step was started and not yet measured
        self._gate_group: Any = None  # the group of raw steps (None: ccoll's MPI path)
        self._gate_agreed = False  # whether the ranks agreed on _gate_group (first step)
        # {bucket index: (elements, dtype ccoll reduces it in)} of the buckets seen, and of
        # those an "auto" step sends through the process group (see _divert_settled).
        self._shapes: dict[int, tuple[int, Any]] = {}
        self._divert: dict[int, tuple[int, Any]] = {}
        self._free = [False]  # set by close(): the one place that frees (collectively)
        self._finalizer = weakref.finalize(self, _close_state, self.comm, self.communicator,
                                           self._gate_comm, self._free)
        if policy != "raw":  # local, after every collective here: a rank it fails on waits
            _load_kernels(self.communicator)  # in none that the others entered

    def __repr__(self) -> str:
        return (
            f"CCollHookState(eb={self.eb!r}, error_feedback={self.error_feedback}, "
            f"start_iter={self.start_iter}, min_numel={self.min_numel}, policy={self.policy!r}, "
            f"ranks={self.comm.Get_size()}, iter={self.iter})"
        )

    def __enter__(self) -> "CCollHookState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the communicators and stop the threads; calling it again does nothing.

        Call it on every rank (``MPI_Comm_free`` is collective) after the last backward
        pass that uses the state.
        """
        if self._finalizer.alive:
            self._free[0] = True
        self._finalizer()

    free = close

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self, model: Any = None) -> dict[str, Any]:
        """Return what a resumed run needs to continue exactly: settings, iteration, residuals.

        Plain values and CPU tensors (copies of the error-feedback residuals), so
        ``torch.save`` and ``torch.load(..., weights_only=True)`` take it. Call it between
        steps (after ``backward`` returned: the hook's futures are complete then).

        Residuals belong to parameters, but DDP's buckets are laid out differently in the
        first step of a new process (before DDP rebuilds them) than later. With ``model``
        (the DDP model, or the module it wraps) the residuals are also stored per parameter
        name (``"residuals_by_param"``), which :meth:`load_state_dict` with the same model
        maps onto any bucket layout. Without it, each bucket's residual is stored with its
        parameters' shapes, which find their place again where those shapes are distinct
        within the bucket; other pieces restart from zero (counted in ``residuals_reset``).
        """
        residuals = {int(i): torch.from_numpy(r.copy()) for i, r in self.residuals.items()}
        layout = {
            int(i): [list(p.shape) for p in self._bucket_params.get(i, ())]
            for i in self.residuals
        }
        out: dict[str, Any] = {
            "version": STATE_VERSION,
            "kind": "CCollHookState",
            "eb_kind": self.eb.kind,
            "eb_value": float(self.eb.value),
            "error_feedback": self.error_feedback,
            "start_iter": self.start_iter,
            "min_numel": self.min_numel,
            "policy": self.policy,
            "iter": self.iter,
            "rank": self.comm.Get_rank(),
            "ranks": self.comm.Get_size(),
            "residuals": residuals,
            "residual_shapes": layout,
            "compressed": self.compressed,
            "exact": self.exact,
            "busy_s": self.busy_s,
        }
        if model is not None:
            names = _param_names(model)
            by_param: dict[str, torch.Tensor] = {}
            for i, r in self.residuals.items():
                for p, lo, hi in _pieces(self._bucket_params.get(i, ())):
                    name = names.get(id(p))
                    if name is None or hi > r.size:
                        raise InputError("model does not hold the parameters of the hook's "
                                         "buckets: pass the DDP model the hook is registered on")
                    by_param[name] = torch.from_numpy(r[lo:hi].copy())
            out["residuals_by_param"] = by_param
        return out

    def load_state_dict(self, state: dict[str, Any], model: Any = None) -> None:
        """Restore iteration, residuals and counters saved by :meth:`state_dict`.

        The settings must equal this state's (:class:`ccoll.InputError` names those that
        differ; :meth:`from_state_dict` constructs a state with the checkpoint's settings).
        Pass the same ``model`` as to :meth:`state_dict` to restore residuals by parameter
        name. The residuals take their place in the buckets at the next backward pass.
        Local: no collective call.
        """
        check_version(state, "CCollHookState")
        mine = {
            "eb_kind": self.eb.kind, "eb_value": float(self.eb.value),
            "error_feedback": self.error_feedback, "start_iter": self.start_iter,
            "min_numel": self.min_numel, "policy": self.policy,
        }
        check_settings(mine, state, "CCollHookState")
        counters = {k: count_of(state, k) for k in ("iter", "compressed", "exact")}
        busy = state.get("busy_s")
        if isinstance(busy, bool) or not isinstance(busy, (int, float)) or not (
                math.isfinite(busy) and busy >= 0):
            raise InputError(f"the state dict's busy_s is {busy!r}: expected seconds >= 0")
        # Residuals are this rank's share of the error not yet sent: another rank's, or
        # those of another world size, would carry the wrong error into the next sums.
        where = (self.comm.Get_rank(), self.comm.Get_size())
        saved = (state.get("rank", where[0]), state.get("ranks", where[1]))
        if saved != where and (state.get("residuals") or state.get("residuals_by_param")):
            raise InputError(
                f"the state dict holds the residuals of rank {saved[0]} of {saved[1]}, and "
                f"this is rank {where[0]} of {where[1]}: load each rank's own state dict at "
                "the world size it was saved at")
        pending: dict[Any, np.ndarray] = {}
        ckpt_buckets: set[int] = set()
        by_param = state.get("residuals_by_param")
        if model is not None and by_param is not None:
            named = dict(_named_params(model))
            missing = sorted(set(by_param) - set(named))
            if missing:
                raise InputError(f"the state dict has residuals of parameters {missing[:5]} "
                                 "that model does not have: pass the model it was saved with")
            wrong = sorted(n for n, r in by_param.items() if _host(r).size != named[n].numel())
            if wrong:  # a model of other shapes: its residuals would be dropped unseen
                n = wrong[0]
                raise InputError(
                    f"the state dict's residual of parameter {n!r} has {_host(by_param[n]).size} "
                    f"elements and that model's {n!r} has {named[n].numel()} "
                    f"({len(wrong)} such parameter(s)): pass the model it was saved with")
            for name, r in by_param.items():
                pending[id(named[name])] = _host(r).reshape(-1)
        else:
            shapes = state.get("residual_shapes", {})
            for i, r in state["residuals"].items():
                try:
                    flat = _host(r).reshape(-1)
                    layout = [tuple(int(d) for d in sh) for sh in shapes.get(i, ())]
                except (TypeError, ValueError):
                    raise InputError(f"the state dict's residual of bucket {i!r} or its "
                                     "shapes are not what state_dict() writes (an array and "
                                     "lists of dimensions)") from None
                ckpt_buckets.add(int(i))
                lo = 0
                for sh in layout:
                    hi = lo + math.prod(sh)
                    if layout.count(sh) == 1:  # pieces of equal shape are ambiguous: dropped
                        pending[(int(i), sh)] = flat[lo:hi]
                    lo = hi
        self.residuals = {}
        self._pending = pending
        self._ckpt_buckets = ckpt_buckets
        self.iter = counters["iter"]
        self.compressed = counters["compressed"]
        self.exact = counters["exact"]
        self.busy_s = float(busy)

    @classmethod
    def from_state_dict(
        cls, state: dict[str, Any], model: Any = None, *, comm: Any = None,
        timeout: float | None = None,
    ) -> "CCollHookState":
        """Construct a state with the settings of ``state`` and load it (collective over comm)."""
        check_version(state, "CCollHookState")
        obj = cls(bound_of(state), error_feedback=state["error_feedback"],
                  start_iter=state["start_iter"], min_numel=state["min_numel"],
                  policy=state["policy"], comm=comm, timeout=timeout)
        try:
            obj.load_state_dict(state, model)
        except BaseException:
            obj.close()  # its communicators and threads, now rather than at a collection
            raise
        return obj

    def __getstate__(self) -> dict[str, Any]:
        # No communicator in the pickle: unpickling makes a new one over MPI.COMM_WORLD,
        # collectively (every rank unpickles its copy at the same point, as torch.load of
        # every rank's checkpoint does).
        timeout = self.communicator.timeout
        return {"state": self.state_dict(),
                "timeout": math.inf if timeout is None else timeout}  # None: forever

    def __setstate__(self, data: dict[str, Any]) -> None:
        state = data["state"]
        check_version(state, "CCollHookState")
        self.__init__(  # type: ignore[misc]
            bound_of(state), error_feedback=state["error_feedback"],
            start_iter=state["start_iter"], min_numel=state["min_numel"],
            policy=state["policy"], timeout=data["timeout"],
        )
        self.load_state_dict(state)

    def global_range(self, x: np.ndarray) -> tuple[float, float]:
        """Return the range of the finite values of ``x`` over every rank (collective)."""
        from mpi4py import MPI

        from ccoll.collectives.waiting import Deadline, wait_all
        from ccoll.compressor.cpu import finite_range  # one parallel pass, not numpy's two

        lo, hi = finite_range(x)
        ext = np.array([lo, -hi], dtype=np.float64)
        deadline = Deadline(self.communicator.timeout, "the value range of a gradient bucket")
        try:
            wait_all([self.comm.Iallreduce(MPI.IN_PLACE, ext, op=MPI.MIN)], deadline,
                     "MPI_Iallreduce")
        except BaseException as exc:
            # The bucket's peers are left waiting: later buckets must not run.
            self.communicator._sync.fail(f"the hook's range allreduce raised {type(exc).__name__}")
            raise
        return float(ext[0]), float(-ext[1])


def _load_kernels(cc: Any) -> None:
    """Load the CPU compressor's kernels now, before training, not in its first step.

    The first kernel a process runs makes numba set up its target (about 0.5 s, importing
    SciPy where installed) and each kernel then loads from numba's cache: about 1 s in
    all, which the first compressed step paid (docs/dev/training-runs.md, "The first
    compressed step"). Local: no collective, the same on every rank. Formats 1 and 2
    where the Communicator's plans may pick either; float32, the dtype every bucket but
    float64 ones is compressed in.
    """
    from ccoll.warmup import warm

    fv = cc.format_version
    warm("float32", (1, 2) if fv is None else (fv,))


def _close_state(comm: Any, communicator: Any, gate_comm: Any = None,
                 free: Any = (True,)) -> None:
    # close() (free[0] set: every rank frees here, MPI_Comm_free being collective), or
    # garbage collection of a state never closed, which runs at a point of its own on each
    # rank: it stops the threads and frees no communicator (ccoll/collectives/channel.py).
    from mpi4py import MPI

    from ccoll.collectives.channel import LEAKED

    if free[0]:
        communicator.close()
    else:
        communicator._finalizer()  # the Communicator's own release, without a free
    for c in (comm, gate_comm):
        if c is not None and c != MPI.COMM_NULL and not MPI.Is_finalized():
            if free[0]:
                c.Free()
            else:
                LEAKED[0] += 1


def _named_params(model: Any) -> list[tuple[str, Any]]:
    """Return the named parameters of ``model`` (a DDP model: of the module it wraps)."""
    inner = getattr(model, "module", model) if isinstance(
        model, torch.nn.parallel.DistributedDataParallel) else model
    if not isinstance(inner, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module (or the DDP model), got {model!r}")
    return list(inner.named_parameters())


def _param_names(model: Any) -> dict[int, str]:
    return {id(p): n for n, p in _named_params(model)}


def _pieces(params: Any) -> list[tuple[Any, int, int]]:
    """Return (parameter, start, end) of each parameter's gradient in its bucket.

    DDP packs them one after another, in ``bucket.parameters()`` order.
    """
    out, lo = [], 0
    for p in params:
        out.append((p, lo, lo + p.numel()))
        lo += p.numel()
    return out


def _host(r: Any) -> np.ndarray:
    return np.array(r.numpy() if isinstance(r, torch.Tensor) else r, copy=True)


def _place_residuals(state: CCollHookState, bucket: dist.GradBucket) -> None:
    """Keep each residual with its parameters when DDP lays its buckets out anew.

    DDP rebuilds its buckets after the first iteration (other order, other grouping), and
    a new process starts from the first layout again. Runs on the caller's thread before
    the bucket is queued. At the first bucket of an iteration whose parameters differ from
    those it had, the residuals of the buckets this iteration has not reached yet are cut
    into per-parameter pieces, and each bucket from there on takes its parameters' pieces
    back. The buckets already queued in this iteration kept their parameters (else the
    change would have shown at them), so none of their parameters is among the pieces, and
    the engine thread, which may be working on them, touches no residual cut here.
    """
    index = bucket.index()
    params = tuple(bucket.parameters())
    old = state._bucket_params.get(index)
    if old is not None and (
        len(old) != len(params) or any(a is not b for a, b in zip(old, params, strict=True))
    ):
        for i, r in list(state.residuals.items()):  # a snapshot: the engine may add entries
            if i in state._seen:
                continue
            for p, lo, hi in _pieces(state._bucket_params.get(i, ())):
                if hi <= r.size:
                    state._pending[id(p)] = r[lo:hi]
            state.residuals.pop(i, None)
    state._bucket_params[index] = params
    state._seen.add(index)
    if state._pending:
        _adopt_pending(state, index, params)
    if bucket.is_last():
        state._seen.clear()
        state._pending.clear()  # pieces no bucket took (their parameters left DDP)


def _adopt_pending(state: CCollHookState, index: int, params: tuple[Any, ...]) -> None:
    """Place pending residual pieces (a checkpoint's, or a re-laid bucket's) of ``params``."""
    found: list[tuple[int, int, np.ndarray]] = []
    total = 0
    reset = False
    for p, lo, hi in _pieces(params):
        piece = state._pending.pop(id(p), None)
        if piece is None:
            piece = state._pending.pop((index, tuple(p.shape)), None)
        if piece is not None and piece.size == hi - lo:
            found.append((lo, hi, piece))
        else:
            reset = True
        total = hi
    if found:
        r = np.zeros(total, dtype=found[0][2].dtype)
        for lo, hi, piece in found:
            r[lo:hi] = piece
        state.residuals[index] = r
    had = index in state._ckpt_buckets  # the checkpoint held a residual for this bucket
    state._ckpt_buckets.discard(index)
    if reset and (found or had):
        state.residuals_reset += 1


def _own_residual(x_ef: np.ndarray, eb_avg: float, state: CCollHookState,
                  out: np.ndarray) -> None:
    """Write into ``out`` what the compressed allreduce that just ran dropped of ``x_ef``.

    The rule lives beside the code that quantizes (:func:`ccoll.collectives.hier.own_residual`):
    which pieces, on which grid, the call's schedule quantized this rank's input in.
    """
    from ccoll.collectives.hier import own_residual

    cc = state.communicator
    plan = cc._last_plan()  # the plan of the call that just ran (this thread's, blocking)
    own_residual(x_ef.reshape(-1), cc.size, cc.rank, eb_avg, True, plan, cc.algorithm,
                 out.reshape(-1))


def _ef_input(state: CCollHookState, x: np.ndarray, index: int) -> np.ndarray:
    """Return ``x + r`` (``x`` alone without a residual of its shape) in the bucket's array."""
    buf = state._ef_input.get(index)
    if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
        buf = state._ef_input[index] = np.empty_like(x)
    r = state.residuals.get(index)
    if r is not None and r.shape == x.shape:
        np.add(x, r, out=buf)
    else:
        np.copyto(buf, x)
    return buf


def _reduce(state: CCollHookState, x: Any, index: int, compress: bool,
            narrow: str | None = None) -> None:
    """Average ``x`` over the ranks, in place; count how it went.

    ``x`` is a host numpy array, or, when error feedback is off, the bucket tensor itself
    (a CUDA one: ccoll's collectives then compress, add and decode on the device; a
    float16/bfloat16 one: they hold the bound in its dtype). With error feedback,
    ``narrow`` names the bucket's dtype when ``x`` is its float32 copy (float16/bfloat16).
    """
    cc = state.communicator
    before = cc.stats.compressed_calls
    try:
        _reduce_counted(state, x, index, compress, narrow)
    finally:
        if cc.stats.compressed_calls > before:
            state.compressed += 1
        else:
            state.exact += 1


def _reduce_counted(state: CCollHookState, x: Any, index: int, compress: bool,
                    narrow: str | None) -> None:
    cc = state.communicator
    if not compress:
        cc.allreduce(x, None, "avg", out=x)
        return
    if not state.error_feedback:
        cc.allreduce(x, state.eb, "avg", out=x)
        return
    x_ef = _ef_input(state, x, index)
    compressed_before = cc.stats.compressed_calls
    if narrow is None:
        # The collective resolves the bound on the range of x_ef it agrees anyway (REL),
        # and reports the absolute bound it held (None: exact): no range pass and no range
        # allreduce of the hook's own.
        cc.allreduce(x_ef, state.eb, "avg", out=x)
        held = cc.last_call.eb_abs
        eb_avg = 0.0 if held is None else held
    else:
        # The average is rounded to float16/bfloat16 after this float32 reduction: it gets
        # what that rounding leaves of the bound (the collectives' rule, from the agreed
        # range of x_ef, so every rank decides alike and refuses alike). x_ef is not a
        # value of the dtype, not even on one rank: the rule of a reduction (ranks >= 2).
        lo, hi = state.global_range(x_ef)
        asked = state.eb
        eb_avg = stage_bound(asked.resolve(lo, hi), narrow, lo, hi,
                             ranks=max(2, state.comm.Get_size()), avg=True, asked=asked)
        if eb_avg == 0.0:  # constant bucket (or no room left above the rounding): exact
            cc.allreduce(x_ef, None, "avg", out=x)
            state.residuals.pop(index, None)
            return
        cc.allreduce(x_ef, ABS(eb_avg), "avg", out=x)
    # A step with NaN/Inf is skipped by GradScaler; its residual is not consumed.
    if not math.isfinite(float(np.add.reduce(x, axis=None, dtype=np.float64))):
        return
    if cc.stats.compressed_calls == compressed_before or not eb_avg:
        # The policy sent it raw (or a constant bucket went lossless): nothing dropped.
        state.residuals.pop(index, None)
        return
    r = state.residuals.get(index)
    if (r is None or r.shape != x.shape or r.dtype != x.dtype or not r.flags.writeable
            or not r.flags.c_contiguous):
        r = np.empty_like(x)  # (a residual of the hook's own is overwritten in place)
    _own_residual(x_ef, eb_avg, state, r)
    state.residuals[index] = r


def _average(
    state: CCollHookState,
    tensor: torch.Tensor,
    index: int,
    compress: bool,
    ready: Any,
) -> torch.Tensor:
    """Engine-thread body: average ``tensor`` over the ranks in place and return it."""
    t0 = time.perf_counter()
    try:
        return _average_timed(state, tensor, index, compress, ready)
    finally:
        state.busy_s += time.perf_counter() - t0


def _average_timed(
    state: CCollHookState,
    tensor: torch.Tensor,
    index: int,
    compress: bool,
    ready: Any,
) -> torch.Tensor:
    if ready is not None:
        # CUDA: the gradients were written on the training stream. This thread's torch work
        # waits for them on the device; ccoll's lanes wait for this thread's stream (the
        # collective's DeviceData.ready), so the host never blocks on training.
        torch.cuda.current_stream(tensor.device).wait_event(ready)
    full = tensor.dtype in (torch.float32, torch.float64)
    if not tensor.is_cuda and full:
        _reduce(state, tensor.numpy(), index, compress)  # a view: reduced in place
        return tensor
    if not (compress and state.error_feedback):
        # The collective takes the bucket itself: a CUDA one goes to ccoll's device path
        # (reduced on the GPU), and a float16/bfloat16 one is averaged under the rule of
        # the collectives: the result in its own dtype holds the bound, or every rank
        # refuses it (ccoll.compressor.precision.stage_bound).
        _reduce(state, tensor, index, compress)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)  # ccoll's kernels ran on their own streams
        return tensor
    # Error feedback (the residual bookkeeping lives on the host): a float32 (float64) host
    # copy is reduced and copied back; a float16/bfloat16 bucket's float32 copy gets the
    # bound that its rounding back to the bucket's dtype leaves (_reduce_counted).
    if full:
        host = tensor.to(device="cpu")
        _reduce(state, host.numpy(), index, compress)
        tensor.copy_(host)
    else:
        low = widen(tensor)
        assert low is not None  # a float16 or bfloat16 bucket (checked in comm_hook)
        wide, narrow = low
        _reduce(state, wide, index, compress, narrow.name)
        narrow.into(tensor, wide)
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return tensor


def comm_hook(
    state: CCollHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks with ccoll; return at once with a Future.

    Register with ``ddp_model.register_comm_hook(state, ccoll.torch.comm_hook)``. The
    Future completes on ccoll's progress-engine thread with the averaged bucket (the bucket
    tensor itself, overwritten). Every rank must register the hook with equal settings:
    DDP fires buckets in index order on every rank, and the engine runs them in that order.
    """
    if not isinstance(state, CCollHookState):
        raise InputError(f"state must be a ccoll.torch.CCollHookState, got {type(state).__name__}")
    tensor = bucket.buffer()
    if tensor.layout != torch.strided:  # nn.Embedding(sparse=True) and the like
        raise InputError(
            f"gradient bucket {bucket.index()} is a {tensor.layout} tensor; ccoll averages "
            "dense gradients: make the layer dense (for example nn.Embedding(..., "
            "sparse=False)) or train this model without the ccoll hook"
        )
    if tensor.dtype not in _SUPPORTED:
        raise InputError(
            f"gradient bucket {bucket.index()} has dtype {tensor.dtype}; expected float32, "
            "float64, float16 or bfloat16"
        )
    compress = state.iter >= state.start_iter and tensor.numel() >= state.min_numel
    if state.error_feedback:
        _place_residuals(state, bucket)
    first, last = state._fresh, bucket.is_last()
    state._fresh = last
    gated = state.gate is not None and state.iter >= state.start_iter
    if state.gate is not None and first and not state._gate_agreed:
        _agree_raw_path(state)
    if gated and first:
        _gate_step(state)
    if last:
        state.iter += 1
    raw_step = gated and state.gate is not None and state.gate.mode == RAW
    shape = (tensor.numel(), _reduced_dtype(tensor))
    state._shapes[bucket.index()] = shape
    # An "auto" step's bucket that ccoll would average exactly whatever its data goes the
    # raw steps' way too (_divert_settled).
    divert = gated and not raw_step and state._divert.get(bucket.index()) == shape
    # Steps before start_iter are exact: with a step check they take the raw steps' path
    # (the group's allreduce: ccoll's MPI path cost MiniLM's first step at 4 ranks and
    # 1 Gbit/s 5.6 s against 3.8 s for DDP's own).
    early = state.gate is not None and not gated
    group = state._gate_group if raw_step or divert or early else None
    if group is not None:
        # The step check chose exact averaging for this step (or ccoll would average this
        # bucket exactly): DDP's own allreduce (the process group's, as DDP runs it without
        # a hook), not ccoll's MPI path, which spins on a core the backward pass needs
        # (docs/training.md).
        state.exact += 1
        tensor.div_(group.size())  # first, as DDP does (no overflow in float16)
        out = dist.all_reduce(tensor, group=group, async_op=True).get_future().then(
            lambda f: f.value()[0])
    else:
        out = _queue(state, tensor, bucket.index(), compress and not raw_step)
    if gated and last:
        return _step_done(state, out, tensor)
    return out


def _queue(state: CCollHookState, tensor: torch.Tensor, index: int,
           compress: bool) -> torch.futures.Future[torch.Tensor]:
    """Queue the bucket on ccoll's engine; return its Future."""
    from ccoll.runtime.progress import submit

    ready = None
    if tensor.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[tensor.device] if tensor.is_cuda else None
    )

    def complete(req: Any) -> None:
        exc = req.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(req.wait())

    req = submit(_average, state, tensor, index, compress, ready, comm=state.comm)
    req.add_done_callback(complete)
    # Chaining makes a failure a real error of the returned future: DDP then raises a
    # RuntimeError that names ccoll's exception and message ("MismatchError: ranks disagree
    # ..."), where a bare set_exception would surface as "Unable to cast ... to Tensor".
    return fut.then(_value)


def _raw_group(state: CCollHookState) -> Any:
    """Return the process group for the step check's exact steps (None: ccoll's MPI path).

    ``state.process_group`` if given; else torch's default group when it is initialised and
    spans the ranks of the state's communicator (``MPI.COMM_WORLD``, as DDP's default).
    """
    from mpi4py import MPI

    if state.process_group is not None:
        return state.process_group
    if not dist.is_initialized() or dist.get_world_size() != state.comm.Get_size():
        return None
    if MPI.Comm.Compare(state.comm, MPI.COMM_WORLD) not in (MPI.IDENT, MPI.CONGRUENT):
        return None
    return dist.group.WORLD


def _gate_step(state: CCollHookState) -> None:
    """Start a gated step: agree on the previous step's time and set this one's mode.

    Runs on the training thread at the step's first bucket; every rank runs the same gated
    steps, so every rank makes the same reductions and feeds the gate the same maximum over
    ranks: the previous step's time goes into a one-float ``MPI_Iallreduce`` on a
    communicator of the hook's own, polled with sleeps, so the gate learns a step's time one
    step later. Not on the DDP process group: a reduction queued there when a step's last
    bucket was averaged (on ccoll's engine thread, or the group's) met DDP's own
    collective of unused parameters (``find_unused_parameters=True``), queued by the
    training thread at the same time, in either order; ranks that queued them in different
    orders aborted in gloo ("Received data size doesn't match") or hung.
    """
    assert state.gate is not None
    prev = None
    if state._gate_open:
        done = state._gate_done
        prev = 0.0 if done is None else done - state._gate_t0
    agreed = None if prev is None else _agree_max_mpi(state, prev)
    state._gate_t0 = time.perf_counter()
    state._gate_done = None
    state._gate_open = True
    mode = state.gate.next(agreed, _raw_floor(state))
    state._divert = _divert_settled(state) if mode != RAW else {}


# A raw step's floor is this share of its buckets' ring time at the calibrated bandwidth: a
# probe on a loaded machine has measured the bandwidth 5x too low, and a floor set too
# high would stop raw tries that could win (docs/training.md, "The step check").
_FLOOR_SHARE = 0.5


def _raw_floor(state: CCollHookState) -> float | None:
    """Return the least seconds a raw step's averaging can take, or None where unknown.

    The previous step's buckets, allreduced by a ring at the link bandwidth that the
    Communicator's calibration measured (probe, cache or the settings; not the model's
    defaults), times :data:`_FLOOR_SHARE`. Every rank has the same buckets and the same
    calibration, so the same floor.
    """
    cc = state.communicator
    cal = cc.calibration
    n = cc.size
    if n < 2 or not state._shapes or cal.link not in ("probe", "cache", "settings"):
        return None
    nbytes = sum(count * dtype.itemsize for count, dtype in state._shapes.values())
    return _FLOOR_SHARE * 2 * (n - 1) / n * nbytes / cal.params.beta


def _reduced_dtype(tensor: torch.Tensor) -> Any:
    """Return the dtype ccoll averages a bucket in (float16/bfloat16: the torch dtype)."""
    if tensor.dtype in _LOW_PRECISION:
        return tensor.dtype  # averaged in its own dtype: never a settled raw plan
    return np.dtype(np.float64) if tensor.dtype == torch.float64 else np.dtype(np.float32)


def _divert_settled(state: CCollHookState) -> dict[int, tuple[int, Any]]:
    """Return the buckets of an ``"auto"`` step that go through the process group.

    Those that ccoll would average exactly whatever their data: too small to compress
    (``min_numel``), or whose plan is raw and settled (what the Communicator's fast path
    runs, :meth:`ccoll.Communicator._raw_settled`). Through ccoll
    they would take its MPI path, which costs the backward pass more than the group's
    allreduce does (docs/training.md), and an "auto" step that compresses nothing would
    then run slower than the raw steps it is compared with. Asked at the step's first
    bucket, on the training thread: DDP has waited for the previous step's buckets, so
    ccoll's engine is idle and every rank reads the same agreed state; the bucket layout
    is the previous step's, and a bucket whose size then differs takes ccoll's path.
    Without a process group for raw steps: none.
    """
    if state._gate_group is None:
        return {}
    # With error feedback too: a full-precision bucket's call carries state.eb (the
    # collective resolves it), so its signature is this one; a diverted bucket keeps its
    # residual for the next compressed step, as in a raw step. (Float16/bfloat16 buckets
    # are averaged in their own dtype: never a settled raw plan.)
    cc = state.communicator
    out = {}
    for index, (count, dtype) in sorted(state._shapes.items()):
        if count < state.min_numel or (isinstance(dtype, np.dtype) and cc._raw_settled(
                count, dtype, state.eb, consume=True)):
            out[index] = (count, dtype)
    return out


def _agree_raw_path(state: CCollHookState) -> None:
    """Agree, at the first step's first bucket, on the path of exact steps (collective).

    The process group's allreduce where every rank has one, else ccoll's MPI path; the
    steps before ``start_iter`` and the step check's raw steps take it.
    """
    state._gate_group = _agreed_raw_group(state)
    state._gate_agreed = True


def _agreed_raw_group(state: CCollHookState) -> Any:
    """Return :func:`_raw_group`, checked to be a group on every rank or on none.

    Collective over the hook's step-check communicator (once, at the first step): a
    rank whose raw steps went through the process group while another's took MPI would
    wait in a collective the other never enters.
    """
    from mpi4py import MPI

    from ccoll.collectives.waiting import Deadline, wait_all

    assert state._gate_comm is not None
    group = _raw_group(state)
    mine = 0 if group is None else _group_identity(group)
    both = np.array([mine, -mine], dtype=np.int64)
    deadline = Deadline(state.communicator.timeout, "the step check's process-group check")
    wait_all([state._gate_comm.Iallreduce(MPI.IN_PLACE, both, op=MPI.MIN)], deadline,
             "MPI_Iallreduce", poll=True)
    if both[0] != -both[1]:
        raise MismatchError(
            "ranks disagree on the process group of the step check's exact steps: some have "
            "one (process_group=, or torch's default group over MPI.COMM_WORLD's ranks), "
            "others none or another group (torch's collectives on two groups never meet, "
            "even of the same ranks); pass the same process_group to CCollHookState on "
            "every rank")
    return group


def _group_identity(group: Any) -> int:
    """Return a positive 52-bit digest of a process group's name and ranks.

    torch names groups in the order they are made, the same on every rank.
    """
    import hashlib

    try:
        ranks = list(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group torch cannot describe: its name alone
        ranks = []
    text = repr((str(getattr(group, "group_name", "")), ranks))
    return 1 + (int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                               "little") >> 12)


def _agree_max_mpi(state: CCollHookState, seconds: float) -> float:
    from mpi4py import MPI

    from ccoll.collectives.waiting import Deadline, wait_all

    assert state._gate_comm is not None
    t = np.array([seconds], dtype=np.float64)
    deadline = Deadline(state.communicator.timeout, "the step time of the hook's step check")
    wait_all([state._gate_comm.Iallreduce(MPI.IN_PLACE, t, op=MPI.MAX)], deadline,
             "MPI_Iallreduce", poll=True)
    return float(t[0])


def _step_done(state: CCollHookState, out: torch.futures.Future[torch.Tensor],
               tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Return the last bucket's Future, noting the step's end when its average is done."""
    def finish(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        value = f.wait()  # raises the bucket's error, if any
        state._gate_done = time.perf_counter()
        return value

    return out.then(finish)


def _value(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.wait()
