//! One chunk's way through this worker: what is queued on a connection
//! (`SendItem`, in the job-wide `Order`), where its bytes come from
//! (`ChunkSrc`), and the active round it belongs to (`Active`).

use std::sync::Arc;
use std::time::Instant;

use super::host::HostRound;
use super::BufPtr;
use crate::client::op::Op;
use crate::protocol::{DType, Header, TensorSpec};

/// One chunk of a push_pull: a slice of the caller's buffer.
#[derive(PartialEq, Eq)]
pub(super) struct ChunkSend {
    pub(super) priority: i32,
    pub(super) seq: u64,
    pub(super) key: u32,
    pub(super) chunk: u32,
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
/// (earlier first use), then lower chunk index — never a `<=`-style comparator.
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
    pub(super) fn order(&self) -> Order {
        match self {
            SendItem::Chunk(c) => (std::cmp::Reverse(c.priority), c.key, c.chunk, c.seq),
            // Control frames: FIFO among themselves, before every push.
            SendItem::Control { seq, .. } => (std::cmp::Reverse(i32::MAX), 0, 0, *seq),
        }
    }
}
pub(super) type Order = (std::cmp::Reverse<i32>, u32, u32, u64);

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

pub(super) struct Active {
    pub(super) op: Arc<Op>,
    pub(super) spec: Arc<TensorSpec>,
    pub(super) ptr: BufPtr,
    pub(super) round: u32,
    pub(super) priority: i32,
    pub(super) flags: u16,
    pub(super) got: Vec<bool>,
    pub(super) remaining: usize,
    /// Set when the host's workers sum this tensor together first.
    pub(super) host: Option<HostRound>,
}

/// Where the chunks of a submission come from and go to.
pub(super) struct ChunkSrc {
    pub(super) ptr: *const u8,
    pub(super) len: usize,
}
