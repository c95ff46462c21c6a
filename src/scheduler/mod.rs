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

use std::collections::{HashMap, HashSet};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use crate::placement::{chunk_elems, Placer};
use crate::protocol::{
    read_control, write_control, Control, DType, ReadError, Register, Role, ServerInfo, TensorSpec, Welcome,
};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Address to listen on, e.g. "0.0.0.0:9000".
    pub bind: String,
    pub num_workers: u32,
    pub num_servers: u32,
    pub partition_bytes: u32,
    pub heartbeat_ms: u32,
    /// A member silent for this long is declared dead.
    pub peer_timeout_ms: u32,
    /// Servers report rounds that waited longer than this.
    pub stall_ms: u32,
    /// Registration must complete within this time.
    pub join_timeout_ms: u32,
    pub namespace: u32,
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

struct Member {
    role: Role,
    rank: u32,
    peer: SocketAddr,
    writer: Mutex<TcpStream>,
}

impl Member {
    fn send(&self, msg: &Control, ns: u32) -> bool {
        match self.writer.lock() {
            Ok(mut w) => write_control(&mut *w, msg, ns).is_ok(),
            Err(_) => false,
        }
    }
    fn describe(&self) -> String {
        format!("{} {} ({})", self.role.name(), self.rank, self.peer)
    }
}

struct Decl {
    numel: u64,
    dtype: DType,
    first_rank: u32,
    declared_by: Vec<bool>,
    conflict: Option<String>,
    spec: Option<TensorSpec>,
    installed: bool,
    since: Instant,
    stall_reported: bool,
}

struct PendingReq {
    rank: u32,
    req: u32,
    names: Vec<String>,
}

struct Registration {
    reg: Register,
    peer: SocketAddr,
    stream: TcpStream,
}

#[derive(Default)]
struct State {
    joining: Vec<Option<Registration>>,
    /// Set once everyone registered: (role, rank) of each joining slot.
    assigned: Option<Vec<(Role, u32)>>,
    members: Vec<Arc<Member>>,
    /// The member created for each registration slot, in join order.
    slot_members: Vec<Option<Arc<Member>>>,
    placer: Option<Placer>,
    decls: HashMap<String, Decl>,
    next_key: u32,
    next_batch: u32,
    acks: HashMap<u32, u32>,
    pending: Vec<PendingReq>,
    barriers: HashMap<u32, HashSet<u32>>,
    said_goodbye: HashSet<u32>,
    finished: bool,
    failed: Option<String>,
}

struct Shared {
    cfg: SchedulerConfig,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking member thread must not take the whole scheduler down.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn log(&self, msg: &str) {
        eprintln!("[gradhub scheduler] {msg}");
    }

    /// Mark the job failed and tell every other member who is gone and why.
    fn fail(&self, st: &mut State, who: Option<&Member>, reason: String) {
        if st.finished || st.failed.is_some() {
            return;
        }
        self.log(&format!("job failed: {reason}"));
        st.failed = Some(reason.clone());
        let members = st.members.clone();
        for m in members {
            if let Some(w) = who {
                if m.role == w.role && m.rank == w.rank {
                    continue;
                }
                m.send(&Control::PeerLost { role: w.role, rank: w.rank, reason: reason.clone() }, self.cfg.namespace);
            } else {
                m.send(&Control::Error { message: reason.clone() }, self.cfg.namespace);
            }
        }
        self.cv.notify_all();
    }
}

/// A running scheduler: its bound address and a handle to wait for the end of the job.
pub struct SchedulerHandle {
    pub addr: SocketAddr,
    join: thread::JoinHandle<Result<(), SchedulerError>>,
}

impl SchedulerHandle {
    pub fn wait(self) -> Result<(), SchedulerError> {
        self.join
            .join()
            .unwrap_or_else(|_| Err(SchedulerError::JobFailed("scheduler thread panicked".into())))
    }
}

/// Bind and start the scheduler in a background thread.
pub fn start_scheduler(cfg: SchedulerConfig) -> Result<SchedulerHandle, SchedulerError> {
    if cfg.num_workers == 0 || cfg.num_servers == 0 {
        return Err(SchedulerError::Config("need at least one worker and one server".into()));
    }
    if cfg.partition_bytes < 4 {
        return Err(SchedulerError::Config("partition size must be at least 4 bytes".into()));
    }
    let listener = TcpListener::bind(&cfg.bind).map_err(|err| SchedulerError::Bind { addr: cfg.bind.clone(), err })?;
    let addr = listener.local_addr().map_err(|err| SchedulerError::Bind { addr: cfg.bind.clone(), err })?;
    listener.set_nonblocking(true).map_err(|err| SchedulerError::Bind { addr: cfg.bind.clone(), err })?;
    let shared = Arc::new(Shared { cfg, state: Mutex::new(State::default()), cv: Condvar::new() });
    let join = thread::Builder::new()
        .name("gradhub-scheduler".into())
        .spawn(move || accept_loop(shared, listener))
        .map_err(|e| SchedulerError::Config(format!("cannot spawn thread: {e}")))?;
    Ok(SchedulerHandle { addr, join })
}

/// Run a scheduler until the job ends (blocking).
pub fn run_scheduler(cfg: SchedulerConfig) -> Result<(), SchedulerError> {
    let h = start_scheduler(cfg)?;
    eprintln!("[gradhub scheduler] listening on {}", h.addr);
    h.wait()
}

fn accept_loop(shared: Arc<Shared>, listener: TcpListener) -> Result<(), SchedulerError> {
    let started = Instant::now();
    let join_timeout = Duration::from_millis(shared.cfg.join_timeout_ms as u64);
    let hb_thread = {
        let shared = shared.clone();
        thread::spawn(move || heartbeat_loop(shared))
    };
    loop {
        {
            let mut st = shared.lock();
            if st.finished || st.failed.is_some() {
                break;
            }
            if st.assigned.is_none() && started.elapsed() > join_timeout {
                let n = st.joining.iter().flatten().count();
                let msg = format!(
                    "only {n} of {} members registered within {:.0}s",
                    shared.cfg.num_workers + shared.cfg.num_servers,
                    join_timeout.as_secs_f64()
                );
                shared.fail(&mut st, None, msg.clone());
                // Members not yet welcomed are only reachable through their registration streams.
                for r in st.joining.iter_mut().flatten() {
                    let _ = write_control(&mut r.stream, &Control::Error { message: msg.clone() }, shared.cfg.namespace);
                }
                break;
            }
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                let shared = shared.clone();
                let _ = thread::Builder::new()
                    .name("gradhub-sched-conn".into())
                    .spawn(move || member_thread(shared, stream, peer));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(20)),
            Err(e) => shared.log(&format!("accept failed: {e}")),
        }
    }
    let _ = hb_thread.join();
    // Give member threads a moment to flush final messages.
    thread::sleep(Duration::from_millis(200));
    let st = shared.lock();
    match &st.failed {
        Some(reason) => Err(SchedulerError::JobFailed(reason.clone())),
        None => {
            shared.log("all workers finished; job complete");
            Ok(())
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
        thread::sleep(period);
    }
}

fn member_thread(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr) {
    let ns = shared.cfg.namespace;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let timeout = Duration::from_millis(shared.cfg.peer_timeout_ms as u64);
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let reg = match read_control(&mut stream, ns) {
        Ok(Control::Register(r)) => r,
        Ok(other) => {
            let message = format!("expected Register, got {:?}", other.msg_type());
            shared.log(&format!("rejecting {peer}: {message}"));
            let _ = write_control(&mut stream, &Control::Error { message }, ns);
            return;
        }
        Err(e) => {
            shared.log(&format!("rejecting {peer}: bad registration: {e}"));
            let _ = write_control(&mut stream, &Control::Error { message: format!("bad registration: {e}") }, ns);
            return;
        }
    };
    if let Err(message) = check_registration(&shared.cfg, &reg) {
        shared.log(&format!("rejecting {} at {peer}: {message}", reg.role.name()));
        let _ = write_control(&mut stream, &Control::Error { message }, ns);
        return;
    }
    let Ok(writer) = stream.try_clone() else { return };
    let me = match join(&shared, reg, peer, stream.try_clone().ok(), writer) {
        Ok(m) => m,
        Err(message) => {
            let _ = write_control(&mut stream, &Control::Error { message }, ns);
            return;
        }
    };
    serve_member(&shared, &me, stream);
}

fn check_registration(cfg: &SchedulerConfig, reg: &Register) -> Result<(), String> {
    if reg.num_workers != 0 && reg.num_workers != cfg.num_workers {
        return Err(format!(
            "{} was started for {} workers but the scheduler expects {}",
            reg.role.name(),
            reg.num_workers,
            cfg.num_workers
        ));
    }
    if reg.num_servers != 0 && reg.num_servers != cfg.num_servers {
        return Err(format!(
            "{} was started for {} servers but the scheduler expects {}",
            reg.role.name(),
            reg.num_servers,
            cfg.num_servers
        ));
    }
    let limit = match reg.role {
        Role::Worker => cfg.num_workers,
        Role::Server => cfg.num_servers,
    };
    if reg.requested_rank >= limit as i32 {
        return Err(format!("requested {} rank {} but the job has {limit}", reg.role.name(), reg.requested_rank));
    }
    if reg.role == Role::Server && (reg.ports.is_empty() || reg.addr.is_empty()) {
        return Err("server registered without an address or ports".into());
    }
    Ok(())
}

/// Register a member and block until everyone has joined; returns this member.
///
/// The thread that completes the registration creates every member and sends
/// every Welcome while holding the state lock, so each member is known (and
/// welcomed) before anyone can send it anything else — a server must not miss
/// a tensor installation because its own thread had not run yet.
fn join(
    shared: &Shared,
    reg: Register,
    peer: SocketAddr,
    stream: Option<TcpStream>,
    writer: TcpStream,
) -> Result<Arc<Member>, String> {
    let cfg = &shared.cfg;
    let mut st = shared.lock();
    if st.assigned.is_some() {
        return Err("the job already has all its members".into());
    }
    let Some(stream) = stream else { return Err("cannot clone socket".into()) };
    drop(writer);
    let slot = st.joining.len();
    st.joining.push(Some(Registration { reg, peer, stream }));
    let total = (cfg.num_workers + cfg.num_servers) as usize;
    if st.joining.len() == total {
        match assign_ranks(cfg, &st.joining) {
            Ok(a) => welcome_all(shared, &mut st, a),
            Err(msg) => {
                shared.fail(&mut st, None, msg.clone());
                for r in st.joining.iter_mut().flatten() {
                    let _ = write_control(&mut r.stream, &Control::Error { message: msg.clone() }, cfg.namespace);
                }
            }
        }
        shared.cv.notify_all();
    }
    while st.assigned.is_none() && st.failed.is_none() {
        st = shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
    }
    if let Some(f) = &st.failed {
        return Err(f.clone());
    }
    st.slot_members.get(slot).cloned().flatten().ok_or_else(|| "internal: no member for this slot".into())
}

/// Create every member, send each its Welcome (state lock held).
fn welcome_all(shared: &Shared, st: &mut State, assigned: Vec<(Role, u32)>) {
    let cfg = &shared.cfg;
    let regs: Vec<Registration> = st.joining.drain(..).flatten().collect();
    let mut servers: Vec<ServerInfo> = assigned
        .iter()
        .zip(regs.iter())
        .filter(|((r, _), _)| *r == Role::Server)
        .map(|((_, rank), g)| ServerInfo {
            rank: *rank,
            addr: g.reg.addr.clone(),
            ports: g.reg.ports.clone(),
            colocated: g.reg.colocated,
        })
        .collect();
    servers.sort_by_key(|s| s.rank);
    let mut hosts = vec![String::new(); cfg.num_workers as usize];
    for ((r, rank), g) in assigned.iter().zip(regs.iter()) {
        if *r == Role::Worker {
            hosts[*rank as usize] = g.reg.hostname.clone();
        }
    }
    st.placer = Some(Placer::new(&servers, cfg.num_workers as usize));
    for ((role, rank), g) in assigned.iter().zip(regs) {
        let member = Arc::new(Member { role: *role, rank: *rank, peer: g.peer, writer: Mutex::new(g.stream) });
        let welcome = Control::Welcome(Welcome {
            rank: *rank,
            num_workers: cfg.num_workers,
            partition_bytes: cfg.partition_bytes,
            heartbeat_ms: cfg.heartbeat_ms,
            stall_ms: cfg.stall_ms,
            servers: servers.clone(),
            worker_hosts: hosts.clone(),
        });
        if !member.send(&welcome, cfg.namespace) {
            shared.log(&format!("cannot send the welcome to {}", member.describe()));
        }
        st.members.push(member.clone());
        st.slot_members.push(Some(member));
    }
    st.assigned = Some(assigned);
    shared.log(&format!("all {} members joined", cfg.num_workers + cfg.num_servers));
}

/// Requested ranks are honoured (and must be unique); the rest are filled in join order.
fn assign_ranks(cfg: &SchedulerConfig, joining: &[Option<Registration>]) -> Result<Vec<(Role, u32)>, String> {
    let mut out = Vec::with_capacity(joining.len());
    let mut taken: HashMap<(u8, u32), SocketAddr> = HashMap::new();
    let role_id = |r: Role| if r == Role::Worker { 0u8 } else { 1u8 };
    let (mut nw, mut ns) = (0u32, 0u32);
    for j in joining.iter().flatten() {
        match j.reg.role {
            Role::Worker => nw += 1,
            Role::Server => ns += 1,
        }
        if j.reg.requested_rank >= 0 {
            let key = (role_id(j.reg.role), j.reg.requested_rank as u32);
            if let Some(prev) = taken.insert(key, j.peer) {
                return Err(format!(
                    "two {}s ({prev} and {}) both asked for rank {}",
                    j.reg.role.name(),
                    j.peer,
                    j.reg.requested_rank
                ));
            }
        }
    }
    if nw != cfg.num_workers || ns != cfg.num_servers {
        return Err(format!(
            "expected {} workers and {} servers, got {nw} workers and {ns} servers",
            cfg.num_workers, cfg.num_servers
        ));
    }
    for j in joining.iter().flatten() {
        let rid = role_id(j.reg.role);
        let rank = if j.reg.requested_rank >= 0 {
            j.reg.requested_rank as u32
        } else {
            let mut r = 0;
            while taken.contains_key(&(rid, r)) {
                r += 1;
            }
            taken.insert((rid, r), j.peer);
            r
        };
        out.push((j.reg.role, rank));
    }
    Ok(out)
}

fn serve_member(shared: &Shared, me: &Arc<Member>, mut stream: TcpStream) {
    let ns = shared.cfg.namespace;
    loop {
        let msg = read_control(&mut stream, ns);
        let mut st = shared.lock();
        let done = st.finished || st.failed.is_some();
        let gone = me.role == Role::Worker && st.said_goodbye.contains(&me.rank);
        match msg {
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
                *st.acks.entry(batch).or_insert(0) += 1;
                shared.cv.notify_all();
            }
            Ok(Control::Barrier { id }) if me.role == Role::Worker => {
                let set = st.barriers.entry(id).or_default();
                set.insert(me.rank);
                if set.len() == shared.cfg.num_workers as usize {
                    st.barriers.remove(&id);
                    for m in st.members.iter().filter(|m| m.role == Role::Worker) {
                        m.send(&Control::BarrierDone { id }, ns);
                    }
                }
            }
            Ok(Control::Goodbye) if me.role == Role::Worker => {
                st.said_goodbye.insert(me.rank);
                if st.said_goodbye.len() == shared.cfg.num_workers as usize && !done {
                    st.finished = true;
                    for m in st.members.iter().filter(|m| m.role == Role::Server) {
                        m.send(&Control::Shutdown, ns);
                    }
                    shared.cv.notify_all();
                }
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
                let reason = match &e {
                    ReadError::Io(io) if io.kind() == ErrorKind::WouldBlock || io.kind() == ErrorKind::TimedOut => {
                        format!("{} sent nothing for {} ms (no heartbeat)", me.describe(), shared.cfg.peer_timeout_ms)
                    }
                    ReadError::Io(io) if io.kind() == ErrorKind::UnexpectedEof => {
                        format!("{} disconnected", me.describe())
                    }
                    _ => format!("{} connection failed: {e}", me.describe()),
                };
                shared.fail(&mut st, Some(me), reason);
                return;
            }
        }
    }
}

/// Record a worker's declarations. Returns a batch of newly complete specs
/// that must be installed on the servers before anyone is answered.
fn declare(
    shared: &Shared,
    st: &mut State,
    rank: u32,
    req: u32,
    entries: Vec<crate::protocol::DeclEntry>,
) -> Option<(u32, Vec<TensorSpec>)> {
    let n = shared.cfg.num_workers as usize;
    let mut names = Vec::with_capacity(entries.len());
    let mut newly_complete = Vec::new();
    for e in &entries {
        let ce = chunk_elems(shared.cfg.partition_bytes, e.dtype.size());
        let bytes = e.numel.checked_mul(e.dtype.size() as u64);
        // The reply lists one u32 slot per chunk; keep it well under the control-message limit.
        if bytes.is_none_or(|b| b > crate::protocol::control::MAX_TENSOR_BYTES)
            || e.numel.div_ceil(ce) > (crate::protocol::MAX_CONTROL_PAYLOAD / 16) as u64
        {
            let message = format!(
                "tensor '{}' with {} elements of {} is too large for partitions of {} bytes",
                e.name,
                e.numel,
                e.dtype.name(),
                shared.cfg.partition_bytes
            );
            if let Some(m) = st.members.iter().find(|m| m.role == Role::Worker && m.rank == rank) {
                m.send(&Control::DeclareError { req, message }, shared.cfg.namespace);
            }
            return None;
        }
    }
    for e in entries {
        let d = st.decls.entry(e.name.clone()).or_insert_with(|| Decl {
            numel: e.numel,
            dtype: e.dtype,
            first_rank: rank,
            declared_by: vec![false; n],
            conflict: None,
            spec: None,
            installed: false,
            since: Instant::now(),
            stall_reported: false,
        });
        if d.conflict.is_none() && (d.numel != e.numel || d.dtype != e.dtype) {
            d.conflict = Some(format!(
                "tensor '{}' declared inconsistently: worker {} has {} elements of {}, worker {} has {} elements of {}",
                e.name,
                d.first_rank,
                d.numel,
                d.dtype.name(),
                rank,
                e.numel,
                e.dtype.name()
            ));
        }
        d.declared_by[rank as usize] = true;
        if d.conflict.is_none() && d.spec.is_none() && d.declared_by.iter().all(|&b| b) {
            newly_complete.push(e.name.clone());
        }
        names.push(e.name);
    }
    st.pending.push(PendingReq { rank, req, names });
    let mut specs = Vec::new();
    for name in newly_complete {
        let key = st.next_key;
        st.next_key += 1;
        let Some(d) = st.decls.get(&name) else { continue };
        let (numel, dtype) = (d.numel, d.dtype);
        let ce = chunk_elems(shared.cfg.partition_bytes, dtype.size());
        let nchunks = numel.div_ceil(ce);
        let sizes = (0..nchunks).map(|c| (ce.min(numel - c * ce)) * dtype.size() as u64);
        let slots = match st.placer.as_mut() {
            Some(p) => p.place(sizes),
            None => continue,
        };
        let spec = TensorSpec { key, name: name.clone(), numel, dtype, chunk_elems: ce, slots };
        if let Some(d) = st.decls.get_mut(&name) {
            d.spec = Some(spec.clone());
        }
        specs.push(spec);
    }
    answer_ready(shared, st);
    if specs.is_empty() {
        return None;
    }
    let batch = st.next_batch;
    st.next_batch += 1;
    Some((batch, specs))
}

/// A tensor some workers declared long ago and others never did: log who is
/// missing and tell the workers waiting on it (their timeouts will name them).
fn report_declaration_stalls(shared: &Shared) {
    let stall = Duration::from_millis(shared.cfg.stall_ms as u64);
    let mut st = shared.lock();
    let mut reports = Vec::new();
    for (name, d) in st.decls.iter_mut() {
        if d.spec.is_some() || d.conflict.is_some() || d.stall_reported || d.since.elapsed() < stall {
            continue;
        }
        d.stall_reported = true;
        let missing: Vec<u32> = (0..d.declared_by.len() as u32).filter(|&r| !d.declared_by[r as usize]).collect();
        let waiting: Vec<u32> = (0..d.declared_by.len() as u32).filter(|&r| d.declared_by[r as usize]).collect();
        reports.push((name.clone(), missing, waiting, d.since.elapsed()));
    }
    for (name, missing, waiting, waited) in reports {
        shared.log(&format!(
            "stall: tensor '{name}' has waited {:.1}s for worker rank(s) {missing:?} to declare it (push_pull it)",
            waited.as_secs_f64()
        ));
        let msg = Control::DeclareStall { name, missing, waited_ms: waited.as_millis() as u64 };
        for m in st.members.iter().filter(|m| m.role == Role::Worker && waiting.contains(&m.rank)) {
            m.send(&msg, shared.cfg.namespace);
        }
    }
    drop(st);
}

/// Send the specs to every server, wait for all acks, then answer workers.
fn install(shared: &Shared, batch: u32, specs: Vec<TensorSpec>) {
    let ns = shared.cfg.namespace;
    let servers: Vec<Arc<Member>> =
        shared.lock().members.iter().filter(|m| m.role == Role::Server).cloned().collect();
    let msg = Control::ServerDeclare { batch, specs: specs.clone() };
    for s in &servers {
        s.send(&msg, ns);
    }
    let mut st = shared.lock();
    while st.acks.get(&batch).copied().unwrap_or(0) < shared.cfg.num_servers && st.failed.is_none() {
        st = shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
    }
    st.acks.remove(&batch);
    for s in &specs {
        if let Some(d) = st.decls.get_mut(&s.name) {
            d.installed = true;
        }
    }
    answer_ready(shared, &mut st);
}

/// Answer every pending declaration whose tensors are all installed, or that
/// contains a conflicting tensor.
fn answer_ready(shared: &Shared, st: &mut State) {
    let ns = shared.cfg.namespace;
    let mut i = 0;
    while i < st.pending.len() {
        let p = &st.pending[i];
        let conflict = p.names.iter().find_map(|n| st.decls.get(n).and_then(|d| d.conflict.clone()));
        let ready = p.names.iter().all(|n| st.decls.get(n).is_some_and(|d| d.installed));
        if conflict.is_none() && !ready {
            i += 1;
            continue;
        }
        let p = st.pending.swap_remove(i);
        let reply = match conflict {
            Some(message) => Control::DeclareError { req: p.req, message },
            None => Control::Declared {
                req: p.req,
                specs: p.names.iter().filter_map(|n| st.decls.get(n).and_then(|d| d.spec.clone())).collect(),
            },
        };
        if let Some(m) = st.members.iter().find(|m| m.role == Role::Worker && m.rank == p.rank) {
            m.send(&reply, ns);
        }
    }
}
