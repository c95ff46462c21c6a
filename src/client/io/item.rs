//! What every part says of one chunk: its send item on a connection's
//! queue (`SendItem`, `ChunkSend`) in the job-wide order (`SendOrder`), what
//! the frame being written carries (`Carry`), how a send goes again
//! (`Again`), its route through this worker (`Route`) and where its
//! result is read into (`ResultDest`). A leaf: it imports no other part.

use std::time::Instant;

use crate::protocol::{DType, Header, FLAG_RESENT};

/// One chunk of a push_pull: a slice of the caller's buffer.
#[derive(PartialEq, Eq)]
pub(super) struct ChunkSend {
    pub(super) priority: i32,
    pub(super) seq: u64,
    pub(super) key: u32,
    pub(super) chunk: u32,
    /// Its place among the tensor's pushes (`flow::Active::push_position`).
    pub(super) position: u32,
    pub(super) round: u32,
    pub(super) flags: u16,
    pub(super) dtype: DType,
    pub(super) ptr: *const u8,
    pub(super) len: usize,
    /// The data is in the host's shared segment, which the server maps:
    /// send only the header (PushRef).
    pub(super) by_ref: bool,
    /// When it was queued (the timeline's QUEUED stage).
    pub(super) queued: Instant,
}

/// Something waiting to be sent on a connection. Strict total order,
/// identical on every worker: higher priority first, then lower key
/// (earlier first use), then the chunk's place among the tensor's pushes
/// (its index, the shards interleaved in a sharded tensor) — never a
/// `<=`-style comparator.
/// A push of zeros (a header only: an all-gather's others' slots) goes
/// before every push with data: it costs its link nothing, and the chunk's
/// round, which waits for it, can complete as soon as the chunk's data
/// arrives from its owner, instead of after this worker's own data.
#[derive(PartialEq, Eq)]
pub(super) enum SendItem {
    Chunk(ChunkSend),
    /// A frame with a payload of its own (DataHello, OptConfig, Restore):
    /// not a push, so it takes no credit and expects no result; these go
    /// out in the order they were queued, before every push.
    Control {
        seq: u64,
        header: Header,
        payload: Vec<u8>,
    },
}

impl SendItem {
    /// Position in the job-wide order (smaller = sooner).
    pub(super) fn order(&self) -> SendOrder {
        match self {
            // (A send again after a mend or a failover keeps its place.)
            SendItem::Chunk(c)
                if c.flags & (crate::protocol::FLAG_ZEROS | FLAG_RESENT) == crate::protocol::FLAG_ZEROS =>
            {
                (std::cmp::Reverse(i32::MAX), c.key, c.position, c.seq)
            }
            SendItem::Chunk(c) => (std::cmp::Reverse(c.priority), c.key, c.position, c.seq),
            // Control frames: FIFO among themselves, before every push.
            SendItem::Control { seq, .. } => (std::cmp::Reverse(i32::MAX), 0, 0, *seq),
        }
    }
}
/// A send's place in the job-wide order (priority descending, key, the
/// chunk's place among the tensor's pushes, then queueing): which chunk goes first, not the order sums add in
/// (`crate::sum_order`).
pub(super) type SendOrder = (std::cmp::Reverse<i32>, u32, u32, u64);

/// What the frame being written carries: a chunk of a caller's buffer, or
/// nothing beyond its encoded bytes (control frames).
#[derive(Clone, Copy)]
pub(super) enum Carry {
    Chunk { ptr: *const u8, len: usize },
    Encoded,
}

impl Ord for SendItem {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // BinaryHeap pops the greatest: the greatest is the soonest.
        o.order().cmp(&self.order())
    }
}
impl PartialOrd for SendItem {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// What a re-sent chunk carries.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Again {
    /// A first send.
    No,
    /// Its push again, flagged `FLAG_RESENT`.
    Push,
    /// Only its header (zeros, `FLAG_RESENT`): its result had started to
    /// arrive, so the server has the round complete and answers with the
    /// result; the push itself may be overwritten by that result already.
    ResultOnly,
}

impl Again {
    /// The flags a send of it carries, from the op's.
    pub(super) fn flags(self, flags: u16) -> u16 {
        match self {
            Again::No => flags,
            Again::Push => flags | FLAG_RESENT,
            Again::ResultOnly => flags | FLAG_RESENT | crate::protocol::FLAG_ZEROS,
        }
    }
}

/// Where one chunk of an active round goes through this worker, fixed when
/// the round starts (`Active::route`). It answers every "where": which
/// bytes a push reads (`Active::push_src`), where the result lands
/// (`IoCore::on_header`), and how it reaches the caller once whole
/// (`IoCore::land`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Route {
    /// Pushed from the caller's buffer; the result lands there.
    Caller,
    /// Pushed from the caller's buffer; the result lands in the tensor's
    /// kept copy and is copied over once whole (failover on: the buffer
    /// holds this worker's push until then, see `failover::Kept`).
    Kept,
    /// The host's sum in shared memory, which this worker pushes for its
    /// host (by reference when its server maps the segment); the result
    /// lands in the segment, then is copied to the caller and published.
    HostOwner,
    /// Another worker of this host pushes it: its result is copied from
    /// the segment once that worker publishes it.
    HostPeer,
}

/// Where an incoming result goes: chunk `chunk` of tensor `key`, `len`
/// bytes at `dst` in the caller's buffer.
#[derive(Clone, Copy)]
pub(super) struct ResultDest {
    pub(super) key: u32,
    pub(super) chunk: usize,
    pub(super) dst: *mut u8,
    pub(super) len: usize,
}

// SAFETY: `dst` points into an active op's buffer, which stays valid until
// the op completes; results are written and ops completed only by the
// holder of the `IoCore` lock (the I/O thread, or a caller waiting on a
// one-chunk op: `IoCore::poll_for`).
unsafe impl Send for ResultDest {}
