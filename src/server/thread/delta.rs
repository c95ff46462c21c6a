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
//!
//! With a replica (failover), every applied push goes to it too and its
//! answer waits for the replica's ack, so the replica has every change any
//! worker has seen; the replica keeps the parameters and each pusher's next
//! push number, and a push that comes again after a failover is answered
//! without being applied twice (`Admit::Replay`).

use std::collections::VecDeque;

/// What a pusher is owed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owed {
    Nothing,
    /// The answer to its push `round` (`by_ref`: through shared memory);
    /// `kept`: the chunk's replica has the push (or there is none), so a
    /// failover cannot lose what the answer shows.
    Answer {
        round: u32,
        by_ref: bool,
        kept: bool,
    },
}

/// What an ack from the replica acknowledges (acks come in the order the
/// frames went).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sent {
    /// The push of the pusher at this position.
    Push(usize),
    /// The whole state (a new replica): every push applied before it.
    Snapshot,
}

/// What an admitted push is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// The pusher's next push: applied.
    Push,
    /// The push before it, applied already (by the lost server whose chunk
    /// this is now, replicated here) but not answered: answered only.
    Replay,
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
    /// By pusher position: pushes applied so far (init included), which
    /// is the number of its next push.
    steps: Vec<u32>,
    owed: Vec<Owed>,
    /// By pusher position: its connection closed (it finished, or the job
    /// is failing): it no longer holds the others back.
    gone: Vec<bool>,
    /// Whether the parameters arrived (the init push of `init_from`).
    initialized: bool,
    staleness: Option<u32>,
    /// Frames sent to the replica and not acked yet, oldest first.
    unacked: VecDeque<Sent>,
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
            unacked: VecDeque::new(),
        }
    }

    /// Taken over from a lost server: the parameters came with the replica,
    /// and `next` says, by rank, which push each pusher makes next.
    pub fn restored(pushers: &[u32], next: &[(u32, u32)], staleness: Option<u32>) -> Deltas {
        let mut d = Deltas::new(pushers, staleness);
        for &(rank, n) in next {
            if let Some(p) = d.position(rank) {
                d.steps[p] = n;
            }
        }
        d.initialized = true;
        d
    }

    /// By rank, the next push of each pusher (for a new replica).
    pub fn next_pushes(&self) -> Vec<(u32, u32)> {
        self.pushers.iter().copied().zip(self.steps.iter().copied()).collect()
    }

    fn position(&self, rank: u32) -> Option<usize> {
        self.pushers.iter().position(|&r| r == rank)
    }

    /// Whether `rank` may push `round` now, and what it is.
    pub fn admit(&self, rank: u32, round: u32) -> Result<Admit, Refusal> {
        let p = self.position(rank).ok_or(Refusal::NotAPusher)?;
        if let Owed::Answer { round: owed, .. } = self.owed[p] {
            return Err(Refusal::Early { owed });
        }
        match self.steps[p] {
            want if want == round => Ok(Admit::Push),
            want if want == round.wrapping_add(1) && self.initialized => Ok(Admit::Replay),
            want => Err(Refusal::Round { want }),
        }
    }

    /// `rank`'s push `round` was applied (or, init, taken as the
    /// parameters when `params` says so): it is owed its answer, which
    /// waits for the replica's ack if it went to one (`replicated`).
    pub fn applied(&mut self, rank: u32, round: u32, by_ref: bool, params: bool, replicated: bool) {
        let Some(p) = self.position(rank) else { return };
        self.steps[p] = round.wrapping_add(1);
        self.owed[p] = Owed::Answer { round, by_ref, kept: !replicated };
        if replicated {
            self.unacked.push_back(Sent::Push(p));
        }
        self.initialized |= params;
    }

    /// A replayed push (`Admit::Replay`) is owed its answer.
    pub fn replayed(&mut self, rank: u32, round: u32, by_ref: bool) {
        if let Some(p) = self.position(rank) {
            self.owed[p] = Owed::Answer { round, by_ref, kept: true };
        }
    }

    /// The replica acked the oldest frame it was sent.
    pub fn acked(&mut self) {
        match self.unacked.pop_front() {
            Some(Sent::Push(p)) => self.keep(|q| q == p),
            Some(Sent::Snapshot) => self.keep(|_| true),
            None => {}
        }
    }

    /// A new replica was sent the whole state (`replica`: true), or there
    /// is no replica any more: what the old one had not acked waits for
    /// the snapshot's ack, or for nothing.
    pub fn replica_changed(&mut self, replica: bool) {
        self.unacked.clear();
        match replica {
            true => self.unacked.push_back(Sent::Snapshot),
            false => self.keep(|_| true),
        }
    }

    /// Mark the answers owed at the positions `which` picks as kept.
    fn keep(&mut self, which: impl Fn(usize) -> bool) {
        for (p, o) in self.owed.iter_mut().enumerate() {
            if let Owed::Answer { kept, .. } = o {
                *kept |= which(p);
            }
        }
    }

    /// The answers that may go now (each taken off what is owed): none
    /// before the parameters arrived or the replica has the push; with a
    /// staleness bound, only those that leave no pusher more than that many
    /// answers ahead of the slowest live one. Counting answers (not pushes
    /// applied) keeps the bound when an answer waits for the replica: with
    /// a bound of 0 the workers keep in step exactly, every answer of a
    /// step sent together, before anyone's next change.
    pub fn answers(&mut self) -> Vec<Answer> {
        if !self.initialized {
            return Vec::new();
        }
        // Every worker starts from worker 0's parameters as they came: the
        // answers to the init pushes wait until every live pusher's is in
        // and kept by the replica, and then go together, so none is sent
        // after another worker's first change was added (an answer carries
        // the parameters as they are when it goes).
        let started = (0..self.steps.len()).all(|p| self.gone[p] || self.steps[p] >= 1)
            && !self.owed.iter().any(|o| matches!(o, Owed::Answer { round: 0, kept: false, .. }));
        let ready = |o: &Owed| match *o {
            Owed::Answer { kept, round, .. } => kept && (started || round > 0),
            Owed::Nothing => false,
        };
        // Answers each pusher has had: one fewer than its pushes if one is owed.
        let had: Vec<u32> = self
            .steps
            .iter()
            .zip(&self.owed)
            .map(|(&s, o)| if matches!(o, Owed::Answer { .. }) { s.saturating_sub(1) } else { s })
            .collect();
        let mut go: Vec<bool> = self.owed.iter().map(ready).collect();
        // The slowest live pusher after this batch; a pusher too far ahead
        // of it waits, which can only lower it: repeat until nothing changes.
        let slowest = loop {
            let after = |p: usize| if go[p] { self.steps[p] } else { had[p] };
            let slowest = (0..self.steps.len()).filter(|&p| !self.gone[p]).map(after).min().unwrap_or(0);
            let Some(s) = self.staleness else { break slowest };
            let ahead: Vec<usize> =
                (0..go.len()).filter(|&p| go[p] && self.steps[p].saturating_sub(slowest) > s).collect();
            if ahead.is_empty() {
                break slowest;
            }
            for p in ahead {
                go[p] = false;
            }
        };
        let mut out = Vec::new();
        for (p, owed) in self.owed.iter_mut().enumerate() {
            let Owed::Answer { round, by_ref, .. } = *owed else { continue };
            if !go[p] {
                continue;
            }
            *owed = Owed::Nothing;
            out.push(Answer { rank: self.pushers[p], round, by_ref, lead: self.steps[p].saturating_sub(slowest) });
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
        d.applied(2, 0, false, false, false);
        d.applied(1, 0, false, false, false);
        assert!(d.answers().is_empty(), "no parameters yet");
        d.applied(0, 0, false, true, false);
        assert_eq!(ranks(&d.answers()), vec![(0, 0), (1, 0), (2, 0)]);
        // Unbounded: worker 0 runs ahead alone, answered every time.
        for round in 1..6 {
            assert_eq!(d.admit(0, round), Ok(Admit::Push));
            d.applied(0, round, false, false, false);
            let a = d.answers();
            assert_eq!(ranks(&a), vec![(0, round)]);
            assert_eq!(a[0].lead, round);
        }
    }

    #[test]
    fn every_worker_starts_from_the_parameters_as_they_came() {
        // Worker 0's init push is in; worker 1's is late: worker 0 is not
        // answered (nor can it push a change) until it is, so worker 1's
        // answer cannot carry worker 0's first change.
        let mut d = Deltas::new(&[0, 1], None);
        d.applied(0, 0, false, true, false);
        assert!(d.answers().is_empty(), "worker 1 has not started");
        assert_eq!(d.admit(0, 1), Err(Refusal::Early { owed: 0 }));
        d.applied(1, 0, false, false, false);
        assert_eq!(ranks(&d.answers()), vec![(0, 0), (1, 0)]);
        // A pusher that left before starting holds nobody back.
        let mut d = Deltas::new(&[0, 1, 2], None);
        d.applied(0, 0, false, true, false);
        d.applied(1, 0, false, false, false);
        d.leave(2);
        assert_eq!(ranks(&d.answers()), vec![(0, 0), (1, 0)]);
    }

    #[test]
    fn a_push_must_be_the_pushers_next_and_wait_for_its_last_answer() {
        let mut d = Deltas::new(&[3, 5], None);
        assert_eq!(d.admit(4, 0), Err(Refusal::NotAPusher));
        assert_eq!(d.admit(3, 1), Err(Refusal::Round { want: 0 }));
        d.applied(3, 0, true, false, false);
        assert_eq!(d.admit(3, 1), Err(Refusal::Early { owed: 0 }));
        d.applied(5, 0, false, true, false);
        let a = d.answers();
        assert_eq!(ranks(&a), vec![(3, 0), (5, 0)]);
        assert!(a[0].by_ref && !a[1].by_ref);
        assert_eq!(d.admit(3, 1), Ok(Admit::Push));
        assert_eq!(d.admit(3, 2), Err(Refusal::Round { want: 1 }));
        assert_eq!(d.admit(5, 0), Ok(Admit::Replay), "answered, then pushed again after a failover");
    }

    #[test]
    fn with_a_replica_an_answer_waits_for_its_ack_in_order() {
        let mut d = Deltas::new(&[0, 1], None);
        d.applied(0, 0, false, true, true);
        d.applied(1, 0, false, false, true);
        assert!(d.answers().is_empty(), "not acked yet");
        d.acked();
        assert!(d.answers().is_empty(), "the init answers go together, once every one is kept");
        d.acked();
        assert_eq!(ranks(&d.answers()), vec![(0, 0), (1, 0)]);
        d.applied(0, 1, false, false, true);
        d.acked();
        assert_eq!(ranks(&d.answers()), vec![(0, 1)]);
        d.applied(0, 2, false, false, true);
        // A new replica: what the old one never acked waits for the snapshot.
        d.replica_changed(true);
        assert!(d.answers().is_empty());
        d.acked();
        assert_eq!(ranks(&d.answers()), vec![(0, 2)]);
        d.applied(1, 1, false, false, true);
        d.replica_changed(false);
        assert_eq!(ranks(&d.answers()), vec![(1, 1)], "no replica: nothing to wait for");
    }

    #[test]
    fn a_restored_chunk_goes_on_from_the_replicas_counts() {
        let mut d = Deltas::restored(&[0, 1], &[(0, 4), (1, 3)], Some(1));
        assert_eq!(d.admit(0, 4), Ok(Admit::Push));
        assert_eq!(d.admit(0, 3), Ok(Admit::Replay));
        assert_eq!(d.admit(1, 1), Err(Refusal::Round { want: 3 }));
        d.replayed(0, 3, false);
        assert_eq!(ranks(&d.answers()), vec![(0, 3)]);
        assert_eq!(d.next_pushes(), vec![(0, 4), (1, 3)]);
    }

    #[test]
    fn with_a_bound_the_fastest_waits_for_the_slowest_exactly() {
        for s in 0..3u32 {
            let mut d = Deltas::new(&[0, 1], Some(s));
            d.applied(0, 0, false, true, false);
            d.applied(1, 0, false, false, false);
            assert_eq!(d.answers().len(), 2);
            // Worker 0 pushes as fast as it is answered; worker 1 never.
            let mut round = 1;
            loop {
                d.applied(0, round, false, false, false);
                let a = d.answers();
                if a.is_empty() {
                    break;
                }
                assert!(a[0].lead <= s);
                round += 1;
            }
            assert_eq!(round, s + 1, "worker 0 stops s + 1 pushes ahead, answered s of them");
            // Worker 1's push releases worker 0 (and is answered itself).
            d.applied(1, 1, false, false, false);
            let a = ranks(&d.answers());
            assert!(a.contains(&(1, 1)) && a.contains(&(0, round)), "{a:?}");
        }
    }

    #[test]
    fn with_a_bound_of_zero_an_answer_waiting_for_the_replica_holds_its_step_back() {
        let mut d = Deltas::new(&[0, 1, 2], Some(0));
        d.applied(0, 0, false, true, true);
        d.applied(1, 0, false, false, true);
        d.applied(2, 0, false, false, true);
        d.acked();
        d.acked();
        assert!(d.answers().is_empty(), "worker 2's answer waits for its ack, so the others wait too");
        d.acked();
        assert_eq!(ranks(&d.answers()), vec![(0, 0), (1, 0), (2, 0)]);
    }

    #[test]
    fn a_pusher_that_left_holds_nobody_back() {
        let mut d = Deltas::new(&[0, 1, 2], Some(1));
        for r in 0..3 {
            d.applied(r, 0, false, r == 0, false);
        }
        assert_eq!(d.answers().len(), 3);
        d.applied(0, 1, false, false, false);
        d.applied(1, 1, false, false, false);
        assert_eq!(ranks(&d.answers()), vec![(0, 1), (1, 1)]);
        d.applied(0, 2, false, false, false);
        assert!(d.answers().is_empty(), "two ahead of worker 2");
        d.leave(2);
        assert_eq!(ranks(&d.answers()), vec![(0, 2)]);
        d.applied(1, 2, false, false, false);
        d.leave(1);
        assert!(d.answers().is_empty(), "nothing is owed to a pusher that left");
    }
}
