//! The `sim` source (explicit opt-in only): reads simulated GPUs from a fake pod's
//! `GET <url>/sim/gpu` and decides which of its values may be forwarded. Missing or null fields
//! stay absent; out-of-range values (utilisation outside 0..1, NaN, negative, memory used above
//! total, wrong JSON types) become `Reading.rejected` entries, never signals. The fake pod's
//! GPM-style activity (`sm_occupancy`, `sm_utilization`, `tensor_activity`, `dram_activity`,
//! `null` on GPUs before Hopper, as real GPM) is forwarded with activity source `SIM`.

use super::model_server::fetch;
use super::{Reading, Rejected, Source, SourceError};
use crate::sources::nvml::throttle_reason_names;
use ai_lb_proto::v1::{GpuActivitySource, GpuStats};
use serde_json::{Map, Value};
use std::time::{Duration, Instant};

const NAME: &str = "sim";

/// Where the fake pod is.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOptions {
    /// Base URL of the fake pod, e.g. `http://127.0.0.1:9000`; the source GETs `<url>/sim/gpu`.
    pub url: String,
    pub timeout: Duration,
}

/// The `sim` source.
#[derive(Debug)]
pub struct SimSource {
    url: String,
    client: reqwest::Client,
}

impl SimSource {
    pub fn new(opts: SimOptions) -> Result<Self, SourceError> {
        let url = format!("{}/sim/gpu", opts.url.trim_end_matches('/'));
        if reqwest::Url::parse(&url).is_err() {
            return Err(SourceError::Other {
                source_name: NAME,
                detail: format!("url: invalid URL {:?}", opts.url),
            });
        }
        let client = reqwest::Client::builder()
            .timeout(opts.timeout)
            .connect_timeout(opts.timeout)
            .build()
            .map_err(|e| SourceError::Other {
                source_name: NAME,
                detail: format!("HTTP client: {e}"),
            })?;
        Ok(Self { url, client })
    }
}

#[async_trait::async_trait]
impl Source for SimSource {
    fn name(&self) -> &'static str {
        NAME
    }

    fn local(&self) -> bool {
        true
    }

    async fn sample(&mut self, _now: Instant) -> Result<Reading, SourceError> {
        let body = fetch(&self.client, NAME, &self.url).await?;
        parse_gpus(&body)
    }
}

/// Decodes a `/sim/gpu` body. A body that is not `{"gpus":[...]}` fails the sample; bad values
/// inside it are rejected one by one.
pub fn parse_gpus(body: &[u8]) -> Result<Reading, SourceError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| SourceError::Malformed {
        source_name: NAME,
        line: e.line(),
        detail: format!("not JSON: {e}"),
    })?;
    let gpus = v
        .get("gpus")
        .and_then(Value::as_array)
        .ok_or_else(|| SourceError::Other {
            source_name: NAME,
            detail: "response has no \"gpus\" array".into(),
        })?;
    let mut rejected = Vec::new();
    let mut out = Vec::with_capacity(gpus.len());
    for (pos, g) in gpus.iter().enumerate() {
        let Some(obj) = g.as_object() else {
            rejected.push(Rejected {
                field: format!("gpus[{pos}]"),
                value: g.to_string(),
                reason: "not an object".into(),
            });
            continue;
        };
        out.push(gpu(pos, obj, &mut rejected));
    }
    Ok(Reading {
        gpus: Some(out),
        rejected,
        ..Default::default()
    })
}

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: String,
    rejected: &'a mut Vec<Rejected>,
}

impl Fields<'_> {
    fn reject(&mut self, key: &str, v: &Value, reason: &str) {
        self.rejected.push(Rejected {
            field: format!("{}.{key}", self.prefix),
            value: v.to_string(),
            reason: reason.to_string(),
        });
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A finite number ≥ 0.
    fn non_negative(&mut self, key: &str) -> Option<f64> {
        let v = self.get(key)?.clone();
        match v.as_f64() {
            Some(f) if f.is_finite() && f >= 0.0 => Some(f),
            Some(_) => {
                self.reject(key, &v, "negative or not finite");
                None
            }
            None => {
                self.reject(key, &v, "not a number");
                None
            }
        }
    }

    /// A number in 0..1.
    fn fraction(&mut self, key: &str) -> Option<f64> {
        let f = self.non_negative(key)?;
        if f > 1.0 {
            self.reject(key, &Value::from(f), "above 1");
            return None;
        }
        Some(f)
    }

    fn u64(&mut self, key: &str) -> Option<u64> {
        let v = self.get(key)?.clone();
        match v.as_u64() {
            Some(n) => Some(n),
            None => {
                self.reject(key, &v, "not a non-negative integer");
                None
            }
        }
    }

    fn string(&mut self, key: &str) -> Option<String> {
        let v = self.get(key)?.clone();
        match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                self.reject(key, &v, "not a string");
                None
            }
        }
    }
}

fn gpu(pos: usize, obj: &Map<String, Value>, rejected: &mut Vec<Rejected>) -> GpuStats {
    let mut f = Fields {
        obj,
        prefix: format!("gpus[{pos}]"),
        rejected,
    };
    let index = f
        .u64("index")
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or(pos as u32);
    let mut g = GpuStats {
        index,
        uuid: f.string("uuid").unwrap_or_default(),
        name: f.string("name").unwrap_or_default(),
        ..Default::default()
    };
    g.utilization = f.fraction("utilization");
    g.sm_occupancy = f.fraction("sm_occupancy");
    g.sm_utilization = f.fraction("sm_utilization");
    g.tensor_activity = f.fraction("tensor_activity");
    g.dram_activity = f.fraction("dram_activity");
    if g.sm_occupancy.is_some()
        || g.sm_utilization.is_some()
        || g.tensor_activity.is_some()
        || g.dram_activity.is_some()
    {
        g.activity_source = GpuActivitySource::Sim as i32;
    }
    g.memory_used_bytes = f.u64("memory_used_bytes");
    g.memory_total_bytes = f.u64("memory_total_bytes");
    if let (Some(used), Some(total)) = (g.memory_used_bytes, g.memory_total_bytes) {
        if used > total {
            f.reject(
                "memory_used_bytes",
                &Value::from(used),
                &format!("memory used above total {total}"),
            );
            g.memory_used_bytes = None;
        }
    }
    g.temperature_celsius = match f.get("temperature_celsius").cloned() {
        None => None,
        Some(v) => match v.as_f64() {
            Some(t) if t.is_finite() && (-100.0..=200.0).contains(&t) => Some(t),
            _ => {
                f.reject("temperature_celsius", &v, "not a temperature in -100..200");
                None
            }
        },
    };
    g.power_watts = f.non_negative("power_watts");
    g.power_limit_watts = f.non_negative("power_limit_watts");
    g.throttle_reasons = f.u64("throttle_reasons");
    g.throttle_reason_names = g
        .throttle_reasons
        .map(throttle_reason_names)
        .unwrap_or_default();
    g.ecc_uncorrected_errors = f.u64("ecc_uncorrected_errors");
    g.xid_errors = f.u64("xid_errors");
    g.last_xid = match f.u64("last_xid") {
        Some(x) => match u32::try_from(x) {
            Ok(x) => Some(x),
            Err(_) => {
                f.reject("last_xid", &Value::from(x), "above u32");
                None
            }
        },
        None => None,
    };
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_body_decodes() {
        let body = br#"{"gpus":[{"index":0,"uuid":"GPU-1","name":"NVIDIA H100 80GB HBM3 (simulated)","utilization":0.42,"memory_used_bytes":123,"memory_total_bytes":456,"temperature_celsius":55.0,"power_watts":300.0,"power_limit_watts":700.0,"throttle_reasons":0,"ecc_uncorrected_errors":0,"xid_errors":0,"last_xid":null}]}"#;
        let r = parse_gpus(body).unwrap();
        assert!(r.rejected.is_empty(), "{:?}", r.rejected);
        let g = &r.gpus.unwrap()[0];
        assert_eq!(g.uuid, "GPU-1");
        assert_eq!(g.utilization, Some(0.42));
        assert_eq!(g.memory_used_bytes, Some(123));
        assert_eq!(g.power_limit_watts, Some(700.0));
        assert_eq!(g.throttle_reasons, Some(0));
        assert_eq!(g.last_xid, None);
    }

    #[test]
    fn missing_fields_are_absent_and_bad_ones_rejected() {
        let body = br#"{"gpus":[{"index":1,"utilization":1.5,"memory_used_bytes":500,"memory_total_bytes":100,"power_watts":-3,"temperature_celsius":"hot"},{}]}"#;
        let r = parse_gpus(body).unwrap();
        let gpus = r.gpus.unwrap();
        assert_eq!(gpus[0].utilization, None);
        assert_eq!(gpus[0].memory_used_bytes, None);
        assert_eq!(gpus[0].memory_total_bytes, Some(100));
        assert_eq!(gpus[0].power_watts, None);
        assert_eq!(gpus[0].temperature_celsius, None);
        assert_eq!(
            gpus[1],
            GpuStats {
                index: 1,
                ..Default::default()
            }
        );
        let fields: Vec<_> = r.rejected.iter().map(|r| r.field.as_str()).collect();
        assert_eq!(
            fields,
            vec![
                "gpus[0].utilization",
                "gpus[0].memory_used_bytes",
                "gpus[0].temperature_celsius",
                "gpus[0].power_watts"
            ]
        );
    }

    #[test]
    fn gpm_fields_are_forwarded_null_is_absent_and_garbage_rejected() {
        let hopper = br#"{"gpus":[{"index":0,"utilization":1.0,"sm_occupancy":0.31,"sm_utilization":0.9,"tensor_activity":0.2,"dram_activity":0.7}]}"#;
        let r = parse_gpus(hopper).unwrap();
        assert!(r.rejected.is_empty(), "{:?}", r.rejected);
        let g = &r.gpus.unwrap()[0];
        assert_eq!(g.utilization, Some(1.0));
        assert_eq!(g.sm_occupancy, Some(0.31));
        assert_eq!(g.sm_utilization, Some(0.9));
        assert_eq!(g.tensor_activity, Some(0.2));
        assert_eq!(g.dram_activity, Some(0.7));
        assert_eq!(g.activity_source, GpuActivitySource::Sim as i32);

        let ampere = br#"{"gpus":[{"index":0,"utilization":1.0,"sm_occupancy":null,"sm_utilization":null,"tensor_activity":null,"dram_activity":null}]}"#;
        let r = parse_gpus(ampere).unwrap();
        assert!(r.rejected.is_empty());
        let g = &r.gpus.unwrap()[0];
        assert_eq!(g.sm_occupancy, None);
        assert_eq!(g.activity_source, GpuActivitySource::Unspecified as i32);

        let bad = br#"{"gpus":[{"index":0,"sm_occupancy":1.5,"sm_utilization":-0.1,"tensor_activity":"busy","dram_activity":0.4}]}"#;
        let r = parse_gpus(bad).unwrap();
        let g = &r.gpus.as_ref().unwrap()[0];
        assert_eq!(
            (g.sm_occupancy, g.sm_utilization, g.tensor_activity),
            (None, None, None)
        );
        assert_eq!(g.dram_activity, Some(0.4));
        let fields: Vec<_> = r.rejected.iter().map(|r| r.field.as_str()).collect();
        assert_eq!(
            fields,
            vec![
                "gpus[0].sm_occupancy",
                "gpus[0].sm_utilization",
                "gpus[0].tensor_activity"
            ]
        );
    }

    #[test]
    fn body_without_gpus_fails_the_sample() {
        assert!(parse_gpus(b"{}").is_err());
        assert!(parse_gpus(b"<html>").is_err());
    }
}
