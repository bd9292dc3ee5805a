//! `--repeats N`: a load scenario run N times on the same trace and pool, the policies' order
//! reversed every other repeat so that no policy always runs first (or last), each repeat's
//! table and summary under `<out>/<scenario>/repeat-<k>/`, and `<out>/<scenario>/repeats.md`:
//! per policy the p99 TTFT, p99 end-to-end latency and throughput of every repeat and their
//! median, and each policy's ratio to the first one named in `--policies`, per repeat and the
//! median of those.
//!
//! Why: at light load a p99 is a handful of requests, and the same policy on the same trace
//! measured from 67 to 138 ms p99 TTFT between runs (sharegpt-poisson-60,
//! bench-results/misleading-frontend/README.md), far more than the 5 % some targets ask to
//! resolve. One run decides nothing there; the spread over repeats says how much a ratio is
//! worth.

use std::path::Path;

use serde_json::{json, Value};

use crate::overhead::median;
use crate::scenario::{self, Env, Load};
use crate::topology::{Policy, Pool};

pub type Error = String;

/// The order of the policies in repeat `k` (0-based): as given in even repeats, reversed in
/// odd ones.
pub fn order(policies: &[Policy], k: usize) -> Vec<Policy> {
    let mut v = policies.to_vec();
    if k % 2 == 1 {
        v.reverse();
    }
    v
}

/// The metrics a repeat is summed up by: (label, JSON pointer into a policy's summary, whether
/// every table shows it). The others appear only when a repeat has them (a fault run's
/// breaker openings before its fault, false trips in `fault-noisy`, and the pod-seconds they
/// held pods open).
const METRICS: [(&str, &str, bool); 5] = [
    ("p99 TTFT (ms)", "/all/ttft_ms/p99", true),
    ("p99 e2e (ms)", "/all/e2e_ms/p99", true),
    ("output tok/s", "/all/output_tokens_per_s", true),
    (
        "openings before the fault",
        "/fault/attempts/breaker_openings_before_fault",
        false,
    ),
    (
        "open pod-s before the fault",
        "/fault/attempts/breaker_open_pod_seconds_before_fault",
        false,
    ),
];

fn metric(summary: &Value, policy: &str, m: usize) -> Option<f64> {
    let (_, pointer, _) = METRICS.get(m)?;
    summary["policies"]
        .as_array()?
        .iter()
        .find(|p| p["policy"] == policy)?
        .pointer(pointer)?
        .as_f64()
}

/// The metrics `summaries` show: those every table has, and the others where some repeat of
/// some policy has them.
fn shown(policies: &[&str], summaries: &[Value]) -> Vec<usize> {
    (0..METRICS.len())
        .filter(|m| {
            METRICS[*m].2
                || policies
                    .iter()
                    .any(|p| summaries.iter().any(|s| metric(s, p, *m).is_some()))
        })
        .collect()
}

/// Runs `load` `n` times (n ≥ 1), writes each repeat under `<env.out>/<load>/repeat-<k>/` and
/// the repeats' table; returns the repeats' summary.
pub fn run(load: &Load, env: &Env, pool: &mut Pool, cmd: &str, n: usize) -> Result<Value, Error> {
    let mut summaries = Vec::new();
    for k in 0..n {
        let mut e = env.clone();
        e.policies = order(&env.policies, k);
        e.work = env.work.join(&load.name).join(format!("repeat-{}", k + 1));
        let out = env.out.join(&load.name).join(format!("repeat-{}", k + 1));
        eprintln!(
            "[bench] {}: repeat {} of {n} ({})",
            load.name,
            k + 1,
            e.policies
                .iter()
                .map(|p| p.name())
                .collect::<Vec<_>>()
                .join(", ")
        );
        summaries.push(scenario::run_load_into(load, &e, pool, cmd, &out)?);
    }
    let names: Vec<&str> = env.policies.iter().map(|p| p.name()).collect();
    let text = table(&load.name, cmd, &names, &summaries);
    let dir = env.out.join(&load.name);
    write(&dir, &text)?;
    Ok(json!({
        "scenario": load.name,
        "command": cmd,
        "repeats": summaries,
    }))
}

fn write(dir: &Path, text: &str) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    std::fs::write(dir.join("repeats.md"), text)
        .map_err(|e| format!("writing {}: {e}", dir.join("repeats.md").display()))
}

fn cell(v: Option<f64>, ratio: bool) -> String {
    match v {
        Some(x) if ratio => format!("{x:.2}"),
        Some(x) => format!("{x:.0}"),
        None => "–".into(),
    }
}

/// One row: `head`, each repeat's value, and their median (ratios: two decimals, the median
/// in bold); a repeat without the value shows a dash and stays out of the median.
fn row(head: &str, vals: Vec<Option<f64>>, ratio: bool) -> String {
    let cells: String = vals
        .iter()
        .map(|v| format!(" {} |", cell(*v, ratio)))
        .collect();
    let med = cell(median(vals.into_iter().flatten().collect()), ratio);
    let med = if ratio { format!("**{med}**") } else { med };
    format!("| {head} |{cells} {med} |\n")
}

/// The repeats' markdown table: a row per policy and metric, then per other policy and metric
/// its ratio to the first policy (per repeat, then the median of those ratios).
pub fn table(name: &str, cmd: &str, policies: &[&str], summaries: &[Value]) -> String {
    let n = summaries.len();
    let mut t = format!(
        "### {name}: {n} repeats on one trace, the policies' order reversed every other repeat\n\n`{cmd}`\n\n"
    );
    let head: String = (1..=n).map(|k| format!(" {k} |")).collect();
    let rule: String = (0..n).map(|_| "---|").collect();
    t.push_str(&format!(
        "| policy | metric |{head} median |\n|---|---|{rule}---|\n"
    ));
    let shown = shown(policies, summaries);
    for p in policies {
        for &m in &shown {
            let label = METRICS[m].0;
            let vals = summaries.iter().map(|s| metric(s, p, m)).collect();
            t.push_str(&row(&format!("{p} | {label}"), vals, false));
        }
    }
    if let Some((base, others)) = policies.split_first() {
        for p in others {
            for &m in &shown {
                let label = METRICS[m].0;
                let ratios = summaries
                    .iter()
                    .map(|s| match (metric(s, p, m), metric(s, base, m)) {
                        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                        _ => None,
                    })
                    .collect();
                t.push_str(&row(&format!("{p} / {base} | {label}"), ratios, true));
            }
        }
    }
    t.push_str(&format!(
        "\nEach repeat's own table: `repeat-<k>/table.md`. Odd repeats ran {}, even ones the reverse.\n",
        policies.join(", ")
    ));
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(rows: &[(&str, f64, f64, f64)]) -> Value {
        json!({"policies": rows.iter().map(|(p, ttft, e2e, tok)| json!({
            "policy": p,
            "all": {"ttft_ms": {"p99": ttft}, "e2e_ms": {"p99": e2e}, "output_tokens_per_s": tok},
        })).collect::<Vec<_>>()})
    }

    #[test]
    fn the_order_reverses_every_other_repeat() {
        let p = [Policy::LeastRequest, Policy::AiLb];
        assert_eq!(order(&p, 0), vec![Policy::LeastRequest, Policy::AiLb]);
        assert_eq!(order(&p, 1), vec![Policy::AiLb, Policy::LeastRequest]);
        assert_eq!(order(&p, 2), vec![Policy::LeastRequest, Policy::AiLb]);
    }

    #[test]
    fn the_table_gives_each_repeat_and_the_median_ratio_to_the_first_policy() {
        let s = vec![
            summary(&[
                ("ai_lb", 100.0, 1000.0, 50.0),
                ("ai_lb_learned", 150.0, 1000.0, 50.0),
            ]),
            summary(&[
                ("ai_lb_learned", 60.0, 900.0, 50.0),
                ("ai_lb", 120.0, 1000.0, 50.0),
            ]),
            summary(&[
                ("ai_lb", 80.0, 1000.0, 50.0),
                ("ai_lb_learned", 88.0, 1100.0, 50.0),
            ]),
        ];
        let t = table("x", "cmd", &["ai_lb", "ai_lb_learned"], &s);
        // Per repeat in the named order, whatever order each repeat ran in.
        assert!(
            t.contains("| ai_lb | p99 TTFT (ms) | 100 | 120 | 80 | 100 |"),
            "{t}"
        );
        assert!(
            t.contains("| ai_lb_learned | p99 TTFT (ms) | 150 | 60 | 88 | 88 |"),
            "{t}"
        );
        // Ratios 1.5, 0.5, 1.1: median 1.10.
        assert!(
            t.contains("| ai_lb_learned / ai_lb | p99 TTFT (ms) | 1.50 | 0.50 | 1.10 | **1.10** |"),
            "{t}"
        );
        assert!(
            t.contains("| ai_lb_learned / ai_lb | p99 e2e (ms) | 1.00 | 0.90 | 1.10 | **1.00** |"),
            "{t}"
        );
    }

    #[test]
    fn a_policy_missing_from_a_repeat_shows_a_dash_and_stays_out_of_the_median() {
        let s = vec![
            summary(&[
                ("ai_lb", 100.0, 1000.0, 50.0),
                ("least_request", 200.0, 1000.0, 50.0),
            ]),
            summary(&[("ai_lb", 100.0, 1000.0, 50.0)]),
        ];
        let t = table("x", "cmd", &["ai_lb", "least_request"], &s);
        assert!(
            t.contains("| least_request / ai_lb | p99 TTFT (ms) | 2.00 | – | **2.00** |"),
            "{t}"
        );
    }

    #[test]
    fn false_trip_rows_appear_only_where_a_fault_run_counted_them() {
        let plain = vec![summary(&[("ai_lb", 100.0, 1000.0, 50.0)])];
        let t = table("x", "cmd", &["ai_lb"], &plain);
        assert!(!t.contains("before the fault"), "{t}");
        let mut a = summary(&[
            ("ai_lb", 100.0, 1000.0, 50.0),
            ("ai_lb_adaptive", 100.0, 1000.0, 50.0),
        ]);
        for (k, (n, ps)) in [(8, 40.0), (2, 10.0)].into_iter().enumerate() {
            a["policies"][k]["fault"] = json!({"attempts": {
                "breaker_openings_before_fault": n,
                "breaker_open_pod_seconds_before_fault": ps,
            }});
        }
        let t = table("x", "cmd", &["ai_lb", "ai_lb_adaptive"], &[a]);
        assert!(
            t.contains("| ai_lb_adaptive / ai_lb | openings before the fault | 0.25 | **0.25** |"),
            "{t}"
        );
        assert!(
            t.contains(
                "| ai_lb_adaptive / ai_lb | open pod-s before the fault | 0.25 | **0.25** |"
            ),
            "{t}"
        );
        assert!(
            t.contains("| ai_lb | open pod-s before the fault | 40 | 40 |"),
            "{t}"
        );
    }
}
