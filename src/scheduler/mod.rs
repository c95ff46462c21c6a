//! The scheduler: rendezvous, tensor declarations and liveness for one job.
//!
//! Low-rate control plane, so it uses plain blocking sockets with one thread
//! per member and a single mutex-protected state. It
//! - waits for every worker and server to register, assigns ranks and sends
//!   each the cluster map;
//! - collects tensor declarations from all workers, checks they agree, places
//!   each tensor once (so placement is identical everywhere), installs the
//!   specs on every server and only then answers the workers;
//! - runs barriers;
//! - watches liveness: a member that disconnects or stops heartbeating is
//!   reported to everyone (PeerLost), which fails the job instead of hanging it;
//! - ends the job when every worker said goodbye, telling servers to exit.

mod declarations;
mod failover;
mod membership;
mod racks;
mod service;
mod state;

pub use racks::RackMode;
pub use service::{service_status, start_service, ServiceConfig, ServiceHandle};

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::protocol::auth::{self, Secret};
use crate::protocol::{read_control, read_control_limited, write_control, Control, Role, MAX_REGISTER_PAYLOAD};
use crate::transport::{AcceptErrors, AcceptFailure, DeadlineReader};
use declarations::{declare, free_on_servers, install, release, report_declaration_stalls};
use membership::{check_registration, enter_barrier, join, lost_reason, say_goodbye};
use state::{Member, Shared, State};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Address to listen on, e.g. "0.0.0.0:9000".
    pub bind: String,
    pub num_workers: u32,
    pub num_servers: u32,
    pub partition_bytes: u32,
    /// Heartbeat period of every member (at most a quarter of the peer timeout).
    pub heartbeat_ms: u32,
    /// A member silent for this long is declared dead.
    pub peer_timeout_ms: u32,
    /// Servers report rounds that waited longer than this.
    pub stall_ms: u32,
    /// Registration must complete within this time.
    pub join_timeout_ms: u32,
    pub namespace: u32,
    /// Workers on one host sum there first (see `placement::HostLayout`);
    /// off: every worker pushes everything itself, as with one per host.
    pub host_reduce: bool,
    /// A lost server's chunks move to the other servers and training goes
    /// on (`failover`); off: losing a server fails the job.
    pub failover: bool,
    /// Reduce within racks before the core (`racks`): PHub's model decides
    /// from the bandwidths (Gbit/s, 0: not given), or forced.
    pub rack_reduce: RackMode,
    pub link_gbit: f64,
    pub core_gbit: f64,
    /// The job's token: every connection proves it (`protocol::auth`).
    pub secret: Secret,
    /// Limits of a job on a shared service (0: none): tensors declared at
    /// once, and their bytes (what the servers hold for it).
    pub max_tensors: u32,
    pub max_bytes: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            bind: "0.0.0.0:0".into(),
            num_workers: 1,
            num_servers: 1,
            partition_bytes: crate::DEFAULT_PARTITION_BYTES,
            heartbeat_ms: 1000,
            peer_timeout_ms: 10_000,
            stall_ms: 30_000,
            join_timeout_ms: 300_000,
            namespace: 0,
            host_reduce: true,
            failover: true,
            rack_reduce: RackMode::Auto,
            link_gbit: 0.0,
            core_gbit: 0.0,
            secret: Secret::none(),
            max_tensors: 0,
            max_bytes: 0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error("scheduler cannot listen on {addr}: {err}")]
    Bind { addr: String, err: std::io::Error },
    #[error("invalid scheduler configuration: {0}")]
    Config(String),
    #[error("job failed: {0}")]
    JobFailed(String),
}

pub struct SchedulerHandle {
    pub addr: SocketAddr,
    join: thread::JoinHandle<Result<(), SchedulerError>>,
}

impl SchedulerHandle {
    pub fn wait(self) -> Result<(), SchedulerError> {
        self.join.join().unwrap_or_else(|_| Err(SchedulerError::JobFailed("scheduler thread panicked".into())))
    }
}

/// Bind and start the scheduler in a background thread.
pub fn start_scheduler(cfg: SchedulerConfig) -> Result<SchedulerHandle, SchedulerError> {
    crate::logging::init();
    let cfg = checked(cfg)?;
    let listener = TcpListener::bind(&cfg.bind).map_err(|err| SchedulerError::Bind { addr: cfg.bind.clone(), err })?;
    let addr = listener.local_addr().map_err(|err| SchedulerError::Bind { addr: cfg.bind.clone(), err })?;
    listener.set_nonblocking(true).map_err(|err| SchedulerError::Bind { addr: cfg.bind.clone(), err })?;
    let shared = Shared::new(cfg);
    let join = thread::Builder::new()
        .name("gradhub-scheduler".into())
        .spawn(move || accept_loop(shared, listener))
        .map_err(|e| SchedulerError::Config(format!("cannot spawn thread: {e}")))?;
    Ok(SchedulerHandle { addr, join })
}

/// The configuration, checked, with the heartbeat fitted to the timeout.
fn checked(cfg: SchedulerConfig) -> Result<SchedulerConfig, SchedulerError> {
    if cfg.num_workers == 0 || cfg.num_servers == 0 {
        return Err(SchedulerError::Config("need at least one worker and one server".into()));
    }
    if cfg.partition_bytes < 4 {
        return Err(SchedulerError::Config("partition size must be at least 4 bytes".into()));
    }
    // Every member waits this long for a heartbeat: it must span a few of them.
    if cfg.peer_timeout_ms < cfg.heartbeat_ms.max(10).saturating_mul(2) {
        return Err(SchedulerError::Config(format!(
            "peer timeout ({} ms) must be at least twice the heartbeat period ({} ms)",
            cfg.peer_timeout_ms, cfg.heartbeat_ms
        )));
    }
    // At least four heartbeats per peer timeout, so that one late heartbeat
    // (a busy machine) does not look like a death.
    let mut cfg = cfg;
    cfg.heartbeat_ms = cfg.heartbeat_ms.min(cfg.peer_timeout_ms / 4).max(10);
    Ok(cfg)
}

impl Shared {
    fn new(cfg: SchedulerConfig) -> Arc<Shared> {
        Arc::new(Shared { cfg, state: Mutex::new(State::default()), cv: Condvar::new(), pending: AtomicUsize::new(0) })
    }
}

/// Run a scheduler until the job ends (blocking).
pub fn run_scheduler(cfg: SchedulerConfig) -> Result<(), SchedulerError> {
    let h = start_scheduler(cfg)?;
    log::info!(target: "scheduler", "listening on {}", h.addr);
    h.wait()
}

fn accept_loop(shared: Arc<Shared>, listener: TcpListener) -> Result<(), SchedulerError> {
    let job = Job::start(shared.clone());
    let (mut refused, mut last_refusal_log) = (0u64, Instant::now() - Duration::from_secs(1));
    let mut accept_errors = AcceptErrors::default();
    while !job.over() {
        match listener.accept() {
            Ok((stream, peer)) => {
                // Connections not registered yet hold a thread each: bounded.
                let pending = shared.pending.fetch_add(1, Ordering::SeqCst);
                if pending >= pending_cap(&shared.cfg) {
                    shared.pending.fetch_sub(1, Ordering::SeqCst);
                    refused += 1;
                    if last_refusal_log.elapsed() >= Duration::from_secs(1) {
                        log::warn!(
                            target: "scheduler",
                            "refused {refused} connection(s) (latest from {peer}): {pending} are already registering"
                        );
                        (refused, last_refusal_log) = (0, Instant::now());
                    }
                    drop(stream);
                    continue;
                }
                let spawned = thread::Builder::new().name("gradhub-sched-conn".into()).spawn({
                    let shared = shared.clone();
                    move || member_thread(&shared, stream, peer)
                });
                if let Err(e) = spawned {
                    shared.pending.fetch_sub(1, Ordering::SeqCst);
                    log::warn!(target: "scheduler", "cannot serve {peer}: {e}");
                }
            }
            Err(e) => match accept_errors.on_error("scheduler", &e) {
                AcceptFailure::Skip => {}
                AcceptFailure::Drained | AcceptFailure::Later => thread::sleep(Duration::from_millis(20)),
            },
        }
    }
    job.conclude()
}

/// One job's life: its heartbeats, its registration deadline, its end.
struct Job {
    shared: Arc<Shared>,
    started: Instant,
    heartbeats: thread::JoinHandle<()>,
}

impl Job {
    fn start(shared: Arc<Shared>) -> Job {
        let heartbeats = {
            let shared = shared.clone();
            thread::spawn(move || heartbeat_loop(shared))
        };
        Job { shared, started: Instant::now(), heartbeats }
    }

    /// Whether the job ended (finished or failed); fails it when not every
    /// member registered within the join timeout.
    fn over(&self) -> bool {
        let shared = &self.shared;
        let mut st = shared.lock();
        if st.finished || st.failed.is_some() {
            return true;
        }
        let join_timeout = Duration::from_millis(shared.cfg.join_timeout_ms as u64);
        if st.assigned.is_none() && self.started.elapsed() > join_timeout {
            let n = st.joining.iter().flatten().count();
            let msg = format!(
                "only {n} of {} members registered within {:.1}s",
                shared.cfg.num_workers as u64 + shared.cfg.num_servers as u64,
                join_timeout.as_secs_f64()
            );
            shared.fail(&mut st, None, msg.clone());
            shared.reject_joining(&mut st, &msg);
            return true;
        }
        false
    }

    /// After `over`: how the job ended. Every member still connected is
    /// then cut off, so no thread of the job outlives it.
    fn conclude(self) -> Result<(), SchedulerError> {
        let _ = self.heartbeats.join();
        // Give member threads a moment to flush final messages.
        thread::sleep(Duration::from_millis(200));
        let mut st = self.shared.lock();
        for m in &st.members {
            m.disconnect();
        }
        for r in st.joining.iter_mut().flatten() {
            let _ = r.stream.shutdown(std::net::Shutdown::Both);
        }
        match &st.failed {
            Some(reason) => Err(SchedulerError::JobFailed(reason.clone())),
            None => {
                log::info!(target: "scheduler", "all workers finished; job complete");
                Ok(())
            }
        }
    }
}

fn heartbeat_loop(shared: Arc<Shared>) {
    let period = Duration::from_millis(shared.cfg.heartbeat_ms.max(10) as u64);
    loop {
        let members = {
            let st = shared.lock();
            if st.finished || st.failed.is_some() {
                return;
            }
            st.members.clone()
        };
        for m in members {
            m.send(&Control::Heartbeat, shared.cfg.namespace);
        }
        report_declaration_stalls(&shared);
        free_on_servers(&shared, &mut shared.lock());
        thread::sleep(period);
    }
}

/// At most this many connections may be registering at once (each holds a
/// thread until it has registered or its peer timeout passed).
fn pending_cap(cfg: &SchedulerConfig) -> usize {
    2 * (cfg.num_workers + cfg.num_servers) as usize + 16
}

/// Serve one connection: its registration (counted in `pending` until it is
/// done), then, for a member, its messages.
fn member_thread(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let timeout = Duration::from_millis(shared.cfg.peer_timeout_ms as u64);
    let ns = shared.cfg.namespace;
    let registered = greet(&stream, peer, &shared.cfg.secret.keys(), timeout, |_| ns)
        .and_then(|(_, first)| expect_register(&stream, peer, first, ns))
        .and_then(|reg| admit(shared, reg, stream, peer));
    shared.pending.fetch_sub(1, Ordering::SeqCst);
    if let Some((me, stream)) = registered {
        serve_member(shared, &me, stream);
    }
}

/// A new connection's handshake and first message (the job it announced and
/// what it sent), or None, logged, if it failed. Before it has registered, a
/// peer gets a small frame and the peer timeout for the handshake and that
/// message together, so a stranger can hold neither memory nor a thread.
fn greet(
    stream: &TcpStream,
    peer: SocketAddr,
    keys: &impl Fn(&str) -> Secret,
    timeout: Duration,
    namespace_of: impl Fn(&str) -> u32,
) -> Option<(String, Result<Control, crate::protocol::ReadError>)> {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(timeout));
    let mut within = DeadlineReader::new(stream, timeout);
    let job = match auth::listen_blocking(&mut within, &mut &*stream, keys) {
        Ok(job) => job,
        Err(e) => {
            log::warn!(target: "scheduler", "rejecting {peer}: {e}");
            return None;
        }
    };
    let first = read_control_limited(&mut within, namespace_of(&job), MAX_REGISTER_PAYLOAD);
    let _ = stream.set_read_timeout(Some(timeout));
    Some((job, first))
}

/// The Register a member's first message must be (else it is told why).
fn expect_register(
    mut stream: &TcpStream,
    peer: SocketAddr,
    first: Result<Control, crate::protocol::ReadError>,
    ns: u32,
) -> Option<crate::protocol::Register> {
    match first {
        Ok(Control::Register(r)) => Some(r),
        Ok(other) => {
            let message = format!("expected Register, got {:?}", other.msg_type());
            log::warn!(target: "scheduler", "rejecting {peer}: {message}");
            let _ = write_control(&mut stream, &Control::Error { message }, ns);
            None
        }
        Err(e) => {
            log::warn!(target: "scheduler", "rejecting {peer}: bad registration: {e}");
            let _ = write_control(&mut stream, &Control::Error { message: format!("bad registration: {e}") }, ns);
            None
        }
    }
}

/// Check a registration and join the job with it (blocks until everyone has).
fn admit(
    shared: &Arc<Shared>,
    reg: crate::protocol::Register,
    mut stream: TcpStream,
    peer: SocketAddr,
) -> Option<(Arc<Member>, TcpStream)> {
    let ns = shared.cfg.namespace;
    if let Err(why) = check_registration(&shared.cfg, &reg) {
        log::warn!(target: "scheduler", "rejecting {} at {peer}: {why}", reg.role.name());
        let _ = write_control(&mut stream, &Control::Error { message: why.to_string() }, ns);
        return None;
    }
    // The member's writer: a clone, so this thread keeps reading from `stream`.
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            log::warn!(target: "scheduler", "rejecting {peer}: cannot clone its socket: {e}");
            return None;
        }
    };
    let me = match join(shared, reg, peer, writer) {
        Ok((m, false)) => m,
        Ok((m, true)) => {
            // Joined the running job: move chunks to it, on a thread of its
            // own (this one reads the acks it waits for).
            let (sh, new) = (shared.clone(), m.clone());
            let moved =
                thread::Builder::new().name("gradhub-take-in".into()).spawn(move || failover::take_in(&sh, &new));
            if let Err(e) = moved {
                let mut st = shared.lock();
                shared.fail(&mut st, None, format!("cannot start moving chunks to {}: {e}", m.describe()));
            }
            m
        }
        Err(why) => {
            let _ = write_control(&mut stream, &Control::Error { message: why.to_string() }, ns);
            return None;
        }
    };
    Some((me, stream))
}

fn serve_member(shared: &Shared, me: &Arc<Member>, mut stream: TcpStream) {
    let ns = shared.cfg.namespace;
    loop {
        let msg = read_control(&mut stream, ns);
        let mut st = shared.lock();
        let done = st.finished || st.failed.is_some();
        let gone = me.role == Role::Worker && st.said_goodbye.contains(&me.rank);
        match msg {
            // A job that is over keeps no member (a shared service frees it).
            Ok(Control::Heartbeat) if done => return,
            Ok(Control::Heartbeat) => {}
            Ok(Control::Declare { req, entries }) if me.role == Role::Worker => {
                let batch = declare(shared, &mut st, me.rank, req, entries);
                drop(st);
                if let Some((batch, specs)) = batch {
                    install(shared, batch, specs);
                }
                continue;
            }
            Ok(Control::ServerDeclareAck { batch }) if me.role == Role::Server => {
                st.acks.entry(batch).or_default().insert(me.rank);
                shared.cv.notify_all();
            }
            Ok(Control::ServerMoveAck { batch, kept }) if me.role == Role::Server => {
                st.move_kept.entry(batch).or_default().extend(kept);
                st.acks.entry(batch).or_default().insert(me.rank);
                shared.cv.notify_all();
            }
            Ok(Control::Barrier { id }) if me.role == Role::Worker => enter_barrier(shared, &mut st, me.rank, id),
            Ok(Control::Join) if me.role == Role::Worker => membership::join_worker(shared, &mut st, me.rank),
            Ok(Control::JoinOp { name, numel, dtype, flags, round }) if me.role == Role::Worker => {
                membership::forward_join_op(shared, &mut st, Control::JoinOp { name, numel, dtype, flags, round })
            }
            Ok(op @ Control::SetOp { .. }) if me.role == Role::Worker => {
                if let Err(reason) = membership::forward_set_op(shared, &st, me.rank, op) {
                    me.send(&Control::Error { message: reason.clone() }, ns);
                    shared.fail(&mut st, Some(me), reason);
                    return;
                }
            }
            Ok(Control::Release { keys }) if me.role == Role::Worker => {
                if let Err(reason) = release(shared, &mut st, me.rank, keys) {
                    me.send(&Control::Error { message: reason.clone() }, ns);
                    shared.fail(&mut st, Some(me), reason);
                    return;
                }
            }
            Ok(Control::Goodbye) if me.role == Role::Worker => {
                say_goodbye(shared, &mut st, me.rank);
                // Nothing more for it: its session sees the end at once (see `SessionSender::close`).
                me.finish_writing();
            }
            Ok(Control::Error { message }) => {
                let reason = format!("{} reported an error: {message}", me.describe());
                shared.fail(&mut st, Some(me), reason);
                return;
            }
            Ok(other) => {
                let reason = format!("{} sent an unexpected {:?}", me.describe(), other.msg_type());
                me.send(&Control::Error { message: reason.clone() }, ns);
                shared.fail(&mut st, Some(me), reason);
                return;
            }
            Err(e) => {
                if done || gone {
                    return;
                }
                let reason = lost_reason(&shared.cfg, me, &e);
                if me.role == Role::Server {
                    drop(st);
                    failover::take_over(shared, me, reason);
                    return;
                }
                shared.fail(&mut st, Some(me), reason);
                return;
            }
        }
    }
}
