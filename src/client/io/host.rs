//! The host stage on the I/O side: a round whose chunks the host's workers
//! sum in shared memory first (`HostRound`), pushing the chunks this worker
//! owns once the host's sum is ready, taking the others' results once their
//! owners publish them, and reporting local workers that are late.

use std::sync::Arc;

use super::thread::IoCore;
use super::Io;
use crate::host::Staging;
use crate::waits::StallWatch;

/// A round through the host stage: which chunks this worker pushes (for
/// the host, from `staging`), and which of those it has queued.
pub(super) struct HostRound {
    pub(super) staging: Arc<Staging>,
    pub(super) owned: Vec<bool>,
    pub(super) pushed: Vec<bool>,
    /// Since this worker contributed.
    pub(super) stall: StallWatch,
}

impl Io {
    /// An active round of this host's stage that still waits for worker
    /// `rank`'s contribution (so, if it left, will never complete).
    pub fn waits_for_local(&self, rank: u32) -> Option<String> {
        let h = self.host.as_ref()?;
        let local = h.workers.iter().position(|&r| r == rank)?;
        let ops = self.ops();
        ops.active
            .values()
            .find(|a| a.host.as_ref().is_some_and(|hr| hr.staging.missing(a.round) & (1 << local) != 0))
            .map(|a| a.spec.name.clone())
    }
}

impl IoCore {
    pub(super) fn ring_pending(&mut self) {
        if let (Some(h), bells) = (&self.io.host, std::mem::take(&mut self.bells)) {
            if bells != 0 {
                h.bells.ring_mask(bells);
            }
        }
    }

    /// Report host-stage rounds that have waited too long for a local
    /// worker's contribution: logged once, and quoted by a timed-out wait.
    pub(super) fn check_host_stalls(&mut self) {
        let io = &self.io;
        let Some(h) = &io.host else { return };
        let mut ops = io.ops();
        for a in ops.active.values_mut() {
            let Some(hr) = &mut a.host else { continue };
            let missing = hr.staging.missing(a.round);
            if missing == 0 {
                continue; // the host's sums are complete: servers watch the rest
            }
            let Some(waited) = hr.stall.overdue(io.stall) else { continue };
            let ranks: Vec<u32> =
                h.workers.iter().enumerate().filter(|(l, _)| missing >> l & 1 == 1).map(|(_, &r)| r).collect();
            let msg = format!(
                "tensor '{}' round {} has waited {:.1}s for worker rank(s) {ranks:?} of this host to push_pull it",
                a.spec.name,
                a.round,
                waited.as_secs_f64()
            );
            log::warn!(target: &format!("worker {}", io.rank), "stall: {msg}");
            a.op.set_stall(msg);
        }
    }

    /// A local worker rang: push the owned chunks whose host sums are
    /// complete, copy out the results other owners published.
    pub(super) fn scan_host(&mut self) {
        let io = self.io.clone();
        let io = &*io;
        let Some(h) = &io.host else { return };
        h.doorbell.drain();
        let mut touched = Vec::new();
        let mut published = Vec::new();
        {
            let mut guard = io.ops();
            let ops = &mut *guard;
            for a in ops.active.values_mut() {
                let Some(hr) = &a.host else { continue };
                let mut push = Vec::new();
                for c in 0..a.got.len() {
                    if a.got[c] {
                        continue;
                    }
                    if hr.owned[c] {
                        if !hr.pushed[c] && hr.staging.ready(c, a.round) {
                            push.push(c);
                        }
                    } else if hr.staging.has_result(c, a.round) {
                        published.push((a.spec.key, c));
                    }
                }
                for c in push {
                    if let Some(hr) = &mut a.host {
                        hr.pushed[c] = true;
                    }
                    if let Some(slot) = io.queue_chunk(&mut ops.seq, a, c) {
                        if !touched.contains(&slot) {
                            touched.push(slot);
                        }
                    }
                }
            }
        }
        io.pump_all(&touched);
        for (key, c) in published {
            self.land(key, c);
        }
    }
}
