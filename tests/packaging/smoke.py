"""Smoke test of an installed ccoll (run by tests/packaging/smoke.sh in a fresh venv).

Checks that ``import ccoll`` and the CPU compressor work without any MPI or CUDA wheel, and
what the first collective does: with no MPI library, it raises ccoll's CollectiveError that
names the fix; with one (a site MPI), a 1-rank allreduce runs through it. Prints one line per
check; exits non-zero on the first failure.
"""

import sys

import numpy as np

import ccoll

print(f"ccoll {ccoll.__version__} from {ccoll.__file__}")
if "site-packages" not in ccoll.__file__:
    sys.exit("FAIL: ccoll was not imported from the installed package")

x = np.random.default_rng(0).random(1000).astype(np.float32)
stream = ccoll.compress(x, ccoll.REL(1e-3))
y = ccoll.decompress(stream)
bound = 1e-3 * float(x.max() - x.min())
err = float(np.abs(y.astype(np.float64) - x).max())
ratio = x.nbytes / stream.nbytes
print(
    f"compress: 1000 float32 at REL(1e-3) -> {stream.nbytes} B (ratio {ratio:.2f}),"
    f" max error {err:.3g} <= bound {bound:.3g}: {err <= bound}"
)
if not (y.dtype == x.dtype and y.shape == x.shape and err <= bound):
    sys.exit("FAIL: decompressed data out of the bound")
for mod in ("numba_cuda", "cupy", "mpi4py.MPI"):
    print(f"{mod} imported: {mod in sys.modules}")
if "mpi4py.MPI" in sys.modules or "numba_cuda" in sys.modules:
    sys.exit("FAIL: import ccoll + compress loaded MPI or numba-cuda")

try:
    allreduce = ccoll.allreduce
except ccoll.CollectiveError as exc:
    msg = str(exc)
    print(f"ccoll.allreduce: CollectiveError: {msg.splitlines()[0]}")
    if "pip install 'ccoll[mpich]'" not in msg:
        sys.exit("FAIL: the error does not name the fix")
    print("result: no MPI library here; the first collective says how to get one")
else:
    from mpi4py import MPI

    out = allreduce(np.ones(1000, np.float32), eb=ccoll.ABS(1e-3))
    print(f"MPI library: {MPI.Get_library_version().splitlines()[0]}")
    print(f"1-rank allreduce of ones: max |out - 1| = {float(np.abs(out - 1).max()):.3g}")
    if float(np.abs(out - 1).max()) > 1e-3:
        sys.exit("FAIL: allreduce out of the bound")
    print("result: an MPI library was found; the collective ran through it")
print("smoke test passed")
