//! Replicas of server-side optimizer state, so that losing a server loses
//! no parameters and no optimizer state.
//!
//! Every chunk has a replica slot on another server (`TensorSpec::replicas`,
//! placed by `placement::Placer`). For a chunk with a server-side optimizer,
//! the owning thread sends its replica each round's averaged gradient (or
//! the initial parameters: `Replicate`), and the replica runs the same update
//! on its copy of the state. The owner holds the round's results back until
//! the replica acks (`Received`), so the replica has every round any worker
//! may have received. When the owner is lost, the chunk moves to its replica
//! (`Placer::replace`), which goes on from that state: a push of its last
//! round is answered with its result (a replay), a restore of that round is
//! no news. An owner whose replica changed (lost, or promoted to owner)
//! sends the new one its whole state first (`Snapshot`).
//!
//! The link between the two is an authenticated connection the owner's
//! server opens to the replica's thread (`ServerHello` names the owner's
//! slot); each owner thread has one link per replica slot it uses. After a
//! failover, the owner of a chunk with a new replica sends its snapshot while
//! installing the takeover, which the replica's server may not have done
//! yet: so a replica takes what its link sends for chunks it has not been
//! told of, sized by the frame, and the install checks the size.

use std::collections::HashMap;

use super::optimizer::OptState;
use crate::protocol::{DType, Header, MsgType, OptConfig, FLAG_INIT};
use crate::transport::bytes;

/// What a thread keeps of one chunk it replicates.
pub struct Replica {
    pub elems: usize,
    pub state: Option<Box<OptState>>,
    /// The last round applied.
    pub done: Option<u32>,
}

/// The chunks a thread replicates, by (key, chunk).
#[derive(Default)]
pub struct Replicas {
    pub chunks: HashMap<(u32, u32), Replica>,
}

impl Replicas {
    /// A `Replicate` frame's payload (`data`, f32) for (`key`, `chunk`).
    pub fn apply(&mut self, hdr: &Header, data: &[u8], cfg: Option<&OptConfig>) -> Result<(), String> {
        let r = self.get(hdr, data.len() / 4)?;
        if hdr.dtype != DType::F32 || data.len() != 4 * r.elems {
            return Err(format!("{} bytes of {} for a chunk of {} f32", data.len(), hdr.dtype.name(), r.elems));
        }
        let values: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        if hdr.flags & FLAG_INIT != 0 {
            r.state = Some(Box::new(OptState::new(&values)));
        } else {
            let Some(state) = r.state.as_mut() else {
                return Err(format!("a gradient of round {} before any parameters", hdr.round));
            };
            if r.done.is_some_and(|d| hdr.round != d.wrapping_add(1)) {
                return Err(format!("round {} after round {:?}", hdr.round, r.done));
            }
            if let Some(cfg) = cfg {
                state.update(cfg, &values);
            }
        }
        r.done = Some(hdr.round);
        Ok(())
    }

    /// A `Snapshot` frame's payload: the whole state after round
    /// `hdr.round`, in `hdr.flags` vectors (parameters and moments).
    pub fn restore(&mut self, hdr: &Header, data: &[u8]) -> Result<(), String> {
        let vectors = (hdr.flags as usize).clamp(1, 3);
        let r = self.get(hdr, data.len().saturating_sub(8) / 4 / vectors)?;
        r.state = Some(Box::new(OptState::decode(data, r.elems)?));
        r.done = Some(hdr.round);
        Ok(())
    }

    /// The replica of (key, chunk) in `hdr`; one of `elems` elements if it
    /// is new (see the module's comment).
    fn get(&mut self, hdr: &Header, elems: usize) -> Result<&mut Replica, String> {
        let r = self.chunks.entry((hdr.key, hdr.chunk)).or_insert(Replica { elems, state: None, done: None });
        if r.elems != elems {
            return Err(format!("key {} chunk {}: {elems} elements, but it has {}", hdr.key, hdr.chunk, r.elems));
        }
        Ok(r)
    }

    /// Every worker released these tensors.
    pub fn release(&mut self, keys: &[u32]) {
        self.chunks.retain(|(k, _), _| !keys.contains(k));
    }
}

/// A frame of `msg_type` for (`key`, `chunk`, `round`) with `payload`.
fn frame(msg_type: MsgType, ns: u32, at: (u32, u32, u32), flags: u16, payload: &[u8]) -> Vec<u8> {
    let mut h = Header::new(msg_type);
    (h.namespace, h.key, h.chunk, h.round, h.flags) = (ns, at.0, at.1, at.2, flags);
    h.dtype = DType::F32;
    h.payload_len = payload.len() as u32;
    [&h.encode()[..], payload].concat()
}

/// Round `at.2`'s averaged gradient (or, with FLAG_INIT, the initial parameters).
pub fn replicate_frame(ns: u32, at: (u32, u32, u32), flags: u16, data: &[f32]) -> Vec<u8> {
    frame(MsgType::Replicate, ns, at, flags & FLAG_INIT, bytes(data))
}

/// The whole state after round `at.2`.
pub fn snapshot_frame(ns: u32, at: (u32, u32, u32), state: &OptState) -> Vec<u8> {
    frame(MsgType::Snapshot, ns, at, state.vectors(), &state.encode())
}

/// The optimizer of `key`, for a replica that may not have it yet.
pub fn config_frame(ns: u32, key: u32, cfg: &OptConfig) -> Vec<u8> {
    let mut h = Header::new(MsgType::OptConfig);
    (h.namespace, h.key) = (ns, key);
    let payload = cfg.encode();
    h.payload_len = payload.len() as u32;
    [&h.encode()[..], &payload].concat()
}

/// The first frame on a link: who (which slot) replicates here.
pub fn hello_frame(ns: u32, slot: u32) -> Vec<u8> {
    let mut h = Header::new(MsgType::ServerHello);
    (h.namespace, h.key) = (ns, slot);
    h.encode().to_vec()
}
