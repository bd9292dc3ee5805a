import json,sys,glob,os
d=sys.argv[1]
f=glob.glob(d+'/*/summary.json')
if not f: print(d, 'NO SUMMARY'); sys.exit()
j=json.load(open(f[0])); pol=sys.argv[2] if len(sys.argv)>2 else 'ai_lb'; p=[x for x in j['policies'] if x['policy']==pol][0]
a=p['all']; bt=p.get('by_tag') or {}
def g(x,k,q): return round(x[k][q]) if x and k in x else None
short=bt.get('short'); long=bt.get('long')
fc=p.get('filter_counters') or {}
hold={k:v for k,v in fc.items() if 'hold' in k}
print(os.path.basename(d), 'allTTFTp99', g(a,'ttft_ms','p99'), 'e2ep99', g(a,'e2e_ms','p99'), 'shortTTFTp99', g(short,'ttft_ms','p99'), 'longTTFTmax', g(long,'ttft_ms','max'), 'tok/s', round(a.get('output_tokens_per_s',0)), hold)
