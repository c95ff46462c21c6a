//! Every `GRADHUB_*` setting, declared once: its name, type, default, tier,
//! the roles that read it and one line of help (`SETTINGS`). The only place
//! the core reads the environment (`std::env::var` appears nowhere else).
//!
//! A leaf: this module uses no other module of the crate, so any module may
//! read a setting without tying itself to the roles (the unit test
//! `settings_is_a_leaf` holds it so). The defaults a role's config shares
//! with this table are constants (`defaults`), which the `Default` impls of
//! `SchedulerConfig`, `ServerConfig` and `ClientConfig` use, so each exists
//! once; settings that read as a crate type (`SumOrder::from_env`,
//! `Training::from_env`) are parsed in that type's module from the strings
//! here. Python gets this table through `gradhub._core.settings()` and
//! parses every variable by it (`python/gradhub/_env.py`); the README's
//! settings tables are generated from it (`gradhub settings --markdown`:
//! the user-facing and advanced tiers; `gradhub settings --all` lists the
//! internal ones too), and `tests/test_settings.py` fails when any of them
//! drift.

use std::time::Duration;

/// The defaults the roles' configs and this table share (one copy of each).
pub mod defaults {
    /// Chunk size (`GRADHUB_PARTITION_BYTES`; `crate::DEFAULT_PARTITION_BYTES`).
    /// See docs/benchmarks.md for the measurement behind it.
    pub const PARTITION_BYTES: u32 = 256 << 10;
    /// `GRADHUB_NAMESPACE`.
    pub const NAMESPACE: u32 = 0;
    /// `GRADHUB_CONNECT_TIMEOUT`: a worker's or server's, in seconds.
    pub const CONNECT_TIMEOUT_SECS: u64 = 60;
    /// `GRADHUB_SERVER_PORT` (0: free ports).
    pub const SERVER_PORT: u16 = 0;
    /// `GRADHUB_SERVER_RANK` (-1: assigned).
    pub const SERVER_RANK: i32 = -1;
    /// `GRADHUB_COLOCATED`.
    pub const COLOCATED: bool = false;
    /// `GRADHUB_STALL_SECONDS`, in milliseconds.
    pub const STALL_MS: u32 = 30_000;
    /// `GRADHUB_PEER_TIMEOUT`, in milliseconds.
    pub const PEER_TIMEOUT_MS: u32 = 10_000;
    /// `GRADHUB_JOIN_TIMEOUT`, in milliseconds.
    pub const JOIN_TIMEOUT_MS: u32 = 300_000;
    /// `GRADHUB_SERVER_SHM`.
    pub const SERVER_SHM: bool = true;
    /// `GRADHUB_FAILOVER`.
    pub const FAILOVER: bool = true;
    /// `GRADHUB_DETERMINISTIC`.
    pub const DETERMINISTIC: bool = false;
    /// `GRADHUB_ASYNC`.
    pub const ASYNC: bool = false;
    /// `GRADHUB_RACK` ("": none).
    pub const RACK: &str = "";
    /// `GRADHUB_RACK_REDUCE` (`scheduler::RackMode::parse` reads it).
    pub const RACK_REDUCE: &str = "auto";
    /// `GRADHUB_LINK_GBIT` (0: not given).
    pub const LINK_GBIT: f64 = 0.0;
    /// `GRADHUB_CORE_GBIT` (0: not given).
    pub const CORE_GBIT: f64 = 0.0;
    /// `GRADHUB_SPIN_US`.
    pub const SPIN_US: u64 = 50;
}

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

/// What an unset variable means: a value (written as the variable would
/// be; from `defaults` where a role's config has the field), or none.
#[derive(Debug, Clone, Copy)]
pub enum DefaultIs {
    Text(&'static str),
    Int(i64),
    Float(f64),
    Flag(bool),
    /// Milliseconds, written as seconds (the scheduler's timeouts).
    Millis(u32),
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

/// Who a setting is for: the README lists `User` and `Advanced`,
/// `gradhub settings --all` every tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// What a user sets to run jobs: where the scheduler is, the job's
    /// size, token and name, its training mode, timeouts, logs and traces.
    User,
    /// Tuning and layout a user may need: chunks and credit, server ports
    /// and threads, racks, the host stage, failover, the optimizer's knobs.
    Advanced,
    /// Test, benchmark and ablation knobs: not for jobs.
    Internal,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::User => "user",
            Tier::Advanced => "advanced",
            Tier::Internal => "internal",
        }
    }
}

#[derive(Debug)]
pub struct Setting {
    pub name: &'static str,
    pub kind: Kind,
    pub default: DefaultIs,
    pub roles: &'static [Role],
    pub tier: Tier,
    /// Older names read when this one is not set (Horovod's).
    pub aliases: &'static [&'static str],
    pub help: &'static str,
}

impl Setting {
    /// The default as the variable would be written; None: unset.
    pub fn default_value(&self) -> Option<String> {
        Some(match self.default {
            DefaultIs::Text(t) => t.into(),
            DefaultIs::Int(i) => i.to_string(),
            DefaultIs::Float(f) => f.to_string(),
            DefaultIs::Flag(b) => if b { "1" } else { "0" }.into(),
            DefaultIs::Millis(ms) => (f64::from(ms) / 1000.0).to_string(),
            DefaultIs::Unset(_) => return None,
        })
    }
    /// The default as the docs show it.
    pub fn default_doc(&self) -> String {
        match (self.default, self.default_value()) {
            (DefaultIs::Unset(doc), _) => doc.into(),
            (_, Some(v)) if !v.is_empty() => v,
            _ => "none".into(),
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

macro_rules! setting {
    ($tier:ident, $name:literal, $kind:expr, $default:expr, $roles:expr, $help:literal) => {
        setting!($tier, $name, $kind, $default, $roles, $help, aliases = &[])
    };
    ($tier:ident, $name:literal, $kind:expr, $default:expr, $roles:expr, $help:literal, aliases = $aliases:expr) => {
        Setting {
            name: $name,
            kind: $kind,
            default: $default,
            roles: $roles,
            tier: Tier::$tier,
            aliases: $aliases,
            help: $help,
        }
    };
}

use DefaultIs::Unset;
use Kind::{Choice, Flag, Float, Int, Str};

const fn text(t: &'static str) -> DefaultIs {
    DefaultIs::Text(t)
}
const fn int(i: i64) -> DefaultIs {
    DefaultIs::Int(i)
}
const fn float(f: f64) -> DefaultIs {
    DefaultIs::Float(f)
}
const fn flag(b: bool) -> DefaultIs {
    DefaultIs::Flag(b)
}
const fn millis(ms: u32) -> DefaultIs {
    DefaultIs::Millis(ms)
}

/// The registry, in the README's order.
#[rustfmt::skip]
pub static SETTINGS: &[Setting] = &[
    setting!(User, "GRADHUB_SCHEDULER", Str, Unset("none (torchrun: `MASTER_ADDR`, port `MASTER_PORT` + 1; srun: the step's first node)"), MEMBERS,
        "the scheduler's host:port; the scheduler listens on its port. Under torchrun or in an srun step without it, rank 0 hosts the scheduler and each node's local rank 0 a colocated server"),
    setting!(User, "GRADHUB_ROLE", Choice(&["worker", "server", "scheduler"]), text("worker"), MEMBERS,
        "what `gradhub.init()` does in this process: join as a worker, or (BytePS style) run a server or the scheduler and exit when the job ends"),
    setting!(User, "GRADHUB_NUM_WORKERS", Int, Unset("torchrun's `WORLD_SIZE`, srun's `SLURM_STEP_NUM_TASKS`"), MEMBERS,
        "number of workers in the job (`gradhub scheduler --workers`)"),
    setting!(User, "GRADHUB_NUM_SERVERS", Int, Unset("torchrun, srun: one per node"), MEMBERS,
        "number of summation servers in the job (`gradhub scheduler --servers`)"),
    setting!(User, "GRADHUB_RANK", Int, Unset("torchrun's `RANK`, srun's `SLURM_PROCID`"), WORKER,
        "this worker's rank"),
    setting!(Advanced, "GRADHUB_LOCAL_RANK", Int, Unset("torchrun's `LOCAL_RANK`, srun's `SLURM_LOCALID`"), WORKER,
        "a worker's rank among the workers of its host (`gradhub launch`, torchrun and srun set it); the scheduler checks it against the host identities of the workers that registered: a mismatch fails `init()` on every worker, naming the host"),
    setting!(Advanced, "GRADHUB_LOCAL_SIZE", Int, Unset("torchrun's `LOCAL_WORLD_SIZE`, srun's tasks on this node"), WORKER,
        "the number of workers on this worker's host, checked like `GRADHUB_LOCAL_RANK`"),
    setting!(Advanced, "GRADHUB_SCHEDULER_PORT", Int, Unset("`MASTER_PORT` + 1 (srun: from the job and step ids)"), WORKER,
        "torchrun or srun without `GRADHUB_SCHEDULER`: the port of the scheduler rank 0 hosts"),
    setting!(Advanced, "GRADHUB_NAMESPACE", Int, int(defaults::NAMESPACE as i64), MEMBERS,
        "the job's namespace, carried by every frame (a shared service derives each job's from its name)"),
    setting!(User, "GRADHUB_JOB_TOKEN", Str, Unset("none (`gradhub launch`: made up)"), ALL,
        "the job's secret, the same on every member; every connection proves it (docs/security.md)"),
    setting!(User, "GRADHUB_JOB_TOKEN_FILE", Str, Unset("none"), ALL,
        "a file holding `GRADHUB_JOB_TOKEN`"),
    setting!(User, "GRADHUB_JOB", Str, Unset("none"), WORKER,
        "a worker's job name on a shared service (`gradhub scheduler --service`); its `GRADHUB_JOB_TOKEN` is what `gradhub token NAME` prints on the service"),
    setting!(User, "GRADHUB_MIN_WORKERS", Int, Unset("none: a job of fixed size"), WORKER,
        "an elastic job on a shared service (`GRADHUB_JOB`): the fewest workers it goes on with; a lost worker ends the running generation, the others roll back to their last commit (`gradhub.torch.elastic`) and form the next one with new ranks"),
    setting!(User, "GRADHUB_MAX_WORKERS", Int, Unset("`GRADHUB_NUM_WORKERS`"), WORKER,
        "an elastic job (`GRADHUB_MIN_WORKERS`): the most workers a generation takes"),
    setting!(User, "GRADHUB_SERVICE_TOKEN", Str, Unset("none"), &[Role::Server, Role::Scheduler],
        "a shared service's master token (its scheduler, servers, `gradhub token` and `gradhub status`)"),
    setting!(User, "GRADHUB_SERVICE_TOKEN_FILE", Str, Unset("none"), &[Role::Server, Role::Scheduler],
        "a file holding `GRADHUB_SERVICE_TOKEN`"),
    setting!(User, "GRADHUB_ENCRYPT", Flag, flag(false), ALL,
        "1 (`--encrypt`): encrypt and authenticate every connection of the job (AES-256-GCM, keys derived from the job token for each connection); needs a token. The same on every member: one that differs is refused, naming this setting (docs/security.md)"),
    setting!(User, "GRADHUB_INSECURE", Flag, flag(false), MEMBERS,
        "1 (`--insecure`): let a scheduler, server or worker whose connections may leave the machine run without a token (anyone reaching its ports can join)"),
    setting!(Advanced, "GRADHUB_PARTITION_BYTES", Int, int(defaults::PARTITION_BYTES as i64), &[Role::Scheduler, Role::Launcher],
        "chunk size (scheduler-wide); see docs/benchmarks.md"),
    setting!(Advanced, "GRADHUB_CREDIT_BYTES", Int, Unset("the larger of 512 KiB and 4 chunks"), WORKER,
        "bytes in flight per server-thread connection (worker), on average: split in proportion to the bytes placed on each; the default holds at least 4 of the job's chunks (`GRADHUB_PARTITION_BYTES`) because credit returns a whole chunk at a time"),
    setting!(Internal, "GRADHUB_SPREAD_BYTES", Int, Unset("2 MiB where a worker's shares differ, else none"), WORKER,
        "worker: how far, in the job-wide order, its pushes may run ahead of its oldest one no server has received whole yet, over all its connections; keeps each server's flow at its share of the link (docs/architecture.md); 0: no limit"),
    setting!(Advanced, "GRADHUB_TCP_CONGESTION", Str, text("cubic"), DATA,
        "congestion control of every data connection (workers and servers); `system`: the machine's default; one the kernel lacks or does not allow is a warning (once per process) and the default. Measured: BBR stalled CPU-only servers' flows for 40–60 ms a few times a second (docs/benchmarks.md)"),
    setting!(User, "GRADHUB_CONNECT_TIMEOUT", Float, float(defaults::CONNECT_TIMEOUT_SECS as f64), DATA,
        "seconds a worker or server keeps retrying the scheduler (`gradhub server --connect-timeout`)"),
    setting!(Internal, "GRADHUB_SPIN_US", Int, int(defaults::SPIN_US as i64), WORKER,
        "microseconds a worker waiting for an operation spins before it sleeps (short round trips finish faster spun)"),
    setting!(Advanced, "GRADHUB_SERVER_THREADS", Int, Unset("by launcher"), &[Role::Server, Role::Launcher, Role::Worker],
        "threads per server: `gradhub server` defaults to the number of cores, `gradhub launch` to 1 (`--server-threads`), the server embedded under torchrun to 1"),
    setting!(Advanced, "GRADHUB_SERVER_PORT", Int, int(defaults::SERVER_PORT as i64), SERVER,
        "a server's first port; thread t listens on port + t (`--port`); 0: free ports"),
    setting!(Advanced, "GRADHUB_SERVER_RANK", Int, int(defaults::SERVER_RANK as i64), SERVER,
        "request this server rank (`--rank`); -1: assigned"),
    setting!(Advanced, "GRADHUB_ADVERTISE_ADDR", Str, Unset("the address of the interface that reaches the scheduler"), SERVER,
        "the address a server tells workers to connect to (`--advertise-addr`)"),
    setting!(Advanced, "GRADHUB_STALL_SECONDS", Float, millis(defaults::STALL_MS), SCHEDULER,
        "report rounds waiting longer than this"),
    setting!(User, "GRADHUB_PEER_TIMEOUT", Float, millis(defaults::PEER_TIMEOUT_MS), SCHEDULER,
        "seconds of silence before a member (worker, server or scheduler) is declared dead; at least 2 (two heartbeats); read by the scheduler, which tells every member"),
    setting!(User, "GRADHUB_JOIN_TIMEOUT", Float, millis(defaults::JOIN_TIMEOUT_MS), SCHEDULER,
        "seconds the scheduler waits for every member to register (`--join-timeout`); on a shared service also how long an elastic job's next generation may gather before it fails below its minimum"),
    setting!(Advanced, "GRADHUB_COLOCATED", Flag, flag(defaults::COLOCATED), SERVER,
        "this server runs on a worker machine (`--colocated`)"),
    setting!(Internal, "GRADHUB_KERNELS", Str, text("auto"), DATA,
        "force `portable`, `avx2` or `avx512` summation kernels"),
    setting!(Internal, "GRADHUB_HOST_ID", Str, Unset("host name + network namespace"), DATA,
        "which workers share a machine (and sum in its shared memory first); set it when several \"nodes\" run on one machine (tests), or to group hosts your own way"),
    setting!(Advanced, "GRADHUB_HOST_REDUCE", Flag, Unset("1; 0 with `GRADHUB_ASYNC=1`"), SCHEDULER,
        "scheduler: workers that share a machine sum there first and push one share each, so they wait for each other every step; 0 (`--no-host-reduce`): every worker pushes everything itself. Off by default in the asynchronous mode, where no worker should wait for another (1 there: host mates keep in step, said at start-up)"),
    setting!(Internal, "GRADHUB_SERVER_SHM", Flag, flag(defaults::SERVER_SHM), WORKER,
        "worker: with the host stage on, push to a server on the same machine by reference through shared memory; 0: through loopback TCP like any other server"),
    setting!(Advanced, "GRADHUB_FAILOVER", Flag, flag(defaults::FAILOVER), SCHEDULER,
        "scheduler: when a server is lost (it dies, or is silent for the peer timeout), its chunks move to the other servers and training goes on with exactly the sums it would have had (see docs/architecture.md, \"Failover\"); 0 (`--no-failover`): a lost server fails the job. With the optimizer on the servers, each chunk's parameters and optimizer state are kept on a second server too (its replica, where the chunk moves), so training goes on with the same parameters; losing a chunk's server and its replica at once, or any server of a one-server job, fails the job with a clear error"),
    setting!(User, "GRADHUB_DETERMINISTIC", Flag, flag(defaults::DETERMINISTIC), MEMBERS,
        "1: every sum (server rounds, the host stage, rack relays; so fused buckets and sufficient factors too) adds the workers' float contributions in rank order whatever order they arrive in, so results are bitwise identical run after run (integers are exact in any order); costs a copy of each push that arrives before its turn (docs/benchmarks.md). The same on every worker, server and the scheduler: a member set otherwise is refused at `init()`"),
    setting!(User, "GRADHUB_ASYNC", Flag, flag(defaults::ASYNC), MEMBERS,
        "1: the asynchronous mode (BytePS's): the servers hold the parameters of `DistributedOptimizer`'s tensors, apply each worker's parameter change as soon as it arrives and answer that worker alone, so no worker waits for another; no bound on staleness unless `GRADHUB_STALENESS` gives one (docs/torch.md, \"Training modes\"). The same on every worker, server and the scheduler: a member set otherwise is refused at `init()`"),
    setting!(User, "GRADHUB_STALENESS", Int, Unset("no bound"), MEMBERS,
        "with `GRADHUB_ASYNC=1`: a worker more than this many steps ahead of the slowest worker waits for it (stale-synchronous training; 0: every step waits for every worker). The same on every member"),
    setting!(Advanced, "GRADHUB_RACK", Str, text(defaults::RACK), DATA,
        "the rack of a worker or server (`gradhub server --rack`): every member names one, or none does"),
    setting!(Advanced, "GRADHUB_RACK_REDUCE", Choice(&["auto", "on", "off"]), text(defaults::RACK_REDUCE), SCHEDULER,
        "scheduler (`--rack-reduce`): with members in two or more racks, sum each chunk within each rack before it crosses the core when PHub's model says it pays (`auto`), always (`on`), or never (`off`)"),
    setting!(Advanced, "GRADHUB_LINK_GBIT", Float, float(defaults::LINK_GBIT), SCHEDULER,
        "scheduler (`--link-gbit`): each host's link in Gbit/s, for PHub's model; 0: not given, 10 assumed"),
    setting!(Advanced, "GRADHUB_CORE_GBIT", Float, float(defaults::CORE_GBIT), SCHEDULER,
        "scheduler (`--core-gbit`): each rack's link to the core in Gbit/s, for PHub's model; 0: not given, one host link assumed"),
    setting!(User, "GRADHUB_METRICS_ADDR", Str, Unset("none"), &[Role::Server, Role::Scheduler],
        "`--metrics-addr HOST:PORT` of `gradhub scheduler` (also `--service`) and `gradhub server`: serve Prometheus metrics at `http://HOST:PORT/metrics`: members and jobs, bytes pushed and returned, chunk rounds and their latency, stalls, failovers, authentication failures, memory"),
    setting!(User, "GRADHUB_SERVER_TIMELINE", Str, Unset("none"), SERVER,
        "`gradhub server --timeline`: write a Chrome/Perfetto trace of the server's chunk rounds there (`{rank}`: its rank): how long each waited for its pushers and which worker came last; `gradhub timeline merge` puts it on one clock with the workers' (`GRADHUB_TIMELINE`)"),
    setting!(User, "GRADHUB_TIMELINE", Str, Unset("none"), WORKER,
        "worker 0 writes a Chrome trace of every operation to this path, and of every chunk it pushes (queued, on the wire, waiting for the result) to the same path ending `.chunks.json`; with `{rank}` in it every worker writes its own, merged by `gradhub timeline merge OUT FILES...`",
        aliases = &["HOROVOD_TIMELINE"]),
    setting!(Advanced, "GRADHUB_OVERLAP_FORWARD", Flag, flag(false), WORKER,
        "`DistributedOptimizer(overlap_forward=True)`: the next forward pass starts while the last gradients are still being summed (docs/torch.md); `auto`: off, and autotune may try it"),
    setting!(Advanced, "GRADHUB_OPTIMIZER_ON_SERVER", Flag, flag(false), WORKER,
        "`DistributedOptimizer(optimizer_on_server=True)`: the servers run SGD or AdamW on float32 parameters (docs/torch.md)"),
    setting!(Advanced, "GRADHUB_SCHEDULING", Choice(&["auto", "priority", "size", "fifo"]), text("auto"), WORKER,
        "`DistributedOptimizer`: push the gradients the next forward pass needs first (`priority`, P3), the largest first (`size`: with the synchronous step, the last updates after the last byte are the smallest), or in the order they are ready (`fifo`: the same order on every worker, whenever each one's gradients arrive); `auto`: `priority` with forward overlap, else `fifo` (docs/torch.md)"),
    setting!(Advanced, "GRADHUB_EAGER_UPDATE", Flag, flag(true), WORKER,
        "`DistributedOptimizer` (SGD, Adam, AdamW; synchronous schedule): `step()` updates each parameter as soon as its reduced gradient is in, while the others are still being summed, and returns when all are updated (docs/torch.md, \"Eager update\"); 0: one update after every gradient is in"),
    setting!(Advanced, "GRADHUB_SFB", Choice(&["auto", "off", "force"]), text("auto"), WORKER,
        "`DistributedOptimizer`: exchange `nn.Linear` weight gradients as Poseidon's sufficient factors where that moves fewer bytes (`auto`), wherever exact (`force`), or never (`off`); the same on every worker (docs/torch.md)"),
    setting!(Advanced, "GRADHUB_SHAPE_CHECK", Flag, flag(true), WORKER,
        "`allreduce`, grouped allreduce and `reducescatter` check, as Horovod, that every worker passes the same shapes and dtypes (one more small round beside the data; never on `DistributedOptimizer`'s gradients); 0: off, the same on every worker (docs/torch.md)"),
    setting!(Advanced, "GRADHUB_LOCAL_STAGE", Choice(&["auto", "shm", "torch"]), text("auto"), WORKER,
        "gradhub.torch: how the workers of one host sum a tensor before the network: `shm`, the host stage in shared memory; `torch`, a torch.distributed group of the host's workers (NCCL for CUDA, gloo for CPU) reduce-scatters, each worker stages and pushes its 1/W share, and all-gathers the result; `auto`: `torch` for CUDA tensors, `shm` for CPU ones (docs/architecture.md, \"GPU data path\"); the same on every worker"),
    setting!(Advanced, "GRADHUB_FUSION_THRESHOLD", Int, int(256 << 10), WORKER,
        "`DistributedOptimizer`: bytes of a fusion bucket; gradients of at most a quarter of it travel packed, one push_pull per bucket and step (docs/torch.md, \"Tensor fusion\"; chosen by docs/benchmarks.md); 0: off; the same on every worker"),
    setting!(Advanced, "GRADHUB_AUTOTUNE", Flag, flag(false), WORKER,
        "`DistributedOptimizer`: try the fusion threshold, the chunk size, the credit (and forward overlap, if `GRADHUB_OVERLAP_FORWARD=auto`) during the first steps and keep the fastest; the knobs you set stay (docs/torch.md, \"Autotune\")",
        aliases = &["HOROVOD_AUTOTUNE"]),
    setting!(Advanced, "GRADHUB_AUTOTUNE_FILE", Str, Unset("none"), WORKER,
        "save the autotuner's choice there; when the file exists (same workers and parameters), load it instead of tuning"),
    setting!(Advanced, "GRADHUB_AUTOTUNE_LOG", Str, Unset("none"), WORKER,
        "worker 0 writes a CSV line per trial: the settings, the step time, whether it became the best",
        aliases = &["HOROVOD_AUTOTUNE_LOG"]),
    setting!(Advanced, "GRADHUB_AUTOTUNE_WARMUP_STEPS", Int, int(3), WORKER,
        "autotune: steps before the first trial (at least 0)"),
    setting!(Advanced, "GRADHUB_AUTOTUNE_STEPS_PER_TRIAL", Int, int(5), WORKER,
        "autotune: steps timed per trial (at least 1)"),
    setting!(User, "GRADHUB_LOG", Str, text("info"), ALL,
        "log level of the Rust core in every role: `error`, `warn`, `info`, `debug`, `trace` or `off`; one format, `[gradhub <role>] message`"),
    setting!(Internal, "GRADHUB_BENCH_QUICK", Flag, flag(false), BENCH,
        "`cargo bench --bench kernels`: a short run (< 10 s)"),
    setting!(Internal, "GRADHUB_BENCH_TBF_LATENCY", Str, text("20ms"), BENCH,
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
    let default = defaults::SPIN_US;
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

/// A flag's value as set: Some(true) for 1/true/yes/on, Some(false) for
/// 0/false/no/off (any case), None when unset; Err names the variable and
/// the value. Read by the types whose setting is a flag
/// (`SumOrder::from_env`, `Training::from_env`).
pub fn read_flag(name: &str) -> Result<Option<bool>, String> {
    match raw(name).map(|v| v.to_ascii_lowercase()).as_deref() {
        None => Ok(None),
        Some("0" | "false" | "no" | "off") => Ok(Some(false)),
        Some("1" | "true" | "yes" | "on") => Ok(Some(true)),
        Some(other) => Err(format!("{name}={other:?} is not a flag (1/0, true/false, yes/no, on/off)")),
    }
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
    fn defaults_are_written_as_the_docs_show_them() {
        let v = |n| lookup(n).and_then(Setting::default_value).unwrap();
        assert_eq!(v("GRADHUB_PEER_TIMEOUT"), "10");
        assert_eq!(v("GRADHUB_STALL_SECONDS"), "30");
        assert_eq!(v("GRADHUB_CONNECT_TIMEOUT"), "60");
        assert_eq!(v("GRADHUB_PARTITION_BYTES"), "262144");
        assert_eq!(v("GRADHUB_SERVER_RANK"), "-1");
        assert_eq!(lookup("GRADHUB_CREDIT_BYTES").unwrap().default_doc(), "the larger of 512 KiB and 4 chunks");
        assert_eq!(v("GRADHUB_RACK_REDUCE"), "auto");
        assert_eq!(lookup("GRADHUB_RACK").unwrap().default_doc(), "none");
        assert_eq!(v("GRADHUB_DETERMINISTIC"), "0");
        assert_eq!(v("GRADHUB_SERVER_SHM"), "1");
    }

    #[test]
    fn every_accessor_reads_a_registered_setting() {
        // Each debug-asserts its name is in the table.
        assert!(spin() <= Duration::from_secs(1) || raw("GRADHUB_SPIN_US").is_some());
        let _ = (tcp_congestion(), kernels(), log_level(), host_id(), hostname_var());
        let _ = (read_flag("GRADHUB_DETERMINISTIC"), read_flag("GRADHUB_ASYNC"));
        assert!(lookup("HOSTNAME").is_none());
    }

    #[test]
    fn internal_settings_are_the_harness_knobs() {
        let internal: Vec<_> = SETTINGS.iter().filter(|s| s.tier == Tier::Internal).map(|s| s.name).collect();
        for name in ["GRADHUB_BENCH_QUICK", "GRADHUB_BENCH_TBF_LATENCY", "GRADHUB_SPIN_US", "GRADHUB_KERNELS"] {
            assert!(internal.contains(&name), "{name}");
        }
        // What a user sets to run a job is never internal.
        for name in ["GRADHUB_SCHEDULER", "GRADHUB_NUM_WORKERS", "GRADHUB_JOB_TOKEN", "GRADHUB_LOG"] {
            assert_eq!(lookup(name).unwrap().tier, Tier::User, "{name}");
        }
    }

    /// The registry is a leaf of the crate: it names no other module (no
    /// `crate::` or `super::` path outside comments and these tests), so
    /// the modules that read a setting (transport, kernels, client, logging)
    /// and the configs that share its defaults form no import circle.
    #[test]
    fn settings_is_a_leaf() {
        let source = include_str!("settings.rs");
        let code = source.split("#[cfg(test)]").next().unwrap();
        let paths: Vec<_> = code
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim_start().starts_with("//"))
            .filter(|(_, l)| l.contains("crate::") || l.contains("super::"))
            .map(|(i, l)| format!("settings.rs:{}: {}", i + 1, l.trim()))
            .collect();
        assert!(paths.is_empty(), "settings.rs must use no other module of the crate: {paths:#?}");
    }
}
