//! Encryption (src/protocol/seal.rs) on real sockets: an encrypted job
//! sums exactly as any job does, over its control and data connections,
//! and a member whose setting differs is refused with the setting named.

use gradhub::client::Client;
use gradhub::protocol::auth::{Secret, ENCRYPT_SETTING};
use gradhub::protocol::DType;
use gradhub::server::run_server;

use crate::support::*;

fn sealed() -> Secret {
    token().encrypted(true).expect("a token")
}

#[test]
fn an_encrypted_job_sums_exactly_over_every_connection() {
    // Three workers on three hosts (no host stage: every push crosses a
    // socket), two servers of two threads. (Server-to-server links, made
    // for a server-side optimizer, are sealed alike: tests/test_encrypt.py.)
    let (nw, ns) = (3u32, 2u32);
    let mut cfg = sched_config(nw, ns);
    cfg.secret = sealed();
    let h = start(cfg);
    let servers: Vec<_> = (0..ns as i32)
        .map(|i| {
            let mut sc = server_config(h.addr, 2, false, i, nw, ns);
            sc.secret = sealed();
            spawn_server(sc)
        })
        .collect();
    let pending: Vec<_> = (0..nw)
        .map(|i| {
            let mut c = client_config(h.addr, i as i32, nw, ns);
            (c.secret, c.host) = (sealed(), Some(format!("host-{i}")));
            spawn_client(c)
        })
        .collect();
    let clients: Vec<Client> = pending.into_iter().map(|p| p.join()).collect();
    // Sizes of one element to several chunks (1024-byte partitions), f32
    // and f16 (summed in f32, returned as f16), each worker its own values.
    let sizes = [1usize, 300, 5000];
    let results: Vec<_> = std::thread::scope(|s| {
        let runs: Vec<_> = clients
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let r = c.rank as f32;
                    let mut out = Vec::new();
                    for (t, &n) in sizes.iter().enumerate() {
                        let v: Vec<f32> = (0..n).map(|i| r * 1000.0 + i as f32).collect();
                        out.push(push_pull(c, &format!("w{t}"), v, DType::F32, 0, 0).unwrap());
                        let h: Vec<u16> = (0..n).map(|i| half::f16::from_f32(r + (i % 7) as f32).to_bits()).collect();
                        let got = push_pull(c, &format!("h{t}"), h, DType::F16, 0, 0).unwrap();
                        out.push(got.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect());
                    }
                    out
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let ranks: f32 = (0..nw).map(|r| r as f32).sum();
    for got in &results {
        for (t, &n) in sizes.iter().enumerate() {
            let want: Vec<f32> = (0..n).map(|i| ranks * 1000.0 + nw as f32 * i as f32).collect();
            assert_eq!(got[2 * t], want, "f32 tensor of {n}");
            let want: Vec<f32> = (0..n).map(|i| ranks + nw as f32 * (i % 7) as f32).collect();
            assert_eq!(got[2 * t + 1], want, "f16 tensor of {n}");
        }
    }
    for c in clients {
        c.shutdown();
    }
    let mut job = RealJob { addr: h.addr, sched: Some(h), servers };
    for r in job.server_results() {
        assert_eq!(r, Ok(()), "server exit");
    }
    assert_eq!(job.wait(), Ok(()));
}

#[test]
fn a_member_whose_encryption_differs_is_refused_naming_the_setting() {
    // An encrypted job: a worker and a server without encryption.
    let mut cfg = sched_config(1, 1);
    cfg.secret = sealed();
    let h = start(cfg);
    let mut c = client_config(h.addr, -1, 1, 1);
    c.connect_timeout = std::time::Duration::from_secs(3);
    let err = Client::connect(c).err().expect("an unencrypted worker must not join");
    assert_contains(&err.to_string(), &[ENCRYPT_SETTING, "encrypt"]);
    let mut sc = server_config(h.addr, 1, false, 0, 1, 1);
    sc.connect_timeout = std::time::Duration::from_secs(3);
    let err = run_server(sc).expect_err("an unencrypted server must not join");
    assert_contains(&err.to_string(), &[ENCRYPT_SETTING]);
    // The job itself is untouched: its real members join and sum.
    let mut sc = server_config(h.addr, 1, false, 0, 1, 1);
    sc.secret = sealed();
    let server = spawn_server(sc);
    let mut c = client_config(h.addr, -1, 1, 1);
    c.secret = sealed();
    let c = spawn_client(c).join();
    assert_eq!(push_pull(&c, "x", vec![1.5f32; 700], DType::F32, 0, 0).unwrap(), vec![1.5f32; 700]);
    c.shutdown();
    let mut job = RealJob { addr: h.addr, sched: Some(h), servers: vec![server] };
    assert_eq!(job.server_results(), vec![Ok(())]);
    assert_eq!(job.wait(), Ok(()));

    // An unencrypted job: an encrypting worker is refused too.
    let job = real_job(sched_config(1, 1), &[(1, false)]);
    let mut c = client_config(job.addr, -1, 1, 1);
    (c.secret, c.connect_timeout) = (sealed(), std::time::Duration::from_secs(3));
    let err = Client::connect(c).err().expect("an encrypting worker must not join an unencrypted job");
    assert_contains(&err.to_string(), &[ENCRYPT_SETTING, "do not encrypt"]);
    let c = job.clients(1, 1, 1).remove(0);
    c.shutdown();
    job.finish_ok();
}
