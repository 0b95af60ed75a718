# ccoll: every target sets up .venv itself (created or refreshed when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.ccoll-installed
MPIEXEC := $(VENV)/bin/mpiexec
# Ranks for the MPI test runs; each run has a per-test timeout so a hung rank fails fast.
MPI_RANKS ?= 1 2 3 4 5
MPI_TEST_TIMEOUT ?= 60
PYTEST_MPI = $(VPY) -m mpi4py -m pytest tests/mpi -q -p no:cacheprovider \
	--timeout=$(MPI_TEST_TIMEOUT) --timeout-method=thread

.PHONY: all venv demo test test-unit test-mpi test-cuda test-slow bench lint datasets clean \
	slurm-up slurm-down

all: test

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[test,torch,lint]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	timeout 900 $(MPIEXEC) -n 4 $(VPY) -m mpi4py -m ccoll.demo

test: $(STAMP)
	$(MAKE) --no-print-directory test-unit test-cuda test-mpi

test-unit: $(STAMP)
	$(VPY) -m pytest tests -m "not slow" --ignore=tests/mpi --ignore=tests/cuda

test-cuda: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest tests/cuda -m "not slow"

test-mpi: $(STAMP)
	@set -e; for n in $(MPI_RANKS); do \
	  echo "== tests/mpi with $$n rank(s)"; \
	  timeout 900 $(MPIEXEC) -n $$n $(PYTEST_MPI) -m "not slow"; \
	done

test-slow: $(STAMP)
	$(VPY) -m pytest tests -m slow --ignore=tests/mpi --ignore=tests/cuda
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest tests/cuda -m slow
	@set -e; for n in 2 4; do timeout 3600 $(MPIEXEC) -n $$n $(PYTEST_MPI) -m slow --timeout=1800; done

bench: $(STAMP)
	$(VPY) bench/compressor.py

# One-node Slurm on this machine (root, Debian) for trying jobs/*.sbatch; see jobs/README.md.
slurm-up:
	jobs/local-slurm/up.sh

slurm-down:
	jobs/local-slurm/down.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check ccoll tests bench
	$(VENV)/bin/mypy

datasets: $(STAMP)
	$(VPY) -m pip install -q -e ".[capture]"
	$(VPY) datasets/capture.py --out-dir datasets

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
