//! The native module's config (`ai_lb_filter_native::config::parse`: `filter`, `agents`,
//! `steering`). Properties: never panics; an accepted config's `filter` is the core's own
//! parse of that object, and every pool has at least one agent address.
#![no_main]

use ai_lb_filter_core::FilterConfig;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(cfg) = ai_lb_filter_native::config::parse(data) else {
        return;
    };
    let v: Value = serde_json::from_slice(data).expect("an accepted config is JSON");
    let filter = serde_json::to_vec(&v["filter"]).expect("a Value serialises");
    assert_eq!(FilterConfig::from_json(&filter).as_ref(), Ok(&cfg.filter));
    assert_eq!(cfg.agents.len(), cfg.filter.pools.len());
    assert!(cfg.agents.iter().all(|a| !a.is_empty()));
});
