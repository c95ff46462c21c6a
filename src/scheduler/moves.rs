//! Moves (`Moves`, edited only here): the servers lost, and the moves of
//! chunks under way (takeovers of lost servers, one server taken in while
//! the job runs), during which no declaration is answered; and the plans of
//! which chunks move where, computed from the placement alone (unit-tested
//! without sockets). `failover` runs them: it sends, waits for the acks
//! and tells the workers.

use std::collections::HashMap;
use std::sync::Arc;

use super::config::SchedulerConfig;
use super::declarations::Declarations;
use super::installs::Installs;
use super::member::Member;
use super::membership::{Members, Refusal, Registration};
use crate::protocol::{Role, ServerInfo, TensorSpec, Welcome, MAX_JOINED_SLOTS};

#[derive(Default)]
pub(super) struct Moves {
    /// Servers lost and taken over, by rank.
    lost: Vec<u32>,
    /// Takeovers under way (two servers lost at once: two).
    takeovers: u32,
    /// The server being taken into the running job: one at a time.
    taking_in: Option<u32>,
}

impl Moves {
    /// Whether chunks are moving: declarations are not answered meanwhile
    /// (their placement may still change).
    pub fn busy(&self) -> bool {
        self.takeovers > 0 || self.taking_in.is_some()
    }

    /// The servers still in the job among `servers` (every server it had).
    pub fn live_servers(&self, servers: &[ServerInfo]) -> Vec<ServerInfo> {
        servers.iter().filter(|s| !self.lost.contains(&s.rank)).cloned().collect()
    }

    /// Server `lost` is out: its slots leave the placement and its chunks,
    /// in tensors still in use, are placed again on the servers left.
    /// Returns the specs that changed (by key), until `end_take_over`.
    pub fn begin_take_over(&mut self, lost: u32, decls: &mut Declarations) -> Vec<TensorSpec> {
        self.lost.push(lost);
        self.takeovers += 1;
        place_again_without(decls, lost)
    }

    /// A member of a job rebuilt by a scheduler that restarted says server
    /// `lost` was lost before (`rejoin`): its slots take no more chunks.
    pub fn lost_before(&mut self, lost: u32, decls: &mut Declarations) {
        if !self.lost.contains(&lost) {
            self.lost.push(lost);
            if let Some(p) = decls.placer_mut() {
                p.remove_server(lost);
            }
        }
    }

    pub fn end_take_over(&mut self) {
        self.takeovers = self.takeovers.saturating_sub(1);
    }

    /// A server registered while the job runs (state lock held): welcome it
    /// (`late`: no worker shares memory with it), add its threads to the
    /// placement and tell every member where it is, before any declaration
    /// can be placed on it. The move to it is then under way until
    /// `end_take_in`.
    pub fn admit_late(
        &mut self,
        cfg: &SchedulerConfig,
        members: &mut Members,
        decls: &mut Declarations,
        installs: &mut Installs,
        joining: Registration,
    ) -> Result<Arc<Member>, Refusal> {
        let Registration { reg, peer, stream } = joining;
        let racks = members.welcome().is_some_and(|w| w.rack_reduce);
        if !cfg.failover || cfg.num_servers < 2 || racks {
            let why = match cfg.failover {
                false => "failover is off (GRADHUB_FAILOVER=0)",
                true if racks => "it reduces within racks first, which has no failover",
                true => {
                    "it started with one server, so its workers keep no results to re-send (start it with two or more)"
                }
            };
            return Err(Refusal::Late(format!("this job cannot take a server while it runs: {why}")));
        }
        if self.busy() {
            return Err(Refusal::Late(
                "another server is joining the job or being taken over; try again in a moment".into(),
            ));
        }
        let (Some(template), Some(placer)) = (members.welcome().cloned(), decls.placer_mut()) else {
            return Err(Refusal::Internal("a running job without its cluster map"));
        };
        let initial: usize = template.servers.iter().map(|s| s.ports.len()).sum();
        if placer.num_slots() + reg.ports.len() > initial + MAX_JOINED_SLOTS {
            return Err(Refusal::Late(format!(
                "the job has taken {} server threads since it started and may take {MAX_JOINED_SLOTS} at most",
                placer.num_slots() - initial
            )));
        }
        let info = ServerInfo {
            rank: members.server_infos().len() as u32,
            addr: reg.addr,
            ports: reg.ports,
            colocated: reg.colocated,
            host: reg.hostname,
            rack: 0, // racks matter with two levels only, which has no failover
        };
        let member = Arc::new(Member::new(Role::Server, info.rank, peer, stream));
        let mut servers = members.server_infos().to_vec();
        servers.push(info.clone());
        let welcome = Welcome { rank: info.rank, servers, late: true, ..template };
        // Nothing changes unless it is welcomed: every member numbers slots alike.
        if !member.send(&crate::protocol::Control::Welcome(welcome), cfg.namespace) {
            return Err(Refusal::Late("cannot send the welcome".into()));
        }
        placer.add_server(&info);
        // Before anything else can name its slots: workers connect to it,
        // servers learn where a replica on it would be.
        members.add_server(info.clone(), member.clone(), cfg.namespace);
        installs.server_joined(info.rank);
        self.taking_in = Some(info.rank); // no declaration is answered until the move is done
        log::warn!(
            target: "scheduler",
            "server {} ({}, {} thread(s), {}) joined the running job; moving chunks to it",
            info.rank,
            info.addr,
            info.ports.len(),
            if info.colocated { "colocated" } else { "CPU-only" }
        );
        Ok(member)
    }

    pub fn end_take_in(&mut self) {
        self.taking_in = None;
    }
}

/// Place again every chunk on server `lost`'s slots, in tensors still in
/// use by some worker; returns the specs that changed, by key.
fn place_again_without(decls: &mut Declarations, lost: u32) -> Vec<TensorSpec> {
    let (Some(placer), specs) = decls.in_use() else { return Vec::new() };
    let gone = placer.remove_server(lost);
    let mut changed = Vec::new();
    for spec in specs {
        if placer.replace(spec, &gone) {
            changed.push(spec.clone());
        }
    }
    changed.sort_by_key(|s| s.key);
    changed
}

/// A move to a server taken in, between its two steps: each tensor's slots
/// before it (by key).
pub(super) struct TakeIn {
    before: HashMap<u32, Vec<u32>>,
}

impl TakeIn {
    /// First step: rebalance chunks onto server `new` until it carries its
    /// share. Returns the plan and the specs whose chunks the old owners
    /// give up (`ServerMove`).
    /// None without a placement.
    pub fn plan(decls: &mut Declarations, new: u32) -> Option<(TakeIn, Vec<TensorSpec>)> {
        let (Some(placer), specs) = decls.in_use() else { return None };
        let mut specs: Vec<&mut TensorSpec> = specs.collect();
        specs.sort_by_key(|s| s.key);
        let before = specs.iter().map(|s| (s.key, s.slots.clone())).collect();
        let changed = placer.rebalance_onto(new, &mut specs);
        let moved = changed.iter().map(|&i| specs[i].clone()).collect();
        Some((TakeIn { before }, moved))
    }

    /// Second step: the old owners kept chunks `kept` (key, chunk: those
    /// with server-side optimizer state, which would not move with them),
    /// which go back where they were. Returns the specs that changed in
    /// the end (by key, to take over at the new server) and the chunks moved.
    pub fn finish(&self, decls: &mut Declarations, kept: &[(u32, u32)]) -> (Vec<TensorSpec>, usize) {
        let (Some(placer), specs) = decls.in_use() else { return (Vec::new(), 0) };
        let mut changed = Vec::new();
        let mut chunks = 0;
        for spec in specs {
            let Some(old) = self.before.get(&spec.key) else { continue };
            for &(key, c) in kept {
                if key == spec.key {
                    if let Some(&slot) = old.get(c as usize) {
                        placer.keep(spec, c as usize, slot);
                    }
                }
            }
            if old != &spec.slots {
                chunks += old.iter().zip(&spec.slots).filter(|(a, b)| a != b).count();
                changed.push(spec.clone());
            }
        }
        changed.sort_by_key(|s| s.key);
        (changed, chunks)
    }
}

#[cfg(test)]
mod tests {
    use super::super::declarations::tests::{declare_all, entry, job, servers};
    use super::*;
    use crate::protocol::DeclEntry;

    /// The server of each chunk's slot, by tensor key.
    fn owners(d: &mut Declarations) -> HashMap<u32, Vec<u32>> {
        let (Some(p), specs) = d.in_use() else { panic!("no placer") };
        let specs: Vec<(u32, Vec<u32>)> = specs.map(|s| (s.key, s.slots.clone())).collect();
        specs.into_iter().map(|(k, slots)| (k, slots.iter().map(|&s| p.slot(s).unwrap().server).collect())).collect()
    }

    #[test]
    fn a_lost_servers_chunks_and_only_those_move_to_their_replicas() {
        let (cfg, mut d) = job(2, &servers(3, 2));
        let names: Vec<DeclEntry> = (0..6).map(|i| entry(&format!("t{i}"), 16 * (i + 1))).collect();
        let placed = declare_all(&cfg, &mut d, &names);
        let before = owners(&mut d);
        // Slots are numbered server by server: two per server here.
        let on_1 = |slots: &[u32]| slots.iter().any(|&s| s / 2 == 1);
        let mut want: Vec<u32> = placed.iter().filter(|s| on_1(&s.slots) || on_1(&s.replicas)).map(|s| s.key).collect();
        want.sort_unstable();
        assert!(placed.iter().any(|s| on_1(&s.slots)));
        let mut moves = Moves::default();
        assert!(!moves.busy());
        let changed = moves.begin_take_over(1, &mut d);
        assert!(moves.busy(), "declarations wait for the takeover");
        let keys: Vec<u32> = changed.iter().map(|s| s.key).collect();
        assert_eq!(keys, want, "the specs with a chunk or a replica on server 1 change, by key");
        let after = owners(&mut d);
        for old in &placed {
            for c in 0..old.num_chunks() {
                let now = after[&old.key][c];
                assert_ne!(now, 1, "tensor {} chunk {c} still on the lost server", old.key);
                match before[&old.key][c] {
                    // Moved to its replica, where its optimizer state is.
                    1 => assert_eq!(now, old.replicas[c] / 2),
                    was => assert_eq!(now, was, "tensor {} chunk {c} moved without need", old.key),
                }
            }
        }
        for spec in &changed {
            assert!(!on_1(&spec.replicas), "replicas on the lost server are placed again");
        }
        assert_eq!(moves.live_servers(&servers(3, 2)).iter().map(|s| s.rank).collect::<Vec<_>>(), [0, 2]);
        moves.end_take_over();
        assert!(!moves.busy());
    }

    #[test]
    fn a_server_taken_in_gets_its_share_less_the_chunks_kept() {
        let (cfg, mut d) = job(2, &servers(2, 1));
        let names: Vec<DeclEntry> = (0..8).map(|i| entry(&format!("t{i}"), 16)).collect();
        declare_all(&cfg, &mut d, &names);
        let before = owners(&mut d);
        let new = servers(3, 1).pop().unwrap();
        d.placer_mut().unwrap().add_server(&new);
        let (plan, moved) = TakeIn::plan(&mut d, 2).unwrap();
        assert!(!moved.is_empty(), "the new server takes a share");
        let planned = owners(&mut d);
        let to_new: Vec<(u32, u32)> = planned
            .iter()
            .flat_map(|(&k, s)| s.iter().enumerate().filter(|(_, &s)| s == 2).map(move |(c, _)| (k, c as u32)))
            .collect();
        assert!(to_new.len() >= 2, "{to_new:?}");
        for (key, servers) in &planned {
            for (c, &s) in servers.iter().enumerate() {
                assert!(s == 2 || s == before[key][c], "tensor {key} chunk {c} moved between old servers");
            }
        }
        // The old owner kept one chunk (server-side optimizer state): it stays.
        let kept = to_new[0];
        let (specs, chunks) = plan.finish(&mut d, &[kept]);
        assert_eq!(chunks, to_new.len() - 1);
        let after = owners(&mut d);
        assert_eq!(after[&kept.0][kept.1 as usize], before[&kept.0][kept.1 as usize]);
        let changed: Vec<u32> = specs.iter().map(|s| s.key).collect();
        let mut want: Vec<u32> = after.iter().filter(|(k, s)| before[k] != **s).map(|(&k, _)| k).collect();
        want.sort_unstable();
        assert_eq!(changed, want);
    }
}
