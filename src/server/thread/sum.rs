//! A chunk's data: its accumulation and result buffers, and the arithmetic
//! of a round on them (first push, adding pushes, finishing the sum, a
//! restored or relayed result). What the round *is* lives in `round`.

use super::accumulation::{Accumulation, Park};
use super::round::Round;
use crate::kernels;
use crate::protocol::{DType, OptConfig, FLAG_AVERAGE, FLAG_INIT};
use crate::server::optimizer::OptState;
use crate::server::replica;
use crate::transport::{bytes, bytes_mut, cast};

pub(super) enum ChunkBuf {
    F32([Vec<f32>; 2]),
    /// f16/bf16 are accumulated in f32 and narrowed once per round.
    Half {
        acc: Vec<f32>,
        out: [Vec<u16>; 2],
    },
    /// float64 and the integers, summed exactly in their own type: raw
    /// little-endian bytes, 8-aligned (`kernels::add_exact`).
    Exact([Vec<u64>; 2]),
}

impl ChunkBuf {
    /// Zeroed buffers for `elems` elements of `dtype`.
    pub fn new(dtype: DType, elems: usize) -> ChunkBuf {
        match dtype {
            DType::F32 => ChunkBuf::F32([vec![0.0; elems], vec![0.0; elems]]),
            d if d.sums_in_place() => {
                let words = (elems * d.size()).div_ceil(8);
                ChunkBuf::Exact([vec![0; words], vec![0; words]])
            }
            _ => ChunkBuf::Half { acc: vec![0.0; elems], out: [vec![0; elems], vec![0; elems]] },
        }
    }

    /// No memory (a released or given-up chunk).
    pub fn empty() -> ChunkBuf {
        ChunkBuf::F32([Vec::new(), Vec::new()])
    }

    /// Add one push of `n` elements of `dtype` to the sum of `parity`
    /// (`first`: it starts the sum; `from` None: a push of zeros).
    ///
    /// # Safety
    /// `from` points to the push's `n` elements, aligned for `dtype`
    /// (exact sums read bytes, any alignment).
    pub unsafe fn add(&mut self, dtype: DType, parity: usize, n: usize, first: bool, from: Option<*const u8>) {
        let Some(from) = from else {
            if first {
                match self {
                    ChunkBuf::F32(b) => b[parity][..n].fill(0.0),
                    ChunkBuf::Half { acc, .. } => acc[..n].fill(0.0),
                    ChunkBuf::Exact(b) => bytes_mut(&mut b[parity])[..n * dtype.size()].fill(0),
                }
            }
            return;
        };
        match self {
            ChunkBuf::F32(b) => {
                // SAFETY: the caller's promise.
                let src = unsafe { std::slice::from_raw_parts(from.cast::<f32>(), n) };
                match first {
                    true => b[parity].copy_from_slice(src),
                    false => kernels::add_f32(&mut b[parity], src),
                }
            }
            ChunkBuf::Half { acc, .. } => {
                // SAFETY: the caller's promise.
                let src = unsafe { std::slice::from_raw_parts(from.cast::<u16>(), n) };
                match (dtype, first) {
                    (DType::F16, true) => kernels::widen_f16(acc, src),
                    (DType::F16, false) => kernels::add_f16(acc, src),
                    (_, true) => kernels::widen_bf16(acc, src),
                    (_, false) => kernels::add_bf16(acc, src),
                }
            }
            ChunkBuf::Exact(b) => {
                let len = n * dtype.size();
                // SAFETY: the caller's promise (read as bytes).
                let src = unsafe { std::slice::from_raw_parts(from, len) };
                let acc = &mut bytes_mut(&mut b[parity])[..len];
                match first {
                    true => acc.copy_from_slice(src),
                    false => kernels::add_exact(dtype, acc, src),
                }
            }
        }
    }
}

pub(super) struct Chunk {
    pub key: u32,
    pub chunk: u32,
    pub dtype: DType,
    pub elems: usize,
    pub round: Round,
    pub buf: ChunkBuf,
    /// A push is being received straight into the accumulator right now;
    /// pushes that complete meanwhile are parked in `deferred` and added after.
    pub direct_in_progress: bool,
    pub deferred: Vec<Vec<u32>>,
    /// Parameters and optimizer state, for tensors with a server-side optimizer.
    pub opt: Option<Box<OptState>>,
    /// In what order pushes are added (`GRADHUB_DETERMINISTIC`).
    pub order: Accumulation,
    /// An asynchronous chunk's pushers and what they are owed (`delta`);
    /// set by its first push (the init push of an asynchronous tensor).
    pub deltas: Option<Box<super::delta::Deltas>>,
}

/// Where a push's data is, for `Chunk::accumulate`.
#[derive(Clone, Copy)]
pub(super) enum Source {
    /// Already in the accumulator (received there directly).
    Direct,
    /// In the connection's scratch buffer.
    Scratch,
    /// In the host's shared segment, at this address (aligned for the dtype).
    Shared(*const u8),
    /// A push of zeros: nothing to add.
    Zeros,
}

impl Source {
    /// Where the push's data is (scratch or shared; meaningless for
    /// `Direct` and `Zeros`). Scratch is u32-aligned, a shared chunk is
    /// checked aligned for its dtype (`parse_push_ref`).
    pub fn data(self, scratch: &[u32]) -> *const u8 {
        match self {
            Source::Shared(p) => p,
            _ => scratch.as_ptr().cast(),
        }
    }

    /// Keep the push's `len` bytes for later: the connection's scratch
    /// buffer itself (it takes another from the pool for its next push), or
    /// a pooled copy of a shared chunk (so nothing kept points into a host
    /// segment, whose mapping goes with its tensor).
    pub fn park(self, len: usize, scratch: &mut Vec<u32>, pool: &mut Vec<Vec<u32>>) -> Vec<u32> {
        match self {
            Source::Shared(p) => {
                let mut v = pool.pop().unwrap_or_default();
                v.resize(len.div_ceil(4), 0);
                // SAFETY: the shared chunk holds the push's len bytes.
                bytes_mut(&mut v)[..len].copy_from_slice(unsafe { std::slice::from_raw_parts(p, len) });
                v
            }
            _ => std::mem::take(scratch),
        }
    }
}

impl Chunk {
    pub fn bytes(&self) -> usize {
        self.elems * self.dtype.size()
    }

    pub fn result_bytes(&self, parity: usize) -> &[u8] {
        match &self.buf {
            ChunkBuf::F32(b) => bytes(&b[parity]),
            ChunkBuf::Half { out, .. } => bytes(&out[parity]),
            ChunkBuf::Exact(b) => &bytes(&b[parity])[..self.elems * self.dtype.size()],
        }
    }

    /// The result buffer of `parity`, to receive `len` bytes into.
    pub fn result_mut(&mut self, parity: usize, len: usize) -> &mut [u8] {
        match &mut self.buf {
            ChunkBuf::F32(b) => &mut bytes_mut(&mut b[parity])[..len],
            ChunkBuf::Half { out, .. } => &mut bytes_mut(&mut out[parity])[..len],
            ChunkBuf::Exact(b) => &mut bytes_mut(&mut b[parity])[..len],
        }
    }

    /// The accumulator of `parity`, to receive a first push into directly.
    pub fn direct_mut(&mut self, parity: usize, len: usize) -> &mut [u8] {
        match &mut self.buf {
            ChunkBuf::F32(b) => &mut bytes_mut(&mut b[parity])[..len],
            // Never chosen: only f32 chunks are received directly.
            ChunkBuf::Half { acc, .. } => &mut bytes_mut(acc)[..0],
            ChunkBuf::Exact(b) => &mut bytes_mut(&mut b[parity])[..0],
        }
    }

    /// A direct receive into `parity` broke off: rebuild the accumulator
    /// from the pushes parked meanwhile (the next push overwrites it if none).
    pub fn abort_direct(&mut self, parity: usize, pool: &mut Vec<Vec<u32>>) {
        self.direct_in_progress = false;
        let n = self.elems;
        if let ChunkBuf::F32(b) = &mut self.buf {
            for (i, d) in self.deferred.drain(..).enumerate() {
                let src: &[f32] = &cast(&d)[..n];
                if i == 0 {
                    b[parity].copy_from_slice(src);
                } else {
                    kernels::add_f32(&mut b[parity], src);
                }
                pool.push(d);
            }
        }
    }

    /// Add a push from `rank` to the sum of `parity`. `first`: no push of
    /// the round is in yet; `init`: an init round (keeps `init_from`'s push);
    /// `scratch`: the connection's buffer, which a push parked behind a
    /// direct receive (or, in rank order, before its turn) takes over.
    #[allow(clippy::too_many_arguments)]
    pub fn accumulate(
        &mut self,
        parity: usize,
        rank: u32,
        first: bool,
        init: bool,
        src: Source,
        scratch: &mut Vec<u32>,
        pool: &mut Vec<Vec<u32>>,
    ) {
        // (An init round keeps one push, whatever the order.)
        if let Accumulation::RankOrder(o) = &mut self.order {
            if !init {
                let at = Park { parity, rank, first, n: self.elems, dtype: self.dtype };
                return o.add(&mut self.buf, at, src, &mut self.direct_in_progress, scratch, pool);
            }
        }
        let n = self.elems;
        let (zeros, direct) = (matches!(src, Source::Zeros), matches!(src, Source::Direct));
        let from = src.data(scratch);
        match &mut self.buf {
            // (While a first push is still arriving straight into the sum, that push sets it.)
            _ if zeros && (!first || self.direct_in_progress) => {}
            ChunkBuf::F32(b) if init => {
                if rank == self.round.init_from {
                    // SAFETY: a push's data is n aligned f32s (see `Source::data`).
                    b[parity].copy_from_slice(unsafe { std::slice::from_raw_parts(from.cast::<f32>(), n) });
                }
            }
            ChunkBuf::F32(b) if direct || self.direct_in_progress => {
                if direct {
                    self.direct_in_progress = false;
                    for d in self.deferred.drain(..) {
                        kernels::add_f32(&mut b[parity], &cast(&d)[..n]);
                        pool.push(d);
                    }
                } else {
                    // The accumulator is still being filled from the network.
                    self.deferred.push(src.park(n * 4, scratch, pool));
                }
            }
            // SAFETY: the push's data is at `from` (or it is zeros).
            buf => unsafe { buf.add(self.dtype, parity, n, first, (!zeros).then_some(from)) },
        }
    }

    /// A relay's sum of `parity`, to travel in the tensor's dtype: 16-bit
    /// sums are rounded once more.
    pub fn narrow_for_owner(&mut self, parity: usize) {
        if let ChunkBuf::Half { acc, out } = &mut self.buf {
            match self.dtype {
                DType::F16 => kernels::narrow_f16(&mut out[parity], acc, 1.0),
                _ => kernels::narrow_bf16(&mut out[parity], acc, 1.0),
            }
        }
    }

    /// A restored result of round parity `parity` (`src`: its bytes).
    pub fn write_result(&mut self, parity: usize, src: &[u8]) {
        match &mut self.buf {
            ChunkBuf::F32(b) => bytes_mut(&mut b[parity]).copy_from_slice(src),
            ChunkBuf::Half { out, .. } => bytes_mut(&mut out[parity]).copy_from_slice(src),
            ChunkBuf::Exact(b) => bytes_mut(&mut b[parity])[..src.len()].copy_from_slice(src),
        }
    }

    /// Every push of the owner's round is in: average over the job's `nw`
    /// workers if the round says so, narrow 16-bit sums, and, with a server-side
    /// optimizer (`opt`), make the result the updated parameters (an init
    /// round: rank 0's parameters and fresh state). Returns what its
    /// replica must apply too (`super::replica`), if it has one.
    pub fn finish(&mut self, nw: u32, opt: Option<&OptConfig>, ns: u32) -> Option<(u32, Vec<u8>)> {
        let parity = self.round.parity();
        let average = self.round.flags & FLAG_AVERAGE != 0;
        let scale = if average { 1.0 / nw as f32 } else { 1.0 };
        let at = (self.key, self.chunk, self.round.number());
        let (flags, replica) = (self.round.flags, self.round.replica());
        match &mut self.buf {
            ChunkBuf::F32(b) if flags & FLAG_INIT != 0 => {
                // New parameters (rank 0's); fresh optimizer state.
                self.opt = Some(Box::new(OptState::new(&b[parity])));
                replica.map(|s| (s, replica::replicate_frame(ns, at, FLAG_INIT, &b[parity])))
            }
            ChunkBuf::F32(b) => {
                if scale != 1.0 {
                    kernels::scale_f32(&mut b[parity], scale);
                }
                // Server-side optimizer: the result is the updated parameters.
                let (Some(cfg), Some(state)) = (opt, self.opt.as_mut()) else { return None };
                let forward = replica.map(|s| (s, replica::replicate_frame(ns, at, 0, &b[parity])));
                state.update(cfg, &b[parity]);
                b[parity].copy_from_slice(&state.param);
                forward
            }
            ChunkBuf::Half { acc, out } => {
                match self.dtype {
                    DType::F16 => kernels::narrow_f16(&mut out[parity], acc, scale),
                    _ => kernels::narrow_bf16(&mut out[parity], acc, scale),
                }
                None
            }
            // Integers are never averaged here (refused in check_push).
            ChunkBuf::Exact(b) if self.dtype == DType::F64 && average => {
                kernels::scale_f64(bytes_mut(&mut b[parity]), 1.0 / nw as f64);
                None
            }
            ChunkBuf::Exact(_) => None,
        }
    }
}
