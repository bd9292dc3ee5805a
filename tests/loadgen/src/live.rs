//! Decides what the `--live` demo table shows: per-pod share over the last second and the
//! whole run, TTFT p50/p99 and errors, rendered from tallies of finished requests.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::stats::{percentile, Outcome, Record, NO_POD};

/// Counts of finished requests over some window.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub pods: BTreeMap<String, u64>,
    pub ttft_ms: Vec<f64>,
    pub done: u64,
    pub ok: u64,
    pub errors: u64,
    pub timeouts: u64,
    pub skipped: u64,
}

impl Tally {
    pub fn add(&mut self, r: &Record) {
        self.done += 1;
        match r.outcome {
            Outcome::Ok => {
                self.ok += 1;
                self.ttft_ms.extend(r.ttft_ms);
            }
            Outcome::Timeout => self.timeouts += 1,
            Outcome::HttpError | Outcome::TransportError => self.errors += 1,
            Outcome::SkippedInFlightCap | Outcome::SessionEnded => self.skipped += 1,
        }
        if r.status.is_some() {
            *self
                .pods
                .entry(r.pod.clone().unwrap_or_else(|| NO_POD.into()))
                .or_default() += 1;
        }
    }

    fn ttft(&mut self, p: f64) -> String {
        self.ttft_ms.sort_by(f64::total_cmp);
        percentile(&self.ttft_ms, p).map_or_else(|| "-".into(), |v| format!("{v:.1}"))
    }
}

fn pct(n: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * n as f64 / total as f64
    }
}

/// One frame of the live table.
pub fn render(elapsed_s: f64, in_flight: usize, last: &mut Tally, cum: &mut Tally) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "t={elapsed_s:6.1}s  in-flight {in_flight:5}  done {:7}  ok {:7}  errors {:5}  timeouts {:5}  skipped {:5}",
        cum.done, cum.ok, cum.errors, cum.timeouts, cum.skipped
    );
    let _ = writeln!(
        s,
        "{:<24} {:>8} {:>7} {:>10} {:>7}",
        "pod", "last 1s", "share", "total", "share"
    );
    let last_total: u64 = last.pods.values().sum();
    let cum_total: u64 = cum.pods.values().sum();
    for (pod, &n) in &cum.pods {
        let l = last.pods.get(pod).copied().unwrap_or(0);
        let _ = writeln!(
            s,
            "{:<24} {:>8} {:>6.1}% {:>10} {:>6.1}%",
            pod,
            l,
            pct(l, last_total),
            n,
            pct(n, cum_total)
        );
    }
    let _ = writeln!(
        s,
        "TTFT ms  last 1s: p50 {} p99 {}   total: p50 {} p99 {}   errors last 1s: {} (+{} timeouts)",
        last.ttft(50.0),
        last.ttft(99.0),
        cum.ttft(50.0),
        cum.ttft(99.0),
        last.errors,
        last.timeouts
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Tag;

    fn rec(pod: &str, outcome: Outcome, ttft: f64) -> Record {
        Record {
            outcome,
            status: Some(200),
            pod: Some(pod.into()),
            ttft_ms: Some(ttft),
            e2e_ms: Some(ttft),
            output_tokens: 1,
            tokens_from_usage: true,
            ..Record::new(0, Tag::Short, 1, 1, 0)
        }
    }

    #[test]
    fn table_shows_last_and_cumulative_share() {
        let mut cum = Tally::default();
        let mut last = Tally::default();
        for r in [
            rec("pod-a", Outcome::Ok, 10.0),
            rec("pod-a", Outcome::Ok, 20.0),
            rec("pod-b", Outcome::Ok, 30.0),
        ] {
            cum.add(&r);
        }
        let r = rec("pod-b", Outcome::Timeout, 5.0);
        cum.add(&r);
        last.add(&r);
        let out = render(3.0, 2, &mut last, &mut cum);
        let a = out.lines().find(|l| l.starts_with("pod-a")).unwrap();
        let b = out.lines().find(|l| l.starts_with("pod-b")).unwrap();
        assert!(a.contains(" 0.0%") && a.contains("50.0%"), "{a}");
        assert!(b.contains("100.0%") && b.contains("50.0%"), "{b}");
        assert!(out.contains("total: p50 20.0 p99 30.0"), "{out}");
        assert!(out.contains("timeouts     1"), "{out}");
    }
}
