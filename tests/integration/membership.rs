//! The scheduler's membership: registration, ranks, Welcome, liveness, end of job.
//! Every member here is fake (raw control connections), so each step is observable.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use gradhub::protocol::{Control, DType, DeclEntry, Role};

use crate::support::*;

#[test]
fn ranks_are_distinct_and_requested_ranks_honoured() {
    let h = start(sched_config(4, 2));
    // Requested ranks mixed with "assign me one" (-1), both roles.
    let mut w2 = Member::register(h.addr, worker_reg(2, "h", 4, 2));
    let mut any_w: Vec<Member> = (0..3).map(|_| Member::register(h.addr, worker_reg(-1, "h", 4, 2))).collect();
    let mut s1 = Member::register(h.addr, server_reg(1, "127.0.0.1", vec![1], false, 4, 2));
    let mut any_s = Member::register(h.addr, server_reg(-1, "127.0.0.1", vec![2], false, 4, 2));

    assert_eq!(w2.welcome().rank, 2);
    assert_eq!(s1.welcome().rank, 1);
    assert_eq!(any_s.welcome().rank, 0);
    let ranks: BTreeSet<u32> = any_w.iter_mut().map(|m| m.welcome().rank).collect();
    assert_eq!(ranks, BTreeSet::from([0, 1, 3]), "unrequested worker ranks fill the gaps, each once");
    drop((w2, any_w, s1, any_s));
    let _ = wait_scheduler(h);
}

#[test]
fn welcome_describes_the_job() {
    let mut cfg = sched_config(2, 2);
    cfg.partition_bytes = 4096;
    cfg.heartbeat_ms = 250;
    cfg.stall_ms = 1234;
    let h = start(cfg);
    // Registered in the "wrong" order: rank 1 before rank 0, for both roles.
    let mut s1 = Member::register(h.addr, server_reg(1, "10.0.0.5", vec![1111, 1112], true, 2, 2));
    let mut s0 = Member::register(h.addr, server_reg(0, "10.0.0.6", vec![2222], false, 2, 2));
    let mut w1 = Member::register(h.addr, worker_reg(1, "hostA", 2, 2));
    let mut w0 = Member::register(h.addr, worker_reg(0, "hostB", 2, 2));

    for (m, role_rank) in [(&mut w0, 0), (&mut w1, 1), (&mut s0, 0), (&mut s1, 1)] {
        let w = m.welcome();
        assert_eq!(w.rank, role_rank);
        assert_eq!(w.num_workers, 2);
        assert_eq!(w.partition_bytes, 4096);
        assert_eq!(w.heartbeat_ms, 250);
        assert_eq!(w.stall_ms, 1234);
        // Servers sorted by rank, with what each registered.
        assert_eq!(w.servers.len(), 2);
        let s = &w.servers[0];
        assert_eq!((s.rank, s.addr.as_str(), s.ports.as_slice(), s.colocated), (0, "10.0.0.6", &[2222u16][..], false));
        let s = &w.servers[1];
        assert_eq!(
            (s.rank, s.addr.as_str(), s.ports.as_slice(), s.colocated),
            (1, "10.0.0.5", &[1111u16, 1112][..], true)
        );
        // Worker host names by rank (for local ranks).
        assert_eq!(w.worker_hosts, vec!["hostB".to_string(), "hostA".to_string()]);
    }
    let job = FakeJob { addr: h.addr, sched: Some(h), workers: vec![w0, w1], servers: vec![s0, s1], welcomes: vec![] };
    job.finish();
}

#[test]
fn two_members_asking_for_the_same_rank_fail_the_job() {
    let h = start(sched_config(2, 1));
    let mut a = Member::register(h.addr, worker_reg(0, "h", 2, 1));
    let mut b = Member::register(h.addr, worker_reg(0, "h", 2, 1));
    let mut s = Member::register(h.addr, server_reg(-1, "127.0.0.1", vec![1], false, 2, 1));
    let (pa, pb) = (a.local.to_string(), b.local.to_string());
    for m in [&mut a, &mut b, &mut s] {
        let e = m.error();
        assert_contains(&e, &["rank 0", &pa, &pb]);
        m.expect_no_welcome();
    }
    let err = wait_scheduler(h).expect_err("the job must fail");
    assert_contains(&err, &["rank 0", &pa, &pb]);
}

#[test]
fn members_configured_for_another_job_are_rejected_and_the_job_goes_on() {
    let h = start(sched_config(2, 1));
    // Wrong number of workers, wrong number of servers, rank out of range, server without ports.
    let mut bad_nw = Member::register(h.addr, worker_reg(-1, "h", 3, 1));
    let e = bad_nw.error();
    assert_contains(&e, &["worker", "3 workers", "2"]);
    let mut bad_ns = Member::register(h.addr, server_reg(-1, "127.0.0.1", vec![1], false, 2, 4));
    let e = bad_ns.error();
    assert_contains(&e, &["server", "4 servers", "1"]);
    let mut bad_rank = Member::register(h.addr, worker_reg(5, "h", 2, 1));
    let e = bad_rank.error();
    assert_contains(&e, &["rank 5"]);
    let mut no_ports = Member::register(h.addr, server_reg(-1, "127.0.0.1", vec![], false, 2, 1));
    let _ = no_ports.error();
    for m in [&mut bad_nw, &mut bad_ns, &mut bad_rank, &mut no_ports] {
        m.expect_no_welcome();
    }
    // Zero means "not configured": accepted.
    let mut w0 = Member::register(h.addr, worker_reg(-1, "h", 0, 0));
    let mut w1 = Member::register(h.addr, worker_reg(-1, "h", 2, 1));
    let mut s0 = Member::register(h.addr, server_reg(-1, "127.0.0.1", vec![1], false, 2, 1));
    let mut ranks: Vec<u32> = [&mut w0, &mut w1].into_iter().map(|m| m.welcome().rank).collect();
    ranks.sort();
    assert_eq!(ranks, vec![0, 1], "the rejected members took no slot");
    assert_eq!(s0.welcome().rank, 0);
    let job = FakeJob { addr: h.addr, sched: Some(h), workers: vec![w0, w1], servers: vec![s0], welcomes: vec![] };
    job.finish();
}

#[test]
fn registration_after_the_job_is_full_is_rejected() {
    let mut job = fake_job(sched_config(2, 1), &[(1, false)]);
    let mut late = Member::register(job.addr, worker_reg(-1, "h", 2, 1));
    let e = late.error();
    assert!(e.contains("already") || e.contains("full"), "{e:?}");
    late.expect_no_welcome();
    drop(late);
    // The job is unaffected: a barrier across both workers still completes.
    for w in &job.workers {
        w.send(&Control::Barrier { id: 3 }).unwrap();
    }
    for w in &mut job.workers {
        assert_eq!(w.recv(), Control::BarrierDone { id: 3 });
    }
    job.finish();
}

#[test]
fn barrier_completes_only_when_every_worker_entered() {
    let mut job = fake_job(sched_config(3, 1), &[(1, false)]);
    job.workers[0].send(&Control::Barrier { id: 0 }).unwrap();
    job.workers[2].send(&Control::Barrier { id: 0 }).unwrap();
    job.workers[0].expect_silence(Duration::from_millis(300));
    job.workers[1].send(&Control::Barrier { id: 0 }).unwrap();
    for w in &mut job.workers {
        assert_eq!(w.recv(), Control::BarrierDone { id: 0 });
    }
    // Barriers are independent by id and reusable.
    for id in [1, 2] {
        for w in &job.workers {
            w.send(&Control::Barrier { id }).unwrap();
        }
        for w in &mut job.workers {
            assert_eq!(w.recv(), Control::BarrierDone { id });
        }
    }
    // One entered again after it completed (its answer lost with a link)
    // is answered at once, to that worker alone.
    job.workers[1].send(&Control::Barrier { id: 1 }).unwrap();
    assert_eq!(job.workers[1].recv(), Control::BarrierDone { id: 1 });
    job.workers[0].expect_silence(Duration::from_millis(200));
    job.finish();
}

#[test]
fn disconnect_after_joining_is_reported_to_every_other_member() {
    let mut job = fake_job(sched_config(3, 2), &[(1, false), (1, true)]);
    let gone = job.workers.remove(1);
    gone.kill();
    for m in job.workers.iter_mut().chain(job.servers.iter_mut()) {
        match m.recv() {
            Control::PeerLost { role, rank, reason } => {
                assert_eq!((role, rank), (Role::Worker, 1));
                assert_contains(&reason, &["worker 1"]);
            }
            other => panic!("expected PeerLost, got {other:?}"),
        }
    }
    let err = job.wait().expect_err("the job must fail");
    assert_contains(&err, &["worker 1"]);
}

#[test]
fn lost_server_is_reported_to_workers_when_failover_is_off() {
    // With failover on, server.rs has its chunks taken over instead.
    let mut cfg = sched_config(2, 2);
    cfg.failover = false;
    let mut job = fake_job(cfg, &[(1, false), (2, false)]);
    let gone = job.servers.remove(1);
    gone.kill();
    for m in job.workers.iter_mut().chain(job.servers.iter_mut()) {
        match m.recv() {
            Control::PeerLost { role, rank, .. } => assert_eq!((role, rank), (Role::Server, 1)),
            other => panic!("expected PeerLost, got {other:?}"),
        }
    }
    let err = job.wait().expect_err("the job must fail");
    assert_contains(&err, &["server 1"]);
}

#[test]
fn silent_member_is_reported_after_the_peer_timeout() {
    let mut cfg = sched_config(2, 1);
    cfg.heartbeat_ms = 50;
    cfg.peer_timeout_ms = 600;
    let mut job = fake_job(cfg, &[(1, false)]);
    let t0 = Instant::now();
    // Worker 0 and the server keep heartbeating; worker 1 stays connected but silent.
    job.workers[0].start_heartbeat(Duration::from_millis(50));
    job.servers[0].start_heartbeat(Duration::from_millis(50));
    for i in [0usize] {
        match job.workers[i].recv() {
            Control::PeerLost { role, rank, reason } => {
                assert_eq!((role, rank), (Role::Worker, 1));
                assert_contains(&reason, &["worker 1", "heartbeat"]);
            }
            other => panic!("expected PeerLost, got {other:?}"),
        }
    }
    match job.servers[0].recv() {
        Control::PeerLost { role, rank, .. } => assert_eq!((role, rank), (Role::Worker, 1)),
        other => panic!("expected PeerLost, got {other:?}"),
    }
    let waited = t0.elapsed();
    // Welcomes were read before t0, so the silence began a little earlier.
    assert!(waited >= Duration::from_millis(300), "reported after only {waited:?}");
    assert!(waited < Duration::from_secs(5), "reported only after {waited:?}");
    let err = job.wait().expect_err("the job must fail");
    assert_contains(&err, &["worker 1"]);
}

#[test]
fn heartbeating_members_are_not_reported() {
    let mut cfg = sched_config(1, 1);
    cfg.heartbeat_ms = 50;
    cfg.peer_timeout_ms = 500;
    let mut job = fake_job(cfg, &[(1, false)]);
    job.workers[0].start_heartbeat(Duration::from_millis(50));
    job.servers[0].start_heartbeat(Duration::from_millis(50));
    // Several peer timeouts pass without anyone being declared lost.
    job.workers[0].expect_silence(Duration::from_millis(1500));
    job.finish();
}

#[test]
fn join_timeout_fails_the_job_when_members_are_missing() {
    let mut cfg = sched_config(2, 1);
    cfg.join_timeout_ms = 300;
    let t0 = Instant::now();
    let h = start(cfg);
    let mut w = Member::register(h.addr, worker_reg(-1, "h", 2, 1));
    let e = w.error();
    assert_contains(&e, &["1 of 3"]);
    w.expect_no_welcome();
    let err = wait_scheduler(h).expect_err("the job must fail");
    assert_contains(&err, &["1 of 3"]);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn goodbye_from_every_worker_shuts_the_servers_down() {
    let mut job = fake_job(sched_config(2, 2), &[(1, false), (1, false)]);
    job.workers[0].send(&Control::Goodbye).unwrap();
    // One goodbye is not the end of the job: everyone still in it is told who left.
    for s in &mut job.servers {
        assert_eq!(s.recv(), Control::PeerLeft { rank: 0 });
    }
    assert_eq!(job.workers[1].recv(), Control::PeerLeft { rank: 0 });
    job.servers[0].expect_silence(Duration::from_millis(300));
    // A worker that said goodbye may disconnect: that is not a failure.
    let w0 = job.workers.remove(0);
    w0.kill();
    job.servers[1].expect_silence(Duration::from_millis(200));
    job.workers[0].send(&Control::Goodbye).unwrap();
    for s in &mut job.servers {
        assert_eq!(s.recv(), Control::Shutdown);
    }
    assert_eq!(job.wait(), Ok(()));
}

#[test]
fn unexpected_message_from_a_member_fails_the_job() {
    let mut job = fake_job(sched_config(2, 1), &[(1, false)]);
    // A worker may not acknowledge server installs.
    job.workers[1].send(&Control::ServerDeclareAck { batch: 0 }).unwrap();
    let e = job.workers[1].error();
    assert_contains(&e, &["worker 1"]);
    for m in [&mut job.workers[0], &mut job.servers[0]] {
        match m.recv() {
            Control::PeerLost { role, rank, reason } => {
                assert_eq!((role, rank), (Role::Worker, 1));
                assert_contains(&reason, &["worker 1"]);
            }
            other => panic!("expected PeerLost, got {other:?}"),
        }
    }
    let err = job.wait().expect_err("the job must fail");
    assert_contains(&err, &["worker 1"]);
}

#[test]
fn member_reporting_an_error_fails_the_job() {
    let mut job = fake_job(sched_config(1, 2), &[(1, false), (1, false)]);
    job.servers[0].send(&Control::Error { message: "disk on fire".into() }).unwrap();
    for m in [&mut job.workers[0], &mut job.servers[1]] {
        match m.recv() {
            Control::PeerLost { role, rank, reason } => {
                assert_eq!((role, rank), (Role::Server, 0));
                assert_contains(&reason, &["disk on fire"]);
            }
            other => panic!("expected PeerLost, got {other:?}"),
        }
    }
    let err = job.wait().expect_err("the job must fail");
    assert_contains(&err, &["server 0", "disk on fire"]);
}

#[test]
fn garbage_instead_of_register_is_rejected() {
    let job = fake_job(sched_config(1, 1), &[(1, false)]);
    // Before the job is full the scheduler would wait for a Register; here it is full
    // already, so try both a wrong first message and raw garbage.
    let mut m = Member::connect(job.addr);
    m.send(&Control::Goodbye).unwrap();
    assert_contains(&m.error(), &["Register"]);
    let mut raw = std::net::TcpStream::connect(job.addr).unwrap();
    raw.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    // Exactly one header's worth, so the scheduler reads all of it before closing.
    std::io::Write::write_all(&mut raw, &[0xAB; gradhub::protocol::HEADER_LEN]).unwrap();
    // Garbage is not a handshake: the stranger learns only that, in namespace 0.
    match gradhub::protocol::read_message(&mut raw, None, 1 << 16) {
        Ok((h, text)) => {
            assert_eq!((h.msg_type, h.namespace), (gradhub::protocol::MsgType::Error, 0));
            assert_eq!(String::from_utf8_lossy(&text), gradhub::protocol::auth::REJECTION);
        }
        other => panic!("expected an Error, got {other:?}"),
    }
    job.finish();
}

/// A worker's registration with a local rank and size, as a launcher gives them.
fn local_worker_reg(rank: i32, host: &str, nw: u32, ns: u32, local: (i32, i32)) -> gradhub::protocol::Register {
    let mut r = worker_reg(rank, host, nw, ns);
    (r.local_rank, r.local_size) = local;
    r
}

#[test]
fn local_ranks_come_from_the_hosts_and_agree_with_the_launcher() {
    // 3 workers: two on host "a" (launcher-given local ranks, not in rank order), one on "b" (none given).
    let h = start(sched_config(3, 1));
    let mut w0 = Member::register(h.addr, local_worker_reg(0, "a", 3, 1, (1, 2)));
    let mut w1 = Member::register(h.addr, worker_reg(1, "b", 3, 1));
    let mut w2 = Member::register(h.addr, local_worker_reg(2, "a", 3, 1, (0, 2)));
    let mut s = Member::register(h.addr, server_reg(-1, "127.0.0.1", vec![1], false, 3, 1));
    for m in [&mut w0, &mut w1, &mut w2, &mut s] {
        let w = m.welcome();
        assert_eq!(w.worker_hosts, vec!["a".to_string(), "b".into(), "a".into()]);
        assert_eq!(w.worker_local_ranks, vec![1, 0, 0]);
    }
    let job = FakeJob { addr: h.addr, sched: Some(h), workers: vec![w0, w1, w2], servers: vec![s], welcomes: vec![] };
    job.finish();
}

#[test]
fn a_wrong_local_size_fails_the_job_naming_the_host() {
    // The launcher says 2 workers per host, but 3 register from host "a"
    // (e.g. GRADHUB_LOCAL_SIZE copied from another machine): every member is told.
    let h = start(sched_config(3, 1));
    let mut ws: Vec<Member> =
        (0..3).map(|r| Member::register(h.addr, local_worker_reg(r, "a", 3, 1, (r % 2, 2)))).collect();
    let mut s = Member::register(h.addr, server_reg(-1, "127.0.0.1", vec![1], false, 3, 1));
    for m in ws.iter_mut().chain([&mut s]) {
        let e = m.error();
        assert_contains(&e, &["2 workers", "3 registered", "host a"]);
        m.expect_no_welcome();
    }
    let err = wait_scheduler(h).expect_err("the job must fail");
    assert_contains(&err, &["host a"]);
}

#[test]
fn strangers_cannot_hold_the_scheduler_before_registering() {
    use gradhub::protocol::{Header, MsgType};
    use std::io::{Read, Write};
    use std::net::TcpStream;

    let mut cfg = sched_config(1, 1);
    cfg.peer_timeout_ms = 600;
    let h = start(cfg);
    // A frame too large for a Register: refused at its header.
    let mut big = TcpStream::connect(h.addr).unwrap();
    big.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut hdr = Header::new(MsgType::Register);
    hdr.namespace = NS;
    hdr.payload_len = 1 << 20;
    big.write_all(&hdr.encode(&[])).unwrap();
    let mut reply = Vec::new();
    let _ = big.read_to_end(&mut reply);
    // Before the handshake nothing larger than its frames (64 bytes) is taken.
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.contains(gradhub::protocol::auth::REJECTION), "{reply:?}");
    // A registration trickling in one byte at a time: cut off after the peer timeout.
    let mut slow = TcpStream::connect(h.addr).unwrap();
    slow.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let start_slow = Instant::now();
    let trickle = std::thread::spawn({
        let mut s = slow.try_clone().unwrap();
        move || {
            for b in hdr.encode(&[]) {
                if s.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    });
    let mut buf = Vec::new();
    let _ = slow.read_to_end(&mut buf);
    let took = start_slow.elapsed();
    assert!(took < Duration::from_secs(3), "a trickling registration held its connection for {took:?}");
    let _ = trickle.join();
    // Many idle connections: beyond the cap (2 x members + 16) they are
    // closed at once, without a thread each; the rest time out.
    let idle: Vec<TcpStream> = (0..60).map(|_| TcpStream::connect(h.addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut closed_at_once = 0;
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        if matches!(s.read(&mut [0u8; 1]), Ok(0)) {
            closed_at_once += 1;
        }
    }
    assert!(closed_at_once >= 60 - (2 * 2 + 16), "only {closed_at_once} of 60 idle connections were refused");
    // Once they have timed out, the real members join and the job runs.
    std::thread::sleep(Duration::from_millis(800));
    let mut w = Member::register(h.addr, worker_reg(0, "h", 1, 1));
    let mut s = Member::register(h.addr, server_reg(0, "127.0.0.1", vec![1], false, 1, 1));
    assert_eq!(w.welcome().rank, 0);
    assert_eq!(s.welcome().rank, 0);
    w.start_heartbeat(Duration::from_millis(100));
    s.start_heartbeat(Duration::from_millis(100));
    w.send(&Control::Goodbye).unwrap();
    assert!(matches!(s.recv(), Control::Shutdown));
    w.stop_heartbeat();
    s.stop_heartbeat();
    assert_eq!(wait_scheduler(h), Ok(()));
}

#[test]
fn a_declaration_or_barrier_that_needs_a_worker_that_left_fails_the_job() {
    // Worker 0 waits for a declaration worker 1 never makes; worker 1 leaves.
    let mut job = fake_job(sched_config(2, 1), &[(1, false)]);
    let entries = vec![DeclEntry {
        name: "x".into(),
        numel: 10,
        dtype: DType::F32,
        partition: 0,
        members: Vec::new(),
        sharded: false,
    }];
    job.workers[0].send(&Control::Declare { req: 1, entries }).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    job.workers[1].send(&Control::Goodbye).unwrap();
    let e = job.workers[0].error();
    assert_contains(&e, &["worker(s) [1] left the job", "tensor 'x'", "worker 0 waits"]);
    assert_contains(&job.wait().unwrap_err(), &["tensor 'x'"]);

    // Worker 0 waits in a barrier worker 1 never enters.
    let mut job = fake_job(sched_config(2, 1), &[(1, false)]);
    job.workers[0].send(&Control::Barrier { id: 0 }).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    job.workers[1].send(&Control::Goodbye).unwrap();
    assert_contains(&job.workers[0].error(), &["worker 1 left the job", "barrier 0"]);
    assert!(job.wait().is_err());

    // Worker 1 left first (worker 0 is told); worker 0 then enters a barrier.
    let mut job = fake_job(sched_config(2, 1), &[(1, false)]);
    job.workers[1].send(&Control::Goodbye).unwrap();
    assert_eq!(job.workers[0].recv(), Control::PeerLeft { rank: 1 });
    job.workers[0].send(&Control::Barrier { id: 0 }).unwrap();
    assert_contains(&job.workers[0].error(), &["worker 1 left the job", "before barrier 0"]);
    assert!(job.wait().is_err());
}
