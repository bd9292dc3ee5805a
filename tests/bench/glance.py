#!/usr/bin/env python3
"""Prints the "at a glance" table of BENCHMARKS.md from the scenario summaries a run wrote:
per scenario, ai_lb's ratio to each baseline that ran (p99 TTFT, p99 e2e, throughput) and,
for the prefix-cache workloads, each policy's hit rate. No dependencies.

    tests/bench/glance.py bench-results/sharegpt-poisson-80 bench-results/prefix-poisson-80 ...
    tests/bench/glance.py --absolute <dirs>   # per scenario: the no-queue floor and every
                                              # policy's p99 TTFT, p99 e2e, tok/s, hit rate, CPU
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


POLICIES = ["round_robin", "least_request", "epp", "ai_lb"]


def ms(x):
    return "–" if x is None else f"{x:,.0f}".replace(",", " ")


def absolute(dirs):
    """One table: per scenario a row per measure, a column per policy (and the floor)."""
    print("| scenario | measure | no-queue floor | " + " | ".join(POLICIES) + " |")
    print("|---|---|---|" + "---|" * len(POLICIES))
    for d in dirs:
        path = Path(d) / "summary.json"
        try:
            v = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"skipping {path}: {e}", file=sys.stderr)
            continue
        by = {p["policy"]: p for p in v["policies"]}
        name = v.get("scenario", d)
        floor = v.get("floor_ttft_ms") or {}
        rows = [
            ("p99 TTFT ms", ms(floor.get("p99")), lambda p: ms(pct(p, "ttft_ms"))),
            ("p99 e2e ms", "", lambda p: ms(pct(p, "e2e_ms"))),
            ("out tok/s", "", lambda p: ms(p["all"]["output_tokens_per_s"])),
        ]
        chat = any(isinstance(p.get("prefix_cache"), dict)
                   and (p["prefix_cache"].get("hit_rate") or 0) > 0.01 for p in by.values())
        if chat:
            rows.append(("hit rate", "", hit))
        if any(p.get("cpu_s") for p in by.values()):
            rows.append(("CPU s (sidecars+picker)", "", lambda p: cpu(p)))
        for i, (measure, fl, f) in enumerate(rows):
            cells = [name if i == 0 else "", measure, fl]
            cells += [f(by[k]) if k in by else "–" for k in POLICIES]
            print("| " + " | ".join(cells) + " |")


def cpu(p):
    c = p.get("cpu_s") or {}
    total = (c.get("sidecars") or 0) + ((p.get("epp") or {}).get("epp_cpu_s") or 0)
    return f"{total:.1f}" if total else "–"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--absolute"]:
        absolute(sys.argv[2:])
    else:
        main(sys.argv[1:])
