//! Mending a broken link to a replica: the server thread that owns chunks
//! with a server-side optimizer keeps their state on another server
//! thread (its replica) over a link it opened. If that link breaks while
//! the job runs, it is dialled again (in short attempts, on a thread of its
//! own, for up to the peer timeout) and the replica is sent each chunk's
//! whole state again (`sync_replica`: a snapshot, which also answers for
//! the round held for its ack), so whatever the broken link lost does not
//! matter. Past the peer timeout the rounds held for the replica fail as
//! before (`check_held`). Links to owners (a rack's relay) are not mended.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;
use mio::Waker;

use super::{LinkTo, ServerThread, ThreadCmd};
use crate::server::replica;
use crate::transport::{dial_until, Greeted};

/// What a thread needs to dial its replicas again.
pub struct Relink {
    /// Its own command channel, and the waker of its poll.
    pub to_self: Sender<ThreadCmd>,
    pub waker: Arc<Waker>,
    /// Every slot's address (host:port) and who serves it.
    pub slots: Arc<Vec<(String, String)>>,
}

impl ServerThread {
    /// Our link to the replica at `slot` broke (`why`): dial it again.
    pub(super) fn relink(&mut self, slot: u32, why: &str) {
        let Some(relink) = &self.cfg.relink else { return };
        let Some((addr, name)) = relink.slots.get(slot as usize).cloned() else { return };
        log::warn!(target: &self.who(), "the link to replica {name} broke ({why}); connecting again");
        let (secret, within) = (self.cfg.secret.clone(), self.cfg.peer_timeout);
        let hello = replica::hello_frame(self.cfg.namespace, self.cfg.slot);
        let (tx, waker) = (relink.to_self.clone(), relink.waker.clone());
        let spawned = std::thread::Builder::new().name(format!("gradhub-relink-{slot}")).spawn(move || {
            let hello = |mut s: crate::transport::Authed| match s.write_frames(&hello) {
                Ok(()) => Greeted::Done(s),
                Err(e) => Greeted::Again(e.to_string()),
            };
            match dial_until(&addr, Instant::now() + within, &secret, || true, hello) {
                Ok(s) => {
                    if tx.send(ThreadCmd::Relinked(slot, s, name)).is_ok() {
                        let _ = waker.wake();
                    }
                }
                Err(f) => log::warn!(target: "server", "no new link to replica {name} within {within:?}: {}", f.why),
            }
        });
        if let Err(e) = spawned {
            log::warn!(target: &self.who(), "cannot dial replica slot {slot} again: {e}");
        }
    }

    /// A new link to the replica at `slot`: in use at once, and every chunk
    /// it replicates sends it its whole state.
    pub(super) fn relinked(&mut self, slot: u32, stream: crate::transport::Authed, name: &str) {
        self.add_link(slot, stream, LinkTo::Replica, name);
        let idxs: Vec<usize> =
            (0..self.chunks.len()).filter(|&i| self.chunks[i].round.replica() == Some(slot)).collect();
        log::info!(target: &self.who(), "linked to replica {name} again; its {} chunk(s) sent their state", idxs.len());
        for idx in idxs {
            self.sync_replica(idx);
        }
    }
}
