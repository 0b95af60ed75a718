"""Lanes that share one device between training, compression, reduction and copies.

A :class:`Scheduler` owns four lanes, in priority order: ``compute`` (training, highest),
``reduce`` and ``copy``, then ``compress`` (lowest). Every lane has the same interface on
both devices (see docs/scheduler.md):

- ``lane.submit(fn, *args, after=[events], **kwargs) -> Event``: ``fn`` runs after all work
  submitted to the lane before it and after every event in ``after``;
- ``lane.record() -> Event``: completes when all work submitted to the lane so far has;
- ``lane.wait(event)``: work submitted to the lane from now on starts after ``event``;
- ``lane.wait_stream(user_stream) -> Event``: same, for all work queued so far on a stream
  the caller owns (training code hands its stream this way);
- ``lane.synchronize()``: block until the lane is idle; raise the lane's first error.

``event.wait(timeout=None)`` returns what the submitted ``fn`` returned (None for
``record``) or re-raises what it raised; ``event.query()`` tells without blocking.

device="cpu": each lane is a worker thread that runs its callables in order. Lanes below
``compute`` lower their thread's CPU priority (Linux ``setpriority`` on the thread id) and
use at most ``grid_limit(lane)`` numba threads.

device="cuda": each lane is a CUDA stream with a priority (CuPy, else cuda.core, else
plain numba streams without priority); ``fn`` is called at once on the submitting thread
and must enqueue its GPU work on ``lane.stream`` (also returned by :func:`current_stream`
while ``fn`` runs); events are CUDA events recorded on and waited for by the streams.

Errors are sticky per lane, as on a CUDA stream: once a callable on a lane raised (or the
lane depended on a failed event), every later submit and record on that lane fails with
the same exception without running, until ``lane.synchronize()`` (or
``Scheduler.synchronize()``) reports it and clears it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ccoll.errors import CCollError
from ccoll.gpu_sched.lanes import LANES, Event, Lane, current_lane, current_stream

__all__ = [
    "LANES",
    "DEFAULT_PRIORITY_RANKS",
    "Event",
    "Lane",
    "Scheduler",
    "configure",
    "current_lane",
    "current_stream",
    "default_scheduler",
    "configured_on",
    "yield_to_training",
]

# 0 = highest. Reduction and copies sit on the collective's critical path once data has
# arrived; compression overlaps with the backward pass and should yield to it.
DEFAULT_PRIORITY_RANKS: Mapping[str, int] = {"compute": 0, "reduce": 1, "copy": 1, "compress": 2}


def _check_fraction(name: str, f: float) -> float:
    f = float(f)
    if not (0.0 < f <= 1.0):
        raise ValueError(f"max_sm_fraction for lane {name!r} must be in (0, 1], got {f!r}")
    return f


class Scheduler:
    """The four lanes on one device, their priorities and their share of the device.

    Parameters
    ----------
    device:
        ``"cpu"`` (worker threads) or ``"cuda"`` (prioritized CUDA streams on the current
        device, or in numba's CUDA simulator).
    max_sm_fraction:
        Share of the device that one kernel launched on a lane other than ``compute``
        should occupy at most, as a float for all of them or a mapping per lane (lanes not
        named get 1.0); see :meth:`grid_limit`. ``compute`` is never capped.
    priorities:
        Priority rank per lane, 0 = highest (default :data:`DEFAULT_PRIORITY_RANKS`). On
        CUDA the ranks are spread over the device's stream-priority range; on CPU a lane's
        thread gets ``5 * rank`` added to its nice value (Linux).
    sm_count, max_threads_per_sm, max_blocks_per_sm:
        Override what is read from the device (the CUDA simulator has no such attributes
        and uses 1, 2048 and 32).

    """

    def __init__(
        self,
        device: str = "cpu",
        *,
        max_sm_fraction: float | Mapping[str, float] = 0.5,
        priorities: Mapping[str, int] | None = None,
        sm_count: int | None = None,
        max_threads_per_sm: int | None = None,
        max_blocks_per_sm: int | None = None,
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        ranks = dict(DEFAULT_PRIORITY_RANKS)
        if priorities is not None:
            unknown = set(priorities) - set(LANES)
            if unknown:
                raise ValueError(f"unknown lane(s) {sorted(unknown)}; lanes are {list(LANES)}")
            for name, r in priorities.items():
                if int(r) != r or r < 0:
                    raise ValueError(f"priority rank of {name!r} must be an int >= 0, got {r!r}")
            ranks.update({k: int(v) for k, v in priorities.items()})
        self.priority_ranks: dict[str, int] = ranks
        if isinstance(max_sm_fraction, Mapping):
            unknown = set(max_sm_fraction) - set(LANES)
            if unknown:
                raise ValueError(f"unknown lane(s) {sorted(unknown)}; lanes are {list(LANES)}")
            fr = {n: _check_fraction(n, max_sm_fraction.get(n, 1.0)) for n in LANES}
        else:
            fr = {n: _check_fraction(n, max_sm_fraction) for n in LANES}
        fr["compute"] = 1.0
        self.sm_fractions: dict[str, float] = fr
        self._lock = threading.Lock()
        self._closed = False
        self._lanes: dict[str, Lane]
        if device == "cpu":
            from ccoll.gpu_sched.thread_lanes import cpu_thread_count, make_thread_lanes

            self._units = cpu_thread_count()
            self._lanes = make_thread_lanes(self.priority_ranks, self.sm_fractions)
        else:
            from ccoll.gpu_sched.cuda_lanes import device_limits, make_cuda_lanes

            sms, tps, bps = device_limits()
            self._units = int(sm_count or sms)
            self._max_threads_per_sm = int(max_threads_per_sm or tps)
            self._max_blocks_per_sm = int(max_blocks_per_sm or bps)
            self._lanes = make_cuda_lanes(self.priority_ranks)

    # -- lanes ------------------------------------------------------------------------

    @property
    def lanes(self) -> dict[str, Lane]:
        """The lanes by name (a copy)."""
        return dict(self._lanes)

    def lane(self, name: str) -> Lane:
        """Return the lane called ``name`` (one of :data:`LANES`)."""
        if self._closed:
            raise CCollError("the scheduler is closed")
        try:
            return self._lanes[name]
        except KeyError:
            raise ValueError(f"unknown lane {name!r}; lanes are {list(LANES)}") from None

    def adopt_stream(self, user_stream: Any, lane: str = "compute") -> Lane:
        """Make ``lane`` (default ``compute``) run on the caller's own stream.

        Accepts a ``torch.cuda.Stream``, a CuPy stream, a numba stream, a cuda.core stream
        (anything with ``__cuda_stream__``) or a raw ``cudaStream_t`` as int. Afterwards
        ``sched.lane("compute").record()`` marks the training stream's progress, and the
        other lanes ``wait`` on such events, so ccoll waits on exactly the work that
        produced its inputs. The stream stays owned by the caller. On ``device="cpu"`` only
        ``None`` (the calling thread) is accepted and nothing changes.
        """
        ln = self.lane(lane)
        ln.adopt(user_stream)
        return ln

    def priority(self, lane: str) -> int | None:
        """Return the lane's priority: CUDA stream priority (lower = higher), or nice value."""
        return self.lane(lane).priority

    def grid_limit(
        self, lane: str, *, threads_per_block: int = 256, blocks_per_sm: int | None = None
    ) -> int:
        """Return the most thread blocks one kernel on ``lane`` should launch.

        CUDA: ``floor(SMs * max_sm_fraction[lane]) * blocks_per_sm`` (at least 1), where
        ``blocks_per_sm`` defaults to how many blocks of ``threads_per_block`` threads fit on
        one SM. A kernel that launches at most that many blocks (grid-stride over its work)
        leaves the other SMs free for training kernels, which stream priority alone cannot
        do once long-running low-priority blocks occupy every SM.
        CPU: ``floor(numba threads * max_sm_fraction[lane])`` (at least 1), the numba
        thread count the lane's worker thread uses; ``threads_per_block`` is ignored.
        """
        self.lane(lane)
        if threads_per_block <= 0:
            raise ValueError(f"threads_per_block must be > 0, got {threads_per_block}")
        units = max(1, int(self._units * self.sm_fractions[lane]))
        if self.device == "cpu":
            return units
        if blocks_per_sm is None:
            blocks_per_sm = min(
                self._max_threads_per_sm // threads_per_block, self._max_blocks_per_sm
            )
        if blocks_per_sm <= 0:
            raise ValueError(
                f"blocks_per_sm must be > 0 (threads_per_block={threads_per_block} exceeds "
                f"{self._max_threads_per_sm} threads per SM?)"
            )
        return units * int(blocks_per_sm)

    # -- whole scheduler -----------------------------------------------------------------

    def synchronize(self) -> None:
        """Synchronize every lane; raise the first error found (every lane is cleared)."""
        first: BaseException | None = None
        for name in LANES:
            try:
                self._lanes[name].synchronize()
            except BaseException as exc:  # noqa: BLE001 - reported after all lanes are idle
                if first is None:
                    first = exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Let pending work finish, then release threads and streams."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for ln in self._lanes.values():
            ln.close()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ccoll Scheduler device={self.device!r} lanes={list(self._lanes)}>"


_default: dict[str, Scheduler] = {}
_default_lock = threading.Lock()
# Options of the process-wide schedulers, per device, set by configure().
_options: dict[str, dict[str, Any]] = {"cpu": {}, "cuda": {}}
_enabled = True
# Tasks of ccoll's collectives queued or running on a process-wide scheduler's lanes.
_busy: dict[str, int] = {"cpu": 0, "cuda": 0}

# On the CPU a lane's numba threads are already capped by the rank's share of its cores
# (ccoll.runtime.cpu_threads); a further cap by default would only slow collectives that
# run beside no training. configure(max_sm_fraction=0.5) leaves half the share to training.
_DEFAULT_FRACTION = {"cpu": 1.0, "cuda": 0.5}

# Until training code registers (yield_to_training), the process-wide CPU lanes run at
# nice 0: nice'd lanes measured 10-24% slower collectives at 64 MiB where ranks share
# cores, since every nice-0 thread (the ranks' polling driving threads, other processes)
# preempts them, and there is no training to give the cores to.
_FLAT: Mapping[str, int] = dict.fromkeys(LANES, 0)
_training = False

def default_scheduler(device: str = "cpu") -> Scheduler:
    """Return the process-wide scheduler for ``device``, created on first use.

    It is created with the options of :func:`configure` (the defaults of
    :class:`Scheduler` where none were given) and shared by every Communicator, the DDP
    hook and the FSDP reduce-scatter of the process.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    with _default_lock:
        s = _default.get(device)
        if s is None or s._closed:
            opts = {"max_sm_fraction": _DEFAULT_FRACTION[device], **_options[device]}
            if device == "cpu" and "priorities" not in opts and not _training:
                opts["priorities"] = _FLAT  # nothing to yield to yet: see yield_to_training
            s = _default[device] = Scheduler(device, **opts)
        return s


def configure(
    device: str | None = None,
    *,
    max_sm_fraction: float | Mapping[str, float] | None = None,
    priorities: Mapping[str, int] | None = None,
    enabled: bool = True,
) -> None:
    """Set the options of the process-wide scheduler(s) that ccoll's collectives use.

    ``device``: ``"cpu"``, ``"cuda"`` or None (both). ``max_sm_fraction`` and
    ``priorities`` are :class:`Scheduler`'s (None: its defaults). ``enabled=False`` makes
    the collectives run their compute on a private thread per channel instead of the lanes
    (as the environment variable ``CCOLL_SCHED=off`` does); it applies to both devices.

    The options are checked here (``ValueError`` naming the problem). A scheduler that
    already exists for ``device`` is closed and the next call of :func:`default_scheduler`
    creates one with the new options; while a collective has tasks on its lanes this
    raises :class:`~ccoll.errors.CCollError` and changes nothing (call it between
    collectives).
    """
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or None (both), got {device!r}")
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True or False, got {enabled!r}")
    opts: dict[str, Any] = {}
    if max_sm_fraction is not None:
        if isinstance(max_sm_fraction, Mapping):
            unknown = set(max_sm_fraction) - set(LANES)
            if unknown:
                raise ValueError(f"unknown lane(s) {sorted(unknown)} in max_sm_fraction; lanes "
                                 f"are {list(LANES)}")
            for n, f in max_sm_fraction.items():
                _check_number(f"max_sm_fraction[{n!r}]", f)
                _check_fraction(n, f)
        else:
            _check_number("max_sm_fraction", max_sm_fraction)
            _check_fraction("every lane", max_sm_fraction)
        opts["max_sm_fraction"] = max_sm_fraction
    if priorities is not None:
        if not isinstance(priorities, Mapping):
            raise ValueError(f"priorities must map lane names to ranks, got {priorities!r}")
        unknown = set(priorities) - set(LANES)
        if unknown:
            raise ValueError(f"unknown lane(s) {sorted(unknown)} in priorities; lanes are "
                             f"{list(LANES)}")
        for name, r in priorities.items():
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"priority rank of {name!r} must be an int >= 0, got {r!r}")
        opts["priorities"] = dict(priorities)
    devices = ("cpu", "cuda") if device is None else (device,)
    global _enabled
    with _default_lock:
        for d in devices:
            if _busy[d]:
                raise CCollError(
                    f"ccoll.gpu_sched.configure() while a collective has {_busy[d]} task(s) on "
                    f"the process-wide {d!r} scheduler's lanes: wait for the collectives "
                    "(and iallreduce requests) to finish, then configure"
                )
        old = [_default.pop(d) for d in devices if d in _default]
        for d in devices:
            _options[d] = opts
        _enabled = enabled
    for s in old:
        s.close()


def yield_to_training() -> None:
    """Give the process-wide CPU lanes their default priorities below training, from now on.

    Called when training code registers with ccoll (a DDP hook state, an FSDP
    reduce-scatter): until then the lanes run at nice 0, since there is nothing to yield
    to. An idle scheduler that exists already is closed and the next one gets the
    priorities; one with tasks in flight keeps its own until :func:`configure`. Priorities
    set with :func:`configure` stand. Raising a nice value cannot be undone without
    privileges, so this holds for the rest of the process.
    """
    global _training
    with _default_lock:
        if _training:
            return
        _training = True
        s = _default.get("cpu")
        if s is None or "priorities" in _options["cpu"] or _busy["cpu"]:
            return
        del _default["cpu"]
    s.close()


def _check_number(what: str, f: Any) -> None:
    if isinstance(f, bool) or not isinstance(f, (int, float)):
        raise ValueError(f"{what} must be a number in (0, 1], got {f!r}")


def configured_on() -> bool:
    """Whether :func:`configure` left the lanes on (the process-wide switch)."""
    return _enabled


def task_started(device: str) -> None:
    """Count a collective task queued on the process-wide lanes (see :func:`configure`)."""
    with _default_lock:
        _busy[device] += 1


def task_finished(device: str) -> None:
    """Count one such task finished or dropped."""
    with _default_lock:
        _busy[device] -= 1
