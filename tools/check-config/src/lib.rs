//! `ai-lb-check-config` as a library: [`inputs::configs_in`] is the entry of the input reader
//! (JSON, WasmPlugin and EnvoyFilter YAML) that the CLI runs and `fuzz/` fuzzes.

pub mod inputs;
