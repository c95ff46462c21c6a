//! The host stage's unit tests: sums, parities, flags, rank order, failures.

use super::*;
use half::f16;

fn job_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

/// The stages of `n` workers of one host, joined concurrently.
fn stages(n: u32) -> Vec<HostStage> {
    stages_adding(n, SumOrder::Arrival)
}

fn stages_adding(n: u32, order: SumOrder) -> Vec<HostStage> {
    // A job of its own each (tests run at once in one process).
    static JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = job_id() ^ (JOBS.fetch_add(1, Ordering::Relaxed) << 40);
    let ranks: Vec<u32> = (0..n).collect();
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let ranks = ranks.clone();
            std::thread::spawn(move || HostStage::join(id, "h", ranks, 0, r, Duration::from_secs(10), order).unwrap())
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn spec(numel: u64, dtype: DType) -> TensorSpec {
    let chunk_elems = 100;
    let n = numel.div_ceil(chunk_elems) as usize;
    TensorSpec {
        key: 3,
        name: "t".into(),
        numel,
        dtype,
        chunk_elems,
        slots: vec![0; n],
        replicas: Vec::new(),
        relays: Vec::new(),
        members: Vec::new(),
    }
}

#[test]
fn sums_complete_with_the_last_contribution_and_rounds_alternate_buffers() {
    let st = stages(3);
    let sp = spec(250, DType::F32);
    let seg: Vec<Arc<SharedTensor>> = st.iter().map(|h| h.tensor(&sp).unwrap()).collect();
    let never = || None;
    for round in 0..4u32 {
        let mut completed = Vec::new();
        for (l, h) in st.iter().enumerate() {
            let v: Vec<f32> = (0..250).map(|i| (i as f32 + 1.0) * (l + 1) as f32 + round as f32).collect();
            assert_eq!(seg[l].missing(round), if l == 0 { 0b111 } else { 0b111 & !((1 << l) - 1) });
            h.contribute(&seg[l], v.as_ptr().cast(), round, 0, l == 0, &never, &mut |c| {
                if c.complete {
                    completed.push((l, c.chunk));
                }
            })
            .unwrap();
        }
        // Only the last worker's contributions complete the three chunks.
        assert_eq!(completed, vec![(2, 0), (2, 1), (2, 2)], "round {round}");
        assert_eq!(seg[0].missing(round), 0);
        for c in 0..3 {
            assert!(seg[1].ready(c, round) && !seg[1].has_result(c, round));
            let (p, len) = seg[0].wire(c, round);
            let (a, b) = (c * 100, (c * 100 + 100).min(250));
            assert_eq!(len, (b - a) * 4);
            // SAFETY: the chunk's wire bytes, f32-aligned in the mapping.
            let got = unsafe { std::slice::from_raw_parts(p.cast::<f32>(), b - a) };
            let want: Vec<f32> = (a..b).map(|i| (i as f32 + 1.0) * 6.0 + 3.0 * round as f32).collect();
            assert_eq!(got, &want[..]);
            seg[0].publish(c, round);
            assert!(seg[2].has_result(c, round) && !seg[2].has_result(c, round + 1));
        }
    }
    for h in &st {
        h.cleanup();
    }
}

/// The host's sum (for halves, its f32 accumulator) of `n` workers
/// contributing in each order of `orders`, one round each.
fn host_sums(dtype: DType, n: u32, order: SumOrder, orders: &[Vec<usize>]) -> Vec<Vec<u8>> {
    let st = stages_adding(n, order);
    let sp = spec(250, dtype);
    let seg: Vec<Arc<SharedTensor>> = st.iter().map(|h| h.tensor(&sp).unwrap()).collect();
    let data: Vec<Vec<u32>> =
        (0..n as usize).map(|l| crate::sum_order::test_encode(dtype, &crate::sum_order::test_values(l, 250))).collect();
    let never = || None;
    let mut sums = Vec::new();
    for (round, arrival) in orders.iter().enumerate() {
        let round = round as u32;
        for &l in arrival {
            st[l].contribute(&seg[l], data[l].as_ptr().cast(), round, 0, l == 0, &never, &mut |_| {}).unwrap();
        }
        let s = &seg[0];
        assert!((0..3).all(|c| s.ready(c, round)), "every chunk summed");
        let es = if dtype.sums_in_place() { dtype.size() } else { 4 };
        // SAFETY: the whole tensor's accumulator of the round's parity.
        sums.push(unsafe { std::slice::from_raw_parts(s.seg.at(s.acc[(round & 1) as usize]), 250 * es) }.to_vec());
    }
    for h in &st {
        h.cleanup();
    }
    sums
}

#[test]
fn in_rank_order_every_arrival_order_gives_the_rank_order_sum() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for n in [3u32, 4] {
            let orders = crate::sum_order::permutations(n as usize);
            let want = host_sums(dtype, n, SumOrder::Arrival, &orders[..1]).remove(0);
            assert_eq!(orders[0], (0..n as usize).collect::<Vec<_>>());
            for (k, got) in host_sums(dtype, n, SumOrder::Rank, &orders).iter().enumerate() {
                assert!(got == &want, "{dtype:?}, {n} workers in order {:?}", orders[k]);
            }
            // The data is such that the order matters (else the test proves nothing).
            let arrival: std::collections::HashSet<_> =
                host_sums(dtype, n, SumOrder::Arrival, &orders).into_iter().collect();
            assert!(arrival.len() > 1, "{dtype:?}: every arrival order gave the same sum");
        }
    }
}

#[test]
fn halves_are_summed_in_f32_and_rounded_once_per_host() {
    let st = stages(2);
    let sp = spec(10, DType::F16);
    let seg: Vec<Arc<SharedTensor>> = st.iter().map(|h| h.tensor(&sp).unwrap()).collect();
    // 2048 + 1 + 1 in f16 steps would stay 2048; summed in f32 it is 2050.
    let a: Vec<u16> = (0..10).map(|i| f16::from_f32(if i == 0 { 2048.0 } else { i as f32 }).to_bits()).collect();
    let b: Vec<u16> = (0..10).map(|i| f16::from_f32(if i == 0 { 2.0 } else { 0.5 }).to_bits()).collect();
    let never = || None;
    st[0].contribute(&seg[0], a.as_ptr().cast(), 0, 0, true, &never, &mut |_| {}).unwrap();
    st[1].contribute(&seg[1], b.as_ptr().cast(), 0, 0, false, &never, &mut |_| {}).unwrap();
    let (p, len) = seg[0].wire(0, 0);
    assert_eq!(len, 20);
    // SAFETY: the chunk's wire bytes, u16-aligned.
    let got: Vec<f32> = unsafe { std::slice::from_raw_parts(p.cast::<u16>(), 10) }
        .iter()
        .map(|&x| f16::from_bits(x).to_f32())
        .collect();
    assert_eq!(got[0], 2050.0);
    assert_eq!(&got[1..4], &[1.5, 2.5, 3.5]);
    for h in &st {
        h.cleanup();
    }
}

#[test]
fn disagreeing_flags_and_init_rounds() {
    let st = stages(2);
    let sp = spec(150, DType::F32);
    let seg: Vec<Arc<SharedTensor>> = st.iter().map(|h| h.tensor(&sp).unwrap()).collect();
    let never = || None;
    let x = vec![5.0f32; 150];
    let y = vec![7.0f32; 150];
    // Init: only the source's values are kept, whoever comes first.
    st[1].contribute(&seg[1], y.as_ptr().cast(), 0, FLAG_INIT, false, &never, &mut |_| {}).unwrap();
    st[0].contribute(&seg[0], x.as_ptr().cast(), 0, FLAG_INIT, true, &never, &mut |_| {}).unwrap();
    // SAFETY: chunk 0's wire bytes.
    assert!(unsafe { std::slice::from_raw_parts(seg[0].wire(0, 0).0.cast::<f32>(), 100) }.iter().all(|&v| v == 5.0));
    // Round 1: the second contributor asks for an average, the first did not.
    st[0].contribute(&seg[0], x.as_ptr().cast(), 1, 0, true, &never, &mut |_| {}).unwrap();
    let err = st[1]
        .contribute(&seg[1], y.as_ptr().cast(), 1, crate::protocol::FLAG_AVERAGE, false, &never, &mut |_| {})
        .unwrap_err();
    assert!(err.contains("disagree"), "{err}");
    for h in &st {
        h.cleanup();
    }
}

#[test]
fn a_worker_that_never_arrives_is_a_clear_error() {
    let err = HostStage::join(job_id() ^ 1, "lonely", vec![0, 1], 0, 0, Duration::from_millis(200), SumOrder::Arrival)
        .err()
        .unwrap();
    assert!(err.contains("only 1 of the 2 workers") && err.contains("GRADHUB_HOST_ID"), "{err}");
}

#[test]
fn a_server_that_does_not_share_the_workers_memory_is_a_clear_error() {
    // Both workers arrive; the server that shares their host identity does not
    // (e.g. another container): it would map segments of its own.
    let id = job_id() ^ 2;
    let t = Duration::from_millis(300);
    let other = std::thread::spawn(move || rendezvous(id, "h", &[0, 1], 1, t));
    let err = rendezvous(id, "h", &[0, 1], 1, t).unwrap_err();
    assert!(err.contains("only 2 of the 2 workers (ranks [0, 1]) and its server on host 'h'"), "{err}");
    assert!(other.join().unwrap().is_err());
    // With it, everyone gets through.
    let id = job_id() ^ 3;
    let w = std::thread::spawn(move || rendezvous(id, "h", &[0], 1, Duration::from_secs(10)));
    rendezvous(id, "h", &[0], 1, Duration::from_secs(10)).unwrap();
    w.join().unwrap().unwrap();
}

#[test]
fn a_lock_held_by_a_lost_worker_gives_way_to_the_jobs_failure() {
    let st = stages(2);
    let sp = spec(10, DType::F32);
    let seg = st[0].tensor(&sp).unwrap();
    // A worker that died holding chunk 0's lock.
    seg.word(0, 0, LOCK).store(1, Ordering::Release);
    let failed = || Some("worker 1 was lost".to_string());
    let x = [1.0f32; 10];
    let err = st[0].contribute(&seg, x.as_ptr().cast(), 0, 0, true, &failed, &mut |_| {}).unwrap_err();
    assert_eq!(err, "worker 1 was lost");
    for h in &st {
        h.cleanup();
    }
}
