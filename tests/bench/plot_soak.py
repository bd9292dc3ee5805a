"""Plots of the soaks (scripts/soak.sh): reads <dir>/report.json, writes <dir>/<soak>.png.
churn: pods present, the per-pod entries held by the filter (pool-state gauge, status page) and
by the agents, and memory (VM, agent, Envoy) over time; overload: admission outcomes per second,
held requests, and memory over time, the overload window shaded; pods: per pool size, the state
size, native decode/pick times and the Envoys' CPU.
Usage: plot_soak.py DIR"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def col(rows, key):
    return [r.get(key) for r in rows]


def churn(d, out):
    s = d["series"]
    t = col(s, "t")
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    a.step(t, col(s, "pods_present"), where="post", label="pods present", color="black", lw=2)
    for key, label in [
        ("filter_pods", "filter: pool state (ailb.pool.default.pods)"),
        ("status_pods", "filter: status page (a worker)"),
        ("agent_entries_max", "agent: peers held (max over agents, all statuses)"),
        ("agent_removed_max", "agent: REMOVED, not yet pruned"),
        ("envoy_endpoint_stat_pods", "Envoy: pods with per-pod stats (never pruned)"),
    ]:
        v = col(s, key)
        if any(x is not None for x in v):
            a.plot(t, v, label=label, lw=1)
    for dep in d.get("departures", []):
        a.axvline(dep["t"], color="grey", alpha=0.15, lw=0.8)
    a.set_ylabel("per-pod entries")
    a.legend(fontsize=8, loc="upper left")
    a.set_title(f"churn ({d.get('data_path')}): {d['events']}, requests {d['requests']}")
    for key, label in [("vm_memory_mib", "VM linear memory"), ("agent_rss_mib_max", "agent RSS (max)"), ("envoy_rss_mib", "Envoy RSS")]:
        v = col(s, key)
        if any(x is not None for x in v):
            b.plot(t, v, label=label)
    b.set_yscale("log")
    b.set_ylabel("MiB")
    b.set_xlabel("s")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def overload(d, out):
    s = d["series"]
    t = col(s, "t")
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    lo, hi = d["overload_window_s"]
    for ax in (a, b, c):
        ax.axvspan(lo, hi, color="red", alpha=0.06)
    for key in ["admitted", "rate_limited", "shed", "held", "held_rejected"]:
        v = col(s, key)
        rate = [0] + [max(0, (v[i] or 0) - (v[i - 1] or 0)) / max(1e-9, t[i] - t[i - 1]) for i in range(1, len(v))]
        a.plot(t, rate, label=key, lw=1)
    a.set_ylabel("per second")
    a.legend(fontsize=8)
    a.set_title(f"overload at 2x capacity ({d['capacity_rps']:.1f} req/s), shaded; recovered after {d.get('recovered_after_s')} s")
    b.plot(t, col(s, "held_depth"), label="ailb.admission.held_depth")
    b.axhline(d["max_held"], color="red", ls="--", lw=0.8, label="maxHeld")
    b.set_ylabel("held")
    b.legend(fontsize=8)
    for key, label in [("vm_memory_mib", "VM linear memory"), ("agent_rss_mib_max", "agent RSS (max)"), ("envoy_rss_mib", "Envoy RSS")]:
        c.plot(t, col(s, key), label=label)
    c.set_yscale("log")
    c.set_ylabel("MiB")
    c.set_xlabel("s")
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def pods(d, out):
    rows = d["rows"]
    n = [str(r["pods"]) for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(14, 4))
    axes[0].bar(n, [r["micro"]["state_bytes"] / 1024 for r in rows])
    axes[0].set_title("published pool state (KiB)")
    axes[1].bar(n, [r["micro"]["install_state_us"] for r in rows])
    axes[1].set_title("install state in a worker (µs, native)")
    axes[2].bar(n, [r["micro"]["pick_us"] for r in rows])
    axes[2].set_title("pick (µs, native)")
    axes[3].bar(n, [r["envoy_cpu_idle_cores_total"] for r in rows])
    axes[3].set_title("Envoy CPU, pool changes only (cores)")
    for a in axes:
        a.set_xlabel("pods")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = json.load(open(os.path.join(sys.argv[1], "report.json")))
    kind = d["soak"]
    out = os.path.join(sys.argv[1], f"{kind}.png")
    {"churn": churn, "overload": overload, "pods": pods}[kind](d, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
