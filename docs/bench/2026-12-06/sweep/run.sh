#!/bin/sh
# The allreduce sweep of docs/performance.md ("The same sweep on a core without AVX-512"),
# run at 628cb6c, when `ccoll bench` still interleaved its rows call by call: the same
# command as runs/run.sh, whose outputs went here. Run from the repository root.
OUT=docs/bench/2026-12-06/sweep exec sh docs/bench/2026-12-06/runs/run.sh
