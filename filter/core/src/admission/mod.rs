//! Admission control (being written).
