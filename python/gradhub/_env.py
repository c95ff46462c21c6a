"""Every setting gradhub reads from the environment, parsed in one place,
by the registry the core declares them in (src/settings.rs, as
`_core.settings()`): name, type, default, roles, help, tier.

gradhub reads its own GRADHUB_* variables first and falls back to torchrun's
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or
in an srun step to Slurm's (_slurm.py), so a script started by `gradhub
launch`, torchrun or srun needs no extra setup. A value
that does not parse raises a ValueError naming the variable.

Readers by role: `worker_env()` (gradhub.init), `scheduler_env()` and
`server_env()` (the `gradhub scheduler|server` commands, GRADHUB_ROLE and the
torchrun-embedded roles), `role()`, `torch_options()` (DistributedOptimizer).
GRADHUB_LOG, GRADHUB_KERNELS, GRADHUB_SPIN_US, GRADHUB_TCP_CONGESTION and
GRADHUB_HOST_ID are read by the Rust core itself, through the same registry.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from . import _core
from ._slurm import step as slurm_step

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class Setting(NamedTuple):
    """A row of the registry (src/settings.rs)."""
    name: str
    kind: str                      # str, int, float, flag or choice
    default: str | None            # as the variable would be written; None: unset
    default_doc: str               # the default as the docs show it
    roles: tuple[str, ...]         # worker, server, scheduler, launcher, bench
    help: str
    choices: tuple[str, ...]
    aliases: tuple[str, ...]       # older names read when this one is not set (Horovod's)
    tier: str                      # user, advanced or internal (see TIERS)


SETTINGS: dict[str, Setting] = {
    r[0]: Setting(r[0], r[1], r[2], r[3], tuple(r[4]), r[5], tuple(r[6]), tuple(r[7]), r[8])
    for r in _core.settings()
}

# Who a setting is for, and the heading it is listed under: docs/settings.md shows the
# first two tiers, `gradhub settings --all` every one.
TIERS = {
    "user": "User-facing settings (what you set to run a job)",
    "advanced": "Advanced settings (tuning and layout)",
    "internal": "Internal settings (test, benchmark and ablation knobs, not for jobs)",
}
DOCUMENTED_TIERS = ("user", "advanced")

_REGISTRY = object()  # get()'s default: the registry's


def setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a gradhub setting: declare it in src/settings.rs") from None


def _present(name: str, flag: bool) -> str | None:
    v = os.environ.get(name)
    if v is None or (not flag and v.strip() == ""):
        return None
    return v


def _parse(name: str, kind: str, v: str, choices: tuple[str, ...] = ()) -> Any:
    """`v`, the value of variable `name`, as `kind`; ValueError naming it."""
    if kind == "int":
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"environment variable {name}={v!r} is not an integer") from None
    if kind == "float":
        try:
            return float(v)
        except ValueError:
            raise ValueError(f"environment variable {name}={v!r} is not a number") from None
    if kind == "flag":
        s = v.strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        raise ValueError(f"environment variable {name}={v!r} is not a flag (use 1/0, true/false, yes/no or on/off)")
    if kind == "choice":
        s = v.strip().lower()
        if s not in choices:
            expected = ", ".join(choices[:-1]) + " or " + choices[-1]
            raise ValueError(f"environment variable {name}={s!r}: expected {expected}")
        return s
    return v.strip()


def get(name: str, default: Any = _REGISTRY) -> Any:
    """Setting `name` (or an alias) as its registry type; if unset (empty,
    except for a flag), `default`, else the registry's default (None: it
    has none). A malformed value raises ValueError naming the variable."""
    s = setting(name)
    flag = s.kind == "flag"
    for var in (name, *s.aliases):
        v = _present(var, flag)
        if v is not None:
            return _parse(var, s.kind, v, s.choices)
    if default is not _REGISTRY:
        return default
    return None if s.default is None else _parse(name, s.kind, s.default, s.choices)


def is_set(name: str) -> bool:
    return _present(setting(name).name, setting(name).kind == "flag") is not None


def _torchrun_int(name: str, default: int | None = None) -> int | None:
    """One of torchrun's variables (not gradhub settings): RANK, WORLD_SIZE, ..."""
    v = _present(name, False)
    return default if v is None else _parse(name, "int", v)


def torchrun_master() -> str | None:
    """torchrun's MASTER_ADDR (not a gradhub setting), if set."""
    return _present("MASTER_ADDR", False)


def fallback(name: str) -> str:
    """A command-line flag's help suffix: the variable it falls back to and
    the default from the registry."""
    return f"({name}; default {setting(name).default_doc})"


def _entry(s: Setting) -> list[str]:
    """A setting as the help texts show it: name, default, wrapped help."""
    alias = f" (or {', '.join(s.aliases)})" if s.aliases else ""
    return [f"  {s.name}{alias}  [default: {s.default_doc}]",
            *textwrap.wrap(s.help.replace("`", ""), 76, initial_indent="      ", subsequent_indent="      ")]


def env_help(roles: tuple[str, ...]) -> str:
    """The `gradhub <cmd> --help` epilog: every user-facing and advanced
    setting a role reads (the internal ones: `gradhub settings --all`)."""
    lines = ["environment (flags win over variables; internal ones: gradhub settings --all):"]
    for s in SETTINGS.values():
        if set(s.roles) & set(roles) and s.tier in DOCUMENTED_TIERS:
            lines += _entry(s)
    return "\n".join(lines) + "\n"


def settings_text(all_tiers: bool = False) -> str:
    """`gradhub settings`: the user-facing and advanced settings under a
    heading each; with `all_tiers` (`--all`) the internal ones too."""
    blocks = []
    for tier, heading in TIERS.items():
        if all_tiers or tier in DOCUMENTED_TIERS:
            entries = [line for s in SETTINGS.values() if s.tier == tier for line in _entry(s)]
            blocks.append("\n".join([f"{heading}:", *entries]))
    if not all_tiers:
        blocks.append("Internal settings (test, benchmark and ablation knobs): gradhub settings --all.")
    return "\n\n".join(blocks) + "\n"


def markdown_table(all_tiers: bool = False) -> str:
    """docs/settings.md's tables (`gradhub settings --markdown`): the
    user-facing and the advanced settings, each under a heading (with
    `all_tiers`, the internal ones too)."""
    out = []
    for tier in TIERS if all_tiers else DOCUMENTED_TIERS:
        rows = [f"### {TIERS[tier]}", "", "| variable | default | read by | meaning |", "| --- | --- | --- | --- |"]
        for s in SETTINGS.values():
            if s.tier == tier:
                name = f"`{s.name}`" + "".join(f" (or `{a}`)" for a in s.aliases)
                rows.append(f"| {name} | {s.default_doc} | {', '.join(s.roles)} | {s.help} |")
        out.append("\n".join(rows) + "\n")
    return "\n".join(out)


# ---------------------------------------------------------------- workers


@dataclass
class WorkerEnv:
    scheduler: str | None
    rank: int
    num_workers: int
    num_servers: int
    local_rank: int | None
    local_size: int | None
    namespace: int
    credit_bytes: int | None
    spread_bytes: int | None       # GRADHUB_SPREAD_BYTES: None = 4 x the credit, 0 = no limit
    connect_timeout: float
    server_shm: bool               # GRADHUB_SERVER_SHM: push to a server on this host through shared memory
    token: str | None              # GRADHUB_JOB_TOKEN(_FILE): see job_token()
    insecure: bool                 # GRADHUB_INSECURE
    job: str | None                # GRADHUB_JOB: this job's name on a shared service
    timeline: str | None           # GRADHUB_TIMELINE (or HOROVOD_TIMELINE): worker 0's Chrome trace file
    rack: str                      # GRADHUB_RACK: this worker's rack ("": none)
    min_workers: int | None        # GRADHUB_MIN_WORKERS: an elastic job's fewest workers (None: fixed size)
    max_workers: int | None        # GRADHUB_MAX_WORKERS (None: the job's starting size)
    torchrun: bool
    # torchrun without GRADHUB_SCHEDULER: this job hosts its scheduler and
    # servers inside the worker processes (see gradhub.api).
    embedded: bool


def worker_env() -> WorkerEnv:
    torchrun = "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ
    # A task of an srun step: Slurm's variables play torchrun's part.
    slurm = None if torchrun else slurm_step(os.environ)
    scheduler = get("GRADHUB_SCHEDULER")
    embedded = (torchrun or slurm is not None) and scheduler is None
    if embedded and slurm is not None:
        scheduler = f"{slurm.scheduler_host}:{get('GRADHUB_SCHEDULER_PORT') or slurm.port}"
    elif embedded:
        port = get("GRADHUB_SCHEDULER_PORT") or (_torchrun_int("MASTER_PORT", 29500) + 1)
        scheduler = f"{os.environ['MASTER_ADDR']}:{port}"
    num_workers = get("GRADHUB_NUM_WORKERS", slurm.size if slurm else _torchrun_int("WORLD_SIZE", 0))
    # Checked by the scheduler against the host identities (GRADHUB_HOST_ID, or
    # host name and network namespace) of every worker that registered.
    local_size = get("GRADHUB_LOCAL_SIZE", slurm.local_size if slurm else _torchrun_int("LOCAL_WORLD_SIZE"))
    default_servers = 0
    job = get("GRADHUB_JOB")
    if torchrun and num_workers and local_size and job is None:
        default_servers = max(1, num_workers // local_size)  # one per node
    elif embedded and slurm is not None and job is None:
        default_servers = len(slurm.nodes)  # one per node, colocated
    return WorkerEnv(
        scheduler=scheduler,
        rank=get("GRADHUB_RANK", slurm.rank if slurm else _torchrun_int("RANK", -1)),
        num_workers=num_workers,
        num_servers=get("GRADHUB_NUM_SERVERS", default_servers),
        local_rank=get("GRADHUB_LOCAL_RANK", slurm.local_rank if slurm else _torchrun_int("LOCAL_RANK")),
        local_size=local_size,
        namespace=get("GRADHUB_NAMESPACE"),
        credit_bytes=get("GRADHUB_CREDIT_BYTES", None),
        spread_bytes=get("GRADHUB_SPREAD_BYTES"),
        connect_timeout=get("GRADHUB_CONNECT_TIMEOUT"),
        server_shm=get("GRADHUB_SERVER_SHM"),
        token=job_token(),
        insecure=insecure(),
        job=job,
        timeline=get("GRADHUB_TIMELINE"),
        rack=get("GRADHUB_RACK"),
        min_workers=get("GRADHUB_MIN_WORKERS"),
        max_workers=get("GRADHUB_MAX_WORKERS"),
        torchrun=torchrun,
        embedded=embedded,
    )


def role() -> str:
    """GRADHUB_ROLE: worker (default), server or scheduler."""
    return get("GRADHUB_ROLE")


# ---------------------------------------------------------------- authentication


def _secret(var: str) -> str | None:
    """`var`, or the contents of the file `var`_FILE names (surrounding
    whitespace stripped)."""
    token = get(var)
    if token is not None:
        return token
    path = get(f"{var}_FILE")
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"{var}_FILE={path!r}: cannot read it: {e.strerror}") from None
    if not token:
        raise ValueError(f"{var}_FILE={path!r} is empty")
    return token


def job_token() -> str | None:
    """The job's secret: GRADHUB_JOB_TOKEN, or the contents of the file
    GRADHUB_JOB_TOKEN_FILE names. Every member of a job must have the same
    one; it never crosses the network."""
    return _secret("GRADHUB_JOB_TOKEN")


def service_token() -> str | None:
    """A shared service's master token: GRADHUB_SERVICE_TOKEN, or the file
    GRADHUB_SERVICE_TOKEN_FILE names. Only the service's scheduler, its
    servers and its operator hold it; each job gets a token derived from it
    (`gradhub token JOB`)."""
    return _secret("GRADHUB_SERVICE_TOKEN")


class TorchrunToken(NamedTuple):
    """A job token shared through torchrun's store (`torchrun_token()`)."""
    token: str
    formed: Callable[[], None]     # call once the job has formed (every member registered)


def torchrun_token(rank: int, timeout: float) -> TorchrunToken | None:
    """A job token for a torchrun job that hosts its own scheduler and servers
    (no GRADHUB_SCHEDULER) and was given none: rank 0 makes one up and shares
    it through torchrun's own store (the elastic agent's TCPStore at
    MASTER_ADDR:MASTER_PORT, which torch.distributed's env:// rendezvous uses
    too), so only processes of this torchrun job learn it. None when the
    processes were not started by torchrun's agent, or its store is not
    shared with them (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).

    The store outlives the group: torchrun restarts every worker after a
    failure or a change of nodes (--nnodes MIN:MAX), and the next group
    finds it. So rank 0 deletes its token once the job has formed (every
    member registered with it: `formed()`), and the next group's readers wait
    for the next rank 0's. The key names no TORCHELASTIC_RESTART_COUNT: that
    count differs between nodes (a failure counts on the failing node only, a
    change of nodes on none, and a node that joins later starts at 0). A
    group that fails before it forms leaves its token behind; a reader of the
    next one may then take it, fail to authenticate, and torchrun restarts
    the group once more."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import datetime
    import secrets

    from torch.distributed import TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout))
    key = "gradhub/job_token"
    if rank != 0:
        return TorchrunToken(store.get(key).decode(), lambda: None)

    def formed() -> None:
        try:
            store.delete_key(key)
        except RuntimeError as e:  # the job stands: only the next group's readers could be misled
            print(f"[gradhub] warning: cannot delete the job token from torchrun's store: {e}", file=sys.stderr)

    token = secrets.token_hex(32)
    store.set(key, token)
    return TorchrunToken(token, formed)


def insecure() -> bool:
    """GRADHUB_INSECURE: run a job reachable from other hosts without a token."""
    return get("GRADHUB_INSECURE")


def encrypt() -> bool:
    """GRADHUB_ENCRYPT: seal every connection (the core reads it too)."""
    return get("GRADHUB_ENCRYPT")


def set_encrypt() -> None:
    """`--encrypt`: GRADHUB_ENCRYPT=1 for this process, whose core reads it
    when it builds each role's config, and for every process it starts."""
    os.environ["GRADHUB_ENCRYPT"] = "1"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, as given) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(who: str, hosts: list[str], token: str | None, allow_insecure: bool) -> None:
    """A member whose connections may leave this machine needs a token,
    unless the user explicitly chose to run without one. Raises ValueError."""
    if token is not None or allow_insecure:
        return
    exposed = [h for h in hosts if not is_loopback(h)]
    if exposed:
        raise ValueError(
            f"{who}: {exposed[0]} is reachable from other machines, and no job token is set. Set "
            "GRADHUB_JOB_TOKEN to the same secret on every member of the job (for example the output of "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`), or GRADHUB_JOB_TOKEN_FILE to a file "
            "holding it; or pass --insecure (GRADHUB_INSECURE=1) to run without authentication, letting anyone "
            "who can reach these ports join the job"
        )


# ---------------------------------------------------------------- scheduler and servers


@dataclass
class SchedulerEnv:
    scheduler: str | None          # GRADHUB_SCHEDULER: its port is the default bind port
    num_workers: int | None
    num_servers: int | None
    partition_bytes: int | None    # None: the core's default
    stall_seconds: float
    peer_timeout: float
    join_timeout: float            # GRADHUB_JOIN_TIMEOUT: for every member to register (an elastic generation too)
    namespace: int
    host_reduce: bool | None       # GRADHUB_HOST_REDUCE: workers sharing a host sum there first (None: unless asynchronous)
    failover: bool                 # GRADHUB_FAILOVER: a lost server's chunks move to the others
    rack_reduce: str               # GRADHUB_RACK_REDUCE: auto (PHub's model), on or off
    link_gbit: float               # GRADHUB_LINK_GBIT: each host's link, for the model (0: not given)
    core_gbit: float               # GRADHUB_CORE_GBIT: each rack's link to the core (0: not given)
    metrics_addr: str | None       # GRADHUB_METRICS_ADDR: serve Prometheus metrics there


def scheduler_env() -> SchedulerEnv:
    return SchedulerEnv(
        scheduler=get("GRADHUB_SCHEDULER"),
        num_workers=get("GRADHUB_NUM_WORKERS"),
        num_servers=get("GRADHUB_NUM_SERVERS"),
        partition_bytes=get("GRADHUB_PARTITION_BYTES", None),
        stall_seconds=get("GRADHUB_STALL_SECONDS"),
        peer_timeout=get("GRADHUB_PEER_TIMEOUT"),
        join_timeout=get("GRADHUB_JOIN_TIMEOUT"),
        namespace=get("GRADHUB_NAMESPACE"),
        host_reduce=get("GRADHUB_HOST_REDUCE"),
        failover=get("GRADHUB_FAILOVER"),
        rack_reduce=get("GRADHUB_RACK_REDUCE"),
        link_gbit=get("GRADHUB_LINK_GBIT"),
        core_gbit=get("GRADHUB_CORE_GBIT"),
        metrics_addr=get("GRADHUB_METRICS_ADDR"),
    )


@dataclass
class ServerEnv:
    scheduler: str | None
    threads: int | None            # None: the launcher's default (docs/settings.md)
    colocated: bool
    advertise: str | None
    port: int
    rank: int
    num_workers: int
    num_servers: int
    namespace: int
    connect_timeout: float
    timeline: str | None           # GRADHUB_SERVER_TIMELINE: the server's Chrome trace ({rank}: its rank)
    rack: str                      # GRADHUB_RACK: this server's rack ("": none)
    metrics_addr: str | None       # GRADHUB_METRICS_ADDR: serve Prometheus metrics there


def server_env() -> ServerEnv:
    return ServerEnv(
        scheduler=get("GRADHUB_SCHEDULER"),
        threads=get("GRADHUB_SERVER_THREADS"),
        colocated=get("GRADHUB_COLOCATED"),
        advertise=get("GRADHUB_ADVERTISE_ADDR"),
        port=get("GRADHUB_SERVER_PORT"),
        rank=get("GRADHUB_SERVER_RANK"),
        num_workers=get("GRADHUB_NUM_WORKERS", 0),
        num_servers=get("GRADHUB_NUM_SERVERS", 0),
        namespace=get("GRADHUB_NAMESPACE"),
        connect_timeout=get("GRADHUB_CONNECT_TIMEOUT"),
        timeline=get("GRADHUB_SERVER_TIMELINE"),
        rack=get("GRADHUB_RACK"),
        metrics_addr=get("GRADHUB_METRICS_ADDR"),
    )


# ---------------------------------------------------------------- gradhub.torch


# Bytes of a fusion bucket (the registry's GRADHUB_FUSION_THRESHOLD).
DEFAULT_FUSION_THRESHOLD = int(setting("GRADHUB_FUSION_THRESHOLD").default)


@dataclass
class TorchOptions:
    overlap_forward: bool | str    # or "auto": off unless autotuning tries it
    optimizer_on_server: bool
    scheduling: str                # priority or fifo
    eager_update: bool             # the synchronous step updates each parameter as its gradient comes in
    sfb: str                       # sufficient factors: auto, off or force
    fusion_threshold: int          # bytes of a fusion bucket (small gradients travel packed); 0: off


@dataclass
class AutotuneOptions:
    enabled: bool                  # GRADHUB_AUTOTUNE (or HOROVOD_AUTOTUNE)
    file: str | None               # GRADHUB_AUTOTUNE_FILE: load the choice from it if it is there, else save it
    log: str | None                # GRADHUB_AUTOTUNE_LOG (or HOROVOD_AUTOTUNE_LOG): a CSV line per trial
    warmup_steps: int              # GRADHUB_AUTOTUNE_WARMUP_STEPS: steps before the first trial
    steps_per_trial: int           # GRADHUB_AUTOTUNE_STEPS_PER_TRIAL: steps timed per trial
    # Which knobs were set by the user (environment), and stay as set.
    fixed: frozenset


def autotune_options() -> AutotuneOptions:
    # (Forward overlap is tried only when allowed: GRADHUB_OVERLAP_FORWARD=auto.)
    fixed = {knob for knob, var in (("fusion_threshold", "GRADHUB_FUSION_THRESHOLD"),
                                    ("credit_bytes", "GRADHUB_CREDIT_BYTES")) if is_set(var)}
    enabled = get("GRADHUB_AUTOTUNE")
    warmup, steps = get("GRADHUB_AUTOTUNE_WARMUP_STEPS"), get("GRADHUB_AUTOTUNE_STEPS_PER_TRIAL")
    if warmup < 0 or steps < 1:
        raise ValueError("GRADHUB_AUTOTUNE_WARMUP_STEPS must be >= 0 and GRADHUB_AUTOTUNE_STEPS_PER_TRIAL >= 1")
    return AutotuneOptions(enabled=enabled, file=get("GRADHUB_AUTOTUNE_FILE"),
                           log=get("GRADHUB_AUTOTUNE_LOG"),
                           warmup_steps=warmup, steps_per_trial=steps, fixed=frozenset(fixed))


def torch_options() -> TorchOptions:
    """The DistributedOptimizer switches, so an unchanged Horovod script can use them."""
    return TorchOptions(
        # A flag, or `auto`: off, and autotune may try it.
        overlap_forward="auto" if os.environ.get("GRADHUB_OVERLAP_FORWARD", "").strip().lower() == "auto"
        else get("GRADHUB_OVERLAP_FORWARD"),
        optimizer_on_server=get("GRADHUB_OPTIMIZER_ON_SERVER"),
        scheduling=get("GRADHUB_SCHEDULING"),
        eager_update=get("GRADHUB_EAGER_UPDATE"),
        sfb=get("GRADHUB_SFB"),
        fusion_threshold=get("GRADHUB_FUSION_THRESHOLD"),
    )
