//! The host stage (BytePS §4.2, intra-machine): workers that share a host
//! sum each chunk in shared memory first; the chunk's owner on that host
//! (`placement::HostLayout`) pushes the host's sum, receives the result and
//! publishes it for the others, who copy it out. So a host's link carries
//! one push and one result per chunk, whatever its number of workers.
//!
//! One segment per tensor (`SharedTensor`) holds, per chunk and round
//! parity, a state block and the host's sum (`wire`), plus one buffer for
//! results.
//! Results land apart from the sums so a sum stays intact until its round
//! completes everywhere, and the last result stays until the next one
//! arrives: after a server loss, the owner re-sends the one and restores
//! the other (`scheduler::failover`). Contributions are made by the caller's thread
//! at submit, under a per-chunk lock held for one chunk's add; the pushes
//! and copy-outs are the I/O thread's (`io`), woken by doorbells.
//!
//! A server on the same host (same host identity) maps the segments too
//! and takes the owners' pushes by reference (BytePS §6, shared memory for
//! colocated processes): the push frame names the chunk, the server sums
//! straight from `wire` and writes the result back there, so neither
//! direction copies the data through the loopback socket.
//!
//! Parity double-buffering is safe for the server's reason: a worker
//! contributes to round r+2 only after its round r+1 completed, which needs
//! every local worker's round r+1 contribution, made after their round r
//! completed (copy-out included), so nobody still reads round r's buffer.
//!
//! With `GRADHUB_DETERMINISTIC=1` (`crate::sum_order`) a chunk's contributions
//! are added in local-rank order (`Adding::LocalRank`): one that comes
//! before its turn is copied into its worker's slot of a second segment,
//! which only the host's workers map, and added when every lower local
//! rank's is. One set of slots serves both parities: a worker contributes
//! to round r+1 only after round r completed, which needed (and added)
//! every contribution of round r.
//!
//! CUDA tensors take the torch local stage instead (NCCL reduce-scatter,
//! the own share through the network stage, all-gather:
//! `gradhub/torch/local_stage.py`, docs/architecture.md "GPU data path");
//! the network stage, the ownership rule and the server do not change.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::kernels;
use crate::protocol::{DType, TensorSpec, FLAG_INIT};
use crate::sum_order::{self, SumOrder};
use crate::transport::shm::{Bells, Doorbell, Segment};

/// Most workers one host may have with the host stage (ring masks are u64).
pub const MAX_LOCAL_WORKERS: usize = 64;

const LINE: usize = 64;
// Words of a chunk's state block (one cache line per chunk and parity).
const LOCK: usize = 0;
/// round + 1 of the contributions the buffer holds (0: never used).
const TAG: usize = 4;
const COUNT: usize = 8;
const FLAGS: usize = 12;
/// = TAG once every local worker contributed (the sum is in `wire`).
const READY: usize = 16;
/// = TAG once the result is in `wire`.
const RESULT: usize = 20;
/// In local-rank order: the local rank whose contribution is added next.
const NEXT: usize = 32;
/// Which local workers contributed (bit = local rank; low and high words).
const MASK_LO: usize = 24;
const MASK_HI: usize = 28;
/// Header word: how many workers mapped the segment.
const ATTACHED: usize = 0;

fn tag(round: u32) -> u32 {
    round.wrapping_add(1)
}

fn round_up(n: usize) -> usize {
    n.div_ceil(LINE) * LINE
}

/// Names what a host's processes share, from its host identity.
pub fn host_tag(host: &str) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    host.hash(&mut h);
    h.finish()
}

/// One worker's contribution to a round: its flags, whether its values
/// count (an init round keeps only rank 0's), and its local rank.
#[derive(Clone, Copy)]
struct Part {
    flags: u16,
    write: bool,
    local: usize,
}

/// How a chunk's local contributions are added.
enum Adding {
    /// As they come, under the chunk's lock.
    Arrival,
    /// In local-rank order; one that comes early waits in its worker's slot
    /// of `slots` (local ranks 1.., `slot_bytes` each; local rank 0 never waits).
    LocalRank { slots: Segment, slot_bytes: usize },
}

/// One tensor's shared buffers on this host.
pub struct SharedTensor {
    seg: Segment,
    dtype: DType,
    chunk_elems: usize,
    numel: usize,
    num_chunks: usize,
    /// Contributions that complete a sum: the host's workers.
    local_size: u32,
    /// Offsets of the f32 sum (halves only) and the wire buffer, by parity,
    /// and of the results.
    acc: [usize; 2],
    wire: [usize; 2],
    result: usize,
    adding: Adding,
}

impl SharedTensor {
    /// Map tensor `spec`'s segment on host `host_tag` of job `job_id`.
    /// `mappers`: how many processes map it (the host's workers and its
    /// servers); the last one removes the name, which nobody needs then.
    pub fn open(job_id: u64, host_tag: u64, spec: &TensorSpec, mappers: usize) -> Result<SharedTensor, String> {
        let (len, acc, wire, result) = SharedTensor::layout(spec);
        let name = format!("gradhub-{job_id:016x}-{host_tag:016x}-k{}", spec.key);
        let seg = Segment::open(&name, len).map_err(|e| format!("tensor '{}': {e}", spec.name))?;
        if seg.word(ATTACHED).fetch_add(1, Ordering::AcqRel) as usize + 1 >= mappers {
            seg.unlink();
        }
        Ok(SharedTensor {
            seg,
            dtype: spec.dtype,
            chunk_elems: spec.chunk_elems as usize,
            numel: spec.numel as usize,
            num_chunks: spec.num_chunks(),
            local_size: 0,
            acc,
            wire,
            result,
            adding: Adding::Arrival,
        })
    }

    /// Add contributions in local-rank order, `local_size` workers here:
    /// maps the slots early ones wait in (a segment of the workers only,
    /// so the servers' mapping of the main one does not change).
    fn in_rank_order(&mut self, job_id: u64, host_tag: u64, key: u32, local_size: usize) -> Result<(), String> {
        let slot_bytes = round_up(self.numel * self.dtype.size());
        let name = format!("gradhub-{job_id:016x}-{host_tag:016x}-k{key}-order");
        let slots = Segment::open(&name, LINE + local_size.saturating_sub(1) * slot_bytes)
            .map_err(|e| format!("tensor key {key}: {e}"))?;
        if slots.word(ATTACHED).fetch_add(1, Ordering::AcqRel) as usize + 1 >= local_size {
            slots.unlink();
        }
        self.adding = Adding::LocalRank { slots, slot_bytes };
        Ok(())
    }

    /// The segments' names.
    fn paths(&self) -> Vec<PathBuf> {
        let mut p = vec![self.seg.path.clone()];
        if let Adding::LocalRank { slots, .. } = &self.adding {
            p.push(slots.path.clone());
        }
        p
    }

    /// The segment's name (removed by whoever maps it when leaving, in
    /// case a mapper never came).
    pub fn path(&self) -> &std::path::Path {
        &self.seg.path
    }

    fn layout(spec: &TensorSpec) -> (usize, [usize; 2], [usize; 2], usize) {
        let n = spec.num_chunks();
        let numel = spec.numel as usize;
        let base = LINE + n * 2 * LINE;
        let acc_bytes = if spec.dtype.sums_in_place() { 0 } else { round_up(numel * 4) };
        let wire_bytes = round_up(numel * spec.dtype.size());
        let acc = [base, base + acc_bytes + wire_bytes];
        let wire = [acc[0] + acc_bytes, acc[1] + acc_bytes];
        // f32, f64 and integer sums are made in the wire buffer itself.
        let acc = if spec.dtype.sums_in_place() { wire } else { acc };
        let result = base + 2 * (acc_bytes + wire_bytes);
        (result + wire_bytes, acc, wire, result)
    }

    fn word(&self, chunk: usize, round: u32, w: usize) -> &AtomicU32 {
        self.seg.word(LINE + (chunk * 2 + (round & 1) as usize) * LINE + w)
    }

    fn range(&self, chunk: usize) -> (usize, usize) {
        let a = chunk * self.chunk_elems;
        (a, (a + self.chunk_elems).min(self.numel))
    }

    /// The wire bytes of a chunk in a round: the host's sum its owner pushes.
    pub fn wire(&self, chunk: usize, round: u32) -> (*mut u8, usize) {
        let (a, b) = self.range(chunk);
        let es = self.dtype.size();
        (self.seg.at(self.wire[(round & 1) as usize] + a * es), (b - a) * es)
    }

    /// Where a chunk's result lands (any round: a result is overwritten
    /// only by the next round's, which needs every local worker to have
    /// completed this one, copy-out included).
    pub fn result(&self, chunk: usize) -> (*mut u8, usize) {
        let (a, b) = self.range(chunk);
        let es = self.dtype.size();
        (self.seg.at(self.result + a * es), (b - a) * es)
    }

    /// Whether every local worker contributed this chunk for `round`.
    pub fn ready(&self, chunk: usize, round: u32) -> bool {
        self.word(chunk, round, READY).load(Ordering::Acquire) == tag(round)
    }

    /// Whether the owner published this chunk's result for `round`.
    pub fn has_result(&self, chunk: usize, round: u32) -> bool {
        self.word(chunk, round, RESULT).load(Ordering::Acquire) == tag(round)
    }

    /// The local workers (bit = local rank) whose contribution some chunk of
    /// `round` still waits for (0: every sum is complete).
    pub fn missing(&self, round: u32) -> u64 {
        let all = if self.local_size >= 64 { u64::MAX } else { (1u64 << self.local_size) - 1 };
        let mut missing = 0;
        for c in 0..self.num_chunks {
            if self.ready(c, round) {
                continue;
            }
            if self.word(c, round, TAG).load(Ordering::Acquire) != tag(round) {
                return all; // nobody has contributed to this chunk yet
            }
            let lo = self.word(c, round, MASK_LO).load(Ordering::Relaxed) as u64;
            let hi = self.word(c, round, MASK_HI).load(Ordering::Relaxed) as u64;
            missing |= all & !(lo | hi << 32);
        }
        missing
    }

    /// The result is in `result`: the other local workers may copy it out.
    pub fn publish(&self, chunk: usize, round: u32) {
        self.word(chunk, round, RESULT).store(tag(round), Ordering::Release);
    }

    /// Add this worker's chunk (`src`, the chunk's bytes in the caller's
    /// buffer) to the host's sum for `round`. `write`: false for an init
    /// round's non-source workers, which only count. Returns whether this
    /// completed the sum (so the owner may push it).
    fn contribute(
        &self,
        chunk: usize,
        round: u32,
        src: *const u8,
        part: Part,
        abort: &dyn Fn() -> Option<String>,
    ) -> Result<bool, String> {
        let lock = self.word(chunk, round, LOCK);
        let mut spins = 0u32;
        while lock.compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
            spins = spins.wrapping_add(1);
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // The holder adds one chunk; it may be descheduled (or dead:
                // then the job fails, and `abort` says so).
                std::thread::yield_now();
                if spins.is_multiple_of(1024) {
                    if let Some(why) = abort() {
                        return Err(why);
                    }
                }
            }
        }
        let result = self.add_locked(chunk, round, src, part);
        lock.store(0, Ordering::Release);
        result
    }

    fn add_locked(&self, chunk: usize, round: u32, src: *const u8, part: Part) -> Result<bool, String> {
        let Part { flags, write, local } = part;
        let t = tag(round);
        let (tag_w, count_w, flags_w) =
            (self.word(chunk, round, TAG), self.word(chunk, round, COUNT), self.word(chunk, round, FLAGS));
        let first = tag_w.load(Ordering::Relaxed) != t;
        if first {
            tag_w.store(t, Ordering::Relaxed);
            count_w.store(0, Ordering::Relaxed);
            flags_w.store(flags as u32, Ordering::Relaxed);
            self.word(chunk, round, MASK_LO).store(0, Ordering::Relaxed);
            self.word(chunk, round, MASK_HI).store(0, Ordering::Relaxed);
        } else if flags_w.load(Ordering::Relaxed) != flags as u32 {
            return Err(format!(
                "workers on this host disagree on the round's flags (average/init): {:#x} and {flags:#x}",
                flags_w.load(Ordering::Relaxed)
            ));
        }
        let p = (round & 1) as usize;
        match &self.adding {
            // (An init round has one writer, which overwrites: any order.)
            Adding::LocalRank { slots, slot_bytes } if write && flags & FLAG_INIT == 0 => {
                let next_w = self.word(chunk, round, NEXT);
                if first {
                    next_w.store(0, Ordering::Relaxed);
                }
                let mut next = next_w.load(Ordering::Relaxed) as usize;
                let (a, b) = self.range(chunk);
                let es = self.dtype.size();
                let slot = |l: usize| slots.at(LINE + (l - 1) * slot_bytes + a * es);
                if local == next {
                    self.add_into(chunk, p, src, next == 0);
                    next += 1;
                } else {
                    // SAFETY: the caller's chunk, copied into this worker's
                    // own slot (in the segment, ours under the lock).
                    unsafe { std::ptr::copy_nonoverlapping(src, slot(local), (b - a) * es) };
                }
                // Whoever contributed after `next` waits in its slot (the
                // mask says who contributed; those before `next` are added).
                let lo = self.word(chunk, round, MASK_LO).load(Ordering::Relaxed) as u64;
                let hi = self.word(chunk, round, MASK_HI).load(Ordering::Relaxed) as u64;
                let mask = lo | hi << 32;
                sum_order::add_waiting(&mut next, self.local_size as usize, |l| {
                    let here = mask & (1u64 << l) != 0;
                    if here {
                        self.add_into(chunk, p, slot(l), false);
                    }
                    here
                });
                next_w.store(next as u32, Ordering::Relaxed);
            }
            // An init round has one writer, which overwrites.
            _ if write => self.add_into(chunk, p, src, first || flags & FLAG_INIT != 0),
            _ => {}
        }
        let bit = 1u64 << local;
        self.word(chunk, round, MASK_LO).fetch_or(bit as u32, Ordering::Relaxed);
        self.word(chunk, round, MASK_HI).fetch_or((bit >> 32) as u32, Ordering::Relaxed);
        let count = count_w.load(Ordering::Relaxed) + 1;
        count_w.store(count, Ordering::Relaxed);
        let done = count == self.local_size;
        if done {
            if !self.dtype.sums_in_place() {
                let (a, b) = self.range(chunk);
                let p = (round & 1) as usize;
                // SAFETY: as above; acc and wire do not overlap for halves.
                let (acc, wire) = unsafe {
                    (
                        std::slice::from_raw_parts(self.seg.at(self.acc[p] + a * 4).cast::<f32>(), b - a),
                        std::slice::from_raw_parts_mut(self.seg.at(self.wire[p] + a * 2).cast::<u16>(), b - a),
                    )
                };
                match self.dtype {
                    DType::F16 => kernels::narrow_f16(wire, acc, 1.0),
                    _ => kernels::narrow_bf16(wire, acc, 1.0),
                }
            }
            self.word(chunk, round, READY).store(t, Ordering::Release);
        }
        Ok(done)
    }

    /// Add a contribution (`src`, the chunk's bytes) to the host's sum of
    /// parity `p`; `copy`: it starts the sum (or an init round's writer).
    /// Under the chunk's lock.
    fn add_into(&self, chunk: usize, p: usize, src: *const u8, copy: bool) {
        let (a, b) = self.range(chunk);
        let n = b - a;
        // SAFETY: the chunk's acc range is inside the segment and ours
        // under the lock (4 bytes per element, or the element's own size
        // when summed in place); `src` is the chunk of the caller's buffer.
        let es = if self.dtype.sums_in_place() { self.dtype.size() } else { 4 };
        let acc_at = self.seg.at(self.acc[p] + a * es);
        // SAFETY: as above (f32 sums, and the f32 accumulator of halves).
        let acc_f32 = || unsafe { std::slice::from_raw_parts_mut(acc_at.cast::<f32>(), n) };
        match self.dtype {
            DType::F64 | DType::I32 | DType::I64 => {
                // SAFETY: as above, as bytes; src holds n elements of the dtype.
                let acc = unsafe { std::slice::from_raw_parts_mut(acc_at, n * es) };
                let src = unsafe { std::slice::from_raw_parts(src, n * es) };
                if copy {
                    acc.copy_from_slice(src);
                } else {
                    kernels::add_exact(self.dtype, acc, src);
                }
            }
            DType::F32 => {
                let acc = acc_f32();
                let src = aligned::<f32>(src, n);
                if copy {
                    acc.copy_from_slice(&src);
                } else {
                    kernels::add_f32(acc, &src);
                }
            }
            d => {
                let acc = acc_f32();
                let src = aligned::<u16>(src, n);
                match (d == DType::F16, copy) {
                    (true, true) => kernels::widen_f16(acc, &src),
                    (true, false) => kernels::add_f16(acc, &src),
                    (false, true) => kernels::widen_bf16(acc, &src),
                    (false, false) => kernels::add_bf16(acc, &src),
                }
            }
        }
    }
}

/// The caller's chunk as a slice of `T`, copied if the buffer is not
/// aligned for `T` (a numpy view into bytes may not be).
fn aligned<'a, T: Copy + Default>(src: *const u8, n: usize) -> std::borrow::Cow<'a, [T]>
where
    [T]: ToOwned<Owned = Vec<T>>,
{
    if (src as usize).is_multiple_of(std::mem::align_of::<T>()) {
        // SAFETY: aligned, and the caller's buffer holds n elements here.
        std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(src.cast::<T>(), n) })
    } else {
        let mut v = vec![T::default(); n];
        // SAFETY: copying n elements' bytes into a buffer of n elements.
        unsafe { std::ptr::copy_nonoverlapping(src, v.as_mut_ptr().cast::<u8>(), n * std::mem::size_of::<T>()) };
        std::borrow::Cow::Owned(v)
    }
}

/// Meet the host's other workers and its servers in shared memory, so that
/// all of them map the same segments: fails if they do not all arrive
/// within `timeout` (e.g. they share a host identity but not /dev/shm,
/// which would otherwise leave each with segments of its own).
pub fn rendezvous(job_id: u64, host: &str, workers: &[u32], servers: usize, timeout: Duration) -> Result<(), String> {
    let name = format!("gradhub-{job_id:016x}-{:016x}-join", host_tag(host));
    let seg = Segment::open(&name, LINE).map_err(|e| e.to_string())?;
    seg.word(ATTACHED).fetch_add(1, Ordering::AcqRel);
    let expected = workers.len() + servers;
    let deadline = Instant::now() + timeout;
    loop {
        let n = seg.word(ATTACHED).load(Ordering::Acquire) as usize;
        if n >= expected {
            break;
        }
        if Instant::now() >= deadline {
            seg.unlink();
            let servers = match servers {
                0 => String::new(),
                1 => " and its server".to_string(),
                s => format!(" and its {s} servers"),
            };
            return Err(format!(
                "only {n} of the {} workers (ranks {workers:?}){servers} on host '{host}' reached its shared memory \
                 ({}) within {:.0}s. If they run in separate containers, give each its own GRADHUB_HOST_ID; \
                 or turn host reduction off with GRADHUB_HOST_REDUCE=0",
                workers.len(),
                seg.path.display(),
                timeout.as_secs_f64()
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // Everyone has it mapped: the name is no longer needed.
    seg.unlink();
    Ok(())
}

/// This worker's part in its host's stage.
pub struct HostStage {
    job_id: u64,
    /// Distinguishes hosts that share /dev/shm (emulated hosts, containers).
    host_tag: u64,
    /// Processes that map each tensor segment: the workers and servers here.
    mappers: usize,
    /// The host's workers by local rank, and this worker's index in it.
    pub workers: Vec<u32>,
    pub local: usize,
    /// Rings the host's workers, by local rank (this one included).
    pub bells: Bells,
    pub doorbell: Doorbell,
    tensors: Mutex<HashMap<u32, Arc<SharedTensor>>>,
    /// Segment names this worker opened, removed when it leaves.
    opened: Mutex<Vec<PathBuf>>,
    /// The order contributions are added in (`GRADHUB_DETERMINISTIC`).
    order: SumOrder,
}

/// One of the host's chunks, as its stage sees it.
pub struct Contribution {
    pub chunk: usize,
    /// Every local worker has contributed: its owner may push it.
    pub complete: bool,
}

impl HostStage {
    /// Meet the other workers of this host: each binds its doorbell, then
    /// all map one rendezvous segment. Fails if they do not all arrive
    /// within `timeout` (e.g. they share a host identity but not /dev/shm).
    /// `servers`: how many server processes on this host map its segments.
    pub fn join(
        job_id: u64,
        host: &str,
        workers: Vec<u32>,
        servers: usize,
        rank: u32,
        timeout: Duration,
        order: SumOrder,
    ) -> Result<HostStage, String> {
        let local = workers.iter().position(|&r| r == rank).ok_or("this worker is not on its host's list")?;
        if workers.len() > MAX_LOCAL_WORKERS {
            return Err(format!(
                "{} workers on one host; the host stage handles up to {MAX_LOCAL_WORKERS} (set GRADHUB_HOST_REDUCE=0)",
                workers.len()
            ));
        }
        let host_tag = host_tag(host);
        let doorbell =
            Doorbell::bind(job_id, rank).map_err(|e| format!("cannot bind this worker's doorbell socket: {e}"))?;
        let bells = Bells::new(job_id, &workers).map_err(|e| format!("doorbells: {e}"))?;
        rendezvous(job_id, host, &workers, servers, timeout)?;
        Ok(HostStage {
            job_id,
            host_tag,
            mappers: workers.len() + servers,
            workers,
            local,
            bells,
            doorbell,
            tensors: Mutex::new(HashMap::new()),
            opened: Mutex::new(Vec::new()),
            order,
        })
    }

    /// The tensor's shared buffers (opened on its first round here).
    pub fn tensor(&self, spec: &TensorSpec) -> Result<Arc<SharedTensor>, String> {
        let mut map = self.tensors.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = map.get(&spec.key) {
            return Ok(s.clone());
        }
        let mut st = SharedTensor::open(self.job_id, self.host_tag, spec, self.mappers)?;
        st.local_size = self.workers.len() as u32;
        if self.order.ranks(spec.dtype) {
            st.in_rank_order(self.job_id, self.host_tag, spec.key, self.workers.len())?;
        }
        self.opened.lock().unwrap_or_else(|e| e.into_inner()).extend(st.paths());
        let s = Arc::new(st);
        map.insert(spec.key, s.clone());
        Ok(s)
    }

    /// The tensor's shared buffers, if it had a round here.
    pub fn mapped(&self, key: u32) -> Option<Arc<SharedTensor>> {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned()
    }

    /// Forget a released tensor's segment; it is unmapped when the
    /// returned mapping goes. Its name is normally gone already (every
    /// mapper had mapped it before the tensor's first round completed).
    pub fn forget(&self, key: u32) -> Option<Arc<SharedTensor>> {
        let st = self.tensors.lock().unwrap_or_else(|e| e.into_inner()).remove(&key)?;
        let paths = st.paths();
        for p in &paths {
            let _ = std::fs::remove_file(p);
        }
        self.opened.lock().unwrap_or_else(|e| e.into_inner()).retain(|p| !paths.contains(p));
        Some(st)
    }

    /// Add every chunk of this worker's buffer (`ptr`) to the host's sums
    /// for `round`, in chunk order. `init_source`: for an init round,
    /// whether this worker's values are the ones kept (rank 0's).
    #[allow(clippy::too_many_arguments)]
    pub fn contribute(
        &self,
        tensor: &SharedTensor,
        ptr: *const u8,
        round: u32,
        flags: u16,
        init_source: bool,
        abort: &dyn Fn() -> Option<String>,
        done: &mut dyn FnMut(Contribution),
    ) -> Result<(), String> {
        let part = Part { flags, write: flags & FLAG_INIT == 0 || init_source, local: self.local };
        let es = tensor.dtype.size();
        for c in 0..tensor.num_chunks {
            let (a, _) = tensor.range(c);
            // SAFETY: chunk c starts inside the caller's buffer of numel elements.
            let src = unsafe { ptr.add(a * es) };
            let complete = tensor.contribute(c, round, src, part, abort)?;
            done(Contribution { chunk: c, complete });
        }
        Ok(())
    }

    /// Remove the names of the segments this worker opened (their memory
    /// goes when the last mapping does).
    pub fn cleanup(&self) {
        for p in self.opened.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests;
