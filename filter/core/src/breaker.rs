//! Decides whether a pod (or pod+model) may receive traffic: a three-state circuit breaker
//! (Closed → Open → HalfOpen → Closed), after linkerd's `http/breaker` consecutive-failures
//! accrual, with an exponential cooldown (`base · 2^(opens-1)`, capped) while a pod keeps
//! failing. The doubling survives a close for `maxCooldownMs` (like Envoy's outlier-detection
//! ejection multiplier), so a pod that fails half its requests, whose probes sometimes all
//! succeed, is not let back at the base cooldown every time. Half-open, the first probe goes
//! alone and the rest of `halfOpenProbes` only once it has succeeded, so a pod that still fails
//! costs one request per cooldown (per sidecar), not the whole budget. The picker sends a
//! half-open pod the next request it can take as its probe, ahead of its weighted draw and of
//! prefix affinity (see [`crate::picker`]): drawn like any pod, a healed pod holding no cached
//! prefix, or with a queue, was left half-open with no probe for as long as the traffic lasted.
//! Time is passed in; every transition is returned so the caller can count it.
//!
//! Failures: 5xx, resets, connect failures, timeouts, and TTFT above `ttftSloMs`; a 4xx is the
//! client's fault and counts as a success. Agent-reported hardware faults trip it at once, and
//! so does the pod's own error rate as its agent reports it (every client's traffic, so every
//! sidecar acts on the same evidence at once).
//! Besides `consecutiveFailures` in a row, a failure rate opens it: [`FailureWindow`] keeps one
//! worker's outcomes of a pod over `failureRateWindowMs` (Envoy's failure-percentage outlier
//! detection works on the same idea), so a pod failing half its requests, which rarely fails
//! five in a row, is cut too.

use crate::config::BreakerConfig;

/// Breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(&self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    /// The value of the per-pod `breaker_state` gauges (the dashboard maps it back):
    /// 0 closed, 1 half-open, 2 open.
    pub fn gauge_value(&self) -> u64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }
}

/// Why a breaker opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TripReason {
    /// Agent-reported Xid/ECC increase (hard signal: opens at once).
    HardwareFault,
    /// Consecutive 5xx responses.
    ServerErrors,
    /// Consecutive stream resets.
    Resets,
    /// Consecutive connect failures.
    ConnectFailures,
    /// Consecutive timeouts.
    Timeouts,
    /// Consecutive responses with TTFT over `ttftSloMs`.
    SlowTtft,
    /// The share of failures over `failureRateWindowMs` reached `failureRate`.
    FailureRate,
    /// The pod's agent reported an error rate of at least `failureRate` over at least
    /// `failureRateMinRequests` requests in its window (all clients' traffic).
    AgentErrorRate,
    /// `breaker.truncation`: answers cut off in a row while the pod answers GPU out-of-memory
    /// errors ([`crate::triggers`]).
    Truncated,
    /// `breaker.wellFormedProbes`: a half-open probe answered something other than
    /// well-formed OpenAI JSON.
    MalformedProbe,
}

impl TripReason {
    /// Every reason (for glue that defines one stat per reason up front).
    pub const ALL: [TripReason; 10] = [
        TripReason::HardwareFault,
        TripReason::ServerErrors,
        TripReason::Resets,
        TripReason::ConnectFailures,
        TripReason::Timeouts,
        TripReason::SlowTtft,
        TripReason::FailureRate,
        TripReason::AgentErrorRate,
        TripReason::Truncated,
        TripReason::MalformedProbe,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            TripReason::HardwareFault => "hardware_fault",
            TripReason::ServerErrors => "server_errors",
            TripReason::Resets => "resets",
            TripReason::ConnectFailures => "connect_failures",
            TripReason::Timeouts => "timeouts",
            TripReason::SlowTtft => "slow_ttft",
            TripReason::FailureRate => "failure_rate",
            TripReason::AgentErrorRate => "agent_error_rate",
            TripReason::Truncated => "truncated",
            TripReason::MalformedProbe => "malformed_probe",
        }
    }

    /// Name used as a cut reason (`breaker_<reason>`).
    pub fn cut_name(&self) -> &'static str {
        match self {
            TripReason::HardwareFault => "breaker_hardware_fault",
            TripReason::ServerErrors => "breaker_server_errors",
            TripReason::Resets => "breaker_resets",
            TripReason::ConnectFailures => "breaker_connect_failures",
            TripReason::Timeouts => "breaker_timeouts",
            TripReason::SlowTtft => "breaker_slow_ttft",
            TripReason::FailureRate => "breaker_failure_rate",
            TripReason::AgentErrorRate => "breaker_agent_error_rate",
            TripReason::Truncated => "breaker_truncated",
            TripReason::MalformedProbe => "breaker_malformed_probe",
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            TripReason::HardwareFault => 1,
            TripReason::ServerErrors => 2,
            TripReason::Resets => 3,
            TripReason::ConnectFailures => 4,
            TripReason::Timeouts => 5,
            TripReason::SlowTtft => 6,
            TripReason::FailureRate => 7,
            TripReason::AgentErrorRate => 8,
            TripReason::Truncated => 9,
            TripReason::MalformedProbe => 10,
        }
    }

    fn from_u8(b: u8) -> Option<Option<TripReason>> {
        Some(match b {
            0 => None,
            1 => Some(TripReason::HardwareFault),
            2 => Some(TripReason::ServerErrors),
            3 => Some(TripReason::Resets),
            4 => Some(TripReason::ConnectFailures),
            5 => Some(TripReason::Timeouts),
            6 => Some(TripReason::SlowTtft),
            7 => Some(TripReason::FailureRate),
            8 => Some(TripReason::AgentErrorRate),
            9 => Some(TripReason::Truncated),
            10 => Some(TripReason::MalformedProbe),
            _ => return None,
        })
    }
}

/// What happened to one upstream request, as the glue observed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// HTTP status, if a response arrived.
    pub status: Option<u16>,
    /// The stream was reset (upstream reset, not a client cancel).
    pub reset: bool,
    pub connect_failure: bool,
    pub timeout: bool,
    /// Time to the first response byte (≈ first token when streaming).
    pub ttft_ms: Option<u64>,
    pub total_ms: Option<u64>,
    /// A half-open probe whose answer was not well-formed OpenAI JSON, under
    /// `breaker.wellFormedProbes` ([`crate::triggers`]): a failure.
    pub malformed: bool,
}

impl Outcome {
    /// The failure this outcome counts as, or None for a success (including every 4xx).
    /// Precedence: connect failure, reset, timeout, 5xx, slow TTFT.
    pub fn failure(&self, cfg: &BreakerConfig) -> Option<TripReason> {
        if self.connect_failure {
            Some(TripReason::ConnectFailures)
        } else if self.reset {
            Some(TripReason::Resets)
        } else if self.timeout {
            Some(TripReason::Timeouts)
        } else if self.status.is_some_and(|s| (500..600).contains(&s)) {
            Some(TripReason::ServerErrors)
        } else if matches!((self.ttft_ms, cfg.ttft_slo_ms), (Some(t), Some(slo)) if t > slo) {
            Some(TripReason::SlowTtft)
        } else if self.malformed {
            Some(TripReason::MalformedProbe)
        } else {
            None
        }
    }

    /// A half-open probe's verdict at its first response byte: true when what has arrived
    /// already counts as a success (a status below 500, the time to first byte within
    /// `ttftSloMs`). The probe then counts as passed at once instead of when its stream ends,
    /// so a pod serving 30-second answers is readmitted in a few first tokens, not in several
    /// whole answers. A failure later in the stream (a reset) is still recorded at its end.
    pub fn probe_passed_at_first_byte(
        status: Option<u16>,
        ttft_ms: u64,
        cfg: &BreakerConfig,
    ) -> bool {
        cfg.well_formed_probes.is_none()
            && status.is_some()
            && Outcome {
                status,
                ttft_ms: Some(ttft_ms),
                ..Outcome::default()
            }
            .failure(cfg)
            .is_none()
    }
}

/// One state change of a breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: BreakerState,
    pub to: BreakerState,
    /// The trip reason for transitions to Open (and the reason still in force otherwise).
    pub reason: Option<TripReason>,
}

/// A transition tagged with the pod (and model, for a per-model breaker), for stats and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerEvent {
    /// Serving address `IP:PORT`.
    pub pod: String,
    pub model: Option<String>,
    pub from: BreakerState,
    pub to: BreakerState,
    pub reason: Option<TripReason>,
}

/// Outcomes of one pod over a sliding window, for the failure-rate trip: two half-window
/// buckets (the older one is dropped as a whole when the window moves on), so the rate covers
/// between half a window and a whole one. Kept per worker VM, not shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FailureWindow {
    /// Start of the current bucket (monotonic ms).
    start_ms: u64,
    cur: (u32, u32),
    prev: (u32, u32),
}

impl FailureWindow {
    /// Records one outcome at `now_ms` and says whether the failure rate now opens the
    /// breaker (then the window starts over).
    pub fn record(&mut self, failed: bool, now_ms: u64, cfg: &BreakerConfig) -> bool {
        self.record_judged(failed, now_ms, cfg, cfg.failure_rate).0
    }

    /// [`FailureWindow::record`], also saying whether `other_rate` in place of
    /// `cfg.failure_rate` would have opened the breaker on the same outcomes (for counting what
    /// an adapted threshold changed, see [`crate::adaptive`]).
    pub fn record_judged(
        &mut self,
        failed: bool,
        now_ms: u64,
        cfg: &BreakerConfig,
        other_rate: f64,
    ) -> (bool, bool) {
        let half = (cfg.failure_rate_window_ms / 2).max(1);
        let since = now_ms.saturating_sub(self.start_ms);
        if since >= 2 * half {
            self.prev = (0, 0);
            self.cur = (0, 0);
            self.start_ms = now_ms;
        } else if since >= half {
            self.prev = self.cur;
            self.cur = (0, 0);
            self.start_ms = self.start_ms.saturating_add(half);
        }
        if failed {
            self.cur.1 = self.cur.1.saturating_add(1);
        } else {
            self.cur.0 = self.cur.0.saturating_add(1);
        }
        let fails = u64::from(self.cur.1) + u64::from(self.prev.1);
        let total = fails + u64::from(self.cur.0) + u64::from(self.prev.0);
        let enough = total >= u64::from(cfg.failure_rate_min_requests);
        let tripped = enough && fails as f64 >= cfg.failure_rate * total as f64;
        let other = enough && fails as f64 >= other_rate * total as f64;
        if tripped {
            *self = FailureWindow {
                start_ms: now_ms,
                ..FailureWindow::default()
            };
        }
        (tripped, other)
    }
}

/// Length of [`Breaker::encode`]'s output.
pub const BREAKER_ENCODED_LEN: usize = 32;
const ENCODING_VERSION: u8 = 1;

/// One write of a breaker that every worker shares, the same algorithm for every store (the
/// wasm filter's shared data with CAS, the native module's process memory): the stored breaker,
/// or a fresh one with this worker's `jitter` where none is stored, is polled (time-driven
/// transitions) and then `update`d. The store writes it, and bumps its pool's epoch so the
/// other workers copy it, only when it `changed`: a success on a closed breaker writes nothing.
pub fn update_shared(
    stored: Option<Breaker>,
    jitter: u8,
    now_ms: u64,
    cfg: &BreakerConfig,
    update: impl FnOnce(&mut Breaker) -> Option<Transition>,
) -> SharedUpdate {
    let before = stored.unwrap_or_else(|| Breaker::with_jitter(jitter));
    let mut breaker = before;
    let mut transitions = Vec::new();
    transitions.extend(breaker.poll(now_ms, cfg));
    transitions.extend(update(&mut breaker));
    SharedUpdate {
        breaker,
        transitions,
        changed: breaker != before,
    }
}

/// What [`update_shared`] left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedUpdate {
    pub breaker: Breaker,
    /// Transitions on the shared breaker (each counted once for the process).
    pub transitions: Vec<Transition>,
    /// The store must write it (and bump the pool's epoch).
    pub changed: bool,
}

/// One circuit breaker. `Default` is Closed with no history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    state: BreakerState,
    reason: Option<TripReason>,
    consecutive_failures: u32,
    /// Opens in a row (drives the cooldown doubling); kept over a close and forgotten once the
    /// breaker has stayed closed for `maxCooldownMs`.
    opens: u32,
    /// Open: when it turns HalfOpen. Closed after a close: when it closed (0 if never opened).
    open_until_ms: u64,
    probes_issued: u32,
    probe_successes: u32,
    last_probe_ms: u64,
    /// Lengthens every cooldown by `jitter / 256` (0 to 99.6 %), so sidecars that opened on the
    /// same snapshot do not all probe at the same moment: the first probe's failure, once its
    /// agent reports it, keeps the others open. A spread of a quarter of the cooldown (5 s:
    /// ~1.2 s for all sidecars) was too narrow for that, as the fault-errors bench showed (all
    /// four sidecars probed within 1.1 s). Kept for the breaker's life.
    jitter: u8,
}

impl Default for Breaker {
    fn default() -> Self {
        Self {
            state: BreakerState::Closed,
            reason: None,
            consecutive_failures: 0,
            opens: 0,
            open_until_ms: 0,
            probes_issued: 0,
            probe_successes: 0,
            last_probe_ms: 0,
            jitter: 0,
        }
    }
}

impl Breaker {
    /// A closed breaker whose cooldowns are lengthened by `jitter / 256`: give each sidecar
    /// (Envoy process) its own random value.
    pub fn with_jitter(jitter: u8) -> Breaker {
        Breaker {
            jitter,
            ..Breaker::default()
        }
    }

    /// This breaker's cooldown for its `opens`-th open in a row, jitter included.
    fn jittered_cooldown_ms(&self, opens: u32, cfg: &BreakerConfig) -> u64 {
        let cd = Self::cooldown_ms(opens, cfg);
        cd.saturating_add(cd.saturating_mul(u64::from(self.jitter)) / 256)
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// The reason of the last trip while not Closed.
    pub fn reason(&self) -> Option<TripReason> {
        self.reason
    }

    /// When an Open breaker turns HalfOpen (monotonic ms).
    pub fn open_until_ms(&self) -> u64 {
        self.open_until_ms
    }

    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// Closed by its probes after an open (at [`Breaker::open_until_ms`]), and the open not yet
    /// forgotten: what a recovery ramp starts from ([`crate::recovery`]).
    pub fn closed_after_open(&self) -> bool {
        self.state == BreakerState::Closed && self.opens > 0
    }

    /// On probation: not Closed, or closed after an open less than `maxCooldownMs` ago (the
    /// cooldown doubling is still remembered). A pod on probation has failed recently, so less
    /// evidence is asked of its agent's error rate (see `breaker.agentErrorRate`).
    pub fn on_probation(&self, now_ms: u64, cfg: &BreakerConfig) -> bool {
        match self.state {
            BreakerState::Open | BreakerState::HalfOpen => true,
            BreakerState::Closed => {
                self.opens > 0 && now_ms.saturating_sub(self.open_until_ms) < cfg.max_cooldown_ms
            }
        }
    }

    /// Cooldown of the `opens`-th consecutive open: `base · 2^(opens-1)`, capped.
    pub fn cooldown_ms(opens: u32, cfg: &BreakerConfig) -> u64 {
        let shift = opens.saturating_sub(1).min(40);
        cfg.base_cooldown_ms
            .saturating_mul(1u64 << shift)
            .min(cfg.max_cooldown_ms)
    }

    /// Advances time: Open → HalfOpen once the cooldown has passed. In HalfOpen, probes that
    /// never reported back are forgotten after `baseCooldownMs`, so a lost probe cannot wedge
    /// the breaker.
    pub fn poll(&mut self, now_ms: u64, cfg: &BreakerConfig) -> Option<Transition> {
        match self.state {
            BreakerState::Open if now_ms >= self.open_until_ms => {
                self.state = BreakerState::HalfOpen;
                self.probes_issued = 0;
                self.probe_successes = 0;
                self.last_probe_ms = now_ms;
                Some(Transition {
                    from: BreakerState::Open,
                    to: BreakerState::HalfOpen,
                    reason: self.reason,
                })
            }
            BreakerState::HalfOpen
                if self.probes_issued > self.probe_successes
                    && now_ms.saturating_sub(self.last_probe_ms) >= cfg.base_cooldown_ms =>
            {
                self.probes_issued = self.probe_successes;
                None
            }
            _ => None,
        }
    }

    /// Whether a request may go to this pod now (call [`Breaker::poll`] first). Closed: yes;
    /// HalfOpen: while probes remain, the first one alone (the rest only once it succeeded, so
    /// a pod that still fails costs one request per cooldown, not the whole probe budget);
    /// Open: no. HalfOpen and admitting, the picker sends it the next request it can take
    /// (its probe) rather than leaving it to the draw; [`Breaker::on_request`] spends it.
    pub fn admits(&self, cfg: &BreakerConfig) -> bool {
        match self.state {
            BreakerState::Closed => true,
            BreakerState::HalfOpen => {
                self.probes_issued < cfg.probes_to_close()
                    && (self.probes_issued == 0 || self.probe_successes > 0)
            }
            BreakerState::Open => false,
        }
    }

    /// Whether a client request may go to this pod now: [`Breaker::admits`], except that with
    /// `breaker.syntheticProbe` a half-open pod takes only the filter's own probes
    /// ([`crate::probe`]).
    pub fn takes_requests(&self, cfg: &BreakerConfig) -> bool {
        self.admits(cfg) && !(cfg.synthetic_probes && self.state == BreakerState::HalfOpen)
    }

    /// `breaker.syntheticProbe`: spends a half-open probe for a synthetic request when one is
    /// due (call [`Breaker::poll`] first): a probe may go ([`Breaker::admits`]) and none went in
    /// the last `interval_ms` (the first one goes at once). True when spent.
    pub fn take_synthetic_probe(
        &mut self,
        now_ms: u64,
        cfg: &BreakerConfig,
        interval_ms: u64,
    ) -> bool {
        if self.state != BreakerState::HalfOpen || !self.admits(cfg) {
            return false;
        }
        if self.probes_issued > 0 && now_ms.saturating_sub(self.last_probe_ms) < interval_ms {
            return false;
        }
        self.on_request(now_ms);
        true
    }

    /// Records that a request was sent (a probe when HalfOpen).
    pub fn on_request(&mut self, now_ms: u64) {
        if self.state == BreakerState::HalfOpen {
            self.probes_issued = self.probes_issued.saturating_add(1);
            self.last_probe_ms = now_ms;
        }
    }

    /// Records an outcome (`failure` from [`Outcome::failure`]).
    pub fn record(
        &mut self,
        failure: Option<TripReason>,
        now_ms: u64,
        cfg: &BreakerConfig,
    ) -> Option<Transition> {
        match (self.state, failure) {
            (BreakerState::Closed, None) => {
                self.consecutive_failures = 0;
                None
            }
            (BreakerState::Closed, Some(r)) => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                // While its traffic ramps back, one failure re-opens it, as a failed probe would.
                let ramping = cfg
                    .recovery_ramp
                    .is_some_and(|ramp| ramp.at(self, now_ms).is_some());
                if ramping || self.consecutive_failures >= cfg.consecutive_failures {
                    Some(self.open(r, now_ms, cfg))
                } else {
                    None
                }
            }
            (BreakerState::HalfOpen, None) => {
                self.probe_successes = self.probe_successes.saturating_add(1);
                if self.probe_successes >= cfg.probes_to_close() {
                    let reason = self.reason;
                    *self = Breaker {
                        opens: self.opens,
                        open_until_ms: now_ms,
                        last_probe_ms: now_ms,
                        jitter: self.jitter,
                        ..Breaker::default()
                    };
                    Some(Transition {
                        from: BreakerState::HalfOpen,
                        to: BreakerState::Closed,
                        reason,
                    })
                } else {
                    None
                }
            }
            (BreakerState::HalfOpen, Some(r)) => Some(self.open(r, now_ms, cfg)),
            // Late answers of requests sent before the trip change nothing.
            (BreakerState::Open, _) => None,
        }
    }

    /// Opens the breaker at once (hard signal). Already Open, no transition is reported: while
    /// the cooldown runs it restarts from now (without doubling); once it is over (the breaker
    /// was due to half-open) this is another open in a row, so the cooldown doubles.
    pub fn trip(
        &mut self,
        reason: TripReason,
        now_ms: u64,
        cfg: &BreakerConfig,
    ) -> Option<Transition> {
        if self.state == BreakerState::Open {
            self.reason = Some(reason);
            if now_ms >= self.open_until_ms {
                self.opens = self.opens.saturating_add(1);
            }
            let cd = self.jittered_cooldown_ms(self.opens.max(1), cfg);
            self.open_until_ms = self.open_until_ms.max(now_ms.saturating_add(cd));
            return None;
        }
        Some(self.open(reason, now_ms, cfg))
    }

    fn open(&mut self, reason: TripReason, now_ms: u64, cfg: &BreakerConfig) -> Transition {
        let from = self.state;
        // Closed long enough since the last close: the doubling starts over.
        if from == BreakerState::Closed
            && now_ms.saturating_sub(self.open_until_ms) >= cfg.max_cooldown_ms
        {
            self.opens = 0;
        }
        self.opens = self.opens.saturating_add(1);
        self.state = BreakerState::Open;
        self.reason = Some(reason);
        self.consecutive_failures = 0;
        self.probes_issued = 0;
        self.probe_successes = 0;
        self.open_until_ms = now_ms.saturating_add(self.jittered_cooldown_ms(self.opens, cfg));
        self.last_probe_ms = self.open_until_ms;
        Transition {
            from,
            to: BreakerState::Open,
            reason: Some(reason),
        }
    }

    /// Fixed-size little-endian encoding for proxy-wasm shared data.
    pub fn encode(&self) -> [u8; BREAKER_ENCODED_LEN] {
        let mut b = [0u8; BREAKER_ENCODED_LEN];
        let state = match self.state {
            BreakerState::Closed => 0u8,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        };
        let mut w = Writer {
            buf: &mut b,
            pos: 0,
        };
        w.put(&[
            ENCODING_VERSION,
            state,
            self.reason.map_or(0, TripReason::to_u8),
            self.jitter,
        ]);
        w.put(&self.consecutive_failures.to_le_bytes());
        w.put(&self.opens.to_le_bytes());
        w.put(&self.open_until_ms.to_le_bytes());
        w.put(&self.probes_issued.to_le_bytes());
        w.put(&self.probe_successes.to_le_bytes());
        // The last 4 bytes: low half of last_probe_ms relative to open_until (saturated);
        // precise enough for the lost-probe timeout.
        let rel = u32::try_from(self.last_probe_ms.saturating_sub(self.open_until_ms))
            .unwrap_or(u32::MAX);
        w.put(&rel.to_le_bytes());
        b
    }

    /// Inverse of [`Breaker::encode`]; None for a wrong length, version or tag.
    pub fn decode(bytes: &[u8]) -> Option<Breaker> {
        if bytes.len() != BREAKER_ENCODED_LEN || bytes.first() != Some(&ENCODING_VERSION) {
            return None;
        }
        let state = match bytes.get(1)? {
            0 => BreakerState::Closed,
            1 => BreakerState::Open,
            2 => BreakerState::HalfOpen,
            _ => return None,
        };
        let reason = TripReason::from_u8(*bytes.get(2)?)?;
        let u32_at = |i: usize| -> Option<u32> {
            Some(u32::from_le_bytes(bytes.get(i..i + 4)?.try_into().ok()?))
        };
        let open_until_ms = u64::from_le_bytes(bytes.get(12..20)?.try_into().ok()?);
        Some(Breaker {
            state,
            reason,
            consecutive_failures: u32_at(4)?,
            opens: u32_at(8)?,
            open_until_ms,
            probes_issued: u32_at(20)?,
            probe_successes: u32_at(24)?,
            last_probe_ms: open_until_ms.saturating_add(u64::from(u32_at(28)?)),
            jitter: *bytes.get(3)?,
        })
    }
}

struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        if let Some(dst) = self.buf.get_mut(self.pos..self.pos + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
        self.pos += bytes.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauge_values_are_the_dashboards() {
        // envoy-config/grafana/ai-lb-dashboard.json maps 0 closed, 1 half-open, 2 open.
        assert_eq!(
            [
                BreakerState::Closed,
                BreakerState::HalfOpen,
                BreakerState::Open
            ]
            .map(|b| b.gauge_value()),
            [0, 1, 2]
        );
    }

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            consecutive_failures: 3,
            base_cooldown_ms: 1000,
            max_cooldown_ms: 3000,
            half_open_probes: 2,
            ttft_slo_ms: Some(500),
            ..BreakerConfig::default()
        }
    }

    #[test]
    fn a_shared_write_is_needed_only_when_the_breaker_changed() {
        let c = cfg();
        // A success on a pod never written: nothing to store.
        let w = update_shared(None, 7, 10, &c, |b| b.record(None, 10, &c));
        assert!(!w.changed && w.transitions.is_empty());
        // Failures change it (counted), the third opens it.
        let mut stored = None;
        for t in 0..3 {
            let w = update_shared(stored, 7, 10 + t, &c, |b| {
                b.record(Some(TripReason::ServerErrors), 10 + t, &c)
            });
            assert!(w.changed);
            stored = Some(w.breaker);
        }
        assert_eq!(stored.map(|b| b.state()), Some(BreakerState::Open));
        // After the cooldown the poll half-opens it, whatever the update does.
        let w = update_shared(stored, 7, 60_000, &c, |_| None);
        assert!(w.changed);
        assert_eq!(
            w.transitions.first().map(|t| t.to),
            Some(BreakerState::HalfOpen)
        );
    }

    #[test]
    fn a_probe_passes_at_its_first_byte_only_on_a_good_status_within_the_ttft_slo() {
        let mut c = cfg();
        c.ttft_slo_ms = Some(500);
        assert!(Outcome::probe_passed_at_first_byte(Some(200), 120, &c));
        assert!(
            Outcome::probe_passed_at_first_byte(Some(429), 120, &c),
            "4xx is the client's"
        );
        assert!(!Outcome::probe_passed_at_first_byte(Some(503), 120, &c));
        assert!(
            !Outcome::probe_passed_at_first_byte(Some(200), 501, &c),
            "slow first token"
        );
        assert!(
            !Outcome::probe_passed_at_first_byte(None, 120, &c),
            "no status seen"
        );
        c.ttft_slo_ms = None;
        assert!(Outcome::probe_passed_at_first_byte(Some(200), 60_000, &c));
    }

    #[test]
    fn failure_rate_opens_once_enough_outcomes_fail_within_the_window() {
        let c = BreakerConfig {
            failure_rate_min_requests: 20,
            ..BreakerConfig::default()
        }; // 0.5 over 10 s, at least 20 outcomes
        let mut w = FailureWindow::default();
        // Alternating success / failure: never 5 in a row, but half failed.
        let mut tripped_at = None;
        for i in 0..40u64 {
            if w.record(i % 2 == 1, 1000 + i * 100, &c) {
                tripped_at = Some(i);
                break;
            }
        }
        assert_eq!(tripped_at, Some(19), "the 20th outcome makes 10 of 20");
        // The window started over: the next outcomes alone do not trip.
        assert!(!w.record(true, 5000, &c));
        // 30 % failures never trip.
        let mut w = FailureWindow::default();
        assert!((0..200u64).all(|i| !w.record(i % 10 < 3, i * 100, &c)));
        // Old outcomes leave the window: 19 failures, then a gap longer than the window, then
        // one more failure is 1 of 1 (below the minimum count), not 20 of 20.
        let mut w = FailureWindow::default();
        for i in 0..19u64 {
            assert!(!w.record(true, i, &c));
        }
        assert!(!w.record(true, 30_000, &c));
    }

    fn fail(b: &mut Breaker, now: u64) -> Option<Transition> {
        b.record(Some(TripReason::ServerErrors), now, &cfg())
    }

    #[test]
    fn opens_after_consecutive_failures_and_success_resets_count() {
        let c = cfg();
        let mut b = Breaker::default();
        assert!(fail(&mut b, 0).is_none());
        assert!(fail(&mut b, 0).is_none());
        assert!(b.record(None, 0, &c).is_none());
        assert!(fail(&mut b, 0).is_none());
        assert!(fail(&mut b, 0).is_none());
        let t = fail(&mut b, 10).unwrap();
        assert_eq!(
            (t.from, t.to, t.reason),
            (
                BreakerState::Closed,
                BreakerState::Open,
                Some(TripReason::ServerErrors)
            )
        );
        assert_eq!(b.open_until_ms(), 1010);
        assert!(!b.admits(&c));
    }

    #[test]
    fn four_xx_never_counts() {
        let c = cfg();
        let o = Outcome {
            status: Some(429),
            ..Default::default()
        };
        assert_eq!(o.failure(&c), None);
        let o = Outcome {
            status: Some(503),
            ..Default::default()
        };
        assert_eq!(o.failure(&c), Some(TripReason::ServerErrors));
        let o = Outcome {
            status: Some(200),
            ttft_ms: Some(501),
            ..Default::default()
        };
        assert_eq!(o.failure(&c), Some(TripReason::SlowTtft));
    }

    #[test]
    fn cooldown_doubles_while_failing_and_caps() {
        let c = cfg();
        let mut b = Breaker::default();
        b.trip(TripReason::HardwareFault, 0, &c);
        assert_eq!(b.open_until_ms(), 1000);
        assert!(b.poll(999, &c).is_none());
        assert_eq!(b.poll(1000, &c).map(|t| t.to), Some(BreakerState::HalfOpen));
        b.on_request(1000);
        assert_eq!(fail(&mut b, 1100).map(|t| t.to), Some(BreakerState::Open));
        assert_eq!(b.open_until_ms(), 3100);
        b.poll(3100, &c);
        b.on_request(3100);
        fail(&mut b, 3200);
        assert_eq!(b.open_until_ms(), 6200, "4000 capped at 3000");
    }

    #[test]
    fn doubling_survives_a_close_until_closed_for_max_cooldown() {
        let c = cfg(); // base 1000, cap 3000, 2 probes
        let mut b = Breaker::default();
        b.trip(TripReason::ServerErrors, 0, &c);
        b.poll(1000, &c);
        b.on_request(1000);
        b.on_request(1000);
        b.record(None, 1100, &c);
        assert_eq!(
            b.record(None, 1200, &c).map(|t| t.to),
            Some(BreakerState::Closed)
        );
        // Failing again soon after the close: the second open waits 2 × base.
        b.trip(TripReason::ServerErrors, 2000, &c);
        assert_eq!(b.open_until_ms(), 4000);
        b.poll(4000, &c);
        b.on_request(4000);
        b.on_request(4000);
        b.record(None, 4100, &c);
        b.record(None, 4200, &c);
        assert_eq!(b.state(), BreakerState::Closed);
        // Closed for the whole cap (3000 ms) before failing again: back to the base.
        b.trip(TripReason::ServerErrors, 7200, &c);
        assert_eq!(b.open_until_ms(), 8200);
        // A close is carried through the shared encoding too.
        let d = Breaker::decode(&b.encode()).unwrap();
        assert_eq!(d, b);
    }

    #[test]
    fn probation_lasts_from_the_first_open_until_closed_for_max_cooldown() {
        let c = cfg(); // cap 3000
        let mut b = Breaker::default();
        assert!(!b.on_probation(0, &c), "never opened");
        b.trip(TripReason::ServerErrors, 0, &c);
        assert!(b.on_probation(10, &c));
        b.poll(1000, &c);
        assert!(b.on_probation(1000, &c), "half-open");
        b.on_request(1000);
        b.on_request(1000);
        b.record(None, 1100, &c);
        b.record(None, 1200, &c);
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.on_probation(4199, &c));
        assert!(!b.on_probation(4200, &c));
    }

    #[test]
    fn agent_error_rate_trip_round_trips_and_names_itself() {
        let c = cfg();
        let mut b = Breaker::default();
        let t = b.trip(TripReason::AgentErrorRate, 10, &c).unwrap();
        assert_eq!(t.reason, Some(TripReason::AgentErrorRate));
        assert_eq!(TripReason::AgentErrorRate.as_str(), "agent_error_rate");
        assert_eq!(
            TripReason::AgentErrorRate.cut_name(),
            "breaker_agent_error_rate"
        );
        let d = Breaker::decode(&b.encode()).unwrap();
        assert_eq!(d.reason(), Some(TripReason::AgentErrorRate));
        // A tag from a newer build is refused, not misread.
        let mut bytes = b.encode();
        bytes[2] = 11;
        assert!(Breaker::decode(&bytes).is_none());
    }

    #[test]
    fn half_open_admits_probe_budget_then_closes() {
        let c = cfg();
        let mut b = Breaker::default();
        b.trip(TripReason::Resets, 0, &c);
        b.poll(1000, &c);
        assert!(b.admits(&c));
        b.on_request(1000);
        assert!(!b.admits(&c), "the first probe goes alone");
        assert!(b.record(None, 1001, &c).is_none());
        assert!(b.admits(&c), "it succeeded: the rest of the budget may go");
        b.on_request(1001);
        assert!(!b.admits(&c), "budget of 2 spent");
        let t = b.record(None, 1002, &c).unwrap();
        assert_eq!(
            (t.from, t.to),
            (BreakerState::HalfOpen, BreakerState::Closed)
        );
        assert!(b.admits(&c));
    }

    #[test]
    fn lost_probes_are_forgotten_after_base_cooldown() {
        let c = cfg();
        let mut b = Breaker::default();
        b.trip(TripReason::Resets, 0, &c);
        b.poll(1000, &c);
        b.on_request(1000);
        assert!(!b.admits(&c));
        b.poll(1999, &c);
        assert!(!b.admits(&c));
        b.poll(2000, &c);
        assert!(
            b.admits(&c),
            "the lone probe never answered: another may go"
        );
        // Lost after a success: the success is kept, the lost one forgotten.
        b.on_request(2000);
        b.record(None, 2100, &c);
        b.on_request(2100);
        assert!(!b.admits(&c));
        b.poll(3100, &c);
        assert!(b.admits(&c));
    }

    #[test]
    fn a_failed_first_probe_reopens_before_any_other_is_sent() {
        let c = cfg();
        let mut b = Breaker::default();
        b.trip(TripReason::ServerErrors, 0, &c);
        b.poll(1000, &c);
        let mut sent = 0;
        for t in 1000..1010 {
            if b.admits(&c) {
                b.on_request(t);
                sent += 1;
            }
        }
        assert_eq!(sent, 1, "one probe while the first is out");
        let t = b.record(Some(TripReason::ServerErrors), 1010, &c).unwrap();
        assert_eq!(t.to, BreakerState::Open);
        assert!(!b.admits(&c));
    }

    #[test]
    fn encode_round_trips() {
        let c = cfg();
        let mut b = Breaker::default();
        b.trip(TripReason::Timeouts, 77, &c);
        b.poll(5000, &c);
        b.on_request(5000);
        let d = Breaker::decode(&b.encode()).unwrap();
        assert_eq!(d, b);
        assert!(Breaker::decode(&[0u8; 3]).is_none());
    }

    #[test]
    fn jitter_lengthens_every_cooldown_and_is_kept() {
        let c = cfg(); // base 1000, cap 3000
        let mut b = Breaker::with_jitter(255);
        b.trip(TripReason::ServerErrors, 0, &c);
        assert_eq!(b.open_until_ms(), 1996, "1000 + 1000 * 255 / 256");
        // Kept open by a signal: the restarted cooldown is jittered too.
        b.trip(TripReason::AgentErrorRate, 500, &c);
        assert_eq!(b.open_until_ms(), 2496);
        b.poll(2496, &c);
        b.on_request(2496);
        fail(&mut b, 2500);
        assert_eq!(b.open_until_ms(), 2500 + 2000 + 1992);
        // Through the shared encoding and a close.
        let mut d = Breaker::decode(&b.encode()).unwrap();
        assert_eq!(d, b);
        d.poll(6491, &c);
        assert_eq!(
            d.state(),
            BreakerState::Open,
            "not before its jittered cooldown"
        );
        d.poll(6492, &c);
        d.on_request(6492);
        d.on_request(6492);
        d.record(None, 6493, &c);
        d.record(None, 6494, &c);
        assert_eq!(d.state(), BreakerState::Closed);
        d.trip(TripReason::ServerErrors, 7000, &c);
        assert_eq!(
            d.open_until_ms(),
            7000 + 3000 + 2988,
            "third open in a row, capped, +99.6 %"
        );
    }
}
