//! Decides what the numbers are: per-request records, nearest-rank percentiles, per-pod
//! shares and the run summary (overall and per tag). Pure: records in, summary out.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::workload::Tag;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// 2xx and the body ended cleanly.
    Ok,
    /// A non-2xx status.
    HttpError,
    /// The client timeout fired before the body ended.
    Timeout,
    /// Connection or body error before the end.
    TransportError,
    /// Not sent: the in-flight safety cap was hit at its send time.
    SkippedInFlightCap,
    /// Not sent: an earlier turn of its multi-turn session failed, timed out or was skipped,
    /// which ends the session.
    SessionEnded,
}

/// The result of one request (one line of `--records`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub id: u64,
    pub tag: Tag,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// Scheduled send offset from the run start, microseconds.
    pub scheduled_us: u64,
    /// Actual send offset, microseconds (minus `scheduled_us` = dispatch lag).
    pub sent_us: u64,
    pub outcome: Outcome,
    pub status: Option<u16>,
    /// Serving pod from `x-fake-pod`.
    pub pod: Option<String>,
    /// Time to the first SSE data event, milliseconds.
    pub ttft_ms: Option<f64>,
    /// Send to end of body (or to the timeout/error), milliseconds.
    pub e2e_ms: Option<f64>,
    pub output_tokens: u64,
    /// True when `output_tokens` came from the usage chunk, false when counted from chunks.
    pub tokens_from_usage: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    /// Shared-prefix group, or multi-turn session group.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub group: Option<u32>,
    /// Shared-prefix user.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub user: Option<u32>,
    /// Multi-turn session.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub session: Option<u64>,
    /// Multi-turn turn, 1-based.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub turn: Option<u32>,
    /// Chat workloads: leading prompt tokens an earlier request can have left in a prefix
    /// cache: the group's system prompt with its role tokens (first turns, shared-prefix), or
    /// the previous turn's prompt plus its answer (later turns). `prompt_tokens` is then the
    /// exact count under the `ai-lb-prefix` chat template.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub prefix_tokens: Option<u32>,
}

impl Record {
    /// A record of request `id` before it is sent: outcome transport error, nothing measured.
    pub fn new(id: u64, tag: Tag, prompt_tokens: u32, max_tokens: u32, scheduled_us: u64) -> Self {
        Record {
            id,
            tag,
            prompt_tokens,
            max_tokens,
            scheduled_us,
            sent_us: scheduled_us,
            outcome: Outcome::TransportError,
            status: None,
            pod: None,
            ttft_ms: None,
            e2e_ms: None,
            output_tokens: 0,
            tokens_from_usage: false,
            error: None,
            group: None,
            user: None,
            session: None,
            turn: None,
            prefix_tokens: None,
        }
    }
}

/// Nearest-rank percentile of ascending data (`p` in 0..=100); None when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Distribution summary of a sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    pub count: u64,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Dist {
    pub fn of(mut v: Vec<f64>) -> Self {
        v.retain(|x| x.is_finite());
        v.sort_by(f64::total_cmp);
        let mean = if v.is_empty() {
            None
        } else {
            Some(v.iter().sum::<f64>() / v.len() as f64)
        };
        Dist {
            count: v.len() as u64,
            mean,
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v.last().copied(),
        }
    }
}

/// Requests served by one pod and their fraction of all answered requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodShare {
    pub requests: u64,
    pub share: f64,
}

/// Key used for answered requests without an `x-fake-pod` header (e.g. an Envoy 503).
pub const NO_POD: &str = "(none)";

/// Per-pod share over answered requests (those with a status).
pub fn pod_shares<'a>(records: impl IntoIterator<Item = &'a Record>) -> BTreeMap<String, PodShare> {
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for r in records {
        if r.status.is_some() {
            let k = r.pod.as_deref().unwrap_or(NO_POD);
            *counts.entry(k.to_string()).or_default() += 1;
        }
    }
    shares_from_counts(&counts)
}

pub fn shares_from_counts(counts: &BTreeMap<String, u64>) -> BTreeMap<String, PodShare> {
    let total: u64 = counts.values().sum();
    counts
        .iter()
        .map(|(k, &n)| {
            let share = if total == 0 {
                0.0
            } else {
                n as f64 / total as f64
            };
            (k.clone(), PodShare { requests: n, share })
        })
        .collect()
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    /// Requests in the trace (sent + skipped).
    pub scheduled: u64,
    pub sent: u64,
    pub ok: u64,
    pub http_errors: u64,
    pub timeouts: u64,
    pub transport_errors: u64,
    pub skipped_in_flight_cap: u64,
    /// Turns not sent because their session ended early (multi-turn only).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub session_ended: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How multi-turn sessions ended.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sessions {
    pub sessions: u64,
    /// Every turn answered (2xx, complete).
    pub completed: u64,
    /// Ended by a failed, timed-out or skipped turn.
    pub ended_early: u64,
    /// Turns not sent because of that.
    pub turns_not_sent: u64,
}

/// Everything reported for one group of requests (all, or one tag).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Group {
    pub counts: Counts,
    pub status_codes: BTreeMap<String, u64>,
    /// timeouts / sent.
    pub timeout_rate: f64,
    /// (http errors + timeouts + transport errors) / sent.
    pub error_rate: f64,
    /// TTFT of successful requests.
    pub ttft_ms: Dist,
    /// End-to-end latency of successful requests.
    pub e2e_ms: Dist,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// `output_tokens` / run wall time.
    pub output_tokens_per_s: f64,
    pub pod_share: BTreeMap<String, PodShare>,
}

/// The `--json` document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Wall-clock time of the run start (records' offsets count from it), milliseconds since the
    /// Unix epoch; lets a harness line records up with events outside the generator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_unix_ms: Option<u64>,
    /// Run start to the last request's end, seconds.
    pub wall_s: f64,
    #[serde(flatten)]
    pub overall: Group,
    pub by_tag: BTreeMap<String, Group>,
    /// How late requests left versus their schedule (generator health), milliseconds.
    pub dispatch_lag_ms: Dist,
    /// Times the in-flight safety cap was hit.
    pub in_flight_cap_hits: u64,
    /// Highest number of requests in flight at once.
    pub peak_in_flight: u64,
    /// The most frequent error messages (up to five) and their counts.
    pub top_errors: Vec<(String, u64)>,
    /// Multi-turn runs only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<Sessions>,
}

pub fn group<'a>(records: impl IntoIterator<Item = &'a Record> + Clone, wall_s: f64) -> Group {
    let mut g = Group::default();
    let mut ttft = Vec::new();
    let mut e2e = Vec::new();
    for r in records.clone() {
        g.counts.scheduled += 1;
        match r.outcome {
            Outcome::SkippedInFlightCap => {
                g.counts.skipped_in_flight_cap += 1;
                continue;
            }
            Outcome::SessionEnded => {
                g.counts.session_ended += 1;
                continue;
            }
            Outcome::Ok => {
                g.counts.ok += 1;
                g.output_tokens += r.output_tokens;
                ttft.extend(r.ttft_ms);
                e2e.extend(r.e2e_ms);
            }
            Outcome::HttpError => g.counts.http_errors += 1,
            Outcome::Timeout => g.counts.timeouts += 1,
            Outcome::TransportError => g.counts.transport_errors += 1,
        }
        g.counts.sent += 1;
        if let Some(s) = r.status {
            *g.status_codes.entry(s.to_string()).or_default() += 1;
        }
    }
    let sent = g.counts.sent.max(1) as f64;
    g.timeout_rate = g.counts.timeouts as f64 / sent;
    g.error_rate =
        (g.counts.http_errors + g.counts.timeouts + g.counts.transport_errors) as f64 / sent;
    g.ttft_ms = Dist::of(ttft);
    g.e2e_ms = Dist::of(e2e);
    g.output_tokens_per_s = if wall_s > 0.0 {
        g.output_tokens as f64 / wall_s
    } else {
        0.0
    };
    g.pod_share = pod_shares(records);
    g
}

pub fn summarize(
    records: &[Record],
    wall_s: f64,
    in_flight_cap_hits: u64,
    peak_in_flight: u64,
) -> Summary {
    let mut by_tag = BTreeMap::new();
    for tag in [Tag::Short, Tag::Long] {
        let sel: Vec<&Record> = records.iter().filter(|r| r.tag == tag).collect();
        if !sel.is_empty() {
            by_tag.insert(tag.as_str().to_string(), group(sel.iter().copied(), wall_s));
        }
    }
    let lag = records
        .iter()
        .filter(|r| r.was_sent())
        .map(|r| r.sent_us.saturating_sub(r.scheduled_us) as f64 / 1000.0)
        .collect();
    Summary {
        started_unix_ms: None,
        wall_s,
        overall: group(records.iter(), wall_s),
        by_tag,
        dispatch_lag_ms: Dist::of(lag),
        in_flight_cap_hits,
        peak_in_flight,
        top_errors: top_errors(records, 5),
        sessions: sessions(records),
    }
}

impl Record {
    /// Whether the request left (was not skipped by the cap nor dropped with its session).
    pub fn was_sent(&self) -> bool {
        !matches!(
            self.outcome,
            Outcome::SkippedInFlightCap | Outcome::SessionEnded
        )
    }
}

/// How the sessions of `records` ended; None when no record belongs to a session.
pub fn sessions(records: &[Record]) -> Option<Sessions> {
    let mut per: BTreeMap<u64, (bool, u64)> = BTreeMap::new();
    for r in records {
        let Some(s) = r.session else { continue };
        let e = per.entry(s).or_insert((true, 0));
        e.0 &= r.outcome == Outcome::Ok;
        if r.outcome == Outcome::SessionEnded {
            e.1 += 1;
        }
    }
    if per.is_empty() {
        return None;
    }
    let completed = per.values().filter(|(ok, _)| *ok).count() as u64;
    Some(Sessions {
        sessions: per.len() as u64,
        completed,
        ended_early: per.len() as u64 - completed,
        turns_not_sent: per.values().map(|(_, n)| n).sum(),
    })
}

/// The `n` most frequent error messages, most frequent first (ties by message).
pub fn top_errors(records: &[Record], n: usize) -> Vec<(String, u64)> {
    let mut m: BTreeMap<&str, u64> = BTreeMap::new();
    for r in records {
        if let Some(e) = &r.error {
            *m.entry(e.as_str()).or_default() += 1;
        }
    }
    let mut v: Vec<(String, u64)> = m.into_iter().map(|(k, c)| (k.to_string(), c)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v.truncate(n);
    v
}

/// Per-pod request counts in consecutive windows of `window_us` (by send time), for
/// share-over-time plots. Index i covers [i*window, (i+1)*window).
pub fn share_over_time(records: &[Record], window_us: u64) -> Vec<BTreeMap<String, u64>> {
    let w = window_us.max(1);
    let mut out: Vec<BTreeMap<String, u64>> = Vec::new();
    for r in records.iter().filter(|r| r.status.is_some()) {
        let i = (r.sent_us / w) as usize;
        if out.len() <= i {
            out.resize_with(i + 1, BTreeMap::new);
        }
        *out[i]
            .entry(r.pod.clone().unwrap_or_else(|| NO_POD.into()))
            .or_default() += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(
        id: u64,
        tag: Tag,
        outcome: Outcome,
        status: Option<u16>,
        pod: Option<&str>,
        ttft: f64,
    ) -> Record {
        Record {
            sent_us: id * 1000 + 500,
            outcome,
            status,
            pod: pod.map(str::to_string),
            ttft_ms: Some(ttft),
            e2e_ms: Some(ttft * 2.0),
            output_tokens: 7,
            tokens_from_usage: true,
            ..Record::new(id, tag, 10, 10, id * 1000)
        }
    }

    #[test]
    fn nearest_rank_percentiles_on_known_data() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 90.0), Some(90.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        let small = [10.0, 20.0, 30.0];
        assert_eq!(percentile(&small, 50.0), Some(20.0));
        assert_eq!(percentile(&small, 99.0), Some(30.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn dist_sorts_and_ignores_nan() {
        let d = Dist::of(vec![3.0, f64::NAN, 1.0, 2.0, 4.0]);
        assert_eq!(d.count, 4);
        assert_eq!(d.p50, Some(2.0));
        assert_eq!(d.max, Some(4.0));
        assert_eq!(d.mean, Some(2.5));
        assert_eq!(Dist::of(vec![]).p99, None);
    }

    #[test]
    fn shares_count_answered_requests_only() {
        let rs = vec![
            rec(0, Tag::Short, Outcome::Ok, Some(200), Some("a"), 1.0),
            rec(1, Tag::Short, Outcome::Ok, Some(200), Some("a"), 1.0),
            rec(2, Tag::Short, Outcome::Ok, Some(200), Some("b"), 1.0),
            rec(3, Tag::Short, Outcome::HttpError, Some(503), None, 1.0),
            rec(4, Tag::Short, Outcome::TransportError, None, None, 1.0),
        ];
        let s = pod_shares(&rs);
        assert_eq!(
            s["a"],
            PodShare {
                requests: 2,
                share: 0.5
            }
        );
        assert_eq!(s["b"].share, 0.25);
        assert_eq!(s[NO_POD].requests, 1);
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn summary_splits_by_tag_and_counts_outcomes() {
        let rs = vec![
            rec(0, Tag::Short, Outcome::Ok, Some(200), Some("a"), 10.0),
            rec(1, Tag::Short, Outcome::Ok, Some(200), Some("b"), 30.0),
            rec(2, Tag::Long, Outcome::Ok, Some(200), Some("a"), 500.0),
            rec(3, Tag::Long, Outcome::Timeout, Some(200), Some("b"), 900.0),
            rec(4, Tag::Short, Outcome::SkippedInFlightCap, None, None, 0.0),
        ];
        let s = summarize(&rs, 2.0, 1, 3);
        let c = &s.overall.counts;
        assert_eq!(
            (
                c.scheduled,
                c.sent,
                c.ok,
                c.timeouts,
                c.skipped_in_flight_cap
            ),
            (5, 4, 3, 1, 1)
        );
        assert_eq!(s.overall.timeout_rate, 0.25);
        assert_eq!(s.overall.error_rate, 0.25);
        assert_eq!(s.overall.status_codes["200"], 4);
        assert_eq!(s.overall.output_tokens, 21);
        assert_eq!(s.overall.output_tokens_per_s, 10.5);
        assert_eq!(s.by_tag["short"].ttft_ms.p99, Some(30.0));
        assert_eq!(
            s.by_tag["long"].ttft_ms.count, 1,
            "timeouts excluded from latency"
        );
        assert_eq!(s.by_tag["long"].counts.timeouts, 1);
        assert_eq!(s.dispatch_lag_ms.max, Some(0.5));
        assert!(s.top_errors.is_empty());
        let j = serde_json::to_value(&s).unwrap();
        assert!(
            j.get("ttft_ms").is_some() && j.get("by_tag").is_some(),
            "overall fields flattened"
        );
    }

    #[test]
    fn sessions_count_completed_and_ended_early() {
        let turn = |id, s, outcome| Record {
            session: Some(s),
            ..rec(id, Tag::Short, outcome, Some(200), Some("a"), 1.0)
        };
        let rs = vec![
            turn(0, 0, Outcome::Ok),
            turn(1, 0, Outcome::Ok),
            turn(2, 1, Outcome::Ok),
            turn(3, 1, Outcome::Timeout),
            turn(4, 1, Outcome::SessionEnded),
            turn(5, 1, Outcome::SessionEnded),
        ];
        let s = summarize(&rs, 1.0, 0, 1);
        assert_eq!(
            s.sessions,
            Some(Sessions {
                sessions: 2,
                completed: 1,
                ended_early: 1,
                turns_not_sent: 2
            })
        );
        let c = &s.overall.counts;
        assert_eq!((c.scheduled, c.sent, c.session_ended), (6, 4, 2));
        assert_eq!(s.dispatch_lag_ms.count, 4, "unsent turns have no lag");
        assert!(summarize(&rs[..0], 1.0, 0, 0).sessions.is_none());
        let j = serde_json::to_value(summarize(&[rs[0].clone()], 1.0, 0, 0)).unwrap();
        assert!(
            j["counts"].get("session_ended").is_none(),
            "zero is not written"
        );
    }

    #[test]
    fn top_errors_most_frequent_first() {
        let mut rs = vec![rec(0, Tag::Short, Outcome::Timeout, None, None, 1.0); 3];
        rs[0].error = Some("b".into());
        rs[1].error = Some("a".into());
        rs[2].error = Some("b".into());
        assert_eq!(
            top_errors(&rs, 5),
            vec![("b".to_string(), 2), ("a".to_string(), 1)]
        );
        assert_eq!(top_errors(&rs, 1).len(), 1);
    }

    #[test]
    fn share_over_time_buckets_by_send_time() {
        let rs = vec![
            rec(0, Tag::Short, Outcome::Ok, Some(200), Some("a"), 1.0),
            rec(1, Tag::Short, Outcome::Ok, Some(200), Some("b"), 1.0),
            rec(3, Tag::Short, Outcome::Ok, Some(200), Some("b"), 1.0),
        ];
        let w = share_over_time(&rs, 2000);
        assert_eq!(w.len(), 2);
        assert_eq!(w[0]["a"], 1);
        assert_eq!(w[0]["b"], 1);
        assert_eq!(w[1]["b"], 1);
    }
}
