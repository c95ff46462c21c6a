//! Timelines: Chrome-trace / Perfetto JSON in the format of the workers'
//! Python timeline (`python/gradhub/timeline.py`), so `gradhub timeline
//! merge` puts a job's servers and workers on one clock.
//!
//! - A server (`gradhub server --timeline`) records, per chunk round, how long
//!   it waited for its pushers (from the first push to the last, and which
//!   worker came last) and how long finishing it took (averaging, rounding
//!   to 16 bits, the server-side optimizer): `Trace::round`.
//! - A worker (its timeline started with `{rank}` or as worker 0) records,
//!   per chunk it pushes, the time queued behind higher priorities and
//!   credit, on the wire until the server has it all, and until the result
//!   is back (the other workers, the sum, the result in flight):
//!   `Trace::chunk`, beside the Python timeline's operations.
//!
//! Events are formatted where they happen and handed to a writer thread
//! over a bounded channel, without waiting: when the writer falls behind,
//! events are dropped and counted (said at the end), never the data path
//! slowed.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::logging::json_str;

/// Events waiting for the writer at most.
const QUEUE: usize = 1 << 16;

/// Rows of a worker's chunk events start here (its Python timeline numbers
/// its tensors' rows from 1, in the same process).
const CHUNK_ROWS: u32 = 100_000;

pub struct Trace {
    tx: Sender<String>,
    t0: Instant,
    pid: u32,
    who: String,
    dropped: AtomicU64,
    /// Worker traces: each tensor's row, by name.
    rows: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

/// What a round of a chunk looked like at its server (see `Trace::round`).
pub struct Round<'a> {
    pub thread: u32,
    pub tensor: &'a str,
    pub chunk: u32,
    pub round: u32,
    pub bytes: usize,
    pub first_push: Instant,
    pub last_push: Instant,
    pub first: u32,
    pub last: u32,
    pub finished: Instant,
}

/// What a pushed chunk looked like at its worker (see `Trace::chunk`).
pub struct ChunkStages<'a> {
    pub tensor: &'a str,
    pub chunk: u32,
    pub round: u32,
    pub bytes: usize,
    pub server: u32,
    pub queued: Instant,
    pub sent: Instant,
    /// When the server said it had the whole push (none for the push that
    /// completed the round: its result is the answer).
    pub received: Option<Instant>,
    pub result: Instant,
}

impl Trace {
    /// Create `path` for process `pid` named `name`, with rows `rows`
    /// (tid, name), and start its writer; returns the trace and the
    /// writer's thread, which ends once every `Trace` is dropped. `who`
    /// names the role in log lines.
    pub fn open(
        path: &str,
        pid: u32,
        name: &str,
        rows: &[(u32, String)],
        who: &str,
    ) -> std::io::Result<(std::sync::Arc<Trace>, std::thread::JoinHandle<()>)> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        let unix_us = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64() * 1e6).unwrap_or(0.0);
        let t0 = Instant::now();
        writeln!(f, "[")?;
        let name = json_str(name);
        writeln!(f, r#"{{"name": "process_name", "ph": "M", "pid": {pid}, "args": {{"name": {name}}}}},"#)?;
        writeln!(f, r#"{{"name": "clock", "ph": "M", "pid": {pid}, "args": {{"unix_us": {unix_us:.1}}}}},"#)?;
        for (tid, row) in rows {
            writeln!(f, "{}", row_event(pid, *tid, row))?;
        }
        f.flush()?;
        let (tx, rx) = bounded(QUEUE);
        let w = who.to_string();
        let writer = std::thread::Builder::new().name("gradhub-timeline".into()).spawn(move || write_all(f, rx, &w))?;
        log::info!(target: who, "writing the timeline to {path}");
        let rows = Default::default();
        let trace = Trace { tx, t0, pid, who: who.to_string(), dropped: AtomicU64::new(0), rows };
        Ok((std::sync::Arc::new(trace), writer))
    }

    fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.t0).as_secs_f64() * 1e6
    }

    fn send(&self, event: String) {
        if self.tx.try_send(event).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One complete ("X") event, with `args` already formatted as JSON members.
    fn span(&self, name: &str, cat: &str, tid: u32, from: Instant, to: Instant, args: &str) -> String {
        let (ts, end) = (self.us(from), self.us(to));
        format!(
            "{{\"name\": \"{name}\", \"cat\": \"{cat}\", \"ph\": \"X\", \"ts\": {ts:.1}, \"dur\": {:.1}, \
             \"pid\": {}, \"tid\": {tid}, \"args\": {{{args}}}}},",
            end - ts,
            self.pid
        )
    }

    /// A server's completed round: waiting for the pushers, then finishing it.
    pub fn round(&self, r: &Round) {
        let args = format!(
            r#""tensor": {}, "chunk": {}, "round": {}, "bytes": {}"#,
            json_str(r.tensor),
            r.chunk,
            r.round,
            r.bytes
        );
        let wait = self.span(
            "WAIT_FOR_PUSHERS",
            "server",
            r.thread,
            r.first_push,
            r.last_push,
            &format!(r#"{args}, "first": {}, "last": {}"#, r.first, r.last),
        );
        let finish = self.span("FINISH_ROUND", "server", r.thread, r.last_push, r.finished, &args);
        self.send(format!("{wait}\n{finish}"));
    }

    /// A worker's pushed chunk, on its tensor's chunk row: QUEUED (behind
    /// higher priorities and the credit), SEND (until the server has it
    /// all), RESULT (the other workers' pushes, the sum and the result in
    /// flight; from the first byte when this push completed the round).
    pub fn chunk(&self, c: &ChunkStages) {
        let tid = {
            let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
            match rows.get(c.tensor) {
                Some(&t) => t,
                None => {
                    let t = CHUNK_ROWS + rows.len() as u32;
                    rows.insert(c.tensor.to_string(), t);
                    self.send(row_event(self.pid, t, &format!("{} (chunks)", c.tensor)));
                    t
                }
            }
        };
        let args = format!(
            r#""tensor": {}, "chunk": {}, "round": {}, "bytes": {}, "server": {}"#,
            json_str(c.tensor),
            c.chunk,
            c.round,
            c.bytes,
            c.server
        );
        let mut out = self.span("QUEUED", "chunk", tid, c.queued, c.sent, &args);
        let on_wire = c.received.unwrap_or(c.result);
        out.push('\n');
        out.push_str(&self.span("SEND", "chunk", tid, c.sent, on_wire, &args));
        if let Some(r) = c.received {
            out.push('\n');
            out.push_str(&self.span("RESULT", "chunk", tid, r, c.result, &args));
        }
        self.send(out);
    }
}

fn row_event(pid: u32, tid: u32, name: &str) -> String {
    let name = json_str(name);
    format!(r#"{{"name": "thread_name", "ph": "M", "pid": {pid}, "tid": {tid}, "args": {{"name": {name}}}}},"#)
}

impl Drop for Trace {
    fn drop(&mut self) {
        let n = self.dropped.load(Ordering::Relaxed);
        if n > 0 {
            log::warn!(target: &self.who, "timeline: {n} event(s) not recorded (the writer fell behind)");
        }
    }
}

fn write_all(mut f: std::io::BufWriter<std::fs::File>, rx: Receiver<String>, who: &str) {
    let mut ok = true;
    while let Ok(event) = rx.recv() {
        ok = ok && writeln!(f, "{event}").is_ok();
        if rx.is_empty() {
            ok = ok && f.flush().is_ok(); // readable while the job runs
        }
    }
    if !ok || f.flush().is_err() {
        log::warn!(target: who, "timeline: writing failed; the file is incomplete");
    }
}
