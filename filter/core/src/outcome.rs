//! Decides which pods a finished request tells the breakers about, and how it went for each:
//! the final upstream gets the final status/flags, and the ranked entries that override_host
//! tried before it (attempt i goes to entry i) failed — Envoy only retries on 5xx, resets and
//! connect failures, so an earlier attempt that did not serve was a failure. A request the
//! client cancelled teaches nothing.

use crate::breaker::Outcome;

/// Envoy's legacy response-flag bits (`response.flags` property), envoy/stream_info/stream_info.h.
pub mod flags {
    pub const UPSTREAM_REQUEST_TIMEOUT: u64 = 0x4;
    pub const UPSTREAM_REMOTE_RESET: u64 = 0x10;
    pub const UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
    pub const UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;
    pub const DOWNSTREAM_CONNECTION_TERMINATION: u64 = 0x4000;
}

/// What the glue saw of one finished request.
#[derive(Debug, Clone, Default)]
pub struct Observed<'a> {
    /// The routing header value written (`a,b,c`), empty when nothing was steered.
    pub ranked: &'a str,
    /// Final upstream host (`upstream.address`).
    pub upstream: Option<&'a str>,
    /// Final HTTP status.
    pub status: Option<u16>,
    /// `response.flags`.
    pub flags: u64,
    /// `response.code_details`.
    pub details: &'a str,
    /// `x-envoy-attempt-count` of the response.
    pub attempts: Option<u32>,
    pub ttft_ms: Option<u64>,
    pub total_ms: Option<u64>,
}

/// The final attempt's outcome.
pub fn final_outcome(o: &Observed<'_>) -> Outcome {
    let d = o.details;
    Outcome {
        status: o.status,
        reset: o.flags & (flags::UPSTREAM_REMOTE_RESET | flags::UPSTREAM_CONNECTION_TERMINATION)
            != 0
            || d.contains("remote_reset")
            || d.contains("upstream_reset_after_response_started"),
        connect_failure: o.flags & flags::UPSTREAM_CONNECTION_FAILURE != 0
            || d.contains("connection_failure"),
        timeout: o.flags & flags::UPSTREAM_REQUEST_TIMEOUT != 0
            || d.contains("upstream_response_timeout"),
        ttft_ms: o.ttft_ms,
        total_ms: o.total_ms,
        malformed: false,
    }
}

/// An attempt that was retried: a failure of unknown kind, counted as a server error.
pub fn retried_outcome() -> Outcome {
    Outcome {
        status: Some(503),
        ..Outcome::default()
    }
}

/// `(pod, outcome)` pairs to feed the breakers, final upstream first.
pub fn attribute<'a>(o: &Observed<'a>) -> Vec<(&'a str, Outcome)> {
    let mut out = Vec::new();
    if o.flags & flags::DOWNSTREAM_CONNECTION_TERMINATION != 0
        || o.details.contains("downstream_remote_disconnect")
    {
        return out;
    }
    let ranked: Vec<&str> = o
        .ranked
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let attempts = o.attempts.unwrap_or(1).max(1) as usize;
    let final_pod = o.upstream.or_else(|| ranked.get(attempts - 1).copied());
    if let Some(p) = final_pod {
        out.push((p, final_outcome(o)));
    }
    // Earlier attempts went to entries 0..attempts-1; without an attempt count, only the
    // chosen entry is known to have been tried.
    let earlier = match o.attempts {
        Some(_) => attempts - 1,
        None => 1,
    };
    for p in ranked.iter().take(earlier) {
        if Some(*p) != final_pod && !out.iter().any(|(q, _)| q == p) {
            out.push((p, retried_outcome()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs<'a>(ranked: &'a str, upstream: Option<&'a str>, attempts: Option<u32>) -> Observed<'a> {
        Observed {
            ranked,
            upstream,
            status: Some(200),
            attempts,
            ..Observed::default()
        }
    }

    #[test]
    fn a_first_attempt_success_touches_only_the_chosen_pod() {
        let got = attribute(&obs("a:1,b:1,c:1", Some("a:1"), Some(1)));
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, "a:1");
        assert_eq!(got[0].1.status, Some(200));
    }

    #[test]
    fn retried_attempts_count_as_failures_of_the_earlier_entries() {
        let got = attribute(&obs("a:1,b:1,c:1", Some("c:1"), Some(3)));
        let pods: Vec<&str> = got.iter().map(|(p, _)| *p).collect();
        assert_eq!(pods, ["c:1", "a:1", "b:1"]);
        assert_eq!(got[1].1.status, Some(503));
        assert_eq!(got[2].1.status, Some(503));
    }

    #[test]
    fn without_attempt_count_only_the_chosen_pod_is_blamed() {
        let got = attribute(&obs("a:1,b:1,c:1", Some("c:1"), None));
        let pods: Vec<&str> = got.iter().map(|(p, _)| *p).collect();
        assert_eq!(pods, ["c:1", "a:1"]);
    }

    #[test]
    fn unsteered_requests_teach_about_the_final_upstream_only() {
        let got = attribute(&obs("", Some("z:9"), Some(2)));
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, "z:9");
    }

    #[test]
    fn client_cancels_teach_nothing() {
        let mut o = obs("a:1", Some("a:1"), Some(1));
        o.flags = flags::DOWNSTREAM_CONNECTION_TERMINATION;
        assert!(attribute(&o).is_empty());
    }

    #[test]
    fn flags_and_details_map_to_outcome_kinds() {
        let mut o = obs("a:1", Some("a:1"), Some(1));
        o.status = Some(503);
        o.flags = flags::UPSTREAM_CONNECTION_FAILURE;
        assert!(final_outcome(&o).connect_failure);
        o.flags = 0;
        o.details = "upstream_reset_before_response_started{remote_reset}";
        assert!(final_outcome(&o).reset);
        o.details = "upstream_response_timeout";
        assert!(final_outcome(&o).timeout);
    }
}
