//! Installs: the batches of tensor specs (declarations, takeovers, moves)
//! sent to the servers, and which servers acknowledged each. A batch is
//! installed when every server still in the job that was sent it acked.

use std::collections::{HashMap, HashSet};

#[derive(Default)]
pub(super) struct Installs {
    next_batch: u32,
    /// Which servers (ranks) installed each batch.
    acks: HashMap<u32, HashSet<u32>>,
    /// The first batch each server that joined the running job was sent.
    joined_at: HashMap<u32, u32>,
    /// The chunks servers kept where they are in a move (by batch).
    move_kept: HashMap<u32, Vec<(u32, u32)>>,
}

impl Installs {
    /// The number of the next batch (batches are installed in this order).
    pub fn next_batch(&mut self) -> u32 {
        let b = self.next_batch;
        self.next_batch += 1;
        b
    }

    /// Server `rank` joined the running job: it is sent the batches from now on.
    pub fn server_joined(&mut self, rank: u32) {
        self.joined_at.insert(rank, self.next_batch);
    }

    pub fn ack(&mut self, batch: u32, rank: u32) {
        self.acks.entry(batch).or_default().insert(rank);
    }

    /// A move's ack, with the chunks (key, chunk) the server kept.
    pub fn ack_move(&mut self, batch: u32, rank: u32, kept: Vec<(u32, u32)>) {
        self.move_kept.entry(batch).or_default().extend(kept);
        self.ack(batch, rank);
    }

    /// Whether every server in `servers` (those still in the job) installed `batch`.
    pub fn installed_everywhere(&self, batch: u32, mut servers: impl Iterator<Item = u32>) -> bool {
        let acked = self.acks.get(&batch);
        // A server that joined later was not sent earlier batches.
        let sent = |rank: u32| self.joined_at.get(&rank).is_none_or(|&first| batch >= first);
        servers.all(|rank| !sent(rank) || acked.is_some_and(|a| a.contains(&rank)))
    }

    /// `batch` is installed (or will never be): forget its acks.
    pub fn forget(&mut self, batch: u32) {
        self.acks.remove(&batch);
    }

    /// The chunks kept where they are in move `batch`.
    pub fn take_kept(&mut self, batch: u32) -> Vec<(u32, u32)> {
        self.move_kept.remove(&batch).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::Installs;

    #[test]
    fn a_batch_waits_for_every_server_it_was_sent_to() {
        let mut i = Installs::default();
        let b0 = i.next_batch();
        assert!(!i.installed_everywhere(b0, [0, 1].into_iter()));
        i.ack(b0, 0);
        assert!(!i.installed_everywhere(b0, [0, 1].into_iter()));
        i.ack(b0, 1);
        assert!(i.installed_everywhere(b0, [0, 1].into_iter()));
        // Server 2 joins: not waited for on earlier batches, waited for on later ones.
        i.server_joined(2);
        assert!(i.installed_everywhere(b0, [0, 1, 2].into_iter()));
        let b1 = i.next_batch();
        i.ack(b1, 0);
        i.ack(b1, 1);
        assert!(!i.installed_everywhere(b1, [0, 1, 2].into_iter()));
        i.ack_move(b1, 2, vec![(7, 3)]);
        assert!(i.installed_everywhere(b1, [0, 1, 2].into_iter()));
        // A lost server is no longer in the list and no longer waited for.
        let b2 = i.next_batch();
        i.ack(b2, 0);
        assert!(i.installed_everywhere(b2, [0].into_iter()));
        assert_eq!(i.take_kept(b1), vec![(7, 3)]);
        assert!(i.take_kept(b1).is_empty());
        i.forget(b1);
        assert!(!i.installed_everywhere(b1, [0].into_iter()));
    }
}
