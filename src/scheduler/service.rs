//! A shared summation service (PHub §3.2): one long-lived scheduler hosts
//! many jobs at once on one fleet of server processes.
//!
//! - A job is known by its name and proves it with a token derived from
//!   the service's master secret (`auth::Secret::job_token`): the operator
//!   hands each job its own, and a job's token opens no other job.
//! - The first worker of a job starts it: the service makes it a scheduler
//!   state of its own (`Shared`: members, key space, placement, barriers,
//!   failures) and has every server process start a server instance for it
//!   (`server::service`), with the job's token, namespace and fresh ports.
//!   From then on the job runs exactly as a job with its own scheduler and
//!   servers does; nothing of it is shared with another job but the
//!   processes and their CPUs, which the OS shares between the jobs'
//!   threads.
//! - When a job ends, finished or failed, its state here and its server
//!   instances end with it, and their memory is freed.
//! - The service itself (empty job name, the master secret) is spoken to by
//!   its server processes (`ServiceJoin`, then traffic reports) and by
//!   operators (`StatusRequest`: what `gradhub status` prints).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use super::elastic::{Formations, ServiceJobs};
use super::membership::check_registration;
use super::state::Shared;
use crate::logging::json_str as js;
use crate::transport::{AcceptErrors, AcceptFailure};

use super::config::{checked, SchedulerConfig, SchedulerError};
use super::job::{admit, admit_rejoin, expect_arrival, greet, serve_member, Arrival, Greeting, Job};
use super::member::{Reader, Writer};
use crate::protocol::auth::{job_namespace, Secret};
use crate::protocol::{read_control, write_control, Control, JobTraffic, ReadError, Register, Role, ServiceJoin};

#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Address to listen on, e.g. "0.0.0.0:9000".
    pub bind: String,
    /// The master secret every job's token derives from.
    pub master: Secret,
    /// What each job gets: partition size, timeouts, host stage, failover
    /// and the per-job limits (`max_tensors`, `max_bytes`). Its job size,
    /// namespace and secret are the job's own.
    pub job: SchedulerConfig,
    /// Jobs running at once.
    pub max_jobs: u32,
    /// Workers of one job (its first worker says how many).
    pub max_workers: u32,
    /// Connections authenticating or registering at once (each holds a
    /// thread until it has, or its peer timeout passed).
    pub max_pending: usize,
    /// Serve Prometheus metrics on this address (`--metrics-addr`).
    pub metrics_addr: Option<String>,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            bind: "0.0.0.0:9000".into(),
            master: Secret::none(),
            job: SchedulerConfig::default(),
            max_jobs: 16,
            max_workers: 4096,
            max_pending: 512,
            metrics_addr: None,
        }
    }
}

pub struct ServiceHandle {
    pub addr: SocketAddr,
    join: thread::JoinHandle<Result<(), SchedulerError>>,
}

impl ServiceHandle {
    /// Serve until the listener fails (the service has no end of its own).
    pub fn wait(self) -> Result<(), SchedulerError> {
        self.join.join().unwrap_or_else(|_| Err(SchedulerError::JobFailed("service thread panicked".into())))
    }
}

struct Service {
    cfg: ServiceConfig,
    addr: SocketAddr,
    jobs: Mutex<HashMap<String, Arc<JobEntry>>>,
    servers: Mutex<Vec<Arc<ServerEntry>>>,
    pending: AtomicUsize,
    next_server: AtomicU64,
    next_start: AtomicU64,
    started: Instant,
    /// Elastic jobs' workers waiting for their next generation.
    elastic: Formations,
}

struct JobEntry {
    shared: Arc<Shared>,
    /// This start of the job (its `ServiceStart`): reports of an earlier
    /// start under the same name (an elastic job's last generation) are
    /// not this one's. None: a job rebuilt by a service that restarted
    /// (its instances report the start the last service gave them).
    start: Option<u64>,
    started: Instant,
    traffic: Mutex<JobRate>,
    /// Set by the job's thread once it is over: read without the job's
    /// lock, so the service's map is never held waiting for one job.
    ended: AtomicBool,
}

/// A job's traffic as its servers report it, and the rate over the last
/// report interval.
#[derive(Default)]
struct JobRate {
    by_server: HashMap<u64, (u64, u64)>,
    sampled: Option<(Instant, u64)>,
    bytes_per_s: f64,
}

/// A server process of the service.
struct ServerEntry {
    id: u64,
    join: ServiceJoin,
    peer: SocketAddr,
    writer: Writer,
    /// The jobs it ran a server for at its last report.
    jobs: Mutex<Vec<String>>,
}

impl ServerEntry {
    fn send(&self, msg: &Control) -> bool {
        self.writer.send(msg, 0)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bind and start the service in a background thread.
pub fn start_service(cfg: ServiceConfig) -> Result<ServiceHandle, SchedulerError> {
    crate::logging::init();
    if cfg.master.is_none() {
        return Err(SchedulerError::Config("a shared service needs a master token".into()));
    }
    // The job template is checked as a job would be (size filled in later).
    let mut template = cfg.job.clone();
    (template.num_workers, template.num_servers) = (1, 1);
    checked(template)?;
    let listener = TcpListener::bind(&cfg.bind).map_err(|err| SchedulerError::Bind { addr: cfg.bind.clone(), err })?;
    let addr = listener.local_addr().map_err(|err| SchedulerError::Bind { addr: cfg.bind.clone(), err })?;
    let svc = Arc::new(Service {
        cfg,
        addr,
        jobs: Mutex::default(),
        servers: Mutex::default(),
        pending: AtomicUsize::new(0),
        next_server: AtomicU64::new(0),
        // Above any start a service that ran before on this address gave
        // (the instances of jobs it rebuilds report theirs).
        next_start: AtomicU64::new(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64),
        ),
        started: Instant::now(),
        elastic: Formations::default(),
    });
    if let Some(at) = svc.cfg.metrics_addr.clone() {
        let s = svc.clone();
        let bound =
            crate::metrics::serve(&at, move || metrics(&s)).map_err(|err| SchedulerError::Bind { addr: at, err })?;
        log::info!(target: "service", "metrics on http://{bound}/metrics");
    }
    {
        let svc = svc.clone();
        thread::Builder::new()
            .name("gradhub-service-hb".into())
            .spawn(move || heartbeat_servers(&svc))
            .map_err(|e| SchedulerError::Config(format!("cannot spawn thread: {e}")))?;
    }
    let join = thread::Builder::new()
        .name("gradhub-service".into())
        .spawn(move || accept_loop(svc, listener))
        .map_err(|e| SchedulerError::Config(format!("cannot spawn thread: {e}")))?;
    Ok(ServiceHandle { addr, join })
}

fn accept_loop(svc: Arc<Service>, listener: TcpListener) -> Result<(), SchedulerError> {
    log::info!(target: "service", "listening on {}; up to {} jobs", svc.addr, svc.cfg.max_jobs);
    let mut last_refusal_log = Instant::now() - Duration::from_secs(1);
    let mut accept_errors = AcceptErrors::default();
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                if accept_errors.on_error("service", &e) != AcceptFailure::Skip {
                    thread::sleep(Duration::from_millis(20));
                }
                continue;
            }
        };
        if svc.pending.fetch_add(1, Ordering::SeqCst) >= svc.cfg.max_pending {
            svc.pending.fetch_sub(1, Ordering::SeqCst);
            if last_refusal_log.elapsed() >= Duration::from_secs(1) {
                log::warn!(target: "service", "refusing {peer}: {} connections are already registering", svc.cfg.max_pending);
                last_refusal_log = Instant::now();
            }
            continue;
        }
        let svc2 = svc.clone();
        let spawned =
            thread::Builder::new().name("gradhub-service-conn".into()).spawn(move || connection(&svc2, stream, peer));
        if let Err(e) = spawned {
            svc.pending.fetch_sub(1, Ordering::SeqCst);
            log::warn!(target: "service", "cannot serve {peer}: {e}");
        }
    }
}

/// The namespace of a job's frames (the service's own: 0).
fn namespace_of(job: &str) -> u32 {
    if job.is_empty() {
        0
    } else {
        job_namespace(job)
    }
}

/// One connection: a job member, a server process or an operator.
fn connection(svc: &Arc<Service>, stream: TcpStream, peer: SocketAddr) {
    let timeout = Duration::from_millis(svc.cfg.job.peer_timeout_ms as u64);
    let greeted = greet(stream, peer, &svc.cfg.master.service_keys(), timeout, namespace_of);
    let Some(Greeting { job, first, reader, writer }) = greeted else {
        svc.pending.fetch_sub(1, Ordering::SeqCst);
        return;
    };
    if job.is_empty() {
        svc.pending.fetch_sub(1, Ordering::SeqCst);
        match first {
            Ok(Control::ServiceJoin(j)) => serve_server(svc, j, (reader, writer), peer),
            Ok(Control::StatusRequest) => {
                writer.send(&Control::StatusReply { json: status_json(svc) }, 0);
            }
            Ok(other) => log::warn!(target: "service", "rejecting {peer}: unexpected {:?}", other.msg_type()),
            Err(e) => log::warn!(target: "service", "rejecting {peer}: {e}"),
        }
        return;
    }
    let ns = namespace_of(&job);
    let reg = match expect_arrival(&writer, peer, first, ns) {
        Some(Arrival::Register(reg)) => Some(reg),
        Some(Arrival::Rejoin(rj)) => {
            svc.pending.fetch_sub(1, Ordering::SeqCst);
            resume(svc, &job, *rj, (reader, writer), peer);
            return;
        }
        None => None,
    };
    // Authenticated and registered: from here the job's size bounds it.
    svc.pending.fetch_sub(1, Ordering::SeqCst);
    let admitted = reg.and_then(|reg| {
        let role = reg.role;
        match join(svc, &job, reg, &writer) {
            Ok((shared, reg)) => admit(&shared, reg, (reader, writer), peer).map(|m| (shared, m)),
            Err(message) => {
                log::warn!(target: "service", "job '{job}': refusing {} at {peer}: {message}", role.name());
                writer.send(&Control::Error { message }, ns);
                None
            }
        }
    });
    if let Some((shared, (me, stream))) = admitted {
        log::info!(target: "service", "job '{job}': admitted {}", me.describe());
        serve_member(&shared, &me, stream);
    }
}

/// A member of job `name` dialled again: its session resumes if the job
/// runs here with it (its connection broke: `Member::offer`); else it
/// rejoins the job as rebuilt by a service that restarted (the first
/// member back starts the rebuild: `rebuilt_job`).
fn resume(
    svc: &Arc<Service>,
    name: &str,
    rj: crate::protocol::Rejoin,
    (reader, writer): (Reader, Writer),
    peer: SocketAddr,
) {
    let who = format!("{} {}", rj.register.role.name(), rj.welcome.rank);
    let ns = namespace_of(name);
    let shared = match rebuilt_job(svc, name, &rj) {
        Ok(shared) => shared,
        Err(message) => {
            log::warn!(target: "service", "rejecting {who} of job '{name}' at {peer}: {message}");
            writer.send(&Control::Error { message }, ns);
            return;
        }
    };
    // Resumed (`admit_rejoin` hands the connection to the member's thread)
    // or taken back into the rebuilt job.
    if let Some((me, stream)) = admit_rejoin(&shared, rj, (reader, writer), peer) {
        log::info!(target: "service", "job '{name}': {} rejoined", me.describe());
        serve_member(&shared, &me, stream);
    }
}

/// The running job `name`, or, if this service does not run it (it
/// restarted), the job made again from its first member back: the same
/// size, namespace and token, rebuilt from what its members report
/// (`scheduler::rejoin`). Its server instances run on in the service's
/// server processes and rejoin it as the workers do.
fn rebuilt_job(svc: &Arc<Service>, name: &str, rj: &crate::protocol::Rejoin) -> Result<Arc<Shared>, String> {
    let mut jobs = lock(&svc.jobs);
    if let Some(j) = jobs.get(name).filter(|j| !j.ended.load(Ordering::SeqCst)) {
        return Ok(j.shared.clone());
    }
    if rj.register.elastic.is_some() {
        return Err(format!(
            "elastic job '{name}' does not run on this service (it restarted): an elastic job's generation is not \
             rebuilt; its workers start the next one"
        ));
    }
    let running = jobs.values().filter(|j| !j.ended.load(Ordering::SeqCst)).count();
    if running >= svc.cfg.max_jobs as usize {
        return Err(format!("the service runs its limit of {} jobs; job '{name}' cannot be rebuilt", svc.cfg.max_jobs));
    }
    let mut cfg = svc.cfg.job.clone();
    cfg.num_workers = rj.welcome.num_workers;
    cfg.num_servers = rj.welcome.servers.len() as u32;
    cfg.namespace = job_namespace(name);
    cfg.secret = svc.cfg.master.key_for(name);
    let cfg = checked(cfg).map_err(|e| e.to_string())?;
    let shared = Shared::new(cfg);
    run_job(svc, &mut jobs, name, shared.clone(), None, false)?;
    log::warn!(target: "service", "job '{name}': its {} rejoins a service that restarted: rebuilding the job", rj.register.role.name());
    Ok(shared)
}

/// The job `reg` joins (and the registration it joins with): an elastic
/// job's worker waits for the job's next generation to form.
fn join(svc: &Arc<Service>, name: &str, reg: Register, stream: &Writer) -> Result<(Arc<Shared>, Register), String> {
    match reg.elastic {
        Some(e) if reg.role == Role::Worker => {
            let job = &svc.cfg.job;
            let timeouts = (job.peer_timeout_ms, job.join_timeout_ms as u64);
            svc.elastic.join(svc, svc.cfg.max_workers, timeouts, name, (reg, e), stream)
        }
        _ => job_for(svc, name, &reg).map(|shared| (shared, reg)),
    }
}

/// The service's jobs as elastic formation sees them.
impl ServiceJobs for Arc<Service> {
    fn running(&self, name: &str) -> bool {
        lock(&self.jobs).get(name).is_some_and(|j| !j.ended.load(Ordering::SeqCst))
    }

    fn announce_joiner(&self, name: &str) -> bool {
        let jobs = lock(&self.jobs);
        let live = jobs.get(name).filter(|j| !j.ended.load(Ordering::SeqCst)).filter(|j| !j.shared.lock().is_over());
        let Some(job) = live else { return false };
        let st = job.shared.lock();
        for m in st.members.workers() {
            m.send(&Control::HostsUpdated, job.shared.cfg.namespace);
        }
        true
    }

    fn start(&self, name: &str, reg: &Register) -> Result<Arc<Shared>, String> {
        job_for(self, name, reg)
    }
}

/// The running job `name`, or a new one started by this worker's Register.
fn job_for(svc: &Arc<Service>, name: &str, reg: &Register) -> Result<Arc<Shared>, String> {
    let mut jobs = lock(&svc.jobs);
    if let Some(j) = jobs.get(name) {
        if !j.ended.load(Ordering::SeqCst) {
            if reg.elastic.is_some() {
                return Err(format!("elastic job '{name}' is running: a worker joins it at its next generation"));
            }
            return Ok(j.shared.clone());
        }
    }
    if reg.role != Role::Worker {
        return Err(format!("job '{name}' is not running on this service (its first worker starts it)"));
    }
    if reg.num_workers == 0 || reg.num_workers > svc.cfg.max_workers {
        return Err(format!(
            "a job on this service needs its size, 1 to {} workers (GRADHUB_NUM_WORKERS), not {}",
            svc.cfg.max_workers, reg.num_workers
        ));
    }
    let running = jobs.values().filter(|j| !j.ended.load(Ordering::SeqCst)).count();
    if running >= svc.cfg.max_jobs as usize {
        return Err(format!("the service runs its limit of {} jobs; try again when one has ended", svc.cfg.max_jobs));
    }
    let servers: Vec<Arc<ServerEntry>> = lock(&svc.servers).clone();
    if servers.is_empty() {
        return Err("the service has no servers: start `gradhub server --service` on its machines".into());
    }
    let mut cfg = svc.cfg.job.clone();
    cfg.num_workers = reg.num_workers;
    cfg.num_servers = servers.len() as u32;
    cfg.namespace = job_namespace(name);
    cfg.secret = svc.cfg.master.key_for(name);
    let cfg = checked(cfg).map_err(|e| e.to_string())?;
    // A registration the job would refuse must not start it.
    check_registration(&cfg, reg).map_err(|e| e.to_string())?;
    let shared = Shared::new(cfg);
    let start = svc.next_start.fetch_add(1, Ordering::Relaxed);
    run_job(svc, &mut jobs, name, shared.clone(), Some(start), reg.elastic.is_some())?;
    drop(jobs);
    log::info!(
        target: "service",
        "job '{name}': started for {} workers on {} servers",
        reg.num_workers,
        servers.len()
    );
    for (rank, s) in servers.iter().enumerate() {
        let start =
            Control::ServiceStart { job: name.to_string(), namespace: job_namespace(name), start, rank: rank as u32 };
        if !s.send(&start) {
            // Its server would never register: fail now, not at the join timeout.
            let why = format!("the service's server at {} could not be told to start the job", s.peer);
            let mut st = shared.lock();
            shared.fail(&mut st, None, why.clone());
            return Err(why);
        }
    }
    Ok(shared)
}

/// Enter job `name` in the service's map and run its life on a thread of
/// its own: it ends (finished or failed) and leaves the map.
fn run_job(
    svc: &Arc<Service>,
    jobs: &mut HashMap<String, Arc<JobEntry>>,
    name: &str,
    shared: Arc<Shared>,
    start: Option<u64>,
    elastic_job: bool,
) -> Result<(), String> {
    let entry = Arc::new(JobEntry {
        shared: shared.clone(),
        start,
        started: Instant::now(),
        traffic: Mutex::default(),
        ended: AtomicBool::new(false),
    });
    jobs.insert(name.to_string(), entry.clone());
    let (svc2, name2) = (svc.clone(), name.to_string());
    let spawned = thread::Builder::new().name(format!("gradhub-job-{name}")).spawn(move || {
        let job = Job::start(entry.shared.clone());
        while !job.over() {
            thread::sleep(Duration::from_millis(50));
        }
        if elastic_job {
            // Its next generation expects the workers that were not lost.
            let lost = entry.shared.lock().lost_workers;
            svc2.elastic.ended(&name2, entry.shared.cfg.num_workers.saturating_sub(lost));
        }
        entry.ended.store(true, Ordering::SeqCst);
        svc2.elastic.wake();
        match job.conclude() {
            Ok(()) => log::info!(target: "service", "job '{name2}': complete"),
            // A lost worker ends an elastic job's generation, not the job.
            Err(SchedulerError::JobFailed(why)) if elastic_job => {
                log::info!(target: "service", "elastic job '{name2}': a generation ended ({why})")
            }
            Err(e) => log::warn!(target: "service", "job '{name2}' ended: {e}"),
        }
        let mut jobs = lock(&svc2.jobs);
        if jobs.get(&name2).is_some_and(|j| Arc::ptr_eq(j, &entry)) {
            jobs.remove(&name2);
        }
    });
    if let Err(e) = spawned {
        jobs.remove(name);
        let mut st = shared.lock();
        shared.fail(&mut st, None, format!("the service cannot start the job: {e}"));
        return Err(format!("the service cannot start the job: {e}"));
    }
    Ok(())
}

/// A server process's link: it reports traffic every second; silent for
/// the peer timeout or disconnected, it leaves the service (its jobs see
/// their server instances lost and fail over or fail, as any job does).
fn serve_server(svc: &Arc<Service>, join: ServiceJoin, (stream, writer): (Reader, Writer), peer: SocketAddr) {
    let id = svc.next_server.fetch_add(1, Ordering::SeqCst);
    log::info!(
        target: "service",
        "server {id} joined from {peer} ({}, {} threads, advertised as {})",
        join.hostname,
        join.threads,
        join.addr
    );
    let entry = Arc::new(ServerEntry { id, join, peer, writer: writer.clone(), jobs: Mutex::default() });
    lock(&svc.servers).push(entry.clone());
    let mut stream = stream;
    let why = loop {
        match read_control(&mut stream, 0) {
            Ok(Control::ServiceStats { jobs }) => {
                *lock(&entry.jobs) = jobs.iter().map(|j| j.job.clone()).collect();
                record(svc, id, jobs);
            }
            Ok(Control::Heartbeat) => {}
            Ok(other) => break format!("unexpected {:?}", other.msg_type()),
            Err(ReadError::TimedOut) => break "silent for the peer timeout".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    // With no job of its running (stopped at the service's end), leaving is no loss.
    let running = {
        let jobs = lock(&svc.jobs);
        lock(&entry.jobs).iter().any(|j| jobs.get(j).is_some_and(|j| !j.ended.load(Ordering::SeqCst)))
    };
    let level = if running { log::Level::Warn } else { log::Level::Info };
    log::log!(target: "service", level, "server {id} ({peer}) left the service: {why}");
    lock(&svc.servers).retain(|s| s.id != id);
    writer.shutdown(std::net::Shutdown::Both);
}

fn record(svc: &Service, server: u64, reports: Vec<JobTraffic>) {
    // Jobs a server instance could not serve: failed below, outside the
    // map's lock (a job's own lock may wait on a slow member's write).
    let mut fail: Vec<(Arc<Shared>, String)> = Vec::new();
    let jobs = lock(&svc.jobs);
    for r in reports {
        let Some(j) = jobs.get(&r.job).filter(|j| j.start.is_none_or(|s| s == r.start)) else { continue };
        if !r.error.is_empty() {
            if !j.ended.load(Ordering::SeqCst) {
                fail.push((j.shared.clone(), format!("a server of the service could not serve it: {}", r.error)));
            }
            continue;
        }
        let mut t = lock(&j.traffic);
        t.by_server.insert(server, (r.bytes, r.rounds));
        let total: u64 = t.by_server.values().map(|v| v.0).sum();
        let now = Instant::now();
        match t.sampled {
            Some((at, bytes)) if now.duration_since(at) >= Duration::from_millis(900) => {
                t.bytes_per_s = total.saturating_sub(bytes) as f64 / now.duration_since(at).as_secs_f64();
                t.sampled = Some((now, total));
            }
            Some(_) => {}
            None => t.sampled = Some((now, total)),
        }
    }
    drop(jobs);
    // Not at the join timeout: its workers learn why now.
    for (shared, why) in fail {
        let mut st = shared.lock();
        shared.fail(&mut st, None, why);
    }
}

fn heartbeat_servers(svc: &Service) {
    loop {
        let servers: Vec<Arc<ServerEntry>> = lock(&svc.servers).clone();
        for s in servers {
            s.send(&Control::Heartbeat);
        }
        thread::sleep(Duration::from_millis(svc.cfg.job.heartbeat_ms.clamp(10, 1000) as u64));
    }
}

/// The service's metrics: its jobs, and per job its members, held bytes and
/// traffic as its servers report it (the same figures as `status_json`).
fn metrics(svc: &Service) -> crate::metrics::Sample {
    let jobs: Vec<(String, Arc<JobEntry>)> = lock(&svc.jobs).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut s = crate::metrics::Sample { jobs: Some(jobs.len() as u64), ..Default::default() };
    for (name, j) in &jobs {
        let (bytes, rounds) = lock(&j.traffic).by_server.values().fold((0u64, 0u64), |a, v| (a.0 + v.0, a.1 + v.1));
        j.shared.sample(name, &mut s);
        s.pushed_bytes.push((name.clone(), bytes));
        s.rounds.push((name.clone(), rounds));
    }
    s
}

/// What `gradhub status` prints: the service, its servers, and per job its
/// members, tensors, bytes held and traffic.
fn status_json(svc: &Service) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "{{\"addr\": {}, \"uptime_s\": {:.1}, \"max_jobs\": {}, \"servers\": [",
        js(&svc.addr.to_string()),
        svc.started.elapsed().as_secs_f64(),
        svc.cfg.max_jobs
    );
    for (i, s) in lock(&svc.servers).iter().enumerate() {
        let _ = write!(
            o,
            "{}{{\"id\": {}, \"peer\": {}, \"host\": {}, \"addr\": {}, \"threads\": {}, \"jobs\": [{}]}}",
            if i > 0 { ", " } else { "" },
            s.id,
            js(&s.peer.to_string()),
            js(&s.join.hostname),
            js(&s.join.addr),
            s.join.threads,
            lock(&s.jobs).iter().map(|j| js(j)).collect::<Vec<_>>().join(", ")
        );
    }
    o.push_str("], \"jobs\": [");
    let jobs: Vec<(String, Arc<JobEntry>)> = lock(&svc.jobs).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (i, (name, j)) in jobs.iter().enumerate() {
        let (bytes, rounds, rate) = {
            let t = lock(&j.traffic);
            let (b, r) = t.by_server.values().fold((0u64, 0u64), |a, v| (a.0 + v.0, a.1 + v.1));
            (b, r, t.bytes_per_s)
        };
        let st = j.shared.lock();
        let state = st.phase_name();
        let (tensors, held_bytes) = st.decls.held();
        let _ = write!(
            o,
            "{}{{\"name\": {}, \"namespace\": {}, \"state\": {}, \"age_s\": {:.1}, \"workers\": {}, \"servers\": {}, \
             \"tensors\": {tensors}, \"held_bytes\": {held_bytes}, \"pushed_bytes\": {bytes}, \"rounds\": {rounds}, \
             \"push_rate_bytes_per_s\": {rate:.0}, \"members\": [",
            if i > 0 { ", " } else { "" },
            js(name),
            j.shared.cfg.namespace,
            js(state),
            j.started.elapsed().as_secs_f64(),
            j.shared.cfg.num_workers,
            j.shared.cfg.num_servers,
        );
        for (k, m) in st.members.all().iter().enumerate() {
            let _ = write!(
                o,
                "{}{{\"role\": {}, \"rank\": {}, \"peer\": {}}}",
                if k > 0 { ", " } else { "" },
                js(m.role.name()),
                m.rank,
                js(&m.peer.to_string())
            );
        }
        o.push_str("]}");
    }
    o.push_str("]}");
    o
}

/// Ask the service at `addr` for its report (authenticated with the master
/// secret): the JSON text.
pub fn service_status(addr: &str, master: &Secret, timeout: Duration) -> Result<String, String> {
    let s = crate::transport::connect_authenticated(addr, timeout, master).map_err(|e| e.to_string())?;
    s.stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let (mut r, mut w) = s.split().map_err(|e| e.to_string())?;
    write_control(&mut w, &Control::StatusRequest, 0).map_err(|e| e.to_string())?;
    match read_control(&mut r, 0) {
        Ok(Control::StatusReply { json }) => Ok(json),
        Ok(Control::Error { message }) => Err(message),
        Ok(other) => Err(format!("unexpected {:?} from the service", other.msg_type())),
        Err(e) => Err(format!("no report from the service at {addr}: {e}")),
    }
}
