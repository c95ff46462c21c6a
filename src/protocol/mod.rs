//! Wire protocol: the fixed frame header, control-message payloads, and
//! blocking helpers for the (low-rate) control connections.

pub mod auth;
pub mod codec;
pub mod control;
pub mod frame;
pub mod optim;
pub mod reader;
pub mod seal;

pub use control::{
    Control, DeclEntry, ElasticReg, JobTraffic, Register, Rejoin, Role, ServerInfo, ServiceJoin, TensorSpec, Welcome,
    MAX_JOINED_SLOTS, NO_SERVER,
};
pub use frame::{
    crc32c, encode_frame, DType, Header, MsgType, FLAG_ASYNC, FLAG_AVERAGE, FLAG_INIT, FLAG_LEAVING, FLAG_NO_RESULT,
    FLAG_RESENT, FLAG_SEALED, FLAG_ZEROS, HEADER_LEN, MAGIC, PUSH_OWN_FLAGS, VERSION,
};
pub use optim::{OptConfig, OptKind};
pub use reader::{Frame, FrameReader, ReadError};

use std::io::{Read, Write};

/// Control payloads are small; this bounds what a peer can make us buffer.
/// (A Declared reply lists one u32 per chunk, so 64 MiB allows ~16M chunks.)
pub const MAX_CONTROL_PAYLOAD: u32 = 64 << 20;

/// Largest payload of a data-connection frame that is not tensor data
/// (stall notices, errors, optimizer configs).
pub const MAX_NOTICE_PAYLOAD: u32 = 64 << 10;

/// The header limit on a data connection: chunks are bounded by the
/// partition size, which may be smaller than a notice. Each frame type's
/// exact length is checked after the header.
pub fn data_payload_limit(partition_bytes: u32) -> u32 {
    partition_bytes.max(MAX_NOTICE_PAYLOAD)
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("bad magic 0x{0:04x} (not a gradhub peer?)")]
    BadMagic(u16),
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    UnsupportedVersion(u8),
    #[error("unknown message type {0}")]
    UnknownType(u8),
    #[error("unknown flag bits 0x{0:04x}")]
    UnknownFlags(u16),
    #[error("unknown dtype code {0}")]
    BadDtype(u8),
    #[error("reserved header byte is not zero")]
    ReservedNonZero,
    #[error("payload length {len} exceeds the limit of {max} bytes")]
    PayloadTooLarge { len: u32, max: u32 },
    #[error("frame truncated: need {need} bytes, got {got}")]
    Truncated { need: usize, got: usize },
    /// A checksum (`frame`) did not match: the frame changed on the way.
    #[error("checksum mismatch in {0}: the frame was corrupted on the way")]
    BadChecksum(String),
    /// A sealed frame's tag did not match (`seal`): changed on the way, or
    /// not sealed with this connection's key.
    #[error(
        "authentication tag mismatch in {0}: the frame was changed on the way or not sealed with this connection's key"
    )]
    BadTag(String),
    #[error("malformed payload: {0}")]
    BadPayload(String),
    #[error("unexpected message: {0}")]
    UnexpectedType(String),
    // The job's own namespace is not told to whoever sent the frame.
    #[error("namespace {got} is not this job's")]
    WrongNamespace { got: u32 },
}

impl ProtocolError {
    /// The frame changed between the two ends (a bad checksum or tag): not
    /// the peer's doing, so the link may be mended instead of failing.
    pub fn changed_on_the_way(&self) -> bool {
        matches!(self, ProtocolError::BadChecksum(_) | ProtocolError::BadTag(_))
    }
}

/// The largest first message a peer may send once it has authenticated
/// and before it has registered: a Register is a few hundred bytes, a
/// Rejoin lists the member's tensors (about 100 bytes each plus 4 per
/// chunk: a million chunks fit).
pub const MAX_REGISTER_PAYLOAD: u32 = 16 << 20;

/// Read one control message from a blocking stream (with the one frame
/// reader). A read timeout on the stream gives `ReadError::TimedOut`.
pub fn read_control<R: Read>(r: &mut R, namespace: u32) -> Result<Control, ReadError> {
    read_control_limited(r, namespace, MAX_CONTROL_PAYLOAD)
}

/// `read_control` with a smaller payload limit (before registration).
pub fn read_control_limited<R: Read>(r: &mut R, namespace: u32, max_payload: u32) -> Result<Control, ReadError> {
    let (h, payload) = read_message(r, Some(namespace), max_payload)?;
    Ok(Control::decode(&h, &payload)?)
}

/// Read one whole frame, header and payload, from a blocking stream; with
/// `namespace`, a frame of another namespace is an error (read no further).
pub fn read_message<R: Read>(
    r: &mut R,
    namespace: Option<u32>,
    max_payload: u32,
) -> Result<(Header, Vec<u8>), ReadError> {
    let mut rx = FrameReader::<()>::default();
    loop {
        match rx.read_from(&mut *r, max_payload, |()| &mut [], None)? {
            None => return Err(ReadError::TimedOut),
            Some(Frame::Header(h)) => match namespace {
                Some(ns) if h.namespace != ns => return Err(ProtocolError::WrongNamespace { got: h.namespace }.into()),
                _ => rx.receive_owned(h),
            },
            Some(Frame::Message(h, payload)) => return Ok((h, payload)),
            Some(Frame::Payload(..)) => return Err(ReadError::Internal("a control payload in caller memory".into())),
        }
    }
}

/// Write one control message to a blocking stream.
pub fn write_control<W: Write>(w: &mut W, msg: &Control, namespace: u32) -> std::io::Result<()> {
    w.write_all(&msg.encode(namespace))?;
    w.flush()
}

/// Payload of a Stall frame: which server thread reports, and the worker
/// ranks that have not pushed the chunk (key/chunk/round are in the header).
pub fn encode_stall(server: u32, thread: u32, waited_ms: u64, missing: &[u32]) -> Vec<u8> {
    let mut w = codec::Writer::new();
    w.u32(server).u32(thread).u64(waited_ms).u32(missing.len() as u32);
    for &m in missing {
        w.u32(m);
    }
    w.buf
}

pub struct StallReport {
    pub server: u32,
    pub thread: u32,
    pub waited_ms: u64,
    pub missing: Vec<u32>,
}

pub fn decode_stall(payload: &[u8]) -> Result<StallReport, ProtocolError> {
    let mut r = codec::Reader::new(payload);
    let server = r.u32("server")?;
    let thread = r.u32("thread")?;
    let waited_ms = r.u64("waited_ms")?;
    let n = r.count("missing", 4)?;
    let missing = (0..n).map(|_| r.u32("rank")).collect::<Result<_, _>>()?;
    r.finish("Stall")?;
    Ok(StallReport { server, thread, waited_ms, missing })
}

#[cfg(test)]
mod tests;
