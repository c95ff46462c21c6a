"""`gradhub launch` without hosts: a whole job on this machine, supervised;
and what every launch shares (the job's environment, the scheduler's flags).

Starts the scheduler, the servers and the workers as child processes, prefixes
every output line with the role and rank, and stops everything as soon as one
process fails, returning its exit code. When all workers succeed, the
scheduler tells the servers to exit; stragglers are terminated after a grace
period. With --min-workers, the job is elastic (elastic.py): it runs on a
shared service started for it, and a lost worker does not end it.
"""

from __future__ import annotations

import os
import secrets
import sys

from .. import _env
from .._ports import free_port
from . import elastic
from .proc import Proc, supervise

GRADHUB = [sys.executable, "-m", "gradhub"]


def job_env(args, scheduler: str, workers: int, servers: int) -> dict[str, str]:
    """The environment every process of the job starts from."""
    base = dict(os.environ)
    # Every member proves this job's secret on every connection; one is made
    # up unless the user gave one.
    if _env.job_token() is None:
        base["GRADHUB_JOB_TOKEN"] = secrets.token_hex(32)
    base.update({
        "GRADHUB_SCHEDULER": scheduler,
        "GRADHUB_NUM_WORKERS": str(workers),
        "GRADHUB_NUM_SERVERS": str(servers),
        "PYTHONUNBUFFERED": "1",
    })
    if args.partition_bytes:
        base["GRADHUB_PARTITION_BYTES"] = str(args.partition_bytes)
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


def scheduler_flags(args) -> list[str]:
    """The launch flags the scheduler takes, as its command line."""
    flags = ["--stall-seconds", str(args.stall_seconds), "--peer-timeout", str(args.peer_timeout)]
    if args.partition_bytes:
        flags += ["--partition-bytes", str(args.partition_bytes)]
    if args.host_reduce is not None:   # None: the scheduler's default, from the training mode
        flags.append("--host-reduce" if args.host_reduce else "--no-host-reduce")
    if not args.failover:
        flags.append("--no-failover")
    flags += ["--rack-reduce", args.rack_reduce, "--link-gbit", str(args.link_gbit),
              "--core-gbit", str(args.core_gbit)]
    return flags


def scheduler_argv(args, bind: str, service: bool) -> list[str]:
    """The scheduler's command line; `service`: the shared service of an elastic job."""
    return GRADHUB + ["scheduler", "--bind", bind] + (["--service"] if service else []) + scheduler_flags(args)


def server_argv(args, colocated: bool, rank: int | None) -> list[str]:
    """A server's command line; `rank` None: a server of the job's shared
    service (an elastic job), which takes no rank."""
    argv = GRADHUB + ["server", "--threads", str(args.server_threads)]
    argv += ["--service"] if rank is None else ["--rank", str(rank)]
    return argv + (["--colocated"] if colocated else [])


def launch_local(args, command: list[str]) -> int:
    workers_n = args.workers if args.workers is not None else 1
    if workers_n < 1 or args.servers < 1:
        print("gradhub launch: need at least one worker and one server", file=sys.stderr)
        return 2
    problem = elastic.check(args, workers_n)
    if problem:
        print(f"gradhub launch: {problem}", file=sys.stderr)
        return 2
    el = elastic.Elastic(args) if args.min_workers is not None else None
    port = args.port or free_port()
    sched = f"127.0.0.1:{port}"
    base = job_env(args, sched, workers_n, args.servers)
    svc_env = el.service_env(base) if el else base
    procs: list[Proc] = []
    procs.append(Proc("scheduler", scheduler_argv(args, sched, el is not None),
                      {**svc_env, "GRADHUB_ROLE": "scheduler"}))
    for s in range(args.servers):
        colocated = args.colocated or s < args.colocated_servers
        argv = server_argv(args, colocated, None if el else s) + ["--advertise-addr", "127.0.0.1",
                                                                  "--bind-host", "127.0.0.1"]
        procs.append(Proc(f"server {s}", argv, {**svc_env, "GRADHUB_ROLE": "server"}))
    rc = el.ready(sched, args.servers, procs, "gradhub launch") if el else None
    if rc is not None:
        return rc
    started = iter(range(1 << 30))
    # torch's env:// rendezvous (`dist.init_process_group("gradhub")` without arguments): rank 0's
    # TCPStore on a free port here. Not for an elastic job (its size changes).
    torch_env = {} if el else torch_rendezvous_env("127.0.0.1", free_port(), workers_n)

    def start_worker(_lost: Proc | None = None) -> Proc:
        w = next(started)
        env = {**base, **torch_env, **node_env(0, 1), "GRADHUB_ROLE": "worker", "GRADHUB_RANK": str(w),
               "LOCAL_RANK": str(w), "LOCAL_WORLD_SIZE": str(workers_n)}
        if torch_env:
            env["RANK"] = str(w)
        return Proc(f"worker {w}", command, el.worker_env(env) if el else env)

    workers = [start_worker() for _ in range(workers_n)]
    procs += workers
    # An elastic job with --max-workers: a lost worker is replaced (here, on this machine).
    replace = start_worker if el is not None and el.max_workers is not None else None
    return supervise(procs, workers, "gradhub launch", min_workers=el.min_workers if el else None,
                     replace=replace, max_workers=el.max_workers or 0 if el else 0,
                     stop_service=el.stop if el else None)
