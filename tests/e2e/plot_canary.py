#!/usr/bin/env python3
"""Plots bench_canary's requests.csv: per second, the share of requests the canary (v2) served
and the client-visible errors in each run (the fault's time marked), and the latency CDF of the
requests stable (v1) pods served in each run.

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
for run in runs:
    total = defaultdict(int)
    canary = defaultdict(int)
    errors = defaultdict(int)
    for r in rows:
        if r["run"] != run:
            continue
        s = int(r["at_ms"]) // 1000
        total[s] += 1
        canary[s] += r["version"] == "v2"
        errors[s] += r["status"] != "200"
    xs = sorted(total)
    axes[0].plot(xs, [canary[x] / total[x] for x in xs], label=run)
    axes[1].plot(xs, [errors[x] for x in xs], label=run)
for ax in axes:
    ax.axvline(fault_s, color="grey", linestyle=":", label="canary starts failing")
axes[0].set_ylabel("share served by the canary (v2)")
axes[0].set_title("Canary share and client errors per second (weights v1 95 / v2 5)")
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
