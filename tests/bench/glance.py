#!/usr/bin/env python3
"""Prints the "at a glance" table of BENCHMARKS.md from the scenario summaries a run wrote:
per scenario, ai_lb's ratio to each baseline that ran (p99 TTFT, p99 e2e, throughput) and,
for the prefix-cache workloads, each policy's hit rate. No dependencies.

    tests/bench/glance.py bench-results/sharegpt-poisson-80 bench-results/prefix-poisson-80 ...
"""
import json
import sys
from pathlib import Path

BASELINES = ["least_request", "round_robin", "epp"]


def pct(p, key):
    return p["all"][key]["p99"] if p["all"].get(key) else None


def ratio(a, b):
    if a is None or b in (None, 0):
        return "–"
    return f"{a / b:.2f}"


def hit(p):
    c = p.get("prefix_cache")
    if isinstance(c, dict) and c.get("hit_rate") is not None:
        return f"{100 * c['hit_rate']:.1f} %"
    return "–"


def main(dirs):
    rows = []
    for d in dirs:
        path = Path(d) / "summary.json"
        try:
            v = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"skipping {path}: {e}", file=sys.stderr)
            continue
        by = {p["policy"]: p for p in v["policies"]}
        a = by.get("ai_lb")
        if a is None:
            continue
        cells = [v.get("scenario", d)]
        for b in BASELINES:
            p = by.get(b)
            if p is None:
                cells += ["–", "–", "–"]
                continue
            cells += [
                ratio(pct(a, "ttft_ms"), pct(p, "ttft_ms")),
                ratio(pct(a, "e2e_ms"), pct(p, "e2e_ms")),
                ratio(a["all"]["output_tokens_per_s"], p["all"]["output_tokens_per_s"]),
            ]
        chat = str(v.get("workload", "")).lower() in ("sharedprefix", "multiturn", "shared-prefix", "multi-turn")
        cells.append(" / ".join(hit(by[k]) for k in ["ai_lb", "epp", "least_request"] if k in by)
                     if chat else "–")
        rows.append(cells)
    head = ["scenario"]
    for b in BASELINES:
        head += [f"/ {b}: p99 TTFT", "p99 e2e", "throughput"]
    head.append("hit rate ai_lb / epp / least_request")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
