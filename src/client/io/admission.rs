//! Admission: when a queued chunk may go on the wire. Per connection two
//! credit windows (`Window`: unreceived, unreturned), worker-wide the
//! spread (`Spread`), and the credit split across connections in
//! proportion to the bytes placed on each (`split_credit`); its state is
//! `Admission`'s.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::item::SendOrder;

/// Bytes in a window, by their place in the job-wide order: what the
/// admission rules count. Its owner knows which chunk holds which order.
#[derive(Default)]
pub(super) struct Window {
    pub(super) bytes: usize,
    orders: BTreeMap<SendOrder, usize>,
}

impl Window {
    /// A chunk of no bytes (a push of zeros) is not counted: it holds no
    /// credit, and as the first in the window it would stop preemption
    /// (one sent again as zeros replaces what it counted before).
    pub(super) fn insert(&mut self, order: SendOrder, len: usize) {
        if len == 0 {
            self.remove(&order);
            return;
        }
        self.bytes += len;
        if let Some(old) = self.orders.insert(order, len) {
            self.bytes -= old;
        }
    }
    pub(super) fn remove(&mut self, order: &SendOrder) {
        if let Some(len) = self.orders.remove(order) {
            self.bytes -= len;
        }
    }
    /// Whether a chunk of this order may go: within `limit`, or, over it,
    /// if it comes before every chunk in the window (preemption).
    pub(super) fn admits(&self, order: SendOrder, len: usize, limit: usize) -> bool {
        self.bytes == 0 || self.bytes + len <= limit || self.orders.keys().next().is_some_and(|&f| order < f)
    }
    /// Whether a chunk of this order may go when only the chunks that come
    /// before it in the job-wide order count against `limit`. The first
    /// unfinished chunk of the job has none before it, so it can always
    /// move (no deadlock), and a newly urgent tensor is not held back by
    /// less urgent chunks still waiting for other workers.
    pub(super) fn admits_before(&self, order: SendOrder, len: usize, limit: usize) -> bool {
        let mut ahead = 0;
        for (_, &l) in self.orders.range(..order) {
            ahead += l;
            if ahead + len > limit {
                return false;
            }
        }
        true
    }
}

/// Worker-wide: every chunk queued or in flight on any connection and not
/// yet received whole by its server. A chunk may go only while the bytes
/// before it in the job-wide order stay under the spread limit, so no
/// connection runs ahead of a slower one by more than that: each server's
/// flow then moves at its share of the worker's link (BytePS's split
/// assumes it), instead of TCP's equal share per flow, which let the flows
/// to colocated servers finish early and left the links of CPU-only
/// servers the last ones busy.
#[derive(Default)]
pub(super) struct Spread {
    pub(super) window: Window,
    /// Each chunk's order and connection (to drop a lost one's).
    pub(super) entries: HashMap<(u32, u32), (SendOrder, usize)>,
}

impl Spread {
    pub(super) fn insert(&mut self, key: u32, chunk: u32, order: SendOrder, len: usize, slot: usize) {
        // A chunk re-queued (failover) replaces its entry.
        self.remove(key, chunk);
        self.window.insert(order, len);
        self.entries.insert((key, chunk), (order, slot));
    }
    pub(super) fn remove(&mut self, key: u32, chunk: u32) {
        if let Some((order, _)) = self.entries.remove(&(key, chunk)) {
            self.window.remove(&order);
        }
    }
    pub(super) fn drop_slot(&mut self, slot: usize) {
        let gone: Vec<(u32, u32)> = self.entries.iter().filter(|(_, &(_, s))| s == slot).map(|(&k, _)| k).collect();
        for (key, chunk) in gone {
            self.remove(key, chunk);
        }
    }
}

/// The worker's admission state: the base credit, the bytes placed on
/// each connection (which split it), and the spread.
pub(super) struct Admission {
    /// The base credit per connection (`set_credit` may change it).
    credit: AtomicUsize,
    /// Bytes of all declared tensors placed on each connection's server thread.
    placed: Mutex<Vec<u64>>,
    /// See `Spread` and `spread_limit`.
    spread: Mutex<Spread>,
    fixed: Option<usize>,
    /// The default spread for the current placement (`split_credit`).
    auto: AtomicUsize,
    /// Some connection waits for the spread to shrink (see `Conn::spread_blocked`).
    pub(super) blocked: AtomicBool,
}

impl Admission {
    /// `credit` per connection; `spread`: a fixed limit (Some(0): off), or
    /// None for the default.
    pub(super) fn new(credit: usize, spread: Option<usize>) -> Admission {
        Admission {
            credit: AtomicUsize::new(credit),
            placed: Mutex::new(Vec::new()),
            spread: Mutex::new(Spread::default()),
            fixed: spread,
            auto: AtomicUsize::new(0),
            blocked: AtomicBool::new(false),
        }
    }

    pub(super) fn credit(&self) -> usize {
        self.credit.load(Ordering::Relaxed)
    }

    pub(super) fn placed(&self) -> MutexGuard<'_, Vec<u64>> {
        self.placed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The spread's default for shares placed as `shares`.
    pub(super) fn set_auto(&self, shares: &[u64]) {
        let auto = if uneven(shares) { crate::DEFAULT_CREDIT_BYTES * crate::SPREAD_CREDITS } else { 0 };
        self.auto.store(auto, Ordering::Relaxed);
    }

    /// Chunks in the spread, and their bytes (see `IoStats`).
    pub(super) fn unreceived(&self) -> (usize, usize) {
        let sp = self.spread();
        (sp.entries.len(), sp.window.bytes)
    }

    /// Bytes that may come before a chunk in the spread for it to go; 0: no
    /// limit. Unless set, 2 MiB while the placed shares are uneven, else none.
    pub(super) fn spread_limit(&self) -> usize {
        self.fixed.unwrap_or_else(|| self.auto.load(Ordering::Relaxed))
    }

    pub(super) fn spread(&self) -> MutexGuard<'_, Spread> {
        self.spread.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Change the base credit per connection (autotuning; see `Io::set_credit`).
    pub(super) fn set_credit(&self, bytes: usize) {
        self.credit.store(bytes.max(1), Ordering::Relaxed);
    }

    /// Chunk `chunk` of `key` is no longer in the spread: whether some
    /// connection waited for it to shrink (the flag is cleared; the
    /// caller pumps those connections: `Io::spread_done`).
    pub(super) fn done(&self, key: u32, chunk: u32) -> bool {
        if self.fixed == Some(0) {
            return false; // off for good: nothing was counted
        }
        let mut sp = self.spread();
        sp.remove(key, chunk);
        self.blocked.swap(false, Ordering::AcqRel)
    }
}

/// Per-connection credits: `base` x (connections with bytes placed), split in
/// proportion to `placed`; never below `base / 4`, so a connection can always
/// keep a chunk moving. Before any placement every connection gets `base`.
pub fn split_credit(base: usize, placed: &[u64]) -> Vec<usize> {
    let total: u64 = placed.iter().sum();
    if total == 0 {
        return vec![base; placed.len()];
    }
    let budget = (base * placed.iter().filter(|&&b| b > 0).count()) as f64;
    placed.iter().map(|&b| ((budget * b as f64 / total as f64) as usize).max(base / 4)).collect()
}

/// Whether the shares placed on a worker's connections differ (the largest
/// over 1.25 x the smallest, connections with nothing placed aside): the
/// case the spread exists for. With equal shares TCP's per-flow fairness
/// already gives each server its share, and the spread only throttles (a
/// VGG-19 step with 4 CPU-only servers and 256 KiB chunks: 315.6 samples/s
/// with it at 2 MiB, 337.1 without; docs/benchmarks.md).
pub fn uneven(placed: &[u64]) -> bool {
    let mut nonzero = placed.iter().filter(|&&b| b > 0);
    let Some(&first) = nonzero.next() else { return false };
    let (lo, hi) = nonzero.fold((first, first), |(lo, hi), &b| (lo.min(b), hi.max(b)));
    hi as f64 > 1.25 * lo as f64
}

#[cfg(test)]
mod tests {
    use super::{split_credit, uneven, SendOrder, Spread, Window};

    #[test]
    fn the_spread_is_for_uneven_shares_only() {
        assert!(!uneven(&[]) && !uneven(&[0, 0]) && !uneven(&[5]));
        // k = 4 CPU-only servers (colocated ones get nothing): equal.
        assert!(!uneven(&[0, 250, 0, 250, 250, 250]));
        // Within 25 %: a greedy placement's rounding.
        assert!(!uneven(&[100, 120, 110]));
        // BytePS's split with k = 1 of n = 4: a CPU-only server takes twice a colocated one's share.
        assert!(uneven(&[17, 17, 17, 17, 33]));
    }
    use std::cmp::Reverse;

    fn order(priority: i32, key: u32, chunk: u32) -> SendOrder {
        (Reverse(priority), key, chunk, 0)
    }

    #[test]
    fn windows_preempt_and_count_only_what_comes_first() {
        let mut w = Window::default();
        // Empty: anything goes, even a chunk larger than the limit.
        assert!(w.admits(order(0, 1, 0), 500, 100) && w.admits_before(order(0, 1, 0), 500, 100));
        w.insert(order(0, 1, 0), 60);
        w.insert(order(0, 1, 1), 60);
        // Over the limit, a later chunk of the same tensor waits...
        assert!(!w.admits(order(0, 1, 2), 60, 100));
        assert!(!w.admits_before(order(0, 1, 2), 60, 100));
        // ...a more urgent one preempts: nothing in the window comes before it.
        assert!(w.admits(order(5, 2, 0), 60, 100));
        assert!(w.admits_before(order(5, 2, 0), 60, 100));
        // Once urgent chunks are out, the next urgent chunk counts only them.
        w.insert(order(5, 2, 0), 60);
        assert!(!w.admits(order(5, 2, 1), 30, 100)); // 150 bytes in flight
        assert!(w.admits_before(order(5, 2, 1), 30, 100)); // 60 before it
        assert!(!w.admits_before(order(5, 2, 1), 50, 100));
        // Removing twice takes the bytes once.
        w.remove(&order(0, 1, 0));
        w.remove(&order(0, 1, 0));
        assert_eq!(w.bytes, 120);
    }

    #[test]
    fn the_spread_counts_each_chunk_once_until_received_or_its_connection_is_lost() {
        let mut s = Spread::default();
        s.insert(1, 0, order(0, 1, 0), 100, 0);
        s.insert(1, 1, order(0, 1, 1), 100, 1);
        s.insert(1, 2, order(0, 1, 2), 100, 0);
        // Only what comes before a chunk counts: the first always goes.
        assert!(s.window.admits_before(order(0, 1, 0), 100, 150));
        assert!(s.window.admits_before(order(0, 1, 1), 100, 250));
        assert!(!s.window.admits_before(order(0, 1, 2), 100, 250));
        // Re-queued (failover): replaced, not counted twice.
        s.insert(1, 1, order(0, 1, 1), 100, 2);
        assert_eq!((s.entries.len(), s.window.bytes), (3, 300));
        // Received: gone; removing twice changes nothing.
        s.remove(1, 0);
        s.remove(1, 0);
        assert_eq!((s.entries.len(), s.window.bytes), (2, 200));
        assert!(s.window.admits_before(order(0, 1, 2), 100, 250));
        // A lost connection's entries go; the others stay.
        s.drop_slot(0);
        assert_eq!((s.entries.len(), s.window.bytes), (1, 100));
        assert!(s.entries.contains_key(&(1, 1)) && !s.entries.contains_key(&(1, 2)));
    }

    #[test]
    fn credit_follows_the_placed_bytes() {
        // Before any tensor is placed: the base credit everywhere.
        assert_eq!(split_credit(100, &[0, 0, 0]), vec![100, 100, 100]);
        // Equal shares keep the base credit.
        assert_eq!(split_credit(100, &[5, 5, 5, 5]), vec![100; 4]);
        // BytePS k=2, n=4: CPU-only servers 0.3 M each, colocated 0.1 M each.
        assert_eq!(split_credit(1000, &[3, 3, 1, 1, 1, 1]), vec![1800, 1800, 600, 600, 600, 600]);
        // Unused connections keep a floor and do not dilute the budget.
        assert_eq!(split_credit(400, &[1, 1, 0]), vec![400, 400, 100]);
    }
}
