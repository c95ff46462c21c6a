//! A point-to-point message on the wire: cut into `PeerData` frames of at
//! most `FRAME_BYTES` on the way out (so a sealed connection seals bounded
//! pieces and a reader's buffer stays bounded), checked and put together
//! again on the way in. Every field a frame carries is checked against the
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

struct Partial {
    tag: Tag,
    count: u32,
    next: u32,
    data: Vec<u8>,
}

/// Puts one connection's frames together into messages, in order.
#[derive(Default)]
pub struct Assembler {
    seq: u32,
    partial: Option<Partial>,
}

impl Assembler {
    /// Take the next frame: the message it completes (tag and bytes), or
    /// None while one is incomplete; an error if the frame is not the one
    /// that must come next.
    pub fn take(&mut self, h: &Header, payload: Vec<u8>) -> Result<Option<(Tag, Vec<u8>)>, String> {
        if h.msg_type != MsgType::PeerData {
            return Err(format!("a {:?} frame among point-to-point messages", h.msg_type));
        }
        if h.flags != 0 || h.dtype != DType::None {
            return Err(format!("flags {:#x} and dtype {:?} on a point-to-point frame", h.flags, h.dtype));
        }
        if h.round != self.seq {
            return Err(format!("message number {} where {} comes next", h.round, self.seq));
        }
        if payload.len() != h.payload_len as usize {
            return Err(format!("{} payload bytes where the header says {}", payload.len(), h.payload_len));
        }
        let mut p = match self.partial.take() {
            None => {
                if h.chunk != 0 || h.key == 0 || h.key > MAX_FRAMES {
                    return Err(format!("frame {} of {} to start a message", h.chunk, h.key));
                }
                Partial { tag: h.priority, count: h.key, next: 0, data: Vec::new() }
            }
            Some(p) if h.chunk != p.next || h.key != p.count || h.priority != p.tag => {
                return Err(format!(
                    "frame {} of {} (tag {}) where frame {} of {} (tag {}) comes next",
                    h.chunk, h.key, h.priority, p.next, p.count, p.tag
                ))
            }
            Some(p) => p,
        };
        let last = p.next + 1 == p.count;
        let ok = if last {
            payload.len() <= FRAME_BYTES && (p.count == 1 || !payload.is_empty())
        } else {
            payload.len() == FRAME_BYTES
        };
        if !ok {
            return Err(format!("frame {} of {} carries {} bytes", p.next, p.count, payload.len()));
        }
        if p.data.is_empty() {
            p.data = payload;
        } else {
            p.data.extend_from_slice(&payload);
        }
        p.next += 1;
        if !last {
            self.partial = Some(p);
            return Ok(None);
        }
        self.seq = self.seq.wrapping_add(1);
        Ok(Some((p.tag, p.data)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn through(a: &mut Assembler, seq: u32, tag: Tag, data: &[u8]) -> Vec<Option<(Tag, Vec<u8>)>> {
        frames(7, seq, tag, data).map(|(h, p)| a.take(&h, p.to_vec()).unwrap()).collect()
    }

    #[test]
    fn messages_of_every_size_come_out_whole_and_in_order() {
        let mut a = Assembler::default();
        for (seq, len) in [0, 1, FRAME_BYTES - 1, FRAME_BYTES, FRAME_BYTES + 1, 3 * FRAME_BYTES].into_iter().enumerate()
        {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + seq) as u8).collect();
            let out = through(&mut a, seq as u32, -3, &data);
            assert_eq!(out.len(), len.div_ceil(FRAME_BYTES).max(1));
            assert!(out[..out.len() - 1].iter().all(|o| o.is_none()));
            assert_eq!(out.last().unwrap().as_ref(), Some(&(-3, data)));
        }
        assert!(fits(FRAME_BYTES * MAX_FRAMES as usize) && !fits(FRAME_BYTES * MAX_FRAMES as usize + 1));
    }

    #[test]
    fn a_frame_out_of_place_is_an_error() {
        let data = vec![1u8; 2 * FRAME_BYTES + 5];
        let fr: Vec<_> = frames(7, 0, 1, &data).map(|(h, p)| (h, p.to_vec())).collect();
        type Change = Box<dyn Fn(&mut Header, &mut Vec<u8>)>;
        let cases: Vec<(&str, Change)> = vec![
            ("number", Box::new(|h, _| h.round = 1)),
            ("frame index", Box::new(|h, _| h.chunk = 1)),
            ("count", Box::new(|h, _| h.key = 0)),
            ("too many", Box::new(|h, _| h.key = MAX_FRAMES + 1)),
            (
                "short",
                Box::new(|h, p| {
                    p.pop();
                    h.payload_len -= 1;
                }),
            ),
            ("length", Box::new(|h, _| h.payload_len -= 1)),
            ("type", Box::new(|h, _| h.msg_type = MsgType::Push)),
            ("flags", Box::new(|h, _| h.flags = 1)),
        ];
        for (what, change) in cases {
            let (mut h, mut p) = fr[0].clone();
            change(&mut h, &mut p);
            assert!(Assembler::default().take(&h, p).is_err(), "{what}");
        }
        // Mid-message: another tag, a skipped frame, a new message.
        for change in [|h: &mut Header| h.priority = 2, |h: &mut Header| h.chunk = 2, |h: &mut Header| h.chunk = 0] {
            let mut a = Assembler::default();
            a.take(&fr[0].0, fr[0].1.clone()).unwrap();
            let (mut h, p) = fr[1].clone();
            change(&mut h);
            assert!(a.take(&h, p).is_err());
        }
    }
}
