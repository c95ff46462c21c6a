//! Which posted receive an arrived message goes to: pure state, no sockets
//! and no threads, so every order of posts, arrivals and losses is tested
//! directly (`tests` below).
//!
//! torch's rule: messages from one peer with one tag are received in the
//! order they were sent, by receives in the order they were posted. So an
//! arrival goes to the earliest posted receive that takes it (its source,
//! or any source, and its tag), and a new receive takes the earliest
//! arrival it matches; what nobody has asked for yet waits in the inbox.

use std::collections::{HashMap, VecDeque};

/// A message's tag (torch's `tag`, any int).
pub type Tag = i32;

/// One whole message from a peer.
#[derive(Debug, PartialEq, Eq)]
pub struct Message {
    pub src: u32,
    pub tag: Tag,
    pub data: Vec<u8>,
}

/// What became of a posted receive.
#[derive(Debug)]
pub enum Posted<R> {
    /// A message had arrived for it: deliver it now.
    Matched(R, Message),
    /// It waits for a message (its ticket, to cancel it).
    Waiting(u64),
    /// Its source is lost (why) and nothing from it is left.
    Failed(R, String),
}

/// A receive that will never be matched, and why.
pub type Failed<R> = (u64, R, String);

struct Pending<R> {
    ticket: u64,
    src: Option<u32>,
    tag: Tag,
    recv: R,
}

impl<R> Pending<R> {
    fn takes(&self, src: u32, tag: Tag) -> bool {
        self.tag == tag && self.src.is_none_or(|s| s == src)
    }
}

/// Posted receives and arrived messages of one group's links.
pub struct Matcher<R> {
    next_ticket: u64,
    /// Receives not yet matched, in the order they were posted.
    pending: VecDeque<Pending<R>>,
    /// Messages not yet received, in the order they arrived.
    inbox: VecDeque<Message>,
    /// Bytes in the inbox, by source (a reader stops reading past its limit).
    backlog: HashMap<u32, usize>,
    /// Peers whose connection ended, and how.
    lost: HashMap<u32, String>,
    closed: Option<String>,
}

impl<R> Default for Matcher<R> {
    fn default() -> Self {
        Matcher {
            next_ticket: 0,
            pending: VecDeque::new(),
            inbox: VecDeque::new(),
            backlog: HashMap::new(),
            lost: HashMap::new(),
            closed: None,
        }
    }
}

impl<R> Matcher<R> {
    /// Post a receive from `src` (None: any source) with `tag`.
    pub fn post(&mut self, src: Option<u32>, tag: Tag, recv: R) -> Posted<R> {
        if let Some(why) = &self.closed {
            return Posted::Failed(recv, why.clone());
        }
        let found = self.inbox.iter().position(|m| m.tag == tag && src.is_none_or(|s| s == m.src));
        if let Some(msg) = found.and_then(|i| self.inbox.remove(i)) {
            self.unqueue(&msg);
            return Posted::Matched(recv, msg);
        }
        if let Some(why) = src.and_then(|s| self.lost.get(&s)) {
            return Posted::Failed(recv, why.clone());
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.pending.push_back(Pending { ticket, src, tag, recv });
        Posted::Waiting(ticket)
    }

    /// A message arrived: the receive it goes to, if one is posted (else it
    /// waits in the inbox).
    pub fn arrive(&mut self, msg: Message) -> Option<(u64, R, Message)> {
        if self.closed.is_some() {
            return None;
        }
        match self.claim(msg.src, msg.tag) {
            Some((ticket, recv)) => Some((ticket, recv, msg)),
            None => {
                *self.backlog.entry(msg.src).or_default() += msg.data.len();
                self.inbox.push_back(msg);
                None
            }
        }
    }

    /// A message from `src` with `tag` begins: the receive it goes to, if
    /// one is posted (taken now, so its bytes can land in place; the
    /// caller fills it). Messages from one source begin in the order they
    /// were sent, after the one before was whole.
    pub fn claim(&mut self, src: u32, tag: Tag) -> Option<(u64, R)> {
        if self.closed.is_some() {
            return None;
        }
        let i = self.pending.iter().position(|p| p.takes(src, tag))?;
        self.pending.remove(i).map(|p| (p.ticket, p.recv))
    }

    /// Nothing more will come from `src` (why): the receives only it could
    /// match fail. What it sent before stays receivable.
    pub fn lose(&mut self, src: u32, why: String) -> Vec<Failed<R>> {
        let (gone, kept) = std::mem::take(&mut self.pending).into_iter().partition(|p| p.src == Some(src));
        self.pending = kept;
        self.lost.entry(src).or_insert(why.clone());
        gone.into_iter().map(|p: Pending<R>| (p.ticket, p.recv, why.clone())).collect()
    }

    /// The links close: every waiting receive fails, the inbox is dropped.
    pub fn close(&mut self, why: String) -> Vec<Failed<R>> {
        self.closed.get_or_insert(why.clone());
        self.inbox.clear();
        self.backlog.clear();
        self.pending.drain(..).map(|p| (p.ticket, p.recv, why.clone())).collect()
    }

    /// Withdraw a waiting receive (its caller gave up): None if it was
    /// matched or failed already.
    pub fn cancel(&mut self, ticket: u64) -> Option<R> {
        let i = self.pending.iter().position(|p| p.ticket == ticket)?;
        self.pending.remove(i).map(|p| p.recv)
    }

    /// Bytes from `src` that wait in the inbox.
    pub fn backlog(&self, src: u32) -> usize {
        self.backlog.get(&src).copied().unwrap_or(0)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.is_some()
    }

    fn unqueue(&mut self, msg: &Message) {
        if let Some(b) = self.backlog.get_mut(&msg.src) {
            *b -= msg.data.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(src: u32, tag: Tag, byte: u8) -> Message {
        Message { src, tag, data: vec![byte; 3] }
    }

    fn matched(p: Posted<&'static str>) -> (&'static str, Message) {
        match p {
            Posted::Matched(r, m) => (r, m),
            other => panic!("not matched: {other:?}"),
        }
    }

    #[test]
    fn one_peer_one_tag_is_received_in_the_order_it_was_sent() {
        let mut m = Matcher::default();
        // Two arrive before anyone asks, then two receives take them in order.
        assert!(m.arrive(msg(1, 0, 10)).is_none());
        assert!(m.arrive(msg(1, 0, 11)).is_none());
        assert_eq!(m.backlog(1), 6);
        assert_eq!(matched(m.post(Some(1), 0, "a")).1.data[0], 10);
        assert_eq!(matched(m.post(Some(1), 0, "b")).1.data[0], 11);
        assert_eq!(m.backlog(1), 0);
        // Two receives wait; arrivals fill them in the order they were posted.
        assert!(matches!(m.post(Some(1), 0, "c"), Posted::Waiting(_)));
        assert!(matches!(m.post(Some(1), 0, "d"), Posted::Waiting(_)));
        assert_eq!(m.arrive(msg(1, 0, 12)).map(|(_, r, m)| (r, m.data[0])), Some(("c", 12)));
        assert_eq!(m.arrive(msg(1, 0, 13)).map(|(_, r, m)| (r, m.data[0])), Some(("d", 13)));
    }

    #[test]
    fn tags_and_sources_are_matched_apart() {
        let mut m = Matcher::default();
        assert!(matches!(m.post(Some(1), 5, "tag5"), Posted::Waiting(_)));
        assert!(matches!(m.post(Some(2), 0, "from2"), Posted::Waiting(_)));
        // Not what either waits for: queued.
        assert!(m.arrive(msg(1, 0, 1)).is_none());
        assert_eq!(m.arrive(msg(2, 0, 2)).map(|(_, r, _)| r), Some("from2"));
        assert_eq!(m.arrive(msg(1, 5, 3)).map(|(_, r, _)| r), Some("tag5"));
        assert_eq!(matched(m.post(Some(1), 0, "late")).1.data[0], 1);
    }

    #[test]
    fn any_source_takes_the_earliest_arrival_and_waits_its_turn() {
        let mut m = Matcher::default();
        assert!(m.arrive(msg(3, 0, 30)).is_none());
        assert!(m.arrive(msg(2, 0, 20)).is_none());
        let (_, got) = matched(m.post(None, 0, "any"));
        assert_eq!(got.src, 3);
        // Posted before a receive from 2: an arrival from 2 goes to it first.
        let mut m = Matcher::default();
        assert!(matches!(m.post(None, 7, "any"), Posted::Waiting(_)));
        assert!(matches!(m.post(Some(2), 7, "two"), Posted::Waiting(_)));
        assert_eq!(m.arrive(msg(2, 7, 1)).map(|(_, r, _)| r), Some("any"));
        assert_eq!(m.arrive(msg(2, 7, 2)).map(|(_, r, _)| r), Some("two"));
    }

    #[test]
    fn a_lost_peer_fails_only_what_it_alone_could_send_after_its_last_message() {
        let mut m = Matcher::default();
        assert!(m.arrive(msg(1, 0, 9)).is_none());
        assert!(matches!(m.post(Some(1), 1, "other tag"), Posted::Waiting(_)));
        assert!(matches!(m.post(None, 1, "any"), Posted::Waiting(_)));
        let failed = m.lose(1, "rank 1 closed".into());
        assert_eq!(failed.iter().map(|f| f.1).collect::<Vec<_>>(), vec!["other tag"]);
        // What it sent before is still received; after that, a receive from it fails at once.
        assert_eq!(matched(m.post(Some(1), 0, "sent before")).1.data[0], 9);
        assert!(matches!(m.post(Some(1), 0, "after"), Posted::Failed("after", w) if w == "rank 1 closed"));
        // The any-source receive still waits for the others.
        assert_eq!(m.arrive(msg(2, 1, 5)).map(|(_, r, _)| r), Some("any"));
    }

    #[test]
    fn cancel_withdraws_and_close_fails_everything() {
        let mut m = Matcher::default();
        let Posted::Waiting(t) = m.post(Some(1), 0, "gave up") else { panic!() };
        assert_eq!(m.cancel(t), Some("gave up"));
        assert_eq!(m.cancel(t), None);
        // The message it would have taken waits for the next receive.
        assert!(m.arrive(msg(1, 0, 4)).is_none());
        assert!(matches!(m.post(Some(2), 0, "waiting"), Posted::Waiting(_)));
        let failed = m.close("destroyed".into());
        assert_eq!(failed.iter().map(|f| (f.1, f.2.as_str())).collect::<Vec<_>>(), vec![("waiting", "destroyed")]);
        assert_eq!(m.backlog(1), 0);
        assert!(matches!(m.post(Some(1), 0, "x"), Posted::Failed(..)));
        assert!(m.arrive(msg(1, 0, 5)).is_none());
        assert!(m.is_closed());
    }
}
