//! The check-config tool's inputs (`inputs::configs_in`: a JSON config, or Kubernetes YAML
//! with WasmPlugin / EnvoyFilter resources), then the filter's parser on every config found,
//! as `ai-lb-check-config` runs them. The input's length picks the name (`.json`, `.yaml`,
//! or stdin's guess). Properties: never panics; a `.json` input is one config, its text
//! unchanged; every config found in YAML names its resource, and a WasmPlugin's is JSON text
//! (an EnvoyFilter's is whatever string its StringValue holds).
#![no_main]

use ai_lb_check_config::inputs::{configs_in, Found};
use ai_lb_filter_core::FilterConfig;
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 3] = ["config.json", "plugin.yaml", "<stdin>"];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let name = NAMES[data.len() % NAMES.len()];
    let found = configs_in(name, text);
    let json = name.ends_with(".json") || (name == "<stdin>" && text.trim_start().starts_with('{'));
    if json {
        assert_eq!(
            found,
            vec![Found::Config {
                resource: None,
                json: text.to_string()
            }]
        );
    }
    for f in &found {
        match f {
            Found::Config {
                resource,
                json: cfg,
            } => {
                if !json {
                    let r = resource
                        .as_deref()
                        .expect("a YAML config names its resource");
                    if r.starts_with("WasmPlugin/") {
                        assert!(serde_json::from_str::<serde_json::Value>(cfg).is_ok());
                    }
                }
                let _ = FilterConfig::from_json(cfg.as_bytes()).map_err(|e| e.to_string());
            }
            Found::Broken { resource, reason } => {
                assert!(resource.is_some() && !reason.is_empty());
            }
        }
    }
});
