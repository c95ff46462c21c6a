"""The `gradhub` command: launch a local job, or run one role of a multi-host job.

Every flag falls back to the GRADHUB_* variable the workers read, so one
environment describes a job for all roles. Servers never import torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

ENV_HELP = """
environment (flags win over variables):
  GRADHUB_SCHEDULER        scheduler host:port (all roles)
  GRADHUB_NUM_WORKERS      number of workers in the job
  GRADHUB_NUM_SERVERS      number of summation servers in the job
  GRADHUB_SERVER_THREADS   threads (cores) per server
  GRADHUB_COLOCATED=1      this server shares a machine with a worker
  GRADHUB_ADVERTISE_ADDR   address a server tells workers to use
  GRADHUB_PARTITION_BYTES  chunk size (scheduler decides for the job)
  GRADHUB_CREDIT_BYTES     bytes in flight per server-thread connection (workers)
  GRADHUB_STALL_SECONDS    report rounds stalled longer than this
  GRADHUB_PEER_TIMEOUT     seconds of silence before a member is declared dead
"""


def _env_int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v not in (None, "") else default


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _split_hostport(s: str, default_port: int) -> tuple[str, int]:
    if ":" in s:
        host, _, port = s.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)
    return s, default_port


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--partition-bytes", type=int, default=_env_int("GRADHUB_PARTITION_BYTES"),
                   help="chunk size in bytes (default: GRADHUB_PARTITION_BYTES or 256 KiB)")
    p.add_argument("--stall-seconds", type=float, default=_env_float("GRADHUB_STALL_SECONDS", 30.0),
                   help="servers report a round that waited longer than this (default 30)")
    p.add_argument("--peer-timeout", type=float, default=_env_float("GRADHUB_PEER_TIMEOUT", 10.0),
                   help="seconds without a heartbeat before a member is declared dead (default 10)")


def build_parser() -> argparse.ArgumentParser:
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
    lp.add_argument("--server-threads", type=int, default=_env_int("GRADHUB_SERVER_THREADS", 1),
                    help="threads per server (default 1)")
    g = lp.add_mutually_exclusive_group()
    g.add_argument("--colocated", action="store_true",
                   help="mark every server as colocated with a worker (all-reduce-like traffic split)")
    g.add_argument("--colocated-servers", type=int, default=0, metavar="C",
                   help="mark the first C servers colocated, the rest CPU-only (mixed job)")
    lp.add_argument("--port", type=int, default=0, help="scheduler port (default: a free port)")
    _add_scheduler_args(lp)
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
                    help="host:port to listen on (default: 0.0.0.0 and the port of GRADHUB_SCHEDULER, or 9000)")
    sp.add_argument("--workers", type=int, default=_env_int("GRADHUB_NUM_WORKERS"),
                    help="number of workers (GRADHUB_NUM_WORKERS)")
    sp.add_argument("--servers", type=int, default=_env_int("GRADHUB_NUM_SERVERS"),
                    help="number of servers (GRADHUB_NUM_SERVERS)")
    _add_scheduler_args(sp)

    vp = sub.add_parser(
        "server",
        help="run one summation server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a summation server: one thread per core, each owning a fixed share of the "
        "chunks. Registers with the scheduler and exits when the job ends.",
        epilog=ENV_HELP,
    )
    vp.add_argument("--scheduler", default=os.environ.get("GRADHUB_SCHEDULER"),
                    help="scheduler host:port (GRADHUB_SCHEDULER)")
    vp.add_argument("--threads", type=int, default=_env_int("GRADHUB_SERVER_THREADS", os.cpu_count() or 1),
                    help="server threads (GRADHUB_SERVER_THREADS; default: number of cores)")
    vp.add_argument("--colocated", action="store_true", default=_env_flag("GRADHUB_COLOCATED"),
                    help="this server runs on a worker machine (GRADHUB_COLOCATED=1)")
    vp.add_argument("--advertise-addr", default=os.environ.get("GRADHUB_ADVERTISE_ADDR"),
                    help="address workers should connect to (GRADHUB_ADVERTISE_ADDR; default: the local "
                    "address of the interface that reaches the scheduler)")
    vp.add_argument("--bind-host", default="0.0.0.0", help="host to listen on (default 0.0.0.0)")
    vp.add_argument("--port", type=int, default=_env_int("GRADHUB_SERVER_PORT", 0),
                    help="first port; thread t listens on port+t (default: free ports)")
    vp.add_argument("--rank", type=int, default=_env_int("GRADHUB_SERVER_RANK", -1),
                    help="request this server rank (default: assigned)")
    vp.add_argument("--connect-timeout", type=float, default=_env_float("GRADHUB_CONNECT_TIMEOUT", 60.0),
                    help="seconds to keep retrying the scheduler (default 60)")
    sub.add_parser("bench", help="benchmark suite on an emulated cluster (see `gradhub bench --help`)",
                   add_help=False)
    return p


def _run_scheduler(args) -> int:
    from . import _core

    if args.workers is None or args.servers is None:
        print("gradhub scheduler: --workers and --servers (or GRADHUB_NUM_WORKERS/GRADHUB_NUM_SERVERS) "
              "are required", file=sys.stderr)
        return 2
    bind = args.bind
    if bind is None:
        port = 9000
        if os.environ.get("GRADHUB_SCHEDULER"):
            _, port = _split_hostport(os.environ["GRADHUB_SCHEDULER"], 9000)
        bind = f"0.0.0.0:{port}"
    elif ":" not in bind:
        bind = f"{bind}:9000"
    try:
        _core.run_scheduler(bind, args.workers, args.servers,
                            args.partition_bytes or _core.DEFAULT_PARTITION_BYTES,
                            peer_timeout_ms=int(args.peer_timeout * 1000),
                            stall_ms=int(args.stall_seconds * 1000),
                            namespace=_env_int("GRADHUB_NAMESPACE", 0))
    except _core.GradhubError as e:
        print(f"gradhub scheduler: {e}", file=sys.stderr)
        return 1
    return 0


def _run_server(args) -> int:
    from . import _core

    if not args.scheduler:
        print("gradhub server: --scheduler (or GRADHUB_SCHEDULER) is required", file=sys.stderr)
        return 2
    try:
        _core.run_server(args.scheduler, threads=max(1, args.threads), colocated=args.colocated,
                         advertise=args.advertise_addr, bind_host=args.bind_host, base_port=args.port,
                         rank=args.rank, num_workers=_env_int("GRADHUB_NUM_WORKERS", 0),
                         num_servers=_env_int("GRADHUB_NUM_SERVERS", 0),
                         namespace=_env_int("GRADHUB_NAMESPACE", 0), connect_timeout=args.connect_timeout)
    except _core.GradhubError as e:
        print(f"gradhub server: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd in ("scheduler", "server"):
        # Blocking in native code: let Ctrl-C terminate the process directly.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        return _run_scheduler(args) if args.cmd == "scheduler" else _run_server(args)
    from .launch import launch

    cmd = args.command
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("launch needs a worker command after --")
    return launch(args, cmd)


if __name__ == "__main__":
    sys.exit(main())
