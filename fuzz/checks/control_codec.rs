//! Checks of the control-message codec, shared by the `control_codec` fuzz
//! target and the test suite's short random run (`tests/integration/fuzz.rs`).
//!
//! The input drives a generator of well-formed messages (every type, every
//! field), so the fuzzer explores the codec's structure rather than the
//! header's magic bytes. Every generated message must encode and decode to
//! itself; then the input's remaining bytes mutate the encoded frame (flip,
//! truncate, insert, overwrite a length), and whatever decodes from a
//! mutation must be a fixed point of encode/decode. Any panic is a bug.

use std::io::Cursor;

use gradhub::protocol::{
    decode_stall, encode_stall, read_control, Control, DType, DeclEntry, JobTraffic, OptConfig, OptKind, Register,
    Rejoin, Role, ServerInfo, ServiceJoin, TensorSpec, Welcome,
};

/// Values taken from the front of the input; zeros once it is used up.
pub struct Source<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Source<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Source { data, pos: 0 }
    }
    pub fn rest(&self) -> &'a [u8] {
        &self.data[self.pos.min(self.data.len())..]
    }
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        for x in b.iter_mut() {
            *x = self.data.get(self.pos).copied().unwrap_or(0);
            self.pos += 1;
        }
        b
    }
    pub fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    /// A length below `max`.
    fn len(&mut self, max: usize) -> usize {
        self.u8() as usize % max
    }
    /// Any UTF-8 text (the codec's strings must be), empty to long.
    fn text(&mut self) -> String {
        let n = match self.u8() {
            255 => 300 + self.len(200), // longer than one length byte
            n => n as usize % 24,
        };
        let raw: Vec<u8> = (0..n).map(|_| self.u8()).collect();
        String::from_utf8_lossy(&raw).into_owned()
    }
    fn list<T>(&mut self, max: usize, mut f: impl FnMut(&mut Self) -> T) -> Vec<T> {
        let n = self.len(max);
        (0..n).map(|_| f(self)).collect()
    }
    fn dtype(&mut self) -> DType {
        const TYPES: [DType; 6] = [DType::F32, DType::F16, DType::BF16, DType::F64, DType::I32, DType::I64];
        TYPES[self.len(TYPES.len())]
    }
    /// A spec the decoder accepts: one slot per chunk of `chunk_elems`.
    fn spec(&mut self) -> TensorSpec {
        let chunks = self.len(12) as u64;
        let chunk_elems = 1 + (self.u32() as u64 % 100_000);
        let numel = match chunks {
            0 => 0,
            c => (c - 1) * chunk_elems + 1 + self.u32() as u64 % chunk_elems,
        };
        let slots = (0..chunks).map(|_| self.u32()).collect();
        let replicas = match self.bool() {
            true => (0..chunks).map(|_| self.u32()).collect(),
            false => Vec::new(),
        };
        let relays = match (self.bool(), chunks) {
            (true, 1..) => (0..chunks * (1 + self.u32() as u64 % 3)).map(|_| self.u32()).collect(),
            _ => Vec::new(),
        };
        let members = match relays.is_empty() {
            true => self.ranks(),
            false => Vec::new(),
        };
        let (key, name, dtype) = (self.u32(), self.text(), self.dtype());
        TensorSpec { key, name, numel, dtype, chunk_elems, slots, replicas, relays, members }
    }
    /// Ranks in strictly ascending order (a tensor's members), maybe none.
    fn ranks(&mut self) -> Vec<u32> {
        let mut at = 0u32;
        self.list(5, |s| {
            at = at.saturating_add(1 + s.u32() % 9);
            at
        })
    }
    fn server(&mut self) -> ServerInfo {
        ServerInfo {
            rank: self.u32(),
            addr: self.text(),
            ports: self.list(4, |s| s.u16()),
            colocated: self.bool(),
            host: self.text(),
            rack: self.u32(),
        }
    }
    fn role(&mut self) -> Role {
        if self.bool() {
            Role::Server
        } else {
            Role::Worker
        }
    }
}

/// A well-formed registration, fields from `s`.
fn register(s: &mut Source) -> Register {
    Register {
        role: s.role(),
        requested_rank: s.u32() as i32,
        hostname: s.text(),
        addr: s.text(),
        ports: s.list(8, |s| s.u16()),
        colocated: s.bool(),
        num_workers: s.u32(),
        num_servers: s.u32(),
        local_rank: s.u32() as i32,
        local_size: s.u32() as i32,
        rack: s.text(),
        sum_order: if s.bool() { gradhub::sum_order::SumOrder::Rank } else { gradhub::sum_order::SumOrder::Arrival },
        training: match s.u8() % 3 {
            0 => gradhub::training::Training::Synchronous,
            1 => gradhub::training::Training::Asynchronous { staleness: None },
            _ => gradhub::training::Training::Asynchronous { staleness: Some(s.u32() % 1000) },
        },
        elastic: s.bool().then(|| gradhub::protocol::ElasticReg {
            min_workers: s.u32(),
            max_workers: s.u32(),
            initial: s.u32(),
            prev_rank: s.u32() as i32,
        }),
    }
}

/// A well-formed Welcome, fields from `s`.
fn welcome(s: &mut Source) -> Welcome {
    let (rank, num_workers, partition_bytes) = (s.u32(), s.u32(), s.u32());
    let (heartbeat_ms, stall_ms, peer_timeout_ms) = (s.u32(), s.u32(), s.u32());
    let mut servers = s.list(6, |s| s.server());
    let worker_hosts = s.list(8, |s| s.text());
    let worker_local_ranks = worker_hosts.iter().map(|_| s.u32()).collect();
    let racks = s.list(4, |s| s.text());
    let n = racks.len().max(1) as u32;
    let worker_racks = worker_hosts.iter().map(|_| s.u32() % n).collect();
    servers.iter_mut().for_each(|x| x.rack %= n);
    Welcome {
        rank,
        num_workers,
        partition_bytes,
        heartbeat_ms,
        stall_ms,
        peer_timeout_ms,
        servers,
        worker_hosts,
        worker_local_ranks,
        job_id: s.u64(),
        host_reduce: s.bool(),
        failover: s.bool(),
        late: s.bool(),
        racks,
        worker_racks,
        rack_reduce: s.bool(),
    }
}

/// A well-formed message of any type, fields from `s`.
pub fn message(s: &mut Source) -> Control {
    match s.u8() % 38 {
        0 => Control::Register(register(s)),
        1 => Control::Welcome(welcome(s)),
        2 => Control::Declare {
            req: s.u32(),
            entries: s.list(6, |s| DeclEntry {
                name: s.text(),
                numel: s.u64(),
                dtype: s.dtype(),
                partition: s.u32(),
                members: s.ranks(),
                sharded: s.bool(),
            }),
        },
        3 => Control::Declared { req: s.u32(), specs: s.list(4, |s| s.spec()) },
        4 => Control::DeclareError { req: s.u32(), message: s.text() },
        5 => Control::Heartbeat,
        6 => Control::PeerLost { role: s.role(), rank: s.u32(), reason: s.text() },
        7 => Control::PeerLeft { rank: s.u32() },
        8 => Control::Goodbye,
        9 => Control::Shutdown,
        10 => Control::Barrier { id: s.u32() },
        11 => Control::BarrierDone { id: s.u32() },
        12 => Control::ServerDeclare { batch: s.u32(), specs: s.list(4, |s| s.spec()) },
        13 => Control::ServerDeclareAck { batch: s.u32() },
        14 => Control::Release { keys: s.list(16, |s| s.u32()) },
        15 => Control::ServerRelease { keys: s.list(16, |s| s.u32()) },
        16 => Control::ServerTakeOver { batch: s.u32(), lost: s.u32(), specs: s.list(4, |s| s.spec()) },
        17 => Control::Failover { batch: s.u32(), lost: s.u32(), reason: s.text(), specs: s.list(4, |s| s.spec()) },
        18 => Control::DeclareStall { name: s.text(), missing: s.list(8, |s| s.u32()), waited_ms: s.u64() },
        19 => Control::ServiceJoin(ServiceJoin {
            hostname: s.text(),
            addr: s.text(),
            threads: s.u32(),
            colocated: s.u8() & 1 == 1,
        }),
        20 => Control::ServiceStart { job: s.text(), namespace: s.u32(), start: s.u64(), rank: s.u32() },
        21 => Control::ServiceStats {
            jobs: s.list(4, |s| JobTraffic {
                job: s.text(),
                start: s.u64(),
                bytes: s.u64(),
                rounds: s.u64(),
                error: s.text(),
            }),
        },
        22 => Control::StatusRequest,
        23 => Control::StatusReply { json: s.text() },
        24 => Control::Join,
        25 => Control::Joined { rank: s.u32() },
        26 => Control::JoinDone { last: s.u32() },
        27 => Control::JoinOp {
            name: s.text(),
            numel: s.u64(),
            dtype: s.dtype(),
            flags: s.u16(),
            round: s.u32(),
            release_after: s.bool(),
        },
        29 => Control::ServerJoined { server: s.server() },
        30 => Control::ServerMove { batch: s.u32(), specs: s.list(4, |s| s.spec()) },
        31 => Control::ServerMoveAck { batch: s.u32(), kept: s.list(8, |s| (s.u32(), s.u32())) },
        32 => Control::HostsUpdated,
        33 => Control::Rejoin(Box::new(Rejoin {
            register: register(s),
            welcome: welcome(s),
            specs: s.list(4, |s| s.spec()),
            keys: s.list(16, |s| s.u32()),
            left: s.list(8, |s| s.u32()),
            lost: s.list(4, |s| s.u32()),
            barriers: s.u32(),
            received: s.u64(),
        })),
        34 => Control::Unreachable { server: s.u32(), reason: s.text() },
        35 => Control::Ack { received: s.u64() },
        36 => Control::Resumed { received: s.u64() },
        _ => Control::Error { message: s.text() },
    }
}

/// Decode `frame` (one message, then possibly more bytes); a message that
/// decodes must re-encode to one that decodes to itself.
fn fixed_point(frame: &[u8], ns: u32) {
    if let Ok(msg) = read_control(&mut Cursor::new(frame), ns) {
        let again = read_control(&mut Cursor::new(&msg.encode(ns)), ns)
            .unwrap_or_else(|e| panic!("re-encoded {msg:?} fails to decode: {e}"));
        assert_eq!(again, msg);
    }
}

pub fn check(data: &[u8]) {
    let mut s = Source::new(data);
    let msg = message(&mut s);
    let ns = s.u32();
    let frame = msg.encode(ns);

    // 1. Round trip, alone and followed by a second message on the stream.
    let got = read_control(&mut Cursor::new(&frame), ns).unwrap_or_else(|e| panic!("{msg:?} fails to decode: {e}"));
    assert_eq!(got, msg);
    let next = message(&mut s);
    let mut two = frame.clone();
    two.extend_from_slice(&next.encode(ns));
    let mut cur = Cursor::new(&two);
    assert_eq!(read_control(&mut cur, ns).expect("first of two"), msg);
    assert_eq!(read_control(&mut cur, ns).expect("second of two"), next);
    // Another job's namespace is refused, not decoded.
    assert!(read_control(&mut Cursor::new(&frame), ns.wrapping_add(1)).is_err());

    // 2. Mutations of the frame, from the rest of the input.
    let mut m = frame;
    for _ in 0..s.len(8) {
        let at = if m.is_empty() { 0 } else { s.u32() as usize % m.len() };
        match s.u8() % 5 {
            0 if !m.is_empty() => m[at] ^= 1 << (s.u8() % 8),
            1 => m.truncate(at),
            2 => {
                let b = s.u8();
                m.insert(at.min(m.len()), b)
            }
            // A length or count: overwrite 4 bytes with a small or huge number.
            3 if m.len() >= at + 4 => {
                let v = if s.bool() { s.u8() as u32 } else { u32::MAX - s.u8() as u32 };
                m[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                let b = s.u8();
                m.push(b)
            }
        }
        fixed_point(&m, ns);
    }

    // 3. The optimizer config (sent on data connections): valid ones round
    //    trip, and any 30 bytes decode to a config or an error.
    let c = OptConfig {
        kind: if s.bool() { OptKind::Sgd } else { OptKind::AdamW },
        lr: s.u8() as f32 / 100.0,
        momentum: s.u8() as f32 / 256.0,
        dampening: s.u8() as f32 / 256.0,
        weight_decay: s.u8() as f32 / 1000.0,
        nesterov: s.bool(),
        beta1: s.u8() as f32 / 256.0,
        beta2: s.u8() as f32 / 256.0,
        eps: s.u8() as f32 * 1e-9,
    };
    assert_eq!(OptConfig::decode(&c.encode()).expect("valid optimizer config"), c);
    let _ = OptConfig::decode(&s.rest()[..s.rest().len().min(40)]);

    // 4. Stall notices (also on data connections).
    let missing: Vec<u32> = s.list(8, |s| s.u32());
    let (server, thread, waited) = (s.u32(), s.u32(), s.u64());
    let st = decode_stall(&encode_stall(server, thread, waited, &missing)).expect("valid stall");
    assert_eq!((st.server, st.thread, st.waited_ms, st.missing), (server, thread, waited, missing));
    let _ = decode_stall(s.rest());
}
