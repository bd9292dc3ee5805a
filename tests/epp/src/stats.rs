//! Decides what the picker counts: every request outcome (picks per pod, prefix hits, the
//! answers it refused with their status) and every input it could not use (bad bodies, request
//! trailers it ignores, content blocks it skips), so nothing is dropped silently. Plain atomic
//! counters, read by the admin page.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, Value};

/// A counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The picker's counters.
#[derive(Debug, Default)]
pub struct Stats {
    /// ext_proc streams opened by Envoy.
    pub streams: Counter,
    /// Streams that ended with a gRPC error before the response went back whole.
    pub stream_errors: Counter,
    /// Streams Envoy reset after the response went back whole (how Envoy ends them).
    pub streams_reset_after_response: Counter,
    /// Streams cancelled before the response went back whole (the client went away).
    pub streams_cancelled: Counter,
    /// Requests scheduled by the profile, per pod (index in `--pods` order).
    pub picks: Vec<Counter>,
    /// Requests without a body, sent to a random pod, per pod.
    pub random_picks: Vec<Counter>,
    /// Scheduled requests whose chosen pod matched at least one block.
    pub prefix_hits: Counter,
    /// Blocks matched on the chosen pods, and blocks of the scheduled requests.
    pub prefix_matched_blocks: Counter,
    pub prefix_request_blocks: Counter,
    /// Scheduled requests that had no prompt blocks (prefix score 0 everywhere).
    pub no_prompt_blocks: Counter,
    /// Answered 503: no pod to pick from.
    pub no_pod_503: Counter,
    /// Answered 400: body or path the parser refused, or no model.
    pub bad_request_400: Counter,
    /// Answered 500: a body-less request with no pod to send it to.
    pub internal_500: Counter,
    /// Request trailers received; llm-d's handler ignores them, so does this one.
    pub request_trailers_ignored: Counter,
    /// Multimodal content blocks skipped when reading a prompt.
    pub multimodal_blocks_skipped: Counter,
    /// Messages that arrived out of order (e.g. a body before headers) and were answered as
    /// llm-d would, or ignored.
    pub unexpected_messages: Counter,
    /// Responses echoed chunk by chunk (server-sent events or `"stream": true`) and buffered
    /// whole until their end.
    pub responses_streamed: Counter,
    pub responses_buffered: Counter,
    /// Token usage read from the responses (`usage` blocks), as llm-d records it.
    pub usage_prompt_tokens: Counter,
    pub usage_completion_tokens: Counter,
}

impl Stats {
    /// Counters for a pool of `pods` pods.
    pub fn new(pods: usize) -> Stats {
        Stats {
            picks: (0..pods).map(|_| Counter::default()).collect(),
            random_picks: (0..pods).map(|_| Counter::default()).collect(),
            ..Stats::default()
        }
    }

    /// Everything but the per-pod counters, by name.
    pub fn totals(&self) -> Value {
        json!({
            "streams": self.streams.get(),
            "stream_errors": self.stream_errors.get(),
            "streams_reset_after_response": self.streams_reset_after_response.get(),
            "streams_cancelled": self.streams_cancelled.get(),
            "picks": self.picks.iter().map(Counter::get).sum::<u64>(),
            "random_picks": self.random_picks.iter().map(Counter::get).sum::<u64>(),
            "prefix_hits": self.prefix_hits.get(),
            "prefix_matched_blocks": self.prefix_matched_blocks.get(),
            "prefix_request_blocks": self.prefix_request_blocks.get(),
            "no_prompt_blocks": self.no_prompt_blocks.get(),
            "no_pod_503": self.no_pod_503.get(),
            "bad_request_400": self.bad_request_400.get(),
            "internal_500": self.internal_500.get(),
            "request_trailers_ignored": self.request_trailers_ignored.get(),
            "multimodal_blocks_skipped": self.multimodal_blocks_skipped.get(),
            "unexpected_messages": self.unexpected_messages.get(),
            "responses_streamed": self.responses_streamed.get(),
            "responses_buffered": self.responses_buffered.get(),
            "usage_prompt_tokens": self.usage_prompt_tokens.get(),
            "usage_completion_tokens": self.usage_completion_tokens.get(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_sum_the_per_pod_counters() {
        let s = Stats::new(2);
        s.picks[0].inc();
        s.picks[1].add(2);
        s.random_picks[1].inc();
        s.no_pod_503.inc();
        let t = s.totals();
        assert_eq!(t["picks"], 3);
        assert_eq!(t["random_picks"], 1);
        assert_eq!(t["no_pod_503"], 1);
        assert_eq!(t["bad_request_400"], 0);
    }
}
