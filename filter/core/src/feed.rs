//! Decides when the agent feed (re)opens its `WatchPool` stream, for both data paths (the
//! wasm filter's lease holder; the native module's feed thread): open when idle and due, give
//! up on a silent stream, and back off exponentially with "equal jitter" after failures
//! (delay = d/2 + rand·d/2 with d = min(max, base·2^failures); AWS Architecture Blog,
//! "Exponential Backoff and Jitter", 2015). Pure: `now_ms` and the random draw come in.

use crate::config::WatchConfig;

/// The agent's heartbeat when the filter asks for none (`watch.heartbeatMs` 0).
pub const DEFAULT_HEARTBEAT_MS: u64 = 5_000;

/// Backoff limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub base_ms: u64,
    pub max_ms: u64,
    /// A stream with no message (event or heartbeat) for this long is cancelled and reopened.
    pub idle_timeout_ms: u64,
}

impl Backoff {
    /// The limits `watch` configures: reconnect base and cap, and a stream silent for three
    /// heartbeats and a second (the agent's default heartbeat when `heartbeatMs` is 0) is dead.
    pub fn from_watch(w: &WatchConfig) -> Self {
        let heartbeat = if w.heartbeat_ms == 0 {
            DEFAULT_HEARTBEAT_MS
        } else {
            u64::from(w.heartbeat_ms)
        };
        Backoff {
            base_ms: w.reconnect_base_ms,
            max_ms: w.reconnect_max_ms,
            idle_timeout_ms: heartbeat.saturating_mul(3).saturating_add(1_000),
        }
    }

    /// The delay before attempt number `failures + 1`, with `rand01` in [0, 1).
    pub fn delay_ms(&self, failures: u32, rand01: f64) -> u64 {
        let exp = self
            .base_ms
            .saturating_mul(1u64 << failures.min(30))
            .min(self.max_ms);
        let half = exp / 2;
        let jitter = (half as f64 * rand01.clamp(0.0, 1.0)) as u64;
        half + jitter
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle {
        next_attempt_ms: u64,
    },
    Open {
        token: u32,
        last_activity_ms: u64,
        got_message: bool,
    },
}

/// The subscription of one pool in the VM that holds its lease.
#[derive(Debug, Clone)]
pub struct Subscription {
    backoff: Backoff,
    state: State,
    failures: u32,
}

impl Subscription {
    pub fn new(backoff: Backoff) -> Self {
        Self {
            backoff,
            state: State::Idle { next_attempt_ms: 0 },
            failures: 0,
        }
    }

    /// How long until the next attempt is due (0: now); None while a stream is open.
    pub fn wait_ms(&self, now_ms: u64) -> Option<u64> {
        match self.state {
            State::Idle { next_attempt_ms } => Some(next_attempt_ms.saturating_sub(now_ms)),
            State::Open { .. } => None,
        }
    }

    /// The silence after which a stream is given up (ms).
    pub fn idle_timeout_ms(&self) -> u64 {
        self.backoff.idle_timeout_ms
    }

    /// True when no stream is open and the backoff delay has passed.
    pub fn due(&self, now_ms: u64) -> bool {
        matches!(self.state, State::Idle { next_attempt_ms } if now_ms >= next_attempt_ms)
    }

    pub fn token(&self) -> Option<u32> {
        match self.state {
            State::Open { token, .. } => Some(token),
            State::Idle { .. } => None,
        }
    }

    pub fn consecutive_failures(&self) -> u32 {
        self.failures
    }

    pub fn opened(&mut self, token: u32, now_ms: u64) {
        self.state = State::Open {
            token,
            last_activity_ms: now_ms,
            got_message: false,
        };
    }

    /// The host refused to open the stream, or it closed/was cancelled: schedule a retry.
    pub fn failed(&mut self, now_ms: u64, rand01: f64) {
        let delay = self.backoff.delay_ms(self.failures, rand01);
        self.failures = self.failures.saturating_add(1);
        self.state = State::Idle {
            next_attempt_ms: now_ms.saturating_add(delay),
        };
    }

    /// A message arrived on `token`; false if it is not the current stream (ignore it).
    pub fn message(&mut self, token: u32, now_ms: u64) -> bool {
        match &mut self.state {
            State::Open {
                token: t,
                last_activity_ms,
                got_message,
            } if *t == token => {
                *last_activity_ms = now_ms;
                *got_message = true;
                self.failures = 0;
                true
            }
            _ => false,
        }
    }

    /// The stream `token` closed. A stream that delivered messages retries after the base
    /// delay; one that never did counts as a failure. False if `token` is not current.
    pub fn closed(&mut self, token: u32, now_ms: u64, rand01: f64) -> bool {
        match self.state {
            State::Open { token: t, .. } if t == token => {
                self.failed(now_ms, rand01);
                true
            }
            _ => false,
        }
    }

    /// The token of a stream silent for longer than the idle timeout (to cancel), if any.
    pub fn silent(&self, now_ms: u64) -> Option<u32> {
        match self.state {
            State::Open {
                token,
                last_activity_ms,
                ..
            } if now_ms.saturating_sub(last_activity_ms) > self.backoff.idle_timeout_ms => {
                Some(token)
            }
            _ => None,
        }
    }

    /// Forget the stream (lease lost or stream cancelled); returns its token to cancel.
    pub fn stop(&mut self, now_ms: u64) -> Option<u32> {
        let token = self.token();
        self.state = State::Idle {
            next_attempt_ms: now_ms,
        };
        token
    }

    /// True once the current stream has delivered at least one message.
    pub fn live(&self) -> bool {
        matches!(
            self.state,
            State::Open {
                got_message: true,
                ..
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Backoff = Backoff {
        base_ms: 100,
        max_ms: 2_000,
        idle_timeout_ms: 5_000,
    };

    #[test]
    fn delay_doubles_up_to_the_cap_with_jitter_in_the_upper_half() {
        assert_eq!(B.delay_ms(0, 0.0), 50);
        assert_eq!(B.delay_ms(0, 1.0), 100);
        assert_eq!(B.delay_ms(1, 0.0), 100);
        assert_eq!(B.delay_ms(3, 1.0), 800);
        assert_eq!(B.delay_ms(10, 1.0), 2_000);
        assert_eq!(B.delay_ms(u32::MAX, 0.5), 1_500);
    }

    #[test]
    fn opens_immediately_then_backs_off_after_failures() {
        let mut s = Subscription::new(B);
        assert!(s.due(0));
        s.opened(1, 0);
        assert!(!s.due(0));
        assert!(s.closed(1, 10, 0.0));
        assert!(!s.due(59));
        assert!(s.due(60));
        s.opened(2, 60);
        assert!(s.closed(2, 70, 0.0));
        assert!(!s.due(169));
        assert!(s.due(170));
        assert_eq!(s.consecutive_failures(), 2);
    }

    #[test]
    fn a_message_resets_the_failure_count() {
        let mut s = Subscription::new(B);
        s.failed(0, 0.0);
        s.failed(0, 0.0);
        s.opened(5, 1_000);
        assert!(s.message(5, 1_001));
        assert!(s.live());
        assert_eq!(s.consecutive_failures(), 0);
    }

    #[test]
    fn stale_tokens_are_ignored() {
        let mut s = Subscription::new(B);
        s.opened(5, 0);
        assert!(!s.message(4, 1));
        assert!(!s.closed(4, 1, 0.0));
        assert_eq!(s.token(), Some(5));
    }

    #[test]
    fn a_silent_stream_is_reported_after_the_idle_timeout() {
        let mut s = Subscription::new(B);
        s.opened(9, 0);
        assert_eq!(s.silent(5_000), None);
        assert_eq!(s.silent(5_001), Some(9));
        s.message(9, 5_001);
        assert_eq!(s.silent(5_002), None);
        assert_eq!(s.stop(6_000), Some(9));
        assert!(s.due(6_000));
    }
}
