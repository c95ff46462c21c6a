//! The host stage: workers that share a host identity sum in shared memory
//! and push one share each. Real scheduler, servers and clients; each
//! client is put on a host by name (`ClientConfig::host`).

use gradhub::client::Client;
use gradhub::protocol::{DType, DeclEntry, FLAG_AVERAGE, FLAG_INIT};
use half::{bf16, f16};

use crate::support::*;

/// A job whose worker `r` runs on host `hosts[r]`; clients sorted by rank.
/// Colocated servers go to the workers' hosts in order of first appearance
/// (so their host's owners push to them by reference); CPU-only servers
/// run on hosts of their own.
fn host_job(hosts: &[&str], servers: &[(usize, bool)], reduce: bool) -> (RealJob, Vec<Client>) {
    host_job_shm(hosts, servers, reduce, true)
}

fn server_hosts(hosts: &[&str], servers: &[(usize, bool)]) -> Vec<Option<String>> {
    let mut distinct: Vec<&str> = Vec::new();
    for h in hosts {
        if !distinct.contains(h) {
            distinct.push(h);
        }
    }
    let mut next = 0;
    servers
        .iter()
        .enumerate()
        .map(|(i, &(_, colocated))| {
            Some(if colocated {
                next += 1;
                distinct[(next - 1) % distinct.len()].to_string()
            } else {
                format!("cpu-{i}")
            })
        })
        .collect()
}

fn host_job_shm(hosts: &[&str], servers: &[(usize, bool)], reduce: bool, shm: bool) -> (RealJob, Vec<Client>) {
    let (nw, ns) = (hosts.len() as u32, servers.len() as u32);
    let mut cfg = sched_config(nw, ns);
    cfg.host_reduce = reduce;
    let job = real_job_on(cfg, servers, &server_hosts(hosts, servers));
    let pending: Vec<_> = hosts
        .iter()
        .enumerate()
        .map(|(r, h)| {
            let mut c = client_config(job.addr, r as i32, nw, ns);
            c.host = Some(h.to_string());
            c.server_shm = shm;
            spawn_client(c)
        })
        .collect();
    let clients: Vec<Client> = pending.into_iter().map(|p| p.join()).collect();
    for (r, c) in clients.iter().enumerate() {
        assert_eq!(c.rank, r as u32);
        assert_eq!(c.local_size as usize, hosts.iter().filter(|h| **h == hosts[r]).count());
    }
    (job, clients)
}

fn finish(job: RealJob, clients: Vec<Client>) {
    for c in &clients {
        assert!(c.failure().is_none(), "worker {}: {:?}", c.rank, c.failure());
        c.shutdown();
    }
    job.finish_ok();
}

/// Values every dtype holds exactly, and whose sums over a few workers it
/// holds exactly too, so any order of summation gives the same bits.
fn v(rank: u32, i: usize) -> f32 {
    ((i % 16) as f32 - 8.0) * (rank + 1) as f32 * 0.5
}

/// Every worker runs rounds of tensors of several sizes (0 elements, part
/// of a chunk, one chunk, many chunks over every server thread) in f32,
/// f16 and bf16, plain and averaged, and checks each result element by
/// element against the sum over all workers.
///
/// Owners push to a server on their own host by reference (unless `shm`
/// is off), to every other server through sockets.
fn exact_sums(hosts: &[&str], servers: &[(usize, bool)], reduce: bool) {
    exact_sums_shm(hosts, servers, reduce, true)
}

fn exact_sums_shm(hosts: &[&str], servers: &[(usize, bool)], reduce: bool, shm: bool) {
    let nw = hosts.len() as u32;
    let (job, clients) = host_job_shm(hosts, servers, reduce, shm);
    let sizes = [0usize, 3, 256, 1000, 7001];
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                for &n in &sizes {
                    let sum: Vec<f32> = (0..n).map(|i| (0..nw).map(|r| v(r, i)).sum()).collect();
                    for round in 0..3 {
                        let flags = if round == 1 { FLAG_AVERAGE } else { 0 };
                        let scale = if round == 1 { 1.0 / nw as f32 } else { 1.0 };
                        let mine: Vec<f32> = (0..n).map(|i| v(c.rank, i)).collect();
                        let got = push_pull(c, &format!("f32-{n}"), mine, DType::F32, flags, round).unwrap();
                        let want: Vec<f32> = sum.iter().map(|x| x * scale).collect();
                        assert_eq!(got, want, "worker {} f32 size {n} round {round}", c.rank);

                        let mine: Vec<u16> = (0..n).map(|i| f16::from_f32(v(c.rank, i)).to_bits()).collect();
                        let got = push_pull(c, &format!("f16-{n}"), mine, DType::F16, flags, 0).unwrap();
                        let want: Vec<u16> = sum.iter().map(|x| f16::from_f32(x * scale).to_bits()).collect();
                        assert_eq!(got, want, "worker {} f16 size {n} round {round}", c.rank);

                        let mine: Vec<u16> = (0..n).map(|i| bf16::from_f32(v(c.rank, i)).to_bits()).collect();
                        let got = push_pull(c, &format!("bf16-{n}"), mine, DType::BF16, flags, 0).unwrap();
                        let want: Vec<u16> = sum.iter().map(|x| bf16::from_f32(x * scale).to_bits()).collect();
                        assert_eq!(got, want, "worker {} bf16 size {n} round {round}", c.rank);

                        // float64 beyond float32's precision (2^40 + small), summed exactly.
                        let big = |r: u32, i: usize| (1u64 << 40) as f64 + v(r, i) as f64;
                        let mine: Vec<f64> = (0..n).map(|i| big(c.rank, i)).collect();
                        let got = push_pull(c, &format!("f64-{n}"), mine, DType::F64, flags, 0).unwrap();
                        let scale64 = if round == 1 { 1.0 / nw as f64 } else { 1.0 };
                        let want: Vec<f64> =
                            (0..n).map(|i| (0..nw).map(|r| big(r, i)).sum::<f64>() * scale64).collect();
                        assert_eq!(got, want, "worker {} f64 size {n} round {round}", c.rank);

                        // Integers near their limits: summed exactly, wrapping as torch's do.
                        let wide = |r: u32, i: usize| i64::MAX / 2 + (v(r, i) * 2.0) as i64;
                        let mine: Vec<i64> = (0..n).map(|i| wide(c.rank, i)).collect();
                        let got = push_pull(c, &format!("i64-{n}"), mine, DType::I64, 0, 0).unwrap();
                        let want: Vec<i64> =
                            (0..n).map(|i| (0..nw).fold(0i64, |a, r| a.wrapping_add(wide(r, i)))).collect();
                        assert_eq!(got, want, "worker {} i64 size {n} round {round}", c.rank);
                        let narrow = |r: u32, i: usize| i32::MAX / 2 + (v(r, i) * 2.0) as i32;
                        let mine: Vec<i32> = (0..n).map(|i| narrow(c.rank, i)).collect();
                        let got = push_pull(c, &format!("i32-{n}"), mine, DType::I32, 0, 0).unwrap();
                        let want: Vec<i32> =
                            (0..n).map(|i| (0..nw).fold(0i32, |a, r| a.wrapping_add(narrow(r, i)))).collect();
                        assert_eq!(got, want, "worker {} i32 size {n} round {round}", c.rank);
                    }
                }
            });
        }
    });
    let placed = server_hosts(hosts, servers);
    for h in hosts {
        let on_h: Vec<&Client> = clients.iter().filter(|c| hosts[c.rank as usize] == *h).collect();
        let by_ref: u64 = on_h.iter().map(|c| c.stats().data.pushed_by_ref).sum();
        let by_socket: u64 = on_h.iter().map(|c| c.stats().data.pushed_by_socket).sum();
        let shares = placed.iter().any(|p| p.as_deref() == Some(*h));
        if shm && reduce && on_h.len() > 1 && shares {
            assert!(by_ref > 0, "host {h}: no push by reference ({by_socket} through sockets)");
        } else {
            assert_eq!(by_ref, 0, "host {h}: pushed by reference without a server sharing its memory");
        }
        assert!(by_ref + by_socket > 0, "host {h} pushed nothing");
    }
    finish(job, clients);
}

#[test]
fn server_shm_off_pushes_through_sockets() {
    exact_sums_shm(&["a", "a", "a", "b", "b"], &[(1, true), (2, true)], true, false);
}

#[test]
fn two_workers_on_one_host() {
    exact_sums(&["a", "a"], &[(2, false)], true);
}

#[test]
fn three_workers_on_one_host_and_colocated_servers() {
    exact_sums(&["a", "a", "a"], &[(1, true), (2, true)], true);
}

#[test]
fn two_hosts_of_four_with_cpu_only_servers() {
    exact_sums(&["a", "a", "a", "a", "b", "b", "b", "b"], &[(1, true), (1, true), (2, false)], true);
}

#[test]
fn uneven_hosts_three_and_one() {
    exact_sums(&["a", "b", "a", "a"], &[(2, true), (1, true)], true);
}

#[test]
fn interleaved_hosts_and_a_lone_worker() {
    exact_sums(&["b", "a", "c", "a", "b"], &[(1, false), (1, true)], true);
}

#[test]
fn host_reduction_off_on_shared_hosts() {
    exact_sums(&["a", "a", "b"], &[(2, false)], false);
}

#[test]
fn init_round_keeps_rank_0s_values_through_the_host_stage() {
    // Rank 0 shares host b with rank 2; host a's owners push values the server must ignore.
    let (job, clients) = host_job(&["b", "a", "b", "a"], &[(2, false)], true);
    let n = 3000;
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                let mine: Vec<f32> = (0..n).map(|i| v(c.rank, i) + 100.0 * c.rank as f32).collect();
                let got = push_pull(c, "params", mine, DType::F32, FLAG_INIT, 0).unwrap();
                let want: Vec<f32> = (0..n).map(|i| v(0, i)).collect();
                assert_eq!(got, want, "worker {}", c.rank);
                // The next (gradient) round sums as usual.
                let mine: Vec<f32> = (0..n).map(|i| v(c.rank, i)).collect();
                let got = push_pull(c, "params", mine, DType::F32, 0, 0).unwrap();
                let want: Vec<f32> = (0..n).map(|i| (0..4).map(|r| v(r, i)).sum()).collect();
                assert_eq!(got, want, "worker {}", c.rank);
            });
        }
    });
    finish(job, clients);
}

#[test]
fn many_tensors_in_flight_with_priorities_on_shared_hosts() {
    let (job, clients) = host_job(&["a", "a", "a", "b", "b"], &[(2, false), (1, true)], true);
    let sizes: Vec<usize> = (0..24).map(|t| 1 + (t * 997) % 4000).collect();
    std::thread::scope(|s| {
        for c in &clients {
            let sizes = &sizes;
            s.spawn(move || {
                for step in 0..4u32 {
                    // Start every tensor, then wait for all: rounds overlap across tensors.
                    let mut bufs: Vec<Vec<f32>> =
                        sizes.iter().map(|&n| (0..n).map(|i| v(c.rank, i) * (step + 1) as f32).collect()).collect();
                    let ops: Vec<_> = bufs
                        .iter_mut()
                        .enumerate()
                        .map(|(t, b)| {
                            // SAFETY: the buffers outlive the ops (waited below).
                            unsafe {
                                c.push_pull(
                                    b.as_mut_ptr().cast(),
                                    b.len() * 4,
                                    DType::F32,
                                    &format!("t{t}"),
                                    0,
                                    (t % 5) as i32,
                                    None,
                                )
                            }
                            .unwrap()
                        })
                        .collect();
                    for op in &ops {
                        op.wait(Some(IO_TIMEOUT)).unwrap();
                    }
                    for (t, b) in bufs.iter().enumerate() {
                        let want: Vec<f32> =
                            (0..sizes[t]).map(|i| (0..5).map(|r| v(r, i)).sum::<f32>() * (step + 1) as f32).collect();
                        assert_eq!(b, &want, "worker {} tensor {t} step {step}", c.rank);
                    }
                }
            });
        }
    });
    finish(job, clients);
}

#[test]
fn workers_of_one_host_disagreeing_on_average_fail_the_job_for_everyone() {
    let (mut job, clients) = host_job(&["a", "a", "b"], &[(1, false)], true);
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let flags = if c.rank == 0 { FLAG_AVERAGE } else { 0 };
                    push_pull(c, "g", vec![1.0f32; 2000], DType::F32, flags, 0).unwrap_err()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The host's workers say why; the other host's worker fails too (with
    // the reason, or with the server closing on it when that came first).
    for (r, e) in errors.iter().enumerate().take(2) {
        assert!(e.contains("disagree"), "worker {r}: {e}");
    }
    assert!(errors[2].contains("push_pull 'g' failed"), "{}", errors[2]);
    for c in &clients {
        assert!(c.failure().is_some(), "worker {}", c.rank);
    }
    assert!(job.wait().unwrap_err().contains("disagree"));
    drop(clients);
}

#[test]
fn a_failing_worker_fails_its_host_peers_and_everyone_else() {
    let (mut job, clients) = host_job(&["a", "a", "b"], &[(1, false)], true);
    let (stay, gone) = (&clients[0], &clients[1]);
    let other_host = &clients[2];
    std::thread::scope(|s| {
        let a = s.spawn(|| push_pull(stay, "g", vec![1.0f32; 5000], DType::F32, 0, 0).unwrap_err());
        let b = s.spawn(|| push_pull(other_host, "g", vec![1.0f32; 5000], DType::F32, 0, 0).unwrap_err());
        // Worker 1 never contributes: its host's sum cannot complete.
        std::thread::sleep(std::time::Duration::from_millis(200));
        gone.abort("test: gave up");
        for e in [a.join().unwrap(), b.join().unwrap()] {
            assert_contains(&e, &["worker 1 failed", "gave up"]);
        }
    });
    assert!(job.wait().unwrap_err().contains("worker 1 failed"));
    drop(clients);
}

#[test]
fn shared_memory_names_are_removed_once_every_local_worker_and_server_mapped_them() {
    // Server 1 shares host a: it maps the segments too, and counts.
    let (job, clients) = host_job(&["a", "a", "a"], &[(1, false), (1, true)], true);
    let id = clients[0].job_id;
    let ours = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(&format!("gradhub-{id:016x}-")))
            .collect()
    };
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || push_pull(c, "g", vec![2.0f32; 3000], DType::F32, 0, 0).unwrap());
        }
    });
    // Every worker mapped the tensor's segment: its name is gone, the memory stays in use.
    assert_eq!(ours(), Vec::<String>::new());
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                assert_eq!(push_pull(c, "g", vec![1.0f32; 3000], DType::F32, 0, 0).unwrap(), vec![3.0; 3000])
            });
        }
    });
    finish(job, clients);
}

#[test]
fn a_round_waiting_for_a_local_worker_is_reported_naming_it() {
    let mut cfg = sched_config(3, 1);
    cfg.stall_ms = 300;
    let job = real_job(cfg, &[(1, false)]);
    let pending: Vec<_> = (0..3)
        .map(|r| {
            let mut c = client_config(job.addr, r, 3, 1);
            c.host = Some("a".into());
            spawn_client(c)
        })
        .collect();
    let clients: Vec<Client> = pending.into_iter().map(|p| p.join()).collect();
    // Declared by everyone, so the scheduler has nothing to report.
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                c.declare(vec![DeclEntry {
                    name: "x".into(),
                    numel: 3000,
                    dtype: DType::F32,
                    partition: 0,
                    members: Vec::new(),
                    sharded: false,
                }])
                .unwrap()
            });
        }
    });
    let mut bufs: Vec<Vec<f32>> = (0..3).map(|r| vec![r as f32; 3000]).collect();
    let start = |c: &Client, b: &mut Vec<f32>| {
        // SAFETY: the buffers outlive the ops (waited below).
        unsafe { c.push_pull(b.as_mut_ptr().cast(), b.len() * 4, DType::F32, "x", 0, 0, None) }.unwrap()
    };
    let (b0, rest) = bufs.split_first_mut().unwrap();
    let (b1, rest) = rest.split_first_mut().unwrap();
    let ops = [start(&clients[0], b0), start(&clients[1], b1)];
    // Worker 2 has not started its round: the host's sums wait for it.
    let err = ops[0].wait(Some(std::time::Duration::from_millis(1500))).unwrap_err().to_string();
    assert_contains(&err, &["did not complete", "'x'", "rank(s) [2] of this host"]);
    let op2 = start(&clients[2], &mut rest[0]);
    for op in ops.iter().chain([&op2]) {
        op.wait(Some(IO_TIMEOUT)).unwrap();
    }
    assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 3.0)));
    finish(job, clients);
}

/// In-place push_pull of f32 `buf` whose tensor is freed once it completes.
fn push_pull_then_release(c: &Client, name: &str, mut buf: Vec<f32>) -> Vec<f32> {
    let nbytes = buf.len() * 4;
    // SAFETY: buf lives until the op completes (waited below, or the test fails).
    let op = unsafe {
        c.push_pull_live(
            buf.as_mut_ptr().cast(),
            nbytes,
            DType::F32,
            name,
            0,
            true,
            0,
            None,
            Default::default(),
            Default::default(),
        )
    }
    .unwrap();
    op.wait(Some(IO_TIMEOUT)).unwrap();
    buf
}

#[test]
fn unnamed_ops_and_reshaped_names_free_their_state_through_the_host_stage() {
    // Server 1 shares host a (pushes by reference).
    let (job, clients) = host_job(&["a", "a", "b"], &[(1, false), (1, true)], true);
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                for i in 0..40usize {
                    // A generated name, used once: freed when the op completes.
                    let n = 1 + (i * 733) % 3000;
                    let mine: Vec<f32> = (0..n).map(|j| v(c.rank, j)).collect();
                    let name = format!("push_pull.noname.{i}");
                    let got = push_pull_then_release(c, &name, mine);
                    let want: Vec<f32> = (0..n).map(|j| (0..3).map(|r| v(r, j)).sum()).collect();
                    assert_eq!(got, want, "worker {} op {i}", c.rank);
                }
                assert_eq!(c.stats().tensors, 0, "worker {} kept state of unnamed ops", c.rank);
                // One name, three shapes: each change is a new tensor.
                for (i, n) in [1000usize, 10, 1000].into_iter().enumerate() {
                    let got = push_pull(c, "x", vec![(i + 1) as f32; n], DType::F32, 0, 0).unwrap();
                    assert_eq!(got, vec![3.0 * (i + 1) as f32; n], "worker {} shape {n}", c.rank);
                }
                assert_eq!(c.stats().tensors, 1);
                c.release(&["x".to_string()]).unwrap();
                assert_eq!(c.stats().tensors, 0);
                let e = c.release(&["x".to_string()]).unwrap_err().to_string();
                assert_contains(&e, &["tensor 'x' is not declared"]);
            });
        }
    });
    finish(job, clients);
}

#[test]
fn a_name_in_flight_can_be_neither_released_nor_reshaped() {
    let (job, clients) = host_job(&["a", "b"], &[(1, false)], true);
    let mut b = vec![1.0f32; 100];
    // Worker 0 alone: the round cannot complete while worker 1 waits below.
    // SAFETY: the buffer outlives the op (waited below).
    let op = unsafe { clients[0].push_pull(b.as_mut_ptr().cast(), 400, DType::F32, "x", 0, 0, None) }.unwrap();
    let e = clients[0].release(&["x".to_string()]).unwrap_err().to_string();
    assert_contains(&e, &["tensor 'x' is in flight"]);
    let mut small = vec![1.0f32; 10];
    // SAFETY: refused, never used.
    let e = unsafe { clients[0].push_pull(small.as_mut_ptr().cast(), 40, DType::F32, "x", 0, 0, None) };
    let e = e.err().expect("a reshape in flight was accepted").to_string();
    assert!(e.contains("already being push_pulled") || e.contains("in flight"), "{e}");
    assert_eq!(push_pull(&clients[1], "x", vec![2.0f32; 100], DType::F32, 0, 0).unwrap(), vec![3.0; 100]);
    op.wait(Some(IO_TIMEOUT)).unwrap();
    assert_eq!(b, vec![3.0; 100]);
    finish(job, clients);
}
