//! Decides nothing: what the core's admission gate (`ai_lb_filter_core::lifecycle::admission`)
//! needs from proxy-wasm: the tenants' token buckets in Envoy's shared data ([`HostStore`],
//! CAS, exact across worker VMs), the VM's metrics as its stats sink (`ailb.admission.*`), and
//! the plugin config's `admission` section in either shape.

use proxy_wasm::types::Status;
use serde_json::Value;

use ai_lb_filter_core::admission::bucket::{CasMismatch, SharedStore};
use ai_lb_filter_core::admission::priority::PriorityClass;
use ai_lb_filter_core::admission::AdmissionConfig;
use ai_lb_filter_core::error::ConfigError;
use ai_lb_filter_core::lifecycle::admission::AdmissionStats;

use crate::host;
use crate::metrics::Metrics;

/// Prefix of every admission stat.
const PREFIX: &str = "ailb.admission";

/// proxy-wasm shared data as the core's [`SharedStore`]. Any host error other than a CAS
/// mismatch is also reported as a mismatch: the core's retry loop is bounded and then fails
/// open (counted).
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match host::shared_get(key) {
            (Some(v), Some(cas)) => Some((v, cas)),
            (Some(v), None) => Some((v, 0)),
            _ => None,
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        match host::shared_set(key, value, cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) | Err(_) => Err(CasMismatch),
        }
    }
}

/// The VM's metrics, named as the wasm filter always named them (tenant and class in the
/// name; `stats_tags` can turn them into labels).
impl AdmissionStats for Metrics {
    fn count(&mut self, what: &str, by: u64) {
        self.inc(&format!("{PREFIX}.{what}"), by);
    }
    fn count_tenant(&mut self, tenant: &str, class: PriorityClass, what: &str, by: u64) {
        let class = class.as_str();
        self.inc(&format!("{PREFIX}.tenant.{tenant}.{class}.{what}"), by);
    }
    fn record(&mut self, what: &str, value: u64) {
        Metrics::record(self, &format!("{PREFIX}.{what}"), value);
    }
    fn set(&mut self, what: &str, value: u64) {
        Metrics::set(self, &format!("{PREFIX}.{what}"), value);
    }
}

/// Reads the `admission` section of the plugin config whichever shape `FilterConfig` gives it
/// (the raw JSON value, or the already validated config).
pub trait AdmissionSection {
    fn admission_config(&self) -> Result<Option<AdmissionConfig>, ConfigError>;
}

impl AdmissionSection for Option<Value> {
    fn admission_config(&self) -> Result<Option<AdmissionConfig>, ConfigError> {
        match self {
            None => Ok(None),
            Some(v) => AdmissionConfig::from_value(v).map(|c| c.enabled.then_some(c)),
        }
    }
}

impl AdmissionSection for Option<AdmissionConfig> {
    fn admission_config(&self) -> Result<Option<AdmissionConfig>, ConfigError> {
        Ok(self.clone().filter(|c| c.enabled))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_section_is_read_from_either_shape() {
        let raw: Option<Value> =
            Some(json!({"tenants": {"default": {"tokensPerSecond": 5, "burst": 9}}}));
        let c = raw.admission_config().unwrap().unwrap();
        assert_eq!(c.tenants.default.burst, 9);
        let off: Option<Value> = Some(json!({"enabled": false}));
        assert!(off.admission_config().unwrap().is_none());
        let none: Option<Value> = None;
        assert!(none.admission_config().unwrap().is_none());
        let bad: Option<Value> =
            Some(json!({"tenants": {"default": {"tokensPerSecond": 0, "burst": 9}}}));
        let e = bad.admission_config().unwrap_err();
        assert_eq!(e.path, "admission.tenants.default.tokensPerSecond");
        let typed: Option<AdmissionConfig> = Some(c.clone());
        assert_eq!(typed.admission_config().unwrap(), Some(c));
    }
}
