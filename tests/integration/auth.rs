//! Authentication (src/protocol/auth.rs) on real sockets: without the job's
//! token nobody joins, squats a rank on a server, or poses as a server; a
//! recorded handshake does not pass again; the job itself is untouched.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use gradhub::client::Client;
use gradhub::protocol::auth::{self, Connector, Secret, REJECTION};
use gradhub::protocol::{read_message, DType, MsgType};

use crate::support::*;

/// What a listener answered a connector that could not authenticate: its
/// Error frame's text (namespace 0: nothing of the job), then a close.
/// Public for `server::a_server_port_takes_nothing_before_the_handshake`.
pub fn rejection_of(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let (h, text) = read_message(s, None, 1 << 16).expect("an Error frame");
    assert_eq!((h.msg_type, h.namespace), (MsgType::Error, 0));
    String::from_utf8_lossy(&text).into_owned()
}

/// A connector that holds `secret` against the listener at `addr`.
pub fn try_auth(addr: std::net::SocketAddr, secret: &Secret) -> (TcpStream, Result<(), auth::AuthError>) {
    let s = TcpStream::connect_timeout(&addr, IO_TIMEOUT).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let r = authenticate(&s, secret);
    (s, r)
}

#[test]
fn a_wrong_or_missing_token_is_rejected_by_the_scheduler_and_the_job_goes_on() {
    let job = real_job(sched_config(1, 1), &[(1, false)]);
    for bad in [Secret::new(b"not-the-token"), Secret::none()] {
        // The scheduler cannot prove the token to this connector...
        let (_, r) = try_auth(job.addr, &bad);
        assert!(r.unwrap_err().to_string().contains("does not hold this job's token"));
        // ...and a real member with the wrong token gets a clear error.
        let mut cfg = client_config(job.addr, -1, 1, 1);
        (cfg.secret, cfg.connect_timeout) = (bad.clone(), Duration::from_secs(3));
        let err = Client::connect(cfg).err().expect("a worker without the token must not join");
        assert_contains(&err.to_string(), &["authentication failed", "token"]);
    }
    // A connector that skips the handshake and registers straight away.
    let mut rogue = Member::connect_raw(job.addr);
    rogue.send(&gradhub::protocol::Control::Register(worker_reg(0, "rogue", 1, 1))).unwrap();
    assert_eq!(rejection_of(&mut rogue.reader), REJECTION);
    // The real worker still joins as rank 0, and its sums are its own.
    let c = job.clients(1, 1, 1).remove(0);
    assert_eq!(c.rank, 0);
    assert_eq!(push_pull(&c, "x", vec![2.5f32; 40], DType::F32, 0, 0).unwrap(), vec![2.5f32; 40]);
    c.shutdown();
    job.finish_ok();
}

#[test]
fn a_recorded_handshake_does_not_pass_again() {
    let job = real_job(sched_config(1, 1), &[(1, false)]);
    // Record a complete, valid handshake: the hello and the proof.
    let s = TcpStream::connect_timeout(&job.addr, IO_TIMEOUT).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let (c, hello) = Connector::start(&token()).unwrap();
    (&s).write_all(&hello).unwrap();
    let (h, challenge) = read_message(&mut &s, None, 1 << 16).unwrap();
    assert_eq!(h.msg_type, MsgType::AuthChallenge);
    let (proof, _) = c.answer(&challenge).unwrap();
    (&s).write_all(&proof).unwrap();
    drop(s);
    // Replayed byte for byte on a new connection: the listener's new nonce
    // makes the old proof worthless.
    let mut again = TcpStream::connect_timeout(&job.addr, IO_TIMEOUT).unwrap();
    again.write_all(&hello).unwrap();
    let (h, _) = read_message(&mut again, None, 1 << 16).unwrap();
    assert_eq!(h.msg_type, MsgType::AuthChallenge);
    again.write_all(&proof).unwrap();
    assert_eq!(rejection_of(&mut again), REJECTION);
    let c = job.clients(1, 1, 1).remove(0);
    c.shutdown();
    job.finish_ok();
}

#[test]
fn a_process_without_the_token_cannot_pose_as_a_server() {
    // The rogue registers as the job's only server with the right protocol
    // but no token: refused, so the job never starts with it.
    let cfg = sched_config(1, 1);
    let h = start(cfg);
    let mut rogue = Member::connect_raw(h.addr);
    let (_, hello) = Connector::start(&Secret::new(b"rogue")).unwrap();
    rogue.reader.write_all(&hello).unwrap();
    let (h2, _) = read_message(&mut rogue.reader, None, 1 << 16).unwrap();
    assert_eq!(h2.msg_type, MsgType::AuthChallenge);
    // It cannot check the scheduler's proof; it answers with a guess.
    let mut guess = gradhub::protocol::Header::new(MsgType::AuthProof);
    guess.payload_len = auth::PROOF_LEN as u32;
    rogue.reader.write_all(&gradhub::protocol::encode_frame(&guess, &[7u8; auth::PROOF_LEN])).unwrap();
    assert_eq!(rejection_of(&mut rogue.reader), REJECTION);
    // A rogue listener a worker is sent to (as if it had got into the
    // cluster map) cannot prove the token: the worker refuses it.
    let (l, port) = listener();
    let pending = spawn("rogue listener", move || {
        let s = accept(&l);
        auth::listen_blocking(&mut &s, &mut &s, &Secret::new(b"rogue").keys()).err().map(|e| e.to_string())
    });
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let err = authenticate(&s, &token()).unwrap_err();
    assert_contains(&err.to_string(), &["does not hold this job's token"]);
    drop(s);
    // ...and it never gets a proof it could use elsewhere.
    assert!(pending.join().is_some(), "the rogue listener completed a handshake");
    drop(h);
}
