//! Horovod's join on the worker: taking part with zeros in the operations
//! other workers announce while this one is in `join()`.

use std::collections::HashMap;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use crossbeam_channel::bounded;

use super::op::{Extent, Op};
use super::table::JOIN_QUEUE;
use super::{Client, ClientError};
use crate::protocol::{Control, DType};

/// Zero pushes in flight, by name, with the buffers they read.
pub(super) type ZeroPushes = HashMap<String, (Arc<Op>, Vec<u8>)>;

impl Client {
    /// Horovod's join: this worker has no more data. Until every worker has
    /// joined, it takes part in the others' operations with zeros (an
    /// average still divides by every worker, as in Horovod). Returns the
    /// rank that joined last and the names this worker pushed meanwhile.
    /// Nothing of this worker's own may be in flight.
    pub fn join(&self) -> Result<(u32, Vec<String>), ClientError> {
        self.check_usable()?;
        let (tx, rx) = bounded(JOIN_QUEUE);
        {
            let mut t = self.shared.table();
            if !t.in_flight.is_empty() {
                let mut names: Vec<&str> = t.in_flight.iter().map(String::as_str).collect();
                names.sort_unstable();
                return Err(ClientError::Usage(format!(
                    "join() with operations in flight ({}): wait for them first",
                    names.join(", ")
                )));
            }
            if t.join_events.is_some() {
                return Err(ClientError::Usage("join() is already running on another thread".into()));
            }
            t.join_events = Some(tx);
        }
        let result = self.join_loop(&rx);
        self.shared.table().join_events = None;
        result
    }

    fn join_loop(&self, rx: &crossbeam_channel::Receiver<Control>) -> Result<(u32, Vec<String>), ClientError> {
        self.shared.send_ctrl(&Control::Join).map_err(|e| ClientError::Failed(e.to_string()))?;
        let mut pushed: Vec<String> = Vec::new();
        loop {
            let msg = match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(m) => m,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    self.check_usable()?;
                    if let Some(gone) = self.shared.table().left {
                        let why = format!(
                            "worker {gone} left the job without calling join(), so join() on worker {} can never \
                             complete: every worker must join",
                            self.rank
                        );
                        self.shared.fail_job(why.clone());
                        return Err(ClientError::Failed(why));
                    }
                    continue;
                }
                Err(_) => return Err(ClientError::Failed("client closed".into())),
            };
            match msg {
                Control::JoinDone { last } => {
                    let ops: Vec<Arc<Op>> = {
                        let z = self.zero_pushes();
                        pushed.iter().filter_map(|n| z.get(n).map(|(op, _)| op.clone())).collect()
                    };
                    for op in ops {
                        op.wait(None).map_err(|e| ClientError::Failed(e.to_string()))?;
                    }
                    return Ok((last, pushed));
                }
                Control::JoinOp { name, numel, dtype, flags, round, release_after } => {
                    let took_part = self.push_zeros(&name, numel, dtype, (flags, release_after), round)?;
                    pushed.extend(took_part.then_some(name));
                }
                _ => {}
            }
        }
    }

    /// Take part with zeros in the `round`-th use of `name`, which another
    /// worker announced (`JoinOp`: this worker joined). Returns false for a
    /// round this worker took part in already.
    fn push_zeros(
        &self,
        name: &str,
        numel: u64,
        dtype: DType,
        (flags, release_after): (u16, bool),
        round: u32,
    ) -> Result<bool, ClientError> {
        let (done, finished) = {
            let t = self.shared.table();
            (t.uses.get(name).map_or(0, |u| u.round), t.recent_transient.1.contains(name))
        };
        if finished || round.wrapping_sub(done) as i32 <= 0 {
            return Ok(false);
        }
        if flags & crate::protocol::FLAG_INIT != 0 {
            let why = format!(
                "worker {} takes part with zeros (it joined) in the initial \
                 parameters of '{name}' for a server-side optimizer: that is not possible",
                self.rank
            );
            self.shared.fail_job(why.clone());
            return Err(ClientError::Failed(why));
        }
        // A name's rounds follow one another: the last one completes first.
        let last = self.zero_pushes().remove(name);
        if let Some((op, _)) = last {
            op.wait(None).map_err(|e| ClientError::Failed(e.to_string()))?;
        }
        let bytes = usize::try_from(numel)
            .ok()
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| ClientError::Failed(format!("'{name}' is too large")))?;
        let mut zeros = vec![0u8; bytes];
        // SAFETY: `zeros` is kept in `zero_pushes` (its heap buffer does not
        // move) until the op has completed.
        let op = unsafe {
            {
                // Zeros pushed, no result wanted: a header each way per chunk.
                let none = Extent { live: Some((0, 0)), want: Some((0, 0)), live_is_own: false };
                self.push_pull_live(
                    zeros.as_mut_ptr(),
                    bytes,
                    dtype,
                    name,
                    flags,
                    release_after,
                    0,
                    None,
                    none,
                    Default::default(),
                )?
            }
        };
        let mut z = self.zero_pushes();
        z.retain(|_, (op, _)| !op.done());
        z.insert(name.to_string(), (op, zeros));
        Ok(true)
    }

    fn zero_pushes(&self) -> MutexGuard<'_, ZeroPushes> {
        self.zero_pushes.lock().unwrap_or_else(|e| e.into_inner())
    }
}
