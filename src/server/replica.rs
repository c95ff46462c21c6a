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
//! slot); each owner thread has one link per replica slot it uses.

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
        let r = self.get(hdr)?;
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

    /// A `Snapshot` frame's payload: the whole state after round `hdr.round`.
    pub fn restore(&mut self, hdr: &Header, data: &[u8]) -> Result<(), String> {
        let r = self.get(hdr)?;
        r.state = Some(Box::new(OptState::decode(data, r.elems)?));
        r.done = Some(hdr.round);
        Ok(())
    }

    fn get(&mut self, hdr: &Header) -> Result<&mut Replica, String> {
        self.chunks
            .get_mut(&(hdr.key, hdr.chunk))
            .ok_or_else(|| format!("key {} chunk {} is not replicated by this server thread", hdr.key, hdr.chunk))
    }

    /// Every worker released these tensors.
    pub fn release(&mut self, keys: &[u32]) {
        self.chunks.retain(|(k, _), _| !keys.contains(k));
    }

    pub fn has_key(&self, key: u32) -> bool {
        self.chunks.keys().any(|&(k, _)| k == key)
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
    frame(MsgType::Snapshot, ns, at, 0, &state.encode())
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
