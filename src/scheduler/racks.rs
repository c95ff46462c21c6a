//! Racks, and whether a job reduces within each rack before the core
//! (PHub §3.4's hierarchical reduction).
//!
//! Hosts in a rack share a top-of-rack switch with full bisection
//! bandwidth; the links from racks to the network core are oversubscribed.
//! With one level, every pusher in a rack sends its share of every chunk
//! owned in another rack across the core, and gets the result back the same
//! way. With two levels, each rack first sums a chunk on a server thread of
//! its own (the chunk's relay), which pushes only the rack's sum across the
//! core to the chunk's owner and hands the result back to the rack: 1/N of
//! the cross-rack traffic for N pushers per rack, for one more hop.
//!
//! PHub decides with a model of the time per model byte (arXiv version):
//! two levels pay when N(R−1)/(R·B_core) > max(N/B_rack, 1/B_worker) + C,
//! C = (R−1)/(R·min(B_rack, B_core)): the left side is the core carrying
//! every pusher's cross-rack traffic; the right, the rack's servers taking
//! in the rack's pushes (or each pusher sending one model) and then the
//! racks' sums crossing the core. B_rack is what the rack's servers can take
//! in together (their links), B_core one rack's link to the core.
//!
//! gradhub uses that model with two changes, both measured
//! (docs/benchmarks.md, "Racks"): with owners spread over the racks, a
//! rack's core link carries the results of its own chunks to the other
//! racks as well as its pushes out, so both levels' core terms are twice
//! PHub's (one level 2N(R−1)/R, two levels 2(R−1)/R); and the two levels
//! overlap chunk by chunk, so their costs are a max, not a sum. With PHub's
//! literal model, one level was chosen on a core as fast as a host link,
//! where two levels ran 1.25 times as fast.

/// `GRADHUB_RACK_REDUCE`: decide with PHub's model, or force either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RackMode {
    Auto,
    On,
    Off,
}

impl RackMode {
    pub fn parse(s: &str) -> Option<RackMode> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "" => Some(RackMode::Auto),
            "on" | "1" | "true" | "yes" => Some(RackMode::On),
            "off" | "0" | "false" | "no" => Some(RackMode::Off),
            _ => None,
        }
    }
}

/// The bandwidths PHub's model needs, in Gbit/s (0: not given).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bandwidths {
    /// Each host's link (workers' and servers').
    pub link_gbit: f64,
    /// Each rack's link to the core.
    pub core_gbit: f64,
}

/// What the scheduler tells every member about racks.
#[derive(Debug, Clone, PartialEq)]
pub struct RackPlan {
    /// Rack names, sorted; one rack named "" when none was given.
    pub racks: Vec<String>,
    pub worker_racks: Vec<u32>,
    pub server_racks: Vec<u32>,
    pub reduce: bool,
    /// Why, for the log.
    pub why: String,
}

/// PHub's model as gradhub uses it (see above): (one level's cost, two
/// levels' cost), seconds per model gigabit through the busiest link; two
/// levels pay when the first is larger. `pushers` per rack, `racks` racks,
/// bandwidths in Gbit/s.
pub fn phub_costs(pushers: f64, racks: f64, worker: f64, rack: f64, core: f64) -> (f64, f64) {
    let cross = 2.0 * (racks - 1.0) / racks;
    let flat = pushers * cross / core;
    let two = (pushers / rack).max(1.0 / worker).max(cross / rack.min(core));
    (flat, two)
}

/// Group members into racks and decide. `worker_racks` by rank and
/// `servers` (each with the rack name it registered, by rank) give the
/// names; `pushers` is which machine pushes for each worker (its host index
/// with the host stage, else its rank). Every member gives a rack or none
/// does; a rack with workers needs a server of its own for two levels.
pub fn plan(
    worker_racks: &[String],
    server_racks: &[String],
    pushers: &[usize],
    mode: RackMode,
    bw: Bandwidths,
) -> Result<RackPlan, String> {
    let given = worker_racks.iter().chain(server_racks).filter(|r| !r.is_empty()).count();
    let total = worker_racks.len() + server_racks.len();
    if given != 0 && given != total {
        let missing: Vec<String> = worker_racks
            .iter()
            .enumerate()
            .filter(|(_, r)| r.is_empty())
            .map(|(i, _)| format!("worker {i}"))
            .chain(server_racks.iter().enumerate().filter(|(_, r)| r.is_empty()).map(|(i, _)| format!("server {i}")))
            .collect();
        return Err(format!(
            "{} gave no rack while other members did: set GRADHUB_RACK (--rack) for every member or none",
            missing.join(", ")
        ));
    }
    let mut racks: Vec<String> = worker_racks.iter().chain(server_racks).cloned().collect();
    racks.sort();
    racks.dedup();
    if racks.is_empty() {
        racks.push(String::new());
    }
    let index = |name: &String| racks.iter().position(|r| r == name).unwrap_or(0) as u32;
    let w_racks: Vec<u32> = worker_racks.iter().map(index).collect();
    let s_racks: Vec<u32> = server_racks.iter().map(index).collect();
    let mut plan = RackPlan { racks, worker_racks: w_racks, server_racks: s_racks, reduce: false, why: String::new() };
    let r = plan.racks.len();
    if r < 2 {
        plan.why = "one rack".into();
        return Ok(plan);
    }
    // Pushing machines per rack, and the links of each rack's servers.
    let mut machines: Vec<Vec<usize>> = vec![Vec::new(); r];
    for (rank, &rk) in plan.worker_racks.iter().enumerate() {
        let m = pushers.get(rank).copied().unwrap_or(rank);
        if !machines[rk as usize].contains(&m) {
            machines[rk as usize].push(m);
        }
    }
    let served: Vec<usize> = (0..r).map(|i| plan.server_racks.iter().filter(|&&x| x as usize == i).count()).collect();
    let bare: Vec<&String> =
        (0..r).filter(|&i| !machines[i].is_empty() && served[i] == 0).map(|i| &plan.racks[i]).collect();
    let working = machines.iter().filter(|m| !m.is_empty()).count();
    if mode == RackMode::Off {
        plan.why = "two-level reduction is off (GRADHUB_RACK_REDUCE=off)".into();
        return Ok(plan);
    }
    if !bare.is_empty() || working < 2 {
        let why = match bare.is_empty() {
            false => format!("rack(s) {bare:?} hold workers but no server to sum their chunks first"),
            true => "only one rack holds workers".into(),
        };
        if mode == RackMode::On {
            return Err(format!("two-level reduction (GRADHUB_RACK_REDUCE=on) is impossible: {why}"));
        }
        plan.why = format!("one level: {why}");
        return Ok(plan);
    }
    if mode == RackMode::On {
        plan.reduce = true;
        plan.why = "two levels: forced (GRADHUB_RACK_REDUCE=on)".into();
        return Ok(plan);
    }
    // PHub's model for the most crowded rack; a server's link counts once
    // however many threads it has.
    let link = if bw.link_gbit > 0.0 { bw.link_gbit } else { 10.0 };
    let (core, assumed) = match bw.core_gbit > 0.0 {
        true => (bw.core_gbit, ""),
        false => (link, " (GRADHUB_CORE_GBIT not given: taken as one host link)"),
    };
    let n = machines.iter().map(Vec::len).max().unwrap_or(1) as f64;
    let fewest = (0..r).filter(|&i| !machines[i].is_empty()).map(|i| served[i]).min().unwrap_or(1).max(1);
    let rack_bw = fewest as f64 * link;
    let (flat, two) = phub_costs(n, r as f64, link, rack_bw, core);
    plan.reduce = flat > two;
    plan.why = format!(
        "{}: PHub's model with {n:.0} pushing machine(s) per rack, {r} racks, host links {link} Gbit/s, \
         core links {core} Gbit/s{assumed}, the rack's servers {rack_bw} Gbit/s: one level {flat:.3} s, \
         two levels {two:.3} s per model gigabit through the busiest link (GRADHUB_RACK_REDUCE=on|off overrides)",
        if plan.reduce { "two levels" } else { "one level" }
    );
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(names: &[&str]) -> Vec<String> {
        names.iter().map(|x| x.to_string()).collect()
    }

    const BW: Bandwidths = Bandwidths { link_gbit: 1.0, core_gbit: 0.0 };

    #[test]
    fn the_model_weighs_the_core_against_the_rack_in_both_directions() {
        // 4 pushers per rack, 2 racks, core as fast as a host link, one
        // server link per pusher: one level puts 4 models' worth on the
        // core (pushes out, results out), two levels 1.
        let (flat, two) = phub_costs(4.0, 2.0, 1.0, 4.0, 1.0);
        assert!((flat - 4.0).abs() < 1e-12 && (two - 1.0).abs() < 1e-12, "{flat} {two}");
        // 2 pushers per rack, the core four times slower: 8 against 4.
        let (flat, two) = phub_costs(2.0, 2.0, 1.0, 2.0, 0.25);
        assert!((flat - 8.0).abs() < 1e-12 && (two - 4.0).abs() < 1e-12, "{flat} {two}");
        // One pusher per rack: nothing to sum first; one level (a tie) stays.
        let (flat, two) = phub_costs(1.0, 2.0, 1.0, 1.0, 1.0);
        assert!(flat <= two, "{flat} {two}");
        // A rack whose one server link must take 4 pushers' shares: the
        // rack is the bottleneck of two levels, and one level wins on a fast core.
        let (flat, two) = phub_costs(4.0, 2.0, 1.0, 1.0, 8.0);
        assert!(flat < two, "{flat} {two}");
    }

    #[test]
    fn racks_are_numbered_by_name_and_decided_by_the_model() {
        let w = s(&["b", "b", "a", "a"]);
        // A server on each host (colocated).
        let sr = s(&["a", "a", "b", "b"]);
        let fast_core = Bandwidths { link_gbit: 1.0, core_gbit: 8.0 };
        let p = plan(&w, &sr, &[0, 1, 2, 3], RackMode::Auto, fast_core).unwrap();
        assert_eq!(p.racks, s(&["a", "b"]));
        assert_eq!(p.worker_racks, vec![1, 1, 0, 0]);
        assert_eq!(p.server_racks, vec![0, 0, 1, 1]);
        assert!(!p.reduce, "{}", p.why);
        assert!(p.why.starts_with("one level: PHub's model"), "{}", p.why);
        // A core as fast as a host link already carries more with one level.
        for core_gbit in [1.0, 0.25] {
            let core = Bandwidths { link_gbit: 1.0, core_gbit };
            let p = plan(&w, &sr, &[0, 1, 2, 3], RackMode::Auto, core).unwrap();
            assert!(p.reduce && p.why.starts_with("two levels: PHub's model"), "{}", p.why);
        }
        let slow_core = Bandwidths { link_gbit: 1.0, core_gbit: 0.25 };
        // Workers on one host (host stage) push as one machine: one level.
        let p = plan(&w, &sr, &[0, 0, 1, 1], RackMode::Auto, slow_core).unwrap();
        assert!(!p.reduce, "{}", p.why);
        let p = plan(&w, &sr, &[0, 1, 2, 3], RackMode::On, fast_core).unwrap();
        assert!(p.reduce);
        let p = plan(&w, &sr, &[0, 1, 2, 3], RackMode::Off, slow_core).unwrap();
        assert!(!p.reduce);
    }

    #[test]
    fn no_racks_one_rack_and_wrong_settings() {
        let p = plan(&s(&["", ""]), &s(&[""]), &[0, 1], RackMode::On, BW).unwrap();
        assert_eq!((p.racks.len(), p.reduce), (1, false));
        assert_eq!(p.worker_racks, vec![0, 0]);
        let e = plan(&s(&["a", ""]), &s(&["a"]), &[0, 1], RackMode::Auto, BW).unwrap_err();
        assert!(e.contains("worker 1 gave no rack"), "{e}");
        // Rack b has workers and no server: forced is an error, auto says why.
        let e = plan(&s(&["a", "b"]), &s(&["a"]), &[0, 1], RackMode::On, BW).unwrap_err();
        assert!(e.contains("[\"b\"] hold workers but no server"), "{e}");
        let p = plan(&s(&["a", "b"]), &s(&["a"]), &[0, 1], RackMode::Auto, BW).unwrap();
        assert!(!p.reduce && p.why.contains("no server"), "{}", p.why);
        // A rack of CPU-only servers alone: only one rack holds workers.
        let p = plan(&s(&["a", "a"]), &s(&["a", "b"]), &[0, 1], RackMode::Auto, BW).unwrap();
        assert!(!p.reduce && p.why.contains("only one rack"), "{}", p.why);
    }
}
