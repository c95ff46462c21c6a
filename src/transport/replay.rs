//! What one side of a member's control session keeps so the session can
//! resume on a new connection after the old one broke (`crate::session`,
//! `scheduler::member`): every message it sent since the Welcome
//! (heartbeats aside), numbered from 1, until the other side's `Ack`
//! says it arrived. A resume sends again what came after the other
//! side's count. Bounded: past `REPLAY_BYTES` unacknowledged, the oldest
//! go, and a resume that would need them is refused (the session is lost,
//! as it was before resumes existed).

use std::collections::VecDeque;

use crate::protocol::Control;

/// Bytes of unacknowledged messages kept per session and direction.
pub const REPLAY_BYTES: usize = 16 << 20;

/// Whether `msg` is numbered in a session: not liveness, not the
/// session's own opening (Welcome, Resumed).
pub fn counted(msg: &Control) -> bool {
    !matches!(msg, Control::Heartbeat | Control::Ack { .. } | Control::Welcome(_) | Control::Resumed { .. })
}

#[derive(Debug, Default)]
pub struct Replay {
    /// Messages numbered so far (the last one's number).
    sent: u64,
    /// The newest messages, contiguous and ending at `sent`.
    kept: VecDeque<Vec<u8>>,
    bytes: usize,
    limit: Option<usize>,
}

impl Replay {
    pub fn new() -> Replay {
        Replay::default()
    }

    #[cfg(test)]
    fn with_limit(limit: usize) -> Replay {
        Replay { limit: Some(limit), ..Replay::default() }
    }

    /// Number the next message (encoded) and keep it.
    pub fn push(&mut self, encoded: Vec<u8>) {
        self.sent += 1;
        self.bytes += encoded.len();
        self.kept.push_back(encoded);
        while self.bytes > self.limit.unwrap_or(REPLAY_BYTES) {
            match self.kept.pop_front() {
                Some(old) => self.bytes -= old.len(),
                None => break,
            }
        }
    }

    /// The other side has `received` of them: those need not be kept.
    pub fn acked(&mut self, received: u64) {
        let first = self.sent - self.kept.len() as u64 + 1;
        let drop = received.saturating_add(1).saturating_sub(first).min(self.kept.len() as u64);
        for old in self.kept.drain(..drop as usize) {
            self.bytes -= old.len();
        }
    }

    /// The messages after the other side's `received`, in order; None if
    /// some of them were not kept (or `received` is more than was ever
    /// sent).
    pub fn after(&self, received: u64) -> Option<Vec<Vec<u8>>> {
        if received > self.sent {
            return None;
        }
        let missing = (self.sent - received) as usize;
        if missing > self.kept.len() {
            return None;
        }
        Some(self.kept.iter().skip(self.kept.len() - missing).cloned().collect())
    }

    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// A new session (a scheduler that restarted): numbering starts again.
    pub fn reset(&mut self) {
        *self = Replay { limit: self.limit, ..Replay::default() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(i: u8, len: usize) -> Vec<u8> {
        vec![i; len]
    }

    /// `after` as one buffer.
    fn after(r: &Replay, received: u64) -> Option<Vec<u8>> {
        r.after(received).map(|f| f.concat())
    }

    #[test]
    fn a_resume_gets_exactly_what_the_other_side_missed_in_order() {
        let mut r = Replay::new();
        for i in 1..=5 {
            r.push(msg(i, i as usize));
        }
        assert_eq!(after(&r, 5), Some(vec![]));
        assert_eq!(after(&r, 3), Some([msg(4, 4), msg(5, 5)].concat()));
        assert_eq!(after(&r, 0).map(|b| b.len()), Some(15));
        assert_eq!(after(&r, 6), None, "more than was sent is a confused peer");
        r.acked(2);
        assert_eq!(after(&r, 2), Some([msg(3, 3), msg(4, 4), msg(5, 5)].concat()));
        assert_eq!(after(&r, 1), None, "message 2 was acknowledged and dropped");
        r.acked(1); // an old ack changes nothing
        assert_eq!(after(&r, 2).map(|b| b.len()), Some(12));
        r.acked(99); // more than was sent drops everything, no panic
        assert_eq!(after(&r, 5), Some(vec![]));
        assert_eq!(after(&r, 4), None);
        r.push(msg(6, 6));
        assert_eq!(after(&r, 5), Some(msg(6, 6)));
    }

    #[test]
    fn past_the_bound_the_oldest_go_and_a_resume_needing_them_is_refused() {
        let mut r = Replay::with_limit(10);
        for i in 1..=4 {
            r.push(msg(i, 4));
        }
        assert_eq!(r.bytes, 8);
        assert_eq!(after(&r, 2), Some([msg(3, 4), msg(4, 4)].concat()));
        assert_eq!(after(&r, 1), None);
        r.push(msg(5, 40)); // bigger than the bound: nothing kept
        assert_eq!(after(&r, 4), None);
        assert_eq!(after(&r, 5), Some(vec![]));
        r.reset();
        assert_eq!((r.sent(), after(&r, 0)), (0, Some(vec![])));
    }

    #[test]
    fn only_session_messages_are_numbered() {
        assert!(!counted(&Control::Heartbeat));
        assert!(!counted(&Control::Ack { received: 3 }));
        assert!(!counted(&Control::Resumed { received: 3 }));
        assert!(counted(&Control::Barrier { id: 1 }));
        assert!(counted(&Control::Goodbye));
    }
}
