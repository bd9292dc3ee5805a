"""Plots for bench-results/: latency CDFs per policy (TTFT and e2e) with the no-queue TTFT
floor, for fault runs the faulty pod's share of requests over time, for the prefix-cache
workloads (shared-prefix, multi-turn) each policy's TTFT distribution against the floor (first
and later turns apart for multi-turn) and its prefix-cache hit rate, and for the freshness
sweep p99 TTFT and change-to-routing latency against the agents' sample interval, and the three
overhead figures (overhead/figures.png, from overhead/{stream,epp,rps}/summary.json). Reads the
merged per-request records the benchmark leaves in its work dir (<work>/<scenario>/<policy>.jsonl,
<work>/<scenario>/floor.jsonl) and the summaries in <out>.
Usage: plot.py WORK_DIR OUT_DIR"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

POLICIES = ["round_robin", "least_request", "ai_lb"]


def load(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def cdf(ax, values, label):
    v = sorted(values)
    if not v:
        return
    n = len(v)
    ax.plot(v, [(i + 1) / n for i in range(n)], label=label)


def load_floor(wdir):
    """Per-request no-queue floor (ms) by id, if the run wrote it."""
    f = os.path.join(wdir, "floor.jsonl")
    if not os.path.isfile(f):
        return {}
    return {r["id"]: r["floor_ms"] for r in load(f)}


def ttft_of(r, timeout):
    if r["outcome"] == "ok" and r.get("ttft_ms") is not None:
        return r["ttft_ms"]
    return timeout


def prefix_plots(scen, s, recs, floor, sdir, timeout):
    """TTFT CDFs per policy against the floor (per turn class for multi-turn), and each
    policy's prefix-cache hit rate from the pods' counters (n/a drawn as a note, never 0)."""
    classes = [("all", lambda r: True)]
    if s.get("workload") == "MultiTurn":
        classes += [("first turns", lambda r: (r.get("turn") or 1) == 1),
                    ("later turns", lambda r: (r.get("turn") or 1) > 1)]
    fig, axes = plt.subplots(1, len(classes) + 1, figsize=(5.5 * (len(classes) + 1), 4))
    for ax, (label, keep) in zip(axes, classes):
        ids = set()
        for p, rs in recs.items():
            sel = [r for r in rs if keep(r) and r["outcome"] in ("ok", "timeout")]
            ids.update(r["id"] for r in sel)
            cdf(ax, [ttft_of(r, timeout) for r in sel], p)
        cdf(ax, [floor[i] for i in ids if i in floor], "no-queue floor")
        ax.set_xscale("log")
        ax.set_xlabel(f"TTFT (ms), {label}")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    ax = axes[-1]
    names, rates, notes = [], [], []
    for p in s["policies"]:
        c = p.get("prefix_cache")
        names.append(p["policy"])
        if isinstance(c, dict) and c.get("hit_rate") is not None:
            rates.append(100.0 * c["hit_rate"])
            notes.append(f"{100.0 * c['hit_rate']:.1f} %")
        else:
            rates.append(0.0)
            notes.append("n/a")
    bars = ax.bar(names, rates)
    for b, n in zip(bars, notes):
        ax.annotate(n, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom")
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{scen}: TTFT against the no-queue floor; prefix-cache hit rate per policy")
    fig.tight_layout()
    fig.savefig(os.path.join(sdir, "prefix.png"), dpi=80)
    plt.close(fig)


def freshness(s, sdir):
    """p99 TTFT and change-to-routing latency (GPU and queue changes) against the agents'
    sample interval; the sweep's points (both samples at the interval) as lines, the shipped
    defaults (and the defaults under load) as single markers."""
    pts = s["points"]
    sweep = sorted(
        (p for p in pts if p.get("gpu_sample_interval_ms") == p["sample_interval_ms"]),
        key=lambda p: p["sample_interval_ms"],
    )
    others = [p for p in pts if p not in sweep]
    xs = [p["sample_interval_ms"] for p in sweep]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(xs, [p["ai_lb"]["ttft_ms"]["p99"] for p in sweep], marker="o", label="ai_lb")
    for p in others:
        axes[0].plot([p["sample_interval_ms"]], [p["ai_lb"]["ttft_ms"]["p99"]], "s",
                     label=f"ai_lb, {p['label']}")
    lr = (s.get("least_request") or {}).get("ttft_ms", {}).get("p99")
    if lr is not None:
        axes[0].axhline(lr, color="k", linestyle="--", label="least_request (same trace)")
    axes[0].set_ylabel("p99 TTFT (ms)")
    kinds = [("gpu", "pod forced to 99 % GPU"), ("queue", "pod's queue forced full")]
    for kind, what in kinds:
        axes[1].plot(xs, [p["reaction"][kind]["cut_ms"]["p99"] for p in sweep], marker="o",
                     label=f"{what} -> every sidecar shows it cut")
    loaded = [s["under_load"]] if s.get("under_load") else []
    for p in others + loaded:
        for kind, _ in kinds:
            axes[1].plot([p["sample_interval_ms"]], [p["reaction"][kind]["cut_ms"]["p99"]], "s",
                         label=f"{kind}, {p['label']}")
    axes[1].set_ylabel("change -> routing change, p99 (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("agent sample interval (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"freshness sweep ({s['trace']}, {s['sidecars']} sidecars)")
    fig.tight_layout()
    fig.savefig(os.path.join(sdir, "freshness.png"), dpi=80)
    plt.close(fig)
    print("plots written for freshness")


# A summary is written when its run's records are complete; records written after it, or long
# before it, are another run's (the work dir keeps the latest run of each scenario name, whatever
# its pool or --out, so a later run on another pool or a copied summary must not be replotted
# with them).
RUN_GAP_S = 600


def records_match(summ, wdir):
    recs = [os.path.join(wdir, f) for f in os.listdir(wdir) if f.endswith(".jsonl")]
    if not recs:
        return False
    t_summ = os.path.getmtime(summ)
    t_recs = max(os.path.getmtime(f) for f in recs)
    return t_recs <= t_summ + 1 and t_summ - t_recs <= RUN_GAP_S


def main(work, out):
    for scen in sorted(os.listdir(out)):
        sdir = os.path.join(out, scen)
        summ = os.path.join(sdir, "summary.json")
        wdir = os.path.join(work, scen)
        if not os.path.isfile(summ) or not os.path.isdir(wdir):
            continue
        if not records_match(summ, wdir):
            print(f"no plots for {scen}: the records in {wdir} are another run's")
            continue
        s = json.load(open(summ))
        if "points" in s:
            freshness(s, sdir)
            continue
        if "policies" not in s:
            continue
        timeout = s["client_timeout_s"] * 1000.0
        recs = {}
        for p in [p["policy"] for p in s["policies"]] or POLICIES:
            f = os.path.join(wdir, p + ".jsonl")
            if os.path.isfile(f):
                recs[p] = load(f)
        if not recs:
            continue
        floor = load_floor(wdir)
        tags = ["all"] + (["short"] if s.get("workload") == "Hol" else [])
        for tag in tags:
            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            for p, rs in recs.items():
                sel = [r for r in rs if tag == "all" or r["tag"] == tag]
                sel = [r for r in sel if r["outcome"] in ("ok", "timeout")]
                ttft = [r["ttft_ms"] if r.get("ttft_ms") is not None and r["outcome"] == "ok" else timeout for r in sel]
                e2e = [r["e2e_ms"] if r["outcome"] == "ok" and r.get("e2e_ms") is not None else timeout for r in sel]
                cdf(axes[0], ttft, p)
                cdf(axes[1], e2e, p)
            if floor:
                ids = {r["id"] for rs in recs.values() for r in rs
                       if (tag == "all" or r["tag"] == tag) and r["outcome"] in ("ok", "timeout")}
                cdf(axes[0], [floor[i] for i in ids if i in floor], "no-queue floor")
            for ax, name in zip(axes, ["TTFT (ms)", "e2e (ms)"]):
                ax.set_xscale("log")
                ax.set_xlabel(name)
                ax.set_ylabel("fraction of requests")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend()
            fig.suptitle(f"{scen}: latency CDF ({tag} requests; timeouts at {timeout:.0f} ms)")
            fig.tight_layout()
            fig.savefig(os.path.join(sdir, f"cdf_{tag}.png"), dpi=80)
            plt.close(fig)
        if s.get("workload") in ("SharedPrefix", "MultiTurn"):
            prefix_plots(scen, s, recs, floor, sdir, timeout)
        faults = [p for p in s["policies"] if p.get("fault")]
        if faults:
            fig, ax = plt.subplots(figsize=(9, 4))
            for p in faults:
                series = p["fault"]["share_per_250ms"]
                xs = [i * 0.25 for i in range(len(series))]
                ax.plot(xs, [v if v is not None else float("nan") for v in series], label=p["policy"])
            t = faults[0]["fault"]["fault_at_ms"] / 1000.0
            ax.axvline(t, color="k", linestyle="--", label="fault")
            ax.set_xlabel("send time (s)")
            ax.set_ylabel(f"share to {faults[0]['fault']['pod']} (250 ms windows)")
            ax.legend()
            ax.grid(True, alpha=0.3)
            fig.suptitle(f"{scen}: share of new requests reaching the faulty pod")
            fig.tight_layout()
            fig.savefig(os.path.join(sdir, "share_over_time.png"), dpi=80)
            plt.close(fig)
            opened = [p for p in faults if (p["fault"].get("attempts") or {}).get("openings_over_time")]
            if opened:
                # Breaker openings over time (fault-noisy: before the fault they are false trips),
                # and when each sidecar first showed the faulty pod cut.
                fig, ax = plt.subplots(figsize=(9, 4))
                for p in opened:
                    pts = p["fault"]["attempts"]["openings_over_time"]
                    line, = ax.step([x for x, _ in pts], [y for _, y in pts], where="post", label=p["policy"])
                    for c in p["fault"].get("sidecar_cut_ms_after_fault") or []:
                        if c is not None:
                            ax.axvline(t + c / 1000.0, color=line.get_color(), alpha=0.4, linewidth=1)
                ax.axvline(t, color="k", linestyle="--", label="fault")
                ax.set_xlabel("time since the first request (s)")
                ax.set_ylabel("breaker openings, all sidecars")
                ax.legend()
                ax.grid(True, alpha=0.3)
                fig.suptitle(f"{scen}: breaker openings (thin lines: each sidecar's cut of {faults[0]['fault']['pod']})")
                fig.tight_layout()
                fig.savefig(os.path.join(sdir, "openings_over_time.png"), dpi=80)
                plt.close(fig)
        print(f"plots written for {scen}")


def overhead_figures(out):
    """The three overhead figures (overhead-stream, -epp, -rps) in one picture,
    <out>/overhead/figures.png, from their summaries: each build's per-round CPU efficiency on
    streamed answers against its goal and floor; the latency each side adds over plain Envoy and
    its CPU per request (the picker's stacked on epp's Envoy); each build's per-round req/s
    against plain's on the trivial upstream."""
    base = os.path.join(out, "overhead")
    summ = {}
    for name in ("stream", "epp", "rps"):
        f = os.path.join(base, name, "summary.json")
        if os.path.isfile(f):
            summ[name] = json.load(open(f))
    if not summ:
        return
    fig, axes = plt.subplots(1, 4, figsize=(24, 4.8), gridspec_kw={"width_ratios": [1, 1.8, 1, 1]})

    def per_round(ax, builds, get, goals, title, ylabel):
        for i, b in enumerate(builds):
            sp = get(b)
            if not sp:
                continue
            vals = [v for v in sp["values"] if v is not None]
            ax.scatter([i] * len(vals), vals, alpha=0.6)
            ax.hlines(sp["median"], i - 0.3, i + 0.3, color="k")
            for g, style in zip(goals.get(b, ()), ("--", ":")):
                ax.hlines(g, i - 0.4, i + 0.4, color="g" if style == "--" else "r", linestyle=style)
        ax.set_xticks(range(len(builds)))
        ax.set_xticklabels(builds)
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)

    s = summ.get("stream")
    if s:
        builds = [b for b in s["sides"] if b != "least_request"]
        per_round(axes[0], builds, lambda b: s["efficiency"][b]["per_round"],
                  {"ai_lb_native": (0.97, 0.95), "ai_lb": (0.9, 0.85)},
                  f"1. streamed answers at {s['rate_rps']:.0f} req/s:\nCPU efficiency plain / build per round\n(line: median; green goal, red floor)",
                  "plain CPU per request / build's")
    e = summ.get("epp")
    if e:
        sides = [x for x in e["sides"] if x != "least_request"]
        measures = ["ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"]
        phases = [(e, f"{e['rate_rps']:.0f}/s")]
        if e.get("low_rate"):
            phases.append((e["low_rate"], f"{e['low_rate']['rate_rps']:.0f}/s"))
        groups = [(ph, m, f"{m}\n@{label}") for ph, label in phases for m in measures]
        w = 0.8 / len(sides)
        for j, side in enumerate(sides):
            vals = [((ph["added_us"].get(side) or {}).get(m) or {}).get("median") or 0.0 for ph, m, _ in groups]
            axes[1].bar([i + j * w for i in range(len(groups))], vals, w, label=side)
        axes[1].set_xticks([i + 0.4 - w / 2 for i in range(len(groups))])
        axes[1].set_xticklabels([g[2] for g in groups], fontsize="x-small")
        axes[1].set_yscale("symlog", linthresh=100)
        axes[1].set_ylabel("added over plain Envoy, µs (median of rounds)")
        axes[1].set_title("2. against the endpoint picker:\nadded latency at half and a tenth of the lowest max", fontsize="medium")
        axes[1].legend(fontsize="small")
        axes[1].grid(True, axis="y", alpha=0.3)
        names = e["sides"]
        envoy = [e["envoy_cpu_us_per_request_median"].get(x) or 0.0 for x in names]
        picker = [e["picker_cpu_us_per_request_median"].get(x) or 0.0 for x in names]
        axes[2].bar(names, envoy, label="Envoy")
        axes[2].bar(names, picker, bottom=envoy, label="picker process")
        axes[2].set_ylabel("CPU per answered request, µs (median of rounds)")
        axes[2].set_title("2. CPU per request, picker counted", fontsize="medium")
        axes[2].legend(fontsize="small")
        axes[2].grid(True, axis="y", alpha=0.3)
    r = summ.get("rps")
    if r:
        builds = [b for b in r["sides"] if b != "least_request"]
        per_round(axes[3], builds, lambda b: r["vs_least_request"][b]["rps_ratio"],
                  {"ai_lb_native": (0.9,), "ai_lb": (0.7,)},
                  "3. trivial upstream, closed loop:\nreq/s / plain's per round (green: goal)",
                  "build req/s / plain req/s")
    fig.tight_layout()
    fig.savefig(os.path.join(base, "figures.png"), dpi=80)
    plt.close(fig)
    print("plots written for overhead figures")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    overhead_figures(sys.argv[2])
