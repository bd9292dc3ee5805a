//! The local demo's data path and numbers (`src/bin/ai-lb-demo.rs`), kept here so that tests
//! can run and check them (`tests/demo_counters.rs`): how Envoy is started for the wasm filter
//! or the native module, the traffic, and every count the live table and the end-of-run
//! summary show.
//!
//! Counts come from Envoy's own stats (`/stats?format=json` on the admin port), which sum every
//! worker's. The status page answers from whichever worker took the request (its `worker`
//! field says which), and each worker has its own router and counters: a summary read from it
//! once said `steered: 519` while the table, from Envoy's stats, said 861, and
//! `breaker.closed: 0` after a breaker had opened and closed (issue 31).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::envoy::{
    native_filter_config, native_template, workspace_bin, Envoy, EnvoyOptions, Error, HttpClient,
};

/// Which of ai-lb's two data paths runs in Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPath {
    /// The proxy-wasm filter (`filter/wasm`, `envoy-config/envoy.yaml`).
    Wasm,
    /// The Envoy dynamic module (`filter/native`, `envoy-config/envoy-native.yaml`).
    Native,
}

impl DataPath {
    /// In words, for the demo's output.
    pub fn name(self) -> &'static str {
        match self {
            DataPath::Wasm => "the ai-lb wasm filter (envoy-config/envoy.yaml)",
            DataPath::Native => "the ai-lb native module (envoy-config/envoy-native.yaml)",
        }
    }

    /// What Envoy puts before the filter's own stat names.
    pub fn stat_prefix(self) -> &'static str {
        match self {
            DataPath::Wasm => "wasmcustom.",
            DataPath::Native => "dynamicmodulescustom.",
        }
    }

    /// The full name of the filter's stat `ailb.<name>`.
    pub fn stat(self, name: &str) -> String {
        format!("{}ailb.{name}", self.stat_prefix())
    }

    /// The full name of pod `addr`'s pick counter: the wasm filter puts the pod in the name
    /// (`ailb.endpoint.<addr>.picks`, a stats_tag makes it a label), the native module gives
    /// `ailb.endpoint.picks` the label `ailb_endpoint`.
    pub fn picks_stat(self, addr: &str) -> String {
        match self {
            DataPath::Wasm => self.stat(&format!("endpoint.{addr}.picks")),
            DataPath::Native => self.stat(&format!("endpoint.picks.ailb_endpoint.{addr}")),
        }
    }
}

/// What the native module does not run (`filter/native/src/config.rs` refuses each): the
/// field, and what the demo says when it drops it.
const NATIVE_LACKS: &[(&str, &str)] = &[
    ("admission", "admission control is wasm-only"),
    ("bigRequestHold", "the big-request hold is wasm-only"),
];

/// The plugin config `filter_json` without what the native module does not run (admission,
/// the big-request hold, the guard mode), and a note naming each part dropped.
pub fn native_subset(filter_json: &str) -> Result<(String, Vec<String>), Error> {
    let mut v: Value =
        serde_json::from_str(filter_json).map_err(|e| format!("filter config: {e}"))?;
    let obj = v
        .as_object_mut()
        .ok_or("filter config: expected a JSON object")?;
    let mut notes = Vec::new();
    for (field, why) in NATIVE_LACKS {
        if obj.remove(*field).is_some_and(|x| !x.is_null()) {
            notes.push(format!(
                "`{field}` dropped for the native run: {why} (run without --native to keep it)"
            ));
        }
    }
    if obj.get("mode").and_then(Value::as_str) == Some("guard") {
        obj.remove("mode");
        notes.push(
            "`mode: guard` dropped for the native run: the guard is wasm-only; the module routes"
                .to_string(),
        );
    }
    Ok((v.to_string(), notes))
}

/// Envoy's options for `path` in front of `pods` (the `inference` cluster) and their `agents`,
/// with the plugin config `filter_json`; for the native module, also a note for each part of
/// the config it does not run (dropped, see [`native_subset`]).
pub fn envoy_options(
    path: DataPath,
    filter_json: &str,
    pods: &[SocketAddr],
    agents: &[SocketAddr],
) -> Result<(EnvoyOptions, Vec<String>), Error> {
    let (mut opts, notes) = match path {
        DataPath::Wasm => (EnvoyOptions::new(filter_json), Vec::new()),
        DataPath::Native => {
            let (filter, notes) = native_subset(filter_json)?;
            let mut opts = EnvoyOptions::new(native_filter_config(&filter, agents)?);
            opts.template = Some(native_template()?);
            (opts, notes)
        }
    };
    opts.inference = pods.to_vec();
    opts.agents = agents.to_vec();
    Ok((opts, notes))
}

/// The load generator's workloads the demo runs, with the flags that shape them.
pub const WORKLOADS: &[(&str, &[&str])] = &[
    (
        "shared-prefix",
        &[
            "--groups",
            "6",
            "--system-tokens",
            "1500",
            "--question-tokens",
            "150",
            "--answer-tokens",
            "120",
        ],
    ),
    (
        "multi-turn",
        &[
            "--groups",
            "6",
            "--question-tokens",
            "150",
            "--answer-tokens",
            "120",
        ],
    ),
    ("sharegpt", &[]),
];

/// Starts the load generator: `workload` at `rate` requests a second for `duration_s` seconds
/// against `listener`, its summary written to `json`. It dies with the calling thread.
pub fn spawn_loadgen(
    listener: SocketAddr,
    rate: f64,
    duration_s: u64,
    workload: &str,
    json: &Path,
) -> Result<Child, Error> {
    let bin = workspace_bin("ai-lb-loadgen")?;
    let shape = WORKLOADS
        .iter()
        .find(|(w, _)| *w == workload)
        .map_or(&[][..], |(_, f)| *f);
    let mut cmd = Command::new(&bin);
    crate::process::die_with_parent(&mut cmd)
        .args(shape)
        .args([
            "--url".to_string(),
            format!("http://{listener}"),
            "--rate".into(),
            rate.to_string(),
            "--duration".into(),
            format!("{duration_s}s"),
            "--workload".into(),
            workload.to_string(),
            "--seed".into(),
            "7".into(),
            "--timeout".into(),
            "30s".into(),
            "--json".into(),
            json.display().to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start {}: {e}", bin.display()))
}

/// Monitoring calls must not stall the table.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Envoy's counters and gauges from `/stats?format=json` on its admin port (each the sum over
/// every worker), by full name; histograms are skipped.
pub fn read_stats(admin: SocketAddr) -> Result<BTreeMap<String, u64>, Error> {
    let r = HttpClient::new(admin)
        .with_timeout(PROBE_TIMEOUT)
        .get("/stats?format=json", &[("connection", "close")])?;
    if r.status != 200 {
        return Err(format!("/stats?format=json: {} {}", r.status, r.text()));
    }
    let v: Value =
        serde_json::from_slice(&r.body).map_err(|e| format!("/stats?format=json: {e}"))?;
    Ok(v["stats"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s["name"].as_str()?.to_string(), s["value"].as_u64()?)))
        .collect())
}

/// The filter's prefix-affinity counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixCounts {
    pub keyed: u64,
    pub hit: u64,
    pub spill: u64,
    pub rendezvous: u64,
    pub blocks: u64,
    pub blocks_held: u64,
}

/// The filter's counts over every worker, as Envoy's stats have them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Per pod (serving address): requests steered to it (`ailb.endpoint.picks`).
    pub picks: BTreeMap<String, u64>,
    /// `ailb.steered`: requests the filter steered to a pod it chose.
    pub steered: u64,
    /// `ailb.fail_open`: requests steered over every pod when too few passed the cut-offs.
    pub fail_open: u64,
    /// `ailb.steer_failed`: picks that could not be handed to Envoy.
    pub steer_failed: u64,
    /// `ailb.fallback.<reason>`: requests left to Envoy's own balancing.
    pub fallbacks: BTreeMap<String, u64>,
    /// `ailb.breaker_opened.<reason>`.
    pub opened: BTreeMap<String, u64>,
    /// `ailb.breaker_half_opened`.
    pub half_opened: u64,
    /// `ailb.breaker_closed`.
    pub closed: u64,
    pub prefix: PrefixCounts,
}

impl Counts {
    /// The counts of `path` for `pods` in `stats` (full names, as from [`read_stats`]).
    pub fn from_stats(
        path: DataPath,
        pods: &[SocketAddr],
        stats: &BTreeMap<String, u64>,
    ) -> Counts {
        let get = |name: &str| stats.get(&path.stat(name)).copied().unwrap_or(0);
        let by_reason = |family: &str| -> BTreeMap<String, u64> {
            let head = path.stat(&format!("{family}."));
            stats
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix(&head)?.to_string(), *v)))
                .collect()
        };
        Counts {
            picks: pods
                .iter()
                .map(|a| {
                    let a = a.to_string();
                    let n = stats.get(&path.picks_stat(&a)).copied().unwrap_or(0);
                    (a, n)
                })
                .collect(),
            steered: get("steered"),
            fail_open: get("fail_open"),
            steer_failed: get("steer_failed"),
            fallbacks: by_reason("fallback"),
            opened: by_reason("breaker_opened"),
            half_opened: get("breaker_half_opened"),
            closed: get("breaker_closed"),
            prefix: PrefixCounts {
                keyed: get("prefix.keyed"),
                hit: get("prefix.hit"),
                spill: get("prefix.spill"),
                rendezvous: get("prefix.rendezvous"),
                blocks: get("prefix.blocks"),
                blocks_held: get("prefix.blocks_held"),
            },
        }
    }

    /// Reads them from `envoy` now.
    pub fn read(envoy: &Envoy, path: DataPath, pods: &[SocketAddr]) -> Result<Counts, Error> {
        Ok(Counts::from_stats(path, pods, &read_stats(envoy.admin)?))
    }

    /// What was counted since `base` (an earlier reading of the same Envoy).
    pub fn since(&self, base: &Counts) -> Counts {
        let sub = |a: u64, b: u64| a.saturating_sub(b);
        let sub_map = |m: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>| {
            m.iter()
                .map(|(k, v)| (k.clone(), sub(*v, b.get(k).copied().unwrap_or(0))))
                .collect()
        };
        let (p, q) = (&self.prefix, &base.prefix);
        Counts {
            picks: sub_map(&self.picks, &base.picks),
            steered: sub(self.steered, base.steered),
            fail_open: sub(self.fail_open, base.fail_open),
            steer_failed: sub(self.steer_failed, base.steer_failed),
            fallbacks: sub_map(&self.fallbacks, &base.fallbacks),
            opened: sub_map(&self.opened, &base.opened),
            half_opened: sub(self.half_opened, base.half_opened),
            closed: sub(self.closed, base.closed),
            prefix: PrefixCounts {
                keyed: sub(p.keyed, q.keyed),
                hit: sub(p.hit, q.hit),
                spill: sub(p.spill, q.spill),
                rendezvous: sub(p.rendezvous, q.rendezvous),
                blocks: sub(p.blocks, q.blocks),
                blocks_held: sub(p.blocks_held, q.blocks_held),
            },
        }
    }

    /// Every pod's picks together.
    pub fn picks_total(&self) -> u64 {
        self.picks.values().sum()
    }

    /// Breaker opens of every reason together.
    pub fn opened_total(&self) -> u64 {
        self.opened.values().sum()
    }

    /// The picks the per-pod counters must add up to once every worker has added its own:
    /// every request steered, fail-opens too (they are steered over every pod), less those
    /// whose pick could not be handed to Envoy.
    pub fn picks_due(&self) -> u64 {
        (self.steered + self.fail_open).saturating_sub(self.steer_failed)
    }
}

/// How long the counts must stay still before [`settle`] trusts them: several of the wasm
/// filter's exports (every 200 ms per worker).
const STILL_FOR: Duration = Duration::from_secs(1);

/// Waits, after the traffic has stopped, until Envoy's counts of `path` have settled, and
/// returns them: every pick is counted for its pod (the per-pod picks add up to
/// [`Counts::picks_due`]) and nothing changed for [`STILL_FOR`]. The native module adds a
/// worker's per-pod counts at most once a second, on a request that worker handles, so each
/// poll also asks for the status page (`status_path`, answered by the filter, never steered)
/// on a connection of its own, which the kernel hands to any worker. Fails at `timeout` with
/// the last counts.
pub fn settle(
    envoy: &Envoy,
    path: DataPath,
    pods: &[SocketAddr],
    status_path: &str,
    timeout: Duration,
) -> Result<Counts, Error> {
    let deadline = Instant::now() + timeout;
    let mut last: Option<(Counts, Instant)> = None;
    let mut seen = Counts::default();
    let got = crate::wait::poll(
        deadline,
        Duration::from_millis(100),
        "counts to settle",
        || {
            let _ = HttpClient::new(envoy.listener)
                .with_timeout(PROBE_TIMEOUT)
                .get(status_path, &[("connection", "close")]);
            let now = Counts::read(envoy, path, pods)?;
            seen = now.clone();
            let still_since = match &last {
                Some((c, since)) if *c == now => *since,
                _ => Instant::now(),
            };
            last = Some((now.clone(), still_since));
            let settled =
                now.picks_total() == now.picks_due() && still_since.elapsed() >= STILL_FOR;
            Ok(settled.then_some(now))
        },
    );
    got.map_err(|e| {
        format!(
            "{e}: per-pod picks {} (expected {}: steered {} + fail-open {} - not handed {}), {seen:?}",
            seen.picks_total(),
            seen.picks_due(),
            seen.steered,
            seen.fail_open,
            seen.steer_failed
        )
    })
}

/// The live table's share columns: per pod, the requests steered to it in the last interval
/// and since the start, from Envoy's stats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shares {
    /// Per pod (serving address): (last interval, since the start).
    pub per_pod: BTreeMap<String, (u64, u64)>,
    pub sum_last: u64,
    pub sum_total: u64,
}

impl Shares {
    /// From the counts `now`, those of the previous tick `last`, and those at the `start`.
    pub fn new(now: &Counts, last: &Counts, start: &Counts) -> Shares {
        let in_last = now.since(last);
        let total = now.since(start);
        let per_pod: BTreeMap<String, (u64, u64)> = now
            .picks
            .keys()
            .map(|a| {
                let l = in_last.picks.get(a).copied().unwrap_or(0);
                let t = total.picks.get(a).copied().unwrap_or(0);
                (a.clone(), (l, t))
            })
            .collect();
        Shares {
            sum_last: per_pod.values().map(|(l, _)| l).sum(),
            sum_total: per_pod.values().map(|(_, t)| t).sum(),
            per_pod,
        }
    }
}

/// The end-of-run summary: what the filter did over the run, every worker's counts together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The counts since the start.
    pub counts: Counts,
    /// False when the counts did not settle in time (the summary says so): a worker may not
    /// have added its last per-pod counts.
    pub settled: bool,
}

impl Summary {
    /// Settles the counts after the traffic ([`settle`], up to `timeout`) and takes those of
    /// `start` away.
    pub fn after_traffic(
        envoy: &Envoy,
        path: DataPath,
        pods: &[SocketAddr],
        status_path: &str,
        start: &Counts,
        timeout: Duration,
    ) -> Result<Summary, Error> {
        let (end, settled) = match settle(envoy, path, pods, status_path, timeout) {
            Ok(c) => (c, true),
            Err(_) => (Counts::read(envoy, path, pods)?, false),
        };
        Ok(Summary {
            counts: end.since(start),
            settled,
        })
    }

    /// The summary's lines; `name` names a pod by its address.
    pub fn lines(&self, name: impl Fn(&str) -> String) -> Vec<String> {
        let c = &self.counts;
        let mut out = Vec::new();
        let mut named: Vec<(String, u64)> = c.picks.iter().map(|(a, n)| (name(a), *n)).collect();
        named.sort();
        let pods: Vec<String> = named.iter().map(|(a, n)| format!("{a} {n}")).collect();
        out.push(format!(
            "steered by ai-lb: {} requests (per pod: {}; together {})",
            c.steered,
            pods.join(", "),
            c.picks_total()
        ));
        if c.fail_open > 0 || c.steer_failed > 0 {
            out.push(format!(
                "  also steered over every pod (fail-open): {}; picks not handed to Envoy: {}",
                c.fail_open, c.steer_failed
            ));
        }
        let fallbacks: Vec<String> = c
            .fallbacks
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        out.push(format!(
            "left to Envoy's balancing (fallback): {}",
            if fallbacks.is_empty() {
                "none".to_string()
            } else {
                fallbacks.join(", ")
            }
        ));
        let reasons: Vec<String> = c
            .opened
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        out.push(format!(
            "breakers: opened {}{}, half-opened {}, closed {}",
            c.opened_total(),
            if reasons.is_empty() {
                String::new()
            } else {
                format!(" ({})", reasons.join(", "))
            },
            c.half_opened,
            c.closed
        ));
        if c.prefix.keyed > 0 {
            out.push(format!(
                "prefix affinity: {} prompts keyed, {} to a pod caching their prefix, {} spilled, {} to their rendezvous pod",
                c.prefix.keyed, c.prefix.hit, c.prefix.spill, c.prefix.rendezvous
            ));
        }
        out.push(if self.settled {
            "(Envoy's stats: every worker's counts added up)".to_string()
        } else {
            "(Envoy's stats; not settled in time: a worker's last per-pod counts may be missing)"
                .to_string()
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_native_run_drops_what_the_module_lacks_and_says_so() {
        let (json, notes) = native_subset(
            r#"{"pools":[],"admission":{"tenants":{}},"bigRequestHold":{},"mode":"guard","minPods":1}"#,
        )
        .unwrap();
        let v: Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v, serde_json::json!({"pools": [], "minPods": 1}));
        assert_eq!(notes.len(), 3, "{notes:?}");
        for f in ["admission", "bigRequestHold", "mode: guard"] {
            assert!(notes.iter().any(|n| n.contains(f)), "{f}: {notes:?}");
        }
        let (same, none) = native_subset(r#"{"minPods":1,"admission":null}"#).unwrap();
        assert!(none.is_empty(), "{none:?}");
        assert_eq!(same, r#"{"minPods":1}"#);
    }

    #[test]
    fn counts_are_read_under_each_paths_names() {
        let pods: Vec<SocketAddr> = vec!["127.0.0.1:1".parse().unwrap()];
        let stats: BTreeMap<String, u64> = [
            ("wasmcustom.ailb.steered", 5),
            ("wasmcustom.ailb.endpoint.127.0.0.1:1.picks", 5),
            ("wasmcustom.ailb.breaker_opened.server_errors", 1),
            ("dynamicmodulescustom.ailb.steered", 7),
            (
                "dynamicmodulescustom.ailb.endpoint.picks.ailb_endpoint.127.0.0.1:1",
                6,
            ),
            ("dynamicmodulescustom.ailb.breaker_closed", 2),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let w = Counts::from_stats(DataPath::Wasm, &pods, &stats);
        assert_eq!((w.steered, w.picks_total(), w.opened_total()), (5, 5, 1));
        let n = Counts::from_stats(DataPath::Native, &pods, &stats);
        assert_eq!((n.steered, n.picks_total(), n.closed), (7, 6, 2));
        assert_eq!(
            n.since(&n),
            Counts::from_stats(DataPath::Native, &pods, &BTreeMap::new())
        );
    }
}
