//! The two data paths as the end-to-end tests drive them: how an Envoy with each starts and
//! how Envoy names its stats. The stat names are the same; Envoy prefixes them `wasmcustom.`
//! or `dynamicmodulescustom.`, and per-pod stats carry the pod in the name (wasm, turned into
//! the `ailb_endpoint` tag by envoy.yaml) or as the `ailb_endpoint` label (native).

use std::net::SocketAddr;

use ai_lb_e2e::envoy::{self, Envoy, EnvoyOptions, PodPool};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Wasm,
    Native,
}

/// Both paths, for tests that run one table of scenarios against each.
pub const BOTH: [Path; 2] = [Path::Wasm, Path::Native];

impl Path {
    pub fn prefix(self) -> &'static str {
        match self {
            Path::Wasm => "wasmcustom.",
            Path::Native => "dynamicmodulescustom.",
        }
    }

    /// The string the listener carries for the plugin config `filter` (the native module's
    /// config wraps it with every pool's agents).
    pub fn carried(self, filter: &str, agents: &[SocketAddr]) -> String {
        match self {
            Path::Wasm => filter.to_string(),
            Path::Native => envoy::native_filter_config(filter, agents).unwrap(),
        }
    }

    /// Envoy options for `filter` in front of `inference`, reading the agents at `agents`.
    pub fn opts_for(
        self,
        filter: &str,
        inference: &[SocketAddr],
        agents: &[SocketAddr],
    ) -> EnvoyOptions {
        let mut o = EnvoyOptions::new(self.carried(filter, agents));
        if self == Path::Native {
            o.template = Some(envoy::native_template().unwrap());
        }
        o.inference = inference.to_vec();
        o.agents = agents.to_vec();
        o
    }

    /// Envoy options for `filter` in front of every pod of `pool`, reading `agents`.
    pub fn opts(self, pool: &PodPool, filter: &str, agents: &[SocketAddr]) -> EnvoyOptions {
        self.opts_for(filter, &pool.pod_addrs, agents)
    }

    /// An Envoy with `filter` in front of `pool`, reading its agents.
    pub fn start(self, pool: &PodPool, filter: &str) -> Envoy {
        Envoy::start(&self.opts(pool, filter, &pool.agent_addrs)).unwrap()
    }

    /// A counter or gauge by its name without the prefix (`ailb.steered`); 0 when absent.
    pub fn stat(self, envoy: &Envoy, name: &str) -> u64 {
        envoy.stat(&format!("{}{name}", self.prefix())).unwrap_or(0)
    }

    /// The per-pod stat `metric` (`picks`, `score`, ...) of `addr` as `/stats` names it.
    pub fn pod_stat_name(self, metric: &str, addr: &str) -> String {
        match self {
            Path::Wasm => format!("wasmcustom.ailb.endpoint.{addr}.{metric}"),
            Path::Native => {
                format!("dynamicmodulescustom.ailb.endpoint.{metric}.ailb_endpoint.{addr}")
            }
        }
    }

    /// The per-pod stat `metric` of every pod of `pool`, in pod order.
    pub fn per_pod(self, envoy: &Envoy, pool: &PodPool, metric: &str) -> Vec<u64> {
        pool.pod_addrs
            .iter()
            .map(|a| {
                envoy
                    .stat(&self.pod_stat_name(metric, &a.to_string()))
                    .unwrap_or(0)
            })
            .collect()
    }

    /// The per-pod picks line of `addr` in `/stats/prometheus`.
    pub fn prometheus_picks(self, addr: &str) -> String {
        match self {
            Path::Wasm => format!("ailb_endpoint_picks{{ailb_endpoint=\"{addr}\"}}"),
            Path::Native => {
                format!(
                    "envoy_dynamicmodulescustom_ailb_endpoint_picks{{ailb_endpoint=\"{addr}\"}}"
                )
            }
        }
    }
}
