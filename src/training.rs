//! The job's training mode (`GRADHUB_ASYNC`, `GRADHUB_STALENESS`):
//! synchronous rounds (every pusher's gradient summed, then every pusher
//! answered), or BytePS's asynchronous mode, where the servers hold the
//! parameters, apply each worker's parameter change as soon as it has
//! arrived and answer that worker alone, optionally with a bound on how far
//! the fastest worker may run ahead of the slowest (stale-synchronous
//! training). The same on every member of a job: the scheduler refuses a
//! member whose mode differs (`scheduler::membership`).

use crate::settings::{self, defaults};

/// How a job's workers wait for each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Training {
    /// Rounds: a result is the sum of every worker's push (the default).
    #[default]
    Synchronous,
    /// Each push applied on arrival and answered to its worker alone; with
    /// `staleness` Some(s), a worker's answer waits until it is at most s
    /// steps ahead of the slowest pusher (None: no bound).
    Asynchronous { staleness: Option<u32> },
}

/// On the wire: the staleness, u32::MAX for no bound.
const UNBOUNDED: u32 = u32::MAX;

impl Training {
    /// The default mode (`GRADHUB_ASYNC`'s default; no staleness bound).
    pub fn default_mode() -> Training {
        if defaults::ASYNC {
            Training::Asynchronous { staleness: None }
        } else {
            Training::Synchronous
        }
    }

    /// `GRADHUB_ASYNC` and `GRADHUB_STALENESS`: the training mode, for a
    /// role whose config was not given it (the Python bindings'
    /// constructors).
    pub fn from_env() -> Result<Training, String> {
        let on = settings::read_flag("GRADHUB_ASYNC")?.unwrap_or(defaults::ASYNC);
        let staleness = match settings::raw("GRADHUB_STALENESS") {
            None => None,
            Some(v) => Some(
                v.parse::<u32>()
                    .map_err(|_| format!("GRADHUB_STALENESS={v:?} is not a count of steps (0, 1, 2, ...)"))?,
            ),
        };
        Training::new(on, staleness)
    }

    /// From the settings' values: `asynchronous` and the staleness bound
    /// (which only an asynchronous job has).
    pub fn new(asynchronous: bool, staleness: Option<u32>) -> Result<Training, String> {
        match (asynchronous, staleness) {
            (false, None) => Ok(Training::Synchronous),
            (false, Some(s)) => Err(format!(
                "GRADHUB_STALENESS={s} bounds the asynchronous mode only: set GRADHUB_ASYNC=1 too (or unset it)"
            )),
            (true, s) => Ok(Training::Asynchronous { staleness: s }),
        }
    }

    pub fn is_asynchronous(self) -> bool {
        matches!(self, Training::Asynchronous { .. })
    }

    /// The staleness bound of an asynchronous job (None: none, or synchronous).
    pub fn staleness(self) -> Option<u32> {
        match self {
            Training::Asynchronous { staleness } => staleness,
            Training::Synchronous => None,
        }
    }

    /// Encoded as a mode byte and the bound.
    pub fn to_wire(self) -> (u8, u32) {
        match self {
            Training::Synchronous => (0, 0),
            Training::Asynchronous { staleness } => (1, staleness.unwrap_or(UNBOUNDED)),
        }
    }

    pub fn from_wire(mode: u8, bound: u32) -> Option<Training> {
        match mode {
            0 => Some(Training::Synchronous),
            1 => Some(Training::Asynchronous { staleness: (bound != UNBOUNDED).then_some(bound) }),
            _ => None,
        }
    }
}

impl std::fmt::Display for Training {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Training::Synchronous => write!(f, "synchronous"),
            Training::Asynchronous { staleness: None } => write!(f, "asynchronous (GRADHUB_ASYNC=1)"),
            Training::Asynchronous { staleness: Some(s) } => {
                write!(f, "asynchronous with staleness {s} (GRADHUB_ASYNC=1 GRADHUB_STALENESS={s})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mode_round_trips_and_a_bound_needs_the_asynchronous_mode() {
        for t in [
            Training::Synchronous,
            Training::Asynchronous { staleness: None },
            Training::Asynchronous { staleness: Some(0) },
            Training::Asynchronous { staleness: Some(7) },
        ] {
            let (m, b) = t.to_wire();
            assert_eq!(Training::from_wire(m, b), Some(t));
        }
        assert_eq!(Training::from_wire(2, 0), None);
        assert!(Training::new(false, Some(2)).unwrap_err().contains("GRADHUB_ASYNC=1"));
        assert_eq!(Training::new(true, Some(2)), Ok(Training::Asynchronous { staleness: Some(2) }));
        assert_eq!(Training::new(false, None), Ok(Training::Synchronous));
    }
}
