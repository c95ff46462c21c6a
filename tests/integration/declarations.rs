//! The scheduler's declarations: agreement, keys and chunking, placement,
//! installation on servers before workers are answered, conflicts, stalls.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use gradhub::protocol::{Control, DType, TensorSpec};

use crate::support::*;

/// Collect installs from fake servers until every name in `names` arrived.
fn installed(srv: &AckServer, names: &[&str]) -> HashMap<String, TensorSpec> {
    let mut got = HashMap::new();
    let deadline = Instant::now() + IO_TIMEOUT;
    while !names.iter().all(|n| got.contains_key(*n)) {
        let left = deadline.saturating_duration_since(Instant::now());
        let (_, specs) = srv.installs.recv_timeout(left).expect("server install");
        for s in specs {
            assert!(got.insert(s.name.clone(), s).is_none(), "installed twice");
        }
    }
    got
}

#[test]
fn workers_declaring_in_different_orders_get_identical_specs() {
    let mut job = fake_job(sched_config(3, 2), &[(2, false), (1, false)]);
    let servers: Vec<AckServer> = job.servers.drain(..).map(auto_ack).collect();
    let all = [("a", 1000u64, DType::F32), ("b", 10, DType::F16), ("c", 300, DType::BF16), ("e", 0, DType::F32)];
    let w = &mut job.workers;
    w[0].send(&Control::Declare { req: 10, entries: decl_entries(&[all[0], all[1], all[2], all[3]]) }).unwrap();
    w[1].send(&Control::Declare { req: 20, entries: decl_entries(&[all[2], all[3], all[0], all[1]]) }).unwrap();
    // Worker 2 in two requests.
    let s2a = declared(w[2].declare(30, &[all[0]]), 30);
    let s2b = declared(w[2].declare(31, &[all[3], all[1], all[2]]), 31);
    let s0 = declared(w[0].recv(), 10);
    let s1 = declared(w[1].recv(), 20);

    // Each reply lists the request's tensors in the request's order.
    let names = |s: &[TensorSpec]| s.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&s0), ["a", "b", "c", "e"]);
    assert_eq!(names(&s1), ["c", "e", "a", "b"]);
    assert_eq!(names(&s2a), ["a"]);
    assert_eq!(names(&s2b), ["e", "b", "c"]);

    let by_name = |v: Vec<TensorSpec>| v.into_iter().map(|s| (s.name.clone(), s)).collect::<BTreeMap<_, _>>();
    let m0 = by_name(s0);
    assert_eq!(m0, by_name(s1), "worker 1 got other specs than worker 0");
    assert_eq!(m0, by_name(s2a.into_iter().chain(s2b).collect()), "worker 2 got other specs than worker 0");

    // Keys are distinct; chunking follows the partition size and dtype.
    let keys: HashSet<u32> = m0.values().map(|s| s.key).collect();
    assert_eq!(keys.len(), 4);
    for (name, numel, dtype) in all {
        let s = &m0[name];
        assert_eq!((s.numel, s.dtype), (numel, dtype));
        assert_eq!(s.chunk_elems, (PARTITION as usize / dtype.size()) as u64);
        assert_eq!(s.slots.len() as u64, numel.div_ceil(s.chunk_elems));
        assert!(s.slots.iter().all(|&slot| slot < 3), "{s:?}: only 3 server threads exist");
    }
    assert_eq!(m0["a"].slots.len(), 4);
    // 4 chunks of 'a' over 3 equal threads: all three are used.
    assert_eq!(m0["a"].slots.iter().collect::<HashSet<_>>().len(), 3);

    // Every server installed exactly these specs.
    for srv in &servers {
        let got = installed(srv, &["a", "b", "c", "e"]);
        for (name, s) in &m0 {
            assert_eq!(&got[name], s);
        }
    }

    // Declaring again answers at once with the same spec.
    let again = declared(job.workers[0].declare(11, &[all[0]]), 11);
    assert_eq!(again, vec![m0["a"].clone()]);

    for s in servers {
        let (m, end) = s.stop();
        assert!(end.is_none(), "server got {end:?}");
        job.servers.push(m);
    }
    job.finish();
}

#[test]
fn tensors_are_installed_on_every_server_before_any_worker_is_answered() {
    let mut job = fake_job(sched_config(2, 2), &[(1, false), (1, false)]);
    for w in &job.workers {
        w.send(&Control::Declare { req: 1, entries: decl_entries(&[("w", 5000, DType::F32)]) }).unwrap();
    }
    let mut batches = Vec::new();
    for s in &mut job.servers {
        match s.recv() {
            Control::ServerDeclare { batch, specs } => batches.push((batch, specs)),
            other => panic!("expected ServerDeclare, got {other:?}"),
        }
    }
    assert_eq!(batches[0], batches[1], "both servers install the same batch");
    let (batch, specs) = batches.pop().unwrap();
    assert_eq!(specs.len(), 1);
    // One server acknowledged: nobody is answered yet.
    job.servers[0].send(&Control::ServerDeclareAck { batch }).unwrap();
    job.workers[0].expect_silence(Duration::from_millis(300));
    job.servers[1].send(&Control::ServerDeclareAck { batch }).unwrap();
    for w in &mut job.workers {
        assert_eq!(declared(w.recv(), 1), specs);
    }
    job.finish();
}

#[test]
fn inconsistent_declarations_are_answered_with_an_error_to_every_worker_involved() {
    let mut job = fake_job(sched_config(3, 1), &[(1, false)]);
    let srv = auto_ack(job.servers.remove(0));
    let w = &mut job.workers;

    // Different sizes.
    w[0].send(&Control::Declare { req: 1, entries: decl_entries(&[("x", 100, DType::F32)]) }).unwrap();
    w[1].send(&Control::Declare { req: 1, entries: decl_entries(&[("x", 101, DType::F32)]) }).unwrap();
    for i in [0, 1] {
        match w[i].recv() {
            Control::DeclareError { req, message } => {
                assert_eq!(req, 1);
                assert_contains(&message, &["'x'", "100", "101"]);
            }
            other => panic!("worker {i}: expected DeclareError, got {other:?}"),
        }
    }
    // A worker declaring it later is told too.
    match w[2].declare(1, &[("x", 100, DType::F32)]) {
        Control::DeclareError { req: 1, message } => assert_contains(&message, &["'x'"]),
        other => panic!("expected DeclareError, got {other:?}"),
    }

    // Different dtypes, inside a batch with a good tensor.
    w[0].send(&Control::Declare { req: 2, entries: decl_entries(&[("ok", 8, DType::F32), ("y", 10, DType::F32)]) })
        .unwrap();
    w[1].send(&Control::Declare { req: 2, entries: decl_entries(&[("y", 10, DType::F16)]) }).unwrap();
    for i in [0, 1] {
        match w[i].recv() {
            Control::DeclareError { req, message } => {
                assert_eq!(req, 2);
                assert_contains(&message, &["'y'", "float32", "float16"]);
            }
            other => panic!("worker {i}: expected DeclareError, got {other:?}"),
        }
    }

    // The job goes on: a consistent tensor is declared normally.
    for w in w.iter() {
        w.send(&Control::Declare { req: 3, entries: decl_entries(&[("z", 64, DType::BF16)]) }).unwrap();
    }
    let specs: Vec<_> = w.iter_mut().map(|m| declared(m.recv(), 3)).collect();
    assert!(specs.iter().all(|s| s == &specs[0] && s[0].name == "z"));
    // Only 'z' was ever installed ('ok' still waits for workers 1 and 2).
    let (_, inst) = srv.installs.recv_timeout(IO_TIMEOUT).unwrap();
    assert_eq!(inst, specs[0]);
    assert!(srv.installs.try_recv().is_err());
    let (m, _) = srv.stop();
    job.servers.push(m);
    job.finish();
}

#[test]
fn oversized_tensor_is_refused_to_its_declarer_only() {
    let mut job = fake_job(sched_config(2, 1), &[(1, false)]);
    let srv = auto_ack(job.servers.remove(0));
    match job.workers[0].declare(4, &[("fine", 4, DType::F32), ("huge", 1 << 40, DType::F32)]) {
        Control::DeclareError { req: 4, message } => assert_contains(&message, &["'huge'", "too large"]),
        other => panic!("expected DeclareError, got {other:?}"),
    }
    job.workers[1].expect_silence(Duration::from_millis(200));
    // Nothing of the refused request was recorded: 'fine' needs worker 0 again.
    for w in &job.workers {
        w.send(&Control::Declare { req: 5, entries: decl_entries(&[("fine", 4, DType::F32)]) }).unwrap();
    }
    for w in &mut job.workers {
        assert_eq!(declared(w.recv(), 5).len(), 1);
    }
    let (m, _) = srv.stop();
    job.servers.push(m);
    job.finish();
}

#[test]
fn declaration_waiting_for_a_worker_gets_a_stall_report_naming_it() {
    let mut cfg = sched_config(3, 1);
    cfg.stall_ms = 300;
    cfg.heartbeat_ms = 50;
    let mut job = fake_job(cfg, &[(1, false)]);
    let srv = auto_ack(job.servers.remove(0));
    let t0 = Instant::now();
    for i in [0, 2] {
        job.workers[i].send(&Control::Declare { req: 9, entries: decl_entries(&[("s", 10, DType::F32)]) }).unwrap();
    }
    for i in [0, 2] {
        match job.workers[i].recv() {
            Control::DeclareStall { name, missing, waited_ms } => {
                assert_eq!(name, "s");
                assert_eq!(missing, vec![1]);
                assert!(waited_ms >= 300, "waited_ms {waited_ms}");
            }
            other => panic!("worker {i}: expected DeclareStall, got {other:?}"),
        }
    }
    assert!(t0.elapsed() >= Duration::from_millis(280), "stall reported after {:?}", t0.elapsed());
    // Worker 1 (not waiting on it) hears nothing; the report is not repeated.
    job.workers[1].expect_silence(Duration::from_millis(100));
    job.workers[0].expect_silence(Duration::from_millis(300));
    // A stall is not an error: once worker 1 declares, everyone gets the spec.
    let s1 = declared(job.workers[1].declare(9, &[("s", 10, DType::F32)]), 9);
    for i in [0, 2] {
        assert_eq!(declared(job.workers[i].recv(), 9), s1);
    }
    let (m, _) = srv.stop();
    job.servers.push(m);
    job.finish();
}

/// Bytes placed per global slot by these specs.
fn slot_bytes(specs: &[TensorSpec], nslots: usize) -> Vec<u64> {
    let mut b = vec![0u64; nslots];
    for s in specs {
        for (c, &slot) in s.slots.iter().enumerate() {
            b[slot as usize] += s.chunk_bytes(c) as u64;
        }
    }
    b
}

/// Every worker declares the same tensors (alternate workers in reverse order).
fn declare_everywhere(job: &mut FakeJob, tensors: &[(String, u64, DType)]) -> Vec<TensorSpec> {
    let e: Vec<(&str, u64, DType)> = tensors.iter().map(|(n, k, d)| (n.as_str(), *k, *d)).collect();
    for (i, w) in job.workers.iter().enumerate() {
        let mut e = e.clone();
        if i % 2 == 1 {
            e.reverse();
        }
        w.send(&Control::Declare { req: 0, entries: decl_entries(&e) }).unwrap();
    }
    let mut specs: Vec<Vec<TensorSpec>> = job.workers.iter_mut().map(|w| declared(w.recv(), 0)).collect();
    for s in &mut specs {
        s.sort_by_key(|s| s.key);
    }
    assert!(specs.iter().all(|s| s == &specs[0]));
    specs.swap_remove(0)
}

#[test]
fn placement_with_mixed_servers_follows_the_byteps_weights() {
    // n = 4 workers, k = 1 CPU-only server: weights 2(n-1) = 6 (CPU-only) and
    // n-k = 3 (colocated), i.e. shares 1/2, 1/4, 1/4 of the bytes; a server's
    // share is split evenly over its threads.
    let mut job = fake_job(sched_config(4, 3), &[(1, false), (2, true), (1, true)]);
    let srvs: Vec<AckServer> = job.servers.drain(..).map(auto_ack).collect();
    let tensors: Vec<(String, u64, DType)> = (0..60u64)
        .map(|i| (format!("t{i}"), 50 + (i * 977) % 3000, if i % 3 == 0 { DType::F16 } else { DType::F32 }))
        .collect();
    let specs = declare_everywhere(&mut job, &tensors);
    let b = slot_bytes(&specs, 4);
    let total: u64 = b.iter().sum();
    let expect_total: u64 = tensors.iter().map(|(_, n, d)| n * d.size() as u64).sum();
    assert_eq!(total, expect_total);
    let share = |x: u64| x as f64 / total as f64;
    let per_server = [b[0], b[1] + b[2], b[3]];
    for (got, want) in per_server.iter().zip([0.5, 0.25, 0.25]) {
        assert!((share(*got) - want).abs() < 0.02, "server shares {per_server:?} of {total}, want 2:1:1");
    }
    assert!((share(b[1]) - 0.125).abs() < 0.02 && (share(b[2]) - 0.125).abs() < 0.02, "threads {b:?}");
    for s in srvs {
        job.servers.push(s.stop().0);
    }
    job.finish();
}

#[test]
fn placement_gives_colocated_servers_nothing_when_cpu_servers_outnumber_workers() {
    // n = 2 workers, k = 2 CPU-only servers: a colocated server's weight n-k is 0
    // (BytePS's "use PS only" regime); the two CPU-only servers split evenly.
    let mut job = fake_job(sched_config(2, 3), &[(1, false), (1, true), (1, false)]);
    let srvs: Vec<AckServer> = job.servers.drain(..).map(auto_ack).collect();
    let tensors: Vec<(String, u64, DType)> = (0..20u64).map(|i| (format!("p{i}"), 100 + i * 37, DType::F32)).collect();
    let specs = declare_everywhere(&mut job, &tensors);
    let b = slot_bytes(&specs, 3);
    assert_eq!(b[1], 0, "colocated server got bytes: {b:?}");
    let total = (b[0] + b[2]) as f64;
    assert!((b[0] as f64 / total - 0.5).abs() < 0.05, "{b:?}");
    for s in srvs {
        job.servers.push(s.stop().0);
    }
    job.finish();
}

#[test]
fn placement_counts_hosts_not_workers_when_hosts_sum_first() {
    // 4 workers on 2 hosts, 2 CPU-only and 2 colocated servers. With the host
    // stage 2 machines push (n = 2 = k: PS only, colocated servers get
    // nothing); without it 4 do (n = 4, k = 2: weights 6 and 2).
    let hosts: Vec<String> = ["a", "a", "b", "b"].iter().map(|h| h.to_string()).collect();
    let servers = [(1, false), (1, false), (1, true), (1, true)];
    let tensors: Vec<(String, u64, DType)> = (0..40u64).map(|i| (format!("p{i}"), 100 + i * 53, DType::F32)).collect();
    for reduce in [true, false] {
        let mut cfg = sched_config(4, 4);
        cfg.host_reduce = reduce;
        let mut job = fake_job_on(cfg, &servers, &hosts);
        let srvs: Vec<AckServer> = job.servers.drain(..).map(auto_ack).collect();
        let specs = declare_everywhere(&mut job, &tensors);
        let b = slot_bytes(&specs, 4);
        let total: u64 = b.iter().sum();
        let cpu_share = (b[0] + b[1]) as f64 / total as f64;
        if reduce {
            assert_eq!((b[2], b[3]), (0, 0), "colocated servers got bytes: {b:?}");
        } else {
            // 2 x 6 / (2 x 6 + 2 x 2) = 3/4 on the CPU-only servers.
            assert!((cpu_share - 0.75).abs() < 0.03, "{b:?}");
        }
        for s in srvs {
            job.servers.push(s.stop().0);
        }
        job.finish();
    }
}

#[test]
fn a_name_repeated_in_one_request_is_placed_and_installed_once() {
    let mut job = fake_job(sched_config(1, 1), &[(2, false)]);
    job.workers[0]
        .send(&Control::Declare { req: 0, entries: decl_entries(&[("x", 600, DType::F32), ("x", 600, DType::F32)]) })
        .unwrap();
    let (batch, specs) = match job.servers[0].recv() {
        Control::ServerDeclare { batch, specs } => (batch, specs),
        other => panic!("expected ServerDeclare, got {other:?}"),
    };
    job.servers[0].send(&Control::ServerDeclareAck { batch }).unwrap();
    let reply = declared(job.workers[0].recv(), 0);
    assert_eq!(reply.len(), 2);
    assert_eq!(reply[0], reply[1]);
    // The server allocates chunk buffers per installed spec: one tensor, one spec.
    let keys: Vec<u32> = specs.iter().map(|s| s.key).collect();
    assert_eq!(specs.len(), 1, "'x' installed {} times, under keys {keys:?}", specs.len());
    assert_eq!(specs[0], reply[0]);
    job.finish();
}

/// The next ServerDeclare a fake server gets, acknowledged; its specs.
fn ack_install(s: &mut Member) -> Vec<TensorSpec> {
    match s.recv() {
        Control::ServerDeclare { batch, specs } => {
            s.send(&Control::ServerDeclareAck { batch }).unwrap();
            specs
        }
        other => panic!("expected ServerDeclare, got {other:?}"),
    }
}

#[test]
fn a_tensor_is_freed_on_the_servers_once_every_worker_released_it_and_its_name_is_free_at_once() {
    let mut job = fake_job(sched_config(2, 1), &[(2, false)]);
    for w in &job.workers {
        w.send(&Control::Declare { req: 1, entries: decl_entries(&[("x", 1000, DType::F32), ("y", 8, DType::F32)]) })
            .unwrap();
    }
    let installed = ack_install(&mut job.servers[0]);
    let specs: Vec<Vec<TensorSpec>> = job.workers.iter_mut().map(|w| declared(w.recv(), 1)).collect();
    assert_eq!(specs[0], specs[1]);
    assert_eq!(installed.len(), 2);
    let (x, y) = (specs[0][0].clone(), specs[0][1].clone());

    // Worker 0 is done with x: the servers keep it (worker 1 may still be
    // receiving its last result) ...
    job.workers[0].send(&Control::Release { keys: vec![x.key] }).unwrap();
    job.servers[0].expect_silence(Duration::from_millis(300));
    // ... but the name is free: declaring it again is a new tensor, once
    // every worker declared it.
    job.workers[0].send(&Control::Declare { req: 2, entries: decl_entries(&[("x", 10, DType::F16)]) }).unwrap();
    job.servers[0].expect_silence(Duration::from_millis(300));
    job.workers[1].send(&Control::Release { keys: vec![x.key] }).unwrap();
    match job.servers[0].recv() {
        Control::ServerRelease { keys } => assert_eq!(keys, vec![x.key]),
        other => panic!("expected ServerRelease, got {other:?}"),
    }
    job.workers[1].send(&Control::Declare { req: 2, entries: decl_entries(&[("x", 10, DType::F16)]) }).unwrap();
    let again = ack_install(&mut job.servers[0]);
    let new: Vec<TensorSpec> = job.workers.iter_mut().map(|w| declared(w.recv(), 2).remove(0)).collect();
    assert_eq!(new[0], new[1]);
    assert_eq!(again, vec![new[0].clone()]);
    assert_eq!((new[0].numel, new[0].dtype), (10, DType::F16));
    assert!(new[0].key != x.key && new[0].key != y.key, "a new tensor needs a new key: {new:?}");

    // y is untouched: declaring it again answers at once with its spec.
    let again_y = declared(job.workers[0].declare(3, &[("y", 8, DType::F32)]), 3);
    assert_eq!(again_y, vec![y]);
    job.finish();
}

#[test]
fn releasing_a_tensor_twice_or_one_never_declared_fails_the_job_naming_the_worker() {
    for case in ["twice", "unknown"] {
        let mut job = fake_job(sched_config(2, 1), &[(1, false)]);
        let srv: Vec<AckServer> = job.servers.drain(..).map(auto_ack).collect();
        let x = declare_everywhere(&mut job, &[("x".into(), 100, DType::F32)]).remove(0);
        let (key, want) = match case {
            "twice" => {
                job.workers[1].send(&Control::Release { keys: vec![x.key] }).unwrap();
                (x.key, "worker 1 released tensor 'x' twice")
            }
            _ => (x.key + 100, "worker 1 released tensor key"),
        };
        job.workers[1].send(&Control::Release { keys: vec![key] }).unwrap();
        assert_contains(&job.workers[1].error(), &[want]);
        match job.workers[0].recv() {
            Control::PeerLost { rank: 1, reason, .. } => assert_contains(&reason, &[want]),
            other => panic!("{case}: worker 0 expected PeerLost, got {other:?}"),
        }
        assert_contains(&job.wait().unwrap_err(), &[want]);
        drop(srv);
    }
}
