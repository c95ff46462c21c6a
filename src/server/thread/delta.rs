//! An asynchronous chunk (`crate::training`, `GRADHUB_ASYNC`): the chunk
//! holds the parameters (its first push, the init push, brings worker 0's),
//! adds each worker's parameter change to them as soon as it has arrived,
//! and answers that worker alone with the parameters as they are then. No
//! round waits for other workers, except that with a staleness bound s a
//! worker's answer waits until it is at most s pushes ahead of the slowest
//! pusher. Pure bookkeeping (no sockets, no buffers): unit-tested below.
//!
//! Each pusher's pushes are numbered 0 (init), 1, 2, ... like rounds, so
//! the worker's side is unchanged: it pushes round k only after the answer
//! to round k - 1, so at most one answer per pusher is ever owed.

/// What a pusher is owed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owed {
    Nothing,
    /// The answer to its push `round` (`by_ref`: through shared memory).
    Answer {
        round: u32,
        by_ref: bool,
    },
}

/// Why a push does not fit (the caller words it).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The rank does not push this chunk.
    NotAPusher,
    /// The push names another round than the pusher's next, `want`.
    Round { want: u32 },
    /// Its previous push is not answered yet.
    Early { owed: u32 },
}

/// An answer to send: to `rank`, for its push `round`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Answer {
    pub rank: u32,
    pub round: u32,
    pub by_ref: bool,
    /// How many pushes it is ahead of the slowest pusher.
    pub lead: u32,
}

pub(super) struct Deltas {
    /// The chunk's pushers, by rank.
    pushers: Vec<u32>,
    /// By pusher position: pushes applied so far (init included).
    steps: Vec<u32>,
    owed: Vec<Owed>,
    /// By pusher position: its connection closed (it finished, or the job
    /// is failing): it no longer holds the others back.
    gone: Vec<bool>,
    /// Whether the parameters arrived (the init push of `init_from`).
    initialized: bool,
    staleness: Option<u32>,
}

impl Deltas {
    pub fn new(pushers: &[u32], staleness: Option<u32>) -> Deltas {
        let n = pushers.len();
        Deltas {
            pushers: pushers.to_vec(),
            steps: vec![0; n],
            owed: vec![Owed::Nothing; n],
            gone: vec![false; n],
            initialized: false,
            staleness,
        }
    }

    fn position(&self, rank: u32) -> Option<usize> {
        self.pushers.iter().position(|&r| r == rank)
    }

    /// Whether `rank` may push `round` now.
    pub fn admit(&self, rank: u32, round: u32) -> Result<(), Refusal> {
        let p = self.position(rank).ok_or(Refusal::NotAPusher)?;
        if let Owed::Answer { round: owed, .. } = self.owed[p] {
            return Err(Refusal::Early { owed });
        }
        match self.steps[p] {
            want if want == round => Ok(()),
            want => Err(Refusal::Round { want }),
        }
    }

    /// `rank`'s push `round` was applied (or, init, taken as the
    /// parameters when `params` says so): it is owed its answer.
    pub fn applied(&mut self, rank: u32, round: u32, by_ref: bool, params: bool) {
        let Some(p) = self.position(rank) else { return };
        self.steps[p] = round + 1;
        self.owed[p] = Owed::Answer { round, by_ref };
        self.initialized |= params;
    }

    /// The answers that may go now (each taken off what is owed): none
    /// before the parameters arrived; with a staleness bound, only to
    /// pushers at most that many pushes ahead of the slowest.
    pub fn answers(&mut self) -> Vec<Answer> {
        if !self.initialized {
            return Vec::new();
        }
        let live = self.steps.iter().zip(&self.gone).filter(|(_, &g)| !g).map(|(&s, _)| s);
        let slowest = live.min().unwrap_or(0);
        let mut out = Vec::new();
        for (p, owed) in self.owed.iter_mut().enumerate() {
            let Owed::Answer { round, by_ref } = *owed else { continue };
            let lead = self.steps[p] - slowest;
            if self.staleness.is_some_and(|s| lead > s) {
                continue;
            }
            *owed = Owed::Nothing;
            out.push(Answer { rank: self.pushers[p], round, by_ref, lead });
        }
        out
    }

    /// `rank`'s connection closed: nothing is owed to it any more, and the
    /// bound no longer waits for it (a worker that finished early).
    pub fn leave(&mut self, rank: u32) {
        if let Some(p) = self.position(rank) {
            (self.gone[p], self.owed[p]) = (true, Owed::Nothing);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(a: &[Answer]) -> Vec<(u32, u32)> {
        a.iter().map(|a| (a.rank, a.round)).collect()
    }

    #[test]
    fn nothing_is_answered_before_the_parameters_then_each_push_at_once() {
        let mut d = Deltas::new(&[0, 1, 2], None);
        d.applied(2, 0, false, false);
        d.applied(1, 0, false, false);
        assert!(d.answers().is_empty(), "no parameters yet");
        d.applied(0, 0, false, true);
        assert_eq!(ranks(&d.answers()), vec![(0, 0), (1, 0), (2, 0)]);
        // Unbounded: worker 0 runs ahead alone, answered every time.
        for round in 1..6 {
            assert_eq!(d.admit(0, round), Ok(()));
            d.applied(0, round, false, false);
            let a = d.answers();
            assert_eq!(ranks(&a), vec![(0, round)]);
            assert_eq!(a[0].lead, round);
        }
    }

    #[test]
    fn a_push_must_be_the_pushers_next_and_wait_for_its_last_answer() {
        let mut d = Deltas::new(&[3, 5], None);
        assert_eq!(d.admit(4, 0), Err(Refusal::NotAPusher));
        assert_eq!(d.admit(3, 1), Err(Refusal::Round { want: 0 }));
        d.applied(3, 0, true, false);
        assert_eq!(d.admit(3, 1), Err(Refusal::Early { owed: 0 }));
        d.applied(5, 0, false, true);
        let a = d.answers();
        assert_eq!(ranks(&a), vec![(3, 0), (5, 0)]);
        assert!(a[0].by_ref && !a[1].by_ref);
        assert_eq!(d.admit(3, 1), Ok(()));
        assert_eq!(d.admit(3, 2), Err(Refusal::Round { want: 1 }));
    }

    #[test]
    fn with_a_bound_the_fastest_waits_for_the_slowest_exactly() {
        for s in 0..3u32 {
            let mut d = Deltas::new(&[0, 1], Some(s));
            d.applied(0, 0, false, true);
            d.applied(1, 0, false, false);
            assert_eq!(d.answers().len(), 2);
            // Worker 0 pushes as fast as it is answered; worker 1 never.
            let mut round = 1;
            loop {
                d.applied(0, round, false, false);
                let a = d.answers();
                if a.is_empty() {
                    break;
                }
                assert!(a[0].lead <= s);
                round += 1;
            }
            assert_eq!(round, s + 1, "worker 0 stops s + 1 pushes ahead, answered s of them");
            // Worker 1's push releases worker 0 (and is answered itself).
            d.applied(1, 1, false, false);
            let a = ranks(&d.answers());
            assert!(a.contains(&(1, 1)) && a.contains(&(0, round)), "{a:?}");
        }
    }

    #[test]
    fn a_pusher_that_left_holds_nobody_back() {
        let mut d = Deltas::new(&[0, 1, 2], Some(1));
        for r in 0..3 {
            d.applied(r, 0, false, r == 0);
        }
        assert_eq!(d.answers().len(), 3);
        d.applied(0, 1, false, false);
        d.applied(1, 1, false, false);
        assert_eq!(ranks(&d.answers()), vec![(0, 1), (1, 1)]);
        d.applied(0, 2, false, false);
        assert!(d.answers().is_empty(), "two ahead of worker 2");
        d.leave(2);
        assert_eq!(ranks(&d.answers()), vec![(0, 2)]);
        d.applied(1, 2, false, false);
        d.leave(1);
        assert!(d.answers().is_empty(), "nothing is owed to a pusher that left");
    }
}
