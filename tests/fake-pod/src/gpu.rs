//! Decides what the simulated GPUs report on `/sim/gpu` (the agent's `sim` source): utilisation
//! from the engine's busy fraction and batch occupancy, memory, temperature, power, and the
//! injected Xid/ECC faults, in the exact JSON shape the agent reads.

use serde::Serialize;

use crate::config::PresetSpec;
use crate::faults::Faults;

/// NVML `nvmlClocksThrottleReasonHwSlowdown`, reported while a slowdown fault is active.
pub const THROTTLE_HW_SLOWDOWN: u64 = 0x8;
/// Fraction of total memory vLLM preallocates (`--gpu-memory-utilization` default 0.9).
pub const MEMORY_USED_FRACTION: f64 = 0.9;

/// Body of `GET /sim/gpu`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimGpuReport {
    pub gpus: Vec<SimGpu>,
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimGpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub utilization: f64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub temperature_celsius: f64,
    pub power_watts: f64,
    pub power_limit_watts: f64,
    pub throttle_reasons: u64,
    pub ecc_uncorrected_errors: u64,
    pub xid_errors: u64,
    pub last_xid: Option<u32>,
}

/// Reported utilisation (0..1) from the busy fraction and mean batch occupancy
/// (running / max_num_seqs) over the last second: `busy × (0.5 + 0.5 × occupancy)`.
///
/// Real NVML utilisation is "fraction of time a kernel was running", which reads ~100 % as soon
/// as one request is decoding; a signal that saturates at batch 1 cannot tell a pod with 1
/// sequence from one with 200. We keep NVML's meaning for the first half (busy time) and let
/// the batch occupancy fill the rest, so the signal keeps a gradient under load. A test that
/// needs NVML's saturated reading forces it with the `gpu_utilization` fault.
pub fn utilization(busy_fraction: f64, occupancy: f64) -> f64 {
    let b = busy_fraction.clamp(0.0, 1.0);
    let o = occupancy.clamp(0.0, 1.0);
    (b * (0.5 + 0.5 * o)).clamp(0.0, 1.0)
}

/// A stable NVML-style UUID derived from the pod name and GPU index.
pub fn gpu_uuid(pod_name: &str, index: u32) -> String {
    let hi = fnv1a(format!("{pod_name}/{index}").as_bytes());
    let lo = fnv1a(format!("{index}\u{0}{pod_name}").as_bytes());
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xffff,
        hi & 0xffff,
        lo >> 48,
        lo & 0xffff_ffff_ffff
    )
}

/// 64-bit FNV-1a.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Builds the report for `num_gpus` GPUs of a tensor-parallel group (all equally loaded;
/// injected Xid/ECC faults land on GPU 0).
pub fn report(
    spec: &PresetSpec,
    pod_name: &str,
    num_gpus: u32,
    engine_utilization: f64,
    faults: &Faults,
) -> SimGpuReport {
    let util = faults
        .gpu_utilization
        .unwrap_or(engine_utilization)
        .clamp(0.0, 1.0);
    let gpus = (0..num_gpus)
        .map(|index| SimGpu {
            index,
            uuid: gpu_uuid(pod_name, index),
            name: spec.gpu_name.to_string(),
            utilization: util,
            memory_used_bytes: (spec.memory_total_bytes as f64 * MEMORY_USED_FRACTION) as u64,
            memory_total_bytes: spec.memory_total_bytes,
            temperature_celsius: 30.0 + 45.0 * util,
            power_watts: spec.idle_power_watts
                + (spec.power_limit_watts - spec.idle_power_watts) * util,
            power_limit_watts: spec.power_limit_watts,
            throttle_reasons: if faults.throttle.unwrap_or(faults.slowdown > 1.0) {
                THROTTLE_HW_SLOWDOWN
            } else {
                0
            },
            ecc_uncorrected_errors: if index == 0 { faults.ecc_errors } else { 0 },
            xid_errors: if index == 0 { faults.xid_errors } else { 0 },
            last_xid: if index == 0 { faults.last_xid } else { None },
        })
        .collect();
    SimGpuReport { gpus }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Preset;

    #[test]
    fn utilization_grows_with_busy_and_occupancy() {
        assert_eq!(utilization(0.0, 1.0), 0.0);
        assert_eq!(utilization(1.0, 0.0), 0.5);
        assert_eq!(utilization(1.0, 1.0), 1.0);
        assert!(utilization(1.0, 0.4) > utilization(1.0, 0.1));
        assert_eq!(utilization(2.0, f64::NAN.max(0.0)), 0.5);
    }

    #[test]
    fn uuid_is_stable_and_distinct() {
        let a = gpu_uuid("pod-a", 0);
        assert_eq!(a, gpu_uuid("pod-a", 0));
        assert_ne!(a, gpu_uuid("pod-a", 1));
        assert_ne!(a, gpu_uuid("pod-b", 0));
        assert!(a.starts_with("GPU-") && a.len() == 40, "{a}");
    }

    #[test]
    fn report_has_the_agreed_shape() {
        let spec = Preset::H100_8b.spec();
        let faults = Faults {
            gpu_utilization: Some(0.42),
            xid_errors: 1,
            last_xid: Some(79),
            ..Faults::default()
        };
        let r = report(&spec, "pod", 2, 0.1, &faults);
        let v = serde_json::to_value(&r).unwrap();
        let g0 = &v["gpus"][0];
        let mut keys: Vec<_> = g0.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "ecc_uncorrected_errors",
                "index",
                "last_xid",
                "memory_total_bytes",
                "memory_used_bytes",
                "name",
                "power_limit_watts",
                "power_watts",
                "temperature_celsius",
                "throttle_reasons",
                "utilization",
                "uuid",
                "xid_errors"
            ]
        );
        assert_eq!(g0["utilization"], 0.42);
        assert_eq!(g0["last_xid"], 79);
        assert_eq!(v["gpus"][1]["last_xid"], serde_json::Value::Null);
        assert_eq!(v["gpus"][1]["index"], 1);
        assert_eq!(g0["name"], "NVIDIA H100 80GB HBM3 (simulated)");
    }
}
