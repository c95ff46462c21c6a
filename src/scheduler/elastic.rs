//! Elastic jobs on the shared service: forming a job's next generation.
//!
//! An elastic job runs as a sequence of generations under one name on the
//! service (`service`): when a worker is lost, or one asks to join, the
//! running generation ends on every member, the survivors roll back to
//! their last commit (`gradhub.torch.elastic`) and register again, and the
//! service forms the next generation from whoever registered, with dense
//! ranks. Its servers start fresh instances, as for any job.
//!
//! The rules here are pure (no sockets, no clock of their own), so every
//! case is tested directly:
//! - ranks: workers of the previous generation first, in their old rank
//!   order, so rank 0 is always a survivor holding the committed state
//!   that `sync()` broadcasts; newcomers after them, in arrival order;
//! - when to form: at once when the expected workers registered (the
//!   first generation: the size the job starts with; a later one: the
//!   previous generation's survivors) or `max` did; otherwise, once no one
//!   new came for `settle` (an expected worker died during the reset) and
//!   at least `min` did; a generation still short of `min` after
//!   `timeout` fails with the reason;
//! - who forms it: a candidate whose connection closed while it waited is
//!   left out before the generation forms (`form_or_wait`), so the
//!   generation neither forms with a dead member (failing at its Welcome
//!   and forming again) nor counts it.
//!
//! `Formations` is the service's glue around them (`join`): the workers
//! waiting for each job's next generation, each waiting on its own
//! connection's thread until one of them takes the decision for all. What
//! it needs of the service is `ServiceJobs`.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::mem::MaybeUninit;
use std::net::TcpStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::state::Shared;
use crate::protocol::{ElasticReg, Register};

/// An elastic job's bounds, from its first worker's registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub min: u32,
    pub max: u32,
}

/// How long formation waits (see the module's comment).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub settle: Duration,
    pub timeout: Duration,
}

/// One worker waiting for the next generation.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Its rank in the generation it comes from; None: new to the job.
    pub prev_rank: Option<u32>,
    /// The rank a worker new to the job asked for (`GRADHUB_RANK`, as
    /// `gradhub launch` numbers it): newcomers are ranked by it, so the
    /// first generation numbers the workers as their launcher does.
    pub requested: Option<u32>,
    pub arrived: Instant,
}

/// What formation does now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Wait for more workers, at most until then.
    Wait(Instant),
    /// Form the generation with everyone who registered.
    Form,
    /// Give up: too few workers came.
    Fail(String),
}

/// The rank of each candidate (in the order given) in the new generation.
pub fn assign(cands: &[Candidate]) -> Vec<u32> {
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by_key(|&i| {
        let c = &cands[i];
        (c.prev_rank.is_none(), c.prev_rank, c.requested.unwrap_or(u32::MAX), c.arrived, i)
    });
    let mut ranks = vec![0; cands.len()];
    for (rank, &i) in order.iter().enumerate() {
        ranks[i] = rank as u32;
    }
    ranks
}

/// Whether the generation forms now, given who registered so far.
pub fn decide(bounds: Bounds, timing: Timing, expected: u32, cands: &[Candidate], now: Instant) -> Decision {
    let n = cands.len() as u32;
    let (Some(first), Some(last)) = (cands.iter().map(|c| c.arrived).min(), cands.iter().map(|c| c.arrived).max())
    else {
        return Decision::Wait(now + timing.timeout);
    };
    if n >= bounds.max || (n >= expected.max(1) && n >= bounds.min) {
        return Decision::Form;
    }
    let settled = now.saturating_duration_since(last) >= timing.settle;
    if settled && n >= bounds.min {
        return Decision::Form;
    }
    let deadline = first + timing.timeout;
    if now >= deadline && n >= bounds.min {
        return Decision::Form;
    }
    if now >= deadline {
        return Decision::Fail(format!(
            "only {n} worker(s) registered within {:.0?}, below the job's minimum of {}",
            timing.timeout, bounds.min
        ));
    }
    Decision::Wait(if n >= bounds.min { (last + timing.settle).min(deadline) } else { deadline })
}

/// Whom a generation expects (`decide`'s `expected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// The job's first: the size it starts with.
    First { initial: u32 },
    /// A later one: the last generation's survivors, and the newcomers it
    /// was told of (`Waiting::announced`).
    After { survivors: u32 },
}

/// A waiting candidate as formation sees it.
pub trait Waiting {
    fn candidate(&self) -> Candidate;
    /// Its connection closed: it will never take its rank.
    fn gone(&self) -> bool;
    /// A newcomer the running generation was told of (it re-forms for it).
    fn announced(&self) -> bool;
}

fn expected<T: Waiting>(expect: Expect, cands: &[T]) -> u32 {
    match expect {
        Expect::First { initial } => initial,
        Expect::After { survivors } => survivors + cands.iter().filter(|c| c.announced()).count() as u32,
    }
}

/// `decide`, leaving out first (when it would form) the candidates that
/// are `gone`: they leave `cands`, no longer expected (a survivor, a worker
/// of the first generation; an announced newcomer stops counting as it
/// leaves), and the rest decide again. So a dead candidate neither forms a
/// generation (which would fail at its Welcome and form again) nor is
/// waited for.
pub fn form_or_wait<T: Waiting>(
    bounds: Bounds,
    timing: Timing,
    expect: Expect,
    cands: &mut Vec<T>,
    now: Instant,
) -> Decision {
    let list: Vec<Candidate> = cands.iter().map(T::candidate).collect();
    let decision = decide(bounds, timing, expected(expect, cands), &list, now);
    if decision != Decision::Form || !cands.iter().any(T::gone) {
        return decision;
    }
    let expect = match expect {
        Expect::First { initial } => {
            Expect::First { initial: initial.saturating_sub(cands.iter().filter(|c| c.gone()).count() as u32) }
        }
        Expect::After { survivors } => {
            let lost = cands.iter().filter(|c| c.gone() && c.candidate().prev_rank.is_some()).count() as u32;
            Expect::After { survivors: survivors.saturating_sub(lost) }
        }
    };
    cands.retain(|c| !c.gone());
    let list: Vec<Candidate> = cands.iter().map(T::candidate).collect();
    decide(bounds, timing, expected(expect, cands), &list, now)
}

/// Whether a waiting worker's connection has closed: it sends nothing
/// while it waits for its Welcome, so the end of the stream (or an error)
/// is all a peek can find; pending bytes or none yet mean it is there.
pub fn closed(stream: &TcpStream) -> bool {
    let mut byte = [MaybeUninit::<u8>::uninit()];
    match socket2::SockRef::from(stream).recv_with_flags(&mut byte, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
        Ok(n) => n == 0,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
    }
}

/// What formation needs of the service: its jobs.
pub trait ServiceJobs {
    /// Whether job `name`'s last generation still runs (the next one waits
    /// for it to end everywhere before starting under its name).
    fn running(&self, name: &str) -> bool;
    /// Tell a live generation of job `name` that a worker waits to join
    /// (its workers re-form at their next commit); whether one runs.
    fn announce_joiner(&self, name: &str) -> bool;
    /// Start job `name`'s next generation from `reg` (a worker's
    /// registration, with the generation's size).
    fn start(&self, name: &str, reg: &Register) -> Result<Arc<Shared>, String>;
}

/// A generation formed: its job and each ticket's rank in it.
type Generation = (Arc<Shared>, HashMap<u64, u32>);

/// A worker waiting for the next generation.
struct Waiter {
    ticket: u64,
    cand: Candidate,
    /// Its connection (a clone), to leave it out if it closes; None if it
    /// could not be cloned (then it is taken as there).
    link: Option<TcpStream>,
    /// A newcomer the running generation was told of (`ServiceJobs::announce_joiner`).
    announced: bool,
}

impl Waiting for Waiter {
    fn candidate(&self) -> Candidate {
        self.cand
    }

    fn gone(&self) -> bool {
        self.link.as_ref().is_some_and(closed)
    }

    fn announced(&self) -> bool {
        self.announced
    }
}

/// The workers gathering for an elastic job's next generation.
#[derive(Default)]
struct Forming {
    bounds: Option<Bounds>,
    /// In arrival order.
    waiters: Vec<Waiter>,
    next_ticket: u64,
    /// The decision, taken once by one waiter for all.
    outcome: Option<Result<Generation, String>>,
    /// Waiters that have not taken the outcome yet.
    waiting: usize,
}

/// How long formation waits for an expected worker that does not come
/// before going on without it (`Timing::settle`), in peer timeouts: a
/// second worker lost with the first is not counted among the lost (the
/// job had failed already), so its generation forms this late.
const SETTLE_PEER_TIMEOUTS: u32 = 3;

/// Elastic jobs' formations on the service.
#[derive(Default)]
pub struct Formations {
    /// Workers waiting for their job's next generation, by job name;
    /// `formed` wakes them (a new candidate, a decision, a generation over).
    forming: Mutex<HashMap<String, Forming>>,
    formed: Condvar,
    /// The survivors of each job's last generation, by job name.
    survivors: Mutex<HashMap<String, u32>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Formations {
    /// Job `name`'s generation is over with `survivors` workers not lost:
    /// its next one expects them.
    pub fn ended(&self, name: &str, survivors: u32) {
        lock(&self.survivors).insert(name.to_string(), survivors);
    }

    /// Wake the waiters to look again (a generation ended).
    pub fn wake(&self) {
        self.formed.notify_all();
    }

    /// Wait, with the other workers registering for elastic job `name`
    /// (`reg`, its `e`, on `stream`), for its next generation, then join it
    /// with the rank it gave. `max_workers`: the service's bound on a job.
    pub fn join(
        &self,
        jobs: &impl ServiceJobs,
        max_workers: u32,
        (peer_timeout_ms, join_timeout_ms): (u32, u64),
        name: &str,
        (mut reg, e): (Register, ElasticReg),
        stream: &super::member::Writer,
    ) -> Result<(Arc<Shared>, Register), String> {
        if e.min_workers == 0 || e.min_workers > e.max_workers || e.max_workers > max_workers {
            return Err(format!(
                "an elastic job needs 1 <= minimum <= maximum <= {max_workers} workers, not {} and {}",
                e.min_workers, e.max_workers
            ));
        }
        let bounds = Bounds { min: e.min_workers, max: e.max_workers };
        let timing = Timing {
            settle: Duration::from_millis(u64::from(peer_timeout_ms) * u64::from(SETTLE_PEER_TIMEOUTS)),
            timeout: Duration::from_millis(join_timeout_ms),
        };
        let mut all = lock(&self.forming);
        // A decision still being taken up by its waiters belongs to them.
        while all.get(name).is_some_and(|f| f.outcome.is_some()) {
            all = self.formed.wait(all).unwrap_or_else(|e| e.into_inner());
        }
        let f = all.entry(name.to_string()).or_default();
        match f.bounds {
            Some(b) if b != bounds => {
                return Err(format!(
                    "workers of elastic job '{name}' disagree on its bounds: {}..{} here, {}..{} before",
                    bounds.min, bounds.max, b.min, b.max
                ))
            }
            _ => f.bounds = Some(bounds),
        }
        let ticket = f.next_ticket;
        f.next_ticket += 1;
        let prev_rank = u32::try_from(e.prev_rank).ok();
        // A worker new to the job while a generation runs (not a survivor of
        // one that just ended): the running workers re-form the job at their
        // next commit (`HostsUpdatedInterrupt`), with it.
        let announced = prev_rank.is_none() && jobs.announce_joiner(name);
        if announced {
            log::info!(target: "service", "elastic job '{name}': a worker waits to join; re-forming at the next commit");
        }
        let requested = u32::try_from(reg.requested_rank).ok();
        let cand = Candidate { prev_rank, requested, arrived: Instant::now() };
        let link = stream.socket().ok();
        f.waiters.push(Waiter { ticket, cand, link, announced });
        f.waiting += 1;
        self.formed.notify_all();
        loop {
            let Some(f) = all.get_mut(name) else { return Err("the elastic job's formation was lost".into()) };
            if let Some(outcome) = &f.outcome {
                let mine = match outcome {
                    Ok((shared, ranks)) => ranks
                        .get(&ticket)
                        .map(|&r| (shared.clone(), r, ranks.len() as u32))
                        .ok_or_else(|| "this worker was left out of the elastic job's generation".to_string()),
                    Err(why) => Err(why.clone()),
                };
                f.waiting -= 1;
                if f.waiting == 0 {
                    all.remove(name);
                }
                self.formed.notify_all();
                let (shared, rank, size) = mine?;
                (reg.requested_rank, reg.num_workers) = (rank as i32, size);
                // The launcher's local ranks describe the first generation only: the scheduler's own count.
                (reg.local_rank, reg.local_size) = (-1, -1);
                return Ok((shared, reg));
            }
            let now = Instant::now();
            let expect = lock(&self.survivors)
                .get(name)
                .map_or(Expect::First { initial: e.initial }, |&survivors| Expect::After { survivors });
            // The previous generation ends everywhere before the next starts under its name.
            let decision = if jobs.running(name) {
                Decision::Wait(now + Duration::from_millis(50))
            } else {
                form_or_wait(bounds, timing, expect, &mut f.waiters, now)
            };
            match decision {
                Decision::Wait(until) => {
                    let wait = until.saturating_duration_since(now).max(Duration::from_millis(1));
                    all = self.formed.wait_timeout(all, wait).unwrap_or_else(|e| e.into_inner()).0;
                }
                Decision::Form => {
                    let cands: Vec<Candidate> = f.waiters.iter().map(|w| w.cand).collect();
                    let ranks = assign(&cands);
                    let mut first = reg.clone();
                    first.num_workers = cands.len() as u32;
                    // Its rank is the generation's to give (a newcomer may have
                    // asked for one beyond this generation's size).
                    first.requested_rank = -1;
                    let started = jobs.start(name, &first);
                    if started.is_ok() {
                        log::info!(target: "service", "elastic job '{name}': a generation of {} workers", cands.len());
                    }
                    let tickets = f.waiters.iter().map(|w| w.ticket).zip(ranks).collect();
                    f.outcome = Some(started.map(|shared| (shared, tickets)));
                    f.waiters.clear();
                    lock(&self.survivors).remove(name);
                    self.formed.notify_all();
                }
                Decision::Fail(why) => {
                    f.outcome = Some(Err(format!("elastic job '{name}': {why}")));
                    f.waiters.clear();
                    self.formed.notify_all();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    const TIMING: Timing = Timing { settle: Duration::from_millis(1000), timeout: Duration::from_secs(60) };

    #[test]
    fn survivors_keep_their_order_and_rank_0_is_always_a_survivor() {
        let t0 = Instant::now();
        // Old ranks 3 and 1 survived (2 died), a newcomer came first, another later.
        let cands = [
            Candidate { prev_rank: None, requested: None, arrived: at(t0, 0) },
            Candidate { prev_rank: Some(3), requested: None, arrived: at(t0, 5) },
            Candidate { prev_rank: Some(1), requested: None, arrived: at(t0, 9) },
            Candidate { prev_rank: None, requested: None, arrived: at(t0, 7) },
        ];
        assert_eq!(assign(&cands), vec![2, 1, 0, 3]);
        // Dense whatever the gaps: 0..n.
        let mut r = assign(&cands);
        r.sort_unstable();
        assert_eq!(r, vec![0, 1, 2, 3]);
    }

    #[test]
    fn newcomers_take_the_ranks_they_asked_for_in_order() {
        let t0 = Instant::now();
        // The first generation: the launcher's workers 0..3 arriving in another order.
        let c = |requested, ms| Candidate { prev_rank: None, requested, arrived: at(t0, ms) };
        assert_eq!(assign(&[c(Some(2), 0), c(Some(0), 5), c(Some(1), 9)]), vec![2, 0, 1]);
        // Survivors still come first; a newcomer asking for nothing comes after those that asked.
        let survivor = Candidate { prev_rank: Some(0), requested: Some(5), arrived: at(t0, 20) };
        assert_eq!(assign(&[c(None, 0), c(Some(7), 5), survivor]), vec![2, 1, 0]);
    }

    #[test]
    fn forms_at_once_at_the_maximum() {
        let t0 = Instant::now();
        let cands: Vec<_> =
            (0..4).map(|i| Candidate { prev_rank: Some(i), requested: None, arrived: at(t0, 0) }).collect();
        let b = Bounds { min: 2, max: 4 };
        assert_eq!(decide(b, TIMING, 8, &cands, at(t0, 1)), Decision::Form);
        assert_eq!(decide(b, TIMING, 8, &cands[..3], at(t0, 1)), Decision::Wait(at(t0, 1000)));
    }

    #[test]
    fn forms_at_once_when_the_expected_workers_came() {
        let t0 = Instant::now();
        let b = Bounds { min: 1, max: 8 };
        let cands: Vec<_> =
            (0..3).map(|i| Candidate { prev_rank: Some(i), requested: None, arrived: at(t0, 0) }).collect();
        assert_eq!(decide(b, TIMING, 3, &cands, at(t0, 1)), Decision::Form);
        assert_eq!(decide(b, TIMING, 3, &cands[..2], at(t0, 1)), Decision::Wait(at(t0, 1000)));
        // Never below the minimum, even when fewer were expected (survivors of a loss).
        let b = Bounds { min: 3, max: 3 };
        assert_eq!(decide(b, TIMING, 2, &cands[..2], at(t0, 1)), Decision::Wait(at(t0, 60_000)));
        match decide(b, TIMING, 2, &cands[..2], at(t0, 60_000)) {
            Decision::Fail(why) => assert!(why.contains("minimum of 3"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn forms_once_settled_with_at_least_the_minimum() {
        let t0 = Instant::now();
        let b = Bounds { min: 2, max: 8 };
        let cands = [
            Candidate { prev_rank: Some(0), requested: None, arrived: at(t0, 0) },
            Candidate { prev_rank: Some(2), requested: None, arrived: at(t0, 300) },
        ];
        // A later arrival restarts the settle time.
        assert_eq!(decide(b, TIMING, 8, &cands, at(t0, 900)), Decision::Wait(at(t0, 1300)));
        assert_eq!(decide(b, TIMING, 8, &cands, at(t0, 1300)), Decision::Form);
        // Below the minimum, settling is not enough: wait to the timeout.
        assert_eq!(decide(b, TIMING, 8, &cands[..1], at(t0, 5000)), Decision::Wait(at(t0, 60_000)));
    }

    #[test]
    fn fails_with_the_reason_below_the_minimum_at_the_timeout() {
        let t0 = Instant::now();
        let b = Bounds { min: 3, max: 8 };
        let cands = [Candidate { prev_rank: Some(1), requested: None, arrived: at(t0, 0) }];
        match decide(b, TIMING, 8, &cands, at(t0, 60_000)) {
            Decision::Fail(why) => assert!(why.contains("only 1 worker(s)") && why.contains("minimum of 3"), "{why}"),
            other => panic!("{other:?}"),
        }
        // At the minimum by then, it forms instead.
        let two = [cands[0], Candidate { prev_rank: None, requested: None, arrived: at(t0, 59_999) }];
        assert_eq!(decide(Bounds { min: 2, max: 8 }, TIMING, 8, &two, at(t0, 60_000)), Decision::Form);
    }

    /// A candidate for `form_or_wait`: whether its connection closed, whether announced.
    struct Fake(Candidate, bool, bool);

    impl Waiting for Fake {
        fn candidate(&self) -> Candidate {
            self.0
        }
        fn gone(&self) -> bool {
            self.1
        }
        fn announced(&self) -> bool {
            self.2
        }
    }

    #[test]
    fn a_candidate_whose_connection_closed_is_left_out_and_not_waited_for() {
        let t0 = Instant::now();
        let b = Bounds { min: 2, max: 8 };
        let c = |prev: Option<u32>, ms| Candidate { prev_rank: prev, requested: None, arrived: at(t0, ms) };
        // The first generation: 4 expected, 4 came, one of them has gone.
        let mut cands: Vec<Fake> = (0..4).map(|i| Fake(c(None, i), i == 1, false)).collect();
        let first = Expect::First { initial: 4 };
        assert_eq!(form_or_wait(b, TIMING, first, &mut cands, at(t0, 10)), Decision::Form);
        // It formed with the three there (no one else is expected), ranked among themselves.
        assert_eq!(cands.iter().map(|f| f.0.arrived).collect::<Vec<_>>(), vec![at(t0, 0), at(t0, 2), at(t0, 3)]);
        assert_eq!(assign(&cands.iter().map(|f| f.0).collect::<Vec<_>>()), vec![0, 1, 2]);

        // A later one: 2 survivors and a newcomer the job re-formed for; the newcomer has gone.
        let after = Expect::After { survivors: 2 };
        let mut cands =
            vec![Fake(c(None, 0), true, true), Fake(c(Some(1), 5), false, false), Fake(c(Some(0), 6), false, false)];
        assert_eq!(form_or_wait(b, TIMING, after, &mut cands, at(t0, 7)), Decision::Form);
        assert_eq!(assign(&cands.iter().map(|f| f.0).collect::<Vec<_>>()), vec![1, 0]);
        // A survivor that has gone: the other is not kept waiting for it.
        let mut cands = vec![Fake(c(Some(0), 0), false, false), Fake(c(Some(1), 5), true, false)];
        assert_eq!(form_or_wait(b, TIMING, after, &mut cands, at(t0, 7)), Decision::Wait(at(t0, 60_000)));
        assert_eq!(cands.len(), 1);
        // Below the minimum once it left: the rest wait (for the timeout), and fail with the reason.
        match form_or_wait(b, TIMING, after, &mut cands, at(t0, 60_000)) {
            Decision::Fail(why) => assert!(why.contains("only 1 worker(s)"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_candidate_that_has_gone_is_only_looked_for_when_the_generation_would_form() {
        let t0 = Instant::now();
        let b = Bounds { min: 2, max: 8 };
        // Waiting (2 of 4 came): nothing is removed yet, the decision is decide's.
        let mut cands = vec![
            Fake(Candidate { prev_rank: None, requested: None, arrived: at(t0, 0) }, true, false),
            Fake(Candidate { prev_rank: None, requested: None, arrived: at(t0, 1) }, false, false),
        ];
        let first = Expect::First { initial: 4 };
        assert_eq!(form_or_wait(b, TIMING, first, &mut cands, at(t0, 2)), Decision::Wait(at(t0, 1001)));
        assert_eq!(cands.len(), 2);
        // Settled with the minimum: it would form, but one has gone; the other waits on
        // (below the minimum: to the timeout, from the first arrival still there).
        assert_eq!(form_or_wait(b, TIMING, first, &mut cands, at(t0, 1001)), Decision::Wait(at(t0, 60_001)));
        assert_eq!(cands.len(), 1);
    }

    #[test]
    fn a_closed_connection_is_seen_and_an_open_one_is_not() {
        use std::io::Write;
        use std::net::TcpListener;

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut worker = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (served, _) = listener.accept().unwrap();
        assert!(!closed(&served));
        // Bytes waiting (unread) are not a close, and a peek leaves them.
        worker.write_all(b"x").unwrap();
        let t0 = Instant::now();
        while !matches!(served.peek(&mut [0u8]), Ok(1)) {
            assert!(t0.elapsed() < Duration::from_secs(10));
        }
        assert!(!closed(&served));
        drop(worker);
        // The peer's end: after the byte still waiting, so a close is seen once it is read.
        let mut byte = [0u8];
        std::io::Read::read_exact(&mut &served, &mut byte).unwrap();
        let t0 = Instant::now();
        while !closed(&served) {
            assert!(t0.elapsed() < Duration::from_secs(10), "the close was never seen");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
