//! The worker's table of names: declared tensors (their specs), ops parked
//! until a declaration completes, names in flight, barriers, and what
//! Horovod's join and process sets need to know of each name's uses.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crossbeam_channel::Sender;

use super::io::BufPtr;
use super::op::Op;
use super::ClientError;
use crate::protocol::{Control, DType, TensorSpec};

pub(super) enum Waiter {
    /// A blocking declare() call.
    Sync(Sender<Result<Vec<TensorSpec>, String>>),
    /// Declared on first push_pull; the ops for these names wait in `parked`.
    Async(Vec<String>),
}

pub(super) struct Parked {
    pub(super) op: Arc<Op>,
    pub(super) numel: u64,
    pub(super) dtype: DType,
    pub(super) ptr: BufPtr,
    pub(super) priority: i32,
    pub(super) flags: u16,
}

#[derive(Default)]
pub(super) struct Table {
    pub(super) specs: HashMap<String, Arc<TensorSpec>>,
    /// Names to release when their op completes (`release_after`).
    pub(super) transient: HashSet<String>,
    pub(super) parked: HashMap<String, Vec<Parked>>,
    pub(super) waiters: HashMap<u32, Waiter>,
    pub(super) in_flight: HashSet<String>,
    pub(super) barriers: HashMap<u32, Sender<Result<(), String>>>,
    /// A worker that left cleanly while this one goes on (`PeerLeft`).
    pub(super) left: Option<u32>,
    /// Every worker that did, and every server lost (for a scheduler that
    /// restarts: `Rejoin`).
    pub(super) gone: Vec<u32>,
    pub(super) lost_servers: Vec<u32>,
    /// Sharded tensors (`DeclEntry::sharded`, as this worker declared them,
    /// which the scheduler holds every worker to): their shard count, which
    /// orders their chunks' pushes (`io::Submission::shards`).
    pub(super) shards: HashMap<String, u32>,
    /// Tensors (keys) whose optimizer runs on the servers: its OptConfig payload.
    pub(super) server_opt: HashMap<u32, Vec<u8>>,
    /// Horovod's join: every name's uses so far (its round counter, the
    /// same on every worker) and its last call, announced to joined workers.
    pub(super) uses: HashMap<String, Use>,
    /// Other workers joined (`Joined`): announce operations to them.
    pub(super) peers_joined: bool,
    /// Unnamed tensors completed lately (their `uses` are gone): a joined
    /// worker must not push zeros for one that a peer announces late.
    pub(super) recent_transient: (std::collections::VecDeque<String>, HashSet<String>),
    /// While this worker is in `join()`: where the scheduler's join
    /// messages go.
    pub(super) join_events: Option<Sender<Control>>,
}

#[derive(Clone, Copy)]
pub(super) struct Use {
    pub(super) round: u32,
    pub(super) numel: u64,
    pub(super) dtype: DType,
    /// The round's frame flags.
    pub(super) flags: u16,
    /// Freed once the round completes (see `Client::push_pull_live`).
    pub(super) release_after: bool,
}

/// Join messages waiting for `join()` to take them.
pub(super) const JOIN_QUEUE: usize = 4096;
/// Unnamed tensors remembered after they completed (see `recent_transient`).
pub(super) const RECENT_TRANSIENT: usize = 4096;

/// Take tensor `name` out of the table to declare it again with another
/// shape; refused while a round of it is in flight.
pub(super) fn take_for_reshape(
    t: &mut Table,
    name: &str,
    numel: u64,
    dtype: DType,
) -> Result<Arc<TensorSpec>, ClientError> {
    let Some(s) = t.specs.get(name) else {
        return Err(ClientError::Usage(format!("tensor '{name}' is not declared")));
    };
    if t.in_flight.contains(name) {
        return Err(ClientError::Usage(format!(
            "tensor '{name}' has {} elements of {} and a round of it is in flight; it cannot change to {numel} \
             elements of {} before that round completes",
            s.numel,
            s.dtype.name(),
            dtype.name()
        )));
    }
    t.transient.remove(name);
    t.specs.remove(name).ok_or_else(|| ClientError::Usage(format!("tensor '{name}' is not declared")))
}

/// The announcement of a name's latest use to joined workers.
pub(super) fn join_op(name: &str, u: &Use) -> Control {
    Control::JoinOp {
        name: name.to_string(),
        numel: u.numel,
        dtype: u.dtype,
        flags: u.flags,
        round: u.round,
        release_after: u.release_after,
    }
}

pub(super) fn check_matches(s: &TensorSpec, numel: u64, dtype: DType) -> Result<(), ClientError> {
    if s.numel != numel || s.dtype != dtype {
        return Err(ClientError::Usage(format!(
            "tensor '{}' was declared with {} elements of {} but this call has {} elements of {}",
            s.name,
            s.numel,
            s.dtype.name(),
            numel,
            dtype.name()
        )));
    }
    Ok(())
}
