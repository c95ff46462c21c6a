//! What a worker pushes and pulls of a tensor: zeros outside its live
//! bytes, no result outside its wanted bytes or inside its own slot, a
//! member tensor summed by its members alone.

use gradhub::client::{Client, Extent, Summed};
use gradhub::protocol::DType;

use crate::client::shutdown_all;
use crate::support::*;

/// In-place push_pull of f32 `buf`, zeros outside bytes `live`.
fn push_pull_live(c: &Client, name: &str, buf: Vec<f32>, live: (usize, usize)) -> Vec<f32> {
    push_pull_extent(c, name, buf, Extent { live: Some(live), ..Extent::default() })
}

/// In-place push_pull of f32 `buf` with `extent`.
fn push_pull_extent(c: &Client, name: &str, buf: Vec<f32>, extent: Extent) -> Vec<f32> {
    push_pull_of(c, name, buf, extent, &[])
}

/// In-place push_pull of f32 `buf` with `extent`, summed over `members` (empty: all).
fn push_pull_of(c: &Client, name: &str, mut buf: Vec<f32>, extent: Extent, members: &[u32]) -> Vec<f32> {
    let nbytes = buf.len() * 4;
    let ptr = buf.as_mut_ptr() as *mut u8;
    // SAFETY: buf lives until the op completes (waited below, or the test fails).
    let op = unsafe {
        c.push_pull_live(ptr, nbytes, DType::F32, name, 0, false, 0, None, extent, Summed { members, sharded: false })
    }
    .unwrap();
    op.wait(Some(IO_TIMEOUT)).unwrap();
    buf
}

#[test]
fn chunks_outside_the_live_bytes_go_as_zeros_and_everything_sums_right() {
    // Without the host stage the chunks wholly outside a worker's rows are
    // header-only pushes of zeros; with it, the host's sum goes whole. The
    // results are the same: every worker's rows, as an allgather.
    for host_reduce in [false, true] {
        let mut cfg = sched_config(3, 2);
        cfg.host_reduce = host_reduce;
        let job = real_job(cfg, &[(1, false), (2, false)]);
        let clients = job.clients(3, 3, 2);
        // 1000 values in chunks of 256 (PARTITION bytes): worker r owns 300r..300r+300 (not on chunk edges).
        let val = |i: usize| (i % 97) as f32 + 1.0;
        let want: Vec<f32> = (0..1000).map(|i| if i < 900 { val(i) } else { 0.0 }).collect();
        std::thread::scope(|s| {
            for c in &clients {
                let want = &want;
                s.spawn(move || {
                    let r = c.rank as usize;
                    let rows = 300 * r..300 * r + 300;
                    let mine: Vec<f32> = (0..1000).map(|i| if rows.contains(&i) { val(i) } else { 0.0 }).collect();
                    for round in 0..3 {
                        let got = push_pull_live(c, "gather", mine.clone(), (rows.start * 4, rows.end * 4));
                        assert_eq!(&got, want, "worker {r} round {round} host_reduce {host_reduce}");
                    }
                    // A broadcast from worker 0: the others push nothing but headers.
                    let b: Vec<f32> = (0..1000).map(|i| if r == 0 { val(i) } else { 0.0 }).collect();
                    let live = if r == 0 { (0, 4000) } else { (0, 0) };
                    let got = push_pull_live(c, "bcast", b, live);
                    assert_eq!(got, (0..1000).map(val).collect::<Vec<_>>(), "worker {r}");
                    // Chunks of 256 values: 0..300 touches chunks 0-1, 300..600 chunks 1-2,
                    // 600..900 chunks 2-3; the rest are zeros, 3 rounds of them, plus the broadcast's.
                    let zeros = c.stats().data.pushed_zeros;
                    let want_zeros = if host_reduce { 0 } else { 3 * 2 + if r == 0 { 0 } else { 4 } };
                    assert_eq!(zeros, want_zeros, "worker {r} host_reduce {host_reduce}");
                    // An all-gather's own slot (`live_is_own`), on chunk edges: 1536
                    // values, worker r's 512r..512r+512, chunks 2r and 2r+1. Their
                    // sums are its own push: they come back as a header (keeping it).
                    let all: Vec<f32> = (0..1536).map(val).collect();
                    let rows = 512 * r..512 * r + 512;
                    let mine: Vec<f32> = (0..1536).map(|i| if rows.contains(&i) { val(i) } else { 0.0 }).collect();
                    let own =
                        Extent { live: Some((rows.start * 4, rows.end * 4)), live_is_own: true, ..Extent::default() };
                    for round in 0..3 {
                        let got = push_pull_extent(c, "gather-own", mine.clone(), own);
                        assert_eq!(got, all, "worker {r} round {round} host_reduce {host_reduce}");
                    }
                    let asked_none = c.stats().data.pushed_no_result;
                    assert_eq!(asked_none, if host_reduce { 0 } else { 3 * 2 }, "worker {r} host_reduce {host_reduce}");
                });
            }
        });
        shutdown_all(clients);
        job.finish_ok();
    }
}

#[test]
fn a_member_tensor_is_summed_by_its_members_alone_beside_the_host_stage() {
    // Four workers on one host (the host stage on), two servers: tensors of
    // the workers {0, 1}, {2, 3} and {1, 3} are pushed by their members
    // alone, each for itself (through sockets, not the host's segment), and
    // sum over them; the others never touch them. A tensor of every worker
    // still goes through the host stage.
    let mut cfg = sched_config(4, 2);
    cfg.host_reduce = true;
    let job = real_job(cfg, &[(1, false), (2, false)]);
    let clients = job.clients(4, 4, 2);
    let sets: [&[u32]; 3] = [&[0, 1], &[2, 3], &[1, 3]];
    let val = |r: u32, i: usize| ((i * (r as usize + 2)) % 53) as f32 - 20.0;
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                let r = c.rank;
                let mine: Vec<&[u32]> = sets.iter().copied().filter(|m| m.contains(&r)).collect();
                for round in 0..3 {
                    for (k, m) in sets.iter().enumerate().filter(|(_, m)| m.contains(&r)) {
                        let buf: Vec<f32> = (0..1000).map(|i| val(r, i) + round as f32).collect();
                        let got = push_pull_of(c, &format!("set{k}"), buf, Extent::default(), m);
                        let want: Vec<f32> =
                            (0..1000).map(|i| m.iter().map(|&q| val(q, i) + round as f32).sum()).collect();
                        assert_eq!(got, want, "worker {r} set {m:?} round {round}");
                    }
                }
                // 1000 values in chunks of 256: 4 pushes a round, by socket.
                let d = c.stats().data;
                assert_eq!((d.pushed_by_socket, d.pushed_by_ref), (3 * 4 * mine.len() as u64, 0), "worker {r}");
                let everyone: Vec<f32> = (0..1000).map(|i| val(r, i)).collect();
                let got = push_pull_extent(c, "all", everyone, Extent::default());
                assert_eq!(got, (0..1000).map(|i| (0..4).map(|q| val(q, i)).sum()).collect::<Vec<f32>>());
                // Members that do not include this worker are refused.
                let other: &[u32] = if r == 0 { &[1, 2] } else { &[0] };
                let mut b = vec![0f32; 4];
                // SAFETY: refused before anything is queued.
                let refused = unsafe {
                    c.push_pull_live(
                        b.as_mut_ptr().cast(),
                        16,
                        DType::F32,
                        "x",
                        0,
                        false,
                        0,
                        None,
                        Extent::default(),
                        Summed { members: other, sharded: false },
                    )
                };
                assert!(refused.is_err_and(|e| e.to_string().contains("must be ascending ranks that include")));
            });
        }
    });
    shutdown_all(clients);
    job.finish_ok();
}

#[test]
fn chunks_outside_the_wanted_bytes_come_back_as_a_header_and_keep_the_push() {
    // A reduce-scatter: every worker pushes all of it and wants its own
    // rows. Without the host stage the chunks wholly outside them are
    // answered by a header only and keep what the worker pushed; the
    // others (its rows' chunks, edges included) hold the sum. With the
    // host stage every chunk comes back summed. A worker that wants
    // nothing (a joined one's zeros) gets only headers.
    for host_reduce in [false, true] {
        let mut cfg = sched_config(3, 2);
        cfg.host_reduce = host_reduce;
        let job = real_job(cfg, &[(1, false), (2, false)]);
        let clients = job.clients(3, 3, 2);
        let val = |r: usize, i: usize| ((i * (r + 3)) % 89) as f32 - 40.0;
        let sum: Vec<f32> = (0..1000).map(|i| (0..3).map(|r| val(r, i)).sum()).collect();
        std::thread::scope(|s| {
            for c in &clients {
                let sum = &sum;
                s.spawn(move || {
                    let r = c.rank as usize;
                    // Rows 300r..300r+300 of chunks of 256 values: 0..300 touches
                    // chunks 0-1, 300..600 chunks 1-2, 600..900 chunks 2-3.
                    let rows = 300 * r..300 * r + 300;
                    let touched = (rows.start / 256)..=((rows.end - 1) / 256);
                    let mine: Vec<f32> = (0..1000).map(|i| val(r, i)).collect();
                    let want = Extent { want: Some((rows.start * 4, rows.end * 4)), ..Extent::default() };
                    for round in 0..3 {
                        let got = push_pull_extent(c, "scatter", mine.clone(), want);
                        for i in 0..1000 {
                            let summed = host_reduce || touched.contains(&(i / 256));
                            let expect = if summed { sum[i] } else { mine[i] };
                            assert_eq!(
                                got[i], expect,
                                "worker {r} round {round} element {i} host_reduce {host_reduce}"
                            );
                        }
                    }
                    // Wanting nothing: every chunk's result is a header (the
                    // buffer keeps its push), and the round still completes.
                    let none = Extent { want: Some((0, 0)), ..Extent::default() };
                    let got = push_pull_extent(c, "nothing", mine.clone(), none);
                    assert_eq!(got, if host_reduce { sum.clone() } else { mine.clone() }, "worker {r}");
                    let asked_none = c.stats().data.pushed_no_result;
                    let want_none = if host_reduce { 0 } else { 3 * (4 - touched.count() as u64) + 4 };
                    assert_eq!(asked_none, want_none, "worker {r} host_reduce {host_reduce}");
                });
            }
        });
        shutdown_all(clients);
        job.finish_ok();
    }
}
