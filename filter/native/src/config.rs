//! The native module's configuration: the wasm filter's plugin config (validated by the core,
//! unchanged) under `filter`, plus where each pool's agents listen, since a dynamic module
//! reaches them itself instead of through an Envoy cluster:
//!
//! ```json
//! {"filter": { ...envoy-config/filter-config.json... },
//!  "agents": {"default": ["127.0.0.1:9090"]},
//!  "steering": "header"}
//! ```
//!
//! `steering` (optional) says how the pick reaches Envoy's load balancer: `"header"` (default)
//! writes the ranked list into `filter.routingHeader` for a cluster on the override_host
//! policy, which also sends retries down the list; `"overrideHost"` hands the chosen pod to
//! Envoy as the stream's upstream override host, so the cluster can keep a built-in policy
//! (least_request), whose own choice then serves retries; `"both"` does both.
//!
//! Every mode and section of the wasm filter's config is run (routing, admission, the
//! big-request hold, guard mode); a config that fails validation is refused naming the field,
//! so Envoy rejects it instead of running a filter that silently ignores part of it.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use ai_lb_filter_core::config::FilterConfig;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    filter: serde_json::Value,
    agents: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    steering: Option<String>,
}

/// How the pick reaches Envoy's load balancer (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steering {
    Header,
    OverrideHost,
    Both,
}

impl Steering {
    pub fn header(self) -> bool {
        matches!(self, Steering::Header | Steering::Both)
    }
    pub fn override_host(self) -> bool {
        matches!(self, Steering::OverrideHost | Steering::Both)
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct NativeConfig {
    pub filter: FilterConfig,
    /// Per pool (config order): the agents' gRPC addresses, tried in turn.
    pub agents: Vec<Vec<SocketAddr>>,
    pub steering: Steering,
}

/// Parses and validates; errors read `ai-lb native config: field `<path>`: ...`.
pub fn parse(bytes: &[u8]) -> Result<NativeConfig, String> {
    let err = |field: &str, msg: String| format!("ai-lb native config: field `{field}`: {msg}");
    let raw: Raw = serde_json::from_slice(bytes).map_err(|e| {
        format!("ai-lb native config: {e} (expected {{\"filter\": {{...}}, \"agents\": {{\"<pool>\": [\"ip:port\"]}}}})")
    })?;
    let text = serde_json::to_vec(&raw.filter).map_err(|e| err("filter", e.to_string()))?;
    let filter = FilterConfig::from_json(&text)
        .map_err(|e| format!("ai-lb native config: in `filter`: {e}"))?;
    for name in raw.agents.keys() {
        if filter.pool_by_name(name).is_none() {
            return Err(err(
                &format!("agents.{name}"),
                format!("value {name:?}: no pool of that name in `filter.pools`"),
            ));
        }
    }
    let mut agents = Vec::new();
    for p in &filter.pools {
        let field = format!("agents.{}", p.name);
        let list = raw.agents.get(&p.name).ok_or_else(|| {
            err(
                &field,
                "missing: every pool needs its agents' addresses".into(),
            )
        })?;
        if list.is_empty() {
            return Err(err(&field, "value []: at least one agent address".into()));
        }
        let mut addrs = Vec::new();
        for (i, a) in list.iter().enumerate() {
            let addr = a.parse::<SocketAddr>().map_err(|_| {
                err(
                    &format!("{field}[{i}]"),
                    format!("value {a:?}: not an ip:port address"),
                )
            })?;
            addrs.push(addr);
        }
        agents.push(addrs);
    }
    let steering = match raw.steering.as_deref() {
        None | Some("header") => Steering::Header,
        Some("overrideHost") => Steering::OverrideHost,
        Some("both") => Steering::Both,
        Some(v) => {
            return Err(err(
                "steering",
                format!("value {v:?}: expected \"header\", \"overrideHost\" or \"both\""),
            ))
        }
    };
    // A synthetic probe reaches its pod through the routing header only (a callout has no
    // stream to set an override host on): under `overrideHost` alone the cluster keeps a
    // built-in policy, which would send the probe to any pod and judge the wrong one.
    if filter.synthetic_probe.is_some() && steering == Steering::OverrideHost {
        return Err(err(
            "steering",
            "value \"overrideHost\": `filter.breaker.syntheticProbe` needs the routing header \
             (\"header\" or \"both\", on a cluster with the override_host policy) to reach \
             the probed pod"
                .into(),
        ));
    }
    Ok(NativeConfig {
        filter,
        agents,
        steering,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILTER: &str = r#"{"pools":[{"name":"default","cluster":"inference"}]}"#;

    fn cfg(agents: &str) -> String {
        format!(r#"{{"filter":{FILTER},"agents":{agents}}}"#)
    }

    #[test]
    fn a_valid_config_keeps_the_filter_and_the_agents_per_pool() {
        let c =
            parse(cfg(r#"{"default":["127.0.0.1:9090","127.0.0.2:9091"]}"#).as_bytes()).unwrap();
        assert_eq!(c.filter.pools.len(), 1);
        assert_eq!(c.agents[0].len(), 2);
        assert_eq!(c.agents[0][1], "127.0.0.2:9091".parse().unwrap());
    }

    #[test]
    fn bad_input_names_the_field_and_the_value() {
        let e = parse(cfg(r#"{"default":["localhost"]}"#).as_bytes()).unwrap_err();
        assert!(
            e.contains("agents.default[0]") && e.contains("\"localhost\""),
            "{e}"
        );
        let e = parse(cfg(r#"{}"#).as_bytes()).unwrap_err();
        assert!(e.contains("agents.default") && e.contains("missing"), "{e}");
        let e = parse(cfg(r#"{"default":["127.0.0.1:1"],"other":["127.0.0.1:2"]}"#).as_bytes())
            .unwrap_err();
        assert!(e.contains("agents.other"), "{e}");
        let e = parse(br#"{"filter":{"pools":[]},"agents":{}}"#).unwrap_err();
        assert!(e.contains("in `filter`"), "{e}");
        let e = parse(br#"{"filter":{},"agents":{},"extra":1}"#).unwrap_err();
        assert!(e.contains("extra"), "{e}");
        let with_steering = |v: &str| {
            format!(
                r#"{{"filter":{FILTER},"agents":{{"default":["127.0.0.1:1"]}},"steering":{v}}}"#
            )
        };
        let e = parse(with_steering(r#""lb""#).as_bytes()).unwrap_err();
        assert!(e.contains("`steering`") && e.contains("\"lb\""), "{e}");
        for (v, want) in [
            (r#""header""#, Steering::Header),
            (r#""overrideHost""#, Steering::OverrideHost),
            (r#""both""#, Steering::Both),
        ] {
            assert_eq!(parse(with_steering(v).as_bytes()).unwrap().steering, want);
        }
        assert_eq!(
            parse(cfg(r#"{"default":["127.0.0.1:1"]}"#).as_bytes())
                .unwrap()
                .steering,
            Steering::Header
        );
        // A synthetic probe needs the routing header to reach its pod.
        let probing = |steering: &str| {
            format!(
                r#"{{"filter":{{"pools":[{{"name":"default","cluster":"inference"}}],"breaker":{{"syntheticProbe":{{"body":"{{}}"}}}}}},"agents":{{"default":["127.0.0.1:1"]}},"steering":{steering}}}"#
            )
        };
        let e = parse(probing(r#""overrideHost""#).as_bytes()).unwrap_err();
        assert!(
            e.contains("`steering`") && e.contains("syntheticProbe"),
            "{e}"
        );
        assert!(parse(probing(r#""both""#).as_bytes()).is_ok());
        assert!(parse(probing(r#""header""#).as_bytes()).is_ok());
    }

    #[test]
    fn every_mode_and_section_is_accepted_and_a_bad_mode_named() {
        let with = |extra: &str| {
            format!(
                r#"{{"filter":{{"pools":[{{"name":"default","cluster":"inference"}}],{extra}}},"agents":{{"default":["127.0.0.1:1"]}}}}"#
            )
        };
        assert!(parse(with(r#""bigRequestHold":{}"#).as_bytes()).is_ok());
        // Admission is accepted (the limiter, priority classes and the held queue).
        let limiter = r#""admission":{"tenants":{"default":{"tokensPerSecond":10,"burst":20}}}"#;
        if let Err(e) = parse(with(limiter).as_bytes()) {
            panic!("{e}");
        }
        assert!(parse(with(r#""admission":{"saturation":{"maxHeld":4}}"#).as_bytes()).is_ok());
        // Guard mode (the inference pod's inbound sidecar) is run too.
        let guard = parse(with(r#""mode":"guard""#).as_bytes()).unwrap();
        assert_eq!(guard.filter.mode, ai_lb_filter_core::config::Mode::Guard);
        let e = parse(with(r#""mode":"gaurd""#).as_bytes()).unwrap_err();
        assert!(e.contains("mode") && e.contains("gaurd"), "{e}");
    }
}
