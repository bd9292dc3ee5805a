//! The llm-d endpoint-picker baseline in end-to-end runs: starts `ai-lb-epp` (one picker for a
//! pool, waiting for its `LISTENING grpc|admin` lines), reads its admin page, and renders
//! `envoy-config/envoy-epp.yaml` (Envoy with the ext_proc filter asking that picker) into
//! [`EnvoyOptions`] that [`Envoy::start`] runs. See docs/epp-baseline.md.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::envoy::{self, Envoy, EnvoyOptions, Error};
use crate::process::{Proc, Spec};

/// The picker's binary name.
pub const BIN: &str = "ai-lb-epp";

/// A running `ai-lb-epp`.
#[derive(Debug)]
pub struct Epp {
    pub proc: Proc,
    /// Its ext_proc gRPC address (Envoy's `epp` cluster).
    pub grpc: SocketAddr,
    /// Its admin page (`/stats`, `/healthz`).
    pub admin: SocketAddr,
}

/// Starts `bin` (an `ai-lb-epp` build) for `pods`, gRPC and admin on 127.0.0.1 port 0, with
/// `extra` flags (e.g. `--seed 1`, `--queue-weight 0`).
pub fn spawn_with(bin: &Path, pods: &[SocketAddr], extra: &[&str]) -> Result<Epp, Error> {
    let pods: Vec<String> = pods.iter().map(ToString::to_string).collect();
    let mut args: Vec<String> = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--admin-listen".into(),
        "127.0.0.1:0".into(),
        "--pods".into(),
        pods.join(","),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let proc = Proc::spawn(&Spec {
        name: "epp".into(),
        program: bin.to_path_buf(),
        args,
        env: Vec::new(),
        listening: vec!["grpc".into(), "admin".into()],
        deadline: crate::process::START_DEADLINE,
    })?;
    let grpc = proc.addr("grpc")?;
    let admin = proc.addr("admin")?;
    Ok(Epp { proc, grpc, admin })
}

/// Starts this workspace's `ai-lb-epp` build (debug, else release) for `pods`.
pub fn spawn(pods: &[SocketAddr], extra: &[&str]) -> Result<Epp, Error> {
    spawn_with(&envoy::workspace_bin(BIN)?, pods, extra)
}

impl Epp {
    /// The admin page `/stats` (per pod: metrics, scrape record, picks; totals: counters).
    pub fn stats(&self) -> Result<Value, Error> {
        let r = envoy::http_get(self.admin, "/stats")?;
        if r.status != 200 {
            return Err(format!("epp /stats: status {} {}", r.status, r.text()));
        }
        serde_json::from_slice(&r.body).map_err(|e| format!("epp /stats: {e}: {}", r.text()))
    }

    /// Per-pod picks (scheduled requests), in `--pods` order.
    pub fn picks(&self) -> Result<Vec<u64>, Error> {
        let s = self.stats()?;
        Ok(s["pods"]
            .as_array()
            .ok_or_else(|| format!("epp /stats without pods: {s}"))?
            .iter()
            .map(|p| p["picks"].as_u64().unwrap_or(0))
            .collect())
    }

    /// Polls `/stats` every 50 ms until `ok` holds, up to `timeout`.
    pub fn wait_until(
        &self,
        timeout: Duration,
        what: &str,
        ok: impl Fn(&Value) -> bool,
    ) -> Result<Value, Error> {
        let mut last = Value::Null;
        let every = Duration::from_millis(50);
        crate::wait::poll(Instant::now() + timeout, every, what, || {
            Ok(match self.stats() {
                Ok(s) if ok(&s) => Some(s),
                Ok(s) => {
                    last = s;
                    None
                }
                Err(_) => None,
            })
        })
        .map_err(|e| self.proc.failure(&format!("{e}; last /stats: {last}")))
    }

    /// Waits until every pod's metrics were read at least once.
    pub fn wait_scraped(&self, timeout: Duration) -> Result<Value, Error> {
        self.wait_until(timeout, "every pod scraped", |s| {
            s["pods"]
                .as_array()
                .is_some_and(|p| p.iter().all(|p| p["scraped"] == true))
        })
    }
}

/// The template `envoy-config/envoy-epp.yaml`.
pub fn template() -> Result<String, Error> {
    let p = envoy::workspace_root().join("envoy-config/envoy-epp.yaml");
    std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))
}

/// Options running `envoy-epp.yaml` in front of `pods`, its ext_proc filter asking the picker
/// at `epp` (`EPP_ENDPOINTS` rendered here; the rest by [`envoy::write_config`]).
pub fn envoy_options(epp: SocketAddr, pods: &[SocketAddr]) -> Result<EnvoyOptions, Error> {
    let t = template()?;
    if !t.contains("${EPP_ENDPOINTS}") {
        return Err("envoy-config/envoy-epp.yaml: no ${EPP_ENDPOINTS} placeholder".into());
    }
    let mut opts = EnvoyOptions::new("{}");
    opts.template = Some(t.replace("${EPP_ENDPOINTS}", &envoy::endpoints_yaml(&[epp])));
    opts.inference = pods.to_vec();
    Ok(opts)
}

/// Starts Envoy (`concurrency` workers) in front of `pods`, steered by the picker at `epp`.
pub fn start_envoy(epp: SocketAddr, pods: &[SocketAddr], concurrency: u32) -> Result<Envoy, Error> {
    let mut opts = envoy_options(epp, pods)?;
    opts.concurrency = concurrency;
    Envoy::start(&opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_renders_with_every_placeholder_filled() {
        let epp: SocketAddr = "127.0.0.1:9002".parse().unwrap();
        let pods: Vec<SocketAddr> = vec!["127.0.0.1:8001".parse().unwrap()];
        let opts = envoy_options(epp, &pods).unwrap();
        let dir = envoy::scratch_dir("epp-render").unwrap();
        let path = envoy::write_config(&opts, &dir).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(text.contains("port_value: 9002"), "{text}");
        assert!(text.contains("name: envoy.filters.http.ext_proc"));
        assert!(text.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert!(text.contains("failure_mode_allow: true"));
        assert!(text.contains("- header: x-gateway-destination-endpoint"));
    }
}
