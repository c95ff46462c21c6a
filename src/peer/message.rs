//! A point-to-point message on the wire: cut into `PeerData` frames of at
//! most `FRAME_BYTES` on the way out (so a sealed connection seals bounded
//! pieces and a reader's buffer stays bounded); on the way in each frame's
//! header is checked in sequence (`Sequence`) before its payload is read
//! anywhere. Every field a frame carries is checked against the
//! connection's sequence before it is trusted; a frame out of place is an
//! error that ends the connection, never a message delivered wrong.

use crate::protocol::{DType, Header, MsgType};

use super::matching::Tag;

/// The largest payload of one frame.
pub const FRAME_BYTES: usize = 4 << 20;
/// The most frames one message may have (64 GiB).
pub const MAX_FRAMES: u32 = 16 << 10;

/// The frames of message number `seq` on a connection: each header and
/// the part of `data` it carries (one empty frame for an empty message).
pub fn frames(namespace: u32, seq: u32, tag: Tag, data: &[u8]) -> impl Iterator<Item = (Header, &[u8])> {
    let count = data.len().div_ceil(FRAME_BYTES).max(1);
    (0..count).map(move |i| {
        let part = &data[(i * FRAME_BYTES).min(data.len())..((i + 1) * FRAME_BYTES).min(data.len())];
        let mut h = Header::new(MsgType::PeerData);
        h.namespace = namespace;
        h.round = seq;
        h.priority = tag;
        h.chunk = i as u32;
        h.key = count as u32;
        h.payload_len = part.len() as u32;
        (h, part)
    })
}

/// Whether a message of `bytes` can be sent (`MAX_FRAMES` frames).
pub fn fits(bytes: usize) -> bool {
    bytes.div_ceil(FRAME_BYTES) <= MAX_FRAMES as usize
}

/// Where a frame stands in its message.
#[derive(Debug, PartialEq, Eq)]
pub struct Step {
    pub tag: Tag,
    /// Its message's frame count.
    pub count: u32,
    pub first: bool,
    pub last: bool,
}

struct Partial {
    tag: Tag,
    count: u32,
    next: u32,
}

/// One connection's frames, checked in sequence: each header must be the
/// one that comes next (before its payload is read anywhere).
#[derive(Default)]
pub struct Sequence {
    seq: u32,
    partial: Option<Partial>,
}

impl Sequence {
    /// Check the next frame's header: where it stands, or why it cannot
    /// come now.
    pub fn check(&mut self, h: &Header) -> Result<Step, String> {
        if h.msg_type != MsgType::PeerData {
            return Err(format!("a {:?} frame among point-to-point messages", h.msg_type));
        }
        if h.flags != 0 || h.dtype != DType::None {
            return Err(format!("flags {:#x} and dtype {:?} on a point-to-point frame", h.flags, h.dtype));
        }
        if h.round != self.seq {
            return Err(format!("message number {} where {} comes next", h.round, self.seq));
        }
        let mut p = match self.partial.take() {
            None => {
                if h.chunk != 0 || h.key == 0 || h.key > MAX_FRAMES {
                    return Err(format!("frame {} of {} to start a message", h.chunk, h.key));
                }
                Partial { tag: h.priority, count: h.key, next: 0 }
            }
            Some(p) if h.chunk != p.next || h.key != p.count || h.priority != p.tag => {
                return Err(format!(
                    "frame {} of {} (tag {}) where frame {} of {} (tag {}) comes next",
                    h.chunk, h.key, h.priority, p.next, p.count, p.tag
                ))
            }
            Some(p) => p,
        };
        let (first, last) = (p.next == 0, p.next + 1 == p.count);
        let len = h.payload_len as usize;
        let ok = if last { len <= FRAME_BYTES && (p.count == 1 || len > 0) } else { len == FRAME_BYTES };
        if !ok {
            return Err(format!("frame {} of {} carries {len} bytes", p.next, p.count));
        }
        p.next += 1;
        let step = Step { tag: p.tag, count: p.count, first, last };
        if last {
            self.seq = self.seq.wrapping_add(1);
        } else {
            self.partial = Some(p);
        }
        Ok(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_of_every_size_are_cut_and_checked_in_order() {
        let mut seq = Sequence::default();
        for (n, len) in [0, 1, FRAME_BYTES - 1, FRAME_BYTES, FRAME_BYTES + 1, 3 * FRAME_BYTES].into_iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + n) as u8).collect();
            let fr: Vec<_> = frames(7, n as u32, -3, &data).collect();
            assert_eq!(fr.len(), len.div_ceil(FRAME_BYTES).max(1));
            let mut joined = Vec::new();
            for (i, (h, part)) in fr.iter().enumerate() {
                let step = seq.check(h).unwrap();
                assert_eq!(step, Step { tag: -3, count: fr.len() as u32, first: i == 0, last: i + 1 == fr.len() });
                joined.extend_from_slice(part);
            }
            assert_eq!(joined, data);
        }
        assert!(fits(FRAME_BYTES * MAX_FRAMES as usize) && !fits(FRAME_BYTES * MAX_FRAMES as usize + 1));
    }

    #[test]
    fn a_frame_out_of_place_is_an_error() {
        let data = vec![1u8; 2 * FRAME_BYTES + 5];
        let fr: Vec<Header> = frames(7, 0, 1, &data).map(|(h, _)| h).collect();
        type Change = fn(&mut Header);
        let cases: [(&str, Change); 7] = [
            ("number", |h| h.round = 1),
            ("frame index", |h| h.chunk = 1),
            ("count", |h| h.key = 0),
            ("too many", |h| h.key = MAX_FRAMES + 1),
            ("short", |h| h.payload_len -= 1),
            ("type", |h| h.msg_type = MsgType::Push),
            ("flags", |h| h.flags = 1),
        ];
        for (what, change) in cases {
            let mut h = fr[0];
            change(&mut h);
            assert!(Sequence::default().check(&h).is_err(), "{what}");
        }
        // Mid-message: another tag, a skipped frame, a new message.
        let cases: [Change; 3] = [|h| h.priority = 2, |h| h.chunk = 2, |h| h.chunk = 0];
        for change in cases {
            let mut seq = Sequence::default();
            seq.check(&fr[0]).unwrap();
            let mut h = fr[1];
            change(&mut h);
            assert!(seq.check(&h).is_err());
        }
        // The last frame may be short, never empty in a message of several.
        let mut seq = Sequence::default();
        seq.check(&fr[0]).unwrap();
        seq.check(&fr[1]).unwrap();
        let mut h = fr[2];
        h.payload_len = 0;
        assert!(seq.check(&h).is_err());
    }
}
