"""Project ccoll's hierarchical allreduce against MPI's to many nodes with the cost model.

Pure arithmetic on ccoll's own model (:mod:`ccoll.collectives.model`, docs/model.md): no MPI,
no compressor. For ``R = 8`` ranks per node and ``K = 2 .. 512`` nodes, a link of 25, 100 or
400 Gbit/s per node and the compressor at its measured CPU speed or at cuSZp-class GPU speed,
it prints the predicted time of MPI's allreduce (the same two levels without compression:
an exact reduce-scatter and allgather through shared memory inside the node, a raw ring
between nodes at the node's link) and of ccoll's (the same node phases, compressed rings
between nodes), and the speedup.

The wire ratio comes from the measured one of ``op="avg"`` on MiniLM gradients at REL 1e-3
(docs/bench/scaleout.json, docs/performance.md "Scale out"): one rank's ratio ``r`` is
solved from the measured wire ratio at the largest rank count there, through the model's
word count (:func:`ratios.split_bits`, ``g log2 k`` growth of sums, the split the model
chooses), and then extrapolated to ``K`` ring members the same way
(:func:`ratios.split_ratios`).

A second projection puts ccoll on GPUs next to NCCL's ring (:func:`project_gpu`,
docs/model.md "Projection on GPUs against NCCL's ring"): 8 to 512 GPUs, 8 per node, 64 MiB
each, 100 and 400 Gbit/s per node; the node phases over NVLink; ccoll in stream format 1
and in format 2, whose ratio and kernel rates are format 1's scaled by what the CPU
kernels measured (no GPU measurement of either exists); NCCL as a flat raw ring over all
GPUs at the full link.

Run: ``.venv/bin/python bench/project_scaleout.py --md docs/bench/projection.md
--json docs/bench/projection.json --png docs/img/projection_speedup.png``
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ccoll.collectives import model, ratios
from ccoll.collectives.policy.plan import MARGIN as DECISION_MARGIN

HERE = Path(__file__).resolve().parent
MEASURED = HERE.parent / "docs" / "bench" / "scaleout.json"

RANKS_PER_NODE = 8
NODES = tuple(2**i for i in range(1, 10))  # 2 .. 512
LINKS_GBIT = (25, 100, 400)
SIZES = {"64 MiB": 64 << 20, "1 GiB": 1 << 30}
# Latency of one message between nodes (an RDMA-class fabric; TCP is 10-50 us).
ALPHA = 5e-6
# cuSZp-class GPU compressor (bytes of float data per second; cuSZp2, SC24, reports averages
# of 332 GB/s compress and 513 GB/s decompress end to end on an A100). The homomorphic add reads
# two streams and writes one, lighter than a decompression: taken at decompression speed.
GPU = {"compress": 300e9, "add": 500e9, "decompress": 500e9,
       # a compute call on the GPU is a kernel launch or two, not a Python loop turn
       "chunk_overhead": 10e-6}
# MPI's sum on GPU data runs at GPU speed too (a memory-bound add), so the baseline is not
# handicapped by the host's 4 GB/s sum.
GPU_REDUCE = 1000e9
COMPRESSORS = ("cpu", "gpu")

# GPUs against NCCL's ring (:func:`project_gpu`).
GPU_RANKS = (8, 16, 64, 128, 512)
GPU_LINKS_GBIT = (100, 400)
GPU_SIZE = "64 MiB"
# Bus bandwidth of one GPU inside its node (bytes/s): NCCL's own tuning model caps an A100's
# at 235 GB/s (``busBw = std::min(busBw, 235.0f)``, src/graph/tuning.cc). It is
# ``Params.shm`` of the node phases here, in place of the host's shared memory.
NVLINK_BW = 235e9
# Latency of one ring step over NVLink: NCCL's tuning model's ring/Simple figure (3.4 us).
NVLINK_ALPHA = 3.4e-6
# Stream format 2 against format 1, measured on the CPU only (MiniLM gradients, REL 1e-3).
# Ratio: format 2's bytes over format 1's on 1 Mi values (docs/model.md "Stream format").
V2_GAIN = 1.44
# Kernel rates: one numba thread, best of 7, the same quiet run (docs/performance.md
# "Format v2 on the CPU", with add from docs/dev/format-v2.md): compress 2.52 / 2.84 GB/s,
# add 1.70 / 3.04, decompress 6.56 / 7.80. The GPU's format-2 rates are its format-1 rates
# times these: an assumption, no GPU kernel of either format has been timed.
V2_RATE = {"compress": 2.52 / 2.84, "add": 1.70 / 3.04, "decompress": 6.56 / 7.80}
# Schedules between nodes each side may use (its faster one at every point).
SCHEDULES = ("ring", "halving")


@dataclass(frozen=True)
class Point:
    """One projected configuration and the model's times (seconds)."""

    size: str
    nodes: int
    link_gbit: int
    compressor: str
    split: float
    ratio_rs: float
    ratio_ag: float
    chunks: int
    mpi_s: float
    ccoll_s: float
    # How the ccoll and MPI times move data between nodes: "ring" or "halving".
    schedule: str = "ring"
    mpi_schedule: str = "ring"

    @property
    def speedup(self) -> float:
        return self.mpi_s / self.ccoll_s

    @property
    def auto_speedup(self) -> float:
        """What ``policy="auto"`` gets: the speedup where the model compresses (predicted
        ``DECISION_MARGIN`` faster), else 1 (the call goes to MPI)."""
        return self.speedup if self.speedup > 1 + DECISION_MARGIN else 1.0


def wire_ratio(ratio: float, ranks: int, share: float) -> float:
    """The model's wire ratio (raw ring bytes / bytes sent) of a flat ring of ``ranks``."""
    words = ratios.split_bits(ranks, share)
    return 2 * (ranks - 1) * ratio * (1.0 + ratios.DEFAULT_WIDTH) / words


def calibrate_ratio(rows: list[dict[str, float]]) -> tuple[float, int]:
    """One rank's ratio that makes the model's wire ratio the measured one at the most ranks."""
    last = max(rows, key=lambda r: r["ranks"])
    n = int(last["ranks"])
    return last["avg_auto_ratio"] / wire_ratio(1.0, n, float(last["auto_share"])), n


def params(link_gbit: float, compressor: str) -> model.Params:
    """Model constants of one configuration: DEFAULTS with the link, latency and compressor."""
    p = replace(model.DEFAULTS, alpha=ALPHA, beta=link_gbit * 1e9 / 8, raw_efficiency=1.0)
    if compressor == "gpu":
        p = replace(p, reduce=GPU_REDUCE, **GPU)
    return p


def project(ratio: float, nodes: int, link_gbit: float, compressor: str, size: str,
            schedules: tuple[str, ...] = SCHEDULES, p: model.Params | None = None) -> Point:
    """Predict MPI's and ccoll's two-level allreduce at one point with the model.

    The ring between nodes is ``model.predict``'s two-level prediction; with ``"halving"``
    in ``schedules`` both sides may also move data between nodes by recursive halving and
    doubling (ccoll: ``model.predict_halving`` on the node's share, MPI: Rabenseifner's
    ``model.predict_raw_halving``), each taking its faster schedule. ``p``: the model's
    constants, if not :func:`params`'s.
    """
    share = ratios.split_fraction(nodes)
    r_rs, r_ag = ratios.split_ratios(ratio, nodes, share)
    p = params(link_gbit, compressor) if p is None else p
    total = SIZES[size]
    pr = model.predict(total, nodes * RANKS_PER_NODE, p, r_rs, ratio_sum=r_ag,
                       hier=(nodes, RANKS_PER_NODE))
    pt = Point(size=size, nodes=nodes, link_gbit=int(link_gbit), compressor=compressor,
               split=share, ratio_rs=r_rs, ratio_ag=r_ag, chunks=pr.chunks, mpi_s=pr.raw,
               ccoll_s=pr.homomorphic)
    if "halving" not in schedules:
        return pt
    # The rings between nodes: one per local rank, on its share, each with beta / R.
    part = total / RANKS_PER_NODE
    pi = replace(p, beta=p.beta / RANKS_PER_NODE)
    intra = model.predict_node_phases(total, RANKS_PER_NODE, p)
    k = model.best_halving_pieces(part, nodes, pi, ratio, share=share)
    halv = intra + model.predict_halving(part, nodes, pi, ratio, share=share, pieces=k)
    raw_halv = intra + model.predict_raw_halving(part, nodes, pi)
    # The Communicator's rule (model.choose_schedule): halving from HALVING_MIN_RANKS ring
    # members on, where it is predicted faster; each schedule with its best chunks.
    if nodes >= model.HALVING_MIN_RANKS and halv < pt.ccoll_s:
        pt = replace(pt, ccoll_s=halv, chunks=k, schedule="halving")
    if raw_halv < pt.mpi_s:
        pt = replace(pt, mpi_s=raw_halv, mpi_schedule="halving")
    return pt


def project_all(ratio: float) -> list[Point]:
    return [project(ratio, k, g, c, s) for s in SIZES for g in LINKS_GBIT
            for c in COMPRESSORS for k in NODES]


@dataclass(frozen=True)
class GpuPoint:
    """ccoll on GPUs in stream formats 1 and 2 against NCCL's ring at one point (seconds).

    ``raw_s``: the same two levels as ccoll without compression (NVLink inside the node, the
    faster of a raw ring and raw halving between nodes). ``v2_s``: format 2 on the ring
    between nodes; ``v2_any_s``: format 2 on the faster of ring and halving, as ccoll's
    plan may run it (docs/collectives.md, "The stream format of a call").
    ``flat_v1_s``: format 1 on one flat ring through all GPUs at the node's link, the path
    device data takes today.
    """

    ranks: int
    nodes: int
    link_gbit: int
    nccl_s: float
    raw_s: float
    v1_s: float
    v1_schedule: str
    v1_ratio_rs: float
    v1_ratio_ag: float
    v2_s: float
    v2_ratio_rs: float
    v2_ratio_ag: float
    v2_any_s: float
    flat_v1_s: float

    @property
    def speedup_v1(self) -> float:
        return self.nccl_s / self.v1_s

    @property
    def speedup_v2(self) -> float:
        return self.nccl_s / self.v2_s


def nccl_ring(size: float, ranks: int, link_gbit: float) -> float:
    """NCCL's ring allreduce of ``size`` bytes per GPU over ``ranks`` GPUs, 8 per node.

    One flat ring through every GPU: ``2(N-1)`` steps, ``2(K-1)`` of them between nodes
    (``ALPHA`` each) and the rest over NVLink (``NVLINK_ALPHA``), the structure of NCCL's
    tuning model; every byte crosses each node's link once per phase, at the full link
    (NCCL's channels together fill the NIC): ``2(N-1)/N * S / beta``; on one node NVLink's
    ``NVLINK_BW``. The sum runs inside the copy kernels and costs no time of its own.
    """
    nodes = ranks // RANKS_PER_NODE
    beta = link_gbit * 1e9 / 8 if nodes > 1 else NVLINK_BW
    return (2 * (nodes - 1) * ALPHA + 2 * (ranks - nodes) * NVLINK_ALPHA
            + 2 * (ranks - 1) / ranks * size / beta)


def gpu_params(link_gbit: float, version: int) -> model.Params:
    """The GPU rows' constants with the node phases over NVLink; format 2's rates scaled."""
    p = replace(params(link_gbit, "gpu"), shm=NVLINK_BW)
    if version == 2:
        p = replace(p, **{k: getattr(p, k) * v for k, v in V2_RATE.items()})
    return p


def project_gpu(ratio: float, ranks: int, link_gbit: float) -> GpuPoint:
    """ccoll in formats 1 and 2 on ``ranks`` GPUs (8 a node) against :func:`nccl_ring`.

    From 2 nodes on, :func:`project` with :func:`gpu_params` (format 2: one rank's ratio
    times ``V2_GAIN``, on the ring alone, as the Communicator runs it); on one node a flat
    ring over NVLink (``model.predict`` with ``NVLINK_BW`` and ``NVLINK_ALPHA``).
    """
    nodes = ranks // RANKS_PER_NODE
    size = SIZES[GPU_SIZE]
    nccl = nccl_ring(size, ranks, link_gbit)
    p1, p2 = gpu_params(link_gbit, 1), gpu_params(link_gbit, 2)
    share = ratios.split_fraction(ranks)
    r_rs, r_ag = ratios.split_ratios(ratio, ranks, share)
    if nodes >= 2:
        flat = model.predict(size, ranks, p1, r_rs, ratio_sum=r_ag).homomorphic
        v1 = project(ratio, nodes, link_gbit, "gpu", GPU_SIZE, p=p1)
        v2 = project(ratio * V2_GAIN, nodes, link_gbit, "gpu", GPU_SIZE, schedules=("ring",),
                     p=p2)
        v2_any = project(ratio * V2_GAIN, nodes, link_gbit, "gpu", GPU_SIZE, p=p2)
        return GpuPoint(ranks, nodes, int(link_gbit), nccl, v1.mpi_s, v1.ccoll_s, v1.schedule,
                        v1.ratio_rs, v1.ratio_ag, v2.ccoll_s, v2.ratio_rs, v2.ratio_ag,
                        v2_any.ccoll_s, flat)
    nv = {"alpha": NVLINK_ALPHA, "beta": NVLINK_BW}
    f1 = model.predict(size, ranks, replace(p1, **nv), r_rs, ratio_sum=r_ag)
    f2 = model.predict(size, ranks, replace(p2, **nv), r_rs * V2_GAIN,
                       ratio_sum=r_ag * V2_GAIN)
    return GpuPoint(ranks, nodes, int(link_gbit), nccl, f1.raw, f1.homomorphic, "ring", r_rs,
                    r_ag, f2.homomorphic, r_rs * V2_GAIN, r_ag * V2_GAIN, f2.homomorphic,
                    f1.homomorphic)


def project_gpu_all(ratio: float) -> list[GpuPoint]:
    return [project_gpu(ratio, n, g) for g in GPU_LINKS_GBIT for n in GPU_RANKS]


def gpu_table(points: list[GpuPoint]) -> str:
    """The GPU projection against NCCL's ring as Markdown, one table per link."""
    lines: list[str] = []
    for g in GPU_LINKS_GBIT:
        lines += [f"{GPU_SIZE} per GPU, {RANKS_PER_NODE} GPUs per node, {g} Gbit/s per node "
                  "(projection)", "",
                  "| GPUs | nodes | NCCL ring ms | two-level raw ms | ccoll v1 ms | v1 speedup "
                  "| ccoll v2 ms | v2 speedup |", "|" + "---:|" * 8]
        for pt in points:
            if pt.link_gbit == g:
                lines.append(f"| {pt.ranks} | {pt.nodes} | {_ms(pt.nccl_s)} | {_ms(pt.raw_s)} "
                             f"| {_ms(pt.v1_s)} | {pt.speedup_v1:.2f} | {_ms(pt.v2_s)} "
                             f"| {pt.speedup_v2:.2f} |")
        lines.append("")
    return "\n".join(lines)


def monotone(points: list[Point]) -> dict[tuple[str, int, str], bool]:
    """Per (size, link, compressor): whether ``policy="auto"``'s speedup never falls as
    nodes grow (:attr:`Point.auto_speedup`)."""
    series: dict[tuple[str, int, str], list[Point]] = {}
    for pt in points:
        series.setdefault((pt.size, pt.link_gbit, pt.compressor), []).append(pt)
    out = {}
    for key, pts in series.items():
        sp = [pt.auto_speedup for pt in sorted(pts, key=lambda pt: pt.nodes)]
        out[key] = all(b >= a * (1 - 1e-12) for a, b in zip(sp, sp[1:], strict=False))
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def table(points: list[Point], ratio: float, rows: list[dict[str, float]]) -> str:
    lines = ["Wire ratio of a flat ring, MiniLM `op=\"avg\"` REL 1e-3: measured and the model's "
             f"(one rank's ratio r = {ratio:.2f} solved at the last row)", "",
             "| ranks | split | measured | model |", "|---:|---:|---:|---:|"]
    for r in rows:
        n = int(r["ranks"])
        lines.append(f"| {n} | {r['auto_share']:g} | {r['avg_auto_ratio']:.2f} | "
                     f"{wire_ratio(ratio, n, float(r['auto_share'])):.2f} |")
    lines.append("")
    names = {"cpu": "compressor at its measured CPU speed, MPI's sum on the host",
             "gpu": "cuSZp-class GPU compressor, MPI's sum on the GPU"}
    for size in SIZES:
        for c in COMPRESSORS:
            head = "| nodes | split | " + " | ".join(
                f"{g} Gbit/s: MPI ms | ccoll ms | speedup" for g in LINKS_GBIT) + " |"
            lines += [f"{size} per rank, {RANKS_PER_NODE} ranks per node, {names[c]}", "",
                      head, "|" + "---:|" * (2 + 3 * len(LINKS_GBIT))]
            for k in NODES:
                by = {pt.link_gbit: pt for pt in points
                      if pt.size == size and pt.nodes == k and pt.compressor == c}
                cells = [str(k), f"{by[LINKS_GBIT[0]].split:g}"]
                for g in LINKS_GBIT:
                    cells += [_ms(by[g].mpi_s), _ms(by[g].ccoll_s), f"{by[g].speedup:.2f}"]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plot(points: list[Point], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(SIZES), figsize=(12, 5), sharey=True)
    for ax, size in zip(axes, SIZES, strict=True):
        for g in LINKS_GBIT:
            for c, style in (("cpu", "-"), ("gpu", "--")):
                pts = [pt for pt in points if pt.size == size and pt.link_gbit == g
                       and pt.compressor == c]
                ax.plot([pt.nodes for pt in pts], [pt.speedup for pt in pts], style,
                        marker="o", label=f"{g} Gbit/s, {c.upper()} compressor")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_yticks([0.5, 0.75, 1, 1.5, 2, 3, 4])
        ax.set_xlabel(f"nodes ({RANKS_PER_NODE} ranks each)")
        ax.set_title(f"{size} per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("projected speedup over MPI_Allreduce")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle("ccoll hierarchical allreduce, projected by the cost model "
                 "(MiniLM gradients, REL 1e-3, op=avg)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", default=str(MEASURED),
                    help="bench/scaleout.py's JSON (measured wire ratios per rank count)")
    ap.add_argument("--md", help="also write the Markdown tables to this file")
    ap.add_argument("--json", dest="json_out", help="write every point as JSON")
    ap.add_argument("--png", help="write the speedup plot")
    args = ap.parse_args(argv)
    rows = sorted(json.loads(Path(args.measured).read_text()), key=lambda r: r["ranks"])
    ratio, _ = calibrate_ratio(rows)
    points = project_all(ratio)
    text = table(points, ratio, rows)
    mono = monotone(points)
    falls = [k for k, ok in mono.items() if not ok]
    text += ("speedup non-decreasing in nodes everywhere" if not falls else
             "speedup FALLS with nodes for: " + ", ".join(f"{s} {g} Gbit/s {c}"
                                                         for s, g, c in falls)) + "\n"
    gpu = project_gpu_all(ratio)
    text += "\n" + gpu_table(gpu)
    sys.stdout.write(text)
    if args.md:
        Path(args.md).write_text(text)
    if args.json_out:
        doc = {"ratio": ratio, "alpha": ALPHA, "ranks_per_node": RANKS_PER_NODE,
               "points": [{**asdict(pt), "speedup": pt.speedup, "auto_speedup": pt.auto_speedup}
                           for pt in points],
               "gpu_nccl": {"nvlink_bw": NVLINK_BW, "nvlink_alpha": NVLINK_ALPHA,
                            "v2_gain": V2_GAIN, "v2_rate": V2_RATE,
                            "points": [{**asdict(pt), "speedup_v1": pt.speedup_v1,
                                        "speedup_v2": pt.speedup_v2} for pt in gpu]}}
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        plot(points, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
