//! A scheduler that restarted: the job goes on. While the scheduler is
//! away the data plane trains (it needs nothing from it); each member dials
//! the same address again for up to the peer timeout (`crate::session`)
//! and sends a `Rejoin` instead of a Register: its registration, the
//! Welcome it had (rank and cluster map), and what it knows — a worker its
//! tensors as placed, the barriers it passed, the workers that left and the
//! servers lost; a server the keys it holds, who left and who was lost.
//!
//! The first rejoin brings the cluster map (`Members::rejoin`); the job
//! is rebuilt from the reports (`Declarations::rejoin`, the placer counting
//! every placed tensor once, the lost servers' slots out) and waits, up to
//! the peer timeout, for every member of the map that has not left or been
//! lost; one that does not come back fails the job, named. Requests the members had not had answered (Declare,
//! Barrier) are sent again by their sessions, and are answered once every
//! member is back (an install needs every server).
//!
//! A shared service that restarted rebuilds each of its jobs the same way,
//! the job made again by its first member back (`service::rebuilt_job`).
//!
//! Not rebuilt (refused here, so the job fails naming why, as before this
//! existed): a job that reduces within racks (its workers hold per-rack
//! slots, not the placement), and an elastic job's generation on a service.
//! A tensor released by some workers and not all when
//! the scheduler went away is freed on the servers at the job's end only.

use super::config::SchedulerConfig;
use crate::protocol::Rejoin;

/// Why this scheduler cannot take `rj` back, if it cannot (a pure check of
/// the rejoin against the scheduler's settings).
pub(super) fn unsupported(cfg: &SchedulerConfig, rj: &Rejoin) -> Option<String> {
    let w = &rj.welcome;
    if w.rack_reduce {
        return Some("a restarted scheduler does not rebuild a job that reduces within racks".into());
    }
    if w.num_workers != cfg.num_workers {
        return Some(format!(
            "the job had {} workers, but this scheduler was started for {}",
            w.num_workers, cfg.num_workers
        ));
    }
    let servers = w.servers.len() as u32;
    if servers < cfg.num_servers {
        return Some(format!("the job had {servers} servers, but this scheduler was started for {}", cfg.num_servers));
    }
    if w.partition_bytes != cfg.partition_bytes {
        return Some(format!(
            "the job's partition was {} bytes, but this scheduler was started with --partition-bytes {}",
            w.partition_bytes, cfg.partition_bytes
        ));
    }
    if w.peer_timeout_ms != cfg.peer_timeout_ms {
        return Some(format!(
            "the job's peer timeout was {} ms, but this scheduler was started with {} ms",
            w.peer_timeout_ms, cfg.peer_timeout_ms
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::unsupported;
    use crate::protocol::{Register, Rejoin, Role, Welcome};
    use crate::scheduler::SchedulerConfig;

    fn rejoin(tweak: impl FnOnce(&mut Welcome)) -> Rejoin {
        let cfg = SchedulerConfig { num_workers: 2, num_servers: 1, ..Default::default() };
        let mut welcome = Welcome {
            rank: 1,
            num_workers: cfg.num_workers,
            partition_bytes: cfg.partition_bytes,
            heartbeat_ms: cfg.heartbeat_ms,
            stall_ms: cfg.stall_ms,
            peer_timeout_ms: cfg.peer_timeout_ms,
            servers: vec![crate::protocol::ServerInfo {
                rank: 0,
                addr: "10.0.0.1".into(),
                ports: vec![1],
                colocated: false,
                host: "h".into(),
                rack: 0,
            }],
            worker_hosts: vec!["a".into(), "b".into()],
            worker_local_ranks: vec![0, 0],
            job_id: 7,
            host_reduce: true,
            failover: false,
            late: false,
            racks: vec![String::new()],
            worker_racks: vec![0, 0],
            rack_reduce: false,
        };
        tweak(&mut welcome);
        let register = Register {
            role: Role::Worker,
            requested_rank: -1,
            hostname: "a".into(),
            addr: String::new(),
            ports: vec![],
            colocated: false,
            num_workers: 2,
            num_servers: 1,
            local_rank: -1,
            local_size: -1,
            rack: String::new(),
            sum_order: Default::default(),
            training: Default::default(),
            elastic: None,
        };
        Rejoin { register, welcome, specs: vec![], keys: vec![], left: vec![], lost: vec![], barriers: 0, received: 0 }
    }

    #[test]
    fn a_rejoin_that_fits_the_restarted_scheduler_is_taken_and_others_are_named() {
        let cfg = SchedulerConfig { num_workers: 2, num_servers: 1, ..Default::default() };
        assert_eq!(unsupported(&cfg, &rejoin(|_| {})), None);
        let why = |t: fn(&mut Welcome)| unsupported(&cfg, &rejoin(t)).unwrap_or_default();
        assert!(why(|w| w.rack_reduce = true).contains("within racks"));
        assert!(why(|w| w.num_workers = 3).contains("3 workers"));
        assert!(why(|w| w.servers.clear()).contains("0 servers"));
        assert!(why(|w| w.partition_bytes = 1024).contains("--partition-bytes"));
        assert!(why(|w| w.peer_timeout_ms = 1).contains("peer timeout"));
    }
}
