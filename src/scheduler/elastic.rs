//! Elastic jobs on the shared service: forming a job's next generation.
//!
//! An elastic job runs as a sequence of generations under one name on the
//! service (`service`): when a worker is lost, or one asks to join, the
//! running generation ends on every member, the survivors roll back to
//! their last commit (`gradhub.torch.elastic`) and register again, and the
//! service forms the next generation from whoever registered, with dense
//! ranks. Its servers start fresh instances, as for any job.
//!
//! The rules here are pure (no sockets, no clock of their own), so every
//! case is tested directly:
//! - ranks: workers of the previous generation first, in their old rank
//!   order, so rank 0 is always a survivor holding the committed state
//!   that `sync()` broadcasts; newcomers after them, in arrival order;
//! - when to form: at once when the expected workers registered (the
//!   first generation: the size the job starts with; a later one: the
//!   previous generation's survivors) or `max` did; otherwise, once no one
//!   new came for `settle` (an expected worker died during the reset) and
//!   at least `min` did; a generation still short of `min` after
//!   `timeout` fails with the reason.

use std::time::{Duration, Instant};

/// An elastic job's bounds, from its first worker's registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub min: u32,
    pub max: u32,
}

/// How long formation waits (see the module's comment).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub settle: Duration,
    pub timeout: Duration,
}

/// One worker waiting for the next generation.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Its rank in the generation it comes from; None: new to the job.
    pub prev_rank: Option<u32>,
    pub arrived: Instant,
}

/// What formation does now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Wait for more workers, at most until then.
    Wait(Instant),
    /// Form the generation with everyone who registered.
    Form,
    /// Give up: too few workers came.
    Fail(String),
}

/// The rank of each candidate (in the order given) in the new generation.
pub fn assign(cands: &[Candidate]) -> Vec<u32> {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by_key(|&i| (cands[i].prev_rank.is_none(), cands[i].prev_rank, cands[i].arrived, i));
    let mut ranks = vec![0; cands.len()];
    for (rank, &i) in order.iter().enumerate() {
        ranks[i] = rank as u32;
    }
    ranks
}

/// Whether the generation forms now, given who registered so far.
pub fn decide(bounds: Bounds, timing: Timing, expected: u32, cands: &[Candidate], now: Instant) -> Decision {
    let n = cands.len() as u32;
    let (Some(first), Some(last)) = (cands.iter().map(|c| c.arrived).min(), cands.iter().map(|c| c.arrived).max())
    else {
        return Decision::Wait(now + timing.timeout);
    };
    if n >= bounds.max || (n >= expected.max(1) && n >= bounds.min) {
        return Decision::Form;
    }
    let settled = now.saturating_duration_since(last) >= timing.settle;
    if settled && n >= bounds.min {
        return Decision::Form;
    }
    let deadline = first + timing.timeout;
    if now >= deadline && n >= bounds.min {
        return Decision::Form;
    }
    if now >= deadline {
        return Decision::Fail(format!(
            "only {n} worker(s) registered within {:.0?}, below the job's minimum of {}",
            timing.timeout, bounds.min
        ));
    }
    Decision::Wait(if n >= bounds.min { (last + timing.settle).min(deadline) } else { deadline })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    const TIMING: Timing = Timing { settle: Duration::from_millis(1000), timeout: Duration::from_secs(60) };

    #[test]
    fn survivors_keep_their_order_and_rank_0_is_always_a_survivor() {
        let t0 = Instant::now();
        // Old ranks 3 and 1 survived (2 died), a newcomer came first, another later.
        let cands = [
            Candidate { prev_rank: None, arrived: at(t0, 0) },
            Candidate { prev_rank: Some(3), arrived: at(t0, 5) },
            Candidate { prev_rank: Some(1), arrived: at(t0, 9) },
            Candidate { prev_rank: None, arrived: at(t0, 7) },
        ];
        assert_eq!(assign(&cands), vec![2, 1, 0, 3]);
        // Dense whatever the gaps: 0..n.
        let mut r = assign(&cands);
        r.sort_unstable();
        assert_eq!(r, vec![0, 1, 2, 3]);
    }

    #[test]
    fn forms_at_once_at_the_maximum() {
        let t0 = Instant::now();
        let cands: Vec<_> = (0..4).map(|i| Candidate { prev_rank: Some(i), arrived: at(t0, 0) }).collect();
        let b = Bounds { min: 2, max: 4 };
        assert_eq!(decide(b, TIMING, 8, &cands, at(t0, 1)), Decision::Form);
        assert_eq!(decide(b, TIMING, 8, &cands[..3], at(t0, 1)), Decision::Wait(at(t0, 1000)));
    }

    #[test]
    fn forms_at_once_when_the_expected_workers_came() {
        let t0 = Instant::now();
        let b = Bounds { min: 1, max: 8 };
        let cands: Vec<_> = (0..3).map(|i| Candidate { prev_rank: Some(i), arrived: at(t0, 0) }).collect();
        assert_eq!(decide(b, TIMING, 3, &cands, at(t0, 1)), Decision::Form);
        assert_eq!(decide(b, TIMING, 3, &cands[..2], at(t0, 1)), Decision::Wait(at(t0, 1000)));
        // Never below the minimum, even when fewer were expected (survivors of a loss).
        let b = Bounds { min: 3, max: 3 };
        assert_eq!(decide(b, TIMING, 2, &cands[..2], at(t0, 1)), Decision::Wait(at(t0, 60_000)));
        match decide(b, TIMING, 2, &cands[..2], at(t0, 60_000)) {
            Decision::Fail(why) => assert!(why.contains("minimum of 3"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn forms_once_settled_with_at_least_the_minimum() {
        let t0 = Instant::now();
        let b = Bounds { min: 2, max: 8 };
        let cands = [
            Candidate { prev_rank: Some(0), arrived: at(t0, 0) },
            Candidate { prev_rank: Some(2), arrived: at(t0, 300) },
        ];
        // A later arrival restarts the settle time.
        assert_eq!(decide(b, TIMING, 8, &cands, at(t0, 900)), Decision::Wait(at(t0, 1300)));
        assert_eq!(decide(b, TIMING, 8, &cands, at(t0, 1300)), Decision::Form);
        // Below the minimum, settling is not enough: wait to the timeout.
        assert_eq!(decide(b, TIMING, 8, &cands[..1], at(t0, 5000)), Decision::Wait(at(t0, 60_000)));
    }

    #[test]
    fn fails_with_the_reason_below_the_minimum_at_the_timeout() {
        let t0 = Instant::now();
        let b = Bounds { min: 3, max: 8 };
        let cands = [Candidate { prev_rank: Some(1), arrived: at(t0, 0) }];
        match decide(b, TIMING, 8, &cands, at(t0, 60_000)) {
            Decision::Fail(why) => assert!(why.contains("only 1 worker(s)") && why.contains("minimum of 3"), "{why}"),
            other => panic!("{other:?}"),
        }
        // At the minimum by then, it forms instead.
        let two = [cands[0], Candidate { prev_rank: None, arrived: at(t0, 59_999) }];
        assert_eq!(decide(Bounds { min: 2, max: 8 }, TIMING, 8, &two, at(t0, 60_000)), Decision::Form);
    }
}
