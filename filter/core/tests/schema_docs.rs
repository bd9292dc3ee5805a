//! Decides whether docs/configuration.md documents the plugin config the code accepts: its
//! field tables are rendered from the JSON Schema (so every field, type, default and range of
//! the code appears, and nothing else), and its complete example is accepted by the parser.
//! Regenerate the tables with:
//! `UPDATE_SCHEMA=1 cargo test -p ai-lb-filter-core --features schema --test schema_docs`.

use std::fmt::Write as _;
use std::path::PathBuf;

use ai_lb_filter_core::config::{plugin_config_schema, FilterConfig};
use serde_json::Value;

const BEGIN: &str =
    "<!-- BEGIN GENERATED FIELD TABLES: do not edit, see filter/core/tests/schema_docs.rs -->";
const END: &str = "<!-- END GENERATED FIELD TABLES -->";
const REGENERATE: &str =
    "UPDATE_SCHEMA=1 cargo test -p ai-lb-filter-core --features schema --test schema_docs";

fn doc_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md")
}

/// The `$defs` entry `s` refers to (directly or through `anyOf` with null).
fn referenced<'a>(root: &'a Value, s: &'a Value) -> Option<(&'a str, &'a Value)> {
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let name = r.trim_start_matches("#/$defs/");
        return Some((name, &root["$defs"][name]));
    }
    s.get("anyOf")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().find_map(|x| referenced(root, x)))
}

/// The object definition `s` refers to, if it refers to one with properties.
fn def<'a>(root: &'a Value, s: &'a Value) -> Option<(&'a str, &'a Value)> {
    referenced(root, s).filter(|(_, d)| d.get("properties").is_some())
}

fn type_of(root: &Value, s: &Value) -> String {
    if let Some((name, _)) = def(root, s) {
        return format!("object ({name})");
    }
    if let Some((_, d)) = referenced(root, s) {
        if let Some(one_of) = d.get("oneOf").and_then(Value::as_array) {
            return one_of
                .iter()
                .filter_map(|v| v.get("const"))
                .map(|v| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(" \\| ");
        }
        return type_of(root, d);
    }
    let types: Vec<&str> = match &s["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    let t = types.into_iter().find(|t| *t != "null").unwrap_or("any");
    match t {
        "array" => format!("array of {}", type_of(root, &s["items"])),
        "object" => match s.get("additionalProperties").filter(|a| a.is_object()) {
            Some(ap) => format!("map: name → {}", type_of(root, ap)),
            None => "object".to_string(),
        },
        "string" => match s.get("enum").and_then(Value::as_array) {
            Some(e) => e
                .iter()
                .filter(|v| !v.is_null())
                .map(|v| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(" \\| "),
            None => "string".to_string(),
        },
        other => other.to_string(),
    }
}

fn range_of(s: &Value) -> String {
    let lo = match (s.get("minimum"), s.get("exclusiveMinimum")) {
        (Some(m), _) => Some(format!("[{m}")),
        (_, Some(m)) => Some(format!("({m}")),
        _ => None,
    };
    let hi = match (s.get("maximum"), s.get("exclusiveMaximum")) {
        (Some(m), _) => Some(format!("{m}]")),
        (_, Some(m)) => Some(format!("{m})")),
        _ => None,
    };
    match (lo, hi) {
        (None, None) => String::new(),
        (Some(l), None) => format!("≥ {}", l.trim_start_matches('[')).replace("≥ (", "> "),
        (None, Some(h)) => format!("≤ {h}"),
        (Some(l), Some(h)) => format!("{l}, {h}"),
    }
}

fn cell(s: &str) -> String {
    s.split('\n')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

fn render_tables(schema: &Value) -> String {
    let mut out = String::new();
    let mut queue: Vec<(String, &Value)> = vec![(String::new(), schema)];
    while let Some((path, obj)) = queue.first().cloned() {
        queue.remove(0);
        let title = if path.is_empty() {
            "Top level".to_string()
        } else {
            format!("`{path}`")
        };
        let _ = writeln!(out, "### {title}\n");
        if let Some(d) = obj.get("description").and_then(Value::as_str) {
            let _ = writeln!(out, "{}\n", cell(d));
        }
        let required: Vec<&str> = obj["required"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let _ = writeln!(out, "| Field | Type | Default | Range | Meaning |");
        let _ = writeln!(out, "|---|---|---|---|---|");
        let Some(props) = obj["properties"].as_object() else {
            continue;
        };
        for (k, p) in props {
            let default = match p.get("default") {
                Some(d) => format!("`{d}`"),
                None if required.contains(&k.as_str()) => "required".to_string(),
                None => "none".to_string(),
            };
            let desc = p.get("description").and_then(Value::as_str).unwrap_or("");
            let _ = writeln!(
                out,
                "| `{k}` | {} | {default} | {} | {} |",
                type_of(schema, p),
                range_of(p),
                cell(desc)
            );
            let child_path = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            // Nested objects get their own table; arrays and maps of objects too.
            let inner = def(schema, p).map(|(_, d)| d);
            if let Some(d) = inner {
                queue.push((child_path.clone(), d));
            } else if let Some((_, d)) = p.get("items").and_then(|i| def(schema, i)) {
                queue.push((format!("{child_path}[]"), d));
            } else if let Some((_, d)) = p.get("additionalProperties").and_then(|a| def(schema, a))
            {
                queue.push((format!("{child_path}.<name>"), d));
            }
        }
        out.push('\n');
    }
    // The same definition reached twice (e.g. score weights) is rendered once per path: fine,
    // each path is a place a user writes it.
    out.trim_end().to_string()
}

/// The reference's field tables are the schema's (the README links to them).
#[test]
fn field_tables_match_the_schema() {
    let tables = render_tables(&plugin_config_schema());
    for path in [doc_path()] {
        let doc = std::fs::read_to_string(&path).unwrap_or_default();
        let (Some(b), Some(e)) = (doc.find(BEGIN), doc.find(END)) else {
            panic!(
                "{} lacks the generated-table markers {BEGIN:?} … {END:?}",
                path.display()
            );
        };
        let current = doc[b + BEGIN.len()..e].trim();
        if std::env::var_os("UPDATE_SCHEMA").is_some() {
            let new = format!("{}{BEGIN}\n\n{tables}\n\n{}", &doc[..b], &doc[e..]);
            std::fs::write(&path, new).unwrap();
            continue;
        }
        assert!(
            current == tables,
            "{}'s field tables are out of date with the config types. Regenerate them with:\n  {REGENERATE}",
            path.display()
        );
    }
}

#[test]
fn every_schema_property_is_in_the_doc() {
    let doc = std::fs::read_to_string(doc_path()).unwrap();
    fn walk(root: &Value, s: &Value, out: &mut Vec<String>) {
        let s = def(root, s).map(|(_, d)| d).unwrap_or(s);
        if let Some(props) = s["properties"].as_object() {
            for (k, v) in props {
                out.push(k.clone());
                walk(root, v, out);
                if let Some(i) = v.get("items") {
                    walk(root, i, out);
                }
                if let Some(a) = v.get("additionalProperties").filter(|a| a.is_object()) {
                    walk(root, a, out);
                }
            }
        }
    }
    let schema = plugin_config_schema();
    let mut names = Vec::new();
    walk(&schema, &schema, &mut names);
    assert!(names.len() > 50, "schema walk found only {names:?}");
    for n in names {
        assert!(
            doc.contains(&format!("`{n}`")),
            "docs/configuration.md never mentions `{n}`"
        );
    }
}

/// The first ```json block after "## Complete example" is a config the filter accepts, with
/// admission on.
#[test]
fn complete_example_is_accepted() {
    let doc = std::fs::read_to_string(doc_path()).unwrap();
    let at = doc
        .find("## Complete example")
        .expect("docs/configuration.md has a `## Complete example` section");
    let rest = &doc[at..];
    let start = rest.find("```json\n").expect("a ```json block") + "```json\n".len();
    let len = rest[start..].find("```").expect("the block ends");
    let json = &rest[start..start + len];
    let cfg = FilterConfig::from_json(json.as_bytes())
        .unwrap_or_else(|e| panic!("the documented example is refused: {e}"));
    assert!(cfg.admission.is_some_and(|a| a.enabled));
    assert!(!cfg.pools.is_empty());
}
