#!/usr/bin/env python3
"""Plots bench_derived_priority's requests.csv: the TTFT CDF of each request kind with the
derived priority off and on, and the share of each kind answered 503.

    python3 tests/e2e/plot_derived_priority.py bench-results/derived-priority
"""
import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results/derived-priority")
rows = list(csv.DictReader(open(out / "requests.csv")))

fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, kind in zip(axes, ["important", "batch"]):
    for run, style in [("off", "--"), ("on", "-")]:
        t = sorted(
            float(r["ttft_ms"])
            for r in rows
            if r["run"] == run and r["kind"] == kind and r["status"] == "200" and r["ttft_ms"]
        )
        if not t:
            continue
        y = [(i + 1) / len(t) for i in range(len(t))]
        ax.plot(t, y, style, label=f"derivedPriority {run} (n={len(t)})")
    ax.set_title(f"{kind} requests: TTFT of the 200s")
    ax.set_xlabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
axes[0].set_ylabel("fraction of requests")
fig.tight_layout()
fig.savefig(out / "ttft_cdf.png", dpi=110)

fig, ax = plt.subplots(figsize=(6, 4))
labels, off, on = [], [], []
for kind in ["important", "batch"]:
    labels.append(kind)
    for run, acc in [("off", off), ("on", on)]:
        of = [r for r in rows if r["run"] == run and r["kind"] == kind]
        acc.append(sum(r["status"] == "503" for r in of) / max(len(of), 1))
x = range(len(labels))
ax.bar([i - 0.2 for i in x], off, 0.4, label="derivedPriority off")
ax.bar([i + 0.2 for i in x], on, 0.4, label="derivedPriority on")
ax.set_xticks(list(x))
ax.set_xticklabels(labels)
ax.set_ylabel("share answered 503 (held past maxWaitStandardMs)")
ax.legend()
fig.tight_layout()
fig.savefig(out / "share_503.png", dpi=110)
print(f"wrote {out / 'ttft_cdf.png'} and {out / 'share_503.png'}")
