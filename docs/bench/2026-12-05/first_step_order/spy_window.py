import json,sys,collections
d=json.load(open(sys.argv[1]))
fr=d['shared']['frames']
profs=d['profiles']
for p in profs: print(p['name'], len(p['samples']), sum(p['weights']))
main=profs[0]
def has(s, key): return any(key in fr[i]['name'] or key in (fr[i].get('file') or '') for i in s)
# find runs of samples in optimizer step (adamw)
runs=[];cur=None
for i,s in enumerate(main['samples']):
    a=has(s,'adamw') or has(s,'optimizer.py')
    if a and cur is None: cur=i
    if not a and cur is not None: runs.append((cur,i)); cur=None
runs.sort(key=lambda r:r[0]-r[1])
print('longest optimizer runs (sample idx):', runs[:6])
lo,hi=runs[0]
def top(samples, n=12, depth=4):
    c=collections.Counter()
    for s in samples:
        # leaf frames (last entries)
        c[' < '.join(fr[i]['name']+':'+str(fr[i].get('line')) for i in s[::-1][:depth])]+=1
    return c.most_common(n)
print('MAIN in window', lo, hi)
for k,v in top(main['samples'][lo:hi]): print('  ',v,k)
for p in profs:
    if p is main: continue
    # align by sample index (approx)
    print('THREAD', p['name'])
    for k,v in top(p['samples'][lo:hi],6): print('  ',v,k)
