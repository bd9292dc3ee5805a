//! The SSE / JSON usage scanner (`admission::UsageScanner`), fed the response in chunks split
//! at points taken from the input. Input: one byte `k`, then `k` split bytes (each a chunk
//! length), then the response body (its remainder is one last chunk). Properties: never
//! panics; what it finds (the last usage, how many it found, how many it could not read) does
//! not depend on where the stream was split: whole, byte by byte and at the fuzzed points all
//! agree; a non-streaming JSON body whose only `usage` is top-level reads as
//! `usage_from_json` reads it.
#![no_main]

use ai_lb_filter_core::admission::usage::usage_from_json;
use ai_lb_filter_core::admission::UsageScanner;
use libfuzzer_sys::fuzz_target;

fn outcome(s: &UsageScanner) -> (Option<ai_lb_filter_core::admission::Usage>, u32, u32) {
    (s.usage(), s.found, s.unreadable)
}

fuzz_target!(|data: &[u8]| {
    let Some((&k, rest)) = data.split_first() else {
        return;
    };
    let k = usize::from(k % 16).min(rest.len());
    let (splits, body) = rest.split_at(k);

    let mut whole = UsageScanner::new();
    whole.feed(body);

    let mut chunked = UsageScanner::new();
    let mut at = body;
    for &len in splits {
        let (chunk, tail) = at.split_at(usize::from(len).min(at.len()));
        chunked.feed(chunk);
        at = tail;
    }
    chunked.feed(at);
    assert_eq!(outcome(&chunked), outcome(&whole), "split at {splits:?}");

    let mut bytewise = UsageScanner::new();
    for b in body.chunks(1) {
        bytewise.feed(b);
    }
    assert_eq!(outcome(&bytewise), outcome(&whole), "fed byte by byte");

    // One usage object, at the top level of a JSON body with no escapes (so the one `"usage"`
    // in its bytes is that key): both readers agree.
    if whole.found == 1 && whole.unreadable == 0 && !body.contains(&b'\\') {
        if let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(body) {
            let usages = body.windows(7).filter(|w| *w == b"\"usage\"").count();
            if usages == 1 && map.contains_key("usage") {
                assert_eq!(usage_from_json(body), whole.usage());
            }
        }
    }
});
