"""The launch plan: every process of a job, where it runs, its command line
and its environment, made by pure functions from the launch options
(flags.py) and the worker hosts (-H, a hostfile, a discovery script's; none:
this machine). Nothing here starts a process or opens a socket: the
launchers (local.py, ssh.py; run.py starts and watches a plan) find out
what only the machines can tell (free ports, addresses) and make up the
job's secrets, give them in as a `Site`, and start what the plan lists.
Slurm's steps have a plan too (slurm.py), of the tasks srun starts.

    lay = layout(opts, hosts)        # which worker on which host, where the servers go
    p = plan(opts, lay, site)        # every process's label, host, argv and environment
"""

from __future__ import annotations

import sys
from collections import Counter
from types import MappingProxyType
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

from .flags import LaunchOptions
from .hosts import Host, parse_server_hosts, worker_slots

if TYPE_CHECKING:
    from .elastic import Elastic

GRADHUB = (sys.executable, "-m", "gradhub")

# Variables that describe this login, not the job: a remote login has its own.
_LOCAL_ONLY = {"HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "DISPLAY",
               "MAIL", "TMUX", "STY", "LS_COLORS", "INVOCATION_ID", "JOURNAL_STREAM"}
_LOCAL_PREFIXES = ("SSH_", "XDG_", "DBUS_")


def forwarded(env: Mapping[str, str]) -> dict[str, str]:
    """The part of the launcher's environment a remote process gets."""
    return {k: v for k, v in env.items() if k not in _LOCAL_ONLY and not k.startswith(_LOCAL_PREFIXES)}


def elastic_problem(opts: LaunchOptions, workers: int) -> str | None:
    """What is wrong with the elastic flags for a job of `workers`, or None."""
    if opts.min_workers is None:
        return "--max-workers needs --min-workers (an elastic job)" if opts.max_workers is not None else None
    most = opts.max_workers if opts.max_workers is not None else workers
    if not 1 <= opts.min_workers <= workers <= most:
        return (f"an elastic job needs 1 <= --min-workers ({opts.min_workers}) <= the workers ({workers}) <= "
                f"--max-workers ({most})")
    return None


@dataclass(frozen=True)
class Layout:
    """Where a job's members go."""
    slots: tuple[tuple[int, str | None, int], ...]  # (rank, host, local rank) of every worker; None: this machine
    hosts: tuple[str, ...]                           # the worker hosts in use, in rank order (none: this machine)
    servers: tuple[str | None, ...]                  # each server's host (None: this machine)
    cpu_servers: bool = False                        # --server-hosts: CPU-only servers, not colocated ones

    @property
    def workers(self) -> int:
        return len(self.slots)

    @property
    def every_host(self) -> list[str]:
        """The hosts the job runs on (each once): the worker hosts, then the server hosts."""
        return list(dict.fromkeys(self.hosts + tuple(h for h in self.servers if h is not None)))


def layout(opts: LaunchOptions, hosts: Sequence[Host] | None) -> Layout:
    """The job's layout: `hosts` None, on this machine (-w workers, -s
    servers); else `slots` workers per host, ranked host by host, and a
    colocated server on each worker host used (or one on each --server-hosts
    host). A ValueError says what is wrong with the flags."""
    if hosts is None:
        n = opts.workers if opts.workers is not None else 1
        if n < 1 or opts.servers < 1:
            raise ValueError("need at least one worker and one server")
        problem = elastic_problem(opts, n)
        if problem:
            raise ValueError(problem)
        return Layout(tuple((w, None, w) for w in range(n)), (), (None,) * opts.servers)
    server_hosts = parse_server_hosts(opts.server_hosts) if opts.server_hosts else []
    n = opts.workers
    if opts.host_discovery_script and n is None:  # every slot found, up to --max-workers
        total = sum(h.slots for h in hosts)
        n = min(total, opts.max_workers or total)
    slots = worker_slots(list(hosts), n)
    problem = elastic_problem(opts, len(slots))
    if problem:
        raise ValueError(problem)
    used = tuple(dict.fromkeys(h.name for _, h, _ in slots))
    return Layout(tuple((r, h.name, local) for r, h, local in slots), used, tuple(server_hosts) or used,
                  bool(server_hosts))


@dataclass(frozen=True)
class Site:
    """What the launcher found out or made up before planning: the plan's
    only inputs besides the options and the layout."""
    scheduler: str                            # the scheduler's address, host:port, as every member dials it
    environ: Mapping[str, str]                # the launcher's environment: every process starts from it
    token: str | None = None                  # a job token made up for this launch (None: the environment has one)
    store: tuple[str, int] | None = None      # torch's TCPStore (rank 0's host, a free port there); not elastic
    elastic: Elastic | None = None            # an elastic job's (--min-workers) service token, name and job token


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the plan."""
    role: str                                 # scheduler, server or worker
    label: str                                # its output's prefix, and its name in the launcher's messages
    host: str | None                          # the host it is started on over ssh; None: this machine
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)  # its environment, read-only (a remote one's: what travels there)
    rank: int | None = None                   # a worker's rank, a server's number


@dataclass(frozen=True)
class Plan:
    """A job: its processes in the order they start (the scheduler, the
    servers, then the workers) and what a worker started later gets."""
    scheduler: str                            # the scheduler's address
    processes: tuple[ProcessSpec, ...]
    hosts: tuple[str, ...] = ()               # the worker hosts (none: this machine)
    elastic: Elastic | None = None            # an elastic job: a lost worker does not end it
    joining: Mapping[str, str] = field(default_factory=dict, repr=False)  # a later worker's environment, less its own
    command: tuple[str, ...] = ()
    embedded: bool = False                    # the scheduler and servers run inside the workers (an srun step)

    @property
    def service(self) -> list[ProcessSpec]:
        """The scheduler and the servers (an elastic job's shared service)."""
        return [p for p in self.processes if p.role != "worker"]

    @property
    def servers(self) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == "server"]

    @property
    def workers(self) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == "worker"]

    @property
    def most_workers(self) -> int:
        """The most workers an elastic job may have at once (--max-workers, else its starting size)."""
        return (self.elastic.max_workers if self.elastic else None) or len(self.workers)

    def joiner(self, rank: int, host: str | None) -> ProcessSpec:
        """Worker `rank`, started on `host` while the job runs (an elastic job's
        replacement, or a worker on a discovered slot): it joins at the job's
        next commit; on other hosts, the service gives its local ranks."""
        env = {**self.joining, "GRADHUB_RANK": str(rank)}
        if host is None:
            env["LOCAL_RANK"] = str(rank)
        if self.elastic is not None:
            env = self.elastic.worker_env(env)
        return _spec(f"worker {rank}", host, self.command, env, rank)


def job_env(environ: Mapping[str, str], token: str | None, scheduler: str, workers: int, servers: int,
            partition_bytes: int | None) -> dict[str, str]:
    """The environment every process of the job starts from."""
    base = dict(environ)
    # Every member proves this job's secret on every connection: `token`, made up unless the user gave one.
    if token is not None:
        base["GRADHUB_JOB_TOKEN"] = token
    base.update({
        "GRADHUB_SCHEDULER": scheduler,
        "GRADHUB_NUM_WORKERS": str(workers),
        "GRADHUB_NUM_SERVERS": str(servers),
        "PYTHONUNBUFFERED": "1",
    })
    if partition_bytes:
        base["GRADHUB_PARTITION_BYTES"] = str(partition_bytes)
    return base


def torch_rendezvous_env(host: str, port: int, workers: int) -> dict[str, str]:
    """What torch's default env:// init reads (each worker's RANK is added):
    rank 0 hosts the TCPStore at host:port. gradhub.init() still joins the
    launcher's job (GRADHUB_SCHEDULER wins over MASTER_ADDR)."""
    return {"MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": str(workers)}


def node_env(node: int, nodes: int) -> dict[str, str]:
    """A worker's node, under the names torchrun exports and torch's
    ecosystem reads (Lightning: NODE_RANK or GROUP_RANK): the index of its
    host among the job's worker hosts, whose ranks are contiguous."""
    return {"GROUP_RANK": str(node), "NODE_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes)}


def scheduler_flags(opts: LaunchOptions) -> list[str]:
    """The launch flags the scheduler takes, as its command line."""
    flags = ["--stall-seconds", str(opts.stall_seconds), "--peer-timeout", str(opts.peer_timeout),
             "--join-timeout", str(opts.join_timeout)]
    if opts.partition_bytes:
        flags += ["--partition-bytes", str(opts.partition_bytes)]
    if opts.host_reduce is not None:   # None: the scheduler's default, from the training mode
        flags.append("--host-reduce" if opts.host_reduce else "--no-host-reduce")
    if not opts.failover:
        flags.append("--no-failover")
    flags += ["--rack-reduce", opts.rack_reduce, "--link-gbit", str(opts.link_gbit),
              "--core-gbit", str(opts.core_gbit)]
    return flags


def scheduler_argv(opts: LaunchOptions, bind: str, service: bool) -> tuple[str, ...]:
    """The scheduler's command line; `service`: the shared service of an elastic job."""
    return GRADHUB + ("scheduler", "--bind", bind, *(["--service"] if service else []), *scheduler_flags(opts))


def server_argv(opts: LaunchOptions, colocated: bool, rank: int | None) -> tuple[str, ...]:
    """A server's command line; `rank` None: a server of the job's shared
    service (an elastic job), which takes no rank."""
    argv = GRADHUB + ("server", "--threads", str(opts.server_threads))
    argv += ("--service",) if rank is None else ("--rank", str(rank))
    return argv + (("--colocated",) if colocated else ())


def _spec(name: str, host: str | None, argv: Sequence[str], env: Mapping[str, str], rank: int | None = None
          ) -> ProcessSpec:
    """A process named `name` (role first) on `host`: labelled name@host there."""
    return ProcessSpec(role=name.split()[0], label=f"{name}@{host}" if host else name, host=host,
                       argv=tuple(argv), env=MappingProxyType(forwarded(env) if host else dict(env)), rank=rank)


def plan(opts: LaunchOptions, lay: Layout, site: Site) -> Plan:
    """The job's plan: a scheduler (here; with --scheduler-host first, on the
    first worker host), the servers (on this machine bound to loopback;
    across hosts, colocated on the worker hosts unless --server-hosts), and
    a worker per slot running the command, with the GRADHUB_* variables,
    torchrun's (ranks, local ranks, node ranks; torch's env:// rendezvous
    unless elastic) and, in an elastic job, its name, token and bounds; the
    scheduler and servers of an elastic job are its shared service."""
    el = site.elastic
    base = job_env(site.environ, site.token, site.scheduler, lay.workers, len(lay.servers), opts.partition_bytes)
    svc = el.service_env(base) if el else base
    remote = bool(lay.hosts)
    at = lay.hosts[0] if remote and opts.scheduler_host == "first" else None
    procs = [_spec("scheduler", at, scheduler_argv(opts, site.scheduler, el is not None),
                   {**svc, "GRADHUB_ROLE": "scheduler"})]
    for s, host in enumerate(lay.servers):
        if host is None:
            colocated = opts.colocated or s < opts.colocated_servers
            argv = server_argv(opts, colocated, None if el else s) + ("--advertise-addr", "127.0.0.1",
                                                                      "--bind-host", "127.0.0.1")
        else:
            argv = server_argv(opts, not lay.cpu_servers, None if el else s)
        procs.append(_spec(f"server {s}", host, argv, {**svc, "GRADHUB_ROLE": "server"}, s))
    # torch's env:// rendezvous (`dist.init_process_group("gradhub")` without arguments): rank 0's
    # TCPStore. Not for an elastic job (its size changes).
    torch_env = torch_rendezvous_env(*site.store, lay.workers) if site.store is not None and el is None else {}
    per_host = Counter(h for _, h, _ in lay.slots)
    for rank, host, local in lay.slots:
        if host is None:
            env = {**base, **torch_env, **node_env(0, 1), "GRADHUB_ROLE": "worker", "GRADHUB_RANK": str(rank),
                   "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(lay.workers)}
        else:
            n = str(per_host[host])
            env = {**base, **torch_env, **node_env(lay.hosts.index(host), len(lay.hosts)), "GRADHUB_ROLE": "worker",
                   "GRADHUB_RANK": str(rank), "GRADHUB_LOCAL_RANK": str(local), "GRADHUB_LOCAL_SIZE": n,
                   "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": n}
        if torch_env:
            env["RANK"] = str(rank)
        procs.append(_spec(f"worker {rank}", host, opts.command, el.worker_env(env) if el else env, rank))
    # A worker started later: on this machine, one more like the others; on
    # another host, the service gives its local ranks.
    joining = ({**base, **node_env(0, 1), "GRADHUB_ROLE": "worker", "LOCAL_WORLD_SIZE": str(lay.workers)}
               if not remote else {**base, "GRADHUB_ROLE": "worker"})
    return Plan(site.scheduler, tuple(procs), lay.hosts, el, MappingProxyType(joining), tuple(opts.command))
