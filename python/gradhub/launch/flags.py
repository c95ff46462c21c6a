"""The flags of `gradhub launch`, defined here once (`add_args`), and what
they say as a typed value (`LaunchOptions`, from `options`), which the
launch plan (plan.py) is made from: the launchers never see argparse's
namespace."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Callable, NoReturn

from .._argtypes import count as _count, existing_file, port


def add_args(lp: argparse.ArgumentParser, server_threads: int, shared: Callable[[argparse.ArgumentParser], None]) -> None:
    """Every flag of `gradhub launch`; `server_threads`: --server-threads'
    default; `shared(lp)` adds the flags it shares with `gradhub scheduler`
    (the scheduler's settings, --encrypt), listed between the host flags
    and the elastic ones."""
    lp.add_argument("-w", "--workers", type=_count(1), default=None,
                    help="number of worker processes (required on this machine; with -H/--hostfile: default "
                    "every slot)")
    lp.add_argument("-s", "--servers", type=_count(1), default=1, help="number of summation servers (default 1)")
    lp.add_argument("--server-threads", type=_count(1), default=server_threads,
                    help="threads per server (GRADHUB_SERVER_THREADS, else 1)")
    g = lp.add_mutually_exclusive_group()
    g.add_argument("--colocated", action="store_true",
                   help="mark every server as colocated with a worker (all-reduce-like traffic split)")
    g.add_argument("--colocated-servers", type=_count(0), default=0, metavar="C",
                   help="mark the first C servers colocated, the rest CPU-only (mixed job)")
    lp.add_argument("--port", type=port, default=0, help="scheduler port (default: a free port)")
    hg = lp.add_argument_group(
        "across hosts (SSH)", "Workers on other hosts, started over ssh (key-based login, no password prompt); "
        "the scheduler runs on this machine (or --scheduler-host first), a server on each worker host (colocated) unless --server-hosts. "
        "Every host must have the same Python (this one's path) with gradhub installed; each is checked before "
        "anything starts. The environment (the job token among it) travels over ssh's stdin, never on a "
        "command line.")
    hx = hg.add_mutually_exclusive_group()
    hx.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
                    help="worker hosts and how many workers each runs, e.g. node1:4,node2:4 (horovodrun's -H)")
    hx.add_argument("--hostfile", default=None, metavar="FILE",
                    help="worker hosts, one a line: 'host slots=N' or 'host:N' (# comments)")
    hg.add_argument("--server-hosts", default=None, metavar="HOST,...",
                    help="run one CPU-only server on each of these hosts instead of a colocated one per worker host")
    hg.add_argument("--ssh-port", type=_count(1, most=65535), default=None, help="ssh port on every host (default: ssh's, 22)")
    hg.add_argument("--ssh-identity-file", type=existing_file, default=None, metavar="FILE",
                    help="private key for every ssh connection (ssh -i)")
    hg.add_argument("--ssh-config", type=existing_file, default=None, metavar="FILE",
                    help="an ssh_config file for every ssh connection (ssh -F): user names, jump hosts, host keys")
    hg.add_argument("--scheduler-host", choices=("local", "first"), default="local",
                    help="where the scheduler (an elastic job's shared service) runs: on this machine (local, the "
                    "default) or, started over ssh, on the first worker host (first), at that host's address as "
                    "it saw this machine's ssh come in; for a launching machine the hosts cannot reach")
    shared(lp)
    _add_elastic_args(lp)
    lp.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the worker command")


def _add_elastic_args(lp: argparse.ArgumentParser) -> None:
    g = lp.add_argument_group(
        "elastic jobs", "Run the job as an elastic job (Horovod's elastic API, `gradhub.torch.elastic`): a worker "
        "that fails does not end it while at least --min-workers are still running; the survivors roll back to "
        "their last commit and go on with new ranks and size. The launch starts a shared service for the job "
        "(`gradhub scheduler --service`, servers with --service) and stops it at the end. The exit code is 0 "
        "when every worker still in the job at its end exited 0; the lost ones are reported.")
    g.add_argument("--min-workers", type=int, default=None, metavar="M",
                   help="run elastic: keep the job running while at least M workers live; fewer: stop it and "
                   "fail (1 <= M <= -w)")
    g.add_argument("--max-workers", type=int, default=None, metavar="X",
                   help="the most workers the elastic job may have (default: -w), given to the workers as "
                   "GRADHUB_MAX_WORKERS. Given, a lost worker is replaced (on its host) while fewer run, at most "
                   "once per starting worker: the replacement joins at the job's next commit")
    g.add_argument("--host-discovery-script", default=None, metavar="S",
                   help="an executable that prints the hosts available now, one 'host:slots' a line (as "
                   "horovodrun's): the job starts on them (-w defaults to their slots, up to --max-workers) and "
                   "follows them, run every --discovery-interval: a new host or slot gets a worker (up to "
                   "--max-workers; it joins at the next commit), a host gone has its workers stopped (the job goes "
                   "on while --min-workers run). A run that fails or takes over 5 s is reported and the last hosts "
                   "kept. Servers stay on the first hosts found (or --server-hosts). Instead of -H/--hostfile")
    g.add_argument("--slots-per-host", type=int, default=1, metavar="N",
                   help="the slots of a host the discovery script lists without any (default 1)")
    g.add_argument("--discovery-interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between runs of the host discovery script (default 1)")


@dataclass(frozen=True)
class LaunchOptions:
    """What `gradhub launch`'s command line asks for (defaults as the flags')."""
    command: tuple[str, ...] = ()          # the worker command
    workers: int | None = None             # -w (None: every slot of the hosts)
    servers: int = 1
    server_threads: int = 1
    colocated: bool = False
    colocated_servers: int = 0
    port: int = 0                          # the scheduler's (0: a free one)
    # Across hosts
    hosts: str | None = None               # -H, as given
    hostfile: str | None = None
    server_hosts: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_config: str | None = None
    scheduler_host: str = "local"          # local or first
    # The scheduler's settings (also `gradhub scheduler`'s flags)
    partition_bytes: int | None = None
    stall_seconds: float = 30.0
    peer_timeout: float = 30.0
    join_timeout: float = 300.0
    host_reduce: bool | None = None        # None: the scheduler's default, from the training mode
    failover: bool = True
    rack_reduce: str = "auto"
    link_gbit: float = 0.0
    core_gbit: float = 0.0
    # Elastic jobs
    min_workers: int | None = None
    max_workers: int | None = None
    host_discovery_script: str | None = None
    slots_per_host: int = 1
    discovery_interval: float = 1.0

    @property
    def remote(self) -> bool:
        """Whether the workers run on other hosts, started over ssh."""
        return bool(self.hosts or self.hostfile or self.host_discovery_script)

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None


def options(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> LaunchOptions:
    """The launch flags of a parsed command line as options; a combination
    that makes no sense is `error(message)` (the parser's usage error)."""
    cmd = list(args.command or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        error("launch needs a worker command after --")
    remote = args.hosts or args.hostfile or args.host_discovery_script
    if args.host_discovery_script and (args.hosts or args.hostfile):
        error("--host-discovery-script gives the hosts: leave out -H/--hostfile")
    if args.host_discovery_script and args.min_workers is None:
        error("--host-discovery-script needs --min-workers: only an elastic job follows its hosts")
    if args.workers is None and not remote:
        error("launch needs -w/--workers (or -H/--hostfile to run across hosts)")
    if args.server_hosts and not remote:
        error("--server-hosts needs -H/--hostfile")
    if args.scheduler_host == "first" and not remote:
        error("--scheduler-host first needs hosts (-H/--hostfile/--host-discovery-script): a job on this "
              "machine has its scheduler here")
    if args.slots_per_host < 1:
        error(f"argument --slots-per-host: {args.slots_per_host} is out of range (at least 1)")
    if not 0 < args.discovery_interval < float("inf"):
        error(f"argument --discovery-interval: {args.discovery_interval:g} is out of range (more than 0)")
    given = {f.name: getattr(args, f.name) for f in fields(LaunchOptions) if f.name != "command"}
    return LaunchOptions(command=tuple(cmd), **given)
