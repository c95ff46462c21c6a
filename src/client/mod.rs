//! The worker client (BytePS's Communication Service, in the training
//! process): joins the job, opens one data connection per server thread,
//! declares tensors, and runs push_pull through the I/O thread.
//!
//! Threads: the caller's thread (submits, waits on handles), one I/O thread
//! (all data connections, see `io`), one control thread (scheduler messages:
//! declarations, barriers, peer failures: `control`) and a heartbeat thread.
//! Workers that share a host sum there first (`host`).
//!
//! Where things are: `Client` (this file: joining, declare, push_pull,
//! barrier, release, leaving); `config` (settings, errors); `table` (names,
//! parked ops, uses); `shared` (what the threads share, completions, peers
//! leaving, failover and joins as the control thread sees them); `control`
//! (the control thread); `join` (Horovod's join, process sets); `io` (the
//! data plane); `op` (handles).

mod config;
mod control;
mod io;
mod join;
mod op;
mod shared;
mod table;

pub use config::{ClientConfig, ClientError};
pub use io::IoStats;
pub use op::{Callback, Extent, Op, OpError, Summed};

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::bounded;
use mio::Poll;

use crate::host::HostStage;
use crate::placement::HostLayout;
use crate::protocol::{Control, DType, DeclEntry, MsgType, Register, Role};
use crate::session::Joining;
use crate::transport::{connect_authenticated, join_host_port};
use control::control_loop;
use io::{BufPtr, Io, IoThread};
use join::ZeroPushes;
use shared::Shared;
use table::{check_matches, join_op, take_for_reshape, Parked, Table, Use, Waiter};

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
            sum_order: cfg.sum_order,
            training: cfg.training,
            elastic: cfg.elastic,
        })?;
        let w = session.welcome.clone();
        let me = w.rank as usize;
        let before = cfg.elastic.map(|e| if e.prev_rank >= 0 { e.prev_rank } else { cfg.rank });
        if before.is_some_and(|r| i64::from(r) != i64::from(w.rank)) {
            // The service numbers each generation; this line (under the new
            // number) lets the launcher's label follow it.
            log::info!(
                target: &format!("worker {}", w.rank),
                "this worker is rank {} of {} in the elastic job's new generation",
                w.rank,
                w.num_workers
            );
        }
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
                let stage = HostStage::join(
                    w.job_id,
                    host,
                    local.to_vec(),
                    servers_here,
                    w.rank,
                    cfg.connect_timeout,
                    cfg.sum_order,
                )
                .map_err(ClientError::Setup)?;
                // Said once per host (by its first worker), not by every worker on every start.
                let level = if local[0] == w.rank { log::Level::Info } else { log::Level::Debug };
                log::log!(
                    target: "worker",
                    level,
                    "host stage: the {} workers on this host (ranks {:?}) sum their tensors in shared memory \
                     first, and each pushes 1/{} of every tensor (GRADHUB_HOST_REDUCE=0 turns this off)",
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
                let authed =
                    connect_authenticated(&addr, cfg.connect_timeout, &cfg.secret).map_err(|e| setup(&desc, e))?;
                let conn = io::NewConn::new(authed, addr, desc.clone(), s.rank, by_ref);
                conns.push(conn.map_err(|e| setup(&desc, e))?);
            }
        }

        let poll = Poll::new().map_err(|e| setup("poll", e))?;
        let limit = crate::protocol::data_payload_limit(w.partition_bytes);
        let stall = Duration::from_millis(w.stall_ms as u64);
        let failover = w.failover.then(|| Duration::from_millis(w.peer_timeout_ms as u64));
        let base_credit = cfg.credit_bytes.unwrap_or_else(|| crate::default_credit_bytes(w.partition_bytes));
        let credit = (base_credit, cfg.spread_bytes);
        let mend = (cfg.secret.clone(), Duration::from_millis(w.peer_timeout_ms as u64));
        let io = Io::new(&poll, conns, w.rank, credit, ns, limit, Arc::new(layout), host_stage, stall, failover, mend)
            .map_err(|e| setup("data connections", e))?;
        let shared = Arc::new(Shared {
            session: session.sender(),
            secret: cfg.secret.clone(),
            namespace: ns,
            connect_timeout: cfg.connect_timeout,
            rack,
            table: Mutex::new(Table::default()),
            failure: Mutex::new(None),
            io: Arc::new(io),
            next_req: AtomicU32::new(0),
            next_barrier: AtomicU32::new(0),
            closing: AtomicBool::new(false),
            hosts_updated: AtomicBool::new(false),
        });

        let weak = Arc::downgrade(&shared);
        session.on_rejoin(move || weak.upgrade().map(|s| s.rejoin_report()).unwrap_or_default());
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name.into()).spawn(f).map_err(|e| setup("spawn", e))
        };
        let threads = vec![
            {
                let shared = shared.clone();
                let io = shared.io.clone();
                spawn("gradhub-io", Box::new(move || IoThread::new(poll, io, shared).run()))?
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
        unsafe {
            let all = (Extent::default(), Summed::default());
            self.push_pull_live(ptr, nbytes, dtype, name, flags, false, priority, keepalive, all.0, all.1)
        }
    }

    /// `push_pull` of a buffer that is zeros outside bytes `extent.live` (a
    /// worker's own rows of an allgather, a broadcast from another worker):
    /// the chunks wholly outside it are pushed as zeros, header only
    /// (`FLAG_ZEROS`); and whose result is needed only in bytes
    /// `extent.want` (a reduce-scatter's shard; none for a joined worker's
    /// zeros): the chunks wholly outside it are answered by a header only and
    /// keep what was pushed; so are those wholly inside `extent.live` if
    /// `extent.live_is_own` (an all-gather's own slot). Neither applies under the host stage, which
    /// sums and shares every chunk of a host.
    /// `summed.members`: the workers that sum this tensor, by rank,
    /// ascending (a process set's, a torch sub-group's), this one among
    /// them; each pushes for itself, and no other worker takes part (empty:
    /// every worker). `summed.sharded`: member q reads the q-th of as many
    /// equal shards (placed on its host's server, where it has one). Both
    /// are the tensor's: they count when it is first declared. Horovod's join does not cover such a tensor: a joined
    /// worker pushes zeros only for tensors of every worker.
    /// `release_after`: free the tensor once this round completes (see
    /// `release`), for a generated name that is never used again; the
    /// worker's own bookkeeping, told to joined workers in `JoinOp`, never
    /// a frame flag.
    ///
    /// # Safety
    /// As `push_pull`; and the buffer must be zeros outside `extent.live`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn push_pull_live(
        &self,
        ptr: *mut u8,
        nbytes: usize,
        dtype: DType,
        name: &str,
        flags: u16,
        release_after: bool,
        priority: i32,
        keepalive: Option<Box<dyn std::any::Any + Send>>,
        extent: Extent,
        summed: Summed,
    ) -> Result<Arc<Op>, ClientError> {
        let members = summed.members;
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
        let known = crate::protocol::FLAG_AVERAGE | crate::protocol::FLAG_INIT | crate::protocol::FLAG_ASYNC;
        if flags & !known != 0 {
            return Err(ClientError::Usage(format!("unknown push_pull flags {flags:#x}")));
        }
        if (extent.want.is_some() || extent.live_is_own) && flags & crate::protocol::FLAG_ASYNC != 0 {
            return Err(ClientError::Usage("an asynchronous push_pull always returns its whole result".into()));
        }
        let rank = self.shared.io.rank();
        if !members.is_empty() && (members.windows(2).any(|w| w[0] >= w[1]) || members.binary_search(&rank).is_err()) {
            return Err(ClientError::Usage(format!(
                "push_pull '{name}': members {members:?} must be ascending ranks that include this worker ({rank})"
            )));
        }
        let op = Arc::new(Op::new(name.to_string(), keepalive, extent));
        let ptr = BufPtr(ptr);
        let mut t = self.shared.table();
        if t.specs.get(name).is_some_and(|s| check_matches(s, numel, dtype).is_err()) {
            // Another shape: a new tensor under the same name (as Horovod allows).
            let old = take_for_reshape(&mut t, name, numel, dtype)?;
            drop(t);
            self.shared.release_specs(&[old]);
            t = self.shared.table();
        }
        // An asynchronous push waits for nobody: a worker that finished early
        // does not hold the others back.
        let waits_for_all = flags & crate::protocol::FLAG_ASYNC == 0;
        let left =
            if waits_for_all { self.shared.check_left_of(&t, &format!("push_pull '{name}'"), members) } else { Ok(()) };
        if let Err(e) = left {
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
        let u = Use { round, numel, dtype, flags, release_after };
        match t.uses.get_mut(name) {
            Some(x) => *x = u,
            None => {
                t.uses.insert(name.to_string(), u);
            }
        }
        if t.peers_joined && members.is_empty() {
            drop(t);
            if let Err(e) = self.shared.send_ctrl(&join_op(name, &u)) {
                self.shared.set_failure(e.to_string());
            }
            t = self.shared.table();
        }
        if let Some(s) = t.specs.get(name).cloned() {
            // Checked against the spec above.
            let shards = t.shards.get(name).copied().unwrap_or(0);
            drop(t);
            self.shared.submit(op.clone(), s, ptr, priority, flags, shards);
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
            if summed.sharded {
                let m = if members.is_empty() { self.num_workers } else { members.len() as u32 };
                t.shards.insert(name.to_string(), m);
            } else {
                t.shards.remove(name);
            }
            let req = self.shared.next_req.fetch_add(1, Ordering::Relaxed);
            t.waiters.insert(req, Waiter::Async(vec![name.to_string()]));
            drop(t);
            let (members, sharded) = (members.to_vec(), summed.sharded);
            let e = DeclEntry { name: name.to_string(), numel, dtype, partition: 0, members, sharded };
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
        self.declare(vec![DeclEntry {
            name: name.to_string(),
            numel,
            dtype: DType::F32,
            partition: 0,
            members: Vec::new(),
            sharded: false,
        }])?;
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

    /// Point-to-point links for member `rank` of a group of `size` (its
    /// name), authenticated with this job's token (`crate::peer`).
    pub fn peer_links(
        &self,
        rank: u32,
        size: u32,
        group: String,
        host: String,
        timeout: Duration,
    ) -> std::io::Result<crate::peer::PeerLinks> {
        crate::peer::PeerLinks::open(crate::peer::PeerConfig {
            rank,
            size,
            group,
            namespace: self.shared.namespace,
            secret: self.shared.secret.clone(),
            host,
            timeout,
            buffer_bytes: crate::peer::BUFFER_BYTES,
        })
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
        if let Some(h) = self.shared.io.host_stage() {
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

    /// Whether workers wait to join this elastic job (it re-forms at the
    /// next commit: `gradhub.torch.elastic`).
    pub fn hosts_updated(&self) -> bool {
        self.shared.hosts_updated.load(Ordering::Acquire)
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
                t.shards.remove(n);
            }
            specs
        };
        self.shared.release_specs(&specs);
        Ok(())
    }

    /// What this worker holds and has done so far, in one snapshot (for
    /// tests, benchmarks and diagnostics).
    pub fn stats(&self) -> ClientStats {
        let tensors = self.shared.table().specs.len();
        ClientStats { tensors, data: self.shared.io.stats() }
    }
}

/// A snapshot of a worker's counters (`Client::stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientStats {
    /// Tensors this worker holds state for (declared and not released).
    pub tensors: usize,
    /// The data plane's counters.
    pub data: IoStats,
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shutdown();
    }
}
