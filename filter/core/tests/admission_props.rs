//! Properties of the admission input parsers, which see untrusted bytes inside Envoy: they
//! never panic, the estimator is monotone under concatenation (roughly additive), and the usage
//! scanner's answer does not depend on how the stream is cut into chunks.

use ai_lb_filter_core::admission::config::CostConfig;
use ai_lb_filter_core::admission::cost::{
    cost_from_body, data_url_image_size, estimate_text_tokens, Endpoint,
};
use ai_lb_filter_core::admission::usage::UsageScanner;
use proptest::prelude::*;

fn sse_stream(prompt: u64, completion: u64, deltas: &[String]) -> String {
    let mut s = String::new();
    for d in deltas {
        let chunk = serde_json::json!({"choices": [{"delta": {"content": d}}], "usage": null});
        s.push_str(&format!("data: {chunk}\n\n"));
    }
    let last = serde_json::json!({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}});
    s.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
    s
}

proptest! {
    #[test]
    fn estimator_never_panics_and_is_superadditive_within_one(a in any::<String>(), b in any::<String>()) {
        let (ea, eb) = (estimate_text_tokens(&a), estimate_text_tokens(&b));
        let joined = format!("{a}\n{b}");
        let ej = estimate_text_tokens(&joined);
        // Joining with a line break never loses more than the rounding of each part and the
        // merges at the seam.
        prop_assert!(u64::from(ej) + 3 >= u64::from(ea) + u64::from(eb), "{ea} + {eb} vs {ej}");
    }

    #[test]
    fn cost_from_arbitrary_bytes_never_panics(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = cost_from_body(&CostConfig::default(), Endpoint::Chat, &body);
    }

    #[test]
    fn cost_from_arbitrary_chat_never_panics(content in any::<String>(), url in any::<String>(), n in any::<i64>(), max in any::<i64>()) {
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": content},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{url}")}},
                {"type": "input_audio", "input_audio": {"data": url, "format": "wav"}}
            ]}],
            "n": n, "max_tokens": max
        });
        let c = cost_from_body(&CostConfig::default(), Endpoint::Chat, body.to_string().as_bytes());
        prop_assert!(c.is_ok());
        let _ = data_url_image_size(&format!("data:image/jpeg;base64,/9j/{url}"));
    }

    #[test]
    fn usage_scanner_is_independent_of_chunking(
        prompt in 0u64..1_000_000,
        completion in 0u64..100_000,
        deltas in proptest::collection::vec(any::<String>(), 0..8),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let stream = sse_stream(prompt, completion, &deltas);
        let bytes = stream.as_bytes();
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
        points.sort_unstable();
        let mut s = UsageScanner::new();
        let mut prev = 0;
        for p in points.into_iter().chain(std::iter::once(bytes.len())) {
            s.feed(&bytes[prev..p]);
            prev = p;
        }
        let u = s.usage();
        prop_assert_eq!(u.map(|u| (u.prompt_tokens, u.completion_tokens)), Some((prompt, completion)));
    }
}
