//! How a chunk's pushes become its sum (`Accumulation`): as they arrive,
//! or, with `GRADHUB_DETERMINISTIC=1` (`crate::sum_order`), in the rank order
//! of its pushers whatever order they arrive in. A push that arrives before
//! its turn waits in its pusher's slot (the connection's scratch buffer,
//! taken over, or a pooled copy of a shared chunk) and is added as soon as
//! every lower rank's is: at most one waiting push per pusher, so memory is
//! bounded by the pushes in flight. No sockets here: unit-tested below.

use super::sum::{ChunkBuf, Source};
use crate::protocol::DType;
use crate::sum_order::{self, SumOrder};

/// The chunk's accumulation mode, fixed when it is installed.
pub(super) enum Accumulation {
    /// Added as they arrive (the default, and integer sums, exact anyway).
    Arrival,
    /// Added in rank order.
    RankOrder(InOrder),
}

impl Accumulation {
    /// The mode of a chunk of `dtype` pushed by `pushers` in a job summing in `order`.
    pub fn new(order: SumOrder, dtype: DType, pushers: &[u32]) -> Accumulation {
        if !order.ranks(dtype) {
            return Accumulation::Arrival;
        }
        let mut ranks = pushers.to_vec();
        ranks.sort_unstable();
        let waiting = ranks.iter().map(|_| Waiting::Nothing).collect();
        Accumulation::RankOrder(InOrder { ranks, next: 0, waiting })
    }

    /// Whether `rank`'s push may be received straight into the accumulator
    /// (it is the round's first): in rank order, only the first pusher's.
    pub fn direct_for(&self, rank: u32) -> bool {
        match self {
            Accumulation::Arrival => true,
            Accumulation::RankOrder(o) => o.ranks.first() == Some(&rank),
        }
    }

    /// The round ends without its sum (a restored result completed it, or
    /// the chunk is released or given up): the waiting pushes go.
    pub fn clear(&mut self, pool: &mut Vec<Vec<u32>>) {
        if let Accumulation::RankOrder(o) = self {
            o.clear(pool);
        }
    }
}

/// A pusher's push that came before its turn.
enum Waiting {
    Nothing,
    Data(Vec<u32>),
    Zeros,
}

/// Rank-order bookkeeping: the pushers in rank order, the position of the
/// next one to add, and by position the pushes waiting for their turn.
pub(super) struct InOrder {
    ranks: Vec<u32>,
    next: usize,
    waiting: Vec<Waiting>,
}

/// Which push `InOrder::add` adds: its round parity, pusher, whether it is
/// the round's first to arrive, and the chunk's size and dtype.
#[derive(Clone, Copy)]
pub(super) struct Park {
    pub parity: usize,
    pub rank: u32,
    pub first: bool,
    pub n: usize,
    pub dtype: DType,
}

impl InOrder {
    /// Add `rank`'s push if it is its turn (then every waiting push whose
    /// turn follows), else keep it waiting. `direct`: a push of the first
    /// pusher is being received straight into the accumulator (`Source::Direct`
    /// when it is in).
    pub fn add(
        &mut self,
        buf: &mut ChunkBuf,
        at: Park,
        src: Source,
        direct: &mut bool,
        scratch: &mut Vec<u32>,
        pool: &mut Vec<Vec<u32>>,
    ) {
        if at.first {
            // Nothing of this round is in: none of an earlier one may count.
            self.clear(pool);
        }
        // (`Round::admit` lets only the chunk's pushers push.)
        let Ok(pos) = self.ranks.binary_search(&at.rank) else { return };
        match src {
            // The first pusher's push, received into the accumulator.
            Source::Direct => {
                *direct = false;
                self.next = 1;
            }
            _ if pos == self.next && !*direct => {
                let from = (!matches!(src, Source::Zeros)).then(|| src.data(scratch));
                // SAFETY: the push's data (`Source::data`), n elements of the dtype.
                unsafe { buf.add(at.dtype, at.parity, at.n, pos == 0, from) };
                self.next += 1;
            }
            Source::Zeros => self.waiting[pos] = Waiting::Zeros,
            _ => self.waiting[pos] = Waiting::Data(src.park(at.n * at.dtype.size(), scratch, pool)),
        }
        let waiting = &mut self.waiting;
        sum_order::add_waiting(&mut self.next, waiting.len(), |p| {
            let from = match std::mem::replace(&mut waiting[p], Waiting::Nothing) {
                Waiting::Nothing => return false,
                Waiting::Zeros => None,
                Waiting::Data(v) => Some(v),
            };
            // SAFETY: a parked push holds its n elements, u32-aligned.
            unsafe { buf.add(at.dtype, at.parity, at.n, p == 0, from.as_ref().map(|v| v.as_ptr().cast())) };
            pool.extend(from);
            true
        });
    }

    fn clear(&mut self, pool: &mut Vec<Vec<u32>>) {
        self.next = 0;
        for w in &mut self.waiting {
            if let Waiting::Data(v) = std::mem::replace(w, Waiting::Nothing) {
                pool.push(v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sum_order::{permutations, test_encode as wire, test_values as values};
    use crate::transport::{bytes, cast};

    /// The sum's bytes (for halves, the f32 accumulator's).
    fn sum_bytes(buf: &ChunkBuf, parity: usize) -> Vec<u8> {
        match buf {
            ChunkBuf::F32(b) => bytes(&b[parity]).to_vec(),
            ChunkBuf::Half { acc, .. } => bytes(acc).to_vec(),
            ChunkBuf::Exact(b) => bytes(&b[parity]).to_vec(),
        }
    }

    /// The sum of pushes by `ranks` arriving in `arrival` order (`zeros`:
    /// that rank pushes zeros), each through scratch, or through the
    /// accumulator directly for the first pusher when `direct`.
    fn sum(
        dtype: DType,
        order: SumOrder,
        ranks: &[u32],
        arrival: &[usize],
        zeros: Option<u32>,
        direct: bool,
    ) -> Vec<u8> {
        let n = 37;
        let mut acc = Accumulation::new(order, dtype, ranks);
        let mut buf = ChunkBuf::new(dtype, n);
        let (mut pool, mut in_direct) = (Vec::new(), false);
        // A direct receive starts with the round's first push and completes
        // after every other push arrived (they park behind it).
        let mut steps: Vec<usize> = arrival.to_vec();
        if direct && acc.direct_for(ranks[arrival[0]]) {
            in_direct = true;
            steps.rotate_left(1);
        }
        for (k, &i) in steps.iter().enumerate() {
            let rank = ranks[i];
            let mut scratch = wire(dtype, &values(rank as usize, n));
            let src = match () {
                _ if zeros == Some(rank) => Source::Zeros,
                _ if in_direct && acc.direct_for(rank) => {
                    if let ChunkBuf::F32(b) = &mut buf {
                        b[1].copy_from_slice(cast(&scratch));
                    }
                    Source::Direct
                }
                _ => Source::Scratch,
            };
            let at = Park { parity: 1, rank, first: k == 0, n, dtype };
            match &mut acc {
                Accumulation::RankOrder(o) => o.add(&mut buf, at, src, &mut in_direct, &mut scratch, &mut pool),
                Accumulation::Arrival => {
                    let from = (!matches!(src, Source::Zeros)).then(|| src.data(&scratch));
                    // SAFETY: scratch holds n elements.
                    unsafe { buf.add(dtype, 1, n, k == 0, from) }
                }
            }
        }
        if let Accumulation::RankOrder(o) = &acc {
            assert_eq!(o.next, ranks.len(), "every push added");
            assert!(o.waiting.iter().all(|w| matches!(w, Waiting::Nothing)), "nothing left waiting");
        }
        sum_bytes(&buf, 1)
    }

    #[test]
    fn every_arrival_order_gives_the_rank_order_sum_bit_for_bit() {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for ranks in [&[0u32, 2, 5][..], &[1, 3, 4, 7][..]] {
                let in_rank_order: Vec<usize> = (0..ranks.len()).collect();
                let want = sum(dtype, SumOrder::Arrival, ranks, &in_rank_order, None, false);
                let mut arrival_sums = std::collections::HashSet::new();
                for p in permutations(ranks.len()) {
                    for zeros in [None, Some(ranks[1])] {
                        let got = sum(dtype, SumOrder::Rank, ranks, &p, zeros, false);
                        let want_z = sum(dtype, SumOrder::Arrival, ranks, &in_rank_order, zeros, false);
                        assert_eq!(
                            got,
                            if zeros.is_none() { want.clone() } else { want_z },
                            "{dtype:?} {p:?} {zeros:?}"
                        );
                    }
                    arrival_sums.insert(sum(dtype, SumOrder::Arrival, ranks, &p, None, false));
                }
                // The data is such that the order matters (else the test proves nothing).
                assert!(arrival_sums.len() > 1, "{dtype:?}: every arrival order gave the same sum");
            }
        }
    }

    #[test]
    fn a_direct_first_push_and_pushes_parked_behind_it_keep_rank_order() {
        let ranks = [0u32, 1, 2, 3];
        let want = sum(DType::F32, SumOrder::Arrival, &ranks, &[0, 1, 2, 3], None, false);
        for p in permutations(4) {
            assert_eq!(sum(DType::F32, SumOrder::Rank, &ranks, &p, None, true), want, "{p:?}");
        }
        let acc = Accumulation::new(SumOrder::Rank, DType::F32, &[4, 2]);
        assert!(acc.direct_for(2) && !acc.direct_for(4));
        assert!(Accumulation::new(SumOrder::Arrival, DType::F32, &[4, 2]).direct_for(4));
    }

    #[test]
    fn integers_keep_arrival_order_and_a_cleared_round_returns_its_buffers() {
        assert!(matches!(Accumulation::new(SumOrder::Rank, DType::I64, &[0, 1]), Accumulation::Arrival));
        let mut acc = Accumulation::new(SumOrder::Rank, DType::F32, &[0, 1, 2]);
        let (mut buf, mut pool, mut direct) = (ChunkBuf::new(DType::F32, 4), Vec::new(), false);
        let Accumulation::RankOrder(o) = &mut acc else { panic!("rank order") };
        let mut scratch = vec![0u32; 4];
        o.add(
            &mut buf,
            Park { parity: 0, rank: 2, first: true, n: 4, dtype: DType::F32 },
            Source::Scratch,
            &mut direct,
            &mut scratch,
            &mut pool,
        );
        assert!(scratch.is_empty(), "the parked push took the scratch buffer");
        acc.clear(&mut pool);
        assert_eq!(pool.len(), 1);
    }
}
