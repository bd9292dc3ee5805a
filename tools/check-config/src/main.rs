//! `ai-lb-check-config`: decides whether ai-lb plugin configs are accepted, with the same parser
//! the filter runs in Envoy (`FilterConfig::from_json`). Reads JSON files, `-` (stdin, JSON or
//! YAML), and Kubernetes YAML (multi-document) holding `WasmPlugin` (`spec.pluginConfig`) or
//! `EnvoyFilter` resources (the wasm filter's `configuration` StringValue in the patches).
//! Exit 0: every config is valid; 1: one is invalid; 2: usage or I/O error.

use std::io::Read;
use std::process::ExitCode;

use ai_lb_check_config::inputs::{configs_in, Found};

const USAGE: &str = "usage: ai-lb-check-config [--schema] <FILE|->...
  FILE   a plugin config JSON file (.json), or Kubernetes YAML (.yaml/.yml) with WasmPlugin
         and/or EnvoyFilter resources; `-` reads stdin (JSON or YAML)
  --schema  print the plugin config's JSON Schema and exit
Prints `OK <file> [<resource>]` per valid config, the field path, value and reason per
invalid one, and `WARN` lines (field, value, why) for what a valid config lets any client
claim or read: a tenant key from a header no authentication filter sets, the debug header,
the status page. Exit status: 0 all valid (warnings or not), 1 some config invalid, 2 usage
or I/O error.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--schema") {
        if args.len() != 1 {
            eprintln!("--schema takes no other argument\n{USAGE}");
            return ExitCode::from(2);
        }
        let schema = ai_lb_filter_core::config::plugin_config_schema();
        match serde_json::to_string_pretty(&schema) {
            Ok(s) => {
                println!("{s}");
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("cannot render the schema: {e}");
                return ExitCode::from(2);
            }
        }
    }
    if args.is_empty() {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    }
    if let Some(flag) = args
        .iter()
        .find(|a| a.starts_with('-') && a.as_str() != "-")
    {
        eprintln!("unknown option {flag}\n{USAGE}");
        return ExitCode::from(2);
    }

    let mut invalid = 0usize;
    let mut io_errors = 0usize;
    let mut checked = 0usize;
    for arg in &args {
        let (name, text) = match read_input(arg) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("ERROR {arg}: {e}");
                io_errors += 1;
                continue;
            }
        };
        let found = configs_in(&name, &text);
        if found.is_empty() {
            println!("SKIP {name}: no WasmPlugin or EnvoyFilter with an ai-lb plugin config");
        }
        for f in found {
            checked += 1;
            match f {
                Found::Config { resource, json } => {
                    match ai_lb_filter_core::FilterConfig::from_json(json.as_bytes()) {
                        Ok(cfg) => {
                            println!("OK {name}{}", label(&resource));
                            for w in trust_warnings(&cfg) {
                                println!("WARN {name}{}: {w}", label(&resource));
                            }
                        }
                        Err(e) => {
                            invalid += 1;
                            println!("INVALID {name}{}: {e}", label(&resource));
                        }
                    }
                }
                Found::Broken { resource, reason } => {
                    invalid += 1;
                    println!("INVALID {name}{}: {reason}", label(&resource));
                }
            }
        }
    }
    if io_errors > 0 {
        ExitCode::from(2)
    } else if invalid > 0 {
        ExitCode::from(1)
    } else if checked == 0 {
        eprintln!("no plugin config found in the given inputs");
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

/// What a valid route config lets any client claim or read (issue 31): a tenant key from a
/// header no authentication filter sets, and the debug header and status page, which show pod
/// addresses and scores to whoever asks. Warnings, not errors: each is right where every caller
/// is trusted.
fn trust_warnings(cfg: &ai_lb_filter_core::FilterConfig) -> Vec<String> {
    use ai_lb_filter_core::config::Mode;
    if cfg.mode != Mode::Route {
        return Vec::new();
    }
    let mut out: Vec<String> = cfg
        .admission
        .iter()
        .filter(|a| a.enabled)
        .flat_map(|a| a.trust_warnings())
        .map(|w| w.to_string())
        .collect();
    let quoted = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| s.to_string());
    if let Some(h) = &cfg.debug_header {
        out.push(format!(
            "field `debugHeader`: value {}: any client that sends `{h}` gets the chosen pod's \
             address, its score and the ranked list in the response; set it only where every \
             caller may see them, or remove the header from other callers' requests before \
             ai-lb (Envoy `header_mutation`)",
            quoted(h)
        ));
    }
    if let Some(p) = &cfg.status_path {
        out.push(format!(
            "field `statusPath`: value {}: any client that requests this path gets every pod's \
             address, load and scores; serve it only where every caller may see them, or deny \
             the path to other callers before ai-lb (Envoy `rbac`)",
            quoted(p)
        ));
    }
    out
}

fn label(resource: &Option<String>) -> String {
    match resource {
        Some(r) => format!(" [{r}]"),
        None => String::new(),
    }
}

/// The display name and text of one input (`-` = stdin).
fn read_input(arg: &str) -> Result<(String, String), String> {
    if arg == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| format!("cannot read stdin: {e}"))?;
        Ok(("<stdin>".to_string(), s))
    } else {
        let s = std::fs::read_to_string(arg).map_err(|e| format!("cannot read: {e}"))?;
        Ok((arg.to_string(), s))
    }
}
