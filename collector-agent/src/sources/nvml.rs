//! The `nvml` source: reads every GPU visible to the pod through NVML (nvml-wrapper), behind a
//! small [`GpuBackend`] trait so the decisions are tested with a fake. It decides which GPUs are
//! visible (`NVIDIA_VISIBLE_DEVICES` / `CUDA_VISIBLE_DEVICES`, values passed in), maps NVML's
//! `NotSupported` to an absent field (never a fake 0), decodes the clocks-event (throttle)
//! reasons bitmask (nvml.h `nvmlClocksEventReason*`), and counts Xid critical errors seen
//! through NVML event sets since the agent started. On Hopper and later it also reads GPM
//! activity (SM occupancy, SM, tensor-pipe and DRAM-bandwidth use), which NVML computes from
//! two samples taken `--gpm-interval` apart; a GPU without GPM reports those fields absent.
//!
//! Why GPM: NVML's `utilization.gpu` is the fraction of time any kernel ran, so it reads about
//! 100 % as soon as one sequence decodes and cannot tell a batch of 1 from a batch of 200. SM
//! occupancy (active warps over the maximum) keeps growing with the batch.

use super::{Reading, Rejected, Source, SourceError};
use ai_lb_proto::v1::GpuActivitySource;
use ai_lb_proto::v1::GpuStats;
use std::collections::HashMap;
use std::time::{Duration, Instant};

const NAME: &str = "nvml";

/// The outcome of one NVML query.
#[derive(Debug, Clone, PartialEq)]
pub enum Field<T> {
    Value(T),
    /// This GPU has no such reading: the field stays absent.
    NotSupported,
    /// The query failed: the field stays absent and the failure is reported as rejected.
    Failed(String),
}

/// One device's readings, in NVML's units.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceReading {
    pub name: Field<String>,
    /// Percent 0..100.
    pub utilization_percent: Field<u32>,
    /// (used, total) bytes.
    pub memory_bytes: Field<(u64, u64)>,
    pub temperature_celsius: Field<u32>,
    pub power_milliwatts: Field<u32>,
    pub power_limit_milliwatts: Field<u32>,
    pub throttle_reasons: Field<u64>,
    pub ecc_uncorrected_volatile: Field<u64>,
}

/// One GPM reading of a device over the interval since the previous one, in percent 0..100
/// (NVML's unit). Each metric can fail on its own.
#[derive(Debug, Clone, PartialEq)]
pub struct GpmReading {
    pub sm_occupancy_percent: Field<f64>,
    pub sm_util_percent: Field<f64>,
    pub tensor_percent: Field<f64>,
    pub dram_bw_percent: Field<f64>,
}

/// An Xid critical error event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEvent {
    /// UUID of the device that raised it.
    pub uuid: String,
    /// The Xid code, `None` when NVML reports it as unknown.
    pub xid: Option<u64>,
}

/// What the source needs from NVML.
pub trait GpuBackend: Send {
    fn device_count(&mut self) -> Result<u32, String>;
    fn device_uuid(&mut self, index: u32) -> Result<String, String>;
    /// All readings of one device; per-field failures are in the fields.
    fn read(&mut self, index: u32) -> Result<DeviceReading, String>;
    /// Starts watching Xid critical errors of `index`; false when the device cannot.
    fn watch_xid(&mut self, index: u32) -> bool;
    /// Xid events that arrived since the last call, without blocking.
    fn poll_xid(&mut self) -> Vec<XidEvent>;
    /// Takes a GPM sample of `index` and returns the metrics between it and the previous one:
    /// `None` on the first call (a rate needs two samples), `Field::NotSupported` on a GPU
    /// without GPM (before Hopper). The default is a backend without GPM.
    fn gpm(&mut self, _index: u32) -> Option<Field<GpmReading>> {
        Some(Field::NotSupported)
    }
}

/// Names of the clocks-event (throttle) reason bits, nvml.h order.
const THROTTLE_BITS: [(u64, &str); 9] = [
    (0x1, "GpuIdle"),
    (0x2, "ApplicationsClocksSetting"),
    (0x4, "SwPowerCap"),
    (0x8, "HwSlowdown"),
    (0x10, "SyncBoost"),
    (0x20, "SwThermalSlowdown"),
    (0x40, "HwThermalSlowdown"),
    (0x80, "HwPowerBrakeSlowdown"),
    (0x100, "DisplayClockSetting"),
];

/// Decodes a throttle-reasons bitmask into names; unknown bits are named `Unknown(0x…)`.
pub fn throttle_reason_names(mask: u64) -> Vec<String> {
    let mut names = Vec::new();
    let mut known = 0u64;
    for (bit, name) in THROTTLE_BITS {
        known |= bit;
        if mask & bit != 0 {
            names.push(name.to_string());
        }
    }
    if mask & !known != 0 {
        names.push(format!("Unknown({:#x})", mask & !known));
    }
    names
}

/// One entry of a visible-devices list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceId {
    Index(u32),
    /// A GPU UUID (`GPU-…`) or a unique prefix of one; `MIG-…` ids are kept but match no GPU.
    Uuid(String),
}

/// A parsed visible-devices variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Visible {
    All,
    None,
    List(Vec<DeviceId>),
}

/// The environment values that decide visibility, read by `main` and passed in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VisibleEnv {
    pub nvidia_visible_devices: Option<String>,
    pub cuda_visible_devices: Option<String>,
}

impl VisibleEnv {
    /// Reads the two variables from the process environment (for `main`).
    pub fn from_process_env() -> Self {
        Self {
            nvidia_visible_devices: std::env::var("NVIDIA_VISIBLE_DEVICES").ok(),
            cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        }
    }
}

/// Parses `NVIDIA_VISIBLE_DEVICES` (container runtime): unset or `all` → all; `none`, `void` or
/// empty → none; else a comma list of indices and UUIDs.
pub fn parse_nvidia_visible(value: Option<&str>) -> Result<Visible, String> {
    let Some(v) = value.map(str::trim) else {
        return Ok(Visible::All);
    };
    match v {
        "all" => Ok(Visible::All),
        "" | "none" | "void" => Ok(Visible::None),
        _ => parse_list("NVIDIA_VISIBLE_DEVICES", v, false).map(Visible::List),
    }
}

/// Parses `CUDA_VISIBLE_DEVICES`: unset → no restriction; empty → none; else a comma list, read
/// up to the first negative index as CUDA does (`-1` alone hides every GPU).
pub fn parse_cuda_visible(value: Option<&str>) -> Result<Visible, String> {
    let Some(v) = value.map(str::trim) else {
        return Ok(Visible::All);
    };
    if v.is_empty() {
        return Ok(Visible::None);
    }
    parse_list("CUDA_VISIBLE_DEVICES", v, true).map(|l| {
        if l.is_empty() {
            Visible::None
        } else {
            Visible::List(l)
        }
    })
}

fn parse_list(var: &str, v: &str, stop_at_negative: bool) -> Result<Vec<DeviceId>, String> {
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim) {
        if item.starts_with("GPU-") || item.starts_with("MIG-") {
            out.push(DeviceId::Uuid(item.to_string()));
        } else if let Ok(i) = item.parse::<u32>() {
            out.push(DeviceId::Index(i));
        } else if stop_at_negative && item.parse::<i64>().is_ok_and(|i| i < 0) {
            break;
        } else {
            return Err(format!(
                "{var}: invalid value {v:?}: entry {item:?} is neither an index, a GPU-/MIG- UUID, \
                 \"all\" nor \"none\""
            ));
        }
    }
    Ok(out)
}

/// Applies one list to candidate devices `(NVML index, UUID)`, keeping their order. Indices in a
/// list that NVML cannot all satisfy while it sees exactly as many GPUs as listed mean the
/// container runtime already applied the list (NVML inside a container renumbers from 0): all
/// candidates are kept then.
fn apply(
    list: &Visible,
    cands: &[(u32, String)],
    warnings: &mut Vec<String>,
    var: &str,
) -> Vec<(u32, String)> {
    let ids = match list {
        Visible::All => return cands.to_vec(),
        Visible::None => return Vec::new(),
        Visible::List(ids) => ids,
    };
    let out_of_range = ids
        .iter()
        .any(|id| matches!(id, DeviceId::Index(i) if *i as usize >= cands.len()));
    if out_of_range
        && ids.len() == cands.len()
        && ids.iter().all(|id| matches!(id, DeviceId::Index(_)))
    {
        return cands.to_vec();
    }
    let mut keep = vec![false; cands.len()];
    for id in ids {
        match id {
            DeviceId::Index(i) => match keep.get_mut(*i as usize) {
                Some(k) => *k = true,
                None => warnings.push(format!(
                    "{var}: index {i} is not among the {} GPUs NVML sees",
                    cands.len()
                )),
            },
            DeviceId::Uuid(u) if u.starts_with("MIG-") => {
                warnings.push(format!(
                    "{var}: MIG device {u} is not read (whole GPUs only)"
                ));
            }
            DeviceId::Uuid(u) => {
                let hits: Vec<usize> = cands
                    .iter()
                    .enumerate()
                    .filter(|(_, (_, cu))| cu.starts_with(u.as_str()))
                    .map(|(p, _)| p)
                    .collect();
                match hits.as_slice() {
                    [p] => keep[*p] = true,
                    [] => warnings.push(format!("{var}: {u} matches no GPU NVML sees")),
                    _ => warnings.push(format!("{var}: {u} matches several GPUs; ignored")),
                }
            }
        }
    }
    cands
        .iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(c, _)| c.clone())
        .collect()
}

/// Kept devices `(NVML index, UUID)` and warnings about list entries that matched nothing.
pub type Selection = (Vec<(u32, String)>, Vec<String>);

/// The devices visible to the pod among `devices` (NVML index, UUID), in NVML order:
/// `NVIDIA_VISIBLE_DEVICES` first, then `CUDA_VISIBLE_DEVICES`, whose indices count within what
/// the first one left. Returns the kept devices and warnings about entries that matched nothing.
pub fn select_visible(env: &VisibleEnv, devices: &[(u32, String)]) -> Result<Selection, String> {
    let nvidia = parse_nvidia_visible(env.nvidia_visible_devices.as_deref())?;
    let cuda = parse_cuda_visible(env.cuda_visible_devices.as_deref())?;
    let mut warnings = Vec::new();
    let after_nvidia = apply(&nvidia, devices, &mut warnings, "NVIDIA_VISIBLE_DEVICES");
    // CUDA indices are positions in what the runtime exposed, never NVML indices to renumber.
    let cuda_out = match &cuda {
        Visible::List(ids) => {
            let mut keep = vec![false; after_nvidia.len()];
            for id in ids {
                match id {
                    DeviceId::Index(i) => match keep.get_mut(*i as usize) {
                        Some(k) => *k = true,
                        None => warnings.push(format!(
                            "CUDA_VISIBLE_DEVICES: index {i} is not among the {} visible GPUs",
                            after_nvidia.len()
                        )),
                    },
                    DeviceId::Uuid(_) => {
                        let one = apply(
                            &Visible::List(vec![id.clone()]),
                            &after_nvidia,
                            &mut warnings,
                            "CUDA_VISIBLE_DEVICES",
                        );
                        for (p, c) in after_nvidia.iter().enumerate() {
                            if one.contains(c) {
                                keep[p] = true;
                            }
                        }
                    }
                }
            }
            after_nvidia
                .iter()
                .zip(keep)
                .filter(|(_, k)| *k)
                .map(|(c, _)| c.clone())
                .collect()
        }
        other => apply(other, &after_nvidia, &mut warnings, "CUDA_VISIBLE_DEVICES"),
    };
    Ok((cuda_out, warnings))
}

/// Per-device Xid tally since the agent started.
#[derive(Debug, Default, Clone, Copy)]
struct XidTally {
    count: u64,
    last: Option<u32>,
}

/// A GPU the source reads.
#[derive(Debug)]
struct Tracked {
    index: u32,
    uuid: String,
    xid_watched: bool,
    gpm: GpmState,
}

/// Where a device's GPM readings stand.
#[derive(Debug, Default)]
struct GpmState {
    /// The device said it has no GPM: never asked again.
    unsupported: bool,
    /// When the last GPM sample was taken.
    sampled_at: Option<Instant>,
    /// The last computed activity (fractions 0..1), reported until the next one.
    last: Option<Activity>,
}

/// Activity fractions 0..1, each absent when its metric failed or was out of range.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Activity {
    sm_occupancy: Option<f64>,
    sm_utilization: Option<f64>,
    tensor: Option<f64>,
    dram: Option<f64>,
}

/// The `nvml` source.
pub struct NvmlSource {
    backend: Box<dyn GpuBackend>,
    devices: Vec<Tracked>,
    gpm_interval: Duration,
    xids: HashMap<String, XidTally>,
    warnings: Vec<String>,
}

impl std::fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource")
            .field("devices", &self.devices)
            .field("warnings", &self.warnings)
            .finish()
    }
}

impl NvmlSource {
    /// Opens the real NVML (initialised once per process and kept) and selects the visible GPUs;
    /// GPM activity is recomputed every `gpm_interval`.
    pub fn open(env: &VisibleEnv, gpm_interval: Duration) -> Result<Self, SourceError> {
        let backend = real::NvmlBackend::init().map_err(|detail| SourceError::Other {
            source_name: NAME,
            detail,
        })?;
        Self::new(Box::new(backend), env, gpm_interval)
    }

    /// Builds the source over any backend: lists the devices, keeps the visible ones and starts
    /// watching their Xid errors.
    pub fn new(
        mut backend: Box<dyn GpuBackend>,
        env: &VisibleEnv,
        gpm_interval: Duration,
    ) -> Result<Self, SourceError> {
        let other = |detail: String| SourceError::Other {
            source_name: NAME,
            detail,
        };
        let count = backend
            .device_count()
            .map_err(|e| other(format!("device count: {e}")))?;
        let mut all = Vec::with_capacity(count as usize);
        for i in 0..count {
            let uuid = backend
                .device_uuid(i)
                .map_err(|e| other(format!("GPU {i} UUID: {e}")))?;
            all.push((i, uuid));
        }
        let (visible, warnings) = select_visible(env, &all).map_err(other)?;
        for w in &warnings {
            tracing::warn!(source = NAME, "{w}");
        }
        let devices = visible
            .into_iter()
            .map(|(index, uuid)| Tracked {
                xid_watched: backend.watch_xid(index),
                index,
                uuid,
                gpm: GpmState::default(),
            })
            .collect();
        Ok(Self {
            backend,
            devices,
            gpm_interval,
            xids: HashMap::new(),
            warnings,
        })
    }

    /// Visible-devices entries that matched nothing, for `main` to log once.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The (NVML index, UUID) of the GPUs read.
    pub fn devices(&self) -> Vec<(u32, String)> {
        self.devices
            .iter()
            .map(|d| (d.index, d.uuid.clone()))
            .collect()
    }

    /// One sample at `now` (synchronous; NVML calls do not block for long).
    pub fn read_all(&mut self, now: Instant) -> Result<Reading, SourceError> {
        for ev in self.backend.poll_xid() {
            let t = self.xids.entry(ev.uuid).or_default();
            t.count += 1;
            if let Some(x) = ev.xid.and_then(|x| u32::try_from(x).ok()) {
                t.last = Some(x);
            }
        }
        let mut rejected = Vec::new();
        let mut gpus = Vec::with_capacity(self.devices.len());
        for d in &mut self.devices {
            let activity = gpm_activity(
                self.backend.as_mut(),
                d,
                now,
                self.gpm_interval,
                &mut rejected,
            );
            let r = self.backend.read(d.index).map_err(|e| SourceError::Other {
                source_name: NAME,
                detail: format!("GPU {} ({}): {e}", d.index, d.uuid),
            })?;
            let mut rej = |field: &str, value: String, reason: String| {
                rejected.push(Rejected {
                    field: format!("gpu[{}].{field}", d.index),
                    value,
                    reason,
                })
            };
            let mut g = GpuStats {
                index: d.index,
                uuid: d.uuid.clone(),
                ..Default::default()
            };
            g.name = take(r.name, "name", &mut rej).unwrap_or_default();
            g.utilization = take(r.utilization_percent, "utilization", &mut rej).and_then(|p| {
                if p <= 100 {
                    Some(f64::from(p) / 100.0)
                } else {
                    rej("utilization", p.to_string(), "percent above 100".into());
                    None
                }
            });
            if let Some((used, total)) = take(r.memory_bytes, "memory", &mut rej) {
                g.memory_total_bytes = Some(total);
                if used <= total {
                    g.memory_used_bytes = Some(used);
                } else {
                    rej(
                        "memory_used_bytes",
                        used.to_string(),
                        format!("above total {total}"),
                    );
                }
            }
            g.temperature_celsius =
                take(r.temperature_celsius, "temperature_celsius", &mut rej).map(f64::from);
            g.power_watts =
                take(r.power_milliwatts, "power_watts", &mut rej).map(|mw| f64::from(mw) / 1000.0);
            g.power_limit_watts = take(r.power_limit_milliwatts, "power_limit_watts", &mut rej)
                .map(|mw| f64::from(mw) / 1000.0);
            g.throttle_reasons = take(r.throttle_reasons, "throttle_reasons", &mut rej);
            g.throttle_reason_names = g
                .throttle_reasons
                .map(throttle_reason_names)
                .unwrap_or_default();
            g.ecc_uncorrected_errors = take(
                r.ecc_uncorrected_volatile,
                "ecc_uncorrected_errors",
                &mut rej,
            );
            if d.xid_watched {
                let t = self.xids.get(&d.uuid).copied().unwrap_or_default();
                g.xid_errors = Some(t.count);
                g.last_xid = t.last;
            }
            if let Some(a) = activity {
                g.sm_occupancy = a.sm_occupancy;
                g.sm_utilization = a.sm_utilization;
                g.tensor_activity = a.tensor;
                g.dram_activity = a.dram;
                g.activity_source = GpuActivitySource::Gpm as i32;
            }
            gpus.push(g);
        }
        Ok(Reading {
            gpus: Some(gpus),
            rejected,
            ..Default::default()
        })
    }
}

/// The device's GPM activity to report at `now`: recomputed from a new sample once
/// `interval` has passed since the last one, else the last values. None for a GPU without GPM
/// (asked once) and until the first interval has passed.
fn gpm_activity(
    backend: &mut dyn GpuBackend,
    d: &mut Tracked,
    now: Instant,
    interval: Duration,
    rejected: &mut Vec<Rejected>,
) -> Option<Activity> {
    let st = &mut d.gpm;
    if st.unsupported {
        return None;
    }
    let due = st
        .sampled_at
        .is_none_or(|t| now.saturating_duration_since(t) >= interval);
    if due {
        st.sampled_at = Some(now);
        match backend.gpm(d.index) {
            None => {}
            Some(Field::NotSupported) => {
                st.unsupported = true;
                st.last = None;
            }
            Some(Field::Failed(e)) => {
                rejected.push(Rejected {
                    field: format!("gpu[{}].gpm", d.index),
                    value: String::new(),
                    reason: format!("NVML GPM query failed: {e}"),
                });
                st.last = None;
            }
            Some(Field::Value(r)) => {
                let mut pct = |name: &str, f: Field<f64>| -> Option<f64> {
                    let field = format!("gpu[{}].{name}", d.index);
                    match f {
                        Field::Value(p) if p.is_finite() && (0.0..=100.0).contains(&p) => {
                            Some(p / 100.0)
                        }
                        Field::Value(p) => {
                            rejected.push(Rejected {
                                field,
                                value: p.to_string(),
                                reason: "not a percent in 0..100".into(),
                            });
                            None
                        }
                        Field::NotSupported => None,
                        Field::Failed(e) => {
                            rejected.push(Rejected {
                                field,
                                value: String::new(),
                                reason: format!("NVML GPM metric failed: {e}"),
                            });
                            None
                        }
                    }
                };
                st.last = Some(Activity {
                    sm_occupancy: pct("sm_occupancy", r.sm_occupancy_percent),
                    sm_utilization: pct("sm_utilization", r.sm_util_percent),
                    tensor: pct("tensor_activity", r.tensor_percent),
                    dram: pct("dram_activity", r.dram_bw_percent),
                });
            }
        }
    }
    st.last
}

fn take<T>(f: Field<T>, field: &str, rej: &mut impl FnMut(&str, String, String)) -> Option<T> {
    match f {
        Field::Value(v) => Some(v),
        Field::NotSupported => None,
        Field::Failed(e) => {
            rej(field, String::new(), format!("NVML query failed: {e}"));
            None
        }
    }
}

#[async_trait::async_trait]
impl Source for NvmlSource {
    fn name(&self) -> &'static str {
        NAME
    }

    fn local(&self) -> bool {
        true
    }

    async fn sample(&mut self, now: Instant) -> Result<Reading, SourceError> {
        self.read_all(now)
    }
}

/// The backend over the real NVML library.
pub mod real {
    use super::{DeviceReading, Field, GpmReading, GpuBackend, XidEvent};
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
    use nvml_wrapper::enums::event::XidError;
    use nvml_wrapper::enums::gpm::GpmMetricId;
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper::gpm::{gpm_metrics_get, GpmSample};
    use nvml_wrapper::{EventSet, Nvml};
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    /// The GPM metrics read, in the order of [`GpmReading`]'s fields.
    const GPM_METRICS: [GpmMetricId; 4] = [
        GpmMetricId::SmOccupancy,
        GpmMetricId::SmUtil,
        GpmMetricId::AnyTensorUtil,
        GpmMetricId::DramBwUtil,
    ];

    /// NVML, initialised once per process and kept for its lifetime (event sets borrow it).
    static NVML: OnceLock<&'static Nvml> = OnceLock::new();
    static INIT: Mutex<()> = Mutex::new(());

    fn nvml() -> Result<&'static Nvml, String> {
        if let Some(n) = NVML.get() {
            return Ok(n);
        }
        let _guard = INIT
            .lock()
            .map_err(|_| "NVML init lock poisoned".to_string())?;
        if let Some(n) = NVML.get() {
            return Ok(n);
        }
        let n = Nvml::init().map_err(|e| match e {
            NvmlError::LibloadingError(e) => format!(
                "NVML library not found (libnvidia-ml.so.1): {e}; on a node without NVIDIA GPUs \
                 or driver, use --gpu-source sim or none"
            ),
            NvmlError::DriverNotLoaded => "NVML: the NVIDIA driver is not loaded; use \
                 --gpu-source sim or none"
                .to_string(),
            other => format!("NVML init failed: {other}"),
        })?;
        let leaked: &'static Nvml = Box::leak(Box::new(n));
        Ok(*NVML.get_or_init(|| leaked))
    }

    fn field<T>(r: Result<T, NvmlError>) -> Field<T> {
        match r {
            Ok(v) => Field::Value(v),
            Err(NvmlError::NotSupported) => Field::NotSupported,
            Err(e) => Field::Failed(e.to_string()),
        }
    }

    /// Reads GPUs through `nvml_wrapper::Nvml`.
    pub struct NvmlBackend {
        nvml: &'static Nvml,
        /// One event set per watched device, with the device's UUID.
        xid_sets: Vec<(String, EventSet<'static>)>,
        /// The previous GPM sample of each device, the start of the next interval.
        gpm_prev: HashMap<u32, GpmSample<'static>>,
    }

    impl NvmlBackend {
        pub fn init() -> Result<Self, String> {
            Ok(Self {
                nvml: nvml()?,
                xid_sets: Vec::new(),
                gpm_prev: HashMap::new(),
            })
        }
    }

    impl GpuBackend for NvmlBackend {
        fn device_count(&mut self) -> Result<u32, String> {
            self.nvml.device_count().map_err(|e| e.to_string())
        }

        fn device_uuid(&mut self, index: u32) -> Result<String, String> {
            let d = self
                .nvml
                .device_by_index(index)
                .map_err(|e| e.to_string())?;
            d.uuid().map_err(|e| e.to_string())
        }

        fn read(&mut self, index: u32) -> Result<DeviceReading, String> {
            let d = self
                .nvml
                .device_by_index(index)
                .map_err(|e| e.to_string())?;
            Ok(DeviceReading {
                name: field(d.name()),
                utilization_percent: field(d.utilization_rates().map(|u| u.gpu)),
                memory_bytes: field(d.memory_info().map(|m| (m.used, m.total))),
                temperature_celsius: field(d.temperature(TemperatureSensor::Gpu)),
                power_milliwatts: field(d.power_usage()),
                power_limit_milliwatts: field(d.enforced_power_limit()),
                throttle_reasons: field(d.current_throttle_reasons().map(|t| t.bits())),
                ecc_uncorrected_volatile: field(
                    d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
                ),
            })
        }

        fn watch_xid(&mut self, index: u32) -> bool {
            let Ok(d) = self.nvml.device_by_index(index) else {
                return false;
            };
            let Ok(uuid) = d.uuid() else {
                return false;
            };
            let Ok(set) = self.nvml.create_event_set() else {
                return false;
            };
            match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                Ok(set) => {
                    self.xid_sets.push((uuid, set));
                    true
                }
                Err(_) => false,
            }
        }

        fn gpm(&mut self, index: u32) -> Option<Field<GpmReading>> {
            let d = match self.nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => return Some(Field::Failed(e.to_string())),
            };
            match d.gpm_support() {
                Ok(true) => {}
                Ok(false) | Err(NvmlError::NotSupported) => return Some(Field::NotSupported),
                Err(e) => return Some(Field::Failed(e.to_string())),
            }
            let sample = match d.gpm_sample() {
                Ok(s) => s,
                Err(NvmlError::NotSupported) => return Some(Field::NotSupported),
                Err(e) => return Some(Field::Failed(e.to_string())),
            };
            let prev = self.gpm_prev.insert(index, sample)?;
            let now = self.gpm_prev.get(&index)?;
            let results = match gpm_metrics_get(self.nvml, &prev, now, &GPM_METRICS) {
                Ok(r) => r,
                Err(NvmlError::NotSupported) => return Some(Field::NotSupported),
                Err(e) => return Some(Field::Failed(e.to_string())),
            };
            let mut it = results.into_iter().map(|r| field(r.map(|m| m.value)));
            let mut next = || it.next().unwrap_or(Field::NotSupported);
            Some(Field::Value(GpmReading {
                sm_occupancy_percent: next(),
                sm_util_percent: next(),
                tensor_percent: next(),
                dram_bw_percent: next(),
            }))
        }

        fn poll_xid(&mut self) -> Vec<XidEvent> {
            let mut out = Vec::new();
            for (uuid, set) in &self.xid_sets {
                // Bounded: a flood of events cannot hold the sampler.
                for _ in 0..1024 {
                    match set.wait(0) {
                        Ok(ev) if ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR) => {
                            out.push(XidEvent {
                                uuid: uuid.clone(),
                                xid: match ev.event_data {
                                    Some(XidError::Value(v)) => Some(v),
                                    _ => None,
                                },
                            });
                        }
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
            }
            out
        }
    }

    #[cfg(test)]
    mod tests {
        use super::super::{NvmlSource, VisibleEnv};

        // Needs an NVIDIA GPU and driver: `cargo test -p ai-lb-agent -- --ignored nvml`
        #[test]
        #[ignore = "needs an NVIDIA GPU and libnvidia-ml.so.1"]
        fn nvml_reads_real_gpus() {
            let mut s = NvmlSource::open(
                &VisibleEnv::from_process_env(),
                std::time::Duration::from_millis(100),
            )
            .expect("NVML");
            println!("devices: {:?}, warnings: {:?}", s.devices(), s.warnings());
            let t0 = std::time::Instant::now();
            s.read_all(t0).expect("read");
            // GPM needs two samples an interval apart.
            std::thread::sleep(std::time::Duration::from_millis(200));
            let r = s
                .read_all(t0 + std::time::Duration::from_millis(200))
                .expect("read");
            for g in r.gpus.as_deref().unwrap_or_default() {
                println!("{g:?}");
            }
            println!("rejected: {:?}", r.rejected);
            assert!(!r.gpus.unwrap_or_default().is_empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_names() {
        assert!(throttle_reason_names(0).is_empty());
        assert_eq!(
            throttle_reason_names(0x4 | 0x40),
            vec!["SwPowerCap", "HwThermalSlowdown"]
        );
        assert_eq!(throttle_reason_names(0x1000), vec!["Unknown(0x1000)"]);
    }

    fn devs(n: u32) -> Vec<(u32, String)> {
        (0..n).map(|i| (i, format!("GPU-{i}aaa"))).collect()
    }

    fn env(nv: Option<&str>, cuda: Option<&str>) -> VisibleEnv {
        VisibleEnv {
            nvidia_visible_devices: nv.map(str::to_string),
            cuda_visible_devices: cuda.map(str::to_string),
        }
    }

    fn idx(e: &VisibleEnv, n: u32) -> Vec<u32> {
        select_visible(e, &devs(n))
            .unwrap()
            .0
            .into_iter()
            .map(|d| d.0)
            .collect()
    }

    #[test]
    fn visible_devices_semantics() {
        assert_eq!(idx(&env(None, None), 4), vec![0, 1, 2, 3]);
        assert_eq!(idx(&env(Some("all"), None), 2), vec![0, 1]);
        for none in ["none", "void", ""] {
            assert!(idx(&env(Some(none), None), 4).is_empty(), "{none}");
        }
        assert_eq!(idx(&env(Some("2,0"), None), 4), vec![0, 2]);
        assert_eq!(idx(&env(Some("GPU-3"), None), 4), vec![3]);
        // Runtime already filtered to host GPUs 2,3: NVML renumbers them 0,1.
        assert_eq!(idx(&env(Some("2,3"), None), 2), vec![0, 1]);
        // CUDA indices count within what NVIDIA_VISIBLE_DEVICES left.
        assert_eq!(idx(&env(Some("1,3"), Some("1")), 4), vec![3]);
        assert!(idx(&env(None, Some("-1")), 4).is_empty());
        assert!(idx(&env(None, Some("")), 4).is_empty());
        assert_eq!(idx(&env(None, Some("2,-1,0")), 4), vec![2]);
        assert_eq!(idx(&env(None, Some("GPU-1")), 4), vec![1]);
        let e = select_visible(&env(Some("gpu0"), None), &devs(1)).unwrap_err();
        assert!(
            e.contains("NVIDIA_VISIBLE_DEVICES") && e.contains("gpu0"),
            "{e}"
        );
        let (_, w) = select_visible(&env(Some("GPU-9"), None), &devs(2)).unwrap();
        assert_eq!(w.len(), 1);
    }
}
