//! Decides what a run measured, from the load generator's per-request records (pure): TTFT and
//! e2e percentiles (nearest rank) with timed-out requests counted AT the client timeout (so a
//! policy cannot improve its p99 by timing out its slowest requests), timeout and error rates,
//! output tokens/s, per-pod shares, shares over time windows, dispatch lag, the ratios of
//! one policy to another, and the prefix-cache hit rate from the pods' own counters
//! (`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, in tokens, as vLLM
//! exports them), scraped before and after a run.

use std::collections::BTreeMap;

use ai_lb_loadgen::stats::{Outcome, Record};
use serde::Serialize;

/// Nearest-rank percentile of an ascending slice (`p` in 0..=100).
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let i = rank.clamp(1, sorted.len()) - 1;
    sorted.get(i).copied()
}

/// p50/p90/p99/max of a sample, ms.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Pcts {
    pub count: usize,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Pcts {
    pub fn of(mut v: Vec<f64>) -> Self {
        v.retain(|x| x.is_finite());
        v.sort_by(f64::total_cmp);
        Pcts {
            count: v.len(),
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v.last().copied(),
        }
    }
}

/// The figures of one policy on one trace (or one tag of it).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub timeouts: usize,
    pub errors: usize,
    pub skipped: usize,
    /// Multi-turn: turns not sent because an earlier turn of their session failed.
    pub session_ended: usize,
    pub timeout_rate: f64,
    pub error_rate: f64,
    /// Over ok and timed-out requests; a timeout counts as `timeout_ms` (a lower bound).
    pub ttft_ms: Pcts,
    pub e2e_ms: Pcts,
    /// Output tokens of ok requests / (first send → last completion).
    pub output_tokens_per_s: f64,
    /// Answered requests per pod (any status), as a fraction of all answered.
    pub pod_share: BTreeMap<String, f64>,
    /// Actual minus scheduled send time: the generator's own health.
    pub dispatch_lag_ms: Pcts,
}

/// Summarises `records` (any subset, e.g. one tag) given the client timeout.
pub fn summarize(records: &[&Record], timeout_ms: f64) -> Summary {
    let mut s = Summary {
        requests: records.len(),
        ..Summary::default()
    };
    let (mut ttft, mut e2e, mut lag) = (Vec::new(), Vec::new(), Vec::new());
    let mut per_pod: BTreeMap<String, usize> = BTreeMap::new();
    let mut answered = 0usize;
    let mut tokens = 0u64;
    let (mut first_send, mut last_end) = (f64::INFINITY, 0.0f64);
    for r in records {
        let sent_ms = r.sent_us as f64 / 1000.0;
        match r.outcome {
            Outcome::Ok => {
                s.ok += 1;
                ttft.push(r.ttft_ms.unwrap_or(timeout_ms));
                let e = r.e2e_ms.unwrap_or(timeout_ms);
                e2e.push(e);
                tokens += r.output_tokens;
                first_send = first_send.min(sent_ms);
                last_end = last_end.max(sent_ms + e);
            }
            Outcome::Timeout => {
                s.timeouts += 1;
                ttft.push(r.ttft_ms.unwrap_or(timeout_ms).min(timeout_ms));
                e2e.push(timeout_ms);
                first_send = first_send.min(sent_ms);
            }
            Outcome::SkippedInFlightCap => s.skipped += 1,
            Outcome::SessionEnded => s.session_ended += 1,
            Outcome::HttpError | Outcome::TransportError => s.errors += 1,
        }
        if r.was_sent() {
            lag.push((r.sent_us as f64 - r.scheduled_us as f64) / 1000.0);
        }
        if r.status.is_some() {
            answered += 1;
            *per_pod
                .entry(r.pod.clone().unwrap_or_else(|| "(none)".into()))
                .or_default() += 1;
        }
    }
    let n = s.requests.max(1) as f64;
    s.timeout_rate = s.timeouts as f64 / n;
    s.error_rate = s.errors as f64 / n;
    s.ttft_ms = Pcts::of(ttft);
    s.e2e_ms = Pcts::of(e2e);
    s.dispatch_lag_ms = Pcts::of(lag);
    let span_s = (last_end - first_send) / 1000.0;
    s.output_tokens_per_s = if span_s > 0.0 {
        tokens as f64 / span_s
    } else {
        0.0
    };
    s.pod_share = per_pod
        .into_iter()
        .map(|(k, v)| (k, v as f64 / answered.max(1) as f64))
        .collect();
    s
}

/// Share of requests SENT in each window that went to `pod` (None for an empty window).
/// Windows of `window_ms` start at 0 and cover `[0, end_ms)`.
pub fn share_over_time(
    records: &[&Record],
    pod: &str,
    window_ms: f64,
    end_ms: f64,
) -> Vec<Option<f64>> {
    let n = (end_ms / window_ms).ceil().max(0.0) as usize;
    let mut hits = vec![0usize; n];
    let mut all = vec![0usize; n];
    for r in records {
        if r.status.is_none() {
            continue;
        }
        let i = (r.sent_us as f64 / 1000.0 / window_ms).floor() as usize;
        if let (Some(a), Some(h)) = (all.get_mut(i), hits.get_mut(i)) {
            *a += 1;
            if r.pod.as_deref() == Some(pod) {
                *h += 1;
            }
        }
    }
    all.iter()
        .zip(hits)
        .map(|(&a, h)| (a > 0).then(|| h as f64 / a as f64))
        .collect()
}

/// Share of answered requests sent in `[from_ms, to_ms)` that went to `pod` (None if none).
pub fn share_between(records: &[&Record], pod: &str, from_ms: f64, to_ms: f64) -> Option<f64> {
    let (mut hits, mut all) = (0usize, 0usize);
    for r in records {
        let t = r.sent_us as f64 / 1000.0;
        if r.status.is_none() || t < from_ms || t >= to_ms {
            continue;
        }
        all += 1;
        if r.pod.as_deref() == Some(pod) {
            hits += 1;
        }
    }
    (all > 0).then(|| hits as f64 / all as f64)
}

/// What each sidecar still sent to the faulty pod `pod` after its own routing showed the pod
/// cut (`cut_ms[i]`, ms since the start, for the sidecar whose records are `per_sidecar[i]`;
/// None: never seen cut). A request counts as sent to the pod when the pod answered it, or
/// when it timed out with no answer at all (a frozen pod sends nothing).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct AfterCut {
    /// Sidecars whose routing showed the pod cut.
    pub sidecars_cut: usize,
    pub sent_to_pod: usize,
    pub timeouts: usize,
    /// Send times of those requests, ms after that sidecar's cut.
    pub sent_ms_after_cut: Vec<f64>,
}

pub fn after_cut(per_sidecar: &[Vec<Record>], cut_ms: &[Option<f64>], pod: &str) -> AfterCut {
    let mut out = AfterCut::default();
    for (records, cut) in per_sidecar.iter().zip(cut_ms) {
        let Some(cut) = cut else { continue };
        out.sidecars_cut += 1;
        for r in records {
            let t = r.sent_us as f64 / 1000.0;
            let timed_out = r.outcome == Outcome::Timeout && r.pod.is_none();
            if t < *cut || !(r.pod.as_deref() == Some(pod) || timed_out) {
                continue;
            }
            out.sent_to_pod += 1;
            if r.outcome == Outcome::Timeout {
                out.timeouts += 1;
            }
            out.sent_ms_after_cut.push(t - cut);
        }
    }
    out
}

/// The value of a Prometheus counter in `text`, summed over its samples (any labels); None
/// when no sample of it is present (an absent counter is not a zero one). A sample line is
/// `name{labels} value` or `name value`; a value that does not parse makes it None too.
pub fn counter(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for l in text.lines() {
        let Some(rest) = l.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let v = l.rsplit(' ').next()?.parse::<f64>().ok()?;
        if !v.is_finite() {
            return None;
        }
        sum = Some(sum.unwrap_or(0.0) + v);
    }
    sum
}

/// Prefix-cache counter names (tokens), as vLLM exports them.
pub const HITS: &str = "vllm:prefix_cache_hits_total";
pub const QUERIES: &str = "vllm:prefix_cache_queries_total";

/// One pod's prefix-cache counters, or None when its `/metrics` lacks either.
pub fn cache_counters(metrics: &str) -> Option<(f64, f64)> {
    Some((counter(metrics, HITS)?, counter(metrics, QUERIES)?))
}

/// Prefix-cache use over a run, from every pod's counters before and after it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CacheUse {
    /// Prompt tokens served from the cache, summed over the pods.
    pub hits: f64,
    /// Prompt tokens looked up.
    pub queries: f64,
    /// hits / queries (None when nothing was queried).
    pub hit_rate: Option<f64>,
    /// Per pod: (hits, queries).
    pub per_pod: BTreeMap<String, (f64, f64)>,
}

/// What a policy's prefix-cache use reads as: measured, or "n/a" when any pod lacks the
/// counters (never reported as 0).
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(untagged)]
pub enum CacheReport {
    Measured(CacheUse),
    NotAvailable(&'static str),
}

/// Written where the counters are missing.
pub const NOT_AVAILABLE: &str = "n/a";

/// The run's cache use from per-pod counters before and after it (same pods, same order).
/// A counter that went down (the pod restarted) or is missing on any pod gives "n/a".
pub fn cache_use(
    before: &[(String, Option<(f64, f64)>)],
    after: &[(String, Option<(f64, f64)>)],
) -> CacheReport {
    let mut per_pod = BTreeMap::new();
    let (mut hits, mut queries) = (0.0, 0.0);
    if before.len() != after.len() || before.is_empty() {
        return CacheReport::NotAvailable(NOT_AVAILABLE);
    }
    for ((name, b), (_, a)) in before.iter().zip(after) {
        let (Some((hb, qb)), Some((ha, qa))) = (b, a) else {
            return CacheReport::NotAvailable(NOT_AVAILABLE);
        };
        let (dh, dq) = (ha - hb, qa - qb);
        if dh < 0.0 || dq < 0.0 {
            return CacheReport::NotAvailable(NOT_AVAILABLE);
        }
        hits += dh;
        queries += dq;
        per_pod.insert(name.clone(), (dh, dq));
    }
    CacheReport::Measured(CacheUse {
        hits,
        queries,
        hit_rate: (queries > 0.0).then(|| hits / queries),
        per_pod,
    })
}

/// `a / b`, None when either is missing or `b` is 0.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => Some(a / b),
        _ => None,
    }
}

/// The ratios the targets are stated in: `this / base`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Ratios {
    pub ttft_p99: Option<f64>,
    pub e2e_p99: Option<f64>,
    pub e2e_p50: Option<f64>,
    pub timeout_rate: Option<f64>,
    pub throughput: Option<f64>,
}

pub fn ratios(this: &Summary, base: &Summary) -> Ratios {
    Ratios {
        ttft_p99: ratio(this.ttft_ms.p99, base.ttft_ms.p99),
        e2e_p99: ratio(this.e2e_ms.p99, base.e2e_ms.p99),
        e2e_p50: ratio(this.e2e_ms.p50, base.e2e_ms.p50),
        timeout_rate: ratio(Some(this.timeout_rate), Some(base.timeout_rate)),
        throughput: ratio(
            Some(this.output_tokens_per_s),
            Some(base.output_tokens_per_s),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_loadgen::workload::Tag;

    fn rec(id: u64, outcome: Outcome, pod: Option<&str>, sent_ms: u64, e2e: f64) -> Record {
        Record {
            sent_us: sent_ms * 1000 + 500,
            outcome,
            status: match outcome {
                Outcome::Ok => Some(200),
                Outcome::HttpError => Some(500),
                _ => None,
            },
            pod: pod.map(String::from),
            ttft_ms: (outcome == Outcome::Ok).then_some(e2e / 10.0),
            e2e_ms: (outcome == Outcome::Ok).then_some(e2e),
            output_tokens: if outcome == Outcome::Ok { 10 } else { 0 },
            tokens_from_usage: true,
            ..Record::new(id, Tag::Short, 10, 10, sent_ms * 1000)
        }
    }

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 1.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn timeouts_count_at_the_timeout_and_errors_are_separate() {
        let rs = [
            rec(0, Outcome::Ok, Some("a"), 0, 100.0),
            rec(1, Outcome::Ok, Some("b"), 0, 200.0),
            rec(2, Outcome::Timeout, None, 0, 0.0),
            rec(3, Outcome::HttpError, Some("a"), 0, 0.0),
        ];
        let refs: Vec<&Record> = rs.iter().collect();
        let s = summarize(&refs, 5000.0);
        assert_eq!((s.ok, s.timeouts, s.errors), (2, 1, 1));
        assert_eq!(s.e2e_ms.count, 3);
        assert_eq!(s.e2e_ms.max, Some(5000.0));
        assert_eq!(s.e2e_ms.p50, Some(200.0));
        assert!((s.timeout_rate - 0.25).abs() < 1e-12);
        // Answered: 2 by a (one of them a 500), 1 by b.
        assert!((s.pod_share["a"] - 2.0 / 3.0).abs() < 1e-12);
        // 20 tokens over 0.5 ms → 200.5 ms.
        assert!((s.output_tokens_per_s - 20.0 / 0.2).abs() < 1e-9);
        assert_eq!(s.dispatch_lag_ms.p50, Some(0.5));
    }

    #[test]
    fn shares_by_window() {
        let rs = [
            rec(0, Outcome::Ok, Some("a"), 100, 1.0),
            rec(1, Outcome::Ok, Some("b"), 200, 1.0),
            rec(2, Outcome::Ok, Some("b"), 1100, 1.0),
            rec(3, Outcome::Timeout, None, 1200, 1.0),
        ];
        let refs: Vec<&Record> = rs.iter().collect();
        assert_eq!(
            share_over_time(&refs, "a", 1000.0, 3000.0),
            vec![Some(0.5), Some(0.0), None]
        );
        assert_eq!(share_between(&refs, "b", 0.0, 2000.0), Some(2.0 / 3.0));
        assert_eq!(share_between(&refs, "b", 5000.0, 6000.0), None);
    }

    #[test]
    fn after_the_cut_counts_each_sidecars_own_requests_to_the_pod() {
        let sidecar0 = vec![
            rec(0, Outcome::Timeout, None, 900, 0.0),
            rec(1, Outcome::Timeout, None, 1100, 0.0),
            rec(2, Outcome::Ok, Some("b"), 1200, 1.0),
            rec(3, Outcome::Ok, Some("a"), 1300, 1.0),
        ];
        let sidecar1 = vec![rec(4, Outcome::Timeout, None, 1100, 0.0)];
        let sidecar2 = vec![rec(5, Outcome::Timeout, None, 5000, 0.0)];
        // Sidecar 0 cut pod a at 1000 ms, sidecar 1 at 1200 ms, sidecar 2 never.
        let a = after_cut(
            &[sidecar0, sidecar1, sidecar2],
            &[Some(1000.0), Some(1200.0), None],
            "a",
        );
        assert_eq!(a.sidecars_cut, 2);
        assert_eq!((a.sent_to_pod, a.timeouts), (2, 1));
        assert_eq!(a.sent_ms_after_cut, vec![100.5, 300.5]);
    }

    #[test]
    fn counters_are_summed_and_absent_is_not_zero() {
        let text =
            "# HELP vllm:prefix_cache_hits_total x\n# TYPE vllm:prefix_cache_hits_total counter\n\
                    vllm:prefix_cache_hits_total{model_name=\"m\"} 96.0\n\
                    vllm:prefix_cache_hits_total{model_name=\"n\"} 4\n\
                    vllm:prefix_cache_hits_total_created 1.7e9\n\
                    vllm:prefix_cache_queries_total 200\n";
        assert_eq!(counter(text, HITS), Some(100.0));
        assert_eq!(cache_counters(text), Some((100.0, 200.0)));
        assert_eq!(counter(text, "vllm:absent"), None);
        assert_eq!(cache_counters("vllm:prefix_cache_hits_total 3\n"), None);
        assert_eq!(counter("vllm:prefix_cache_hits_total x\n", HITS), None);
        assert_eq!(counter("vllm:prefix_cache_hits_total NaN\n", HITS), None);
    }

    #[test]
    fn cache_use_is_the_difference_or_not_available() {
        let p = |v: &[Option<(f64, f64)>]| -> Vec<(String, Option<(f64, f64)>)> {
            v.iter()
                .enumerate()
                .map(|(i, x)| (format!("pod-{i}"), *x))
                .collect()
        };
        let before = p(&[Some((10.0, 100.0)), Some((0.0, 0.0))]);
        let after = p(&[Some((40.0, 200.0)), Some((20.0, 100.0))]);
        let CacheReport::Measured(u) = cache_use(&before, &after) else {
            panic!("measured")
        };
        assert_eq!((u.hits, u.queries, u.hit_rate), (50.0, 200.0, Some(0.25)));
        assert_eq!(u.per_pod["pod-1"], (20.0, 100.0));
        let missing = p(&[Some((40.0, 200.0)), None]);
        assert_eq!(
            cache_use(&before, &missing),
            CacheReport::NotAvailable("n/a")
        );
        let restarted = p(&[Some((0.0, 0.0)), Some((20.0, 100.0))]);
        assert_eq!(
            cache_use(&before, &restarted),
            CacheReport::NotAvailable("n/a")
        );
        let CacheReport::Measured(idle) = cache_use(&before, &before) else {
            panic!("measured")
        };
        assert_eq!(idle.hit_rate, None, "nothing queried is not a 0 % hit rate");
        assert_eq!(
            serde_json::to_value(cache_use(&before, &missing)).unwrap(),
            serde_json::json!("n/a")
        );
    }

    #[test]
    fn ratios_need_both_sides() {
        assert_eq!(ratio(Some(1.0), Some(2.0)), Some(0.5));
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(2.0)), None);
    }
}
