//! The scheduler's state behind its one mutex (`Shared`, with a condition
//! variable for the threads waiting on it), composed of sub-states each
//! owned and edited by its module: who is in the job (`membership`), what
//! tensors it has (`declarations`), the batches installed on the servers
//! (`installs`), chunks moving between servers (`moves`), Horovod's join
//! (`joins`); and the job's phase. The operations here are those that span
//! several sub-states, fail the job or wait on the lock; each sub-state's
//! own rules are in its module.

use std::net::SocketAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::config::SchedulerConfig;
use super::declarations::Declarations;
use super::installs::Installs;
use super::joins::{JoinOps, JoinStep};
use super::member::{Member, Writer};
use super::membership::{Members, Refusal, Registration};
use super::moves::Moves;
use super::reach::Reports;
use crate::protocol::{Control, DeclEntry, Register, Rejoin, Role, TensorSpec};

/// Where the job is. Registration is part of `Running`: whether everyone
/// registered is `Members::welcomed`. Finished and failed are final.
#[derive(Default)]
enum JobPhase {
    #[default]
    Running,
    /// Every worker said goodbye; the servers were told to exit.
    Finished,
    Failed(String),
}

#[derive(Default)]
pub(super) struct State {
    phase: JobPhase,
    pub members: Members,
    pub decls: Declarations,
    pub installs: Installs,
    pub moves: Moves,
    pub joins: JoinOps,
    /// Workers' reports of servers they cannot reach (`reach`).
    pub reach: Reports,
    /// Workers whose loss failed the job (an elastic job's next generation
    /// expects the others back: `service`).
    pub lost_workers: u32,
}

impl State {
    /// Whether the job ended, finished or failed.
    pub fn is_over(&self) -> bool {
        !matches!(self.phase, JobPhase::Running)
    }

    pub fn failed(&self) -> Option<&str> {
        match &self.phase {
            JobPhase::Failed(why) => Some(why),
            _ => None,
        }
    }

    /// The phase in words (`gradhub status`).
    pub fn phase_name(&self) -> &'static str {
        match self.phase {
            JobPhase::Failed(_) => "failed",
            JobPhase::Finished => "finished",
            JobPhase::Running if self.members.welcomed() => "running",
            JobPhase::Running => "registering",
        }
    }

    /// Whether every server still in the job installed `batch`.
    fn installed_everywhere(&self, batch: u32) -> bool {
        self.installs.installed_everywhere(batch, self.members.servers().map(|m| m.rank))
    }

    /// Answer every declaration that can be answered, unless chunks are
    /// moving (their placement may still change: see `failover`).
    pub fn answer_ready(&mut self, ns: u32) {
        if !self.moves.busy() {
            self.decls.answer_ready(&self.members, ns);
        }
    }
}

/// Tensors placed together, to install on every server (`Shared::install`)
/// before their workers are answered: the install's number and the specs.
pub(super) type Batch = Option<(u32, Vec<TensorSpec>)>;

pub(super) struct Shared {
    pub cfg: SchedulerConfig,
    pub state: Mutex<State>,
    pub cv: Condvar,
    /// Connections accepted and not yet registered (or refused).
    pub pending: AtomicUsize,
}

impl Shared {
    pub fn new(cfg: SchedulerConfig) -> Arc<Shared> {
        Arc::new(Shared { cfg, state: Mutex::new(State::default()), cv: Condvar::new(), pending: AtomicUsize::new(0) })
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking member thread must not take the whole scheduler down.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This job's members and held bytes, as job `job` of the metrics.
    pub fn sample(&self, job: &str, s: &mut crate::metrics::Sample) {
        let st = self.lock();
        for role in [crate::protocol::Role::Worker, crate::protocol::Role::Server] {
            let n = st.members.all().iter().filter(|m| m.role == role).count() as u64;
            s.members.push((job.to_string(), role.name(), n));
        }
        s.held_bytes.push((job.to_string(), st.decls.held().1));
    }

    /// The metrics of a scheduler's only job (`--metrics-addr`).
    pub fn metrics(&self) -> crate::metrics::Sample {
        let mut s = crate::metrics::Sample { jobs: Some(u64::from(!self.lock().is_over())), ..Default::default() };
        self.sample("", &mut s);
        s
    }

    /// Mark the job failed and tell every other member who is gone and why.
    pub fn fail(&self, st: &mut State, who: Option<&Member>, reason: String) {
        if st.is_over() {
            return;
        }
        log::error!(target: "scheduler", "job failed: {reason}");
        st.phase = JobPhase::Failed(reason.clone());
        st.lost_workers += u32::from(who.is_some_and(|w| w.role == crate::protocol::Role::Worker));
        for m in st.members.all() {
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

    /// Fail the job, telling the members not welcomed yet too.
    pub fn fail_registration(&self, st: &mut State, message: String) {
        self.fail(st, None, message.clone());
        st.members.reject_joining(&message, self.cfg.namespace);
    }

    /// Wait until every server still in the job installed `batch` (or the
    /// job failed); returns the state, locked.
    pub fn wait_installed(&self, batch: u32) -> MutexGuard<'_, State> {
        let mut st = self.lock();
        while !st.installed_everywhere(batch) && st.failed().is_none() {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.installs.forget(batch);
        st
    }

    /// Register a member and block until everyone has joined; returns this
    /// member, and whether it is a server joining the running job.
    ///
    /// The thread that completes the registration creates every member and
    /// sends every Welcome while holding the state lock, so each member is
    /// known (and welcomed) before anyone can send it anything else — a
    /// server must not miss a tensor installation because its own thread
    /// had not run yet.
    pub fn join(&self, reg: Register, peer: SocketAddr, stream: Writer) -> Result<(Arc<Member>, bool), Refusal> {
        let cfg = &self.cfg;
        let mut guard = self.lock();
        let st = &mut *guard;
        if st.members.welcomed() {
            if reg.role != Role::Server {
                return Err(Refusal::Full);
            }
            // A server joining the running job (`failover::take_in`).
            match &st.phase {
                JobPhase::Failed(f) => return Err(Refusal::JobFailed(f.clone())),
                JobPhase::Finished => return Err(Refusal::Late("the job has finished".into())),
                JobPhase::Running => {}
            }
            let State { members, decls, installs, moves, .. } = st;
            return moves
                .admit_late(cfg, members, decls, installs, Registration { reg, peer, stream })
                .map(|m| (m, true));
        }
        let slot = st.members.register(reg, peer, stream);
        if st.members.registered() == (cfg.num_workers + cfg.num_servers) as usize {
            match st.members.welcome_everyone(cfg) {
                Ok(placer) => st.decls.set_placer(placer),
                Err(msg) => self.fail_registration(st, msg),
            }
            self.cv.notify_all();
        }
        while !guard.members.welcomed() && guard.failed().is_none() {
            guard = self.cv.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(f) = guard.failed() {
            return Err(Refusal::JobFailed(f.to_string()));
        }
        let me = guard.members.for_slot(slot).ok_or(Refusal::Internal("no member for this slot"))?;
        Ok((me, false))
    }

    /// A member rejoins after this scheduler restarted (`Members::rejoin`):
    /// its tensors (a worker's) or keys (a server's) go into the rebuilt
    /// declarations. Once every member is back, declarations waiting for
    /// that go on: those every worker declared meanwhile are placed then,
    /// returned as a batch to install (on a thread of its own: `install`
    /// waits for acks that member threads read).
    pub fn rejoin(&self, rj: Rejoin, peer: SocketAddr, stream: Writer) -> Result<(Arc<Member>, Batch), Refusal> {
        let cfg = &self.cfg;
        let mut guard = self.lock();
        let st = &mut *guard;
        match &st.phase {
            JobPhase::Failed(f) => return Err(Refusal::JobFailed(f.clone())),
            JobPhase::Finished => return Err(Refusal::Late("the job has finished".into())),
            JobPhase::Running => {}
        }
        if let Some(why) = super::rejoin::unsupported(cfg, &rj) {
            return Err(Refusal::Late(why));
        }
        let (me, done) = st.members.rejoin(&rj, peer, stream, cfg.namespace)?;
        if st.decls.placer().is_none() {
            let placer = st.members.welcome().map(super::membership::placer_of);
            match placer {
                Some(Ok(p)) => st.decls.set_placer(p),
                Some(Err(why)) => {
                    self.fail(st, None, format!("rebuilding the job: {why}"));
                    return Err(Refusal::JobFailed(why));
                }
                None => {}
            }
        }
        for &lost in &rj.lost {
            st.moves.lost_before(lost, &mut st.decls);
        }
        let rebuilt = match rj.register.role {
            Role::Worker => st.decls.rejoin(me.rank, cfg.num_workers, &rj.specs),
            Role::Server => {
                st.decls.server_keys(&rj.keys);
                Ok(())
            }
        };
        if let Err(why) = rebuilt {
            self.fail(st, Some(&me), why.clone());
            return Err(Refusal::JobFailed(why));
        }
        let mut batch = None;
        if done {
            let specs = st.decls.rebuilt();
            self.free_on_servers(st);
            st.answer_ready(cfg.namespace);
            if !specs.is_empty() {
                batch = Some((st.installs.next_batch(), specs));
            }
        }
        self.cv.notify_all();
        Ok((me, batch))
    }

    /// Record a worker's declarations. Returns a batch of newly complete
    /// specs that must be installed on the servers before anyone is answered.
    pub fn declare(&self, st: &mut State, rank: u32, req: u32, entries: Vec<DeclEntry>) -> Batch {
        let ns = self.cfg.namespace;
        let specs = match st.decls.declare(&self.cfg, rank, req, entries) {
            Ok(specs) => specs,
            Err(message) => {
                if let Some(m) = st.members.worker(rank) {
                    m.send(&Control::DeclareError { req, message }, ns);
                }
                return None;
            }
        };
        st.answer_ready(ns);
        if let Some(why) = st.decls.waiting_on_departed(st.members.left()) {
            self.fail(st, None, why);
            return None;
        }
        if specs.is_empty() {
            return None;
        }
        Some((st.installs.next_batch(), specs))
    }

    /// Send the specs to every server, wait for all acks, then answer workers.
    pub fn install(&self, batch: u32, specs: Vec<TensorSpec>) {
        let ns = self.cfg.namespace;
        let (servers, free) = {
            let mut st = self.lock();
            // A restarted scheduler installs once every server is back.
            while st.members.rebuilding().is_some() && !st.is_over() {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            let servers: Vec<Arc<Member>> = st.members.servers().cloned().collect();
            (servers, st.decls.take_to_free())
        };
        let mut msgs = vec![Control::ServerDeclare { batch, specs: specs.clone() }];
        if !free.is_empty() {
            msgs.insert(0, Control::ServerRelease { keys: free });
        }
        for s in &servers {
            s.send_all(&msgs, ns);
        }
        let mut st = self.wait_installed(batch);
        st.decls.installed(&specs);
        st.answer_ready(ns);
    }

    /// Worker `rank` released tensors `keys` (see `Declarations::release`);
    /// an error names a protocol violation.
    pub fn release(&self, st: &mut State, rank: u32, keys: Vec<u32>) -> Result<(), String> {
        if st.decls.release(rank, self.cfg.num_workers, keys)? {
            self.free_on_servers(st);
        }
        Ok(())
    }

    /// Tell the servers to free the tensors every worker released.
    pub fn free_on_servers(&self, st: &mut State) {
        // Not while a restarted scheduler rebuilds the job: a key a server
        // reported may yet be reported by a worker not back.
        if st.members.rebuilding().is_none() {
            st.decls.free_on_servers(&st.members, self.cfg.namespace);
        }
    }

    /// A tensor some workers declared long ago and others never did: log
    /// who is missing and tell the workers waiting on it (their timeouts
    /// will name them).
    pub fn report_declaration_stalls(&self) {
        let stall = Duration::from_millis(self.cfg.stall_ms as u64);
        let mut st = self.lock();
        for s in st.decls.stalls(stall) {
            log::warn!(target: "scheduler",
                "stall: tensor '{}' has waited {:.1}s for worker rank(s) {:?} to declare it (push_pull it)",
                s.name, s.waited.as_secs_f64(), s.missing
            );
            let msg =
                Control::DeclareStall { name: s.name, missing: s.missing, waited_ms: s.waited.as_millis() as u64 };
            for m in st.members.workers().filter(|m| s.waiting.contains(&m.rank)) {
                m.send(&msg, self.cfg.namespace);
            }
        }
    }

    /// A worker entered barrier `id`; the last one releases everyone.
    pub fn enter_barrier(&self, st: &mut State, rank: u32, id: u32) {
        if let Err(why) = st.members.enter_barrier(rank, id, self.cfg.num_workers, self.cfg.namespace) {
            self.fail(st, None, why);
        }
    }

    /// A worker finished; when every worker has, the servers are told to
    /// exit. Before that, everyone still in the job is told it left
    /// (`PeerLeft`): whatever it did not take part in can never complete,
    /// and must fail rather than wait (e.g. a worker that runs more steps
    /// than the others).
    pub fn say_goodbye(&self, st: &mut State, rank: u32) {
        let ns = self.cfg.namespace;
        let everyone = st.members.say_goodbye(rank, self.cfg.num_workers);
        if st.is_over() {
            return;
        }
        if everyone {
            st.phase = JobPhase::Finished;
            for m in st.members.servers() {
                m.send(&Control::Shutdown, ns);
            }
            self.cv.notify_all();
            return;
        }
        let stuck = st.decls.waiting_on_departed(st.members.left()).or_else(|| st.members.barrier_without(rank));
        if let Some(why) = stuck {
            self.fail(st, None, why);
            return;
        }
        for m in st.members.staying() {
            m.send(&Control::PeerLeft { rank }, ns);
        }
    }

    /// Horovod's join: worker `rank` has no more data. Until every worker
    /// has joined, the others announce their operations (`JoinOp`) and the
    /// joined ones push zeros for them; then everyone is told who joined last.
    pub fn join_worker(&self, st: &mut State, rank: u32) {
        let msg = match st.joins.join(rank, self.cfg.num_workers) {
            Err(reason) => return self.fail(st, None, reason),
            Ok(JoinStep::AllJoined) => Control::JoinDone { last: rank },
            // The others announce what they have in flight (each such
            // operation needs this worker now) and everything they start
            // from then on.
            Ok(JoinStep::Joined) => Control::Joined { rank },
        };
        for m in st.members.workers() {
            m.send(&msg, self.cfg.namespace);
        }
    }

    /// An operation a worker started while others have joined: the joined
    /// workers push zeros for it (each (name, round) once, whoever announces it).
    pub fn forward_join_op(&self, st: &mut State, op: Control) {
        let Control::JoinOp { name, round, .. } = &op else { return };
        let targets = st.joins.targets(name, *round);
        for m in st.members.workers().filter(|m| targets.contains(&m.rank)) {
            m.send(&op, self.cfg.namespace);
        }
    }
}
