"""The model's view of a call: its agreed facts, the plan, and every candidate path priced.

:func:`candidates` turns a call's :class:`Facts` and the Communicator's constants into
every way to run it (raw, the flat ring or recursive halving, two levels; each compressed
path in each stream format the model compares), each with the model's seconds (docs/model.md).
:mod:`ccoll.collectives.policy.plan` chooses among them. Pure arithmetic on agreed numbers:
the same list on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ccoll.collectives import model, ratios
from ccoll.collectives.model import Params

__all__ = ["Facts", "Plan", "Candidate", "Options", "Formats", "candidates", "FEWER_BYTES"]

# Of one path's two stream formats, format 2 (fewer bytes) runs unless format 1 is faster
# by more than this share of its time: at equal speed the link and the peers' traffic gain
# from the smaller stream, and calls on shared cores vary by more than this from run to run.
FEWER_BYTES = 0.03


class Facts(NamedTuple):
    """The agreed facts of one call that a plan depends on (the same on every rank)."""

    collective: str
    elements: int
    itemsize: int  # of what moves (float16/bfloat16: 4)
    policy: str
    algorithm: str
    exact: bool  # eb=None
    lossless: bool  # the bound resolved to 0
    avg: bool
    device: bool
    ranks: int
    # A REL bound on host data: a call that may compress first finds its data's range, a
    # pass over it before the agreement that only a compressed plan needs.
    ranged: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one call does, chosen by :class:`Planner` (frozen, the same on every rank).

    ``variant``: ``"raw"``, ``"flat"`` (the flat ring, or recursive halving where
    ``pieces > 0``) or ``"two levels"``; ``chunk_elems``: elements per pipeline chunk;
    ``split``: share of the bound for the allgather phase (0: none); ``version``: the stream
    format; ``predicted_raw``/``predicted``: the model's seconds for raw and for this path;
    ``ratio``: the ratio the model used; ``trial``: run to be measured; ``fast``: the
    next repeat of this signature may skip the agreement; ``format_reason``: why this
    stream format (a compressed plan); ``key``: the candidate it is in the measured loop
    (the path, with " v2" in format 2).
    """

    variant: str
    reason: str
    chunk_elems: int = 0
    pieces: int = 0
    split: float = 0.0
    version: int = 1
    predicted_raw: float | None = None
    predicted: float | None = None
    ratio: float | None = None
    trial: bool = False
    fast: bool = False
    format_reason: str = ""
    # The candidate it is in the measured loop (:data:`VARIANTS`): the path, " v2" added
    # in format 2. Derived; set once here so that a repeated call reads a field.
    key: str = field(default="", init=False, compare=False)

    def __post_init__(self) -> None:
        key = self.variant + " v2" if self.version == 2 and self.variant != "raw" \
            else self.variant
        object.__setattr__(self, "key", key)

    @property
    def compress(self) -> bool:
        """Whether the call compresses."""
        return self.variant != "raw"

    @property
    def two_level(self) -> bool:
        """Whether the call runs in two levels (exact node sums, compressed between nodes)."""
        return self.variant == "two levels"


class Candidate(NamedTuple):
    """One way to run a call, as the model sees it."""

    plan: Plan
    seconds: float  # predicted


class Options(NamedTuple):
    """The Communicator's options that shape plans (the same on every rank: agreed)."""

    chunk_elems: int | None
    split: float | None
    schedule: str
    hier: tuple[int, int] | None  # (nodes, ranks per node) where two levels may run
    version: int | None = None  # the Communicator's format_version (None: per call)


class Formats(NamedTuple):
    """What the model knows of stream format 2 beside format 1.

    ``params``: the model's constants with format 2's kernel rates; ``gain``: format 2's
    ratio over format 1's on the same data and bound. The calibration's (its synthetic
    sample at REL 1e-3), or, for a ``policy="auto"`` signature whose first call sampled its
    data, that sample's: the gain, and format 1's rates times the sampled speed factors.
    """

    params: Params
    gain: float


# ----------------------------------------------------------------------- the model's view


def _flat(f: Facts, p: Params, ratio: float, width: float, o: Options,
          ring_ranks: int | None = None, share_count: int | None = None,
          version: int = 1) -> tuple[Plan, float]:
    """Return the flat compressed path of a call: schedule, chunk, split, and its time.

    ``p`` and ``ratio`` are those of stream format ``version`` (either runs either schedule).
    """
    n = f.ranks if ring_ranks is None else ring_ranks
    count = f.elements if share_count is None else share_count
    size = float(count * f.itemsize)
    split = 0.0
    homo = f.algorithm == "homomorphic" and not f.device
    if f.collective == "allreduce" and homo and n >= 2:
        share = ratios.split_fraction(n) if o.split is None else o.split
        if share > 0 and o.split is None and not model.split_pays(size, n, p, ratio, share,
                                                                  width=width):
            share = 0.0
        split = share
    if o.chunk_elems is not None:
        chunk = int(o.chunk_elems)
    else:
        chunk = model.chunk_elems_for(count, f.itemsize, n, p, ratio, width=width)
    pieces = 0
    if f.collective == "allreduce" and homo and n >= 2 and o.schedule != "ring":
        cand = model.halving_pieces(count, f.itemsize, chunk, fixed=o.chunk_elems is not None)
        if o.schedule == "halving":
            pieces = cand
        else:
            block = -(-count // n)
            chunks = max(1, -(-block // max(1, chunk)))
            if model.choose_schedule(size, n, p, ratio, share=split, chunks=chunks,
                                     pieces=cand, width=width) == "halving":
                pieces = cand
    block = max(1, -(-count // max(1, n)))
    chunks = max(1, -(-block // max(1, chunk)))
    if pieces:
        t = model.predict_halving(size, n, p, ratio, share=split, pieces=pieces, width=width)
    else:
        pred = model.predict(size, n, p, ratio, collective=f.collective, chunks=chunks,
                             width=width)
        t = pred.homomorphic if f.algorithm == "homomorphic" else pred.dar
    return Plan("flat", "", chunk_elems=chunk, pieces=pieces, split=split,
                version=version), t


def _two_levels(f: Facts, p: Params, ratio: float, width: float, o: Options,
                version: int) -> tuple[Plan, float]:
    """Return the two-level path of a call (``o.hier`` applies) and its time."""
    assert o.hier is not None
    nodes, rpn = o.hier
    size = float(f.elements * f.itemsize)
    share = -(-f.elements // rpn)  # one local rank's share, reduced by the inter-node ring
    two, _ = _flat(f, p, ratio, width, o, ring_ranks=nodes, share_count=share, version=version)
    block = -(-share // nodes)
    chunks = max(1, -(-block // max(1, two.chunk_elems)))
    pred = model.predict(size, f.ranks, p, ratio, collective=f.collective, hier=o.hier,
                         chunks=chunks, width=width)
    t2 = pred.homomorphic if f.algorithm == "homomorphic" else pred.dar
    return Plan("two levels", "", two.chunk_elems, two.pieces, two.split, version=version), t2


def _versions(f: Facts, o: Options, formats: Formats | None) -> tuple[int, ...]:
    """Return the stream formats the model compares for a call (one: forced or unknown)."""
    if o.version is not None:
        return (o.version,)
    if formats is None or f.device:
        return (1,)
    return (1, 2)


def _by_version(f: Facts, p: Params, ratio: float, width: float, o: Options,
                formats: Formats | None, path: Any) -> list[tuple[Plan, float]]:
    """Run ``path`` (:func:`_flat` or :func:`_two_levels`) in each format the model compares.

    Each plan carries its version, the ratio the model used for it and why
    (``format_reason``: its prediction beside the other format's). Format 1 first.
    """
    versions = _versions(f, o, formats)
    got = []
    for v in versions:
        # A forced format 2 without a calibration of it is priced as format 1.
        pv, rv = ((p, ratio) if v == 1 or formats is None
                  else (formats.params, ratio * formats.gain))
        plan, t = path(f, pv, rv, width, o, version=v)
        got.append((t, v, plan, rv))
    out = []
    for t, v, plan, rv in got:
        if o.version is not None:
            why = f"format_version={o.version}"
        elif len(got) == 1:
            why = ("device data: no measured rates of the device kernels" if f.device
                   else "format 2's rates not measured")
        else:
            other = next(g for g in got if g[1] != v)
            why = (f"predicted {_ms(t)} at ratio {rv:.3g}; format {other[1]} "
                   f"{_ms(other[0])} at ratio {other[3]:.3g}")
        out.append((Plan(plan.variant, "", plan.chunk_elems, plan.pieces, plan.split, v,
                         ratio=rv, format_reason=why), t))
    return out


def _paths(cands: list[Candidate], measured: dict[str, float]) -> list[Candidate]:
    """One candidate per path (raw first), each compressed path in the format that runs.

    Of a path's two formats, format 2, which sends fewer bytes where the model compares
    both (docs/model.md, "Stream format"), runs unless format 1 is faster by more than
    :data:`FEWER_BYTES`: by their ``measured`` times (by :attr:`Plan.key`) once both have
    one, else by the model's (a format measured slow does not hand its path to the other
    format's prediction: that one is tried only where the path is the best).
    """
    by: dict[str, list[Candidate]] = {}
    for c in cands:
        by.setdefault(c.plan.variant, []).append(c)
    out = []
    for group in by.values():
        one = next((c for c in group if c.plan.version == 1), None)
        two = next((c for c in group if c.plan.version == 2), None)
        if one is None or two is None:
            out.append(group[0])
        else:
            k1, k2 = one.plan.key, two.plan.key
            t1, t2 = ((measured[k1], measured[k2]) if k1 in measured and k2 in measured
                      else (one.seconds, two.seconds))
            out.append(two if t2 <= t1 * (1.0 + FEWER_BYTES) else one)
    return out


def _format_why(pick: Candidate, cands: list[Candidate], est: dict[str, float],
                measured: dict[str, float], trial: bool = False) -> str:
    """Why ``pick`` runs in its stream format, beside the other format of its path."""
    p = pick.plan
    other = next((c for c in cands if c.plan.variant == p.variant and c.plan.key != p.key),
                 None)
    if other is None:
        return p.format_reason
    k, ok = p.key, other.plan.key
    why = (f"{'measured' if k in measured else 'predicted'} {_ms(est[k])} at ratio "
           f"{p.ratio:.3g}; format {other.plan.version} "
           f"{'measured ' if ok in measured else ''}{_ms(est[ok])} at ratio "
           f"{other.plan.ratio:.3g}")
    # The note follows what :func:`_paths` compared: measured times once both have one.
    both = k in measured and ok in measured
    t, t_other = (measured[k], measured[ok]) if both else (pick.seconds, other.seconds)
    if p.version == 2 and t > t_other and not trial:
        why += f" (within {FEWER_BYTES:.0%}: fewer bytes)"
    return why


def candidates(f: Facts, p: Params, ratio: float, width: float, o: Options,
               formats: Formats | None = None) -> list[Candidate]:
    """Every way the model sees to run the call, raw first, with predicted seconds.

    Each compressed path once per stream format the model compares (``formats``: what the
    calibration measured of format 2; ``o.version`` forces one), format 1 first. Pure
    arithmetic on agreed numbers: the same list on every rank.
    """
    n = f.ranks
    size = float(f.elements * f.itemsize)
    t_raw = model.predict(size, n, p, 1.0, collective=f.collective, chunks=1).raw if n > 1 \
        else 0.0
    out = [Candidate(Plan("raw", "", predicted_raw=t_raw, predicted=t_raw), t_raw)]
    paths: list[Any] = [_flat]
    hier = o.hier
    if hier is not None and model.hierarchical_applies(hier, f.collective) and not f.device:
        paths.append(_two_levels)
    scan = model.range_time(size, p) if f.ranged else 0.0  # a REL bound's range, first
    for path in paths:
        for plan, t in _by_version(f, p, ratio, width, o, formats, path):
            t += scan
            out.append(Candidate(Plan(plan.variant, "", plan.chunk_elems, plan.pieces,
                                      plan.split, plan.version, predicted_raw=t_raw,
                                      predicted=t, ratio=plan.ratio,
                                      format_reason=plan.format_reason), t))
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"
