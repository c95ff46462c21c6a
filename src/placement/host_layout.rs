//! `HostLayout`: which worker of a host pushes each chunk (the host stage),
//! and, with two-level reduction, who pushes to a chunk's owner and relays.

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
