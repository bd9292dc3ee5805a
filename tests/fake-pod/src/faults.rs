//! Decides which faults are injected and how `POST /control` updates them: a partial JSON
//! update, validated field by field (all-or-nothing), errors naming the field and the value.

use serde::Serialize;
use serde_json::{Map, Value};

/// Current fault injection state (also the body of `GET /control`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Faults {
    /// Multiplies the iteration time (≥ 1).
    pub slowdown: f64,
    /// Fraction of requests answered 500 (0..1), decided by the seeded RNG.
    pub error_rate: f64,
    /// Fraction of requests answered 500 with a CUDA out-of-memory error, as vLLM answers one
    /// (`torch.OutOfMemoryError: CUDA out of memory. ...`), decided by the seeded RNG.
    pub memory_error_rate: f64,
    /// Fraction of answers cut off half-way: a stream ends (cleanly) after `max_tokens / 2`
    /// tokens with no finish reason, usage or `[DONE]`; a non-streamed answer carries that
    /// many tokens and `finish_reason: null`. Decided by the seeded RNG.
    pub truncate_rate: f64,
    /// Fraction of requests answered 200 with a body that is not OpenAI JSON (a broken proxy
    /// or server in front of the engine): `text/plain` `upstream engine error`, streamed or
    /// not. Decided by the seeded RNG.
    pub malformed_rate: f64,
    /// The API server's front end takes this long (ms) per request, one request at a time,
    /// before the request reaches the engine: a CPU-starved server process (tokenisation and
    /// request handling on a throttled CPU) or a slow path in front of the engine. Requests
    /// queue for it, and no engine metric shows the wait (queue, running and the latency
    /// histograms start at the engine). 0: off.
    pub frontend_ms: u64,
    /// New requests are accepted but not answered while true.
    pub hang: bool,
    /// The API server stops answering anything, `/metrics` and `/v1/models` included (a wedged
    /// or SIGSTOPped vLLM), while `/sim/gpu` (NVML's stand-in) and `/control` still answer.
    pub freeze: bool,
    /// Forces the utilisation reported by /sim/gpu (0..1).
    pub gpu_utilization: Option<f64>,
    /// Forces the GPM SM occupancy reported by /sim/gpu (0..1); only on presets whose GPU has
    /// GPM (an A100 reports none, so forcing one there is refused).
    pub sm_occupancy: Option<f64>,
    /// Whether /sim/gpu reports the HW-slowdown throttle reason: `None` follows `slowdown`
    /// (reported while it is above 1, as a thermally or power-throttled GPU would), `Some`
    /// forces it (`false`: a slowdown the GPU does not show, e.g. a noisy neighbour).
    pub throttle: Option<bool>,
    /// Forces `vllm:num_requests_waiting` to at least this.
    pub queue: Option<u32>,
    /// Injected Xid errors so far, and the last one.
    pub xid_errors: u64,
    pub last_xid: Option<u32>,
    /// Injected uncorrected ECC errors so far.
    pub ecc_errors: u64,
    /// GPU memory that grows with load and ends in an OOM crash ([`crate::oom`]); None: off.
    pub memory_growth: Option<crate::oom::MemoryGrowth>,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            slowdown: 1.0,
            error_rate: 0.0,
            memory_error_rate: 0.0,
            truncate_rate: 0.0,
            malformed_rate: 0.0,
            frontend_ms: 0,
            hang: false,
            freeze: false,
            gpu_utilization: None,
            sm_occupancy: None,
            throttle: None,
            queue: None,
            xid_errors: 0,
            last_xid: None,
            ecc_errors: 0,
            memory_growth: None,
        }
    }
}

/// A rejected control update.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("control body must be a JSON object: {0}")]
    NotAnObject(String),
    #[error("unknown control field `{field}` (value {value}); known: slowdown, error_rate, memory_error_rate, truncate_rate, malformed_rate, frontend_ms, hang, freeze, gpu_utilization, sm_occupancy, throttle, queue, xid, ecc_errors, memory_growth, reset")]
    UnknownField { field: String, value: String },
    #[error("invalid value {value} for control field `{field}`: {reason}")]
    InvalidValue {
        field: String,
        value: String,
        reason: &'static str,
    },
}

fn invalid(field: &str, value: &Value, reason: &'static str) -> ControlError {
    ControlError::InvalidValue {
        field: field.to_string(),
        value: value.to_string(),
        reason,
    }
}

fn unit_interval(field: &str, v: &Value) -> Result<f64, ControlError> {
    match v.as_f64() {
        Some(x) if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err(invalid(field, v, "must be a number between 0 and 1")),
    }
}

/// `memory_growth`: null (off) or `{"bytes_per_s_per_seq": > 0, "sustained_seqs": ≥ 0
/// (default 0), "restart_ms": 0..=600000 (default 5000)}`.
fn memory_growth(v: &Value) -> Result<Option<crate::oom::MemoryGrowth>, ControlError> {
    const F: &str = "memory_growth";
    if v.is_null() {
        return Ok(None);
    }
    let o = v
        .as_object()
        .ok_or_else(|| invalid(F, v, "must be null or an object"))?;
    for k in o.keys() {
        if !matches!(
            k.as_str(),
            "bytes_per_s_per_seq" | "sustained_seqs" | "restart_ms"
        ) {
            return Err(invalid(
                F,
                v,
                "unknown key (known: bytes_per_s_per_seq, sustained_seqs, restart_ms)",
            ));
        }
    }
    let bytes_per_s_per_seq = match o.get("bytes_per_s_per_seq").and_then(Value::as_f64) {
        Some(x) if x.is_finite() && x > 0.0 => x,
        _ => return Err(invalid(F, v, "bytes_per_s_per_seq must be a number > 0")),
    };
    let sustained_seqs = match o.get("sustained_seqs") {
        None => 0.0,
        Some(s) => match s.as_f64() {
            Some(x) if x.is_finite() && x >= 0.0 => x,
            _ => return Err(invalid(F, v, "sustained_seqs must be a number >= 0")),
        },
    };
    let restart_ms = match o.get("restart_ms") {
        None => 5000,
        Some(s) => match s.as_u64() {
            Some(x) if x <= 600_000 => x,
            _ => return Err(invalid(F, v, "restart_ms must be an integer in 0..=600000")),
        },
    };
    Ok(Some(crate::oom::MemoryGrowth {
        bytes_per_s_per_seq,
        sustained_seqs,
        restart_ms,
    }))
}

impl Faults {
    /// Applies a partial update from a JSON body. `reset: true` is applied first, then the
    /// other fields; nothing changes if any field is invalid. `gpm`: whether the pod's GPU
    /// reports GPM readings (`sm_occupancy` can be forced only then).
    pub fn apply(&self, body: &Value, gpm: bool) -> Result<Faults, ControlError> {
        let obj: &Map<String, Value> = body
            .as_object()
            .ok_or_else(|| ControlError::NotAnObject(body.to_string()))?;
        let mut next = self.clone();
        match obj.get("reset") {
            None => {}
            Some(Value::Bool(true)) => next = Faults::default(),
            Some(Value::Bool(false)) => {}
            Some(v) => return Err(invalid("reset", v, "must be true or false")),
        }
        for (field, v) in obj {
            match field.as_str() {
                "reset" => {}
                "slowdown" => match v.as_f64() {
                    Some(x) if x.is_finite() && x >= 1.0 => next.slowdown = x,
                    _ => return Err(invalid(field, v, "must be a number >= 1")),
                },
                "error_rate" => next.error_rate = unit_interval(field, v)?,
                "memory_error_rate" => next.memory_error_rate = unit_interval(field, v)?,
                "truncate_rate" => next.truncate_rate = unit_interval(field, v)?,
                "malformed_rate" => next.malformed_rate = unit_interval(field, v)?,
                "frontend_ms" => match v.as_u64() {
                    Some(x) if x <= 60_000 => next.frontend_ms = x,
                    _ => {
                        return Err(invalid(
                            field,
                            v,
                            "must be an integer within 0..=60000 (ms)",
                        ))
                    }
                },
                "hang" => {
                    next.hang = v
                        .as_bool()
                        .ok_or_else(|| invalid(field, v, "must be true or false"))?
                }
                "freeze" => {
                    next.freeze = v
                        .as_bool()
                        .ok_or_else(|| invalid(field, v, "must be true or false"))?
                }
                "gpu_utilization" => {
                    next.gpu_utilization = if v.is_null() {
                        None
                    } else {
                        Some(unit_interval(field, v)?)
                    }
                }
                "sm_occupancy" => {
                    next.sm_occupancy = if v.is_null() {
                        None
                    } else if !gpm {
                        return Err(invalid(
                            field,
                            v,
                            "this preset's GPU has no GPM (A100 and older): it reports no SM occupancy to force",
                        ));
                    } else {
                        Some(unit_interval(field, v)?)
                    }
                }
                "throttle" => {
                    next.throttle = match v {
                        Value::Null => None,
                        Value::Bool(b) => Some(*b),
                        _ => return Err(invalid(field, v, "must be true, false or null")),
                    }
                }
                "queue" => {
                    next.queue = if v.is_null() {
                        None
                    } else {
                        let q = v
                            .as_u64()
                            .and_then(|q| u32::try_from(q).ok())
                            .ok_or_else(|| invalid(field, v, "must be a u32 or null"))?;
                        Some(q)
                    }
                }
                "xid" => {
                    let x = v
                        .as_u64()
                        .and_then(|q| u32::try_from(q).ok())
                        .ok_or_else(|| invalid(field, v, "must be a u32 Xid code"))?;
                    next.xid_errors += 1;
                    next.last_xid = Some(x);
                }
                "memory_growth" => next.memory_growth = memory_growth(v)?,
                "ecc_errors" => {
                    let n = v
                        .as_u64()
                        .ok_or_else(|| invalid(field, v, "must be a u64 count to add"))?;
                    next.ecc_errors = next.ecc_errors.saturating_add(n);
                }
                _ => {
                    return Err(ControlError::UnknownField {
                        field: field.clone(),
                        value: v.to_string(),
                    })
                }
            }
        }
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    impl Faults {
        /// `apply` on a GPU with GPM.
        fn apply_t(&self, body: &Value) -> Result<Faults, ControlError> {
            self.apply(body, true)
        }
    }

    #[test]
    fn memory_growth_is_validated_and_cleared_by_null() {
        let f = Faults::default()
            .apply_t(&json!({"memory_growth": {"bytes_per_s_per_seq": 1e8, "sustained_seqs": 4}}))
            .unwrap();
        assert_eq!(
            f.memory_growth,
            Some(crate::oom::MemoryGrowth {
                bytes_per_s_per_seq: 1e8,
                sustained_seqs: 4.0,
                restart_ms: 5000
            })
        );
        for bad in [
            json!({"memory_growth": {"bytes_per_s_per_seq": 0}}),
            json!({"memory_growth": {"bytes_per_s_per_seq": 1e8, "sustained_seqs": -1}}),
            json!({"memory_growth": {"bytes_per_s_per_seq": 1e8, "restart_ms": 700000}}),
            json!({"memory_growth": {"bytes_per_s_per_seq": 1e8, "grow": 1}}),
            json!({"memory_growth": 3}),
        ] {
            let e = f.apply_t(&bad).unwrap_err().to_string();
            assert!(e.contains("memory_growth"), "{e}");
        }
        let off = f.apply_t(&json!({"memory_growth": null})).unwrap();
        assert_eq!(off.memory_growth, None);
    }

    #[test]
    fn sm_occupancy_is_forced_only_where_the_gpu_has_gpm() {
        let f = Faults::default()
            .apply(&json!({"sm_occupancy": 0.97}), true)
            .unwrap();
        assert_eq!(f.sm_occupancy, Some(0.97));
        assert_eq!(
            f.apply(&json!({"sm_occupancy": null}), true)
                .unwrap()
                .sm_occupancy,
            None
        );
        let e = Faults::default()
            .apply(&json!({"sm_occupancy": 0.97}), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sm_occupancy") && e.contains("0.97") && e.contains("GPM"),
            "{e}"
        );
        // Clearing is always allowed.
        assert!(Faults::default()
            .apply(&json!({"sm_occupancy": null}), false)
            .is_ok());
    }

    #[test]
    fn partial_updates_apply() {
        let f = Faults::default()
            .apply_t(&json!({"slowdown": 2.5, "error_rate": 0.5, "queue": 7}))
            .unwrap();
        assert_eq!(f.slowdown, 2.5);
        assert_eq!(f.error_rate, 0.5);
        assert_eq!(f.queue, Some(7));
        let f = f
            .apply_t(&json!({"queue": null, "xid": 79, "ecc_errors": 2}))
            .unwrap();
        assert_eq!(f.queue, None);
        assert_eq!(f.slowdown, 2.5);
        assert_eq!((f.xid_errors, f.last_xid, f.ecc_errors), (1, Some(79), 2));
        let f = f.apply_t(&json!({"xid": 48})).unwrap();
        assert_eq!((f.xid_errors, f.last_xid), (2, Some(48)));
    }

    #[test]
    fn reset_clears_then_applies_the_rest() {
        let f = Faults::default()
            .apply_t(&json!({"hang": true, "freeze": true, "xid": 1}))
            .unwrap();
        let f = f.apply_t(&json!({"reset": true, "slowdown": 3})).unwrap();
        assert_eq!(
            f,
            Faults {
                slowdown: 3.0,
                ..Faults::default()
            }
        );
    }

    #[test]
    fn bad_fields_name_field_and_value() {
        let base = Faults::default();
        for (body, field, value) in [
            (json!({"bogus": 1}), "bogus", "1"),
            (json!({"slowdown": 0.5}), "slowdown", "0.5"),
            (json!({"error_rate": 1.5}), "error_rate", "1.5"),
            (json!({"hang": "yes"}), "hang", "\"yes\""),
            (json!({"frontend_ms": -1}), "frontend_ms", "-1"),
            (json!({"frontend_ms": 60001}), "frontend_ms", "60001"),
            (json!({"freeze": 1}), "freeze", "1"),
            (json!({"gpu_utilization": -0.1}), "gpu_utilization", "-0.1"),
            (json!({"sm_occupancy": 1.5}), "sm_occupancy", "1.5"),
            (json!({"queue": -1}), "queue", "-1"),
            (json!({"throttle": 1}), "throttle", "1"),
            (json!({"xid": "x"}), "xid", "\"x\""),
            (json!({"reset": 1}), "reset", "1"),
        ] {
            let e = base.apply_t(&body).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(value), "{e}");
        }
        // all-or-nothing: a valid field next to an invalid one is not applied
        assert!(base.apply_t(&json!({"slowdown": 2, "nope": 1})).is_err());
        assert!(base.apply_t(&json!([1])).is_err());
    }
}
