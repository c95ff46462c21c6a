//! The one frame reader: a header, then its payload, from any byte source —
//! the nonblocking data connections (`transport::Connection`) and the
//! blocking control connections (`read_control`) alike. The payload goes
//! where the caller says once it has seen the header: straight into caller
//! memory (a tensor chunk, an accumulator) or into a buffer of the reader's
//! own (control payloads, stall notices).

use std::io::{self, Read};

use super::frame::{payload_crc, Crc32c};
use super::seal::{Opener, TAG_LEN};
use super::{Header, ProtocolError, HEADER_LEN};

/// Owned payload buffers start at this size and double as data arrives.
const OWNED_STEP: usize = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("connection closed by the peer")]
    Closed,
    #[error("connection closed by the peer in the middle of a frame")]
    ClosedMidFrame,
    /// A blocking read's timeout passed with no complete frame.
    #[error("nothing received within the read timeout")]
    TimedOut,
    #[error("connection lost: {0}")]
    Io(#[from] io::Error),
    #[error("bad frame: {0}")]
    Protocol(#[from] ProtocolError),
    /// A caller broke the reader's contract (a bug, not the peer's fault).
    #[error("internal: {0}")]
    Internal(String),
}

/// Outcome of one nonblocking read or write attempt.
#[derive(Debug, PartialEq, Eq)]
enum Progress {
    /// Moved this many bytes (> 0, or 0 for an empty buffer).
    Moved(usize),
    /// Nothing to do now; wait for the next readiness event.
    WouldBlock,
    /// The peer closed the connection (reads only).
    Closed,
}

fn read_nb<R: Read>(mut r: R, buf: &mut [u8]) -> io::Result<Progress> {
    loop {
        return match r.read(buf) {
            Ok(0) if !buf.is_empty() => Ok(Progress::Closed),
            Ok(n) => Ok(Progress::Moved(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Progress::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Err(e),
        };
    }
}

/// Read into `buf[*got..]` until it is full (true) or the socket is
/// drained (false). A close with nothing of a frame read is `Closed`.
/// `edge`: a nonblocking source watched edge-triggered, where a short read
/// already shows the socket drained (data arriving later raises a new
/// edge), so the read that would only say `WouldBlock` is skipped: one
/// syscall fewer per small frame. Not after an event that reported the
/// peer's close: see `transport::Drain`. `crc` takes in every byte read,
/// while it is still in cache.
fn fill<R: Read>(
    r: &mut R,
    buf: &mut [u8],
    got: &mut usize,
    at_boundary: bool,
    edge: bool,
    mut crc: Option<&mut Crc32c>,
) -> Result<bool, ReadError> {
    while *got < buf.len() {
        match read_nb(&mut *r, &mut buf[*got..])? {
            Progress::Moved(n) => {
                if let Some(c) = crc.as_deref_mut() {
                    c.update(&buf[*got..*got + n]);
                }
                *got += n;
                if edge && *got < buf.len() {
                    return Ok(false);
                }
            }
            Progress::WouldBlock => return Ok(false),
            Progress::Closed if at_boundary && *got == 0 => return Err(ReadError::Closed),
            Progress::Closed => return Err(ReadError::ClosedMidFrame),
        }
    }
    Ok(true)
}

/// A complete piece of an incoming frame.
#[derive(Debug)]
pub enum Frame<T> {
    /// A header. If it announces a payload, the caller calls `receive_into`
    /// or `receive_owned` before reading on.
    Header(Header),
    /// A payload received whole into the caller's memory for `T`.
    Payload(Header, T),
    /// A payload received whole into a buffer of the reader's own.
    Message(Header, Vec<u8>),
}

enum ReadState<T> {
    Header {
        got: usize,
    },
    /// A sealed frame without a payload: its tag, checked before the
    /// header is returned.
    HeaderTag {
        hdr: Header,
        tag: TagIn,
    },
    /// A header with a payload was returned; the caller has not said where
    /// the payload goes yet (reading on would take it for the next header).
    Unclaimed {
        hdr: Header,
    },
    Into {
        hdr: Header,
        target: T,
        got: usize,
        crc: Crc32c,
        tag: TagIn,
    },
    Owned {
        hdr: Header,
        buf: Vec<u8>,
        got: usize,
        crc: Crc32c,
        tag: TagIn,
    },
}

/// The tag after a sealed frame's payload, as it arrives.
#[derive(Default)]
struct TagIn {
    got: usize,
    bytes: [u8; TAG_LEN],
}

/// Read state of one connection or stream; `T` names a caller-owned
/// payload destination.
pub struct FrameReader<T> {
    head: [u8; HEADER_LEN],
    state: ReadState<T>,
    /// The checksum the last header announced for its payload.
    want_crc: u32,
}

impl<T: Copy> Default for FrameReader<T> {
    fn default() -> Self {
        FrameReader { head: [0; HEADER_LEN], state: ReadState::Header { got: 0 }, want_crc: 0 }
    }
}

impl<T: Copy> FrameReader<T> {
    /// The payload of `hdr` (the header just read) goes to the caller's
    /// memory for `target`. It is checked against its checksum (or its tag)
    /// once whole: a mismatch is an error, and the caller must not use what
    /// landed.
    pub fn receive_into(&mut self, hdr: Header, target: T) {
        self.state = ReadState::Into { hdr, target, got: 0, crc: Crc32c::default(), tag: TagIn::default() };
    }

    /// The payload of `hdr` (the header just read) goes to a buffer of the
    /// reader's own (control payloads, bounded by the header's length limit).
    pub fn receive_owned(&mut self, hdr: Header) {
        self.state = ReadState::Owned { hdr, buf: Vec::new(), got: 0, crc: Crc32c::default(), tag: TagIn::default() };
    }

    /// Part of a frame has arrived and the rest has not.
    pub fn in_frame(&self) -> bool {
        !matches!(self.state, ReadState::Header { got: 0 })
    }

    /// The destination of the payload being received, if any.
    pub fn target(&self) -> Option<T> {
        match self.state {
            ReadState::Into { target, .. } => Some(target),
            _ => None,
        }
    }

    /// The last header's bytes as they arrived.
    pub fn header_bytes(&self) -> &[u8; HEADER_LEN] {
        &self.head
    }

    /// Forget any partial frame (the connection is closing, perhaps over a
    /// payload that failed its checksum); returns the destination being
    /// filled, if any.
    pub fn reset(&mut self) -> Option<T> {
        let old = std::mem::replace(&mut self.state, ReadState::Header { got: 0 });
        match old {
            ReadState::Into { target, .. } => Some(target),
            _ => None,
        }
    }
    /// Read until one frame event is complete (`Ok(Some)`) or the socket has
    /// nothing more for now (`Ok(None)`). `dst` gives the caller memory of a
    /// `receive_into` target, exactly the payload's length; it is asked for
    /// only while that payload is being received. `open`: the connection's
    /// receiving key, when its frames are sealed (`protocol::seal`).
    pub fn read_from<'d, R: Read>(
        &mut self,
        r: R,
        max_payload: u32,
        dst: impl FnOnce(T) -> &'d mut [u8],
        open: Option<&mut Opener>,
    ) -> Result<Option<Frame<T>>, ReadError> {
        self.read(r, max_payload, dst, false, open)
    }

    /// `read_from` for a nonblocking socket watched edge-triggered: a short
    /// read ends the attempt (`Ok(None)`) as `WouldBlock` would.
    pub fn read_edge<'d, R: Read>(
        &mut self,
        r: R,
        max_payload: u32,
        dst: impl FnOnce(T) -> &'d mut [u8],
        open: Option<&mut Opener>,
    ) -> Result<Option<Frame<T>>, ReadError> {
        self.read(r, max_payload, dst, true, open)
    }

    fn read<'d, R: Read>(
        &mut self,
        mut r: R,
        max_payload: u32,
        dst: impl FnOnce(T) -> &'d mut [u8],
        edge: bool,
        mut open: Option<&mut Opener>,
    ) -> Result<Option<Frame<T>>, ReadError> {
        let sealed = open.is_some();
        let mut dst = Some(dst);
        loop {
            // Each arm returns whether its part is whole, checked (before
            // leaving the state, so that on a mismatch `reset` still
            // returns the destination the bad bytes landed in).
            let done = match &mut self.state {
                ReadState::Header { got } => {
                    let at_boundary = *got == 0;
                    fill(&mut r, &mut self.head, got, at_boundary, edge, None)?
                }
                ReadState::HeaderTag { hdr, tag } => {
                    let done = fill(&mut r, &mut tag.bytes, &mut tag.got, false, edge, None)?;
                    if done {
                        if let Some(o) = open.as_deref_mut() {
                            o.open(&self.head, &mut [], &tag.bytes).map_err(|_| changed(hdr))?;
                        }
                    }
                    done
                }
                ReadState::Into { hdr, target, got, crc, tag } => {
                    let len = hdr.payload_len as usize;
                    let take = dst.take().ok_or_else(|| ReadError::Internal("a payload asked for twice".into()))?;
                    let whole: &mut [u8] = if len == 0 { &mut [] } else { take(*target) };
                    if whole.len() != len {
                        return Err(ReadError::Internal(format!(
                            "a {}-byte destination for a {len}-byte payload",
                            whole.len()
                        )));
                    }
                    let done = fill(&mut r, whole, got, false, edge, (!sealed).then_some(&mut *crc))?;
                    let check = Check { head: &self.head, hdr, crc, want_crc: self.want_crc };
                    done && check.payload(&mut r, edge, open.as_deref_mut(), whole, tag)?
                }
                ReadState::Unclaimed { hdr } => {
                    return Err(ReadError::Internal(format!(
                        "the {}-byte payload of a {:?} frame was neither received nor refused",
                        hdr.payload_len, hdr.msg_type
                    )))
                }
                ReadState::Owned { hdr, buf, got, crc, tag } => {
                    let len = hdr.payload_len as usize;
                    let done = loop {
                        // Grow with the data actually received, not with what the
                        // header claims, so a lying peer cannot make us allocate.
                        if *got == buf.len() && buf.len() < len {
                            buf.resize(len.min((buf.len() * 2).max(OWNED_STEP)), 0);
                        }
                        if !fill(&mut r, buf, got, false, edge, (!sealed).then_some(&mut *crc))? {
                            break false;
                        }
                        if *got == len {
                            break true;
                        }
                    };
                    let check = Check { head: &self.head, hdr, crc, want_crc: self.want_crc };
                    done && check.payload(&mut r, edge, open.as_deref_mut(), buf, tag)?
                }
            };
            if !done {
                return Ok(None);
            }
            let frame = match std::mem::replace(&mut self.state, ReadState::Header { got: 0 }) {
                ReadState::Header { .. } => {
                    let hdr = Header::decode(&self.head, max_payload)?;
                    self.want_crc = payload_crc(&self.head);
                    if hdr.payload_len > 0 {
                        self.state = ReadState::Unclaimed { hdr };
                    } else if sealed {
                        self.state = ReadState::HeaderTag { hdr, tag: TagIn::default() };
                        continue;
                    }
                    Frame::Header(hdr)
                }
                ReadState::HeaderTag { hdr, .. } => Frame::Header(hdr),
                ReadState::Into { hdr, target, .. } => Frame::Payload(hdr, target),
                ReadState::Owned { hdr, buf, .. } => Frame::Message(hdr, buf),
                ReadState::Unclaimed { .. } => unreachable!("returned above"),
            };
            return Ok(Some(frame));
        }
    }
}

/// What a frame that failed its tag is: changed on the way, or not sealed
/// with this connection's key.
fn changed(hdr: &Header) -> ReadError {
    ProtocolError::BadTag(format!(
        "a {:?} frame (key {}, chunk {}, round {})",
        hdr.msg_type, hdr.key, hdr.chunk, hdr.round
    ))
    .into()
}

/// What a whole payload is checked against.
struct Check<'a> {
    head: &'a [u8; HEADER_LEN],
    hdr: &'a Header,
    crc: &'a Crc32c,
    want_crc: u32,
}

impl Check<'_> {
    /// The payload `data` is in: read its tag if it is sealed, then open it
    /// (`open`) or check its checksum. False: the tag is not whole yet.
    fn payload<R: Read>(
        &self,
        r: &mut R,
        edge: bool,
        open: Option<&mut Opener>,
        data: &mut [u8],
        tag: &mut TagIn,
    ) -> Result<bool, ReadError> {
        match open {
            Some(o) => {
                if !fill(r, &mut tag.bytes, &mut tag.got, false, edge, None)? {
                    return Ok(false);
                }
                o.open(self.head, data, &tag.bytes).map_err(|_| changed(self.hdr))?;
            }
            None => check_crc(self.hdr, self.crc, self.want_crc)?,
        }
        Ok(true)
    }
}

fn check_crc(hdr: &Header, crc: &Crc32c, want: u32) -> Result<(), ReadError> {
    if hdr.payload_len == 0 || crc.value() == want {
        return Ok(());
    }
    let what = format!(
        "the payload of a {:?} frame (key {}, chunk {}, round {})",
        hdr.msg_type, hdr.key, hdr.chunk, hdr.round
    );
    Err(ProtocolError::BadChecksum(what).into())
}
