//! The request body readers: routing (`body::routing_fields`, and `routing_fields_prefix` for
//! the first bytes of a body too large to read whole), admission cost
//! (`admission::cost::cost_from_body`: model, max_tokens, messages, multimodal parts), and the
//! prompt keying of prefix affinity (`prefix::keys::prompt_ids`, `keys_of`), plus the
//! multimodal header readers called directly on the input (`data_url_image_size`,
//! `audio_seconds`, `estimate_text_tokens`). The endpoint, the malformed-JSON policy, the
//! token cap and the block size come from the input's length, so seeds stay plain JSON.
//! Properties: never panics; the prefix scanner reads a whole body as the parser does (where
//! the parser reads it: no duplicate fields, no `\u` escapes that could spell a key) and, on
//! the body cut short (at a point taken from its length), sees no model or the whole body's;
//! `reject` refuses exactly what is not a JSON object and `passUncosted` refuses nothing; the
//! cost's output reservation is the routing reader's; a prompt keyed under a token cap is the
//! uncapped prompt cut at the cap (the bounded-cost claim of keys.rs), and so are its key
//! blocks.
#![no_main]

use ai_lb_filter_core::admission::config::{CostConfig, MalformedJsonPolicy};
use ai_lb_filter_core::admission::cost::{
    audio_seconds, cost_from_body, data_url_image_size, estimate_text_tokens, CostBasis, Endpoint,
};
use ai_lb_filter_core::body::{routing_fields, routing_fields_prefix, RoutingFields};
use ai_lb_filter_core::prefix::keys::{keys_of, prompt_ids, seed_of, PromptKeys};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const ENDPOINTS: [Endpoint; 4] = [
    Endpoint::Chat,
    Endpoint::Completions,
    Endpoint::Embeddings,
    Endpoint::Other,
];

fuzz_target!(|body: &[u8]| {
    let n = body.len();
    let routing = routing_fields(body);

    let is_object = serde_json::from_slice::<Value>(body).is_ok_and(|v| v.is_object());

    // The prefix scanner: on the whole body, and cut at a point taken from the length.
    let scanned = routing_fields_prefix(body);
    let cut = routing_fields_prefix(&body[..(n * 7 / 13).min(n)]);
    if is_object && routing != RoutingFields::default() && !body.windows(2).any(|w| w == b"\\u") {
        assert_eq!(
            scanned, routing,
            "the prefix scanner reads a whole body as the parser does"
        );
        if cut.model.is_some() {
            assert_eq!(
                cut.model, routing.model,
                "a cut body's model is the whole body's"
            );
        }
    }

    let endpoint = ENDPOINTS[n % 4];
    let policy = if (n / 4).is_multiple_of(2) {
        MalformedJsonPolicy::Reject
    } else {
        MalformedJsonPolicy::PassUncosted
    };
    let cfg = CostConfig {
        malformed_json: policy,
        ..CostConfig::default()
    };
    let cost = cost_from_body(&cfg, endpoint, body);
    match policy {
        MalformedJsonPolicy::Reject => assert_eq!(cost.is_ok(), is_object),
        MalformedJsonPolicy::PassUncosted => assert!(cost.is_ok()),
    }
    if let (Ok(c), Some(t)) = (&cost, routing.max_output_tokens) {
        if c.basis == CostBasis::Parsed && t <= u64::from(u32::MAX) {
            assert_eq!(c.output_tokens, t, "cost and routing read max_tokens alike");
        }
    }
    if let Err(e) = &cost {
        let _ = e.error_body();
    }

    // Prompt keying: capped against uncapped.
    let cap = 1 + n % 97;
    let (mut capped, mut whole) = (Vec::new(), Vec::new());
    let (model_c, found_c) = prompt_ids(body, cap, &mut capped);
    let (model_w, found_w) = prompt_ids(body, 1 << 20, &mut whole);
    assert_eq!((&model_c, found_c), (&model_w, found_w));
    assert!(capped.len() <= cap);
    assert_eq!(
        capped[..],
        whole[..whole.len().min(cap)],
        "a capped prompt is the whole prompt cut at the cap"
    );
    if let (Some(m), Some(r)) = (&model_c, &routing.model) {
        assert_eq!(m, r, "prefix keying and routing read the same model");
    }
    let block = 1 + (n / 97 % 16) as u32;
    let seed = seed_of(model_w.as_deref().unwrap_or(""));
    let (mut scratch, mut kc, mut kw) = (Vec::new(), PromptKeys::default(), PromptKeys::default());
    keys_of(&capped, seed, block, &mut scratch, &mut kc);
    keys_of(&whole, seed, block, &mut scratch, &mut kw);
    assert_eq!(kc.blocks(), capped.len() / block as usize);
    assert_eq!(kw.blocks(), whole.len() / block as usize);
    assert_eq!(kc.keys[..], kw.keys[..kc.blocks()], "key blocks chain");

    // Multimodal headers and the text estimator, on the raw input.
    if let Ok(s) = std::str::from_utf8(body) {
        let _ = data_url_image_size(s);
        for format in ["wav", "mp3", "flac"] {
            if let Some(secs) = audio_seconds(s, format) {
                assert!(secs.is_finite() && secs >= 0.0);
            }
        }
        let _ = estimate_text_tokens(s);
    }
});
