//! One job's life (`Job`: its heartbeats, its registration deadline, its
//! end) and each member's connection to it: the handshake, the
//! registration, then the member's messages, dispatched to the state's
//! operations (`state`, `failover`).

use std::net::{SocketAddr, TcpStream};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use super::config::SchedulerError;
use super::failover;
use super::member::{Comeback, Member, Reader, Writer};
use super::membership::{check_registration, lost_reason};
use super::state::Shared;
use crate::protocol::auth::{self, Secret};
use crate::protocol::{read_control, read_control_limited, Control, ReadError, Role, MAX_REGISTER_PAYLOAD};
use crate::transport::{DeadlineReader, SealedReader, SealedWriter};

/// One job's life: its heartbeats, its registration deadline, its end.
pub(super) struct Job {
    shared: Arc<Shared>,
    started: Instant,
    heartbeats: thread::JoinHandle<()>,
    /// Dropped at the job's end: wakes the heartbeat thread at once, so
    /// the end does not wait out a heartbeat period.
    stop_heartbeats: mpsc::Sender<()>,
}

impl Job {
    pub fn start(shared: Arc<Shared>) -> Job {
        let (stop_heartbeats, stopped) = mpsc::channel();
        let heartbeats = {
            let shared = shared.clone();
            thread::spawn(move || heartbeat_loop(shared, stopped))
        };
        Job { shared, started: Instant::now(), heartbeats, stop_heartbeats }
    }

    /// Whether the job ended (finished or failed); fails it when not every
    /// member registered within the join timeout.
    pub fn over(&self) -> bool {
        let shared = &self.shared;
        let mut st = shared.lock();
        if st.is_over() {
            return true;
        }
        let join_timeout = Duration::from_millis(shared.cfg.join_timeout_ms as u64);
        if let Some(rb) = st.members.rebuilding() {
            let within = Duration::from_millis(shared.cfg.peer_timeout_ms as u64);
            if rb.since.elapsed() > within {
                let msg = format!(
                    "the scheduler restarted and {} did not rejoin within {:.1}s (the peer timeout)",
                    rb.describe_missing(),
                    within.as_secs_f64()
                );
                shared.fail(&mut st, None, msg);
                return true;
            }
        }
        if !st.members.welcomed() && self.started.elapsed() > join_timeout {
            let n = st.members.registered();
            let msg = format!(
                "only {n} of {} members registered within {:.1}s",
                shared.cfg.num_workers as u64 + shared.cfg.num_servers as u64,
                join_timeout.as_secs_f64()
            );
            shared.fail_registration(&mut st, msg);
            return true;
        }
        false
    }

    /// After `over`: how the job ended. Every member still connected is
    /// then cut off, so no thread of the job outlives it.
    pub fn conclude(self) -> Result<(), SchedulerError> {
        drop(self.stop_heartbeats);
        let _ = self.heartbeats.join();
        // Give member threads a moment to flush final messages.
        thread::sleep(Duration::from_millis(200));
        let mut st = self.shared.lock();
        st.members.disconnect_all();
        match st.failed() {
            Some(reason) => Err(SchedulerError::JobFailed(reason.to_string())),
            None => {
                log::info!(target: "scheduler", "all workers finished; job complete");
                Ok(())
            }
        }
    }
}

fn heartbeat_loop(shared: Arc<Shared>, stopped: mpsc::Receiver<()>) {
    let period = Duration::from_millis(shared.cfg.heartbeat_ms.max(10) as u64);
    loop {
        let members = {
            let st = shared.lock();
            if st.is_over() {
                return;
            }
            st.members.all().to_vec()
        };
        for m in members {
            m.send(&m.ack(), shared.cfg.namespace);
        }
        shared.report_declaration_stalls();
        shared.free_on_servers(&mut shared.lock());
        if !matches!(stopped.recv_timeout(period), Err(mpsc::RecvTimeoutError::Timeout)) {
            return;
        }
    }
}

/// A new connection, authenticated: the job it announced, its first
/// message, and the connection's halves.
pub(super) struct Greeting {
    pub job: String,
    pub first: Result<Control, crate::protocol::ReadError>,
    pub reader: Reader,
    pub writer: Writer,
}

/// A new connection's handshake and first message, or None, logged, if it
/// failed. Before it has registered, a peer gets a small frame and the peer
/// timeout for the handshake and that message together, so a stranger can
/// hold neither memory nor a thread.
pub(super) fn greet(
    stream: TcpStream,
    peer: SocketAddr,
    keys: &impl Fn(&str) -> Secret,
    timeout: Duration,
    namespace_of: impl Fn(&str) -> u32,
) -> Option<Greeting> {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(timeout));
    let mut within = DeadlineReader::new(&stream, timeout);
    let (job, keys) = match auth::listen_blocking(&mut within, &mut &stream, keys) {
        Ok(done) => done,
        Err(e) => {
            log::warn!(target: "scheduler", "rejecting {peer}: {e}");
            return None;
        }
    };
    let (seal, open) = keys.map(|k| (k.seal, k.open)).unzip();
    let mut within = SealedReader::new(within, open).limit(MAX_REGISTER_PAYLOAD);
    let first = read_control_limited(&mut within, namespace_of(&job), MAX_REGISTER_PAYLOAD);
    let open = within.into_parts().1;
    let _ = stream.set_read_timeout(Some(timeout));
    let reader = match stream.try_clone() {
        Ok(s) => SealedReader::new(s, open),
        Err(e) => {
            log::warn!(target: "scheduler", "rejecting {peer}: cannot clone its socket: {e}");
            return None;
        }
    };
    Some(Greeting { job, first, reader, writer: Writer::new(SealedWriter::new(stream, seal)) })
}

/// A member's first message: a registration, or a rejoin of a scheduler
/// that restarted.
pub(super) enum Arrival {
    Register(crate::protocol::Register),
    Rejoin(Box<crate::protocol::Rejoin>),
}

/// A Register or a Rejoin, which a member's first message must be (else
/// it is told why).
pub(super) fn expect_arrival(
    writer: &Writer,
    peer: SocketAddr,
    first: Result<Control, crate::protocol::ReadError>,
    ns: u32,
) -> Option<Arrival> {
    match first {
        Ok(Control::Register(r)) => Some(Arrival::Register(r)),
        Ok(Control::Rejoin(r)) => Some(Arrival::Rejoin(r)),
        Ok(other) => {
            let message = format!("expected Register, got {:?}", other.msg_type());
            log::warn!(target: "scheduler", "rejecting {peer}: {message}");
            writer.send(&Control::Error { message }, ns);
            None
        }
        Err(e) => {
            log::warn!(target: "scheduler", "rejecting {peer}: bad registration: {e}");
            writer.send(&Control::Error { message: format!("bad registration: {e}") }, ns);
            None
        }
    }
}

/// A registration's checks (refused: told why).
fn checked(shared: &Shared, reg: &crate::protocol::Register, who: &str, writer: &Writer, peer: SocketAddr) -> bool {
    if let Err(why) = check_registration(&shared.cfg, reg) {
        log::warn!(target: "scheduler", "rejecting {who} at {peer}: {why}");
        writer.send(&Control::Error { message: why.to_string() }, shared.cfg.namespace);
        return false;
    }
    true
}

/// Check a rejoin and take the member back into the rebuilt job.
pub(super) fn admit_rejoin(
    shared: &Arc<Shared>,
    rj: crate::protocol::Rejoin,
    (reader, writer): (Reader, Writer),
    peer: SocketAddr,
) -> Option<(Arc<Member>, Reader)> {
    let ns = shared.cfg.namespace;
    let who = format!("{} {}", rj.register.role.name(), rj.welcome.rank);
    if !checked(shared, &rj.register, &who, &writer, peer) {
        return None;
    }
    let live = {
        let st = shared.lock();
        st.members.resumable(&rj).filter(|_| !st.is_over())
    };
    if let Some(me) = live {
        // Its connection broke while this scheduler lived: its own thread
        // takes the new one and resumes the session.
        log::info!(target: "scheduler", "{} dialled again from {peer}: resuming its session", me.describe());
        me.offer(Comeback { reader, writer, received: rj.received });
        return None;
    }
    match shared.rejoin(rj, peer, writer.clone()) {
        Ok((me, None)) => Some((me, reader)),
        Ok((me, Some((batch, specs)))) => {
            // Declared while the job was rebuilt, placed once it is: this
            // thread goes on to serve the member (a server's acks).
            let sh = shared.clone();
            let spawned = thread::Builder::new().name("gradhub-install".into()).spawn(move || sh.install(batch, specs));
            if let Err(e) = spawned {
                let mut st = shared.lock();
                shared.fail(&mut st, None, format!("cannot start installing the tensors declared meanwhile: {e}"));
            }
            Some((me, reader))
        }
        Err(why) => {
            log::warn!(target: "scheduler", "rejecting {who} at {peer}: {why}");
            writer.send(&Control::Error { message: why.to_string() }, ns);
            None
        }
    }
}

/// Check a registration and join the job with it (blocks until everyone has).
pub(super) fn admit(
    shared: &Arc<Shared>,
    reg: crate::protocol::Register,
    (reader, writer): (Reader, Writer),
    peer: SocketAddr,
) -> Option<(Arc<Member>, Reader)> {
    let ns = shared.cfg.namespace;
    if !checked(shared, &reg, reg.role.name(), &writer, peer) {
        return None;
    }
    let me = match shared.join(reg, peer, writer.clone()) {
        Ok((m, false)) => m,
        Ok((m, true)) => {
            // Joined the running job: move chunks to it, on a thread of its
            // own (this one reads the acks it waits for).
            let (sh, new) = (shared.clone(), m.clone());
            let moved =
                thread::Builder::new().name("gradhub-take-in".into()).spawn(move || failover::take_in(&sh, &new));
            if let Err(e) = moved {
                let mut st = shared.lock();
                shared.fail(&mut st, None, format!("cannot start moving chunks to {}: {e}", m.describe()));
            }
            m
        }
        Err(why) => {
            writer.send(&Control::Error { message: why.to_string() }, ns);
            return None;
        }
    };
    Some((me, reader))
}

pub(super) fn serve_member(shared: &Arc<Shared>, me: &Arc<Member>, mut stream: Reader) {
    let ns = shared.cfg.namespace;
    let within = Duration::from_millis(shared.cfg.peer_timeout_ms as u64);
    let keep_alive = crate::session::keep_alive(within);
    let _ = stream.get_ref().set_read_timeout(Some(keep_alive));
    loop {
        let msg = read_control(&mut stream, ns);
        if let Ok(m) = &msg {
            me.heard(m);
        }
        let mut st = shared.lock();
        let done = st.is_over();
        let gone = me.role == Role::Worker && st.members.has_left(me.rank);
        match msg {
            // A job that is over keeps no member (a shared service frees it).
            Ok(Control::Heartbeat | Control::Ack { .. }) if done => return,
            Ok(Control::Heartbeat | Control::Ack { .. }) => {}
            Ok(Control::Declare { req, entries }) if me.role == Role::Worker => {
                let batch = shared.declare(&mut st, me.rank, req, entries);
                drop(st);
                if let Some((batch, specs)) = batch {
                    shared.install(batch, specs);
                }
                continue;
            }
            Ok(Control::ServerDeclareAck { batch }) if me.role == Role::Server => {
                st.installs.ack(batch, me.rank);
                shared.cv.notify_all();
            }
            Ok(Control::ServerMoveAck { batch, kept }) if me.role == Role::Server => {
                st.installs.ack_move(batch, me.rank, kept);
                shared.cv.notify_all();
            }
            Ok(Control::Barrier { id }) if me.role == Role::Worker => shared.enter_barrier(&mut st, me.rank, id),
            Ok(Control::Unreachable { server, reason }) if me.role == Role::Worker => {
                // Judged a moment later (`reach`), on a thread of its own:
                // this one goes on reading the worker, whose acks and
                // heartbeats a takeover needs. A report of a server gone
                // already is moot.
                if !st.members.servers().any(|m| m.rank == server) {
                    continue;
                }
                st.reach.record(me.rank, server, Instant::now());
                drop(st);
                let why = format!("server {server} is unreachable from worker {}: {reason}", me.rank);
                log::warn!(target: "scheduler", "{why}");
                let (sh, worker) = (shared.clone(), me.clone());
                let spawned = thread::Builder::new()
                    .name("gradhub-unreachable".into())
                    .spawn(move || failover::unreachable(&sh, &worker, server, why));
                if let Err(e) = spawned {
                    let mut st = shared.lock();
                    shared.fail(&mut st, None, format!("cannot start judging server {server}'s report: {e}"));
                }
                continue;
            }
            Ok(Control::Join) if me.role == Role::Worker => shared.join_worker(&mut st, me.rank),
            Ok(op @ Control::JoinOp { .. }) if me.role == Role::Worker => shared.forward_join_op(&mut st, op),
            Ok(Control::Release { keys }) if me.role == Role::Worker => {
                if let Err(reason) = shared.release(&mut st, me.rank, keys) {
                    me.send(&Control::Error { message: reason.clone() }, ns);
                    shared.fail(&mut st, Some(me), reason);
                    return;
                }
            }
            Ok(Control::Goodbye) if me.role == Role::Worker => {
                shared.say_goodbye(&mut st, me.rank);
                // Nothing more for it: its session sees the end at once (see `SessionSender::close`).
                me.finish_writing();
            }
            Ok(Control::Error { message }) => {
                let reason = format!("{} reported an error: {message}", me.describe());
                shared.fail(&mut st, Some(me), reason);
                return;
            }
            Ok(other) => {
                let reason = format!("{} sent an unexpected {:?}", me.describe(), other.msg_type());
                me.send(&Control::Error { message: reason.clone() }, ns);
                shared.fail(&mut st, Some(me), reason);
                return;
            }
            Err(e) => {
                if done || gone {
                    return;
                }
                drop(st);
                // A connection that broke (not one the member closed) may
                // come back within the peer timeout since it was last
                // heard; one offered already is taken. One silent past the
                // keep-alive is shut (the member, if alive, dials again); a
                // member silent for the peer timeout is lost, as before.
                let silent = matches!(e, ReadError::TimedOut) && me.heard_at().elapsed() < within;
                let broke = silent || may_resume(&e, stream.get_ref());
                let until = match broke {
                    true => {
                        let what = match silent {
                            true => {
                                format!("nothing heard for {:.1}s; its connection is shut", keep_alive.as_secs_f64())
                            }
                            false => e.to_string(),
                        };
                        log::warn!(target: "scheduler", "{}: {what}; waiting for it to dial again", me.describe());
                        me.disconnect();
                        me.heard_at() + within
                    }
                    false => Instant::now(),
                };
                let mut reason = lost_reason(&shared.cfg, me, &e);
                if let Some(c) = me.wait_comeback(until) {
                    match me.resume(c, ns) {
                        Ok(reader) => {
                            log::warn!(target: "scheduler", "{}: the session resumed on a new connection", me.describe());
                            stream = reader;
                            let _ = stream.get_ref().set_read_timeout(Some(keep_alive));
                            continue;
                        }
                        Err(why) => reason = why,
                    }
                } else if broke {
                    reason = format!(
                        "{reason}, and it did not dial again within {:.1}s (the peer timeout)",
                        within.as_secs_f64()
                    );
                }
                let mut st = shared.lock();
                if st.is_over() || (me.role == Role::Worker && st.members.has_left(me.rank)) {
                    return;
                }
                if me.role == Role::Server && !st.members.servers().any(|m| m.rank == me.rank) {
                    return; // written off already (unreachable from a worker): its connection was cut
                }
                if me.role == Role::Server {
                    drop(st);
                    failover::take_over(shared, me, reason.clone());
                } else {
                    shared.fail(&mut st, Some(me), reason.clone());
                    drop(st);
                }
                // A new connection offered meanwhile is told it is out.
                me.refuse_comeback(&format!("{reason}: it is out of the job"), ns);
                return;
            }
        }
    }
}

/// Whether a failed read of `socket` may be the connection's fault rather
/// than the member's: reset, cut mid-frame, or a frame changed on the way.
/// A reset may read as a clean end (a heartbeat's write took its error):
/// the socket's state tells.
fn may_resume(e: &crate::protocol::ReadError, socket: &TcpStream) -> bool {
    use crate::protocol::ReadError;
    match e {
        ReadError::Io(_) | ReadError::ClosedMidFrame => true,
        ReadError::Protocol(p) => p.changed_on_the_way(),
        ReadError::Closed => crate::transport::ended_by_reset(socket),
        _ => false,
    }
}
