//! The filter core.
