//! One server thread: owns a listener, the connections every worker opened to
//! it, and a fixed set of chunks. Nothing here is shared with other threads
//! (PHub's shared-nothing, chunk-to-core mapping), so the data path has no locks.
//!
//! Per chunk and round: the first push is received straight into the
//! accumulation buffer (f32), later pushes land in a per-connection scratch
//! buffer and are added with the vectorized kernel. When every pusher has
//! pushed, the sum goes back to the pushers on the same connections, without
//! a pull request (fused push-pull). A chunk's pushers are one worker per
//! host (`HostLayout`: that worker pushes its host's sum), or every worker
//! when hosts do not reduce first. Results are double-buffered by round
//! parity: a pusher can only push round r+2 after every pusher received round
//! r, so the buffer of round r is never overwritten while it is being sent.
//!
//! A worker on this server's own host pushes by reference (`PushRef`): the
//! chunk is read from the host's shared segment (`crate::host::Staging`)
//! and its result written back there (`ResultRef`), instead of both
//! crossing the loopback socket.
//!
//! Chunks taken over from a lost server (*adopted*, see
//! `scheduler::failover`) do not know their round: the first push or
//! restored result sets it. Workers re-send the pushes the lost server had
//! not answered, and each sends the last result it holds (`Restore`, round
//! in the header) first, since some workers may have received a result that
//! others never did: a restored result completes its round as the sum
//! would have (the pushers of that round get it), and a push of a round
//! already complete is answered with its result at once (a replay). A
//! worker restores round r only if it received it, and pushes round r+1
//! only after restoring r, so a round is never summed from a mix of pushes
//! and never completed twice with different results.
//!
//! A chunk with a server-side optimizer also has a replica on another
//! server (`super::replica`): its results wait for the replica's ack.
//!
//! With two-level reduction across racks (`scheduler::racks`), a thread may
//! also be a rack's *relay* for a chunk owned in another rack: it sums the
//! pushes of its rack's workers like any round, then pushes the rack's sum
//! to the owner over a link of its own (as pusher `HostLayout::relay_id`)
//! and hands the owner's result to its rack as the round's result. Averaging
//! and the server-side optimizer happen at the owner only.

use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};

use super::optimizer::OptState;
use super::replica::{self, Replicas};
use crate::host::Staging;
use crate::kernels;
use crate::placement::HostLayout;
use crate::protocol::auth::{self, Secret};
use crate::protocol::{
    encode_stall, DType, Header, MsgType, OptConfig, ProtocolError, ReadError, TensorSpec, FLAG_AVERAGE, FLAG_INIT,
    FLAG_ZEROS,
};
use crate::transport::{
    bytes, bytes_mut, cast, AcceptErrors, AcceptFailure, ConnError, Connection, Drain, Frame, FrameReader, FrameWriter,
    Outgoing,
};

pub const LISTENER: Token = Token(0);
pub const WAKER: Token = Token(1);
const FIRST_CONN: usize = 2;

/// What a link this thread opened to another server thread is for.
pub enum LinkTo {
    /// The slot replicating our chunks' optimizer state (ServerHello sent).
    Replica,
    /// The owner of chunks we relay for our rack (DataHello sent).
    Owner,
}

pub enum ThreadCmd {
    /// Install specs; the chunks whose slot is this thread's become ours
    /// (adopted from a lost server if the flag is set), and so do those we
    /// relay for our rack. With the tensors' shared segments when workers
    /// on this host push by reference, and new links (authenticated and
    /// introduced) to other server threads, by slot.
    Declare(
        Vec<TensorSpec>,
        bool,
        Vec<(u32, Arc<Staging>)>,
        Vec<(u32, std::net::TcpStream, LinkTo, String)>,
        Sender<()>,
    ),
    /// Every worker released these tensors (keys): free their chunks.
    Release(Vec<u32>),
    /// Chunks move to a server that joined (`scheduler::failover::take_in`):
    /// give up each of ours these specs place elsewhere, unless it has a
    /// server-side optimizer; answer with the (key, chunk) pairs kept.
    GiveUp(Vec<TensorSpec>, Sender<Vec<(u32, u32)>>),
    Stop,
    /// Worker `rank` left the job cleanly while others go on.
    Left(u32),
    /// The job failed: tell every connected worker why, then exit.
    Abort(String),
}

pub struct ThreadConfig {
    pub server: u32,
    pub thread: u32,
    pub slot: u32,
    /// This server's rack (two-level reduction: `layout` has the racks),
    /// and how many relays may push here then (ranks after the workers').
    pub rack: u32,
    pub relays: u32,
    pub num_workers: u32,
    /// Who pushes which chunk.
    pub layout: Arc<HostLayout>,
    /// By rank: the worker shares this server's host and its stage, so it
    /// may push by reference.
    pub local: Arc<Vec<bool>>,
    pub namespace: u32,
    pub partition_bytes: u32,
    pub stall: Duration,
    /// A connection that has not said DataHello, or has sent part of a frame
    /// and nothing more, for this long is closed (a broken or hostile peer
    /// must not hold a connection forever).
    pub peer_timeout: Duration,
    /// The job's token, which every connecting worker must prove.
    pub secret: Secret,
    /// What this server's threads summed (a shared service reports it).
    pub traffic: Arc<super::Traffic>,
    pub timeline: Option<Arc<crate::timeline::Trace>>,
}

enum ChunkBuf {
    F32([Vec<f32>; 2]),
    /// f16/bf16 are accumulated in f32 and narrowed once per round.
    Half {
        acc: Vec<f32>,
        out: [Vec<u16>; 2],
    },
    /// float64 and the integers, summed exactly in their own type: raw
    /// little-endian bytes, 8-aligned (`kernels::add_exact`).
    Exact([Vec<u64>; 2]),
}

struct Chunk {
    key: u32,
    chunk: u32,
    dtype: DType,
    elems: usize,
    round: u32,
    /// The workers that push this chunk (one per host), by rank, and the
    /// relays of other racks (`HostLayout::pushers_at`).
    pushers: Vec<u32>,
    /// Init rounds keep the push of the pusher for rank 0's host
    /// (`u32::MAX`: none, at a relay of another rack).
    init_from: u32,
    /// A rack's relay of a chunk owned elsewhere: the owner's slot; and
    /// whether this round's sum went there (its result completes the round).
    upstream: Option<u32>,
    forwarded: bool,
    pushed: Vec<bool>,
    /// By rank: this round's push came by reference (so does the result).
    by_ref: Vec<bool>,
    count: u32,
    flags: u16,
    priority: i32,
    started: Option<Instant>,
    /// The worker whose push started the round (for the timeline).
    first: u32,
    stall_reported: bool,
    /// A push is being received straight into the accumulator right now;
    /// pushes that complete meanwhile are parked in `deferred` and added after.
    direct_in_progress: bool,
    deferred: Vec<Vec<u32>>,
    buf: ChunkBuf,
    /// Parameters and optimizer state, for tensors with a server-side optimizer.
    opt: Option<Box<OptState>>,
    /// Taken over from a lost server; until `known`, its round is not.
    adopted: bool,
    known: bool,
    /// The last complete round, whose result is in its parity's buffer.
    done: Option<u32>,
    /// The slot replicating this chunk's optimizer state, if any.
    replica: Option<u32>,
    /// A complete round whose results wait for the replica's ack, and since when.
    held: Option<(u32, Instant)>,
}

impl Chunk {
    fn result_bytes(&self, parity: usize) -> &[u8] {
        match &self.buf {
            ChunkBuf::F32(b) => bytes(&b[parity]),
            ChunkBuf::Half { out, .. } => bytes(&out[parity]),
            ChunkBuf::Exact(b) => &bytes(&b[parity])[..self.elems * self.dtype.size()],
        }
    }
}

/// A result waiting to be sent; higher priority first, then FIFO.
#[derive(PartialEq, Eq)]
struct TxItem {
    priority: i32,
    seq: u64,
    chunk: usize,
    round: u32,
    by_ref: bool,
    /// A relay's push of its rack's sum to the owner, not a result.
    push: bool,
}
impl Ord for TxItem {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.priority.cmp(&o.priority).then_with(|| o.seq.cmp(&self.seq))
    }
}
impl PartialOrd for TxItem {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// Where an incoming push payload goes.
#[derive(Clone, Copy)]
struct Dest {
    chunk: usize,
    /// Straight into the accumulator of round parity `parity`, else into the
    /// connection's scratch buffer.
    direct: bool,
    parity: usize,
    len: usize,
    /// What the payload is, if not a contribution to the chunk's round.
    kind: PayloadKind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PayloadKind {
    Push,
    /// A push of a round already complete (adopted chunks): answered with its result.
    Replay,
    /// A restored result (`MsgType::Restore`).
    Restore,
    /// A restored result of a tensor released here since: dropped.
    Discard,
    /// A push of a chunk given up here (moved to a server that joined):
    /// dropped and acknowledged; the worker re-sends it to the new server.
    Moved,
    /// The owner's result of a round we relayed, into the result buffer.
    Upstream,
}

/// What a frame being written carries: a result (its payload is a chunk's
/// result buffer), or nothing beyond pre-encoded bytes (acks, notices).
#[derive(Clone, Copy)]
enum Carry {
    Result { chunk: usize, parity: usize },
    Encoded,
}

struct Conn {
    link: Connection,
    /// The authentication handshake (`protocol::auth`): nothing else is
    /// accepted before it is done.
    auth: auth::Listener,
    rank: Option<u32>,
    /// The slot of the server thread at the other end: one replicating
    /// its chunks here (it said ServerHello), or our link to a replica.
    server: Option<u32>,
    rx: FrameReader<Dest>,
    tx: FrameWriter<Carry>,
    scratch: Vec<u32>,
    results: BinaryHeap<TxItem>,
    /// Advisory frames (stall notices), sent between results.
    notices: VecDeque<Vec<u8>>,
    /// When the connection was accepted, and when its last frame (or frame
    /// part) arrived whole: see `ThreadConfig::peer_timeout`.
    accepted: Instant,
    last_frame: Instant,
    /// Received frames (headers) not yet written: sent before anything else,
    /// batched into one write per readable event. Bounded by the pushes a
    /// worker may have unacknowledged (its credit plus preempting chunks).
    acks: Vec<u8>,
}

/// A round waiting too long: its chunk indices here, the missing ranks, how long.
type StalledRound = (Vec<usize>, Vec<u32>, Duration);

/// A failed handshake closes the connection; the peer is told only that
/// authentication failed (`close` adds nothing about the job), the log says why.
fn auth_failed(e: auth::AuthError) -> ConnError {
    ConnError::Invalid(match e {
        auth::AuthError::Failed(why) => format!("authentication failed: {why}"),
        other => format!("authentication failed: {other}"),
    })
}

/// Unsent bytes the kernel may hold per data connection before the socket
/// stops being writable (TCP_NOTSENT_LOWAT): results queue in our priority
/// heap instead, so an urgent result never waits behind a deep socket
/// buffer. 256 KiB keeps a 25 Gbit/s link busy for ~80 µs between wake-ups.
const NOTSENT_LOWAT: u32 = 256 << 10;

pub struct ServerThread {
    cfg: ThreadConfig,
    poll: Poll,
    listener: TcpListener,
    cmds: Receiver<ThreadCmd>,
    conns: HashMap<usize, Conn>,
    next_token: usize,
    worker_conn: Vec<Option<usize>>,
    chunks: Vec<Chunk>,
    index: HashMap<(u32, u32), usize>,
    names: HashMap<u32, String>,
    seq: u64,
    /// Recycled scratch buffers (see `Chunk::deferred`).
    pool: Vec<Vec<u32>>,
    /// Server-side optimizer per key (set by OptConfig frames).
    opt_cfg: HashMap<u32, OptConfig>,
    /// Every key with at least one chunk on this thread: its dtype and the
    /// indices of its chunks in `chunks`.
    keys_here: HashMap<u32, (DType, Vec<usize>)>,
    /// Indices in `chunks` of released tensors' chunks, reused first.
    free: Vec<usize>,
    /// By rank: the worker left the job cleanly (`ThreadCmd::Left`).
    left: Vec<bool>,
    /// Shared segments of this host's tensors (see `ThreadCmd::Declare`).
    shm: HashMap<u32, Arc<Staging>>,
    /// Keys released here lately, oldest first (at most `FREED_MEMORY`): a
    /// worker may restore a result of one after every worker released it
    /// (the failover reached it after the release), which is no error.
    freed: VecDeque<u32>,
    freed_set: HashSet<u32>,
    /// Chunks of other threads this one replicates (`super::replica`).
    replicas: Replicas,
    /// Our links to the threads replicating our chunks: slot -> token.
    links: HashMap<u32, usize>,
    /// Our links to the owners of the chunks we relay: slot -> token.
    uplinks: HashMap<u32, usize>,
    /// Chunks given up here (`ThreadCmd::GiveUp`): what still comes for them
    /// is dropped (pushes acknowledged), not an error.
    moved_away: HashSet<(u32, u32)>,
    /// Indices in `chunks` given up while a frame was still being read into
    /// or written from them: freed once none is (`free_retired`).
    retired: Vec<usize>,
    accept_errors: AcceptErrors,
    /// When to accept again after running out of descriptors: connections
    /// already queued raise no new edge (`AcceptFailure::Later`).
    accept_retry: Option<Instant>,
}

/// The pause before accepting again after running out of descriptors.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// How many released keys a thread remembers (keys are never reused).
const FREED_MEMORY: usize = 1 << 16;

type ConnResult = Result<(), ConnError>;

impl ServerThread {
    pub fn new(cfg: ThreadConfig, poll: Poll, listener: TcpListener, cmds: Receiver<ThreadCmd>) -> ServerThread {
        let n = (cfg.num_workers + cfg.relays) as usize;
        ServerThread {
            cfg,
            poll,
            listener,
            cmds,
            conns: HashMap::new(),
            next_token: FIRST_CONN,
            worker_conn: vec![None; n],
            chunks: Vec::new(),
            index: HashMap::new(),
            names: HashMap::new(),
            seq: 0,
            pool: Vec::new(),
            opt_cfg: HashMap::new(),
            keys_here: HashMap::new(),
            free: Vec::new(),
            shm: HashMap::new(),
            freed: VecDeque::new(),
            freed_set: HashSet::new(),
            left: vec![false; n],
            replicas: Replicas::default(),
            links: HashMap::new(),
            uplinks: HashMap::new(),
            accept_errors: AcceptErrors::default(),
            accept_retry: None,
            moved_away: HashSet::new(),
            retired: Vec::new(),
        }
    }

    /// Register the listener and a waker; the waker is used by the control
    /// thread to signal commands.
    pub fn setup(poll: &Poll, listener: &mut TcpListener) -> std::io::Result<Waker> {
        poll.registry().register(listener, LISTENER, Interest::READABLE)?;
        Waker::new(poll.registry(), WAKER)
    }

    fn who(&self) -> String {
        format!("server {}/t{}", self.cfg.server, self.cfg.thread)
    }

    pub fn run(mut self) {
        let mut events = Events::with_capacity(256);
        let tick =
            (self.cfg.stall.min(self.cfg.peer_timeout) / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        loop {
            let wait = self.accept_retry.map_or(tick, |t| t.saturating_duration_since(Instant::now()).min(tick));
            if let Err(e) = self.poll.poll(&mut events, Some(wait)) {
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                log::error!(target: &self.who(), "poll failed: {e}");
                return;
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(),
                    WAKER => {}
                    Token(t) => {
                        let mut res = Ok(());
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            res = self.on_readable(t, Drain::of(ev));
                        }
                        let acks = self.conns.get(&t).is_some_and(|c| !c.acks.is_empty());
                        if res.is_ok() && (ev.is_writable() || acks) {
                            res = self.flush(t);
                        }
                        match res {
                            Ok(()) => {}
                            // A clean close between frames: the worker is done.
                            Err(ConnError::Read(ReadError::Closed)) => self.close(t, ""),
                            Err(why) => self.close(t, &why.to_string()),
                        }
                    }
                }
            }
            while let Ok(cmd) = self.cmds.try_recv() {
                match cmd {
                    ThreadCmd::Declare(specs, adopt, shm, links, ack) => {
                        for (slot, stream, to, name) in links {
                            self.add_link(slot, stream, to, &name);
                        }
                        self.install(&specs, adopt);
                        self.shm.extend(shm);
                        let _ = ack.send(());
                    }
                    ThreadCmd::Release(keys) => self.release(&keys),
                    ThreadCmd::GiveUp(specs, ack) => {
                        let kept = self.give_up(&specs);
                        let _ = ack.send(kept);
                    }
                    ThreadCmd::Stop => return,
                    ThreadCmd::Left(rank) => self.on_left(rank),
                    ThreadCmd::Abort(why) => {
                        let tokens: Vec<usize> = self.conns.keys().copied().collect();
                        for t in tokens {
                            self.close(t, &why);
                        }
                        return;
                    }
                }
            }
            if self.accept_retry.is_some_and(|t| Instant::now() >= t) {
                self.accept();
            }
            self.check_stalls();
            self.close_idle();
            self.check_held();
            if !self.retired.is_empty() {
                self.free_retired();
            }
        }
    }

    fn accept(&mut self) {
        self.accept_retry = None;
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    crate::transport::tune_data_socket(&stream);
                    // Best effort: without it results are still ordered, only less strictly.
                    let _ = socket2::SockRef::from(&stream).set_tcp_notsent_lowat(NOTSENT_LOWAT);
                    if let Err(e) = self.add_conn(stream, peer.to_string(), auth::Listener::default()) {
                        log::warn!(target: &self.who(), "cannot register connection from {peer}: {e}");
                    }
                }
                Err(e) => match self.accept_errors.on_error(&self.who(), &e) {
                    AcceptFailure::Skip => {}
                    AcceptFailure::Drained => return,
                    AcceptFailure::Later => {
                        self.accept_retry = Some(Instant::now() + ACCEPT_RETRY);
                        return;
                    }
                },
            }
        }
    }

    fn add_conn(&mut self, stream: mio::net::TcpStream, peer: String, auth: auth::Listener) -> std::io::Result<usize> {
        let t = self.next_token;
        self.next_token += 1;
        let link = Connection::new(self.poll.registry(), stream, Token(t), peer)?;
        let now = Instant::now();
        let conn = Conn {
            link,
            auth,
            rank: None,
            server: None,
            rx: FrameReader::default(),
            tx: FrameWriter::default(),
            scratch: Vec::new(),
            results: BinaryHeap::new(),
            notices: VecDeque::new(),
            acks: Vec::new(),
            accepted: now,
            last_frame: now,
        };
        self.conns.insert(t, conn);
        Ok(t)
    }

    /// Our link to the thread at `slot`, which replicates chunks of ours
    /// or owns chunks we relay (authenticated and introduced by the control
    /// loop).
    fn add_link(&mut self, slot: u32, stream: std::net::TcpStream, to: LinkTo, name: &str) {
        let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let what = match to {
            LinkTo::Replica => "replica",
            LinkTo::Owner => "owner",
        };
        let registered = stream.set_nonblocking(true).and_then(|()| {
            crate::transport::tune_data_socket(&stream);
            // As on accepted sockets: the relay's pushes queue in priority order here.
            let _ = socket2::SockRef::from(&stream).set_tcp_notsent_lowat(NOTSENT_LOWAT);
            self.add_conn(
                mio::net::TcpStream::from_std(stream),
                format!("{what} {name} ({peer})"),
                auth::Listener::Done { job: String::new() },
            )
        });
        match registered {
            Ok(t) => {
                if let Some(c) = self.conns.get_mut(&t) {
                    c.server = Some(slot);
                }
                let links = match to {
                    LinkTo::Replica => &mut self.links,
                    LinkTo::Owner => &mut self.uplinks,
                };
                if let Some(old) = links.insert(slot, t) {
                    self.close(old, "replaced by a new link");
                }
            }
            Err(e) => log::warn!(target: &self.who(), "cannot register the link to {what} {name}: {e}"),
        }
    }

    /// Queue `frame` on the link to replica `slot`. Without one (it broke,
    /// or could not be opened) the frame is dropped: the results it would
    /// release stay held until a failover gives the chunk a new replica,
    /// or `check_held` fails the job.
    fn send_to_replica(&mut self, slot: u32, frame: Vec<u8>) {
        let Some(&t) = self.links.get(&slot) else { return };
        if let Some(c) = self.conns.get_mut(&t) {
            c.notices.push_back(frame);
        }
        if let Err(why) = self.flush(t) {
            self.close(t, &why.to_string());
        }
    }

    /// Chunk `idx`'s replica is new: send it the optimizer and the whole
    /// state (a held round waits for this ack instead), or, without a
    /// replica, release a held round.
    fn sync_replica(&mut self, idx: usize) {
        let ch = &self.chunks[idx];
        let (key, chunk, ns) = (ch.key, ch.chunk, self.cfg.namespace);
        let (Some(state), Some(slot)) = (ch.opt.as_ref(), ch.replica) else {
            if ch.held.is_some() && ch.replica.is_none() {
                self.chunks[idx].held = None;
                self.send_results(idx);
            }
            return;
        };
        let round = ch.done.unwrap_or(ch.round.wrapping_sub(1));
        let snapshot = replica::snapshot_frame(ns, (key, chunk, round), state);
        if let Some(cfg) = self.opt_cfg.get(&key) {
            let frame = replica::config_frame(ns, key, cfg);
            self.send_to_replica(slot, frame);
        }
        self.send_to_replica(slot, snapshot);
        if let Some((r, _)) = &mut self.chunks[idx].held {
            *r = round;
        }
    }

    fn install(&mut self, specs: &[TensorSpec], adopt: bool) {
        let n = (self.cfg.num_workers + self.cfg.relays) as usize;
        let layout = self.cfg.layout.clone();
        for s in specs {
            self.names.insert(s.key, s.name.clone());
            for (c, &slot) in s.slots.iter().enumerate() {
                let at = (s.key, c as u32);
                let rep = s.replicas.get(c).copied();
                let (a, b) = s.chunk_range(c);
                let elems = b - a;
                // A chunk owned in another rack that our rack sums here first
                // (else, if ours, we own it, and the owner's rack is ours).
                let mine = layout.num_racks() > 0 && s.slot_for(self.cfg.rack, c) == self.cfg.slot;
                let upstream = (mine && slot != self.cfg.slot).then_some(slot);
                let relay_slot = |r: u32| s.slot_for(r, c);
                if slot != self.cfg.slot && upstream.is_none() {
                    if rep == Some(self.cfg.slot) {
                        let new = replica::Replica { elems, state: None, done: None };
                        self.replicas.chunks.entry(at).or_insert(new);
                    } else {
                        self.replicas.chunks.remove(&at);
                    }
                    continue;
                }
                self.moved_away.remove(&at);
                if let Some(&idx) = self.index.get(&at) {
                    if self.chunks[idx].replica != rep {
                        self.chunks[idx].replica = rep;
                        self.sync_replica(idx);
                    }
                    continue;
                }
                // Taken over from a lost server whose replica we were: go
                // on from the state it replicated here.
                let from = self.replicas.chunks.remove(&at).filter(|_| adopt);
                let buf = match s.dtype {
                    DType::F32 => ChunkBuf::F32([vec![0.0; elems], vec![0.0; elems]]),
                    d if d.sums_in_place() => {
                        let words = (elems * d.size()).div_ceil(8);
                        ChunkBuf::Exact([vec![0; words], vec![0; words]])
                    }
                    _ => ChunkBuf::Half { acc: vec![0.0; elems], out: [vec![0; elems], vec![0; elems]] },
                };
                let chunk = Chunk {
                    key: s.key,
                    chunk: c as u32,
                    dtype: s.dtype,
                    elems,
                    round: 0,
                    pushers: layout.pushers_at(s.key, c as u32, self.cfg.rack, upstream.is_some(), &relay_slot),
                    init_from: layout
                        .init_pusher(s.key, c as u32, self.cfg.rack, upstream.is_some(), &relay_slot)
                        .unwrap_or(u32::MAX),
                    upstream,
                    forwarded: false,
                    pushed: vec![false; n],
                    by_ref: vec![false; n],
                    count: 0,
                    flags: 0,
                    priority: 0,
                    started: None,
                    first: 0,
                    stall_reported: false,
                    direct_in_progress: false,
                    deferred: Vec::new(),
                    buf,
                    opt: None,
                    adopted: adopt,
                    known: !adopt,
                    done: None,
                    replica: rep,
                    held: None,
                };
                let mut chunk = chunk;
                if let Some(replica::Replica { state: Some(state), done: Some(d), .. }) = from {
                    if let ChunkBuf::F32(b) = &mut chunk.buf {
                        if b[(d & 1) as usize].len() == state.param.len() {
                            b[(d & 1) as usize].copy_from_slice(&state.param);
                            (chunk.known, chunk.round, chunk.done) = (true, d.wrapping_add(1), Some(d));
                            chunk.opt = Some(state);
                        }
                    }
                }
                let needs_sync = chunk.opt.is_some();
                let idx = match self.free.pop() {
                    Some(i) => {
                        self.chunks[i] = chunk;
                        i
                    }
                    None => {
                        self.chunks.push(chunk);
                        self.chunks.len() - 1
                    }
                };
                self.index.insert(at, idx);
                self.keys_here.entry(s.key).or_insert_with(|| (s.dtype, Vec::new())).1.push(idx);
                if needs_sync {
                    self.sync_replica(idx); // its replica is a new one
                }
            }
        }
    }

    /// Every worker released these tensors, so each of their rounds is
    /// complete and its results were received: free their chunks (the
    /// slots are reused by later tensors). A push for them now is an error
    /// (an unknown key).
    fn release(&mut self, keys: &[u32]) {
        self.replicas.release(keys);
        if !self.moved_away.is_empty() {
            self.moved_away.retain(|(k, _)| !keys.contains(k));
        }
        let mut freed = Vec::new();
        for key in keys {
            self.names.remove(key);
            self.opt_cfg.remove(key);
            self.shm.remove(key);
            let Some((_, idxs)) = self.keys_here.remove(key) else { continue };
            if self.freed.len() == FREED_MEMORY {
                if let Some(old) = self.freed.pop_front() {
                    self.freed_set.remove(&old);
                }
            }
            self.freed.push_back(*key);
            self.freed_set.insert(*key);
            for idx in idxs {
                let ch = &mut self.chunks[idx];
                self.index.remove(&(ch.key, ch.chunk));
                if ch.count > 0 {
                    // Only a worker breaking the protocol can have pushed it.
                    let who = format!("server {}/t{}", self.cfg.server, self.cfg.thread);
                    log::warn!(target: &who, "tensor key {key} released with a partial round {}", ch.round);
                }
                ch.count = 0;
                ch.started = None;
                ch.buf = ChunkBuf::F32([Vec::new(), Vec::new()]);
                ch.opt = None;
                ch.deferred.clear();
                freed.push(idx);
            }
        }
        // A push arriving into a freed chunk breaks the protocol too; its
        // destination must not be reused under it.
        let stray: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.rx.target().is_some_and(|d| freed.contains(&d.chunk)))
            .map(|(&t, _)| t)
            .collect();
        for t in stray {
            self.close(t, "push for a tensor every worker released");
        }
        self.free.extend(freed);
    }

    /// Give up our chunks that `specs` place elsewhere (see
    /// `ThreadCmd::GiveUp`); returns the ones kept for their server-side
    /// optimizer state. A round in progress is abandoned: its pushers
    /// re-send their pushes to the new server, and whoever received a
    /// result from here restores it there.
    fn give_up(&mut self, specs: &[TensorSpec]) -> Vec<(u32, u32)> {
        let mut kept = Vec::new();
        let mut gone = Vec::new();
        for s in specs {
            for (c, &slot) in s.slots.iter().enumerate() {
                let at = (s.key, c as u32);
                let Some(&idx) = self.index.get(&at).filter(|_| slot != self.cfg.slot) else { continue };
                if self.chunks[idx].opt.is_some() || self.opt_cfg.contains_key(&s.key) {
                    kept.push(at);
                    continue;
                }
                self.index.remove(&at);
                if let Some((_, idxs)) = self.keys_here.get_mut(&s.key) {
                    idxs.retain(|&i| i != idx);
                    if idxs.is_empty() {
                        self.keys_here.remove(&s.key);
                    }
                }
                self.moved_away.insert(at);
                let ch = &mut self.chunks[idx];
                (ch.count, ch.started, ch.held, ch.stall_reported) = (0, None, None, false);
                ch.pushed.iter_mut().for_each(|p| *p = false);
                gone.push(idx);
            }
        }
        if gone.is_empty() {
            return kept;
        }
        for c in self.conns.values_mut() {
            c.results.retain(|r| !gone.contains(&r.chunk));
        }
        log::info!(target: &self.who(), "gave up {} chunk(s) to a server that joined", gone.len());
        self.retired.extend(gone);
        self.free_retired();
        kept
    }

    /// Free the given-up chunks no frame is being read into or written from.
    fn free_retired(&mut self) {
        let busy: HashSet<usize> = self
            .conns
            .values()
            .flat_map(|c| {
                let reading = c.rx.target().map(|d| d.chunk);
                let writing = match c.tx.current() {
                    Some(Carry::Result { chunk, .. }) => Some(*chunk),
                    _ => None,
                };
                reading.into_iter().chain(writing)
            })
            .collect();
        let mut freed = Vec::new();
        self.retired.retain(|&idx| {
            if busy.contains(&idx) {
                return true;
            }
            freed.push(idx);
            false
        });
        for idx in freed {
            let ch = &mut self.chunks[idx];
            ch.buf = ChunkBuf::F32([Vec::new(), Vec::new()]);
            ch.direct_in_progress = false;
            self.pool.append(&mut ch.deferred);
            self.free.push(idx);
        }
    }

    /// A frame for a chunk given up here: a push is acknowledged (its
    /// worker re-sends it to the chunk's new server once it learns of the
    /// move) and, like a restored result or an optimizer config, dropped.
    fn drop_moved(&mut self, t: usize, hdr: Header) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        conn.rank.ok_or("a data frame before DataHello")?;
        let want = hdr.payload_len as usize;
        if want > 0 {
            if conn.scratch.len() * 4 < want {
                if conn.scratch.is_empty() {
                    conn.scratch = self.pool.pop().unwrap_or_default();
                }
                conn.scratch.resize(want.div_ceil(4), 0);
            }
            let kind = if hdr.msg_type == MsgType::Push { PayloadKind::Moved } else { PayloadKind::Discard };
            conn.rx.receive_into(hdr, Dest { chunk: usize::MAX, direct: false, parity: 0, len: want, kind });
            return Ok(());
        }
        if matches!(hdr.msg_type, MsgType::Push | MsgType::PushRef) {
            self.ack_moved(t, &hdr);
        }
        Ok(())
    }

    fn ack_moved(&mut self, t: usize, hdr: &Header) {
        let mut ack = Header::new(MsgType::Received);
        (ack.namespace, ack.key, ack.chunk, ack.round) = (self.cfg.namespace, hdr.key, hdr.chunk, hdr.round);
        if let Some(c) = self.conns.get_mut(&t) {
            c.acks.extend_from_slice(&ack.encode());
        }
    }

    fn close(&mut self, t: usize, why: &str) {
        let who = self.who();
        let Some(mut c) = self.conns.remove(&t) else { return };
        if let Some(Dest { chunk, direct: true, parity, .. }) = c.rx.reset() {
            // The accumulator holds a partial push: rebuild it from the
            // pushes parked meanwhile (the next push overwrites it if none).
            let ch = &mut self.chunks[chunk];
            ch.direct_in_progress = false;
            let n = ch.elems;
            if let ChunkBuf::F32(b) = &mut ch.buf {
                for (i, d) in ch.deferred.drain(..).enumerate() {
                    let src: &[f32] = &cast(&d)[..n];
                    if i == 0 {
                        b[parity].copy_from_slice(src);
                    } else {
                        kernels::add_f32(&mut b[parity], src);
                    }
                    self.pool.push(d);
                }
            }
        }
        let peer = match c.rank {
            Some(r) => format!("worker {r} ({})", c.link.peer),
            None => c.link.peer.clone(),
        };
        if !why.is_empty() {
            log::warn!(target: &who, "closing connection from {peer}: {why}");
            // Best effort: tell the peer why, unless a frame is half-written.
            if c.tx.idle() {
                // A peer that has not authenticated learns nothing of the job.
                let authed = c.auth.is_done();
                let msg = match authed {
                    true => format!("server {} thread {}: {why}", self.cfg.server, self.cfg.thread),
                    false => why.to_string(),
                };
                let mut h = Header::new(MsgType::Error);
                h.namespace = if authed { self.cfg.namespace } else { 0 };
                h.payload_len = msg.len() as u32;
                c.link.write_last_words(&[&h.encode()[..], msg.as_bytes()].concat());
            }
        }
        c.tx.clear();
        c.link.deregister(self.poll.registry());
        if let Some(slot) = c.server {
            if self.links.get(&slot) == Some(&t) {
                self.links.remove(&slot);
            }
            if self.uplinks.get(&slot) == Some(&t) {
                self.uplinks.remove(&slot);
                // Rounds relayed there can never complete: their pushers are told.
                let stuck: Vec<usize> = (0..self.chunks.len())
                    .filter(|&i| {
                        self.chunks[i].upstream == Some(slot)
                            && self.index.contains_key(&(self.chunks[i].key, self.chunks[i].chunk))
                    })
                    .filter(|&i| self.chunks[i].forwarded || self.chunks[i].count > 0)
                    .collect();
                if !stuck.is_empty() {
                    let why = format!(
                        "the link to {}, which owns chunks this rack sums here first, closed{}",
                        c.link.peer,
                        if why.is_empty() { String::new() } else { format!(": {why}") }
                    );
                    self.fail_pushers(&stuck, &why);
                }
            }
        }
        if let Some(r) = c.rank {
            if self.worker_conn[r as usize] == Some(t) {
                self.worker_conn[r as usize] = None;
            }
        }
    }

    fn on_readable(&mut self, t: usize, drain: Drain) -> ConnResult {
        loop {
            let Some(conn) = self.conns.get_mut(&t) else { return Ok(()) };
            let chunks = &mut self.chunks;
            let scratch = &mut conn.scratch;
            let data = crate::protocol::data_payload_limit(self.cfg.partition_bytes);
            let limit = match (conn.auth.is_done(), conn.server) {
                // A snapshot: parameters and up to two moments.
                (true, Some(_)) => data.saturating_mul(3).saturating_add(8),
                (true, None) => data,
                (false, _) => auth::MAX_AUTH_PAYLOAD,
            };
            let frame = conn.link.read_frame(
                &mut conn.rx,
                limit,
                |d| {
                    if d.kind == PayloadKind::Upstream {
                        let p = d.parity;
                        match &mut chunks[d.chunk].buf {
                            ChunkBuf::F32(b) => &mut bytes_mut(&mut b[p])[..d.len],
                            ChunkBuf::Half { out, .. } => &mut bytes_mut(&mut out[p])[..d.len],
                            ChunkBuf::Exact(b) => &mut bytes_mut(&mut b[p])[..d.len],
                        }
                    } else if d.direct {
                        match &mut chunks[d.chunk].buf {
                            ChunkBuf::F32(b) => &mut bytes_mut(&mut b[d.parity])[..d.len],
                            // Never chosen: only f32 chunks are received directly.
                            ChunkBuf::Half { acc, .. } => &mut bytes_mut(acc)[..0],
                            ChunkBuf::Exact(b) => &mut bytes_mut(&mut b[d.parity])[..0],
                        }
                    } else {
                        &mut bytes_mut(scratch)[..d.len]
                    }
                },
                drain,
            )?;
            if frame.is_some() {
                conn.last_frame = Instant::now();
            }
            match frame {
                None => return Ok(()),
                Some(Frame::Header(hdr)) => self.on_header(t, hdr)?,
                // A chunk given up while its payload was being read: as if
                // the frame had come after (`drop_moved`).
                Some(Frame::Payload(hdr, d))
                    if d.kind != PayloadKind::Discard
                        && self.index.get(&(hdr.key, hdr.chunk)) != Some(&d.chunk)
                        && self.moved_away.contains(&(hdr.key, hdr.chunk)) =>
                {
                    if matches!(d.kind, PayloadKind::Push | PayloadKind::Replay | PayloadKind::Moved) {
                        self.ack_moved(t, &hdr);
                    }
                }
                Some(Frame::Payload(hdr, d)) => match d.kind {
                    PayloadKind::Push => self.on_push_complete(t, hdr, d.chunk, d.direct)?,
                    PayloadKind::Replay => self.replay(t, hdr, d.chunk, false)?,
                    PayloadKind::Restore => self.restore(t, hdr, d.chunk)?,
                    PayloadKind::Moved => self.ack_moved(t, &hdr),
                    PayloadKind::Upstream => self.relayed(d.chunk),
                    PayloadKind::Discard => {}
                },
                Some(Frame::Message(hdr, buf)) if !conn.auth.is_done() => {
                    let reply = conn.auth.on_frame(&self.cfg.secret.keys(), &hdr, &buf).map_err(auth_failed)?;
                    if let Some(r) = reply {
                        conn.acks.extend_from_slice(&r); // written by the flush after this read
                    }
                }
                Some(Frame::Message(hdr, buf)) => self.on_message(t, hdr, &buf)?,
            }
        }
    }

    /// A frame received whole (see `on_header`): an optimizer config, or
    /// replication from the server thread that owns the chunk.
    fn on_message(&mut self, t: usize, hdr: Header, buf: &[u8]) -> ConnResult {
        let from = self.conns.get(&t).and_then(|c| c.server);
        match hdr.msg_type {
            MsgType::OptConfig => {
                let cfg = OptConfig::decode(buf)?;
                let changed = self.opt_cfg.insert(hdr.key, cfg) != Some(cfg);
                if changed && from.is_none() {
                    // A worker's: our replicas of the key's chunks need it too.
                    let idxs = self.keys_here.get(&hdr.key).map(|k| k.1.clone()).unwrap_or_default();
                    let mut slots: Vec<u32> = idxs.iter().filter_map(|&i| self.chunks[i].replica).collect();
                    slots.sort_unstable();
                    slots.dedup();
                    for slot in slots {
                        self.send_to_replica(slot, replica::config_frame(self.cfg.namespace, hdr.key, &cfg));
                    }
                    // The owners of the chunks we relay apply it.
                    let mut owners: Vec<u32> = idxs.iter().filter_map(|&i| self.chunks[i].upstream).collect();
                    owners.sort_unstable();
                    owners.dedup();
                    for slot in owners {
                        let Some(&ut) = self.uplinks.get(&slot) else { continue };
                        if let Some(c) = self.conns.get_mut(&ut) {
                            c.notices.push_back(replica::config_frame(self.cfg.namespace, hdr.key, &cfg));
                        }
                        if let Err(why) = self.flush(ut) {
                            self.close(ut, &why.to_string());
                        }
                    }
                }
                Ok(())
            }
            MsgType::Replicate | MsgType::Snapshot => {
                let r = match hdr.msg_type {
                    MsgType::Replicate => self.replicas.apply(&hdr, buf, self.opt_cfg.get(&hdr.key)),
                    _ => self.replicas.restore(&hdr, buf),
                };
                r.map_err(|e| ConnError::Invalid(format!("replication from server thread slot {from:?}: {e}")))?;
                let mut ack = Header::new(MsgType::Received);
                (ack.namespace, ack.key, ack.chunk, ack.round) = (self.cfg.namespace, hdr.key, hdr.chunk, hdr.round);
                if let Some(c) = self.conns.get_mut(&t) {
                    c.acks.extend_from_slice(&ack.encode());
                }
                Ok(())
            }
            MsgType::Stall => Ok(()),
            other => Err(format!("internal: {other:?} received whole").into()),
        }
    }

    /// Our replica acked round `hdr.round` of a chunk: its held results go out.
    fn on_replica_ack(&mut self, hdr: &Header) {
        let Some(&idx) = self.index.get(&(hdr.key, hdr.chunk)) else { return };
        if self.chunks[idx].held.is_some_and(|(r, _)| r == hdr.round) {
            self.chunks[idx].held = None;
            self.send_results(idx);
        }
    }

    fn on_header(&mut self, t: usize, hdr: Header) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        if !conn.auth.is_done() {
            if !matches!(hdr.msg_type, MsgType::AuthHello | MsgType::AuthProof) {
                return Err(auth_failed(auth::AuthError::Failed("a frame before the authentication handshake")));
            }
            conn.rx.receive_owned(hdr);
            return Ok(());
        }
        if hdr.namespace != self.cfg.namespace {
            return Err(ProtocolError::WrongNamespace { got: hdr.namespace }.into());
        }
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        if conn.server.is_some() {
            return self.on_server_header(t, hdr);
        }
        match hdr.msg_type {
            MsgType::ServerHello => {
                if hdr.payload_len != 0 || conn.rank.is_some() {
                    return Err("a ServerHello with a payload, or after DataHello".into());
                }
                conn.server = Some(hdr.key);
                Ok(())
            }
            MsgType::DataHello => {
                let r = hdr.key;
                if hdr.payload_len != 0 {
                    return Err(format!("DataHello with a {}-byte payload", hdr.payload_len).into());
                }
                if conn.rank.is_some() {
                    return Err("second DataHello on one connection".into());
                }
                // Ranks after the workers' are other racks' relays (`HostLayout::relay_id`).
                if r >= self.cfg.num_workers + self.cfg.relays {
                    return Err(ConnError::Invalid(format!(
                        "worker rank {r} out of range (job has {} workers)",
                        self.cfg.num_workers
                    )));
                }
                if self.worker_conn[r as usize].is_some() {
                    return Err(ConnError::Invalid(format!("worker rank {r} is already connected")));
                }
                conn.rank = Some(r);
                self.worker_conn[r as usize] = Some(t);
                Ok(())
            }
            MsgType::Push | MsgType::PushRef | MsgType::Restore if self.moved_away.contains(&(hdr.key, hdr.chunk)) => {
                self.drop_moved(t, hdr)
            }
            MsgType::Push => {
                let (idx, _, kind) = self.check_push(t, &hdr)?;
                let ch = &self.chunks[idx];
                let zeros = hdr.flags & FLAG_ZEROS != 0;
                if zeros && hdr.flags & FLAG_INIT != 0 {
                    return Err(ConnError::Invalid(format!(
                        "tensor '{}' chunk {}: a push of zeros cannot carry initial parameters",
                        self.name(hdr.key),
                        hdr.chunk
                    )));
                }
                let want = if zeros { 0 } else { ch.elems * ch.dtype.size() };
                if hdr.payload_len as usize != want {
                    return Err(ConnError::Invalid(format!(
                        "tensor '{}' chunk {}: payload of {} bytes, expected {want}",
                        self.name(hdr.key),
                        hdr.chunk,
                        hdr.payload_len
                    )));
                }
                // Init rounds keep only one push (rank 0's), so nothing goes
                // straight in; nor into an adopted chunk, which a restored
                // result may complete at any time.
                let init = hdr.flags & FLAG_INIT != 0;
                let direct = ch.count == 0
                    && ch.dtype == DType::F32
                    && !ch.direct_in_progress
                    && !init
                    && !zeros
                    && !ch.adopted
                    && kind == PayloadKind::Push;
                let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
                if direct {
                    self.chunks[idx].direct_in_progress = true;
                } else if conn.scratch.len() * 4 < want {
                    if conn.scratch.is_empty() {
                        conn.scratch = self.pool.pop().unwrap_or_default();
                    }
                    conn.scratch.resize((self.cfg.partition_bytes as usize).div_ceil(4).max(want.div_ceil(4)), 0);
                }
                if want == 0 {
                    return match kind {
                        PayloadKind::Replay => self.replay(t, hdr, idx, false),
                        _ => self.on_push_complete(t, hdr, idx, direct),
                    };
                }
                let parity = (hdr.round & 1) as usize;
                conn.rx.receive_into(hdr, Dest { chunk: idx, direct, parity, len: want, kind });
                Ok(())
            }
            MsgType::Restore => {
                let gone = self.freed_set.contains(&hdr.key) && !self.index.contains_key(&(hdr.key, hdr.chunk));
                let (idx, kind) = match gone {
                    true => (0, PayloadKind::Discard),
                    false => (self.check_restore(t, &hdr)?, PayloadKind::Restore),
                };
                let want = hdr.payload_len as usize;
                let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
                if conn.scratch.len() * 4 < want {
                    if conn.scratch.is_empty() {
                        conn.scratch = self.pool.pop().unwrap_or_default();
                    }
                    conn.scratch.resize((self.cfg.partition_bytes as usize).div_ceil(4).max(want.div_ceil(4)), 0);
                }
                if want == 0 {
                    return if gone { Ok(()) } else { self.restore(t, hdr, idx) };
                }
                let parity = (hdr.round & 1) as usize;
                conn.rx.receive_into(hdr, Dest { chunk: idx, direct: false, parity, len: want, kind });
                Ok(())
            }
            MsgType::PushRef => {
                let (idx, rank, kind) = self.check_push(t, &hdr)?;
                if hdr.payload_len != 0 {
                    return Err(format!("PushRef with a {}-byte payload", hdr.payload_len).into());
                }
                if hdr.flags & FLAG_ZEROS != 0 {
                    return Err("PushRef flagged as zeros (only a Push may be)".into());
                }
                let local = self.cfg.local.get(rank as usize).copied().unwrap_or(false);
                let Some(st) = self.shm.get(&hdr.key).filter(|_| local).cloned() else {
                    return Err(ConnError::Invalid(format!(
                        "worker {rank} pushed tensor '{}' by reference, but does not share memory with this server",
                        self.name(hdr.key)
                    )));
                };
                let (ptr, len) = st.wire(hdr.chunk as usize, hdr.round);
                let ch = &self.chunks[idx];
                if len != ch.elems * ch.dtype.size() || !(ptr as usize).is_multiple_of(ch.dtype.size()) {
                    return Err(
                        format!("internal: shared chunk of {len} bytes at {ptr:?} for {} elements", ch.elems).into()
                    );
                }
                if kind == PayloadKind::Replay {
                    return self.replay(t, hdr, idx, true);
                }
                // The owner's chunk of this round in the segment, which it
                // leaves alone until our result comes back.
                self.add_push(t, hdr, idx, false, Some(ptr))
            }
            MsgType::OptConfig => {
                conn.rank.ok_or("OptConfig before DataHello")?;
                match self.keys_here.get(&hdr.key).map(|k| k.0) {
                    // Every chunk of it here moved away: the worker sends the
                    // config to the new servers too.
                    None if self.moved_away.iter().any(|&(k, _)| k == hdr.key) => return self.drop_moved(t, hdr),
                    None => {
                        return Err(ConnError::Invalid(format!(
                            "OptConfig for key {} which has no chunk on this thread",
                            hdr.key
                        )))
                    }
                    Some(DType::F32) => {}
                    Some(d) => {
                        return Err(ConnError::Invalid(format!(
                            "a server-side optimizer needs float32 tensors, key {} is {}",
                            hdr.key,
                            d.name()
                        )))
                    }
                }
                if hdr.payload_len as usize != crate::protocol::optim::OPT_CONFIG_LEN {
                    return Err(ConnError::Invalid(format!("OptConfig payload of {} bytes", hdr.payload_len)));
                }
                conn.rx.receive_owned(hdr);
                Ok(())
            }
            other => Err(format!("unexpected {other:?} frame on a data connection").into()),
        }
    }

    /// A frame from another server thread: on a link of ours, the replica's
    /// acks; on one it opened, what it replicates here.
    fn on_server_header(&mut self, t: usize, hdr: Header) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        let ours = conn.server.is_some_and(|s| self.links.get(&s) == Some(&t));
        let up = conn.server.filter(|s| self.uplinks.get(s) == Some(&t));
        match hdr.msg_type {
            MsgType::Received if ours && hdr.payload_len == 0 => {
                self.on_replica_ack(&hdr);
                Ok(())
            }
            // The owner received a push of ours: nothing to do (no credit here).
            MsgType::Received if up.is_some() && hdr.payload_len == 0 => Ok(()),
            MsgType::Result if up.is_some() => {
                let idx = self.index.get(&(hdr.key, hdr.chunk)).copied();
                let ch = idx.map(|i| &self.chunks[i]).filter(|c| c.upstream == up && c.forwarded);
                let Some(ch) = ch.filter(|c| c.round == hdr.round && c.dtype == hdr.dtype) else {
                    return Err(ConnError::Invalid(format!(
                        "a result for key {} chunk {} round {} that this thread did not push there",
                        hdr.key, hdr.chunk, hdr.round
                    )));
                };
                let want = ch.elems * ch.dtype.size();
                if hdr.payload_len as usize != want {
                    return Err(format!("a result of {} bytes, expected {want}", hdr.payload_len).into());
                }
                let (chunk, parity) = (idx.unwrap_or(0), (hdr.round & 1) as usize);
                if want == 0 {
                    self.relayed(chunk);
                    return Ok(());
                }
                let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
                let kind = PayloadKind::Upstream;
                conn.rx.receive_into(hdr, Dest { chunk, direct: false, parity, len: want, kind });
                Ok(())
            }
            // The owner waits for other racks: it says so in its own log.
            MsgType::Stall if up.is_some() => {
                conn.rx.receive_owned(hdr);
                Ok(())
            }
            MsgType::OptConfig | MsgType::Replicate | MsgType::Snapshot if !ours && up.is_none() => {
                if hdr.msg_type == MsgType::OptConfig
                    && hdr.payload_len as usize != crate::protocol::optim::OPT_CONFIG_LEN
                {
                    return Err(ConnError::Invalid(format!("OptConfig payload of {} bytes", hdr.payload_len)));
                }
                conn.rx.receive_owned(hdr);
                Ok(())
            }
            // Its last words as it closes (the job ended or failed): it says why itself.
            MsgType::Error => Err(ConnError::Read(ReadError::Closed)),
            other => Err(format!("unexpected {other:?} frame from another server thread").into()),
        }
    }

    /// Checks common to both kinds of push; returns the chunk's index, the
    /// pusher, and whether it is a contribution or a replay (adopted chunks).
    fn check_push(&mut self, t: usize, hdr: &Header) -> Result<(usize, u32, PayloadKind), ConnError> {
        let (idx, rank) = self.chunk_of(t, hdr)?;
        let ch = &mut self.chunks[idx];
        if !ch.known {
            (ch.round, ch.known) = (hdr.round, true);
        }
        let ch = &self.chunks[idx];
        if ch.adopted && hdr.round != ch.round && ch.done == Some(hdr.round) && ch.pushers.contains(&rank) {
            return Ok((idx, rank, PayloadKind::Replay));
        }
        let name = self.name(hdr.key);
        if hdr.dtype != ch.dtype {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: dtype {} but it was declared {}",
                hdr.chunk,
                hdr.dtype.name(),
                ch.dtype.name()
            )));
        }
        if hdr.round != ch.round {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: push for round {} but the chunk is at round {}",
                hdr.chunk, hdr.round, ch.round
            )));
        }
        if !ch.pushers.contains(&rank) {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: worker {rank} pushed, but worker {} pushes it for that host",
                hdr.chunk,
                self.cfg.layout.owner(rank, hdr.key, hdr.chunk)
            )));
        }
        if ch.pushed[rank as usize] {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: worker {rank} pushed twice in round {}",
                hdr.chunk, ch.round
            )));
        }
        if let Some(why) = self.never_completes(ch) {
            return Err(ConnError::Invalid(why));
        }
        // (Zeros or data is each pusher's own business.)
        if ch.count > 0 && hdr.flags & !FLAG_ZEROS != ch.flags {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}': workers disagree on the round's flags (average/init) in round {}",
                ch.round
            )));
        }
        if hdr.flags & FLAG_INIT != 0 && ch.dtype != DType::F32 {
            return Err(ConnError::Invalid(format!("tensor '{name}': parameter initialization needs float32")));
        }
        if hdr.flags & FLAG_AVERAGE != 0 && ch.dtype.is_integer() {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}': {} is summed exactly; workers average integers themselves",
                ch.dtype.name()
            )));
        }
        // A relay has no optimizer state: the owner applies the optimizer.
        if hdr.flags & FLAG_INIT == 0 && ch.opt.is_none() && ch.upstream.is_none() && self.opt_cfg.contains_key(&ch.key)
        {
            return Err(ConnError::Invalid(self.no_parameters(ch)));
        }
        Ok((idx, rank, PayloadKind::Push))
    }

    /// The chunk a data frame names (owned by this thread), and its sender.
    fn chunk_of(&self, t: usize, hdr: &Header) -> Result<(usize, u32), ConnError> {
        let conn = self.conns.get(&t).ok_or("internal: no connection")?;
        let rank = conn.rank.ok_or("Push before DataHello")?;
        let &idx = self.index.get(&(hdr.key, hdr.chunk)).ok_or_else(|| {
            format!("key {} chunk {} is not owned by this server thread (undeclared or misrouted)", hdr.key, hdr.chunk)
        })?;
        Ok((idx, rank))
    }

    /// Checks on a restored result; returns the chunk's index.
    fn check_restore(&self, t: usize, hdr: &Header) -> Result<usize, ConnError> {
        let (idx, rank) = self.chunk_of(t, hdr)?;
        let ch = &self.chunks[idx];
        let name = self.name(hdr.key);
        let want = ch.elems * ch.dtype.size();
        if !ch.adopted {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: a restored result for a chunk this server did not take over",
                hdr.chunk
            )));
        }
        if !ch.pushers.contains(&rank) || hdr.dtype != ch.dtype || hdr.payload_len as usize != want {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: restored result from worker {rank} of {} bytes of {}, expected \
                 {want} bytes of {} from one of workers {:?}",
                hdr.chunk,
                hdr.payload_len,
                hdr.dtype.name(),
                ch.dtype.name(),
                ch.pushers
            )));
        }
        if ch.known && hdr.round > ch.round {
            return Err(ConnError::Invalid(format!(
                "tensor '{name}' chunk {}: restored result of round {} but the chunk is at round {}",
                hdr.chunk, hdr.round, ch.round
            )));
        }
        if self.opt_cfg.contains_key(&ch.key) {
            // New parameters cannot stand in for the optimizer state that made them.
            if ch.opt.is_none() {
                return Err(ConnError::Invalid(self.no_parameters(ch)));
            }
            if ch.known && hdr.round == ch.round {
                return Err(ConnError::Invalid(format!(
                    "tensor '{name}' chunk {}: worker {rank} restored round {} of a server-side optimizer, which \
                     its replica never had",
                    hdr.chunk, hdr.round
                )));
            }
        }
        Ok(idx)
    }

    /// A restored result of round s (in the connection's scratch buffer):
    /// it sets an adopted chunk's round, completes round s if it is the
    /// one being summed, or is kept for replays of round s; older ones are
    /// stale (every worker had them).
    fn restore(&mut self, t: usize, hdr: Header, idx: usize) -> ConnResult {
        let conn = self.conns.get(&t).ok_or("internal: no connection")?;
        let ch = &mut self.chunks[idx];
        let s = hdr.round;
        let completes = !ch.known || s == ch.round;
        if !completes && (s.wrapping_add(1) != ch.round || ch.done == Some(s)) {
            return Ok(());
        }
        let parity = (s & 1) as usize;
        let n = ch.elems;
        let src = &bytes(&conn.scratch)[..n * ch.dtype.size()];
        match &mut ch.buf {
            ChunkBuf::F32(b) => bytes_mut(&mut b[parity]).copy_from_slice(src),
            ChunkBuf::Half { out, .. } => bytes_mut(&mut out[parity]).copy_from_slice(src),
            ChunkBuf::Exact(b) => bytes_mut(&mut b[parity])[..src.len()].copy_from_slice(src),
        }
        ch.done = Some(s);
        if !completes {
            return Ok(());
        }
        (ch.round, ch.known) = (s, true);
        ch.priority = ch.priority.max(hdr.priority);
        self.send_results(idx);
        Ok(())
    }

    /// A push of round `hdr.round`, already complete here: answer it with
    /// the result (the payload, received into scratch, is not needed).
    fn replay(&mut self, t: usize, hdr: Header, idx: usize, by_ref: bool) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        self.seq += 1;
        let priority = hdr.priority;
        conn.results.push(TxItem { priority, seq: self.seq, chunk: idx, round: hdr.round, by_ref, push: false });
        self.flush(t)
    }

    /// Why a chunk's current round can never complete: a pusher that has
    /// not pushed it left the job. (A worker leaves with nothing in flight,
    /// so every round it took part in is complete.)
    fn never_completes(&self, ch: &Chunk) -> Option<String> {
        let gone = ch.pushers.iter().find(|&&p| self.left[p as usize] && !ch.pushed[p as usize])?;
        Some(format!(
            "worker {gone} has left the job (it shut down or exited), so tensor '{}' round {} can never complete: \
             every worker must run the same collective operations",
            self.name(ch.key),
            ch.round
        ))
    }

    /// Worker `rank` left: the workers that pushed a round it never will
    /// are told why (their connections close, which fails their job).
    fn on_left(&mut self, rank: u32) {
        let Some(l) = self.left.get_mut(rank as usize) else { return };
        *l = true;
        let mut close: Vec<(usize, String)> = Vec::new();
        for ch in self.chunks.iter().filter(|c| c.count > 0) {
            if let Some(why) = self.never_completes(ch) {
                for (r, _) in ch.pushed.iter().enumerate().filter(|(_, &p)| p) {
                    if let Some(t) = self.worker_conn[r] {
                        if !close.iter().any(|(c, _)| *c == t) {
                            close.push((t, why.clone()));
                        }
                    }
                }
            }
        }
        for (t, why) in close {
            self.close(t, &why);
        }
    }

    /// Why a chunk of a tensor with a server-side optimizer has no state here.
    fn no_parameters(&self, ch: &Chunk) -> String {
        let why = match ch.adopted {
            true => {
                "its server was lost and the state had no replica (failover off, no other server, or the \
                     replica was lost too)"
            }
            false => "no initial parameters were pushed (an init round) before the first gradient",
        };
        format!(
            "tensor '{}' chunk {}: its server-side optimizer has no parameters on server {}: {why}",
            self.name(ch.key),
            ch.chunk,
            self.cfg.server
        )
    }

    fn name(&self, key: u32) -> &str {
        self.names.get(&key).map(String::as_str).unwrap_or("?")
    }

    fn on_push_complete(&mut self, t: usize, hdr: Header, idx: usize, direct: bool) -> ConnResult {
        self.add_push(t, hdr, idx, direct, None)
    }

    /// Add a push to its chunk's sum: from `shared` (by reference), else
    /// from the connection's scratch buffer, or already in place (`direct`).
    fn add_push(&mut self, t: usize, hdr: Header, idx: usize, direct: bool, shared: Option<*const u8>) -> ConnResult {
        let conn = self.conns.get_mut(&t).ok_or("internal: no connection")?;
        let rank = conn.rank.ok_or("internal: no rank")? as usize;
        let ch = &mut self.chunks[idx];
        let parity = (hdr.round & 1) as usize;
        let n = ch.elems;
        let first = ch.count == 0;
        let init = hdr.flags & FLAG_INIT != 0;
        // A push of zeros adds nothing; as the first, it clears the sum.
        let zeros = hdr.flags & FLAG_ZEROS != 0;
        let src: *const u8 = match shared {
            Some(p) => p,
            // Unused when direct; else the push was received into it.
            None => conn.scratch.as_ptr().cast(),
        };
        if shared.is_none() && !direct && !zeros && conn.scratch.len() * 4 < n * ch.dtype.size() {
            return Err("internal: push data missing".into());
        }
        // SAFETY: n elements, aligned (checked for shared chunks; scratch is
        // u32); only called when the push's data is there (not `direct`).
        let f32s = || unsafe { std::slice::from_raw_parts(src.cast::<f32>(), n) };
        let u16s = || unsafe { std::slice::from_raw_parts(src.cast::<u16>(), n) };
        match &mut ch.buf {
            // (While a first push is still arriving straight into the sum, that push sets it.)
            _ if zeros && (!first || ch.direct_in_progress) => {}
            ChunkBuf::F32(b) if zeros => b[parity][..n].fill(0.0),
            ChunkBuf::Half { acc, .. } if zeros => acc[..n].fill(0.0),
            ChunkBuf::Exact(b) if zeros => bytes_mut(&mut b[parity])[..n * ch.dtype.size()].fill(0),
            ChunkBuf::F32(b) if init => {
                if rank as u32 == ch.init_from {
                    b[parity].copy_from_slice(f32s());
                }
            }
            ChunkBuf::F32(b) => {
                if direct {
                    ch.direct_in_progress = false;
                    for d in ch.deferred.drain(..) {
                        kernels::add_f32(&mut b[parity], &cast(&d)[..n]);
                        self.pool.push(d);
                    }
                } else if ch.direct_in_progress {
                    // The accumulator is still being filled from the network.
                    let parked = match shared {
                        Some(_) => {
                            let mut v = self.pool.pop().unwrap_or_default();
                            v.resize(n, 0);
                            bytes_mut(&mut v)[..n * 4].copy_from_slice(bytes(f32s()));
                            v
                        }
                        None => std::mem::take(&mut conn.scratch),
                    };
                    ch.deferred.push(parked);
                } else if first {
                    b[parity].copy_from_slice(f32s());
                } else {
                    kernels::add_f32(&mut b[parity], f32s());
                }
            }
            ChunkBuf::Half { acc, .. } => {
                let src = u16s();
                match (ch.dtype, first) {
                    (DType::F16, true) => kernels::widen_f16(acc, src),
                    (DType::F16, false) => kernels::add_f16(acc, src),
                    (_, true) => kernels::widen_bf16(acc, src),
                    (_, false) => kernels::add_bf16(acc, src),
                }
            }
            ChunkBuf::Exact(b) => {
                let len = n * ch.dtype.size();
                // SAFETY: the push's len bytes (any alignment: read as bytes).
                let src = unsafe { std::slice::from_raw_parts(src, len) };
                let acc = &mut bytes_mut(&mut b[parity])[..len];
                match first {
                    true => acc.copy_from_slice(src),
                    false => kernels::add_exact(ch.dtype, acc, src),
                }
            }
        }
        if first {
            ch.started = Some(Instant::now());
            ch.first = rank as u32;
            ch.flags = hdr.flags & !FLAG_ZEROS;
            ch.priority = hdr.priority;
        }
        ch.priority = ch.priority.max(hdr.priority);
        ch.pushed[rank] = true;
        ch.by_ref[rank] = shared.is_some();
        ch.count += 1;
        // The last push of a round is answered by the result itself (one
        // frame and one wake-up fewer on a small round trip).
        let pushers = ch.pushers.len() as u32;
        if ch.count < pushers {
            let mut ack = Header::new(MsgType::Received);
            ack.namespace = self.cfg.namespace;
            ack.key = hdr.key;
            ack.chunk = hdr.chunk;
            ack.round = hdr.round;
            conn.acks.extend_from_slice(&ack.encode());
        }
        if ch.count == pushers {
            let waited = ch.started.map(|t| (t, Instant::now(), ch.round));
            match ch.upstream {
                Some(slot) => self.forward(idx, slot),
                None => self.finish_round(idx),
            }
            if let (Some(tl), Some((first_push, last_push, round))) = (&self.cfg.timeline, waited) {
                let ch = &self.chunks[idx];
                tl.round(&crate::timeline::Round {
                    thread: self.cfg.thread,
                    tensor: self.names.get(&ch.key).map_or("?", String::as_str),
                    chunk: ch.chunk,
                    round,
                    bytes: ch.elems * ch.dtype.size(),
                    first_push,
                    last_push,
                    first: ch.first,
                    last: rank as u32,
                    finished: Instant::now(),
                });
            }
        }
        Ok(())
    }

    /// Every pusher of a round we relay pushed: push the rack's sum to the
    /// chunk's owner at `slot` (16-bit sums rounded once more, to travel in
    /// the tensor's dtype); its result completes the round (`relayed`).
    fn forward(&mut self, idx: usize, slot: u32) {
        let ch = &mut self.chunks[idx];
        let parity = (ch.round & 1) as usize;
        if let ChunkBuf::Half { acc, out } = &mut ch.buf {
            match ch.dtype {
                DType::F16 => kernels::narrow_f16(&mut out[parity], acc, 1.0),
                _ => kernels::narrow_bf16(&mut out[parity], acc, 1.0),
            }
        }
        // From now on the round waits for the owner, whose stall reports are its own.
        (ch.forwarded, ch.started) = (true, None);
        self.cfg.traffic.relay();
        let (priority, round) = (ch.priority, ch.round);
        let (key, chunk) = (ch.key, ch.chunk);
        let Some(&t) = self.uplinks.get(&slot) else {
            let why = format!(
                "tensor '{}' chunk {chunk}: this rack's sum cannot reach the chunk's owner (server thread slot {slot}): no link",
                self.name(key)
            );
            return self.fail_pushers(&[idx], &why);
        };
        self.seq += 1;
        if let Some(c) = self.conns.get_mut(&t) {
            c.results.push(TxItem { priority, seq: self.seq, chunk: idx, round, by_ref: false, push: true });
        }
        if let Err(why) = self.flush(t) {
            self.close(t, &why.to_string());
        }
    }

    /// The owner's result of a round we relayed arrived (into the round's
    /// result buffer): it is the round's result here too.
    fn relayed(&mut self, idx: usize) {
        let ch = &mut self.chunks[idx];
        ch.forwarded = false;
        ch.done = Some(ch.round);
        self.send_results(idx);
    }

    /// Close the connections of the workers that pushed these chunks' rounds, telling them why.
    fn fail_pushers(&mut self, idxs: &[usize], why: &str) {
        let mut tokens: Vec<usize> = Vec::new();
        for &idx in idxs {
            let ch = &self.chunks[idx];
            for (r, _) in ch.pushed.iter().enumerate().filter(|(_, &p)| p) {
                tokens.extend(self.worker_conn.get(r).copied().flatten());
            }
        }
        tokens.sort_unstable();
        tokens.dedup();
        for t in tokens {
            self.close(t, why);
        }
    }

    /// Every pusher pushed: finalize and send the result to each of them.
    fn finish_round(&mut self, idx: usize) {
        let nw = self.cfg.num_workers;
        let ch = &mut self.chunks[idx];
        self.cfg.traffic.add((ch.elems * ch.dtype.size() * ch.pushers.len()) as u64);
        let parity = (ch.round & 1) as usize;
        let scale = if ch.flags & FLAG_AVERAGE != 0 { 1.0 / nw as f32 } else { 1.0 };
        let opt = self.opt_cfg.get(&ch.key);
        let (ns, at) = (self.cfg.namespace, (ch.key, ch.chunk, ch.round));
        // What the replica must apply too (see `super::replica`).
        let mut forward = None;
        match &mut ch.buf {
            ChunkBuf::F32(b) if ch.flags & FLAG_INIT != 0 => {
                // New parameters (rank 0's); fresh optimizer state.
                ch.opt = Some(Box::new(OptState::new(&b[parity])));
                forward = ch.replica.map(|s| (s, replica::replicate_frame(ns, at, FLAG_INIT, &b[parity])));
            }
            ChunkBuf::F32(b) => {
                if scale != 1.0 {
                    kernels::scale_f32(&mut b[parity], scale);
                }
                // Server-side optimizer: the result is the updated parameters.
                if let (Some(cfg), Some(state)) = (opt, ch.opt.as_mut()) {
                    forward = ch.replica.map(|s| (s, replica::replicate_frame(ns, at, 0, &b[parity])));
                    state.update(cfg, &b[parity]);
                    b[parity].copy_from_slice(&state.param);
                }
            }
            ChunkBuf::Half { acc, out } => match ch.dtype {
                DType::F16 => kernels::narrow_f16(&mut out[parity], acc, scale),
                _ => kernels::narrow_bf16(&mut out[parity], acc, scale),
            },
            // Integers are never averaged here (refused in check_push).
            ChunkBuf::Exact(b) if ch.dtype == DType::F64 && scale != 1.0 => {
                kernels::scale_f64(bytes_mut(&mut b[parity]), 1.0 / nw as f64)
            }
            ChunkBuf::Exact(_) => {}
        }
        ch.done = Some(ch.round);
        if ch.stall_reported {
            let name = self.names.get(&ch.key).map(String::as_str).unwrap_or("?");
            // Formatted here only: this function runs for every chunk of every round.
            let who = format!("server {}/t{}", self.cfg.server, self.cfg.thread);
            log::info!(
                target: &who,
                "stall resolved: tensor '{name}' chunk {} round {} complete",
                ch.chunk,
                ch.round
            );
        }
        if let Some((slot, frame)) = forward {
            ch.held = Some((ch.round, Instant::now()));
            self.send_to_replica(slot, frame);
            return;
        }
        self.send_results(idx);
    }

    /// The chunk's round is complete (its result in the round's parity
    /// buffer): start the next one, send the result to the round's pushers.
    fn send_results(&mut self, idx: usize) {
        let ch = &mut self.chunks[idx];
        let (round, priority) = (ch.round, ch.priority);
        ch.round = ch.round.wrapping_add(1);
        ch.count = 0;
        ch.started = None;
        ch.stall_reported = false;
        for i in 0..self.chunks[idx].pushers.len() {
            let r = self.chunks[idx].pushers[i] as usize;
            // A restored result completes a round some pushers had not pushed.
            if !self.chunks[idx].pushed[r] {
                continue;
            }
            let Some(t) = self.worker_conn[r] else { continue };
            self.seq += 1;
            let by_ref = self.chunks[idx].by_ref[r];
            if let Some(c) = self.conns.get_mut(&t) {
                c.results.push(TxItem { priority, seq: self.seq, chunk: idx, round, by_ref, push: false });
            }
            if let Err(why) = self.flush(t) {
                self.close(t, &why.to_string());
            }
        }
        self.chunks[idx].pushed.iter_mut().for_each(|p| *p = false);
    }

    /// Write acks, then notices, then results in priority order, until done
    /// or the socket is full.
    fn flush(&mut self, t: usize) -> ConnResult {
        let Some(conn) = self.conns.get_mut(&t) else { return Ok(()) };
        let chunks = &self.chunks;
        let shm = &self.shm;
        let ns = self.cfg.namespace;
        let (acks, notices, results) = (&mut conn.acks, &mut conn.notices, &mut conn.results);
        let next = || {
            if !acks.is_empty() {
                return Some(Outgoing::encoded(Carry::Encoded, std::mem::take(acks)));
            }
            if let Some(n) = notices.pop_front() {
                return Some(Outgoing::encoded(Carry::Encoded, n));
            }
            let item = results.pop()?;
            let ch = &chunks[item.chunk];
            let parity = (item.round & 1) as usize;
            let mut h = Header {
                msg_type: if item.push { MsgType::Push } else { MsgType::Result },
                flags: if item.push { ch.flags } else { 0 },
                dtype: ch.dtype,
                namespace: ns,
                key: ch.key,
                chunk: ch.chunk,
                round: item.round,
                priority: item.priority,
                payload_len: (ch.elems * ch.dtype.size()) as u32,
            };
            if item.by_ref {
                if let Some(st) = shm.get(&ch.key) {
                    let src = ch.result_bytes(parity);
                    let (dst, len) = st.result(ch.chunk as usize);
                    // SAFETY: the pusher's chunk of this round in the segment:
                    // it waits for this frame before touching it again.
                    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len.min(src.len())) };
                    h.msg_type = MsgType::ResultRef;
                    h.payload_len = 0;
                    return Some(Outgoing::encoded(Carry::Encoded, h.encode().to_vec()));
                }
            }
            Some(Outgoing::frame(Carry::Result { chunk: item.chunk, parity }, &h))
        };
        let payload = |c: &Carry| match *c {
            Carry::Result { chunk, parity } => chunks[chunk].result_bytes(parity),
            Carry::Encoded => &[],
        };
        conn.link.pump(self.poll.registry(), &mut conn.tx, next, payload)?;
        Ok(())
    }

    /// Close connections that never said who they are, or stopped in the
    /// middle of a frame, for longer than the peer timeout.
    fn close_idle(&mut self) {
        let limit = self.cfg.peer_timeout;
        let late: Vec<(usize, String)> = self
            .conns
            .iter()
            .filter_map(|(&t, c)| {
                if c.rank.is_none() && c.server.is_none() && c.accepted.elapsed() > limit {
                    Some((t, format!("no DataHello within {:.1}s", limit.as_secs_f64())))
                } else if c.rx.in_frame() && c.last_frame.elapsed() > limit {
                    Some((t, format!("a frame stalled half-received for over {:.1}s", limit.as_secs_f64())))
                } else {
                    None
                }
            })
            .collect();
        for (t, why) in late {
            self.close(t, &why);
        }
    }

    /// Results held for a replica's ack that never came (its link broke and
    /// no failover gave the chunk another within 3 peer timeouts): the
    /// job cannot go on safely, so every worker here is told why.
    fn check_held(&mut self) {
        let limit = self.cfg.peer_timeout * 3;
        let Some(ch) = self.chunks.iter().find(|c| c.held.is_some_and(|(_, since)| since.elapsed() > limit)) else {
            return;
        };
        let why = format!(
            "tensor '{}' chunk {} round {}: its replica (server thread slot {}) has not acknowledged the round's \
             optimizer update for {:.1}s, and no failover came",
            self.name(ch.key),
            ch.chunk,
            ch.round,
            ch.replica.map_or("none".to_string(), |s| s.to_string()),
            limit.as_secs_f64()
        );
        self.chunks.iter_mut().for_each(|c| c.held = None);
        let workers: Vec<usize> = self.conns.iter().filter(|(_, c)| c.rank.is_some()).map(|(&t, _)| t).collect();
        for t in workers {
            self.close(t, &why);
        }
    }

    /// Report rounds that have waited too long: which ranks did not push.
    fn check_stalls(&mut self) {
        let now = Instant::now();
        // (key, round) -> (chunk indices, missing ranks, waited)
        let mut by_key: HashMap<(u32, u32), StalledRound> = HashMap::new();
        for (i, ch) in self.chunks.iter_mut().enumerate() {
            // A held round waits for its replica, not for a worker (`check_held`).
            let Some(start) = ch.started.filter(|_| ch.held.is_none()) else { continue };
            let waited = now - start;
            if ch.stall_reported || waited < self.cfg.stall {
                continue;
            }
            ch.stall_reported = true;
            let e = by_key.entry((ch.key, ch.round)).or_insert_with(|| (Vec::new(), Vec::new(), waited));
            e.0.push(i);
            for &r in &ch.pushers {
                if !ch.pushed[r as usize] && !e.1.contains(&r) {
                    e.1.push(r);
                }
            }
        }
        for ((key, round), (idxs, mut missing, waited)) in by_key {
            missing.sort_unstable();
            let name = self.names.get(&key).cloned().unwrap_or_default();
            // Pushers after the workers are other racks' relays (`HostLayout::relay_id`).
            let nw = self.cfg.num_workers;
            let relays: Vec<u32> = missing.iter().filter(|&&r| r >= nw).map(|&r| r - nw).collect();
            let workers: Vec<u32> = missing.iter().copied().filter(|&r| r < nw).collect();
            let also = match relays.is_empty() {
                true => String::new(),
                false => format!(" and the rack relays at server thread slot(s) {relays:?}"),
            };
            log::warn!(
                target: &self.who(),
                "stall: tensor '{name}' (key {key}) round {round} has waited {:.1}s for worker rank(s) {workers:?}{also} ({} chunk(s) on this thread)",
                waited.as_secs_f64(),
                idxs.len()
            );
            let first = &self.chunks[idxs[0]];
            let payload = encode_stall(self.cfg.server, self.cfg.thread, waited.as_millis() as u64, &missing);
            let mut h = Header::new(MsgType::Stall);
            h.namespace = self.cfg.namespace;
            h.key = key;
            h.chunk = first.chunk;
            h.round = round;
            h.payload_len = payload.len() as u32;
            let pushed: Vec<usize> = first.pushed.iter().enumerate().filter(|(_, &p)| p).map(|(r, _)| r).collect();
            let frame = [&h.encode()[..], &payload].concat();
            for r in pushed {
                let Some(t) = self.worker_conn[r] else { continue };
                if let Some(c) = self.conns.get_mut(&t) {
                    c.notices.push_back(frame.clone());
                }
                if let Err(why) = self.flush(t) {
                    self.close(t, &why.to_string());
                }
            }
        }
    }
}
