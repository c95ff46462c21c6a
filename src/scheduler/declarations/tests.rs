//! Unit tests of the declarations: placement once every worker (or
//! member) declared, conflicts, releases, restarts, stalls; helpers the
//! moves' tests share.

use super::*;
use crate::protocol::ServerInfo;

/// `n` servers of `threads` threads each (CPU-only), by rank.
pub(in crate::scheduler) fn servers(n: u32, threads: u16) -> Vec<ServerInfo> {
    (0..n)
        .map(|rank| ServerInfo {
            rank,
            addr: format!("10.0.0.{rank}"),
            ports: (0..threads).map(|p| 9000 + p).collect(),
            colocated: false,
            host: format!("s{rank}"),
            rack: 0,
        })
        .collect()
}

/// A job of `workers` workers on `servers`, with replicas, placed as
/// the scheduler places it; chunks of 64 bytes.
pub(in crate::scheduler) fn job(workers: u32, servers: &[ServerInfo]) -> (SchedulerConfig, Declarations) {
    let cfg = SchedulerConfig {
        num_workers: workers,
        num_servers: servers.len() as u32,
        partition_bytes: 64,
        ..SchedulerConfig::default()
    };
    let mut d = Declarations::default();
    d.set_placer(Placer::new(servers, workers as usize).with_replicas(true));
    (cfg, d)
}

pub(in crate::scheduler) fn entry(name: &str, numel: u64) -> DeclEntry {
    DeclEntry { name: name.into(), numel, dtype: DType::F32, partition: 0, members: Vec::new(), sharded: false }
}

/// Every worker declares `entries` (request 0); the tensors placed.
pub(in crate::scheduler) fn declare_all(
    cfg: &SchedulerConfig,
    d: &mut Declarations,
    entries: &[DeclEntry],
) -> Vec<TensorSpec> {
    let mut specs = Vec::new();
    for rank in 0..cfg.num_workers {
        specs.extend(d.declare(cfg, rank, 0, entries.to_vec()).unwrap());
    }
    d.installed(&specs);
    specs
}

fn answers(d: &mut Declarations) -> Vec<(u32, Control)> {
    let mut a = d.ready();
    a.sort_by_key(|x| x.0);
    a
}

#[test]
fn a_tensor_is_placed_once_every_worker_declared_it_and_answered_once_installed() {
    let (cfg, mut d) = job(2, &servers(2, 1));
    let a = d.declare(&cfg, 1, 7, vec![entry("w", 40), entry("b", 3)]).unwrap();
    assert!(a.is_empty(), "worker 0 has not declared yet");
    assert!(answers(&mut d).is_empty());
    // Worker 0 declares them in another order, one twice: placed once each.
    let specs = d.declare(&cfg, 0, 9, vec![entry("b", 3), entry("w", 40), entry("b", 3)]).unwrap();
    assert_eq!(specs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["b", "w"]);
    assert_eq!(specs.iter().map(|s| s.key).collect::<Vec<_>>(), [0, 1]);
    let w = &specs[1];
    assert_eq!((w.chunk_elems, w.num_chunks()), (16, 3));
    assert_eq!(w.replicas.len(), 3, "replicas with two servers");
    assert!(answers(&mut d).is_empty(), "not installed yet");
    d.installed(&specs);
    let a = answers(&mut d);
    assert_eq!(a.len(), 2);
    assert!(matches!(&a[0].1, Control::Declared { req: 9, specs } if specs.len() == 3));
    assert!(matches!(&a[1].1, Control::Declared { req: 7, specs } if specs.len() == 2));
    assert_eq!(d.held(), (2, (40 + 3) * 4));
}

#[test]
fn a_restarted_scheduler_rebuilds_the_declarations_from_what_the_members_report() {
    // The first scheduler: three tensors, one released by worker 1 only.
    let (cfg, mut first) = job(2, &servers(2, 1));
    let specs = declare_all(&cfg, &mut first, &[entry("a", 40), entry("b", 3), entry("c", 17)]);
    let (a, b, c) = (specs[0].clone(), specs[1].clone(), specs[2].clone());
    // The restarted one: worker 0 holds all three, worker 1 had its
    // answer for "b" lost (it will declare it again) and released "c".
    let (_, mut d) = job(2, &servers(2, 1));
    d.rejoin(0, 2, &specs).unwrap();
    d.rejoin(1, 2, std::slice::from_ref(&a)).unwrap();
    // A server holds a key no worker has: installed, never answered.
    d.server_keys(&[a.key, b.key, c.key, 9]);
    d.rebuilt();
    assert_eq!(d.take_to_free(), [9]);
    // Worker 1 declares "b" again: answered at once with the same placement.
    assert!(d.declare(&cfg, 1, 4, vec![entry("b", 3)]).unwrap().is_empty());
    let got = answers(&mut d);
    assert!(
        matches!(&got[..], [(1, Control::Declared { req: 4, specs })] if specs == std::slice::from_ref(&b)),
        "{got:?}"
    );
    // New tensors take keys above every key reported, placed as the
    // first scheduler would have (its placer counted them all).
    let next = declare_all(&cfg, &mut d, &[entry("d", 30)]).remove(0);
    let want = declare_all(&cfg, &mut first, &[entry("d", 30)]).remove(0);
    assert_eq!(next.key, 10);
    assert_eq!(TensorSpec { key: 10, ..want }, next);
    // "c": worker 0 releases it, and worker 1's release reached the old
    // scheduler only: held until the job ends (documented), not an error.
    assert!(!d.release(0, 2, vec![c.key]).unwrap());
    assert!(d.take_to_free().is_empty());
    // A release of a key nobody reported yet waits for its holder.
    let (_, mut e) = job(2, &servers(2, 1));
    e.rejoin(1, 2, &[]).unwrap();
    e.release(1, 2, vec![a.key]).unwrap();
    assert!(e.release(1, 2, vec![a.key]).unwrap_err().contains("twice"));
    e.rejoin(0, 2, std::slice::from_ref(&a)).unwrap();
    e.release(0, 2, vec![a.key]).unwrap();
    assert_eq!(e.take_to_free(), [a.key]);
    // Workers that disagree on a tensor's placement are named.
    let mut moved = a.clone();
    moved.slots.reverse();
    moved.slots[0] ^= 1;
    let (_, mut f) = job(2, &servers(2, 1));
    f.rejoin(0, 2, &[a]).unwrap();
    assert!(f.rejoin(1, 2, &[moved]).unwrap_err().contains("placed unlike worker 0's"));
}

#[test]
fn a_tensor_answered_to_some_workers_before_the_restart_keeps_its_placement() {
    // The first scheduler placed "b" and answered worker 1; the restart
    // took worker 0's answer, and worker 0 declares it again to the new
    // scheduler before worker 1 is back with the placement.
    let (cfg, mut first) = job(2, &servers(2, 1));
    let specs = declare_all(&cfg, &mut first, &[entry("a", 40), entry("b", 3)]);
    let (_, mut d) = job(2, &servers(2, 1));
    d.rejoin(0, 2, &specs[..1]).unwrap();
    assert!(d.declare(&cfg, 0, 5, vec![entry("b", 3)]).unwrap().is_empty(), "waits for worker 1");
    d.rejoin(1, 2, &specs).unwrap();
    d.server_keys(&[specs[0].key, specs[1].key]);
    d.rebuilt();
    assert!(d.take_to_free().is_empty(), "every key is held");
    let got = answers(&mut d);
    assert!(
        matches!(&got[..], [(0, Control::Declared { req: 5, specs: s })] if s[..] == specs[1..]),
        "worker 0 gets the first scheduler's placement: {got:?}"
    );
    // New tensors go above it.
    assert_eq!(declare_all(&cfg, &mut d, &[entry("c", 8)])[0].key, specs[1].key + 1);
    // A tensor worker 0 declared differently than it was placed is named.
    let (_, mut e) = job(2, &servers(2, 1));
    e.declare(&cfg, 0, 6, vec![entry("b", 4)]).unwrap();
    assert!(e.rejoin(1, 2, &specs[1..]).unwrap_err().contains("placed unlike worker 0's"));
}

#[test]
fn a_tensor_declared_while_the_job_is_rebuilt_is_placed_above_every_key_the_servers_report() {
    // The first scheduler placed "a" and "b"; every worker released "b"
    // (the highest key) before the restart, and the servers had not
    // freed it yet.
    let (cfg, mut first) = job(2, &servers(2, 1));
    let specs = declare_all(&cfg, &mut first, &[entry("a", 40), entry("b", 3)]);
    let (_, mut d) = job(2, &servers(2, 1));
    d.rejoin(0, 2, &specs[..1]).unwrap();
    d.rejoin(1, 2, &specs[..1]).unwrap();
    // Both workers declare "c" before the servers are back: not placed
    // yet, so it cannot take "b"'s key.
    for rank in 0..2 {
        assert!(d.declare(&cfg, rank, 3, vec![entry("c", 8)]).unwrap().is_empty(), "placed while rebuilding");
    }
    d.server_keys(&[specs[0].key, specs[1].key]);
    let placed = d.rebuilt();
    assert_eq!(placed.len(), 1);
    assert_eq!((placed[0].name.as_str(), placed[0].key), ("c", specs[1].key + 1));
    assert_eq!(d.take_to_free(), [specs[1].key]);
    // Answered once installed, with that placement.
    d.installed(&placed);
    let got = answers(&mut d);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.iter().all(|(_, a)| matches!(a, Control::Declared { req: 3, specs } if specs == &placed)));
    // Placing goes on as before once rebuilt.
    assert_eq!(declare_all(&cfg, &mut d, &[entry("e", 8)])[0].key, placed[0].key + 1);
}

#[test]
fn disagreeing_declarations_are_answered_with_the_conflict() {
    let (cfg, mut d) = job(2, &servers(1, 1));
    d.declare(&cfg, 0, 1, vec![entry("w", 40)]).unwrap();
    let placed = d.declare(&cfg, 1, 2, vec![entry("w", 41)]).unwrap();
    assert!(placed.is_empty());
    let a = answers(&mut d);
    assert_eq!(a.len(), 2);
    for (_, reply) in &a {
        let Control::DeclareError { message, .. } = reply else { panic!("{reply:?}") };
        assert!(message.contains("declared inconsistently") && message.contains("worker 1 has 41"), "{message}");
    }
}

#[test]
fn bad_partitions_and_limits_refuse_the_request() {
    let (mut cfg, mut d) = job(1, &servers(1, 1));
    let e = DeclEntry { partition: 128, ..entry("w", 40) };
    assert!(d.declare(&cfg, 0, 0, vec![e]).unwrap_err().contains("outside 4..=64"));
    let e = DeclEntry { partition: 2, ..entry("w", 40) };
    assert!(d.declare(&cfg, 0, 0, vec![e]).is_err());
    cfg.max_tensors = 1;
    assert!(d.declare(&cfg, 0, 0, vec![entry("a", 1), entry("b", 1)]).unwrap_err().contains("2 tensors"));
    assert_eq!(d.declare(&cfg, 0, 0, vec![entry("a", 1), entry("a", 1)]).unwrap().len(), 1);
    (cfg.max_tensors, cfg.max_bytes) = (0, 8);
    assert!(d.declare(&cfg, 0, 0, vec![entry("c", 4)]).unwrap_err().contains("MiB"));
}

#[test]
fn a_tensor_is_freed_when_the_last_worker_released_it() {
    let (cfg, mut d) = job(2, &servers(2, 1));
    let specs = declare_all(&cfg, &mut d, &[entry("w", 40)]);
    let key = specs[0].key;
    assert!(d.release(0, 2, vec![key + 1]).unwrap_err().contains("not in use"));
    assert_eq!(d.release(0, 2, vec![key]), Ok(false));
    assert!(d.release(0, 2, vec![key]).unwrap_err().contains("released tensor 'w' twice"));
    assert!(d.take_to_free().is_empty(), "worker 1 still uses it");
    assert_eq!(d.held().0, 1);
    assert_eq!(d.release(1, 2, vec![key]), Ok(false));
    assert_eq!(d.take_to_free(), vec![key]);
    assert_eq!(d.held(), (0, 0));
    // The name is free again: a new tensor with a new key.
    let again = declare_all(&cfg, &mut d, &[entry("w", 40)]);
    assert_ne!(again[0].key, key);
}

#[test]
fn a_declaration_waiting_on_a_worker_that_left_is_named() {
    let (cfg, mut d) = job(3, &servers(1, 1));
    d.declare(&cfg, 0, 0, vec![entry("w", 4)]).unwrap();
    d.declare(&cfg, 1, 0, vec![entry("w", 4)]).unwrap();
    let left: HashSet<u32> = [2].into();
    let why = d.waiting_on_departed(&left).unwrap();
    assert!(why.contains("worker(s) [2] left") && why.contains("tensor 'w'"), "{why}");
    // Worker 0 left after declaring it: worker 1 still waits on worker 2.
    assert!(d.waiting_on_departed(&[0].into()).is_none());
    // Nobody waits on a tensor only departed workers declared.
    let (cfg, mut d) = job(2, &servers(1, 1));
    d.declare(&cfg, 0, 0, vec![entry("w", 4)]).unwrap();
    assert!(d.waiting_on_departed(&[0].into()).is_none());
    assert!(d.stalls(Duration::ZERO).iter().any(|s| s.name == "w" && s.missing == [1] && s.waiting == [0]));
    assert!(d.stalls(Duration::ZERO).is_empty(), "reported once");
}

#[test]
fn a_member_tensor_is_placed_once_its_members_declared_it_and_freed_once_they_released_it() {
    let (cfg, mut d) = job(4, &servers(2, 1));
    let m = |name: &str, members: &[u32]| DeclEntry { members: members.to_vec(), ..entry(name, 40) };
    assert!(d.declare(&cfg, 0, 0, vec![m("g", &[1, 3])]).unwrap_err().contains("not its own"));
    assert!(d.declare(&cfg, 1, 0, vec![m("g", &[1, 4])]).unwrap_err().contains("outside the job's 4 workers"));
    assert!(d.declare(&cfg, 1, 0, vec![m("g", &[1, 3])]).unwrap().is_empty(), "worker 3 has not declared");
    let stall = d.stalls(Duration::ZERO);
    assert!(stall.iter().any(|s| s.name == "g" && s.missing == [3] && s.waiting == [1]), "members only");
    let specs = d.declare(&cfg, 3, 0, vec![m("g", &[1, 3])]).unwrap();
    assert_eq!(specs.len(), 1);
    assert_eq!((specs[0].members.as_slice(), specs[0].relays.len()), (&[1u32, 3][..], 0));
    d.installed(&specs);
    assert_eq!(answers(&mut d).iter().map(|a| a.0).collect::<Vec<_>>(), [1, 3], "members are answered");
    // Declared over other members by one of them: a conflict.
    d.declare(&cfg, 0, 1, vec![m("h", &[0, 2])]).unwrap();
    d.declare(&cfg, 2, 1, vec![m("h", &[0, 2, 3])]).unwrap();
    let a = answers(&mut d);
    assert!(
        a.iter().all(
            |(_, r)| matches!(r, Control::DeclareError { message, .. } if message.contains("over workers [0, 2]"))
        ),
        "{a:?}"
    );
    // Freed once both members released it; a non-member's release is refused.
    let key = specs[0].key;
    assert!(d.release(0, 4, vec![key]).is_err());
    assert_eq!(d.release(1, 4, vec![key]), Ok(false));
    assert!(d.take_to_free().is_empty());
    assert_eq!(d.release(3, 4, vec![key]), Ok(false));
    assert_eq!(d.take_to_free(), vec![key]);
}
