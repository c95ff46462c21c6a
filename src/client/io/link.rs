//! A link's life (`LinkState`) and what its errors mean (`broke`,
//! `mendable`). A leaf: it imports no other part.

use crate::protocol::ReadError;
use crate::transport::ConnError;

/// A link's life, which only moves forward (a link may skip states),
/// except from `Mending` back to `Live`:
/// - `Live`: in use;
/// - `Mending`: its socket failed with its server not known lost: it is
///   dialled again (`mend`); nothing is written meanwhile;
/// - `Broken`: its socket failed (with failover on): nothing is written to
///   it, and the I/O thread waits for the scheduler to say where its
///   chunks went (`IoCore::check_lost` bounds that wait);
/// - `WrittenOff`: the scheduler says its server was lost: nothing read
///   from it counts any more (a frozen server may come back and answer
///   rounds that moved), even before the failover is applied;
/// - `Dead`: the failover is applied: deregistered, never touched again.
#[repr(u8)]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum LinkState {
    Live = 0,
    Mending = 1,
    Broken = 2,
    WrittenOff = 3,
    Dead = 4,
}

impl LinkState {
    pub(super) fn of(v: u8) -> LinkState {
        match v {
            0 => LinkState::Live,
            1 => LinkState::Mending,
            2 => LinkState::Broken,
            3 => LinkState::WrittenOff,
            _ => LinkState::Dead,
        }
    }
}

/// Whether an error means the connection broke (its server may be lost),
/// not that the server said or sent something wrong.
pub(super) fn broke(e: &ConnError) -> bool {
    matches!(e, ConnError::Io(_) | ConnError::Read(ReadError::Closed | ReadError::ClosedMidFrame | ReadError::Io(_)))
}

/// The link broke in a way a new connection may mend (`mend`): `broke`,
/// or a frame that changed on the way.
pub(super) fn mendable(e: &ConnError) -> bool {
    broke(e) || e.changed_on_the_way()
}
