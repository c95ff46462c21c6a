//! Mending a broken data link: a connection to a server thread that fails
//! (reset, closed without a word, a corrupted frame, or silent past the
//! socket's user timeout) while its server is not known to be lost is
//! dialled again, and what was on it and unanswered is sent again, marked
//! `FLAG_RESENT`: the server counts each push once (one already counted is
//! only acknowledged, a round already complete is answered with its
//! result). Within the peer timeout; after it, the link is given up as
//! before (failover on: the scheduler's failover; off: the job fails,
//! naming the link).
//!
//! The dialling runs on a thread of its own per broken link (short
//! attempts, so the first one after a link comes back gets through, not
//! TCP's backed-off retry); the I/O thread installs what it found.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mio::Token;

use super::item::{Again, SendItem};
use super::link::LinkState;
use super::thread::IoCore;
use crate::protocol::auth::Secret;
use crate::protocol::{Header, MsgType, FLAG_RESENT};
use crate::transport::Connection;

/// How long past its time a mend is given up if its dial never reports.
const LATE: Duration = Duration::from_millis(1200);

/// What mending needs, and the dials that finished.
pub(super) struct Mending {
    secret: Secret,
    /// How long a link may be mended before it is given up.
    within: Duration,
    done: Mutex<Vec<(usize, std::io::Result<crate::transport::Authed>)>>,
    /// Links whose writes failed on a caller's thread, for the I/O thread.
    asked: Mutex<Vec<(usize, String)>>,
}

impl Mending {
    pub(super) fn new(secret: Secret, within: Duration) -> Mending {
        Mending { secret, within, done: Mutex::new(Vec::new()), asked: Mutex::new(Vec::new()) }
    }

    pub(super) fn ask(&self, i: usize, why: String) {
        self.asked.lock().unwrap_or_else(|e| e.into_inner()).push((i, why));
    }

    fn take(&self) -> Vec<(usize, std::io::Result<crate::transport::Authed>)> {
        std::mem::take(&mut *self.done.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The pure part of a mend: of the chunks that were on the broken link,
/// which to send again and how. `sent`: (key, chunk) on the wire there,
/// unanswered; `partial`: the one whose result was arriving; `got`: whether
/// a chunk's result is in (its op still active), None for a chunk of no
/// active op (nothing waits for it any more).
pub(super) fn resends(
    sent: &[(u32, u32)],
    partial: Option<(u32, u32)>,
    got: impl Fn(u32, u32) -> Option<bool>,
) -> Vec<(u32, u32, Again)> {
    let mut seen = HashSet::new();
    sent.iter()
        .chain(partial.iter())
        .filter(|&&kc| seen.insert(kc))
        .filter(|&&(k, c)| got(k, c) == Some(false))
        .map(|&(k, c)| (k, c, if partial == Some((k, c)) { Again::ResultOnly } else { Again::Push }))
        .collect()
}

impl IoCore {
    /// Link `i` broke: stop using it and dial it again (`mend`). False if
    /// it is past mending (written off, or mending already).
    pub(super) fn start_mend(&mut self, i: usize, why: &str) -> bool {
        let io = self.io.clone();
        let c = &io.send.conns[i];
        if c.advance(LinkState::Mending) != LinkState::Live {
            return false;
        }
        let partial = self.rx[i].reset().map(|d| (d.key, d.chunk as u32));
        c.link().deregister(&io.send.registry);
        let until = {
            let mut st = c.send();
            st.mending = Some((Instant::now(), partial));
            // From its first break since it last worked: a link that
            // connects and breaks again at once is not mended forever.
            let since = match c.doubtful.swap(true, Ordering::Relaxed) {
                true => st.doubted_at.unwrap_or_else(Instant::now),
                false => Instant::now(),
            };
            st.doubted_at = Some(since);
            since + io.mend.within
        };
        if Instant::now() >= until {
            self.give_up(i, &format!("{why}, and it has carried nothing since it first broke"));
            return true;
        }
        log::warn!(target: &format!("worker {}", io.rank), "{}: {why}; connecting again", c.desc());
        let addr = c.addr.clone();
        let weak = std::sync::Arc::downgrade(&io);
        let spawned = std::thread::Builder::new().name(format!("gradhub-mend-{i}")).spawn(move || {
            let Some(secret) = weak.upgrade().map(|io| io.mend.secret.clone()) else { return };
            let wanted = || weak.upgrade().is_some_and(|io| io.send.mending(i));
            let result = crate::transport::dial_until(&addr, until, &secret, wanted, crate::transport::Greeted::Done)
                .map_err(|f| std::io::Error::other(f.why));
            if let Some(io) = weak.upgrade() {
                io.mend.done.lock().unwrap_or_else(|e| e.into_inner()).push((i, result));
                io.recv.wake();
            }
        });
        if let Err(e) = spawned {
            self.give_up(i, &format!("cannot start mending it: {e}"));
        }
        true
    }

    /// Start the mends asked for, install the links whose dialling
    /// finished, or give them up.
    pub(super) fn finish_mends(&mut self) {
        let asked = std::mem::take(&mut *self.io.mend.asked.lock().unwrap_or_else(|e| e.into_inner()));
        for (i, why) in asked {
            if !self.start_mend(i, &why) && self.io.send.conns[i].state() == LinkState::Live {
                self.give_up(i, &why);
            }
        }
        for (i, result) in self.io.mend.take() {
            if !self.io.send.mending(i) {
                continue; // written off or failed meanwhile
            }
            match result.and_then(|s| self.install(i, s)) {
                Ok(n) => log::info!(
                    target: &format!("worker {}", self.io.rank),
                    "{}: connected again; re-sent {n} chunk(s)",
                    self.io.send.conns[i].desc()
                ),
                Err(e) => self.give_up(i, &e.to_string()),
            }
        }
    }

    /// Link `i` mending past its time, or a dial that failed for good.
    fn give_up(&mut self, i: usize, why: &str) {
        let io = self.io.clone();
        let c = &io.send.conns[i];
        let secs = io.mend.within.as_secs_f64();
        if io.failover.on {
            // As if it had broken now: the scheduler, told the server is
            // unreachable from here, fails it over (unless it is lost
            // already), or `check_lost` fails the job.
            c.broke(&mut c.send());
            log::warn!(target: &format!("worker {}", io.rank), "{}: not connected again within {secs:.1}s ({why}); waiting for the scheduler's failover", c.desc());
            let reason = format!("its link {} could not be made again within {secs:.1}s ({why})", c.desc());
            self.owner.unreachable(c.server, reason);
            return;
        }
        let msg = format!("{}: the connection broke and could not be made again within {secs:.1}s: {why}", c.desc());
        self.owner.fail_job(msg);
    }

    /// A new socket for link `i`: DataHello (resent) first, then every
    /// unanswered chunk again; returns how many.
    fn install(&mut self, i: usize, authed: crate::transport::Authed) -> std::io::Result<usize> {
        let io = self.io.clone();
        let c = &io.send.conns[i];
        let (stream, seal, open) = authed.into_parts();
        crate::transport::tune_data_socket(&stream);
        stream.set_nonblocking(true)?;
        let link =
            Connection::new(&io.send.registry, mio::net::TcpStream::from_std(stream), Token(i), c.desc().into())?;
        link.seal_with_parts(seal, open).map_err(std::io::Error::other)?;
        let (sent, partial) = {
            let mut st = c.send();
            let sent = st.flights.on_wire();
            let partial = st.mending.take().and_then(|(_, p)| p);
            // What was written to the old socket is gone with it; what is
            // queued stays queued.
            st.flights.clear();
            // A fresh writer: what it watched was the old socket's.
            st.tx = Default::default();
            st.quiet_callers = 0;
            st.detached.clear();
            st.resent.clear();
            st.mends += 1;
            let mut hello = Header::new(MsgType::DataHello);
            (hello.namespace, hello.key, hello.flags) = (io.namespace, io.rank, FLAG_RESENT);
            st.heap.push(SendItem::Control { seq: 0, header: hello, payload: Vec::new() });
            (sent, partial)
        };
        io.admission.spread().drop_slot(i);
        self.rx[i] = Default::default();
        let mut n = 0;
        {
            let mut ops = io.ops();
            let ops = &mut *ops;
            let got = |k: u32, ch: u32| ops.active.get(&k).map(|a| a.got.get(ch as usize).copied().unwrap_or(true));
            for (key, chunk, again) in resends(&sent, partial, got) {
                if let Some(a) = ops.active.get(&key) {
                    if let Some(slot) = io.queue_chunk(&mut ops.seq, a, chunk as usize, again) {
                        io.send.conns[slot].send().resent.insert((key, chunk));
                        n += 1;
                    }
                }
            }
        }
        if !c.mended(link) {
            return Err(std::io::Error::other("written off while it was mended"));
        }
        io.pump(i).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(n)
    }

    /// Give up links mending for longer than they may.
    pub(super) fn check_mends(&mut self) {
        let within = self.io.mend.within;
        let late: Vec<usize> = (0..self.rx.len())
            .filter(|&i| {
                self.io.send.mending(i)
                    && self.io.send.conns[i].send().mending.is_some_and(|(t, _)| t.elapsed() > within + LATE)
            })
            .collect();
        for i in late {
            self.give_up(i, "no connection");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{resends, Again};

    #[test]
    fn what_was_unanswered_goes_again_and_a_result_half_received_is_asked_for_again() {
        let sent = [(1, 0), (1, 1), (2, 0), (3, 0)];
        // Key 1 chunk 1's result is in; key 3 has no op any more.
        let got = |k: u32, c: u32| match (k, c) {
            (1, 1) => Some(true),
            (3, _) => None,
            _ => Some(false),
        };
        assert_eq!(resends(&sent, Some((2, 0)), got), vec![(1, 0, Again::Push), (2, 0, Again::ResultOnly)]);
        // A result arriving for a chunk no longer on the wire list is asked for too.
        assert_eq!(resends(&[], Some((1, 0)), got), vec![(1, 0, Again::ResultOnly)]);
        assert!(resends(&[], None, got).is_empty());
    }
}
