//! The filter's decisions, free of proxy-wasm: configuration, signal snapshots, scoring,
//! breakers, picking and admission. Time (`now_ms`) and randomness are passed in, so every
//! decision is a pure function of its inputs and tested natively.

pub mod admission;
pub mod error;

pub use error::ConfigError;
