import json,sys
for f in sys.argv[1:]:
    v=json.load(open(f))
    print(f, "steps=", v.get("empty_wasm_steps"))
    m=v["max_rps"]
    for s in v["sides"]:
        rps=[r[s]["ok_rps"] for r in m["rounds"]]
        cpu=[r[s]["envoy_cpu_us_per_request"] for r in m["rounds"]]
        vs=m["vs_least_request"].get(s,{})
        c=v["cpu_per_request"]["vs_least_request"].get(s,{})
        print(f"  {s:14s} rps {' '.join('%6.0f'%x for x in rps)} | cpu {' '.join('%5.0f'%x for x in cpu)} | rps ratio {vs.get('ratio_of_medians')} rounds {[round(x,2) for x in vs.get('ratio_per_round',[])]} | cpu ratio {c.get('ratio_of_medians')}")
    for ph in ["filter_half_load","half_load"]:
        p=v[ph]; print("  ",ph,p["rate_rps"], {k:(round(x["ratio_of_medians"],2) if x["ratio_of_medians"] else None, x["added_us_median"] and round(x["added_us_median"])) for k,x in p["vs_least_request"].items()})
