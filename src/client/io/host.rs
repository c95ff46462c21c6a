//! The host stage on the I/O side (`HostSide`): for a round whose chunks
//! the host's workers sum in shared memory first (`flow::HostRound`), the
//! I/O thread pushes the chunks this worker owns once the host's sum is
//! ready, takes the others' results once their owners publish them, and
//! reports local workers that are late.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::item::Again;
use super::thread::IoCore;
use super::NONE_LEFT;
use crate::host::HostStage;

/// The host stage as the data plane holds it.
pub(super) struct HostSide {
    /// Present when other workers share this host (and host reduction is on).
    pub(super) stage: Option<HostStage>,
    /// A host-stage round waiting longer than this is reported (as servers do).
    pub(super) stall: Duration,
    /// A worker that left the job (`NONE_LEFT`: none); see `Shared::on_peer_left`.
    left: AtomicU32,
}

impl HostSide {
    pub(super) fn new(stage: Option<HostStage>, stall: Duration) -> HostSide {
        HostSide { stage, stall, left: AtomicU32::new(NONE_LEFT) }
    }

    /// The worker that left, if one did.
    pub(super) fn left(&self) -> Option<u32> {
        Some(self.left.load(Ordering::Acquire)).filter(|&r| r != NONE_LEFT)
    }

    /// Worker `rank` left the job while this one goes on (`Io::set_left`).
    pub(super) fn set_left(&self, rank: u32) {
        self.left.store(rank, Ordering::Release);
    }
}

impl IoCore {
    pub(super) fn ring_pending(&mut self) {
        if let (Some(h), bells) = (&self.io.host.stage, std::mem::take(&mut self.bells)) {
            if bells != 0 {
                h.bells.ring_mask(bells);
            }
        }
    }

    /// Report host-stage rounds that have waited too long for a local
    /// worker's contribution: logged once, and quoted by a timed-out wait.
    pub(super) fn check_host_stalls(&mut self) {
        let io = &self.io;
        let Some(h) = &io.host.stage else { return };
        let mut ops = io.ops();
        for a in ops.active.values_mut() {
            let Some(hr) = &mut a.host else { continue };
            let missing = hr.shared.missing(a.round);
            if missing == 0 {
                continue; // the host's sums are complete: servers watch the rest
            }
            let Some(waited) = hr.stall.overdue(io.host.stall) else { continue };
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
        let Some(h) = &io.host.stage else { return };
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
                        if !hr.pushed[c] && hr.shared.ready(c, a.round) {
                            push.push(c);
                        }
                    } else if hr.shared.has_result(c, a.round) {
                        published.push((a.spec.key, c));
                    }
                }
                for c in push {
                    if let Some(hr) = &mut a.host {
                        hr.pushed[c] = true;
                    }
                    if let Some(slot) = io.queue_chunk(&mut ops.seq, a, c, Again::No) {
                        if !touched.contains(&slot) {
                            touched.push(slot);
                        }
                    }
                }
            }
        }
        io.pump_all(&touched);
        for (key, c) in published {
            self.land(key, c, true);
        }
    }
}
