//! The member session (src/session.rs) as workers and servers see it: the
//! job's peer timeout comes from the scheduler's Welcome and means the same
//! for every role; a silent or lost scheduler is reported, never waited on.

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use gradhub::client::{Client, ClientConfig};
use gradhub::protocol::auth::Secret;
use gradhub::protocol::{read_control, write_control, Control, Role, Welcome};
use gradhub::server::{run_server, ServerConfig};

use crate::support::accept_authenticated;

/// A scheduler that welcomes one member and then does what the test says.
struct FakeScheduler {
    listener: TcpListener,
}

impl FakeScheduler {
    fn new() -> FakeScheduler {
        FakeScheduler { listener: TcpListener::bind("127.0.0.1:0").expect("bind") }
    }
    fn addr(&self) -> String {
        self.listener.local_addr().expect("addr").to_string()
    }
    /// Accept one member, check its Register, send a Welcome with this peer timeout.
    fn welcome(&self, role: Role, peer_timeout_ms: u32) -> TcpStream {
        let (mut s, _) = self.listener.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        accept_authenticated(&s, &Secret::none());
        match read_control(&mut s, 0) {
            Ok(Control::Register(r)) => assert_eq!(r.role, role),
            other => panic!("expected Register, got {other:?}"),
        }
        write_control(&mut s, &Control::Welcome(welcome(peer_timeout_ms)), 0).expect("welcome");
        s
    }
}

/// The Welcome of a one-worker job without servers.
fn welcome(peer_timeout_ms: u32) -> Welcome {
    Welcome {
        rank: 0,
        num_workers: 1,
        partition_bytes: 1 << 16,
        heartbeat_ms: 50,
        stall_ms: 60_000,
        peer_timeout_ms,
        servers: Vec::new(),
        worker_hosts: vec![gradhub::host_id()],
        worker_local_ranks: vec![0],
        job_id: 1,
        host_reduce: false,
        failover: false,
        late: false,
        racks: Vec::new(),
        worker_racks: vec![0],
        rack_reduce: false,
    }
}

/// The next message that is not a heartbeat.
fn next_message(s: &mut TcpStream) -> Control {
    loop {
        match read_control(s, 0) {
            Ok(Control::Heartbeat | Control::Ack { .. }) => {}
            Ok(m) => return m,
            Err(e) => panic!("no message: {e}"),
        }
    }
}

#[test]
fn a_worker_dials_a_lost_scheduler_again_rejoins_and_sends_its_request_once() {
    let sched = FakeScheduler::new();
    let addr = sched.addr();
    let t = std::thread::spawn(move || Client::connect(ClientConfig { scheduler: addr, ..Default::default() }));
    let first = sched.welcome(Role::Worker, 3000);
    let client = std::sync::Arc::new(t.join().expect("thread").expect("connect"));
    // The scheduler goes away; a barrier entered meanwhile waits for it.
    drop(first);
    let c = client.clone();
    let barrier = std::thread::spawn(move || c.barrier());
    // It comes back: the worker dials it again and rejoins with what it knows.
    let (mut s, _) = sched.listener.accept().expect("accept");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    accept_authenticated(&s, &Secret::none());
    let rj = match read_control(&mut s, 0) {
        Ok(Control::Rejoin(rj)) => rj,
        other => panic!("expected Rejoin, got {other:?}"),
    };
    assert_eq!((rj.register.role, rj.welcome.rank, rj.welcome.job_id), (Role::Worker, 0, 1));
    assert_eq!((rj.specs.len(), rj.barriers), (0, 0));
    write_control(&mut s, &Control::Welcome(welcome(3000)), 0).expect("welcome");
    // A scheduler heartbeats (a silent one would be lost again).
    let beating = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (mut hb, on) = (s.try_clone().expect("clone"), beating.clone());
    let heart = std::thread::spawn(move || {
        while on.load(std::sync::atomic::Ordering::SeqCst) && write_control(&mut hb, &Control::Heartbeat, 0).is_ok() {
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    // The barrier request goes again, once, and its answer releases it.
    assert_eq!(next_message(&mut s), Control::Barrier { id: 0 });
    write_control(&mut s, &Control::BarrierDone { id: 0 }, 0).expect("done");
    barrier.join().expect("thread").expect("barrier");
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_millis(400) {
        match read_control(&mut s, 0) {
            Ok(Control::Heartbeat | Control::Ack { .. }) => {}
            other => panic!("only heartbeats after the barrier, got {other:?}"),
        }
    }
    assert_eq!(client.failure(), None);
    // Its goodbye reaches the scheduler that came back.
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let bye = std::thread::spawn(move || client.shutdown());
    assert_eq!(next_message(&mut s), Control::Goodbye);
    beating.store(false, std::sync::atomic::Ordering::SeqCst);
    heart.join().expect("thread");
    drop(s);
    bye.join().expect("thread");
}

/// The member's next message, heartbeats skipped; Acks returned (what
/// they acknowledge is the test's point).
fn next_with_acks(s: &mut TcpStream) -> Control {
    loop {
        match read_control(s, 0) {
            Ok(Control::Heartbeat) => {}
            Ok(m) => return m,
            Err(e) => panic!("no message: {e}"),
        }
    }
}

/// The member's next message that is no heartbeat nor Ack.
fn next_counted(s: &mut TcpStream) -> Control {
    loop {
        match next_with_acks(s) {
            Control::Ack { .. } => {}
            m => return m,
        }
    }
}

/// Accept the member dialling again: its Rejoin.
fn accept_rejoin(sched: &FakeScheduler) -> (TcpStream, gradhub::protocol::Rejoin) {
    let (mut s, _) = sched.listener.accept().expect("accept");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    accept_authenticated(&s, &Secret::none());
    match read_control(&mut s, 0) {
        Ok(Control::Rejoin(rj)) => (s, *rj),
        other => panic!("expected Rejoin, got {other:?}"),
    }
}

#[test]
fn a_session_whose_connection_broke_resumes_and_each_side_gets_exactly_what_it_missed() {
    let sched = FakeScheduler::new();
    let addr = sched.addr();
    let t = std::thread::spawn(move || Client::connect(ClientConfig { scheduler: addr, ..Default::default() }));
    let mut first = sched.welcome(Role::Worker, 3000);
    let client = std::sync::Arc::new(t.join().expect("thread").expect("connect"));
    // Two barriers: the first answered, the second's request arrives, then
    // the connection breaks.
    let c = client.clone();
    let barriers = std::thread::spawn(move || c.barrier().and_then(|()| c.barrier()));
    assert_eq!(next_counted(&mut first), Control::Barrier { id: 0 });
    write_control(&mut first, &Control::BarrierDone { id: 0 }, 0).expect("done");
    // The member acknowledges the answer in its heartbeats; its second
    // request comes meanwhile.
    let (mut acked, mut second) = (false, false);
    while !(acked && second) {
        match next_with_acks(&mut first) {
            Control::Ack { received: 1 } => acked = true,
            Control::Ack { received: 0 } => {}
            Control::Barrier { id: 1 } => second = true,
            other => panic!("unexpected {other:?}"),
        }
    }
    drop(first);
    // It dials again and says how much of the scheduler's session it got.
    let (mut s, rj) = accept_rejoin(&sched);
    assert_eq!((rj.welcome.job_id, rj.welcome.rank, rj.received), (1, 0, 1));
    // This scheduler lived but says it got only the first request: that one
    // is not sent again (it is acknowledged), the second is, once.
    write_control(&mut s, &Control::Resumed { received: 1 }, 0).expect("resumed");
    assert_eq!(next_counted(&mut s), Control::Barrier { id: 1 });
    write_control(&mut s, &Control::BarrierDone { id: 1 }, 0).expect("done");
    barriers.join().expect("thread").expect("both barriers");
    while next_with_acks(&mut s) != (Control::Ack { received: 2 }) {}
    // Broken again, and this time the scheduler had everything: nothing is
    // sent again, and the session goes on (a third barrier).
    drop(s);
    let (mut s, rj) = accept_rejoin(&sched);
    assert_eq!(rj.received, 2);
    write_control(&mut s, &Control::Resumed { received: 2 }, 0).expect("resumed");
    let c = client.clone();
    let third = std::thread::spawn(move || c.barrier());
    assert_eq!(next_counted(&mut s), Control::Barrier { id: 2 }, "only the new request");
    write_control(&mut s, &Control::BarrierDone { id: 2 }, 0).expect("done");
    third.join().expect("thread").expect("third barrier");
    assert_eq!(client.failure(), None);
    // A scheduler that claims more than was sent is a confused one: the
    // member gives up on it, naming why.
    drop(s);
    let (mut s, _) = accept_rejoin(&sched);
    write_control(&mut s, &Control::Resumed { received: 99 }, 0).expect("resumed");
    let failed = wait_until(Duration::from_secs(10), || client.failure().is_some());
    assert!(failed < Duration::from_secs(10));
    let why = client.failure().unwrap_or_default();
    assert!(why.contains("received 99") && why.contains("not kept"), "{why}");
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "condition not met within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    start.elapsed()
}

#[test]
fn a_worker_uses_the_peer_timeout_from_welcome() {
    let sched = FakeScheduler::new();
    let addr = sched.addr();
    let t = std::thread::spawn(move || Client::connect(ClientConfig { scheduler: addr, ..Default::default() }));
    let mut s = sched.welcome(Role::Worker, 400);
    let client = t.join().expect("thread").expect("connect");
    // Heartbeats keep the session alive well past the timeout...
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(1200) {
        write_control(&mut s, &Control::Heartbeat, 0).expect("heartbeat");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(client.failure(), None);
    // ...the member heartbeats too...
    assert!(matches!(read_control(&mut s, 0), Ok(Control::Ack { .. })));
    // ...and silence is detected after the job's timeout, not a built-in 10 s.
    let took = wait_until(Duration::from_secs(5), || client.failure().is_some());
    let why = client.failure().unwrap_or_default();
    assert!(why.contains("scheduler sent nothing") && why.contains("heartbeat"), "{why}");
    assert!(took < Duration::from_secs(3), "detected after {took:?}");
    client.shutdown();
}

#[test]
fn a_server_uses_the_peer_timeout_from_welcome_and_reports_a_lost_scheduler() {
    for (silent, expect) in [(true, "scheduler sent nothing"), (false, "lost the connection to the scheduler")] {
        let sched = FakeScheduler::new();
        let addr = sched.addr();
        let started = Instant::now();
        let t = std::thread::spawn(move || {
            run_server(ServerConfig {
                scheduler: addr,
                advertise: Some("127.0.0.1".into()),
                bind_host: "127.0.0.1".into(),
                ..Default::default()
            })
        });
        let s = sched.welcome(Role::Server, 300);
        if !silent {
            drop(s);
            let err = t.join().expect("thread").expect_err("the server must fail");
            assert!(err.to_string().contains(expect), "{err}");
            continue;
        }
        let err = t.join().expect("thread").expect_err("the server must fail");
        assert!(err.to_string().contains(expect), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        drop(s);
    }
}

#[test]
fn a_rejection_reaches_the_member_as_an_error() {
    let sched = FakeScheduler::new();
    let addr = sched.addr();
    let t = std::thread::spawn(move || {
        Client::connect(ClientConfig { scheduler: addr, connect_timeout: Duration::from_secs(5), ..Default::default() })
    });
    let (mut s, _) = sched.listener.accept().expect("accept");
    accept_authenticated(&s, &Secret::none());
    assert!(matches!(read_control(&mut s, 0), Ok(Control::Register(_))));
    write_control(&mut s, &Control::Error { message: "go away".into() }, 0).expect("error");
    let err = t.join().expect("thread").err().expect("connect must fail");
    let msg = err.to_string();
    assert!(msg.contains("rejected by the scheduler") && msg.contains("go away"), "{msg}");
}
