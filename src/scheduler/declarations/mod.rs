//! Declarations (`Declarations`, edited only here): collect each worker's
//! tensor declarations, check they agree, place each complete tensor once
//! (so placement is identical on every worker), answer the workers once it
//! is installed on every server; report tensors some workers never
//! declare; free tensors every worker released. The placer lives here:
//! moves (`moves`) place chunks again through `in_use`.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::config::SchedulerConfig;
use super::membership::Members;
use crate::placement::{chunk_elems, Placer};
use crate::protocol::{Control, DType, DeclEntry, TensorSpec};
use crate::waits::{left_message, StallWatch};

struct Decl {
    numel: u64,
    dtype: DType,
    /// Bytes per chunk (resolved: never 0).
    partition: u32,
    first_rank: u32,
    /// The workers that sum it (empty: all); the others count as declared.
    members: Vec<u32>,
    /// Its shards go to their readers' hosts (`DeclEntry::sharded`).
    sharded: bool,
    declared_by: Vec<bool>,
    conflict: Option<String>,
    spec: Option<TensorSpec>,
    installed: bool,
    /// Since its first declaration (`crate::waits`).
    stall: StallWatch,
}

/// A released tensor: out of use by name (declaring the name again makes a
/// new tensor), freed on the servers once every worker released it.
struct Retiring {
    spec: TensorSpec,
    released_by: Vec<bool>,
}

struct PendingReq {
    rank: u32,
    req: u32,
    names: Vec<String>,
}

/// A tensor some workers declared long ago and others never did.
pub(super) struct Stall {
    pub name: String,
    pub missing: Vec<u32>,
    pub waiting: Vec<u32>,
    pub waited: Duration,
}

#[derive(Default)]
pub(super) struct Declarations {
    /// Set once every member registered (`membership`).
    placer: Option<Placer>,
    decls: HashMap<String, Decl>,
    /// The name of every placed tensor, by key (for `Release`).
    by_key: HashMap<u32, String>,
    /// Tensors some workers released and others not yet, by key.
    retiring: HashMap<u32, Retiring>,
    /// Tensors every worker released, not yet freed on the servers (sent
    /// with the next install or heartbeat: see `release`).
    to_free: Vec<u32>,
    next_key: u32,
    /// Declarations a worker waits to have answered.
    pending: Vec<PendingReq>,
    /// Rebuilt by a scheduler that restarted (`rejoin`): a worker may
    /// release a tensor this scheduler has not heard of yet (its holders
    /// rejoin later), recorded here by key until one reports it.
    rebuilt: bool,
    early: HashMap<u32, Vec<u32>>,
    /// A restarted scheduler waits for its members (`rejoin` until
    /// `rebuilt`): complete tensors are not placed yet, since a key a server
    /// still holds (a tensor freed after the restart began, reported by a
    /// server not back yet) would be given out again.
    placing_held: bool,
}

/// By rank, whether a worker is outside `members` (empty: every worker is in):
/// what a tensor's declarations and releases start from, so that it is
/// complete once every member declared (released) it.
fn outside(members: &[u32], n: usize) -> Vec<bool> {
    (0..n as u32).map(|r| !members.is_empty() && members.binary_search(&r).is_err()).collect()
}

/// At most this many keys released early (`Declarations::early`).
const EARLY_RELEASES: usize = 1 << 16;

/// Released keys sent to the servers at once, without waiting for the next
/// install or heartbeat (which take them along: one wake-up of a server for
/// both, not one more per unnamed operation).
const FREE_BATCH: usize = 1024;

impl Declarations {
    pub fn set_placer(&mut self, placer: Placer) {
        self.placer = Some(placer);
    }

    pub fn placer(&self) -> Option<&Placer> {
        self.placer.as_ref()
    }

    pub fn placer_mut(&mut self) -> Option<&mut Placer> {
        self.placer.as_mut()
    }

    /// Tensors the job holds (declared, or released by some workers only)
    /// and their bytes.
    pub fn held(&self) -> (usize, u64) {
        let size = |numel: u64, dtype: DType| numel.saturating_mul(dtype.size() as u64);
        let bytes = self.decls.values().map(|d| size(d.numel, d.dtype)).sum::<u64>()
            + self.retiring.values().map(|r| size(r.spec.numel, r.spec.dtype)).sum::<u64>();
        (self.decls.len() + self.retiring.len(), bytes)
    }

    /// Why declaring `entries` would take the job past its limits on a shared
    /// service (tensors held at once, and their bytes), if it would.
    fn over_limits(&self, cfg: &SchedulerConfig, entries: &[DeclEntry]) -> Option<String> {
        if cfg.max_tensors == 0 && cfg.max_bytes == 0 {
            return None;
        }
        let mut new: Vec<&DeclEntry> = Vec::new();
        for e in entries {
            if !self.decls.contains_key(&e.name) && !new.iter().any(|n| n.name == e.name) {
                new.push(e);
            }
        }
        let (held, held_bytes) = self.held();
        let tensors = held + new.len();
        let bytes = held_bytes + new.iter().map(|e| e.numel.saturating_mul(e.dtype.size() as u64)).sum::<u64>();
        if cfg.max_tensors > 0 && tensors > cfg.max_tensors as usize {
            return Some(format!(
                "this job would hold {tensors} tensors on the service, over its limit of {} per job \
                 (the service's --job-max-tensors)",
                cfg.max_tensors
            ));
        }
        if cfg.max_bytes > 0 && bytes > cfg.max_bytes {
            return Some(format!(
                "this job would hold {:.1} MiB of tensors on the service, over its limit of {:.1} MiB per job \
                 (the service's --job-max-mib)",
                bytes as f64 / (1 << 20) as f64,
                cfg.max_bytes as f64 / (1 << 20) as f64
            ));
        }
        None
    }

    /// Why an entry cannot be declared (sent back as a `DeclareError`), if
    /// one cannot.
    fn check(cfg: &SchedulerConfig, e: &DeclEntry) -> Option<String> {
        let job = cfg.partition_bytes;
        if e.members.last().is_some_and(|&r| r >= cfg.num_workers) {
            return Some(format!(
                "tensor '{}': members {:?} name a rank outside the job's {} workers",
                e.name, e.members, cfg.num_workers
            ));
        }
        // A tensor may take smaller chunks than the job's (autotuning tries
        // them), never larger: the job's partition bounds every data frame.
        if e.partition != 0 && (e.partition < e.dtype.size() as u32 || e.partition > job) {
            return Some(format!(
                "tensor '{}': a partition of {} bytes is outside {}..={job} (an element of {} up to the job's \
                 partition size, the scheduler's --partition-bytes)",
                e.name,
                e.partition,
                e.dtype.size(),
                e.dtype.name()
            ));
        }
        let partition = if e.partition == 0 { job } else { e.partition };
        let ce = chunk_elems(partition, e.dtype.size());
        let bytes = e.numel.checked_mul(e.dtype.size() as u64);
        // The reply lists one u32 slot per chunk; keep it well under the control-message limit.
        if bytes.is_none_or(|b| b > crate::protocol::control::MAX_TENSOR_BYTES)
            || e.numel.div_ceil(ce) > (crate::protocol::MAX_CONTROL_PAYLOAD / 16) as u64
        {
            return Some(format!(
                "tensor '{}' with {} elements of {} is too large for partitions of {} bytes",
                e.name,
                e.numel,
                e.dtype.name(),
                partition
            ));
        }
        None
    }

    /// Record worker `rank`'s declarations (request `req`). Returns the
    /// newly complete tensors, placed (to install on the servers before
    /// anyone is answered), or why the request is refused.
    pub fn declare(
        &mut self,
        cfg: &SchedulerConfig,
        rank: u32,
        req: u32,
        entries: Vec<DeclEntry>,
    ) -> Result<Vec<TensorSpec>, String> {
        if let Some(message) = entries.iter().find_map(|e| Self::check(cfg, e)) {
            return Err(message);
        }
        if let Some(e) = entries.iter().find(|e| !e.members.is_empty() && e.members.binary_search(&rank).is_err()) {
            return Err(format!(
                "worker {rank} declared tensor '{}' of the workers {:?}, not its own",
                e.name, e.members
            ));
        }
        if let Some(message) = self.over_limits(cfg, &entries) {
            return Err(message);
        }
        let n = cfg.num_workers as usize;
        let mut names = Vec::with_capacity(entries.len());
        let mut newly_complete = Vec::new();
        for e in entries {
            let partition = if e.partition == 0 { cfg.partition_bytes } else { e.partition };
            let d = self.decls.entry(e.name.clone()).or_insert_with(|| Decl {
                numel: e.numel,
                dtype: e.dtype,
                partition,
                first_rank: rank,
                declared_by: outside(&e.members, n),
                members: e.members.clone(),
                sharded: e.sharded,
                conflict: None,
                spec: None,
                installed: false,
                stall: StallWatch::start(),
            });
            if d.conflict.is_none() && (d.numel != e.numel || d.dtype != e.dtype || d.partition != partition) {
                d.conflict = Some(format!(
                    "tensor '{}' declared inconsistently: worker {} has {} elements of {} in chunks of {} bytes, \
                     worker {} has {} elements of {} in chunks of {} bytes",
                    e.name,
                    d.first_rank,
                    d.numel,
                    d.dtype.name(),
                    d.partition,
                    rank,
                    e.numel,
                    e.dtype.name(),
                    partition
                ));
            }
            // (Once placed, how it was placed no longer matters: a
            // scheduler that restarted rebuilt it without knowing.)
            if d.conflict.is_none() && d.spec.is_none() && d.sharded != e.sharded {
                d.conflict = Some(format!(
                    "tensor '{}' declared inconsistently: worker {} {} it as shards, worker {rank} {}",
                    e.name,
                    d.first_rank,
                    if d.sharded { "declared" } else { "did not declare" },
                    if e.sharded { "did" } else { "did not" }
                ));
            }
            if d.conflict.is_none() && d.members != e.members {
                d.conflict = Some(format!(
                    "tensor '{}' declared inconsistently: worker {} sums it over workers {:?}, worker {rank} over {:?} \
                     (empty: every worker)",
                    e.name, d.first_rank, d.members, e.members
                ));
            }
            d.declared_by[rank as usize] = true;
            // A name repeated in one request completes (and is placed) once.
            let complete = d.declared_by.iter().all(|&b| b);
            if d.conflict.is_none() && d.spec.is_none() && complete && !newly_complete.contains(&e.name) {
                newly_complete.push(e.name.clone());
            }
            names.push(e.name);
        }
        // A request sent again (its answer lost with a link) is answered once.
        if !self.pending.iter().any(|p| p.rank == rank && p.req == req) {
            self.pending.push(PendingReq { rank, req, names });
        }
        if self.placing_held {
            return Ok(Vec::new());
        }
        Ok(self.place(newly_complete))
    }

    /// Place the tensors `names` (complete, not placed): a key each, above
    /// every key given out or reported, and their chunks' servers.
    fn place(&mut self, names: Vec<String>) -> Vec<TensorSpec> {
        let mut specs = Vec::new();
        for name in names {
            let key = self.next_key;
            self.next_key += 1;
            let Some(d) = self.decls.get(&name) else { continue };
            let (numel, dtype, members) = (d.numel, d.dtype, d.members.clone());
            // Its readers, in shard order (every worker when it has no members).
            let readers: Vec<u32> = match (d.sharded, members.is_empty()) {
                (false, _) => Vec::new(),
                (true, true) => (0..d.declared_by.len() as u32).collect(),
                (true, false) => members.clone(),
            };
            let ce = chunk_elems(d.partition, dtype.size());
            let nchunks = numel.div_ceil(ce);
            let chunks = (0..nchunks)
                .map(|c| (c * ce, (c * ce + ce).min(numel), (ce.min(numel - c * ce)) * dtype.size() as u64));
            let Some(placer) = self.placer.as_mut() else { continue };
            let shard = (numel / readers.len().max(1) as u64).max(1);
            let slots = match !readers.is_empty() && numel.is_multiple_of(readers.len() as u64) {
                // Shard q: elements q * shard .. (q + 1) * shard, read by readers[q].
                true => placer.place_sharded(chunks, |lo, hi| {
                    (lo / shard == (hi - 1) / shard).then(|| readers.get((lo / shard) as usize).copied()).flatten()
                }),
                false => placer.place(chunks.map(|(_, _, b)| b)),
            };
            let mut spec = TensorSpec {
                key,
                name: name.clone(),
                numel,
                dtype,
                chunk_elems: ce,
                slots,
                replicas: Vec::new(),
                relays: Vec::new(),
                members,
            };
            spec.replicas = placer.place_replicas(&spec);
            // Members push straight to each chunk's owner.
            if spec.members.is_empty() {
                spec.relays = placer.place_relays(&spec);
            }
            if let Some(d) = self.decls.get_mut(&name) {
                d.spec = Some(spec.clone());
            }
            self.by_key.insert(key, name.clone());
            specs.push(spec);
        }
        specs
    }

    /// A worker that rejoined a scheduler that restarted (`Members::rejoin`)
    /// has the tensors `specs`, declared, installed and answered: they are
    /// the job's as placed (the placer counts them once). Errors name a
    /// worker whose tensor disagrees with another's of the same name.
    pub fn rejoin(&mut self, rank: u32, num_workers: u32, specs: &[TensorSpec]) -> Result<(), String> {
        let n = num_workers as usize;
        self.rebuilt = true;
        self.placing_held = true;
        for s in specs {
            let d = match self.decls.get_mut(&s.name) {
                Some(d) => d,
                None => {
                    if let Some(p) = self.placer.as_mut() {
                        p.account(s);
                    }
                    self.by_key.insert(s.key, s.name.clone());
                    self.decls.entry(s.name.clone()).or_insert(Decl {
                        numel: s.numel,
                        dtype: s.dtype,
                        partition: (s.chunk_elems.saturating_mul(s.dtype.size() as u64)).min(u32::MAX as u64) as u32,
                        first_rank: rank,
                        declared_by: outside(&s.members, n),
                        members: s.members.clone(),
                        sharded: false,
                        conflict: None,
                        spec: Some(s.clone()),
                        installed: true,
                        stall: StallWatch::start(),
                    })
                }
            };
            if d.spec.is_none() && d.conflict.is_none() && d.numel == s.numel && d.dtype == s.dtype {
                // Declared again by workers whose answer the restart took
                // (this one had its own): placed and installed by the first
                // scheduler as reported; they are answered with it.
                if let Some(p) = self.placer.as_mut() {
                    p.account(s);
                }
                self.by_key.insert(s.key, s.name.clone());
                d.spec = Some(s.clone());
                d.installed = true;
            }
            if d.spec.as_ref() != Some(s) {
                return Err(format!(
                    "worker {rank} rejoined with tensor '{}' (key {}) placed unlike worker {}'s",
                    s.name, s.key, d.first_rank
                ));
            }
            if let Some(b) = d.declared_by.get_mut(rank as usize) {
                *b = true;
            }
            self.next_key = self.next_key.max(s.key.saturating_add(1));
        }
        Ok(())
    }

    /// A server that rejoined has `keys` installed: new tensors take keys
    /// above them; those no worker holds once every member is back (a
    /// declaration installed but not answered before the restart, which
    /// its workers declare again) are freed (`rebuilt`).
    pub fn server_keys(&mut self, keys: &[u32]) {
        self.rebuilt = true;
        self.placing_held = true;
        for &k in keys {
            self.next_key = self.next_key.max(k.saturating_add(1));
            if !self.by_key.contains_key(&k) && !self.to_free.contains(&k) {
                self.to_free.push(k);
            }
        }
    }

    /// Every member rejoined: keys some server holds that a worker reported
    /// after all stay; the rest are freed. Returns the tensors every worker
    /// declared meanwhile, placed now (to install before they are answered).
    pub fn rebuilt(&mut self) -> Vec<TensorSpec> {
        let by_key = &self.by_key;
        self.to_free.retain(|k| !by_key.contains_key(k));
        self.placing_held = false;
        let mut complete: Vec<String> = Vec::new();
        for p in &self.pending {
            for name in &p.names {
                let ready = self
                    .decls
                    .get(name)
                    .is_some_and(|d| d.spec.is_none() && d.conflict.is_none() && d.declared_by.iter().all(|&b| b));
                if ready && !complete.contains(name) {
                    complete.push(name.clone());
                }
            }
        }
        self.place(complete)
    }

    /// The tensors of a batch are installed on every server.
    pub fn installed(&mut self, specs: &[TensorSpec]) {
        for s in specs {
            if let Some(d) = self.decls.get_mut(&s.name) {
                d.installed = true;
            }
        }
    }

    /// Worker `rank` (of `num_workers`) is done with tensors `keys`
    /// (`Control::Release`). A worker releases a tensor only once its last
    /// round completed there, which means every worker pushed that round:
    /// nobody can push it again, so the name is free at once, and the
    /// servers free its chunks when the last worker (the last to receive
    /// the result) released it. Returns whether enough keys wait to be
    /// freed to send them now; errors name a protocol violation (an unknown
    /// key, a second release).
    pub fn release(&mut self, rank: u32, num_workers: u32, keys: Vec<u32>) -> Result<bool, String> {
        let n = num_workers as usize;
        for key in keys {
            if self.rebuilt && !self.retiring.contains_key(&key) && !self.by_key.contains_key(&key) {
                // Released before its holders rejoined (or freed already).
                let by = self.early.entry(key).or_default();
                if by.contains(&rank) {
                    return Err(format!("worker {rank} released tensor key {key} twice"));
                }
                by.push(rank);
                if self.early.len() > EARLY_RELEASES {
                    return Err(format!("over {EARLY_RELEASES} tensors released that no worker holds"));
                }
                continue;
            }
            if !self.retiring.contains_key(&key) {
                let installed =
                    self.by_key.get(&key).and_then(|name| self.decls.get(name)).is_some_and(|d| d.installed);
                let spec = match self.by_key.remove(&key).and_then(|name| self.decls.remove(&name)).and_then(|d| d.spec)
                {
                    Some(spec) if installed => spec,
                    _ => return Err(format!("worker {rank} released tensor key {key}, which is not in use")),
                };
                let mut released_by = outside(&spec.members, n);
                for r in self.early.remove(&key).unwrap_or_default() {
                    if let Some(b) = released_by.get_mut(r as usize) {
                        *b = true;
                    }
                }
                self.retiring.insert(key, Retiring { spec, released_by });
            }
            let Some(r) = self.retiring.get_mut(&key) else { continue };
            if std::mem::replace(&mut r.released_by[rank as usize], true) {
                return Err(format!("worker {rank} released tensor '{}' twice", r.spec.name));
            }
            if r.released_by.iter().all(|&b| b) {
                let Some(r) = self.retiring.remove(&key) else { continue };
                if let Some(p) = self.placer.as_mut() {
                    p.unplace(&r.spec);
                }
                self.to_free.push(key);
            }
        }
        Ok(self.to_free.len() >= FREE_BATCH)
    }

    /// The keys every worker released, to free on the servers (taken).
    pub fn take_to_free(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.to_free)
    }

    /// Tell the servers to free the tensors every worker released.
    pub fn free_on_servers(&mut self, members: &Members, ns: u32) {
        if self.to_free.is_empty() {
            return;
        }
        let msg = Control::ServerRelease { keys: self.take_to_free() };
        for m in members.servers() {
            m.send(&msg, ns);
        }
    }

    /// A declaration a worker still waits for that can never complete: a
    /// worker that left the job (`left`: said goodbye) never declared it.
    pub fn waiting_on_departed(&self, left: &HashSet<u32>) -> Option<String> {
        for p in self.pending.iter().filter(|p| !left.contains(&p.rank)) {
            for name in &p.names {
                let Some(d) = self.decls.get(name).filter(|d| d.spec.is_none() && d.conflict.is_none()) else {
                    continue;
                };
                let mut gone: Vec<u32> = left.iter().copied().filter(|&r| !d.declared_by[r as usize]).collect();
                if gone.is_empty() {
                    continue;
                }
                gone.sort_unstable();
                return Some(left_message(
                    &format!("worker(s) {gone:?}"),
                    &format!("without declaring tensor '{name}', which worker {} waits for", p.rank),
                ));
            }
        }
        None
    }

    /// Tensors some workers declared over `stall` ago and others never did,
    /// each reported once.
    pub fn stalls(&mut self, stall: Duration) -> Vec<Stall> {
        let mut reports = Vec::new();
        for (name, d) in self.decls.iter_mut() {
            if d.spec.is_some() || d.conflict.is_some() {
                continue;
            }
            let Some(waited) = d.stall.overdue(stall) else { continue };
            let by = &d.declared_by;
            let member = |r: &u32| d.members.is_empty() || d.members.binary_search(r).is_ok();
            let missing: Vec<u32> = (0..by.len() as u32).filter(|&r| !by[r as usize]).collect();
            let waiting: Vec<u32> = (0..by.len() as u32).filter(|&r| by[r as usize] && member(&r)).collect();
            reports.push(Stall { name: name.clone(), missing, waiting, waited });
        }
        reports
    }

    /// Answer every pending declaration whose tensors are all installed, or
    /// that contains a conflicting tensor (the caller holds them back
    /// during a move: their placement may still change).
    pub fn answer_ready(&mut self, members: &Members, ns: u32) {
        for (rank, reply) in self.ready() {
            if let Some(m) = members.worker(rank) {
                m.send(&reply, ns);
            }
        }
    }

    /// The answers `answer_ready` sends, by worker rank (taken from `pending`).
    fn ready(&mut self) -> Vec<(u32, Control)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            let conflict = p.names.iter().find_map(|n| self.decls.get(n).and_then(|d| d.conflict.clone()));
            let ready = p.names.iter().all(|n| self.decls.get(n).is_some_and(|d| d.installed));
            if conflict.is_none() && !ready {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            let reply = match conflict {
                Some(message) => Control::DeclareError { req: p.req, message },
                None => Control::Declared {
                    req: p.req,
                    specs: p.names.iter().filter_map(|n| self.decls.get(n).and_then(|d| d.spec.clone())).collect(),
                },
            };
            out.push((p.rank, reply));
        }
        out
    }

    /// The placer and every placed tensor some worker may still use
    /// (declared, or released by some workers only): what a move changes.
    pub fn in_use(&mut self) -> (Option<&mut Placer>, impl Iterator<Item = &mut TensorSpec>) {
        let specs = self
            .decls
            .values_mut()
            .filter_map(|d| d.spec.as_mut())
            .chain(self.retiring.values_mut().map(|r| &mut r.spec));
        (self.placer.as_mut(), specs)
    }
}

#[cfg(test)]
pub(super) mod tests;
