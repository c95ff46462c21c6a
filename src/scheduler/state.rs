//! The scheduler's shared state, in one place: who is in the job
//! (membership) and what tensors it has (declarations), behind one mutex
//! with a condition variable for the threads waiting on either.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::declarations::{Decl, PendingReq, Retiring};
use super::membership::Registration;
use super::SchedulerConfig;
use crate::placement::Placer;
use crate::protocol::{write_control, Control, Role};

pub(super) struct Member {
    pub role: Role,
    pub rank: u32,
    pub peer: SocketAddr,
    pub writer: Mutex<TcpStream>,
}

impl Member {
    pub fn send(&self, msg: &Control, ns: u32) -> bool {
        match self.writer.lock() {
            Ok(mut w) => write_control(&mut *w, msg, ns).is_ok(),
            Err(_) => false,
        }
    }
    /// Several messages in one write (one wake-up of the member).
    pub fn send_all(&self, msgs: &[Control], ns: u32) -> bool {
        let buf: Vec<u8> = msgs.iter().flat_map(|m| m.encode(ns)).collect();
        match self.writer.lock() {
            Ok(mut w) => w.write_all(&buf).is_ok(),
            Err(_) => false,
        }
    }
    pub fn describe(&self) -> String {
        format!("{} {} ({})", self.role.name(), self.rank, self.peer)
    }
    /// Nothing more will be sent to the member (it said goodbye).
    pub fn finish_writing(&self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Write);
        }
    }
    /// Cut the member off (a lost server that may come back to life).
    pub fn disconnect(&self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl State {
    /// Whether every server still in the job installed `batch`.
    pub fn installed_everywhere(&self, batch: u32) -> bool {
        let acked = self.acks.get(&batch);
        // A server that joined later was not sent earlier batches.
        let sent = |rank: u32| self.joined_at.get(&rank).is_none_or(|&first| batch >= first);
        self.members
            .iter()
            .filter(|m| m.role == Role::Server && sent(m.rank))
            .all(|m| acked.is_some_and(|a| a.contains(&m.rank)))
    }
}

#[derive(Default)]
pub(super) struct State {
    // Membership.
    pub joining: Vec<Option<Registration>>,
    /// Set once everyone registered: (role, rank) of each joining slot.
    pub assigned: Option<Vec<(Role, u32)>>,
    pub members: Vec<Arc<Member>>,
    /// The member created for each registration slot, in join order.
    pub slot_members: Vec<Option<Arc<Member>>>,
    pub barriers: HashMap<u32, HashSet<u32>>,
    pub said_goodbye: HashSet<u32>,
    // Declarations.
    pub placer: Option<Placer>,
    pub decls: HashMap<String, Decl>,
    /// The name of every placed tensor, by key (for `Release`).
    pub by_key: HashMap<u32, String>,
    /// Tensors some workers released and others not yet, by key.
    pub retiring: HashMap<u32, Retiring>,
    /// Tensors every worker released, not yet freed on the servers (sent
    /// with the next install or heartbeat: see `declarations::release`).
    pub to_free: Vec<u32>,
    pub next_key: u32,
    pub next_batch: u32,
    /// Which servers (ranks) installed each batch of specs.
    pub acks: HashMap<u32, HashSet<u32>>,
    /// Servers lost and taken over (`failover`); failovers under way, during
    /// which no declaration is answered (its placement may still move).
    pub lost_servers: Vec<u32>,
    pub failing_over: u32,
    /// Every server the job has had, lost ones included, by rank (slots
    /// are numbered over all of them); the Welcome every member got, for
    /// a server that joins while the job runs; the first batch each such
    /// server was sent; the chunks servers kept in a move (by batch).
    pub servers: Vec<crate::protocol::ServerInfo>,
    pub welcome: Option<crate::protocol::Welcome>,
    pub joined_at: HashMap<u32, u32>,
    pub move_kept: HashMap<u32, Vec<(u32, u32)>>,
    /// A server is joining (`failover::take_in`): one at a time.
    pub taking_in: bool,
    pub pending: Vec<PendingReq>,
    /// Horovod's join: the workers that joined so far, the last of them,
    /// and by name the latest round announced and who it went to.
    pub joined: HashSet<u32>,
    pub join_last: u32,
    pub join_ops: HashMap<String, (u32, HashSet<u32>)>,
    // The job.
    pub finished: bool,
    pub failed: Option<String>,
}

pub(super) struct Shared {
    pub cfg: SchedulerConfig,
    pub state: Mutex<State>,
    pub cv: Condvar,
    /// Connections accepted and not yet registered (or refused).
    pub pending: std::sync::atomic::AtomicUsize,
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking member thread must not take the whole scheduler down.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Mark the job failed and tell every other member who is gone and why.
    pub fn fail(&self, st: &mut State, who: Option<&Member>, reason: String) {
        if st.finished || st.failed.is_some() {
            return;
        }
        log::error!(target: "scheduler", "job failed: {reason}");
        st.failed = Some(reason.clone());
        let members = st.members.clone();
        for m in members {
            if let Some(w) = who {
                if m.role == w.role && m.rank == w.rank {
                    continue;
                }
                m.send(&Control::PeerLost { role: w.role, rank: w.rank, reason: reason.clone() }, self.cfg.namespace);
            } else {
                m.send(&Control::Error { message: reason.clone() }, self.cfg.namespace);
            }
        }
        self.cv.notify_all();
    }

    /// Wait until every server still in the job installed `batch` (or the
    /// job failed); returns the state, locked.
    pub fn wait_installed(&self, batch: u32) -> MutexGuard<'_, State> {
        let mut st = self.lock();
        while !st.installed_everywhere(batch) && st.failed.is_none() {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.acks.remove(&batch);
        st
    }

    /// Tell the members not welcomed yet (reachable only through their
    /// registration streams) why the job failed.
    pub fn reject_joining(&self, st: &mut State, message: &str) {
        for r in st.joining.iter_mut().flatten() {
            let _ = write_control(&mut r.stream, &Control::Error { message: message.to_string() }, self.cfg.namespace);
        }
    }
}
