//! Membership: registration checks, rank assignment, the Welcome with the
//! cluster map, barriers, goodbyes and liveness (a member that disconnects
//! or stops heartbeating fails the job, and everyone is told who and why).

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};

use super::state::{Member, Shared, State};
use super::SchedulerConfig;
use crate::placement::{HostLayout, Placer};
use crate::protocol::{Control, ReadError, Register, Role, ServerInfo, Welcome};

pub(super) struct Registration {
    pub reg: Register,
    pub peer: SocketAddr,
    pub stream: TcpStream,
}

/// Why a registration is refused; the message is sent to the member.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refusal {
    #[error("{role} was started for {got} {what} but the scheduler expects {want}")]
    JobSize { role: &'static str, what: &'static str, got: u32, want: u32 },
    #[error("requested {role} rank {rank} but the job has {limit}")]
    RankOutOfRange { role: &'static str, rank: i32, limit: u32 },
    #[error("server registered without an address or ports")]
    NoAddress,
    #[error("the job already has all its members")]
    Full,
    #[error("{0}")]
    Late(String),
    #[error("{0}")]
    JobFailed(String),
    #[error("internal: {0}")]
    Internal(&'static str),
}

pub(super) fn check_registration(cfg: &SchedulerConfig, reg: &Register) -> Result<(), Refusal> {
    let role = reg.role.name();
    if reg.num_workers != 0 && reg.num_workers != cfg.num_workers {
        return Err(Refusal::JobSize { role, what: "workers", got: reg.num_workers, want: cfg.num_workers });
    }
    if reg.num_servers != 0 && reg.num_servers != cfg.num_servers {
        return Err(Refusal::JobSize { role, what: "servers", got: reg.num_servers, want: cfg.num_servers });
    }
    let limit = match reg.role {
        Role::Worker => cfg.num_workers,
        Role::Server => cfg.num_servers,
    };
    if reg.requested_rank >= limit as i32 {
        return Err(Refusal::RankOutOfRange { role, rank: reg.requested_rank, limit });
    }
    if reg.role == Role::Server && (reg.ports.is_empty() || reg.addr.is_empty()) {
        return Err(Refusal::NoAddress);
    }
    Ok(())
}

/// Register a member and block until everyone has joined; returns this member.
///
/// The thread that completes the registration creates every member and sends
/// every Welcome while holding the state lock, so each member is known (and
/// welcomed) before anyone can send it anything else — a server must not miss
/// a tensor installation because its own thread had not run yet.
pub(super) fn join(
    shared: &Shared,
    reg: Register,
    peer: SocketAddr,
    stream: TcpStream,
) -> Result<(Arc<Member>, bool), Refusal> {
    let cfg = &shared.cfg;
    let mut st = shared.lock();
    if st.assigned.is_some() {
        if reg.role == Role::Server {
            // A server joining the running job (`failover::take_in`).
            return super::failover::admit_late(shared, &mut st, reg, peer, stream).map(|m| (m, true));
        }
        return Err(Refusal::Full);
    }
    let slot = st.joining.len();
    st.joining.push(Some(Registration { reg, peer, stream }));
    let total = (cfg.num_workers + cfg.num_servers) as usize;
    if st.joining.len() == total {
        match assign_ranks(cfg, &st.joining) {
            Ok(a) => welcome_all(shared, &mut st, a),
            Err(msg) => {
                shared.fail(&mut st, None, msg.clone());
                shared.reject_joining(&mut st, &msg);
            }
        }
        shared.cv.notify_all();
    }
    while st.assigned.is_none() && st.failed.is_none() {
        st = shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
    }
    if let Some(f) = &st.failed {
        return Err(Refusal::JobFailed(f.clone()));
    }
    let me = st.slot_members.get(slot).cloned().flatten().ok_or(Refusal::Internal("no member for this slot"))?;
    Ok((me, false))
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
            host: g.reg.hostname.clone(),
            rack: 0,
        })
        .collect();
    servers.sort_by_key(|s| s.rank);
    let mut hosts = vec![String::new(); cfg.num_workers as usize];
    let mut claims = vec![(-1, -1); cfg.num_workers as usize];
    let mut worker_racks = vec![String::new(); cfg.num_workers as usize];
    let mut server_racks = vec![String::new(); servers.len()];
    for ((r, rank), g) in assigned.iter().zip(regs.iter()) {
        match *r {
            Role::Worker => {
                hosts[*rank as usize] = g.reg.hostname.clone();
                claims[*rank as usize] = (g.reg.local_rank, g.reg.local_size);
                worker_racks[*rank as usize] = g.reg.rack.clone();
            }
            _ => {
                if let Some(x) = server_racks.get_mut(*rank as usize) {
                    *x = g.reg.rack.clone();
                }
            }
        }
    }
    let layout = local_ranks(&hosts, &claims).and_then(|l| {
        let layout = HostLayout::new(&hosts, &l, cfg.host_reduce)?;
        let pushers: Vec<usize> = (0..cfg.num_workers).map(|r| layout.host_index(r)).collect();
        let bw = super::racks::Bandwidths { link_gbit: cfg.link_gbit, core_gbit: cfg.core_gbit };
        let plan = super::racks::plan(&worker_racks, &server_racks, &pushers, cfg.rack_reduce, bw)?;
        let racks = if plan.reduce { plan.racks.len() as u32 } else { 0 };
        let pushing = layout.num_hosts();
        layout.with_racks(&plan.worker_racks, racks)?;
        Ok((l, pushing, plan))
    });
    let (local_ranks, pushing, plan) = match layout {
        Ok(l) => l,
        Err(msg) => {
            // Put the registrations back: the failure reaches them there.
            st.joining = regs.into_iter().map(Some).collect();
            shared.fail(st, None, msg.clone());
            shared.reject_joining(st, &msg);
            return;
        }
    };
    for s in servers.iter_mut() {
        s.rack = plan.server_racks.get(s.rank as usize).copied().unwrap_or(0);
    }
    // What pushes is one worker per host (host stage) or every worker: the
    // BytePS split counts those machines, not the workers on them.
    // Replicas of every chunk on a second server, so a lost server's
    // chunks, server-side optimizer state included, can move (`failover`);
    // not with two levels, whose relays a failover would not move.
    let failover = cfg.failover && cfg.num_servers > 1 && !plan.reduce;
    let mut placer = Placer::new(&servers, pushing).with_replicas(failover);
    if plan.reduce {
        let mut with_workers = vec![false; plan.racks.len()];
        for &r in &plan.worker_racks {
            with_workers[r as usize] = true;
        }
        placer = placer.with_racks(&plan.server_racks, with_workers);
    }
    log::info!(
        target: "scheduler",
        "{} workers on {pushing} pushing machines{}; summation shares per server: {}",
        cfg.num_workers,
        if cfg.host_reduce { "" } else { " (host reduction off)" },
        placer.describe_shares(&servers)
    );
    if plan.racks.len() > 1 {
        log::info!(target: "scheduler", "racks {:?}: {}", plan.racks, plan.why);
        if plan.reduce && cfg.failover && cfg.num_servers > 1 {
            log::warn!(target: "scheduler", "failover is off: a lost server fails a job that reduces within racks");
        }
    }
    st.placer = Some(placer);
    let template = Welcome {
        rank: 0,
        num_workers: cfg.num_workers,
        partition_bytes: cfg.partition_bytes,
        heartbeat_ms: cfg.heartbeat_ms,
        stall_ms: cfg.stall_ms,
        peer_timeout_ms: cfg.peer_timeout_ms,
        servers: servers.clone(),
        worker_hosts: hosts,
        worker_local_ranks: local_ranks,
        job_id: random_job_id(),
        host_reduce: cfg.host_reduce,
        failover,
        late: false,
        racks: plan.racks,
        worker_racks: plan.worker_racks,
        rack_reduce: plan.reduce,
    };
    for ((role, rank), g) in assigned.iter().zip(regs) {
        let member = Arc::new(Member { role: *role, rank: *rank, peer: g.peer, writer: Mutex::new(g.stream) });
        let welcome = Control::Welcome(Welcome { rank: *rank, ..template.clone() });
        if !member.send(&welcome, cfg.namespace) {
            log::warn!(target: "scheduler", "cannot send the welcome to {}", member.describe());
        }
        st.members.push(member.clone());
        st.slot_members.push(Some(member));
    }
    st.assigned = Some(assigned);
    st.servers = servers;
    st.welcome = Some(template);
    log::info!(target: "scheduler", "all {} members joined", cfg.num_workers + cfg.num_servers);
}

/// A job identifier no other job on the same hosts will have: std's
/// `RandomState` is seeded from the OS's random source, mixed with the
/// time and process id. (Unique, not secret: nothing is protected by it.)
fn random_job_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

/// Each worker's local rank on its host (workers with the same host
/// identity), by rank. Workers whose launcher gave a local rank and size
/// must agree with what registered: the size is the number of workers with
/// that host identity, and the host's local ranks are 0..size, each once.
/// A host whose workers gave none gets them in rank order. A wrong setting
/// is an error here, not a silent slowdown (or wrong sharing) later.
pub(super) fn local_ranks(hosts: &[String], claims: &[(i32, i32)]) -> Result<Vec<u32>, String> {
    let mut out = vec![0u32; hosts.len()];
    let mut by_host: Vec<(&String, Vec<usize>)> = Vec::new();
    for (rank, h) in hosts.iter().enumerate() {
        match by_host.iter_mut().find(|(k, _)| *k == h) {
            Some((_, v)) => v.push(rank),
            None => by_host.push((h, vec![rank])),
        }
    }
    for (host, ranks) in by_host {
        let size = ranks.len();
        let given: Vec<usize> = ranks.iter().copied().filter(|&r| claims[r].0 >= 0 || claims[r].1 >= 0).collect();
        if given.is_empty() {
            for (l, &r) in ranks.iter().enumerate() {
                out[r] = l as u32;
            }
            continue;
        }
        if given.len() != size {
            let missing: Vec<usize> = ranks.iter().copied().filter(|r| !given.contains(r)).collect();
            return Err(format!(
                "host {host}: workers {given:?} were given a local rank and size but workers {missing:?} were not \
                 (set GRADHUB_LOCAL_RANK/GRADHUB_LOCAL_SIZE, or torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE, for all or none)"
            ));
        }
        let mut seen = vec![None; size];
        for &r in &ranks {
            let (l, n) = claims[r];
            if n != size as i32 {
                return Err(format!(
                    "worker {r} was told its host has {n} workers, but {size} registered from host {host} (workers {ranks:?})"
                ));
            }
            if l < 0 || l >= n {
                return Err(format!("worker {r} was given local rank {l}, outside 0..{n}"));
            }
            if let Some(other) = seen[l as usize].replace(r) {
                return Err(format!("workers {other} and {r} on host {host} were both given local rank {l}"));
            }
            out[r] = l as u32;
        }
    }
    Ok(out)
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

/// A worker entered barrier `id`; the last one releases everyone.
pub(super) fn enter_barrier(shared: &Shared, st: &mut State, rank: u32, id: u32) {
    let set = st.barriers.entry(id).or_default();
    set.insert(rank);
    if let Some(gone) = st.said_goodbye.iter().find(|r| !set.contains(r)) {
        let why = format!(
            "worker {gone} left the job (shut down or exited) before barrier {id}, which worker {rank} entered: \
             every worker must run the same collective operations"
        );
        shared.fail(st, None, why);
        return;
    }
    if set.len() == shared.cfg.num_workers as usize {
        st.barriers.remove(&id);
        for m in st.members.iter().filter(|m| m.role == Role::Worker) {
            m.send(&Control::BarrierDone { id }, shared.cfg.namespace);
        }
    }
}

/// A worker finished; when every worker has, the servers are told to exit.
/// Before that, everyone still in the job is told it left (`PeerLeft`):
/// whatever it did not take part in can never complete, and must fail
/// rather than wait (e.g. a worker that runs more steps than the others).
/// Horovod's join: worker `rank` has no more data. Until every worker has
/// joined, the others announce their operations (`JoinOp`) and the joined
/// ones push zeros for them; then everyone is told who joined last.
pub(super) fn join_worker(shared: &Shared, st: &mut State, rank: u32) {
    let ns = shared.cfg.namespace;
    if !st.joined.insert(rank) {
        let reason = format!("worker {rank} called join() twice");
        shared.fail(st, None, reason);
        return;
    }
    st.join_last = rank;
    let workers: Vec<Arc<super::state::Member>> =
        st.members.iter().filter(|m| m.role == Role::Worker).cloned().collect();
    if st.joined.len() == shared.cfg.num_workers as usize {
        st.joined.clear();
        st.join_ops.clear();
        for m in workers {
            m.send(&Control::JoinDone { last: rank }, ns);
        }
        return;
    }
    // The others announce what they have in flight (each such operation
    // needs this worker now) and everything they start from then on.
    for m in workers {
        m.send(&Control::Joined { rank }, ns);
    }
}

/// An operation a worker started while others have joined: the joined
/// workers push zeros for it (each (name, round) once, whoever announces it).
pub(super) fn forward_join_op(shared: &Shared, st: &mut State, op: Control) {
    let Control::JoinOp { name, round, .. } = &op else { return };
    if st.joined.is_empty() {
        return;
    }
    // Each round to each joined worker once, whoever announces it; rounds
    // of one name only move forward.
    let entry = st.join_ops.entry(name.clone()).or_insert((*round, HashSet::new()));
    if round.wrapping_sub(entry.0) as i32 > 0 {
        *entry = (*round, HashSet::new());
    } else if *round != entry.0 {
        return;
    }
    let ns = shared.cfg.namespace;
    let targets: Vec<u32> = st.joined.iter().copied().filter(|r| !entry.1.contains(r)).collect();
    entry.1.extend(targets.iter().copied());
    for m in st.members.iter().filter(|m| m.role == Role::Worker && targets.contains(&m.rank)) {
        m.send(&op, ns);
    }
}

/// An operation of a process set, announced by the set's first member:
/// the workers `to`, outside the set, push zeros for it (sent as a
/// `JoinOp`). Returns why the announcement is invalid, if it is.
pub(super) fn forward_set_op(shared: &Shared, st: &State, from: u32, op: Control) -> Result<(), String> {
    let Control::SetOp { to, name, numel, dtype, flags, round } = op else { return Ok(()) };
    let n = shared.cfg.num_workers;
    let mut seen = HashSet::new();
    if let Some(bad) = to.iter().find(|&&r| r >= n || r == from || !seen.insert(r)) {
        return Err(format!(
            "worker {from} announced '{name}' of a process set to worker {bad}, which is out of range, \
             itself or listed twice (the job has {n} workers)"
        ));
    }
    let msg = Control::JoinOp { name, numel, dtype, flags, round };
    // One that left is not waited for: the announcer's op fails on its PeerLeft.
    for m in st.members.iter().filter(|m| m.role == Role::Worker && seen.contains(&m.rank)) {
        m.send(&msg, shared.cfg.namespace);
    }
    Ok(())
}

pub(super) fn say_goodbye(shared: &Shared, st: &mut State, rank: u32) {
    st.said_goodbye.insert(rank);
    let done = st.finished || st.failed.is_some();
    if done {
        return;
    }
    if st.said_goodbye.len() == shared.cfg.num_workers as usize {
        st.finished = true;
        for m in st.members.iter().filter(|m| m.role == Role::Server) {
            m.send(&Control::Shutdown, shared.cfg.namespace);
        }
        shared.cv.notify_all();
        return;
    }
    if let Some(why) = super::declarations::waiting_on_departed(st) {
        shared.fail(st, None, why);
        return;
    }
    if let Some((id, _)) = st.barriers.iter().find(|(_, entered)| !entered.contains(&rank)) {
        let why = format!(
            "worker {rank} left the job (shut down or exited) while others wait in barrier {id}: \
             every worker must run the same collective operations"
        );
        shared.fail(st, None, why);
        return;
    }
    for m in st.members.iter().filter(|m| !(m.role == Role::Worker && st.said_goodbye.contains(&m.rank))) {
        m.send(&Control::PeerLeft { rank }, shared.cfg.namespace);
    }
}

/// Why a member's control connection failed, in words for everyone else.
pub(super) fn lost_reason(cfg: &SchedulerConfig, me: &Member, e: &ReadError) -> String {
    match e {
        ReadError::TimedOut => {
            format!("{} sent nothing for {} ms (no heartbeat)", me.describe(), cfg.peer_timeout_ms)
        }
        ReadError::Closed | ReadError::ClosedMidFrame => format!("{} disconnected", me.describe()),
        _ => format!("{} connection failed: {e}", me.describe()),
    }
}

#[cfg(test)]
mod tests {
    use super::local_ranks;

    fn hosts(h: &[&str]) -> Vec<String> {
        h.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn local_ranks_follow_rank_order_when_not_given() {
        let h = hosts(&["a", "b", "a", "a", "b"]);
        assert_eq!(local_ranks(&h, &[(-1, -1); 5]).unwrap(), vec![0, 0, 1, 2, 1]);
    }

    #[test]
    fn given_local_ranks_are_kept_when_they_agree_with_the_hosts() {
        // torchrun on 2 nodes x 2, ranks registered in any order: kept as given.
        let h = hosts(&["n0", "n0", "n1", "n1"]);
        let c = [(1, 2), (0, 2), (0, 2), (1, 2)];
        assert_eq!(local_ranks(&h, &c).unwrap(), vec![1, 0, 0, 1]);
        // One host given, another not: each host on its own terms.
        let c = [(0, 2), (1, 2), (-1, -1), (-1, -1)];
        assert_eq!(local_ranks(&h, &c).unwrap(), vec![0, 1, 0, 1]);
    }

    #[test]
    fn wrong_local_settings_are_errors_naming_the_worker_and_host() {
        let h = hosts(&["n0", "n0", "n0"]);
        // Told 2 per host, 3 registered from it (e.g. hosts that all look alike).
        let e = local_ranks(&h, &[(0, 2), (1, 2), (0, 2)]).unwrap_err();
        assert!(
            e.contains("worker 0") && e.contains("2 workers") && e.contains("3 registered") && e.contains("n0"),
            "{e}"
        );
        // Two workers with the same local rank.
        let e = local_ranks(&h, &[(0, 3), (1, 3), (1, 3)]).unwrap_err();
        assert!(e.contains("workers 1 and 2") && e.contains("local rank 1"), "{e}");
        // Out of range.
        let e = local_ranks(&h, &[(0, 3), (1, 3), (3, 3)]).unwrap_err();
        assert!(e.contains("worker 2") && e.contains("local rank 3"), "{e}");
        // Given for some workers of a host only.
        let e = local_ranks(&h, &[(0, 3), (-1, -1), (2, 3)]).unwrap_err();
        assert!(e.contains("[0, 2]") && e.contains("[1]"), "{e}");
    }
}
