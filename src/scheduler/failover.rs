//! Failover: when a summation server is lost (disconnected, or silent for
//! the peer timeout), its chunks move to the servers left and the job goes
//! on with exactly the sums it would have had.
//!
//! The scheduler places the lost server's chunks again (same weights, its
//! slots out), has every remaining server install them (`ServerTakeOver`,
//! acked), and only then tells the workers (`Failover`), so a re-sent push
//! never reaches a server that does not own its chunk yet. Declarations
//! are not answered meanwhile: their placement may still move. The rest —
//! which pushes to re-send, which results to restore — is the workers'
//! (`client::io`) and the servers' (`server::thread`) part.
//!
//! This module runs the moves (sends, waits for the acks, tells the
//! workers); which chunks move where, and the moves under way, are
//! `moves`' (`Moves`, `TakeIn`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::member::Member;
use super::moves::TakeIn;
use super::reach::Blame;
use super::state::Shared;
use crate::protocol::{Control, NO_SERVER};

/// Worker `worker` cannot reach live server `server` (`why`): half the peer
/// timeout later (time for the worker's other links to give up too, if its
/// own network failed), the server is written off, or the worker, if it
/// alone reported several servers (`reach`), fails the job as one cut off.
pub(super) fn unreachable(shared: &Shared, worker: &Member, server: u32, why: String) {
    let window = Duration::from_millis(shared.cfg.peer_timeout_ms as u64 / 2);
    std::thread::sleep(window);
    let mut st = shared.lock();
    if st.is_over() {
        return;
    }
    match st.reach.blame(worker.rank, Instant::now(), window) {
        Blame::Worker { servers } => {
            let list: Vec<String> = servers.iter().map(u32::to_string).collect();
            let reason = format!(
                "worker {} cannot reach servers {}, which no other worker reported: it is the one cut off ({why})",
                worker.rank,
                list.join(", ")
            );
            worker.send(&Control::Error { message: reason.clone() }, shared.cfg.namespace);
            shared.fail(&mut st, Some(worker), reason);
        }
        Blame::Server => {
            let Some(lost) = st.members.servers().find(|m| m.rank == server).cloned() else { return };
            drop(st);
            take_over(shared, &lost, why);
        }
    }
}

/// Server `lost` is gone for `reason`: move its chunks, or fail the job if
/// failover is off or no server is left.
pub(super) fn take_over(shared: &Shared, lost: &Member, reason: String) {
    let ns = shared.cfg.namespace;
    let (batch, specs) = {
        let mut guard = shared.lock();
        let st = &mut *guard;
        // Over, or written off already (two reports of one unreachable server).
        if st.is_over() || !st.members.servers().any(|m| m.rank == lost.rank) {
            return;
        }
        let others: Vec<Arc<Member>> = st.members.servers().filter(|m| m.rank != lost.rank).cloned().collect();
        let on = st.members.welcome().is_some_and(|w| w.failover);
        if !on || others.is_empty() {
            let why = match st.members.welcome().is_some_and(|w| w.rack_reduce) {
                true => " (failover is off with two-level reduction across racks)",
                false if on => " (no server is left to take its chunks over)",
                false => "",
            };
            shared.fail(st, Some(lost), format!("{reason}{why}"));
            return;
        }
        st.members.remove_server(lost.rank);
        let specs = st.moves.begin_take_over(lost.rank, &mut st.decls);
        let batch = st.installs.next_batch();
        log::warn!(
            target: "scheduler",
            "{reason}: moving its chunks of {} tensor(s) to server(s) {:?}; training goes on",
            specs.len(),
            { let mut r: Vec<u32> = others.iter().map(|m| m.rank).collect(); r.sort_unstable(); r }
        );
        // Sent under the lock: every server installs takeovers in batch
        // order (two servers lost at once place some chunks twice).
        let msg = Control::ServerTakeOver { batch, lost: lost.rank, specs: specs.clone() };
        for s in &others {
            s.send(&msg, ns);
        }
        shared.cv.notify_all(); // a wait for another takeover's installs no longer waits for this server
        (batch, specs)
    };
    // A lost server that comes back to life (it was stopped, not killed)
    // finds why and a closed connection, and exits; its workers drop theirs.
    let why = format!("{reason}: this server is out of the job, the others took its chunks over");
    lost.send(&Control::Error { message: why }, ns);
    lost.disconnect();
    let mut st = shared.wait_installed(batch);
    st.moves.end_take_over();
    if st.failed().is_some() {
        return;
    }
    // With two takeovers at once, their Failovers may reach the workers in
    // either order: the batch tells them which placement is the later one.
    let msg = Control::Failover { batch, lost: lost.rank, reason: reason.clone(), specs };
    for m in st.members.staying_workers() {
        m.send(&msg, ns);
    }
    crate::metrics::count(&crate::metrics::FAILOVERS);
    log::info!(target: "scheduler", "server {} taken over; the workers re-send what it had not returned", lost.rank);
    st.answer_ready(ns);
}

/// Move chunks to server `new` (just admitted: `Moves::admit_late`) until
/// it carries its share: the servers that own them give them up first
/// (`ServerMove`; one with server-side optimizer state is kept where it
/// is, since its state would not move with it), then `new` installs them
/// as taken over, then the workers re-send what the old owners had not
/// answered and restore the results they hold (`Failover` with
/// `NO_SERVER`), exactly as when a server is lost. A round is summed
/// entirely at one server: whoever got its result from the old owner
/// restores it at the new one.
pub(super) fn take_in(shared: &Shared, new: &Member) {
    let ns = shared.cfg.namespace;
    let (batch, plan) = {
        let mut guard = shared.lock();
        let st = &mut *guard;
        let planned = if st.is_over() { None } else { TakeIn::plan(&mut st.decls, new.rank) };
        let Some((plan, moved)) = planned else { return st.moves.end_take_in() };
        let batch = st.installs.next_batch();
        let msg = Control::ServerMove { batch, specs: moved };
        for s in st.members.servers() {
            s.send(&msg, ns);
        }
        (batch, plan)
    };
    let mut guard = shared.wait_installed(batch);
    let kept = guard.installs.take_kept(batch);
    if guard.failed().is_some() {
        return guard.moves.end_take_in();
    }
    let st = &mut *guard;
    let (specs, chunks) = plan.finish(&mut st.decls, &kept);
    let batch = st.installs.next_batch();
    let msg = Control::ServerTakeOver { batch, lost: NO_SERVER, specs: specs.clone() };
    for s in st.members.servers() {
        s.send(&msg, ns);
    }
    drop(guard);
    let mut st = shared.wait_installed(batch);
    st.moves.end_take_in();
    if st.failed().is_some() {
        return;
    }
    let reason = format!("server {} joined the job", new.rank);
    let msg = Control::Failover { batch, lost: NO_SERVER, reason, specs };
    for m in st.members.staying_workers() {
        m.send(&msg, ns);
    }
    let shares = match st.decls.placer() {
        Some(p) => p.describe_shares(&st.moves.live_servers(st.members.server_infos())),
        None => String::new(),
    };
    log::info!(
        target: "scheduler",
        "server {} took over {chunks} chunk(s) ({} kept where they are: server-side optimizer state); \
         summation shares per server: {shares}",
        new.rank,
        kept.len()
    );
    st.answer_ready(ns);
}
