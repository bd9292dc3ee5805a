//! The agent's KV-event reader: a model server's msgpack payload (`kv_events::wire::
//! decode_batch`, both encodings vLLM has used) and the view of the pod's prefix cache built
//! from its events (`kv_events::view::PrefixView::apply`, `summary`). Properties: never
//! panics; a decoded payload decodes the same as the third frame of a message; a summary's
//! keys are ascending, without duplicates and within the budget; a clear empties the view.
#![no_main]

use ai_lb_agent::kv_events::view::PrefixView;
use ai_lb_agent::kv_events::wire::{decode_batch, decode_message, Event};
use ai_lb_agent::kv_events::DEFAULT_BLOCK_TOKENS;
use libfuzzer_sys::fuzz_target;

const MAX_KEYS: usize = 64;

fuzz_target!(|data: &[u8]| {
    let batch = decode_batch(data);
    let seq = 7u64.to_be_bytes();
    let msg = decode_message(&[b"kv".as_slice(), seq.as_slice(), data]);
    // Compared as text: a NaN timestamp is not equal to itself.
    assert_eq!(format!("{:?}", msg.map(|m| m.batch)), format!("{batch:?}"));
    let Ok(batch) = batch else {
        return;
    };
    let small = 1 + (data.len() % 32) as u32;
    for block_tokens in [DEFAULT_BLOCK_TOKENS, small] {
        let mut view = PrefixView::new(block_tokens, MAX_KEYS);
        for ev in batch.events.iter().flatten() {
            view.apply(ev);
            if *ev == Event::Cleared {
                assert_eq!(view.blocks(), 0);
            }
        }
        if let Ok(s) = view.summary(ai_lb_prefix::model_seed("m")) {
            assert!(s.keys.len() <= MAX_KEYS);
            assert!(
                s.keys.windows(2).all(|w| w[0] < w[1]),
                "keys ascending, unique"
            );
        }
    }
});
