//! One chunk's way through this worker once queued: its phases on a
//! connection (`Phase`) and the credit windows that follow them
//! (`InFlight`), the active round it belongs to (`Active`, with its
//! `HostRound` through the host stage) and where a push's bytes come from
//! (`ChunkSrc`). What is queued (`item::SendItem`) and its route
//! (`item::Route`) are in `item`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::admission::Window;
use super::item::{Route, SendOrder};
use super::trace::Stamp;
use super::BufPtr;
use crate::client::op::Op;
use crate::host::SharedTensor;
use crate::protocol::TensorSpec;
use crate::waits::StallWatch;

/// A push_pull in flight: one round of one tensor.
pub(super) struct Active {
    pub(super) op: Arc<Op>,
    pub(super) spec: Arc<TensorSpec>,
    pub(super) ptr: BufPtr,
    pub(super) round: u32,
    pub(super) priority: i32,
    pub(super) flags: u16,
    /// A sharded tensor's shard count (0: not sharded).
    pub(super) shards: u32,
    /// By chunk: its result is in the caller's buffer.
    pub(super) got: Vec<bool>,
    pub(super) remaining: usize,
    /// Set when the host's workers sum this tensor together first.
    pub(super) host: Option<HostRound>,
    /// Results land in the tensor's kept copy first (`Route::Kept`).
    pub(super) kept: bool,
}

impl Active {
    /// Chunk `c`'s place among the tensor's pushes, the same on every
    /// worker: its index, or in a sharded tensor, the shards interleaved
    /// (each shard's first chunk, then each one's second, ...). A
    /// reduce-scatter's shards then complete side by side, so each reader
    /// pulls its own while the pushes go on, instead of the last shard's
    /// reader pulling all of its shard after every push.
    pub(super) fn push_position(&self, c: usize) -> u32 {
        push_position(c, self.spec.numel, self.spec.chunk_elems, self.shards)
    }

    pub(super) fn route(&self, c: usize) -> Route {
        match &self.host {
            Some(h) if h.owned[c] => Route::HostOwner,
            Some(_) => Route::HostPeer,
            None if self.kept => Route::Kept,
            None => Route::Caller,
        }
    }

    /// Chunk `c`'s bytes in the caller's buffer.
    pub(super) fn caller_chunk(&self, c: usize) -> (*mut u8, usize) {
        let (a, b) = self.spec.chunk_range(c);
        let es = self.spec.dtype.size();
        // SAFETY: a..b lies within the buffer of numel elements the caller passed.
        (unsafe { self.ptr.0.add(a * es) }, (b - a) * es)
    }

    /// Whether this worker wants chunk `c`'s result back: not where the
    /// caller said it needs none of the chunk (`Extent::want`), unless the
    /// host stage shares it with the host's other workers.
    pub(super) fn wants_result(&self, c: usize) -> bool {
        let (lo, hi) = self.spec.chunk_range(c);
        let es = self.spec.dtype.size();
        !(matches!(self.route(c), Route::Caller | Route::Kept) && self.op.extent.unwanted(lo * es, hi * es))
    }

    /// What this worker's push of chunk `c` reads; None if another worker
    /// of this host pushes it.
    pub(super) fn push_src(&self, c: usize) -> Option<ChunkSrc> {
        match (self.route(c), &self.host) {
            (Route::HostOwner, Some(h)) => {
                let (ptr, len) = h.shared.wire(c, self.round);
                Some(ChunkSrc { ptr, len })
            }
            (Route::Caller | Route::Kept, _) => {
                let (ptr, len) = self.caller_chunk(c);
                Some(ChunkSrc { ptr, len })
            }
            _ => None,
        }
    }
}

/// The bytes a push of one chunk reads.
pub(super) struct ChunkSrc {
    pub(super) ptr: *const u8,
    pub(super) len: usize,
}

/// A round through the host stage: which chunks this worker pushes (for
/// the host, from `tensor`), and which of those it has queued.
pub(super) struct HostRound {
    pub(super) shared: Arc<SharedTensor>,
    pub(super) owned: Vec<bool>,
    pub(super) pushed: Vec<bool>,
    /// Since this worker contributed.
    pub(super) stall: StallWatch,
}

/// Where a chunk this worker pushed on a connection is. Queued chunks are
/// in the connection's heap, done ones are gone:
/// queued → `OnWire` (`InFlight::sent`) → `Received` (the server's
/// Received ack: `InFlight::received`) → done (its result is in:
/// `InFlight::done`; the push that completes a round skips `Received`).
/// A chunk moved to another server, or a connection lost, leaves at any
/// phase (`InFlight::forget`, `InFlight::clear`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Phase {
    OnWire,
    Received,
}

struct Flight {
    order: SendOrder,
    phase: Phase,
    /// Its stages so far, while a timeline is recorded.
    stamp: Option<Stamp>,
}

/// A connection's chunks between queued and done, each in its `Phase`, and
/// the two credit windows that follow from the phases: `unreceived` holds
/// the chunks `OnWire` (bounded by the credit), `unreturned` every chunk
/// here (only what comes before a chunk counts, see `Window::admits_before`).
/// Every change goes through the transitions below, so the windows and
/// the stamps never disagree.
#[derive(Default)]
pub(super) struct InFlight {
    chunks: HashMap<(u32, u32), Flight>,
    pub(super) unreceived: Window,
    pub(super) unreturned: Window,
}

impl InFlight {
    /// The chunks on the wire or received, result not back.
    pub(super) fn on_wire(&self) -> Vec<(u32, u32)> {
        self.chunks.keys().copied().collect()
    }

    /// Queued → on the wire.
    pub(super) fn sent(&mut self, key: u32, chunk: u32, order: SendOrder, len: usize, stamp: Option<Stamp>) {
        self.forget(key, chunk); // never twice (a chunk re-sent after a move)
        self.unreceived.insert(order, len);
        self.unreturned.insert(order, len);
        self.chunks.insert((key, chunk), Flight { order, phase: Phase::OnWire, stamp });
    }

    /// On the wire → received whole by the server: its bytes leave the
    /// unreceived window. False if the chunk is not on the wire here.
    pub(super) fn received(&mut self, key: u32, chunk: u32) -> bool {
        let Some(f) = self.chunks.get_mut(&(key, chunk)).filter(|f| f.phase == Phase::OnWire) else {
            return false;
        };
        f.phase = Phase::Received;
        if let Some(s) = &mut f.stamp {
            s.received = Some(Instant::now());
        }
        self.unreceived.remove(&f.order);
        true
    }

    /// Its result is in: done, out of both windows; its stamps, if recorded.
    pub(super) fn done(&mut self, key: u32, chunk: u32) -> Option<Stamp> {
        self.forget(key, chunk)
    }

    /// Leaves at whatever phase it is in (moved to another server).
    pub(super) fn forget(&mut self, key: u32, chunk: u32) -> Option<Stamp> {
        let f = self.chunks.remove(&(key, chunk))?;
        if f.phase == Phase::OnWire {
            self.unreceived.remove(&f.order);
        }
        self.unreturned.remove(&f.order);
        f.stamp
    }

    /// Everything leaves (the connection is lost, or the job failed).
    pub(super) fn clear(&mut self) {
        *self = InFlight::default();
    }

    #[cfg(test)]
    pub(super) fn phase(&self, key: u32, chunk: u32) -> Option<Phase> {
        self.chunks.get(&(key, chunk)).map(|f| f.phase)
    }
}

/// `Active::push_position` of chunk `c` (of `chunk_elems`) of a tensor of
/// `numel` elements in `shards` equal shards (0 or 1: not sharded). Distinct
/// for distinct chunks: within a shard, chunks start `chunk_elems` apart.
fn push_position(c: usize, numel: u64, chunk_elems: u64, shards: u32) -> u32 {
    let (m, per) = (shards as u64, chunk_elems.max(1));
    if m < 2 || !numel.is_multiple_of(m) || numel / m == 0 {
        return c as u32;
    }
    let start = c as u64 * per;
    let (shard, within) = (start / (numel / m), start % (numel / m));
    u32::try_from(within / per * m + shard).unwrap_or(c as u32)
}

#[cfg(test)]
mod tests {
    use super::{push_position, InFlight, Phase, SendOrder};
    use std::cmp::Reverse;

    #[test]
    fn a_sharded_tensor_pushes_its_shards_interleaved() {
        // 3 shards of 2 chunks: shard 0's first chunk, shard 1's, shard 2's, then the seconds.
        let order = |numel: u64, per: u64, m: u32| {
            let n = numel.div_ceil(per) as usize;
            let mut c: Vec<usize> = (0..n).collect();
            c.sort_by_key(|&c| push_position(c, numel, per, m));
            c
        };
        assert_eq!(order(1536, 256, 3), vec![0, 2, 4, 1, 3, 5]);
        // Not sharded, or shards that do not divide the tensor: chunk order.
        assert_eq!(order(1536, 256, 0), (0..6).collect::<Vec<_>>());
        assert_eq!(order(1537, 256, 3), (0..7).collect::<Vec<_>>());
        // Chunks off the shards' edges: still one place each.
        for (numel, per, m) in [(1000u64, 256u64, 4u32), (4096, 100, 4), (99, 7, 3), (10, 256, 2), (6000, 1, 8)] {
            let n = numel.div_ceil(per) as usize;
            let mut p: Vec<u32> = (0..n).map(|c| push_position(c, numel, per, m)).collect();
            p.sort_unstable();
            p.dedup();
            assert_eq!(p.len(), n, "numel {numel} chunk {per} shards {m}");
        }
    }

    fn order(key: u32, chunk: u32) -> SendOrder {
        (Reverse(0), key, chunk, 0)
    }

    #[test]
    fn a_chunk_moves_through_its_phases_and_the_windows_follow() {
        let mut f = InFlight::default();
        f.sent(1, 0, order(1, 0), 100, None);
        f.sent(1, 1, order(1, 1), 50, None);
        assert_eq!((f.unreceived.bytes, f.unreturned.bytes), (150, 150));
        assert_eq!(f.phase(1, 0), Some(Phase::OnWire));
        // Received: out of the unreceived window only; a second ack is refused.
        assert!(f.received(1, 0));
        assert!(!f.received(1, 0));
        assert_eq!(f.phase(1, 0), Some(Phase::Received));
        assert_eq!((f.unreceived.bytes, f.unreturned.bytes), (50, 150));
        // An ack for a chunk never sent here is refused.
        assert!(!f.received(2, 0));
        // Done from Received, and straight from OnWire (the round's last push).
        f.done(1, 0);
        assert_eq!((f.unreceived.bytes, f.unreturned.bytes), (50, 50));
        f.done(1, 1);
        assert_eq!((f.unreceived.bytes, f.unreturned.bytes), (0, 0));
        assert_eq!(f.phase(1, 1), None);
        // Sent again (re-sent after a move): counted once.
        f.sent(3, 0, order(3, 0), 10, None);
        f.sent(3, 0, order(3, 0), 10, None);
        assert_eq!((f.unreceived.bytes, f.unreturned.bytes), (10, 10));
        f.forget(3, 0);
        assert_eq!((f.unreceived.bytes, f.unreturned.bytes), (0, 0));
        f.sent(4, 0, order(4, 0), 10, None);
        f.clear();
        assert_eq!((f.unreceived.bytes, f.unreturned.bytes, f.phase(4, 0)), (0, 0, None));
    }
}
