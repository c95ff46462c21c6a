//! The links over real sockets on this host: both directions, tags, any
//! source, messages of many frames, encryption, refusals, a lost peer and
//! a receiver that holds its sender back.

use std::sync::mpsc::{channel, Receiver};

use super::*;

fn config(rank: u32, size: u32, secret: &Secret) -> PeerConfig {
    PeerConfig {
        rank,
        size,
        group: "g/0".into(),
        namespace: 3,
        secret: secret.clone(),
        host: "127.0.0.1".into(),
        timeout: Duration::from_secs(10),
        buffer_bytes: 64 << 20,
    }
}

fn group(size: u32, secret: &Secret) -> Vec<PeerLinks> {
    (0..size).map(|r| PeerLinks::open(config(r, size, secret)).unwrap()).collect()
}

type Got = Receiver<(Result<u32, String>, Vec<u8>)>;

/// Post a receive of `len` bytes; the channel gets its outcome and bytes.
fn post(l: &PeerLinks, src: Option<u32>, tag: Tag, len: usize) -> (Option<u64>, Got) {
    let (tx, rx) = channel();
    let buf = Arc::new(Mutex::new(vec![0u8; len]));
    let ptr = lock(&buf).as_mut_ptr();
    let keep = buf.clone();
    let done = Box::new(move |r| {
        let bytes = lock(&buf).clone();
        let _ = tx.send((r, bytes));
    });
    // SAFETY: the Vec is kept alive by `keep` and only read after `done`.
    let t = l.post(src, tag, unsafe { Receive::new(ptr, len, Box::new(keep), done) });
    (t, rx)
}

fn got(rx: &Got) -> (Result<u32, String>, Vec<u8>) {
    rx.recv_timeout(Duration::from_secs(20)).expect("the receive was never told")
}

#[test]
fn messages_cross_both_ways_in_order_with_tags_and_any_source() {
    let g = group(3, &Secret::new(b"tok"));
    let addr = |r: usize| g[r].address().to_string();
    // Posted before anything is sent, and after: each takes its own.
    let (_, a) = post(&g[1], Some(0), 0, 4);
    g[0].send(1, &addr(1), 0, &[1, 2, 3, 4]).unwrap();
    g[0].send(1, &addr(1), 0, &[5, 6, 7, 8]).unwrap();
    g[0].send(1, &addr(1), 9, &[9; 4]).unwrap();
    assert_eq!(got(&a), (Ok(0), vec![1, 2, 3, 4]));
    let (_, tagged) = post(&g[1], Some(0), 9, 4);
    let (_, b) = post(&g[1], Some(0), 0, 4);
    assert_eq!(got(&tagged), (Ok(0), vec![9; 4]));
    assert_eq!(got(&b), (Ok(0), vec![5, 6, 7, 8]));
    // The other way, a message of several frames.
    let big: Vec<u8> = (0..2 * FRAME_BYTES + 17).map(|i| (i % 251) as u8).collect();
    let (_, c) = post(&g[0], Some(1), -5, big.len());
    g[1].send(0, &addr(0), -5, &big).unwrap();
    assert_eq!(got(&c), (Ok(1), big));
    // Any source: whoever sends; the sender's rank comes back.
    let (_, any) = post(&g[0], None, 2, 1);
    g[2].send(0, &addr(0), 2, &[42]).unwrap();
    assert_eq!(got(&any), (Ok(2), vec![42]));
    // An empty message.
    let (_, e) = post(&g[2], Some(0), 0, 0);
    g[0].send(2, &addr(2), 0, &[]).unwrap();
    assert_eq!(got(&e), (Ok(0), vec![]));
}

#[test]
fn sealed_links_carry_messages_and_keep_them_private() {
    let secret = Secret::new(b"tok").encrypted(true).unwrap();
    let g = group(2, &secret);
    let data = vec![7u8; FRAME_BYTES + 3];
    let (_, r) = post(&g[1], Some(0), 1, data.len());
    g[0].send(1, g[1].address(), 1, &data).unwrap();
    assert_eq!(got(&r), (Ok(0), data));
    // A member that does not encrypt is refused.
    let plain = PeerLinks::open(config(0, 2, &Secret::new(b"tok"))).unwrap();
    assert!(plain.send(1, g[1].address(), 1, &[1]).is_err());
}

#[test]
fn strangers_other_groups_and_wrong_members_are_refused_with_a_reason() {
    let tok = Secret::new(b"tok");
    let g = group(2, &tok);
    let stranger = PeerLinks::open(config(0, 2, &Secret::new(b"other"))).unwrap();
    let e = stranger.send(1, g[1].address(), 0, &[1]).unwrap_err();
    assert!(e.contains("cannot reach member 1") && e.contains("authentication"), "{e}");
    let mut other = config(0, 2, &tok);
    other.group = "g/1".into();
    let e = PeerLinks::open(other).unwrap().send(1, g[1].address(), 0, &[1]).unwrap_err();
    assert!(e.contains("refused") && e.contains("group"), "{e}");
    // Member 0's own listener, given as member 1's address.
    let e = g[0].send(1, g[0].address(), 0, &[1]).unwrap_err();
    assert!(e.contains("refused") && e.contains("this is member 0"), "{e}");
    assert!(g[1].send(5, g[0].address(), 0, &[1]).unwrap_err().contains("group of 2"));
    assert!(got(&post(&g[1], Some(1), 0, 1).1).0.unwrap_err().contains("member 1 in a group of 2"));
    // None of that reached member 1; a real member 0 does.
    let (_, r) = post(&g[1], None, 0, 1);
    assert!(r.recv_timeout(Duration::from_millis(200)).is_err());
    PeerLinks::open(config(0, 2, &tok)).unwrap().send(1, g[1].address(), 0, &[3]).unwrap();
    assert_eq!(got(&r), (Ok(0), vec![3]));
}

#[test]
fn a_peer_that_ends_fails_the_receives_only_it_could_fill_naming_it() {
    let mut g = group(3, &Secret::new(b"tok"));
    let addr1 = g[1].address().to_string();
    g[0].send(1, &addr1, 0, &[1]).unwrap();
    let (_, from0) = post(&g[1], Some(0), 5, 1);
    let (_, any) = post(&g[1], None, 5, 1);
    let (_, sent) = post(&g[1], Some(0), 0, 1);
    assert_eq!(got(&sent), (Ok(0), vec![1]));
    g.remove(0).close("test");
    let why = got(&from0).0.unwrap_err();
    assert!(why.contains("member 0") && why.contains("closed"), "{why}");
    // A receive from it now fails at once; the any-source one waits on for member 2.
    assert!(got(&post(&g[0], Some(0), 0, 1).1).0.unwrap_err().contains("member 0"));
    let (one, two) = (&g[0], &g[1]);
    two.send(1, &addr1, 5, &[9]).unwrap();
    assert_eq!(got(&any), (Ok(2), vec![9]));
    // A size that does not match is an error naming the sender.
    let (_, small) = post(one, Some(2), 0, 1);
    two.send(1, &addr1, 0, &[1, 2]).unwrap();
    let why = got(&small).0.unwrap_err();
    assert!(why.contains("member 2 sent a message of 2 bytes (tag 0) to a receive of 1 bytes"), "{why}");
}

#[test]
fn a_receiver_that_reads_nothing_holds_its_sender_back_and_cancel_withdraws() {
    let secret = Secret::new(b"tok");
    let mut cfg = config(1, 2, &secret);
    cfg.buffer_bytes = 1 << 20;
    let recv = PeerLinks::open(cfg).unwrap();
    let send = Arc::new(PeerLinks::open(config(0, 2, &secret)).unwrap());
    let addr = recv.address().to_string();
    let (tx, sent) = channel();
    let s = send.clone();
    let t = std::thread::spawn(move || {
        for i in 0..64u8 {
            s.send(1, &addr, 0, &vec![i; 1 << 20]).unwrap();
            let _ = tx.send(i);
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    let ahead = sent.try_iter().count();
    assert!(ahead < 40, "{ahead} of 64 MiB sent with nobody receiving (buffer 1 MiB plus the sockets')");
    let (ticket, cancelled) = post(&recv, Some(0), 7, 1);
    assert!(recv.cancel(ticket.unwrap()));
    for i in 0..64u8 {
        let (_, r) = post(&recv, Some(0), 0, 1 << 20);
        let (who, bytes) = got(&r);
        assert_eq!(who, Ok(0));
        assert!(bytes.iter().all(|&b| b == i));
    }
    t.join().unwrap();
    assert!(cancelled.try_recv().is_err(), "a cancelled receive is never told");
}

#[test]
fn silent_strangers_hold_at_most_max_greeting_threads_and_members_get_through_after() {
    use std::io::Read;
    let tok = Secret::new(b"tok");
    let g = group(2, &tok);
    let silent: Vec<TcpStream> = (0..MAX_GREETING).map(|_| TcpStream::connect(g[1].address()).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut extra = TcpStream::connect(g[1].address()).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let t0 = std::time::Instant::now();
    assert_eq!(extra.read(&mut [0u8; 8]).unwrap_or(0), 0, "one past the bound is closed");
    assert!(t0.elapsed() < Duration::from_secs(3));
    drop(silent); // their handshakes end at once
    std::thread::sleep(Duration::from_millis(300));
    let (_, r) = post(&g[1], Some(0), 0, 1);
    g[0].send(1, g[1].address(), 0, &[7]).unwrap();
    assert_eq!(got(&r), (Ok(0), vec![7]));
}
