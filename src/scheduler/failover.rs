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

use std::sync::Arc;

use super::declarations::{answer_ready, place_again};
use super::state::{Member, Shared};
use crate::protocol::{Control, Role};

/// Server `lost` is gone for `reason`: move its chunks, or fail the job if
/// failover is off or no server is left.
pub(super) fn take_over(shared: &Shared, lost: &Member, reason: String) {
    let ns = shared.cfg.namespace;
    let (batch, specs) = {
        let mut st = shared.lock();
        if st.finished || st.failed.is_some() {
            return;
        }
        let others: Vec<Arc<Member>> =
            st.members.iter().filter(|m| m.role == Role::Server && m.rank != lost.rank).cloned().collect();
        if !shared.cfg.failover || shared.cfg.num_servers < 2 || others.is_empty() {
            let on = shared.cfg.failover && shared.cfg.num_servers > 1;
            let why = if on { " (no server is left to take its chunks over)" } else { "" };
            shared.fail(&mut st, Some(lost), format!("{reason}{why}"));
            return;
        }
        st.members.retain(|m| !(m.role == Role::Server && m.rank == lost.rank));
        st.lost_servers.push(lost.rank);
        st.failing_over += 1;
        let gone = st.placer.as_mut().map(|p| p.remove_server(lost.rank)).unwrap_or_default();
        let specs = place_again(&mut st, &gone);
        let batch = st.next_batch;
        st.next_batch += 1;
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
    st.failing_over -= 1;
    if st.failed.is_some() {
        return;
    }
    // With two takeovers at once, their Failovers may reach the workers in
    // either order: the batch tells them which placement is the later one.
    let msg = Control::Failover { batch, lost: lost.rank, reason: reason.clone(), specs };
    for m in st.members.iter().filter(|m| m.role == Role::Worker && !st.said_goodbye.contains(&m.rank)) {
        m.send(&msg, ns);
    }
    log::info!(target: "scheduler", "server {} taken over; the workers re-send what it had not returned", lost.rank);
    answer_ready(shared, &mut st);
}
