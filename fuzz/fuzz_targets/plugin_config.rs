//! The plugin config (`FilterConfig::from_json`, its `admission` and `prefixAffinity` sections
//! included). Properties: never panics; a config that parses parses to the same config again
//! from its canonical JSON (keys re-ordered, whitespace and escapes normalised), so nothing
//! depends on how the JSON was written; its `admission` section re-validates equal from
//! `AdmissionConfig::to_value`; a validated config builds a router.
#![no_main]

use ai_lb_filter_core::admission::AdmissionConfig;
use ai_lb_filter_core::{FilterConfig, Router};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let parsed = FilterConfig::from_json(data);
    let cfg = match parsed {
        Ok(c) => c,
        Err(e) => {
            // The error is what Envoy logs: it renders.
            let _ = e.to_string();
            return;
        }
    };
    if let Ok(v) = serde_json::from_slice::<Value>(data) {
        let canonical = serde_json::to_vec(&v).expect("a Value serialises");
        // Only where the canonical text reads back as the same value (serde_json's float
        // parsing may move a printed float by one ULP).
        if serde_json::from_slice::<Value>(&canonical).ok().as_ref() == Some(&v) {
            let again = FilterConfig::from_json(&canonical);
            assert_eq!(again.as_ref(), Ok(&cfg), "canonical JSON of a valid config");
        }
    }
    if let Some(adm) = &cfg.admission {
        let back = AdmissionConfig::from_value(&adm.to_value());
        assert_eq!(
            back.as_ref(),
            Ok(adm),
            "admission re-validated from to_value"
        );
    }
    let _ = Router::new(cfg);
});
