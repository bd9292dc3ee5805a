//! The agent's configuration: flags through clap (`RawArgs`'s parser), a config file
//! (`config::parse_file`, YAML or TOML by extension), their merge (`RawArgs::merge`) and the
//! validation (`AgentConfig::try_from`). Input (text): one argument per line; a line
//! `=== <ext>` starts the config file, read as `agent.<ext>`. Properties: never panics; a
//! validated config keeps the rules it promises (a routable serving address, the GPU sampled
//! no slower than the pod, windows at least one sample long, the recent window at least two);
//! every error renders.
#![no_main]

use std::path::Path;

use ai_lb_agent::config::{parse_file, AgentConfig, RawArgs};
use std::sync::OnceLock;

use clap::{Command, CommandFactory, FromArgMatches};
use libfuzzer_sys::fuzz_target;

static COMMAND: OnceLock<Command> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut args = vec!["ai-lb-agent"];
    let mut file = None;
    let mut lines = text.split('\n');
    for line in lines.by_ref() {
        if let Some(ext) = line.strip_prefix("=== ") {
            file = Some(ext);
            break;
        }
        args.push(line);
    }
    let rest: Vec<&str> = lines.collect();
    // `RawArgs::try_parse_from`, with the command built once (building it is most of the
    // cost of a parse, and the same every time).
    let parsed = COMMAND
        .get_or_init(|| {
            let mut c = RawArgs::command();
            c.build();
            c
        })
        .clone()
        .try_get_matches_from(&args)
        .and_then(|m| RawArgs::from_arg_matches(&m));
    let raw = match parsed {
        Ok(r) => r,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let raw = match file {
        Some(ext) => match parse_file(Path::new(&format!("agent.{ext}")), &rest.join("\n")) {
            Ok(f) => raw.merge(f),
            Err(e) => {
                let _ = e.to_string();
                return;
            }
        },
        None => raw,
    };
    let cfg = match AgentConfig::try_from(raw) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert!(cfg.serving_address.port() != 0 && !cfg.serving_address.ip().is_unspecified());
    assert!(cfg.gpu_sample_interval <= cfg.sample_interval);
    assert!(cfg.window >= cfg.sample_interval && cfg.rate_window >= cfg.sample_interval);
    assert!(cfg.recent_window >= cfg.sample_interval * 2);
    assert!(cfg.models.iter().all(|m| !m.is_empty() && m.trim() == m));
});
