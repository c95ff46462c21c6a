//! Declarations: collect each worker's tensor declarations, check they
//! agree, place each complete tensor once (so placement is identical on
//! every worker), install it on every server and only then answer the
//! workers; report tensors some workers never declare; free tensors every
//! worker released.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::state::{Member, Shared, State};
use crate::placement::chunk_elems;
use crate::protocol::{Control, DType, Role, TensorSpec};

pub(super) struct Decl {
    numel: u64,
    dtype: DType,
    /// Bytes per chunk (resolved: never 0).
    partition: u32,
    first_rank: u32,
    declared_by: Vec<bool>,
    conflict: Option<String>,
    spec: Option<TensorSpec>,
    installed: bool,
    since: Instant,
    stall_reported: bool,
}

/// A released tensor: out of use by name (declaring the name again makes a
/// new tensor), freed on the servers once every worker released it.
pub(super) struct Retiring {
    spec: TensorSpec,
    released_by: Vec<bool>,
}

pub(super) struct PendingReq {
    rank: u32,
    req: u32,
    names: Vec<String>,
}

/// Tensors the job holds (declared, or released by some workers only) and
/// their bytes.
pub(super) fn held(st: &State) -> (usize, u64) {
    let size = |numel: u64, dtype: DType| numel.saturating_mul(dtype.size() as u64);
    let bytes = st.decls.values().map(|d| size(d.numel, d.dtype)).sum::<u64>()
        + st.retiring.values().map(|r| size(r.spec.numel, r.spec.dtype)).sum::<u64>();
    (st.decls.len() + st.retiring.len(), bytes)
}

/// Why declaring `entries` would take the job past its limits on a shared
/// service (tensors held at once, and their bytes), if it would.
fn over_limits(cfg: &super::SchedulerConfig, st: &State, entries: &[crate::protocol::DeclEntry]) -> Option<String> {
    if cfg.max_tensors == 0 && cfg.max_bytes == 0 {
        return None;
    }
    let mut new: Vec<&crate::protocol::DeclEntry> = Vec::new();
    for e in entries {
        if !st.decls.contains_key(&e.name) && !new.iter().any(|n| n.name == e.name) {
            new.push(e);
        }
    }
    let (held, held_bytes) = held(st);
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

/// Record a worker's declarations. Returns a batch of newly complete specs
/// that must be installed on the servers before anyone is answered.
pub(super) fn declare(
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
        let job = shared.cfg.partition_bytes;
        // A tensor may take smaller chunks than the job's (autotuning tries
        // them), never larger: the job's partition bounds every data frame.
        if e.partition != 0 && (e.partition < e.dtype.size() as u32 || e.partition > job) {
            let message = format!(
                "tensor '{}': a partition of {} bytes is outside {}..={job} (an element of {} up to the job's \
                 partition size, the scheduler's --partition-bytes)",
                e.name,
                e.partition,
                e.dtype.size(),
                e.dtype.name()
            );
            if let Some(m) = st.members.iter().find(|m| m.role == Role::Worker && m.rank == rank) {
                m.send(&Control::DeclareError { req, message }, shared.cfg.namespace);
            }
            return None;
        }
        let partition = if e.partition == 0 { job } else { e.partition };
        let ce = chunk_elems(partition, e.dtype.size());
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
                partition
            );
            if let Some(m) = st.members.iter().find(|m| m.role == Role::Worker && m.rank == rank) {
                m.send(&Control::DeclareError { req, message }, shared.cfg.namespace);
            }
            return None;
        }
    }
    if let Some(message) = over_limits(&shared.cfg, st, &entries) {
        if let Some(m) = st.members.iter().find(|m| m.role == Role::Worker && m.rank == rank) {
            m.send(&Control::DeclareError { req, message }, shared.cfg.namespace);
        }
        return None;
    }
    for e in entries {
        let partition = if e.partition == 0 { shared.cfg.partition_bytes } else { e.partition };
        let d = st.decls.entry(e.name.clone()).or_insert_with(|| Decl {
            numel: e.numel,
            dtype: e.dtype,
            partition,
            first_rank: rank,
            declared_by: vec![false; n],
            conflict: None,
            spec: None,
            installed: false,
            since: Instant::now(),
            stall_reported: false,
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
        d.declared_by[rank as usize] = true;
        // A name repeated in one request completes (and is placed) once.
        let complete = d.declared_by.iter().all(|&b| b);
        if d.conflict.is_none() && d.spec.is_none() && complete && !newly_complete.contains(&e.name) {
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
        let ce = chunk_elems(d.partition, dtype.size());
        let nchunks = numel.div_ceil(ce);
        let sizes = (0..nchunks).map(|c| (ce.min(numel - c * ce)) * dtype.size() as u64);
        let slots = match st.placer.as_mut() {
            Some(p) => p.place(sizes),
            None => continue,
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
        };
        if let Some(p) = st.placer.as_mut() {
            spec.replicas = p.place_replicas(&spec);
            spec.relays = p.place_relays(&spec);
        }
        if let Some(d) = st.decls.get_mut(&name) {
            d.spec = Some(spec.clone());
        }
        st.by_key.insert(key, name.clone());
        specs.push(spec);
    }
    answer_ready(shared, st);
    if let Some(why) = waiting_on_departed(st) {
        shared.fail(st, None, why);
        return None;
    }
    if specs.is_empty() {
        return None;
    }
    let batch = st.next_batch;
    st.next_batch += 1;
    Some((batch, specs))
}

/// Worker `rank` is done with tensors `keys` (`Control::Release`). A
/// worker releases a tensor only once its last round completed there, which
/// means every worker pushed that round: nobody can push it again, so the
/// name is free at once, and the servers free its chunks when the last
/// worker (the last to receive the result) released it. Errors name a
/// protocol violation (an unknown key, a second release).
pub(super) fn release(shared: &Shared, st: &mut State, rank: u32, keys: Vec<u32>) -> Result<(), String> {
    let n = shared.cfg.num_workers as usize;
    let mut freed = Vec::new();
    for key in keys {
        if !st.retiring.contains_key(&key) {
            let installed = st.by_key.get(&key).and_then(|name| st.decls.get(name)).is_some_and(|d| d.installed);
            let spec = match st.by_key.remove(&key).and_then(|name| st.decls.remove(&name)).and_then(|d| d.spec) {
                Some(spec) if installed => spec,
                _ => return Err(format!("worker {rank} released tensor key {key}, which is not in use")),
            };
            st.retiring.insert(key, Retiring { spec, released_by: vec![false; n] });
        }
        let Some(r) = st.retiring.get_mut(&key) else { continue };
        if std::mem::replace(&mut r.released_by[rank as usize], true) {
            return Err(format!("worker {rank} released tensor '{}' twice", r.spec.name));
        }
        if r.released_by.iter().all(|&b| b) {
            let Some(r) = st.retiring.remove(&key) else { continue };
            let s = &r.spec;
            if let Some(p) = st.placer.as_mut() {
                p.unplace(s);
            }
            freed.push(key);
        }
    }
    st.to_free.extend(freed);
    if st.to_free.len() >= FREE_BATCH {
        free_on_servers(shared, st);
    }
    Ok(())
}

/// Released keys sent to the servers at once, without waiting for the next
/// install or heartbeat (which take them along: one wake-up of a server for
/// both, not one more per unnamed operation).
const FREE_BATCH: usize = 1024;

/// Tell the servers to free the tensors every worker released.
pub(super) fn free_on_servers(shared: &Shared, st: &mut State) {
    if st.to_free.is_empty() {
        return;
    }
    let msg = Control::ServerRelease { keys: std::mem::take(&mut st.to_free) };
    for m in st.members.iter().filter(|m| m.role == Role::Server) {
        m.send(&msg, shared.cfg.namespace);
    }
}

/// A declaration a worker still waits for that can never complete: a
/// worker that left the job (goodbye) never declared it.
pub(super) fn waiting_on_departed(st: &State) -> Option<String> {
    for p in st.pending.iter().filter(|p| !st.said_goodbye.contains(&p.rank)) {
        for name in &p.names {
            let Some(d) = st.decls.get(name).filter(|d| d.spec.is_none() && d.conflict.is_none()) else { continue };
            let mut gone: Vec<u32> = st.said_goodbye.iter().copied().filter(|&r| !d.declared_by[r as usize]).collect();
            if gone.is_empty() {
                continue;
            }
            gone.sort_unstable();
            return Some(format!(
                "worker(s) {gone:?} left the job (shut down or exited) without declaring tensor '{name}', \
                 which worker {} waits for: every worker must run the same collective operations",
                p.rank
            ));
        }
    }
    None
}

/// A tensor some workers declared long ago and others never did: log who is
/// missing and tell the workers waiting on it (their timeouts will name them).
pub(super) fn report_declaration_stalls(shared: &Shared) {
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
        log::warn!(target: "scheduler",
            "stall: tensor '{name}' has waited {:.1}s for worker rank(s) {missing:?} to declare it (push_pull it)",
            waited.as_secs_f64()
        );
        let msg = Control::DeclareStall { name, missing, waited_ms: waited.as_millis() as u64 };
        for m in st.members.iter().filter(|m| m.role == Role::Worker && waiting.contains(&m.rank)) {
            m.send(&msg, shared.cfg.namespace);
        }
    }
    drop(st);
}

/// Send the specs to every server, wait for all acks, then answer workers.
pub(super) fn install(shared: &Shared, batch: u32, specs: Vec<TensorSpec>) {
    let ns = shared.cfg.namespace;
    let (servers, free) = {
        let mut st = shared.lock();
        let servers: Vec<Arc<Member>> = st.members.iter().filter(|m| m.role == Role::Server).cloned().collect();
        (servers, std::mem::take(&mut st.to_free))
    };
    let mut msgs = vec![Control::ServerDeclare { batch, specs: specs.clone() }];
    if !free.is_empty() {
        msgs.insert(0, Control::ServerRelease { keys: free });
    }
    for s in &servers {
        s.send_all(&msgs, ns);
    }
    let mut st = shared.wait_installed(batch);
    for s in &specs {
        if let Some(d) = st.decls.get_mut(&s.name) {
            d.installed = true;
        }
    }
    answer_ready(shared, &mut st);
}

/// Answer every pending declaration whose tensors are all installed, or that
/// contains a conflicting tensor (not during a failover: see `failover`).
pub(super) fn answer_ready(shared: &Shared, st: &mut State) {
    let ns = shared.cfg.namespace;
    if st.failing_over > 0 {
        return;
    }
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

/// Every placed tensor some worker may still use: declared, or released
/// by some workers only.
pub(super) fn specs_in_use<'a>(
    decls: &'a mut HashMap<String, Decl>,
    retiring: &'a mut HashMap<u32, Retiring>,
) -> impl Iterator<Item = &'a mut TensorSpec> {
    decls.values_mut().filter_map(|d| d.spec.as_mut()).chain(retiring.values_mut().map(|r| &mut r.spec))
}

/// Place again every chunk on the slots `gone` (a lost server's), in
/// tensors still in use by some worker; returns the specs that changed.
pub(super) fn place_again(st: &mut State, gone: &[u32]) -> Vec<TensorSpec> {
    let Some(placer) = st.placer.as_mut() else { return Vec::new() };
    let mut changed = Vec::new();
    for spec in specs_in_use(&mut st.decls, &mut st.retiring) {
        if placer.replace(spec, gone) {
            changed.push(spec.clone());
        }
    }
    changed.sort_by_key(|s| s.key);
    changed
}
