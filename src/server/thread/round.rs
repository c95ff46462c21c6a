//! One chunk's round: its number, who has pushed it, and where it is in its
//! lifecycle. Pure bookkeeping (no sockets, no buffers, no clock reads of
//! its own), so every transition is unit-tested below.
//!
//! ```text
//!                 first push / restore          (an adopted chunk starts here)
//!      Unknown ──────────────────────────┐
//!                                        v
//!   ┌─────────────────────────────────> Idle ── add: first push ──> Summing
//!   │                                                                │
//!   │                        add: last push ─────────────────────────┤
//!   │            ┌─────────────────────┬─────────────────────────────┤
//!   │            v                     v                             v
//!   │       Forwarded              Held                      (owner, no replica
//!   │     (relay: the rack's     (owner: waits for            to wait for)
//!   │      sum went to the        its replica's ack)               │
//!   │      owner)  │                   │ ack, or no replica         │
//!   │              │ owner's result    │ any more                   │
//!   │              v                   v                            v
//!   └──────────────────── complete(): done = r, next round r + 1 ───┘
//!                         (results to round r's pushers)
//!
//!   A restored result of the current round completes it from Unknown,
//!   Idle or Summing. Any phase ── retire() ──> Retired (released, given
//!   up, or its replica never acked: no round runs any more).
//! ```
//!
//! The result of round r is in buffer parity r & 1 (`parity`): a pusher
//! only pushes round r + 2 after every pusher received round r, so that
//! buffer is never overwritten while it is being sent.

use std::time::{Duration, Instant};

use crate::waits::StallWatch;

/// Where a chunk's current round is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Taken over from a lost server: the first push or restored result
    /// says which round it is at.
    Unknown,
    /// Waiting for the round's first push.
    Idle,
    /// Some pushes are in, the first when `stall` started (`crate::waits`).
    Summing { stall: StallWatch },
    /// A relay's round: the rack's sum went to the owner, whose result completes it.
    Forwarded,
    /// An owner's round is summed, its results wait for the replica's ack (since `since`).
    Held { since: Instant },
    /// Released or given up (or its replica never acked): no round runs any more.
    Retired,
}

/// What this thread is for a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// It sums the chunk and answers its pushers; a server-side optimizer's
    /// state is replicated at the thread of slot `replica`.
    Owner { replica: Option<u32> },
    /// It sums its rack's pushes, then pushes that sum to the owner at slot `owner`.
    Relay { owner: u32 },
}

/// How the chunk came to this thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    /// Declared here.
    Installed,
    /// Taken over from a lost server (or moved here): pushes it already
    /// answered may come again (replays), and results may be restored.
    Adopted,
}

/// Why a push does not fit the round (the caller words it).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The push names another round than `at`.
    Round { at: u32 },
    /// The rank does not push this chunk.
    NotAPusher,
    /// The rank already pushed this round.
    Twice,
    /// No round runs any more (`Phase::Retired`).
    Retired,
}

/// What an admitted push is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// A contribution to the current round.
    Push,
    /// A push of a round already complete (adopted chunks, or re-sent
    /// over a mended link): answered with its result.
    Replay,
    /// A push re-sent over a mended link that this round already counted:
    /// acknowledged, its payload dropped.
    Counted,
}

/// What a restored result of round s does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Restored {
    /// Every worker has it already: ignored.
    Stale,
    /// The last complete round's result, kept for replays.
    Kept,
    /// It completes the current round (as the sum would have).
    Completes,
}

/// How a pusher gets a round's result: its bytes, written into its shared
/// segment (it pushed by reference), or only the word that the round is
/// complete (it wanted no result: `FLAG_NO_RESULT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(super) enum Reply {
    #[default]
    Bytes,
    ByRef,
    Nothing,
}

impl Reply {
    /// The reply a push asks for: by its flags, and whether it came by reference.
    pub fn to(flags: u16, by_ref: bool) -> Reply {
        match (flags & crate::protocol::FLAG_NO_RESULT != 0, by_ref) {
            (true, _) => Reply::Nothing,
            (false, true) => Reply::ByRef,
            (false, false) => Reply::Bytes,
        }
    }
}

/// Phase, number and role change only through the transitions below.
pub(super) struct Round {
    /// The round being summed (or, `Unknown`, not known yet).
    number: u32,
    phase: Phase,
    role: Role,
    origin: Origin,
    /// The last complete round, whose result is in its parity's buffer.
    done: Option<u32>,
    /// The workers that push this chunk (one per host), by rank, and the
    /// relays of other racks (`HostLayout::pushers_at`).
    pub pushers: Vec<u32>,
    /// Init rounds keep the push of this pusher (`u32::MAX`: none, at a relay of another rack).
    pub init_from: u32,
    /// The round's flags and priority (the first push's; the highest).
    pub flags: u16,
    pub priority: i32,
    /// The pusher whose push started the round (for the timeline).
    pub first: u32,
    /// By rank: pushed this round, and how its result goes back.
    pushed: Vec<bool>,
    reply: Vec<Reply>,
    count: u32,
}

impl Round {
    /// `ranks`: every rank that may push anything here (workers and relays).
    pub fn new(role: Role, origin: Origin, pushers: Vec<u32>, init_from: u32, ranks: usize) -> Round {
        Round {
            number: 0,
            phase: if origin == Origin::Adopted { Phase::Unknown } else { Phase::Idle },
            role,
            origin,
            done: None,
            pushers,
            init_from,
            flags: 0,
            priority: 0,
            first: 0,
            pushed: vec![false; ranks],
            reply: vec![Reply::Bytes; ranks],
            count: 0,
        }
    }

    pub fn number(&self) -> u32 {
        self.number
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn origin(&self) -> Origin {
        self.origin
    }

    pub fn done(&self) -> Option<u32> {
        self.done
    }

    /// An owner's replica is now at `replica`: true if that is a change
    /// (the new one needs the whole state). A relay has none.
    pub fn set_replica(&mut self, replica: Option<u32>) -> bool {
        match &mut self.role {
            Role::Owner { replica: r } if *r != replica => {
                *r = replica;
                true
            }
            _ => false,
        }
    }

    /// The buffer parity of the current round.
    pub fn parity(&self) -> usize {
        (self.number & 1) as usize
    }

    /// No push of the current round is in yet.
    pub fn untouched(&self) -> bool {
        self.count == 0
    }

    pub fn pushed(&self, rank: u32) -> bool {
        self.pushed.get(rank as usize).copied().unwrap_or(false)
    }

    pub fn reply(&self, rank: u32) -> Reply {
        self.reply.get(rank as usize).copied().unwrap_or_default()
    }

    /// The ranks that pushed the current round.
    pub fn pushed_ranks(&self) -> impl Iterator<Item = u32> + '_ {
        self.pushed.iter().enumerate().filter(|(_, &p)| p).map(|(r, _)| r as u32)
    }

    /// The pushers that have not pushed the current round.
    pub fn missing(&self) -> impl Iterator<Item = u32> + '_ {
        self.pushers.iter().copied().filter(|&r| !self.pushed(r))
    }

    /// The owner's slot, for a chunk relayed here.
    pub fn upstream(&self) -> Option<u32> {
        match self.role {
            Role::Relay { owner } => Some(owner),
            Role::Owner { .. } => None,
        }
    }

    pub fn replica(&self) -> Option<u32> {
        match self.role {
            Role::Owner { replica } => replica,
            Role::Relay { .. } => None,
        }
    }

    /// A round is under way here or at the owner (a broken uplink strands it).
    pub fn in_flight(&self) -> bool {
        self.count > 0 || self.phase == Phase::Forwarded
    }

    /// Whether rank may push `round` now, and as what. An adopted chunk
    /// that does not know its round takes the push's (`learn`, on apply).
    pub fn admit(&self, rank: u32, round: u32) -> Result<Admit, Refusal> {
        if self.phase == Phase::Retired {
            return Err(Refusal::Retired);
        }
        let at = if self.phase == Phase::Unknown { round } else { self.number };
        if self.origin == Origin::Adopted && round != at && self.done == Some(round) && self.pushers.contains(&rank) {
            return Ok(Admit::Replay);
        }
        if round != at {
            return Err(Refusal::Round { at });
        }
        if !self.pushers.contains(&rank) {
            return Err(Refusal::NotAPusher);
        }
        if self.pushed(rank) {
            return Err(Refusal::Twice);
        }
        Ok(Admit::Push)
    }

    /// `admit` for a push re-sent after its link was mended (FLAG_RESENT):
    /// the old link may have delivered it, and the result may have been
    /// lost with that link.
    pub fn admit_again(&self, rank: u32, round: u32) -> Result<Admit, Refusal> {
        let at = if self.phase == Phase::Unknown { round } else { self.number };
        if self.phase != Phase::Retired && self.pushers.contains(&rank) {
            if round != at && self.done == Some(round) {
                return Ok(Admit::Replay);
            }
            if round == at && self.pushed(rank) {
                return Ok(Admit::Counted);
            }
        }
        self.admit(rank, round)
    }

    /// Unknown -> Idle at `round` (an adopted chunk's first push says it).
    pub fn learn(&mut self, round: u32) {
        if self.phase == Phase::Unknown {
            (self.number, self.phase) = (round, Phase::Idle);
        }
    }

    /// -> Idle after round `d`, whose result and optimizer state a replica
    /// kept (an adopted chunk going on from it).
    pub fn resume_after(&mut self, d: u32) {
        (self.number, self.done, self.phase) = (d.wrapping_add(1), Some(d), Phase::Idle);
    }

    /// Idle/Summing: count an admitted push; true when it was the last.
    /// `now` is read for a round's first push only (one clock read a round).
    pub fn add(&mut self, rank: u32, flags: u16, priority: i32, reply: Reply, now: impl FnOnce() -> Instant) -> bool {
        if self.count == 0 {
            self.phase = Phase::Summing { stall: StallWatch::since(now()) };
            (self.first, self.flags, self.priority) = (rank, flags, priority);
        }
        self.priority = self.priority.max(priority);
        self.pushed[rank as usize] = true;
        self.reply[rank as usize] = reply;
        self.count += 1;
        self.count as usize == self.pushers.len()
    }

    /// When the round's first push came, while it is being summed.
    pub fn since(&self) -> Option<Instant> {
        match self.phase {
            Phase::Summing { stall } => Some(stall.started()),
            _ => None,
        }
    }

    pub fn stall_reported(&self) -> bool {
        matches!(self.phase, Phase::Summing { stall } if stall.reported())
    }

    /// Summing for `limit` or longer and not reported yet: marks it
    /// reported and says how long it waited.
    pub fn stalled(&mut self, now: Instant, limit: Duration) -> Option<Duration> {
        let Phase::Summing { stall } = &mut self.phase else { return None };
        stall.overdue_at(now, limit)
    }

    /// Summing -> Forwarded (a relay pushed its rack's sum to the owner).
    pub fn forward(&mut self) {
        self.phase = Phase::Forwarded;
    }

    /// Summing -> Held: the round is summed (its result is `done`) and
    /// waits for the replica's ack.
    pub fn hold(&mut self, now: Instant) {
        self.done = Some(self.number);
        self.phase = Phase::Held { since: now };
    }

    /// Held for longer than `limit`.
    pub fn held_past(&self, now: Instant, limit: Duration) -> bool {
        matches!(self.phase, Phase::Held { since } if now.saturating_duration_since(since) > limit)
    }

    /// Held for `round` (the replica acked it).
    pub fn held_for(&self, round: u32) -> bool {
        matches!(self.phase, Phase::Held { .. }) && self.number == round
    }

    /// -> Idle at the next round: the current one is complete (its result
    /// in `parity`); returns it. `pushed_ranks` still names the round's
    /// pushers, who get the result, until `delivered`.
    pub fn complete(&mut self) -> u32 {
        let r = self.number;
        self.done = Some(r);
        self.number = r.wrapping_add(1);
        self.count = 0;
        self.phase = Phase::Idle;
        r
    }

    /// The completed round's results are queued.
    pub fn delivered(&mut self) {
        self.pushed.iter_mut().for_each(|p| *p = false);
    }

    /// A restored result of round s: what it does, and the round it sets.
    /// Unless `Stale`, the caller writes it into parity s & 1; on
    /// `Completes`, it then completes the round (`complete`).
    pub fn restore(&mut self, s: u32, priority: i32) -> Restored {
        let completes = self.phase == Phase::Unknown || s == self.number;
        if !completes && (s.wrapping_add(1) != self.number || self.done == Some(s)) {
            return Restored::Stale;
        }
        self.done = Some(s);
        if !completes {
            return Restored::Kept;
        }
        self.learn(s);
        self.number = s;
        self.priority = self.priority.max(priority);
        Restored::Completes
    }

    /// -> Retired: nothing of the round counts any more.
    pub fn retire(&mut self) {
        self.count = 0;
        self.phase = Phase::Retired;
        self.pushed.iter_mut().for_each(|p| *p = false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn owner(pushers: &[u32]) -> Round {
        Round::new(Role::Owner { replica: None }, Origin::Installed, pushers.to_vec(), pushers[0], 8)
    }

    #[test]
    fn a_round_counts_each_pusher_once_and_completes_at_the_last() {
        let t0 = Instant::now();
        let mut r = owner(&[0, 2, 5]);
        assert_eq!(r.phase, Phase::Idle);
        assert_eq!(r.admit(2, 0), Ok(Admit::Push));
        assert!(!r.add(2, 0, 3, Reply::Bytes, || t0));
        assert_eq!(r.phase, Phase::Summing { stall: StallWatch::since(t0) });
        assert_eq!((r.first, r.priority), (2, 3));
        assert_eq!(r.admit(2, 0), Err(Refusal::Twice));
        assert_eq!(r.admit(1, 0), Err(Refusal::NotAPusher));
        assert_eq!(r.admit(0, 1), Err(Refusal::Round { at: 0 }));
        assert!(!r.add(0, 0, 7, Reply::ByRef, || t0 + MS));
        assert_eq!(r.missing().collect::<Vec<_>>(), vec![5]);
        assert!(r.add(5, 0, 1, Reply::to(crate::protocol::FLAG_NO_RESULT, true), || t0 + 2 * MS));
        assert_eq!(r.priority, 7);
        assert_eq!(r.complete(), 0);
        assert_eq!((r.number, r.done, r.phase), (1, Some(0), Phase::Idle));
        // The pushers of round 0 get its result, by reference where they
        // pushed so, and only its word where they wanted none.
        assert_eq!(r.pushed_ranks().collect::<Vec<_>>(), vec![0, 2, 5]);
        assert_eq!((r.reply(0), r.reply(2), r.reply(5)), (Reply::ByRef, Reply::Bytes, Reply::Nothing));
        r.delivered();
        assert_eq!(r.pushed_ranks().count(), 0);
        assert!(r.untouched());
        assert_eq!(r.admit(2, 1), Ok(Admit::Push));
    }

    #[test]
    fn a_single_pusher_completes_at_once_and_zero_pushes_complete_nothing() {
        let mut r = owner(&[4]);
        assert_eq!(r.admit(4, 0), Ok(Admit::Push));
        assert!(r.add(4, 0, 0, Reply::Bytes, Instant::now));
        // No push yet: the round waits (no stall, nothing in flight).
        let mut idle = owner(&[0, 1]);
        assert!(!idle.in_flight());
        assert_eq!(idle.stalled(Instant::now() + Duration::from_secs(100), MS), None);
        assert_eq!(idle.since(), None);
    }

    #[test]
    fn results_alternate_between_the_two_parities() {
        let mut r = owner(&[0, 1]);
        for n in 0..5u32 {
            assert_eq!(r.parity(), (n & 1) as usize);
            r.add(0, 0, 0, Reply::Bytes, Instant::now);
            r.add(1, 0, 0, Reply::Bytes, Instant::now);
            assert_eq!(r.complete(), n);
            r.delivered();
            // Round n's result stays in its parity while n + 1 sums in the other.
            assert_ne!(r.parity(), (n & 1) as usize);
        }
    }

    #[test]
    fn an_owner_with_a_replica_holds_the_round_until_the_ack() {
        let t0 = Instant::now();
        let mut r = Round::new(Role::Owner { replica: Some(3) }, Origin::Installed, vec![0, 1], 0, 2);
        assert_eq!(r.replica(), Some(3));
        r.add(0, 0, 0, Reply::Bytes, || t0);
        assert!(r.add(1, 0, 0, Reply::Bytes, || t0));
        r.hold(t0 + MS);
        assert_eq!(r.done, Some(0));
        assert!(r.held_for(0) && !r.held_for(1));
        assert!(!r.held_past(t0 + 5 * MS, 10 * MS) && r.held_past(t0 + 20 * MS, 10 * MS));
        // A held round waits for its replica, not for a worker: no stall.
        assert_eq!(r.stalled(t0 + Duration::from_secs(10), MS), None);
        assert_eq!(r.admit(0, 0), Err(Refusal::Twice));
        assert_eq!(r.complete(), 0);
        assert_eq!(r.phase, Phase::Idle);
    }

    #[test]
    fn a_relay_forwards_its_racks_sum_and_the_owners_result_completes_it() {
        let t0 = Instant::now();
        let mut r = Round::new(Role::Relay { owner: 9 }, Origin::Installed, vec![1, 2], u32::MAX, 4);
        assert_eq!((r.upstream(), r.replica()), (Some(9), None));
        r.add(1, 0, 0, Reply::Bytes, || t0);
        assert!(r.add(2, 0, 0, Reply::Bytes, || t0));
        r.forward();
        assert_eq!(r.phase, Phase::Forwarded);
        assert!(r.in_flight());
        // Waiting for the owner, whose stall reports are its own.
        assert_eq!(r.stalled(t0 + Duration::from_secs(10), MS), None);
        assert_eq!(r.complete(), 0);
        assert!(!r.in_flight());
    }

    #[test]
    fn a_stall_is_reported_once_per_round() {
        let t0 = Instant::now();
        let mut r = owner(&[0, 1]);
        r.add(0, 0, 0, Reply::Bytes, || t0);
        assert_eq!(r.stalled(t0 + 5 * MS, 10 * MS), None);
        assert_eq!(r.stalled(t0 + 10 * MS, 10 * MS), Some(10 * MS));
        assert!(r.stall_reported());
        assert_eq!(r.stalled(t0 + 50 * MS, 10 * MS), None);
        r.add(1, 0, 0, Reply::Bytes, || t0);
        r.complete();
        assert!(!r.stall_reported());
    }

    #[test]
    fn an_adopted_chunk_learns_its_round_and_replays_the_last_complete_one() {
        let mut r = Round::new(Role::Owner { replica: None }, Origin::Adopted, vec![0, 1], 0, 2);
        assert_eq!(r.phase, Phase::Unknown);
        // Any round goes until one is known.
        assert_eq!(r.admit(0, 7), Ok(Admit::Push));
        r.learn(7);
        assert_eq!((r.number, r.phase), (7, Phase::Idle));
        r.add(0, 0, 0, Reply::Bytes, Instant::now);
        r.add(1, 0, 0, Reply::Bytes, Instant::now);
        r.complete();
        r.delivered();
        // A push of round 7 again (its pusher never got the result): a replay.
        assert_eq!(r.admit(1, 7), Ok(Admit::Replay));
        assert_eq!(r.admit(1, 6), Err(Refusal::Round { at: 8 }));
        // Installed chunks never replay.
        let mut i = owner(&[0]);
        i.add(0, 0, 0, Reply::Bytes, Instant::now);
        i.complete();
        assert_eq!(i.admit(0, 0), Err(Refusal::Round { at: 1 }));
    }

    #[test]
    fn a_push_sent_again_over_a_mended_link_counts_once() {
        let mut r = owner(&[0, 1]);
        r.add(0, 0, 0, Reply::Bytes, Instant::now);
        // Counted already (the old link delivered it): only acknowledged.
        assert_eq!(r.admit_again(0, 0), Ok(Admit::Counted));
        assert_eq!(r.admit(0, 0), Err(Refusal::Twice), "without the flag it is an error");
        // Not counted yet (the old link lost it): a push like any other.
        assert_eq!(r.admit_again(1, 0), Ok(Admit::Push));
        r.add(1, 0, 0, Reply::Bytes, Instant::now);
        r.complete();
        r.delivered();
        // Complete (its result lost with the old link): answered again.
        assert_eq!(r.admit_again(1, 0), Ok(Admit::Replay));
        assert_eq!(r.admit(1, 0), Err(Refusal::Round { at: 1 }));
        // Anything else is refused as it would be.
        assert_eq!(r.admit_again(2, 1), Err(Refusal::NotAPusher));
        assert_eq!(r.admit_again(0, 5), Err(Refusal::Round { at: 1 }));
    }

    #[test]
    fn restored_results_set_complete_or_are_stale() {
        let mut r = Round::new(Role::Owner { replica: None }, Origin::Adopted, vec![0, 1], 0, 2);
        // Unknown: a restore of round 4 completes it; the round goes on at 5.
        assert_eq!(r.restore(4, 0), Restored::Completes);
        assert_eq!((r.number, r.phase), (4, Phase::Idle));
        assert_eq!(r.complete(), 4);
        // The previous round again: every worker had it.
        assert_eq!(r.restore(4, 0), Restored::Stale);
        assert_eq!(r.restore(2, 0), Restored::Stale);
        // The current round, with one push in: the restore completes it for that pusher.
        r.add(1, 0, 0, Reply::Bytes, Instant::now);
        assert_eq!(r.restore(5, 0), Restored::Completes);
        assert_eq!(r.complete(), 5);
        assert_eq!(r.pushed_ranks().collect::<Vec<_>>(), vec![1]);
        r.delivered();
        // Round 5 unknown as done (a fresh adopted chunk at 6): kept for replays.
        let mut k = Round::new(Role::Owner { replica: None }, Origin::Adopted, vec![0], 0, 1);
        k.learn(6);
        assert_eq!(k.restore(5, 0), Restored::Kept);
        assert_eq!((k.done, k.number), (Some(5), 6));
        assert_eq!(k.admit(0, 5), Ok(Admit::Replay));
    }

    #[test]
    fn a_retired_round_forgets_its_pushes() {
        let mut r = owner(&[0, 1]);
        r.add(0, 0, 0, Reply::Bytes, Instant::now);
        r.retire();
        assert_eq!(r.phase, Phase::Retired);
        assert!(r.untouched() && r.pushed_ranks().count() == 0 && !r.in_flight());
        assert_eq!(r.admit(1, 0), Err(Refusal::Retired));
    }
}
