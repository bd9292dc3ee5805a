//! Open-loop load generator for OpenAI-compatible streaming endpoints: seeded traces
//! (`schedule`, `workload`, with prompt texts from `text`), a measuring client (`client`,
//! `sse`), the dispatcher (`run`) and the numbers (`stats`, `report`, `live`). The binary
//! `ai-lb-loadgen` wires them to flags.

pub mod client;
pub mod config;
pub mod live;
pub mod report;
pub mod run;
pub mod schedule;
pub mod sse;
pub mod stats;
pub mod text;
pub mod workload;
