//! State shared by the caller, the control thread and the I/O thread
//! (`Shared`): the name table, the job's failure, and what happens when an
//! op completes, a declaration arrives, a worker leaves, a server is lost or
//! joins. It is the data plane's `Completion`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::io::{self, BufPtr, Completion, Io, Submission};
use super::op::Op;
use super::table::{check_matches, Parked, Table, Waiter, RECENT_TRANSIENT};
use super::ClientError;
use crate::protocol::auth::Secret;
use crate::protocol::{Control, ServerInfo, TensorSpec, NO_SERVER};
use crate::session::{SessionError, SessionSender};
use crate::transport::{connect_authenticated, join_host_port};

/// State shared by the caller, the control thread and the I/O thread.
pub struct Shared {
    pub(super) session: SessionSender,
    /// How to reach a server that joins while the job runs (`ServerJoined`).
    pub(super) secret: Secret,
    /// The job's namespace (point-to-point links carry it too).
    pub(super) namespace: u32,
    pub(super) connect_timeout: Duration,
    /// With two-level reduction, this worker's rack: it pushes each chunk
    /// to its rack's relay (`TensorSpec::slot_for`).
    pub(super) rack: Option<u32>,
    pub(super) table: Mutex<Table>,
    pub(super) failure: Mutex<Option<String>>,
    pub(super) io: Arc<Io>,
    pub(super) next_req: AtomicU32,
    pub(super) next_barrier: AtomicU32,
    pub(super) closing: AtomicBool,
    /// Workers wait to join this elastic job (`Control::HostsUpdated`).
    pub(super) hosts_updated: AtomicBool,
}

impl Shared {
    pub(super) fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A worker left cleanly (`PeerLeft`). It had nothing in flight, so it
    /// took part in every operation that can still complete here; anything
    /// waiting for it now (a declaration, a barrier, a host-stage
    /// contribution; servers catch pushes, the scheduler declarations) or
    /// started later never will, and
    /// fails the job for everyone, naming it, instead of hanging.
    pub(super) fn on_peer_left(&self, rank: u32) {
        let me = self.io.rank();
        let mut waiting = {
            let mut t = self.table();
            t.left.get_or_insert(rank);
            if !t.gone.contains(&rank) {
                t.gone.push(rank);
            }
            let mut w: Vec<String> = t.parked.keys().map(|n| format!("push_pull '{n}'")).collect();
            if !t.barriers.is_empty() {
                w.push("a barrier".into());
            }
            w
        };
        self.io.set_left(rank);
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
    pub(super) fn check_left(&self, t: &Table, what: &str) -> Result<(), ClientError> {
        self.check_left_of(t, what, &[])
    }

    /// `check_left` for an operation of the workers `members` (empty: all).
    pub(super) fn check_left_of(&self, t: &Table, what: &str, members: &[u32]) -> Result<(), ClientError> {
        match t.left {
            Some(r) if members.is_empty() || members.binary_search(&r).is_ok() => {
                let msg = io::left_message(r, self.io.rank(), what);
                Err(ClientError::Failed(msg))
            }
            _ => Ok(()),
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
                    t.shards.remove(&op.name);
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
    pub(super) fn release_specs(&self, specs: &[Arc<TensorSpec>]) {
        for s in specs {
            self.io.forget(s);
        }
        let keys = specs.iter().map(|s| s.key).collect();
        if let Err(e) = self.session.send_later(&Control::Release { keys }) {
            self.set_failure(e.to_string());
        }
    }

    /// Whether every one of `specs` is in the table already, as it is.
    pub(super) fn knows(&self, specs: &[TensorSpec]) -> bool {
        let t = self.table();
        specs.iter().all(|s| t.specs.get(&s.name).is_some_and(|have| **have == *s))
    }

    /// What this worker tells a scheduler that restarted: its tensors as
    /// placed now, and the workers that left.
    pub(super) fn rejoin_report(&self) -> crate::session::Report {
        let t = self.table();
        let specs = t.specs.values().map(|s| TensorSpec::clone(s)).collect();
        // Barriers below the first one waited on (or below the next) were passed.
        let next = self.next_barrier.load(std::sync::atomic::Ordering::Relaxed);
        let barriers = t.barriers.keys().copied().min().unwrap_or(next);
        let (left, lost) = (t.gone.clone(), t.lost_servers.clone());
        crate::session::Report { specs, keys: Vec::new(), left, lost, barriers }
    }

    pub(super) fn send_ctrl(&self, msg: &Control) -> Result<(), SessionError> {
        self.session.send(msg)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit(
        &self,
        op: Arc<Op>,
        spec: Arc<TensorSpec>,
        ptr: BufPtr,
        priority: i32,
        flags: u16,
        shards: u32,
    ) {
        self.io.submit(Submission { op, spec, ptr, priority, flags, shards }, self);
    }

    /// Install declared specs and release ops that were waiting for them.
    pub(super) fn on_declared(&self, specs: Vec<TensorSpec>) {
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
                    let shards = t.shards.get(&s.name).copied().unwrap_or(0);
                    ready.extend(ops.into_iter().map(|p| (p, s.clone(), shards)));
                }
            }
        }
        for (p, s, shards) in ready {
            match check_matches(&s, p.numel, p.dtype) {
                Ok(()) => self.submit(p.op, s, p.ptr, p.priority, p.flags, shards),
                Err(e) => self.finish_op(&p.op, Some(e.to_string())),
            }
        }
    }

    /// Server `lost` was lost (`reason`) and its chunks moved: take the new
    /// specs and let the I/O thread re-send and restore what it must. A
    /// chunk with a server-side optimizer keeps its state only if it moved
    /// to its replica (`server::replica`); if one did not, the job fails.
    pub(super) fn on_failover(&self, batch: u32, lost: u32, reason: String, specs: Vec<TensorSpec>) {
        let me = self.io.rank();
        let mut moved = Vec::with_capacity(specs.len());
        let mut opt = HashMap::new();
        let mut state_lost = None;
        let conns: Vec<usize> =
            self.io.conns().iter().enumerate().filter(|(_, c)| c.server == lost).map(|(i, _)| i).collect();
        self.io.write_off(&conns);
        {
            let mut t = self.table();
            if lost != NO_SERVER && !t.lost_servers.contains(&lost) {
                t.lost_servers.push(lost);
            }
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
    pub(super) fn on_server_joined(&self, s: ServerInfo) -> Result<(), ClientError> {
        let mut conns = Vec::with_capacity(s.ports.len());
        for (t, &port) in s.ports.iter().enumerate() {
            let addr = join_host_port(&s.addr, port);
            let desc = format!("server {} ({addr}) thread {t}", s.rank);
            let setup = |e: std::io::Error| ClientError::Setup(format!("{desc}, which joined the job: {e}"));
            let authed = connect_authenticated(&addr, self.connect_timeout, &self.secret).map_err(setup)?;
            conns.push(io::NewConn::new(authed, addr, desc.clone(), s.rank, false).map_err(setup)?);
        }
        self.io.add_conns(conns).map_err(|e| ClientError::Setup(format!("server {} joined the job: {e}", s.rank)))
    }

    pub(super) fn on_declare_error(&self, req: u32, message: String) {
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

/// Why chunks of a tensor with a server-side optimizer lose their state
/// moving from placement `before` to `now`: a chunk that moved anywhere
/// but to its replica (`server::replica`).
pub(super) fn opt_state_lost(before: &TensorSpec, now: &TensorSpec) -> Option<String> {
    let c = (0..before.num_chunks().min(now.num_chunks()))
        .find(|&c| before.slots[c] != now.slots[c] && before.replicas.get(c) != Some(&now.slots[c]))?;
    Some(match before.replicas.get(c) {
        None => format!("(chunk {c}): it had no replica (failover is off, or no other server was left)"),
        Some(r) => format!("(chunk {c}): its replica (server thread slot {r}) was lost too"),
    })
}

impl Completion for Shared {
    fn finish_op(&self, op: &Op, error: Option<String>) {
        Shared::finish_op(self, op, error)
    }
    fn fail_job(&self, msg: String) {
        Shared::fail_job(self, msg)
    }
    fn unreachable(&self, server: u32, reason: String) {
        if let Err(e) = self.send_ctrl(&Control::Unreachable { server, reason }) {
            log::warn!(target: "worker", "cannot tell the scheduler server {server} is unreachable: {e}");
        }
    }
    fn failure(&self) -> Option<String> {
        Shared::failure(self)
    }
    fn closing(&self) -> bool {
        self.closing.load(std::sync::atomic::Ordering::SeqCst)
    }
}
