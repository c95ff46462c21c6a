//! Who is cut off when a worker reports a live server unreachable
//! (`Control::Unreachable`): the server, written off like a lost one, or
//! the worker. A worker whose own links are down (its host's network, a
//! partition of that host) gives up on every server it has links to, one
//! after another; writing each off would empty the job of healthy servers.
//! So a report is judged a short while after it came (`Reports::blame`,
//! pure: tested without sockets): a worker that reported two or more
//! servers nobody else reported is the one cut off; otherwise the server is.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Reports kept (the oldest go first; judging looks back two windows).
const KEPT: usize = 1024;

#[derive(Default)]
pub(super) struct Reports {
    seen: VecDeque<(u32, u32, Instant)>,
}

/// What a report of server `server` by a worker comes to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Blame {
    /// The server: written off (its chunks move).
    Server,
    /// The worker, who reported these servers (sorted), which no other
    /// worker reported: it is the one cut off.
    Worker { servers: Vec<u32> },
}

impl Reports {
    /// Worker `worker` reported server `server` unreachable at `at`.
    pub fn record(&mut self, worker: u32, server: u32, at: Instant) {
        if self.seen.len() == KEPT {
            self.seen.pop_front();
        }
        self.seen.push_back((worker, server, at));
    }

    /// Judge `worker`'s report, made `window` ago or less, at `now`: by the
    /// reports of the last two windows (a worker's links give up within a
    /// window of each other when its own network failed: each is given up
    /// the peer timeout after it broke, and idle ones notice a little later).
    pub fn blame(&self, worker: u32, now: Instant, window: Duration) -> Blame {
        let since = now.checked_sub(2 * window).unwrap_or(now);
        let recent = || self.seen.iter().filter(move |r| r.2 >= since);
        let mut alone: Vec<u32> = recent()
            .filter(|&&(w, s, _)| w == worker && !recent().any(|&(o, t, _)| o != worker && t == s))
            .map(|r| r.1)
            .collect();
        alone.sort_unstable();
        alone.dedup();
        match alone.len() {
            0 | 1 => Blame::Server,
            _ => Blame::Worker { servers: alone },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Blame, Reports};
    use std::time::{Duration, Instant};

    #[test]
    fn a_worker_that_alone_reports_several_servers_is_the_one_cut_off() {
        let (t0, w) = (Instant::now(), Duration::from_secs(1));
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // One server cut off from one worker (a partition): the server goes.
        let mut r = Reports::default();
        r.record(1, 0, ms(0));
        assert_eq!(r.blame(1, ms(1000), w), Blame::Server);
        // The worker's links to every server give up within the window: the worker.
        for s in 1..3 {
            r.record(1, s, ms(100 * s as u64));
        }
        assert_eq!(r.blame(1, ms(1000), w), Blame::Worker { servers: vec![0, 1, 2] });
        // The same server reported twice is one server.
        let mut r = Reports::default();
        r.record(1, 0, ms(0));
        r.record(1, 0, ms(10));
        assert_eq!(r.blame(1, ms(1000), w), Blame::Server);
        // Servers every worker reports are cut off themselves (a rack of
        // servers partitioned from the workers): they go.
        let mut r = Reports::default();
        for worker in 0..3 {
            for s in [0, 1] {
                r.record(worker, s, ms(10 * (worker as u64 + s as u64)));
            }
        }
        for worker in 0..3 {
            assert_eq!(r.blame(worker, ms(1000), w), Blame::Server);
        }
        // A worker cut off from the remote servers, its host's one aside,
        // which the others then report: the worker, for the two only it reports.
        let mut r = Reports::default();
        r.record(1, 1, ms(0));
        r.record(1, 2, ms(5));
        r.record(0, 0, ms(8));
        r.record(2, 0, ms(9));
        assert_eq!(r.blame(1, ms(1000), w), Blame::Worker { servers: vec![1, 2] });
        assert_eq!(r.blame(0, ms(1000), w), Blame::Server);
        // Reports older than two windows are forgotten: one partition long
        // ago and one now are two single partitions.
        let mut r = Reports::default();
        r.record(1, 0, ms(0));
        r.record(1, 1, ms(5000));
        assert_eq!(r.blame(1, ms(5500), w), Blame::Server);
    }

    #[test]
    fn reports_are_bounded() {
        let mut r = Reports::default();
        let t0 = Instant::now();
        for i in 0..(super::KEPT as u32 + 10) {
            r.record(i, 0, t0);
        }
        assert_eq!(r.seen.len(), super::KEPT);
    }
}
