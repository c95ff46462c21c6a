//! Horovod's join and process sets (`JoinOps`, edited only here): which
//! workers joined (have no more data), and which announced operations each
//! joined worker or worker outside a set must push zeros for. Pure: the
//! caller (`state`) sends what these decide.

use std::collections::{HashMap, HashSet};

/// What a worker's join led to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum JoinStep {
    /// Others still have data: they announce their operations to it.
    Joined,
    /// Every worker joined, this one last: the join is over.
    AllJoined,
}

#[derive(Default)]
pub(super) struct JoinOps {
    /// The workers that joined so far.
    joined: HashSet<u32>,
    /// By name, the latest round announced and the joined workers it went to.
    announced: HashMap<String, (u32, HashSet<u32>)>,
}

impl JoinOps {
    /// Worker `rank` has no more data (of `num_workers`); an error names a
    /// second join.
    pub fn join(&mut self, rank: u32, num_workers: u32) -> Result<JoinStep, String> {
        if !self.joined.insert(rank) {
            return Err(format!("worker {rank} called join() twice"));
        }
        if self.joined.len() == num_workers as usize {
            self.joined.clear();
            self.announced.clear();
            return Ok(JoinStep::AllJoined);
        }
        Ok(JoinStep::Joined)
    }

    /// An operation (`name`, `round`) a worker started while others have
    /// joined: the joined workers it must go to, each round to each of them
    /// once, whoever announces it; rounds of one name only move forward.
    pub fn targets(&mut self, name: &str, round: u32) -> Vec<u32> {
        if self.joined.is_empty() {
            return Vec::new();
        }
        let entry = self.announced.entry(name.to_string()).or_insert((round, HashSet::new()));
        if round.wrapping_sub(entry.0) as i32 > 0 {
            *entry = (round, HashSet::new());
        } else if round != entry.0 {
            return Vec::new();
        }
        let targets: Vec<u32> = self.joined.iter().copied().filter(|r| !entry.1.contains(r)).collect();
        entry.1.extend(targets.iter().copied());
        targets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut v: Vec<u32>) -> Vec<u32> {
        v.sort_unstable();
        v
    }

    #[test]
    fn a_join_completes_when_every_worker_joined_and_not_twice() {
        let mut j = JoinOps::default();
        assert_eq!(j.join(2, 3), Ok(JoinStep::Joined));
        assert!(j.join(2, 3).unwrap_err().contains("worker 2 called join() twice"));
        assert_eq!(j.join(0, 3), Ok(JoinStep::Joined));
        assert_eq!(j.join(1, 3), Ok(JoinStep::AllJoined));
        // Over: nobody joined, nothing is forwarded, and a new join may start.
        assert!(j.targets("t", 0).is_empty());
        assert_eq!(j.join(2, 3), Ok(JoinStep::Joined));
    }

    #[test]
    fn each_round_goes_to_each_joined_worker_once_and_rounds_move_forward() {
        let mut j = JoinOps::default();
        assert!(j.targets("t", 5).is_empty(), "nobody joined yet");
        j.join(1, 4).unwrap();
        assert_eq!(j.targets("t", 5), vec![1]);
        assert!(j.targets("t", 5).is_empty(), "announced again by another worker");
        j.join(3, 4).unwrap();
        assert_eq!(j.targets("t", 5), vec![3], "only the newly joined one");
        assert!(j.targets("t", 4).is_empty(), "an older round is not sent");
        assert_eq!(sorted(j.targets("t", 6)), vec![1, 3]);
        // Rounds wrap around.
        assert_eq!(sorted(j.targets("w", u32::MAX)), vec![1, 3]);
        assert_eq!(sorted(j.targets("w", 0)), vec![1, 3]);
    }
}
