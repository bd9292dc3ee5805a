//! Runs a real Envoy 1.40 with the ai-lb wasm filter for end-to-end tests: renders
//! `envoy-config/envoy.yaml` with run-time values, starts Envoy with an ephemeral admin port
//! (read back from `--admin-address-path`) and an ephemeral listener port (read back from the
//! admin `/listeners`), waits for `/ready`, reads `/stats` and `/stats/prometheus`, keeps the
//! log, and kills Envoy on drop. Also a small blocking HTTP/1.1 client and a stub upstream.
//!
//! `--disable-hot-restart` means no shared-memory base id, so any number of Envoys can run side
//! by side without choosing `--base-id` values.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Harness error: a sentence saying what failed and where to look.
pub type Error = String;

/// Root of the workspace (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The Envoy binary: `$ENVOY_BIN`, else `<workspace>/.venv/bin/envoy`, else `envoy` on PATH.
pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        return PathBuf::from(p);
    }
    let venv = workspace_root().join(".venv/bin/envoy");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("envoy")
}

/// The target dirs to search for build outputs: `$CARGO_TARGET_DIR`, the dir holding this test
/// binary (`<target>/debug/deps/..`), and `<workspace>/target`.
fn target_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        let d = PathBuf::from(d);
        dirs.push(if d.is_absolute() {
            d
        } else {
            workspace_root().join(d)
        });
    }
    if let Ok(exe) = std::env::current_exe() {
        // <target>/<profile>/deps/<test-binary>
        if let Some(t) = exe.ancestors().nth(3) {
            dirs.push(t.to_path_buf());
        }
    }
    dirs.push(workspace_root().join("target"));
    let mut seen = Vec::new();
    dirs.retain(|d| {
        let new = !seen.contains(d);
        seen.push(d.clone());
        new
    });
    dirs
}

/// A build output: the path in `$env_var` (which must exist), else the first of `candidates`
/// (relative to a target dir) that exists; the error says how to build it.
pub fn built(env_var: &str, candidates: &[&str], build: &str) -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os(env_var) {
        let p = PathBuf::from(p);
        return if p.exists() {
            Ok(p)
        } else {
            Err(format!("{env_var}={} does not exist", p.display()))
        };
    }
    let dirs = target_dirs();
    for d in &dirs {
        for c in candidates {
            let p = d.join(c);
            if p.exists() {
                return Ok(p);
            }
        }
    }
    Err(format!(
        "not built: run `{build}` (looked for {candidates:?} in {dirs:?}, or set {env_var})"
    ))
}

/// The wasm filter: `$AI_LB_WASM`, else `<target>/wasm32-wasip1/release/ai_lb_filter_wasm.wasm`.
pub fn wasm_path() -> Result<PathBuf, Error> {
    built(
        "AI_LB_WASM",
        &["wasm32-wasip1/release/ai_lb_filter_wasm.wasm"],
        "cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release",
    )
}

/// The native module (filter/native): `$AI_LB_NATIVE`, else
/// `<target>/{release,debug}/libai_lb_filter_native.so`.
pub fn native_module_path() -> Result<PathBuf, Error> {
    built(
        "AI_LB_NATIVE",
        &[
            "release/libai_lb_filter_native.so",
            "debug/libai_lb_filter_native.so",
        ],
        "cargo build --release -p ai-lb-filter-native",
    )
}

/// The template `envoy-config/envoy-native.yaml` (the native module).
pub fn native_template() -> Result<String, Error> {
    let p = workspace_root().join("envoy-config/envoy-native.yaml");
    std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))
}

/// `envoy-native.yaml` with the `inference` cluster on Envoy's built-in least_request policy
/// instead of override_host: for the module's `"steering": "overrideHost"`, which hands the
/// pick to Envoy as the stream's upstream override host.
pub fn native_template_least_request() -> Result<String, Error> {
    let t = native_template()?;
    let start = t
        .find("    load_balancing_policy:\n")
        .ok_or("envoy-native.yaml: no load_balancing_policy block")?;
    let end_marker = "least_request.v3.LeastRequest\n";
    let end = t[start..]
        .find(end_marker)
        .map(|i| start + i + end_marker.len())
        .ok_or("envoy-native.yaml: the override_host block does not end in LeastRequest")?;
    Ok(format!(
        "{}    lb_policy: LEAST_REQUEST\n{}",
        &t[..start],
        &t[end..]
    ))
}

/// Sets the native module config's `steering` (`header`, `overrideHost` or `both`).
pub fn native_with_steering(config: &str, steering: &str) -> Result<String, Error> {
    let mut v: serde_json::Value =
        serde_json::from_str(config).map_err(|e| format!("native config: {e}"))?;
    v["steering"] = serde_json::json!(steering);
    Ok(v.to_string())
}

/// The native module's config: the wasm filter's plugin config `filter_json` under `filter`,
/// and `agents` as every pool's agent addresses.
pub fn native_filter_config(filter_json: &str, agents: &[SocketAddr]) -> Result<String, Error> {
    let filter: serde_json::Value =
        serde_json::from_str(filter_json).map_err(|e| format!("filter config: {e}"))?;
    let addrs: Vec<String> = agents.iter().map(|a| a.to_string()).collect();
    let mut per_pool = serde_json::Map::new();
    for p in filter["pools"].as_array().into_iter().flatten() {
        if let Some(name) = p["name"].as_str() {
            per_pool.insert(name.to_string(), serde_json::json!(addrs));
        }
    }
    Ok(serde_json::json!({"filter": filter, "agents": per_pool}).to_string())
}

/// A binary of this workspace (e.g. `ai-lb-agent`, `ai-lb-fake-pod`) in the target dirs.
pub fn workspace_bin(name: &str) -> Result<PathBuf, Error> {
    let dirs = target_dirs();
    for d in &dirs {
        for profile in ["debug", "release"] {
            let p = d.join(profile).join(name);
            if p.exists() {
                return Ok(p);
            }
        }
    }
    Err(format!(
        "binary {name} is not built: run `cargo build --bins` (looked in {dirs:?})"
    ))
}

/// The template `envoy-config/envoy.yaml`.
pub fn template() -> Result<String, Error> {
    let p = workspace_root().join("envoy-config/envoy.yaml");
    std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))
}

/// Replaces every `${NAME}` of `vars`; fails naming any placeholder left over.
pub fn render(template: &str, vars: &BTreeMap<&str, String>) -> Result<String, Error> {
    let mut out = template.to_string();
    for (k, v) in vars {
        out = out.replace(&format!("${{{k}}}"), v);
    }
    // Placeholders only count outside comments.
    for line in out.lines() {
        let code = line.split('#').next().unwrap_or("");
        if let Some(i) = code.find("${") {
            return Err(format!(
                "placeholder left unrendered: {}",
                &code[i..].chars().take(40).collect::<String>()
            ));
        }
    }
    Ok(out)
}

/// `s` as a YAML double-quoted scalar (the JSON string escapes are valid YAML).
pub fn yaml_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A YAML flow list of `lb_endpoints` for these addresses.
pub fn endpoints_yaml(addrs: &[SocketAddr]) -> String {
    let items: Vec<String> = addrs
        .iter()
        .map(|a| {
            format!(
                "{{endpoint: {{address: {{socket_address: {{address: \"{}\", port_value: {}}}}}}}}}",
                a.ip(),
                a.port()
            )
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// What to run Envoy with.
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// The filter's JSON config (rendered into `FILTER_CONFIG`).
    pub filter_config: String,
    /// The model servers (the `inference` cluster).
    pub inference: Vec<SocketAddr>,
    /// The collector agents (the `ai_lb_agents` cluster).
    pub agents: Vec<SocketAddr>,
    /// Worker threads.
    pub concurrency: u32,
    /// Template text; None = `envoy-config/envoy.yaml`.
    pub template: Option<String>,
    /// How long to wait for `/ready`.
    pub ready_timeout: Duration,
}

impl EnvoyOptions {
    pub fn new(filter_config: impl Into<String>) -> Self {
        Self {
            filter_config: filter_config.into(),
            inference: Vec::new(),
            agents: Vec::new(),
            concurrency: 2,
            template: None,
            ready_timeout: Duration::from_secs(30),
        }
    }
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh scratch dir under the system temp dir.
pub fn scratch_dir(tag: &str) -> Result<PathBuf, Error> {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!(
        "ai-lb-e2e-{tag}-{}-{n}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&d).map_err(|e| format!("creating {}: {e}", d.display()))?;
    Ok(d)
}

/// The rendered config file for `opts` (admin and listener on 127.0.0.1 port 0).
pub fn write_config(opts: &EnvoyOptions, dir: &Path) -> Result<PathBuf, Error> {
    let template = match &opts.template {
        Some(t) => t.clone(),
        None => template()?,
    };
    let mut vars = BTreeMap::new();
    if template.contains("${WASM_PATH}") {
        vars.insert("WASM_PATH", wasm_path()?.display().to_string());
    }
    if template.contains("${NATIVE_MODULE_PATH}") {
        vars.insert(
            "NATIVE_MODULE_PATH",
            native_module_path()?.display().to_string(),
        );
    }
    vars.insert("ADMIN_ADDRESS", "127.0.0.1".to_string());
    vars.insert("ADMIN_PORT", "0".to_string());
    vars.insert("LISTEN_ADDRESS", "127.0.0.1".to_string());
    vars.insert("LISTEN_PORT", "0".to_string());
    vars.insert("FILTER_CONFIG", yaml_quote(&opts.filter_config));
    vars.insert("INFERENCE_ENDPOINTS", endpoints_yaml(&opts.inference));
    vars.insert("AGENT_ENDPOINTS", endpoints_yaml(&opts.agents));
    let text = render(&template, &vars)?;
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(path)
}

fn envoy_command(config: &Path, dir: &Path, concurrency: u32) -> Command {
    let mut cmd = Command::new(envoy_bin());
    crate::process::die_with_parent(&mut cmd)
        .arg("-c")
        .arg(config)
        .arg("--disable-hot-restart")
        .arg("--concurrency")
        .arg(concurrency.to_string())
        .arg("--admin-address-path")
        .arg(dir.join("admin.addr"))
        .arg("--log-path")
        .arg(dir.join("envoy.log"))
        // Tests read the log while Envoy runs: flush it often.
        .arg("--file-flush-interval-msec")
        .arg("200")
        .arg("-l")
        .arg("info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd
}

fn spawn_error(e: &std::io::Error) -> Error {
    format!(
        "cannot run Envoy at {}: {e} (install it with scripts/setup.sh, or set ENVOY_BIN)",
        envoy_bin().display()
    )
}

/// Outcome of running Envoy until it exits (for configs Envoy must refuse).
#[derive(Debug)]
pub struct Exited {
    pub status: ExitStatus,
    pub log: String,
}

/// Runs Envoy with `opts` expecting it to exit within `timeout` (e.g. a refused config).
/// Fails if it is still running (then it was killed) or cannot start.
pub fn run_until_exit(opts: &EnvoyOptions, timeout: Duration) -> Result<Exited, Error> {
    let dir = scratch_dir("exit")?;
    let config = write_config(opts, &dir)?;
    let mut child = envoy_command(&config, &dir, opts.concurrency)
        .spawn()
        .map_err(|e| spawn_error(&e))?;
    let exited = crate::wait::poll(
        Instant::now() + timeout,
        Duration::from_millis(50),
        "envoy to exit (refusing its config)",
        || {
            child
                .try_wait()
                .map_err(|e| format!("waiting for envoy: {e}"))
        },
    );
    match exited {
        Ok(status) => {
            let log = std::fs::read_to_string(dir.join("envoy.log")).unwrap_or_default();
            let _ = std::fs::remove_dir_all(&dir);
            Ok(Exited { status, log })
        }
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("{e}; log in {}", dir.display()))
        }
    }
}

/// `envoy --mode validate` on a rendered config; Ok(()) when Envoy accepts it.
pub fn validate(opts: &EnvoyOptions) -> Result<(), Error> {
    let dir = scratch_dir("validate")?;
    let config = write_config(opts, &dir)?;
    let out = Command::new(envoy_bin())
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(&config)
        .arg("--disable-hot-restart")
        .output()
        .map_err(|e| spawn_error(&e))?;
    let _ = std::fs::remove_dir_all(&dir);
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "envoy --mode validate failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A running Envoy, killed on drop. Its log and rendered config stay in `dir` if a test fails.
pub struct Envoy {
    child: Child,
    pub dir: PathBuf,
    pub admin: SocketAddr,
    pub listener: SocketAddr,
}

impl std::fmt::Debug for Envoy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Envoy")
            .field("dir", &self.dir)
            .field("admin", &self.admin)
            .field("listener", &self.listener)
            .finish()
    }
}

impl Envoy {
    /// The Envoy process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts Envoy and waits until `/ready` answers 200 and the listener is bound.
    pub fn start(opts: &EnvoyOptions) -> Result<Envoy, Error> {
        let dir = scratch_dir("envoy")?;
        let config = write_config(opts, &dir)?;
        Self::start_config(dir, &config, opts.concurrency, opts.ready_timeout, &[])
    }

    /// Starts Envoy on a config file already written (in `dir`, which also takes its log and
    /// admin address file), with `extra_args` after the harness's own (e.g. `--drain-time-s`),
    /// and waits until `/ready` answers 200 and the `inference` listener is bound.
    pub fn start_config(
        dir: PathBuf,
        config: &Path,
        concurrency: u32,
        ready_timeout: Duration,
        extra_args: &[String],
    ) -> Result<Envoy, Error> {
        let child = envoy_command(config, &dir, concurrency)
            .args(extra_args)
            .spawn()
            .map_err(|e| spawn_error(&e))?;
        let placeholder: SocketAddr = ([127, 0, 0, 1], 0).into();
        let mut envoy = Envoy {
            child,
            dir,
            admin: placeholder,
            listener: placeholder,
        };
        let deadline = Instant::now() + ready_timeout;
        // The admin address file appears once the admin listener is bound.
        envoy.admin = envoy.wait_for(deadline, "admin address file", |e| {
            let text = std::fs::read_to_string(e.dir.join("admin.addr")).ok()?;
            text.trim().parse().ok()
        })?;
        envoy.wait_for(deadline, "/ready", |e| {
            let r = http_get(e.admin, "/ready").ok()?;
            (r.status == 200).then_some(())
        })?;
        envoy.listener = envoy.wait_for(deadline, "the inference listener", |e| {
            let r = http_get(e.admin, "/listeners").ok()?;
            // `inference::127.0.0.1:PORT`
            r.text()
                .lines()
                .find_map(|l| l.strip_prefix("inference::"))
                .and_then(|a| a.trim().parse().ok())
        })?;
        Ok(envoy)
    }

    fn wait_for<T>(
        &mut self,
        deadline: Instant,
        what: &str,
        mut f: impl FnMut(&Envoy) -> Option<T>,
    ) -> Result<T, Error> {
        let every = Duration::from_millis(25);
        let got = crate::wait::poll(deadline, every, what, || {
            if let Some(v) = f(self) {
                return Ok(Some(v));
            }
            match self.child.try_wait() {
                Ok(Some(status)) => Err(format!("envoy exited ({status}) before {what}")),
                _ => Ok(None),
            }
        });
        got.map_err(|e| format!("{e}; log:\n{}", self.log_tail(60)))
    }

    /// The whole log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// `/stats` as name → value (counters and gauges; histograms are skipped).
    pub fn stats(&self) -> Result<BTreeMap<String, u64>, Error> {
        let r = http_get(self.admin, "/stats")?;
        Ok(parse_stats(&r.text()))
    }

    /// One stat from `/stats` (0 when absent).
    pub fn stat(&self, name: &str) -> Result<u64, Error> {
        Ok(self.stats()?.get(name).copied().unwrap_or(0))
    }

    /// `/stats/prometheus` text.
    pub fn prometheus(&self) -> Result<String, Error> {
        Ok(http_get(self.admin, "/stats/prometheus")?.text())
    }

    /// Polls `f` every 50 ms until it returns Some or `timeout` passes ([`crate::wait`]); the
    /// error names `what` and carries the log's tail.
    pub fn poll<T>(
        &self,
        timeout: Duration,
        what: &str,
        mut f: impl FnMut() -> Option<T>,
    ) -> Result<T, Error> {
        let every = Duration::from_millis(50);
        crate::wait::poll(Instant::now() + timeout, every, what, || Ok(f()))
            .map_err(|e| format!("{e}; envoy log:\n{}", self.log_tail(40)))
    }

    /// True if the wasm VM trapped or the filter logged a panic.
    pub fn wasm_failed(&self) -> bool {
        let log = self.log();
        log.contains("panicked at")
            || log.contains("Uncaught RuntimeError")
            || log.contains("Function: proxy_on_")
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if thread::panicking() {
            eprintln!("envoy log and config kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Parses Envoy's `/stats` text (`name: value`).
pub fn parse_stats(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(": ")?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// An HTTP response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A keep-alive HTTP/1.1 client for one address (reconnects when the server closes).
#[derive(Debug)]
pub struct HttpClient {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
    timeout: Duration,
}

impl HttpClient {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            conn: None,
            timeout: Duration::from_secs(30),
        }
    }

    /// The same client with another connect/read timeout (default 30 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sends one request; retries once on a stale keep-alive connection.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Response, Error> {
        let reused = self.conn.is_some();
        match self.try_request(method, path, headers, body) {
            Ok(r) => Ok(r),
            Err(_) if reused => {
                self.conn = None;
                self.try_request(method, path, headers, body)
            }
            Err(e) => Err(e),
        }
    }

    fn try_request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Response, Error> {
        if self.conn.is_none() {
            let s = TcpStream::connect_timeout(&self.addr, self.timeout)
                .map_err(|e| format!("connect {}: {e}", self.addr))?;
            s.set_read_timeout(Some(self.timeout)).ok();
            s.set_nodelay(true).ok();
            self.conn = Some(BufReader::new(s));
        }
        let addr = self.addr;
        let conn = self
            .conn
            .as_mut()
            .ok_or_else(|| "no connection".to_string())?;
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
        let stream = conn.get_mut();
        stream
            .write_all(req.as_bytes())
            .and_then(|_| stream.write_all(body))
            .map_err(|e| format!("write to {addr}: {e}"))?;
        let resp = read_response(conn).map_err(|e| format!("read from {addr}: {e}"));
        match &resp {
            Ok(r) if r.header("connection") == Some("close") => self.conn = None,
            Err(_) => self.conn = None,
            _ => {}
        }
        resp
    }

    pub fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> Result<Response, Error> {
        self.request("GET", path, headers, b"")
    }

    pub fn post_json(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Response, Error> {
        let mut h: Vec<(&str, &str)> = vec![("content-type", "application/json")];
        h.extend_from_slice(headers);
        self.request("POST", path, &h, body.as_bytes())
    }
}

fn read_response(r: &mut BufReader<TcpStream>) -> std::io::Result<Response> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(bad("connection closed"));
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let find = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.to_string())
    };
    let mut body = Vec::new();
    if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| bad("bad chunk size"))?;
            if size == 0 {
                // trailers until an empty line
                loop {
                    line.clear();
                    r.read_line(&mut line)?;
                    if line.trim().is_empty() {
                        break;
                    }
                }
                break;
            }
            let mut chunk = vec![0; size];
            r.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk);
            line.clear();
            r.read_line(&mut line)?;
        }
    } else if let Some(n) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else if status != 204 && status != 304 {
        r.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// One GET on a fresh connection.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<Response, Error> {
    HttpClient::new(addr).get(path, &[("connection", "close")])
}

/// Request headers (lower-cased names) of every request a [`StubUpstream`] served.
pub type SeenHeaders = Arc<Mutex<Vec<Vec<(String, String)>>>>;

/// A tiny HTTP/1.1 upstream that answers every request with 200, header
/// `x-fake-pod: <its address>` and the request headers it saw (one per line) as the body.
/// For tests that need endpoints but no GPU model. Stops on drop.
pub struct StubUpstream {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    pub seen: SeenHeaders,
}

impl std::fmt::Debug for StubUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StubUpstream")
            .field("addr", &self.addr)
            .finish()
    }
}

impl StubUpstream {
    pub fn start() -> Result<StubUpstream, Error> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop2, seen2) = (stop.clone(), seen.clone());
        thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let seen = seen2.clone();
                        let stop = stop2.clone();
                        thread::spawn(move || serve_stub(s, addr, seen, stop));
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(StubUpstream { addr, stop, seen })
    }
}

impl Drop for StubUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn serve_stub(s: TcpStream, addr: SocketAddr, seen: SeenHeaders, stop: Arc<AtomicBool>) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let Ok(mut w) = s.try_clone() else { return };
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) {
        line.clear();
        match read_line_lossy(&mut r, &mut line) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                continue
            }
            Err(_) => return,
        }
        let mut headers = Vec::new();
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if read_line_lossy(&mut r, &mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
                if k == "content-length" {
                    len = v.parse().unwrap_or(0);
                }
                headers.push((k, v));
            }
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let text: String = headers.iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
        if let Ok(mut g) = seen.lock() {
            g.push(headers);
        }
        let resp = format!(
            "HTTP/1.1 200 OK\r\nx-fake-pod: {addr}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{text}",
            text.len()
        );
        if w.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

/// One line, its bytes as text with invalid UTF-8 replaced: header values may carry obs-text
/// bytes (0x80-0xFF), which Envoy passes on and `read_line` would refuse.
fn read_line_lossy(r: &mut impl BufRead, line: &mut String) -> std::io::Result<usize> {
    let mut buf = Vec::new();
    let n = r.read_until(b'\n', &mut buf)?;
    line.push_str(&String::from_utf8_lossy(&buf));
    Ok(n)
}

/// A free loopback port for a process that must know its peers' ports before they start
/// (the agents' static peers): checked free by binding it, then released for the process.
///
/// Drawn at random outside the kernel's ephemeral range (`ip_local_port_range`), where the
/// outgoing connections of a load test and every `bind(0)` take their ports: a port from
/// `bind(0)` is the one the kernel hands out next, and was taken by an outgoing connection
/// before the agent bound it often enough to fail a benchmark run and a CI run (`Address
/// already in use`). Below the range when it leaves 1 000 ports there, else above it, else
/// (a range covering nearly everything) anywhere from 10 000 up, still at random.
pub fn free_port() -> Result<u16, Error> {
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let (first, span) = port_draw_range(ephemeral_range());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut x = u64::from(std::process::id()) << 32 ^ u64::from(nanos);
    for _ in 0..256 {
        // splitmix64 over (pid, time, draw count): distinct processes and threads spread.
        x = x
            .wrapping_add(DRAWS.fetch_add(1, Ordering::Relaxed).wrapping_add(1))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let port = first + u16::try_from(z % u64::from(span)).unwrap_or(0);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err("no free loopback port after 256 random draws".into())
}

/// The kernel's ephemeral port range (`ip_local_port_range`); Linux's default if unreadable.
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|v| v.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

/// Where [`free_port`] draws from, as (first port, number of ports), given the ephemeral range.
fn port_draw_range((low, high): (u16, u16)) -> (u16, u16) {
    const FIRST: u16 = 10_000;
    const ROOM: u16 = 1_000;
    if low >= FIRST + ROOM {
        (FIRST, low - FIRST)
    } else if high <= u16::MAX - ROOM {
        (high + 1, u16::MAX - high)
    } else {
        (FIRST, u16::MAX - FIRST)
    }
}

pub use crate::process::Proc;

/// Starts one workspace binary (fake pod, agent) and waits for its `LISTENING <kind>` line.
fn spawn_listening(name: &str, bin: &Path, args: Vec<String>, kind: &str) -> Result<Proc, Error> {
    Proc::spawn(&crate::process::Spec {
        name: name.to_string(),
        program: bin.to_path_buf(),
        args,
        env: Vec::new(),
        listening: vec![kind.to_string()],
        deadline: Duration::from_secs(20),
    })
}

/// Agent timing for tests: fast sampling, pushes and heartbeats.
pub const AGENT_FAST_ARGS: &[&str] = &[
    "--sample-interval",
    "50ms",
    "--watch-min-interval",
    "50ms",
    "--heartbeat",
    "300ms",
    "--peer-stale-after",
    "1500ms",
    "--window",
    "2s",
];

/// Fake GPU pods, each with its collector agent; every agent lists all the others as peers,
/// so any agent's `WatchPool` covers the whole pool.
#[derive(Debug)]
pub struct PodPool {
    /// `pod0`, `pod1`, ... (also the `x-fake-pod` response header value).
    pub names: Vec<String>,
    pub pods: Vec<Proc>,
    pub pod_addrs: Vec<SocketAddr>,
    pub agents: Vec<Option<Proc>>,
    pub agent_addrs: Vec<SocketAddr>,
}

impl PodPool {
    /// Starts `n` fake pods (`--time-scale time_scale`) and their agents.
    pub fn start(n: usize, time_scale: f64) -> Result<PodPool, Error> {
        Self::start_with(n, time_scale, |_| Vec::new())
    }

    /// Like [`PodPool::start`], with extra fake-pod flags per pod index (e.g. `--preset`).
    pub fn start_with(
        n: usize,
        time_scale: f64,
        pod_extra: impl Fn(usize) -> Vec<String>,
    ) -> Result<PodPool, Error> {
        Self::start_with_agents(n, time_scale, pod_extra, |_| Vec::new())
    }

    /// Like [`PodPool::start_with`], each pod publishing vLLM's KV events over ZeroMQ and its
    /// agent reading them (`--kv-events-endpoint` on both), so snapshots carry the pod's
    /// prefix-cache contents.
    ///
    /// The endpoints' ports are drawn free, and another process may take one before its pod
    /// binds it (seen once in a full test run: "Address already in use"); then the pool starts
    /// again on new ports, up to three times.
    pub fn start_with_kv_events(
        n: usize,
        time_scale: f64,
        pod_extra: impl Fn(usize) -> Vec<String>,
    ) -> Result<PodPool, Error> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let endpoints: Vec<String> = (0..n)
                .map(|_| free_port().map(|p| format!("tcp://127.0.0.1:{p}")))
                .collect::<Result<_, _>>()?;
            let started = Self::start_with_agents(
                n,
                time_scale,
                |i| {
                    let mut v = vec!["--kv-events-endpoint".to_string(), endpoints[i].clone()];
                    v.extend(pod_extra(i));
                    v
                },
                |i| vec!["--kv-events-endpoint".to_string(), endpoints[i].clone()],
            );
            match started {
                Err(e) if attempt < 3 && e.contains("Address already in use") => {
                    eprintln!(
                        "[e2e] a KV-event port was taken before its pod bound it; again: {e}"
                    );
                }
                other => return other,
            }
        }
    }

    /// Like [`PodPool::start_with`], with extra agent flags per pod index too.
    pub fn start_with_agents(
        n: usize,
        time_scale: f64,
        pod_extra: impl Fn(usize) -> Vec<String>,
        agent_extra: impl Fn(usize) -> Vec<String>,
    ) -> Result<PodPool, Error> {
        let pod_bin = workspace_bin("ai-lb-fake-pod")?;
        let agent_bin = workspace_bin("ai-lb-agent")?;
        let mut names = Vec::new();
        let mut pods = Vec::new();
        let mut pod_addrs = Vec::new();
        for i in 0..n {
            let name = format!("pod{i}");
            let args: Vec<String> = [
                "--listen",
                "127.0.0.1:0",
                "--pod-name",
                &name,
                "--seed",
                &(i + 1).to_string(),
                "--time-scale",
                &time_scale.to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .chain(pod_extra(i))
            .collect();
            let p = spawn_listening(&name, &pod_bin, args, "http")?;
            let addr = p.addr("http")?;
            names.push(name);
            pod_addrs.push(addr);
            pods.push(p);
        }
        let agent_addrs: Vec<SocketAddr> = (0..n)
            .map(|_| free_port().map(|p| SocketAddr::from(([127, 0, 0, 1], p))))
            .collect::<Result<_, _>>()?;
        let mut agents = Vec::new();
        for i in 0..n {
            let peers: Vec<String> = agent_addrs
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, a)| a.to_string())
                .collect();
            let pod = pod_addrs[i];
            let mut args: Vec<String> = vec![
                "--grpc-listen".into(),
                agent_addrs[i].to_string(),
                "--http-listen".into(),
                "127.0.0.1:0".into(),
                "--pod-name".into(),
                names[i].clone(),
                "--serving-address".into(),
                pod.to_string(),
                "--gpu-source".into(),
                "sim".into(),
                "--sim-url".into(),
                format!("http://{pod}"),
                "--model-server-url".into(),
                format!("http://{pod}"),
                "--engine".into(),
                "vllm".into(),
            ];
            if !peers.is_empty() {
                args.push("--peers".into());
                args.push(peers.join(","));
            }
            args.extend(AGENT_FAST_ARGS.iter().map(|s| s.to_string()));
            args.extend(agent_extra(i));
            let name = format!("agent{i}");
            let a = spawn_listening(&name, &agent_bin, args, "grpc")?;
            agents.push(Some(a));
        }
        Ok(PodPool {
            names,
            pods,
            pod_addrs,
            agents,
            agent_addrs,
        })
    }

    /// The pod name of a serving address.
    pub fn name_of(&self, addr: &str) -> Option<&str> {
        self.pod_addrs
            .iter()
            .position(|a| a.to_string() == addr)
            .and_then(|i| self.names.get(i))
            .map(String::as_str)
    }

    /// `POST /control` on pod `i` (fault injection, e.g. `{"sm_occupancy":0.97}`).
    pub fn control(&self, i: usize, json: &str) -> Result<(), Error> {
        let addr = *self.pod_addrs.get(i).ok_or_else(|| format!("no pod {i}"))?;
        let r = HttpClient::new(addr).post_json("/control", &[("connection", "close")], json)?;
        if r.status == 200 {
            Ok(())
        } else {
            Err(format!(
                "POST /control {json} on pod{i}: {} {}",
                r.status,
                r.text()
            ))
        }
    }

    /// Sends a signal to every live agent (e.g. `STOP` to hang them, `CONT` to resume).
    pub fn signal_agents(&mut self, sig: &str) -> Result<(), Error> {
        for a in self.agents.iter_mut().flatten() {
            a.signal(sig)?;
        }
        Ok(())
    }

    /// Kills every agent.
    pub fn kill_agents(&mut self) {
        for a in self.agents.iter_mut() {
            if let Some(mut p) = a.take() {
                p.kill();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_outside_the_ephemeral_range_and_distinct() {
        let (low, high) = ephemeral_range();
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let (first, span) = port_draw_range((low, high));
        for &p in &ports {
            let p32 = u32::from(p);
            assert!(
                (u32::from(first)..u32::from(first) + u32::from(span)).contains(&p32),
                "{p} outside the draw range {first}+{span} (ephemeral {low}-{high})"
            );
        }
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() >= 45, "{ports:?}");
    }

    #[test]
    fn the_draw_range_avoids_the_ephemeral_range_where_it_can() {
        // Linux's default: below it.
        assert_eq!(port_draw_range((32_768, 60_999)), (10_000, 22_768));
        // A range starting low: above it.
        assert_eq!(port_draw_range((1_024, 49_151)), (49_152, 16_384));
        // A range covering nearly everything: anywhere from 10 000, at random.
        assert_eq!(port_draw_range((1_024, 65_535)), (10_000, 55_535));
    }
}
