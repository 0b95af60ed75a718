import sys, time, numba, numpy as np
sys.path.insert(0, "bench")
from compressor import DEFAULT_FILES, load_concat
import ccoll
from ccoll.compressor import add_data
numba.set_num_threads(1)
xx = load_concat(DEFAULT_FILES[0])
eb = 1e-3 * (float(xx.max()) - float(xx.min()))
n = int(sys.argv[1])
mid = xx.size // 2
x, z = xx[mid:mid+n].copy(), xx[mid+n:mid+2*n].copy()
a = ccoll.compress(x, ccoll.ABS(eb), version=2)
for _ in range(100): add_data(a, z)
t0 = time.perf_counter(); k = 0
while time.perf_counter() - t0 < float(sys.argv[2]):
    add_data(a, z); k += 1
print((time.perf_counter() - t0) / k * 1e6, "us")
