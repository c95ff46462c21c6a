//! The worker client (BytePS's Communication Service, in the training
//! process): joins the job, opens one data connection per server thread,
//! declares tensors, and runs push_pull through the I/O thread.
//!
//! Threads: the caller's thread (submits, waits on handles), one I/O thread
//! (all data connections, see `io`), one control thread (scheduler messages:
//! declarations, barriers, peer failures) and a heartbeat thread. Workers
//! that share a host sum there first (`host`).

mod io;
mod op;

pub use op::{Callback, Op, OpError};

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender};
use mio::Poll;

use crate::host::HostStage;
use crate::placement::HostLayout;
use crate::protocol::auth::Secret;
use crate::protocol::{Control, DType, DeclEntry, MsgType, Register, Role, ServerInfo, TensorSpec, NO_SERVER};
use crate::session::{Joining, Session, SessionError, SessionSender};
use crate::transport::{connect_authenticated, join_host_port};
use io::{BufPtr, Io, IoThread, Submission};

#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub scheduler: String,
    pub rank: i32,
    pub num_workers: u32,
    pub num_servers: u32,
    pub namespace: u32,
    /// Max bytes in flight per server-thread connection.
    pub credit_bytes: usize,
    /// How many bytes, in the job-wide order, may stand between the next
    /// chunk this worker sends and its oldest one not yet received by its
    /// server (`io::Spread`). None: `SPREAD_CREDITS` x the credit (and it
    /// follows `set_credit`); Some(0): no limit.
    pub spread_bytes: Option<usize>,
    pub connect_timeout: Duration,
    /// This worker's local rank and the number of workers on its host, as
    /// the launcher says (-1: not given, the scheduler assigns them by rank
    /// order among workers with the same `crate::host_id`).
    pub local_rank: i32,
    pub local_size: i32,
    /// This worker's host identity (default `crate::host_id()`): workers
    /// with the same one share memory and sum there first.
    pub host: Option<String>,
    /// Push the host's sums to a server on this host by reference, through
    /// shared memory (host stage only), instead of over loopback TCP.
    pub server_shm: bool,
    /// The job's token: every connection proves it (`protocol::auth`).
    pub secret: Secret,
    /// This worker's rack (`GRADHUB_RACK`), if racks are used.
    pub rack: String,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            scheduler: "127.0.0.1:9000".into(),
            rank: -1,
            num_workers: 0,
            num_servers: 0,
            namespace: 0,
            credit_bytes: crate::DEFAULT_CREDIT_BYTES,
            spread_bytes: None,
            connect_timeout: Duration::from_secs(60),
            local_rank: -1,
            local_size: -1,
            host: None,
            server_shm: true,
            secret: Secret::none(),
            rack: String::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot join the job: {0}")]
    Setup(String),
    #[error("cannot join the job: {0}")]
    Session(#[from] SessionError),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Failed(String),
}

enum Waiter {
    /// A blocking declare() call.
    Sync(Sender<Result<Vec<TensorSpec>, String>>),
    /// Declared on first push_pull; the ops for these names wait in `parked`.
    Async(Vec<String>),
}

struct Parked {
    op: Arc<Op>,
    numel: u64,
    dtype: DType,
    ptr: BufPtr,
    priority: i32,
    flags: u16,
}

/// A `push_pull` flag local to this worker (never on the wire): release
/// the tensor once this round completes (see `Client::release`). For
/// operations without a name, whose generated names are never used again.
pub const RELEASE_AFTER: u16 = 0x8000;

#[derive(Default)]
struct Table {
    specs: HashMap<String, Arc<TensorSpec>>,
    /// Names to release when their op completes (`RELEASE_AFTER`).
    transient: HashSet<String>,
    parked: HashMap<String, Vec<Parked>>,
    waiters: HashMap<u32, Waiter>,
    in_flight: HashSet<String>,
    barriers: HashMap<u32, Sender<Result<(), String>>>,
    /// A worker that left cleanly while this one goes on (`PeerLeft`).
    left: Option<u32>,
    /// Tensors (keys) whose optimizer runs on the servers: its OptConfig payload.
    server_opt: HashMap<u32, Vec<u8>>,
    /// Horovod's join: every name's uses so far (its round counter, the
    /// same on every worker) and its last call, announced to joined workers.
    uses: HashMap<String, Use>,
    /// Other workers joined (`Joined`): announce operations to them.
    peers_joined: bool,
    /// Unnamed tensors completed lately (their `uses` are gone): a joined
    /// worker must not push zeros for one that a peer announces late.
    recent_transient: (std::collections::VecDeque<String>, HashSet<String>),
    /// While this worker is in `join()`: where the scheduler's join
    /// messages go.
    join_events: Option<Sender<Control>>,
    /// Once process sets exist (`serve_set_ops`): where operations of sets
    /// this worker is not in go, the rest of the time.
    set_events: Option<Sender<Control>>,
    /// Names of the zero pushes in flight for those.
    set_pushes: HashSet<String>,
}

#[derive(Clone, Copy)]
struct Use {
    round: u32,
    numel: u64,
    dtype: DType,
    /// Wire flags, plus RELEASE_AFTER.
    flags: u16,
}

/// Join messages waiting for `join()` to take them.
const JOIN_QUEUE: usize = 4096;
/// Unnamed tensors remembered after they completed (see `recent_transient`).
const RECENT_TRANSIENT: usize = 4096;

/// State shared by the caller, the control thread and the I/O thread.
pub struct Shared {
    session: SessionSender,
    /// How to reach a server that joins while the job runs (`ServerJoined`).
    secret: Secret,
    connect_timeout: Duration,
    /// With two-level reduction, this worker's rack: it pushes each chunk
    /// to its rack's relay (`TensorSpec::slot_for`).
    rack: Option<u32>,
    table: Mutex<Table>,
    failure: Mutex<Option<String>>,
    io: Io,
    next_req: AtomicU32,
    next_barrier: AtomicU32,
    closing: AtomicBool,
}

impl Shared {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A worker left cleanly (`PeerLeft`). It had nothing in flight, so it
    /// took part in every operation that can still complete here; anything
    /// waiting for it now (a declaration, a barrier, a host-stage
    /// contribution; servers catch pushes, the scheduler declarations) or
    /// started later never will, and
    /// fails the job for everyone, naming it, instead of hanging.
    fn on_peer_left(&self, rank: u32) {
        let me = self.io.rank();
        let mut waiting = {
            let mut t = self.table();
            t.left.get_or_insert(rank);
            let mut w: Vec<String> = t.parked.keys().map(|n| format!("push_pull '{n}'")).collect();
            if !t.barriers.is_empty() {
                w.push("a barrier".into());
            }
            w
        };
        self.io.left.store(rank, Ordering::Release);
        if let Some(name) = self.io.waits_for_local(rank) {
            waiting.push(format!("push_pull '{name}' on their host"));
        }
        if waiting.is_empty() {
            // Debug only: at the end of every job each worker hears of the others leaving.
            log::debug!(target: &format!("worker {me}"), "worker {rank} has left the job");
        } else {
            waiting.sort();
            self.fail_job(io::left_message(rank, me, &waiting.join(", ")));
        }
    }

    /// Fails the job if a worker has left (see `on_peer_left`).
    fn check_left(&self, t: &Table, what: &str) -> Result<(), ClientError> {
        match t.left {
            Some(r) => {
                let msg = io::left_message(r, self.io.rank(), what);
                Err(ClientError::Failed(msg))
            }
            None => Ok(()),
        }
    }

    /// Record a job failure (first one wins) and fail everything waiting.
    pub(crate) fn set_failure(&self, msg: String) {
        {
            let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            if f.is_some() {
                return;
            }
            *f = Some(msg.clone());
        }
        let (parked, waiters, barriers) = {
            let mut t = self.table();
            (std::mem::take(&mut t.parked), std::mem::take(&mut t.waiters), std::mem::take(&mut t.barriers))
        };
        for (_, ops) in parked {
            for p in ops {
                self.finish_op(&p.op, Some(msg.clone()));
            }
        }
        for (_, w) in waiters {
            if let Waiter::Sync(tx) = w {
                let _ = tx.send(Err(msg.clone()));
            }
        }
        for (_, tx) in barriers {
            let _ = tx.send(Err(msg.clone()));
        }
        self.io.request_fail(msg);
    }

    /// This worker found the job cannot go on (e.g. its host's sum failed):
    /// tell every member, through the scheduler, then fail locally.
    pub(crate) fn fail_job(&self, msg: String) {
        if self.failure().is_none() {
            let _ = self.send_ctrl(&Control::Error { message: msg.clone() });
        }
        self.set_failure(msg);
    }

    pub(crate) fn finish_op(&self, op: &Op, error: Option<String>) {
        let release = {
            let mut t = self.table();
            t.in_flight.remove(&op.name);
            t.set_pushes.remove(&op.name);
            // After a failure the job is over (or the tensor never existed).
            match t.transient.remove(&op.name) && error.is_none() {
                true => {
                    t.uses.remove(&op.name);
                    let (order, set) = &mut t.recent_transient;
                    if set.insert(op.name.clone()) {
                        order.push_back(op.name.clone());
                        if order.len() > RECENT_TRANSIENT {
                            if let Some(old) = order.pop_front() {
                                set.remove(&old);
                            }
                        }
                    }
                    t.specs.remove(&op.name)
                }
                false => None,
            }
        };
        if let Some(spec) = release {
            self.release_specs(&[spec]);
        }
        // Callbacks and the keepalive (e.g. a Python object) run outside our locks.
        if let Some(done) = op.complete(error) {
            done.run();
        }
    }

    /// Forget tensors taken out of the table (nothing in flight) and tell
    /// the scheduler, which frees them on the servers once every worker did.
    fn release_specs(&self, specs: &[Arc<TensorSpec>]) {
        for s in specs {
            self.io.forget(s);
        }
        let keys = specs.iter().map(|s| s.key).collect();
        if let Err(e) = self.session.send_later(&Control::Release { keys }) {
            self.set_failure(e.to_string());
        }
    }

    fn send_ctrl(&self, msg: &Control) -> Result<(), SessionError> {
        self.session.send(msg)
    }

    fn submit(&self, op: Arc<Op>, spec: Arc<TensorSpec>, ptr: BufPtr, priority: i32, flags: u16) {
        self.io.submit(Submission { op, spec, ptr, priority, flags }, self);
    }

    /// Install declared specs and release ops that were waiting for them.
    fn on_declared(&self, specs: Vec<TensorSpec>) {
        let mut ready = Vec::new();
        for s in &specs {
            self.io.note_placement(s, true);
        }
        {
            let mut t = self.table();
            for s in specs {
                let s = Arc::new(s);
                t.specs.insert(s.name.clone(), s.clone());
                if let Some(ops) = t.parked.remove(&s.name) {
                    ready.extend(ops.into_iter().map(|p| (p, s.clone())));
                }
            }
        }
        for (p, s) in ready {
            match check_matches(&s, p.numel, p.dtype) {
                Ok(()) => self.submit(p.op, s, p.ptr, p.priority, p.flags),
                Err(e) => self.finish_op(&p.op, Some(e.to_string())),
            }
        }
    }

    /// Server `lost` was lost (`reason`) and its chunks moved: take the new
    /// specs and let the I/O thread re-send and restore what it must. A
    /// chunk with a server-side optimizer keeps its state only if it moved
    /// to its replica (`server::replica`); if one did not, the job fails.
    fn on_failover(&self, batch: u32, lost: u32, reason: String, specs: Vec<TensorSpec>) {
        let me = self.io.rank();
        let mut moved = Vec::with_capacity(specs.len());
        let mut opt = HashMap::new();
        let mut state_lost = None;
        let conns: Vec<usize> =
            self.io.conns.iter().enumerate().filter(|(_, c)| c.server == lost).map(|(i, _)| i).collect();
        self.io.write_off(&conns);
        {
            let mut t = self.table();
            let live: HashSet<u32> = t.specs.values().map(|s| s.key).collect();
            // Under the table's lock, before the table changes: a submission
            // that finds the new spec here finds it in the I/O's too.
            let mut latest = self.io.latest();
            latest.retain(|k, _| live.contains(k));
            for s in specs {
                if latest.get(&s.key).is_some_and(|&(b, _)| b > batch) {
                    continue; // placed again by a later failover, already applied
                }
                let s = Arc::new(s);
                let before = latest
                    .insert(s.key, (batch, s.clone()))
                    .map(|(_, b)| b)
                    .or_else(|| t.specs.get(&s.name).filter(|c| c.key == s.key).cloned());
                if let Some(cfg) = t.server_opt.get(&s.key) {
                    opt.insert(s.key, cfg.clone());
                    // A move to a server that joined never takes a chunk
                    // with state: its server kept those.
                    if let Some(why) = before.filter(|_| lost != NO_SERVER).and_then(|b| opt_state_lost(&b, &s)) {
                        state_lost.get_or_insert(format!("tensor '{}' {why}", s.name));
                    }
                }
                let current = match t.specs.get_mut(&s.name) {
                    Some(cur) if cur.key == s.key => Some(std::mem::replace(cur, s.clone())),
                    _ => None,
                };
                moved.push((s, current));
            }
        }
        if let Some(why) = state_lost {
            self.fail_job(format!(
                "server {lost} was lost ({reason}) with the server-side optimizer state of {why}, so training \
                 cannot go on"
            ));
            return;
        }
        match lost {
            NO_SERVER => log::info!(target: &format!("worker {me}"), "{reason}: {} tensor(s) move to it", moved.len()),
            _ => log::warn!(target: &format!("worker {me}"), "server {lost} was lost ({reason}); moving on without it"),
        }
        self.io.fail_over(io::FailoverNote { lost, conns, moved, opt });
    }

    /// A server joined the running job: connect to each of its threads
    /// (the next slots) before the scheduler moves chunks to it. No worker
    /// pushes to it by reference: it did not meet this host's stage.
    fn on_server_joined(&self, s: ServerInfo) -> Result<(), ClientError> {
        let mut conns = Vec::with_capacity(s.ports.len());
        for (t, &port) in s.ports.iter().enumerate() {
            let addr = join_host_port(&s.addr, port);
            let desc = format!("server {} ({addr}) thread {t}", s.rank);
            let setup = |e: std::io::Error| ClientError::Setup(format!("{desc}, which joined the job: {e}"));
            let stream = connect_authenticated(&addr, self.connect_timeout, &self.secret).map_err(setup)?;
            crate::transport::tune_data_socket(&stream);
            stream.set_nonblocking(true).map_err(setup)?;
            conns.push(io::NewConn {
                stream: mio::net::TcpStream::from_std(stream),
                desc,
                server: s.rank,
                by_ref: false,
            });
        }
        self.io.add_conns(conns).map_err(|e| ClientError::Setup(format!("server {} joined the job: {e}", s.rank)))
    }

    fn on_declare_error(&self, req: u32, message: String) {
        let waiter = self.table().waiters.remove(&req);
        let names = match waiter {
            Some(Waiter::Sync(tx)) => {
                let _ = tx.send(Err(message.clone()));
                return;
            }
            Some(Waiter::Async(names)) => names,
            None => return,
        };
        // Fail the ops that were waiting for this declaration.
        let parked: Vec<Parked> = {
            let mut t = self.table();
            names.iter().flat_map(|n| t.parked.remove(n).unwrap_or_default()).collect()
        };
        for p in parked {
            self.finish_op(&p.op, Some(message.clone()));
        }
    }
}

/// Take tensor `name` out of the table to declare it again with another
/// shape; refused while a round of it is in flight.
fn take_for_reshape(t: &mut Table, name: &str, numel: u64, dtype: DType) -> Result<Arc<TensorSpec>, ClientError> {
    let Some(s) = t.specs.get(name) else {
        return Err(ClientError::Usage(format!("tensor '{name}' is not declared")));
    };
    if t.in_flight.contains(name) {
        return Err(ClientError::Usage(format!(
            "tensor '{name}' has {} elements of {} and a round of it is in flight; it cannot change to {numel} \
             elements of {} before that round completes",
            s.numel,
            s.dtype.name(),
            dtype.name()
        )));
    }
    t.transient.remove(name);
    t.specs.remove(name).ok_or_else(|| ClientError::Usage(format!("tensor '{name}' is not declared")))
}

/// Why chunks of a tensor with a server-side optimizer lose their state
/// moving from placement `before` to `now`: a chunk that moved anywhere
/// but to its replica (`server::replica`).
fn opt_state_lost(before: &TensorSpec, now: &TensorSpec) -> Option<String> {
    let c = (0..before.num_chunks().min(now.num_chunks()))
        .find(|&c| before.slots[c] != now.slots[c] && before.replicas.get(c) != Some(&now.slots[c]))?;
    Some(match before.replicas.get(c) {
        None => format!("(chunk {c}): it had no replica (failover is off, or no other server was left)"),
        Some(r) => format!("(chunk {c}): its replica (server thread slot {r}) was lost too"),
    })
}

/// Zero pushes in flight, by name, with the buffers they read.
type ZeroPushes = HashMap<String, (Arc<Op>, Vec<u8>)>;

/// The thread behind `Client::serve_set_ops`: pushes zeros for each
/// announced operation of a process set this worker is not in, until the
/// client is closed or dropped (it holds the client only while working).
fn set_ops_loop(client: Weak<Client>, rx: crossbeam_channel::Receiver<Control>) {
    loop {
        let msg = rx.recv_timeout(Duration::from_millis(100));
        let Some(c) = client.upgrade() else { return };
        if c.check_usable().is_err() {
            return;
        }
        match msg {
            Ok(Control::JoinOp { name, numel, dtype, flags, round }) => {
                if let Err(e) = c.push_zeros(&name, numel, dtype, flags, round, true) {
                    // The job failed (and says why) or is closing.
                    log::debug!(target: &format!("worker {}", c.rank), "process-set thread ends: {e}");
                    return;
                }
            }
            Ok(_) | Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// The announcement of a name's latest use to joined workers.
fn join_op(name: &str, u: &Use) -> Control {
    Control::JoinOp { name: name.to_string(), numel: u.numel, dtype: u.dtype, flags: u.flags, round: u.round }
}

fn check_matches(s: &TensorSpec, numel: u64, dtype: DType) -> Result<(), ClientError> {
    if s.numel != numel || s.dtype != dtype {
        return Err(ClientError::Usage(format!(
            "tensor '{}' was declared with {} elements of {} but this call has {} elements of {}",
            s.name,
            s.numel,
            s.dtype.name(),
            numel,
            dtype.name()
        )));
    }
    Ok(())
}

pub struct Client {
    pub rank: u32,
    pub num_workers: u32,
    pub local_rank: u32,
    pub local_size: u32,
    /// Every worker's local rank, by rank (Horovod's cross rank and size
    /// come from it).
    pub local_ranks: Vec<u32>,
    pub num_servers: u32,
    pub partition_bytes: u32,
    /// The scheduler's identifier of this job (names its shared memory).
    pub job_id: u64,
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    closed: AtomicBool,
    /// Zero pushes in flight for other workers' operations (`push_zeros`),
    /// by name: join() and the process-set thread share them.
    zero_pushes: Mutex<ZeroPushes>,
}

impl Client {
    /// Join the job: register, receive the cluster map, connect to every server thread.
    pub fn connect(cfg: ClientConfig) -> Result<Client, ClientError> {
        crate::logging::init();
        let setup = |what: &str, e: std::io::Error| ClientError::Setup(format!("{what}: {e}"));
        let ns = cfg.namespace;
        let session = Joining::connect(&cfg.scheduler, cfg.connect_timeout, ns, &cfg.secret)?.register(Register {
            role: Role::Worker,
            requested_rank: cfg.rank,
            hostname: cfg.host.clone().unwrap_or_else(crate::host_id),
            addr: String::new(),
            ports: Vec::new(),
            colocated: false,
            num_workers: cfg.num_workers,
            num_servers: cfg.num_servers,
            local_rank: cfg.local_rank,
            local_size: cfg.local_size,
            rack: cfg.rack.clone(),
        })?;
        let w = session.welcome.clone();
        let me = w.rank as usize;
        let (Some(host), Some(&local_rank)) = (w.worker_hosts.get(me), w.worker_local_ranks.get(me)) else {
            return Err(ClientError::Setup(format!("the Welcome has no host for worker {me}")));
        };
        let local_size = w.worker_hosts.iter().filter(|h| *h == host).count() as u32;
        let racks = if w.rack_reduce { w.racks.len() as u32 } else { 0 };
        let layout = HostLayout::new(&w.worker_hosts, &w.worker_local_ranks, w.host_reduce)
            .and_then(|l| l.with_racks(&w.worker_racks, racks))
            .map_err(|e| ClientError::Setup(format!("the scheduler's host layout: {e}")))?;
        let rack = w.rack_reduce.then(|| w.worker_racks.get(me).copied().unwrap_or(0));
        // Servers on this host map the host stage's segments too.
        let servers_here = w.servers.iter().filter(|s| &s.host == host).count();
        let host_stage = match layout.host_workers(w.rank) {
            local if local.len() > 1 => {
                let stage = HostStage::join(w.job_id, host, local.to_vec(), servers_here, w.rank, cfg.connect_timeout)
                    .map_err(ClientError::Setup)?;
                log::info!(
                    target: "worker",
                    "worker {}: {} workers on this host ({:?}) sum there first; this one pushes 1/{} of each tensor",
                    w.rank,
                    local.len(),
                    local,
                    local.len()
                );
                Some(stage)
            }
            _ => None,
        };

        // One data connection per server thread, in slot order.
        let mut conns = Vec::new();
        for s in &w.servers {
            for (t, &port) in s.ports.iter().enumerate() {
                let by_ref = cfg.server_shm && &s.host == host;
                let addr = join_host_port(&s.addr, port);
                let desc = format!("server {} ({addr}) thread {t}", s.rank);
                let stream =
                    connect_authenticated(&addr, cfg.connect_timeout, &cfg.secret).map_err(|e| setup(&desc, e))?;
                crate::transport::tune_data_socket(&stream);
                stream.set_nonblocking(true).map_err(|e| setup(&desc, e))?;
                conns.push(io::NewConn { stream: mio::net::TcpStream::from_std(stream), desc, server: s.rank, by_ref });
            }
        }

        let poll = Poll::new().map_err(|e| setup("poll", e))?;
        let limit = crate::protocol::data_payload_limit(w.partition_bytes);
        let stall = Duration::from_millis(w.stall_ms as u64);
        let failover = w.failover.then(|| Duration::from_millis(w.peer_timeout_ms as u64));
        let credit = (cfg.credit_bytes, cfg.spread_bytes);
        let io = Io::new(&poll, conns, w.rank, credit, ns, limit, Arc::new(layout), host_stage, stall, failover)
            .map_err(|e| setup("data connections", e))?;
        let shared = Arc::new(Shared {
            session: session.sender(),
            secret: cfg.secret.clone(),
            connect_timeout: cfg.connect_timeout,
            rack,
            table: Mutex::new(Table::default()),
            failure: Mutex::new(None),
            io,
            next_req: AtomicU32::new(0),
            next_barrier: AtomicU32::new(0),
            closing: AtomicBool::new(false),
        });

        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name.into()).spawn(f).map_err(|e| setup("spawn", e))
        };
        let threads = vec![
            {
                let shared = shared.clone();
                spawn("gradhub-io", Box::new(move || IoThread::new(poll, shared).run()))?
            },
            {
                let shared = shared.clone();
                spawn("gradhub-control", Box::new(move || control_loop(shared, session)))?
            },
        ];
        Ok(Client {
            rank: w.rank,
            num_workers: w.num_workers,
            local_rank,
            local_size,
            local_ranks: w.worker_local_ranks.clone(),
            num_servers: w.servers.len() as u32,
            partition_bytes: w.partition_bytes,
            job_id: w.job_id,
            shared,
            threads: Mutex::new(threads),
            closed: AtomicBool::new(false),
            zero_pushes: Mutex::new(ZeroPushes::new()),
        })
    }

    fn check_usable(&self) -> Result<(), ClientError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(ClientError::Usage("gradhub has been shut down".into()));
        }
        if let Some(f) = self.shared.failure() {
            return Err(ClientError::Failed(format!("the job has failed: {f}")));
        }
        Ok(())
    }

    /// Declare tensors ahead of their first round, in one exchange. Blocks
    /// until every worker has declared them (or a mismatch is found).
    pub fn declare(&self, entries: Vec<DeclEntry>) -> Result<(), ClientError> {
        self.check_usable()?;
        let (todo, stale) = {
            let mut t = self.shared.table();
            let mut todo = Vec::new();
            let mut stale = Vec::new();
            for e in entries {
                match t.specs.get(&e.name) {
                    Some(s) if check_matches(s, e.numel, e.dtype).is_ok() => {}
                    Some(_) => {
                        stale.push(take_for_reshape(&mut t, &e.name, e.numel, e.dtype)?);
                        todo.push(e);
                    }
                    None => todo.push(e),
                }
            }
            (todo, stale)
        };
        if !stale.is_empty() {
            self.shared.release_specs(&stale);
        }
        if todo.is_empty() {
            return Ok(());
        }
        let req = self.shared.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = bounded(1);
        self.shared.table().waiters.insert(req, Waiter::Sync(tx));
        if let Err(e) = self.shared.send_ctrl(&Control::Declare { req, entries: todo }) {
            self.shared.set_failure(e.to_string());
        }
        match rx.recv() {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(ClientError::Failed(e)),
            Err(_) => Err(ClientError::Failed(self.shared.failure().unwrap_or_else(|| "client closed".into()))),
        }
    }

    /// Start an in-place push_pull of `nbytes` at `ptr`. The memory must stay
    /// valid and untouched until the returned op completes; `keepalive` is
    /// held until then.
    ///
    /// # Safety
    /// `ptr` must point to `nbytes` writable bytes that outlive the op.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn push_pull(
        &self,
        ptr: *mut u8,
        nbytes: usize,
        dtype: DType,
        name: &str,
        flags: u16,
        priority: i32,
        keepalive: Option<Box<dyn std::any::Any + Send>>,
    ) -> Result<Arc<Op>, ClientError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.push_pull_live(ptr, nbytes, dtype, name, flags, priority, keepalive, None) }
    }

    /// `push_pull` of a buffer that is zeros outside bytes `live` (a
    /// worker's own rows of an allgather, a broadcast from another worker):
    /// the chunks wholly outside it are pushed as zeros, header only
    /// (`FLAG_ZEROS`), unless the host stage sums this host's pushes first.
    ///
    /// # Safety
    /// As `push_pull`; and the buffer must be zeros outside `live`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn push_pull_live(
        &self,
        ptr: *mut u8,
        nbytes: usize,
        dtype: DType,
        name: &str,
        flags: u16,
        priority: i32,
        keepalive: Option<Box<dyn std::any::Any + Send>>,
        live: Option<(usize, usize)>,
    ) -> Result<Arc<Op>, ClientError> {
        self.check_usable()?;
        if dtype == DType::None {
            return Err(ClientError::Usage("push_pull needs a float32, float16 or bfloat16 tensor".into()));
        }
        if !nbytes.is_multiple_of(dtype.size()) {
            return Err(ClientError::Usage(format!(
                "{nbytes} bytes is not a whole number of {} elements",
                dtype.name()
            )));
        }
        let numel = (nbytes / dtype.size()) as u64;
        if flags & !(crate::protocol::FLAG_AVERAGE | crate::protocol::FLAG_INIT | RELEASE_AFTER) != 0 {
            return Err(ClientError::Usage(format!("unknown push_pull flags {flags:#x}")));
        }
        let (all_flags, flags, release_after) = (flags, flags & !RELEASE_AFTER, flags & RELEASE_AFTER != 0);
        let op = Arc::new(Op::new(name.to_string(), keepalive, live));
        let ptr = BufPtr(ptr);
        let mut t = self.shared.table();
        if t.specs.get(name).is_some_and(|s| check_matches(s, numel, dtype).is_err()) {
            // Another shape: a new tensor under the same name (as Horovod allows).
            let old = take_for_reshape(&mut t, name, numel, dtype)?;
            drop(t);
            self.shared.release_specs(&[old]);
            t = self.shared.table();
        }
        if let Err(e) = self.shared.check_left(&t, &format!("push_pull '{name}'")) {
            drop(t);
            self.shared.fail_job(e.to_string());
            return Err(e);
        }
        if !t.in_flight.insert(name.to_string()) {
            return Err(ClientError::Usage(format!(
                "tensor '{name}' is already being push_pulled; wait for its handle before starting another round"
            )));
        }
        if release_after {
            t.transient.insert(name.to_string());
        }
        // Counted under the same lock as `peers_joined` is set, so every
        // operation is announced to joined workers once it matters.
        let round = t.uses.get(name).map_or(0, |u| u.round).wrapping_add(1);
        let u = Use { round, numel, dtype, flags: all_flags };
        match t.uses.get_mut(name) {
            Some(x) => *x = u,
            None => {
                t.uses.insert(name.to_string(), u);
            }
        }
        if t.peers_joined {
            drop(t);
            if let Err(e) = self.shared.send_ctrl(&join_op(name, &u)) {
                self.shared.set_failure(e.to_string());
            }
            t = self.shared.table();
        }
        if let Some(s) = t.specs.get(name).cloned() {
            // Checked against the spec above.
            drop(t);
            self.shared.submit(op.clone(), s, ptr, priority, flags);
            return Ok(op);
        }
        // First use: declare it asynchronously; the op runs when every worker declared it.
        let first = !t.parked.contains_key(name);
        t.parked.entry(name.to_string()).or_default().push(Parked {
            op: op.clone(),
            numel,
            dtype,
            ptr,
            priority,
            flags,
        });
        if first {
            let req = self.shared.next_req.fetch_add(1, Ordering::Relaxed);
            t.waiters.insert(req, Waiter::Async(vec![name.to_string()]));
            drop(t);
            let e = DeclEntry { name: name.to_string(), numel, dtype, partition: 0 };
            if let Err(msg) = self.shared.send_ctrl(&Control::Declare { req, entries: vec![e] }) {
                self.shared.set_failure(msg.to_string());
            }
        }
        Ok(op)
    }

    /// Run `cfg` on the server threads that own `name`'s chunks: from now on
    /// its rounds return updated parameters instead of sums. Declares the
    /// tensor if needed. The parameters must be set with an init round
    /// (FLAG_INIT) before the first gradient round.
    pub fn set_server_optimizer(
        &self,
        name: &str,
        numel: u64,
        cfg: crate::protocol::OptConfig,
    ) -> Result<(), ClientError> {
        self.declare(vec![DeclEntry { name: name.to_string(), numel, dtype: DType::F32, partition: 0 }])?;
        let spec = self
            .shared
            .table()
            .specs
            .get(name)
            .cloned()
            .ok_or_else(|| ClientError::Failed(format!("tensor '{name}' is not declared")))?;
        let mut slots: Vec<u32> = spec.slots.clone();
        slots.sort_unstable();
        slots.dedup();
        let payload = cfg.encode();
        self.shared.table().server_opt.insert(spec.key, payload.clone());
        for slot in slots {
            self.shared.io.send_control(slot as usize, spec.key, MsgType::OptConfig, payload.clone())?;
        }
        Ok(())
    }

    /// Horovod's join: this worker has no more data. Until every worker has
    /// joined, it takes part in the others' operations with zeros (an
    /// average still divides by every worker, as in Horovod). Returns the
    /// rank that joined last and the names this worker pushed meanwhile.
    /// Nothing of this worker's own may be in flight.
    pub fn join(&self) -> Result<(u32, Vec<String>), ClientError> {
        self.check_usable()?;
        let (tx, rx) = bounded(JOIN_QUEUE);
        {
            let mut t = self.shared.table();
            if t.in_flight.iter().any(|n| !t.set_pushes.contains(n)) {
                let mut names: Vec<&str> =
                    t.in_flight.iter().filter(|n| !t.set_pushes.contains(*n)).map(String::as_str).collect();
                names.sort_unstable();
                return Err(ClientError::Usage(format!(
                    "join() with operations in flight ({}): wait for them first",
                    names.join(", ")
                )));
            }
            if t.join_events.is_some() {
                return Err(ClientError::Usage("join() is already running on another thread".into()));
            }
            t.join_events = Some(tx);
        }
        let result = self.join_loop(&rx);
        self.shared.table().join_events = None;
        result
    }

    fn join_loop(&self, rx: &crossbeam_channel::Receiver<Control>) -> Result<(u32, Vec<String>), ClientError> {
        self.shared.send_ctrl(&Control::Join).map_err(|e| ClientError::Failed(e.to_string()))?;
        let mut pushed: Vec<String> = Vec::new();
        loop {
            let msg = match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(m) => m,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    self.check_usable()?;
                    if let Some(gone) = self.shared.table().left {
                        let why = format!(
                            "worker {gone} left the job without calling join(), so join() on worker {} can never \
                             complete: every worker must join",
                            self.rank
                        );
                        self.shared.fail_job(why.clone());
                        return Err(ClientError::Failed(why));
                    }
                    continue;
                }
                Err(_) => return Err(ClientError::Failed("client closed".into())),
            };
            match msg {
                Control::JoinDone { last } => {
                    let ops: Vec<Arc<Op>> = {
                        let z = self.zero_pushes();
                        pushed.iter().filter_map(|n| z.get(n).map(|(op, _)| op.clone())).collect()
                    };
                    for op in ops {
                        op.wait(None).map_err(|e| ClientError::Failed(e.to_string()))?;
                    }
                    return Ok((last, pushed));
                }
                Control::JoinOp { name, numel, dtype, flags, round } => {
                    let took_part = self.push_zeros(&name, numel, dtype, flags, round, false)?;
                    pushed.extend(took_part.then_some(name));
                }
                _ => {}
            }
        }
    }

    /// Take part with zeros in the `round`-th use of `name`, which another
    /// worker announced (`JoinOp`: this worker joined, or is outside the
    /// process set of the operation). Returns false for a round this worker
    /// took part in already. `background`: for the set-op thread (see
    /// `serve_set_ops`), so that leaving waits for it.
    fn push_zeros(
        &self,
        name: &str,
        numel: u64,
        dtype: DType,
        flags: u16,
        round: u32,
        background: bool,
    ) -> Result<bool, ClientError> {
        let (done, finished) = {
            let t = self.shared.table();
            (t.uses.get(name).map_or(0, |u| u.round), t.recent_transient.1.contains(name))
        };
        if finished || round.wrapping_sub(done) as i32 <= 0 {
            return Ok(false);
        }
        if flags & crate::protocol::FLAG_INIT != 0 {
            let why = format!(
                "worker {} takes part with zeros (it joined, or is outside a process set) in the initial \
                 parameters of '{name}' for a server-side optimizer: that is not possible",
                self.rank
            );
            self.shared.fail_job(why.clone());
            return Err(ClientError::Failed(why));
        }
        // A name's rounds follow one another: the last one completes first.
        let last = self.zero_pushes().remove(name);
        if let Some((op, _)) = last {
            op.wait(None).map_err(|e| ClientError::Failed(e.to_string()))?;
        }
        let bytes = usize::try_from(numel)
            .ok()
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| ClientError::Failed(format!("'{name}' is too large")))?;
        let mut zeros = vec![0u8; bytes];
        // SAFETY: `zeros` is kept in `zero_pushes` (its heap buffer does not
        // move) until the op has completed.
        let op = unsafe { self.push_pull_live(zeros.as_mut_ptr(), bytes, dtype, name, flags, 0, None, Some((0, 0)))? };
        if background {
            let mut t = self.shared.table();
            if t.in_flight.contains(name) {
                t.set_pushes.insert(name.to_string());
            }
        }
        let mut z = self.zero_pushes();
        z.retain(|_, (op, _)| !op.done());
        z.insert(name.to_string(), (op, zeros));
        Ok(true)
    }

    fn zero_pushes(&self) -> MutexGuard<'_, ZeroPushes> {
        self.zero_pushes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take part, from now on, in the operations of process sets this
    /// worker is not in: their first member announces each one (`announce`)
    /// and a thread of this worker pushes zeros for it (an operation needs
    /// every worker's push). Idempotent; the thread ends with the client.
    pub fn serve_set_ops(self: &Arc<Self>) -> Result<(), ClientError> {
        self.check_usable()?;
        let (tx, rx) = bounded(JOIN_QUEUE);
        {
            let mut t = self.shared.table();
            if t.set_events.is_some() {
                return Ok(());
            }
            t.set_events = Some(tx);
        }
        let me = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("gradhub-set-ops".into())
            .spawn(move || set_ops_loop(me, rx))
            .map(|_| ())
            .map_err(|e| ClientError::Failed(format!("cannot start the process-set thread: {e}")))
    }

    /// Announce the operation just started on `name` (this worker is the
    /// first member of its process set) to the workers `to`, outside the
    /// set: they push zeros for it.
    pub fn announce(&self, name: &str, to: Vec<u32>) -> Result<(), ClientError> {
        if to.is_empty() {
            return Ok(());
        }
        let u = self.shared.table().uses.get(name).copied();
        let u = u.ok_or_else(|| ClientError::Usage(format!("announce('{name}') before its push_pull")))?;
        let msg = Control::SetOp {
            to,
            name: name.to_string(),
            numel: u.numel,
            dtype: u.dtype,
            flags: u.flags,
            round: u.round,
        };
        self.shared.send_ctrl(&msg).map_err(|e| ClientError::Failed(e.to_string()))
    }

    /// Block until every worker has entered the barrier.
    pub fn barrier(&self) -> Result<(), ClientError> {
        self.check_usable()?;
        let (tx, rx) = bounded(1);
        let id = {
            let mut t = self.shared.table();
            if let Err(e) = self.shared.check_left(&t, "a barrier") {
                drop(t);
                self.shared.fail_job(e.to_string());
                return Err(e);
            }
            if t.peers_joined {
                return Err(ClientError::Usage(
                    "barrier() while another worker is in join(): a joined worker takes part in push_pulls \
                     only, so this barrier could never complete"
                        .into(),
                ));
            }
            // Numbered only once it is entered: ids must match across workers.
            let id = self.shared.next_barrier.fetch_add(1, Ordering::Relaxed);
            t.barriers.insert(id, tx);
            id
        };
        if let Err(e) = self.shared.send_ctrl(&Control::Barrier { id }) {
            self.shared.set_failure(e.to_string());
        }
        match rx.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ClientError::Failed(e)),
            Err(_) => Err(ClientError::Failed("client closed".into())),
        }
    }

    /// Leave the job cleanly. In-flight operations are failed.
    pub fn shutdown(&self) {
        self.leave(None)
    }

    /// Leave the job because this worker failed (an exception, a signal):
    /// every member is told, with `reason`, instead of waiting for this
    /// worker's pushes forever.
    pub fn abort(&self, reason: &str) {
        self.leave(Some(format!("worker {} failed: {reason}", self.rank)))
    }

    /// With nothing in flight and no failure this is a clean goodbye. A
    /// worker that leaves with operations in flight (others may be waiting
    /// for its pushes) fails the job instead, naming them.
    fn leave(&self, failure: Option<String>) {
        if failure.is_none() {
            self.finish_set_pushes();
        }
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let failure = failure.or_else(|| {
            let t = self.shared.table();
            if t.in_flight.is_empty() {
                return None;
            }
            let mut names: Vec<&str> = t.in_flight.iter().map(String::as_str).collect();
            names.sort_unstable();
            Some(format!("worker {} shut down with operations in flight: {}", self.rank, names.join(", ")))
        });
        self.shared.closing.store(true, Ordering::SeqCst);
        match &failure {
            // The job has not failed already: tell everyone why this worker goes.
            Some(msg) if self.shared.failure().is_none() => {
                let _ = self.shared.send_ctrl(&Control::Error { message: msg.clone() });
                self.shared.session.close(false);
            }
            Some(_) => self.shared.session.close(false),
            // The job failed: no goodbye, which would tell the scheduler this
            // worker finished. Say why here: no operation may be left to report it.
            None if self.shared.failure().is_some() => {
                let why = self.shared.failure().unwrap_or_default();
                log::warn!(target: &format!("worker {}", self.rank), "leaving a failed job: {why}");
                self.shared.session.close(false)
            }
            None => self.shared.session.close(true),
        }
        self.shared.io.stop();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
        self.shared.io.stop_timeline();
        if let Some(h) = &self.shared.io.host {
            h.cleanup();
        }
        // Anything still pending can no longer complete.
        let parked = std::mem::take(&mut self.shared.table().parked);
        for (_, ops) in parked {
            for p in ops {
                self.shared.finish_op(&p.op, Some("gradhub was shut down".into()));
            }
        }
    }

    pub fn failure(&self) -> Option<String> {
        self.shared.failure()
    }

    /// Record every chunk this worker pushes in a timeline at `path`
    /// (`crate::timeline`): queued, on the wire, waiting for the result.
    pub fn start_timeline(&self, path: &str) -> Result<(), ClientError> {
        self.shared
            .io
            .start_timeline(path)
            .map_err(|e| ClientError::Usage(format!("cannot write the timeline {path}: {e}")))
    }

    /// Stop recording the chunks' timeline; returns once the file is written.
    pub fn stop_timeline(&self) {
        self.shared.io.stop_timeline()
    }

    /// The base credit per connection, in bytes (`ClientConfig::credit_bytes`).
    pub fn credit(&self) -> usize {
        self.shared.io.credit()
    }

    /// Change the base credit per connection (autotuning): bytes a
    /// connection may have pushed and not yet received whole by its server.
    pub fn set_credit(&self, bytes: usize) -> Result<(), ClientError> {
        if bytes == 0 {
            return Err(ClientError::Usage("the credit must be at least one byte".into()));
        }
        self.shared.io.set_credit(bytes);
        Ok(())
    }

    /// Before a clean goodbye: the zeros this worker pushed for process
    /// sets it is not in complete once the sets' members pushed theirs
    /// (they have announced them, so they are on their way): wait for
    /// that, at most a peer timeout, rather than leave them in flight.
    fn finish_set_pushes(&self) {
        let deadline = Instant::now() + self.shared.io.peer_timeout.max(Duration::from_secs(5));
        loop {
            {
                let t = self.shared.table();
                if t.set_pushes.is_empty() || t.in_flight.iter().any(|n| !t.set_pushes.contains(n)) {
                    return;
                }
            }
            if Instant::now() >= deadline || self.shared.failure().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Free tensors this worker no longer uses: here at once, on the
    /// servers once every worker released them. Using a name again later
    /// declares a new tensor. Every worker must release the same names
    /// (like any collective), none of them in flight.
    pub fn release(&self, names: &[String]) -> Result<(), ClientError> {
        self.check_usable()?;
        let specs = {
            let mut t = self.shared.table();
            for n in names {
                if t.in_flight.contains(n) {
                    return Err(ClientError::Usage(format!(
                        "tensor '{n}' is in flight; wait for its handle before releasing it"
                    )));
                }
                if !t.specs.contains_key(n) {
                    return Err(ClientError::Usage(format!("tensor '{n}' is not declared (or already released)")));
                }
            }
            let mut specs = Vec::with_capacity(names.len());
            for n in names {
                if let Some(s) = t.specs.remove(n) {
                    specs.push(s);
                }
            }
            specs
        };
        self.shared.release_specs(&specs);
        Ok(())
    }

    /// Tensors this worker holds state for (declared and not released).
    pub fn num_tensors(&self) -> usize {
        self.shared.table().specs.len()
    }

    /// Chunks this worker pushed so far: (by reference through shared
    /// memory, through a socket, and of those as zeros: a header only).
    pub fn pushed_chunks(&self) -> (u64, u64, u64) {
        let io = &self.shared.io;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        (load(&io.pushed_by_ref), load(&io.pushed_by_socket), load(&io.pushed_zeros))
    }

    /// Chunks queued or in flight that their servers have not received
    /// whole yet, and their bytes (what the spread counts; none once every
    /// op is done).
    pub fn unreceived(&self) -> (usize, usize) {
        self.shared.io.unreceived()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Handle the scheduler's messages until the session ends.
fn control_loop(shared: Arc<Shared>, mut session: Session) {
    loop {
        let msg = session.recv();
        if shared.closing.load(Ordering::Relaxed) {
            // `leave` closes the session, with a goodbye if the worker
            // finished: closing it here first would lose the goodbye.
            session.keep_open();
            return;
        }
        match msg {
            Ok(Control::Declared { req, mut specs }) => {
                if let Some(rack) = shared.rack {
                    for s in &mut specs {
                        s.slots = (0..s.num_chunks()).map(|c| s.slot_for(rack, c)).collect();
                    }
                }
                let waiter = shared.table().waiters.remove(&req);
                shared.on_declared(specs.clone());
                if let Some(Waiter::Sync(tx)) = waiter {
                    let _ = tx.send(Ok(specs));
                }
            }
            Ok(Control::DeclareError { req, message }) => shared.on_declare_error(req, message),
            Ok(Control::DeclareStall { name, missing, waited_ms }) => {
                let msg = format!(
                    "the scheduler reports tensor '{name}' has waited {:.1}s for worker rank(s) {missing:?} to push_pull or declare it",
                    waited_ms as f64 / 1000.0
                );
                if let Some(ops) = shared.table().parked.get(&name) {
                    for p in ops {
                        p.op.set_stall(msg.clone());
                    }
                }
            }
            Ok(Control::BarrierDone { id }) => {
                if let Some(tx) = shared.table().barriers.remove(&id) {
                    let _ = tx.send(Ok(()));
                }
            }
            Ok(Control::PeerLost { role, rank, reason }) => {
                shared.set_failure(format!("{} {rank} was lost: {reason}", role.name()));
                return;
            }
            Ok(Control::PeerLeft { rank }) => shared.on_peer_left(rank),
            Ok(Control::Joined { rank: _ }) => {
                // Announce what is in flight now; what starts later is
                // announced as it starts (see `push_pull`).
                let msgs: Vec<Control> = {
                    let mut t = shared.table();
                    t.peers_joined = true;
                    t.in_flight.iter().filter_map(|n| t.uses.get(n).map(|u| join_op(n, u))).collect()
                };
                for m in msgs {
                    if let Err(e) = shared.send_ctrl(&m) {
                        shared.set_failure(e.to_string());
                    }
                }
            }
            Ok(msg @ Control::JoinOp { .. }) => {
                // In join(), join() takes part; else the process-set thread.
                let (join, set) = {
                    let t = shared.table();
                    (t.join_events.clone(), t.set_events.clone())
                };
                if let Some(tx) = join {
                    let _ = tx.send(msg);
                } else if let Some(tx) = set {
                    if tx.try_send(msg).is_err() {
                        shared.set_failure(format!(
                            "over {JOIN_QUEUE} operations of process sets wait for this worker's zeros"
                        ));
                        return;
                    }
                }
            }
            Ok(Control::JoinDone { last }) => {
                let tx = {
                    let mut t = shared.table();
                    t.peers_joined = false;
                    t.join_events.clone()
                };
                if let Some(tx) = tx {
                    let _ = tx.send(Control::JoinDone { last });
                }
            }
            Ok(Control::Failover { batch, lost, reason, specs }) => shared.on_failover(batch, lost, reason, specs),
            Ok(Control::ServerJoined { server }) => {
                if let Err(e) = shared.on_server_joined(server) {
                    shared.fail_job(format!("worker {}: {e}", shared.io.rank()));
                }
            }
            Ok(Control::Error { message }) => {
                shared.set_failure(format!("scheduler: {message}"));
                return;
            }
            Ok(other) => {
                shared.set_failure(crate::session::unexpected(&other));
                return;
            }
            Err(e) => {
                shared.set_failure(e.to_string());
                return;
            }
        }
    }
}
