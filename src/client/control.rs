//! The control thread: the scheduler's messages to this worker, each handed
//! to the part of the client it concerns.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::shared::Shared;
use super::table::{join_op, Waiter};
use crate::protocol::Control;
use crate::session::Session;

/// Handle the scheduler's messages until the session ends.
pub(super) fn control_loop(shared: Arc<Shared>, mut session: Session) {
    loop {
        let msg = session.recv();
        if shared.closing.load(Ordering::Relaxed) {
            // `leave` closes the session, with a goodbye if the worker
            // finished: closing it here first would lose the goodbye.
            session.keep_open();
            return;
        }
        match msg {
            Ok(Control::Declared { req, mut specs }) => {
                if let Some(rack) = shared.rack {
                    for s in &mut specs {
                        s.slots = (0..s.num_chunks()).map(|c| s.slot_for(rack, c)).collect();
                    }
                }
                let waiter = shared.table().waiters.remove(&req);
                if waiter.is_none() && shared.knows(&specs) {
                    continue; // answered again: a request re-sent after its answer was lost
                }
                shared.on_declared(specs.clone());
                if let Some(Waiter::Sync(tx)) = waiter {
                    let _ = tx.send(Ok(specs));
                }
            }
            Ok(Control::DeclareError { req, message }) => shared.on_declare_error(req, message),
            Ok(Control::DeclareStall { name, missing, waited_ms }) => {
                let msg = format!(
                    "the scheduler reports tensor '{name}' has waited {:.1}s for worker rank(s) {missing:?} to push_pull or declare it",
                    waited_ms as f64 / 1000.0
                );
                if let Some(ops) = shared.table().parked.get(&name) {
                    for p in ops {
                        p.op.set_stall(msg.clone());
                    }
                }
            }
            Ok(Control::BarrierDone { id }) => {
                if let Some(tx) = shared.table().barriers.remove(&id) {
                    let _ = tx.send(Ok(()));
                }
            }
            Ok(Control::PeerLost { role, rank, reason }) => {
                shared.set_failure(format!("{} {rank} was lost: {reason}", role.name()));
                return;
            }
            Ok(Control::PeerLeft { rank }) => shared.on_peer_left(rank),
            Ok(Control::HostsUpdated) => shared.hosts_updated.store(true, Ordering::Release),
            Ok(Control::Joined { rank: _ }) => {
                // Announce what is in flight now; what starts later is
                // announced as it starts (see `push_pull`).
                let msgs: Vec<Control> = {
                    let mut t = shared.table();
                    t.peers_joined = true;
                    t.in_flight.iter().filter_map(|n| t.uses.get(n).map(|u| join_op(n, u))).collect()
                };
                for m in msgs {
                    if let Err(e) = shared.send_ctrl(&m) {
                        shared.set_failure(e.to_string());
                    }
                }
            }
            Ok(msg @ Control::JoinOp { .. }) => {
                // In join(), join() takes part (outside it: a late one, dropped).
                if let Some(tx) = shared.table().join_events.clone() {
                    let _ = tx.send(msg);
                }
            }
            Ok(Control::JoinDone { last }) => {
                let tx = {
                    let mut t = shared.table();
                    t.peers_joined = false;
                    t.join_events.clone()
                };
                if let Some(tx) = tx {
                    let _ = tx.send(Control::JoinDone { last });
                }
            }
            Ok(Control::Failover { batch, lost, reason, specs }) => shared.on_failover(batch, lost, reason, specs),
            Ok(Control::ServerJoined { server }) => {
                if let Err(e) = shared.on_server_joined(server) {
                    shared.fail_job(format!("worker {}: {e}", shared.io.rank()));
                }
            }
            Ok(Control::Error { message }) => {
                shared.set_failure(format!("scheduler: {message}"));
                return;
            }
            Ok(other) => {
                shared.set_failure(crate::session::unexpected(&other));
                return;
            }
            Err(e) => {
                shared.set_failure(e.to_string());
                return;
            }
        }
    }
}
