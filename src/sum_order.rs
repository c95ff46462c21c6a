//! Deterministic sums (`GRADHUB_DETERMINISTIC`): the job-wide order in which
//! a reduction adds its contributions, and the one rule every stage that
//! sums (a server thread's chunk round, a host stage's chunk) follows with
//! it. Float addition is not associative, so a sum made in arrival order
//! differs in its last bits from run to run; made in rank order it is the
//! same every time. Integers wrap, which is exact in any order, so they keep
//! the arrival order either way.

use crate::protocol::DType;
use crate::settings::{self, defaults};

/// The order a reduction adds the contributions of its workers in: the
/// same on every worker and server of a job (the scheduler refuses a
/// member whose setting differs, `scheduler::membership`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SumOrder {
    /// As they arrive: nothing waits (the default).
    #[default]
    Arrival,
    /// In rank order, whatever order they arrive in: a contribution that
    /// comes before its turn waits in a buffer of its own until every
    /// lower rank's is added, so results are bitwise identical run after run.
    Rank,
}

impl SumOrder {
    /// `GRADHUB_DETERMINISTIC`'s value.
    pub fn deterministic(on: bool) -> SumOrder {
        if on {
            SumOrder::Rank
        } else {
            SumOrder::Arrival
        }
    }

    /// `GRADHUB_DETERMINISTIC`: the order sums add contributions in, for a
    /// role whose config was not given it (the Python bindings'
    /// constructors); a malformed value is a warning and the default.
    pub fn from_env() -> SumOrder {
        let on = settings::read_flag("GRADHUB_DETERMINISTIC").unwrap_or_else(|e| {
            log::warn!("{e}; using {}", u8::from(defaults::DETERMINISTIC));
            None
        });
        SumOrder::deterministic(on.unwrap_or(defaults::DETERMINISTIC))
    }

    pub fn is_deterministic(self) -> bool {
        self == SumOrder::Rank
    }

    /// Whether sums of `dtype` are made in rank order: floats only (integer
    /// sums wrap, the same in any order).
    pub fn ranks(self, dtype: DType) -> bool {
        self == SumOrder::Rank && !dtype.is_integer()
    }

    pub fn to_u8(self) -> u8 {
        self as u8
    }

    pub fn from_u8(v: u8) -> Option<SumOrder> {
        match v {
            0 => Some(SumOrder::Arrival),
            1 => Some(SumOrder::Rank),
            _ => None,
        }
    }
}

/// Add the contributions waiting for their turn: `next` is the position
/// (in rank order) of the next one to add, `len` how many there are, and
/// `add(p)` adds position p's if it is there (false: not yet, stop). Each
/// stage keeps the waiting ones its own way (a server thread in pooled
/// buffers, a host stage in shared memory); this is the order they follow.
pub fn add_waiting(next: &mut usize, len: usize, mut add: impl FnMut(usize) -> bool) {
    while *next < len && add(*next) {
        *next += 1;
    }
}

/// Every order of `n` items (Heap's algorithm), for the tests that check a
/// sum made in rank order does not depend on the arrival order.
#[cfg(test)]
pub fn permutations(n: usize) -> Vec<Vec<usize>> {
    fn heap(k: usize, a: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if k <= 1 {
            out.push(a.clone());
            return;
        }
        for i in 0..k {
            heap(k - 1, a, out);
            let j = if k.is_multiple_of(2) { i } else { 0 };
            a.swap(j, k - 1);
        }
    }
    let mut out = Vec::new();
    heap(n, &mut (0..n).collect(), &mut out);
    out
}

/// Values whose float sum depends on the order: magnitudes 1e-4..5e4 (f16 holds them),
/// signs mixed (tests).
#[cfg(test)]
pub fn test_values(rank: usize, n: usize) -> Vec<f64> {
    (0..n).map(|i| (((rank * 7 + i * 13) % 11) as f64 - 5.0) * 10f64.powi(((rank + i) % 5) as i32 * 2 - 4)).collect()
}

/// `v` as elements of `dtype`, in a u32 buffer (as a server's scratch is) (tests).
#[cfg(test)]
pub fn test_encode(dtype: DType, v: &[f64]) -> Vec<u32> {
    use half::{bf16, f16};
    let b: Vec<u8> = match dtype {
        DType::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        DType::F64 => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|&x| f16::from_f64(x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|&x| bf16::from_f64(x).to_le_bytes()).collect(),
    };
    let mut out = vec![0u32; b.len().div_ceil(4)];
    crate::transport::bytes_mut(&mut out)[..b.len()].copy_from_slice(&b);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_contributions_are_added_up_to_the_first_missing_one() {
        let here = [true, true, false, true];
        let mut added = Vec::new();
        let mut next = 0;
        add_waiting(&mut next, 4, |p| {
            here[p] && {
                added.push(p);
                true
            }
        });
        assert_eq!((next, added), (2, vec![0, 1]));
    }

    #[test]
    fn orders_round_trip_and_integers_keep_arrival_order() {
        for o in [SumOrder::Arrival, SumOrder::Rank] {
            assert_eq!(SumOrder::from_u8(o.to_u8()), Some(o));
        }
        assert_eq!(SumOrder::from_u8(2), None);
        assert!(SumOrder::Rank.ranks(DType::F64) && SumOrder::Rank.ranks(DType::BF16));
        assert!(!SumOrder::Rank.ranks(DType::I64) && !SumOrder::Arrival.ranks(DType::F32));
        let p = permutations(4);
        assert_eq!(p.len(), 24);
        assert_eq!(p.iter().collect::<std::collections::HashSet<_>>().len(), 24);
    }
}
