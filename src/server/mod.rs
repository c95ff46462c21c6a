//! The summation server process: registers with the scheduler, starts one
//! shared-nothing thread per configured core (each with its own listening
//! port), installs tensor specs on its threads when the scheduler says so,
//! and exits when the job ends. On a host whose workers sum there first,
//! it maps their shared segments so they can push to it by reference.

mod optimizer;
mod replica;
mod service;
mod thread;

pub use service::{run_service_server, ServiceServerConfig};

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::bounded;
use mio::{Poll, Waker};

use crate::host::{host_tag, SharedTensor};
use crate::placement::HostLayout;
use crate::protocol::auth::Secret;
use crate::protocol::{Control, Header, MsgType, Register, Role, TensorSpec, NO_SERVER};
use crate::session::{Joining, Session, SessionError};
use crate::settings::defaults;
use crate::sum_order::SumOrder;
use thread::{LinkTo, NewLink, Relink, ServerThread, ThreadCmd, ThreadConfig};

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Scheduler address, host:port.
    pub scheduler: String,
    pub threads: usize,
    pub colocated: bool,
    /// Address to advertise to workers; default: the local address of the
    /// connection to the scheduler (the interface that reaches it).
    pub advertise: Option<String>,
    /// Host to bind the per-thread listeners to.
    pub bind_host: String,
    /// First port; thread t listens on base_port + t. 0 = any free ports.
    pub base_port: u16,
    pub rank: i32,
    pub num_workers: u32,
    pub num_servers: u32,
    pub namespace: u32,
    pub connect_timeout: Duration,
    /// This server's host identity (default `crate::host_id()`): workers
    /// with the same one share memory with it.
    pub host: Option<String>,
    /// The job's token: every connection proves it (`protocol::auth`).
    pub secret: Secret,
    /// Counted by the threads (a shared service reports it per job).
    pub traffic: Arc<Traffic>,
    /// Write a timeline of the chunk rounds here (`{rank}`: the server's rank).
    pub timeline: Option<String>,
    /// This server's rack (`GRADHUB_RACK`), if racks are used.
    pub rack: String,
    /// Serve Prometheus metrics on this address (`--metrics-addr`).
    pub metrics_addr: Option<String>,
    /// The order chunks add their pushes in (`GRADHUB_DETERMINISTIC`): the
    /// same on every member (the scheduler checks).
    pub sum_order: SumOrder,
    /// Synchronous or asynchronous (`crate::training`): the same on every member.
    pub training: crate::training::Training,
}

/// Bytes pushed to a server and chunk rounds it completed, so far.
#[derive(Debug, Default)]
pub struct Traffic {
    bytes: std::sync::atomic::AtomicU64,
    rounds: std::sync::atomic::AtomicU64,
    /// Rounds relayed for this server's rack (two-level reduction).
    relayed: std::sync::atomic::AtomicU64,
    /// While metrics are served (`observe`): bytes of results sent, and
    /// each round's latency; nothing is timed otherwise.
    observed: std::sync::atomic::AtomicBool,
    returned: std::sync::atomic::AtomicU64,
    latency: crate::metrics::Latency,
}

impl Traffic {
    /// A round of `bytes` pushed, summed now; its first push came at `since`.
    fn add(&self, bytes: u64, since: Option<std::time::Instant>) {
        use std::sync::atomic::Ordering::Relaxed;
        self.bytes.fetch_add(bytes, Relaxed);
        self.rounds.fetch_add(1, Relaxed);
        if let (true, Some(t)) = (self.observed.load(Relaxed), since) {
            self.latency.observe(t.elapsed());
        }
    }
    fn returned(&self, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.observed.load(Relaxed) {
            self.returned.fetch_add(bytes, Relaxed);
        }
    }
    /// Count what metrics report from now on (returned bytes, latencies).
    pub fn observe(&self) {
        self.observed.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    /// The metrics of job `job` (`""`: this server's only job) so far.
    pub fn sample(&self, job: &str, s: &mut crate::metrics::Sample) {
        use std::sync::atomic::Ordering::Relaxed;
        let (bytes, rounds) = self.get();
        s.pushed_bytes.push((job.to_string(), bytes));
        s.rounds.push((job.to_string(), rounds));
        s.returned_bytes.push((job.to_string(), self.returned.load(Relaxed)));
        s.latency.push((job.to_string(), self.latency.snapshot()));
    }
    fn relay(&self) {
        self.relayed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    /// (bytes, rounds)
    pub fn get(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.bytes.load(Relaxed), self.rounds.load(Relaxed))
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            scheduler: "127.0.0.1:9000".into(),
            threads: 1,
            colocated: defaults::COLOCATED,
            advertise: None,
            bind_host: "0.0.0.0".into(),
            base_port: defaults::SERVER_PORT,
            rank: defaults::SERVER_RANK,
            num_workers: 0,
            num_servers: 0,
            namespace: defaults::NAMESPACE,
            connect_timeout: Duration::from_secs(defaults::CONNECT_TIMEOUT_SECS),
            host: None,
            secret: Secret::none(),
            traffic: Arc::default(),
            timeline: None,
            rack: defaults::RACK.into(),
            metrics_addr: None,
            sum_order: SumOrder::deterministic(defaults::DETERMINISTIC),
            training: crate::training::Training::default_mode(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("server setup failed: {0}")]
    Setup(String),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("job failed: {0}")]
    JobFailed(String),
}

/// The accept queue asked for on every data port (see `run_server`).
const LISTEN_BACKLOG: i32 = 4096;

pub fn run_server(cfg: ServerConfig) -> Result<(), ServerError> {
    crate::logging::init();
    let setup = |what: &str, e: std::io::Error| ServerError::Setup(format!("{what}: {e}"));
    let threads = cfg.threads.max(1);

    // Bind every thread's listener first, so the ports we advertise exist.
    let mut listeners = Vec::with_capacity(threads);
    for t in 0..threads {
        let port = if cfg.base_port == 0 { 0 } else { cfg.base_port + t as u16 };
        let addr = format!("{}:{port}", cfg.bind_host);
        let l = std::net::TcpListener::bind(&addr).map_err(|e| setup(&format!("cannot listen on {addr}"), e))?;
        // A deep accept queue (the kernel caps it at somaxconn): with std's
        // 128, a burst of connections (strangers' or a large job's) overflows
        // it, and those the kernel then drops wait seconds for SYN
        // retransmits before the thread can even start their handshake
        // timeout. Best effort: a shorter queue only delays them.
        let _ = socket2::SockRef::from(&l).listen(LISTEN_BACKLOG);
        l.set_nonblocking(true).map_err(|e| setup("listener", e))?;
        listeners.push(l);
    }
    let ports: Vec<u16> = listeners.iter().map(|l| l.local_addr().map(|a| a.port()).unwrap_or(0)).collect();
    if let Some(at) = &cfg.metrics_addr {
        cfg.traffic.observe();
        let traffic = cfg.traffic.clone();
        let bound = crate::metrics::serve(at, move || {
            let mut s = crate::metrics::Sample::default();
            traffic.sample("", &mut s);
            s
        })
        .map_err(|e| setup(&format!("metrics: cannot listen on {at}"), e))?;
        log::info!(target: "server", "metrics on http://{bound}/metrics");
    }

    let joining = Joining::connect(&cfg.scheduler, cfg.connect_timeout, cfg.namespace, &cfg.secret)?;
    let advertise = match &cfg.advertise {
        Some(a) => a.clone(),
        None => joining.local_ip()?.to_string(),
    };
    let ns = cfg.namespace;
    let host = cfg.host.clone().unwrap_or_else(crate::host_id);
    let mut session = joining.register(Register {
        role: Role::Server,
        requested_rank: cfg.rank,
        hostname: host.clone(),
        addr: advertise.clone(),
        ports: ports.clone(),
        colocated: cfg.colocated,
        num_workers: cfg.num_workers,
        num_servers: cfg.num_servers,
        local_rank: -1,
        local_size: -1,
        rack: cfg.rack.clone(),
        sum_order: cfg.sum_order,
        training: cfg.training,
        elastic: None,
    })?;
    let welcome = session.welcome.clone();
    let rank = welcome.rank;
    let who = format!("server {rank}");
    let first_slot: u32 = welcome.servers.iter().filter(|s| s.rank < rank).map(|s| s.ports.len() as u32).sum();
    log::info!(
        target: &who,
        "serving {} workers on {advertise} ports {ports:?} ({}), {} thread(s)",
        welcome.num_workers,
        if cfg.colocated { "colocated" } else { "CPU-only" },
        threads
    );

    let racks = if welcome.rack_reduce { welcome.racks.len() as u32 } else { 0 };
    let my_rack = welcome.servers.iter().find(|s| s.rank == rank).map_or(0, |s| s.rack);
    let layout = HostLayout::new(&welcome.worker_hosts, &welcome.worker_local_ranks, welcome.host_reduce)
        .and_then(|l| l.with_racks(&welcome.worker_racks, racks))
        .map_err(|e| ServerError::Setup(format!("the scheduler's host layout: {e}")))?;
    if welcome.rack_reduce {
        let name = welcome.racks.get(my_rack as usize).map_or("?", String::as_str);
        log::info!(target: &who, "rack '{name}': this rack's workers push here first, for chunks owned in other racks");
    }
    let layout = std::sync::Arc::new(layout);
    if layout.num_hosts() < welcome.num_workers as usize {
        log::info!(target: &who, "{} workers on {} hosts: one push per host and chunk", welcome.num_workers, layout.num_hosts());
    }
    // Workers of this host that sum here first may push by reference (not
    // to a server that joined later: they met in shared memory without it).
    let local: Vec<bool> = (0..welcome.num_workers)
        .map(|r| !welcome.late && welcome.worker_hosts[r as usize] == host && layout.host_workers(r).len() > 1)
        .collect();
    let mut segments = Segments { job_id: welcome.job_id, host_tag: host_tag(&host), mappers: 0, open: HashMap::new() };
    if let Some(r) = local.iter().position(|&l| l) {
        let servers_here = welcome.servers.iter().filter(|s| s.host == host).count();
        let workers = layout.host_workers(r as u32);
        segments.mappers = workers.len() + servers_here;
        crate::host::rendezvous(welcome.job_id, &host, workers, servers_here, cfg.connect_timeout)
            .map_err(ServerError::Setup)?;
        log::info!(target: &who, "workers {:?} share this host: they push by reference through shared memory", layout.host_workers(r as u32));
    }
    let local = Arc::new(local);
    let (timeline, timeline_writer) = match &cfg.timeline {
        Some(path) => {
            let path = path.replace("{rank}", &rank.to_string());
            let rows: Vec<(u32, String)> = (0..threads as u32).map(|t| (t, format!("thread {t}"))).collect();
            // Pids apart from the workers' (their ranks) in a merged trace.
            let (t, w) = crate::timeline::Trace::open(&path, 1_000_000 + rank, &format!("gradhub {who}"), &rows, &who)
                .map_err(|e| ServerError::Setup(format!("cannot write the timeline {path}: {e}")))?;
            (Some(t), Some(w))
        }
        None => (None, None),
    };

    // Spawn the shared-nothing threads.
    let mut cmd_txs = Vec::with_capacity(threads);
    let mut wakers: Vec<Arc<Waker>> = Vec::with_capacity(threads);
    let slots: Arc<Vec<(String, String)>> = Arc::new(welcome.servers.iter().flat_map(slots_of).collect());
    let mut joins = Vec::with_capacity(threads);
    for (t, l) in listeners.into_iter().enumerate() {
        let poll = Poll::new().map_err(|e| setup("poll", e))?;
        let mut listener = mio::net::TcpListener::from_std(l);
        let waker = Arc::new(ServerThread::setup(&poll, &mut listener).map_err(|e| setup("poll registration", e))?);
        // Bounded: the control thread waits for each Declare's ack anyway.
        let (tx, rx) = bounded(16);
        let tc = ThreadConfig {
            server: rank,
            thread: t as u32,
            slot: first_slot + t as u32,
            rack: my_rack,
            relays: if welcome.rack_reduce { welcome.servers.iter().map(|s| s.ports.len() as u32).sum() } else { 0 },
            num_workers: welcome.num_workers,
            layout: layout.clone(),
            local: local.clone(),
            namespace: ns,
            partition_bytes: welcome.partition_bytes,
            stall: Duration::from_millis(welcome.stall_ms as u64),
            peer_timeout: Duration::from_millis(welcome.peer_timeout_ms as u64),
            secret: cfg.secret.clone(),
            traffic: cfg.traffic.clone(),
            timeline: timeline.clone(),
            sum_order: cfg.sum_order,
            training: cfg.training,
            relink: Some(Relink { to_self: tx.clone(), waker: waker.clone(), slots: slots.clone() }),
        };
        let st = ServerThread::new(tc, poll, listener, rx);
        let j = std::thread::Builder::new()
            .name(format!("gradhub-server-t{t}"))
            .spawn(move || st.run())
            .map_err(|e| setup("spawn", e))?;
        cmd_txs.push(tx);
        wakers.push(waker);
        joins.push(j);
    }

    let mut links = Links {
        first_slot,
        threads: threads as u32,
        slots: slots.to_vec(),
        made: HashSet::new(),
        secret: cfg.secret.clone(),
        namespace: ns,
        relay: welcome.rack_reduce.then_some((my_rack, layout.relay_id(first_slot))),
        made_up: HashSet::new(),
    };
    // For a scheduler that restarts (`Rejoin`): the keys installed here,
    // and the workers that left.
    let held: Arc<std::sync::Mutex<Held>> = Arc::default();
    {
        let held = held.clone();
        session.on_rejoin(move || {
            let h = held.lock().unwrap_or_else(|e| e.into_inner());
            crate::session::Report {
                keys: h.keys.iter().copied().collect(),
                left: h.left.clone(),
                lost: h.lost.clone(),
                specs: Vec::new(),
                barriers: 0,
            }
        });
    }
    let result = control_loop(&mut session, &cmd_txs, &wakers, &mut segments, &mut links, &held);
    drop(session);
    for (tx, w) in cmd_txs.iter().zip(&wakers) {
        let _ = tx.send(match &result {
            Ok(()) => ThreadCmd::Stop,
            Err(e) => ThreadCmd::Abort(e.to_string()),
        });
        let _ = w.wake();
    }
    for j in joins {
        let _ = j.join();
    }
    drop(timeline); // the threads' copies went with them: the writer finishes
    if let Some(w) = timeline_writer {
        let _ = w.join();
    }
    segments.cleanup();
    match &result {
        Ok(()) => {
            let (bytes, rounds) = cfg.traffic.get();
            let relayed = match cfg.traffic.relayed.load(std::sync::atomic::Ordering::Relaxed) {
                0 => String::new(),
                n => format!(", {n} relayed for this rack"),
            };
            // The servers' record of the staleness (tests and users read it here).
            let lead = match cfg.training.is_asynchronous() {
                true => format!(
                    "; asynchronous: a worker was at most {} steps ahead of the slowest when answered",
                    crate::metrics::ASYNC_LEAD_MAX.load(std::sync::atomic::Ordering::Relaxed)
                ),
                false => String::new(),
            };
            log::info!(
                target: &who,
                "job complete ({rounds} chunk rounds summed, {bytes} bytes pushed here{relayed}){lead}, exiting"
            )
        }
        Err(e) => log::error!(target: &who, "{e}"),
    }
    result
}

/// What a server tells a scheduler that restarted (`Rejoin`).
#[derive(Default)]
struct Held {
    keys: HashSet<u32>,
    left: Vec<u32>,
    lost: Vec<u32>,
}

/// Serve the scheduler's requests until the job ends.
fn control_loop(
    session: &mut Session,
    cmd_txs: &[crossbeam_channel::Sender<ThreadCmd>],
    wakers: &[Arc<Waker>],
    segments: &mut Segments,
    links: &mut Links,
    held: &std::sync::Mutex<Held>,
) -> Result<(), ServerError> {
    let sender = session.sender();
    let hold = |keys: &mut dyn Iterator<Item = u32>, on: bool| {
        let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
        for k in keys {
            match on {
                true => h.keys.insert(k),
                false => h.keys.remove(&k),
            };
        }
    };
    let exited = || ServerError::JobFailed("a server thread exited".into());
    let who = format!("server {}", session.welcome.rank);
    let to_threads = |cmd: &mut dyn FnMut(usize) -> ThreadCmd| to_threads(cmd_txs, wakers, cmd).map_err(|()| exited());
    let install = |segments: &mut Segments,
                   links: &mut Links,
                   specs: &[TensorSpec],
                   adopt: bool,
                   batch: u32|
     -> Result<(), ServerError> {
        let shm = segments.map(specs).map_err(ServerError::Setup)?;
        let mut new_links = links.open(specs);
        let (ack_tx, ack_rx) = bounded(cmd_txs.len());
        to_threads(&mut |t| {
            let l = std::mem::take(&mut new_links[t]);
            ThreadCmd::Declare(specs.to_vec(), adopt, shm.clone(), l, ack_tx.clone())
        })?;
        for _ in cmd_txs {
            ack_rx.recv().map_err(|_| exited())?;
        }
        hold(&mut specs.iter().map(|s| s.key), true);
        sender.send(&Control::ServerDeclareAck { batch })?;
        Ok(())
    };
    loop {
        match session.recv()? {
            Control::ServerDeclare { batch, specs } => {
                // A new tensor never takes a key held here (only a move or
                // a takeover installs a held key again): its chunks would go
                // on from the other tensor's rounds.
                let held_key = {
                    let h = held.lock().unwrap_or_else(|e| e.into_inner());
                    specs.iter().find(|s| h.keys.contains(&s.key)).map(|s| (s.key, s.name.clone()))
                };
                if let Some((key, name)) = held_key {
                    return Err(ServerError::JobFailed(format!(
                        "the scheduler installed tensor '{name}' under key {key}, which this server holds already \
                         for another tensor"
                    )));
                }
                install(segments, links, &specs, false, batch)?
            }
            Control::ServerTakeOver { batch, lost, specs } => {
                let moved = specs.len();
                if lost != NO_SERVER {
                    held.lock().unwrap_or_else(|e| e.into_inner()).lost.push(lost);
                }
                install(segments, links, &specs, true, batch)?;
                match lost {
                    NO_SERVER => log::info!(target: &who, "chunks of {moved} tensor(s) moved to their new servers"),
                    _ => {
                        log::warn!(target: &who, "server {lost} was lost: taking over its chunks here ({moved} tensor(s) moved)")
                    }
                }
            }
            Control::ServerMove { batch, specs } => {
                let (tx, rx) = bounded(cmd_txs.len());
                to_threads(&mut |_| ThreadCmd::GiveUp(specs.clone(), tx.clone()))?;
                let mut kept = Vec::new();
                for _ in cmd_txs {
                    kept.extend(rx.recv().map_err(|_| exited())?);
                }
                if !kept.is_empty() {
                    log::info!(target: &who, "keeping {} chunk(s) with server-side optimizer state here", kept.len());
                }
                sender.send(&Control::ServerMoveAck { batch, kept })?;
            }
            Control::ServerJoined { server } => {
                log::info!(target: &who, "server {} joined the job at {}", server.rank, server.addr);
                links.slots.extend(slots_of(&server));
            }
            Control::ServerRelease { keys } => {
                hold(&mut keys.iter().copied(), false);
                segments.release(&keys);
                to_threads(&mut |_| ThreadCmd::Release(keys.clone()))?;
            }
            Control::Shutdown => return Ok(()),
            Control::PeerLeft { rank } => {
                held.lock().unwrap_or_else(|e| e.into_inner()).left.push(rank);
                to_threads(&mut |_| ThreadCmd::Left(rank))?
            }
            Control::PeerLost { role, rank: r, reason } => {
                return Err(ServerError::JobFailed(format!("{} {r} lost: {reason}", role.name())))
            }
            Control::Error { message } => return Err(ServerError::JobFailed(message)),
            other => {
                log::warn!(target: &format!("server {}", session.welcome.rank), "ignoring {}", crate::session::unexpected(&other));
            }
        }
    }
}

/// Give server thread t the command cmd(t) and wake it to run it; Err if
/// a thread is gone.
fn to_threads(
    cmd_txs: &[crossbeam_channel::Sender<ThreadCmd>],
    wakers: &[Arc<Waker>],
    cmd: &mut dyn FnMut(usize) -> ThreadCmd,
) -> Result<(), ()> {
    for (t, (tx, w)) in cmd_txs.iter().zip(wakers).enumerate() {
        tx.send(cmd(t)).map_err(|_| ())?;
        let _ = w.wake();
    }
    Ok(())
}

/// Each of a server's slots (one per thread): its address, and who serves it.
fn slots_of(s: &crate::protocol::ServerInfo) -> Vec<(String, String)> {
    let who = |t| format!("server {} thread {t}", s.rank);
    s.ports.iter().enumerate().map(|(t, &p)| (crate::transport::join_host_port(&s.addr, p), who(t))).collect()
}

/// The links this server's threads open to other server threads: to the
/// threads replicating their chunks (`replica`), and, as a rack's relay
/// (two-level reduction), to the owners of the chunks they relay. One per
/// (thread, slot) and kind, opened here, on the control loop, before the
/// specs that need it are installed.
struct Links {
    first_slot: u32,
    threads: u32,
    /// Every slot's address (host:port) and who serves it.
    slots: Vec<(String, String)>,
    made: HashSet<(u32, u32)>,
    secret: Secret,
    namespace: u32,
    /// With two levels: our rack, and the pusher id our thread 0 says
    /// DataHello with at an owner (`HostLayout::relay_id`; thread t: + t).
    relay: Option<(u32, u32)>,
    made_up: HashSet<(u32, u32)>,
}

impl Links {
    /// Links the threads need for `specs` and do not have yet, by thread.
    /// One that cannot be opened (its server is being lost) is logged: the
    /// chunks it would serve hold their results until a failover gives
    /// them another replica.
    fn open(&mut self, specs: &[TensorSpec]) -> Vec<Vec<NewLink>> {
        let mut out: Vec<Vec<_>> = (0..self.threads).map(|_| Vec::new()).collect();
        if let Some((rack, id)) = self.relay {
            for s in specs {
                for c in 0..s.num_chunks() {
                    let (relay, owner) = (s.slot_for(rack, c), s.slots[c]);
                    let Some(t) = relay.checked_sub(self.first_slot).filter(|&t| t < self.threads) else { continue };
                    if relay == owner || !self.made_up.insert((t, owner)) {
                        continue;
                    }
                    let mut hello = Header::new(MsgType::DataHello);
                    (hello.namespace, hello.key) = (self.namespace, id + t);
                    match self.connect(owner, &hello.encode(&[])) {
                        Ok(stream) => out[t as usize].push((owner, Some(stream), LinkTo::Owner, self.name(owner))),
                        // Its server is gone (the job is failing): the
                        // relay's rounds fail with that, naming it.
                        Err(e) => {
                            log::warn!(target: "server", "thread {t}: no link to owner {}: {e}", self.name(owner));
                            out[t as usize].push((owner, None, LinkTo::Owner, self.name(owner)));
                        }
                    }
                }
            }
        }
        for s in specs {
            for (&slot, &r) in s.slots.iter().zip(&s.replicas) {
                let Some(t) = slot.checked_sub(self.first_slot).filter(|&t| t < self.threads) else { continue };
                if !self.made.insert((t, r)) {
                    continue;
                }
                match self.connect(r, &replica::hello_frame(self.namespace, self.first_slot + t)) {
                    Ok(stream) => out[t as usize].push((r, Some(stream), LinkTo::Replica, self.name(r))),
                    Err(e) => {
                        self.made.remove(&(t, r));
                        log::warn!(target: "server", "thread {t}: no link to replica {}: {e}", self.name(r));
                    }
                }
            }
        }
        out
    }

    /// Who serves `slot`, for messages.
    fn name(&self, slot: u32) -> String {
        match self.slots.get(slot as usize) {
            Some((_, who)) => format!("{who} (slot {slot})"),
            None => format!("server thread slot {slot}"),
        }
    }

    /// An authenticated link to `slot`, introduced by `hello`.
    fn connect(&self, slot: u32, hello: &[u8]) -> std::io::Result<crate::transport::Authed> {
        let (addr, _) = self.slots.get(slot as usize).ok_or_else(|| std::io::Error::other("no such slot"))?;
        // One attempt: the thread's listener exists since its server
        // registered; a refusal means it is gone.
        let mut stream = crate::transport::connect_authenticated(addr, Duration::ZERO, &self.secret)?;
        stream.write_frames(hello)?;
        Ok(stream)
    }
}

/// The shared segments of this host's tensors, mapped when they are
/// declared (before any worker uses them), when workers here push by
/// reference (`mappers` > 0).
struct Segments {
    job_id: u64,
    host_tag: u64,
    mappers: usize,
    open: HashMap<u32, Arc<SharedTensor>>,
}

impl Segments {
    fn map(&mut self, specs: &[TensorSpec]) -> Result<Vec<(u32, Arc<SharedTensor>)>, String> {
        if self.mappers == 0 {
            return Ok(Vec::new());
        }
        let mut out = Vec::with_capacity(specs.len());
        // A member tensor's members push for themselves, never by reference.
        for s in specs.iter().filter(|s| s.members.is_empty()) {
            let st = match self.open.get(&s.key) {
                Some(st) => st.clone(),
                None => {
                    let st = Arc::new(SharedTensor::open(self.job_id, self.host_tag, s, self.mappers)?);
                    self.open.insert(s.key, st.clone());
                    st
                }
            };
            out.push((s.key, st));
        }
        Ok(out)
    }

    /// Drop this process's mappings of released tensors (each segment's
    /// name is gone already: every worker here had mapped it).
    fn release(&mut self, keys: &[u32]) {
        for k in keys {
            if let Some(st) = self.open.remove(k) {
                let _ = std::fs::remove_file(st.path());
            }
        }
    }

    /// Remove the names (in case a worker never came to map them).
    fn cleanup(&self) {
        for st in self.open.values() {
            let _ = std::fs::remove_file(st.path());
        }
    }
}
