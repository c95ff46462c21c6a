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

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};

use super::declarations::{answer_ready, place_again, specs_in_use};
use super::membership::Refusal;
use super::state::{Member, Shared, State};
use crate::protocol::{Control, Register, Role, ServerInfo, TensorSpec, Welcome, MAX_JOINED_SLOTS, NO_SERVER};

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
        let on = st.welcome.as_ref().is_some_and(|w| w.failover);
        if !on || others.is_empty() {
            let why = match st.welcome.as_ref().is_some_and(|w| w.rack_reduce) {
                true => " (failover is off with two-level reduction across racks)",
                false if on => " (no server is left to take its chunks over)",
                false => "",
            };
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

/// A server registered while the job runs (state lock held): welcome it
/// (`late`: no worker shares memory with it), add its threads to the
/// placement and tell every member where it is, before any declaration
/// can be placed on it. `take_in` then moves chunks to it.
pub(super) fn admit_late(
    shared: &Shared,
    st: &mut State,
    reg: Register,
    peer: SocketAddr,
    stream: TcpStream,
) -> Result<Arc<Member>, Refusal> {
    let cfg = &shared.cfg;
    if let Some(f) = &st.failed {
        return Err(Refusal::JobFailed(f.clone()));
    }
    if st.finished {
        return Err(Refusal::Late("the job has finished".into()));
    }
    let racks = st.welcome.as_ref().is_some_and(|w| w.rack_reduce);
    if !cfg.failover || cfg.num_servers < 2 || racks {
        let why = match cfg.failover {
            false => "failover is off (GRADHUB_FAILOVER=0)",
            true if racks => "it reduces within racks first, which has no failover",
            true => "it started with one server, so its workers keep no results to re-send (start it with two or more)",
        };
        return Err(Refusal::Late(format!("this job cannot take a server while it runs: {why}")));
    }
    if st.taking_in || st.failing_over > 0 {
        return Err(Refusal::Late(
            "another server is joining the job or being taken over; try again in a moment".into(),
        ));
    }
    let (Some(template), Some(placer)) = (st.welcome.clone(), st.placer.as_mut()) else {
        return Err(Refusal::Internal("a running job without its cluster map"));
    };
    let initial: usize = template.servers.iter().map(|s| s.ports.len()).sum();
    if placer.num_slots() + reg.ports.len() > initial + MAX_JOINED_SLOTS {
        return Err(Refusal::Late(format!(
            "the job has taken {} server threads since it started and may take {MAX_JOINED_SLOTS} at most",
            placer.num_slots() - initial
        )));
    }
    let info = ServerInfo {
        rank: st.servers.len() as u32,
        addr: reg.addr,
        ports: reg.ports,
        colocated: reg.colocated,
        host: reg.hostname,
        rack: 0, // racks matter with two levels only, which has no failover
    };
    let member = Arc::new(Member { role: Role::Server, rank: info.rank, peer, writer: Mutex::new(stream) });
    let mut servers = st.servers.clone();
    servers.push(info.clone());
    let welcome = Welcome { rank: info.rank, servers, late: true, ..template };
    // Nothing changes unless it is welcomed: every member numbers slots alike.
    if !member.send(&Control::Welcome(welcome), cfg.namespace) {
        return Err(Refusal::Late("cannot send the welcome".into()));
    }
    placer.add_server(&info);
    st.servers.push(info.clone());
    // Before anything else can name its slots: workers connect to it,
    // servers learn where a replica on it would be.
    let joined = Control::ServerJoined { server: info.clone() };
    for m in st.members.iter().filter(|m| !(m.role == Role::Worker && st.said_goodbye.contains(&m.rank))) {
        m.send(&joined, cfg.namespace);
    }
    st.joined_at.insert(info.rank, st.next_batch);
    st.members.push(member.clone());
    st.taking_in = true;
    st.failing_over += 1; // no declaration is answered until the move is done
    log::warn!(
        target: "scheduler",
        "server {} ({}, {} thread(s), {}) joined the running job; moving chunks to it",
        info.rank,
        info.addr,
        info.ports.len(),
        if info.colocated { "colocated" } else { "CPU-only" }
    );
    Ok(member)
}

/// Move chunks to server `new` (just admitted) until it carries its share:
/// the servers that own them give them up first (`ServerMove`; one with
/// server-side optimizer state is kept where it is, since its state would
/// not move with it), then `new` installs them as taken over, then the
/// workers re-send what the old owners had not answered and restore the
/// results they hold (`Failover` with `NO_SERVER`), exactly as when a
/// server is lost. A round is summed entirely at one server: whoever got
/// its result from the old owner restores it at the new one.
pub(super) fn take_in(shared: &Shared, new: &Member) {
    let ns = shared.cfg.namespace;
    let done = |st: &mut State| {
        st.failing_over -= 1;
        st.taking_in = false;
    };
    let (batch, before) = {
        let mut st = shared.lock();
        if st.finished || st.failed.is_some() {
            done(&mut st);
            return;
        }
        let st = &mut *st;
        let Some(placer) = st.placer.as_mut() else { return done(st) };
        let mut specs: Vec<&mut TensorSpec> = specs_in_use(&mut st.decls, &mut st.retiring).collect();
        specs.sort_by_key(|s| s.key);
        let before: HashMap<u32, Vec<u32>> = specs.iter().map(|s| (s.key, s.slots.clone())).collect();
        let changed = placer.rebalance_onto(new.rank, &mut specs);
        let moved: Vec<TensorSpec> = changed.iter().map(|&i| specs[i].clone()).collect();
        let batch = st.next_batch;
        st.next_batch += 1;
        let msg = Control::ServerMove { batch, specs: moved };
        for s in st.members.iter().filter(|m| m.role == Role::Server) {
            s.send(&msg, ns);
        }
        (batch, before)
    };
    let mut guard = shared.wait_installed(batch);
    let kept = guard.move_kept.remove(&batch).unwrap_or_default();
    if guard.failed.is_some() {
        return done(&mut guard);
    }
    let st = &mut *guard;
    let Some(placer) = st.placer.as_mut() else { return done(st) };
    let mut final_specs = Vec::new();
    for spec in specs_in_use(&mut st.decls, &mut st.retiring) {
        let Some(old) = before.get(&spec.key) else { continue };
        for &(key, c) in &kept {
            if key == spec.key {
                if let Some(&slot) = old.get(c as usize) {
                    placer.keep(spec, c as usize, slot);
                }
            }
        }
        if old != &spec.slots {
            final_specs.push(spec.clone());
        }
    }
    final_specs.sort_by_key(|s| s.key);
    let chunks: usize =
        final_specs.iter().map(|s| (0..s.num_chunks()).filter(|&c| before[&s.key][c] != s.slots[c]).count()).sum();
    let batch = st.next_batch;
    st.next_batch += 1;
    let msg = Control::ServerTakeOver { batch, lost: NO_SERVER, specs: final_specs.clone() };
    for s in st.members.iter().filter(|m| m.role == Role::Server) {
        s.send(&msg, ns);
    }
    drop(guard);
    let mut st = shared.wait_installed(batch);
    done(&mut st);
    if st.failed.is_some() {
        return;
    }
    let reason = format!("server {} joined the job", new.rank);
    let msg = Control::Failover { batch, lost: NO_SERVER, reason, specs: final_specs };
    for m in st.members.iter().filter(|m| m.role == Role::Worker && !st.said_goodbye.contains(&m.rank)) {
        m.send(&msg, ns);
    }
    let shares = match (&st.placer, st.servers.iter().filter(|s| !st.lost_servers.contains(&s.rank))) {
        (Some(p), live) => p.describe_shares(&live.cloned().collect::<Vec<_>>()),
        (None, _) => String::new(),
    };
    log::info!(
        target: "scheduler",
        "server {} took over {chunks} chunk(s) ({} kept where they are: server-side optimizer state); \
         summation shares per server: {shares}",
        new.rank,
        kept.len()
    );
    answer_ready(shared, &mut st);
}
