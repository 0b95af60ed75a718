import json,collections,glob,sys
for f in sorted(glob.glob(sys.argv[1]+'/trace_*.json')):
    d=json.load(open(f)); ev=d['traceEvents'] if isinstance(d,dict) else d
    out=collections.defaultdict(list)
    for e in ev:
        if e.get('ph')=='X' and e['name'] in ('optimizer step','backward() returns'):
            out[(e['pid'],e['name'])].append(round(e['dur']/1e3))
    print(f.split('/')[-1].replace('trace_minilm_',''), {k:sorted(v) for k,v in sorted(out.items())})
