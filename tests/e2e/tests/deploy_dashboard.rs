//! Decides whether the Grafana dashboard (envoy-config/grafana/ai-lb-dashboard.json) is usable
//! as provisioned: it parses, every panel has a datasource and at least one query, panels fit
//! the 24-column grid without overlapping, and every metric it names is one the filter or the
//! agent actually exports (checked against their source, so a renamed metric breaks this test
//! rather than silently emptying a panel).

mod deploy_support;

use std::collections::BTreeSet;

use deploy_support::*;
use serde_json::Value;

fn dashboard() -> Value {
    let path = repo_root().join("envoy-config/grafana/ai-lb-dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn panels(d: &Value) -> Vec<Value> {
    d["panels"].as_array().cloned().unwrap_or_default()
}

#[test]
fn every_panel_has_a_datasource_and_a_query() {
    let d = dashboard();
    assert_eq!(
        d["uid"].as_str(),
        Some("ai-lb"),
        "a stable uid keeps links working"
    );
    let ps = panels(&d);
    assert!(
        ps.len() >= 8,
        "expected the ai-lb panels, found {}",
        ps.len()
    );
    let mut ids = BTreeSet::new();
    for p in &ps {
        let title = p["title"].as_str().unwrap_or("?");
        assert!(
            ids.insert(p["id"].as_u64()),
            "duplicate panel id in {title}"
        );
        let ds = &p["datasource"];
        assert!(
            ds["uid"].as_str().is_some() && ds["type"].as_str().is_some(),
            "panel {title}: no datasource"
        );
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        assert!(!targets.is_empty(), "panel {title}: no target");
        let mut refs = BTreeSet::new();
        for t in &targets {
            let expr = t["expr"].as_str().unwrap_or_default();
            assert!(!expr.trim().is_empty(), "panel {title}: empty query");
            assert!(
                refs.insert(t["refId"].as_str().unwrap_or_default().to_string()),
                "panel {title}: duplicate refId"
            );
            assert_eq!(
                expr.matches('(').count(),
                expr.matches(')').count(),
                "panel {title}: unbalanced ( ) in {expr}"
            );
        }
    }
}

#[test]
fn panels_fit_the_grid_without_overlap() {
    let ps = panels(&dashboard());
    let rects: Vec<(String, u64, u64, u64, u64)> = ps
        .iter()
        .map(|p| {
            let g = &p["gridPos"];
            let n = |k: &str| {
                g[k].as_u64()
                    .unwrap_or_else(|| panic!("panel {:?}: gridPos.{k}", p["title"]))
            };
            (
                p["title"].as_str().unwrap_or("?").to_string(),
                n("x"),
                n("y"),
                n("w"),
                n("h"),
            )
        })
        .collect();
    for (t, x, _, w, h) in &rects {
        assert!(
            x + w <= 24 && *w > 0 && *h > 0,
            "panel {t} does not fit the 24-column grid"
        );
    }
    for (i, a) in rects.iter().enumerate() {
        for b in rects.iter().skip(i + 1) {
            let overlap = a.1 < b.1 + b.3 && b.1 < a.1 + a.3 && a.2 < b.2 + b.4 && b.2 < a.2 + a.4;
            assert!(!overlap, "panels {} and {} overlap", a.0, b.0);
        }
    }
}

/// Metric names in a PromQL query: identifiers outside label matchers `{...}`, strings and
/// grouping lists (`by (...)`, `without`, `on`, `ignoring`, `group_left/right`), that are not
/// function calls or keywords; only ai-lb's, the agent's and Envoy's prefixes are kept.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const GROUPING: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const KEYWORDS: [&str; 5] = ["and", "or", "unless", "bool", "offset"];
    let mut out = BTreeSet::new();
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    let mut braces = 0usize;
    let mut in_quotes = false;
    let mut skip_group = false;
    while i < chars.len() {
        let c = chars[i];
        if in_quotes {
            in_quotes = c != '"';
            i += 1;
            continue;
        }
        match c {
            '"' => in_quotes = true,
            '{' => braces += 1,
            '}' => braces = braces.saturating_sub(1),
            ')' if skip_group => skip_group = false,
            _ => {}
        }
        if (c.is_ascii_lowercase() || c == '_') && braces == 0 && !skip_group {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace()).copied();
            if GROUPING.contains(&word.as_str()) {
                skip_group = next == Some('(');
            } else if next != Some('(')
                && !KEYWORDS.contains(&word.as_str())
                && ["ailb_", "ai_lb_agent_", "envoy_"]
                    .iter()
                    .any(|p| word.starts_with(p))
            {
                out.insert(word);
            }
            continue;
        }
        i += 1;
    }
    out
}

fn source_text(rel_dir: &str) -> String {
    files_with_ext(&repo_root().join(rel_dir), &[".rs"])
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .collect::<Vec<_>>()
        .join("\n")
}

/// All spellings of `name` with each `_` kept or turned into `.` (Envoy names use dots, the
/// Prometheus export turns them into underscores).
fn dotted_variants(name: &str) -> Vec<String> {
    let parts: Vec<&str> = name.split('_').collect();
    let n = parts.len().saturating_sub(1).min(10);
    (0..(1u32 << n))
        .map(|mask| {
            let mut s = parts.first().copied().unwrap_or_default().to_string();
            for (i, p) in parts.iter().enumerate().skip(1) {
                s.push(if mask & (1 << (i - 1)) != 0 { '.' } else { '_' });
                s.push_str(p);
            }
            s
        })
        .collect()
}

#[test]
fn every_metric_named_is_exported_by_the_filter_or_the_agent() {
    let d = dashboard();
    let filter_src = source_text("filter/wasm/src") + &source_text("filter/core/src");
    let agent_src = source_text("collector-agent/src");
    let mut checked = 0;
    for p in panels(&d) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            for m in metric_names(expr) {
                checked += 1;
                if let Some(rest) = m.strip_prefix("ai_lb_agent_") {
                    assert!(
                        agent_src.contains(&format!("\"ai_lb_agent_{rest}\"")),
                        "panel {:?}: the agent exports no {m}",
                        p["title"]
                    );
                } else if let Some(pod_metric) = m.strip_prefix("ailb_endpoint_") {
                    assert!(
                        filter_src.contains(&format!("name(\"{pod_metric}\")")),
                        "panel {:?}: the filter defines no per-pod metric {pod_metric} (ailb.endpoint.<pod>.{pod_metric})",
                        p["title"]
                    );
                } else if let Some(rest) = m.strip_prefix("ailb_") {
                    let found = dotted_variants(rest).iter().any(|v| {
                        [
                            format!("\"ailb.{v}\""),
                            format!("\"ailb.{v}."),
                            format!("(\"{v}\""),
                            format!("(\"{v}."),
                        ]
                        .iter()
                        .any(|needle| filter_src.contains(needle.as_str()))
                    });
                    assert!(
                        found,
                        "panel {:?}: the filter exports no metric named like {m}",
                        p["title"]
                    );
                }
            }
        }
    }
    assert!(
        checked >= 10,
        "expected to check the panels' metric names, checked {checked}"
    );
}

#[test]
fn metric_name_extraction_skips_functions_labels_and_strings() {
    let names = metric_names(
        r#"sum by (ailb_endpoint, envoy_x) (rate(ailb_endpoint_picks{ailb_endpoint="ailb_x"}[1m])) / ignoring(ailb_endpoint) group_left sum(rate(envoy_cluster_upstream_rq_retry[1m])) + histogram_quantile(0.99, ai_lb_agent_y)"#,
    );
    assert_eq!(
        names,
        BTreeSet::from([
            "ai_lb_agent_y".to_string(),
            "ailb_endpoint_picks".to_string(),
            "envoy_cluster_upstream_rq_retry".to_string()
        ])
    );
}
