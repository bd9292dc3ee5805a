//! How much one request counts: its seats, KV-cache tokens and output reservation
//! ([`RequestSize`], from its body size and `max_tokens`), and whether it is big.

use super::Router;

/// Prompt bytes per KV token in [`Router::request_size`] (English text runs ~4 characters per
/// token in the common BPE vocabularies).
const PROMPT_BYTES_PER_TOKEN: f64 = 4.0;

/// Bound of one request's KV estimate, so a huge `max_tokens` cannot overflow sums.
const MAX_REQUEST_KV_TOKENS: f64 = 1e9;

/// A request holding at least this many times the mean request's KV tokens is "big": it
/// counts as waiting for KV cache on a pod whose queue's head already waits for it (see
/// [`PodRt::pick_key`]), and among pods where it would start at once it keeps the earlier
/// draw instead of the less loaded (see [`Router::decide_for`]).
///
/// [`PodRt::pick_key`]: super::pod::PodRt::pick_key
pub(super) const BIG_KV_FACTOR: f64 = 4.0;

/// How much one request counts in a VM's in-flight estimates ([`Router::request_size`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestSize {
    /// Seats it counts for on pods that do not report their KV cache (1 = a mean request).
    pub weight: f64,
    /// KV-cache tokens it will hold at most: prompt estimate plus output reservation.
    pub kv_tokens: f64,
    /// Output tokens it reserves (`max_tokens`), 0 when unknown: decides whether it prefers
    /// the faster-decoding pod (`longOutputTokens`).
    pub output_tokens: f64,
}

impl RequestSize {
    /// A request of unknown size: one seat, no KV estimate.
    pub const UNIT: RequestSize = RequestSize {
        weight: 1.0,
        kv_tokens: 0.0,
        output_tokens: 0.0,
    };
}

impl Router {
    /// How much one request counts in this VM's in-flight estimate, from its body size (None:
    /// not known; the glue passes `content-length` when it did not read the body) and its
    /// output reservation (`max_tokens`, None when the request sets none):
    /// - `weight`: its body size over the running mean of the body sizes seen (an EWMA, so a
    ///   sidecar calibrates to its own traffic), clamped to [0.25, 16]. A 4000-token prompt
    ///   among 250-token ones counts ~16 seats on pods that do not report their KV cache: a
    ///   burst of long prompts from one sidecar spreads over pods instead of filling one pod's
    ///   KV cache before the next snapshot shows it. Body size unknown: 1.
    /// - `kv_tokens`: the KV-cache tokens it will hold at most, prompt (body bytes / 4, the
    ///   usual characters per token of English text; JSON framing counts too) plus output
    ///   reservation.
    pub fn request_size(
        &mut self,
        body_bytes: Option<usize>,
        max_output_tokens: Option<u64>,
    ) -> RequestSize {
        let prompt = body_bytes.map_or(0.0, |b| (b as f64 / PROMPT_BYTES_PER_TOKEN).ceil());
        let output = max_output_tokens
            .map_or(0.0, |t| t as f64)
            .min(MAX_REQUEST_KV_TOKENS);
        let kv_tokens = (prompt + output).min(MAX_REQUEST_KV_TOKENS);
        if max_output_tokens.is_some() {
            let m = self.mean_output_tokens.unwrap_or(output);
            self.mean_output_tokens = Some(m + 0.02 * (output - m));
        }
        let Some(b) = body_bytes else {
            return RequestSize {
                weight: 1.0,
                kv_tokens,
                output_tokens: output,
            };
        };
        let b = (b as f64).max(1.0);
        // Against the mean before this request, then fold it in.
        let mean = self.mean_body_bytes.unwrap_or(b).max(1.0);
        self.mean_body_bytes = Some(mean + 0.02 * (b - mean));
        RequestSize {
            weight: (b / mean).clamp(0.25, 16.0),
            kv_tokens,
            output_tokens: output,
        }
    }

    /// Whether a request holding `kv_tokens` is [`BIG_KV_FACTOR`] times the mean
    /// request's KV tokens (mean prompt estimate plus mean output reservation) or more; false
    /// before any sized request was seen.
    pub(super) fn kv_is_big(&self, kv_tokens: f64) -> bool {
        let Some(out) = self.mean_output_tokens else {
            return false;
        };
        let prompt = self
            .mean_body_bytes
            .map_or(0.0, |b| b / PROMPT_BYTES_PER_TOKEN);
        let mean = prompt + out;
        mean > 0.0 && kv_tokens >= BIG_KV_FACTOR * mean
    }
}
