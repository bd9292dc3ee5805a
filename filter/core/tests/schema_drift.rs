//! Decides whether the committed JSON Schema of the plugin config
//! (`filter/core/plugin-config.schema.json`) still matches the config types it is generated
//! from, and whether the schema's defaults agree with what the parser actually does.
//! Regenerate with:
//! `UPDATE_SCHEMA=1 cargo test -p ai-lb-filter-core --features schema --test schema_drift`.

use std::path::PathBuf;

use ai_lb_filter_core::config::{plugin_config_schema, FilterConfig};
use serde_json::Value;

const REGENERATE: &str =
    "UPDATE_SCHEMA=1 cargo test -p ai-lb-filter-core --features schema --test schema_drift";

fn schema_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("plugin-config.schema.json")
}

fn rendered() -> String {
    let mut s = serde_json::to_string_pretty(&plugin_config_schema()).unwrap();
    s.push('\n');
    s
}

#[test]
fn committed_schema_matches_the_config_types() {
    let want = rendered();
    let path = schema_path();
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{} is out of date with the config types in filter/core/src/config.rs and \
         filter/core/src/admission/config.rs. Regenerate it with:\n  {REGENERATE}",
        path.display()
    );
}

/// Walks `properties` (following `$ref`s into `$defs`) and returns (dotted path, schema).
fn properties(root: &Value) -> Vec<(String, Value)> {
    fn resolve<'a>(root: &'a Value, s: &'a Value) -> &'a Value {
        if let Some(r) = s.get("$ref").and_then(Value::as_str) {
            let name = r.trim_start_matches("#/$defs/");
            return &root["$defs"][name];
        }
        if let Some(any) = s.get("anyOf").and_then(Value::as_array) {
            if let Some(x) = any.iter().find(|x| x.get("$ref").is_some()) {
                return resolve(root, x);
            }
        }
        s
    }
    fn walk(root: &Value, s: &Value, prefix: &str, out: &mut Vec<(String, Value)>) {
        let s = resolve(root, s);
        if let Some(props) = s.get("properties").and_then(Value::as_object) {
            for (k, v) in props {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.push((path.clone(), v.clone()));
                walk(root, v, &path, out);
                let inner = resolve(root, v);
                if let Some(items) = inner.get("items") {
                    walk(root, items, &format!("{path}[]"), out);
                }
                if let Some(ap) = inner.get("additionalProperties").filter(|a| a.is_object()) {
                    walk(root, ap, &format!("{path}.<name>"), out);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, "", &mut out);
    out
}

/// Sets `path` (dotted, no arrays) in a minimal valid config to `value`.
fn config_with(path: &str, value: &Value) -> Value {
    let mut cfg = serde_json::json!({"pools": [{"name": "llm", "cluster": "inference"}]});
    let mut cur = &mut cfg;
    let parts: Vec<&str> = path.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            cur[*part] = value.clone();
        } else {
            if cur.get(*part).is_none() {
                cur[*part] = serde_json::json!({});
            }
            cur = &mut cur[*part];
        }
    }
    cfg
}

/// Config sections (dotted paths) that are off unless present; `{}` turns one on with its
/// defaults (with [`REQUIRED_MEMBERS`] where it has some).
const OFF_UNLESS_PRESENT: [&str; 11] = [
    "admission",
    "bigRequestHold",
    "prefixAffinity",
    "breaker.recoveryRamp",
    "admission.derivedPriority",
    "admission.latencyAwareQuota",
    "breaker.adaptiveThresholds",
    "versions",
    "learnedWeights",
    "breaker.truncation",
    "breaker.syntheticProbe",
];

/// The members a section of [`OFF_UNLESS_PRESENT`] cannot be on without (no default).
const REQUIRED_MEMBERS: [(&str, &str, &str); 1] = [(
    "breaker.syntheticProbe",
    "body",
    r#"{"prompt":"ping","max_tokens":1}"#,
)];

/// Sets the section at dotted `path` to `{}` (plus its required members), creating the objects
/// above it; a section already there keeps what it has.
fn switch_on(c: &mut Value, path: &str) {
    let mut at = c;
    for key in path.split('.') {
        if !at.get(key).is_some_and(Value::is_object) {
            at[key] = serde_json::json!({});
        }
        at = &mut at[key];
    }
    for (section, member, value) in REQUIRED_MEMBERS {
        if section == path && at.get(member).is_none() {
            at[member] = Value::from(value);
        }
    }
}

/// Every documented default, written explicitly, gives the same config as leaving it out; every
/// documented bound is accepted and the value just past it is rejected naming the field.
#[test]
fn schema_defaults_and_bounds_agree_with_the_parser() {
    let schema = plugin_config_schema();
    // The sections that are off unless present (admission, bigRequestHold, prefixAffinity,
    // breaker.recoveryRamp, breaker.adaptiveThresholds, admission.derivedPriority,
    // admission.latencyAwareQuota) are on with every default in the base and in every config
    // compared with it.
    let mut on = config_with("admission", &serde_json::json!({}));
    for section in OFF_UNLESS_PRESENT {
        switch_on(&mut on, section);
    }
    let base = FilterConfig::from_json(&serde_json::to_vec(&on).unwrap()).unwrap();
    let mut checked = 0;
    for (path, prop) in properties(&schema) {
        if path.contains('[') || path.contains('<') || path.starts_with("pools") {
            continue;
        }
        let wrap = |v: &Value| {
            let mut c = config_with(&path, v);
            for section in OFF_UNLESS_PRESENT {
                // The section the property is in is on anyway; its required members are added.
                if !path.starts_with(section) || path.starts_with(&format!("{section}.")) {
                    switch_on(&mut c, section);
                }
            }
            c
        };
        if let Some(d) = prop.get("default") {
            if !d.is_null() && !d.is_object() {
                let c = FilterConfig::from_json(&serde_json::to_vec(&wrap(d)).unwrap())
                    .unwrap_or_else(|e| panic!("{path}: documented default {d} is refused: {e}"));
                assert_eq!(
                    c, base,
                    "{path}: documented default {d} differs from the parser's"
                );
                checked += 1;
            }
        }
        for (key, outside, inclusive) in [
            ("minimum", -1.0, true),
            ("maximum", 1.0, true),
            ("exclusiveMinimum", 0.0, false),
            ("exclusiveMaximum", 0.0, false),
        ] {
            let Some(bound) = prop.get(key).and_then(Value::as_f64) else {
                continue;
            };
            let integer = prop["type"].to_string().contains("integer");
            let past = if inclusive {
                if integer {
                    bound + outside
                } else {
                    bound + outside * 1e-3
                }
            } else {
                bound
            };
            if past < 0.0 && integer {
                continue; // a u64 below 0 is a type error, not a range check
            }
            let bad: Value = if integer {
                (past as i64).into()
            } else {
                past.into()
            };
            let e = FilterConfig::from_json(&serde_json::to_vec(&wrap(&bad)).unwrap())
                .err()
                .unwrap_or_else(|| {
                    panic!("{path}: {bad} is past the documented {key} {bound} but accepted")
                });
            assert!(
                e.path.starts_with(&path),
                "{path}: {bad} rejected naming {e}"
            );
            if inclusive {
                let edge: Value = if integer {
                    (bound as i64).into()
                } else {
                    bound.into()
                };
                let ok = FilterConfig::from_json(&serde_json::to_vec(&wrap(&edge)).unwrap());
                // A cap like maxCooldownMs ≥ baseCooldownMs may refuse a lone bound: only the
                // single-field ranges must accept their edge.
                if !path.ends_with("MaxMs") && !path.ends_with("maxCooldownMs") {
                    assert!(
                        ok.is_ok(),
                        "{path}: documented {key} {bound} is refused: {ok:?}"
                    );
                }
            }
            checked += 1;
        }
    }
    assert!(
        checked > 60,
        "only {checked} defaults/bounds checked: is the schema walk broken?"
    );
}
