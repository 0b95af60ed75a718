"""Error feedback's residual kernel on MiniLM gradients (16 Mi float32, the dump tiled).

Prints GB/s (median of 15 calls, after one warm call) at REL 1e-3 and 1e-4 of the range,
and a checksum of the residual, which must be the same for every checkout:

    cd CHECKOUT
    PYTHONPATH=$PWD python docs/bench/2026-12-06/residual_avx2/residual_speed.py NAME
"""

import sys
import time

import h5py
import numpy as np

from ccoll.compressor.cpu import residual_abs

arrs = []
with h5py.File("datasets/minilm.h5") as f:
    f.visititems(lambda name, obj: arrs.append(obj[...].ravel())
                 if isinstance(obj, h5py.Dataset) and obj.dtype == np.float32 else None)
x = np.concatenate(arrs)
x = np.tile(x, max(1, (16 << 20) // x.size))[: 16 << 20]
lo, hi = float(x.min()), float(x.max())
out = np.empty_like(x)
for rel in (1e-3, 1e-4):
    eb = rel * (hi - lo)
    residual_abs(x, eb, out=out)
    ts = []
    for _ in range(15):
        t0 = time.perf_counter()
        residual_abs(x, eb, out=out)
        ts.append(time.perf_counter() - t0)
    print(sys.argv[1], "rel", rel, f"GB/s {x.nbytes / np.median(ts) / 1e9:.2f}",
          "checksum", float(np.abs(out).sum()))
