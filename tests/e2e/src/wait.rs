//! Decides nothing: the one way the harness and the end-to-end tests wait for something to
//! happen. They poll a condition until a deadline and fail naming what they awaited, never
//! sleep a fixed time and hope: a fixed sleep is too short on a loaded machine (a flaky test)
//! and too long everywhere else.

use std::time::{Duration, Instant};

/// Harness error: a sentence saying what failed.
pub type Error = String;

/// How often [`until`] polls.
pub const POLL_EVERY: Duration = Duration::from_millis(20);

/// Polls `f` every [`POLL_EVERY`] until it returns Some (its value is returned), or fails with
/// "timed out after .. waiting for `what`" once `timeout` has passed.
pub fn until<T>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> Result<T, Error> {
    poll(Instant::now() + timeout, POLL_EVERY, what, || Ok(f()))
}

/// Polls `f` every `every` until it returns `Ok(Some)` (its value is returned) or `Err` (that
/// error is returned: what was awaited can no longer happen, e.g. the process exited), or
/// fails naming `what` once `deadline` has passed. `f` is called at least once, and once more
/// at the deadline.
pub fn poll<T>(
    deadline: Instant,
    every: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<Option<T>, Error>,
) -> Result<T, Error> {
    let start = Instant::now();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(format!(
                "timed out after {:?} waiting for {what}",
                now - start
            ));
        }
        std::thread::sleep(every.min(deadline - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_value_as_soon_as_the_condition_holds() {
        let mut n = 0;
        let v = until(Duration::from_secs(5), "three calls", || {
            n += 1;
            (n == 3).then_some(n)
        });
        assert_eq!(v, Ok(3));
    }

    #[test]
    fn a_timeout_names_what_was_awaited() {
        let e = until(Duration::from_millis(30), "the moon", || None::<()>).unwrap_err();
        assert!(e.contains("waiting for the moon"), "{e}");
    }

    #[test]
    fn an_error_from_the_condition_ends_the_wait() {
        let e = poll(
            Instant::now() + Duration::from_secs(5),
            POLL_EVERY,
            "x",
            || Err::<Option<()>, _>("it exited".to_string()),
        );
        assert_eq!(e, Err("it exited".to_string()));
    }
}
