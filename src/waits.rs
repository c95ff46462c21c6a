//! What every role does about something it waits for (a server's round for
//! pushes, a worker's host-stage round for its local workers, the
//! scheduler's declarations and barriers for workers):
//! - it waits too long: one stall watch (`StallWatch`), reported once past
//!   the job's stall threshold, its end logged if it was reported; each role
//!   checks its watches on the same tick (`tick`);
//! - it can never end, because a worker it needs left the job: one message
//!   (`left_message`), the same from every role.

use std::time::{Duration, Instant};

/// One wait, from `start` (or the last `restart`) until it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StallWatch {
    since: Instant,
    reported: bool,
}

impl StallWatch {
    pub fn start() -> StallWatch {
        StallWatch::since(Instant::now())
    }

    pub fn since(at: Instant) -> StallWatch {
        StallWatch { since: at, reported: false }
    }

    /// A new wait starts now (the next round of the same thing).
    pub fn restart(&mut self) {
        *self = StallWatch::start();
    }

    /// When it started.
    pub fn started(&self) -> Instant {
        self.since
    }

    /// How long it has waited.
    pub fn waited(&self) -> Duration {
        self.since.elapsed()
    }

    /// The time waited, the first time a check finds it at least `limit`
    /// (the caller reports it then); None before and after.
    pub fn overdue(&mut self, limit: Duration) -> Option<Duration> {
        self.overdue_at(Instant::now(), limit)
    }

    /// `overdue`, with the clock read by the caller (once for many watches).
    pub fn overdue_at(&mut self, now: Instant, limit: Duration) -> Option<Duration> {
        let waited = now.saturating_duration_since(self.since);
        if self.reported || waited < limit {
            return None;
        }
        self.reported = true;
        Some(waited)
    }

    /// Whether it was reported (so its end is worth a log line).
    pub fn reported(&self) -> bool {
        self.reported
    }
}

/// Why something can never complete: `who` (e.g. "worker 3") left the job;
/// `then` says what still needed them.
pub fn left_message(who: &str, then: &str) -> String {
    format!("{who} left the job (shut down or exited) {then}: every worker must run the same collective operations")
}

/// How often a role checks its watches (and other deadlines of the same
/// kind): a quarter of the shorter of the stall threshold and the peer
/// timeout, between 50 ms and 1 s, so a stall is reported at most a
/// quarter late and an idle role wakes at most once a second.
pub fn tick(stall: Duration, peer_timeout: Duration) -> Duration {
    (stall.min(peer_timeout) / 4).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::{tick, StallWatch};
    use std::time::{Duration, Instant};

    #[test]
    fn a_stall_is_reported_once_and_again_after_a_restart() {
        let mut w = StallWatch::since(Instant::now() - Duration::from_millis(500));
        assert_eq!(w.overdue(Duration::from_secs(10)), None);
        assert!(!w.reported());
        let waited = w.overdue(Duration::from_millis(100)).expect("overdue");
        assert!(waited >= Duration::from_millis(500));
        assert!(w.reported());
        assert_eq!(w.overdue(Duration::from_millis(100)), None, "reported once");
        w.restart();
        assert!(!w.reported() && w.overdue(Duration::from_millis(100)).is_none());
    }

    #[test]
    fn the_tick_is_a_quarter_of_the_shorter_limit_within_bounds() {
        let s = Duration::from_secs;
        assert_eq!(tick(s(2), s(10)), Duration::from_millis(500));
        assert_eq!(tick(s(60), s(2)), Duration::from_millis(500));
        assert_eq!(tick(Duration::from_millis(40), s(10)), Duration::from_millis(50));
        assert_eq!(tick(s(60), s(60)), s(1));
    }
}
