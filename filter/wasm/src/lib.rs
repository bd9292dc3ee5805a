//! proxy-wasm glue.
