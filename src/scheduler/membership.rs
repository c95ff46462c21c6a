//! Membership: registration checks, rank assignment, the Welcome with the
//! cluster map, barriers, goodbyes, and who is in the job (`Members`, edited
//! only here). Liveness failures are worded here (`lost_reason`); failing
//! the job is `state`'s.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use super::config::SchedulerConfig;
use super::member::{Member, Writer};
use crate::placement::{HostLayout, Placer};
use crate::protocol::{Control, ReadError, Register, Rejoin, Role, ServerInfo, Welcome};
use crate::waits::left_message;

pub(super) struct Registration {
    pub reg: Register,
    pub peer: SocketAddr,
    pub stream: Writer,
}

/// Who is in the job: the registrations until everyone has registered,
/// then the members (lost servers out, servers that joined later in), the
/// cluster map they were welcomed with, barriers and goodbyes.
#[derive(Default)]
pub(super) struct Members {
    joining: Vec<Registration>,
    /// Every member in the job (workers that said goodbye included).
    live: Vec<Arc<Member>>,
    /// The member created for each registration slot, in join order.
    by_slot: Vec<Arc<Member>>,
    barriers: HashMap<u32, HashSet<u32>>,
    /// Barriers below this one completed (every worker numbers its barriers
    /// alike): one entered again (re-sent after its answer was lost with a
    /// link or a scheduler) is answered at once.
    passed: u32,
    said_goodbye: HashSet<u32>,
    /// Every server the job has had, lost ones included, by rank (slots
    /// are numbered over all of them), and the Welcome every member got
    /// (for a server that joins while the job runs).
    servers: Vec<ServerInfo>,
    welcome: Option<Welcome>,
    /// A scheduler that restarted, rebuilding the job from the members
    /// that rejoin (`rejoin`): who has not yet, since when.
    rebuild: Option<Rebuild>,
}

pub(super) struct Rebuild {
    pub since: std::time::Instant,
    pub missing: std::collections::BTreeSet<(u8, u32)>,
}

impl Rebuild {
    /// The members not back yet, in words.
    pub fn describe_missing(&self) -> String {
        let name = |&(role, rank): &(u8, u32)| format!("{} {rank}", if role == 0 { "worker" } else { "server" });
        self.missing.iter().map(name).collect::<Vec<_>>().join(", ")
    }
}

fn role_key(role: Role) -> u8 {
    match role {
        Role::Worker => 0,
        Role::Server => 1,
    }
}

impl Members {
    /// Add a registration; returns its slot (join order).
    pub fn register(&mut self, reg: Register, peer: SocketAddr, stream: Writer) -> usize {
        self.joining.push(Registration { reg, peer, stream });
        self.joining.len() - 1
    }

    /// Whether everyone registered and was welcomed (ranks assigned).
    pub fn welcomed(&self) -> bool {
        self.welcome.is_some()
    }

    /// Registrations waiting for the others.
    pub fn registered(&self) -> usize {
        self.joining.len()
    }

    /// The member welcomed for registration slot `slot`.
    pub fn for_slot(&self, slot: usize) -> Option<Arc<Member>> {
        self.by_slot.get(slot).cloned()
    }

    /// Tell the members not welcomed yet (reachable only through their
    /// registration streams) why the job failed.
    pub fn reject_joining(&mut self, message: &str, ns: u32) {
        for r in &mut self.joining {
            r.stream.send(&Control::Error { message: message.into() }, ns);
        }
    }

    /// Cut every connection off (the job is over).
    pub fn disconnect_all(&mut self) {
        for m in &self.live {
            m.disconnect();
        }
        for r in &self.joining {
            r.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Every member in the job.
    pub fn all(&self) -> &[Arc<Member>] {
        &self.live
    }

    pub fn servers(&self) -> impl Iterator<Item = &Arc<Member>> {
        self.live.iter().filter(|m| m.role == Role::Server)
    }

    pub fn workers(&self) -> impl Iterator<Item = &Arc<Member>> {
        self.live.iter().filter(|m| m.role == Role::Worker)
    }

    pub fn worker(&self, rank: u32) -> Option<&Arc<Member>> {
        self.workers().find(|m| m.rank == rank)
    }

    /// Every member but the workers that said goodbye.
    pub fn staying(&self) -> impl Iterator<Item = &Arc<Member>> {
        self.live.iter().filter(|m| !(m.role == Role::Worker && self.said_goodbye.contains(&m.rank)))
    }

    /// The workers that did not say goodbye.
    pub fn staying_workers(&self) -> impl Iterator<Item = &Arc<Member>> {
        self.staying().filter(|m| m.role == Role::Worker)
    }

    /// Whether worker `rank` said goodbye; and all that did.
    pub fn has_left(&self, rank: u32) -> bool {
        self.said_goodbye.contains(&rank)
    }
    pub fn left(&self) -> &HashSet<u32> {
        &self.said_goodbye
    }

    /// Every server the job has had, by rank; the Welcome template.
    pub fn server_infos(&self) -> &[ServerInfo] {
        &self.servers
    }
    pub fn welcome(&self) -> Option<&Welcome> {
        self.welcome.as_ref()
    }

    /// Server `rank` is out of the job (lost).
    pub fn remove_server(&mut self, rank: u32) {
        self.live.retain(|m| !(m.role == Role::Server && m.rank == rank));
    }

    /// A server welcomed into the running job: every member staying is told
    /// where it is before anything can name its slots.
    pub fn add_server(&mut self, info: ServerInfo, member: Arc<Member>, ns: u32) {
        let joined = Control::ServerJoined { server: info.clone() };
        for m in self.staying() {
            m.send(&joined, ns);
        }
        self.servers.push(info);
        self.live.push(member);
    }

    /// A worker entered barrier `id`; the last one releases everyone.
    /// Returns why the job fails instead, if it must.
    pub fn enter_barrier(&mut self, rank: u32, id: u32, num_workers: u32, ns: u32) -> Result<(), String> {
        if id < self.passed {
            if let Some(m) = self.worker(rank) {
                m.send(&Control::BarrierDone { id }, ns);
            }
            return Ok(());
        }
        let set = self.barriers.entry(id).or_default();
        set.insert(rank);
        if let Some(gone) = self.said_goodbye.iter().find(|r| !set.contains(r)) {
            return Err(left_message(
                &format!("worker {gone}"),
                &format!("before barrier {id}, which worker {rank} entered"),
            ));
        }
        if set.len() == num_workers as usize {
            self.barriers.remove(&id);
            self.passed = self.passed.max(id.saturating_add(1));
            for m in self.workers() {
                m.send(&Control::BarrierDone { id }, ns);
            }
        }
        Ok(())
    }

    /// Worker `rank` said goodbye; returns whether every worker now has.
    pub fn say_goodbye(&mut self, rank: u32, num_workers: u32) -> bool {
        self.said_goodbye.insert(rank);
        self.said_goodbye.len() == num_workers as usize
    }

    /// Why worker `rank` leaving fails the job: others wait for it in a barrier.
    pub fn barrier_without(&self, rank: u32) -> Option<String> {
        let (id, _) = self.barriers.iter().find(|(_, entered)| !entered.contains(&rank))?;
        Some(left_message(&format!("worker {rank}"), &format!("while others wait in barrier {id}")))
    }

    /// A scheduler that restarted and waits for members to rejoin.
    pub fn rebuilding(&self) -> Option<&Rebuild> {
        self.rebuild.as_ref()
    }

    /// The live member a rejoin comes from, if this scheduler did not
    /// restart (same job, not rebuilding, the member still in it): its
    /// connection broke and its session resumes (`Member::offer`).
    pub fn resumable(&self, rj: &Rejoin) -> Option<Arc<Member>> {
        let w = self.welcome.as_ref()?;
        if w.job_id != rj.welcome.job_id || self.rebuild.is_some() {
            return None;
        }
        let (role, rank) = (rj.register.role, rj.welcome.rank);
        if role == Role::Worker && self.has_left(rank) {
            return None;
        }
        self.live.iter().find(|m| m.role == role && m.rank == rank).cloned()
    }

    /// Member `rj` rejoins a scheduler that restarted: the first one brings
    /// the job's cluster map (the rest must have the same job), and the
    /// rebuild waits for every worker that has not left and every server
    /// of the map. Returns the member, welcomed again, and whether it was
    /// the last one awaited.
    pub fn rejoin(
        &mut self,
        rj: &Rejoin,
        peer: SocketAddr,
        stream: Writer,
        ns: u32,
    ) -> Result<(Arc<Member>, bool), Refusal> {
        let (role, rank) = (rj.register.role, rj.welcome.rank);
        let key = (role_key(role), rank);
        match &self.welcome {
            None if !self.joining.is_empty() => {
                return Err(Refusal::Late(format!(
                    "{} {rank} rejoins, but this scheduler is forming a new job (members registered afresh)",
                    role.name()
                )))
            }
            None => {
                let w = &rj.welcome;
                let missing: std::collections::BTreeSet<(u8, u32)> =
                    (0..w.num_workers).map(|r| (0, r)).chain(w.servers.iter().map(|s| (1, s.rank))).collect();
                self.servers = w.servers.clone();
                self.welcome = Some(Welcome { rank: 0, late: false, ..w.clone() });
                self.rebuild = Some(Rebuild { since: std::time::Instant::now(), missing });
                log::warn!(
                    target: "scheduler",
                    "{} {rank} rejoins job {:016x}: rebuilding it from its members",
                    role.name(),
                    w.job_id
                );
            }
            Some(t) if t.job_id != rj.welcome.job_id => {
                return Err(Refusal::Late(format!(
                    "{} {rank} was in job {:016x}, but this scheduler serves job {:016x}",
                    role.name(),
                    rj.welcome.job_id,
                    t.job_id
                )))
            }
            Some(_) if self.rebuild.is_none() && role == Role::Server && !self.servers().any(|m| m.rank == rank) => {
                return Err(Refusal::Late(format!(
                    "server {rank} was written off (lost: its chunks moved to the other servers); it is out of the job"
                )))
            }
            Some(_) if self.rebuild.is_none() => {
                return Err(Refusal::Late(format!(
                    "{} {rank} rejoins, but this scheduler has all its members (it did not restart)",
                    role.name()
                )))
            }
            Some(_) => {}
        }
        let rb = self.rebuild.as_mut().ok_or(Refusal::Internal("no rebuild"))?;
        if !rb.missing.remove(&key) {
            return Err(Refusal::Late(format!("{} {rank} rejoined already, or is not in this job", role.name())));
        }
        for &r in &rj.left {
            self.said_goodbye.insert(r);
            rb.missing.remove(&(0, r));
        }
        for &s in &rj.lost {
            rb.missing.remove(&(1, s));
        }
        self.passed = self.passed.max(rj.barriers);
        let member = Arc::new(Member::new(role, rank, peer, stream));
        if !member.send(&Control::Welcome(rj.welcome.clone()), ns) {
            log::warn!(target: "scheduler", "cannot send the welcome to {}", member.describe());
        }
        self.live.push(member.clone());
        let done = rb.missing.is_empty();
        if done {
            log::info!(
                target: "scheduler",
                "job rebuilt: all its {} members rejoined within {:.1}s",
                self.live.len(),
                rb.since.elapsed().as_secs_f64()
            );
            self.rebuild = None;
        }
        Ok((member, done))
    }

    /// Everyone registered: assign ranks, create every member and send each
    /// its Welcome with the cluster map (state lock held, so each member is
    /// known before anyone can send it anything else); returns the job's
    /// placer. On an error the registrations stay, for the failure to reach them.
    pub fn welcome_everyone(&mut self, cfg: &SchedulerConfig) -> Result<Placer, String> {
        let claims: Vec<(Role, i32, SocketAddr)> =
            self.joining.iter().map(|g| (g.reg.role, g.reg.requested_rank, g.peer)).collect();
        let assigned = assign_ranks(cfg, &claims)?;
        let regs: Vec<Registration> = std::mem::take(&mut self.joining);
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
                self.joining = regs;
                return Err(msg);
            }
        };
        for s in servers.iter_mut() {
            s.rack = plan.server_racks.get(s.rank as usize).copied().unwrap_or(0);
        }
        // Replicas of every chunk on a second server, so a lost server's
        // chunks, server-side optimizer state included, can move (`failover`);
        // not with two levels, whose relays a failover would not move.
        let failover = cfg.failover && cfg.num_servers > 1 && !plan.reduce;
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
            racks: plan.racks.clone(),
            worker_racks: plan.worker_racks.clone(),
            rack_reduce: plan.reduce,
        };
        let placer = match placer_of(&template) {
            Ok(p) => p,
            Err(msg) => {
                self.joining = regs;
                return Err(msg);
            }
        };
        log::info!(
            target: "scheduler",
            "{} workers on {pushing} pushing machines{}; summation shares per server: {}",
            cfg.num_workers,
            if cfg.host_reduce { "" } else { " (host reduction off)" },
            placer.describe_shares(&servers)
        );
        if cfg.training.is_asynchronous() && cfg.host_reduce && (pushing as u32) < cfg.num_workers {
            log::info!(
                target: "scheduler",
                "asynchronous with the host stage on (GRADHUB_HOST_REDUCE=1): the workers of each host wait for \
                 each other every step; unset it to let every worker run at its own pace"
            );
        }
        if plan.racks.len() > 1 {
            log::info!(target: "scheduler", "racks {:?}: {}", plan.racks, plan.why);
            if plan.reduce && cfg.failover && cfg.num_servers > 1 {
                log::warn!(target: "scheduler", "failover is off: a lost server fails a job that reduces within racks");
            }
        }
        for ((role, rank), g) in assigned.iter().zip(regs) {
            let member = Arc::new(Member::new(*role, *rank, g.peer, g.stream));
            let welcome = Control::Welcome(Welcome { rank: *rank, ..template.clone() });
            if !member.send(&welcome, cfg.namespace) {
                log::warn!(target: "scheduler", "cannot send the welcome to {}", member.describe());
            }
            self.live.push(member.clone());
            self.by_slot.push(member);
        }
        self.servers = servers;
        self.welcome = Some(template);
        log::info!(target: "scheduler", "all {} members joined", cfg.num_workers + cfg.num_servers);
        Ok(placer)
    }
}

/// The job's placer for its cluster map `w`: what pushes is one worker per
/// host (host stage) or every worker, and the BytePS split counts those
/// machines, not the workers on them; replicas if the job fails over; the
/// racks if it reduces within them.
pub(super) fn placer_of(w: &Welcome) -> Result<Placer, String> {
    let layout = HostLayout::new(&w.worker_hosts, &w.worker_local_ranks, w.host_reduce)?;
    let mut placer =
        Placer::new(&w.servers, layout.num_hosts()).with_replicas(w.failover).with_homes(&w.worker_hosts, &w.servers);
    if w.rack_reduce {
        let mut with_workers = vec![false; w.racks.len()];
        for &r in &w.worker_racks {
            if let Some(x) = with_workers.get_mut(r as usize) {
                *x = true;
            }
        }
        let mut server_racks = vec![0; w.servers.iter().map(|s| s.rank as usize + 1).max().unwrap_or(0)];
        for s in &w.servers {
            server_racks[s.rank as usize] = s.rack;
        }
        placer = placer.with_racks(&server_racks, with_workers);
    }
    Ok(placer)
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
    #[error("{role} was started with GRADHUB_DETERMINISTIC={got} but the scheduler with {want}: set it the same on every worker, server and the scheduler")]
    SumOrder { role: &'static str, got: u8, want: u8 },
    #[error("{role} was started {got} but the scheduler {want}: set GRADHUB_ASYNC and GRADHUB_STALENESS the same on every worker, server and the scheduler")]
    Training { role: &'static str, got: crate::training::Training, want: crate::training::Training },
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
    if reg.sum_order != cfg.sum_order {
        let flag = |o: crate::sum_order::SumOrder| o.is_deterministic() as u8;
        return Err(Refusal::SumOrder { role, got: flag(reg.sum_order), want: flag(cfg.sum_order) });
    }
    if reg.training != cfg.training {
        return Err(Refusal::Training { role, got: reg.training, want: cfg.training });
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

/// Requested ranks are honoured (and must be unique); the rest are filled
/// in join order. `regs` is each registration's role, requested rank (-1:
/// none) and address, in join order.
fn assign_ranks(cfg: &SchedulerConfig, regs: &[(Role, i32, SocketAddr)]) -> Result<Vec<(Role, u32)>, String> {
    let mut out = Vec::with_capacity(regs.len());
    let mut taken: HashMap<(u8, u32), SocketAddr> = HashMap::new();
    let role_id = |r: Role| if r == Role::Worker { 0u8 } else { 1u8 };
    let (mut nw, mut ns) = (0u32, 0u32);
    for &(role, requested, peer) in regs {
        match role {
            Role::Worker => nw += 1,
            Role::Server => ns += 1,
        }
        if requested >= 0 {
            let key = (role_id(role), requested as u32);
            if let Some(prev) = taken.insert(key, peer) {
                return Err(format!("two {}s ({prev} and {peer}) both asked for rank {requested}", role.name()));
            }
        }
    }
    if nw != cfg.num_workers || ns != cfg.num_servers {
        return Err(format!(
            "expected {} workers and {} servers, got {nw} workers and {ns} servers",
            cfg.num_workers, cfg.num_servers
        ));
    }
    for &(role, requested, peer) in regs {
        let rid = role_id(role);
        let rank = if requested >= 0 {
            requested as u32
        } else {
            let mut r = 0;
            while taken.contains_key(&(rid, r)) {
                r += 1;
            }
            taken.insert((rid, r), peer);
            r
        };
        out.push((role, rank));
    }
    Ok(out)
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
    use super::*;

    fn cfg(num_workers: u32, num_servers: u32) -> SchedulerConfig {
        SchedulerConfig { num_workers, num_servers, ..SchedulerConfig::default() }
    }

    fn peer(i: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], 5000 + i))
    }

    #[test]
    fn requested_ranks_are_kept_and_the_rest_filled_in_join_order() {
        let regs = [
            (Role::Server, -1, peer(0)),
            (Role::Worker, 1, peer(1)),
            (Role::Worker, -1, peer(2)),
            (Role::Server, 0, peer(3)),
            (Role::Worker, -1, peer(4)),
        ];
        let a = assign_ranks(&cfg(3, 2), &regs).unwrap();
        assert_eq!(a, [(Role::Server, 1), (Role::Worker, 1), (Role::Worker, 0), (Role::Server, 0), (Role::Worker, 2)]);
        // Workers and servers have ranks of their own: both may ask for 0.
        let regs = [(Role::Worker, 0, peer(0)), (Role::Server, 0, peer(1))];
        assert_eq!(assign_ranks(&cfg(1, 1), &regs).unwrap(), [(Role::Worker, 0), (Role::Server, 0)]);
    }

    #[test]
    fn a_rank_asked_for_twice_or_a_wrong_mix_is_refused() {
        let regs = [(Role::Worker, 0, peer(0)), (Role::Worker, 0, peer(1)), (Role::Server, -1, peer(2))];
        let e = assign_ranks(&cfg(2, 1), &regs).unwrap_err();
        assert!(e.contains("two workers") && e.contains("10.0.0.1:5000") && e.contains("rank 0"), "{e}");
        let regs = [(Role::Worker, -1, peer(0)), (Role::Worker, -1, peer(1))];
        let e = assign_ranks(&cfg(1, 1), &regs).unwrap_err();
        assert!(e.contains("expected 1 workers and 1 servers, got 2 workers and 0 servers"), "{e}");
    }

    #[test]
    fn registrations_are_checked_against_the_job() {
        let reg = |role, requested_rank, num_workers| Register {
            role,
            requested_rank,
            num_workers,
            hostname: "h".into(),
            addr: "10.0.0.1".into(),
            ports: vec![9000],
            colocated: false,
            num_servers: 0,
            local_rank: -1,
            local_size: -1,
            rack: String::new(),
            sum_order: crate::sum_order::SumOrder::Arrival,
            training: crate::training::Training::Synchronous,
            elastic: None,
        };
        assert!(check_registration(&cfg(2, 1), &reg(Role::Worker, 1, 2)).is_ok());
        assert!(check_registration(&cfg(2, 1), &reg(Role::Worker, -1, 0)).is_ok());
        let e = check_registration(&cfg(2, 1), &reg(Role::Worker, -1, 3)).unwrap_err().to_string();
        assert!(e.contains("started for 3 workers but the scheduler expects 2"), "{e}");
        let e = check_registration(&cfg(2, 1), &reg(Role::Server, 1, 0)).unwrap_err().to_string();
        assert!(e.contains("server rank 1 but the job has 1"), "{e}");
        let no_ports = Register { ports: Vec::new(), ..reg(Role::Server, -1, 0) };
        assert!(matches!(check_registration(&cfg(2, 1), &no_ports), Err(Refusal::NoAddress)));
    }

    #[test]
    fn a_barrier_or_goodbye_that_can_never_complete_is_named() {
        let mut m = Members::default();
        assert_eq!(m.enter_barrier(0, 7, 3, 0), Ok(()));
        assert!(m.barrier_without(1).unwrap().contains("worker 1 left the job"));
        assert!(m.barrier_without(0).is_none(), "worker 0 is in the barrier");
        assert!(!m.say_goodbye(2, 3));
        let e = m.enter_barrier(1, 7, 3, 0).unwrap_err();
        assert!(e.contains("worker 2 left the job") && e.contains("barrier 7, which worker 1 entered"), "{e}");
        assert!(m.has_left(2) && !m.has_left(1));
        assert!(!m.say_goodbye(0, 3));
        assert!(m.say_goodbye(1, 3), "every worker said goodbye");
        // The last one into a barrier releases it.
        let mut m = Members::default();
        assert_eq!(m.enter_barrier(1, 3, 2, 0), Ok(()));
        assert_eq!(m.enter_barrier(0, 3, 2, 0), Ok(()));
        assert!(m.barrier_without(5).is_none(), "barrier 3 is over");
    }

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
