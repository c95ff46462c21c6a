//! Which server thread owns which chunk, and which worker pushes it.
//!
//! Every chunk of every tensor goes to one *slot* (a server thread). Slots are
//! numbered server by server: slot = first_slot(server) + thread. The
//! scheduler places each tensor once, when every worker has declared it, and
//! sends the same answer to all workers and servers, so placement is
//! identical everywhere regardless of the order workers declared in.
//!
//! Load is balanced in bytes, weighted per server as BytePS §4.1 prescribes:
//! with n workers and k CPU-only servers, a CPU-only server should take
//! M_cpu = 2(n-1)M/(n^2+kn-2k) bytes of the summation work and a server
//! colocated with a worker M_gpu = (n-k)M/(n^2+kn-2k). Only the ratio
//! matters, so the weights are 2(n-1) and (n-k). (The formula assumes one
//! colocated server per worker machine, BytePS's setting; with k >= n the
//! colocated servers get no work, the paper's "use PS only" regime.)
//! n counts the machines that push: with several workers per host and the
//! host stage on, one per host (`HostLayout`), not the workers.

use crate::protocol::ServerInfo;

mod host_layout;

pub use host_layout::{owner_index, HostLayout};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub server: u32,
    pub thread: u32,
}

/// Relative share of the summation work for each server (BytePS Eq. 1/2).
pub fn server_weights(colocated: &[bool], num_workers: usize) -> Vec<f64> {
    let n = num_workers as f64;
    let k = colocated.iter().filter(|&&c| !c).count() as f64;
    let w_cpu = 2.0 * (n - 1.0);
    let w_gpu = (n - k).max(0.0);
    let w: Vec<f64> = colocated.iter().map(|&c| if c { w_gpu } else { w_cpu }).collect();
    if w.iter().all(|&x| x <= 0.0) {
        // e.g. one worker: no network traffic to balance, spread evenly.
        return vec![1.0; colocated.len()];
    }
    w
}

/// Greedy weighted least-loaded placement (deterministic, ties -> lowest slot).
///
/// With replicas on, every chunk also gets a replica slot on another
/// server, placed the same way against a load of its own: the replica keeps
/// the chunk's server-side optimizer state and is where the chunk moves if
/// its server is lost (so that state survives). For a chunk without such
/// state a replica costs nothing but the choice of where it would move.
pub struct Placer {
    slots: Vec<Slot>,
    weight: Vec<f64>,
    load: Vec<u64>,
    replica_load: Vec<u64>,
    replicas: bool,
    /// Slots of servers that were lost: never placed on again.
    lost: Vec<bool>,
    /// By slot: its server is colocated with workers; and the machines that
    /// push (for the weights when a server joins).
    colocated: Vec<bool>,
    pushing: usize,
    /// Two-level reduction (`with_racks`): each slot's rack, which racks
    /// hold workers, and the bytes each slot relays.
    rack: Vec<u32>,
    racks_with_workers: Vec<bool>,
    relay_load: Vec<u64>,
    /// By worker rank, the slots of the servers colocated with it
    /// (`with_homes`): where a sharded tensor's shard for it goes.
    homes: Vec<Vec<u32>>,
}

impl Placer {
    pub fn new(servers: &[ServerInfo], num_workers: usize) -> Placer {
        let colocated: Vec<bool> = servers.iter().map(|s| s.colocated).collect();
        let sw = server_weights(&colocated, num_workers);
        let mut slots = Vec::new();
        let mut weight = Vec::new();
        let mut coloc = Vec::new();
        for (s, w) in servers.iter().zip(sw) {
            let t = s.ports.len().max(1);
            for thread in 0..t {
                slots.push(Slot { server: s.rank, thread: thread as u32 });
                weight.push(w / t as f64);
                coloc.push(s.colocated);
            }
        }
        let load = vec![0; slots.len()];
        let replica_load = vec![0; slots.len()];
        let lost = vec![false; slots.len()];
        Placer {
            slots,
            weight,
            load,
            replica_load,
            replicas: false,
            lost,
            colocated: coloc,
            pushing: num_workers,
            rack: Vec::new(),
            racks_with_workers: Vec::new(),
            relay_load: Vec::new(),
            homes: Vec::new(),
        }
    }

    /// Each worker's colocated servers, from the workers' host identities
    /// (by rank) and the servers' (`place_sharded`).
    pub fn with_homes(mut self, worker_hosts: &[String], servers: &[ServerInfo]) -> Placer {
        self.homes = worker_hosts
            .iter()
            .map(|h| {
                let here =
                    |i: &usize| servers.iter().any(|s| s.colocated && &s.host == h && s.rank == self.slots[*i].server);
                (0..self.slots.len()).filter(here).map(|i| i as u32).collect()
            })
            .collect();
        self
    }

    /// Place a sharded tensor's chunks (`DeclEntry::sharded`): each chunk
    /// `(elements lo..hi, bytes)` that lies in one reader's shard
    /// (`reader(lo, hi)`: its rank) goes to that reader's least-loaded
    /// colocated slot, so its result (a reduce-scatter's) or its push (an
    /// all-gather's) stays on the host; the others, and every chunk of a
    /// reader with no server on its host, as `place` would.
    pub fn place_sharded(
        &mut self,
        chunks: impl IntoIterator<Item = (u64, u64, u64)>,
        reader: impl Fn(u64, u64) -> Option<u32>,
    ) -> Vec<u32> {
        let mut out = Vec::new();
        for (lo, hi, b) in chunks {
            let home = reader(lo, hi).and_then(|r| self.homes.get(r as usize));
            let best = home.and_then(|slots| {
                slots.iter().copied().filter(|&s| !self.lost[s as usize]).min_by_key(|&s| self.load[s as usize])
            });
            out.push(match best {
                Some(s) => {
                    self.load[s as usize] += b;
                    s
                }
                None => self.least_loaded(b, None).unwrap_or(0),
            });
        }
        out
    }

    /// Reduce within racks first (`scheduler::racks`): `server_racks` by
    /// server rank, and whether each rack holds workers.
    pub fn with_racks(mut self, server_racks: &[u32], racks_with_workers: Vec<bool>) -> Placer {
        self.rack = self.slots.iter().map(|s| server_racks.get(s.server as usize).copied().unwrap_or(0)).collect();
        self.relay_load = vec![0; self.slots.len()];
        self.racks_with_workers = racks_with_workers;
        self
    }

    /// With racks, per chunk and rack (`TensorSpec::relays`), the slot the
    /// rack's workers push to: the owner in its own rack (and in racks
    /// without workers, which push nothing), else the least-loaded relay
    /// among the rack's own slots. Empty without racks.
    pub fn place_relays(&mut self, spec: &crate::protocol::TensorSpec) -> Vec<u32> {
        let racks = self.racks_with_workers.len();
        if racks < 2 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(spec.num_chunks() * racks);
        for c in 0..spec.num_chunks() {
            let owner = spec.slots[c];
            let b = spec.chunk_bytes(c) as u64;
            for r in 0..racks as u32 {
                let mine = |i: &usize| self.rack[*i] == r && !self.lost[*i];
                let best = (0..self.slots.len()).filter(mine).min_by_key(|&i| (self.relay_load[i], i));
                match best {
                    Some(i) if self.rack[owner as usize] != r && self.racks_with_workers[r as usize] => {
                        self.relay_load[i] += b;
                        out.push(i as u32);
                    }
                    _ => out.push(owner),
                }
            }
        }
        out
    }

    /// Server `s` joined the running job: its threads become the next
    /// slots (a joining server's rank is above every other's, so slot
    /// numbering stays server by server), and every live server's weight
    /// follows the new split (one more CPU-only server changes k).
    pub fn add_server(&mut self, s: &ServerInfo) {
        let t = s.ports.len().max(1);
        for thread in 0..t {
            self.slots.push(Slot { server: s.rank, thread: thread as u32 });
            self.colocated.push(s.colocated);
            self.load.push(0);
            self.replica_load.push(0);
            self.lost.push(false);
            self.weight.push(0.0);
        }
        // Live servers in slot order, each with its thread count.
        let mut live: Vec<(u32, bool, usize)> = Vec::new();
        for (i, sl) in self.slots.iter().enumerate() {
            if self.lost[i] {
                continue;
            }
            match live.last_mut() {
                Some(l) if l.0 == sl.server => l.2 += 1,
                _ => live.push((sl.server, self.colocated[i], 1)),
            }
        }
        let sw = server_weights(&live.iter().map(|l| l.1).collect::<Vec<_>>(), self.pushing);
        for (i, sl) in self.slots.iter().enumerate() {
            if let Some(j) = live.iter().position(|l| l.0 == sl.server).filter(|_| !self.lost[i]) {
                self.weight[i] = sw[j] / live[j].2 as f64;
            }
        }
    }

    /// Move chunks of the placed `specs` onto server `to` (just added)
    /// until it carries its weighted share: again and again, the costliest
    /// slot (load over weight) gives the largest chunk whose move lowers
    /// the higher of the two costs to the new server's cheapest slot.
    /// Replicas stay: none is on the new server yet, so none is on its
    /// chunk's server after a move. Returns the indices of the specs that
    /// changed.
    pub fn rebalance_onto(&mut self, to: u32, specs: &mut [&mut crate::protocol::TensorSpec]) -> Vec<usize> {
        let targets: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].server == to).collect();
        if targets.is_empty() {
            return Vec::new();
        }
        // Each other slot's chunks, largest last (popped first); ties in
        // (tensor, chunk) order, so every run agrees.
        let mut on: Vec<Vec<(u64, usize, usize)>> = vec![Vec::new(); self.slots.len()];
        for (si, spec) in specs.iter().enumerate() {
            for c in 0..spec.num_chunks() {
                let slot = spec.slots[c] as usize;
                if slot < self.slots.len() && !targets.contains(&slot) {
                    on[slot].push((spec.chunk_bytes(c) as u64, si, c));
                }
            }
        }
        for l in &mut on {
            l.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
        }
        // A server with no share (colocated, k >= n) costs far more per
        // byte than any other, so its chunks move off it first.
        let cost = |p: &Placer, i: usize, l: u64| match p.weight[i] > 0.0 {
            true => l as f64 / p.weight[i],
            false => l as f64 * 1e12,
        };
        let mut changed = vec![false; specs.len()];
        while let Some(from) = (0..on.len())
            .filter(|&i| !on[i].is_empty())
            .max_by(|&x, &y| cost(self, x, self.load[x]).total_cmp(&cost(self, y, self.load[y])).then(y.cmp(&x)))
        {
            // Its largest chunk whose move lowers the higher cost, and where to.
            let pick = on[from].iter().enumerate().rev().find_map(|(k, &(b, _, _))| {
                let dest = *targets.iter().min_by(|&&x, &&y| {
                    cost(self, x, self.load[x] + b).total_cmp(&cost(self, y, self.load[y] + b)).then(x.cmp(&y))
                })?;
                let before = cost(self, from, self.load[from]).max(cost(self, dest, self.load[dest]));
                let after =
                    cost(self, from, self.load[from].saturating_sub(b)).max(cost(self, dest, self.load[dest] + b));
                (after < before).then_some((k, dest))
            });
            let Some((k, dest)) = pick else { break };
            let (b, si, c) = on[from].remove(k);
            self.load[from] = self.load[from].saturating_sub(b);
            self.load[dest] += b;
            specs[si].slots[c] = dest as u32;
            changed[si] = true;
        }
        (0..specs.len()).filter(|&i| changed[i]).collect()
    }

    /// Chunk `c` of `spec` stays on slot `slot` after all (its server kept
    /// it: see `scheduler::failover::take_in`): its load goes back.
    pub fn keep(&mut self, spec: &mut crate::protocol::TensorSpec, c: usize, slot: u32) {
        let b = spec.chunk_bytes(c) as u64;
        let now = spec.slots[c] as usize;
        if let Some(l) = self.load.get_mut(now) {
            *l = l.saturating_sub(b);
        }
        if let Some(l) = self.load.get_mut(slot as usize) {
            *l += b;
        }
        spec.slots[c] = slot;
    }

    /// Give every chunk a replica on another server (when there is one).
    pub fn with_replicas(mut self, on: bool) -> Placer {
        self.replicas = on;
        self
    }

    /// Each server's share of the summation work, e.g. "server 0 (CPU-only) 75%, server 1 (colocated) 25%".
    pub fn describe_shares(&self, servers: &[ServerInfo]) -> String {
        let total: f64 = self.weight.iter().sum();
        servers
            .iter()
            .map(|s| {
                let w: f64 =
                    self.slots.iter().zip(&self.weight).filter(|(sl, _)| sl.server == s.rank).map(|(_, w)| w).sum();
                let kind = if s.colocated { "colocated" } else { "CPU-only" };
                format!("server {} ({kind}) {:.0}%", s.rank, 100.0 * w / total.max(f64::MIN_POSITIVE))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    pub fn slot(&self, i: u32) -> Option<Slot> {
        self.slots.get(i as usize).copied()
    }

    /// Bytes placed so far on each slot.
    pub fn loads(&self) -> &[u64] {
        &self.load
    }

    /// Place chunks of the given byte sizes, in order; returns their slots.
    pub fn place(&mut self, chunk_bytes: impl IntoIterator<Item = u64>) -> Vec<u32> {
        chunk_bytes.into_iter().map(|b| self.least_loaded(b, None).unwrap_or(0)).collect()
    }

    /// The slot where `b` more bytes cost least (load over weight), away
    /// from server `not_on` if given, counted in the replicas' load then.
    fn least_loaded(&mut self, b: u64, not_on: Option<u32>) -> Option<u32> {
        let ok = |p: &Placer, i: usize| !p.lost[i] && not_on.is_none_or(|s| p.slots[i].server != s);
        // Servers with no share of the work (BytePS with k >= n) take
        // chunks only when no other server is left.
        let weighted = (0..self.slots.len()).any(|i| ok(self, i) && self.weight[i] > 0.0);
        let load = if not_on.is_some() { &self.replica_load } else { &self.load };
        let mut best = None;
        let mut best_cost = f64::INFINITY;
        for (i, &l) in load.iter().enumerate() {
            if !ok(self, i) || (weighted && self.weight[i] <= 0.0) {
                continue;
            }
            let w = if weighted { self.weight[i] } else { 1.0 };
            let cost = (l + b) as f64 / w;
            if cost < best_cost {
                best_cost = cost;
                best = Some(i);
            }
        }
        let best = best?;
        match not_on {
            Some(_) => self.replica_load[best] += b,
            None => self.load[best] += b,
        }
        Some(best as u32)
    }

    /// Replica slots for `spec`'s chunks (placed already): each on a server
    /// other than its chunk's. Empty when replicas are off or no other
    /// server is left.
    pub fn place_replicas(&mut self, spec: &crate::protocol::TensorSpec) -> Vec<u32> {
        if !self.replicas {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(spec.num_chunks());
        for c in 0..spec.num_chunks() {
            let server = self.slots[spec.slots[c] as usize].server;
            match self.least_loaded(spec.chunk_bytes(c) as u64, Some(server)) {
                Some(r) => out.push(r),
                None => {
                    self.unplace_replicas(spec, &out);
                    return Vec::new();
                }
            }
        }
        out
    }

    fn unplace_replicas(&mut self, spec: &crate::protocol::TensorSpec, replicas: &[u32]) {
        for (c, &r) in replicas.iter().enumerate() {
            if let Some(l) = self.replica_load.get_mut(r as usize) {
                *l = l.saturating_sub(spec.chunk_bytes(c) as u64);
            }
        }
    }

    /// Server `rank` was lost: its slots take no more chunks. Returns them
    /// (by slot index); the caller places their chunks again.
    pub fn remove_server(&mut self, rank: u32) -> Vec<u32> {
        let mut gone = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if s.server == rank && !self.lost[i] {
                self.lost[i] = true;
                self.load[i] = 0;
                self.replica_load[i] = 0;
                gone.push(i as u32);
            }
        }
        gone
    }

    /// Place again the chunks of `spec` that are on `gone` slots: each
    /// moves to its replica if that one is left, else where it costs
    /// least. Chunks whose replica was on `gone` slots, or just became
    /// their chunk's slot, get a new one. Returns whether anything changed.
    pub fn replace(&mut self, spec: &mut crate::protocol::TensorSpec, gone: &[u32]) -> bool {
        let mut changed = false;
        for c in 0..spec.num_chunks() {
            let b = spec.chunk_bytes(c) as u64;
            if gone.contains(&spec.slots[c]) {
                changed = true;
                spec.slots[c] = match spec.replicas.get(c) {
                    Some(&r) if !gone.contains(&r) && !self.lost[r as usize] => {
                        self.replica_load[r as usize] = self.replica_load[r as usize].saturating_sub(b);
                        self.load[r as usize] += b;
                        r
                    }
                    _ => self.least_loaded(b, None).unwrap_or(0),
                };
            }
            let Some(&r) = spec.replicas.get(c) else { continue };
            if gone.contains(&r) || self.lost[r as usize] || r == spec.slots[c] {
                changed = true;
                let server = self.slots[spec.slots[c] as usize].server;
                match self.least_loaded(b, Some(server)) {
                    Some(new) => spec.replicas[c] = new,
                    None => {
                        // No other server left: no replicas for this tensor
                        // (chunk c's replica load is already out).
                        let mut old = std::mem::take(&mut spec.replicas);
                        old[c] = u32::MAX;
                        self.unplace_replicas(spec, &old);
                    }
                }
            }
        }
        changed
    }

    /// Count a tensor placed by an earlier placer of the job (a scheduler
    /// that restarted: `scheduler::rejoin`), as if placed here: `unplace`'s
    /// inverse. Slots out of range are skipped (the spec was checked by
    /// its decoder, not against this job).
    pub fn account(&mut self, spec: &crate::protocol::TensorSpec) {
        for (c, &slot) in spec.slots.iter().enumerate() {
            let b = spec.chunk_bytes(c) as u64;
            if let Some(l) = self.load.get_mut(slot as usize) {
                *l += b;
            }
            if let Some(l) = spec.replicas.get(c).and_then(|&r| self.replica_load.get_mut(r as usize)) {
                *l += b;
            }
        }
        for (i, &slot) in spec.relays.iter().enumerate() {
            let c = i / self.racks_with_workers.len().max(1);
            if spec.slots.get(c).is_some_and(|&owner| owner != slot) {
                if let Some(l) = self.relay_load.get_mut(slot as usize) {
                    *l += spec.chunk_bytes(c) as u64;
                }
            }
        }
    }

    /// Take back a tensor placed earlier, so later tensors fill the room it leaves.
    pub fn unplace(&mut self, spec: &crate::protocol::TensorSpec) {
        for (c, &slot) in spec.slots.iter().enumerate() {
            if let Some(l) = self.load.get_mut(slot as usize) {
                *l = l.saturating_sub(spec.chunk_bytes(c) as u64);
            }
        }
        self.unplace_replicas(spec, &spec.replicas);
        for (i, &slot) in spec.relays.iter().enumerate() {
            let c = i / self.racks_with_workers.len().max(1);
            if slot != spec.slots[c] {
                if let Some(l) = self.relay_load.get_mut(slot as usize) {
                    *l = l.saturating_sub(spec.chunk_bytes(c) as u64);
                }
            }
        }
    }
}

/// Split a tensor of `numel` elements of `elem_size` bytes into chunks of at
/// most `partition_bytes` (at least one element each). Returns elements per chunk.
pub fn chunk_elems(partition_bytes: u32, elem_size: usize) -> u64 {
    ((partition_bytes as usize / elem_size).max(1)) as u64
}

#[cfg(test)]
mod tests;
