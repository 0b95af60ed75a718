#!/usr/bin/env bash
# Hierarchical collectives on emulated nodes: 2 nodes x 2 ranks (jobs/emulated_cluster.py),
# at 1 and 10 Gbit/s per node and direction, 64 MiB of MiniLM-like gradients per rank
# (what `ccoll bench` uses), REL 1e-3. In ONE cluster run per rate, interleaved iteration by
# iteration: MPI_Allreduce, ccoll's flat compressed ring (ranks_per_node=1) and ccoll's
# two-level allreduce (nodes = MPI's shared-memory domains = the emulated nodes). Prints each
# rate's times and the ratios flat/hierarchical and MPI/hierarchical; JSON under $OUT.
#
# Needs root (network namespaces, tc). Usage:
#   sudo bench/hier_cluster.sh                      # 1gbit and 10gbit, -n 5 -w 1
#   sudo ITERS=2 WARMUP=1 RATES="1gbit" bench/hier_cluster.sh
#   sudo ALGO=auto bench/hier_cluster.sh            # policy="auto" instead of "compress"
# Env: RATES (default "1gbit 10gbit"), ALGO (homomorphic, i.e. policy="compress"; or auto),
# SIZE (64M), ITERS (5), WARMUP (1), OUT
# (bench/out/hier_cluster), TIMEOUT per cluster run in s (1800), PY (.venv/bin/python),
# NICE (nice level for every process, default 0; 19 on a shared machine).
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-"1gbit 10gbit"}
ALGO=${ALGO:-homomorphic}
SIZE=${SIZE:-64M}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-1}
OUT=${OUT:-bench/out/hier_cluster}
TIMEOUT=${TIMEOUT:-1800}
PY=${PY:-.venv/bin/python}
NICE=${NICE:-0}
mkdir -p "$OUT"
uptime
for rate in $RATES; do
    json="$OUT/hier_${ALGO}_${rate}.json"
    nice -n "$NICE" "$PY" jobs/emulated_cluster.py --nodes 2 --ranks-per-node 2 --rate "$rate" \
        --timeout "$TIMEOUT" -- \
        ccoll bench allreduce -b "$SIZE" -e "$SIZE" -n "$ITERS" -w "$WARMUP" \
        --iters-large "$ITERS" --warmup-large "$WARMUP" --algorithms "mpi,$ALGO" \
        --ranks-per-node 1,shm --no-model --force --json "$json"
    "$PY" - "$json" "$rate" "$ALGO" <<'PYEOF'
import json, sys
doc = json.load(open(sys.argv[1]))
algo = sys.argv[3]
rows = {r["algorithm"]: r for r in doc["rows"]}
mpi, flat, hier = (rows[a]["avg_us"] / 1e3 for a in ("mpi", f"{algo}/rpn=1", f"{algo}/shm"))
g = doc["meta"]["groupings"][f"{algo}/shm"]
assert "nodes=2, ranks_per_node=2" in g, f"the emulated nodes were not MPI's nodes: {g}"
print(f"{sys.argv[2]} {algo}: {rows['mpi']['size'] >> 20} MiB per rank, load {doc['meta']['loadavg'][0]:.1f}: "
      f"MPI_Allreduce {mpi:.1f} ms, flat ring {flat:.1f} ms, hierarchical {hier:.1f} ms; "
      f"hierarchical {flat / hier:.2f}x faster than flat, {mpi / hier:.2f}x faster than MPI "
      f"(err/eb flat {rows[f'{algo}/rpn=1']['err_over_eb']:.3f}, "
      f"hierarchical {rows[f'{algo}/shm']['err_over_eb']:.3f})")
PYEOF
done
