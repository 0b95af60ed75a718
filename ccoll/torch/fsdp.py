"""FSDP2's gradient reduce-scatter through ccoll's error-bounded ``reduce_scatter``.

PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters the gradients of
each FSDP module once per backward pass, and lets a user replace that collective with
``FSDPModule.set_custom_reduce_scatter(comm)``: ``comm.allocate(size, dtype=, device=)``
makes the flat buffers, ``comm(output_tensor, input_tensor, group, op, async_op=False)``
reduces. :class:`FSDPReduceScatter` is such a ``comm``; :meth:`FSDPReduceScatter.attach`
gives it to every FSDP module of a model, with what it needs to know about each module's
parameters (their names and where their shards lie in the flat buffer), so that
parameters the user exempts and small ones are reduced exactly.

What FSDP hands over (torch 2.13, ``foreach_reduce``): one flat input of ``N * C`` elements
laid out as ``N`` rows of ``C`` (row ``r`` is what rank ``r`` keeps), each row the padded
shards of the module's parameters that have a gradient, in ``fsdp_params`` order; the
output is this rank's row of the reduction. ``op`` is ``AVG`` for float32 and bfloat16
reductions (the default) and ``SUM`` for float16 and float64, FSDP then dividing the
output by its post-division factor; under HSDP it all-reduces the outputs across the
replicas first. docs/training.md ("FSDP2", "HSDP") has the error bound and how it is split.
"""

from __future__ import annotations

import fnmatch
import hashlib
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ccoll.errorbound import ABS, REL, ErrorBound
from ccoll.errors import CollectiveError, InputError, MismatchError
from ccoll.torch._state import (
    STATE_VERSION,
    agreed_communicator,
    bound_of,
    check_settings,
    check_version,
    count_of,
    start_call,
)

__all__ = ["FSDPReduceScatter"]

_SUPPORTED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _exempt_patterns(exempt: Any) -> tuple[str, ...] | None:
    if isinstance(exempt, str):
        exempt = (exempt,)
    try:
        pats = tuple(exempt)
    except TypeError:
        return None
    return pats if all(isinstance(p, str) for p in pats) else None


class FSDPReduceScatter:
    """FSDP2 reduce-scatter with ccoll's error-bounded ``reduce_scatter``.

    Args:
        eb: bound of every element of the sharded gradient FSDP writes, against the exact
            average of every data-parallel rank's gradient (the sum divided by FSDP's
            divide factor; with HSDP after its all-reduce across the replicas; the bound is
            split with FSDP's division factors and the replicas as docs/training.md says):
            ``ccoll.ABS(e)``, ``ccoll.REL(v)`` (``v`` times the range of the values handed to
            the reduce-scatter, over the ranks of ``comm``, per FSDP module), or a string
            ``"rel:1e-3"``. Default ``REL(1e-3)``.
        policy: ``"auto"`` (ccoll's cost model decides per call whether compressing pays),
            ``"compress"`` (always) or ``"raw"`` (never: plain MPI through the same path).
        comm: mpi4py intracommunicator with the ranks of FSDP's reduce-scatter group, in
            the same order (default ``MPI.COMM_WORLD``, right for 1-D FSDP on a process
            group made by :func:`ccoll.torch.init_process_group_from_mpi`; with HSDP the
            ranks of this rank's shard group). The object works on a duplicate of it:
            constructing it is collective over ``comm``.
        exempt: parameter-name patterns (``fnmatch``, matched against the parameter's
            full name, e.g. ``("*bias", "*norm*")``) whose gradients are reduced exactly.
            Needs :meth:`attach` (a module given the object directly with
            ``set_custom_reduce_scatter`` has no names to match).
        min_numel: parameters with fewer elements are reduced exactly (with :meth:`attach`),
            and so is a whole reduce-scatter of fewer elements (its input, all ranks' rows).
        timeout: seconds a collective may wait without progress (nothing from its peers)
            before it raises :class:`ccoll.CollectiveError` on every rank that waits
            (default ``None``: the ``CCOLL_TIMEOUT`` setting, else 600 s; ``math.inf``: wait
            forever, as MPI does). See ``ccoll.Communicator``.

    Every rank must construct it with the same settings (checked: a difference raises
    :class:`ccoll.MismatchError` on every rank). ``async_op=True`` runs the reduction on
    ccoll's progress engine and returns a ``torch.distributed.Work``; torch 2.13's FSDP
    calls it synchronously (from its reduce-scatter stream), so that is the path it takes.

    Attributes:
        compressed / exact: reduce-scatter calls that went through compression, and those
            reduced exactly (small, exempt-only, raw by the policy). A call whose module
            mixes exempt and other parameters makes one collective of each kind.
        elements_compressed / elements_exact: elements (per rank, output side) of each kind.
        unknown_layout: calls whose buffer did not match the module's parameters (some had
            no gradient): reduced exactly as a whole, so exempt parameters stay exact.
        communicator: the :class:`ccoll.Communicator` the calls go through.

    """

    def __init__(
        self,
        eb: ErrorBound | str | None = None,
        *,
        policy: str = "auto",
        comm: Any = None,
        exempt: Iterable[str] = (),
        min_numel: int = 4096,
        timeout: float | None = None,
    ) -> None:
        # Problems are recorded and raised by the agreement on every rank at once.
        base, call, bound, policy = start_call("FSDPReduceScatter", eb, comm, policy)
        if isinstance(min_numel, bool) or not isinstance(min_numel, (int, np.integer)) or (
            min_numel < 0
        ):
            call.problem(InputError, f"min_numel must be an int >= 0, got {min_numel!r}")
            min_numel = 0
        pats = _exempt_patterns(exempt)
        if pats is None:
            call.problem(InputError, "exempt must be a sequence of parameter-name patterns "
                         f"(strings such as '*bias'), got {exempt!r}")
            pats = ()
        self.eb = bound
        self.policy = policy
        self.min_numel = int(min_numel)
        self.exempt = pats
        self.timeout = timeout
        call.min_numel = self.min_numel
        # Which parameters go exact decides which collective each column takes: agreed (its
        # digest in the creation call's settings field), or ranks whose exempt columns have
        # the same sizes would add one rank's a.bias to another's b.bias without an error.
        call.settings = int.from_bytes(
            hashlib.blake2b(repr(pats).encode(), digest_size=8).digest(), "little") >> 12
        call.shown.update({"min_numel": self.min_numel, "settings": f"exempt={pats!r}"})
        self.comm, self.communicator = agreed_communicator(base, call, policy, timeout,
                                                           "FSDPReduceScatter")
        self._free = [False]  # set by close(): the one place that frees (collectively)
        self._finalizer = weakref.finalize(self, _close, self.comm, self.communicator,
                                           self._free)
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self.compressed = 0
        self.exact = 0
        self.elements_compressed = 0
        self.elements_exact = 0
        self.unknown_layout = 0

    def __repr__(self) -> str:
        return (f"FSDPReduceScatter(eb={self.eb!r}, policy={self.policy!r}, "
                f"exempt={self.exempt!r}, min_numel={self.min_numel}, "
                f"ranks={self.comm.Get_size()})")

    def __enter__(self) -> FSDPReduceScatter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the duplicated communicators; calling it again does nothing.

        Call it on every rank (``MPI_Comm_free`` is collective). An object garbage
        collected unclosed stops its Communicator's threads but leaves its communicators to
        ``MPI_Finalize`` (a collector runs at a point of its own on each rank).
        """
        self.wait_pending()
        if self._finalizer.alive:
            self._free[0] = True
        self._finalizer()

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return settings and counters (plain values: ``torch.save`` with ``weights_only``).

        There is no per-step memory (no error feedback): the reduction of a step depends
        only on that step's gradients, so a resumed run reduces exactly as the
        uninterrupted one does.
        """
        return {
            "version": STATE_VERSION,
            "kind": "FSDPReduceScatter",
            "eb_kind": self.eb.kind,
            "eb_value": float(self.eb.value),
            "policy": self.policy,
            "min_numel": self.min_numel,
            "exempt": list(self.exempt),
            "compressed": self.compressed,
            "exact": self.exact,
            "elements_compressed": self.elements_compressed,
            "elements_exact": self.elements_exact,
            "unknown_layout": self.unknown_layout,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters of :meth:`state_dict`; the settings must equal this object's.

        Raises :class:`ccoll.InputError` naming the settings that differ (construct the
        object with the checkpoint's settings: ``FSDPReduceScatter.from_state_dict``).
        """
        check_version(state, "FSDPReduceScatter")
        mine = self.state_dict()
        keys = ("eb_kind", "eb_value", "policy", "min_numel", "exempt")
        check_settings({k: mine[k] for k in keys}, state, "FSDPReduceScatter")
        for k in ("compressed", "exact", "elements_compressed", "elements_exact",
                  "unknown_layout"):
            setattr(self, k, count_of(state, k))

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, comm: Any = None,
                        timeout: float | None = None) -> FSDPReduceScatter:
        """Construct an object with the settings of ``state`` and load it (collective)."""
        check_version(state, "FSDPReduceScatter")
        obj = cls(bound_of(state), policy=state["policy"], comm=comm,
                  exempt=tuple(state["exempt"]), min_numel=state["min_numel"], timeout=timeout)
        try:
            obj.load_state_dict(state)
        except BaseException:
            obj.close()  # its communicators and threads, now rather than at a collection
            raise
        return obj

    def __getstate__(self) -> dict[str, Any]:
        # No communicator in the pickle: unpickling makes a new one over MPI.COMM_WORLD,
        # which is collective (every rank unpickles its copy at the same point).
        return {"state": self.state_dict(), "timeout": self.timeout}

    def __setstate__(self, data: dict[str, Any]) -> None:
        state = data["state"]
        check_version(state, "FSDPReduceScatter")
        self.__init__(bound_of(state), policy=state["policy"],  # type: ignore[misc]
                      exempt=tuple(state["exempt"]), min_numel=state["min_numel"],
                      timeout=data["timeout"])
        self.load_state_dict(state)

    # -- FSDP's protocol -----------------------------------------------------------------

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return a plain ``torch.empty`` buffer (ccoll reads and writes ordinary memory)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` (FSDP's protocol).

        Without :meth:`attach` the whole buffer is one collective (no exemptions).
        """
        return self._reduce(output_tensor, input_tensor, group, op, async_op, None)

    def attach(self, model: torch.nn.Module) -> int:
        """Give this reduce-scatter to every FSDP module of ``model``; return how many.

        Each module gets a view of this object that knows the names and shard sizes of its
        parameters (for ``exempt`` and ``min_numel``); counters and communicator are
        shared. Collective over the communicator (it checks once that FSDP's
        reduce-scatter group has this communicator's ranks and size): call it on every rank.
        """
        from mpi4py import MPI
        from torch.distributed.fsdp import FSDPModule

        views: list[tuple[Any, _ModuleView]] = []
        problem = ""
        if not isinstance(model, torch.nn.Module):  # told to every rank below
            problem = (f"attach takes the model (a torch.nn.Module with FSDP modules), got "
                       f"{type(model).__name__}")
            model = torch.nn.Module()
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = module._get_fsdp_state()._fsdp_param_groups
            if len(groups) > 1:
                problem = ("a module has several FSDP parameter groups (shard_placement_fn "
                           "with per-parameter meshes); set_custom_reduce_scatter cannot "
                           "serve them")
            for pg in groups:
                pgroup = pg.mesh_info.shard_process_group  # type: ignore[attr-defined]
                if (pgroup.size(), pgroup.rank()) != (self.comm.Get_size(), self.comm.Get_rank()):
                    problem = (f"FSDP's reduce-scatter group is rank {pgroup.rank()} of "
                               f"{pgroup.size()}, but comm is rank {self.comm.Get_rank()} of "
                               f"{self.comm.Get_size()}: pass comm= an MPI communicator with "
                               "the ranks of the mesh's shard dimension, in the same order")
                layout = [(names.get(id(fp.sharded_param), "?"), fp) for fp in pg.fsdp_params]
                views.append((module, _ModuleView(self, pg, layout)))
        # Which columns of each module's rows are exact, on every rank alike: the same
        # patterns can pick parameters at other places where ranks name them otherwise,
        # and a column exact on one rank and compressed on another adds one rank's
        # parameter to another's (21-29 times the bound, without an error).
        cols = repr([view.exact_columns() for _, view in views]).encode()
        mine = int.from_bytes(hashlib.sha256(cols).digest()[:7], "little")
        check = np.array([1 if problem else 0, mine, -mine], dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, check[:1], op=MPI.MAX)
        self.comm.Allreduce(MPI.IN_PLACE, check[1:], op=MPI.MIN)
        if check[0]:
            raise InputError(problem or "another rank could not attach the FSDP reduce-scatter "
                             "(see its error)")
        if check[1] != -check[2]:
            raise MismatchError(
                "ranks disagree on which parameters of their FSDP modules are exempt or small "
                "(exact): the same exempt patterns pick parameters at other places where the "
                "ranks' models name or order their parameters differently; build the same "
                "model, with the same names, on every rank")
        for module, view in views:
            module.set_custom_reduce_scatter(view)
        return len(views)

    def wait_pending(self) -> None:
        """Wait for every asynchronous call started so far (re-raises its error)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for req in pending:
            req.wait()

    # -- the reduction -------------------------------------------------------------------

    def _reduce(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool,
        view: _ModuleView | None,
    ) -> Any:
        if self._free[0] or not self._finalizer.alive:  # its communicators are freed
            raise CollectiveError("this FSDPReduceScatter has been closed: make a new one "
                                  "(and attach it) to reduce again")
        n = self.comm.Get_size()
        if inp.dtype not in _SUPPORTED or out.dtype != inp.dtype:
            raise InputError(f"FSDP handed a {inp.dtype} reduce-scatter input and a {out.dtype} "
                             "output; ccoll reduces float32, float64, float16 or bfloat16 "
                             "(set MixedPrecisionPolicy(reduce_dtype=torch.float32))")
        if inp.numel() != n * out.numel():
            raise InputError(f"reduce-scatter input has {inp.numel()} elements, output "
                             f"{out.numel()}: expected {n} times as many ({n} ranks in comm)")
        if group is not None and (group.size(), group.rank()) != (n, self.comm.Get_rank()):
            raise InputError(f"FSDP's reduce-scatter group is rank {group.rank()} of "
                             f"{group.size()}, but comm is rank {self.comm.Get_rank()} of {n}: "
                             "pass comm= an MPI communicator with the same ranks in the same order")
        avg, scale = self._op(op, inp.dtype, inp.device, group, view)
        plan = self._plan(out.numel(), view)
        if inp.is_cuda:  # FSDP wrote the input on the current stream
            torch.cuda.current_stream(inp.device).synchronize()
        if not async_op:
            self.wait_pending()  # one channel: calls run in the order they were made
            self._run(out, inp, avg, scale, plan)
            return None
        from ccoll.runtime.progress import submit

        fut: torch.futures.Future[None] = torch.futures.Future()
        req = submit(self._run, out, inp, avg, scale, plan, comm=self.comm)

        def complete(r: Any) -> None:
            exc = r.exception()
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(None)

        req.add_done_callback(complete)
        with self._lock:
            self._pending.append(req)
        c10d: Any = torch._C._distributed_c10d
        return c10d._create_work_from_future(fut)

    def _op(self, op: Any, dtype: torch.dtype, device: torch.device, group: Any,
            view: _ModuleView | None) -> tuple[bool, float]:
        """Return (average?, factor): the bound passed to ccoll is ``eb * factor``.

        The factor carries the bound from this reduce-scatter's output to the gradient FSDP
        writes (:func:`_bound_factor`).
        """
        if op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            return op == dist.ReduceOp.AVG, _bound_factor(group, dtype, device, view)
        name = getattr(op, "name", None) or type(op).__name__  # a premul-sum op has no name
        raise InputError(f"FSDP asked for reduce op {name}; ccoll's FSDP reduce-scatter does "
                         "SUM and AVG (a custom gradient divide factor makes FSDP ask for a "
                         "pre-multiplied sum: leave set_gradient_divide_factor unset)")

    def _plan(self, chunk: int, view: _ModuleView | None) -> _Plan:
        if chunk * self.comm.Get_size() < self.min_numel:
            return _Plan(None, None, exact_only=True)
        if view is None:
            return _Plan(None, None, exact_only=False)
        return view.plan(chunk)

    def _run(self, out: torch.Tensor, inp: torch.Tensor, avg: bool, scale: float,
             plan: _Plan) -> None:
        """Reduce ``inp`` into ``out``: the compressed columns, then the exact ones."""
        n = self.comm.Get_size()
        rows = inp.view(n, -1)
        opname = "avg" if avg else "sum"
        if plan.unknown:
            self.unknown_layout += 1
        if plan.exact_only:
            self._collective(out, rows, None, None, opname)
            return
        eb = (ABS(self.eb.value * scale) if isinstance(self.eb, ABS)
              else REL(self.eb.value * scale))
        if plan.exact_idx is None:
            self._collective(out, rows, None, eb, opname)
            return
        self._collective(out, rows, plan.comp_idx, eb, opname)
        self._collective(out, rows, plan.exact_idx, None, opname)

    def _collective(self, out: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor | None,
                    eb: ErrorBound | None, opname: str) -> None:
        cc = self.communicator
        part = rows if idx is None else rows.index_select(1, idx.to(rows.device))
        count = part.shape[1]
        x = _as_input(part.reshape(-1))
        before = cc.stats.compressed_calls
        y = cc.reduce_scatter(x, eb, opname)
        yt = torch.as_tensor(y) if not isinstance(y, torch.Tensor) else y
        if idx is None:
            out.copy_(yt.reshape(out.shape))  # of out's dtype already: no rounding
        else:
            out.index_copy_(0, idx.to(out.device), yt.to(out.device, out.dtype))
        if out.is_cuda:
            torch.cuda.synchronize(out.device)  # ccoll's kernels ran on their own streams
        if cc.stats.compressed_calls > before:
            self.compressed += 1
            self.elements_compressed += count
        else:
            self.exact += 1
            self.elements_exact += count


class _Plan:
    """Which output columns go through compression and which are reduced exactly."""

    __slots__ = ("comp_idx", "exact_idx", "exact_only", "unknown")

    def __init__(self, comp_idx: torch.Tensor | None, exact_idx: torch.Tensor | None, *,
                 exact_only: bool, unknown: bool = False) -> None:
        self.comp_idx = comp_idx
        self.exact_idx = exact_idx
        self.exact_only = exact_only
        self.unknown = unknown


class _ModuleView:
    """What one FSDP module's ``set_custom_reduce_scatter`` gets.

    The shared object, plus the module's parameters, to find the exempt and small ones in
    the flat buffer.
    """

    def __init__(self, parent: FSDPReduceScatter, param_group: Any,
                 layout: list[tuple[str, Any]]) -> None:
        self.parent = parent
        self.param_group = param_group
        self.layout = layout
        self._plans: dict[tuple[int, tuple[bool, ...]], _Plan] = {}

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.parent.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        return self.parent._reduce(output_tensor, input_tensor, group, op, async_op, self)

    def plan(self, chunk: int) -> _Plan:
        # Keyed by which parameters require a gradient too: a row of the same width with
        # other parameters frozen (staged fine-tuning) went through the old plan, and an
        # exempt parameter was compressed.
        key = (chunk, tuple(fp.sharded_param.requires_grad for _, fp in self.layout))
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = self._make_plan(chunk)
        return got

    def exact_columns(self) -> list[tuple[int, bool]]:
        """Each parameter's shard width and whether it is reduced exactly (exempt, small)."""
        parent = self.parent
        return [(int(fp.padded_sharded_param_size.numel()),
                 int(fp.sharded_param.numel()) < parent.min_numel
                 or any(fnmatch.fnmatchcase(name, p) for p in parent.exempt))
                for name, fp in self.layout]

    def _make_plan(self, chunk: int) -> _Plan:
        parent = self.parent
        # FSDP reduces the parameters that have a gradient; which ones did is gone by the
        # time it calls: take those that require one, and if their shards do not fill the
        # row exactly, reduce the whole row exactly (exempt parameters must stay exact).
        segs: list[tuple[int, bool]] = []
        for name, fp in self.layout:
            if not fp.sharded_param.requires_grad:
                continue
            width = int(fp.padded_sharded_param_size.numel())
            small = int(fp.sharded_param.numel()) < parent.min_numel
            exempt = any(fnmatch.fnmatchcase(name, p) for p in parent.exempt)
            segs.append((width, small or exempt))
        if sum(w for w, _ in segs) != chunk:
            return _Plan(None, None, exact_only=True, unknown=True)
        if not any(e for _, e in segs):
            return _Plan(None, None, exact_only=False)
        if all(e for _, e in segs):
            return _Plan(None, None, exact_only=True)
        mask = np.repeat(np.array([e for _, e in segs]), [w for w, _ in segs])
        comp = torch.from_numpy(np.flatnonzero(~mask))
        exact = torch.from_numpy(np.flatnonzero(mask))
        return _Plan(comp, exact, exact_only=False)


def _as_input(x: torch.Tensor) -> Any:
    """Return what ccoll's collective takes.

    A host float32/float64 numpy array (a view), or the tensor itself: a CUDA tensor goes
    to ccoll's device path, and a float16/bfloat16 one is reduced under the rule of the
    collectives, so that the output in its own dtype holds the bound (the final rounding
    to that dtype included) or every rank refuses it with ``ErrorBoundError``
    (docs/error-bound.md, "float16 and bfloat16").
    """
    if x.is_cuda or x.dtype not in (torch.float32, torch.float64):
        return x.contiguous()
    return x.contiguous().numpy()


def _most_replicas(group: Any) -> int:
    """Return the most replicas a reduce-scatter over ``group`` can have.

    That is the default process group's size over ``group``'s (1 without either).
    """
    if group is None or not dist.is_initialized():
        return 1
    return max(1, dist.get_world_size() // max(1, group.size()))


def _bound_factor(group: Any, dtype: torch.dtype, device: torch.device,
                  view: _ModuleView | None) -> float:
    """Return what ccoll's bound on this reduce-scatter's output is ``eb`` times.

    FSDP writes ``AR(out) / post``: ``out`` is this output on each of the ``R`` replicas of
    the shard (``R = 1`` without HSDP), ``AR`` FSDP's all-reduce of them across the replicas
    (``SUM`` or ``AVG``; none without HSDP) and ``post`` its post-division factor (1 where it
    has none). An error ``e`` on every ``out`` is at most ``R * e`` after a ``SUM`` and
    ``e`` after an ``AVG``, then divided by ``post``, so ``e = eb * post / R`` (``SUM``) or
    ``eb * post`` (``AVG``) keeps the gradient within ``eb`` of the exact average. ``post``
    and the all-reduce's op come from FSDP's own rule (torch 2.13's
    ``_get_gradient_divide_factors``) with the module's divide factor and
    ``force_sum_reduction_for_comms``, which only :meth:`FSDPReduceScatter.attach` knows.

    Without them (the object given to ``set_custom_reduce_scatter`` by hand, or a torch
    without that rule) the factor assumes the worst FSDP can do: no post-division and a
    ``SUM`` over as many replicas as the default process group leaves room for.
    """
    pg = view.param_group if view is not None else None
    mesh_info = getattr(pg, "mesh_info", None)
    if mesh_info is None:
        return 1.0 / _most_replicas(group)
    # HSDP's mesh (and replicate()'s) has a replicate dimension; 1-D FSDP's has none.
    ar_group = getattr(mesh_info, "replicate_process_group", None)
    replicas = ar_group.size() if ar_group is not None else 1
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors,
        )
    except ImportError:  # another torch: no factor known
        return 1.0 / replicas
    factor = getattr(pg, "gradient_divide_factor", None)
    force_sum = bool(getattr(pg, "force_sum_reduction_for_comms", False))
    _, post, _, ar_op = _get_gradient_divide_factors(group, ar_group, dtype, device.type,
                                                     factor, force_sum)
    scale = float(post) if post is not None else 1.0
    if ar_group is not None and ar_op != dist.ReduceOp.AVG:
        scale /= replicas
    return scale


def _close(comm: Any, communicator: Any, free: Any = (True,)) -> None:
    # close() (free[0] set: every rank frees here, MPI_Comm_free being collective), or
    # garbage collection of an object never closed, which runs at a point of its own on
    # each rank: it stops the threads and frees no communicator (as the hook state's).
    from mpi4py import MPI

    from ccoll.collectives.channel import LEAKED

    if free[0]:
        communicator.close()
    else:
        communicator._finalizer()  # the Communicator's own release, without a free
    if comm != MPI.COMM_NULL and not MPI.Is_finalized():
        if free[0]:
            comm.Free()
        else:
            LEAKED[0] += 1
