//! The overload soak: twice the pool's measured capacity, in bursts, for 10 minutes, through
//! a real Envoy with the wasm filter's admission on. Two tenants each send the pool's whole
//! capacity (gamma arrivals, CV 3): `t1` standard requests, `t2` sheddable ones, each tenant's
//! bucket refilling at 0.75 of the pool's capacity in its own cost. Checked: every tenant's
//! admitted cost stays within its bucket (`tokensPerSecond` x time + `burst`), the held queue
//! stays within `saturation.maxHeld` and does not grow, Envoy's, the VM's and the agents'
//! memory stay flat, no request fails other than by a 429 or 503 of admission; reported: the
//! time after the overload until latency is back to the pre-overload baseline.
//!
//! Phases: capacity (closed loop of 2 x seats, tenant `calib` with an unbounded bucket), then
//! baseline (half the capacity, `t1`), overload, recovery (half the capacity again).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use ai_lb_e2e::envoy::{Envoy, EnvoyOptions, Error, PodPool};
use ai_lb_loadgen::stats::{Outcome, Record};

use super::{mib, quantile, rss_kib, spawn_loadgen, Loadgen, Report, SoakCli};

const PODS: usize = 2;
const SEATS: u32 = 4;
const TIME_SCALE: f64 = 3.0;
const MAX_HELD: u64 = 64;
/// Share of the pool's capacity each tenant's bucket refills at.
const BUCKET_SHARE: f64 = 0.75;
const PREFIX: &str = "wasmcustom.ailb.admission.";

fn admission_config(tokens_per_s: u64, burst: u64) -> String {
    json!({
        "pools": [{"name": "default", "cluster": "inference", "agentCluster": "ai_lb_agents"}],
        "minPods": 1,
        "watch": {"refreshMs": 20, "minIntervalMs": 50, "heartbeatMs": 300,
                  "reconnectBaseMs": 100, "reconnectMaxMs": 1000},
        "admission": {
            "tenantKey": ["header:x-tenant-id"],
            "trustedHeaders": ["x-tenant-id", "x-ai-lb-priority"],
            "tenants": {
                "default": {"tokensPerSecond": tokens_per_s, "burst": burst},
                "calib": {"tokensPerSecond": 100_000_000u64, "burst": 100_000_000u64}
            },
            "saturation": {"maxHeld": MAX_HELD, "maxWaitStandardMs": 2000}
        }
    })
    .to_string()
}

fn load_args(
    rate: f64,
    secs: f64,
    seed: u64,
    tenant: &str,
    class: &str,
    bursty: bool,
) -> Vec<String> {
    let mut v: Vec<String> = [
        "--rate",
        &format!("{rate:.3}"),
        "--duration",
        &format!("{secs}s"),
        "--workload",
        "fixed",
        "--prompt-tokens",
        "64",
        "--output-tokens",
        "16",
        "--timeout",
        "60s",
        "--seed",
        &seed.to_string(),
        "--header",
        &format!("x-tenant-id: {tenant}"),
        "--header",
        &format!("x-ai-lb-priority: {class}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if bursty {
        v.extend(["--arrival", "gamma", "--cv", "3"].map(String::from));
    }
    v
}

/// The admission counters of `tenant` and `class` (`admitted`, `tokens_reserved`, ...).
fn tenant_stat(s: &BTreeMap<String, u64>, tenant: &str, class: &str, name: &str) -> u64 {
    super::stat(s, &format!("{PREFIX}tenant.{tenant}.{class}.{name}"))
}

/// Net cost admitted for a tenant: reserved + charged beyond reservations - refunded.
fn net_cost(s: &BTreeMap<String, u64>, tenant: &str, class: &str) -> i64 {
    tenant_stat(s, tenant, class, "tokens_reserved") as i64
        + tenant_stat(s, tenant, class, "tokens_charged") as i64
        - tenant_stat(s, tenant, class, "tokens_refunded") as i64
}

/// Runs `loadgens` to the end while sampling every second into `series`.
#[allow(clippy::too_many_arguments)]
fn sample_while(
    loadgens: Vec<Loadgen>,
    phase: &str,
    limit: Duration,
    t0: Instant,
    envoy: &Envoy,
    pool: &PodPool,
    series: &mut Vec<Value>,
) -> Result<Vec<Record>, Error> {
    let end = Instant::now() + limit;
    let mut next = Instant::now();
    let mut lgs = loadgens;
    loop {
        let running = lgs
            .iter_mut()
            .any(|l| matches!(l.child.try_wait(), Ok(None)));
        if !running || Instant::now() > end {
            break;
        }
        if Instant::now() >= next {
            next += Duration::from_secs(1);
            let s = envoy.stats().unwrap_or_default();
            let agent_rss = pool
                .agents
                .iter()
                .flatten()
                .filter_map(|a| rss_kib(a.pid()))
                .max()
                .unwrap_or(0);
            let sum = |name: &str| -> u64 {
                s.iter()
                    .filter(|(k, _)| {
                        k.starts_with(&format!("{PREFIX}tenant."))
                            && k.ends_with(&format!(".{name}"))
                    })
                    .map(|(_, v)| *v)
                    .sum()
            };
            series.push(json!({
                "t": (t0.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
                "phase": phase,
                "envoy_rss_mib": mib(rss_kib(envoy.pid()).unwrap_or(0)),
                "vm_memory_mib": s.get("wasmcustom.ailb.vm_memory_bytes").map(|b| mib(b / 1024)),
                "agent_rss_mib_max": mib(agent_rss),
                "held_depth": super::stat(&s, &format!("{PREFIX}held_depth")),
                "admitted": sum("admitted"),
                "rate_limited": sum("rate_limited"),
                "shed": sum("shed"),
                "held": sum("held"),
                "held_rejected": sum("held_rejected"),
            }));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut all = Vec::new();
    for l in lgs {
        all.extend(l.finish(Duration::from_secs(120))?);
    }
    Ok(all)
}

/// TTFT quantile `q` (ms) of the OK records sent in [from, to) seconds of their run.
fn ttft_q(records: &[Record], from: f64, to: f64, q: f64) -> Option<f64> {
    let mut v: Vec<f64> = records
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Ok))
        .filter(|r| {
            let t = r.sent_us as f64 / 1e6;
            t >= from && t < to
        })
        .filter_map(|r| r.ttft_ms)
        .collect();
    quantile(&mut v, q)
}

pub fn run(cli: &SoakCli, work: &Path) -> Result<Report, Error> {
    let secs = cli.secs.unwrap_or(if cli.short { 30.0 } else { 600.0 });
    let (cal_s, base_s, rec_s) = if cli.short {
        (6.0, 8.0, 15.0)
    } else {
        (15.0, 30.0, 60.0)
    };
    let pool = PodPool::start_with_agents(
        PODS,
        TIME_SCALE,
        |_| vec!["--max-num-seqs".into(), SEATS.to_string()],
        |_| Vec::new(),
    )?;
    // The bucket is set once the capacity and the cost of a request are known: start with
    // the calibration tenant only, then restart Envoy with the real bucket.
    let mk = |cfg: String| {
        let mut o = EnvoyOptions::new(cfg);
        o.inference = pool.pod_addrs.clone();
        o.agents = pool.agent_addrs.clone();
        Envoy::start(&o)
    };
    let envoy = mk(admission_config(1, 1))?;
    envoy.poll(Duration::from_secs(30), "the agents' data", || {
        (envoy.stat("wasmcustom.ailb.pool_events").unwrap_or(0) > 0).then_some(())
    })?;
    // Capacity: a closed loop with twice the pool's seats busy.
    let workers = (2 * SEATS as usize * PODS).to_string();
    let mut args = load_args(1000.0, cal_s, cli.seed, "calib", "critical", false);
    args.extend(["--closed-loop".to_string(), workers]);
    let cal =
        spawn_loadgen(envoy.listener, &args, work, "capacity")?.finish(Duration::from_secs(120))?;
    let cal_ok = cal
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Ok))
        .count();
    let capacity = cal_ok as f64 / cal_s;
    let s = envoy.stats()?;
    let cost = tenant_stat(&s, "calib", "critical", "tokens_reserved") as f64
        / tenant_stat(&s, "calib", "critical", "admitted").max(1) as f64;
    drop(envoy);
    if capacity <= 0.5 || cost <= 0.0 {
        return Err(format!(
            "capacity run: {cal_ok} answered in {cal_s} s (cost {cost}): nothing to soak"
        ));
    }
    let tps = (BUCKET_SHARE * capacity * cost).round() as u64;
    let burst = (cost * 2.0 * SEATS as f64).round() as u64;
    eprintln!(
        "[soak] overload: capacity {capacity:.1} req/s, {cost:.0} weighted tokens a request; \
         buckets {tps} tokens/s, burst {burst}; {secs} s at 2x"
    );
    let envoy = mk(admission_config(tps, burst))?;
    envoy.poll(Duration::from_secs(30), "the agents' data", || {
        (envoy.stat("wasmcustom.ailb.pool_events").unwrap_or(0) > 0).then_some(())
    })?;
    let t0 = Instant::now();
    let mut series = Vec::new();
    let half = 0.5 * capacity;
    let base = sample_while(
        vec![spawn_loadgen(
            envoy.listener,
            &load_args(half, base_s, cli.seed, "t0", "standard", false),
            work,
            "baseline",
        )?],
        "baseline",
        Duration::from_secs_f64(base_s + 120.0),
        t0,
        &envoy,
        &pool,
        &mut series,
    )?;
    let before = envoy.stats()?;
    let over_start = t0.elapsed().as_secs_f64();
    let over = sample_while(
        vec![
            spawn_loadgen(
                envoy.listener,
                &load_args(capacity, secs, cli.seed + 1, "t1", "standard", true),
                work,
                "overload-t1",
            )?,
            spawn_loadgen(
                envoy.listener,
                &load_args(capacity, secs, cli.seed + 2, "t2", "sheddable", true),
                work,
                "overload-t2",
            )?,
        ],
        "overload",
        Duration::from_secs_f64(secs + 180.0),
        t0,
        &envoy,
        &pool,
        &mut series,
    )?;
    let over_end = t0.elapsed().as_secs_f64();
    let rec = sample_while(
        vec![spawn_loadgen(
            envoy.listener,
            &load_args(half, rec_s, cli.seed + 3, "t0", "standard", false),
            work,
            "recovery",
        )?],
        "recovery",
        Duration::from_secs_f64(rec_s + 120.0),
        t0,
        &envoy,
        &pool,
        &mut series,
    )?;
    let after = envoy.stats()?;
    let elapsed_over = (over_end - over_start).max(secs);

    let mut report = Report::default();
    // The limiter: each tenant's admitted cost within its bucket over the overload (the
    // settlements of its last requests included: read after the recovery phase).
    let mut tenants = Vec::new();
    for (tenant, class) in [("t1", "standard"), ("t2", "sheddable")] {
        let admitted_cost = net_cost(&after, tenant, class) - net_cost(&before, tenant, class);
        let bound = (tps as f64 * elapsed_over) as i64 + burst as i64;
        let g = |n: &str| {
            tenant_stat(&after, tenant, class, n) - tenant_stat(&before, tenant, class, n)
        };
        report.check(
            admitted_cost <= bound,
            format!(
                "tenant {tenant}: admitted {admitted_cost} weighted tokens > bucket bound {bound}"
            ),
        );
        tenants.push(json!({
            "tenant": tenant, "class": class, "admitted_cost": admitted_cost, "bound": bound,
            "share_of_bound": admitted_cost as f64 / bound as f64,
            "admitted": g("admitted"), "rate_limited": g("rate_limited"), "shed": g("shed"),
            "held": g("held"), "held_rejected": g("held_rejected"),
        }));
    }
    // Every answer is a pod's 200 or admission's 429/503; nothing else (no reset, no timeout).
    let mut by_status: BTreeMap<String, u64> = BTreeMap::new();
    let mut lost = Vec::new();
    for r in base.iter().chain(&over).chain(&rec) {
        let k = match (&r.outcome, r.status) {
            (Outcome::Ok, _) => "200".to_string(),
            (_, Some(s)) => s.to_string(),
            (o, None) => format!("{o:?}"),
        };
        if !matches!(k.as_str(), "200" | "429" | "503") && lost.len() < 5 {
            lost.push(format!("{k}: {:?}", r.error));
        }
        *by_status.entry(k).or_insert(0) += 1;
    }
    let other: u64 = by_status
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "200" | "429" | "503"))
        .map(|(_, v)| v)
        .sum();
    report.check(
        other == 0,
        format!("{other} requests ended otherwise than 200/429/503: {lost:?}"),
    );
    let served_over = over
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Ok))
        .count() as f64;
    report.check(served_over > 0.0, "no request served during the overload");
    // Held requests: within maxHeld, no growth over the overload.
    let over_rows: Vec<&Value> = series.iter().filter(|r| r["phase"] == "overload").collect();
    let held_max = over_rows
        .iter()
        .filter_map(|r| r["held_depth"].as_u64())
        .max()
        .unwrap_or(0);
    report.check(
        held_max <= MAX_HELD,
        format!("held_depth reached {held_max} > maxHeld {MAX_HELD}"),
    );
    // Memory flat: the overload's second half within a slack of its first half.
    let mid = over_start + (over_end - over_start) / 2.0;
    for (key, slack) in [
        ("envoy_rss_mib", 32.0),
        ("vm_memory_mib", 8.0),
        ("agent_rss_mib_max", 16.0),
    ] {
        let a = super::max_in(&series, key, over_start, mid);
        let b = super::max_in(&series, key, mid, over_end + 1.0);
        if let (Some(a), Some(b)) = (a, b) {
            report.check(
                b <= a + slack,
                format!("{key} grew from {a} to {b} MiB during the overload (slack {slack})"),
            );
        }
    }
    if envoy.wasm_failed() {
        report.check(false, "the wasm VM trapped or panicked (see the Envoy log)");
    }
    // Recovery: the first 2 s window of the recovery phase whose p90 TTFT is within 1.5x the
    // baseline's p90 (+5 ms); the later windows above it are counted (on a shared machine a
    // window can be slowed by anything else running).
    let base_p90 = ttft_q(&base, 0.0, base_s, 0.9);
    let mut recovered_at = None;
    let mut later_over = 0;
    if let Some(b) = base_p90 {
        let ok_at = |w: f64| ttft_q(&rec, w, w + 2.0, 0.9).is_none_or(|p| p <= 1.5 * b + 5.0);
        let windows: Vec<f64> = (0..(rec_s / 2.0) as usize)
            .map(|i| i as f64 * 2.0)
            .collect();
        recovered_at = windows.iter().copied().find(|&w| ok_at(w));
        if let Some(r) = recovered_at {
            later_over = windows.iter().filter(|&&w| w > r && !ok_at(w)).count();
        }
    }
    let rec_windows: Vec<Value> = (0..(rec_s / 2.0) as usize)
        .map(|i| {
            let w = i as f64 * 2.0;
            json!({"from_s": w, "p50_ttft_ms": ttft_q(&rec, w, w + 2.0, 0.5), "p90_ttft_ms": ttft_q(&rec, w, w + 2.0, 0.9)})
        })
        .collect();

    let fmtf = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.1}"));
    let mut body = format!(
        "Real Envoy 1.40 (`--concurrency 2`) with the wasm filter and admission on; {PODS} fake pods \
         (`--max-num-seqs {SEATS} --time-scale {TIME_SCALE}`) with their agents; fixed requests (64-token \
         prompt, 16-token answer, streamed). Measured capacity: **{capacity:.1} req/s** (closed loop, \
         {cal_s} s), **{cost:.0}** weighted tokens a request. Each tenant's bucket: {tps} tokens/s \
         ({BUCKET_SHARE} of capacity), burst {burst}; `saturation.maxHeld` {MAX_HELD}, `maxWaitStandardMs` 2000. \
         Phases: baseline {base_s} s at {half:.1} req/s (tenant t0, standard); overload {secs} s at \
         **2x capacity** ({:.1} req/s), gamma arrivals CV 3 (bursts), tenant t1 standard + tenant t2 \
         sheddable, each at capacity; recovery {rec_s} s at {half:.1} req/s.\n\n",
        2.0 * capacity
    );
    body.push_str("| tenant (overload) | passed its bucket | 429 bucket | 429 shed | held | 503 after hold | cost charged to its bucket / bound |\n|---|---|---|---|---|---|---|\n");
    for t in &tenants {
        body.push_str(&format!(
            "| {} ({}) | {} | {} | {} | {} | {} | {} / {} ({:.1} %) |\n",
            t["tenant"].as_str().unwrap_or(""),
            t["class"].as_str().unwrap_or(""),
            t["admitted"],
            t["rate_limited"],
            t["shed"],
            t["held"],
            t["held_rejected"],
            t["admitted_cost"],
            t["bound"],
            100.0 * t["share_of_bound"].as_f64().unwrap_or(0.0)
        ));
    }
    body.push_str(&format!(
        "\nAnswers, all phases: {}.\n\n",
        by_status
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    body.push_str("| during the overload | first half max | second half max |\n|---|---|---|\n");
    for (label, key) in [
        ("Envoy RSS, MiB", "envoy_rss_mib"),
        ("VM memory, MiB", "vm_memory_mib"),
        ("agent RSS, MiB (largest)", "agent_rss_mib_max"),
        ("held requests (`ailb.admission.held_depth`)", "held_depth"),
    ] {
        body.push_str(&format!(
            "| {label} | {} | {} |\n",
            fmtf(super::max_in(&series, key, over_start, mid)),
            fmtf(super::max_in(&series, key, mid, over_end + 1.0))
        ));
    }
    body.push_str(&format!(
        "\nLatency (TTFT, ms): baseline p50 {} / p90 {}; overload p50 {} / p90 {} (admitted requests). \
         Recovery: p90 TTFT back within 1.5x the baseline's p90 (+5 ms) in the 2 s window starting \
         **{}** after the overload ended; {later_over} later window(s) of the recovery phase above it \
         (windows in report.json). Plot: `overload.png`.\n",
        fmtf(ttft_q(&base, 0.0, base_s, 0.5)),
        fmtf(base_p90),
        fmtf(ttft_q(&over, 0.0, secs, 0.5)),
        fmtf(ttft_q(&over, 0.0, secs, 0.9)),
        recovered_at.map_or("never within the recovery phase".to_string(), |w| format!("{w} s"))
    ));
    report.title = "Overload soak (wasm filter, admission on)".into();
    report.body = body;
    report.json = json!({
        "soak": "overload", "secs": secs, "capacity_rps": capacity, "cost_per_request": cost,
        "bucket": {"tokens_per_second": tps, "burst": burst}, "max_held": MAX_HELD,
        "tenants": tenants, "answers": by_status, "held_depth_max": held_max,
        "overload_window_s": [over_start, over_end],
        "baseline_ttft_ms": {"p50": ttft_q(&base, 0.0, base_s, 0.5), "p90": base_p90},
        "recovered_after_s": recovered_at, "recovery_windows_later_over": later_over,
        "recovery_windows": rec_windows,
        "series": series,
    });
    Ok(report)
}
