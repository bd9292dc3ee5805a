//! The soaks of issue 31, each a long run with a report (`scripts/soak.sh`): `churn` (pods
//! joining and leaving through EDS and DNS, agents restarting, a plugin config reload every
//! 10 s under steady traffic), `overload` (twice the pool's measured capacity in bursts with
//! admission on) and `pods` (1,000 simulated pods behind one real agent, 8 sidecars, against
//! 100). Each writes `report.md`, `report.json` (with the time series the plot reads) under
//! its out dir, and returns an error naming every violated bound: a short run (`--short`,
//! scripts/test.sh) fails on a real violation (a departed pod's state kept, a lost request,
//! the limiter's bound exceeded, memory past its bound), never on a timing.

pub mod churn;
pub mod overload;
pub mod pods;
pub mod sim_peers;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{json, Value};

use ai_lb_e2e::envoy::{http_get, workspace_bin, Error};

/// `ai-lb-bench soak-<name> ...`.
#[derive(Debug, Parser)]
#[command(name = "ai-lb-bench soak-<churn|overload|pods>")]
pub struct SoakCli {
    /// `soak-churn`, `soak-overload` or `soak-pods`.
    pub which: String,
    /// The short mode (about a minute; what scripts/test.sh runs): same checks, short phases.
    #[arg(long)]
    pub short: bool,
    /// Seconds of the main phase (churn, overload); default 600, short 40.
    #[arg(long)]
    pub secs: Option<f64>,
    /// Where the report goes; default `bench-results/soak/<name>` (short: under --work).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, default_value = "/tmp/ai-lb-soak")]
    pub work: PathBuf,
    /// churn: the data path, `wasm` (the wasm filter, default) or `native` (the dynamic module).
    #[arg(long, default_value = "wasm")]
    pub data_path: String,
    /// pods: pool sizes to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    pub pods: Vec<usize>,
    /// pods: sidecars (Envoys).
    #[arg(long, default_value_t = 8)]
    pub sidecars: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

/// Runs the soak named by the command line (`ai-lb-bench soak-churn --short`).
pub fn main_from_args(args: impl Iterator<Item = String>) -> Result<(), Error> {
    let cli = SoakCli::try_parse_from(args).map_err(|e| e.to_string())?;
    let name = cli
        .which
        .strip_prefix("soak-")
        .ok_or_else(|| {
            format!(
                "unknown soak {:?}: soak-churn, soak-overload or soak-pods",
                cli.which
            )
        })?
        .to_string();
    if let Some(s) = cli.secs {
        if !(s.is_finite() && s >= 10.0) {
            return Err(format!("invalid value '{s}' for '--secs': at least 10"));
        }
    }
    if cli.sidecars == 0 || cli.pods.iter().any(|&n| n < 2) {
        return Err("--sidecars must be > 0 and every --pods size at least 2".into());
    }
    let out = cli.out.clone().unwrap_or_else(|| {
        if cli.short {
            cli.work.join("short").join(&name)
        } else {
            PathBuf::from("bench-results/soak").join(&name)
        }
    });
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    let work = cli.work.join(&name);
    std::fs::create_dir_all(&work).map_err(|e| format!("creating {}: {e}", work.display()))?;
    let cmdline = format!(
        "scripts/soak.sh {name}{}",
        std::env::args()
            .skip(2)
            .map(|a| format!(" {a}"))
            .collect::<String>()
    );
    let report = match name.as_str() {
        "churn" => churn::run(&cli, &work)?,
        "overload" => overload::run(&cli, &work)?,
        "pods" => pods::run(&cli, &work)?,
        other => return Err(format!("unknown soak {other:?}: churn, overload or pods")),
    };
    report.write(&out, &cmdline)?;
    eprintln!("[soak] {name}: report in {}", out.display());
    if report.violations.is_empty() {
        eprintln!("[soak] {name}: PASS");
        Ok(())
    } else {
        Err(format!(
            "{name}: {} violation(s):\n  {}",
            report.violations.len(),
            report.violations.join("\n  ")
        ))
    }
}

/// What a soak found: its tables, its figures and series, and the bounds it broke.
#[derive(Debug, Default)]
pub struct Report {
    pub title: String,
    /// Markdown after the title (tables, design notes).
    pub body: String,
    /// Figures and series (`series` is what the plot reads).
    pub json: Value,
    pub violations: Vec<String>,
}

impl Report {
    fn write(&self, out: &Path, cmdline: &str) -> Result<(), Error> {
        let verdict = if self.violations.is_empty() {
            "PASS: every bound held".to_string()
        } else {
            format!("FAIL:\n\n- {}", self.violations.join("\n- "))
        };
        let md = format!(
            "# {}\n\nCommand: `{cmdline}`\n\n{}\n\n## Verdict\n\n{verdict}\n",
            self.title, self.body
        );
        let mut j = self.json.clone();
        j["command"] = json!(cmdline);
        j["violations"] = json!(self.violations);
        std::fs::write(out.join("report.md"), md).map_err(|e| e.to_string())?;
        std::fs::write(
            out.join("report.json"),
            serde_json::to_string_pretty(&j).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())
    }

    /// Records a violation when `ok` is false.
    pub fn check(&mut self, ok: bool, what: impl Into<String>) {
        if !ok {
            let w = what.into();
            eprintln!("[soak] VIOLATION: {w}");
            self.violations.push(w);
        }
    }
}

/// Resident memory of process `pid` in KiB (`VmRSS`), None once it is gone.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// CPU seconds (user + system) process `pid` has used.
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // In USER_HZ ticks, 100 per second on every Linux architecture Envoy ships for.
    Some(ticks as f64 / 100.0)
}

/// The agent's `ai_lb_agent_peers{status}` from its `/metrics` (status → count).
pub fn agent_peers(http: SocketAddr) -> Option<BTreeMap<String, u64>> {
    let r = http_get(http, "/metrics").ok()?;
    if r.status != 200 {
        return None;
    }
    let mut m = BTreeMap::new();
    for l in r.text().lines() {
        let Some(rest) = l.strip_prefix("ai_lb_agent_peers{") else {
            continue;
        };
        let status = rest
            .split("status=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap_or("?")
            .to_string();
        let v = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        m.insert(status, v as u64);
    }
    Some(m)
}

/// A running load generator and where its records go.
pub struct Loadgen {
    pub child: Child,
    pub records: PathBuf,
    pub log: PathBuf,
}

/// Starts `ai-lb-loadgen` against `url` with `args` (records to `dir/<tag>.records.jsonl`).
pub fn spawn_loadgen(
    url: SocketAddr,
    args: &[String],
    dir: &Path,
    tag: &str,
) -> Result<Loadgen, Error> {
    let bin = workspace_bin("ai-lb-loadgen")?;
    let records = dir.join(format!("{tag}.records.jsonl"));
    let log = dir.join(format!("{tag}.loadgen.log"));
    let f = std::fs::File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
    let f2 = f.try_clone().map_err(|e| e.to_string())?;
    let child = ai_lb_e2e::process::die_with_parent(&mut Command::new(bin))
        .arg("--url")
        .arg(format!("http://{url}"))
        .arg("--records")
        .arg(&records)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(f))
        .stderr(Stdio::from(f2))
        .spawn()
        .map_err(|e| format!("starting loadgen: {e}"))?;
    Ok(Loadgen {
        child,
        records,
        log,
    })
}

impl Loadgen {
    /// Waits for the loadgen to exit (up to `limit`) and reads its records.
    pub fn finish(mut self, limit: Duration) -> Result<Vec<ai_lb_loadgen::stats::Record>, Error> {
        let end = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => break,
                Ok(Some(st)) => {
                    return Err(format!(
                        "loadgen exited with {st}: {}",
                        ai_lb_e2e::process::file_tail(&self.log, 20)
                    ))
                }
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(200)),
                Ok(None) => {
                    let _ = self.child.kill();
                    return Err(format!("loadgen still running after {limit:?}"));
                }
                Err(e) => return Err(format!("waiting for loadgen: {e}")),
            }
        }
        crate::scenario::read_records(&[self.records.clone()])
    }
}

/// `q`-quantile (0..1) of `v` (sorted in place); None when empty.
pub fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v.get(i).copied()
}

/// MiB from KiB, one decimal.
pub fn mib(kib: u64) -> f64 {
    (kib as f64 / 102.4).round() / 10.0
}

/// A stat by name from a `/stats` map (0 when absent).
pub fn stat(stats: &BTreeMap<String, u64>, name: &str) -> u64 {
    stats.get(name).copied().unwrap_or(0)
}

/// The largest value of `key` over `rows` whose `t` lies in [from, to).
pub fn max_in(rows: &[Value], key: &str, from: f64, to: f64) -> Option<f64> {
    rows.iter()
        .filter(|r| r["t"].as_f64().is_some_and(|t| t >= from && t < to))
        .filter_map(|r| r[key].as_f64())
        .reduce(f64::max)
}
