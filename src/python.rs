//! PyO3 bindings: the `gradhub._core` extension module (typed in
//! `python/gradhub/_core.pyi`); the config objects Python passes in are in
//! `python/config.rs`. Thin: argument conversion, releasing the GIL
//! around anything that blocks, completion callbacks, and the one mapping
//! from `crate::error::Error` to Python exceptions. The Python package builds
//! the user API on this.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender, TrySendError};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

use crate::client::{Client, ClientError, Op, OpError};
use crate::error::Error;
use crate::protocol::auth::Secret;
use crate::protocol::{DType, DeclEntry};
use crate::scheduler;
use crate::server;

mod config;
mod peer;
use config::{PyClientConfig, PySchedulerConfig, PyServerConfig, PyServiceConfig, PyServiceServerConfig};

create_exception!(gradhub, GradhubError, PyRuntimeError, "A gradhub job or operation failed.");
create_exception!(gradhub, GradhubTimeoutError, PyTimeoutError, "A gradhub operation did not finish in time.");

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::Client(ClientError::Usage(m)) => PyValueError::new_err(m),
            Error::Op(OpError::Timeout(m)) => GradhubTimeoutError::new_err(m),
            other => GradhubError::new_err(other.to_string()),
        }
    }
}

/// Convert any entry point's error (the one conversion to Python).
fn py_err(e: impl Into<Error>) -> PyErr {
    e.into().into()
}

/// Python completion callbacks run on one thread of their own: taking the
/// GIL on the I/O thread would stall every other transfer while Python
/// runs (and deadlock if the GIL holder waits for that thread). Bounded;
/// when full, an overflowing callback gets a thread of its own.
fn callback_queue() -> &'static Sender<(Py<PyAny>, Args)> {
    static QUEUE: OnceLock<Sender<(Py<PyAny>, Args)>> = OnceLock::new();
    QUEUE.get_or_init(|| {
        let (tx, rx) = bounded::<(Py<PyAny>, Args)>(1 << 16);
        let spawned = std::thread::Builder::new().name("gradhub-callbacks".into()).spawn(move || {
            for (f, args) in rx {
                run_callback(f, args);
            }
        });
        if let Err(e) = spawned {
            log::error!(target: "worker", "cannot start the callback thread: {e}; callbacks run inline");
        }
        tx
    })
}

/// Callbacks and the interpreter's exit. Once CPython finalizes, a thread
/// that takes the GIL is ended mid-call (or finds no interpreter): on the
/// callback thread a panic or an abort (SIGABRT) after the script's work
/// was done. `close_callbacks` runs from an atexit hook, before
/// finalization: from then on callbacks are dropped unrun, and it waits
/// (bounded) for the ones already running to finish.
struct Gate {
    closing: bool,
    running: usize,
}

static GATE: Mutex<Gate> = Mutex::new(Gate { closing: false, running: 0 });
static GATE_IDLE: Condvar = Condvar::new();
const CLOSE_WAIT: Duration = Duration::from_secs(5);

fn gate() -> MutexGuard<'static, Gate> {
    GATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a completion callback is called with.
enum Args {
    /// An operation's: `(error,)`, None on success.
    Done(Option<String>),
    /// A point-to-point receive's: `(sender, error)`.
    Received(Option<u32>, Option<String>),
}

/// Run `f(args)` on the callback thread (on a thread of its own when the
/// queue is full).
fn queue_callback(f: Py<PyAny>, args: Args) {
    if let Err(TrySendError::Full(item) | TrySendError::Disconnected(item)) = callback_queue().try_send((f, args)) {
        let spawned =
            std::thread::Builder::new().name("gradhub-callback".into()).spawn(move || run_callback(item.0, item.1));
        if let Err(e) = spawned {
            log::error!(target: "worker", "cannot run a completion callback: {e}");
        }
    }
}

fn run_callback(f: Py<PyAny>, args: Args) {
    {
        let mut g = gate();
        if g.closing {
            // Not even a reference count to drop: the interpreter is going.
            std::mem::forget(f);
            return;
        }
        g.running += 1;
    }
    let _running = Running;
    Python::attach(|py| {
        let called = match args {
            Args::Done(err) => f.call1(py, (err,)),
            Args::Received(src, err) => f.call1(py, (src, err)),
        };
        if let Err(e) = called {
            // Like an exception in a thread: reported, never lost silently.
            e.write_unraisable(py, Some(f.bind(py)));
        }
        drop(f);
    });
}

/// One callback running (counted in `Gate::running`), until dropped, also
/// by a panic.
struct Running;

impl Drop for Running {
    fn drop(&mut self) {
        let mut g = gate();
        g.running -= 1;
        if g.running == 0 {
            GATE_IDLE.notify_all();
        }
    }
}

/// Stop running completion callbacks: the interpreter is about to exit
/// (gradhub registers this with atexit, to run after its shutdown). Waits
/// up to 5 s, without the GIL, for callbacks already running.
#[pyfunction]
fn close_callbacks(py: Python<'_>) {
    py.detach(|| {
        let mut g = gate();
        g.closing = true;
        let deadline = Instant::now() + CLOSE_WAIT;
        while g.running > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                log::warn!(target: "worker", "{} completion callback(s) still running at exit", g.running);
                break;
            }
            g = GATE_IDLE.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    });
}

fn dtype_of(s: &str) -> PyResult<DType> {
    DType::from_name(s)
        .ok_or_else(|| PyValueError::new_err(format!("unsupported dtype '{s}' (use float32, float16 or bfloat16)")))
}

/// Run a scheduler until the job ends (blocking, without the GIL).
#[pyfunction]
fn run_scheduler(py: Python<'_>, config: PyRef<'_, PySchedulerConfig>) -> PyResult<()> {
    let cfg = config.cfg.clone();
    py.detach(|| scheduler::run_scheduler(cfg)).map_err(py_err)
}

/// A scheduler running on a background thread of this process.
#[pyclass(module = "gradhub._core")]
struct SchedulerHandle {
    addr: String,
    inner: std::sync::Mutex<Option<scheduler::SchedulerHandle>>,
}

#[pymethods]
impl SchedulerHandle {
    #[getter]
    fn address(&self) -> String {
        self.addr.clone()
    }
    /// Wait for the job to end; raises if it failed.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.inner.lock().map_err(|_| GradhubError::new_err("poisoned"))?.take();
        match h {
            Some(h) => py.detach(|| h.wait()).map_err(py_err),
            None => Ok(()),
        }
    }
}

/// Start a scheduler on a background thread of this process.
#[pyfunction]
fn start_scheduler(config: PyRef<'_, PySchedulerConfig>) -> PyResult<SchedulerHandle> {
    let h = scheduler::start_scheduler(config.cfg.clone()).map_err(py_err)?;
    Ok(SchedulerHandle { addr: h.addr.to_string(), inner: std::sync::Mutex::new(Some(h)) })
}

/// Run a summation server until the job ends (blocking, without the GIL).
#[pyfunction]
fn run_server(py: Python<'_>, config: PyRef<'_, PyServerConfig>) -> PyResult<()> {
    let cfg = config.cfg.clone();
    py.detach(|| server::run_server(cfg)).map_err(py_err)
}

/// Serve every job of the shared service (blocking, without the GIL)
/// until the service goes away.
#[pyfunction]
fn run_service_server(py: Python<'_>, config: PyRef<'_, PyServiceServerConfig>) -> PyResult<()> {
    let cfg = config.cfg.clone();
    py.detach(|| server::run_service_server(cfg)).map_err(py_err)
}

/// Run a shared service (blocking, without the GIL): many jobs, each with
/// the token `job_token(master, name)`. Limits of 0 mean none.
#[pyfunction]
fn run_service(py: Python<'_>, config: PyRef<'_, PyServiceConfig>) -> PyResult<()> {
    let h = scheduler::start_service(config.cfg.clone()).map_err(py_err)?;
    py.detach(|| h.wait()).map_err(py_err)
}

/// Job `job`'s token on the service whose master token is `master`.
#[pyfunction]
fn job_token(master: String, job: String) -> PyResult<String> {
    crate::protocol::auth::check_job_name(&job).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(Secret::new(master.as_bytes()).job_token(&job))
}

/// The shared service's report (JSON text); `token` is its master token.
#[pyfunction]
#[pyo3(signature = (service, token, timeout=10.0, encrypt=None))]
fn service_status(
    py: Python<'_>,
    service: String,
    token: String,
    timeout: f64,
    encrypt: Option<bool>,
) -> PyResult<String> {
    let master = config::secret_of(Some(token), encrypt)?;
    py.detach(|| scheduler::service_status(&service, &master, Duration::from_secs_f64(timeout.max(0.1))))
        .map_err(GradhubError::new_err)
}

/// A push_pull in flight.
#[pyclass(module = "gradhub._core", name = "Handle")]
struct PyHandle {
    op: Arc<Op>,
}

#[pymethods]
impl PyHandle {
    /// Block (without the GIL) until done; raises on failure or timeout.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let op = self.op.clone();
        let t = timeout.map(|s| Duration::from_secs_f64(s.max(0.0)));
        py.detach(move || op.wait(t)).map_err(py_err)
    }
    fn done(&self) -> bool {
        self.op.done()
    }
    /// Call `callback(error)` once the operation completes: `error` is None on
    /// success, else the failure message. Runs on gradhub's callback thread
    /// (on this thread if the operation is already done).
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        let f = callback;
        if !f.bind(py).is_callable() {
            return Err(PyValueError::new_err("add_done_callback needs a callable"));
        }
        if self.op.done() {
            // Already done: on this thread, which holds the GIL.
            let err = self.op.wait(Some(Duration::ZERO)).err().map(|e| e.to_string());
            f.call1(py, (err,))?;
            return Ok(());
        }
        self.op.on_complete(Box::new(move |res| queue_callback(f, Args::Done(res.err()))));
        Ok(())
    }
    #[getter]
    fn name(&self) -> String {
        self.op.name.clone()
    }
}

#[pyclass(module = "gradhub._core", name = "Client")]
struct PyClient {
    inner: Arc<Client>,
}

#[pymethods]
impl PyClient {
    #[new]
    fn new(py: Python<'_>, config: PyRef<'_, PyClientConfig>) -> PyResult<Self> {
        let cfg = config.cfg.clone();
        let c = py.detach(|| Client::connect(cfg)).map_err(py_err)?;
        Ok(PyClient { inner: Arc::new(c) })
    }
    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank
    }
    #[getter]
    fn size(&self) -> u32 {
        self.inner.num_workers
    }
    #[getter]
    fn local_rank(&self) -> u32 {
        self.inner.local_rank
    }
    #[getter]
    fn local_size(&self) -> u32 {
        self.inner.local_size
    }
    #[getter]
    fn local_ranks(&self) -> Vec<u32> {
        self.inner.local_ranks.clone()
    }
    #[getter]
    fn num_servers(&self) -> u32 {
        self.inner.num_servers
    }
    #[getter]
    fn partition_bytes(&self) -> u32 {
        self.inner.partition_bytes
    }

    /// Declare [(name, numel, dtype, partition_bytes), ...] in one exchange
    /// (partition_bytes 0: the job's).
    fn declare(&self, py: Python<'_>, entries: Vec<(String, u64, String, u32)>) -> PyResult<()> {
        let entries = entries
            .into_iter()
            .map(|(name, numel, d, partition)| {
                Ok(DeclEntry { name, numel, dtype: dtype_of(&d)?, partition, members: Vec::new(), sharded: false })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let c = self.inner.clone();
        py.detach(move || c.declare(entries)).map_err(py_err)
    }

    /// Free named tensors (none in flight) here, and on the servers once
    /// every worker released them.
    fn release(&self, names: Vec<String>) -> PyResult<()> {
        self.inner.release(&names).map_err(py_err)
    }

    /// Tensors this worker holds state for (declared, not released).
    fn num_tensors(&self) -> usize {
        self.inner.stats().tensors
    }

    /// Start an in-place push_pull of raw memory. `owner` is kept alive until done.
    /// `release_after`: free the tensor once this round completes (a
    /// generated name, never used again).
    /// `live`: (from, to) bytes outside which the buffer is zeros (pushed as
    /// header-only zero chunks); None: all of it.
    /// `want`: (from, to) bytes whose result is needed; the chunks wholly
    /// outside keep what was pushed (answered by a header only); None: all.
    /// `live_is_own`: no other worker's bytes fall in `live` (an
    /// all-gather's slot): its chunks keep what was pushed, as unwanted ones.
    /// `members`: the ranks (ascending) that sum this tensor; None: all.
    /// `sharded`: member q reads the q-th of as many equal shards.
    /// `asynchronous`: a push of an asynchronous tensor (`GRADHUB_ASYNC`):
    /// the buffer holds this worker's parameter change (with `init`, its
    /// parameters) and receives the parameters the servers hold.
    #[pyo3(signature = (ptr, nbytes, dtype, name, average, priority, owner, init=false, release_after=false, live=None, want=None, live_is_own=false, members=None, sharded=false, asynchronous=false))]
    #[allow(clippy::too_many_arguments)]
    fn push_pull_async(
        &self,
        ptr: usize,
        nbytes: usize,
        dtype: &str,
        name: &str,
        average: bool,
        priority: i32,
        owner: Py<PyAny>,
        init: bool,
        release_after: bool,
        live: Option<(usize, usize)>,
        want: Option<(usize, usize)>,
        live_is_own: bool,
        members: Option<Vec<u32>>,
        sharded: bool,
        asynchronous: bool,
    ) -> PyResult<PyHandle> {
        let flags = if asynchronous { crate::protocol::FLAG_ASYNC } else { 0 }
            | if average { crate::protocol::FLAG_AVERAGE } else { 0 }
            | if init { crate::protocol::FLAG_INIT } else { 0 };
        let dtype = dtype_of(dtype)?;
        if ptr == 0 && nbytes > 0 {
            return Err(PyValueError::new_err("null buffer"));
        }
        // SAFETY: the Python layer passes the data pointer and size of a
        // contiguous, writable buffer owned by `owner`, which the op keeps alive.
        let op = unsafe {
            self.inner.push_pull_live(
                ptr as *mut u8,
                nbytes,
                dtype,
                name,
                flags,
                release_after,
                priority,
                Some(Box::new(owner)),
                crate::client::Extent { live, want, live_is_own },
                crate::client::Summed { members: members.as_deref().unwrap_or(&[]), sharded },
            )
        }
        .map_err(py_err)?;
        Ok(PyHandle { op })
    }

    /// Run an optimizer on the servers for float32 tensor `name` (see DistributedOptimizer(optimizer_on_server=True)).
    #[pyo3(signature = (name, numel, kind, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=false, beta1=0.9, beta2=0.999, eps=1e-8))]
    #[allow(clippy::too_many_arguments)]
    fn set_server_optimizer(
        &self,
        py: Python<'_>,
        name: String,
        numel: u64,
        kind: &str,
        lr: f32,
        momentum: f32,
        dampening: f32,
        weight_decay: f32,
        nesterov: bool,
        beta1: f32,
        beta2: f32,
        eps: f32,
    ) -> PyResult<()> {
        use crate::protocol::{OptConfig, OptKind};
        let kind = match kind {
            "sgd" => OptKind::Sgd,
            "adamw" => OptKind::AdamW,
            k => return Err(PyValueError::new_err(format!("unknown server optimizer '{k}' (sgd or adamw)"))),
        };
        let cfg = OptConfig { kind, lr, momentum, dampening, weight_decay, nesterov, beta1, beta2, eps };
        let c = self.inner.clone();
        py.detach(move || c.set_server_optimizer(&name, numel, cfg)).map_err(py_err)
    }

    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.inner.clone();
        py.detach(move || c.barrier()).map_err(py_err)
    }

    /// Horovod's join (blocking, without the GIL): (the rank that joined
    /// last, the names this worker pushed zeros for meanwhile).
    fn join(&self, py: Python<'_>) -> PyResult<(u32, Vec<String>)> {
        let c = self.inner.clone();
        py.detach(move || c.join()).map_err(py_err)
    }

    /// Leave the job; with operations still in flight this fails the job
    /// for everyone (naming them) instead of leaving them waiting.
    fn shutdown(&self, py: Python<'_>) {
        let c = self.inner.clone();
        py.detach(move || c.shutdown())
    }

    /// Record every chunk this worker pushes in a Chrome trace at `path`.
    fn start_timeline(&self, path: String) -> PyResult<()> {
        self.inner.start_timeline(&path).map_err(py_err)
    }

    /// Stop recording the chunks' timeline (returns once the file is written).
    fn stop_timeline(&self, py: Python<'_>) {
        let c = self.inner.clone();
        py.detach(move || c.stop_timeline())
    }

    /// The base credit per connection, in bytes.
    #[getter]
    fn credit_bytes(&self) -> usize {
        self.inner.credit()
    }

    /// Change the base credit per connection (from the next chunk sent).
    fn set_credit(&self, bytes: usize) -> PyResult<()> {
        self.inner.set_credit(bytes).map_err(py_err)
    }

    /// Leave the job because this worker failed: every member is told `reason`.
    fn abort(&self, py: Python<'_>, reason: String) {
        let c = self.inner.clone();
        py.detach(move || c.abort(&reason))
    }

    /// The job's failure message, if it has failed.
    fn failure(&self) -> Option<String> {
        self.inner.failure()
    }

    /// Point-to-point links for member `rank` of the group `group` of
    /// `size` members, listening on `host` (`crate::peer`).
    fn peer_links(
        &self,
        rank: u32,
        size: u32,
        group: String,
        host: String,
        timeout: f64,
    ) -> PyResult<peer::PyPeerLinks> {
        let t = Duration::from_secs_f64(timeout.max(0.001));
        let links = self
            .inner
            .peer_links(rank, size, group, host, t)
            .map_err(|e| PyRuntimeError::new_err(format!("gradhub: cannot listen for point-to-point messages: {e}")))?;
        Ok(peer::PyPeerLinks::new(links))
    }

    /// Whether workers wait to join this elastic job.
    fn hosts_updated(&self) -> bool {
        self.inner.hosts_updated()
    }
}

/// One frame as the wire carries it (checksums filled in), for tests and
/// tools that talk to members byte by byte. `payload_len`, when given,
/// overrides the payload's real length (to send a header that lies).
#[pyfunction]
#[pyo3(signature = (msg_type, payload=Vec::new(), key=0, chunk=0, round=0, dtype=0, flags=0, namespace=0, payload_len=None))]
#[allow(clippy::too_many_arguments)]
fn encode_frame(
    py: Python<'_>,
    msg_type: u8,
    payload: Vec<u8>,
    key: u32,
    chunk: u32,
    round: u32,
    dtype: u8,
    flags: u16,
    namespace: u32,
    payload_len: Option<u32>,
) -> PyResult<Py<pyo3::types::PyBytes>> {
    use crate::protocol::{DType, Header, MsgType};
    let bad = |what: &str, v: u8| PyValueError::new_err(format!("unknown {what} {v}"));
    let mut h = Header::new(MsgType::from_u8(msg_type).ok_or_else(|| bad("message type", msg_type))?);
    h.dtype = DType::from_u8(dtype).ok_or_else(|| bad("dtype", dtype))?;
    (h.key, h.chunk, h.round, h.flags, h.namespace) = (key, chunk, round, flags, namespace);
    h.payload_len = payload_len.unwrap_or(payload.len() as u32);
    Ok(pyo3::types::PyBytes::new(py, &crate::protocol::encode_frame(&h, &payload)).unbind())
}

#[pyfunction]
fn kernel_simd_level() -> &'static str {
    crate::kernels::simd_level()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    crate::logging::init();
    m.add_function(wrap_pyfunction!(close_callbacks, m)?)?;
    m.add_function(wrap_pyfunction!(run_scheduler, m)?)?;
    m.add_function(wrap_pyfunction!(start_scheduler, m)?)?;
    m.add_function(wrap_pyfunction!(run_server, m)?)?;
    m.add_function(wrap_pyfunction!(run_service_server, m)?)?;
    m.add_function(wrap_pyfunction!(run_service, m)?)?;
    m.add_function(wrap_pyfunction!(job_token, m)?)?;
    m.add_function(wrap_pyfunction!(service_status, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(config::settings, m)?)?;
    m.add_class::<PyClientConfig>()?;
    m.add_class::<PySchedulerConfig>()?;
    m.add_class::<PyServerConfig>()?;
    m.add_class::<PyServiceConfig>()?;
    m.add_class::<PyServiceServerConfig>()?;
    m.add_class::<PyClient>()?;
    m.add_class::<PyHandle>()?;
    m.add_class::<peer::PyPeerLinks>()?;
    m.add_class::<SchedulerHandle>()?;
    m.add("GradhubError", m.py().get_type::<GradhubError>())?;
    m.add("GradhubTimeoutError", m.py().get_type::<GradhubTimeoutError>())?;
    m.add("DEFAULT_PARTITION_BYTES", crate::DEFAULT_PARTITION_BYTES)?;
    m.add("PROTOCOL_VERSION", crate::protocol::VERSION)?;
    m.add("DEFAULT_CREDIT_BYTES", crate::DEFAULT_CREDIT_BYTES)?;
    Ok(())
}
