//! The worker client against a real scheduler and real servers (and, for
//! failures, fake servers or fake workers on raw sockets): setup, push_pull,
//! declare, barrier, failures, shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gradhub::client::{Client, ClientConfig};
use gradhub::protocol::{Control, DType, DeclEntry, MsgType, Role, FLAG_AVERAGE};
use gradhub::scheduler::SchedulerConfig;
use half::{bf16, f16};

use crate::support::*;

pub(crate) fn shutdown_all(clients: Vec<Client>) {
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || c.shutdown());
        }
    });
}

#[test]
fn connect_reports_rank_size_and_local_rank() {
    let job = real_job(sched_config(3, 2), &[(2, false), (1, true)]);
    let want2 = spawn_client(client_config(job.addr, 2, 3, 2));
    let others: Vec<_> = (0..2).map(|_| spawn_client(client_config(job.addr, -1, 3, 2))).collect();
    let c2 = want2.join();
    assert_eq!(c2.rank, 2, "requested rank honoured");
    let mut all: Vec<Client> = others.into_iter().map(|p| p.join()).collect();
    all.push(c2);
    all.sort_by_key(|c| c.rank);
    for (i, c) in all.iter().enumerate() {
        assert_eq!(c.rank, i as u32);
        assert_eq!(c.num_workers, 3);
        assert_eq!(c.num_servers, 2);
        assert_eq!(c.partition_bytes, PARTITION);
        // Every worker runs on this host.
        assert_eq!((c.local_rank, c.local_size), (i as u32, 3));
        assert!(c.failure().is_none());
    }
    shutdown_all(all);
    job.finish_ok();
}

fn val(rank: u32, i: usize) -> f32 {
    (i % 1000) as f32 * 0.5 + rank as f32 * 3.0 - 100.0
}

#[test]
fn push_pull_sums_tensors_of_every_size_across_workers() {
    const NW: u32 = 3;
    let job = real_job(sched_config(NW, 2), &[(2, false), (1, false)]);
    let clients = job.clients(NW, NW, 2);
    // 0 and 1 element, one partial chunk, exactly one chunk (1024 B), one more
    // than a chunk, and many chunks over all three server threads.
    let sizes = [0usize, 1, 7, 256, 257, 5000, 60_000];
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                for &n in &sizes {
                    let name = format!("f32-{n}");
                    let mine: Vec<f32> = (0..n).map(|i| val(c.rank, i)).collect();
                    let sum: Vec<f32> = (0..n).map(|i| (0..NW).map(|r| val(r, i)).sum()).collect();
                    let got = push_pull(c, &name, mine.clone(), DType::F32, 0, 0).unwrap();
                    assert_eq!(got, sum, "rank {} size {n}", c.rank);
                    // Second round of the same tensor, averaged.
                    let got = push_pull(c, &name, mine, DType::F32, FLAG_AVERAGE, 5).unwrap();
                    let avg: Vec<f32> = sum.iter().map(|x| x * (1.0 / NW as f32)).collect();
                    assert_eq!(got, avg, "rank {} size {n} averaged", c.rank);
                }
                for &n in &[1usize, 513, 3000] {
                    let h: Vec<u16> = (0..n)
                        .map(|i| f16::from_f32(((i % 64) as f32 - 32.0) * 0.5 * (c.rank + 1) as f32).to_bits())
                        .collect();
                    let want: Vec<u16> = (0..n)
                        .map(|i| {
                            f16::from_f32((1..=NW).map(|r| ((i % 64) as f32 - 32.0) * 0.5 * r as f32).sum()).to_bits()
                        })
                        .collect();
                    assert_eq!(push_pull(c, &format!("f16-{n}"), h, DType::F16, 0, 0).unwrap(), want);
                    let b: Vec<u16> =
                        (0..n).map(|i| bf16::from_f32((i % 100) as f32 * (c.rank + 1) as f32).to_bits()).collect();
                    let want: Vec<u16> = (0..n)
                        .map(|i| {
                            bf16::from_f32((1..=NW).map(|r| bf16::from_f32((i % 100) as f32 * r as f32).to_f32()).sum())
                                .to_bits()
                        })
                        .collect();
                    assert_eq!(push_pull(c, &format!("bf16-{n}"), b, DType::BF16, 0, 0).unwrap(), want);
                }
            });
        }
    });
    shutdown_all(clients);
    job.finish_ok();
}

#[test]
fn many_push_pulls_in_flight_at_once_with_priorities() {
    many_in_flight(&[(2, false)], None);
}

/// A spread of one byte: a chunk goes only when nothing before it in the
/// job-wide order is still unreceived, on any connection. Everything still
/// completes (the job's first unfinished chunk always may go), and nothing
/// is left counted afterwards.
#[test]
fn the_narrowest_spread_still_completes_everything() {
    many_in_flight(&[(2, false), (1, false), (1, true)], Some(1));
}

fn many_in_flight(servers: &[(usize, bool)], spread: Option<usize>) {
    const NW: u32 = 2;
    let ns = servers.len() as u32;
    let job = real_job(sched_config(NW, ns), servers);
    let pending: Vec<_> = (0..NW)
        .map(|_| spawn_client(ClientConfig { spread_bytes: spread, ..client_config(job.addr, -1, NW, ns) }))
        .collect();
    let mut clients: Vec<Client> = pending.into_iter().map(|p| p.join()).collect();
    clients.sort_by_key(|c| c.rank);
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                for round in 0..3u32 {
                    let mut bufs: Vec<Vec<f32>> = (0..8)
                        .map(|t| (0..(300 + t * 700)).map(|i| val(c.rank, i) + (t + round as usize) as f32).collect())
                        .collect();
                    let ops: Vec<_> = bufs
                        .iter_mut()
                        .enumerate()
                        .map(|(t, b)| {
                            // SAFETY: every op is waited for below while `bufs` is alive.
                            unsafe {
                                c.push_pull(
                                    b.as_mut_ptr() as *mut u8,
                                    b.len() * 4,
                                    DType::F32,
                                    &format!("t{t}"),
                                    0,
                                    (t as i32) % 3,
                                    None,
                                )
                            }
                            .unwrap()
                        })
                        .collect();
                    for op in &ops {
                        if let Err(e) = op.wait(Some(IO_TIMEOUT)) {
                            std::mem::forget(bufs);
                            panic!("{e}");
                        }
                    }
                    for (t, b) in bufs.iter().enumerate() {
                        let want: Vec<f32> = (0..b.len())
                            .map(|i| (0..NW).map(|r| val(r, i) + (t + round as usize) as f32).sum())
                            .collect();
                        assert_eq!(b, &want, "tensor t{t} round {round}");
                    }
                }
                let d = c.stats().data;
                assert_eq!(
                    (d.unreceived_chunks, d.unreceived_bytes),
                    (0, 0),
                    "worker {}: chunks left in the spread",
                    c.rank
                );
            });
        }
    });
    shutdown_all(clients);
    job.finish_ok();
}

#[test]
fn declare_many_tensors_in_one_exchange() {
    const NW: u32 = 3;
    let job = real_job(sched_config(NW, 1), &[(2, false)]);
    let clients = job.clients(NW, NW, 1);
    let decls: Vec<DeclEntry> = (0..50u64)
        .map(|i| DeclEntry {
            name: format!("p{i}"),
            numel: 10 + i * 97,
            dtype: if i % 4 == 0 { DType::BF16 } else { DType::F32 },
            // Some in chunks of their own size (smaller than the job's).
            partition: if i % 3 == 0 { 64 } else { 0 },
            members: Vec::new(),
            sharded: false,
        })
        .collect();
    std::thread::scope(|s| {
        for c in &clients {
            let mut d = decls.clone();
            if c.rank == 1 {
                d.reverse();
            }
            s.spawn(move || c.declare(d).unwrap());
        }
    });
    // Declaring again (locally known) is a no-op.
    clients[0].declare(decls[..3].to_vec()).unwrap();
    // Another size is a new tensor under the same name, declared by every worker.
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                c.declare(vec![DeclEntry {
                    name: "p1".into(),
                    numel: 5,
                    dtype: DType::F16,
                    partition: 0,
                    members: Vec::new(),
                    sharded: false,
                }])
                .unwrap();
                let got = push_pull(c, "p1", vec![f16::from_f32(1.0); 5], DType::F16, 0, 0).unwrap();
                assert_eq!(got, vec![f16::from_f32(NW as f32); 5]);
            });
        }
    });
    std::thread::scope(|s| {
        for c in &clients {
            let decls = &decls;
            s.spawn(move || {
                for d in decls.iter().filter(|d| d.dtype == DType::F32) {
                    let mine: Vec<f32> = (0..d.numel as usize).map(|i| val(c.rank, i)).collect();
                    let want: Vec<f32> = (0..d.numel as usize).map(|i| (0..NW).map(|r| val(r, i)).sum()).collect();
                    assert_eq!(push_pull(c, &d.name, mine, DType::F32, 0, 0).unwrap(), want, "{}", d.name);
                }
            });
        }
    });
    shutdown_all(clients);
    job.finish_ok();
}

#[test]
fn inconsistent_declarations_fail_every_worker_involved_and_the_job_goes_on() {
    let job = real_job(sched_config(2, 1), &[(1, false)]);
    let clients = job.clients(2, 2, 1);
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let e = DeclEntry {
                        name: "bad".into(),
                        numel: 10 + c.rank as u64,
                        dtype: DType::F32,
                        partition: 0,
                        members: Vec::new(),
                        sharded: false,
                    };
                    c.declare(vec![e]).unwrap_err().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errs {
        assert_contains(e, &["'bad'", "10", "11"]);
    }
    // Chunks larger than the job's partition, or of another size on another worker.
    let errs: Vec<(String, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let big = DeclEntry {
                        name: "big".into(),
                        numel: 10,
                        dtype: DType::F32,
                        partition: PARTITION + 4,
                        members: Vec::new(),
                        sharded: false,
                    };
                    let e1 = c.declare(vec![big]).unwrap_err().to_string();
                    let odd = DeclEntry {
                        name: "odd".into(),
                        numel: 10,
                        dtype: DType::F32,
                        partition: 8 + 8 * c.rank,
                        members: Vec::new(),
                        sharded: false,
                    };
                    (e1, c.declare(vec![odd]).unwrap_err().to_string())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (e1, e2) in &errs {
        assert_contains(e1, &["'big'", "partition", &(PARTITION + 4).to_string()]);
        assert_contains(e2, &["'odd'", "chunks of 8 bytes", "chunks of 16 bytes"]);
    }
    // Push-pulls of the same name fail the same way (declared on first use).
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter()
            .map(|c| {
                s.spawn(move || push_pull(c, "bad2", vec![1.0f32; 4 + c.rank as usize], DType::F32, 0, 0).unwrap_err())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errs {
        assert_contains(e, &["'bad2'"]);
    }
    // Other tensors still work.
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                assert_eq!(push_pull(c, "good", vec![1.0f32; 9], DType::F32, 0, 0).unwrap(), vec![2.0f32; 9])
            });
        }
    });
    shutdown_all(clients);
    job.finish_ok();
}

#[test]
fn usage_errors_are_reported_without_harming_the_job() {
    let job = real_job(sched_config(2, 1), &[(1, false)]);
    let clients = job.clients(2, 2, 1);
    let c = &clients[0];
    // Wrong dtype, partial elements, unknown flags.
    let mut b = vec![0u8; 12];
    // SAFETY: rejected before any use of the buffer.
    let e =
        unsafe { c.push_pull(b.as_mut_ptr(), 12, DType::None, "u", 0, 0, None) }.err().expect("DType::None accepted");
    assert!(!e.to_string().is_empty());
    let e =
        unsafe { c.push_pull(b.as_mut_ptr(), 6, DType::F32, "u", 0, 0, None) }.err().expect("6 bytes of f32 accepted");
    assert_contains(&e.to_string(), &["6"]);
    let e = unsafe { c.push_pull(b.as_mut_ptr(), 12, DType::F32, "u", 0x40, 0, None) }
        .err()
        .expect("unknown flag accepted");
    assert_contains(&e.to_string(), &["flag"]);
    // One round per tensor at a time: worker 1 has not pushed "once" yet, so
    // worker 0's first round is still in flight.
    let mut big = vec![1.0f32; 5000];
    // SAFETY: waited below while `big` lives.
    let op = unsafe { c.push_pull(big.as_mut_ptr() as *mut u8, 20_000, DType::F32, "once", 0, 0, None) }.unwrap();
    let mut other = vec![1.0f32; 5000];
    let e = unsafe { c.push_pull(other.as_mut_ptr() as *mut u8, 20_000, DType::F32, "once", 0, 0, None) }
        .err()
        .expect("second concurrent round of one tensor accepted");
    assert_contains(&e.to_string(), &["'once'"]);
    assert_eq!(push_pull(&clients[1], "once", vec![2.0f32; 5000], DType::F32, 0, 0).unwrap(), vec![3.0f32; 5000]);
    op.wait(Some(IO_TIMEOUT)).unwrap();
    assert_eq!(big, vec![3.0f32; 5000]);
    // Then the next round is fine, and the clients are still healthy.
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                assert_eq!(push_pull(c, "once", vec![1.0f32; 5000], DType::F32, 0, 0).unwrap(), vec![2.0f32; 5000])
            });
        }
    });
    assert!(clients.iter().all(|c| c.failure().is_none()));
    drop(other);
    shutdown_all(clients);
    job.finish_ok();
}

#[test]
fn barrier_returns_only_when_every_worker_entered() {
    let job = real_job(sched_config(3, 1), &[(1, false)]);
    let clients = job.clients(3, 3, 1);
    for _ in 0..3 {
        let entered = Arc::new(AtomicBool::new(false));
        std::thread::scope(|s| {
            for c in &clients[..2] {
                let entered = entered.clone();
                s.spawn(move || {
                    c.barrier().unwrap();
                    assert!(entered.load(Ordering::SeqCst), "barrier returned before the last worker entered");
                });
            }
            // Give the two early workers time to (wrongly) return.
            std::thread::sleep(Duration::from_millis(100));
            entered.store(true, Ordering::SeqCst);
            clients[2].barrier().unwrap();
        });
    }
    shutdown_all(clients);
    job.finish_ok();
}

#[test]
fn after_shutdown_every_call_is_a_usage_error() {
    let job = real_job(sched_config(2, 1), &[(1, false)]);
    let clients = job.clients(2, 2, 1);
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || assert_eq!(push_pull(c, "x", vec![1.0f32; 3], DType::F32, 0, 0).unwrap(), vec![2.0f32; 3]));
        }
    });
    let c0 = &clients[0];
    c0.shutdown();
    c0.shutdown(); // idempotent
    let e = push_pull(c0, "x", vec![1.0f32; 3], DType::F32, 0, 0).unwrap_err();
    assert_contains(&e, &["shut down"]);
    assert_contains(
        &c0.declare(vec![DeclEntry {
            name: "y".into(),
            numel: 1,
            dtype: DType::F32,
            partition: 0,
            members: Vec::new(),
            sharded: false,
        }])
        .unwrap_err()
        .to_string(),
        &["shut down"],
    );
    assert_contains(&c0.barrier().unwrap_err().to_string(), &["shut down"]);
    shutdown_all(clients);
    job.finish_ok();
}

/// A fake server: registered over a raw control connection, one thread
/// listening on a raw socket. The client is connected through it.
struct FakeServer {
    ctrl: Member,
    data: std::net::TcpStream,
}

fn job_with_fake_server(
    cfg: gradhub::scheduler::SchedulerConfig,
) -> (gradhub::scheduler::SchedulerHandle, FakeServer, Client) {
    let h = start(cfg);
    let (l, port) = listener();
    let pending = spawn_client(client_config(h.addr, -1, 1, 1));
    let mut ctrl = Member::register(h.addr, server_reg(0, "127.0.0.1", vec![port], false, 1, 1));
    assert_eq!(ctrl.welcome().rank, 0);
    let mut data = accept(&l);
    accept_authenticated(&data, &token());
    let hello = read_header(&mut data);
    assert_eq!((hello.msg_type, hello.key, hello.namespace), (MsgType::DataHello, 0, NS));
    let c = pending.join();
    (h, FakeServer { ctrl, data }, c)
}

#[test]
fn op_fails_naming_the_server_when_it_closes_the_data_connection() {
    // The link is closed without an Error frame and the server never answers
    // again: the worker tries to mend it for the peer timeout, then fails.
    let (h, mut fs, c) = job_with_fake_server(SchedulerConfig { peer_timeout_ms: 1_500, ..sched_config(1, 1) });
    let name = "x";
    let buf = vec![1.0f32; 10];
    let p = {
        // The push_pull runs on its own thread; the fake server plays along.
        let c = Arc::new(c);
        let c2 = c.clone();
        (c, spawn("push_pull", move || push_pull(&c2, name, buf, DType::F32, 0, 0)))
    };
    let (c, pending) = p;
    // The tensor is installed on the (fake) server before the client may push.
    let spec = match fs.ctrl.recv() {
        Control::ServerDeclare { batch, mut specs } => {
            fs.ctrl.send(&Control::ServerDeclareAck { batch }).unwrap();
            specs.remove(0)
        }
        other => panic!("expected ServerDeclare, got {other:?}"),
    };
    let push = read_header(&mut fs.data);
    assert_eq!(push.msg_type, MsgType::Push);
    assert_eq!((push.key, push.chunk, push.round, push.dtype, push.payload_len), (spec.key, 0, 0, DType::F32, 40));
    // The server thread goes away mid-round.
    fs.data.shutdown(std::net::Shutdown::Both).unwrap();
    let e = pending.join().expect_err("push_pull must fail");
    assert_contains(&e, &["server 0", "'x'"]);
    // Whichever comes first: the mend given up, or the scheduler's verdict
    // on a fake server that sends no heartbeats (both after the peer timeout).
    assert!(e.contains("could not be made again within 1.5s") || e.contains("server 0 was lost"), "{e}");
    // The client is failed: further calls say why.
    let e = push_pull(&c, "y", vec![1.0f32; 2], DType::F32, 0, 0).unwrap_err();
    assert_contains(&e, &["server 0"]);
    assert_contains(&c.failure().expect("failure recorded"), &["server 0"]);
    c.shutdown();
    let _ = wait_scheduler(h);
}

#[test]
fn op_fails_naming_the_server_when_the_server_is_lost() {
    let (h, fs, c) = job_with_fake_server(sched_config(1, 1));
    // The server process dies: control and data connections close.
    let FakeServer { ctrl, data } = fs;
    ctrl.kill();
    drop(data);
    let e = push_pull(&c, "x", vec![1.0f32; 10], DType::F32, 0, 0).unwrap_err();
    assert_contains(&e, &["server 0"]);
    assert_contains(&c.failure().expect("failure recorded"), &["server 0"]);
    c.shutdown();
    let err = wait_scheduler(h).expect_err("the job must fail");
    assert_contains(&err, &["server 0"]);
}

#[test]
fn pending_ops_fail_naming_a_lost_worker() {
    let mut job = real_job(sched_config(2, 1), &[(1, false)]);
    let pending = spawn_client(client_config(job.addr, 0, 2, 1));
    let mut w1 = Member::register(job.addr, worker_reg(1, "h", 2, 1));
    assert_eq!(w1.welcome().rank, 1);
    let c = pending.join();
    let mut buf = vec![1.0f32; 100];
    // SAFETY: waited below while `buf` lives (the op fails, it does not time out).
    let op = unsafe { c.push_pull(buf.as_mut_ptr() as *mut u8, 400, DType::F32, "x", 0, 0, None) }.unwrap();
    // Worker 1 never declares "x" and then dies.
    w1.kill();
    let e = op.wait(Some(IO_TIMEOUT)).expect_err("op must fail").to_string();
    assert_contains(&e, &["worker 1"]);
    drop(buf);
    assert_contains(&c.barrier().unwrap_err().to_string(), &["worker 1"]);
    c.shutdown();
    let results = job.server_results();
    assert_contains(results[0].as_ref().expect_err("the server must fail"), &["worker 1"]);
    assert_contains(&job.wait().expect_err("the job must fail"), &["worker 1"]);
}

#[test]
fn timeouts_quote_the_stall_reports_naming_the_missing_rank() {
    let mut cfg = sched_config(2, 1);
    cfg.stall_ms = 300;
    cfg.heartbeat_ms = 50;
    let mut job = real_job(cfg, &[(1, false)]);
    let pending = spawn_client(client_config(job.addr, 0, 2, 1));
    let mut w1 = Member::register(job.addr, worker_reg(1, "h", 2, 1));
    w1.start_heartbeat(Duration::from_millis(50));
    assert_eq!(w1.welcome().rank, 1);
    let c = pending.join();

    // "a": worker 1 never declares it (the scheduler's stall report).
    let mut a = vec![1.0f32; 10];
    // SAFETY: both ops are waited until they fail, below, while the buffers live.
    let op_a = unsafe { c.push_pull(a.as_mut_ptr() as *mut u8, 40, DType::F32, "a", 0, 0, None) }.unwrap();
    // "b": worker 1 declares it but never pushes (the server's stall report).
    let decl =
        DeclEntry { name: "b".into(), numel: 10, dtype: DType::F32, partition: 0, members: Vec::new(), sharded: false };
    w1.send(&Control::Declare { req: 0, entries: vec![decl] }).unwrap();
    let mut b = vec![1.0f32; 10];
    let op_b = unsafe { c.push_pull(b.as_mut_ptr() as *mut u8, 40, DType::F32, "b", 0, 0, None) }.unwrap();
    loop {
        match w1.recv() {
            Control::Declared { req: 0, specs } => break assert_eq!(specs.len(), 1),
            Control::DeclareStall { .. } => continue,
            other => panic!("worker 1: expected Declared, got {other:?}"),
        }
    }

    let ea = op_a.wait(Some(Duration::from_millis(1500))).expect_err("a cannot complete").to_string();
    assert_contains(&ea, &["'a'", "[1]"]);
    let eb = op_b.wait(Some(Duration::from_millis(500))).expect_err("b cannot complete").to_string();
    assert_contains(&eb, &["'b'", "[1]", "server 0"]);

    // End it: worker 1 dies, both ops fail (so their buffers are released).
    w1.kill();
    for op in [&op_a, &op_b] {
        assert_contains(&op.wait(Some(IO_TIMEOUT)).expect_err("must fail").to_string(), &["worker 1"]);
    }
    drop((a, b));
    c.shutdown();
    let _ = job.server_results();
    assert!(job.wait().is_err());
}

#[test]
fn connect_fails_clearly_when_rejected_or_unreachable() {
    let mut cfg = sched_config(1, 1);
    cfg.join_timeout_ms = 1000;
    let h = start(cfg);
    let e = match gradhub::client::Client::connect(client_config(h.addr, -1, 5, 1)) {
        Ok(_) => panic!("a client for 5 workers joined a 1-worker job"),
        Err(e) => e.to_string(),
    };
    assert_contains(&e, &["5 workers"]);
    assert!(wait_scheduler(h).is_err(), "nobody joined: the join timeout fails the job");

    // Nothing listens on port 1.
    let mut cfg = client_config("127.0.0.1:1".parse().unwrap(), -1, 1, 1);
    cfg.connect_timeout = Duration::from_millis(300);
    let e = match gradhub::client::Client::connect(cfg) {
        Ok(_) => panic!("connected to nothing"),
        Err(e) => e.to_string(),
    };
    assert_contains(&e, &["scheduler", "127.0.0.1:1"]);
}

#[test]
fn server_reporting_an_error_fails_the_clients_ops() {
    // The client hears of it through the scheduler (PeerLost), even though its
    // data connection to that server is still open.
    let (h, fs, c) = job_with_fake_server(sched_config(1, 1));
    // The server reports an error to the scheduler (its data connection stays open).
    fs.ctrl.send(&Control::Error { message: "out of memory".into() }).unwrap();
    let e = push_pull(&c, "x", vec![1.0f32; 10], DType::F32, 0, 0).unwrap_err();
    assert_contains(&e, &[Role::Server.name(), "0", "out of memory"]);
    c.shutdown();
    drop(fs);
    assert_contains(&wait_scheduler(h).expect_err("the job must fail"), &["out of memory"]);
}

#[test]
fn shutdown_fails_the_operations_in_flight() {
    let job = real_job(sched_config(2, 1), &[(1, false)]);
    let clients = job.clients(2, 2, 1);
    // Declare first, so worker 0's op is submitted (not waiting for a declaration).
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                c.declare(vec![DeclEntry {
                    name: "x".into(),
                    numel: 1000,
                    dtype: DType::F32,
                    partition: 0,
                    members: Vec::new(),
                    sharded: false,
                }])
                .unwrap()
            });
        }
    });
    let mut buf = vec![1.0f32; 1000];
    // SAFETY: the op is waited for below; if it never completes the buffer is leaked.
    let op = unsafe { clients[0].push_pull(buf.as_mut_ptr() as *mut u8, 4000, DType::F32, "x", 0, 0, None) }.unwrap();
    // Worker 1 never pushes "x"; worker 0 leaves.
    clients[0].shutdown();
    let r = op.wait(Some(Duration::from_secs(2)));
    if !op.done() {
        std::mem::forget(buf);
    }
    let e = r.expect_err("the op cannot have succeeded").to_string();
    assert!(!e.contains("did not complete"), "shutdown left the op in flight: {e}");
    assert_contains(&e, &["shut down"]);
    // Worker 1 would wait for worker 0's push forever: the job fails instead,
    // naming worker 0 and the operation it left behind.
    shutdown_all(clients);
    let mut job = job;
    for r in job.server_results() {
        assert!(r.is_err(), "the server must end with the job's failure");
    }
    let err = job.wait().expect_err("the job must fail");
    assert_contains(&err, &["worker 0", "shut down with operations in flight: x"]);
}

#[test]
fn small_partitions_still_deliver_stall_notices() {
    // 16-byte partitions are valid (the scheduler accepts >= 4), but a Stall
    // frame's payload (24 bytes for one missing rank) is larger than that.
    let mut cfg = sched_config(2, 1);
    cfg.partition_bytes = 16;
    cfg.stall_ms = 200;
    let mut job = real_job(cfg, &[(1, false)]);
    let pending = spawn_client(client_config(job.addr, 0, 2, 1));
    let mut w1 = Member::register(job.addr, worker_reg(1, "h", 2, 1));
    assert_eq!(w1.welcome().rank, 1);
    let c = pending.join();
    let decl =
        DeclEntry { name: "x".into(), numel: 4, dtype: DType::F32, partition: 0, members: Vec::new(), sharded: false };
    w1.send(&Control::Declare { req: 0, entries: vec![decl] }).unwrap();
    let mut buf = vec![1.0f32; 4];
    // SAFETY: the op is waited for until it fails (below) while `buf` lives.
    let op = unsafe { c.push_pull(buf.as_mut_ptr() as *mut u8, 16, DType::F32, "x", 0, 0, None) }.unwrap();
    let e = op.wait(Some(Duration::from_millis(1200))).expect_err("cannot complete without worker 1").to_string();
    let failure = c.failure();
    // End it before asserting, so the op completes and the buffer is released.
    w1.kill();
    let _ = op.wait(Some(IO_TIMEOUT));
    drop(buf);
    c.shutdown();
    let _ = job.server_results();
    let _ = job.wait();
    assert!(failure.is_none(), "a stall notice failed the client: {failure:?}");
    assert_contains(&e, &["did not complete", "[1]"]);
}
