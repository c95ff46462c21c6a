//! The fixed 40-byte frame header every gradhub message starts with.
//!
//! Layout (little-endian):
//! ```text
//!  0  magic u16 = 0x4847 ("GH")   2  version u8    3  type u8
//!  4  flags u16                   6  dtype u8      7  reserved u8 (0)
//!  8  namespace u32              12  key u32      16  chunk u32
//! 20  round u32                  24  priority i32 28  payload_len u32
//! 32  payload_crc u32            36  header_crc u32
//! ```
//! Both checksums are CRC-32C (Castagnoli): `payload_crc` of the payload,
//! `header_crc` of bytes 0..36. TCP's 16-bit checksum misses corruption in
//! a middlebox, a NIC or memory on the way; a flipped bit would otherwise
//! become a wrong gradient in every worker. The header's own checksum is
//! checked before any field is trusted (a corrupt length would desynchronize
//! the stream), the payload's before the payload is used.
//!
//! Decoding validates everything that can be checked without job state;
//! the receiver then checks key/chunk/round/length against what was declared.

use super::ProtocolError;

pub const MAGIC: u16 = 0x4847;
pub const VERSION: u8 = 22;
pub const HEADER_LEN: usize = 40;
/// Bytes of the header covered by `header_crc`.
const CHECKED_LEN: usize = 36;

/// CRC-32C of `data` (hardware-accelerated: crc-fast picks the widest
/// carry-less multiply the CPU has, about 4x the crc32 instruction here).
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// A CRC-32C computed piece by piece, as a payload arrives.
#[derive(Clone)]
pub struct Crc32c(crc_fast::Digest);

impl Default for Crc32c {
    fn default() -> Self {
        Crc32c(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }
}

impl Crc32c {
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }
    pub fn value(&self) -> u32 {
        self.0.finalize() as u32
    }
}

/// The payload checksum a header announces (see the layout above); the
/// header itself must have been decoded first.
pub fn payload_crc(b: &[u8; HEADER_LEN]) -> u32 {
    u32::from_le_bytes([b[32], b[33], b[34], b[35]])
}

/// One whole frame: the header (checksums filled in) and its payload.
pub fn encode_frame(h: &Header, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&h.encode(payload));
    out.extend_from_slice(payload);
    out
}

/// Flag bit: divide the sum by the number of workers before returning it.
pub const FLAG_AVERAGE: u16 = 1;
/// Flag bit: this round carries initial parameter values for a server-side
/// optimizer; the server keeps worker 0's and returns them.
pub const FLAG_INIT: u16 = 2;
/// Flag bit, on a Push only, with no payload: this chunk is all zeros
/// (a worker's part of an allgather or a broadcast that is not its own):
/// counted as a push, adding nothing, and not sent over the wire.
pub const FLAG_ZEROS: u16 = 4;
/// Flag bit: a push of an asynchronous tensor (`crate::training`): its
/// payload is the worker's parameter change (with FLAG_INIT, its
/// parameters), applied on arrival and answered with the parameters.
pub const FLAG_ASYNC: u16 = 8;
/// Flag bit, after a broken link was mended (`client::io::mend`): on a
/// DataHello, the new connection replaces the worker's old one; on a push,
/// it is sent again, so a push already counted is only acknowledged and a
/// round already complete is answered with its result (never summed twice).
pub const FLAG_RESENT: u16 = 16;
/// Flag bit, on an Error from a server: it is leaving the job (written off,
/// the job failed, its scheduler lost), so a worker whose job fails over
/// waits for the scheduler's word instead of failing on this one
/// (`client::io::receive`).
pub const FLAG_LEAVING: u16 = 32;
/// Flag bit, on AuthHello and AuthChallenge: the sender encrypts its
/// connections (`protocol::seal`); both ends must agree (`protocol::auth`).
pub const FLAG_SEALED: u16 = 64;
/// Flag bit: on a Push, the pusher does not need this chunk's result (a
/// reduce-scatter's chunks outside its shard, a joined worker's or a process
/// set's non-member's zeros); on a Result, the answer to such a push: no
/// payload, only the word that the round is complete.
pub const FLAG_NO_RESULT: u16 = 128;
/// The flags of one push alone, not of the round it is part of.
pub const PUSH_OWN_FLAGS: u16 = FLAG_ZEROS | FLAG_RESENT | FLAG_NO_RESULT;
const KNOWN_FLAGS: u16 =
    FLAG_AVERAGE | FLAG_INIT | FLAG_ZEROS | FLAG_ASYNC | FLAG_RESENT | FLAG_LEAVING | FLAG_SEALED | FLAG_NO_RESULT;

macro_rules! msg_types {
    ($($name:ident = $val:expr, $doc:literal;)*) => {
        /// Every message type on the wire. Values are stable across versions.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum MsgType { $(#[doc = $doc] $name = $val,)* }
        impl MsgType {
            pub fn from_u8(v: u8) -> Option<MsgType> {
                match v { $($val => Some(MsgType::$name),)* _ => None }
            }
        }
    };
}

msg_types! {
    DataHello = 1, "worker -> server thread: first frame on a data connection (key = worker rank)";
    Push = 2, "worker -> server thread: one chunk of a tensor for this round";
    Result = 3, "server thread -> worker: the reduced chunk (fused push-pull, no pull request)";
    Stall = 4, "server thread -> worker: a round waited too long; payload names missing ranks";
    Error = 5, "either direction: a fatal problem, UTF-8 text; the sender closes the connection";
    OptConfig = 6, "worker -> server thread: run this optimizer on the key's chunks (payload: OptConfig)";
    Received = 7, "server thread -> worker: a push arrived whole (header only); returns the worker's credit for it";
    PushRef = 8, "worker -> server thread on its host: a Push whose data is in the host's shared segment (no payload)";
    ResultRef = 9, "server thread -> worker on its host: a Result written into the host's shared segment (no payload)";
    Restore = 10, "worker -> server thread taking over a lost server's chunk: the last result of it this worker holds (round in the header)";
    AuthHello = 11, "connector -> listener (scheduler, server thread): first frame of every connection; payload: a fresh nonce, then the job name if any (protocol::auth)";
    AuthChallenge = 12, "listener -> connector: the listener's nonce and its proof of the job's token";
    AuthProof = 13, "connector -> listener: the connector's proof of the job's token";
    ServerHello = 14, "server thread -> the server thread replicating its chunks: first frame after the handshake (key = the sender's slot)";
    Replicate = 15, "server thread -> replica: a round's averaged gradient of a chunk with a server-side optimizer (FLAG_INIT: its initial parameters); acked with Received";
    Snapshot = 35, "server thread -> a new replica: a chunk's whole optimizer state after round `round` (payload: step u64, parameters, moments); acked with Received";
    Register = 16, "member -> scheduler: join the job";
    Welcome = 17, "scheduler -> member: rank and cluster map";
    Declare = 18, "worker -> scheduler: batch of tensor declarations";
    Declared = 19, "scheduler -> worker: tensor specs (key, chunking, placement)";
    DeclareError = 20, "scheduler -> worker: declarations disagree across workers";
    Heartbeat = 21, "member <-> scheduler: liveness";
    PeerLost = 22, "scheduler -> members: a member disconnected or stopped heartbeating";
    Goodbye = 23, "worker -> scheduler: clean exit";
    Shutdown = 24, "scheduler -> servers: every worker finished, exit";
    Barrier = 25, "worker -> scheduler: enter a barrier";
    BarrierDone = 26, "scheduler -> worker: everyone entered the barrier";
    ServerDeclare = 27, "scheduler -> server: install tensor specs before workers use them";
    ServerDeclareAck = 28, "server -> scheduler: specs installed";
    DeclareStall = 29, "scheduler -> worker: a tensor you declared waits for other workers to declare it";
    PeerLeft = 30, "scheduler -> members: a worker left cleanly while others go on";
    Release = 31, "worker -> scheduler: this worker is done with these tensors (keys)";
    ServerRelease = 32, "scheduler -> server: every worker released these tensors (keys): free them";
    ServerTakeOver = 33, "scheduler -> server: a server was lost; install these specs, whose chunks on this server are taken over";
    Failover = 34, "scheduler -> worker: a server was lost and its chunks moved (new specs); re-send what it had not returned";
    ServiceJoin = 36, "server process -> shared service (as the service itself): offer this server to every job the service starts";
    ServiceStart = 37, "shared service -> its server processes: start a server for this job (name, namespace)";
    ServiceStats = 38, "server process -> shared service: bytes and rounds summed per job so far";
    StatusRequest = 39, "operator -> shared service (as the service itself): report the jobs";
    StatusReply = 40, "shared service -> operator: the report, JSON text";
    Join = 41, "worker -> scheduler: this worker has no more data (Horovod's join): it pushes zeros for the others' operations until every worker joined";
    Joined = 42, "scheduler -> workers: a worker joined; announce your operations in flight and to come (JoinOp)";
    JoinOp = 43, "worker -> scheduler -> joined workers: an operation (name, size, dtype, flags, round, freed after it) a joined worker must push zeros for";
    JoinDone = 44, "scheduler -> workers: every worker joined (payload: the last one); all go on";
    // 45 was SetOp (a process set's operation announced to the workers outside it), retired in version 22: a set's tensors are its members' alone.
    ServerJoined = 46, "scheduler -> members: a server joined the running job (its address and ports); workers connect to it";
    ServerMove = 47, "scheduler -> servers: chunks move to a server that joined (new specs); give yours up unless they hold server-side optimizer state";
    ServerMoveAck = 48, "server -> scheduler: chunks given up; payload: the (key, chunk) pairs kept";
    HostsUpdated = 49, "shared service -> an elastic job's workers: workers wait to join; the job re-forms at its next commit";
    Rejoin = 50, "member -> a restarted scheduler: its registration, Welcome and what it knows (tensors, keys, who left); answered with Welcome";
    Unreachable = 51, "worker -> scheduler: its link to this live server could not be mended within the peer timeout; with failover the server is written off and its chunks move";
    Ack = 52, "member <-> scheduler: a heartbeat that also says how many messages (heartbeats aside) its sender has received in this session: the other side stops keeping those for a resume";
    Resumed = 53, "scheduler -> member whose connection broke and that dialled again (Rejoin) while the scheduler lived: how many of its messages arrived; each side sends again what the other missed";
    PeerHello = 54, "worker -> worker (point-to-point, `peer`): first frame after the handshake (key = the sender's rank in the group; payload: the group's name)";
    PeerData = 55, "worker -> worker: one frame of a point-to-point message (priority = tag, round = message number on the connection, chunk = frame index, key = the message's frame count)";
}

/// Element type of a tensor payload. `None` is used by control messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    None = 0,
    F32 = 1,
    F16 = 2,
    BF16 = 3,
    /// Summed exactly in their own type (integers wrap, as torch's do).
    F64 = 4,
    I32 = 5,
    I64 = 6,
}

impl DType {
    pub fn from_u8(v: u8) -> Option<DType> {
        match v {
            0 => Some(DType::None),
            1 => Some(DType::F32),
            2 => Some(DType::F16),
            3 => Some(DType::BF16),
            4 => Some(DType::F64),
            5 => Some(DType::I32),
            6 => Some(DType::I64),
            _ => None,
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::None => 1,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F64 | DType::I64 => 8,
        }
    }
    /// Summed in place in its own type; f16/bf16 are summed in f32 and narrowed once.
    pub fn sums_in_place(self) -> bool {
        !matches!(self, DType::F16 | DType::BF16 | DType::None)
    }
    pub fn is_integer(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::None => "none",
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }
    pub fn from_name(s: &str) -> Option<DType> {
        match s {
            "float32" | "f32" => Some(DType::F32),
            "float16" | "f16" | "half" => Some(DType::F16),
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float64" | "f64" => Some(DType::F64),
            "int32" | "i32" => Some(DType::I32),
            "int64" | "i64" => Some(DType::I64),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub msg_type: MsgType,
    pub flags: u16,
    pub dtype: DType,
    pub namespace: u32,
    pub key: u32,
    pub chunk: u32,
    pub round: u32,
    pub priority: i32,
    pub payload_len: u32,
}

impl Header {
    pub fn new(msg_type: MsgType) -> Header {
        Header {
            msg_type,
            flags: 0,
            dtype: DType::None,
            namespace: 0,
            key: 0,
            chunk: 0,
            round: 0,
            priority: 0,
            payload_len: 0,
        }
    }

    /// The header of a frame carrying `payload` (whose length
    /// `payload_len` must already say), with both checksums. (Tests of
    /// the header alone pass no payload whatever its length says.)
    pub fn encode(&self, payload: &[u8]) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = VERSION;
        b[3] = self.msg_type as u8;
        b[4..6].copy_from_slice(&self.flags.to_le_bytes());
        b[6] = self.dtype as u8;
        b[7] = 0;
        b[8..12].copy_from_slice(&self.namespace.to_le_bytes());
        b[12..16].copy_from_slice(&self.key.to_le_bytes());
        b[16..20].copy_from_slice(&self.chunk.to_le_bytes());
        b[20..24].copy_from_slice(&self.round.to_le_bytes());
        b[24..28].copy_from_slice(&self.priority.to_le_bytes());
        b[28..32].copy_from_slice(&self.payload_len.to_le_bytes());
        b[32..36].copy_from_slice(&crc32c(payload).to_le_bytes());
        let check = crc32c(&b[..CHECKED_LEN]);
        b[36..40].copy_from_slice(&check.to_le_bytes());
        b
    }

    /// Decode and validate a header. `max_payload` bounds the payload length
    /// so that a corrupt length can never make the receiver allocate or wait
    /// for gigabytes.
    pub fn decode(b: &[u8], max_payload: u32) -> Result<Header, ProtocolError> {
        if b.len() < HEADER_LEN {
            return Err(ProtocolError::Truncated { need: HEADER_LEN, got: b.len() });
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let magic = u16_at(0);
        if magic != MAGIC || b[2] != VERSION {
            // A header whose checksum holds with this build's magic and
            // version had one of them changed on the way (a flipped bit):
            // not a stranger's, nor another version's.
            let mut ours = [0u8; CHECKED_LEN];
            ours.copy_from_slice(&b[..CHECKED_LEN]);
            ours[..2].copy_from_slice(&MAGIC.to_le_bytes());
            ours[2] = VERSION;
            if crc32c(&ours) == u32_at(CHECKED_LEN) {
                return Err(ProtocolError::BadChecksum("the header".into()));
            }
            return Err(match magic != MAGIC {
                true => ProtocolError::BadMagic(magic),
                false => ProtocolError::UnsupportedVersion(b[2]),
            });
        }
        if crc32c(&b[..CHECKED_LEN]) != u32_at(CHECKED_LEN) {
            return Err(ProtocolError::BadChecksum("the header".into()));
        }
        let msg_type = MsgType::from_u8(b[3]).ok_or(ProtocolError::UnknownType(b[3]))?;
        let flags = u16_at(4);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(ProtocolError::UnknownFlags(flags));
        }
        let dtype = DType::from_u8(b[6]).ok_or(ProtocolError::BadDtype(b[6]))?;
        if b[7] != 0 {
            return Err(ProtocolError::ReservedNonZero);
        }
        let payload_len = u32_at(28);
        if payload_len > max_payload {
            return Err(ProtocolError::PayloadTooLarge { len: payload_len, max: max_payload });
        }
        Ok(Header {
            msg_type,
            flags,
            dtype,
            namespace: u32_at(8),
            key: u32_at(12),
            chunk: u32_at(16),
            round: u32_at(20),
            priority: u32_at(24) as i32,
            payload_len,
        })
    }
}
