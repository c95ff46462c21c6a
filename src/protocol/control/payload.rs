//! The payload encodings of the control messages: `Control::encode` and
//! `Control::decode`, with the shared pieces (server infos, tensor specs).

use super::*;
use crate::protocol::codec::{Reader, Writer};
use crate::protocol::frame::{DType, Header, MsgType};
use crate::protocol::ProtocolError;

fn put_server(w: &mut Writer, s: &ServerInfo) {
    w.u32(s.rank).str(&s.addr).u32(s.ports.len() as u32);
    for &p in &s.ports {
        w.u16(p);
    }
    w.u8(s.colocated as u8).str(&s.host).u32(s.rack);
}

fn get_server(r: &mut Reader) -> Result<ServerInfo, ProtocolError> {
    let rank = r.u32("server rank")?;
    let addr = r.str("server addr")?;
    let np = r.count("server ports", 2)?;
    let ports = (0..np).map(|_| r.u16("port")).collect::<Result<_, _>>()?;
    let colocated = r.u8("colocated")? != 0;
    let host = r.str("server host")?;
    let rack = r.u32("server rack")?;
    Ok(ServerInfo { rank, addr, ports, colocated, host, rack })
}

fn put_spec(w: &mut Writer, s: &TensorSpec) {
    w.u32(s.key).str(&s.name).u64(s.numel).u8(s.dtype as u8).u64(s.chunk_elems);
    w.u32(s.slots.len() as u32);
    for &slot in &s.slots {
        w.u32(slot);
    }
    w.u32(s.replicas.len() as u32);
    for &slot in &s.replicas {
        w.u32(slot);
    }
    w.u32(s.relays.len() as u32);
    for &slot in &s.relays {
        w.u32(slot);
    }
    put_ranks(w, &s.members);
}

fn put_ranks(w: &mut Writer, ranks: &[u32]) {
    w.u32(ranks.len() as u32);
    for &r in ranks {
        w.u32(r);
    }
}

/// A list of ranks, strictly ascending (a tensor's members).
fn get_ranks(r: &mut Reader, what: &'static str) -> Result<Vec<u32>, ProtocolError> {
    let n = r.count(what, 4)?;
    let ranks = (0..n).map(|_| r.u32("rank")).collect::<Result<Vec<u32>, _>>()?;
    if ranks.windows(2).any(|w| w[0] >= w[1]) {
        return Err(ProtocolError::BadPayload(format!("{what} {ranks:?} are not in strictly ascending order")));
    }
    Ok(ranks)
}

fn get_dtype(r: &mut Reader) -> Result<DType, ProtocolError> {
    let v = r.u8("dtype")?;
    match DType::from_u8(v) {
        Some(d) if d != DType::None => Ok(d),
        _ => Err(ProtocolError::BadDtype(v)),
    }
}

fn get_spec(r: &mut Reader) -> Result<TensorSpec, ProtocolError> {
    let key = r.u32("key")?;
    let name = r.str("name")?;
    let numel = r.u64("numel")?;
    let dtype = get_dtype(r)?;
    let chunk_elems = r.u64("chunk_elems")?;
    let n = r.count("slots", 4)?;
    let mut slots = Vec::with_capacity(n);
    for _ in 0..n {
        slots.push(r.u32("slot")?);
    }
    let nr = r.count("replicas", 4)?;
    let mut replicas = Vec::with_capacity(nr);
    for _ in 0..nr {
        replicas.push(r.u32("replica")?);
    }
    if nr != 0 && nr != n {
        return Err(ProtocolError::BadPayload(format!("tensor spec '{name}': {nr} replica slots for {n} chunks")));
    }
    let nl = r.count("relays", 4)?;
    let mut relays = Vec::with_capacity(nl);
    for _ in 0..nl {
        relays.push(r.u32("relay")?);
    }
    if nl != 0 && (n == 0 || !nl.is_multiple_of(n)) {
        return Err(ProtocolError::BadPayload(format!("tensor spec '{name}': {nl} relay slots for {n} chunks")));
    }
    let members = get_ranks(r, "members")?;
    if !members.is_empty() && nl != 0 {
        return Err(ProtocolError::BadPayload(format!(
            "tensor spec '{name}': members and relays (a member pushes to the owner)"
        )));
    }
    let elem = dtype.size() as u64;
    if numel.checked_mul(elem).is_none_or(|b| b > MAX_TENSOR_BYTES) {
        return Err(ProtocolError::BadPayload(format!("tensor spec '{name}': {numel} elements is too large")));
    }
    // numel * elem fits (checked above), so the largest real chunk does too.
    if chunk_elems.min(numel) * elem > u32::MAX as u64 {
        return Err(ProtocolError::BadPayload(format!(
            "tensor spec '{name}': chunks of {chunk_elems} elements are too large"
        )));
    }
    if chunk_elems == 0 || numel.div_ceil(chunk_elems) != n as u64 {
        return Err(ProtocolError::BadPayload(format!(
            "tensor spec '{name}': {n} chunk slots do not cover {numel} elements in chunks of {chunk_elems}"
        )));
    }
    Ok(TensorSpec { key, name, numel, dtype, chunk_elems, slots, replicas, relays, members })
}

fn put_specs(w: &mut Writer, specs: &[TensorSpec]) {
    w.u32(specs.len() as u32);
    for s in specs {
        put_spec(w, s);
    }
}

fn get_specs(r: &mut Reader) -> Result<Vec<TensorSpec>, ProtocolError> {
    let n = r.count("specs", 33)?;
    (0..n).map(|_| get_spec(r)).collect()
}

fn put_register(w: &mut Writer, m: &Register) {
    w.u8(m.role.to_u8()).i32(m.requested_rank).str(&m.hostname).str(&m.addr);
    w.u32(m.ports.len() as u32);
    for &p in &m.ports {
        w.u16(p);
    }
    w.u8(m.colocated as u8).u32(m.num_workers).u32(m.num_servers);
    w.i32(m.local_rank).i32(m.local_size).str(&m.rack).u8(m.sum_order.to_u8());
    let (mode, bound) = m.training.to_wire();
    w.u8(mode).u32(bound);
    match &m.elastic {
        None => {
            w.u8(0);
        }
        Some(e) => {
            w.u8(1).u32(e.min_workers).u32(e.max_workers).u32(e.initial).i32(e.prev_rank);
        }
    }
}

fn put_welcome(w: &mut Writer, m: &Welcome) {
    w.u32(m.rank).u32(m.num_workers).u32(m.partition_bytes);
    w.u32(m.heartbeat_ms).u32(m.stall_ms).u32(m.peer_timeout_ms);
    w.u32(m.servers.len() as u32);
    for s in &m.servers {
        put_server(w, s);
    }
    w.u32(m.worker_hosts.len() as u32);
    for h in &m.worker_hosts {
        w.str(h);
    }
    w.u32(m.worker_local_ranks.len() as u32);
    for &l in &m.worker_local_ranks {
        w.u32(l);
    }
    w.u64(m.job_id).u8(m.host_reduce as u8).u8(m.failover as u8).u8(m.late as u8);
    w.u32(m.racks.len() as u32);
    for r in &m.racks {
        w.str(r);
    }
    w.u32(m.worker_racks.len() as u32);
    for &r in &m.worker_racks {
        w.u32(r);
    }
    w.u8(m.rack_reduce as u8);
}

fn get_register(r: &mut Reader) -> Result<Register, ProtocolError> {
    let role = Role::from_u8(r.u8("role")?)?;
    let requested_rank = r.i32("requested_rank")?;
    let hostname = r.str("hostname")?;
    let addr = r.str("addr")?;
    let n = r.count("ports", 2)?;
    let ports = (0..n).map(|_| r.u16("port")).collect::<Result<_, _>>()?;
    let colocated = r.u8("colocated")? != 0;
    let num_workers = r.u32("num_workers")?;
    let num_servers = r.u32("num_servers")?;
    let local_rank = r.i32("local_rank")?;
    let local_size = r.i32("local_size")?;
    let rack = r.str("rack")?;
    let order = r.u8("sum_order")?;
    let sum_order =
        SumOrder::from_u8(order).ok_or_else(|| ProtocolError::BadPayload(format!("unknown sum order {order}")))?;
    let (mode, bound) = (r.u8("training mode")?, r.u32("staleness")?);
    let training = crate::training::Training::from_wire(mode, bound)
        .ok_or_else(|| ProtocolError::BadPayload(format!("unknown training mode {mode}")))?;
    let elastic = match r.u8("elastic")? {
        0 => None,
        1 => Some(ElasticReg {
            min_workers: r.u32("min_workers")?,
            max_workers: r.u32("max_workers")?,
            initial: r.u32("initial")?,
            prev_rank: r.i32("prev_rank")?,
        }),
        other => return Err(ProtocolError::BadPayload(format!("elastic flag {other}"))),
    };
    Ok(Register {
        role,
        requested_rank,
        hostname,
        addr,
        ports,
        colocated,
        num_workers,
        num_servers,
        local_rank,
        local_size,
        rack,
        sum_order,
        training,
        elastic,
    })
}

fn get_welcome(r: &mut Reader) -> Result<Welcome, ProtocolError> {
    let rank = r.u32("rank")?;
    let num_workers = r.u32("num_workers")?;
    let partition_bytes = r.u32("partition_bytes")?;
    let heartbeat_ms = r.u32("heartbeat_ms")?;
    let stall_ms = r.u32("stall_ms")?;
    let peer_timeout_ms = r.u32("peer_timeout_ms")?;
    let ns = r.count("servers", 21)?;
    let mut servers = Vec::with_capacity(ns);
    for _ in 0..ns {
        servers.push(get_server(r)?);
    }
    let nw = r.count("worker_hosts", 4)?;
    let worker_hosts: Vec<String> = (0..nw).map(|_| r.str("worker host")).collect::<Result<_, _>>()?;
    let nl = r.count("worker_local_ranks", 4)?;
    let worker_local_ranks: Vec<u32> = (0..nl).map(|_| r.u32("local rank")).collect::<Result<_, _>>()?;
    if nl != nw {
        return Err(ProtocolError::BadPayload(format!("{nl} local ranks for {nw} workers")));
    }
    let job_id = r.u64("job_id")?;
    let host_reduce = r.u8("host_reduce")? != 0;
    let failover = r.u8("failover")? != 0;
    let late = r.u8("late")? != 0;
    let nr = r.count("racks", 4)?;
    let racks: Vec<String> = (0..nr).map(|_| r.str("rack")).collect::<Result<_, _>>()?;
    let nwr = r.count("worker_racks", 4)?;
    let worker_racks: Vec<u32> = (0..nwr).map(|_| r.u32("worker rack")).collect::<Result<_, _>>()?;
    let rack_reduce = r.u8("rack_reduce")? != 0;
    if nwr != nw || worker_racks.iter().any(|&x| x as usize >= nr.max(1)) {
        return Err(ProtocolError::BadPayload(format!("{nwr} worker racks for {nw} workers in {nr} racks")));
    }
    if servers.iter().any(|s| s.rack as usize >= nr.max(1)) {
        return Err(ProtocolError::BadPayload(format!("a server's rack is not one of the {nr} racks")));
    }
    Ok(Welcome {
        rank,
        num_workers,
        partition_bytes,
        heartbeat_ms,
        stall_ms,
        peer_timeout_ms,
        servers,
        worker_hosts,
        worker_local_ranks,
        job_id,
        host_reduce,
        failover,
        late,
        racks,
        worker_racks,
        rack_reduce,
    })
}

impl Control {
    /// Encode into header bytes followed by the payload, ready to write.
    pub fn encode(&self, namespace: u32) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            Control::Register(m) => put_register(&mut w, m),
            Control::Welcome(m) => put_welcome(&mut w, m),
            Control::Rejoin(m) => {
                put_register(&mut w, &m.register);
                put_welcome(&mut w, &m.welcome);
                put_specs(&mut w, &m.specs);
                for list in [&m.keys, &m.left, &m.lost] {
                    w.u32(list.len() as u32);
                    for &k in list {
                        w.u32(k);
                    }
                }
                w.u32(m.barriers).u64(m.received);
            }
            Control::Declare { req, entries } => {
                w.u32(*req).u32(entries.len() as u32);
                for e in entries {
                    w.str(&e.name).u64(e.numel).u8(e.dtype as u8).u32(e.partition);
                    put_ranks(&mut w, &e.members);
                    w.u8(e.sharded as u8);
                }
            }
            Control::Declared { req, specs } => {
                w.u32(*req);
                put_specs(&mut w, specs);
            }
            Control::DeclareError { req, message } => {
                w.u32(*req).str(message);
            }
            Control::Heartbeat
            | Control::Goodbye
            | Control::Shutdown
            | Control::StatusRequest
            | Control::Join
            | Control::HostsUpdated => {}
            Control::Joined { rank } => {
                w.u32(*rank);
            }
            Control::JoinDone { last } => {
                w.u32(*last);
            }
            Control::Ack { received } | Control::Resumed { received } => {
                w.u64(*received);
            }
            Control::JoinOp { name, numel, dtype, flags, round, release_after } => {
                w.str(name).u64(*numel).u8(*dtype as u8).u16(*flags).u32(*round).u8(*release_after as u8);
            }
            Control::ServiceJoin(j) => {
                w.str(&j.hostname).str(&j.addr).u32(j.threads).u8(j.colocated as u8);
            }
            Control::ServiceStart { job, namespace, start, rank } => {
                w.str(job).u32(*namespace).u64(*start).u32(*rank);
            }
            Control::ServiceStats { jobs } => {
                w.u32(jobs.len() as u32);
                for j in jobs {
                    w.str(&j.job).u64(j.start).u64(j.bytes).u64(j.rounds).str(&j.error);
                }
            }
            Control::StatusReply { json } => {
                w.str(json);
            }
            Control::PeerLost { role, rank, reason } => {
                w.u8(role.to_u8()).u32(*rank).str(reason);
            }
            Control::Barrier { id } | Control::BarrierDone { id } => {
                w.u32(*id);
            }
            Control::PeerLeft { rank } => {
                w.u32(*rank);
            }
            Control::Unreachable { server, reason } => {
                w.u32(*server).str(reason);
            }
            Control::ServerDeclare { batch, specs } => {
                w.u32(*batch);
                put_specs(&mut w, specs);
            }
            Control::ServerDeclareAck { batch } => {
                w.u32(*batch);
            }
            Control::Release { keys } | Control::ServerRelease { keys } => {
                w.u32(keys.len() as u32);
                for &k in keys {
                    w.u32(k);
                }
            }
            Control::ServerTakeOver { batch, lost, specs } => {
                w.u32(*batch).u32(*lost);
                put_specs(&mut w, specs);
            }
            Control::Failover { batch, lost, reason, specs } => {
                w.u32(*batch).u32(*lost).str(reason);
                put_specs(&mut w, specs);
            }
            Control::ServerJoined { server } => put_server(&mut w, server),
            Control::ServerMove { batch, specs } => {
                w.u32(*batch);
                put_specs(&mut w, specs);
            }
            Control::ServerMoveAck { batch, kept } => {
                w.u32(*batch).u32(kept.len() as u32);
                for &(k, c) in kept {
                    w.u32(k).u32(c);
                }
            }
            Control::DeclareStall { name, missing, waited_ms } => {
                w.str(name).u64(*waited_ms).u32(missing.len() as u32);
                for &m in missing {
                    w.u32(m);
                }
            }
            Control::Error { message } => {
                w.buf.extend_from_slice(message.as_bytes());
            }
        }
        let mut h = Header::new(self.msg_type());
        h.namespace = namespace;
        h.payload_len = w.buf.len() as u32;
        crate::protocol::encode_frame(&h, &w.buf)
    }

    pub fn decode(h: &Header, payload: &[u8]) -> Result<Control, ProtocolError> {
        let mut r = Reader::new(payload);
        let msg = match h.msg_type {
            MsgType::Register => Control::Register(get_register(&mut r)?),
            MsgType::Welcome => Control::Welcome(get_welcome(&mut r)?),
            MsgType::Rejoin => {
                let register = get_register(&mut r)?;
                let welcome = get_welcome(&mut r)?;
                let specs = get_specs(&mut r)?;
                let mut lists = [Vec::new(), Vec::new(), Vec::new()];
                for (list, what) in lists.iter_mut().zip(["keys", "left", "lost"]) {
                    let n = r.count(what, 4)?;
                    *list = (0..n).map(|_| r.u32(what)).collect::<Result<_, _>>()?;
                }
                let [keys, left, lost] = lists;
                let barriers = r.u32("barriers")?;
                let received = r.u64("received")?;
                Control::Rejoin(Box::new(Rejoin { register, welcome, specs, keys, left, lost, barriers, received }))
            }
            MsgType::Declare => {
                let req = r.u32("req")?;
                let n = r.count("entries", 17)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    let name = r.str("name")?;
                    let numel = r.u64("numel")?;
                    let dtype = get_dtype(&mut r)?;
                    let partition = r.u32("partition")?;
                    let members = get_ranks(&mut r, "members")?;
                    let sharded = match r.u8("sharded")? {
                        0 => false,
                        1 => true,
                        v => return Err(ProtocolError::BadPayload(format!("declaration '{name}': sharded {v}"))),
                    };
                    entries.push(DeclEntry { name, numel, dtype, partition, members, sharded });
                }
                Control::Declare { req, entries }
            }
            MsgType::Declared => {
                let req = r.u32("req")?;
                Control::Declared { req, specs: get_specs(&mut r)? }
            }
            MsgType::DeclareError => {
                let req = r.u32("req")?;
                Control::DeclareError { req, message: r.str("message")? }
            }
            MsgType::Heartbeat => Control::Heartbeat,
            MsgType::Ack => Control::Ack { received: r.u64("received")? },
            MsgType::Resumed => Control::Resumed { received: r.u64("received")? },
            MsgType::Goodbye => Control::Goodbye,
            MsgType::Shutdown => Control::Shutdown,
            MsgType::HostsUpdated => Control::HostsUpdated,
            MsgType::PeerLost => {
                let role = Role::from_u8(r.u8("role")?)?;
                let rank = r.u32("rank")?;
                Control::PeerLost { role, rank, reason: r.str("reason")? }
            }
            MsgType::Barrier => Control::Barrier { id: r.u32("id")? },
            MsgType::PeerLeft => Control::PeerLeft { rank: r.u32("rank")? },
            MsgType::Unreachable => {
                let server = r.u32("server")?;
                Control::Unreachable { server, reason: r.str("reason")? }
            }
            MsgType::BarrierDone => Control::BarrierDone { id: r.u32("id")? },
            MsgType::ServerDeclare => {
                let batch = r.u32("batch")?;
                Control::ServerDeclare { batch, specs: get_specs(&mut r)? }
            }
            MsgType::ServerDeclareAck => Control::ServerDeclareAck { batch: r.u32("batch")? },
            MsgType::DeclareStall => {
                let name = r.str("name")?;
                let waited_ms = r.u64("waited_ms")?;
                let n = r.count("missing", 4)?;
                let missing = (0..n).map(|_| r.u32("rank")).collect::<Result<_, _>>()?;
                Control::DeclareStall { name, missing, waited_ms }
            }
            MsgType::Release | MsgType::ServerRelease => {
                let n = r.count("keys", 4)?;
                let keys = (0..n).map(|_| r.u32("key")).collect::<Result<_, _>>()?;
                match h.msg_type {
                    MsgType::Release => Control::Release { keys },
                    _ => Control::ServerRelease { keys },
                }
            }
            MsgType::ServerTakeOver => {
                let batch = r.u32("batch")?;
                let lost = r.u32("lost")?;
                Control::ServerTakeOver { batch, lost, specs: get_specs(&mut r)? }
            }
            MsgType::Failover => {
                let batch = r.u32("batch")?;
                let lost = r.u32("lost")?;
                let reason = r.str("reason")?;
                Control::Failover { batch, lost, reason, specs: get_specs(&mut r)? }
            }
            MsgType::ServerJoined => Control::ServerJoined { server: get_server(&mut r)? },
            MsgType::ServerMove => {
                let batch = r.u32("batch")?;
                Control::ServerMove { batch, specs: get_specs(&mut r)? }
            }
            MsgType::ServerMoveAck => {
                let batch = r.u32("batch")?;
                let n = r.count("kept", 8)?;
                let kept =
                    (0..n).map(|_| Ok((r.u32("key")?, r.u32("chunk")?))).collect::<Result<_, ProtocolError>>()?;
                Control::ServerMoveAck { batch, kept }
            }
            MsgType::ServiceJoin => {
                let hostname = r.str("hostname")?;
                let addr = r.str("addr")?;
                let threads = r.u32("threads")?;
                let colocated = r.u8("colocated")? != 0;
                Control::ServiceJoin(ServiceJoin { hostname, addr, threads, colocated })
            }
            MsgType::ServiceStart => {
                let job = r.str("job")?;
                let namespace = r.u32("namespace")?;
                let start = r.u64("start")?;
                Control::ServiceStart { job, namespace, start, rank: r.u32("rank")? }
            }
            MsgType::ServiceStats => {
                let n = r.count("jobs", 20)?;
                let mut jobs = Vec::with_capacity(n);
                for _ in 0..n {
                    let job = r.str("job")?;
                    let start = r.u64("start")?;
                    let bytes = r.u64("bytes")?;
                    let rounds = r.u64("rounds")?;
                    jobs.push(JobTraffic { job, start, bytes, rounds, error: r.str("error")? });
                }
                Control::ServiceStats { jobs }
            }
            MsgType::StatusRequest => Control::StatusRequest,
            MsgType::Join => Control::Join,
            MsgType::Joined => Control::Joined { rank: r.u32("rank")? },
            MsgType::JoinDone => Control::JoinDone { last: r.u32("last")? },
            MsgType::JoinOp => {
                let name = r.str("name")?;
                let numel = r.u64("numel")?;
                let dtype = get_dtype(&mut r)?;
                let flags = r.u16("flags")?;
                let round = r.u32("round")?;
                Control::JoinOp { name, numel, dtype, flags, round, release_after: r.u8("release_after")? != 0 }
            }
            MsgType::StatusReply => Control::StatusReply { json: r.str("json")? },
            MsgType::Error => return Ok(Control::Error { message: String::from_utf8_lossy(payload).into_owned() }),
            other => return Err(ProtocolError::UnexpectedType(format!("{other:?} on the control connection"))),
        };
        r.finish(match h.msg_type {
            MsgType::Register => "Register",
            MsgType::Welcome => "Welcome",
            _ => "control message",
        })?;
        Ok(msg)
    }
}
