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
        }
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

/// Which worker pushes which chunk (BytePS §4.2's intra-machine stage).
///
/// Workers that share a host (same host identity) first sum each chunk in
/// shared memory; then one of them, the chunk's *owner* on that host, pushes
/// the host's sum and receives the result for all of them. Owners rotate
/// with (key + chunk), so each of a host's W workers pushes about 1/W of
/// every tensor and a host's link carries what one worker per host would.
/// Every member computes this from the Welcome, so a server knows whose
/// push to expect for each chunk without being told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLayout {
    /// Index of each worker's host, by rank.
    host_of: Vec<usize>,
    /// Each host's workers, by local rank.
    hosts: Vec<Vec<u32>>,
    /// With two-level reduction (`with_racks`), each host's rack and the
    /// number of racks; else empty.
    host_rack: Vec<u32>,
    racks: u32,
}

impl HostLayout {
    /// From the Welcome's host identities and local ranks. With `reduce`
    /// off every worker is its own host: each pushes every chunk itself.
    pub fn new(worker_hosts: &[String], local_ranks: &[u32], reduce: bool) -> Result<HostLayout, String> {
        if worker_hosts.len() != local_ranks.len() {
            return Err(format!("{} host names for {} local ranks", worker_hosts.len(), local_ranks.len()));
        }
        let n = worker_hosts.len();
        if !reduce {
            let hosts = (0..n as u32).map(|r| vec![r]).collect();
            return Ok(HostLayout { host_of: (0..n).collect(), hosts, host_rack: Vec::new(), racks: 0 });
        }
        let mut names: Vec<&String> = Vec::new();
        let mut host_of = Vec::with_capacity(n);
        for h in worker_hosts {
            let i = names.iter().position(|x| *x == h).unwrap_or_else(|| {
                names.push(h);
                names.len() - 1
            });
            host_of.push(i);
        }
        let mut hosts: Vec<Vec<Option<u32>>> =
            names.iter().map(|name| vec![None; worker_hosts.iter().filter(|h| h == name).count()]).collect();
        for (rank, (&h, &l)) in host_of.iter().zip(local_ranks).enumerate() {
            let size = hosts[h].len();
            let slot = hosts[h]
                .get_mut(l as usize)
                .ok_or_else(|| format!("worker {rank} has local rank {l} on host {} of {size} workers", names[h]))?;
            if let Some(other) = slot.replace(rank as u32) {
                return Err(format!("workers {other} and {rank} share local rank {l} on host {}", names[h]));
            }
        }
        // Every slot is filled: as many ranks as slots, and none twice.
        let hosts = hosts.into_iter().map(|h| h.into_iter().flatten().collect()).collect();
        Ok(HostLayout { host_of, hosts, host_rack: Vec::new(), racks: 0 })
    }

    /// Two-level reduction over `racks` racks, each worker's rack by rank
    /// (`scheduler::racks`). A host's workers must share its rack.
    pub fn with_racks(mut self, worker_racks: &[u32], racks: u32) -> Result<HostLayout, String> {
        let mut host_rack = Vec::with_capacity(self.hosts.len());
        for w in &self.hosts {
            let r = |x: &u32| worker_racks.get(*x as usize).copied().unwrap_or(0);
            let first = w.first().map(r).unwrap_or(0);
            if let Some(other) = w.iter().find(|x| r(x) != first) {
                return Err(format!("workers {} and {other} share a host but not a rack", w[0]));
            }
            host_rack.push(first);
        }
        (self.host_rack, self.racks) = (host_rack, racks);
        Ok(self)
    }

    /// The racks reduced first, 0 without two levels.
    pub fn num_racks(&self) -> u32 {
        self.racks
    }

    /// The pusher id a relay (server thread `slot`) has at an owner: after
    /// the workers' ranks. (Per slot, not per rack: a rack's chunks are
    /// relayed by several threads, each with its own link to an owner.)
    pub fn relay_id(&self, slot: u32) -> u32 {
        self.host_of.len() as u32 + slot
    }

    /// Who pushes a chunk to its thread there: with two levels, the owner
    /// (in rack `rack`, `relay` false) takes its own rack's pushers and the
    /// relay of each other rack that holds workers (`relay_slot(rack)`: the
    /// chunk's relay there); a relay (`relay` true, in rack `rack`) takes
    /// its rack's pushers. Without racks, every host's pusher.
    pub fn pushers_at(
        &self,
        key: u32,
        chunk: u32,
        rack: u32,
        relay: bool,
        relay_slot: &dyn Fn(u32) -> u32,
    ) -> Vec<u32> {
        if self.racks == 0 {
            return self.pushers(key, chunk);
        }
        let mut out: Vec<u32> = (self.hosts.iter().zip(&self.host_rack))
            .filter(|(_, &r)| r == rack)
            .map(|(w, _)| w[owner_index(w.len(), key, chunk)])
            .collect();
        if !relay {
            let mut others: Vec<u32> = self.host_rack.iter().copied().filter(|&r| r != rack).collect();
            others.sort_unstable();
            others.dedup();
            out.extend(others.into_iter().map(|r| self.relay_id(relay_slot(r))));
        }
        out
    }

    /// Whose push an init round keeps there (rank 0's host's, or the relay
    /// of its rack); `None` at a relay of another rack (its sum is ignored).
    pub fn init_pusher(
        &self,
        key: u32,
        chunk: u32,
        rack: u32,
        relay: bool,
        relay_slot: &dyn Fn(u32) -> u32,
    ) -> Option<u32> {
        let own = self.owner(0, key, chunk);
        let Some(&r0) = self.host_of.first().and_then(|&h| self.host_rack.get(h)) else { return Some(own) };
        match (relay, r0 == rack) {
            (_, true) => Some(own),
            (true, false) => None,
            (false, false) => Some(self.relay_id(relay_slot(r0))),
        }
    }

    pub fn num_hosts(&self) -> usize {
        self.hosts.len()
    }

    /// The index of `rank`'s host (the machine that pushes for it).
    pub fn host_index(&self, rank: u32) -> usize {
        self.host_of.get(rank as usize).copied().unwrap_or(rank as usize)
    }

    /// The workers on `rank`'s host, by local rank (`rank` included).
    pub fn host_workers(&self, rank: u32) -> &[u32] {
        self.host_of.get(rank as usize).map_or(&[], |&h| &self.hosts[h])
    }

    /// The worker that pushes chunk `chunk` of tensor `key` for `rank`'s host.
    pub fn owner(&self, rank: u32, key: u32, chunk: u32) -> u32 {
        let w = self.host_workers(rank);
        w.get(owner_index(w.len(), key, chunk)).copied().unwrap_or(rank)
    }

    /// The workers whose pushes make up a round of this chunk, one per host.
    pub fn pushers(&self, key: u32, chunk: u32) -> Vec<u32> {
        self.hosts.iter().map(|w| w[owner_index(w.len(), key, chunk)]).collect()
    }
}

/// The local rank, among `local_size` workers, that owns a chunk: rotating
/// with (key + chunk) spreads every tensor evenly over a host's workers.
pub fn owner_index(local_size: usize, key: u32, chunk: u32) -> usize {
    (key as usize + chunk as usize) % local_size.max(1)
}

/// Split a tensor of `numel` elements of `elem_size` bytes into chunks of at
/// most `partition_bytes` (at least one element each). Returns elements per chunk.
pub fn chunk_elems(partition_bytes: u32, elem_size: usize) -> u64 {
    ((partition_bytes as usize / elem_size).max(1)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servers(colocated: &[bool], threads: usize) -> Vec<ServerInfo> {
        colocated
            .iter()
            .enumerate()
            .map(|(i, &c)| ServerInfo {
                rank: i as u32,
                addr: format!("10.0.0.{i}"),
                ports: (0..threads as u16).map(|p| 9000 + p).collect(),
                colocated: c,
                host: format!("h{i}"),
                rack: 0,
            })
            .collect()
    }

    #[test]
    fn weights_match_byteps_formula() {
        // n = 4 workers, k = 2 CPU-only, 4 colocated: M_cpu/M_gpu = 2(n-1)/(n-k) = 3.
        let w = server_weights(&[false, false, true, true, true, true], 4);
        assert_eq!(w, vec![6.0, 6.0, 2.0, 2.0, 2.0, 2.0]);
        // Shares: k*M_cpu + n*M_gpu = M with M_cpu = 2(n-1)M/(n^2+kn-2k).
        let (n, k) = (4.0f64, 2.0f64);
        let total: f64 = w.iter().sum();
        assert!((w[0] / total - 2.0 * (n - 1.0) / (n * n + k * n - 2.0 * k)).abs() < 1e-12);
        assert!((w[2] / total - (n - k) / (n * n + k * n - 2.0 * k)).abs() < 1e-12);
        // All colocated -> equal (all-reduce-equivalent); all CPU-only -> equal (sharded PS).
        assert_eq!(server_weights(&[true; 3], 3), vec![3.0; 3]);
        assert_eq!(server_weights(&[false; 2], 3), vec![4.0; 2]);
        // k >= n: colocated servers get nothing.
        assert_eq!(server_weights(&[false, false, true], 2), vec![2.0, 2.0, 0.0]);
        // A single worker: evenly.
        assert_eq!(server_weights(&[false, true], 1), vec![1.0, 1.0]);
    }

    #[test]
    fn placement_is_deterministic_and_balanced() {
        let s = servers(&[false, false, false], 4);
        let sizes: Vec<u64> = (0..1000).map(|i| 1 + (i * 7919 % 65536) as u64).collect();
        let mut a = Placer::new(&s, 4);
        let mut b = Placer::new(&s, 4);
        let pa = a.place(sizes.iter().copied());
        assert_eq!(pa, b.place(sizes.iter().copied()));
        let loads = a.loads();
        let max = *loads.iter().max().unwrap();
        let min = *loads.iter().min().unwrap();
        // Greedy least-loaded keeps the spread below one largest item.
        assert!(max - min <= 65536, "loads {loads:?}");
        assert_eq!(loads.iter().sum::<u64>(), sizes.iter().sum::<u64>());
    }

    #[test]
    fn a_server_that_joins_takes_its_weighted_share_and_only_from_the_others() {
        // 3 CPU-only servers of 2 threads, 4 pushing machines, 2 tensors of
        // 60 and 37 chunks of one size.
        let mut p = Placer::new(&servers(&[false, false, false], 2), 4);
        let mk = |key, numel| crate::protocol::TensorSpec {
            key,
            name: format!("t{key}"),
            numel,
            dtype: crate::protocol::DType::F32,
            chunk_elems: 1000,
            slots: Vec::new(),
            replicas: Vec::new(),
            relays: Vec::new(),
        };
        let (mut a, mut b) = (mk(0, 60_000), mk(1, 37_000));
        let chunk = 4000;
        a.slots = p.place((0..60).map(|_| chunk));
        b.slots = p.place((0..37).map(|_| chunk));
        let before = (a.slots.clone(), b.slots.clone());
        // A fourth, CPU-only: the same weight as the others, so a quarter.
        let joined = servers(&[false, false, false, false], 2).remove(3);
        p.add_server(&joined);
        assert_eq!(p.num_slots(), 8);
        let changed = p.rebalance_onto(3, &mut [&mut a, &mut b]);
        assert_eq!(changed, vec![0], "equal chunks: the first tensor's move first");
        assert_eq!(a.slots.iter().filter(|&&s| s >= 6).count(), 24, "a quarter of 97 chunks");
        for (old, new) in [(&before.0, &a.slots), (&before.1, &b.slots)] {
            for (o, n) in old.iter().zip(new) {
                assert!(o == n || *n >= 6, "a chunk moved from slot {o} to {n}, not onto the new server");
            }
        }
        let per_server: Vec<u64> = (0..4).map(|s| p.loads()[2 * s..2 * s + 2].iter().sum()).collect();
        let total: u64 = per_server.iter().sum();
        assert_eq!(total, 97 * chunk);
        for (s, &l) in per_server.iter().enumerate() {
            assert!(l.abs_diff(total / 4) <= 2 * chunk, "server {s} carries {l} of {total}: {per_server:?}");
        }
        // Deterministic: the same placement and join give the same moves.
        let mut q = Placer::new(&servers(&[false, false, false], 2), 4);
        let (mut a2, mut b2) = (mk(0, 60_000), mk(1, 37_000));
        a2.slots = q.place((0..60).map(|_| chunk));
        b2.slots = q.place((0..37).map(|_| chunk));
        q.add_server(&joined);
        q.rebalance_onto(3, &mut [&mut a2, &mut b2]);
        assert_eq!((a2.slots, b2.slots), (a.slots.clone(), b.slots.clone()));
        // A chunk its server keeps goes back, load and all.
        let moved = (0..60).find(|&c| a.slots[c] != before.0[c]).unwrap();
        let to = a.slots[moved] as usize;
        let load = p.loads()[to];
        p.keep(&mut a, moved, before.0[moved]);
        assert_eq!(a.slots[moved], before.0[moved]);
        assert_eq!(p.loads()[to], load - chunk);
    }

    #[test]
    fn a_server_that_joins_takes_small_chunks_when_the_large_ones_would_overload_it() {
        // Each of 3 slots holds one 8000-byte chunk and 8 of 500: a joining
        // server of 2 threads (each half a server's weight) cannot take an
        // 8000-byte chunk without becoming the costliest, but takes small ones.
        let mut p = Placer::new(&servers(&[false, false, false], 1), 4);
        let mut t = crate::protocol::TensorSpec {
            key: 0,
            name: "w".into(),
            numel: 0,
            dtype: crate::protocol::DType::F32,
            chunk_elems: 1,
            slots: Vec::new(),
            replicas: Vec::new(),
            relays: Vec::new(),
        };
        let sizes: Vec<u64> = (0..3).map(|_| 8000).chain((0..24).map(|_| 500)).collect();
        t.slots = p.place(sizes.iter().copied());
        let bytes = |p: &Placer| p.loads().to_vec();
        let before = bytes(&p);
        p.add_server(&servers(&[false, false, false, false], 2).remove(3));
        // chunk_bytes() of this spec is 0: move by the sizes placed.
        let mut specs: Vec<crate::protocol::TensorSpec> = sizes
            .iter()
            .zip(&t.slots)
            .enumerate()
            .map(|(i, (&b, &slot))| crate::protocol::TensorSpec {
                key: i as u32,
                name: format!("c{i}"),
                numel: b / 4,
                dtype: crate::protocol::DType::F32,
                chunk_elems: b / 4,
                slots: vec![slot],
                replicas: Vec::new(),
                relays: Vec::new(),
            })
            .collect();
        let mut refs: Vec<&mut crate::protocol::TensorSpec> = specs.iter_mut().collect();
        let changed = p.rebalance_onto(3, &mut refs);
        assert!(!changed.is_empty(), "nothing moved: {before:?} -> {:?}", p.loads());
        assert!(changed.iter().all(|&i| sizes[i] == 500), "a large chunk moved: {changed:?}");
        let old_max = *p.loads()[..3].iter().max().unwrap();
        assert!(old_max < 12_000, "the old slots still carry {:?}", p.loads());
    }

    #[test]
    fn a_cpu_only_server_that_joins_changes_the_byteps_split() {
        // Two colocated servers, n = 2 pushing machines: 50 % each; a
        // CPU-only one joins (k = 1): weights 2(n-1) = 2 vs n-k = 1.
        let mut p = Placer::new(&servers(&[true, true], 1), 2);
        let mut t = crate::protocol::TensorSpec {
            key: 0,
            name: "w".into(),
            numel: 40_000,
            dtype: crate::protocol::DType::F32,
            chunk_elems: 1000,
            slots: Vec::new(),
            replicas: Vec::new(),
            relays: Vec::new(),
        };
        t.slots = p.place((0..40).map(|_| 4000));
        let joined = servers(&[true, true, false], 1).remove(2);
        p.add_server(&joined);
        p.rebalance_onto(2, &mut [&mut t]);
        let on_new = t.slots.iter().filter(|&&s| s == 2).count();
        assert!((19..=21).contains(&on_new), "the CPU-only server took {on_new} of 40 chunks (half expected)");
        // A second CPU-only server makes k = n = 2: BytePS gives the
        // colocated ones nothing, so every chunk leaves them.
        let joined = servers(&[true, true, false, false], 1).remove(3);
        p.add_server(&joined);
        p.rebalance_onto(3, &mut [&mut t]);
        assert!(t.slots.iter().all(|&s| s >= 2), "chunks left on colocated servers: {:?}", t.slots);
        let on_last = t.slots.iter().filter(|&&s| s == 3).count();
        assert!((19..=21).contains(&on_last), "the second CPU-only server took {on_last} of 40 chunks");
    }

    #[test]
    fn replicas_are_on_another_server_and_take_the_chunks_of_a_lost_one() {
        // Three servers of 2 threads: slot / 2 is the server.
        let mut p = Placer::new(&servers(&[false, false, false], 2), 4).with_replicas(true);
        let mut spec = crate::protocol::TensorSpec {
            key: 0,
            name: "w".into(),
            numel: 300,
            dtype: crate::protocol::DType::F32,
            chunk_elems: 10,
            slots: Vec::new(),
            replicas: Vec::new(),
            relays: Vec::new(),
        };
        spec.slots = p.place((0..30).map(|c| spec.chunk_bytes(c) as u64));
        spec.replicas = p.place_replicas(&spec);
        assert_eq!(spec.replicas.len(), 30);
        for c in 0..30 {
            assert_ne!(spec.slots[c] / 2, spec.replicas[c] / 2, "chunk {c}'s replica is on its own server");
        }
        for srv in 0..3 {
            let n = spec.replicas.iter().filter(|&&r| r / 2 == srv).count();
            assert!((8..=12).contains(&n), "server {srv} replicates {n} of 30 chunks");
        }
        let before = spec.clone();
        let gone = p.remove_server(1);
        assert!(p.replace(&mut spec, &gone));
        for c in 0..30 {
            let (s, r) = (spec.slots[c], spec.replicas[c]);
            assert!(s / 2 != 1 && r / 2 != 1, "chunk {c} still uses the lost server: slot {s}, replica {r}");
            assert_ne!(s / 2, r / 2, "chunk {c}'s replica is on its own server");
            if before.slots[c] / 2 == 1 {
                assert_eq!(s, before.replicas[c], "chunk {c} must move to its replica");
            } else {
                assert_eq!(s, before.slots[c], "chunk {c} was not on the lost server");
                if before.replicas[c] / 2 != 1 {
                    assert_eq!(r, before.replicas[c], "chunk {c}'s replica was not lost");
                }
            }
        }
        // Load follows the chunks: the promoted replicas' bytes count as placed.
        let placed: u64 = p.loads().iter().sum();
        assert_eq!(placed, 300 * 4);
        // One server left: nowhere to replicate.
        let gone = p.remove_server(2);
        assert!(p.replace(&mut spec, &gone));
        assert!(spec.slots.iter().all(|&s| s / 2 == 0));
        assert!(spec.replicas.is_empty());
        p.unplace(&spec);
        assert_eq!(p.loads().iter().sum::<u64>(), 0);
        // Off: no replicas.
        let mut q = Placer::new(&servers(&[false, false], 1), 2);
        assert!(q.place_replicas(&spec).is_empty());
    }

    #[test]
    fn a_lost_servers_chunks_move_to_the_others_in_proportion() {
        // Two CPU-only servers (2 threads each) and one colocated, 4 pushing machines.
        let mut p = Placer::new(&servers(&[false, false, true], 2), 4);
        let mut spec = crate::protocol::TensorSpec {
            key: 0,
            name: "w".into(),
            numel: 600,
            dtype: crate::protocol::DType::F32,
            chunk_elems: 10,
            slots: Vec::new(),
            replicas: Vec::new(),
            relays: Vec::new(),
        };
        spec.slots = p.place((0..60).map(|c| spec.chunk_bytes(c) as u64));
        assert!(spec.slots.iter().any(|&s| s / 2 == 1), "server 1 got chunks");
        let before = spec.slots.clone();
        let gone = p.remove_server(1);
        assert_eq!(gone, vec![2, 3]);
        assert!(p.replace(&mut spec, &gone));
        for (c, (&a, &b)) in before.iter().zip(&spec.slots).enumerate() {
            assert!(b / 2 != 1, "chunk {c} still on the lost server");
            if a / 2 != 1 {
                assert_eq!(a, b, "chunk {c} was not on the lost server and must not move");
            }
        }
        // The survivors keep their weights: CPU-only 2(n-1) = 6 vs colocated n-k = 2.
        let bytes = |srv: u32| -> u64 {
            p.loads().iter().enumerate().filter(|(i, _)| *i as u32 / 2 == srv).map(|(_, &l)| l).sum()
        };
        assert_eq!(bytes(1), 0);
        assert_eq!(bytes(0) + bytes(2), 2400);
        assert!(bytes(0) >= 2 * bytes(2), "{} vs {}", bytes(0), bytes(2));
        assert!(!p.replace(&mut spec, &gone), "nothing left to move");
        // Only zero-weight servers left: they take the chunks rather than nobody.
        let mut q = Placer::new(&servers(&[true, true], 1), 1);
        assert!(q.place([4, 4, 4, 4]).iter().all(|&s| s < 2));
    }

    #[test]
    fn placement_follows_weights() {
        // n=4, k=1: M_cpu/M_gpu = 6/3 = 2, so server 0 gets twice each colocated one.
        let s = servers(&[false, true, true, true, true], 2);
        let mut p = Placer::new(&s, 4);
        p.place(std::iter::repeat_n(1000u64, 6000));
        let per_server: Vec<u64> = p.loads().chunks(2).map(|c| c.iter().sum()).collect();
        let unit = per_server[1] as f64;
        assert!((per_server[0] as f64 / unit - 2.0).abs() < 0.01, "{per_server:?}");
        for &l in &per_server[1..] {
            assert!((l as f64 / unit - 1.0).abs() < 0.01, "{per_server:?}");
        }
    }

    fn layout(hosts: &[&str], local: &[u32], reduce: bool) -> Result<HostLayout, String> {
        let h: Vec<String> = hosts.iter().map(|s| s.to_string()).collect();
        HostLayout::new(&h, local, reduce)
    }

    #[test]
    fn host_layout_rotates_owners_within_each_host() {
        // Uneven hosts: a (ranks 0, 2, 3), b (rank 1); local ranks not in rank order.
        let l = layout(&["a", "b", "a", "a"], &[1, 0, 0, 2], true).unwrap();
        assert_eq!(l.num_hosts(), 2);
        assert_eq!(l.host_workers(0), &[2, 0, 3]);
        assert_eq!(l.host_workers(1), &[1]);
        let mut pushed = [0usize; 4];
        for key in 0..5 {
            for chunk in 0..6 {
                let p = l.pushers(key, chunk);
                // One pusher per host, and it is the owner every worker of that host computes.
                assert_eq!(p.len(), 2);
                for r in 0..4 {
                    assert!(p.contains(&l.owner(r, key, chunk)));
                }
                assert_eq!(l.owner(0, key, chunk), l.owner(3, key, chunk));
                assert_eq!(l.owner(1, key, chunk), 1);
                for r in p {
                    pushed[r as usize] += 1;
                }
            }
        }
        // Host a's 30 chunks split evenly over its three workers; b pushes all.
        assert_eq!(pushed, [10, 30, 10, 10]);
        // Off: every worker is its own host.
        let off = layout(&["a", "b", "a", "a"], &[1, 0, 0, 2], false).unwrap();
        assert_eq!(off.pushers(3, 1), vec![0, 1, 2, 3]);
        assert_eq!(off.owner(2, 3, 1), 2);
        // Inconsistent local ranks are refused, not guessed.
        assert!(layout(&["a", "a"], &[0, 0], true).unwrap_err().contains("share local rank 0"));
        assert!(layout(&["a", "a"], &[0, 2], true).unwrap_err().contains("local rank 2"));
        assert!(layout(&["a"], &[0, 1], true).is_err());
    }

    #[test]
    fn relays_stay_in_their_rack_and_every_rack_pushes_to_the_owner_once() {
        // Servers 0, 1 in rack 0, servers 2, 3 in rack 1, and a CPU-only
        // server 4 in rack 2 without workers; 2 threads each.
        let mut s = servers(&[true, true, true, true, false], 2);
        let racks = [0, 0, 1, 1, 2];
        for (x, &r) in s.iter_mut().zip(&racks) {
            x.rack = r;
        }
        let mut p = Placer::new(&s, 4).with_racks(&racks, vec![true, true, false]);
        let mut spec = crate::protocol::TensorSpec {
            key: 1,
            name: "t".into(),
            numel: 40 * 1024,
            dtype: crate::protocol::DType::F32,
            chunk_elems: 1024,
            slots: Vec::new(),
            replicas: Vec::new(),
            relays: Vec::new(),
        };
        spec.slots = p.place((0..40).map(|c| spec.chunk_bytes(c) as u64));
        spec.relays = p.place_relays(&spec);
        assert_eq!(spec.relays.len(), 40 * 3);
        let rack_of = |slot: u32| racks[slot as usize / 2];
        let mut relayed = [0usize; 10];
        for c in 0..40 {
            let owner = spec.slots[c];
            for r in 0..3u32 {
                let to = spec.slot_for(r, c);
                match (rack_of(owner) == r, r) {
                    // The owner's rack pushes to the owner; a rack without workers pushes nothing.
                    (true, _) | (false, 2) => assert_eq!(to, owner, "chunk {c} rack {r}"),
                    (false, _) => {
                        assert_eq!(rack_of(to), r, "chunk {c}: rack {r}'s relay {to} is in another rack");
                        relayed[to as usize] += 1;
                    }
                }
            }
        }
        // Relays spread over each rack's threads (none on the CPU-only rack).
        let per: Vec<usize> = relayed.to_vec();
        assert!(per[..8].iter().all(|&n| n > 0), "{per:?}");
        assert_eq!(per[8] + per[9], 0, "{per:?}");
        let (lo, hi) = (per[..8].iter().min().unwrap(), per[..8].iter().max().unwrap());
        assert!(hi - lo <= 2, "uneven relays {per:?}");
        // Taken back, the relay load is freed: the same tensor again gets the same relays.
        p.unplace(&spec);
        let again = p.place_relays(&spec);
        assert_eq!(again, spec.relays);
    }

    #[test]
    fn with_racks_owners_take_their_rack_and_one_relay_per_other_rack() {
        // Racks: hosts a, b in rack 0; host c in rack 1; host d in rack 2.
        let l = layout(&["a", "a", "b", "c", "c", "d"], &[0, 1, 0, 0, 1, 0], true)
            .unwrap()
            .with_racks(&[0, 0, 0, 1, 1, 2], 3)
            .unwrap();
        assert_eq!((l.num_racks(), l.relay_id(0), l.relay_id(2)), (3, 6, 8));
        // The chunk's relay in rack r is slot 10 + r.
        let slot = |r: u32| 10 + r;
        for (key, chunk) in [(0, 0), (1, 0), (4, 7)] {
            let own = |r| l.owner(r, key, chunk);
            // An owner in rack 0: hosts a and b, then the relays of racks 1 and 2.
            assert_eq!(l.pushers_at(key, chunk, 0, false, &slot), vec![own(0), own(2), 17, 18]);
            // A relay of rack 1 takes host c's pusher only.
            assert_eq!(l.pushers_at(key, chunk, 1, true, &slot), vec![own(3)]);
            // Rank 0's push is the one an init round keeps, through its rack's relay elsewhere.
            assert_eq!(l.init_pusher(key, chunk, 0, false, &slot), Some(own(0)));
            assert_eq!(l.init_pusher(key, chunk, 1, false, &slot), Some(16));
            assert_eq!(l.init_pusher(key, chunk, 0, true, &slot), Some(own(0)));
            assert_eq!(l.init_pusher(key, chunk, 1, true, &slot), None);
        }
        // A host's workers in two racks is an error.
        let e = layout(&["a", "a"], &[0, 1], true).unwrap().with_racks(&[0, 1], 2).unwrap_err();
        assert!(e.contains("share a host but not a rack"), "{e}");
    }

    #[test]
    fn chunking() {
        assert_eq!(chunk_elems(4096, 4), 1024);
        assert_eq!(chunk_elems(3, 4), 1);
    }
}
