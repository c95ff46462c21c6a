//! A server's timeline (`gradhub server --timeline`): per chunk round, how
//! long it waited for its pushers (from the first push to the last, and
//! which worker came last) and how long finishing it took (averaging,
//! rounding to 16 bits, the server-side optimizer), as Chrome-trace events
//! in the same format as the workers' (`python/gradhub/timeline.py`), so
//! `gradhub timeline merge` puts a job's servers and workers on one clock.
//!
//! The server threads format an event and hand it to a writer thread over a
//! bounded channel, without waiting: when the writer falls behind, events
//! are dropped and counted (said at the end), never the data path slowed.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::logging::json_str;

/// Events waiting for the writer at most.
const QUEUE: usize = 1 << 16;

pub struct Timeline {
    tx: Sender<String>,
    t0: Instant,
    pid: u32,
    dropped: AtomicU64,
}

/// What a round of a chunk looked like (see `Timeline::round`).
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

impl Timeline {
    /// Open `path` (`{rank}` replaced by the server's rank) and start its
    /// writer; returns the timeline and the writer's thread, which ends
    /// once every `Timeline` is dropped.
    pub fn open(
        path: &str,
        server: u32,
        threads: u32,
    ) -> std::io::Result<(std::sync::Arc<Timeline>, std::thread::JoinHandle<()>)> {
        let path = path.replace("{rank}", &server.to_string());
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
        // Apart from the workers' pids (their ranks) in a merged trace.
        let pid = 1_000_000 + server;
        let unix_us = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64() * 1e6).unwrap_or(0.0);
        let t0 = Instant::now();
        writeln!(f, "[")?;
        let name = json_str(&format!("gradhub server {server}"));
        writeln!(f, r#"{{"name": "process_name", "ph": "M", "pid": {pid}, "args": {{"name": {name}}}}},"#)?;
        writeln!(f, r#"{{"name": "clock", "ph": "M", "pid": {pid}, "args": {{"unix_us": {unix_us:.1}}}}},"#)?;
        for t in 0..threads {
            let name = json_str(&format!("thread {t}"));
            writeln!(
                f,
                r#"{{"name": "thread_name", "ph": "M", "pid": {pid}, "tid": {t}, "args": {{"name": {name}}}}},"#
            )?;
        }
        f.flush()?;
        let (tx, rx) = bounded(QUEUE);
        let writer = std::thread::Builder::new().name("gradhub-timeline".into()).spawn(move || write_all(f, rx))?;
        log::info!(target: &format!("server {server}"), "writing the timeline to {path}");
        Ok((std::sync::Arc::new(Timeline { tx, t0, pid, dropped: AtomicU64::new(0) }), writer))
    }

    fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.t0).as_secs_f64() * 1e6
    }

    /// Record a completed round: waiting for the pushers, then finishing it.
    pub fn round(&self, r: &Round) {
        let (pid, tid) = (self.pid, r.thread);
        let args = format!(
            r#""tensor": {}, "chunk": {}, "round": {}, "bytes": {}"#,
            json_str(r.tensor),
            r.chunk,
            r.round,
            r.bytes
        );
        let (t1, t2, t3) = (self.us(r.first_push), self.us(r.last_push), self.us(r.finished));
        let event = format!(
            "{{\"name\": \"WAIT_FOR_PUSHERS\", \"cat\": \"server\", \"ph\": \"X\", \"ts\": {t1:.1}, \"dur\": {:.1}, \
             \"pid\": {pid}, \"tid\": {tid}, \"args\": {{{args}, \"first\": {}, \"last\": {}}}}},\n\
             {{\"name\": \"FINISH_ROUND\", \"cat\": \"server\", \"ph\": \"X\", \"ts\": {t2:.1}, \"dur\": {:.1}, \
             \"pid\": {pid}, \"tid\": {tid}, \"args\": {{{args}}}}},",
            t2 - t1,
            r.first,
            r.last,
            t3 - t2
        );
        if self.tx.try_send(event).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        let n = self.dropped.load(Ordering::Relaxed);
        if n > 0 {
            log::warn!(target: "server", "timeline: {n} round(s) not recorded (the writer fell behind)");
        }
    }
}

fn write_all(mut f: std::io::BufWriter<std::fs::File>, rx: Receiver<String>) {
    let mut ok = true;
    while let Ok(event) = rx.recv() {
        ok = ok && writeln!(f, "{event}").is_ok();
        if rx.is_empty() {
            ok = ok && f.flush().is_ok(); // readable while the job runs
        }
    }
    if !ok || f.flush().is_err() {
        log::warn!(target: "server", "timeline: writing failed; the file is incomplete");
    }
}
