//! Control-plane messages (rendezvous, declarations, liveness); their
//! payload encodings are in `payload`. Data-plane frames (Push/Result) carry raw tensor bytes
//! and are handled by the server and client directly.

use super::frame::{DType, MsgType};
use super::ProtocolError;
pub use crate::sum_order::SumOrder;

mod payload;

/// Largest tensor gradhub accepts (1 TiB): far beyond any real gradient,
/// small enough that sizes and offsets never overflow.
pub const MAX_TENSOR_BYTES: u64 = 1 << 40;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Worker,
    Server,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Server => "server",
        }
    }
    fn to_u8(self) -> u8 {
        match self {
            Role::Worker => 0,
            Role::Server => 1,
        }
    }
    fn from_u8(v: u8) -> Result<Role, ProtocolError> {
        match v {
            0 => Ok(Role::Worker),
            1 => Ok(Role::Server),
            _ => Err(ProtocolError::BadPayload(format!("unknown role {v}"))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Register {
    pub role: Role,
    /// Requested rank, or -1 for "assign me one".
    pub requested_rank: i32,
    /// The member's host identity (`crate::host_id`): workers with the same
    /// one share a machine.
    pub hostname: String,
    /// Address peers should use to reach this member (servers only).
    pub addr: String,
    /// One listening port per server thread (servers only).
    pub ports: Vec<u16>,
    pub colocated: bool,
    /// The job size this member was configured with; checked by the scheduler.
    pub num_workers: u32,
    pub num_servers: u32,
    /// Workers: the local rank and the number of workers on this host the
    /// launcher says this worker has (-1: not given); checked by the
    /// scheduler against the host identities of everyone who registered.
    pub local_rank: i32,
    pub local_size: i32,
    /// The rack this member is in (`GRADHUB_RACK`; empty: not given). Racks
    /// let the scheduler reduce within each rack before the core
    /// (`scheduler::racks`).
    pub rack: String,
    /// The order this member's sums add contributions in
    /// (`GRADHUB_DETERMINISTIC`); checked by the scheduler.
    pub sum_order: SumOrder,
    /// Synchronous rounds or the asynchronous mode (`GRADHUB_ASYNC`,
    /// `GRADHUB_STALENESS`); checked by the scheduler.
    pub training: crate::training::Training,
    /// A worker of an elastic job (`scheduler::elastic`): its bounds and
    /// its rank in the generation it comes from; None: a job of fixed size.
    pub elastic: Option<ElasticReg>,
}

/// An elastic job's worker registering for its next generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElasticReg {
    pub min_workers: u32,
    pub max_workers: u32,
    /// The size the job starts with (its first generation forms once that
    /// many came; later ones once the previous one's survivors did).
    pub initial: u32,
    /// Its rank in the previous generation; -1: new to the job.
    pub prev_rank: i32,
}

/// `lost` of a `ServerTakeOver` or `Failover` that moves chunks to a
/// server that joined, no server lost.
pub const NO_SERVER: u32 = u32::MAX;

/// At most this many server threads (slots) may join a running job in
/// all: workers reserve room for their connections up front.
pub const MAX_JOINED_SLOTS: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    pub rank: u32,
    pub addr: String,
    pub ports: Vec<u16>,
    pub colocated: bool,
    /// Host identity: workers with the same one share memory with it.
    pub host: String,
    /// Its rack's index (`Welcome::racks`).
    pub rack: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub rank: u32,
    pub num_workers: u32,
    pub partition_bytes: u32,
    pub heartbeat_ms: u32,
    pub stall_ms: u32,
    /// A peer silent for this long is lost: the same for every role.
    pub peer_timeout_ms: u32,
    pub servers: Vec<ServerInfo>,
    /// Host identity of each worker, by rank.
    pub worker_hosts: Vec<String>,
    /// Local rank of each worker on its host, by rank (checked or assigned
    /// by the scheduler); the local size is the count of equal hosts.
    pub worker_local_ranks: Vec<u32>,
    /// Random per job: names what colocated workers share (memory segments,
    /// doorbells), so two jobs on one host never meet.
    pub job_id: u64,
    /// Workers that share a host sum their gradients there first and push
    /// one share each (see `placement::HostLayout`).
    pub host_reduce: bool,
    /// A lost server's chunks move to the others and the job goes on
    /// (workers keep each chunk's last result for that: `client::io`).
    pub failover: bool,
    /// (To a server) it joined the job while it runs: no worker shares
    /// memory with it, whatever its host (`scheduler::failover::take_in`).
    pub late: bool,
    /// The racks' names, and each worker's rack index, by rank. One rack
    /// (named "") when none was given.
    pub racks: Vec<String>,
    pub worker_racks: Vec<u32>,
    /// Two-level reduction (PHub §3.4): each rack sums a chunk on one of its
    /// own server threads (the chunk's *relay*, `TensorSpec::relays`),
    /// which pushes the rack's sum to the chunk's owner.
    pub rack_reduce: bool,
}

/// A member coming back to its job's scheduler after losing it (the
/// scheduler restarted, `scheduler::rejoin`): who it is and what it knows,
/// for the scheduler to rebuild the job from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejoin {
    /// Its registration as first sent (checked as one is).
    pub register: Register,
    /// The Welcome it had: its rank and the job's cluster map.
    pub welcome: Welcome,
    /// Workers: the tensors declared and answered, as placed now.
    pub specs: Vec<TensorSpec>,
    /// Servers: the keys installed here.
    pub keys: Vec<u32>,
    /// Workers: the ranks it was told left the job (`PeerLeft`).
    pub left: Vec<u32>,
    /// The servers it was told were lost (their chunks moved: `Failover`,
    /// `ServerTakeOver`).
    pub lost: Vec<u32>,
    /// Workers: the barriers it has passed (every worker numbers its
    /// barriers alike: those below this one completed).
    pub barriers: u32,
    /// Messages (heartbeats aside) it received from the scheduler since
    /// its Welcome: a scheduler that did not restart (the connection
    /// broke) resumes the session and sends again what came after them.
    pub received: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclEntry {
    pub name: String,
    pub numel: u64,
    pub dtype: DType,
    /// Bytes per chunk of this tensor; 0: the job's partition size, which
    /// also bounds it (a data frame never exceeds the job's limit).
    pub partition: u32,
    /// The workers that sum it, by rank, ascending (a process set's or a
    /// torch sub-group's tensor); empty: every worker.
    pub members: Vec<u32>,
    /// It is as many equal shards as it has members (or workers), the q-th
    /// read by the q-th of them (a reduce-scatter's result, an all-gather's
    /// slots): each shard's chunks are placed on a server on its reader's
    /// host, where one is (`Placer::place_sharded`).
    pub sharded: bool,
}

/// Everything a worker and a server need to move one tensor: its key, how it
/// is cut into chunks, and which server thread (global slot) owns each chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub key: u32,
    pub name: String,
    pub numel: u64,
    pub dtype: DType,
    pub chunk_elems: u64,
    pub slots: Vec<u32>,
    /// Per chunk, the slot of a second server that keeps a replica of the
    /// chunk's server-side optimizer state and takes the chunk over if its
    /// server is lost (`scheduler::failover`); empty when there is none
    /// (one server, failover or replication off).
    pub replicas: Vec<u32>,
    /// With two-level reduction (`Welcome::rack_reduce`), per chunk and
    /// rack (index `chunk * racks + rack`), the slot the rack's workers push
    /// the chunk to: the owner itself in the owner's rack, else a relay in
    /// theirs; empty otherwise.
    pub relays: Vec<u32>,
    /// The workers that push it, by rank, ascending: each pushes for
    /// itself (no host stage, no relays); empty: every worker, as the host
    /// layout says (`DeclEntry::members`).
    pub members: Vec<u32>,
}

impl TensorSpec {
    pub fn num_chunks(&self) -> usize {
        self.slots.len()
    }
    /// Element range of chunk `c`.
    pub fn chunk_range(&self, c: usize) -> (usize, usize) {
        let start = c as u64 * self.chunk_elems;
        let end = start.saturating_add(self.chunk_elems).min(self.numel);
        (start as usize, end as usize)
    }
    pub fn chunk_bytes(&self, c: usize) -> usize {
        let (s, e) = self.chunk_range(c);
        (e - s) * self.dtype.size()
    }
    /// The slot rack `rack`'s workers push chunk `c` to.
    pub fn slot_for(&self, rack: u32, c: usize) -> u32 {
        let racks = self.relays.len() / self.slots.len().max(1);
        match racks {
            0 => self.slots[c],
            r => self.relays[c * r + rack as usize % r],
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    Register(Register),
    Welcome(Welcome),
    /// Instead of Register, to a scheduler that restarted: answered with
    /// the member's Welcome again.
    Rejoin(Box<Rejoin>),
    Declare {
        req: u32,
        entries: Vec<DeclEntry>,
    },
    Declared {
        req: u32,
        specs: Vec<TensorSpec>,
    },
    DeclareError {
        req: u32,
        message: String,
    },
    Heartbeat,
    /// A heartbeat of a member's session that acknowledges: its sender has
    /// received `received` messages (heartbeats aside) in this session.
    Ack {
        received: u64,
    },
    /// The answer to a Rejoin that found the scheduler alive (the
    /// connection had broken): it received `received` of the member's
    /// messages; it sends again what came after the member's count, and
    /// the member does the same.
    Resumed {
        received: u64,
    },
    PeerLost {
        role: Role,
        rank: u32,
        reason: String,
    },
    /// A worker left cleanly (its goodbye) while others go on: nothing it
    /// did not take part in can complete any more.
    PeerLeft {
        rank: u32,
    },
    Goodbye,
    Shutdown,
    /// Workers wait to join this elastic job (`scheduler::elastic`): its
    /// workers re-form it at their next commit.
    HostsUpdated,
    Barrier {
        id: u32,
    },
    BarrierDone {
        id: u32,
    },
    ServerDeclare {
        batch: u32,
        specs: Vec<TensorSpec>,
    },
    ServerDeclareAck {
        batch: u32,
    },
    /// A worker no longer uses these tensors (an unnamed operation's, or
    /// `release`d by name): once every worker released one, servers free it.
    Release {
        keys: Vec<u32>,
    },
    ServerRelease {
        keys: Vec<u32>,
    },
    /// A worker's link to server `server` broke and could not be made
    /// again within the peer timeout (`reason`), while the scheduler still
    /// hears from the server: a server its workers cannot reach is lost all
    /// the same.
    Unreachable {
        server: u32,
        reason: String,
    },
    /// Server `lost` is gone: install `specs` (every tensor that had chunks
    /// on it, placed again); the chunks that are now this server's start
    /// from the workers' re-sent pushes and restored results. Acked like
    /// ServerDeclare.
    ServerTakeOver {
        batch: u32,
        lost: u32,
        specs: Vec<TensorSpec>,
    },
    /// Server `lost` is gone (`reason`) and the servers took its chunks
    /// over: `specs` replace the workers' specs of the same keys, unless a
    /// later failover (higher `batch`: two servers lost at once) placed them
    /// again already.
    Failover {
        batch: u32,
        lost: u32,
        reason: String,
        specs: Vec<TensorSpec>,
    },
    DeclareStall {
        name: String,
        missing: Vec<u32>,
        waited_ms: u64,
    },
    /// A server joined the running job: workers connect to its threads
    /// (and servers learn where its replica slots are) before any chunk
    /// moves to it.
    ServerJoined {
        server: ServerInfo,
    },
    /// Chunks move to a server that joined: `specs` are their tensors'
    /// new placements. A server gives up each chunk of its own whose slot
    /// changed, except one with server-side optimizer state, which it
    /// keeps and lists in its `ServerMoveAck`.
    ServerMove {
        batch: u32,
        specs: Vec<TensorSpec>,
    },
    ServerMoveAck {
        batch: u32,
        /// (key, chunk) of the chunks this server kept.
        kept: Vec<(u32, u32)>,
    },
    Error {
        message: String,
    },
    /// A shared service's server process offers itself (`scheduler::service`).
    ServiceJoin(ServiceJoin),
    /// Start a server instance for job `job`, whose frames carry
    /// `namespace`; `start` tells this start of the job from another of the
    /// same name (an elastic job's generations), in `JobTraffic`.
    ServiceStart {
        job: String,
        namespace: u32,
        start: u64,
        /// The rank this server takes in the job: its place among the
        /// service's servers, so a job numbers them as the service does.
        rank: u32,
    },
    /// Per job: bytes pushed to this server process and chunk rounds, so far.
    ServiceStats {
        jobs: Vec<JobTraffic>,
    },
    StatusRequest,
    StatusReply {
        json: String,
    },
    /// Horovod's join: this worker ran out of data.
    Join,
    Joined {
        rank: u32,
    },
    /// The `round`-th use of tensor `name` (counted per name by every
    /// worker), which joined workers take part in with zeros.
    JoinOp {
        name: String,
        numel: u64,
        dtype: DType,
        /// The round's frame flags (average, init, asynchronous).
        flags: u16,
        round: u32,
        /// The tensor is freed once this round completes (a generated
        /// name, never used again): every worker drops it then.
        release_after: bool,
    },
    JoinDone {
        last: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceJoin {
    pub hostname: String,
    /// The address workers reach it at (as in `Register`).
    pub addr: String,
    pub threads: u32,
    pub colocated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobTraffic {
    pub job: String,
    /// The `ServiceStart` this instance came from.
    pub start: u64,
    pub bytes: u64,
    pub rounds: u64,
    /// Why this server process's instance for the job ended with an error
    /// or could not start (reported once); empty while it runs.
    pub error: String,
}

impl Control {
    pub fn msg_type(&self) -> MsgType {
        match self {
            Control::Register(_) => MsgType::Register,
            Control::Welcome(_) => MsgType::Welcome,
            Control::Rejoin(_) => MsgType::Rejoin,
            Control::Declare { .. } => MsgType::Declare,
            Control::Declared { .. } => MsgType::Declared,
            Control::DeclareError { .. } => MsgType::DeclareError,
            Control::Heartbeat => MsgType::Heartbeat,
            Control::PeerLost { .. } => MsgType::PeerLost,
            Control::PeerLeft { .. } => MsgType::PeerLeft,
            Control::Goodbye => MsgType::Goodbye,
            Control::Shutdown => MsgType::Shutdown,
            Control::HostsUpdated => MsgType::HostsUpdated,
            Control::Barrier { .. } => MsgType::Barrier,
            Control::BarrierDone { .. } => MsgType::BarrierDone,
            Control::ServerDeclare { .. } => MsgType::ServerDeclare,
            Control::ServerDeclareAck { .. } => MsgType::ServerDeclareAck,
            Control::DeclareStall { .. } => MsgType::DeclareStall,
            Control::Release { .. } => MsgType::Release,
            Control::ServerRelease { .. } => MsgType::ServerRelease,
            Control::ServerTakeOver { .. } => MsgType::ServerTakeOver,
            Control::Unreachable { .. } => MsgType::Unreachable,
            Control::Ack { .. } => MsgType::Ack,
            Control::Resumed { .. } => MsgType::Resumed,
            Control::Failover { .. } => MsgType::Failover,
            Control::Error { .. } => MsgType::Error,
            Control::ServiceJoin(_) => MsgType::ServiceJoin,
            Control::ServiceStart { .. } => MsgType::ServiceStart,
            Control::ServiceStats { .. } => MsgType::ServiceStats,
            Control::StatusRequest => MsgType::StatusRequest,
            Control::StatusReply { .. } => MsgType::StatusReply,
            Control::Join => MsgType::Join,
            Control::Joined { .. } => MsgType::Joined,
            Control::JoinOp { .. } => MsgType::JoinOp,
            Control::JoinDone { .. } => MsgType::JoinDone,
            Control::ServerJoined { .. } => MsgType::ServerJoined,
            Control::ServerMove { .. } => MsgType::ServerMove,
            Control::ServerMoveAck { .. } => MsgType::ServerMoveAck,
        }
    }
}
