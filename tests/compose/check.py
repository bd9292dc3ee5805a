#!/usr/bin/env python3
"""Checks the docker-compose stack for real, then injects faults across hosts during traffic.

Run by `scripts/compose.sh check` (which builds the images first); not meant to be run alone.

    check.py --project P --out DIR -- <compose command...>

Steps, each failing the run (exit 1) when it fails:
  1. `up -d` of the stack without its load generators; every container healthy (or running,
     for the network holders, which have no health check) within a deadline.
  2. Traffic: one load generator per client Envoy (the stack's loadgen image, `docker run` on
     the stack's network, records written to DIR).
  3. Routing by score: from each Envoy's own stats, most requests were steered by the filter (not
     fallback or fail-open) and every pod, on its own host, got requests (per-pod shares from
     Envoy's per-host counters); every agent found the other three through DNS.
  4. Faults, one after another, each measured from Envoy's per-host counters (polled every
     250 ms from both Envoys) and the load generators' records:
       agent-cut     pod-0 leaves the telemetry network (its agent's stream is cut), rejoins
       server-kill   server-1 killed (SIGKILL), started again
       server-pause  server-2 frozen (docker pause), resumed
       envoy-restart envoy-native restarted
  5. Every panel query of the shipped Grafana dashboard returns data from the stack's Prometheus.
  6. `down` leaves no container and no network of the project.
Writes DIR/faults.json and DIR/faults.md (the table docs/compose.md quotes); the load
generators' summaries and records go to DIR/raw/ (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "envoy-config" / "grafana" / "ai-lb-dashboard.json"

PODS = {  # pod -> (data address, telemetry address, server service, agent service)
    "pod-0": ("172.28.0.10", "172.29.0.10", "server-0", "agent-0"),
    "pod-1": ("172.28.0.11", "172.29.0.11", "server-1", "agent-1"),
    "pod-2": ("172.28.0.12", "172.29.0.12", "server-2", "agent-2"),
    "pod-3": ("172.28.0.13", "172.29.0.13", "server-3", "agent-3"),
}
ENVOYS = {  # service -> (data address, admin address)
    "envoy-wasm": ("172.28.0.2", "172.29.0.2"),
    "envoy-native": ("172.28.0.3", "172.29.0.3"),
}
PROMETHEUS = "172.29.0.5:9090"


def log(msg: str) -> None:
    print(f"[compose-check] {msg}", file=sys.stderr, flush=True)


class Failed(Exception):
    pass


failures: list[str] = []


def check(ok: bool, what: str) -> None:
    log(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def run(*args: str, check_rc: bool = True, capture: bool = True) -> str:
    p = subprocess.run(list(args), capture_output=capture, text=True)
    if check_rc and p.returncode != 0:
        raise Failed(f"{' '.join(args)} exited {p.returncode}: {(p.stderr or '').strip()[-2000:]}")
    return (p.stdout or "").strip()


def http_get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Stack:
    def __init__(self, compose: list[str], project: str):
        self.compose = compose
        self.project = project

    def dc(self, *args: str, capture: bool = True) -> str:
        return run(*self.compose, *args, capture=capture)

    def cid(self, service: str) -> str:
        out = self.dc("ps", "-q", service)
        if not out:
            raise Failed(f"service {service} has no container")
        return out.splitlines()[0]

    def services(self) -> list[str]:
        return self.dc("config", "--services").split()

    def network(self, name: str) -> str:
        return f"{self.project}_{name}"


def health(cid: str) -> str:
    out = run("docker", "inspect", "--format",
              "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}", cid)
    status, h = out.split()
    return h if status == "running" and h != "none" else status


def wait_healthy(stack: Stack, services: list[str], deadline_s: float) -> dict[str, str]:
    end = time.time() + deadline_s
    while True:
        states = {s: health(stack.cid(s)) for s in services}
        if all(v in ("healthy", "running") and (v == "healthy" or s.startswith("pod-"))
               for s, v in states.items()):
            return states
        if time.time() > end:
            return states
        time.sleep(1)


# ---------------------------------------------------------------------------------------------
# Envoy per-host counters, polled in the background.

HOST_LINE = re.compile(r"^inference::([0-9.]+):8000::(rq_total|rq_active|rq_error)::(\d+)$")


class Poller(threading.Thread):
    """Every 250 ms: each Envoy's per-host rq_total/rq_active of the inference cluster."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, str, dict[str, dict[str, int]]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for envoy, (_, admin) in ENVOYS.items():
                t = time.time()
                try:
                    text = http_get(f"http://{admin}:9901/clusters", timeout=1.0)
                except Exception:  # an Envoy being restarted: no sample
                    continue
                hosts: dict[str, dict[str, int]] = {}
                for line in text.splitlines():
                    m = HOST_LINE.match(line)
                    if m:
                        hosts.setdefault(m.group(1), {})[m.group(2)] = int(m.group(3))
                self.samples.append((t, envoy, hosts))
            self.stop.wait(0.25)

    def new_requests(self, addr: str) -> list[tuple[float, int]]:
        """(time, requests added since the previous sample of that Envoy) for one pod, both
        Envoys merged; a counter that went down (Envoy restarted) counts from zero."""
        last: dict[str, int] = {}
        out = []
        for t, envoy, hosts in self.samples:
            v = hosts.get(addr, {}).get("rq_total")
            if v is None:
                continue
            prev = last.get(envoy)
            last[envoy] = v
            if prev is None:
                continue
            out.append((t, v - prev if v >= prev else v))
        return out

    def active_before(self, addr: str, t: float) -> int:
        """Requests in flight on a pod (both Envoys) at the last sample before t."""
        best: dict[str, int] = {}
        for ts, envoy, hosts in self.samples:
            if ts <= t and addr in hosts:
                best[envoy] = hosts[addr].get("rq_active", 0)
        return sum(best.values())


# ---------------------------------------------------------------------------------------------
# Load generators.

def start_loadgens(stack: Stack, out: Path, duration_s: int, rate: float) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o777)  # the image's user is not root
    ids = {}
    for i, (envoy, (data, _)) in enumerate(ENVOYS.items()):
        name = f"{stack.project}-check-loadgen-{envoy}"
        run("docker", "rm", "-f", name, check_rc=False)
        for f in (out / f"{envoy}.json", out / f"{envoy}.jsonl"):
            f.unlink(missing_ok=True)
        ids[envoy] = run(
            "docker", "run", "-d", "--name", name, "--network", stack.network("ailb"),
            "-v", f"{out}:/out", "ai-lb/loadgen:dev",
            "--url", f"http://{data}:10000", "--model", "llama-3.1-8b",
            "--rate", str(rate), "--duration", f"{duration_s}s", "--seed", str(11 + i),
            "--timeout", "30s", "--json", f"/out/{envoy}.json", "--records", f"/out/{envoy}.jsonl")
    return ids


def wait_loadgens(ids: dict[str, str], out: Path, timeout_s: float) -> dict[str, tuple[dict, list]]:
    res = {}
    for envoy, cid in ids.items():
        rc = run("docker", "wait", cid, check_rc=False)
        logs = run("docker", "logs", "--tail", "30", cid, check_rc=False)
        run("docker", "rm", "-f", cid, check_rc=False)
        if rc != "0":
            raise Failed(f"load generator for {envoy} exited {rc}: {logs[-1500:]}")
        summary = json.loads((out / f"{envoy}.json").read_text())
        records = [json.loads(line) for line in (out / f"{envoy}.jsonl").read_text().splitlines()]
        res[envoy] = (summary, records)
    return res


def record_times(summary: dict, r: dict) -> tuple[float, float]:
    """(send time, end time) of a record, Unix seconds."""
    t0 = summary["started_unix_ms"] / 1000.0
    sent = t0 + r["sent_us"] / 1e6
    return sent, sent + (r.get("e2e_ms") or 0.0) / 1000.0


# ---------------------------------------------------------------------------------------------
# Envoy stats.

def envoy_stats(admin: str) -> dict[str, int]:
    out = {}
    doc = json.loads(http_get(f"http://{admin}:9901/stats?format=json", timeout=3))
    for s in doc.get("stats", []):
        if "name" in s and isinstance(s.get("value"), int):
            out[s["name"]] = s["value"]
    return out


def decisions(admin: str) -> dict[str, int]:
    """The filter's decision counters of one Envoy: steered, fallback (all reasons), fail-open.
    Both data paths use the same names (ailb.steered, ailb.fallback.<reason>, ailb.fail_open),
    prefixed wasmcustom. (wasm filter) or dynamicmodulescustom. (native module) by Envoy."""
    try:
        st = envoy_stats(admin)
    except Exception:  # an Envoy being restarted
        return {}

    def total_of(pat: str) -> int:
        rx = re.compile(r"(^|\.)ailb\." + pat)
        return sum(v for k, v in st.items() if rx.search(k))
    return {"steered": total_of(r"steered$"), "fallback": total_of(r"fallback($|\.)"),
            "fail_open": total_of(r"fail_open$")}


def routing_check(poller: Poller, window: tuple[float, float]) -> dict:
    result = {}
    for envoy, (_, admin) in ENVOYS.items():
        d = decisions(admin)
        steered, fallback, fail_open = d.get("steered", 0), d.get("fallback", 0), d.get("fail_open", 0)
        result[envoy] = d
        total = steered + fallback + fail_open
        check(total > 0 and steered / total >= 0.9,
              f"{envoy}: requests steered by the filter's scores: {steered} of {total} "
              f"(fallback {fallback}, fail-open {fail_open}); want >= 90 %")
    shares = {}
    for pod, (addr, *_rest) in PODS.items():
        shares[pod] = sum(n for t, n in poller.new_requests(addr) if window[0] <= t <= window[1])
    total = sum(shares.values())
    result["pod_requests"] = shares
    for pod, n in shares.items():
        check(n > 0, f"{pod} ({PODS[pod][0]}) got requests through the Envoys: {n} of {total}")
    return result


def peers_check() -> dict:
    """Each agent found the other pods' agents through the `ai-lb-pods` DNS alias (a headless
    Service's stand-in): its `ai_lb_agent_peers{status="live"}` counts them."""
    out = {}
    rx = re.compile(r'^ai_lb_agent_peers\{status="live"\} ([0-9.]+)$', re.M)
    for pod, (_, tele, _, _) in PODS.items():
        try:
            m = rx.search(http_get(f"http://{tele}:9091/metrics", timeout=3))
            live = int(float(m.group(1))) if m else -1
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            log(f"{pod}: agent metrics: {e}")
            live = -1
        out[pod] = live
        check(live >= len(PODS) - 1,
              f"{pod}'s agent sees {live} live peers through DNS discovery (want {len(PODS) - 1})")
    return out


# ---------------------------------------------------------------------------------------------
# Faults.

def fault_measure(poller: Poller, addr: str, t_fault: float, t_recover: float, t_end: float) -> dict:
    steps = poller.new_requests(addr)
    during = [(t, n) for t, n in steps if t_fault < t <= t_recover and n > 0]
    after = [(t, n) for t, n in steps if t_recover < t <= t_end and n > 0]
    before = [(t, n) for t, n in steps if t_fault - 10 < t <= t_fault]
    last_new = max((t for t, _ in during), default=None)
    return {
        "requests_10s_before": sum(n for _, n in before),
        "requests_during": sum(n for _, n in during),
        # Samples are 250 ms apart: a new request seen at sample t left between the previous
        # sample and t.
        # None: no new request by the first sample after the fault (at most 0.25 s).
        "s_until_no_new_requests": None if last_new is None else round(last_new - t_fault, 2),
        "stopped": last_new is None or (t_recover - last_new) >= 2.0,
        "s_until_used_again": None if not after else round(after[0][0] - t_recover, 2),
        "in_flight_at_fault": poller.active_before(addr, t_fault),
    }


def failures_between(results: dict, t0: float, t1: float) -> list[dict]:
    """Failed requests whose failure (their end) fell in [t0, t1)."""
    out = []
    for envoy, (summary, records) in results.items():
        for r in records:
            if r["outcome"] == "ok":
                continue
            sent, end = record_times(summary, r)
            if t0 <= end < t1:
                out.append({"envoy": envoy, "pod": r.get("pod"), "sent": sent, "end": end,
                            "outcome": r["outcome"], "status": r.get("status"),
                            "error": r.get("error")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--project", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("compose", nargs="+")
    a = ap.parse_args()
    smoke = os.environ.get("AI_LB_COMPOSE_SMOKE") == "1"
    hold, settle = (12, 12) if smoke else (20, 20)
    stack = Stack(a.compose, a.project)
    out = a.out
    report: dict = {"smoke": smoke}
    started = time.time()

    servers = [s for s in stack.services() if not s.startswith("loadgen") and s != "grafana"]
    log(f"up: {' '.join(servers)}")
    stack.dc("down", "--volumes", "--remove-orphans")
    try:
        stack.dc("up", "-d", *servers)
        states = wait_healthy(stack, servers, 120)
        report["health"] = states
        bad = {s: v for s, v in states.items() if v not in ("healthy", "running")
               or (v == "running" and not s.startswith("pod-"))}
        check(not bad, f"every container healthy within 120 s ({len(states)} containers)"
              + (f"; not: {bad}" if bad else ""))
        if bad:
            for s in bad:
                log(f"--- logs of {s}:\n" + stack.dc("logs", "--tail", "30", s))
            raise Failed("stack not healthy")

        poller = Poller()
        poller.start()
        warm = 25
        faults_span = 4 * (hold + settle) + 5
        duration = warm + faults_span
        rate = 6.0
        report.update({"hold_s": hold, "settle_s": settle, "rate": rate})
        t_start = time.time()
        lg = start_loadgens(stack, out / "raw", duration, rate)
        log(f"traffic: {rate} req/s per Envoy for {duration} s")
        time.sleep(warm)

        report["routing"] = routing_check(poller, (t_start + 5, time.time()))
        report["peers"] = peers_check()

        events = []

        decisions_at: dict[str, list] = {}

        def fault(name, pod_or_envoy, do, undo):
            before = {e: decisions(adm) for e, (_, adm) in ENVOYS.items()}
            t_f = time.time()
            do()
            time.sleep(hold)
            t_r = time.time()
            down = {e: decisions(adm) for e, (_, adm) in ENVOYS.items()}
            undo()
            time.sleep(settle)
            decisions_at[name] = [before, down]
            events.append((name, pod_or_envoy, t_f, t_r, time.time()))
            log(f"fault {name} on {pod_or_envoy}: {t_r - t_f:.1f} s, then {settle} s")

        tele = stack.network("ailb-telemetry")
        p0 = stack.cid("pod-0")
        fault("agent-cut", "pod-0",
              lambda: run("docker", "network", "disconnect", tele, p0),
              lambda: run("docker", "network", "connect", "--ip", PODS["pod-0"][1],
                          "--alias", "ai-lb-pods", "--alias", "pod-0", tele, p0))
        s1 = stack.cid("server-1")
        fault("server-kill", "pod-1",
              lambda: run("docker", "kill", s1),
              lambda: run("docker", "start", s1))
        s2 = stack.cid("server-2")
        fault("server-pause", "pod-2",
              lambda: run("docker", "pause", s2),
              lambda: run("docker", "unpause", s2))
        en = stack.cid("envoy-native")
        fault("envoy-restart", "envoy-native",
              lambda: run("docker", "restart", "-t", "5", en),
              lambda: None)

        results = wait_loadgens(lg, out / "raw", duration + 60)
        poller.stop.set()
        poller.join()

        rows = []
        for name, target, t_f, t_r, t_e in events:
            row = {"fault": name, "target": target, "held_s": round(t_r - t_f, 1)}
            before, down = decisions_at[name]
            # The filter's decisions while the fault was held, per Envoy (counter deltas; an
            # Envoy restarted in between counts from zero).
            row["decisions_while_down"] = {
                e: {k: (down[e].get(k, 0) - before[e].get(k, 0)
                        if down[e].get(k, 0) >= before[e].get(k, 0) else down[e].get(k, 0))
                    for k in ("steered", "fallback", "fail_open")}
                for e in ENVOYS if before.get(e) and down.get(e)}
            if target in PODS:
                m = fault_measure(poller, PODS[target][0], t_f, t_r, t_e)
                row.update(m)
                # Requests to the target per 2 s, from 10 s before the fault to the end of
                # its recovery window (the timeline behind the table's columns).
                steps = poller.new_requests(PODS[target][0])
                row["timeline_2s"] = [
                    sum(n for t, n in steps if t_f - 10 + 2 * i < t <= t_f - 8 + 2 * i)
                    for i in range(int((t_e - t_f + 10) // 2))]
                fails = failures_between(results, t_f, t_e)
                row["failed_requests"] = len(fails)
                # A failure without the serving pod's header (no answer at all) is counted
                # against the target: the check below only allows it there.
                row["failed_elsewhere"] = sum(1 for f in fails if f["pod"] not in (None, target))
                row["failed_detail"] = sorted({f"{f['pod']} {f['outcome']} {f['status']} {f['error']}"[:120]
                                               for f in fails})
            else:
                fails = failures_between(results, t_f, t_e)
                row["failed_requests"] = len(fails)
                row["failed_on_other_envoy"] = sum(1 for f in fails if f["envoy"] != target)
                # Back once a request sent after the last failed one succeeds.
                mine = [f for f in fails if f["envoy"] == target]
                last_fail = max((f["sent"] for f in mine), default=t_f)
                ok_after = [record_times(s, r)[0] for e, (s, rs) in results.items() if e == target
                            for r in rs if r["outcome"] == "ok" and record_times(s, r)[0] > last_fail]
                first_ok = min(ok_after, default=None)
                row["s_until_serving_again"] = None if first_ok is None else round(first_ok - t_f, 2)
                row["refused"] = sum(1 for f in mine if f["pod"] is None)
                row["failed_detail"] = sorted({f"{f['outcome']} {f['status']} {f['error']}"[:120] for f in fails})
            rows.append(row)
        report["faults"] = rows
        total = {e: len(rs) for e, (s, rs) in results.items()}
        ok = {e: sum(1 for r in rs if r["outcome"] == "ok") for e, (s, rs) in results.items()}
        report["requests"] = {"total": total, "ok": ok}

        for row in rows:
            if row["fault"] == "agent-cut":
                check(row["failed_requests"] == 0,
                      f"agent-cut: no request failed ({row['failed_requests']}: {row['failed_detail']})")
                # The pod's reading goes stale without its agent: it is cut (by design) and
                # must be steered to again once the agent is back.
                check(row["s_until_used_again"] is not None,
                      f"agent-cut: pod-0 used again after its agent's network is back "
                      f"({row['s_until_used_again']} s)")
            elif row["fault"] in ("server-kill", "server-pause"):
                check(row["stopped"], f"{row['fault']}: new requests to {row['target']} stopped while it was down "
                      f"(last new one {row['s_until_no_new_requests']} s after the fault)")
                allowed = row["in_flight_at_fault"] + row["requests_during"]
                check(row["failed_elsewhere"] == 0 and row["failed_requests"] <= allowed,
                      f"{row['fault']}: failed requests {row['failed_requests']} (elsewhere "
                      f"{row['failed_elsewhere']}) <= in flight on {row['target']} at the fault "
                      f"({row['in_flight_at_fault']}) + sent to it before it was excluded "
                      f"({row['requests_during']})")
                check(row["s_until_used_again"] is not None,
                      f"{row['fault']}: {row['target']} used again after recovery "
                      f"({row['s_until_used_again']} s)")
            elif row["fault"] == "envoy-restart":
                check(row["failed_on_other_envoy"] == 0,
                      f"envoy-restart: no failure through the other Envoy ({row['failed_on_other_envoy']})")
                check(row["s_until_serving_again"] is not None,
                      f"envoy-restart: {row['target']} serving again ({row['s_until_serving_again']} s)")

        report["dashboard"] = dashboard_check()
        write_report(out, report)
    finally:
        if os.environ.get("AI_LB_COMPOSE_KEEP") != "1":
            stack.dc("down", "--volumes", "--remove-orphans")
            left = run("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={a.project}")
            nets = run("docker", "network", "ls", "-q", "--filter", f"label=com.docker.compose.project={a.project}")
            check(not left and not nets, f"down left no container ({len(left.split())}) and no network "
                  f"({len(nets.split())}) of project {a.project}")
    log(f"done in {time.time() - started:.0f} s; {len(failures)} failed check(s)")
    for f in failures:
        log(f"FAILED: {f}")
    return 1 if failures else 0


def dashboard_check() -> dict:
    dash = json.loads(DASHBOARD.read_text())
    results = {}
    for panel in dash.get("panels", []):
        for t in panel.get("targets", []):
            expr = t.get("expr")
            if not expr:
                continue
            q = expr.replace("$cluster", ".*").replace("$__rate_interval", "1m")
            url = f"http://{PROMETHEUS}/api/v1/query?" + urllib.parse.urlencode({"query": q})
            try:
                doc = json.loads(http_get(url, timeout=5))
                n = len(doc.get("data", {}).get("result", []))
            except Exception as e:  # noqa: BLE001 - reported as a failed check
                n = -1
                log(f"query failed: {q}: {e}")
            results[f"{panel.get('title')}: {expr}"] = n
            check(n > 0, f"dashboard panel '{panel.get('title')}' query returns data ({n} series): {expr}")
    return results


def write_report(out: Path, report: dict) -> None:
    (out / "faults.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "| fault | target | held (s) | requests to the target: 10 s before / while down | "
        "s until no new request | in flight at the fault | failed requests (elsewhere) | "
        "s until used again | filter decisions while down: steered / fallback |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def dec(r: dict) -> str:
        d = r.get("decisions_while_down", {})
        return (f"{sum(v['steered'] for v in d.values())} / "
                f"{sum(v['fallback'] + v['fail_open'] for v in d.values())}")
    for r in report["faults"]:
        if r["target"] in PODS:
            if r["s_until_no_new_requests"] is None:
                stop = "≤ 0.25 (none seen)"
            else:
                stop = str(r["s_until_no_new_requests"])
            lines.append(
                f"| {r['fault']} | {r['target']} | {r['held_s']} | {r['requests_10s_before']} / "
                f"{r['requests_during']} | {stop} | {r['in_flight_at_fault']} | "
                f"{r['failed_requests']} ({r['failed_elsewhere']}) | "
                f"{r['s_until_used_again']} | {dec(r)} |")
        else:
            lines.append(
                f"| {r['fault']} | {r['target']} | restart | – | – | – | {r['failed_requests']}: "
                f"{r['failed_requests'] - r['refused']} in flight, {r['refused']} refused "
                f"(other Envoy: {r['failed_on_other_envoy']}) | serving again "
                f"{r['s_until_serving_again']} s after the restart began | {dec(r)} |")
    lines.append("")
    lines.append(f"Requests: {report['requests']}; fault windows {report['hold_s']} s down, "
                 f"{report['settle_s']} s after; traffic {report['rate']} req/s per Envoy; "
                 f"Envoy's per-host counters polled every 250 ms.")
    (out / "faults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failed as e:
        log(f"FAILED: {e}")
        for f in failures:
            log(f"FAILED: {f}")
        sys.exit(1)
