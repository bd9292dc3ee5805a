//! Priority classes and the held queue: decides, under saturation, who proceeds (critical), who
//! waits up to a deadline (standard) and who is shed at once (sheddable), and in which order held
//! requests are released (class, then FIFO). The three classes follow the Gateway API Inference
//! Extension's criticality levels (Critical / Standard / Sheddable).
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::cmp::Ordering;
use std::collections::VecDeque;

use super::config::{PriorityConfig, SaturationConfig};

/// A request's priority class, most important first (the derived order is release order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PriorityClass {
    Critical,
    Standard,
    Sheddable,
}

impl PriorityClass {
    pub const ALL: [PriorityClass; 3] = [Self::Critical, Self::Standard, Self::Sheddable];

    /// Parses a header or config value, case-insensitively.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("critical") {
            Some(Self::Critical)
        } else if s.eq_ignore_ascii_case("standard") {
            Some(Self::Standard)
        } else if s.eq_ignore_ascii_case("sheddable") {
            Some(Self::Sheddable)
        } else {
            None
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Critical => "critical",
            Self::Standard => "standard",
            Self::Sheddable => "sheddable",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Where a request's class came from (for stats: an unknown header value is worth counting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassSource {
    Route,
    Header,
    /// The header was present but not a known class; the default applied.
    InvalidHeader,
    Default,
}

/// Chooses the class: the longest matching route prefix wins (operators pin routes, clients
/// cannot promote themselves there), then the header, then the default.
pub fn classify(
    cfg: &PriorityConfig,
    path: &str,
    header_value: Option<&str>,
) -> (PriorityClass, ClassSource) {
    let route = cfg
        .routes
        .iter()
        .filter(|r| path.starts_with(r.path_prefix.as_str()))
        .max_by_key(|r| r.path_prefix.len());
    if let Some(r) = route {
        return (r.class, ClassSource::Route);
    }
    match header_value {
        Some(v) => match PriorityClass::parse(v) {
            Some(c) => (c, ClassSource::Header),
            None => (cfg.default_class, ClassSource::InvalidHeader),
        },
        None => (cfg.default_class, ClassSource::Default),
    }
}

/// One candidate pod as the saturation test sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodLoad {
    /// Normalised load in 0..=1.
    pub load: f64,
    pub breaker_open: bool,
}

/// Saturated when there is no eligible pod, every breaker is open, or every pod with a closed
/// breaker is above the soft threshold.
pub fn is_saturated(pods: &[PodLoad], soft_threshold: f64) -> bool {
    pods.iter().all(|p| {
        p.breaker_open
            || !matches!(
                p.load.partial_cmp(&soft_threshold),
                Some(Ordering::Less | Ordering::Equal)
            )
    })
}

/// What to do with a request given its class and whether the pool is saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PriorityDecision {
    /// Route now (to the best pod).
    Proceed,
    /// Hold until capacity frees, at most until `deadline_ms`; then 503.
    Hold { deadline_ms: u64 },
    /// 429 now.
    Shed { retry_after_s: u32 },
    /// 503 now: the held queue is full (or holding is disabled with a zero wait).
    Reject { retry_after_s: u32 },
}

/// Applies the class policy; `queue_has_room` is the held queue's `has_room()`.
pub fn decide(
    cfg: &SaturationConfig,
    class: PriorityClass,
    saturated: bool,
    queue_has_room: bool,
    now_ms: u64,
) -> PriorityDecision {
    if !saturated {
        return PriorityDecision::Proceed;
    }
    match class {
        PriorityClass::Critical => PriorityDecision::Proceed,
        PriorityClass::Sheddable => PriorityDecision::Shed {
            retry_after_s: cfg.retry_after_seconds,
        },
        PriorityClass::Standard => {
            if queue_has_room && cfg.max_wait_standard_ms > 0 {
                PriorityDecision::Hold {
                    deadline_ms: now_ms.saturating_add(cfg.max_wait_standard_ms),
                }
            } else {
                PriorityDecision::Reject {
                    retry_after_s: cfg.retry_after_seconds,
                }
            }
        }
    }
}

/// The policy of a derived Ultra or High request (a bounded hold): proceed when the pool is
/// not saturated, when its hold is 0 or the queue is full (a bounded hold is never answered
/// 503), else hold it until `now + max_held_ms`, when it is routed anyway.
pub fn decide_bounded(
    saturated: bool,
    queue_has_room: bool,
    max_held_ms: u64,
    now_ms: u64,
) -> PriorityDecision {
    if !saturated || !queue_has_room || max_held_ms == 0 {
        return PriorityDecision::Proceed;
    }
    PriorityDecision::Hold {
        deadline_ms: now_ms.saturating_add(max_held_ms),
    }
}

/// A request waiting in the held queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The caller's handle (the proxy-wasm http context id).
    pub id: u32,
    pub class: PriorityClass,
    pub enqueued_ms: u64,
    pub deadline_ms: u64,
    /// A bounded hold (a derived Ultra or High request): at its deadline it is routed, not
    /// answered 503 ([`HeldQueue::due`]).
    pub proceed_at_deadline: bool,
}

/// The held queue's lanes, released in this order: a derived Ultra request, a derived High
/// one, then the classes' own (a `critical` request is never held; `sheddable` only if a
/// future policy holds it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lane {
    Ultra = 0,
    High = 1,
    Standard = 2,
    Sheddable = 3,
}

impl Lane {
    /// The lane of a class's own (not derived) requests.
    pub fn of_class(class: PriorityClass) -> Self {
        match class {
            PriorityClass::Critical => Self::Ultra,
            PriorityClass::Standard => Self::Standard,
            PriorityClass::Sheddable => Self::Sheddable,
        }
    }
}

/// A request leaving the queue, released or expired, with how long it waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Left {
    pub id: u32,
    pub class: PriorityClass,
    pub waited_ms: u64,
}

/// The queue refused a request because it already holds `max_held`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull;

/// Per-worker queue of held requests: one FIFO per [`Lane`], released most important lane
/// first.
#[derive(Debug, Clone)]
pub struct HeldQueue {
    queues: [VecDeque<Held>; 4],
    max_held: usize,
}

impl HeldQueue {
    pub fn new(max_held: usize) -> Self {
        Self {
            queues: [
                VecDeque::new(),
                VecDeque::new(),
                VecDeque::new(),
                VecDeque::new(),
            ],
            max_held,
        }
    }

    pub fn depth(&self) -> usize {
        self.queues.iter().map(VecDeque::len).sum()
    }

    pub fn depth_of(&self, class: PriorityClass) -> usize {
        self.queues
            .iter()
            .flat_map(|q| q.iter())
            .filter(|h| h.class == class)
            .count()
    }

    pub fn has_room(&self) -> bool {
        self.depth() < self.max_held
    }

    pub fn push(
        &mut self,
        id: u32,
        class: PriorityClass,
        now_ms: u64,
        deadline_ms: u64,
    ) -> Result<(), QueueFull> {
        self.push_in(id, class, Lane::of_class(class), now_ms, deadline_ms, false)
    }

    /// Holds a derived Ultra / High request in `lane` until `deadline_ms`, when it is routed
    /// anyway ([`HeldQueue::due`]); `class` is what its stats count it as.
    pub fn push_bounded(
        &mut self,
        id: u32,
        class: PriorityClass,
        lane: Lane,
        now_ms: u64,
        deadline_ms: u64,
    ) -> Result<(), QueueFull> {
        self.push_in(id, class, lane, now_ms, deadline_ms, true)
    }

    fn push_in(
        &mut self,
        id: u32,
        class: PriorityClass,
        lane: Lane,
        now_ms: u64,
        deadline_ms: u64,
        proceed_at_deadline: bool,
    ) -> Result<(), QueueFull> {
        if !self.has_room() {
            return Err(QueueFull);
        }
        match self.queues.get_mut(lane as usize) {
            Some(q) => {
                q.push_back(Held {
                    id,
                    class,
                    enqueued_ms: now_ms,
                    deadline_ms,
                    proceed_at_deadline,
                });
                Ok(())
            }
            None => Err(QueueFull),
        }
    }

    /// Removes every bounded hold whose deadline has passed (`deadline_ms <= now_ms`): the
    /// caller routes them now. Call it before [`HeldQueue::expire`], which would answer them.
    pub fn due(&mut self, now_ms: u64) -> Vec<Left> {
        self.take_past_deadline(now_ms, true)
    }

    /// Removes the requests past their deadline whose `proceed_at_deadline` is `bounded`.
    fn take_past_deadline(&mut self, now_ms: u64, bounded: bool) -> Vec<Left> {
        let mut out = Vec::new();
        for q in self.queues.iter_mut() {
            q.retain(|h| {
                if h.proceed_at_deadline == bounded && h.deadline_ms <= now_ms {
                    out.push(Left {
                        id: h.id,
                        class: h.class,
                        waited_ms: now_ms.saturating_sub(h.enqueued_ms),
                    });
                    false
                } else {
                    true
                }
            });
        }
        out
    }

    /// Releases up to `free` requests, most important class first, oldest first within a
    /// class. Expired entries are not released (call `expire` first to answer them).
    pub fn release(&mut self, free: usize, now_ms: u64) -> Vec<Left> {
        let mut out = Vec::new();
        for q in self.queues.iter_mut() {
            while out.len() < free {
                let Some(h) = q.front().copied() else { break };
                q.pop_front();
                if h.deadline_ms <= now_ms {
                    // Stale head: put it back at the front for `expire` and stop this class.
                    q.push_front(h);
                    break;
                }
                out.push(Left {
                    id: h.id,
                    class: h.class,
                    waited_ms: now_ms.saturating_sub(h.enqueued_ms),
                });
            }
        }
        out
    }

    /// Removes every request whose deadline has passed (`deadline_ms <= now_ms`): the caller
    /// answers them 503. A bounded hold is never expired ([`HeldQueue::due`] takes it).
    pub fn expire(&mut self, now_ms: u64) -> Vec<Left> {
        self.take_past_deadline(now_ms, false)
    }

    /// Drops a request whose client went away; true when it was held.
    pub fn remove(&mut self, id: u32) -> bool {
        for q in self.queues.iter_mut() {
            if let Some(pos) = q.iter().position(|h| h.id == id) {
                q.remove(pos);
                return true;
            }
        }
        false
    }

    /// The earliest deadline, for the caller's tick timer.
    pub fn next_deadline(&self) -> Option<u64> {
        self.queues
            .iter()
            .flat_map(|q| q.iter().map(|h| h.deadline_ms))
            .min()
    }

    /// Age of the oldest held request.
    pub fn oldest_wait_ms(&self, now_ms: u64) -> u64 {
        self.queues
            .iter()
            .filter_map(|q| q.front())
            .map(|h| now_ms.saturating_sub(h.enqueued_ms))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::admission::config::RouteClass;

    #[test]
    fn route_beats_header_beats_default() {
        let cfg = PriorityConfig {
            routes: vec![
                RouteClass {
                    path_prefix: "/v1".into(),
                    class: PriorityClass::Standard,
                },
                RouteClass {
                    path_prefix: "/v1/batch".into(),
                    class: PriorityClass::Sheddable,
                },
            ],
            ..PriorityConfig::default()
        };
        assert_eq!(
            classify(&cfg, "/v1/batch/x", Some("critical")),
            (PriorityClass::Sheddable, ClassSource::Route)
        );
        assert_eq!(
            classify(&cfg, "/v1/chat", None),
            (PriorityClass::Standard, ClassSource::Route)
        );
        assert_eq!(
            classify(&cfg, "/other", Some("CRITICAL")),
            (PriorityClass::Critical, ClassSource::Header)
        );
        assert_eq!(
            classify(&cfg, "/other", Some("vip")),
            (PriorityClass::Standard, ClassSource::InvalidHeader)
        );
        assert_eq!(
            classify(&cfg, "/other", None),
            (PriorityClass::Standard, ClassSource::Default)
        );
    }

    #[test]
    fn saturation_needs_every_open_pod_above_threshold() {
        let p = |load, breaker_open| PodLoad { load, breaker_open };
        assert!(is_saturated(&[p(0.9, false), p(0.95, false)], 0.85));
        assert!(!is_saturated(&[p(0.9, false), p(0.5, false)], 0.85));
        assert!(is_saturated(&[p(0.1, true), p(0.9, false)], 0.85));
        assert!(is_saturated(&[p(0.1, true)], 0.85));
        assert!(is_saturated(&[], 0.85));
        assert!(
            is_saturated(&[p(f64::NAN, false)], 0.85),
            "an unreadable load is not spare capacity"
        );
    }

    #[test]
    fn class_policy_under_saturation() {
        let cfg = SaturationConfig {
            max_wait_standard_ms: 300,
            retry_after_seconds: 2,
            ..SaturationConfig::default()
        };
        for c in PriorityClass::ALL {
            assert_eq!(decide(&cfg, c, false, true, 0), PriorityDecision::Proceed);
        }
        assert_eq!(
            decide(&cfg, PriorityClass::Critical, true, false, 0),
            PriorityDecision::Proceed
        );
        assert_eq!(
            decide(&cfg, PriorityClass::Sheddable, true, true, 0),
            PriorityDecision::Shed { retry_after_s: 2 }
        );
        assert_eq!(
            decide(&cfg, PriorityClass::Standard, true, true, 1000),
            PriorityDecision::Hold { deadline_ms: 1300 }
        );
        assert_eq!(
            decide(&cfg, PriorityClass::Standard, true, false, 1000),
            PriorityDecision::Reject { retry_after_s: 2 }
        );
    }

    #[test]
    fn releases_by_class_then_fifo() {
        let mut q = HeldQueue::new(10);
        q.push(1, PriorityClass::Sheddable, 0, 1000).unwrap();
        q.push(2, PriorityClass::Standard, 1, 1000).unwrap();
        q.push(3, PriorityClass::Critical, 2, 1000).unwrap();
        q.push(4, PriorityClass::Standard, 3, 1000).unwrap();
        assert_eq!(q.depth(), 4);
        let ids: Vec<u32> = q.release(3, 10).iter().map(|l| l.id).collect();
        assert_eq!(ids, vec![3, 2, 4]);
        let left = q.release(5, 20);
        assert_eq!(
            left,
            vec![Left {
                id: 1,
                class: PriorityClass::Sheddable,
                waited_ms: 20
            }]
        );
        assert_eq!(q.depth(), 0);
    }

    #[test]
    fn bounded_holds_go_first_by_lane_and_are_due_not_expired_at_their_deadline() {
        assert_eq!(
            decide_bounded(false, true, 150, 0),
            PriorityDecision::Proceed
        );
        assert_eq!(
            decide_bounded(true, false, 150, 0),
            PriorityDecision::Proceed
        );
        assert_eq!(decide_bounded(true, true, 0, 0), PriorityDecision::Proceed);
        assert_eq!(
            decide_bounded(true, true, 150, 1000),
            PriorityDecision::Hold { deadline_ms: 1150 }
        );
        let mut q = HeldQueue::new(10);
        q.push(1, PriorityClass::Standard, 0, 2000).unwrap();
        q.push_bounded(2, PriorityClass::Standard, Lane::High, 1, 600)
            .unwrap();
        q.push_bounded(3, PriorityClass::Critical, Lane::Ultra, 2, 150)
            .unwrap();
        assert_eq!(q.depth_of(PriorityClass::Standard), 2);
        assert_eq!(q.depth_of(PriorityClass::Critical), 1);
        let ids: Vec<u32> = q.release(2, 10).iter().map(|l| l.id).collect();
        assert_eq!(ids, vec![3, 2], "Ultra, then High, then standard");
        q.push_bounded(4, PriorityClass::Critical, Lane::Ultra, 20, 170)
            .unwrap();
        assert!(q.due(169).is_empty());
        // At its deadline a bounded hold is due (routed), never expired (answered).
        assert!(q.expire(170).is_empty());
        let due = q.due(170);
        assert_eq!(
            due,
            vec![Left {
                id: 4,
                class: PriorityClass::Critical,
                waited_ms: 150
            }]
        );
        assert_eq!(q.depth(), 1);
        assert!(q.due(5000).is_empty(), "a standard request is never due");
        assert_eq!(q.expire(2000).len(), 1);
    }

    #[test]
    fn expiry_at_deadline_and_full_queue() {
        let mut q = HeldQueue::new(2);
        q.push(1, PriorityClass::Standard, 0, 100).unwrap();
        q.push(2, PriorityClass::Standard, 50, 150).unwrap();
        assert_eq!(q.push(3, PriorityClass::Standard, 60, 160), Err(QueueFull));
        assert_eq!(q.next_deadline(), Some(100));
        assert_eq!(q.oldest_wait_ms(80), 80);
        assert!(q.expire(99).is_empty());
        assert!(
            q.release(1, 100).is_empty(),
            "an expired head is not released"
        );
        assert_eq!(
            q.expire(100),
            vec![Left {
                id: 1,
                class: PriorityClass::Standard,
                waited_ms: 100
            }]
        );
        assert!(q.remove(2));
        assert!(!q.remove(2));
        assert_eq!(q.depth(), 0);
    }
}
