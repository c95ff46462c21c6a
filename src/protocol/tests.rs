//! Unit and property tests for the wire protocol: header framing, control
//! payloads, the blocking read/write helpers and the Stall payload.

use super::*;
use proptest::prelude::*;
use std::io::Cursor;

/// Every MsgType. `header_rejects_unknown_type` fails if frame.rs gains a
/// type that is missing here.
const ALL_MSG_TYPES: [MsgType; 54] = [
    MsgType::PeerHello,
    MsgType::PeerData,
    MsgType::Ack,
    MsgType::Resumed,
    MsgType::Unreachable,
    MsgType::Rejoin,
    MsgType::HostsUpdated,
    MsgType::ServerJoined,
    MsgType::ServerMove,
    MsgType::ServerMoveAck,
    MsgType::Join,
    MsgType::Joined,
    MsgType::JoinOp,
    MsgType::JoinDone,
    MsgType::ServiceJoin,
    MsgType::ServiceStart,
    MsgType::ServiceStats,
    MsgType::StatusRequest,
    MsgType::StatusReply,
    MsgType::ServerHello,
    MsgType::Replicate,
    MsgType::Snapshot,
    MsgType::AuthHello,
    MsgType::AuthChallenge,
    MsgType::AuthProof,
    MsgType::Restore,
    MsgType::ServerTakeOver,
    MsgType::Failover,
    MsgType::PeerLeft,
    MsgType::Release,
    MsgType::ServerRelease,
    MsgType::DataHello,
    MsgType::PushRef,
    MsgType::ResultRef,
    MsgType::OptConfig,
    MsgType::Received,
    MsgType::Push,
    MsgType::Result,
    MsgType::Stall,
    MsgType::Error,
    MsgType::Register,
    MsgType::Welcome,
    MsgType::Declare,
    MsgType::Declared,
    MsgType::DeclareError,
    MsgType::Heartbeat,
    MsgType::PeerLost,
    MsgType::Goodbye,
    MsgType::Shutdown,
    MsgType::Barrier,
    MsgType::BarrierDone,
    MsgType::ServerDeclare,
    MsgType::ServerDeclareAck,
    MsgType::DeclareStall,
];

/// Data-plane types; every other MsgType is a Control message.
/// Frames that are not control messages: the data plane's, and the
/// authentication handshake's (before any control message).
const DATA_TYPES: [MsgType; 17] = [
    MsgType::PeerHello,
    MsgType::PeerData,
    MsgType::ServerHello,
    MsgType::Replicate,
    MsgType::Snapshot,
    MsgType::AuthHello,
    MsgType::AuthChallenge,
    MsgType::AuthProof,
    MsgType::DataHello,
    MsgType::Push,
    MsgType::Result,
    MsgType::Stall,
    MsgType::OptConfig,
    MsgType::Received,
    MsgType::PushRef,
    MsgType::ResultRef,
    MsgType::Restore,
];

const ALL_DTYPES: [DType; 7] = [DType::None, DType::F32, DType::F16, DType::BF16, DType::F64, DType::I32, DType::I64];

const NS: u32 = 0xDEAD_BEEF;

// ---------------------------------------------------------------- helpers

fn spec(key: u32, name: &str, numel: u64, dtype: DType, chunk_elems: u64, first_slot: u32) -> TensorSpec {
    let n = numel.div_ceil(chunk_elems);
    TensorSpec {
        key,
        name: name.to_string(),
        numel,
        dtype,
        chunk_elems,
        slots: (0..n as u32).map(|i| first_slot.wrapping_add(i) % 7).collect(),
        replicas: match key % 2 {
            0 => Vec::new(),
            _ => (0..n as u32).map(|i| first_slot.wrapping_add(i + 1) % 7).collect(),
        },
        relays: match key % 3 {
            0 => (0..2 * n as u32).map(|i| first_slot.wrapping_add(i) % 5).collect(),
            _ => Vec::new(),
        },
        // A member tensor has no relays.
        members: match key % 3 {
            1 => vec![0, 2, first_slot + 3],
            _ => Vec::new(),
        },
    }
}

/// One realistic instance of every Control variant (plus edge cases:
/// empty lists, empty strings, unicode, extreme integers).
fn sample_controls() -> Vec<Control> {
    let mut all = vec![
        Control::Register(Register {
            role: Role::Worker,
            requested_rank: -1,
            hostname: "gpu-node-03.cluster.local".into(),
            addr: String::new(),
            ports: vec![],
            colocated: false,
            num_workers: 8,
            num_servers: 2,
            local_rank: 3,
            local_size: 4,
            rack: String::new(),
            sum_order: crate::sum_order::SumOrder::Arrival,
            training: crate::training::Training::Asynchronous { staleness: Some(3) },
            elastic: None,
        }),
        Control::Register(Register {
            role: Role::Server,
            requested_rank: i32::MAX,
            hostname: "сервер-ü-東京".into(),
            addr: "10.0.0.17".into(),
            ports: vec![0, 1, 40000, 40001, u16::MAX],
            colocated: true,
            num_workers: u32::MAX,
            num_servers: 0,
            local_rank: -1,
            local_size: -1,
            rack: String::new(),
            sum_order: crate::sum_order::SumOrder::Rank,
            training: crate::training::Training::Asynchronous { staleness: None },
            elastic: Some(ElasticReg { min_workers: 2, max_workers: 9, initial: 4, prev_rank: -1 }),
        }),
        Control::Register(Register {
            role: Role::Worker,
            requested_rank: i32::MIN,
            hostname: String::new(),
            addr: "[::1]".into(),
            ports: vec![1],
            colocated: true,
            num_workers: 1,
            num_servers: 1,
            local_rank: i32::MIN,
            local_size: i32::MAX,
            rack: String::new(),
            sum_order: crate::sum_order::SumOrder::Arrival,
            training: crate::training::Training::Synchronous,
            elastic: Some(ElasticReg { min_workers: u32::MAX, max_workers: 0, initial: u32::MAX, prev_rank: i32::MIN }),
        }),
        Control::Welcome(Welcome {
            rank: 3,
            num_workers: 4,
            partition_bytes: 4 << 20,
            heartbeat_ms: 1000,
            stall_ms: 30_000,
            peer_timeout_ms: 10_000,
            servers: vec![
                ServerInfo {
                    rank: 0,
                    addr: "10.0.0.1".into(),
                    ports: vec![40000, 40001, 40002],
                    colocated: true,
                    host: "h0".into(),
                    rack: 0,
                },
                ServerInfo {
                    rank: 1,
                    addr: "host-β.example".into(),
                    ports: vec![],
                    colocated: false,
                    host: "β".into(),
                    rack: 1,
                },
                ServerInfo {
                    rank: u32::MAX,
                    addr: String::new(),
                    ports: vec![u16::MAX],
                    colocated: false,
                    host: String::new(),
                    rack: 0,
                },
            ],
            worker_hosts: vec!["a".into(), "a".into(), "日本語ホスト".into(), String::new()],
            worker_local_ranks: vec![0, 1, 0, u32::MAX],
            job_id: u64::MAX,
            host_reduce: true,
            failover: false,
            late: true,
            racks: vec!["r0".into(), "ρ1".into()],
            worker_racks: vec![1, 0, 1, 0],
            rack_reduce: true,
        }),
        Control::Welcome(Welcome {
            rank: 0,
            num_workers: 0,
            partition_bytes: 0,
            heartbeat_ms: 0,
            stall_ms: u32::MAX,
            peer_timeout_ms: 1,
            servers: vec![],
            worker_hosts: vec![],
            worker_local_ranks: vec![],
            job_id: 0,
            host_reduce: false,
            failover: true,
            late: false,
            racks: Vec::new(),
            worker_racks: Vec::new(),
            rack_reduce: false,
        }),
        Control::Declare {
            req: 7,
            entries: vec![
                DeclEntry {
                    name: "layer1.weight".into(),
                    numel: 1 << 20,
                    dtype: DType::F32,
                    partition: 0,
                    members: Vec::new(),
                    sharded: false,
                },
                DeclEntry {
                    name: "layer1.bias".into(),
                    numel: 0,
                    dtype: DType::F16,
                    partition: 64 << 10,
                    members: Vec::new(),
                    sharded: false,
                },
                DeclEntry {
                    name: "emb.🚀.grad".into(),
                    numel: u64::MAX,
                    dtype: DType::BF16,
                    partition: u32::MAX,
                    members: Vec::new(),
                    sharded: false,
                },
            ],
        },
        Control::Declare { req: u32::MAX, entries: vec![] },
        Control::Declared {
            req: 7,
            specs: vec![
                spec(0, "layer1.weight", 1 << 20, DType::F32, 1 << 18, 0),
                spec(1, "layer1.bias", 0, DType::F16, 1024, 0),
                spec(2, "emb.🚀.grad", 1000, DType::BF16, 333, 5),
                spec(u32::MAX, "one", 1, DType::F32, u64::MAX, 2),
            ],
        },
        Control::Declared { req: 0, specs: vec![] },
        Control::DeclareError {
            req: 9,
            message: "tensor 'x' declared as float32 by rank 0 but float16 by rank 2 ✗".into(),
        },
        Control::DeclareError { req: 0, message: String::new() },
        Control::Heartbeat,
        Control::Ack { received: 0 },
        Control::Ack { received: u64::MAX },
        Control::Resumed { received: 17 },
        Control::PeerLost { role: Role::Server, rank: 1, reason: "heartbeat timeout after 3000 ms".into() },
        Control::PeerLost { role: Role::Worker, rank: u32::MAX, reason: String::new() },
        Control::PeerLeft { rank: 3 },
        Control::Unreachable { server: 2, reason: "server 2 (10.0.0.3:9001) thread 0: timed out".into() },
        Control::Goodbye,
        Control::Shutdown,
        Control::HostsUpdated,
        Control::Barrier { id: 0 },
        Control::Barrier { id: u32::MAX },
        Control::BarrierDone { id: 42 },
        Control::ServerDeclare {
            batch: 3,
            specs: vec![spec(10, "w", 4096, DType::F16, 1000, 1), spec(11, "b", 1, DType::F32, 1, 0)],
        },
        Control::ServerDeclare { batch: 0, specs: vec![] },
        Control::ServerDeclareAck { batch: u32::MAX },
        Control::Release { keys: vec![0, 7, u32::MAX] },
        Control::Release { keys: vec![] },
        Control::ServerRelease { keys: vec![3] },
        Control::ServerTakeOver { batch: 4, lost: 2, specs: vec![spec(10, "w", 4096, DType::F16, 1000, 1)] },
        Control::ServerTakeOver { batch: u32::MAX, lost: u32::MAX, specs: vec![] },
        Control::ServerJoined {
            server: ServerInfo {
                rank: 3,
                addr: "10.0.0.9".into(),
                ports: vec![40000, 40001],
                colocated: false,
                host: "h9".into(),
                rack: 0,
            },
        },
        Control::ServerMove { batch: 5, specs: vec![spec(10, "w", 4096, DType::F16, 1000, 1)] },
        Control::ServerMove { batch: 0, specs: vec![] },
        Control::ServerMoveAck { batch: 5, kept: vec![(10, 0), (u32::MAX, u32::MAX)] },
        Control::ServerMoveAck { batch: u32::MAX, kept: vec![] },
        Control::Failover {
            batch: 7,
            lost: 1,
            reason: "server 1 (10.0.0.2:4000) disconnected ⚡".into(),
            specs: vec![spec(10, "w", 4096, DType::F16, 1000, 1), spec(11, "b", 1, DType::F32, 1, 0)],
        },
        Control::Failover { batch: u32::MAX, lost: 0, reason: String::new(), specs: vec![] },
        Control::DeclareStall { name: "layer1.weight".into(), missing: vec![1, 3, u32::MAX], waited_ms: 30_000 },
        Control::DeclareStall { name: "ß∂ƒ".into(), missing: vec![], waited_ms: u64::MAX },
        Control::DeclareStall { name: String::new(), missing: vec![0], waited_ms: 0 },
        Control::ServiceJoin(ServiceJoin {
            hostname: "h1".into(),
            addr: "10.0.0.2".into(),
            threads: 4,
            colocated: false,
        }),
        Control::ServiceJoin(ServiceJoin { hostname: String::new(), addr: String::new(), threads: 0, colocated: true }),
        Control::ServiceStart { job: "team-a.resnet".into(), namespace: u32::MAX, start: 3, rank: 2 },
        Control::ServiceStats { jobs: vec![] },
        Control::ServiceStats {
            jobs: vec![
                JobTraffic { job: "a".into(), start: 0, bytes: u64::MAX, rounds: 0, error: String::new() },
                JobTraffic {
                    job: "b".into(),
                    start: u64::MAX,
                    bytes: 0,
                    rounds: 7,
                    error: "cannot listen on 0.0.0.0:0".into(),
                },
            ],
        },
        Control::StatusRequest,
        Control::StatusReply { json: "{\"jobs\": []}".into() },
        Control::Join,
        Control::Joined { rank: 3 },
        Control::JoinDone { last: u32::MAX },
        Control::JoinOp {
            name: "grad.fc1.weight".into(),
            numel: 1 << 40,
            dtype: DType::BF16,
            flags: 3,
            round: 7,
            release_after: false,
        },
        Control::JoinOp { name: String::new(), numel: 0, dtype: DType::I64, flags: 0, round: 0, release_after: true },
        Control::Error { message: "scheduler: job namespace mismatch — bye 👋".into() },
        Control::Error { message: String::new() },
    ];
    // A Rejoin of each registration, with each Welcome and lists long and empty.
    let regs: Vec<Register> = all
        .iter()
        .filter_map(|m| match m {
            Control::Register(r) => Some(r.clone()),
            _ => None,
        })
        .collect();
    let welcomes: Vec<Welcome> = all
        .iter()
        .filter_map(|m| match m {
            Control::Welcome(w) => Some(w.clone()),
            _ => None,
        })
        .collect();
    for (i, register) in regs.into_iter().enumerate() {
        all.push(Control::Rejoin(Box::new(Rejoin {
            register,
            welcome: welcomes[i % welcomes.len()].clone(),
            specs: match i % 2 {
                0 => vec![spec(3, "w", 1000, DType::F32, 100, 1), spec(u32::MAX, "ü", 1, DType::BF16, 1, 0)],
                _ => vec![],
            },
            keys: (0..i as u32 * 3).collect(),
            left: vec![u32::MAX, 0][..i.min(2)].to_vec(),
            lost: vec![3, 1][..(i + 1).min(2)].to_vec(),
            barriers: [0, 7, u32::MAX][i % 3],
            received: [0, 12, u64::MAX][i % 3],
        })));
    }
    all
}

/// Split an encoded control frame into (header, payload).
fn split(frame: &[u8]) -> (Header, &[u8]) {
    let h = Header::decode(frame, MAX_CONTROL_PAYLOAD).expect("header decodes");
    (h, &frame[HEADER_LEN..])
}

/// Decode a full encoded frame, checking the payload length is consistent.
fn decode_frame(frame: &[u8]) -> Result<Control, ProtocolError> {
    let h = Header::decode(frame, MAX_CONTROL_PAYLOAD)?;
    let payload = &frame[HEADER_LEN..];
    assert_eq!(h.payload_len as usize, payload.len(), "payload_len consistent with payload");
    Control::decode(&h, payload)
}

/// Build a frame for `t` with the given raw payload (payload_len set to match).
fn frame_with_payload(t: MsgType, payload: &[u8]) -> (Header, Vec<u8>) {
    let mut h = Header::new(t);
    h.namespace = NS;
    h.payload_len = payload.len() as u32;
    (h, payload.to_vec())
}

fn is_bad_payload<T>(r: &Result<T, ProtocolError>) -> bool {
    matches!(r, Err(ProtocolError::BadPayload(_)))
}

fn valid_header_bytes() -> [u8; HEADER_LEN] {
    let mut h = Header::new(MsgType::Push);
    h.flags = FLAG_AVERAGE;
    h.dtype = DType::F32;
    h.namespace = 1;
    h.key = 2;
    h.chunk = 3;
    h.round = 4;
    h.priority = -5;
    h.payload_len = 100;
    h.encode(&[])
}

// ---------------------------------------------------------------- header

#[test]
fn header_layout_is_little_endian_and_fixed() {
    let mut h = Header::new(MsgType::Push);
    h.flags = FLAG_AVERAGE;
    h.dtype = DType::BF16;
    h.namespace = 0x0403_0201;
    h.key = 0x0807_0605;
    h.chunk = 0x0c0b_0a09;
    h.round = 0x100f_0e0d;
    h.priority = -2;
    h.payload_len = 0x1413_1211;
    let b = h.encode(&[]);
    assert_eq!(b.len(), HEADER_LEN);
    assert_eq!(&b[0..2], &MAGIC.to_le_bytes());
    assert_eq!(&b[0..2], b"GH");
    assert_eq!(b[2], VERSION);
    assert_eq!(b[3], MsgType::Push as u8);
    assert_eq!(&b[4..6], &[1, 0]);
    assert_eq!(b[6], 3);
    assert_eq!(b[7], 0);
    assert_eq!(&b[8..12], &[1, 2, 3, 4]);
    assert_eq!(&b[12..16], &[5, 6, 7, 8]);
    assert_eq!(&b[16..20], &[9, 10, 11, 12]);
    assert_eq!(&b[20..24], &[13, 14, 15, 16]);
    assert_eq!(&b[24..28], &[0xfe, 0xff, 0xff, 0xff]);
    assert_eq!(&b[28..32], &[0x11, 0x12, 0x13, 0x14]);
}

#[test]
fn header_round_trip_every_type_and_dtype() {
    for &t in &ALL_MSG_TYPES {
        for &d in &ALL_DTYPES {
            let mut h = Header::new(t);
            h.dtype = d;
            h.flags = FLAG_AVERAGE;
            h.namespace = 17;
            h.key = 5;
            h.chunk = 9;
            h.round = 100;
            h.priority = -3;
            h.payload_len = 1234;
            let got = Header::decode(&h.encode(&[]), u32::MAX).unwrap();
            assert_eq!(got, h, "{t:?}/{d:?}");
        }
    }
}

#[test]
fn header_round_trip_extreme_values() {
    let extremes_u32 = [0u32, 1, 0x7fff_ffff, 0x8000_0000, u32::MAX];
    let extremes_i32 = [i32::MIN, -1, 0, 1, i32::MAX];
    for &t in &ALL_MSG_TYPES {
        for (i, &v) in extremes_u32.iter().enumerate() {
            let h = Header {
                msg_type: t,
                flags: if i % 2 == 0 { 0 } else { FLAG_AVERAGE },
                dtype: ALL_DTYPES[i % ALL_DTYPES.len()],
                namespace: v,
                key: v,
                chunk: v,
                round: v,
                priority: extremes_i32[i],
                payload_len: v,
            };
            assert_eq!(Header::decode(&h.encode(&[]), u32::MAX).unwrap(), h);
        }
    }
    // payload_len exactly at the limit is accepted.
    let mut h = Header::new(MsgType::Declared);
    h.payload_len = MAX_CONTROL_PAYLOAD;
    assert_eq!(Header::decode(&h.encode(&[]), MAX_CONTROL_PAYLOAD).unwrap(), h);
    h.payload_len = 0;
    assert_eq!(Header::decode(&h.encode(&[]), 0).unwrap(), h);
}

#[test]
fn header_decode_ignores_bytes_after_header() {
    let mut buf = valid_header_bytes().to_vec();
    buf.extend_from_slice(&[0xff; 50]);
    let h = Header::decode(&buf, u32::MAX).unwrap();
    assert_eq!(h, Header::decode(&valid_header_bytes(), u32::MAX).unwrap());
}

/// `b` with its header checksum made right again (after a test changed a
/// field's bytes), so decoding reaches the field's own check.
fn sealed(mut b: [u8; HEADER_LEN]) -> [u8; HEADER_LEN] {
    let check = crc32c(&b[..36]);
    b[36..40].copy_from_slice(&check.to_le_bytes());
    b
}

#[test]
fn crc32c_is_castagnoli() {
    // The check value of CRC-32C (RFC 3720's iSCSI polynomial).
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(b""), 0);
    // Piece by piece, in any cut, is the same as at once.
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 + 7) as u8).collect();
    for cut in [0, 1, 15, 16, 17, 255, 4096, 9999, 10_000] {
        let mut c = frame::Crc32c::default();
        c.update(&data[..cut]);
        c.update(&data[cut..]);
        assert_eq!(c.value(), crc32c(&data), "cut at {cut}");
    }
}

#[test]
fn every_flipped_header_bit_is_refused() {
    let b = valid_header_bytes();
    assert!(Header::decode(&b, u32::MAX).is_ok());
    for byte in 0..HEADER_LEN {
        for bit in 0..8 {
            let mut bad = b;
            bad[byte] ^= 1 << bit;
            let err = Header::decode(&bad, u32::MAX).expect_err("a flipped bit decodes");
            // Magic and version too: a header whose checksum holds with
            // this build's (a bit flipped on the way) is no stranger's nor
            // another version's (those are `header_rejects_bad_magic`,
            // `header_rejects_wrong_version`).
            assert_eq!(err, ProtocolError::BadChecksum("the header".into()), "{byte}.{bit}");
            assert!(err.changed_on_the_way());
        }
    }
}

#[test]
fn a_flipped_payload_byte_is_refused_wherever_it_is() {
    let payload: Vec<u8> = (0..300u32).map(|i| (i * 7) as u8).collect();
    let (mut h, _) = frame_with_payload(MsgType::Stall, &payload);
    (h.key, h.chunk, h.round) = (4, 2, 9);
    let good = encode_frame(&h, &payload);
    assert_eq!(read_message(&mut Cursor::new(&good), Some(NS), MAX_CONTROL_PAYLOAD).unwrap(), (h, payload.clone()));
    for at in HEADER_LEN..good.len() {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        match read_message(&mut Cursor::new(&bad), Some(NS), MAX_CONTROL_PAYLOAD) {
            Err(ReadError::Protocol(ProtocolError::BadChecksum(what))) => {
                assert_eq!(what, "the payload of a Stall frame (key 4, chunk 2, round 9)")
            }
            other => panic!("byte {at} flipped: {other:?}"),
        }
    }
    // Control messages are checked the same way.
    let mut ctl = Control::Error { message: "x".repeat(40) }.encode(NS);
    let last = ctl.len() - 1;
    ctl[last] ^= 1;
    assert!(matches!(read_control(&mut Cursor::new(ctl), NS), Err(ReadError::Protocol(ProtocolError::BadChecksum(_)))));
}

#[test]
fn header_rejects_short_buffer() {
    let b = valid_header_bytes();
    for n in 0..HEADER_LEN {
        assert_eq!(
            Header::decode(&b[..n], u32::MAX),
            Err(ProtocolError::Truncated { need: HEADER_LEN, got: n }),
            "len {n}"
        );
    }
}

#[test]
fn header_rejects_bad_magic() {
    let mut b = valid_header_bytes();
    b[0] = b'X';
    assert_eq!(Header::decode(&sealed(b), u32::MAX), Err(ProtocolError::BadMagic(0x4858)));
    let mut b = valid_header_bytes();
    b[0..2].copy_from_slice(&MAGIC.to_be_bytes()); // byte-swapped magic
    assert_eq!(Header::decode(&sealed(b), u32::MAX), Err(ProtocolError::BadMagic(MAGIC.swap_bytes())));
    // An all-zero buffer fails on magic first.
    assert_eq!(Header::decode(&[0u8; HEADER_LEN], u32::MAX), Err(ProtocolError::BadMagic(0)));
}

#[test]
fn header_rejects_wrong_version() {
    for v in [0u8, 1, VERSION + 1, 0x7f, 0xff] {
        let mut b = valid_header_bytes();
        b[2] = v;
        assert_eq!(Header::decode(&sealed(b), u32::MAX), Err(ProtocolError::UnsupportedVersion(v)));
    }
}

#[test]
fn header_rejects_unknown_type() {
    let known: Vec<u8> = ALL_MSG_TYPES.iter().map(|&t| t as u8).collect();
    for v in 0..=255u8 {
        let mut b = valid_header_bytes();
        b[3] = v;
        let r = Header::decode(&sealed(b), u32::MAX);
        assert_eq!(
            MsgType::from_u8(v).is_some(),
            known.contains(&v),
            "type {v}: ALL_MSG_TYPES in tests.rs is out of sync with frame.rs"
        );
        if known.contains(&v) {
            assert_eq!(r.unwrap().msg_type as u8, v);
            assert_eq!(MsgType::from_u8(v).map(|t| t as u8), Some(v));
        } else {
            assert_eq!(r, Err(ProtocolError::UnknownType(v)), "type {v}");
            assert_eq!(MsgType::from_u8(v), None);
        }
    }
}

#[test]
fn header_rejects_unknown_flag_bits() {
    // Bit 0 is FLAG_AVERAGE, bit 1 FLAG_INIT, bit 2 FLAG_ZEROS, bit 3 FLAG_ASYNC, bit 4 FLAG_RESENT,
    // bit 5 FLAG_LEAVING, bit 6 FLAG_SEALED, bit 7 FLAG_NO_RESULT.
    use crate::protocol::{FLAG_ASYNC, FLAG_LEAVING, FLAG_NO_RESULT, FLAG_RESENT, FLAG_SEALED};
    assert_eq!(
        (FLAG_INIT, FLAG_ZEROS, FLAG_ASYNC, FLAG_RESENT, FLAG_LEAVING, FLAG_SEALED, FLAG_NO_RESULT),
        (2, 4, 8, 16, 32, 64, 128)
    );
    for bit in 8..16 {
        let flags = 1u16 << bit;
        let mut b = valid_header_bytes();
        b[4..6].copy_from_slice(&flags.to_le_bytes());
        assert_eq!(Header::decode(&sealed(b), u32::MAX), Err(ProtocolError::UnknownFlags(flags)), "bit {bit}");
        // Known bit plus an unknown one is still rejected, reporting all bits.
        let both = flags | FLAG_AVERAGE;
        b[4..6].copy_from_slice(&both.to_le_bytes());
        assert_eq!(Header::decode(&sealed(b), u32::MAX), Err(ProtocolError::UnknownFlags(both)));
    }
    let mut b = valid_header_bytes();
    b[4..6].copy_from_slice(&u16::MAX.to_le_bytes());
    assert_eq!(Header::decode(&sealed(b), u32::MAX), Err(ProtocolError::UnknownFlags(u16::MAX)));
}

#[test]
fn header_rejects_bad_dtype() {
    for v in 0..=255u8 {
        let mut b = valid_header_bytes();
        b[6] = v;
        let r = Header::decode(&sealed(b), u32::MAX);
        if v <= 6 {
            assert_eq!(r.unwrap().dtype as u8, v);
        } else {
            assert_eq!(r, Err(ProtocolError::BadDtype(v)), "dtype {v}");
        }
    }
}

#[test]
fn header_rejects_nonzero_reserved() {
    for v in [1u8, 0x80, 0xff] {
        let mut b = valid_header_bytes();
        b[7] = v;
        assert_eq!(Header::decode(&sealed(b), u32::MAX), Err(ProtocolError::ReservedNonZero));
    }
}

#[test]
fn header_rejects_payload_over_limit() {
    let mut h = Header::new(MsgType::Declared);
    h.payload_len = MAX_CONTROL_PAYLOAD + 1;
    assert_eq!(
        Header::decode(&h.encode(&[]), MAX_CONTROL_PAYLOAD),
        Err(ProtocolError::PayloadTooLarge { len: MAX_CONTROL_PAYLOAD + 1, max: MAX_CONTROL_PAYLOAD })
    );
    h.payload_len = u32::MAX;
    assert_eq!(
        Header::decode(&h.encode(&[]), MAX_CONTROL_PAYLOAD),
        Err(ProtocolError::PayloadTooLarge { len: u32::MAX, max: MAX_CONTROL_PAYLOAD })
    );
    h.payload_len = 1;
    assert_eq!(Header::decode(&h.encode(&[]), 0), Err(ProtocolError::PayloadTooLarge { len: 1, max: 0 }));
}

#[test]
fn dtype_helpers() {
    for &d in &ALL_DTYPES {
        assert_eq!(DType::from_u8(d as u8), Some(d));
    }
    assert_eq!(DType::from_u8(7), None);
    assert_eq!(DType::F32.size(), 4);
    assert_eq!(DType::F16.size(), 2);
    assert_eq!(DType::BF16.size(), 2);
    assert_eq!((DType::F64.size(), DType::I32.size(), DType::I64.size()), (8, 4, 8));
    for &d in &ALL_DTYPES[1..] {
        assert_eq!(DType::from_name(d.name()), Some(d));
        assert_eq!(d.sums_in_place(), !matches!(d, DType::F16 | DType::BF16));
        assert_eq!(d.is_integer(), matches!(d, DType::I32 | DType::I64));
    }
    assert_eq!(DType::from_name("none"), None);
    assert_eq!(DType::from_name("int8"), None);
}

// ---------------------------------------------------------------- control round trip

#[test]
fn control_round_trip_every_variant() {
    let samples = sample_controls();
    // Every Control variant (i.e. every control MsgType) is covered.
    let mut covered: Vec<MsgType> = samples.iter().map(Control::msg_type).collect();
    covered.dedup();
    for &t in ALL_MSG_TYPES.iter().filter(|t| !DATA_TYPES.contains(t)) {
        assert!(covered.contains(&t), "no sample for {t:?}");
    }
    for msg in samples {
        for ns in [0u32, 1, NS, u32::MAX] {
            let frame = msg.encode(ns);
            let (h, payload) = split(&frame);
            assert_eq!(h.msg_type, msg.msg_type());
            assert_eq!(h.namespace, ns);
            assert_eq!(h.dtype, DType::None);
            assert_eq!(h.flags, 0);
            assert_eq!(h.payload_len as usize, payload.len());
            assert_eq!(Control::decode(&h, payload).as_ref(), Ok(&msg), "{msg:?}");
        }
    }
}

#[test]
fn control_empty_payload_messages_have_no_payload() {
    for msg in [Control::Heartbeat, Control::Goodbye, Control::Shutdown] {
        let frame = msg.encode(NS);
        assert_eq!(frame.len(), HEADER_LEN);
        assert_eq!(decode_frame(&frame), Ok(msg));
    }
}

#[test]
fn tensor_spec_chunk_geometry() {
    let s = spec(2, "x", 1000, DType::BF16, 333, 0);
    assert_eq!(s.num_chunks(), 4);
    assert_eq!(s.chunk_range(0), (0, 333));
    assert_eq!(s.chunk_range(3), (999, 1000));
    assert_eq!(s.chunk_bytes(0), 666);
    assert_eq!(s.chunk_bytes(3), 2);
    let total: usize = (0..s.num_chunks()).map(|c| s.chunk_bytes(c)).sum();
    assert_eq!(total, 2000);
}

#[test]
fn control_error_decodes_invalid_utf8_lossily() {
    let (h, p) = frame_with_payload(MsgType::Error, b"bad \xff\xfe bytes");
    match Control::decode(&h, &p).unwrap() {
        Control::Error { message } => assert_eq!(message, "bad \u{fffd}\u{fffd} bytes"),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn control_rejects_data_plane_types() {
    for t in DATA_TYPES {
        let (h, p) = frame_with_payload(t, &[0u8; 16]);
        assert!(matches!(Control::decode(&h, &p), Err(ProtocolError::UnexpectedType(_))), "{t:?}");
        let (h, p) = frame_with_payload(t, &[]);
        assert!(matches!(Control::decode(&h, &p), Err(ProtocolError::UnexpectedType(_))), "{t:?}");
    }
}

// ---------------------------------------------------------------- control rejection

#[test]
fn control_rejects_every_truncation() {
    for msg in sample_controls() {
        let frame = msg.encode(NS);
        let (h, payload) = split(&frame);
        for cut in 0..payload.len() {
            let mut th = h;
            th.payload_len = cut as u32;
            let tframe = encode_frame(&th, &payload[..cut]);
            let r = decode_frame(&tframe);
            if matches!(msg, Control::Error { .. }) {
                // Error is free-form text: any prefix is a valid (shorter) message.
                assert!(matches!(r, Ok(Control::Error { .. })), "{msg:?} cut at {cut}");
            } else {
                assert!(is_bad_payload(&r), "{msg:?} cut at {cut}: {r:?}");
            }
            // And through read_control, both with the adjusted and the original length.
            let mut cur = Cursor::new(tframe);
            let r = read_control(&mut cur, NS);
            if !matches!(msg, Control::Error { .. }) {
                assert!(matches!(r, Err(ReadError::Protocol(ProtocolError::BadPayload(_)))), "{r:?}");
            }
            let mut cur = Cursor::new(&frame[..HEADER_LEN + cut]);
            let r = read_control(&mut cur, NS);
            match r {
                Err(ReadError::ClosedMidFrame) => {}
                other => panic!("{msg:?} stream cut at {cut}: expected a close mid-frame, got {other:?}"),
            }
        }
    }
}

#[test]
fn control_rejects_trailing_bytes() {
    for msg in sample_controls() {
        if matches!(msg, Control::Error { .. }) {
            continue; // free-form text, has no framing to violate
        }
        let frame = msg.encode(NS);
        let (h, payload) = split(&frame);
        for extra in [&[0u8][..], &[1, 2, 3], &[0xff; 64]] {
            let mut p = payload.to_vec();
            p.extend_from_slice(extra);
            let mut th = h;
            th.payload_len = p.len() as u32;
            let r = Control::decode(&th, &p);
            match r {
                Err(ProtocolError::BadPayload(m)) => assert!(m.contains("trailing"), "{m}"),
                other => panic!("{msg:?} + {} bytes: {other:?}", extra.len()),
            }
        }
    }
}

/// Payload builders for hand-crafted hostile inputs.
fn w() -> codec::Writer {
    codec::Writer::new()
}

#[test]
fn control_rejects_huge_counts_without_allocating() {
    // If any of these tried Vec::with_capacity(u32::MAX * size_of::<T>()), the
    // test would abort with an allocation failure or take forever.
    for count in [u32::MAX, u32::MAX / 2, 1 << 30, 1000] {
        let mut cases: Vec<(MsgType, Vec<u8>)> = Vec::new();
        // Register: ports count.
        let mut p = w();
        p.u8(0).i32(-1).str("h").str("a").u32(count).u16(1);
        cases.push((MsgType::Register, p.buf));
        // Welcome: servers count.
        let mut p = w();
        p.u32(0).u32(1).u32(2).u32(3).u32(4).u32(5).u32(count).u32(0);
        cases.push((MsgType::Welcome, p.buf));
        // Welcome: per-server ports count.
        let mut p = w();
        p.u32(0).u32(1).u32(2).u32(3).u32(4).u32(5).u32(1).u32(0).str("x").u32(count).u8(0).u32(0);
        cases.push((MsgType::Welcome, p.buf));
        // Welcome: worker_hosts count.
        let mut p = w();
        p.u32(0).u32(1).u32(2).u32(3).u32(4).u32(5).u32(0).u32(count).str("a");
        cases.push((MsgType::Welcome, p.buf));
        // Declare: entries count.
        let mut p = w();
        p.u32(1).u32(count).str("x").u64(1).u8(1);
        cases.push((MsgType::Declare, p.buf));
        // Declared / ServerDeclare: specs count.
        for t in [MsgType::Declared, MsgType::ServerDeclare] {
            let mut p = w();
            p.u32(1).u32(count);
            cases.push((t, p.buf));
            // ... and a spec's slot count.
            let mut p = w();
            p.u32(1).u32(1).u32(0).str("t").u64(u64::MAX).u8(1).u64(1).u32(count).u32(0);
            cases.push((t, p.buf));
        }
        // Strings whose length prefix is huge.
        let mut p = w();
        p.u32(1).u32(count).extend_raw(b"abc");
        cases.push((MsgType::DeclareError, p.buf));
        let mut p = w();
        p.u8(1).u32(2).u32(count);
        cases.push((MsgType::PeerLost, p.buf));
        // DeclareStall: name length and missing-ranks count.
        let mut p = w();
        p.u32(count).u64(1).u32(0);
        cases.push((MsgType::DeclareStall, p.buf));
        let mut p = w();
        p.str("t").u64(1).u32(count).u32(0);
        cases.push((MsgType::DeclareStall, p.buf));

        for (t, payload) in cases {
            let (h, p) = frame_with_payload(t, &payload);
            let r = Control::decode(&h, &p);
            assert!(is_bad_payload(&r), "{t:?} count {count}: {r:?}");
        }
    }
}

/// `Writer` has no raw-append method; this keeps the hostile builders readable.
trait ExtendRaw {
    fn extend_raw(&mut self, b: &[u8]) -> &mut Self;
}
impl ExtendRaw for codec::Writer {
    fn extend_raw(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
}

#[test]
fn control_rejects_invalid_utf8() {
    let bad = b"ok\xc3\x28"; // invalid 2-byte sequence
    let mut cases: Vec<(MsgType, Vec<u8>)> = Vec::new();
    let mut p = w();
    p.u8(0).i32(-1).u32(bad.len() as u32).extend_raw(bad).str("a").u32(0).u8(0).u32(1).u32(1);
    cases.push((MsgType::Register, p.buf));
    let mut p = w();
    p.u8(1).i32(0).str("h").u32(1).extend_raw(b"\xff").u32(0).u8(0).u32(1).u32(1);
    cases.push((MsgType::Register, p.buf));
    let mut p = w();
    p.u32(0).u32(1).u32(2).u32(3).u32(4).u32(5).u32(0).u32(1).u32(2).extend_raw(b"\xed\xa0"); // surrogate prefix
    cases.push((MsgType::Welcome, p.buf));
    let mut p = w();
    p.u32(0).u32(1).u32(2).u32(3).u32(4).u32(5).u32(1).u32(0).u32(1).extend_raw(b"\x80").u32(0).u8(0).u32(0).u64(0);
    cases.push((MsgType::Welcome, p.buf));
    let mut p = w();
    p.u32(1).u32(1).u32(bad.len() as u32).extend_raw(bad).u64(1).u8(1);
    cases.push((MsgType::Declare, p.buf));
    let mut p = w();
    p.u32(1).u32(1).u32(0).u32(bad.len() as u32).extend_raw(bad).u64(1).u8(1).u64(1).u32(1).u32(0);
    cases.push((MsgType::Declared, p.buf));
    let mut p = w();
    p.u32(1).u32(bad.len() as u32).extend_raw(bad);
    cases.push((MsgType::DeclareError, p.buf));
    let mut p = w();
    p.u8(0).u32(1).u32(bad.len() as u32).extend_raw(bad);
    cases.push((MsgType::PeerLost, p.buf));
    let mut p = w();
    p.u32(bad.len() as u32).extend_raw(bad).u64(1).u32(0);
    cases.push((MsgType::DeclareStall, p.buf));
    for (t, payload) in cases {
        let (h, p) = frame_with_payload(t, &payload);
        match Control::decode(&h, &p) {
            Err(ProtocolError::BadPayload(m)) => assert!(m.contains("UTF-8"), "{t:?}: {m}"),
            other => panic!("{t:?}: {other:?}"),
        }
    }
}

fn raw_spec(numel: u64, dtype: u8, chunk_elems: u64, nslots: u32) -> Vec<u8> {
    let mut p = w();
    p.u32(7).str("t").u64(numel).u8(dtype).u64(chunk_elems).u32(nslots);
    for i in 0..nslots {
        p.u32(i);
    }
    p.u32(0); // no replicas
    p.u32(0); // no relays
    p.u32(0); // no members
    p.buf
}

fn specs_payload(t: MsgType, spec_bytes: &[u8]) -> (Header, Vec<u8>) {
    let mut p = w();
    p.u32(5).u32(1).extend_raw(spec_bytes);
    frame_with_payload(t, &p.buf)
}

#[test]
fn control_rejects_a_replica_count_that_is_not_the_chunk_count() {
    for (nrep, ok) in [(0u32, true), (4, true), (3, false), (5, false)] {
        let mut b = raw_spec(10, 1, 3, 4);
        b.truncate(b.len() - 12);
        let mut p = w();
        p.u32(nrep);
        (0..nrep).for_each(|i| {
            p.u32(i + 1);
        });
        p.u32(0).u32(0);
        b.extend_from_slice(&p.buf);
        let (h, payload) = specs_payload(MsgType::Declared, &b);
        match Control::decode(&h, &payload) {
            Ok(Control::Declared { specs, .. }) if ok => assert_eq!(specs[0].replicas.len(), nrep as usize),
            Err(ProtocolError::BadPayload(m)) if !ok => assert!(m.contains("replica slots"), "{m}"),
            other => panic!("{nrep} replicas: {other:?}"),
        }
    }
}

#[test]
fn control_rejects_a_relay_count_that_is_not_a_multiple_of_the_chunk_count() {
    // Per chunk, one slot per rack: 4 chunks in 2 or 3 racks.
    for (nrel, ok) in [(0u32, true), (8, true), (12, true), (4, true), (6, false), (9, false)] {
        let mut b = raw_spec(10, 1, 3, 4);
        b.truncate(b.len() - 8);
        let mut p = w();
        p.u32(nrel);
        (0..nrel).for_each(|i| {
            p.u32(i);
        });
        p.u32(0);
        b.extend_from_slice(&p.buf);
        let (h, payload) = specs_payload(MsgType::Declared, &b);
        match Control::decode(&h, &payload) {
            Ok(Control::Declared { specs, .. }) if ok => assert_eq!(specs[0].relays.len(), nrel as usize),
            Err(ProtocolError::BadPayload(m)) if !ok => assert!(m.contains("relay slots"), "{m}"),
            other => panic!("{nrel} relays: {other:?}"),
        }
    }
}

#[test]
fn control_rejects_members_out_of_order_or_beside_relays() {
    // A spec's members: strictly ascending ranks, and no relays beside them.
    for (members, relays, ok) in [
        (&[1u32, 4][..], 0u32, true),
        (&[][..], 4, true),
        (&[4, 1][..], 0, false),
        (&[2, 2][..], 0, false),
        (&[0, 3][..], 4, false),
    ] {
        let mut b = raw_spec(10, 1, 3, 4);
        b.truncate(b.len() - 8);
        let mut p = w();
        p.u32(relays);
        (0..relays).for_each(|i| {
            p.u32(i);
        });
        p.u32(members.len() as u32);
        members.iter().for_each(|&r| {
            p.u32(r);
        });
        b.extend_from_slice(&p.buf);
        let (h, payload) = specs_payload(MsgType::Declared, &b);
        match Control::decode(&h, &payload) {
            Ok(Control::Declared { specs, .. }) if ok => assert_eq!(specs[0].members, members),
            Err(ProtocolError::BadPayload(m)) if !ok => assert!(m.contains("members"), "{m}"),
            other => panic!("{members:?} with {relays} relays: {other:?}"),
        }
    }
    // The same in a declaration.
    let mut p = w();
    p.u32(1).u32(1).str("x").u64(4).u8(1).u32(0).u32(2).u32(3).u32(1);
    let (h, p) = frame_with_payload(MsgType::Declare, &p.buf);
    assert!(matches!(Control::decode(&h, &p), Err(ProtocolError::BadPayload(m)) if m.contains("ascending")));
    // A sharded flag is 0 or 1.
    let mut p = w();
    p.u32(1).u32(1).str("x").u64(4).u8(1).u32(0).u32(0).u8(2);
    let (h, p) = frame_with_payload(MsgType::Declare, &p.buf);
    assert!(matches!(Control::decode(&h, &p), Err(ProtocolError::BadPayload(m)) if m.contains("sharded 2")));
}

#[test]
fn control_rejects_inconsistent_tensor_specs() {
    for t in [MsgType::Declared, MsgType::ServerDeclare] {
        // Sanity: the raw builder produces a valid spec when consistent.
        for (numel, chunk, n) in
            [(10u64, 3u64, 4u32), (0, 5, 0), (9, 3, 3), (1, u64::MAX, 1), (u64::MAX, 1 << 40, 1 << 24)]
        {
            if n > 1000 {
                continue; // too large to materialise cheaply
            }
            let (h, p) = specs_payload(t, &raw_spec(numel, 1, chunk, n));
            assert!(Control::decode(&h, &p).is_ok(), "{t:?} numel {numel} chunk {chunk} n {n}");
        }
        // Slot count too small / too large.
        for (numel, chunk, n) in [(10u64, 3u64, 3u32), (10, 3, 5), (9, 3, 4), (9, 3, 2), (0, 5, 1), (1, 1, 0)] {
            let (h, p) = specs_payload(t, &raw_spec(numel, 1, chunk, n));
            match Control::decode(&h, &p) {
                Err(ProtocolError::BadPayload(m)) => assert!(m.contains("chunk slots"), "{m}"),
                other => panic!("{t:?} numel {numel} chunk {chunk} n {n}: {other:?}"),
            }
        }
        // chunk_elems = 0, with and without elements (must not divide by zero).
        for (numel, n) in [(0u64, 0u32), (10, 1), (10, 0), (u64::MAX, 3)] {
            let (h, p) = specs_payload(t, &raw_spec(numel, 1, 0, n));
            assert!(is_bad_payload(&Control::decode(&h, &p)), "{t:?} chunk_elems 0 numel {numel}");
        }
        // dtype None or unknown in a spec.
        for d in [0u8, 7, 0xff] {
            let (h, p) = specs_payload(t, &raw_spec(10, d, 5, 2));
            assert_eq!(Control::decode(&h, &p), Err(ProtocolError::BadDtype(d)), "{t:?} dtype {d}");
        }
    }
}

#[test]
fn control_rejects_bad_dtype_in_declaration() {
    for d in [0u8, 7, 0x80, 0xff] {
        let mut p = w();
        p.u32(1).u32(2).str("ok").u64(4).u8(1).u32(0).u32(0).u8(0).str("bad").u64(4).u8(d).u32(0).u32(0).u8(0);
        let (h, p) = frame_with_payload(MsgType::Declare, &p.buf);
        assert_eq!(Control::decode(&h, &p), Err(ProtocolError::BadDtype(d)), "dtype {d}");
    }
    // Encoding a DType::None declaration produces something the peer rejects.
    let msg = Control::Declare {
        req: 1,
        entries: vec![DeclEntry {
            name: "x".into(),
            numel: 1,
            dtype: DType::None,
            partition: 0,
            members: Vec::new(),
            sharded: false,
        }],
    };
    assert_eq!(decode_frame(&msg.encode(NS)), Err(ProtocolError::BadDtype(0)));
}

#[test]
fn control_rejects_unknown_role() {
    for role in [2u8, 0xff] {
        let mut p = w();
        p.u8(role).i32(0).str("h").str("a").u32(0).u8(0).u32(1).u32(1);
        let (h, p) = frame_with_payload(MsgType::Register, &p.buf);
        assert!(is_bad_payload(&Control::decode(&h, &p)));
        let mut p = w();
        p.u8(role).u32(0).str("r");
        let (h, p) = frame_with_payload(MsgType::PeerLost, &p.buf);
        assert!(is_bad_payload(&Control::decode(&h, &p)));
    }
}

// ---------------------------------------------------------------- blocking helpers

#[test]
fn read_write_control_over_cursor() {
    let samples = sample_controls();
    let mut buf = Vec::new();
    for msg in &samples {
        write_control(&mut buf, msg, NS).unwrap();
    }
    let mut cur = Cursor::new(buf);
    for msg in &samples {
        assert_eq!(&read_control(&mut cur, NS).unwrap(), msg);
    }
    // Stream exhausted between messages: a clean close.
    match read_control(&mut cur, NS) {
        Err(ReadError::Closed) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn read_control_rejects_wrong_namespace() {
    let mut buf = Vec::new();
    write_control(&mut buf, &Control::Barrier { id: 3 }, 7).unwrap();
    let mut cur = Cursor::new(buf);
    match read_control(&mut cur, 8) {
        Err(ReadError::Protocol(e @ ProtocolError::WrongNamespace { got: 7 })) => {
            assert!(!e.to_string().contains('8'), "the job's namespace is not revealed: {e}")
        }
        other => panic!("{other:?}"),
    }
    // Only the header was consumed.
    assert_eq!(cur.position() as usize, HEADER_LEN);
}

#[test]
fn read_control_reports_header_errors() {
    // Bad magic (a stranger's header, its checksum its own).
    let mut b: [u8; HEADER_LEN] = Control::Heartbeat.encode(NS)[..HEADER_LEN].try_into().unwrap();
    b[0] = 0;
    let b = sealed(b).to_vec();
    assert!(matches!(read_control(&mut Cursor::new(b), NS), Err(ReadError::Protocol(ProtocolError::BadMagic(_)))));
    // Oversized payload_len is rejected before anything is allocated or read.
    let mut h = Header::new(MsgType::Declared);
    h.namespace = NS;
    h.payload_len = MAX_CONTROL_PAYLOAD + 1;
    assert!(matches!(
        read_control(&mut Cursor::new(h.encode(&[]).to_vec()), NS),
        Err(ReadError::Protocol(ProtocolError::PayloadTooLarge { .. }))
    ));
    h.payload_len = u32::MAX;
    assert!(matches!(
        read_control(&mut Cursor::new(h.encode(&[]).to_vec()), NS),
        Err(ReadError::Protocol(ProtocolError::PayloadTooLarge { .. }))
    ));
    // Data-plane frame on a control connection.
    let mut h = Header::new(MsgType::Push);
    h.namespace = NS;
    h.dtype = DType::F32;
    h.payload_len = 8;
    let b = encode_frame(&h, &[0; 8]);
    assert!(matches!(
        read_control(&mut Cursor::new(b), NS),
        Err(ReadError::Protocol(ProtocolError::UnexpectedType(_)))
    ));
    // Header shorter than its 40 bytes: I/O EOF, not a protocol error.
    let b = Control::Heartbeat.encode(NS);
    assert!(matches!(read_control(&mut Cursor::new(&b[..10]), NS), Err(ReadError::ClosedMidFrame)));
}

// ---------------------------------------------------------------- stall

#[test]
fn stall_round_trip() {
    for (server, thread, waited, missing) in [
        (0u32, 0u32, 0u64, vec![]),
        (1, 3, 30_000, vec![2u32, 5, 7]),
        (u32::MAX, u32::MAX, u64::MAX, vec![0, u32::MAX]),
    ] {
        let p = encode_stall(server, thread, waited, &missing);
        assert_eq!(p.len(), 20 + 4 * missing.len());
        let r = decode_stall(&p).unwrap();
        assert_eq!((r.server, r.thread, r.waited_ms, r.missing), (server, thread, waited, missing));
    }
}

#[test]
fn stall_rejects_malformed() {
    let p = encode_stall(1, 2, 3, &[4, 5, 6]);
    for cut in 0..p.len() {
        assert!(is_bad_payload(&decode_stall(&p[..cut])), "cut {cut}");
    }
    let mut trailing = p.clone();
    trailing.push(0);
    assert!(is_bad_payload(&decode_stall(&trailing)));
    let mut huge = w();
    huge.u32(1).u32(2).u64(3).u32(u32::MAX).u32(0);
    assert!(is_bad_payload(&decode_stall(&huge.buf)));
}

// ---------------------------------------------------------------- properties

fn any_msg_type() -> impl Strategy<Value = MsgType> {
    proptest::sample::select(ALL_MSG_TYPES.to_vec())
}

fn any_dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(ALL_DTYPES.to_vec())
}

prop_compose! {
    fn any_header()(
        msg_type in any_msg_type(),
        average in any::<bool>(),
        dtype in any_dtype(),
        namespace in any::<u32>(),
        key in any::<u32>(),
        chunk in any::<u32>(),
        round in any::<u32>(),
        priority in any::<i32>(),
        payload_len in any::<u32>(),
    ) -> Header {
        Header {
            msg_type,
            flags: if average { FLAG_AVERAGE } else { 0 },
            dtype, namespace, key, chunk, round, priority, payload_len,
        }
    }
}

fn check_decoders_do_not_panic(bytes: &[u8]) {
    if let Ok(h) = Header::decode(bytes, MAX_CONTROL_PAYLOAD) {
        let payload = &bytes[HEADER_LEN..];
        let _ = Control::decode(&h, payload);
        let take = (h.payload_len as usize).min(payload.len());
        let _ = Control::decode(&h, &payload[..take]);
    }
    // Also decode the raw bytes as each control type's payload.
    for &t in &ALL_MSG_TYPES {
        let _ = Control::decode(&Header::new(t), bytes);
    }
    let _ = decode_stall(bytes);
    let _ = read_control(&mut Cursor::new(bytes), 0);
}

proptest! {
    #[test]
    fn prop_header_round_trip(h in any_header()) {
        prop_assert_eq!(Header::decode(&h.encode(&[]), u32::MAX), Ok(h));
        // Re-encoding a decoded header is byte-identical.
        let b = h.encode(&[]);
        prop_assert_eq!(Header::decode(&b, u32::MAX).unwrap().encode(&[]), b);
    }

    #[test]
    fn prop_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        check_decoders_do_not_panic(&bytes);
    }

    #[test]
    fn prop_header_prefixed_bytes_never_panic(
        h in any_header(),
        rest in proptest::collection::vec(any::<u8>(), 0..512),
        use_real_len in any::<bool>(),
    ) {
        let mut h = h;
        if use_real_len {
            h.payload_len = rest.len() as u32;
        }
        let payload = if use_real_len { &rest[..] } else { &[][..] };
        let mut bytes = h.encode(payload).to_vec();
        bytes.extend_from_slice(&rest);
        check_decoders_do_not_panic(&bytes);
    }

    #[test]
    fn prop_mutated_valid_frames_never_panic(
        idx in 0..64usize,
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let samples = sample_controls();
        let mut frame = samples[idx % samples.len()].encode(0);
        for (i, v) in flips {
            let i = i.index(frame.len());
            frame[i] ^= v;
        }
        check_decoders_do_not_panic(&frame);
    }

    #[test]
    fn prop_stall_round_trip(
        server in any::<u32>(), thread in any::<u32>(), waited in any::<u64>(),
        missing in proptest::collection::vec(any::<u32>(), 0..64),
    ) {
        let r = decode_stall(&encode_stall(server, thread, waited, &missing)).unwrap();
        prop_assert_eq!((r.server, r.thread, r.waited_ms, r.missing), (server, thread, waited, missing));
    }
}

// ---------------------------------------------------------------- regressions

/// Specs whose sizes would overflow offset arithmetic (numel = u64::MAX,
/// chunk_elems = 2^63: 2 slots, chunk 1 at 2^63 + 2^63) are rejected by decode.
#[test]
fn decoded_spec_chunk_geometry_does_not_overflow() {
    for (numel, chunk) in [(u64::MAX, 1u64 << 63), (u64::MAX, u64::MAX), (1u64 << 41, 1u64 << 20)] {
        let n = numel.div_ceil(chunk) as u32;
        let (h, p) = specs_payload(MsgType::Declared, &raw_spec(numel, 1, chunk, n));
        assert!(Control::decode(&h, &p).is_err(), "numel {numel} chunk {chunk} accepted");
        if let Ok(Control::Declared { specs, .. }) = Control::decode(&h, &p) {
            let s = &specs[0];
            for c in 0..s.num_chunks() {
                let _ = s.chunk_range(c);
                let _ = s.chunk_bytes(c);
            }
        }
    }
}

// ---------------------------------------------------------------- OptConfig

#[test]
fn opt_config_round_trip_and_rejection() {
    let c = OptConfig {
        kind: OptKind::AdamW,
        lr: 1e-3,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.01,
        nesterov: false,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let b = c.encode();
    assert_eq!(b.len(), optim::OPT_CONFIG_LEN);
    assert_eq!(OptConfig::decode(&b), Ok(c));
    for n in 0..b.len() {
        assert!(OptConfig::decode(&b[..n]).is_err(), "prefix {n}");
    }
    let mut bad = b.clone();
    bad[0] = 9; // unknown kind
    assert!(OptConfig::decode(&bad).is_err());
    for (field, v) in [(1usize, f32::NAN), (1, -1.0), (22, 1.0), (26, -1.0)] {
        let mut bad = b.clone();
        bad[field..field + 4].copy_from_slice(&v.to_bits().to_le_bytes());
        assert!(OptConfig::decode(&bad).is_err(), "field at {field} = {v}");
    }
}

#[test]
fn read_control_reads_payloads_larger_than_one_growth_step() {
    // Owned payloads grow as data arrives: a message of several steps must
    // still come out whole, and a short one right after it too.
    let big = Control::Error { message: "x".repeat(300_000) };
    let mut buf = Vec::new();
    write_control(&mut buf, &big, NS).unwrap();
    write_control(&mut buf, &Control::Barrier { id: 1 }, NS).unwrap();
    let mut cur = Cursor::new(buf);
    assert_eq!(read_control(&mut cur, NS).unwrap(), big);
    assert_eq!(read_control(&mut cur, NS).unwrap(), Control::Barrier { id: 1 });
}
