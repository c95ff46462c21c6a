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
//! Asynchronous chunks (`thread::delta`) are replicated the same way: each
//! worker's parameter change (`Replicate` with FLAG_ASYNC, the pusher's rank
//! first), held back until acked; the replica keeps the parameters and, by
//! pusher, the number of its next push, so a push that comes again after a
//! failover is answered, not applied twice.
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
use crate::protocol::{encode_frame, DType, Header, MsgType, OptConfig, FLAG_ASYNC, FLAG_INIT};
use crate::transport::bytes;

/// What a thread keeps of one chunk it replicates.
pub struct Replica {
    pub elems: usize,
    pub state: Option<Box<OptState>>,
    /// The last round applied.
    pub done: Option<u32>,
    /// An asynchronous chunk: by pusher rank, the number of its next push
    /// (empty for the others).
    pub next: Vec<(u32, u32)>,
}

/// The chunks a thread replicates, by (key, chunk).
#[derive(Default)]
pub struct Replicas {
    pub chunks: HashMap<(u32, u32), Replica>,
}

impl Replicas {
    /// A `Replicate` frame's payload (`data`, f32) for (`key`, `chunk`).
    pub fn apply(&mut self, hdr: &Header, data: &[u8], cfg: Option<&OptConfig>) -> Result<(), String> {
        if hdr.flags & FLAG_ASYNC != 0 {
            return self.apply_async(hdr, data);
        }
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

    /// A worker's push to an asynchronous chunk (see the module's doc):
    /// the rank, then its change (round 0: the init push, whose values are
    /// the parameters with FLAG_INIT, else only counted).
    fn apply_async(&mut self, hdr: &Header, data: &[u8]) -> Result<(), String> {
        let (Some(rank), Some(values)) = (data.get(..4), data.get(4..)) else {
            return Err("an asynchronous push without its rank".into());
        };
        let rank = u32::from_le_bytes([rank[0], rank[1], rank[2], rank[3]]);
        let values: Vec<f32> = values.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let r = self.get(hdr, values.len())?;
        let want = r.next.iter().find(|p| p.0 == rank).map_or(0, |p| p.1);
        if hdr.round != want {
            return Err(format!("worker {rank}'s push {}, but its next is {want}", hdr.round));
        }
        match (hdr.round, hdr.flags & FLAG_INIT != 0, r.state.as_mut()) {
            (0, true, _) => r.state = Some(Box::new(OptState::new(&values))),
            (0, false, _) => {}
            (_, _, Some(state)) => crate::kernels::add_f32(&mut state.param, &values),
            (round, _, None) => return Err(format!("worker {rank}'s change {round} before any parameters")),
        }
        match r.next.iter_mut().find(|p| p.0 == rank) {
            Some(p) => p.1 = hdr.round.wrapping_add(1),
            None => r.next.push((rank, hdr.round.wrapping_add(1))),
        }
        Ok(())
    }

    /// A `Snapshot` frame's payload: the whole state after round
    /// `hdr.round`, in `hdr.flags` vectors (parameters and moments); with
    /// FLAG_ASYNC, an asynchronous chunk's: its pushers' next pushes first.
    pub fn restore(&mut self, hdr: &Header, data: &[u8]) -> Result<(), String> {
        if hdr.flags & FLAG_ASYNC != 0 {
            return self.restore_async(hdr, data);
        }
        let vectors = (hdr.flags as usize).clamp(1, 3);
        let r = self.get(hdr, data.len().saturating_sub(8) / 4 / vectors)?;
        r.state = Some(Box::new(OptState::decode(data, r.elems)?));
        r.done = Some(hdr.round);
        Ok(())
    }

    fn restore_async(&mut self, hdr: &Header, data: &[u8]) -> Result<(), String> {
        let word = |i: usize| data.get(4 * i..4 * i + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let n = word(0).ok_or("an asynchronous snapshot without its pushers")? as usize;
        let next: Vec<(u32, u32)> = (0..n.min(data.len() / 8))
            .map(|i| word(1 + 2 * i).zip(word(2 + 2 * i)))
            .collect::<Option<_>>()
            .ok_or("an asynchronous snapshot cut short")?;
        let rest = data.get(4 + 8 * n..).ok_or("an asynchronous snapshot cut short")?;
        let r = self.get(hdr, rest.len().saturating_sub(8) / 4)?;
        r.state = Some(Box::new(OptState::decode(rest, r.elems)?));
        (r.done, r.next) = (Some(hdr.round), next);
        Ok(())
    }

    /// The replica of (key, chunk) in `hdr`; one of `elems` elements if it
    /// is new (see the module's comment).
    fn get(&mut self, hdr: &Header, elems: usize) -> Result<&mut Replica, String> {
        let new = Replica { elems, state: None, done: None, next: Vec::new() };
        let r = self.chunks.entry((hdr.key, hdr.chunk)).or_insert(new);
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
    encode_frame(&h, payload)
}

/// Round `at.2`'s averaged gradient (or, with FLAG_INIT, the initial parameters).
pub fn replicate_frame(ns: u32, at: (u32, u32, u32), flags: u16, data: &[f32]) -> Vec<u8> {
    frame(MsgType::Replicate, ns, at, flags & FLAG_INIT, bytes(data))
}

/// Worker `rank`'s push `at.2` to an asynchronous chunk: its change (with
/// `params`, the init push that brings the parameters).
pub fn async_frame(ns: u32, at: (u32, u32, u32), rank: u32, params: bool, data: &[f32]) -> Vec<u8> {
    let flags = FLAG_ASYNC | if params { FLAG_INIT } else { 0 };
    frame(MsgType::Replicate, ns, at, flags, &[&rank.to_le_bytes()[..], bytes(data)].concat())
}

/// An asynchronous chunk's whole state: its pushers' next pushes and its parameters.
pub fn async_snapshot_frame(ns: u32, at: (u32, u32, u32), next: &[(u32, u32)], params: &[f32]) -> Vec<u8> {
    let mut payload = (next.len() as u32).to_le_bytes().to_vec();
    for &(rank, n) in next {
        payload.extend_from_slice(&rank.to_le_bytes());
        payload.extend_from_slice(&n.to_le_bytes());
    }
    payload.extend_from_slice(&OptState::new(params).encode());
    frame(MsgType::Snapshot, ns, at, FLAG_ASYNC | 1, &payload)
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
    encode_frame(&h, &payload)
}

/// The first frame on a link: who (which slot) replicates here.
pub fn hello_frame(ns: u32, slot: u32) -> Vec<u8> {
    let mut h = Header::new(MsgType::ServerHello);
    (h.namespace, h.key) = (ns, slot);
    h.encode(&[]).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header and payload of a frame built here.
    fn split(frame: &[u8]) -> (Header, &[u8]) {
        let h = Header::decode(&frame[..crate::protocol::HEADER_LEN], u32::MAX).expect("a header");
        (h, &frame[crate::protocol::HEADER_LEN..])
    }

    #[test]
    fn an_asynchronous_replica_keeps_the_parameters_and_each_pushers_next_push() {
        let mut r = Replicas::default();
        let apply = |r: &mut Replicas, round, rank, params, v: f32| {
            let frame = async_frame(0, (7, 0, round), rank, params, &[v; 4]);
            let (h, p) = split(&frame);
            r.apply(&h, p, None)
        };
        // A change before the parameters, and a frame without its rank: refused.
        assert!(apply(&mut r, 1, 1, false, 1.0).unwrap_err().contains("push 1, but its next is 0"));
        let mut h = Header::new(MsgType::Replicate);
        (h.key, h.flags, h.dtype) = (7, FLAG_ASYNC, DType::F32);
        assert!(r.apply(&h, &[1, 2], None).unwrap_err().contains("without its rank"));
        apply(&mut r, 0, 1, false, 9.0).unwrap(); // worker 1's initial values: counted only
        assert!(apply(&mut r, 1, 1, false, 1.0).unwrap_err().contains("before any parameters"));
        apply(&mut r, 0, 0, true, 2.0).unwrap(); // worker 0's: the parameters
        apply(&mut r, 1, 1, false, 1.0).unwrap();
        apply(&mut r, 1, 0, false, 0.5).unwrap();
        assert!(apply(&mut r, 1, 0, false, 0.5).unwrap_err().contains("push 1, but its next is 2"), "twice");
        let rep = &r.chunks[&(7, 0)];
        assert_eq!(rep.state.as_ref().map(|s| s.param.clone()), Some(vec![3.5; 4]));
        let mut next = rep.next.clone();
        next.sort_unstable();
        assert_eq!(next, vec![(0, 2), (1, 2)]);
        // A new replica from a snapshot has the same.
        let snapshot = async_snapshot_frame(0, (7, 0, 0), &next, &[3.5; 4]);
        let (h, p) = split(&snapshot);
        let mut fresh = Replicas::default();
        fresh.restore(&h, p).unwrap();
        let rep = &fresh.chunks[&(7, 0)];
        assert_eq!((rep.state.as_ref().map(|s| s.param.clone()), rep.next.clone()), (Some(vec![3.5; 4]), next));
        // A snapshot cut short is refused.
        assert!(Replicas::default().restore(&h, &p[..6]).is_err());
    }
}
