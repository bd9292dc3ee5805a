//! Runs a real Envoy whose listener comes from LDS and whose `inference` and `ai_lb_agents`
//! clusters' endpoints come from EDS, each read from a file (`path_config_source` with a
//! `watched_directory`), so a test or a soak can change the plugin config (a listener update)
//! and the pods (an endpoint update) while Envoy serves, as a control plane would.
//!
//! The static config is rendered from the same templates as [`Envoy::start`]
//! (`envoy-config/envoy.yaml`, or `envoy-native.yaml` through [`EnvoyOptions::template`]), then
//! turned inside out: its `inference` listener becomes the LDS resource (on a fixed free
//! port, so every update keeps the same address), its two clusters become EDS clusters. Each
//! resource file lives alone in its own watched directory and is replaced atomically: written
//! beside the directory, then renamed into it (Envoy reloads on the move; a reader never sees
//! a half-written file). Each update waits until Envoy counts it accepted or rejected
//! (`listener_manager.lds.update_{success,rejected}`, `cluster.<name>.update_{success,rejected}`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::envoy::{free_port, scratch_dir, write_config, Envoy, EnvoyOptions, Error};

/// The clusters whose endpoints come from EDS files.
pub const EDS_CLUSTERS: [&str; 2] = ["inference", "ai_lb_agents"];

/// What Envoy did with an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Accepted,
    Rejected,
}

/// An Envoy fed by LDS and EDS files; Envoy is killed on drop.
#[derive(Debug)]
pub struct XdsEnvoy {
    pub envoy: Envoy,
    /// Holds `lds/`, `eds-<cluster>/` and the staging files.
    pub xds_dir: PathBuf,
    /// The listener resource, re-rendered with each new plugin config.
    listener: Value,
    version: u64,
    /// How long an update may take to be counted.
    pub update_timeout: Duration,
}

/// Writes `text` to `dir/name` atomically: into a staging file beside `dir` (same file
/// system), then renamed into `dir`, which is what a `watched_directory` reacts to.
pub fn write_atomically(dir: &Path, name: &str, text: &str) -> Result<(), Error> {
    let parent = dir
        .parent()
        .ok_or_else(|| format!("{} has no parent to stage in", dir.display()))?;
    let staged = parent.join(format!(
        ".{}-{name}.staged",
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("xds")
    ));
    std::fs::write(&staged, text).map_err(|e| format!("writing {}: {e}", staged.display()))?;
    let dest = dir.join(name);
    std::fs::rename(&staged, &dest)
        .map_err(|e| format!("renaming {} to {}: {e}", staged.display(), dest.display()))
}

/// A `path_config_source` for `file`, watching its directory.
fn path_source(file: &Path) -> Value {
    let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
    json!({
        "path_config_source": {
            "path": file.display().to_string(),
            "watched_directory": {"path": dir.display().to_string()}
        },
        "resource_api_version": "V3"
    })
}

/// A `ClusterLoadAssignment` discovery response for `cluster`.
pub fn eds_response(cluster: &str, addrs: &[SocketAddr], version: u64) -> Value {
    let eps: Vec<Value> = addrs
        .iter()
        .map(|a| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": a.ip().to_string(), "port_value": a.port()}}}})
        })
        .collect();
    json!({
        "version_info": version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": cluster,
            "endpoints": [{"lb_endpoints": eps}]
        }]
    })
}

/// The first HTTP filter's plugin config string of `listener` (the wasm filter's
/// `config.configuration.value`, or the dynamic module's `filter_config.value`).
fn config_slot(listener: &mut Value) -> Result<&mut Value, Error> {
    let hcm = listener
        .pointer_mut("/filter_chains/0/filters/0/typed_config")
        .ok_or("listener: no http_connection_manager in its first filter chain")?;
    let filter = hcm
        .pointer_mut("/http_filters/0/typed_config")
        .ok_or("listener: no first http filter")?;
    if filter.pointer("/config/configuration/value").is_some() {
        filter
            .pointer_mut("/config/configuration/value")
            .ok_or_else(|| "unreachable".to_string())
    } else {
        filter.pointer_mut("/filter_config/value").ok_or_else(|| {
            "listener: the first http filter is neither the wasm filter (config.configuration) \
                 nor a dynamic module (filter_config)"
                .to_string()
        })
    }
}

impl XdsEnvoy {
    /// Starts Envoy for `opts` (template, plugin config, endpoints, concurrency) with the
    /// listener from LDS and both clusters' endpoints from EDS; `extra_args` go to Envoy
    /// (e.g. `--drain-time-s 2`, so listeners replaced by updates drain in seconds rather than
    /// Envoy's default 10 minutes).
    pub fn start(opts: &EnvoyOptions, extra_args: &[String]) -> Result<XdsEnvoy, Error> {
        let dir = scratch_dir("xds")?;
        let rendered = write_config(opts, &dir)?;
        let text = std::fs::read_to_string(&rendered)
            .map_err(|e| format!("reading {}: {e}", rendered.display()))?;
        let mut boot: Value = serde_yaml::from_str(&text)
            .map_err(|e| format!("the rendered template is not YAML: {e}"))?;
        let xds_dir = dir.join("xds");
        for sub in ["lds"]
            .into_iter()
            .map(String::from)
            .chain(EDS_CLUSTERS.iter().map(|c| format!("eds-{c}")))
        {
            std::fs::create_dir_all(xds_dir.join(&sub))
                .map_err(|e| format!("creating {}: {e}", xds_dir.join(&sub).display()))?;
        }
        let statics = boot
            .get_mut("static_resources")
            .ok_or("template: no static_resources")?;
        let listeners = statics
            .as_object_mut()
            .and_then(|o| o.remove("listeners"))
            .ok_or("template: no static listeners")?;
        let mut listener = listeners
            .as_array()
            .and_then(|l| l.iter().find(|l| l["name"] == "inference"))
            .cloned()
            .ok_or("template: no `inference` listener")?;
        let port = free_port()?;
        listener["address"]["socket_address"]["port_value"] = json!(port);
        let clusters = statics
            .get_mut("clusters")
            .and_then(Value::as_array_mut)
            .ok_or("template: no static clusters")?;
        for c in clusters.iter_mut() {
            let Some(name) = c["name"].as_str().map(str::to_string) else {
                continue;
            };
            if !EDS_CLUSTERS.contains(&name.as_str()) {
                continue;
            }
            let file = xds_dir.join(format!("eds-{name}")).join("endpoints.json");
            let o = c
                .as_object_mut()
                .ok_or("template: a cluster is not a map")?;
            o.remove("load_assignment");
            o.insert("type".into(), json!("EDS"));
            o.insert(
                "eds_cluster_config".into(),
                json!({"eds_config": path_source(&file)}),
            );
        }
        let lds_file = xds_dir.join("lds").join("listeners.json");
        boot["dynamic_resources"] = json!({"lds_config": path_source(&lds_file)});
        boot["node"] = json!({"id": "ai-lb-xds-files", "cluster": "ai-lb-xds-files"});
        write_listener(&xds_dir, &listener, 1)?;
        for (cluster, addrs) in [
            ("inference", &opts.inference),
            ("ai_lb_agents", &opts.agents),
        ] {
            write_endpoints(&xds_dir, cluster, addrs, 1)?;
        }
        let config = dir.join("bootstrap.json");
        let text = serde_json::to_string_pretty(&boot).map_err(|e| e.to_string())?;
        std::fs::write(&config, text).map_err(|e| format!("writing {}: {e}", config.display()))?;
        let envoy = Envoy::start_config(
            dir,
            &config,
            opts.concurrency,
            opts.ready_timeout,
            extra_args,
        )?;
        if envoy.listener.port() != port {
            return Err(format!(
                "the LDS listener is on {} instead of port {port}",
                envoy.listener
            ));
        }
        Ok(XdsEnvoy {
            envoy,
            xds_dir,
            listener,
            version: 1,
            update_timeout: Duration::from_secs(20),
        })
    }

    /// The plugin config the listener carries now.
    pub fn filter_config(&self) -> Result<String, Error> {
        let mut l = self.listener.clone();
        Ok(config_slot(&mut l)?
            .as_str()
            .unwrap_or_default()
            .to_string())
    }

    /// Replaces the plugin config through LDS and waits until Envoy accepts or rejects the
    /// listener (a config the filter refuses is rejected: Envoy keeps the old listener). An
    /// accepted config is kept for later updates; a rejected one is not.
    pub fn set_filter_config(&mut self, config: &str) -> Result<Applied, Error> {
        let mut next = self.listener.clone();
        *config_slot(&mut next)? = json!(config);
        let before = self.lds_counts()?;
        self.version += 1;
        write_listener(&self.xds_dir, &next, self.version)?;
        let applied = self.await_update("an LDS update", before, || self.lds_counts())?;
        if applied == Applied::Accepted {
            self.listener = next;
        } else {
            // Keep the file what Envoy serves, so a later endpoint or listener update starts
            // from it.
            self.version += 1;
            let before = self.lds_counts()?;
            write_listener(&self.xds_dir, &self.listener, self.version)?;
            self.await_update("restoring the listener file", before, || self.lds_counts())?;
        }
        Ok(applied)
    }

    /// Replaces the endpoints of `cluster` (`inference` or `ai_lb_agents`) through EDS and
    /// waits until Envoy counts the update.
    pub fn set_endpoints(&mut self, cluster: &str, addrs: &[SocketAddr]) -> Result<Applied, Error> {
        if !EDS_CLUSTERS.contains(&cluster) {
            return Err(format!(
                "{cluster} is not an EDS cluster (one of {EDS_CLUSTERS:?})"
            ));
        }
        let before = self.eds_counts(cluster)?;
        self.version += 1;
        write_endpoints(&self.xds_dir, cluster, addrs, self.version)?;
        self.await_update(&format!("an EDS update of {cluster}"), before, || {
            self.eds_counts(cluster)
        })
    }

    /// (accepted, rejected) LDS updates so far.
    pub fn lds_counts(&self) -> Result<(u64, u64), Error> {
        let s = self.envoy.stats()?;
        let g = |k: &str| s.get(k).copied().unwrap_or(0);
        Ok((
            g("listener_manager.lds.update_success"),
            g("listener_manager.lds.update_rejected"),
        ))
    }

    /// (accepted, rejected) EDS updates of `cluster` so far.
    pub fn eds_counts(&self, cluster: &str) -> Result<(u64, u64), Error> {
        let s = self.envoy.stats()?;
        let g = |k: &str| {
            s.get(&format!("cluster.{cluster}.{k}"))
                .copied()
                .unwrap_or(0)
        };
        Ok((g("update_success"), g("update_rejected")))
    }

    fn await_update(
        &self,
        what: &str,
        (ok0, bad0): (u64, u64),
        counts: impl Fn() -> Result<(u64, u64), Error>,
    ) -> Result<Applied, Error> {
        crate::wait::poll(
            Instant::now() + self.update_timeout,
            Duration::from_millis(20),
            &format!("Envoy to count {what} (version {})", self.version),
            || {
                let (ok, bad) = counts()?;
                Ok(if bad > bad0 {
                    Some(Applied::Rejected)
                } else if ok > ok0 {
                    Some(Applied::Accepted)
                } else {
                    None
                })
            },
        )
        .map_err(|e| format!("{e}; envoy log:\n{}", self.envoy.log_tail(30)))
    }
}

fn write_listener(xds_dir: &Path, listener: &Value, version: u64) -> Result<(), Error> {
    let mut l = listener.clone();
    if let Some(o) = l.as_object_mut() {
        o.insert(
            "@type".into(),
            json!("type.googleapis.com/envoy.config.listener.v3.Listener"),
        );
    }
    let doc = json!({"version_info": version.to_string(), "resources": [l]});
    write_atomically(&xds_dir.join("lds"), "listeners.json", &doc.to_string())
}

fn write_endpoints(
    xds_dir: &Path,
    cluster: &str,
    addrs: &[SocketAddr],
    version: u64,
) -> Result<(), Error> {
    let doc = eds_response(cluster, addrs, version);
    write_atomically(
        &xds_dir.join(format!("eds-{cluster}")),
        "endpoints.json",
        &doc.to_string(),
    )
}
