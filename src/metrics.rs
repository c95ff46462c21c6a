//! Prometheus metrics of the scheduler, a server and the shared service
//! (`--metrics-addr HOST:PORT`, `GRADHUB_METRICS_ADDR`): an HTTP listener
//! that answers `GET /metrics` in Prometheus' text format.
//!
//! Nothing here runs per chunk except `Latency::observe` (two relaxed atomic
//! adds, and only while metrics are served): every other value is a counter
//! the roles keep anyway, read at scrape time by a `Sample` the role builds.
//! The format is written by `prometheus-client`.

use std::fmt;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Connections refused in this process because the peer did not prove the
/// job's token (or, connecting, the listener did not prove it).
pub static AUTH_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Servers whose chunks moved to the others after they were lost.
pub static FAILOVERS: AtomicU64 = AtomicU64::new(0);
/// Rounds reported stalled (waiting longer than the stall limit).
pub static STALLS: AtomicU64 = AtomicU64::new(0);

/// Asynchronous training (`GRADHUB_ASYNC`): the most pushes a worker was
/// ahead of the slowest pusher of a chunk when it was answered.
pub static ASYNC_LEAD_MAX: AtomicU64 = AtomicU64::new(0);

pub fn count(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

/// Upper bounds (seconds) of the round latency buckets, from a chunk's
/// first push to its sum: loopback rounds take tens of microseconds,
/// a straggling worker seconds.
pub const LATENCY_BOUNDS_S: [f64; 12] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 2.5, 10.0];

/// A histogram of round latencies, kept in atomics (the last bucket: +Inf).
#[derive(Debug, Default)]
pub struct Latency {
    buckets: [AtomicU64; LATENCY_BOUNDS_S.len() + 1],
    sum_ns: AtomicU64,
}

impl Latency {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = LATENCY_BOUNDS_S.iter().position(|&b| s <= b).unwrap_or(LATENCY_BOUNDS_S.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
    }

    pub fn snapshot(&self) -> LatencySnapshot {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let bounds = LATENCY_BOUNDS_S.iter().copied().chain([f64::INFINITY]);
        LatencySnapshot {
            sum_s: self.sum_ns.load(Relaxed) as f64 / 1e9,
            count: counts.iter().sum(),
            buckets: bounds.zip(counts).collect(),
        }
    }
}

/// A `Latency` read at one moment: (upper bound, count in that bucket).
#[derive(Debug, Clone, Default)]
pub struct LatencySnapshot {
    pub sum_s: f64,
    pub count: u64,
    pub buckets: Vec<(f64, u64)>,
}

/// What a role reports at one scrape. Per-job values carry the job's name
/// (`""`: a scheduler's or server's only job) as label `gradhub_job`
/// (Prometheus keeps `job` for the scrape job).
#[derive(Debug, Default)]
pub struct Sample {
    /// Jobs running (the scheduler: 1 until its job ends; the service: its jobs).
    pub jobs: Option<u64>,
    /// (job, role, members registered)
    pub members: Vec<(String, &'static str, u64)>,
    /// (job, bytes of tensors the servers hold for it)
    pub held_bytes: Vec<(String, u64)>,
    /// (job, bytes pushed to the servers)
    pub pushed_bytes: Vec<(String, u64)>,
    /// (job, bytes of results sent back)
    pub returned_bytes: Vec<(String, u64)>,
    /// (job, chunk rounds summed)
    pub rounds: Vec<(String, u64)>,
    /// (job, round latencies)
    pub latency: Vec<(String, LatencySnapshot)>,
}

type Builder = Box<dyn Fn() -> Sample + Send + Sync>;

struct Scrape(Builder);

impl fmt::Debug for Scrape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Scrape")
    }
}

fn per_job(e: &mut DescriptorEncoder, name: &str, help: &str, kind: MetricType, rows: &[(String, u64)]) -> fmt::Result {
    if rows.is_empty() {
        return Ok(());
    }
    let mut m = e.encode_descriptor(name, help, None, kind)?;
    for (job, v) in rows {
        let labels = [("gradhub_job", job.as_str())];
        match kind {
            MetricType::Counter => ConstCounter::new(*v).encode(m.encode_family(&labels)?)?,
            _ => ConstGauge::new(*v as i64).encode(m.encode_family(&labels)?)?,
        }
    }
    Ok(())
}

fn process_counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> fmt::Result {
    ConstCounter::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

/// This process's resident memory in bytes (Linux; 0 elsewhere).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(0) as u64
}

/// This process's CPU time in seconds, user and system (Linux; 0 elsewhere).
fn cpu_seconds() -> f64 {
    // /proc/self/stat: the command name (field 2) may hold spaces; utime and
    // stime are fields 14 and 15, counted after its closing parenthesis.
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let ticks: u64 = after.split_whitespace().skip(11).take(2).filter_map(|v| v.parse::<u64>().ok()).sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        ticks as f64 / hz as f64
    } else {
        0.0
    }
}

impl Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let s = (self.0)();
        if let Some(jobs) = s.jobs {
            ConstGauge::new(jobs as i64).encode(e.encode_descriptor(
                "gradhub_jobs",
                "jobs running",
                None,
                MetricType::Gauge,
            )?)?;
        }
        if !s.members.is_empty() {
            let mut m =
                e.encode_descriptor("gradhub_members", "members registered, by role", None, MetricType::Gauge)?;
            for (job, role, n) in &s.members {
                let labels = [("gradhub_job", job.as_str()), ("role", role)];
                ConstGauge::new(*n as i64).encode(m.encode_family(&labels)?)?;
            }
        }
        per_job(&mut e, "gradhub_held_bytes", "bytes of tensors held for the job", MetricType::Gauge, &s.held_bytes)?;
        per_job(&mut e, "gradhub_pushed_bytes", "bytes pushed to the servers", MetricType::Counter, &s.pushed_bytes)?;
        per_job(&mut e, "gradhub_returned_bytes", "bytes of sums sent back", MetricType::Counter, &s.returned_bytes)?;
        per_job(&mut e, "gradhub_rounds", "chunk rounds summed", MetricType::Counter, &s.rounds)?;
        if !s.latency.is_empty() {
            let mut m = e.encode_descriptor(
                "gradhub_round_latency_seconds",
                "a chunk round from its first push to its sum",
                None,
                MetricType::Histogram,
            )?;
            for (job, h) in &s.latency {
                let labels = [("gradhub_job", job.as_str())];
                m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(h.sum_s, h.count, &h.buckets, None)?;
            }
        }
        process_counter(&mut e, "gradhub_stalls", "rounds reported stalled", STALLS.load(Relaxed))?;
        process_counter(
            &mut e,
            "gradhub_failovers",
            "lost servers whose chunks moved to others",
            FAILOVERS.load(Relaxed),
        )?;
        ConstGauge::new(ASYNC_LEAD_MAX.load(Relaxed) as i64).encode(e.encode_descriptor(
            "gradhub_async_lead_max",
            "asynchronous mode: the most steps a worker was ahead of the slowest when answered",
            None,
            MetricType::Gauge,
        )?)?;
        process_counter(
            &mut e,
            "gradhub_auth_failures",
            "connections refused: the job token was not proven",
            AUTH_FAILURES.load(Relaxed),
        )?;
        ConstCounter::new(cpu_seconds()).encode(e.encode_descriptor(
            "gradhub_cpu_seconds",
            "CPU time this process used, user and system",
            None,
            MetricType::Counter,
        )?)?;
        ConstGauge::new(resident_bytes() as i64).encode(e.encode_descriptor(
            "gradhub_resident_bytes",
            "memory this process holds (resident set)",
            None,
            MetricType::Gauge,
        )?)
    }
}

/// The text of one scrape.
pub fn render(sample: impl Fn() -> Sample + Send + Sync + 'static) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(Box::new(sample))));
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// Serve `GET /metrics` on `addr` from a thread of its own until the
/// process exits; returns the bound address.
pub fn serve(addr: &str, sample: impl Fn() -> Sample + Send + Sync + 'static) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(Box::new(sample))));
    std::thread::Builder::new().name("gradhub-metrics".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            // One scrape at a time; a client that stalls is dropped after the timeout.
            if let Err(e) = answer(stream, &registry) {
                log::debug!(target: "metrics", "a metrics request failed: {e}");
            }
        }
    })?;
    Ok(bound)
}

/// Read one request (its head only: GET has no body) and answer it.
fn answer(mut stream: TcpStream, registry: &Registry) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(head.split(|&b| b == b'\r').next().unwrap_or_default()).into_owned();
    let mut words = line.split(' ');
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, kind, body) = match (method, path) {
        ("GET", "/metrics" | "/") => {
            let mut body = String::new();
            // Writing to a String cannot fail.
            let _ = prometheus_client::encoding::text::encode(&mut body, registry);
            ("200 OK", "application/openmetrics-text; version=1.0.0; charset=utf-8", body)
        }
        ("GET", _) => ("404 Not Found", "text/plain", "gradhub serves /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", "text/plain", "GET /metrics\n".to_string()),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text_with_cumulative_buckets() {
        let lat = Latency::default();
        lat.observe(Duration::from_micros(50));
        lat.observe(Duration::from_millis(3));
        lat.observe(Duration::from_secs(60));
        let h = lat.snapshot();
        let text = render(move || Sample {
            jobs: Some(1),
            members: vec![(String::new(), "worker", 4)],
            pushed_bytes: vec![("a\"b".into(), 1024)],
            latency: vec![(String::new(), h.clone())],
            ..Sample::default()
        });
        assert!(text.contains("gradhub_jobs 1\n"), "{text}");
        assert!(text.contains("gradhub_members{gradhub_job=\"\",role=\"worker\"} 4\n"), "{text}");
        assert!(text.contains("gradhub_pushed_bytes_total{gradhub_job=\"a\\\"b\"} 1024\n"), "{text}");
        assert!(text.contains("gradhub_round_latency_seconds_count{gradhub_job=\"\"} 3\n"), "{text}");
        // Buckets are cumulative: 1 at 100 µs, 2 from 5 ms on, 3 at +Inf.
        assert!(text.contains("gradhub_round_latency_seconds_bucket{le=\"0.0001\",gradhub_job=\"\"} 1\n"), "{text}");
        assert!(text.contains("gradhub_round_latency_seconds_bucket{le=\"0.005\",gradhub_job=\"\"} 2\n"), "{text}");
        assert!(text.contains("gradhub_round_latency_seconds_bucket{le=\"+Inf\",gradhub_job=\"\"} 3\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn serves_get_metrics_over_http() {
        let addr = serve("127.0.0.1:0", || Sample { jobs: Some(2), ..Sample::default() }).unwrap();
        let get = |path: &str| {
            let mut s = TcpStream::connect(addr).unwrap();
            write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        };
        let ok = get("/metrics");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.contains("gradhub_jobs 2\n"), "{ok}");
        assert!(get("/other").starts_with("HTTP/1.1 404"));
    }
}
