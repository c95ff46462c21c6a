"""The `gradhub` command: launch a local job, or run one role of a multi-host job.

Every flag falls back to the GRADHUB_* variable the workers read, so one
environment describes a job for all roles. Servers never import torch.
"""

from __future__ import annotations

import argparse
import sys

from . import _env, roles

ENV_HELP = """
environment (flags win over variables):
  GRADHUB_SCHEDULER        scheduler host:port (all roles)
  GRADHUB_JOB_TOKEN        the job's secret, the same on every member: every
                           connection proves it (launch makes one up); or
  GRADHUB_JOB_TOKEN_FILE   a file holding it
  GRADHUB_INSECURE=1       allow a job reachable from other machines without
                           a token (anyone reaching its ports can join)
  GRADHUB_NUM_WORKERS      number of workers in the job
  GRADHUB_NUM_SERVERS      number of summation servers in the job
  GRADHUB_SERVER_THREADS   threads (cores) per server (default: launch 1, server
                           the number of cores, torchrun-embedded server 1)
  GRADHUB_COLOCATED=1      this server shares a machine with a worker
  GRADHUB_ADVERTISE_ADDR   address a server tells workers to use
  GRADHUB_PARTITION_BYTES  chunk size (scheduler decides for the job)
  GRADHUB_CREDIT_BYTES     bytes in flight per server-thread connection (workers)
  GRADHUB_STALL_SECONDS    report rounds stalled longer than this
  GRADHUB_PEER_TIMEOUT     seconds of silence before a member is declared dead
                           (at least 2: two heartbeats); set on the scheduler,
                           which tells every member
  GRADHUB_LOG              log level of every role: error, warn, info (default)
                           or debug
  GRADHUB_LOCAL_RANK/SIZE  a worker's rank among its host's workers and their
                           number (default: torchrun's LOCAL_RANK and
                           LOCAL_WORLD_SIZE); checked by the scheduler
  GRADHUB_HOST_ID          which workers share a machine (default: host name
                           and network namespace)
  GRADHUB_HOST_REDUCE=0    workers that share a machine do not sum there
                           first (scheduler; default on)
  GRADHUB_FAILOVER=0       losing a server fails the job instead of moving
                           its chunks to the others (scheduler; default on)
"""


def _add_scheduler_args(p: argparse.ArgumentParser, env: _env.SchedulerEnv) -> None:
    p.add_argument("--partition-bytes", type=int, default=env.partition_bytes,
                   help="chunk size in bytes (default: GRADHUB_PARTITION_BYTES or 256 KiB)")
    p.add_argument("--stall-seconds", type=float, default=env.stall_seconds,
                   help="servers report a round that waited longer than this (default 30)")
    p.add_argument("--peer-timeout", type=float, default=env.peer_timeout,
                   help="seconds without a heartbeat before any member is declared dead; the scheduler tells "
                   "every member (GRADHUB_PEER_TIMEOUT; default 10)")
    p.add_argument("--no-host-reduce", dest="host_reduce", action="store_false", default=env.host_reduce,
                   help="workers that share a machine each push everything themselves instead of summing in "
                   "shared memory first and pushing one share each (GRADHUB_HOST_REDUCE=0)")
    p.add_argument("--no-failover", dest="failover", action="store_false", default=env.failover,
                   help="fail the job when a server is lost, instead of moving its chunks to the other servers "
                   "and going on (GRADHUB_FAILOVER=0)")


def build_parser() -> argparse.ArgumentParser:
    """The command line; defaults come from the environment (a malformed
    variable raises ValueError naming it)."""
    senv = _env.scheduler_env()
    venv = _env.server_env()
    p = argparse.ArgumentParser(
        prog="gradhub",
        description="gradhub: gradient synchronization for data-parallel training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=ENV_HELP,
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    lp = sub.add_parser(
        "launch",
        help="run a whole job on this machine: scheduler, servers and workers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a scheduler, K servers and N workers on this machine. Each worker runs the "
        "given command with GRADHUB_* set; output lines are prefixed with role and rank. If any process "
        "fails, everything is stopped and its exit code is returned.",
        epilog="example:\n  gradhub launch -w 4 -s 2 -- python train.py --epochs 3\n" + ENV_HELP,
    )
    lp.add_argument("-w", "--workers", type=int, required=True, help="number of worker processes")
    lp.add_argument("-s", "--servers", type=int, default=1, help="number of summation servers (default 1)")
    lp.add_argument("--server-threads", type=int, default=venv.threads or 1,
                    help="threads per server (GRADHUB_SERVER_THREADS; default 1)")
    g = lp.add_mutually_exclusive_group()
    g.add_argument("--colocated", action="store_true",
                   help="mark every server as colocated with a worker (all-reduce-like traffic split)")
    g.add_argument("--colocated-servers", type=int, default=0, metavar="C",
                   help="mark the first C servers colocated, the rest CPU-only (mixed job)")
    lp.add_argument("--port", type=int, default=0, help="scheduler port (default: a free port)")
    _add_scheduler_args(lp, senv)
    lp.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the worker command")

    sp = sub.add_parser(
        "scheduler",
        help="run the job's scheduler (one per job)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the rendezvous/declaration/liveness service of one job. Exits 0 when every "
        "worker has finished, 1 if the job failed.",
        epilog=ENV_HELP,
    )
    sp.add_argument("--bind", default=None,
                    help="host:port to listen on (default: the port of GRADHUB_SCHEDULER, or 9000, on its host "
                    "if that is loopback, else on 0.0.0.0)")
    sp.add_argument("--insecure", action="store_true", default=_env.insecure(),
                    help="listen beyond loopback without a job token (GRADHUB_INSECURE=1): anyone who can "
                    "reach the port can join the job")
    sp.add_argument("--workers", type=int, default=senv.num_workers,
                    help="number of workers (GRADHUB_NUM_WORKERS)")
    sp.add_argument("--servers", type=int, default=senv.num_servers,
                    help="number of servers (GRADHUB_NUM_SERVERS)")
    _add_scheduler_args(sp, senv)

    vp = sub.add_parser(
        "server",
        help="run one summation server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a summation server: one thread per core, each owning a fixed share of the "
        "chunks. Registers with the scheduler and exits when the job ends.",
        epilog=ENV_HELP,
    )
    vp.add_argument("--scheduler", default=venv.scheduler,
                    help="scheduler host:port (GRADHUB_SCHEDULER)")
    vp.add_argument("--threads", type=int, default=venv.threads if venv.threads is not None else roles.default_server_threads(),
                    help="server threads (GRADHUB_SERVER_THREADS; default: number of cores)")
    vp.add_argument("--colocated", action="store_true", default=venv.colocated,
                    help="this server runs on a worker machine (GRADHUB_COLOCATED=1)")
    vp.add_argument("--advertise-addr", default=venv.advertise,
                    help="address workers should connect to (GRADHUB_ADVERTISE_ADDR; default: the local "
                    "address of the interface that reaches the scheduler)")
    vp.add_argument("--bind-host", default=None,
                    help="host to listen on (default: 127.0.0.1 if the scheduler is on loopback, else 0.0.0.0)")
    vp.add_argument("--insecure", action="store_true", default=_env.insecure(),
                    help="reach beyond loopback without a job token (GRADHUB_INSECURE=1)")
    vp.add_argument("--port", type=int, default=venv.port,
                    help="first port; thread t listens on port+t (GRADHUB_SERVER_PORT; default: free ports)")
    vp.add_argument("--rank", type=int, default=venv.rank,
                    help="request this server rank (GRADHUB_SERVER_RANK; default: assigned)")
    vp.add_argument("--connect-timeout", type=float, default=venv.connect_timeout,
                    help="seconds to keep retrying the scheduler (GRADHUB_CONNECT_TIMEOUT; default 60)")
    sub.add_parser("bench", help="benchmarks: the data plane on loopback (bench core), PyTorch options "
                   "(bench torch-options) and the emulated-cluster suite (see `gradhub bench --help`)",
                   add_help=False)
    return p


def _run_scheduler(args) -> int:
    e = _env.scheduler_env()
    return roles.run_scheduler(args.bind, args.workers, args.servers, args.partition_bytes, args.stall_seconds,
                               args.peer_timeout, e.namespace, scheduler=e.scheduler, host_reduce=args.host_reduce,
                               failover=args.failover, token=_env.job_token(), insecure=args.insecure)


def _run_server(args) -> int:
    e = _env.server_env()
    return roles.run_server(args.scheduler, args.threads, args.colocated, args.advertise_addr, args.bind_host,
                            args.port, args.rank, e.num_workers, e.num_servers, e.namespace, args.connect_timeout,
                            token=_env.job_token(), insecure=args.insecure)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    try:
        parser = build_parser()
    except ValueError as e:  # a malformed GRADHUB_* variable
        print(f"gradhub: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd in ("scheduler", "server"):
        try:
            return _run_scheduler(args) if args.cmd == "scheduler" else _run_server(args)
        except ValueError as e:  # a malformed GRADHUB_* setting (e.g. the token file)
            print(f"gradhub {args.cmd}: {e}", file=sys.stderr)
            return 2
    from .launch import launch

    cmd = args.command
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("launch needs a worker command after --")
    try:
        return launch(args, cmd)
    except ValueError as e:  # a malformed GRADHUB_* setting (e.g. the token file)
        print(f"gradhub launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
