//! Every `GRADHUB_*` setting, declared once: its name, type, default, the
//! roles that read it and one line of help (`SETTINGS`). The only place
//! the core reads the environment (`std::env::var` appears nowhere else).
//! Defaults of settings that configure a role come from the Rust `Default`
//! impls (`SchedulerConfig`, `ServerConfig`, `ClientConfig`), so they exist
//! once; Python gets this table through `gradhub._core.settings()` and
//! parses every variable by it (`python/gradhub/_env.py`); the README's
//! settings table is generated from it (`gradhub settings --markdown`), and
//! `tests/test_settings.py` fails when any of them drift.

use std::time::Duration;

use crate::client::ClientConfig;
use crate::scheduler::SchedulerConfig;
use crate::server::ServerConfig;

/// How a value is parsed (Python raises ValueError naming the variable for
/// a malformed one; the core logs a warning and uses the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Str,
    Int,
    Float,
    /// 1/0, true/false, yes/no, on/off.
    Flag,
    /// One of these (case-insensitive).
    Choice(&'static [&'static str]),
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Str => "str",
            Kind::Int => "int",
            Kind::Float => "float",
            Kind::Flag => "flag",
            Kind::Choice(_) => "choice",
        }
    }
}

/// What an unset variable means.
#[derive(Debug, Clone, Copy)]
pub enum DefaultIs {
    /// This value (as the variable would be written), taken from the Rust
    /// defaults where a role's config has the field.
    Value(fn() -> String),
    /// No value: the reader decides, as this text says.
    Unset(&'static str),
}

/// Which programs read a setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Worker,
    Server,
    Scheduler,
    /// `gradhub launch` (and the roles it starts).
    Launcher,
    /// The benchmarks (`gradhub bench`, `cargo bench`).
    Bench,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Server => "server",
            Role::Scheduler => "scheduler",
            Role::Launcher => "launcher",
            Role::Bench => "bench",
        }
    }
}

#[derive(Debug)]
pub struct Setting {
    pub name: &'static str,
    pub kind: Kind,
    pub default: DefaultIs,
    pub roles: &'static [Role],
    /// Older names read when this one is not set (Horovod's).
    pub aliases: &'static [&'static str],
    pub help: &'static str,
}

impl Setting {
    /// The default as the variable would be written; None: unset.
    pub fn default_value(&self) -> Option<String> {
        match self.default {
            DefaultIs::Value(f) => Some(f()),
            DefaultIs::Unset(_) => None,
        }
    }
    /// The default as the docs show it.
    pub fn default_doc(&self) -> String {
        match self.default {
            DefaultIs::Value(f) => match f() {
                v if v.is_empty() => "none".into(),
                v => v,
            },
            DefaultIs::Unset(doc) => doc.into(),
        }
    }
}

const ALL: &[Role] = &[Role::Worker, Role::Server, Role::Scheduler, Role::Launcher];
const WORKER: &[Role] = &[Role::Worker];
const SERVER: &[Role] = &[Role::Server];
const SCHEDULER: &[Role] = &[Role::Scheduler];
const MEMBERS: &[Role] = &[Role::Worker, Role::Server, Role::Scheduler];
const DATA: &[Role] = &[Role::Worker, Role::Server];
const BENCH: &[Role] = &[Role::Bench];

fn flag(b: bool) -> String {
    if b { "1" } else { "0" }.into()
}

fn secs(ms: u32) -> String {
    (f64::from(ms) / 1000.0).to_string()
}

fn secs_of(d: Duration) -> String {
    d.as_secs_f64().to_string()
}

macro_rules! setting {
    ($name:literal, $kind:expr, $default:expr, $roles:expr, $help:literal) => {
        setting!($name, $kind, $default, $roles, $help, aliases = &[])
    };
    ($name:literal, $kind:expr, $default:expr, $roles:expr, $help:literal, aliases = $aliases:expr) => {
        Setting { name: $name, kind: $kind, default: $default, roles: $roles, aliases: $aliases, help: $help }
    };
}

use DefaultIs::{Unset, Value};
use Kind::{Choice, Flag, Float, Int, Str};

/// The registry, in the README's order.
#[rustfmt::skip]
pub static SETTINGS: &[Setting] = &[
    setting!("GRADHUB_SCHEDULER", Str, Unset("none (torchrun: `MASTER_ADDR`, port `MASTER_PORT` + 1; srun: the step's first node)"), MEMBERS,
        "the scheduler's host:port; the scheduler listens on its port. Under torchrun or in an srun step without it, rank 0 hosts the scheduler and each node's local rank 0 a colocated server"),
    setting!("GRADHUB_ROLE", Choice(&["worker", "server", "scheduler"]), Value(|| "worker".into()), MEMBERS,
        "what `gradhub.init()` does in this process: join as a worker, or (BytePS style) run a server or the scheduler and exit when the job ends"),
    setting!("GRADHUB_NUM_WORKERS", Int, Unset("torchrun's `WORLD_SIZE`, srun's `SLURM_STEP_NUM_TASKS`"), MEMBERS,
        "number of workers in the job (`gradhub scheduler --workers`)"),
    setting!("GRADHUB_NUM_SERVERS", Int, Unset("torchrun, srun: one per node"), MEMBERS,
        "number of summation servers in the job (`gradhub scheduler --servers`)"),
    setting!("GRADHUB_RANK", Int, Unset("torchrun's `RANK`, srun's `SLURM_PROCID`"), WORKER,
        "this worker's rank"),
    setting!("GRADHUB_LOCAL_RANK", Int, Unset("torchrun's `LOCAL_RANK`, srun's `SLURM_LOCALID`"), WORKER,
        "a worker's rank among the workers of its host (`gradhub launch`, torchrun and srun set it); the scheduler checks it against the host identities of the workers that registered: a mismatch fails `init()` on every worker, naming the host"),
    setting!("GRADHUB_LOCAL_SIZE", Int, Unset("torchrun's `LOCAL_WORLD_SIZE`, srun's tasks on this node"), WORKER,
        "the number of workers on this worker's host, checked like `GRADHUB_LOCAL_RANK`"),
    setting!("GRADHUB_SCHEDULER_PORT", Int, Unset("`MASTER_PORT` + 1 (srun: from the job and step ids)"), WORKER,
        "torchrun or srun without `GRADHUB_SCHEDULER`: the port of the scheduler rank 0 hosts"),
    setting!("GRADHUB_NAMESPACE", Int, Value(|| ClientConfig::default().namespace.to_string()), MEMBERS,
        "the job's namespace, carried by every frame (a shared service derives each job's from its name)"),
    setting!("GRADHUB_JOB_TOKEN", Str, Unset("none (`gradhub launch`: made up)"), ALL,
        "the job's secret, the same on every member; every connection proves it (docs/security.md)"),
    setting!("GRADHUB_JOB_TOKEN_FILE", Str, Unset("none"), ALL,
        "a file holding `GRADHUB_JOB_TOKEN`"),
    setting!("GRADHUB_JOB", Str, Unset("none"), WORKER,
        "a worker's job name on a shared service (`gradhub scheduler --service`); its `GRADHUB_JOB_TOKEN` is what `gradhub token NAME` prints on the service"),
    setting!("GRADHUB_MIN_WORKERS", Int, Unset("none: a job of fixed size"), WORKER,
        "an elastic job on a shared service (`GRADHUB_JOB`): the fewest workers it goes on with; a lost worker ends the running generation, the others roll back to their last commit (`gradhub.torch.elastic`) and form the next one with new ranks"),
    setting!("GRADHUB_MAX_WORKERS", Int, Unset("`GRADHUB_NUM_WORKERS`"), WORKER,
        "an elastic job (`GRADHUB_MIN_WORKERS`): the most workers a generation takes"),
    setting!("GRADHUB_SERVICE_TOKEN", Str, Unset("none"), &[Role::Server, Role::Scheduler],
        "a shared service's master token (its scheduler, servers, `gradhub token` and `gradhub status`)"),
    setting!("GRADHUB_SERVICE_TOKEN_FILE", Str, Unset("none"), &[Role::Server, Role::Scheduler],
        "a file holding `GRADHUB_SERVICE_TOKEN`"),
    setting!("GRADHUB_INSECURE", Flag, Value(|| flag(false)), MEMBERS,
        "1 (`--insecure`): let a scheduler, server or worker whose connections may leave the machine run without a token (anyone reaching its ports can join)"),
    setting!("GRADHUB_PARTITION_BYTES", Int, Value(|| crate::DEFAULT_PARTITION_BYTES.to_string()), &[Role::Scheduler, Role::Launcher],
        "chunk size (scheduler-wide); see docs/benchmarks.md"),
    setting!("GRADHUB_CREDIT_BYTES", Int, Unset("the larger of 512 KiB and 4 chunks"), WORKER,
        "bytes in flight per server-thread connection (worker), on average: split in proportion to the bytes placed on each; the default holds at least 4 of the job's chunks (`GRADHUB_PARTITION_BYTES`) because credit returns a whole chunk at a time"),
    setting!("GRADHUB_SPREAD_BYTES", Int, Unset("2 MiB where a worker's shares differ, else none"), WORKER,
        "worker: how far, in the job-wide order, its pushes may run ahead of its oldest one no server has received whole yet, over all its connections; keeps each server's flow at its share of the link (docs/architecture.md); 0: no limit"),
    setting!("GRADHUB_TCP_CONGESTION", Str, Value(|| "cubic".into()), DATA,
        "congestion control of every data connection (workers and servers); `system`: the machine's default; one the kernel lacks or does not allow is a warning (once per process) and the default. Measured: BBR stalled CPU-only servers' flows for 40–60 ms a few times a second (docs/benchmarks.md)"),
    setting!("GRADHUB_CONNECT_TIMEOUT", Float, Value(|| secs_of(ClientConfig::default().connect_timeout)), DATA,
        "seconds a worker or server keeps retrying the scheduler (`gradhub server --connect-timeout`)"),
    setting!("GRADHUB_SPIN_US", Int, Value(|| "50".into()), WORKER,
        "microseconds a worker waiting for an operation spins before it sleeps (short round trips finish faster spun)"),
    setting!("GRADHUB_SERVER_THREADS", Int, Unset("by launcher"), &[Role::Server, Role::Launcher, Role::Worker],
        "threads per server: `gradhub server` defaults to the number of cores, `gradhub launch` to 1 (`--server-threads`), the server embedded under torchrun to 1"),
    setting!("GRADHUB_SERVER_PORT", Int, Value(|| ServerConfig::default().base_port.to_string()), SERVER,
        "a server's first port; thread t listens on port + t (`--port`); 0: free ports"),
    setting!("GRADHUB_SERVER_RANK", Int, Value(|| ServerConfig::default().rank.to_string()), SERVER,
        "request this server rank (`--rank`); -1: assigned"),
    setting!("GRADHUB_ADVERTISE_ADDR", Str, Unset("the address of the interface that reaches the scheduler"), SERVER,
        "the address a server tells workers to connect to (`--advertise-addr`)"),
    setting!("GRADHUB_STALL_SECONDS", Float, Value(|| secs(SchedulerConfig::default().stall_ms)), SCHEDULER,
        "report rounds waiting longer than this"),
    setting!("GRADHUB_PEER_TIMEOUT", Float, Value(|| secs(SchedulerConfig::default().peer_timeout_ms)), SCHEDULER,
        "seconds of silence before a member (worker, server or scheduler) is declared dead; at least 2 (two heartbeats); read by the scheduler, which tells every member"),
    setting!("GRADHUB_JOIN_TIMEOUT", Float, Value(|| secs(SchedulerConfig::default().join_timeout_ms)), SCHEDULER,
        "seconds the scheduler waits for every member to register (`--join-timeout`); on a shared service also how long an elastic job's next generation may gather before it fails below its minimum"),
    setting!("GRADHUB_COLOCATED", Flag, Value(|| flag(ServerConfig::default().colocated)), SERVER,
        "this server runs on a worker machine (`--colocated`)"),
    setting!("GRADHUB_KERNELS", Str, Value(|| "auto".into()), DATA,
        "force `portable`, `avx2` or `avx512` summation kernels"),
    setting!("GRADHUB_HOST_ID", Str, Unset("host name + network namespace"), DATA,
        "which workers share a machine (and sum in its shared memory first); set it when several \"nodes\" run on one machine (tests), or to group hosts your own way"),
    setting!("GRADHUB_HOST_REDUCE", Flag, Unset("1; 0 with `GRADHUB_ASYNC=1`"), SCHEDULER,
        "scheduler: workers that share a machine sum there first and push one share each, so they wait for each other every step; 0 (`--no-host-reduce`): every worker pushes everything itself. Off by default in the asynchronous mode, where no worker should wait for another (1 there: host mates keep in step, said at start-up)"),
    setting!("GRADHUB_SERVER_SHM", Flag, Value(|| flag(ClientConfig::default().server_shm)), WORKER,
        "worker: with the host stage on, push to a server on the same machine by reference through shared memory; 0: through loopback TCP like any other server"),
    setting!("GRADHUB_FAILOVER", Flag, Value(|| flag(SchedulerConfig::default().failover)), SCHEDULER,
        "scheduler: when a server is lost (it dies, or is silent for the peer timeout), its chunks move to the other servers and training goes on with exactly the sums it would have had (see docs/architecture.md, \"Failover\"); 0 (`--no-failover`): a lost server fails the job. With the optimizer on the servers, each chunk's parameters and optimizer state are kept on a second server too (its replica, where the chunk moves), so training goes on with the same parameters; losing a chunk's server and its replica at once, or any server of a one-server job, fails the job with a clear error"),
    setting!("GRADHUB_DETERMINISTIC", Flag, Value(|| flag(SchedulerConfig::default().sum_order.is_deterministic())), MEMBERS,
        "1: every sum (server rounds, the host stage, rack relays; so fused buckets and sufficient factors too) adds the workers' float contributions in rank order whatever order they arrive in, so results are bitwise identical run after run (integers are exact in any order); costs a copy of each push that arrives before its turn (docs/benchmarks.md). The same on every worker, server and the scheduler: a member set otherwise is refused at `init()`"),
    setting!("GRADHUB_ASYNC", Flag, Value(|| flag(SchedulerConfig::default().training.is_asynchronous())), MEMBERS,
        "1: the asynchronous mode (BytePS's): the servers hold the parameters of `DistributedOptimizer`'s tensors, apply each worker's parameter change as soon as it arrives and answer that worker alone, so no worker waits for another; no bound on staleness unless `GRADHUB_STALENESS` gives one (docs/torch.md, \"Training modes\"). The same on every worker, server and the scheduler: a member set otherwise is refused at `init()`"),
    setting!("GRADHUB_STALENESS", Int, Unset("no bound"), MEMBERS,
        "with `GRADHUB_ASYNC=1`: a worker more than this many steps ahead of the slowest worker waits for it (stale-synchronous training; 0: every step waits for every worker). The same on every member"),
    setting!("GRADHUB_RACK", Str, Value(|| ClientConfig::default().rack), DATA,
        "the rack of a worker or server (`gradhub server --rack`): every member names one, or none does"),
    setting!("GRADHUB_RACK_REDUCE", Choice(&["auto", "on", "off"]), Value(|| format!("{:?}", SchedulerConfig::default().rack_reduce).to_lowercase()), SCHEDULER,
        "scheduler (`--rack-reduce`): with members in two or more racks, sum each chunk within each rack before it crosses the core when PHub's model says it pays (`auto`), always (`on`), or never (`off`)"),
    setting!("GRADHUB_LINK_GBIT", Float, Value(|| SchedulerConfig::default().link_gbit.to_string()), SCHEDULER,
        "scheduler (`--link-gbit`): each host's link in Gbit/s, for PHub's model; 0: not given, 10 assumed"),
    setting!("GRADHUB_CORE_GBIT", Float, Value(|| SchedulerConfig::default().core_gbit.to_string()), SCHEDULER,
        "scheduler (`--core-gbit`): each rack's link to the core in Gbit/s, for PHub's model; 0: not given, one host link assumed"),
    setting!("GRADHUB_METRICS_ADDR", Str, Unset("none"), &[Role::Server, Role::Scheduler],
        "`--metrics-addr HOST:PORT` of `gradhub scheduler` (also `--service`) and `gradhub server`: serve Prometheus metrics at `http://HOST:PORT/metrics`: members and jobs, bytes pushed and returned, chunk rounds and their latency, stalls, failovers, authentication failures, memory"),
    setting!("GRADHUB_SERVER_TIMELINE", Str, Unset("none"), SERVER,
        "`gradhub server --timeline`: write a Chrome/Perfetto trace of the server's chunk rounds there (`{rank}`: its rank): how long each waited for its pushers and which worker came last; `gradhub timeline merge` puts it on one clock with the workers' (`GRADHUB_TIMELINE`)"),
    setting!("GRADHUB_TIMELINE", Str, Unset("none"), WORKER,
        "worker 0 writes a Chrome trace of every operation to this path, and of every chunk it pushes (queued, on the wire, waiting for the result) to the same path ending `.chunks.json`; with `{rank}` in it every worker writes its own, merged by `gradhub timeline merge OUT FILES...`",
        aliases = &["HOROVOD_TIMELINE"]),
    setting!("GRADHUB_OVERLAP_FORWARD", Flag, Value(|| flag(false)), WORKER,
        "`DistributedOptimizer(overlap_forward=True)`: the next forward pass starts while the last gradients are still being summed (docs/torch.md); `auto`: off, and autotune may try it"),
    setting!("GRADHUB_OPTIMIZER_ON_SERVER", Flag, Value(|| flag(false)), WORKER,
        "`DistributedOptimizer(optimizer_on_server=True)`: the servers run SGD or AdamW on float32 parameters (docs/torch.md)"),
    setting!("GRADHUB_SCHEDULING", Choice(&["auto", "priority", "size", "fifo"]), Value(|| "auto".into()), WORKER,
        "`DistributedOptimizer`: push the gradients the next forward pass needs first (`priority`, P3), the largest first (`size`: with the synchronous step, the last updates after the last byte are the smallest), or in the order they are ready (`fifo`: the same order on every worker, whenever each one's gradients arrive); `auto`: `priority` with forward overlap, else `fifo` (docs/torch.md)"),
    setting!("GRADHUB_EAGER_UPDATE", Flag, Value(|| flag(true)), WORKER,
        "`DistributedOptimizer` (SGD, Adam, AdamW; synchronous schedule): `step()` updates each parameter as soon as its reduced gradient is in, while the others are still being summed, and returns when all are updated (docs/torch.md, \"Eager update\"); 0: one update after every gradient is in"),
    setting!("GRADHUB_SFB", Choice(&["auto", "off", "force"]), Value(|| "auto".into()), WORKER,
        "`DistributedOptimizer`: exchange `nn.Linear` weight gradients as Poseidon's sufficient factors where that moves fewer bytes (`auto`), wherever exact (`force`), or never (`off`); the same on every worker (docs/torch.md)"),
    setting!("GRADHUB_SHAPE_CHECK", Flag, Value(|| flag(true)), WORKER,
        "`allreduce`, grouped allreduce and `reducescatter` check, as Horovod, that every worker passes the same shapes and dtypes (one more small round beside the data; never on `DistributedOptimizer`'s gradients); 0: off, the same on every worker (docs/torch.md)"),
    setting!("GRADHUB_LOCAL_STAGE", Choice(&["auto", "shm", "torch"]), Value(|| "auto".into()), WORKER,
        "gradhub.torch: how the workers of one host sum a tensor before the network: `shm`, the host stage in shared memory; `torch`, a torch.distributed group of the host's workers (NCCL for CUDA, gloo for CPU) reduce-scatters, each worker stages and pushes its 1/W share, and all-gathers the result; `auto`: `torch` for CUDA tensors, `shm` for CPU ones (docs/architecture.md, \"GPU data path\"); the same on every worker"),
    setting!("GRADHUB_FUSION_THRESHOLD", Int, Value(|| (256 << 10).to_string()), WORKER,
        "`DistributedOptimizer`: bytes of a fusion bucket; gradients of at most a quarter of it travel packed, one push_pull per bucket and step (docs/torch.md, \"Tensor fusion\"; chosen by docs/benchmarks.md); 0: off; the same on every worker"),
    setting!("GRADHUB_AUTOTUNE", Flag, Value(|| flag(false)), WORKER,
        "`DistributedOptimizer`: try the fusion threshold, the chunk size, the credit (and forward overlap, if `GRADHUB_OVERLAP_FORWARD=auto`) during the first steps and keep the fastest; the knobs you set stay (docs/torch.md, \"Autotune\")",
        aliases = &["HOROVOD_AUTOTUNE"]),
    setting!("GRADHUB_AUTOTUNE_FILE", Str, Unset("none"), WORKER,
        "save the autotuner's choice there; when the file exists (same workers and parameters), load it instead of tuning"),
    setting!("GRADHUB_AUTOTUNE_LOG", Str, Unset("none"), WORKER,
        "worker 0 writes a CSV line per trial: the settings, the step time, whether it became the best",
        aliases = &["HOROVOD_AUTOTUNE_LOG"]),
    setting!("GRADHUB_AUTOTUNE_WARMUP_STEPS", Int, Value(|| "3".into()), WORKER,
        "autotune: steps before the first trial (at least 0)"),
    setting!("GRADHUB_AUTOTUNE_STEPS_PER_TRIAL", Int, Value(|| "5".into()), WORKER,
        "autotune: steps timed per trial (at least 1)"),
    setting!("GRADHUB_LOG", Str, Value(|| "info".into()), ALL,
        "log level of the Rust core in every role: `error`, `warn`, `info`, `debug`, `trace` or `off`; one format, `[gradhub <role>] message`"),
    setting!("GRADHUB_BENCH_QUICK", Flag, Value(|| flag(false)), BENCH,
        "`cargo bench --bench kernels`: a short run (< 10 s)"),
    setting!("GRADHUB_BENCH_TBF_LATENCY", Str, Value(|| "20ms".into()), BENCH,
        "emulated cluster (`gradhub bench`): the queue latency of each link's token-bucket shaper (`tc tbf latency`)"),
];

/// The setting called `name`. Reading an unregistered one is a bug the
/// unit tests catch (every accessor below is called by them).
pub fn lookup(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.name == name)
}

/// The variable's value as set (trimmed), or an alias's; None: not set or
/// empty.
pub fn raw(name: &str) -> Option<String> {
    let s = lookup(name);
    debug_assert!(s.is_some(), "{name} is not in settings::SETTINGS");
    let aliases = s.map(|s| s.aliases).unwrap_or(&[]);
    std::iter::once(name).chain(aliases.iter().copied()).find_map(|var| {
        let v = std::env::var(var).ok()?;
        let v = v.trim();
        (!v.is_empty()).then(|| v.to_string())
    })
}

/// The variable's value, else its default (None: unset without one).
fn value(name: &str) -> Option<String> {
    raw(name).or_else(|| lookup(name).and_then(Setting::default_value))
}

/// `GRADHUB_SPIN_US`: how long `client::Op::wait` spins before sleeping.
pub fn spin() -> Duration {
    let default = lookup("GRADHUB_SPIN_US").and_then(Setting::default_value).and_then(|d| d.parse().ok());
    let default = default.unwrap_or(0);
    let us = match raw("GRADHUB_SPIN_US") {
        None => default,
        Some(v) => v.parse().unwrap_or_else(|_| {
            log::warn!(target: "worker", "GRADHUB_SPIN_US={v:?} is not a number of microseconds; using {default}");
            default
        }),
    };
    Duration::from_micros(us)
}

/// `GRADHUB_TCP_CONGESTION`: the congestion control to set on data
/// connections; None: keep the system's ("system", or set but empty).
pub fn tcp_congestion() -> Option<String> {
    match std::env::var("GRADHUB_TCP_CONGESTION") {
        Ok(v) if v.is_empty() || v == "system" => None,
        Ok(v) => Some(v),
        Err(_) => value("GRADHUB_TCP_CONGESTION"),
    }
}

/// `GRADHUB_KERNELS`: the summation kernels forced; None: the best this CPU has.
pub fn kernels() -> Option<String> {
    raw("GRADHUB_KERNELS").filter(|k| k != "auto")
}

/// `GRADHUB_LOG`, as set (parsed by `logging::init`).
pub fn log_level() -> String {
    value("GRADHUB_LOG").unwrap_or_default()
}

/// `GRADHUB_DETERMINISTIC`: the order sums add contributions in, for a
/// role whose config was not given it (the Python bindings' constructors).
pub fn sum_order() -> crate::order::SumOrder {
    let v = raw("GRADHUB_DETERMINISTIC").map(|v| v.to_ascii_lowercase());
    let on = match v.as_deref() {
        None | Some("0" | "false" | "no" | "off") => false,
        Some("1" | "true" | "yes" | "on") => true,
        Some(other) => {
            log::warn!("GRADHUB_DETERMINISTIC={other:?} is not a flag (1/0, true/false, yes/no, on/off); using 0");
            false
        }
    };
    crate::order::SumOrder::deterministic(on)
}

/// `GRADHUB_ASYNC` and `GRADHUB_STALENESS`: the training mode, for a role
/// whose config was not given it (the Python bindings' constructors).
pub fn training() -> Result<crate::training::Training, String> {
    let on = match raw("GRADHUB_ASYNC").map(|v| v.to_ascii_lowercase()).as_deref() {
        None | Some("0" | "false" | "no" | "off") => false,
        Some("1" | "true" | "yes" | "on") => true,
        Some(other) => return Err(format!("GRADHUB_ASYNC={other:?} is not a flag (1/0, true/false, yes/no, on/off)")),
    };
    let staleness = match raw("GRADHUB_STALENESS") {
        None => None,
        Some(v) => Some(
            v.trim()
                .parse::<u32>()
                .map_err(|_| format!("GRADHUB_STALENESS={v:?} is not a count of steps (0, 1, 2, ...)"))?,
        ),
    };
    crate::training::Training::new(on, staleness)
}

/// `GRADHUB_HOST_ID`, if set (see `crate::host_id`).
pub fn host_id() -> Option<String> {
    raw("GRADHUB_HOST_ID")
}

/// `HOSTNAME`: not a gradhub setting, the fallback for this machine's name
/// when /proc does not say (`crate::hostname`).
pub fn hostname_var() -> Option<String> {
    std::env::var("HOSTNAME").ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_defaults_parse() {
        let mut seen = std::collections::HashSet::new();
        for s in SETTINGS {
            assert!(s.name.starts_with("GRADHUB_"), "{}", s.name);
            assert!(seen.insert(s.name), "{} twice", s.name);
            assert!(!s.roles.is_empty() && !s.help.is_empty(), "{}", s.name);
            let Some(d) = s.default_value() else { continue };
            match s.kind {
                Kind::Int => assert!(d.parse::<i64>().is_ok(), "{}={d}", s.name),
                Kind::Float => assert!(d.parse::<f64>().is_ok(), "{}={d}", s.name),
                Kind::Flag => assert!(d == "0" || d == "1", "{}={d}", s.name),
                Kind::Choice(c) => assert!(c.contains(&d.as_str()), "{}={d}", s.name),
                Kind::Str => {}
            }
        }
    }

    #[test]
    fn defaults_come_from_the_configs() {
        let v = |n| lookup(n).and_then(Setting::default_value).unwrap();
        assert_eq!(v("GRADHUB_PEER_TIMEOUT"), "10");
        assert_eq!(v("GRADHUB_STALL_SECONDS"), "30");
        assert_eq!(v("GRADHUB_CONNECT_TIMEOUT"), "60");
        assert_eq!(lookup("GRADHUB_CREDIT_BYTES").unwrap().default_doc(), "the larger of 512 KiB and 4 chunks");
        assert_eq!(v("GRADHUB_RACK_REDUCE"), "auto");
        assert_eq!(lookup("GRADHUB_RACK").unwrap().default_doc(), "none");
        assert_eq!(v("GRADHUB_DETERMINISTIC"), "0");
    }

    #[test]
    fn every_accessor_reads_a_registered_setting() {
        // Each debug-asserts its name is in the table.
        assert!(spin() <= Duration::from_secs(1) || raw("GRADHUB_SPIN_US").is_some());
        let _ = (tcp_congestion(), kernels(), log_level(), host_id(), hostname_var(), sum_order());
        assert!(lookup("HOSTNAME").is_none());
    }
}
