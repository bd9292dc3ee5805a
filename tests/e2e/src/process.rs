//! The process harness for end-to-end tests: finds this workspace's binaries, spawns them,
//! waits (with a deadline) for the `LISTENING <kind> <addr>` lines they print on stdout, keeps
//! their stderr and stdout in log files (whose tail is printed when a test fails), sends
//! signals (SIGTERM, SIGSTOP/SIGCONT, SIGKILL), and kills them on drop.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Harness error: a sentence saying what failed, with the process log's tail when there is one.
pub type Error = String;

/// How long a process may take to print its `LISTENING` lines.
pub const START_DEADLINE: Duration = Duration::from_secs(20);

/// Root of the workspace (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Where built binaries are looked for: `$CARGO_TARGET_DIR` (when set) then `<repo>/target`.
pub fn target_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        let d = PathBuf::from(d);
        v.push(if d.is_relative() {
            workspace_root().join(d)
        } else {
            d
        });
    }
    v.push(workspace_root().join("target"));
    v
}

/// A debug binary of this workspace, e.g. `ai-lb-agent` or `ai-lb-fake-pod`.
pub fn binary(name: &str) -> Result<PathBuf, Error> {
    let dirs = target_dirs();
    for d in &dirs {
        let p = d.join("debug").join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(format!(
        "binary {name} is not built: run `cargo build --bins` first (looked in {:?})",
        dirs.iter().map(|d| d.join("debug")).collect::<Vec<_>>()
    ))
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh directory for one process's logs under the system temp dir (kept after a failed
/// test, so the failure can be inspected; see [`Proc`]).
pub fn log_dir(tag: &str) -> Result<PathBuf, Error> {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("ai-lb-e2e-{}-{tag}-{n}", std::process::id()));
    std::fs::create_dir_all(&d)
        .map_err(|e| format!("cannot create log dir {}: {e}", d.display()))?;
    Ok(d)
}

/// The last `max_lines` lines of a file ("" if unreadable).
pub fn file_tail(path: &Path, max_lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(64 * 1024);
    let _ = f.seek(SeekFrom::Start(start));
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(max_lines)..].join("\n")
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Short name for logs, e.g. `agent-1`.
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// `LISTENING <kind>` lines to wait for, e.g. `["grpc", "http"]`.
    pub listening: Vec<String>,
    pub deadline: Duration,
}

impl Spec {
    /// Runs workspace binary `bin` with `args`, waiting for the given `LISTENING` kinds.
    pub fn workspace(
        bin: &str,
        name: &str,
        args: &[String],
        listening: &[&str],
    ) -> Result<Spec, Error> {
        Ok(Spec {
            name: name.to_string(),
            program: binary(bin)?,
            args: args.to_vec(),
            env: Vec::new(),
            listening: listening.iter().map(|s| s.to_string()).collect(),
            deadline: START_DEADLINE,
        })
    }
}

/// A running child process. Killed (SIGKILL) on drop; the log tail is printed if the thread is
/// panicking (a failing test).
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Child,
    /// The addresses from its `LISTENING <kind> <addr>` lines.
    pub listening: BTreeMap<String, SocketAddr>,
    pub stderr_log: PathBuf,
    pub stdout_log: PathBuf,
    /// Holds the two logs; removed when the process is dropped, unless a failure message
    /// pointed at them ([`Proc::failure`]), the thread panics (a failed test) or
    /// `AI_LB_KEEP_LOGS` is set.
    log_dir: PathBuf,
    keep_logs: AtomicBool,
    exited: Option<ExitStatus>,
}

/// Makes the child of `cmd` die (SIGKILL) when the thread that spawns it exits, so a harness
/// that is killed (SIGTERM, a timeout, a crashed test) leaves no fake pods, agents, Envoys or
/// load generators running behind it. Linux only (`PR_SET_PDEATHSIG`); elsewhere a no-op.
/// Spawn from the thread that owns the child for its whole life (every harness here does).
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id();
        // SAFETY: runs in the forked child before exec; prctl, getppid and _exit are
        // async-signal-safe and nothing here allocates.
        #[allow(unsafe_code)]
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The harness may have died between the fork and the prctl.
                if u32::try_from(libc::getppid()).ok() != Some(parent) {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    cmd
}

impl Proc {
    /// Spawns `spec` and waits for its `LISTENING` lines (or its exit, or the deadline).
    pub fn spawn(spec: &Spec) -> Result<Proc, Error> {
        let dir = log_dir(&spec.name)?;
        let stderr_log = dir.join("stderr.log");
        let stdout_log = dir.join("stdout.log");
        let err_file = File::create(&stderr_log)
            .map_err(|e| format!("cannot create {}: {e}", stderr_log.display()))?;
        let mut out_file = File::create(&stdout_log)
            .map_err(|e| format!("cannot create {}: {e}", stdout_log.display()))?;
        let mut cmd = Command::new(&spec.program);
        die_with_parent(&mut cmd)
            .args(&spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err_file));
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", spec.program.display()))?;
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            return Err(format!("{}: no stdout pipe", spec.name));
        };
        // One thread copies stdout to its log and forwards LISTENING lines.
        let (tx, rx) = mpsc::channel::<(String, String)>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = writeln!(out_file, "{line}");
                let _ = out_file.flush();
                let mut parts = line.split_whitespace();
                if let (Some("LISTENING"), Some(kind), Some(addr)) =
                    (parts.next(), parts.next(), parts.next())
                {
                    let _ = tx.send((kind.to_string(), addr.to_string()));
                }
            }
        });
        let mut p = Proc {
            name: spec.name.clone(),
            child,
            listening: BTreeMap::new(),
            stderr_log,
            stdout_log,
            log_dir: dir,
            keep_logs: AtomicBool::new(false),
            exited: None,
        };
        let end = Instant::now() + spec.deadline;
        while spec.listening.iter().any(|k| !p.listening.contains_key(k)) {
            let left = end.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok((kind, addr)) => {
                    // `tcp://HOST:PORT` (a ZeroMQ endpoint) names an address too.
                    let a: SocketAddr = addr
                        .trim_start_matches("tcp://")
                        .parse()
                        .map_err(|_| p.failure(&format!("bad LISTENING address {addr:?}")))?;
                    p.listening.insert(kind, a);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(st)) = p.child.try_wait() {
                        p.exited = Some(st);
                        return Err(p.failure(&format!("exited with {st} before LISTENING")));
                    }
                    if Instant::now() >= end {
                        return Err(p.failure(&format!(
                            "no LISTENING {:?} within {:?}",
                            spec.listening, spec.deadline
                        )));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let st = p.child.wait().ok();
                    p.exited = st;
                    return Err(p.failure(&format!("closed stdout before LISTENING (exit {st:?})")));
                }
            }
        }
        Ok(p)
    }

    /// The address of `LISTENING <kind>`.
    pub fn addr(&self, kind: &str) -> Result<SocketAddr, Error> {
        self.listening
            .get(kind)
            .copied()
            .ok_or_else(|| format!("{}: no LISTENING {kind}", self.name))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `msg` with the process's log tail, for test failures.
    pub fn failure(&self, msg: &str) -> String {
        self.keep_logs.store(true, Ordering::Relaxed);
        format!(
            "{}: {msg}\n--- stderr tail ({}) ---\n{}\n--- end ---",
            self.name,
            self.stderr_log.display(),
            file_tail(&self.stderr_log, 40)
        )
    }

    /// The whole stderr log so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// Signals the child by name (`STOP`, `CONT`, `TERM`), only while it is known to be running
    /// (a reaped pid may be reused).
    pub fn signal(&mut self, sig: &str) -> Result<(), Error> {
        if self.exited.is_none() {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.exited = Some(st);
            }
        }
        if let Some(st) = self.exited {
            return Err(format!(
                "{}: cannot send SIG{sig}: already exited ({st})",
                self.name
            ));
        }
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("kill -{sig} {}: {e}", self.pid()))?;
        if st.success() {
            Ok(())
        } else {
            Err(format!("kill -{sig} {} failed: {st}", self.pid()))
        }
    }

    /// Asks for a graceful shutdown.
    pub fn sigterm(&mut self) -> Result<(), Error> {
        self.signal("TERM")
    }

    /// Freezes the process (it stops answering without closing its sockets).
    pub fn sigstop(&mut self) -> Result<(), Error> {
        self.signal("STOP")
    }

    pub fn sigcont(&mut self) -> Result<(), Error> {
        self.signal("CONT")
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            self.exited = self.child.wait().ok();
        }
    }

    /// Waits for the process to exit, up to `deadline`.
    pub fn wait_exit(&mut self, deadline: Duration) -> Result<ExitStatus, Error> {
        if let Some(st) = self.exited {
            return Ok(st);
        }
        let end = Instant::now() + deadline;
        let what = "it to exit";
        let st = crate::wait::poll(end, crate::wait::POLL_EVERY, what, || {
            self.child
                .try_wait()
                .map_err(|e| format!("wait failed: {e}"))
        })
        .map_err(|e| self.failure(&e))?;
        self.exited = Some(st);
        Ok(st)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited.is_none() {
            let _ = self.sigcont();
        }
        self.kill();
        if std::thread::panicking() {
            eprintln!("{}", self.failure("log at test failure"));
        } else if !self.keep_logs.load(Ordering::Relaxed)
            && std::env::var_os("AI_LB_KEEP_LOGS").is_none()
        {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

/// Adds `flag value` unless `args` already sets `flag` (as `flag v` or `flag=v`).
pub fn with_default(args: &mut Vec<String>, flag: &str, value: &str) {
    let set = args
        .iter()
        .any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    if !set {
        args.push(flag.to_string());
        args.push(value.to_string());
    }
}

fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A running `ai-lb-fake-pod`.
#[derive(Debug)]
pub struct FakePod {
    pub proc: Proc,
    pub http_addr: SocketAddr,
}

impl FakePod {
    pub fn url(&self) -> String {
        format!("http://{}", self.http_addr)
    }
}

/// Starts a fake pod on `127.0.0.1:0` (unless `args` sets `--listen`).
pub fn spawn_fake_pod(args: &[&str]) -> Result<FakePod, Error> {
    let mut a = owned(args);
    with_default(&mut a, "--listen", "127.0.0.1:0");
    let proc = Proc::spawn(&Spec::workspace(
        "ai-lb-fake-pod",
        "fake-pod",
        &a,
        &["http"],
    )?)?;
    let http_addr = proc.addr("http")?;
    Ok(FakePod { proc, http_addr })
}

/// A running `ai-lb-agent`.
#[derive(Debug)]
pub struct Agent {
    pub proc: Proc,
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
}

impl Agent {
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }
}

/// Starts an agent with gRPC and HTTP on `127.0.0.1:0` (unless `args` sets them).
pub fn spawn_agent(args: &[&str]) -> Result<Agent, Error> {
    let mut a = owned(args);
    with_default(&mut a, "--grpc-listen", "127.0.0.1:0");
    with_default(&mut a, "--http-listen", "127.0.0.1:0");
    let proc = Proc::spawn(&Spec::workspace(
        "ai-lb-agent",
        "agent",
        &a,
        &["grpc", "http"],
    )?)?;
    let grpc_addr = proc.addr("grpc")?;
    let http_addr = proc.addr("http")?;
    Ok(Agent {
        proc,
        grpc_addr,
        http_addr,
    })
}

/// An agent reading a fake pod: `--gpu-source sim`, its `/metrics` as the model server, and
/// its address as the serving address.
pub fn spawn_agent_for(pod: &FakePod, extra: &[&str]) -> Result<Agent, Error> {
    let url = pod.url();
    let serving = pod.http_addr.to_string();
    let mut args = vec![
        "--serving-address",
        serving.as_str(),
        "--gpu-source",
        "sim",
        "--sim-url",
        url.as_str(),
        "--model-server-url",
        url.as_str(),
    ];
    args.extend_from_slice(extra);
    spawn_agent(&args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_do_not_duplicate_flags() {
        let mut a = owned(&["--listen", "127.0.0.1:5"]);
        with_default(&mut a, "--listen", "127.0.0.1:0");
        assert_eq!(a, owned(&["--listen", "127.0.0.1:5"]));
        let mut b = owned(&["--grpc-listen=1.2.3.4:5"]);
        with_default(&mut b, "--grpc-listen", "127.0.0.1:0");
        assert_eq!(b.len(), 1);
        with_default(&mut b, "--http-listen", "127.0.0.1:0");
        assert_eq!(b.len(), 3);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_child_dies_with_the_thread_that_spawned_it() {
        // The spawning thread ends at once, as a killed harness would: its `sleep` must not
        // outlive it.
        let pid = std::thread::spawn(|| {
            let child = die_with_parent(&mut Command::new("sleep"))
                .arg("30")
                .spawn()
                .unwrap();
            let pid = child.id();
            std::mem::forget(child);
            pid
        })
        .join()
        .unwrap();
        let gone = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            })
        };
        // Killed, a zombie until this test process exits: gone either way.
        let what = format!("sleep {pid} to die with the thread that spawned it");
        crate::wait::until(Duration::from_secs(10), &what, || gone(pid).then_some(())).unwrap();
    }

    #[test]
    fn missing_binary_says_how_to_build() {
        let e = binary("no-such-binary-ai-lb").unwrap_err();
        assert!(e.contains("cargo build --bins"), "{e}");
    }

    #[test]
    fn spawn_reads_listening_lines_and_keeps_stderr() {
        let spec = Spec {
            name: "sh".into(),
            program: "sh".into(),
            args: owned(&[
                "-c",
                "echo starting >&2; echo 'LISTENING http 127.0.0.1:1234'; echo 'LISTENING grpc 127.0.0.1:5678'; exec sleep 30",
            ]),
            env: vec![],
            listening: owned(&["http", "grpc"]),
            deadline: Duration::from_secs(10),
        };
        let mut p = Proc::spawn(&spec).unwrap();
        assert_eq!(p.addr("grpc").unwrap(), "127.0.0.1:5678".parse().unwrap());
        assert_eq!(p.addr("http").unwrap(), "127.0.0.1:1234".parse().unwrap());
        p.sigterm().unwrap();
        let st = p.wait_exit(Duration::from_secs(10)).unwrap();
        assert!(!st.success());
        assert!(p.stderr().contains("starting"));
    }

    #[test]
    fn early_exit_is_reported_with_the_log() {
        let spec = Spec {
            name: "sh".into(),
            program: "sh".into(),
            args: owned(&["-c", "echo 'bad flag --x' >&2; exit 2"]),
            env: vec![],
            listening: owned(&["http"]),
            deadline: Duration::from_secs(10),
        };
        let e = Proc::spawn(&spec).unwrap_err();
        assert!(e.contains("bad flag --x"), "{e}");
        // The message points at the log: it is kept.
        let log = e
            .split(['(', ')'])
            .find(|s| s.ends_with("stderr.log"))
            .map(PathBuf::from)
            .unwrap();
        assert!(log.exists(), "{}", log.display());
        let _ = std::fs::remove_dir_all(log.parent().unwrap());
    }

    #[test]
    fn logs_are_removed_after_a_clean_run_and_kept_after_a_failure() {
        let spec = Spec {
            name: "sh".into(),
            program: "sh".into(),
            args: owned(&["-c", "echo 'LISTENING http 127.0.0.1:1'; exec sleep 30"]),
            env: vec![],
            listening: owned(&["http"]),
            deadline: Duration::from_secs(10),
        };
        let p = Proc::spawn(&spec).unwrap();
        let clean = p.stderr_log.clone();
        assert!(clean.exists());
        drop(p);
        assert!(!clean.exists(), "{}", clean.display());
        let p = Proc::spawn(&spec).unwrap();
        let kept = p.stderr_log.clone();
        let _ = p.failure("something went wrong");
        drop(p);
        assert!(kept.exists(), "{}", kept.display());
        let _ = std::fs::remove_dir_all(kept.parent().unwrap());
    }
}
