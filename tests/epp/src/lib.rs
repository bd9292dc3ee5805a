//! `ai-lb-epp`: a benchmark baseline re-implementing the llm-d router's endpoint picker (EPP)
//! default scheduling (llm-d/llm-d-router at ebab68792), served to Envoy over ext_proc. See
//! docs/epp-baseline.md for what is llm-d's, what is implemented and every deviation.
//!
//! Decisions (pure, no I/O): [`config`], [`prom`], [`podmetrics`], [`request`], [`prefix`],
//! [`scheduler`], [`exchange`], [`pool`], [`stats`]. Glue: [`server`] (tonic), [`scrape`]
//! (HTTP scraper), [`admin`] (axum), and `main.rs`.

pub mod admin;
pub mod config;
pub mod exchange;
pub mod podmetrics;
pub mod pool;
pub mod prefix;
pub mod prom;
pub mod request;
pub mod scheduler;
pub mod scrape;
pub mod server;
pub mod stats;
