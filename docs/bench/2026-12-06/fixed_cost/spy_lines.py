import collections, sys
path, key, thr = sys.argv[1], sys.argv[2], float(sys.argv[3])
incl = collections.Counter(); tot=0
for line in open(path):
    stack, n = line.rsplit(" ", 1); n = int(n)
    frames = stack.split(";")
    if not any(key in f for f in frames): continue
    if any("_compile_for_args" in f for f in frames): continue
    tot += n
    seen=set()
    for f in frames:
        if f not in seen: incl[f]+=n; seen.add(f)
print("# samples:", tot)
for f, n in sorted(incl.items(), key=lambda kv: -kv[1]):
    if n/tot > thr and ("ccoll" in f or "numpy" in f): print(f"{n/tot*100:5.1f}% {f}".replace("/work/main/", ""))
