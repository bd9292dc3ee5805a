//! The one configuration error type: every rejection names the field path, the value and why,
//! so a platform engineer reading the Envoy log knows what to change.

use std::fmt;

/// A rejected configuration value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// JSON path of the field, e.g. `pools[0].weights.gpu`. Empty for whole-document errors.
    pub path: String,
    /// The offending value as written (JSON text), or empty when the field is missing.
    pub value: String,
    /// What is wrong and what is accepted, e.g. `must be within 0..=1`.
    pub reason: String,
}

impl ConfigError {
    pub fn new(
        path: impl Into<String>,
        value: impl fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        Self {
            path: path.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "ai-lb plugin config: {}", self.reason)
        } else if self.value.is_empty() {
            write!(
                f,
                "ai-lb plugin config: field `{}`: {}",
                self.path, self.reason
            )
        } else {
            write!(
                f,
                "ai-lb plugin config: field `{}`: value {}: {}",
                self.path, self.value, self.reason
            )
        }
    }
}

impl std::error::Error for ConfigError {}
