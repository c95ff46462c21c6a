//! The server thread, driven through a real scheduler and a real server
//! (`run_server` on a thread) by fake workers on raw sockets: sums, the
//! Received/Result protocol, frame validation, stalls, shutdown.

use std::time::{Duration, Instant};

use gradhub::protocol::{
    decode_stall, encode_frame, Control, DType, Header, MsgType, TensorSpec, Welcome, FLAG_AVERAGE, FLAG_INIT,
    FLAG_RESENT, FLAG_ZEROS, HEADER_LEN,
};
use half::{bf16, f16};

use crate::support::*;

/// A real scheduler and one real server; the workers are fake.
struct DataJob {
    job: RealJob,
    workers: Vec<Member>,
    welcome: Welcome,
}

/// Fake workers, each on a host of its own.
fn data_job(nw: u32, threads: usize, tweak: impl FnOnce(&mut gradhub::scheduler::SchedulerConfig)) -> DataJob {
    let hosts: Vec<String> = (0..nw).map(|r| format!("h{r}")).collect();
    data_job_on(&hosts, threads, tweak)
}

/// Fake worker `r` registers from host `hosts[r]`.
fn data_job_on(
    hosts: &[String],
    threads: usize,
    tweak: impl FnOnce(&mut gradhub::scheduler::SchedulerConfig),
) -> DataJob {
    let nw = hosts.len() as u32;
    let mut cfg = sched_config(nw, 1);
    tweak(&mut cfg);
    let training = cfg.training;
    let job = real_job(cfg, &[(threads, false)]);
    let reg = |r: u32| gradhub::protocol::Register { training, ..worker_reg(r as i32, &hosts[r as usize], nw, 1) };
    let mut workers: Vec<Member> = (0..nw).map(|r| Member::register(job.addr, reg(r))).collect();
    let welcomes: Vec<Welcome> = workers.iter_mut().map(|w| w.welcome()).collect();
    let welcome = welcomes.into_iter().next().unwrap();
    assert_eq!(welcome.servers.len(), 1);
    assert_eq!(welcome.servers[0].ports.len(), threads);
    assert_eq!(welcome.servers[0].addr, "127.0.0.1");
    DataJob { job, workers, welcome }
}

impl DataJob {
    /// Every worker declares `entries`; returns the (identical) specs.
    fn declare(&mut self, req: u32, entries: &[(&str, u64, DType)]) -> Vec<TensorSpec> {
        let e = decl_entries(entries);
        for w in &self.workers {
            w.send(&Control::Declare { req, entries: e.clone() }).unwrap();
        }
        let specs: Vec<Vec<TensorSpec>> = self.workers.iter_mut().map(|w| declared(w.recv(), req)).collect();
        assert!(specs.iter().all(|s| s == &specs[0]));
        specs.into_iter().next().unwrap()
    }

    fn port(&self, slot: u32) -> u16 {
        self.welcome.servers[0].ports[slot as usize]
    }

    /// A data connection to `slot` with DataHello for `rank`.
    fn conn(&self, slot: u32, rank: u32) -> DataConn {
        DataConn::connect_hello("127.0.0.1", self.port(slot), rank)
    }

    /// A data connection to `slot`, no hello.
    fn raw(&self, slot: u32) -> DataConn {
        DataConn::connect("127.0.0.1", self.port(slot))
    }

    /// Every worker says goodbye: the server exits Ok, the job ends Ok.
    fn finish(self) {
        for w in &self.workers {
            w.send(&Control::Goodbye).unwrap();
        }
        self.job.finish_ok();
    }
}

/// Run one round of `spec` with the fake workers in `order`: each pushes all
/// chunks, non-final pushers get Received for each, then every worker gets
/// every Result. Returns each worker's result bytes per chunk, concatenated.
/// An empty payload is a push of zeros (`FLAG_ZEROS`, header only).
fn round(
    conns: &mut [Vec<DataConn>],
    spec: &TensorSpec,
    round: u32,
    flags: u16,
    order: &[usize],
    payloads: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    let es = spec.dtype.size();
    for (i, &r) in order.iter().enumerate() {
        for c in 0..spec.num_chunks() {
            let (a, b) = spec.chunk_range(c);
            let conn = &mut conns[r][spec.slots[c] as usize];
            match payloads[r].is_empty() {
                true => conn.push(spec, c, round, flags | FLAG_ZEROS, &[]),
                false => conn.push(spec, c, round, flags, &payloads[r][a * es..b * es]),
            }
        }
        if i + 1 < order.len() {
            // Not the last pusher: each push is acknowledged (credit), no result yet.
            for c in 0..spec.num_chunks() {
                conns[r][spec.slots[c] as usize].expect_received(spec, c, round);
            }
        }
    }
    let mut out = Vec::new();
    for conns in conns.iter_mut() {
        let mut bytes = Vec::new();
        for c in 0..spec.num_chunks() {
            bytes.extend(conns[spec.slots[c] as usize].expect_result(spec, c, round));
        }
        out.push(bytes);
    }
    out
}

#[test]
fn f32_pushes_are_summed_and_returned_to_every_worker() {
    let mut job = data_job(3, 2, |_| {});
    // 600 f32 in chunks of 256: three chunks over two server threads.
    let spec = job.declare(0, &[("g", 600, DType::F32)]).remove(0);
    assert_eq!(spec.num_chunks(), 3);
    let mut conns: Vec<Vec<DataConn>> = (0..3).map(|r| (0..2).map(|s| job.conn(s, r)).collect()).collect();
    let vals: Vec<Vec<f32>> =
        (0..3).map(|r| (0..600).map(|i| (r + 1) as f32 * i as f32 * 0.5 - 7.0).collect()).collect();
    let sum: Vec<f32> = (0..600).map(|i| vals[0][i] + vals[1][i] + vals[2][i]).collect();
    let payloads: Vec<Vec<u8>> = vals.iter().map(|v| f32_bytes(v)).collect();

    for res in round(&mut conns, &spec, 0, 0, &[0, 1, 2], &payloads) {
        assert_eq!(bytes_f32(&res), sum);
    }
    // Average, and a different arrival order.
    let third = 1.0f32 / 3.0;
    let avg: Vec<f32> = sum.iter().map(|s| s * third).collect();
    for res in round(&mut conns, &spec, 1, FLAG_AVERAGE, &[2, 0, 1], &payloads) {
        assert_eq!(bytes_f32(&res), avg);
    }
    // Several rounds in a row reuse the double buffers correctly.
    for r in 2..6u32 {
        let scaled: Vec<Vec<u8>> =
            vals.iter().map(|v| f32_bytes(&v.iter().map(|x| x * r as f32).collect::<Vec<_>>())).collect();
        let want: Vec<f32> =
            (0..600).map(|i| (vals[0][i] * r as f32 + vals[1][i] * r as f32) + vals[2][i] * r as f32).collect();
        for res in round(&mut conns, &spec, r, 0, &[1, 2, 0], &scaled) {
            assert_eq!(bytes_f32(&res), want, "round {r}");
        }
    }
    drop(conns);
    job.finish();
}

#[test]
fn pushes_of_zeros_add_nothing_first_in_between_or_last_in_every_dtype() {
    let mut job = data_job(3, 1, |_| {});
    let specs = job
        .declare(0, &[("f", 600, DType::F32), ("h", 700, DType::F16), ("b", 300, DType::BF16), ("d", 200, DType::F64)]);
    let mut conns: Vec<Vec<DataConn>> = (0..3).map(|r| vec![job.conn(0, r)]).collect();
    let vals = |r: usize, i: usize| ((i % 13) as f32 - 6.0) * 0.5 * (r + 1) as f32;
    for (k, spec) in specs.iter().enumerate() {
        let n = spec.numel as usize;
        let payload = |r: usize| -> Vec<u8> {
            match spec.dtype {
                DType::F32 => f32_bytes(&(0..n).map(|i| vals(r, i)).collect::<Vec<_>>()),
                DType::F16 => u16_bytes(&(0..n).map(|i| f16::from_f32(vals(r, i)).to_bits()).collect::<Vec<_>>()),
                DType::BF16 => u16_bytes(&(0..n).map(|i| bf16::from_f32(vals(r, i)).to_bits()).collect::<Vec<_>>()),
                _ => (0..n).flat_map(|i| (vals(r, i) as f64).to_le_bytes()).collect(),
            }
        };
        // Worker 1 pushes zeros; it comes first, in between, and last. (All
        // these values are exact in every dtype, so the sum is too.)
        for (round_no, order) in [[1usize, 0, 2], [0, 1, 2], [2, 0, 1]].iter().enumerate() {
            let payloads = vec![payload(0), Vec::new(), payload(2)];
            let want: Vec<u8> = {
                let sum: Vec<f32> = (0..n).map(|i| vals(0, i) + vals(2, i)).collect();
                match spec.dtype {
                    DType::F32 => f32_bytes(&sum),
                    DType::F16 => u16_bytes(&sum.iter().map(|&x| f16::from_f32(x).to_bits()).collect::<Vec<_>>()),
                    DType::BF16 => u16_bytes(&sum.iter().map(|&x| bf16::from_f32(x).to_bits()).collect::<Vec<_>>()),
                    _ => sum.iter().flat_map(|&x| (x as f64).to_le_bytes()).collect(),
                }
            };
            for res in round(&mut conns, spec, round_no as u32, 0, order, &payloads) {
                assert_eq!(res, want, "tensor {k} order {order:?}");
            }
        }
        // Every worker pushing zeros: zeros come back (the last round's sum is not left over).
        for res in round(&mut conns, spec, 3, 0, &[0, 1, 2], &[Vec::new(), Vec::new(), Vec::new()]) {
            assert!(res.iter().all(|&b| b == 0), "tensor {k}");
        }
    }
    drop(conns);
    job.finish();
}

#[test]
fn f16_and_bf16_are_accumulated_in_f32_and_rounded_once() {
    let mut job = data_job(3, 1, |_| {});
    let specs = job.declare(0, &[("h16", 700, DType::F16), ("hb", 300, DType::BF16)]);
    let (s16, sb) = (&specs[0], &specs[1]);
    assert_eq!((s16.num_chunks(), sb.num_chunks()), (2, 1));
    let mut conns: Vec<Vec<DataConn>> = (0..3).map(|r| vec![job.conn(0, r)]).collect();

    // f16: element 0 is 2048 + 1 + 1. Rounded after every add it would stay
    // 2048 (f16 spacing there is 2); summed in f32 and rounded once it is 2050.
    let v16: Vec<Vec<f16>> = (0..3)
        .map(|r| {
            (0..700)
                .map(|i| match (i, r) {
                    (0, 0) => f16::from_f32(2048.0),
                    (0, _) => f16::from_f32(1.0),
                    _ => f16::from_f32(((i % 40) as f32 - 20.0) * 0.25 * (r + 1) as f32),
                })
                .collect()
        })
        .collect();
    let vb: Vec<Vec<bf16>> = (0..3)
        .map(|r| (0..300).map(|i| bf16::from_f32(((i % 50) as f32 + 0.5) * (r + 1) as f32 * 1.01)).collect())
        .collect();
    let p16: Vec<Vec<u8>> = v16.iter().map(|v| u16_bytes(&v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())).collect();
    let pb: Vec<Vec<u8>> = vb.iter().map(|v| u16_bytes(&v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())).collect();

    for (round_no, flags, scale) in [(0u32, 0u16, 1.0f32), (1, FLAG_AVERAGE, 1.0 / 3.0)] {
        let want16: Vec<u16> = (0..700)
            .map(|i| f16::from_f32((v16[0][i].to_f32() + v16[1][i].to_f32() + v16[2][i].to_f32()) * scale).to_bits())
            .collect();
        let wantb: Vec<u16> = (0..300)
            .map(|i| bf16::from_f32((vb[0][i].to_f32() + vb[1][i].to_f32() + vb[2][i].to_f32()) * scale).to_bits())
            .collect();
        for res in round(&mut conns, s16, round_no, flags, &[0, 1, 2], &p16) {
            let got = bytes_u16(&res);
            assert_eq!(got, want16);
            if round_no == 0 {
                assert_eq!(f16::from_bits(got[0]).to_f32(), 2050.0);
            }
        }
        for res in round(&mut conns, sb, round_no, flags, &[2, 1, 0], &pb) {
            assert_eq!(bytes_u16(&res), wantb);
        }
    }
    drop(conns);
    job.finish();
}

/// A header for tensor `spec`'s chunk 0 with some field changed.
fn hdr(spec: &TensorSpec, f: impl FnOnce(&mut Header)) -> Header {
    let mut h = push_header(spec, 0, 0, 0, spec.chunk_bytes(0));
    f(&mut h);
    h
}

#[test]
fn bad_frames_get_an_error_and_a_closed_connection_while_others_go_on() {
    let mut job = data_job(2, 1, |_| {});
    let spec = job.declare(0, &[("t", 64, DType::F32)]).remove(0);
    assert_eq!(spec.chunk_bytes(0), 256);
    // Worker 0's good connection stays open through all of this.
    let mut good0 = job.conn(0, 0);

    let mut c = job.raw(0);
    c.send_raw(&[0xAB; HEADER_LEN]);
    c.expect_error("magic");

    let mut c = job.raw(0);
    let mut b = hdr(&spec, |h| h.msg_type = MsgType::DataHello).encode(&[]);
    b[2] = 0xEE; // a version no build speaks (its header checksum its own:
                 // a flipped bit of ours is a mismatch, the link's fault)
    let check = gradhub::protocol::crc32c(&b[..36]);
    b[36..40].copy_from_slice(&check.to_le_bytes());
    c.send_raw(&b);
    c.expect_error("version");

    let mut c = job.raw(0);
    c.send_header(&hdr(&spec, |h| {
        h.msg_type = MsgType::DataHello;
        h.key = 1;
        h.namespace = NS + 1;
    }));
    c.expect_error("namespace");

    let mut c = job.raw(0);
    c.send_header(&hdr(&spec, |_| {}));
    c.expect_error("before DataHello");

    let mut c = job.conn(0, 5);
    c.expect_error("out of range");

    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| h.flags = 0x100));
    c.expect_error("flag");

    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| {
        h.msg_type = MsgType::Heartbeat;
        h.payload_len = 0;
    }));
    c.expect_error("unexpected");

    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| h.key = 999));
    c.expect_error("key 999");

    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| h.chunk = 1));
    c.expect_error("chunk 1");

    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| h.payload_len = 100));
    let e = c.expect_error("payload");
    assert_contains(&e, &["100", "256"]);

    // Changed on the way: refused by the checksums before anything is
    // trusted or summed (the round below is still exact). The payload
    // lands in the accumulator (the round's first push) and is dropped.
    // Reset without an Error frame: the link's fault, not the worker's,
    // which connects again (client::io::mend).
    let mut c = job.conn(0, 1);
    let mut b = hdr(&spec, |_| {}).encode(&[1u8; 256]);
    b[13] ^= 1; // the key
    c.send_raw(&b);
    c.expect_reset();
    let mut c = job.conn(0, 1);
    let mut b = encode_frame(&hdr(&spec, |_| {}), &f32_bytes(&[1000.0; 64]));
    b[HEADER_LEN + 10] ^= 4;
    c.send_raw(&b);
    c.expect_reset();

    // A push of zeros carries no payload, and no initial parameters.
    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| h.flags = FLAG_ZEROS));
    let e = c.expect_error("payload");
    assert_contains(&e, &["256", "expected 0"]);
    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| {
        h.flags = FLAG_ZEROS | FLAG_INIT;
        h.payload_len = 0;
    }));
    c.expect_error("zeros cannot carry initial");

    // Over the partition but within the notice limit: refused by its exact length...
    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| h.payload_len = PARTITION + 4));
    let e = c.expect_error("expected");
    assert_contains(&e, &["256"]);

    // ...over every data-frame limit: refused at the header, before any payload.
    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| h.payload_len = gradhub::protocol::data_payload_limit(PARTITION) + 1));
    c.expect_error("exceeds");

    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| {
        h.dtype = DType::F16;
        h.payload_len = 128;
    }));
    c.expect_error("dtype");

    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| h.round = 5));
    c.expect_error("round 5");

    let mut c = job.conn(0, 1);
    c.hello(1);
    c.expect_error("second DataHello");

    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| {
        h.msg_type = MsgType::PushRef;
        h.flags = FLAG_ZEROS;
        h.payload_len = 0;
    }));
    c.expect_error("flagged as zeros");

    // A push by reference from a worker that shares no memory with this server.
    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| {
        h.msg_type = MsgType::PushRef;
        h.payload_len = 0;
    }));
    c.expect_error("does not share memory");

    // A push by reference that claims a payload: refused, not read as the next frame.
    let mut c = job.conn(0, 1);
    c.send_header(&hdr(&spec, |h| {
        h.msg_type = MsgType::PushRef;
        h.payload_len = 8;
    }));
    c.expect_error("PushRef with a 8-byte payload");

    // A DataHello that claims a payload: refused, not read as the next frame.
    let mut c = job.raw(0);
    let mut h = Header::new(MsgType::DataHello);
    h.namespace = NS;
    h.key = 1;
    h.payload_len = 8;
    c.send_header(&h);
    c.expect_error("DataHello with a 8-byte payload");

    // A duplicate push in a round: the first one counts, the connection is closed.
    let v0: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let v1: Vec<f32> = (0..64).map(|i| 100.0 - i as f32 * 3.0).collect();
    let mut c1 = job.conn(0, 1);
    c1.push(&spec, 0, 0, 0, &f32_bytes(&v1));
    c1.expect_received(&spec, 0, 0);
    c1.send_header(&hdr(&spec, |_| {}));
    c1.expect_error("twice");

    // Worker 0's untouched connection completes the round: worker 1's first push counted.
    good0.push(&spec, 0, 0, 0, &f32_bytes(&v0));
    let want: Vec<f32> = v0.iter().zip(&v1).map(|(a, b)| a + b).collect();
    assert_eq!(bytes_f32(&good0.expect_result(&spec, 0, 0)), want);

    // Rank 0 is connected (good0, which just pushed): a second connection for it
    // is refused. Errors name the server thread.
    let mut c = job.conn(0, 0);
    let e = c.expect_error("already connected");
    assert_contains(&e, &["server 0", "thread 0"]);

    // Worker 1 reconnects and the next round works for both.
    let mut c1 = job.conn(0, 1);
    c1.push(&spec, 0, 1, FLAG_AVERAGE, &f32_bytes(&v1));
    c1.expect_received(&spec, 0, 1);
    good0.push(&spec, 0, 1, FLAG_AVERAGE, &f32_bytes(&v0));
    let avg: Vec<f32> = want.iter().map(|s| s * 0.5).collect();
    assert_eq!(bytes_f32(&good0.expect_result(&spec, 0, 1)), avg);
    assert_eq!(bytes_f32(&c1.expect_result(&spec, 0, 1)), avg);

    drop((good0, c1));
    job.finish();
}

#[test]
fn workers_disagreeing_on_the_average_flag_are_refused() {
    let mut job = data_job(2, 1, |_| {});
    let spec = job.declare(0, &[("f", 10, DType::F32)]).remove(0);
    let (v0, v1) = (vec![1.0f32; 10], vec![2.0f32; 10]);
    let mut c0 = job.conn(0, 0);
    let mut c1 = job.conn(0, 1);
    c0.push(&spec, 0, 0, 0, &f32_bytes(&v0));
    c0.expect_received(&spec, 0, 0);
    c1.push(&spec, 0, 0, FLAG_AVERAGE, &f32_bytes(&v1));
    c1.expect_error("flags");
    let mut c1 = job.conn(0, 1);
    c1.push(&spec, 0, 0, 0, &f32_bytes(&v1));
    for c in [&mut c0, &mut c1] {
        assert_eq!(bytes_f32(&c.expect_result(&spec, 0, 0)), vec![3.0f32; 10]);
    }
    drop((c0, c1));
    job.finish();
}

#[test]
fn connection_closed_mid_push_does_not_corrupt_the_sum() {
    let mut job = data_job(2, 1, |_| {});
    let spec = job.declare(0, &[("m", 256, DType::F32)]).remove(0);
    let v0: Vec<f32> = (0..256).map(|i| i as f32 * 0.25).collect();
    let v1: Vec<f32> = (0..256).map(|i| 1000.0 - i as f32).collect();
    let want: Vec<f32> = v0.iter().zip(&v1).map(|(a, b)| a + b).collect();
    let p0 = f32_bytes(&v0);

    let mut c1 = job.conn(0, 1);
    for r in 0..2u32 {
        // Worker 0 sends a push header and half its payload (received straight
        // into the accumulator when it is first)...
        let mut half = job.conn(0, 0);
        let mut b = push_header(&spec, 0, r, 0, p0.len()).encode(&[]).to_vec();
        b.extend_from_slice(&[0xFF; 512]);
        half.send_raw(&b);
        if r == 1 {
            // ...and in round 1 worker 1's push arrives meanwhile (parked behind
            // it; the pause only makes that interleaving likely, either order must work).
            std::thread::sleep(Duration::from_millis(50));
            c1.push(&spec, 0, r, 0, &f32_bytes(&v1));
            c1.expect_received(&spec, 0, r);
        }
        // ...then worker 0's connection dies mid-payload.
        half.s.shutdown(std::net::Shutdown::Write).unwrap();
        half.expect_error("closed");
        // Worker 0 reconnects and pushes again; the sum is exact.
        let mut c0 = job.conn(0, 0);
        c0.push(&spec, 0, r, 0, &p0);
        if r == 0 {
            c0.expect_received(&spec, 0, r);
            c1.push(&spec, 0, r, 0, &f32_bytes(&v1));
        }
        assert_eq!(bytes_f32(&c0.expect_result(&spec, 0, r)), want, "round {r}");
        assert_eq!(bytes_f32(&c1.expect_result(&spec, 0, r)), want, "round {r}");
        c0.close_and_wait();
    }
    drop(c1);
    job.finish();
}

/// A mended link: a new connection with a resent DataHello.
fn mended(job: &DataJob, rank: u32) -> DataConn {
    let mut c = job.raw(0);
    let mut h = Header::new(MsgType::DataHello);
    (h.namespace, h.key, h.flags) = (NS, rank, FLAG_RESENT);
    c.send_header(&h);
    c
}

#[test]
fn a_push_resent_on_a_mended_link_is_counted_once_and_answered_once() {
    let mut job = data_job(2, 1, |_| {});
    let spec = job.declare(0, &[("m", 256, DType::F32)]).remove(0);
    let v: Vec<Vec<f32>> = (0..2).map(|r| (0..256).map(|i| (r * 1000 + i) as f32).collect()).collect();
    let p: Vec<Vec<u8>> = v.iter().map(|v| f32_bytes(v)).collect();
    let want: Vec<f32> = (0..256).map(|i| v[0][i] + v[1][i]).collect();
    let mut c1 = job.conn(0, 1);
    let mut old = job.conn(0, 0);

    // Round 0: worker 0's push was counted, then its link broke and was made
    // again before the round completed: the result goes out on the new link
    // once, and the push re-sent after it gets no answer at all (the worker
    // has its result).
    old.push(&spec, 0, 0, 0, &p[0]);
    old.expect_received(&spec, 0, 0);
    let mut c0 = mended(&job, 0);
    old.expect_closed();
    c1.push(&spec, 0, 0, 0, &p[1]);
    assert_eq!(bytes_f32(&c0.expect_result(&spec, 0, 0)), want);
    c0.push(&spec, 0, 0, FLAG_RESENT, &p[0]);
    assert_eq!(bytes_f32(&c1.expect_result(&spec, 0, 0)), want);

    // Round 1: re-sent before the round completes (the old link delivered
    // it): acknowledged, not counted twice; the result comes once.
    c0.push(&spec, 0, 1, 0, &p[0]);
    c0.expect_received(&spec, 0, 1);
    let mut c0 = {
        drop(c0);
        mended(&job, 0)
    };
    c0.push(&spec, 0, 1, FLAG_RESENT, &p[0]);
    c0.expect_received(&spec, 0, 1);
    c1.push(&spec, 0, 1, 0, &p[1]);
    assert_eq!(bytes_f32(&c0.expect_result(&spec, 0, 1)), want);
    assert_eq!(bytes_f32(&c1.expect_result(&spec, 0, 1)), want);

    // Round 2: the round completed while worker 0 had no link (its result
    // lost with the old one): the re-sent push is answered with the result.
    c0.push(&spec, 0, 2, 0, &p[0]);
    c0.expect_received(&spec, 0, 2);
    c0.close_and_wait();
    c1.push(&spec, 0, 2, 0, &p[1]);
    assert_eq!(bytes_f32(&c1.expect_result(&spec, 0, 2)), want);
    let mut c0 = mended(&job, 0);
    c0.push(&spec, 0, 2, FLAG_RESENT, &p[0]);
    assert_eq!(bytes_f32(&c0.expect_result(&spec, 0, 2)), want);

    // Round 3: counted, then re-sent on a mended link, its round completing
    // while the re-sent payload is half way: the result answers it, no
    // Received follows.
    c0.push(&spec, 0, 3, 0, &p[0]);
    c0.expect_received(&spec, 0, 3);
    let mut c0 = {
        drop(c0);
        mended(&job, 0)
    };
    let h = push_header(&spec, 0, 3, FLAG_RESENT, p[0].len());
    let frame = encode_frame(&h, &p[0]);
    c0.send_raw(&frame[..HEADER_LEN + 100]);
    std::thread::sleep(Duration::from_millis(50));
    c1.push(&spec, 0, 3, 0, &p[1]);
    assert_eq!(bytes_f32(&c1.expect_result(&spec, 0, 3)), want);
    assert_eq!(bytes_f32(&c0.expect_result(&spec, 0, 3)), want);
    c0.send_raw(&frame[HEADER_LEN + 100..]);

    // Round 4 goes on as usual: nothing stale was left on either link (a
    // Received for round 3 would come first here).
    c1.push(&spec, 0, 4, 0, &p[1]);
    c1.expect_received(&spec, 0, 4);
    c0.push(&spec, 0, 4, 0, &p[0]);
    assert_eq!(bytes_f32(&c0.expect_result(&spec, 0, 4)), want);
    assert_eq!(bytes_f32(&c1.expect_result(&spec, 0, 4)), want);
    drop((c0, c1));
    job.finish();
}

#[test]
fn a_round_waiting_for_a_worker_gets_a_stall_notice_naming_it() {
    let mut job = data_job(3, 1, |c| c.stall_ms = 300);
    let spec = job.declare(0, &[("st", 16, DType::F32)]).remove(0);
    let mut conns: Vec<DataConn> = (0..3).map(|r| job.conn(0, r)).collect();
    let t0 = Instant::now();
    for r in [0, 2] {
        conns[r].push(&spec, 0, 0, 0, &f32_bytes(&[1.0; 16]));
        conns[r].expect_received(&spec, 0, 0);
    }
    for r in [0, 2] {
        let (h, p) = conns[r].read_frame();
        assert_eq!(h.msg_type, MsgType::Stall, "{h:?}");
        assert_eq!((h.key, h.round), (spec.key, 0));
        let s = decode_stall(&p).expect("stall payload");
        assert_eq!(s.missing, vec![1]);
        assert_eq!((s.server, s.thread), (0, 0));
        assert!(s.waited_ms >= 300, "{}", s.waited_ms);
    }
    assert!(t0.elapsed() >= Duration::from_millis(280));
    // The late worker completes the round normally.
    conns[1].push(&spec, 0, 0, 0, &f32_bytes(&[1.0; 16]));
    for c in &mut conns {
        assert_eq!(bytes_f32(&c.expect_result(&spec, 0, 0)), vec![3.0f32; 16]);
    }
    drop(conns);
    job.finish();
}

#[test]
fn server_fails_and_tells_its_workers_when_a_worker_is_lost() {
    let mut job = data_job(2, 2, |_| {});
    let spec = job.declare(0, &[("l", 4, DType::F32)]).remove(0);
    let mut c0 = job.conn(spec.slots[0], 0);
    c0.push(&spec, 0, 0, 0, &f32_bytes(&[1.0; 4]));
    c0.expect_received(&spec, 0, 0);
    let gone = job.workers.remove(1);
    gone.kill();
    // The server's data connections are closed with the reason.
    let e = c0.expect_error("worker 1");
    assert!(!e.is_empty());
    match job.workers[0].recv() {
        Control::PeerLost { rank: 1, .. } => {}
        other => panic!("expected PeerLost, got {other:?}"),
    }
    let results = job.job.server_results();
    let err = results[0].clone().expect_err("the server must fail");
    assert_contains(&err, &["worker 1"]);
    assert!(job.job.wait().expect_err("the job must fail").contains("worker 1"));
}

#[test]
fn connections_that_never_say_hello_or_stall_mid_frame_are_closed() {
    // A short peer timeout (the server learns it from Welcome).
    let mut job = data_job(2, 1, |c| c.peer_timeout_ms = 600);
    for w in &mut job.workers {
        w.start_heartbeat(Duration::from_millis(100));
    }
    let specs = job.declare(0, &[("t", 64, DType::F32)]);
    let mut w0 = job.conn(0, 0);
    // Silent: connected, never says who it is.
    let mut silent = job.raw(0);
    // Slow: says hello as rank 1, then 10 bytes of a push header, then nothing.
    let mut slow = job.conn(0, 1);
    slow.send_raw(&push_header(&specs[0], 0, 0, 0, 256).encode(&[])[..10]);
    let start = Instant::now();
    let e = silent.expect_error("no DataHello");
    assert_contains(&e, &["0.6s"]);
    silent.expect_closed();
    let e = slow.expect_error("stalled half-received");
    assert_contains(&e, &["0.6s"]);
    assert!(start.elapsed() < Duration::from_secs(5), "closed after {:?}", start.elapsed());
    // Idle between rounds for longer than the timeout is fine: worker 0 is
    // kept, worker 1 reconnects, and the round completes.
    std::thread::sleep(Duration::from_millis(900));
    let mut w1 = job.conn(0, 1);
    w0.push(&specs[0], 0, 0, 0, &f32_bytes(&[2.5; 64]));
    w0.expect_received(&specs[0], 0, 0);
    w1.push(&specs[0], 0, 0, 0, &f32_bytes(&[1.0; 64]));
    assert_eq!(bytes_f32(&w0.expect_result(&specs[0], 0, 0)), vec![3.5; 64]);
    assert_eq!(bytes_f32(&w1.expect_result(&specs[0], 0, 0)), vec![3.5; 64]);
    for w in &mut job.workers {
        w.stop_heartbeat();
    }
    job.finish();
}

#[test]
fn with_hosts_one_worker_per_host_pushes_each_chunk_and_alone_gets_its_result() {
    // Hosts a (ranks 0, 1, 3) and b (rank 2): every chunk has two pushers.
    let hosts: Vec<String> = ["a", "a", "b", "a"].iter().map(|h| h.to_string()).collect();
    let mut job = data_job_on(&hosts, 1, |_| {});
    let w = &job.welcome;
    assert!(w.host_reduce);
    let layout = gradhub::placement::HostLayout::new(&w.worker_hosts, &w.worker_local_ranks, true).unwrap();
    // 1000 f32 in chunks of 256: four chunks, owned in turn by ranks 0, 1, 3 on host a.
    let spec = job.declare(0, &[("g", 1000, DType::F32)]).remove(0);
    assert_eq!(spec.num_chunks(), 4);
    let mut conns: Vec<DataConn> = (0..4).map(|r| job.conn(0, r)).collect();
    let host_sum: Vec<Vec<f32>> =
        (0..2).map(|h| (0..1000).map(|i| (h * 1000 + i) as f32 * 0.5 - 3.0).collect()).collect();
    let owners_a: Vec<u32> = (0..4).map(|c| layout.owner(0, spec.key, c)).collect();
    assert!([0, 1, 3].iter().all(|r| owners_a.contains(r)), "owners {owners_a:?}");

    let rounds: [(u32, u16, f32); 3] = [(0, 0, 1.0), (1, FLAG_AVERAGE, 0.25), (2, gradhub::protocol::FLAG_INIT, 0.0)];
    for (round_no, flags, scale) in rounds {
        for (c, &owner_a) in owners_a.iter().enumerate() {
            let pushers = layout.pushers(spec.key, c as u32);
            assert_eq!(pushers, vec![owner_a, 2]);
            let (a, b) = spec.chunk_range(c);
            for (i, &p) in pushers.iter().enumerate() {
                let h = if p == 2 { 1 } else { 0 };
                conns[p as usize].push(&spec, c, round_no, flags, &f32_bytes(&host_sum[h][a..b]));
                if i == 0 {
                    conns[p as usize].expect_received(&spec, c, round_no);
                }
            }
            // Sums average over the job's 4 workers, not its 2 hosts; an init
            // round keeps the push of rank 0's host.
            let want: Vec<f32> = if flags == gradhub::protocol::FLAG_INIT {
                host_sum[0][a..b].to_vec()
            } else {
                (a..b).map(|i| (host_sum[0][i] + host_sum[1][i]) * scale).collect()
            };
            for &p in &pushers {
                assert_eq!(bytes_f32(&conns[p as usize].expect_result(&spec, c, round_no)), want, "chunk {c}");
            }
        }
    }
    // A worker pushing a chunk its host's owner pushes is refused, naming the owner.
    let intruder = (0..4u32).find(|&r| r != 2 && r != owners_a[0]).unwrap();
    conns[intruder as usize].push(&spec, 0, 3, 0, &f32_bytes(&host_sum[0][..256]));
    let err = conns[intruder as usize].expect_error("pushes it for that host");
    assert!(err.contains(&format!("worker {} pushes", owners_a[0])), "{err}");
    drop(conns);
    job.finish();
}

#[test]
fn a_released_tensor_is_freed_and_its_chunks_serve_the_next_tensors() {
    let mut job = data_job(2, 2, |_| {});
    let x = job.declare(0, &[("x", 600, DType::F32)]).remove(0);
    let mut conns: Vec<Vec<DataConn>> = (0..2).map(|r| (0..2).map(|s| job.conn(s, r)).collect()).collect();
    let ones = f32_bytes(&[1.0; 600]);
    for res in round(&mut conns, &x, 0, 0, &[0, 1], &[ones.clone(), ones.clone()]) {
        assert_eq!(bytes_f32(&res), vec![2.0; 600]);
    }
    for w in &job.workers {
        w.send(&Control::Release { keys: vec![x.key] }).unwrap();
    }
    // Declared after the release on the same connections: once it is
    // answered, every server thread has freed x (commands run in order).
    let specs = job.declare(1, &[("y", 900, DType::F32), ("z", 300, DType::F16)]);
    let (y, z) = (&specs[0], &specs[1]);
    // The freed chunk buffers were reused, zeroed for the new tensors: exact sums again.
    let vy: Vec<Vec<f32>> = (0..2).map(|r| (0..900).map(|i| (i * (r + 2)) as f32).collect()).collect();
    let want_y: Vec<f32> = (0..900).map(|i| (i * 5) as f32).collect();
    let py: Vec<Vec<u8>> = vy.iter().map(|v| f32_bytes(v)).collect();
    for res in round(&mut conns, y, 0, 0, &[1, 0], &py) {
        assert_eq!(bytes_f32(&res), want_y);
    }
    let hz: Vec<u8> = u16_bytes(&[f16::from_f32(0.5).to_bits(); 300]);
    for res in round(&mut conns, z, 0, 0, &[0, 1], &[hz.clone(), hz]) {
        assert!(bytes_u16(&res).iter().all(|&b| f16::from_bits(b) == f16::from_f32(1.0)));
    }
    // A push for the released tensor is refused like any unknown key.
    let slot = x.slots[0] as usize;
    conns[0][slot].push(&x, 0, 1, 0, &ones[..x.chunk_bytes(0)]);
    conns[0][slot].expect_error("is not owned by this server thread");
    drop(conns);
    job.finish();
}

/// A restore frame: chunk `c`'s result of `round`, as a worker holds it.
fn restore(conn: &mut DataConn, spec: &TensorSpec, c: usize, round: u32, payload: &[u8]) {
    let mut h = push_header(spec, c, round, 0, payload.len());
    h.msg_type = MsgType::Restore;
    conn.send_raw(&encode_frame(&h, payload));
}

/// Server 0 real, server 1 a fake that is lost at once; `nw` fake workers,
/// told of the failover, with data connections to server 0.
struct TakenOver {
    h: gradhub::scheduler::SchedulerHandle,
    real: Pending<Result<(), String>>,
    workers: Vec<Member>,
    /// Tensor x before and after the failover, and its chunks that moved.
    x: TensorSpec,
    x2: TensorSpec,
    lost: Vec<usize>,
    conns: Vec<DataConn>,
}

fn taken_over(nw: u32) -> TakenOver {
    let ns = 2u32;
    let h = start(sched_config(nw, ns));
    let real = spawn_server(server_config(h.addr, 1, false, 0, nw, ns));
    let mut fake = Member::register(h.addr, server_reg(1, "127.0.0.1", vec![40_999], false, nw, ns));
    let mut workers: Vec<Member> =
        (0..nw).map(|r| Member::register(h.addr, worker_reg(r as i32, &format!("h{r}"), nw, ns))).collect();
    fake.welcome();
    let fake = auto_ack(fake);
    let welcome = workers.iter_mut().map(|w| w.welcome()).collect::<Vec<_>>().remove(0);
    assert!(welcome.failover);
    let port = welcome.servers[0].ports[0];
    let e = vec![gradhub::protocol::DeclEntry {
        name: "x".into(),
        numel: 2048,
        dtype: DType::F32,
        partition: 0,
        members: Vec::new(),
        sharded: false,
    }];
    for w in &workers {
        w.send(&Control::Declare { req: 0, entries: e.clone() }).unwrap();
    }
    let x = workers.iter_mut().map(|w| declared(w.recv(), 0)).collect::<Vec<_>>().remove(0).remove(0);
    let lost: Vec<usize> = (0..x.num_chunks()).filter(|&c| x.slots[c] == 1).collect();
    assert!(lost.len() >= 2, "{:?}", x.slots);
    // Server 1 is lost: its chunks move to server 0, then the workers hear.
    let (m, _) = fake.stop();
    m.kill();
    let x2 = match workers[0].recv() {
        Control::Failover { lost: 1, specs, .. } => specs.into_iter().find(|s| s.key == x.key).unwrap(),
        other => panic!("expected Failover, got {other:?}"),
    };
    assert!(x2.slots.iter().all(|&s| s == 0));
    for w in &mut workers[1..] {
        assert!(matches!(w.recv(), Control::Failover { lost: 1, .. }));
    }
    let conns: Vec<DataConn> = (0..nw).map(|r| DataConn::connect_hello("127.0.0.1", port, r)).collect();
    TakenOver { h, real, workers, x, x2, lost, conns }
}

impl TakenOver {
    fn finish(self) {
        drop(self.conns);
        for w in &self.workers {
            w.send(&Control::Goodbye).unwrap();
        }
        assert_eq!(self.real.join(), Ok(()));
        assert_eq!(wait_scheduler(self.h), Ok(()));
    }
}

#[test]
fn a_lost_servers_chunks_are_taken_over_restored_and_replayed() {
    let mut job = taken_over(3);
    let (x, x2, lost, conns) = (&job.x, &job.x2, &job.lost, &mut job.conns);
    let (c0, c1) = (lost[0], lost[1]);
    let n = x2.chunk_bytes(c0) / 4;
    let result = f32_bytes(&vec![7.0; n]);
    let push = |r: usize| f32_bytes(&vec![(r + 1) as f32; n]);
    // Chunk c0: worker 2 missed round 4's result and pushes it again; worker
    // 0 received it and restores it; worker 1 too (a duplicate, ignored).
    conns[2].push(x2, c0, 4, 0, &push(2));
    conns[2].expect_received(x2, c0, 4);
    restore(&mut conns[0], x2, c0, 4, &result);
    assert_eq!(conns[2].expect_result(x2, c0, 4), result, "the restored result completes the round");
    restore(&mut conns[1], x2, c0, 4, &result);
    // Round 5 is summed from everyone's pushes as usual.
    for (r, conn) in conns.iter_mut().enumerate() {
        conn.push(x2, c0, 5, 0, &push(r));
        if r < 2 {
            conn.expect_received(x2, c0, 5);
        }
    }
    for conn in conns.iter_mut() {
        assert_eq!(bytes_f32(&conn.expect_result(x2, c0, 5)), vec![6.0; n]);
    }
    // Chunk c1: the restored result comes first; a push of that round is
    // answered with it at once (a replay), and round 4 goes on.
    restore(&mut conns[1], x2, c1, 3, &result);
    conns[1].push(x2, c1, 4, 0, &push(1));
    conns[1].expect_received(x2, c1, 4); // so the restore was taken before what follows
    conns[2].push(x2, c1, 3, 0, &push(2));
    assert_eq!(conns[2].expect_result(x2, c1, 3), result);
    // Restoring a chunk that was not taken over, or a round ahead of it, breaks the protocol.
    if let Some(kept) = (0..x2.num_chunks()).find(|&c| x.slots[c] == 0) {
        restore(&mut conns[0], x2, kept, 0, &f32_bytes(&vec![1.0; x2.chunk_bytes(kept) / 4]));
        conns[0].expect_error("did not take over");
    }
    restore(&mut conns[1], x2, c1, 9, &result);
    conns[1].expect_error("round 9 but the chunk is at round 4");
    job.finish();
}

#[test]
fn a_push_whose_round_a_restored_result_completes_while_it_arrives_is_answered_with_that_result() {
    // Worker 2 missed round 4's result of a moved chunk and pushes it
    // again; worker 0 received it and restores it while worker 2's payload
    // is still on its way; worker 0 then goes on to round 5.
    let mut job = taken_over(3);
    let (x2, c, conns) = (&job.x2, job.lost[0], &mut job.conns);
    let n = x2.chunk_bytes(c) / 4;
    let result = f32_bytes(&vec![7.0; n]);
    let push = |r: usize, round: u32| f32_bytes(&vec![(10 * round as usize + r) as f32; n]);
    let frame = encode_frame(&push_header(x2, c, 4, 0, 4 * n), &push(2, 4));
    let half = frame.len() / 2;
    conns[2].send_raw(&frame[..half]);
    std::thread::sleep(Duration::from_millis(300)); // its header taken first: the chunk is at round 4
    restore(&mut conns[0], x2, c, 4, &result);
    conns[0].push(x2, c, 5, 0, &push(0, 5));
    conns[0].expect_received(x2, c, 5); // so the restore completed round 4 before the rest arrives
    conns[2].send_raw(&frame[half..]);
    // Not a push of round 5 (that would sum round 4's data into it): a
    // replay of round 4, answered with the restored result.
    assert_eq!(conns[2].expect_result(x2, c, 4), result);
    conns[1].push(x2, c, 5, 0, &push(1, 5));
    conns[1].expect_received(x2, c, 5);
    conns[2].push(x2, c, 5, 0, &push(2, 5));
    for conn in conns.iter_mut() {
        assert_eq!(bytes_f32(&conn.expect_result(x2, c, 5)), vec![153.0; n], "round 5 is its pushes' sum");
    }
    job.finish();
}

#[test]
fn a_server_port_takes_nothing_before_the_handshake_nor_a_wrong_token() {
    use crate::auth::{rejection_of, try_auth};
    let mut job = data_job(1, 1, |_| {});
    let specs = job.declare(0, &[("t", 64, DType::F32)]);
    let port = job.welcome.servers[0].ports[0];
    // A hello squatting rank 0 without a handshake, then the wrong token.
    let mut squat = DataConn::connect_raw("127.0.0.1", port);
    squat.hello(0);
    assert_contains(&rejection_of(&mut squat.s), &["authentication failed"]);
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let (_, r) = try_auth(addr, &gradhub::protocol::auth::Secret::new(b"guess"));
    assert_contains(&r.unwrap_err().to_string(), &["does not hold this job's token"]);
    // Rank 0 is still free for the real worker, and its sum is its own.
    let mut w0 = job.conn(0, 0);
    w0.push(&specs[0], 0, 0, 0, &f32_bytes(&[1.5; 64]));
    assert_eq!(bytes_f32(&w0.expect_result(&specs[0], 0, 0)), vec![1.5; 64]);
    job.finish();
}

#[test]
fn optimizer_chunks_refuse_gradients_without_parameters_and_links_only_replicate_what_they_may() {
    use gradhub::protocol::{OptConfig, OptKind, FLAG_INIT};
    let mut job = data_job(2, 1, |_| {});
    let w = job.declare(0, &[("w", 64, DType::F32)]).remove(0);
    let mut conns: Vec<DataConn> = (0..2).map(|r| job.conn(0, r)).collect();
    let cfg = OptConfig {
        kind: OptKind::Sgd,
        lr: 0.5,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let mut h = Header::new(MsgType::OptConfig);
    (h.namespace, h.key) = (NS, w.key);
    let payload = cfg.encode();
    h.payload_len = payload.len() as u32;
    for c in &mut conns {
        c.send_raw(&encode_frame(&h, &payload));
    }
    // A gradient before any parameters would be summed as if they were.
    conns[0].push(&w, 0, 0, 0, &f32_bytes(&[1.0; 64]));
    conns[0].expect_error("no initial parameters were pushed");
    // With parameters, a round returns parameters: p - lr * mean(g).
    conns[0] = job.conn(0, 0);
    let init: Vec<Vec<u8>> = (0..2).map(|_| f32_bytes(&[2.0; 64])).collect();
    let mut grouped = vec![vec![conns.remove(0)], vec![conns.remove(0)]];
    round(&mut grouped, &w, 0, FLAG_INIT, &[0, 1], &init);
    let grads = vec![f32_bytes(&[1.0; 64]), f32_bytes(&[3.0; 64])];
    let out = round(&mut grouped, &w, 1, FLAG_AVERAGE, &[1, 0], &grads);
    assert_eq!(bytes_f32(&out[0]), vec![2.0 - 0.5 * 2.0; 64]);
    // Another server thread replicating here cannot send a gradient before
    // the parameters it applies to.
    let mut hello = Header::new(MsgType::ServerHello);
    (hello.namespace, hello.key) = (NS, 7);
    let mut link = job.raw(0);
    link.send_header(&hello);
    let mut rep = Header::new(MsgType::Replicate);
    (rep.namespace, rep.key, rep.dtype, rep.payload_len) = (NS, w.key, DType::F32, 256);
    link.send_raw(&encode_frame(&rep, &f32_bytes(&[0.0; 64])));
    link.expect_error("before any parameters");
    // A replication frame changed on the way: the link is reset, not closed
    // cleanly, so the thread that opened it dials it again (`relink`)
    // instead of taking it for a replica that is done.
    let mut link = job.raw(0);
    link.send_header(&hello);
    let mut b = encode_frame(&rep, &f32_bytes(&[0.0; 64]));
    b[HEADER_LEN + 3] ^= 0x10;
    link.send_raw(&b);
    link.expect_reset();
    drop((grouped, link));
    job.finish();
}

#[test]
fn strangers_that_never_authenticate_are_closed_after_the_handshake_timeout() {
    use std::io::Read;
    use std::net::TcpStream;

    // A short peer timeout, which bounds the handshake too (the server learns it from Welcome).
    let mut job = data_job(1, 1, |c| c.peer_timeout_ms = 600);
    job.workers[0].start_heartbeat(Duration::from_millis(100));
    let specs = job.declare(0, &[("t", 64, DType::F32)]);
    let port = job.port(0);
    let start = Instant::now();
    // Many idle connections at once, not a byte sent: the accept queue
    // takes the burst (else the kernel drops some, and their SYN retransmits
    // delay them by seconds before the thread even sees them).
    let idle: Vec<TcpStream> = (0..1000).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    // Each is closed once the handshake timeout passed (with an Error frame
    // that says only that authentication did not happen in time).
    let mut open = 0;
    for (i, mut s) in idle.into_iter().enumerate() {
        let left = Duration::from_secs(4).saturating_sub(start.elapsed()).max(Duration::from_millis(10));
        s.set_read_timeout(Some(left)).unwrap();
        let mut sink = Vec::new();
        if s.read_to_end(&mut sink).is_err() {
            open += 1;
        } else if i == 0 {
            assert_contains(&String::from_utf8_lossy(&sink), &["no authentication handshake within 0.6s"]);
        }
    }
    let took = start.elapsed();
    assert_eq!(open, 0, "{open} of 1000 idle connections were still open after {took:?}");
    assert!(took >= Duration::from_millis(550), "closed after {took:?}, before the timeout");
    // The job goes on: a real worker's round completes.
    let mut w0 = job.conn(0, 0);
    w0.push(&specs[0], 0, 0, 0, &f32_bytes(&[1.5; 64]));
    assert_eq!(bytes_f32(&w0.expect_result(&specs[0], 0, 0)), vec![1.5; 64]);
    job.workers[0].stop_heartbeat();
    job.finish();
}

#[test]
fn asynchronous_chunks_apply_each_change_on_arrival_and_answer_only_its_worker() {
    use gradhub::protocol::{FLAG_ASYNC, FLAG_INIT};
    use gradhub::training::Training;
    let vals = |x: f32| f32_bytes(&[x; 16]);
    let mut job = data_job(2, 1, |c| c.training = Training::Asynchronous { staleness: None });
    let w = job.declare(0, &[("w", 16, DType::F32)]).remove(0);
    let mut c: Vec<DataConn> = (0..2).map(|r| job.conn(0, r)).collect();
    // Worker 1's initial values are acked, and answered only once worker 0's
    // (the parameters) came: with worker 0's.
    c[1].push(&w, 0, 0, FLAG_ASYNC | FLAG_INIT, &vals(5.0));
    c[1].expect_received(&w, 0, 0);
    c[0].push(&w, 0, 0, FLAG_ASYNC | FLAG_INIT, &vals(2.0));
    c[0].expect_received(&w, 0, 0);
    assert_eq!(bytes_f32(&c[0].expect_result(&w, 0, 0)), vec![2.0; 16]);
    assert_eq!(bytes_f32(&c[1].expect_result(&w, 0, 0)), vec![2.0; 16]);
    // Worker 0 runs ahead: each change applied and answered at once.
    for (round, want) in [(1, 3.0), (2, 4.0)] {
        c[0].push(&w, 0, round, FLAG_ASYNC, &vals(1.0));
        c[0].expect_received(&w, 0, round);
        assert_eq!(bytes_f32(&c[0].expect_result(&w, 0, round)), vec![want; 16]);
    }
    c[1].push(&w, 0, 1, FLAG_ASYNC, &vals(0.5));
    c[1].expect_received(&w, 0, 1);
    assert_eq!(bytes_f32(&c[1].expect_result(&w, 0, 1)), vec![4.5; 16]);
    // Out of turn, parameters again, or a synchronous push: refused.
    c[1].push(&w, 0, 3, FLAG_ASYNC, &vals(0.5));
    c[1].expect_error("pushed round 3, but its next is 2");
    c[0].push(&w, 0, 3, FLAG_ASYNC | FLAG_INIT, &vals(9.0));
    c[0].expect_error("initial parameters in round 3");
    let mut again = job.conn(0, 0);
    again.push(&w, 0, 3, 0, &vals(1.0));
    again.expect_error("pushed it synchronously, but it is asynchronous");
    drop((c, again));
    job.finish();
}

#[test]
fn a_push_that_wants_no_result_is_answered_by_a_header_alone() {
    use gradhub::protocol::FLAG_NO_RESULT;
    let mut job = data_job(2, 1, |_| {});
    let g = job.declare(0, &[("g", 64, DType::F32)]).remove(0);
    let mut c: Vec<DataConn> = (0..2).map(|r| job.conn(0, r)).collect();
    for round in 0..3u32 {
        // Worker 1 declines the result (in round 1 it pushes zeros too); worker 0 wants it.
        let zeros = round == 1;
        let (flags, one) =
            if zeros { (FLAG_NO_RESULT | FLAG_ZEROS, vec![]) } else { (FLAG_NO_RESULT, f32_bytes(&[2.0; 64])) };
        c[1].push(&g, 0, round, flags, &one);
        c[1].expect_received(&g, 0, round);
        c[0].push(&g, 0, round, 0, &f32_bytes(&[0.5; 64]));
        let want = if zeros { 0.5 } else { 2.5 };
        assert_eq!(bytes_f32(&c[0].expect_result(&g, 0, round)), vec![want; 64], "round {round}");
        let (h, p) = c[1].read_frame();
        assert_eq!((h.msg_type, h.key, h.chunk, h.round), (MsgType::Result, g.key, 0, round));
        assert_eq!((h.flags, h.payload_len, p.len()), (FLAG_NO_RESULT, 0, 0), "round {round}");
    }
    drop(c);
    job.finish();
}

#[test]
fn an_asynchronous_push_that_wants_no_result_is_refused() {
    use gradhub::protocol::{FLAG_ASYNC, FLAG_INIT, FLAG_NO_RESULT};
    use gradhub::training::Training;
    let mut job = data_job(1, 1, |c| c.training = Training::Asynchronous { staleness: None });
    let w = job.declare(0, &[("w", 16, DType::F32)]).remove(0);
    let mut c = job.conn(0, 0);
    c.push(&w, 0, 0, FLAG_ASYNC | FLAG_INIT | FLAG_NO_RESULT, &f32_bytes(&[1.0; 16]));
    c.expect_error("an asynchronous push cannot decline its answer");
    drop(c);
    job.finish();
}

#[test]
fn an_asynchronous_push_in_a_synchronous_job_is_refused() {
    use gradhub::protocol::{FLAG_ASYNC, FLAG_INIT};
    let mut job = data_job(1, 1, |_| {});
    let w = job.declare(0, &[("w", 16, DType::F32)]).remove(0);
    let mut c = job.conn(0, 0);
    c.push(&w, 0, 0, FLAG_ASYNC | FLAG_INIT, &f32_bytes(&[1.0; 16]));
    c.expect_error("an asynchronous push in a synchronous job");
    drop(c);
    job.finish();
}
