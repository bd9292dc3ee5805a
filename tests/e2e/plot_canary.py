#!/usr/bin/env python3
"""Plots bench_canary's output: per second, the requests the filter routed to the canary (v2)
(its pick count on the status page, canary_picks.csv: a request the canary failed is retried by
Envoy on a stable pod, so the answering pod does not show it) and the client-visible errors in
each run (the fault's time marked); and the latency CDF of the requests stable (v1) pods served
in each run.

    python3 tests/e2e/plot_canary.py bench-results/canary
"""
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results/canary")
rows = list(csv.DictReader(open(out / "requests.csv")))
summary = json.load(open(out / "summary.json"))
fault_s = summary["fault_at_ms"] / 1000.0
runs = ["no-canary", "canary-healthy", "canary-fails"]

fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
picks = list(csv.DictReader(open(out / "canary_picks.csv")))
for run in runs:
    samples = [(int(r["t_ms"]), int(r["canary_picks"])) for r in picks if r["run"] == run]
    per_s = defaultdict(int)
    for (t0, n0), (t1, n1) in zip(samples, samples[1:]):
        per_s[t1 // 1000] += n1 - n0
    xs = sorted(per_s)
    if xs:
        axes[0].plot(xs, [per_s[x] for x in xs], label=run)
    errors = defaultdict(int)
    for r in rows:
        if r["run"] == run:
            errors[int(r["at_ms"]) // 1000] += r["status"] != "200"
    xs = list(range(0, int(summary["secs"])))
    axes[1].plot(xs, [errors[x] for x in xs], label=run)
for ax in axes:
    ax.axvline(fault_s, color="grey", linestyle=":", label="canary starts failing")
axes[0].set_ylabel("requests routed to the canary / s")
axes[0].set_title("Canary (v2) picks and client errors per second (weights v1 95 / v2 5)")
axes[1].set_ylabel("requests not 200")
axes[1].set_xlabel("send time (s)")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig(out / "share_over_time.png", dpi=110)

fig, ax = plt.subplots(figsize=(7, 4))
for run in runs:
    t = sorted(
        float(r["e2e_ms"])
        for r in rows
        if r["run"] == run and r["version"] == "v1" and r["status"] == "200"
    )
    if not t:
        continue
    y = [(i + 1) / len(t) for i in range(len(t))]
    ax.plot(t, y, label=f"{run} (n={len(t)})")
ax.set_xscale("log")
ax.set_xlabel("end-to-end latency of requests stable (v1) pods served (ms)")
ax.set_ylabel("CDF")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out / "stable_latency_cdf.png", dpi=110)
