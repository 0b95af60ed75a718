"""A/B of the engine's small waits in one interleaved job (docs/dev/training-runs.md,
"Where a 100 Mbit/s step goes"): methods whose bucket size ends in .001 wait as before
3ff0f27 (every wait on the progress engine a blocking MPI_Waitsome: wait_all's bulk=True),
the others as since. From the repository root, as root, at 3ff0f27 or later:

    HF_HUB_OFFLINE=1 .venv/bin/python jobs/emulated_cluster.py --ranks 4 --rate 100mbit -- \
        .venv/bin/python -m mpi4py docs/bench/2026-12-05/engine_waits/ab_engine_waits.py \
        --model minilm --methods powersgd,ccoll,ccoll@25.001,ccoll@5,ccoll@5.001 \
        --interleave --steps 16 --eval-every 0 --powersgd-start-iter 2 --seed 1 --out OUT
"""
import sys
sys.path.insert(0, "examples")
import train_ddp
import ccoll.collectives  # noqa
import ccoll.collectives.waiting as W
import importlib, pkgutil
for m in pkgutil.walk_packages(ccoll.__path__, "ccoll."):
    if "__main__" in m.name or "cuda" in m.name or "gpu" in m.name:
        continue
    try:
        importlib.import_module(m.name)
    except Exception:
        pass
orig = W.wait_all
OLD = [False]
def wa(reqs, deadline, stage, *, poll=False, bulk=False):
    return orig(reqs, deadline, stage, poll=poll, bulk=bulk or OLD[0])
n = 0
for name, mod in list(sys.modules.items()):
    if name.startswith("ccoll") and getattr(mod, "wait_all", None) is orig:
        mod.wait_all = wa; n += 1
ostep = train_ddp.Run.step
def step(self, s, counter, rec=None):
    OLD[0] = self.method.endswith(".001")
    try:
        return ostep(self, s, counter, rec)
    finally:
        OLD[0] = False
train_ddp.Run.step = step
print("patched", n, "modules", file=sys.stderr)
sys.argv = ["train_ddp.py"] + sys.argv[1:]
train_ddp.main()
