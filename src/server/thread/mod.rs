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
//! chunk is read from the host's shared segment (`crate::host::SharedTensor`)
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
//!
//! Where things are: this file has the thread, its commands and its event
//! loop; `conns` accepts, reads and closes connections; `validate` turns a
//! frame's header into a typed `Command` (or refuses it), `apply` carries
//! it out; `round` is a chunk's round state machine and `sum` its buffers;
//! `relay` is the links to other server threads (rack relays, replicas);
//! `accumulation` adds a chunk's pushes in rank order when the job's sums
//! must be deterministic (`GRADHUB_DETERMINISTIC`); `ownership` installs,
//! releases, gives up and adopts chunks (and restores and replays for
//! adopted ones); `flush` finishes rounds and queues and
//! writes results, acks and notices, and watches for stalls.

mod accumulation;
mod apply;
mod asynchronous;
mod conns;
mod delta;
mod flush;
mod ownership;
mod relay;
mod relink;
mod round;
mod sum;
mod validate;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};

use super::replica::Replicas;
use crate::host::SharedTensor;
use crate::placement::HostLayout;
use crate::protocol::auth::Secret;
use crate::protocol::{DType, OptConfig, ReadError, TensorSpec, FLAG_LEAVING};
use crate::transport::{AcceptErrors, ConnError, Drain};
use conns::Conn;
use sum::Chunk;

pub const LISTENER: Token = Token(0);
pub const WAKER: Token = Token(1);
const FIRST_CONN: usize = 2;

/// What a link this thread opened to another server thread is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum LinkTo {
    /// The slot replicating our chunks' optimizer state (ServerHello sent).
    Replica,
    /// The owner of chunks we relay for our rack (DataHello sent).
    Owner,
}

/// A link to another server thread: its slot, the stream (none: it could
/// not be reached), what it is for, and who serves it.
pub type NewLink = (u32, Option<crate::transport::Authed>, LinkTo, String);

pub enum ThreadCmd {
    /// Install specs; the chunks whose slot is this thread's become ours
    /// (adopted from a lost server if the flag is set), and so do those we
    /// relay for our rack. With the tensors' shared segments when workers
    /// on this host push by reference, and new links (authenticated and
    /// introduced) to other server threads, by slot, with who serves it
    /// (no stream: an owner that could not be reached).
    Declare(Vec<TensorSpec>, bool, Vec<(u32, Arc<SharedTensor>)>, Vec<NewLink>, Sender<()>),
    /// Every worker released these tensors (keys): free their chunks.
    Release(Vec<u32>),
    /// Chunks move to a server that joined (`scheduler::failover::take_in`):
    /// give up each of ours these specs place elsewhere, unless it has a
    /// server-side optimizer; answer with the (key, chunk) pairs kept.
    GiveUp(Vec<TensorSpec>, Sender<Vec<(u32, u32)>>),
    Stop,
    /// Worker `rank` left the job cleanly while others go on.
    Left(u32),
    /// The job failed, or this server is out of it (written off, its
    /// scheduler lost): tell every connected worker why, then exit.
    Abort(String),
    /// A link to the replica at this slot, dialled again (`relink`).
    Relinked(u32, crate::transport::Authed, String),
}

pub use relink::Relink;

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
    /// A connection that has not authenticated and said DataHello, or has
    /// sent part of a frame and nothing more, for this long is closed (a
    /// broken or hostile peer must not hold a connection forever). The job's
    /// peer timeout, which also bounds the scheduler's handshakes.
    pub peer_timeout: Duration,
    /// The job's token, which every connecting worker must prove.
    pub secret: Secret,
    /// What this server's threads summed (a shared service reports it).
    pub traffic: Arc<super::Traffic>,
    pub timeline: Option<Arc<crate::timeline::Trace>>,
    /// In what order pushes are added (`GRADHUB_DETERMINISTIC`, `accumulation`).
    pub sum_order: crate::sum_order::SumOrder,
    /// Synchronous rounds, or asynchronous chunks (`delta`).
    pub training: crate::training::Training,
    /// How to dial a broken replica link again (None: never).
    pub relink: Option<Relink>,
}

pub struct ServerThread {
    cfg: ThreadConfig,
    poll: Poll,
    listener: TcpListener,
    cmds: Receiver<ThreadCmd>,
    conns: HashMap<usize, Conn>,
    next_token: usize,
    /// Flags of the Error frames sent as connections close (`FLAG_LEAVING`
    /// once this server is out of the job).
    farewell: u16,
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
    shm: HashMap<u32, Arc<SharedTensor>>,
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
    /// Who serves each owner slot we relay to, for messages once its link is gone.
    owners: HashMap<u32, String>,
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
            farewell: 0,
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
            owners: HashMap::new(),
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

    fn name(&self, key: u32) -> &str {
        self.names.get(&key).map(String::as_str).unwrap_or("?")
    }

    pub fn run(mut self) {
        let mut events = Events::with_capacity(256);
        let tick = crate::waits::tick(self.cfg.stall, self.cfg.peer_timeout);
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
                            // Not the peer's doing: its link changed a frame. No
                            // last words, and a reset, so the peer mends the link
                            // (a worker re-dials and re-sends; a server thread
                            // whose replica link this is dials it again) instead
                            // of failing the job or taking it for a clean end.
                            Err(why) if why.changed_on_the_way() => {
                                let peer = self.conns.get(&t).map(|c| c.describe()).unwrap_or_default();
                                log::warn!(target: &self.who(), "closing connection from {peer}: {why}");
                                if let Some(c) = self.conns.get(&t) {
                                    c.link.reset_on_close();
                                }
                                self.close_broken(t, &why.to_string());
                            }
                            Err(why) => self.close(t, &why.to_string()),
                        }
                    }
                }
            }
            while let Ok(cmd) = self.cmds.try_recv() {
                if !self.on_cmd(cmd) {
                    return;
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

    /// Carry out a command of the control thread; false: the thread exits.
    fn on_cmd(&mut self, cmd: ThreadCmd) -> bool {
        match cmd {
            ThreadCmd::Declare(specs, adopt, shm, links, ack) => {
                for (slot, stream, to, name) in links {
                    if to == LinkTo::Owner {
                        self.owners.insert(slot, name.clone());
                    }
                    if let Some(stream) = stream {
                        self.add_link(slot, stream, to, &name);
                    }
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
            ThreadCmd::Stop => return false,
            ThreadCmd::Left(rank) => self.on_left(rank),
            ThreadCmd::Relinked(slot, stream, name) => self.relinked(slot, stream, &name),
            ThreadCmd::Abort(why) => {
                self.cfg.relink = None; // nothing to mend any more
                                        // This server goes: the scheduler, not it, tells the workers
                                        // what next (a failover, or the job's failure).
                self.farewell = FLAG_LEAVING;
                let tokens: Vec<usize> = self.conns.keys().copied().collect();
                for t in tokens {
                    self.close(t, &why);
                }
                return false;
            }
        }
        true
    }
}
