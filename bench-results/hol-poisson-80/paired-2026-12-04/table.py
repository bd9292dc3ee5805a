import re
rows={}
for l in open(__import__('sys').argv[1] if len(__import__('sys').argv)>1 else 'results.txt'):
    m=re.match(r'hol-poisson-80-(\w+)-(\d+) .*shortTTFTp99 (\d+) longTTFTmax (\d+)',l)
    if not m: continue
    v,seed,short,lmax=m.group(1),int(m.group(2)),int(m.group(3)),int(m.group(4))
    held=re.search(r"'big_hold.held': (\d+)",l)
    e2e=int(re.search(r'e2ep99 (\d+)',l).group(1))
    rows.setdefault(seed,{})[v]=(short,lmax,int(held.group(1)) if held else None,e2e)
print('| seed | least_request | ai_lb | ai_lb / LR | ai_lb + bigRequestHold (held) | hold / LR | hold / ai_lb |')
print('|---|---|---|---|---|---|---|')
rs=[];hs=[];ho=[];L=[];O=[];H=[]
for seed in sorted(rows):
    r=rows[seed]
    if 'lr' not in r or 'off' not in r or 'atonce' not in r: 
        print('incomplete',seed,r); continue
    lr,off,on=r['lr'][0],r['off'][0],r['atonce'][0]
    rs.append(off/lr);hs.append(on/lr);ho.append(on/off);L.append(lr);O.append(off);H.append(on)
    print(f"| {seed} | {lr:,} | {off:,} | {off/lr:.2f} | {on:,} ({r['atonce'][2]}) | {on/lr:.2f} | {on/off:.2f} |".replace(',',' '))
n=len(rs)
import statistics as st
print(f"| mean of {n} | {st.mean(L):,.0f} | {st.mean(O):,.0f} | {st.mean(rs):.2f} (median {st.median(rs):.2f}) | {st.mean(H):,.0f} | {st.mean(hs):.2f} (median {st.median(hs):.2f}) | {st.mean(ho):.2f} |".replace(',',' '))
print('seeds meeting <=0.5: off', sum(x<=0.5 for x in rs), 'hold', sum(x<=0.5 for x in hs))
print('long TTFT max off', [rows[s]['off'][1] for s in sorted(rows) if 'off' in rows[s]], 'hold', [rows[s]['atonce'][1] for s in sorted(rows) if 'atonce' in rows[s]], 'lr',[rows[s]['lr'][1] for s in sorted(rows) if 'lr' in rows[s]])
print('e2e p99 off', [rows[s]['off'][3] for s in sorted(rows) if 'off' in rows[s]], 'lr',[rows[s]['lr'][3] for s in sorted(rows) if 'lr' in rows[s]])
