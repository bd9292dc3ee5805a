//! Decides which plugin configs an input holds: a JSON document is one config as is; YAML is
//! read as Kubernetes resources, `WasmPlugin.spec.pluginConfig` and every Envoy wasm
//! `PluginConfig` (`vm_config` next to a `google.protobuf.StringValue` `configuration`) inside
//! an `EnvoyFilter` giving one config each.

use serde::Deserialize;
use serde_json::Value;

/// One config found in an input, or a resource that should hold one but cannot be read.
#[derive(Debug, PartialEq)]
pub enum Found {
    /// The plugin config JSON, exactly as the filter would receive it.
    Config {
        resource: Option<String>,
        json: String,
    },
    /// The input or resource is broken before the filter's parser is reached.
    Broken {
        resource: Option<String>,
        reason: String,
    },
}

/// Every config in `text`; `name` decides the format (`.json` = JSON; `.yaml`/`.yml` = YAML;
/// otherwise, e.g. stdin, JSON when the text starts with `{`, else YAML).
pub fn configs_in(name: &str, text: &str) -> Vec<Found> {
    let lower = name.to_ascii_lowercase();
    let json = if lower.ends_with(".json") {
        true
    } else if lower.ends_with(".yaml") || lower.ends_with(".yml") {
        false
    } else {
        text.trim_start().starts_with('{')
    };
    if json {
        return vec![Found::Config {
            resource: None,
            json: text.to_string(),
        }];
    }
    yaml_configs(text)
}

fn yaml_configs(text: &str) -> Vec<Found> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let yaml = match serde_yaml::Value::deserialize(doc) {
            Ok(v) => v,
            Err(e) => {
                out.push(Found::Broken {
                    resource: Some(format!("document {}", i + 1)),
                    reason: format!("invalid YAML: {e}"),
                });
                // The parser cannot resynchronise after an error.
                break;
            }
        };
        if yaml.is_null() {
            continue;
        }
        let doc: Value = match serde_json::to_value(&yaml) {
            Ok(v) => v,
            Err(e) => {
                out.push(Found::Broken {
                    resource: Some(format!("document {}", i + 1)),
                    reason: format!("YAML that has no JSON equivalent: {e}"),
                });
                continue;
            }
        };
        let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
        let name = doc
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("<unnamed>");
        let resource = format!("{kind}/{name}");
        match kind {
            "WasmPlugin" => match doc.pointer("/spec/pluginConfig") {
                Some(cfg) if !cfg.is_null() => out.push(Found::Config {
                    resource: Some(resource),
                    json: cfg.to_string(),
                }),
                _ => out.push(Found::Broken {
                    resource: Some(resource),
                    reason: "spec.pluginConfig is missing: the filter would get an empty config"
                        .to_string(),
                }),
            },
            "EnvoyFilter" => {
                let mut found = Vec::new();
                if let Some(spec) = doc.get("spec") {
                    wasm_configurations(spec, "spec", &mut found);
                }
                for (path, value) in found {
                    let resource = Some(format!("{resource} {path}"));
                    match value {
                        Ok(json) => out.push(Found::Config { resource, json }),
                        Err(reason) => out.push(Found::Broken { resource, reason }),
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Collects (path, config JSON or why it is unreadable) of every wasm `PluginConfig` below `v`:
/// an object with `vm_config`/`vmConfig` and a `configuration` of type StringValue.
fn wasm_configurations(v: &Value, path: &str, out: &mut Vec<(String, Result<String, String>)>) {
    match v {
        Value::Object(map) => {
            let is_plugin = map.contains_key("vm_config") || map.contains_key("vmConfig");
            if let (true, Some(conf)) = (is_plugin, map.get("configuration")) {
                let at = format!("{path}.configuration");
                let ty = conf.get("@type").and_then(Value::as_str).unwrap_or("");
                if ty.ends_with("google.protobuf.StringValue") {
                    match conf.get("value") {
                        Some(Value::String(s)) => out.push((at, Ok(s.clone()))),
                        _ => out.push((
                            format!("{at}.value"),
                            Err("must be a string holding the plugin config JSON".to_string()),
                        )),
                    }
                } else {
                    out.push((
                        format!("{at}.@type"),
                        Err(format!(
                            "value {}: the ai-lb filter reads a \
                             type.googleapis.com/google.protobuf.StringValue configuration",
                            serde_json::to_string(ty).unwrap_or_default()
                        )),
                    ));
                }
            }
            for (k, x) in map {
                wasm_configurations(x, &format!("{path}.{k}"), out);
            }
        }
        Value::Array(items) => {
            for (i, x) in items.iter().enumerate() {
                wasm_configurations(x, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}
