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
//!
//! Its state is made of sub-states, each owned by its module and composed
//! in `state::State`; dependencies between the modules go one way (see
//! docs/architecture.md, "Scheduler").

mod config;
mod declarations;
mod elastic;
mod failover;
mod installs;
mod job;
mod joins;
mod member;
mod membership;
mod moves;
mod racks;
mod reach;
mod rejoin;
mod service;
mod state;

pub use config::{SchedulerConfig, SchedulerError};
pub use racks::RackMode;
pub use service::{service_status, start_service, ServiceConfig, ServiceHandle};

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::transport::{AcceptErrors, AcceptFailure};
use config::checked;
use job::{admit, admit_rejoin, expect_arrival, greet, serve_member, Arrival, Job};
use state::Shared;

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
    if let Some(at) = shared.cfg.metrics_addr.clone() {
        let s = shared.clone();
        let bound = crate::metrics::serve(&at, move || s.metrics())
            .map_err(|err| SchedulerError::Bind { addr: at.clone(), err })?;
        log::info!(target: "scheduler", "metrics on http://{bound}/metrics");
    }
    let join = thread::Builder::new()
        .name("gradhub-scheduler".into())
        .spawn(move || accept_loop(shared, listener))
        .map_err(|e| SchedulerError::Config(format!("cannot spawn thread: {e}")))?;
    Ok(SchedulerHandle { addr, join })
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
    let registered = greet(stream, peer, &shared.cfg.secret.keys(), timeout, |_| ns).and_then(|g| {
        let halves = (g.reader, g.writer);
        match expect_arrival(&halves.1, peer, g.first, ns)? {
            Arrival::Register(reg) => admit(shared, reg, halves, peer),
            Arrival::Rejoin(rj) => admit_rejoin(shared, *rj, halves, peer),
        }
    });
    shared.pending.fetch_sub(1, Ordering::SeqCst);
    if let Some((me, stream)) = registered {
        serve_member(shared, &me, stream);
    }
}
