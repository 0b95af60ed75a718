"""Cost model of ring allreduce, raw and compressed (docs/model.md derives every formula).

Pure arithmetic on calibrated constants; no MPI, no compressor.
:mod:`ccoll.collectives.policy` measures the constants and uses :func:`predict` to pick
raw or compressed per call (``policy="auto"``); the
``ccoll model`` command prints the predictions and the break-even points
(:mod:`ccoll.collectives.floor`). How a sum's and the split bound's ratios change is
:mod:`ccoll.collectives.ratios`.

Symbols (all sizes in bytes of the uncompressed message, all rates in bytes per second):

- ``S`` message size, ``N`` ranks;
- ``alpha`` latency of one ring step (one ``Sendrecv`` with each neighbour), ``beta`` link
  bandwidth per direction per rank;
- ``reduce`` throughput of a plain elementwise sum (MPI's local reduction);
- ``compress`` / ``add`` / ``decompress``: compressor throughputs, each counted in bytes of
  the *uncompressed* data handled (``add`` of two streams that stand for ``m`` bytes of floats
  takes ``m / add`` seconds, however small the streams are);
- ``ratio`` of one rank's freshly compressed data, ``ratio_sum`` of the fully reduced stream
  (a sum of ``N`` streams has wider codes, so ``ratio_sum <= ratio``);
- ``overhead`` fixed cost of one compressed call (argument checks, agreement, buffers).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ccoll.collectives.ratios import (
    DEFAULT_WIDTH,
    SUM_GROWTH,
    log2,
    ratio_at_finer_bound,
    ratio_of_sum,
    split_ratios,
    split_reduce_share,
)

__all__ = [
    "Params",
    "Prediction",
    "DEFAULTS",
    "predict_raw",
    "predict_homomorphic",
    "predict_dar",
    "predict_halving",
    "predict_raw_halving",
    "halving_shape",
    "halving_words",
    "choose_schedule",
    "best_halving_pieces",
    "halving_pieces",
    "predict_node_phases",
    "predict",
    "predict_raw_reduce_scatter",
    "predict_raw_allgather",
    "predict_compressed_allgather",
    "predict_raw_bcast",
    "predict_compressed_bcast",
    "COLLECTIVES",
    "best_chunks",
    "chunk_elems_for",
    "DEFAULT_RATIO",
    "split_time",
    "split_pays",
    "SHM_BANDWIDTH",
    "predict_hierarchical",
    "hierarchical_applies",
    "range_time",
]


# Assumed bandwidth of MPI's shared-memory transport per rank (bytes/s): a node's exact
# reduce-scatter and allgather (hierarchical allreduce). Not calibrated (docs/model.md).
SHM_BANDWIDTH = 10e9

@dataclass(frozen=True)
class Params:
    """Calibrated constants of one communicator and one compressor backend (SI units)."""

    alpha: float  # s per ring step
    beta: float  # bytes/s per direction per rank
    compress: float  # bytes/s of input
    add: float  # bytes/s of represented input
    decompress: float  # bytes/s of output
    reduce: float = 4e9  # bytes/s of a plain float sum
    overhead: float = 100e-6  # s per compressed call
    chunk_overhead: float = 30e-6  # s per pipeline chunk (a kernel launch, a Python loop turn)
    # Share of the link bandwidth that MPI's own allreduce / reduce-scatter reach (measured:
    # MPICH over TCP reached about half of a 10 Gbit/s link, all of a 1 Gbit/s one).
    raw_efficiency: float = 1.0
    # bytes/s of one rank's share of its node's shared memory (the intra-node phases of a
    # hierarchical allreduce): an assumed constant, not measured (docs/model.md).
    shm: float = SHM_BANDWIDTH
    # bytes/s of the pass that finds a REL bound's range of the data, before the agreement
    # of a call that may compress (docs/model.md, "The range of a REL bound").
    scan: float = 8e9

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"model parameter {name} must be finite and >= 0, got {v!r}")
        for name in ("beta", "compress", "add", "decompress", "reduce", "raw_efficiency",
                     "shm", "scan"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model parameter {name} is a rate and must be > 0")


# Smallest pipeline chunk the model considers (bytes).
MIN_CHUNK_BYTES = 4 << 20
# Ratio of one rank's data assumed where none was sampled (`ccoll model`'s default too).
DEFAULT_RATIO = 16.0

# Used by `ccoll model` for whatever the caller does not give; measured on one core of the
# 2-core development machine with the CPU backend (docs/model.md, "Calibration").
DEFAULTS = Params(
    alpha=50e-6, beta=1.25e8, compress=1.0e9, add=3.0e9, decompress=1.5e9, reduce=4e9
)


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one collective of ``size`` bytes per rank on ``ranks`` ranks."""

    size: int
    ranks: int
    raw: float
    homomorphic: float
    dar: float
    chunks: int
    ratio: float
    ratio_sum: float
    collective: str = "allreduce"

    @property
    def compressed(self) -> float:
        """The faster compressed algorithm's time."""
        return min(self.homomorphic, self.dar)

    @property
    def speedup(self) -> float:
        """Raw time over homomorphic time (> 1: compression pays)."""
        return self.raw / self.homomorphic if self.homomorphic > 0 else math.inf

    @property
    def choice(self) -> str:
        """``"homomorphic"`` when it is predicted faster than raw, else ``"raw"``."""
        return "homomorphic" if self.homomorphic < self.raw else "raw"


# The split's requantization, in decodes and compressions of the data it covers (measured
# on MiniLM gradients, 16 MiB of float32 per owner block; docs/dev/scale-out.md, "Split:
# time"): the owner decodes its reduced chunk to float64, compresses that, decodes the
# result and compares it with the values it came from (about four decodes and one
# compression of S/N); every rank decodes float64 streams, about one decode of the
# (N-1)/N S it receives more than float32 ones.
SPLIT_OWNER_DECODES = 4.0
SPLIT_GATHER_DECODES = 1.0


def split_time(size: float, ranks: int, p: Params) -> float:
    """Seconds the split's requantization adds to a homomorphic ring allreduce (no overlap).

    ``S/N (4/decompress + 1/compress) + (N-1)/N S (1/decompress)``: the owner's
    requantization of its block and everyone's wider decoding (``SPLIT_*_DECODES``).
    """
    if ranks < 2:
        return 0.0
    n = ranks
    return (size / n * (SPLIT_OWNER_DECODES / p.decompress + 1.0 / p.compress)
            + (n - 1) / n * size * SPLIT_GATHER_DECODES / p.decompress)


def split_pays(size: float, ranks: int, p: Params, ratio: float, share: float, *,
               width: float = DEFAULT_WIDTH, max_chunks: int = 64) -> bool:
    """Whether a split at ``share`` is predicted faster than none for ``size`` bytes per rank.

    The homomorphic ring priced with the split's message ratios (:func:`split_ratios`,
    each at its best chunk count) plus :func:`split_time`, against the ring without a
    split. The bytes a split saves are a few percent at 4 ranks and a quarter at 16
    (docs/dev/scale-out.md, "Scale out"), so it pays where the link, not the compressor,
    bounds the call. Pure arithmetic on agreed numbers: the same on every rank.
    """
    if ranks < 2 or share <= 0.0:
        return False

    def ring(s: float) -> float:
        rs, ag = split_ratios(ratio, ranks, s, width)
        k = best_chunks(size, ranks, p, rs, ratio_sum=ag, width=width, max_chunks=max_chunks)
        return predict_homomorphic(size, ranks, p, rs, ratio_sum=ag, chunks=k, width=width)

    return ring(share) + split_time(size, ranks, p) < ring(0.0)


def predict_raw(size: float, ranks: int, p: Params) -> float:
    """Ring (reduce-scatter + allgather) allreduce of raw data, the bandwidth-optimal MPI one.

    ``2(N-1) alpha + 2(N-1)/N * S/(e beta) + (N-1)/N * S/reduce``, ``e`` the share of the
    link MPI's allreduce reaches (``raw_efficiency``).
    """
    if ranks <= 1:
        return 0.0
    n = ranks
    bw = p.beta * p.raw_efficiency
    return 2 * (n - 1) * p.alpha + 2 * (n - 1) / n * size / bw + (n - 1) / n * size / p.reduce


def _overlap(compute: float, network: float, chunks: int) -> float:
    """Makespan of ``chunks`` pieces that each need the processor, then the network.

    The compressor kernels of one rank share its cores, so its compressions and adds run
    one after another on the collective's worker thread while the calling thread moves
    data: only computing and sending overlap. With ``k`` equal pieces the longer resource
    is busy all along and the shorter one adds one piece's worth:
    ``max(C, W) + min(C, W) / k`` (``C + W`` for ``k = 1``).
    """
    k = max(1, chunks)
    return max(compute, network) + min(compute, network) / k


def _gather_and_decode(size: float, n: int, p: Params, ratio_sum: float) -> float:
    """Allgather of the reduced streams (one message per rank) and their decoding.

    This rank's own block is decoded while the allgather moves (``max``), the others after.
    """
    wire = (n - 1) * p.alpha + (n - 1) / n * size / (ratio_sum * p.beta)
    return max(wire, size / n / p.decompress) + (n - 1) / n * size / p.decompress


def _hom_reduce_scatter(size: float, n: int, p: Params, ratio: float, k: int) -> float:
    """Time the homomorphic reduce-scatter phase (without fixed and per-chunk costs)."""
    compute = size / p.compress + (n - 1) / n * size / p.add
    network = k * (n - 1) * p.alpha + (n - 1) / n * size / (ratio * p.beta)
    return _overlap(compute, network, k)


def _dar_reduce_scatter(size: float, n: int, p: Params, ratio: float, k: int,
                        width: float) -> float:
    """Time the DAR reduce-scatter phase (without fixed and per-chunk costs)."""
    r1 = ratio_at_finer_bound(ratio, (2 * n - 1) / n, width)
    r_steps = ratio_of_sum(r1, max(1.0, n / 2), width)
    blk = size / n
    compute = blk / p.compress + (n - 1) * blk * (1 / p.decompress + 1 / p.reduce
                                                   + 1 / p.compress)
    network = k * (n - 1) * p.alpha + (n - 1) * blk / (r_steps * p.beta)
    return _overlap(compute, network, k)


def predict_homomorphic(
    size: float, ranks: int, p: Params, ratio: float, *, ratio_sum: float | None = None,
    chunks: int = 1, width: float = DEFAULT_WIDTH,
) -> float:
    """Homomorphic ring: compress once, reduce-scatter by adding streams, allgather, decode.

    Reduce-scatter: the worker compresses all ``S`` and adds ``N-1`` received blocks,
    ``C = S/compress + (N-1)/N * S/add``, while the ring moves fresh streams,
    ``W = k (N-1) alpha + (N-1)/N * S/(ratio beta)``; each ring block is cut into ``k``
    chunks (one stream, one message each), so ``max(C, W) + min(C, W)/k``. Then the
    allgather of the reduced streams (ratio ``ratio_sum``) and the decoding
    (:func:`_gather_and_decode`); plus ``overhead + (k - 1) * chunk_overhead`` (the fixed
    cost of a call includes its first chunk).
    """
    if ranks <= 1:
        return p.overhead
    n = ranks
    rs = ratio_of_sum(ratio, n, width) if ratio_sum is None else ratio_sum
    k = max(1, int(chunks))
    return (p.overhead + (k - 1) * p.chunk_overhead + _hom_reduce_scatter(size, n, p, ratio, k)
            + _gather_and_decode(size, n, p, rs))


def predict_dar(
    size: float, ranks: int, p: Params, ratio: float, *, chunks: int = 1,
    width: float = DEFAULT_WIDTH,
) -> float:
    """Decompress-add-recompress ring (C-Coll style), with the same chunking.

    ``ratio`` is the ratio of one rank's data at the homomorphic ring's per-rank bound
    ``eb/N``; DAR compresses with ``eb/(2N-1)``, which costs ``log2((2N-1)/N)`` bits per
    code, and sends partial sums, which cost like sums of half the ranks. Compute:
    the first block ``S/(N compress)`` and at each step ``S/N (1/decompress + 1/reduce +
    1/compress)``; then the allgather and decoding as in the homomorphic ring.
    """
    if ranks <= 1:
        return p.overhead
    n = ranks
    k = max(1, int(chunks))
    r_final = ratio_of_sum(ratio_at_finer_bound(ratio, (2 * n - 1) / n, width), n, width)
    return (p.overhead + (k - 1) * p.chunk_overhead
            + _dar_reduce_scatter(size, n, p, ratio, k, width)
            + _gather_and_decode(size, n, p, r_final))


def halving_shape(ranks: int) -> tuple[int, int]:
    """``(m, rest)`` of recursive halving on ``ranks``: ``2**m`` ranks halve, ``rest`` fold."""
    m = max(1, int(ranks)).bit_length() - 1
    return m, int(ranks) - (1 << m)


def halving_words(ranks: int, share: float = 0.0, width: float = DEFAULT_WIDTH,
                  growth: float = SUM_GROWTH) -> tuple[list[tuple[float, float]], float]:
    """Words per non-zero block of recursive halving's messages, by step.

    Returns ``([(fraction of S, words), ...], ag_words)``: the reduce-scatter's messages
    (the fold of an extra rank, then step ``j`` sending ``S / 2**(j+1)`` of partial sums of
    ``2**j`` streams, ``2**(j+1)`` on folded ranks, ``g log2`` of that wider) and the words
    of the allgather's blocks (the full sum, or requantized at ``share`` as in
    :func:`split_bits`).
    """
    m, rest = halving_shape(ranks)
    f = 1 if rest else 0
    finer = -log2(split_reduce_share(ranks, share))
    base = 1.0 + width + finer
    steps = [(1.0, base)] if f else []
    steps += [(0.5 ** (j + 1), base + growth * (j + f)) for j in range(m)]
    if share <= 0:
        ag = 1.0 + width + growth * log2(ranks)
    else:
        ag = 1.0 + max(0.0, width + (growth - 1.0) * log2(ranks) - log2(share))
    return steps, ag


def predict_halving(
    size: float, ranks: int, p: Params, ratio: float, *, share: float = 0.0,
    pieces: int = 2, width: float = DEFAULT_WIDTH, growth: float = SUM_GROWTH,
) -> float:
    """Homomorphic recursive halving and doubling (:mod:`ccoll.collectives.halving`).

    ``Q = 2**m <= N`` ranks, ``rest = N - Q`` folded into them (``f = 1`` if any: one
    more message of the whole ``S`` each way). Reduce-scatter: compute as the ring's,
    ``S/compress + (Q-1)/Q * S/add`` (plus ``S/add`` for the fold); network
    ``(m + f) alpha`` (one latency per step: a step's chunks follow each other to one
    peer) plus the bytes of :func:`halving_words` over ``beta``, where ``ratio`` is one
    rank's fresh stream (``1 + width`` words a block); overlapped as the ring's over the
    ``pieces / 2`` pieces each half of the first step is cut into. Allgather:
    ``(m + f) alpha`` plus ``((Q-1)/Q + f) S`` of final blocks, this rank's own block
    decoded meanwhile, then the others. Fixed costs: ``overhead`` and ``chunk_overhead``
    for each compute call beyond the first, about ``pieces + 5 m`` of them (compress or
    add each piece, cut, add, join and decode at each step).
    """
    n = int(ranks)
    if n <= 1:
        return p.overhead
    m, rest = halving_shape(n)
    q = 1 << m
    f = 1 if rest else 0
    k = max(2, int(pieces))
    steps, ag_words = halving_words(n, share, width, growth)
    per_word = size / (ratio * (1.0 + width) * p.beta)
    compute = size / p.compress + (q - 1) / q * size / p.add + f * size / p.add
    network = (m + f) * p.alpha + sum(frac * w for frac, w in steps) * per_word
    rs = _overlap(compute, network, k // 2)
    wire = (m + f) * p.alpha + ((q - 1) / q + f) * ag_words * per_word
    ag = max(wire, size / q / p.decompress) + (q - 1) / q * size / p.decompress
    return p.overhead + (k - 1 + 5 * m) * p.chunk_overhead + rs + ag


def halving_pieces(count: int, itemsize: int, chunk_elems: int, *, fixed: bool = False) -> int:
    """Pieces the first step of recursive halving cuts ``count`` elements into.

    About ``chunk_elems`` each (the Communicator's fixed chunk, ``fixed``), or, for a chunk
    chosen per call (the ring's, which shrinks with the rank count), at least
    :data:`MIN_CHUNK_BYTES`; 2 to :data:`MAX_HALVING_PIECES`. Pure arithmetic on agreed
    numbers.
    """
    elems = max(1, int(chunk_elems))
    if not fixed:
        elems = max(elems, MIN_CHUNK_BYTES // max(1, int(itemsize)))
    return min(MAX_HALVING_PIECES, max(2, -(-int(count) // elems)))


def predict_raw_halving(size: float, ranks: int, p: Params) -> float:
    """Raw recursive halving and doubling (Rabenseifner's allreduce, as MPI libraries run it).

    ``2 (m + f) alpha + 2 ((Q-1)/Q + f) S/(e beta) + ((Q-1)/Q + f) S/reduce`` with the
    :func:`halving_shape` of ``N``.
    """
    n = int(ranks)
    if n <= 1:
        return 0.0
    m, rest = halving_shape(n)
    q = 1 << m
    f = 1 if rest else 0
    part = (q - 1) / q + f
    bw = p.beta * p.raw_efficiency
    return 2 * (m + f) * p.alpha + 2 * part * size / bw + part * size / p.reduce


# Most pieces the first step of recursive halving cuts a message into (halving_pieces).
MAX_HALVING_PIECES = 256
# Fewest ranks for which schedule="auto" considers recursive halving (choose_schedule).
HALVING_MIN_RANKS = 8


def choose_schedule(size: float, ranks: int, p: Params, ratio: float, *, share: float = 0.0,
                    chunks: int = 1, pieces: int = 2, width: float = DEFAULT_WIDTH) -> str:
    """``"halving"`` where it is predicted faster than the ring, else ``"ring"``.

    Below :data:`HALVING_MIN_RANKS` ranks always the ring: at 2 ranks both are one
    exchange, and at 3-7 the schedules differ by a few latency steps and a bit or two of
    width, which the model prices within its own error, while the ring's pipeline is the
    one measured there (docs/model.md, "Recursive halving"). From there the ring's
    prediction uses the same word count (:func:`split_ratios`), so the two differ in
    their latency terms, the widths of their partial sums and the fold. Pure arithmetic
    on agreed numbers: every rank gets the same answer.
    """
    n = int(ranks)
    if n < HALVING_MIN_RANKS:
        return "ring"
    rs, ag = split_ratios(ratio, n, share, width)
    ring = predict_homomorphic(size, n, p, rs, ratio_sum=ag, chunks=chunks, width=width)
    halv = predict_halving(size, n, p, ratio, share=share, pieces=pieces, width=width)
    return "halving" if halv < ring else "ring"


def predict_raw_reduce_scatter(size: float, ranks: int, p: Params) -> float:
    """Raw ring reduce-scatter: ``(N-1) alpha + (N-1)/N * S (1/(e beta) + 1/reduce)``."""
    n = ranks
    bw = p.beta * p.raw_efficiency
    return (n - 1) * p.alpha + (n - 1) / n * size * (1 / bw + 1 / p.reduce)


def predict_raw_allgather(size: float, ranks: int, p: Params) -> float:
    """Raw ring allgather of ``S`` bytes per rank: ``(N-1) (alpha + S/beta)``."""
    return (ranks - 1) * (p.alpha + size / p.beta)


def predict_compressed_allgather(size: float, ranks: int, p: Params, ratio: float) -> float:
    """Compress once, allgather the streams, decode all ``N``: no pipelining."""
    n = ranks
    return (p.overhead + size / p.compress + (n - 1) * (p.alpha + size / (ratio * p.beta))
            + n * size / p.decompress)


def predict_raw_bcast(size: float, ranks: int, p: Params) -> float:
    """Large-message bcast (scatter + ring allgather): ``~ 2(N-1)/N * S/beta``."""
    n = ranks
    return (n - 1 + (n - 1).bit_length()) * p.alpha + 2 * (n - 1) / n * size / p.beta


def predict_compressed_bcast(size: float, ranks: int, p: Params, ratio: float) -> float:
    """Predict a compressed bcast: the root compresses, every rank decodes the stream."""
    return p.overhead + size / p.compress + predict_raw_bcast(size / ratio, ranks, p) + (
        size / p.decompress
    )


def best_chunks(size: float, ranks: int, p: Params, ratio: float, *,
                ratio_sum: float | None = None, width: float = DEFAULT_WIDTH,
                max_chunks: int = 64, min_chunk_bytes: int = MIN_CHUNK_BYTES) -> int:
    """Pick the chunks per ring block (a power of two) that minimize the homomorphic time.

    A ring block is ``S/N`` bytes; chunks smaller than ``min_chunk_bytes`` are not
    considered: below that the per-chunk costs of the ring (thread hand-offs, polling,
    kernel calls), which the model folds into ``chunk_overhead``, stop being constant
    (on the 2-core machine of docs/performance.md, 256 KiB chunks made a 64 MiB allreduce
    2.4x slower than 4 MiB chunks).
    """
    best_k, best_t = 1, math.inf
    k = 1
    block = size / max(1, ranks)
    while k <= max_chunks and (k == 1 or block / k >= min_chunk_bytes):
        t = predict_homomorphic(size, ranks, p, ratio, ratio_sum=ratio_sum, chunks=k,
                                width=width)
        if t < best_t * (1 - 1e-9):
            best_k, best_t = k, t
        k *= 2
    return best_k


def chunk_elems_for(count: int, itemsize: int, ranks: int, p: Params,
                    ratio: float = DEFAULT_RATIO, *, width: float = DEFAULT_WIDTH,
                    max_chunks: int = 64, min_chunk_bytes: int = MIN_CHUNK_BYTES) -> int:
    """Elements per pipeline chunk for a compressed call of ``count`` elements per rank.

    The ring block (``ceil(count / ranks)`` elements) cut into :func:`best_chunks` pieces:
    a power of two, none under ``min_chunk_bytes`` unless the block is one chunk. Pure
    arithmetic on its arguments: ranks that pass the same numbers get the same chunk.
    """
    n = max(1, int(ranks))
    block = max(1, -(-int(count) // n))
    k = best_chunks(float(count * itemsize), n, p, ratio, width=width, max_chunks=max_chunks,
                    min_chunk_bytes=min_chunk_bytes)
    return max(1, -(-block // k))


COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "bcast")


def hierarchical_applies(hier: tuple[int, int] | None, collective: str = "allreduce") -> bool:
    """Whether a call runs in two levels: an allreduce on at least 2 nodes of 2+ ranks."""
    return hier is not None and collective == "allreduce" and hier[0] >= 2 and hier[1] >= 2


def predict_node_phases(size: float, ranks_per_node: int, p: Params) -> float:
    """Time the node phases of a two-level allreduce: ``2 (R-1)/R S/shm + (R-1)/R S/reduce``."""
    r = int(ranks_per_node)
    return 2 * (r - 1) / r * size / p.shm + (r - 1) / r * size / p.reduce


def best_halving_pieces(size: float, ranks: int, p: Params, ratio: float, *,
                        share: float = 0.0, width: float = DEFAULT_WIDTH,
                        max_pieces: int = 64, min_chunk_bytes: int = MIN_CHUNK_BYTES) -> int:
    """Pick the first-step pieces of :func:`predict_halving` (as :func:`best_chunks`).

    A power of two from 2; none under ``min_chunk_bytes`` unless there are 2.
    """
    best_k, best_t = 2, math.inf
    k = 2
    while k <= max_pieces and (k == 2 or size / k >= min_chunk_bytes):
        t = predict_halving(size, ranks, p, ratio, share=share, pieces=k, width=width)
        if t < best_t * (1 - 1e-9):
            best_k, best_t = k, t
        k *= 2
    return best_k


def predict_hierarchical(size: float, nodes: int, ranks_per_node: int, p: Params,
                         ratio: float, *, ratio_sum: float | None = None,
                         chunks: int | None = None, width: float = DEFAULT_WIDTH,
                         max_chunks: int = 64) -> Prediction:
    """Two-level allreduce: exact inside each node, a ring per local rank between nodes.

    With ``K`` nodes of ``R`` ranks: the node's reduce-scatter and allgather move
    ``(R-1)/R * S`` each through shared memory (``shm``) and sum ``(R-1)/R * S``
    (``reduce``); between nodes ``R`` rings of ``K`` ranks each carry ``S/R`` on the node's
    link, which they share: each ring sees ``beta / R``. Raw is the same two levels with a
    raw ring (what a node-aware ``MPI_Allreduce`` does); compressed runs
    :func:`predict_homomorphic` / :func:`predict_dar` on the share. ``ratio`` is one rank's
    at the flat per-rank bound, a conservative stand-in for the node sums' (docs/model.md).
    """
    k_nodes, r = int(nodes), int(ranks_per_node)
    share = size / r
    pi = replace(p, beta=p.beta / r)
    intra = predict_node_phases(size, r, p)
    rs = ratio_of_sum(ratio, k_nodes, width) if ratio_sum is None else ratio_sum
    k = (best_chunks(share, k_nodes, pi, ratio, ratio_sum=rs, width=width,
                     max_chunks=max_chunks) if chunks is None else max(1, int(chunks)))
    raw = intra + predict_raw(share, k_nodes, pi)
    hom = intra + predict_homomorphic(share, k_nodes, pi, ratio, ratio_sum=rs, chunks=k,
                                      width=width)
    dar = intra + predict_dar(share, k_nodes, pi, ratio, chunks=k, width=width)
    return Prediction(size=int(size), ranks=k_nodes * r, raw=raw, homomorphic=hom, dar=dar,
                      chunks=k, ratio=ratio, ratio_sum=rs, collective="allreduce")


def predict(size: float, ranks: int, p: Params, ratio: float, *,
            collective: str = "allreduce", ratio_sum: float | None = None,
            chunks: int | None = None, width: float = DEFAULT_WIDTH,
            max_chunks: int = 64, hier: tuple[int, int] | None = None,
            ranged: bool = False) -> Prediction:
    """Raw, homomorphic and DAR predictions for one call; ``chunks=None`` picks the best.

    For ``allgather`` and ``bcast`` (nothing is summed) ``homomorphic`` and ``dar`` both
    hold the compressed algorithm's time, and ``ratio`` is at the full bound. ``hier``
    (nodes, ranks per node): an allreduce on at least 2 nodes of 2+ ranks is predicted in
    two levels (:func:`predict_hierarchical`); ``chunks`` are then per inter-node block.
    ``ranged``: a REL bound on host data, whose range a compressed call finds first, a
    pass over the data at ``p.scan`` (added to ``homomorphic`` and ``dar``).
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    pred = _predict(size, ranks, p, ratio, collective, ratio_sum, chunks, width, max_chunks,
                    hier)
    if not ranged or ranks <= 1:
        return pred
    scan = range_time(size, p)
    return replace(pred, homomorphic=pred.homomorphic + scan, dar=pred.dar + scan)


def range_time(size: float, p: Params) -> float:
    """Seconds of the pass that finds a REL bound's range in ``size`` bytes.

    A compressed call's, before its agreement (docs/model.md, "The range of a REL bound").
    """
    return size / p.scan


def _predict(size: float, ranks: int, p: Params, ratio: float, collective: str,
             ratio_sum: float | None, chunks: int | None, width: float, max_chunks: int,
             hier: tuple[int, int] | None) -> Prediction:
    """:func:`predict` without the range pass."""
    if hier is not None and hierarchical_applies(hier, collective):
        return predict_hierarchical(size, hier[0], hier[1], p, ratio, ratio_sum=ratio_sum,
                                    chunks=chunks, width=width, max_chunks=max_chunks)
    n = ranks
    rs = ratio_of_sum(ratio, n, width) if ratio_sum is None else ratio_sum
    k = (best_chunks(size, n, p, ratio, ratio_sum=rs, width=width, max_chunks=max_chunks)
         if chunks is None else max(1, int(chunks)))
    if n <= 1:
        raw = hom = dar = 0.0
    elif collective == "allreduce":
        raw = predict_raw(size, n, p)
        hom = predict_homomorphic(size, n, p, ratio, ratio_sum=rs, chunks=k, width=width)
        dar = predict_dar(size, n, p, ratio, chunks=k, width=width)
    elif collective == "reduce_scatter":
        raw = predict_raw_reduce_scatter(size, n, p)
        fixed = p.overhead + (k - 1) * p.chunk_overhead + size / n / p.decompress
        hom = fixed + _hom_reduce_scatter(size, n, p, ratio, k)
        dar = fixed + _dar_reduce_scatter(size, n, p, ratio, k, width)
    elif collective == "allgather":
        k, rs = 1, ratio
        raw = predict_raw_allgather(size, n, p)
        hom = dar = predict_compressed_allgather(size, n, p, ratio)
    else:
        k, rs = 1, ratio
        raw = predict_raw_bcast(size, n, p)
        hom = dar = predict_compressed_bcast(size, n, p, ratio)
    return Prediction(size=int(size), ranks=n, raw=raw, homomorphic=hom, dar=dar, chunks=k,
                      ratio=ratio, ratio_sum=rs, collective=collective)
