//! Decides how a run summary reads for a person on stdout (the `--json` file carries the same
//! numbers for machines).

use std::fmt::Write;

use crate::stats::{Dist, PodShare, Summary};

fn f(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

fn dist_row(s: &mut String, name: &str, d: &Dist) {
    let _ = writeln!(
        s,
        "  {name:<12} {:>7} {:>9} {:>9} {:>9} {:>9}",
        d.count,
        f(d.p50),
        f(d.p90),
        f(d.p99),
        f(d.max)
    );
}

fn shares(map: &std::collections::BTreeMap<String, PodShare>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    map.iter()
        .map(|(k, v)| format!("{k} {:.1}% ({})", v.share * 100.0, v.requests))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The human summary.
pub fn render(s: &Summary) -> String {
    let mut out = String::new();
    let c = &s.overall.counts;
    let _ = writeln!(
        out,
        "requests: {} scheduled, {} sent in {:.2} s; ok {}, http errors {}, timeouts {} ({:.2}%), transport errors {}, skipped by in-flight cap {}",
        c.scheduled,
        c.sent,
        s.wall_s,
        c.ok,
        c.http_errors,
        c.timeouts,
        s.overall.timeout_rate * 100.0,
        c.transport_errors,
        c.skipped_in_flight_cap
    );
    if let Some(x) = &s.sessions {
        let _ = writeln!(
            out,
            "sessions: {}, completed {}, ended early {} ({} turns not sent)",
            x.sessions, x.completed, x.ended_early, x.turns_not_sent
        );
    }
    let codes: Vec<String> = s
        .overall
        .status_codes
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let _ = writeln!(
        out,
        "status codes: {}",
        if codes.is_empty() {
            "-".into()
        } else {
            codes.join(" ")
        }
    );
    let _ = writeln!(
        out,
        "  {:<12} {:>7} {:>9} {:>9} {:>9} {:>9}",
        "latency ms", "count", "p50", "p90", "p99", "max"
    );
    dist_row(&mut out, "TTFT all", &s.overall.ttft_ms);
    for (tag, g) in &s.by_tag {
        dist_row(&mut out, &format!("TTFT {tag}"), &g.ttft_ms);
    }
    dist_row(&mut out, "e2e all", &s.overall.e2e_ms);
    for (tag, g) in &s.by_tag {
        dist_row(&mut out, &format!("e2e {tag}"), &g.e2e_ms);
    }
    let _ = writeln!(
        out,
        "output tokens: {} ({:.1} tok/s)",
        s.overall.output_tokens, s.overall.output_tokens_per_s
    );
    let _ = writeln!(out, "pod share: {}", shares(&s.overall.pod_share));
    if s.by_tag.len() > 1 {
        for (tag, g) in &s.by_tag {
            let _ = writeln!(out, "pod share {tag}: {}", shares(&g.pod_share));
        }
    }
    let _ = writeln!(
        out,
        "generator: dispatch lag ms p50 {} p99 {} max {}; peak in flight {}; in-flight cap hits {}",
        f(s.dispatch_lag_ms.p50),
        f(s.dispatch_lag_ms.p99),
        f(s.dispatch_lag_ms.max),
        s.peak_in_flight,
        s.in_flight_cap_hits
    );
    for (msg, n) in &s.top_errors {
        let _ = writeln!(out, "error x{n}: {msg}");
    }
    out
}
