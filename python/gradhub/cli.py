"""The `gradhub` command: launch a local job, or run one role of a multi-host job.

Every flag falls back to the GRADHUB_* variable the workers read, so one
environment describes a job for all roles. Servers never import torch.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import _core, _env, roles
from ._argtypes import Parser, count as _count, output_file, port
from .launch import flags as launch_flags

# The `--help` epilogs: the settings each command's roles read, from the
# registry (src/settings.rs), so they show its defaults.
ALL_ROLES = ("worker", "server", "scheduler", "launcher")

# The scheduler's timeouts travel in milliseconds as u32.
_SECONDS = _count(0, float, above=True, most=10**6)


def _add_scheduler_args(p: argparse.ArgumentParser, env: _env.SchedulerEnv) -> None:
    p.add_argument("--partition-bytes", type=_count(4), default=env.partition_bytes,
                   help="chunk size in bytes " + _env.fallback("GRADHUB_PARTITION_BYTES"))
    p.add_argument("--stall-seconds", type=_count(0, float, most=10**6), default=env.stall_seconds,
                   help="servers report a round that waited longer than this " + _env.fallback("GRADHUB_STALL_SECONDS"))
    p.add_argument("--peer-timeout", type=_SECONDS, default=env.peer_timeout,
                   help="seconds without a heartbeat before any member is declared dead; the scheduler tells "
                   "every member " + _env.fallback("GRADHUB_PEER_TIMEOUT"))
    p.add_argument("--join-timeout", type=_SECONDS, default=env.join_timeout,
                   help="seconds to wait for every member to register; on a shared service also how long an "
                   "elastic job's next generation may gather before it fails below its minimum "
                   + _env.fallback("GRADHUB_JOIN_TIMEOUT"))
    p.add_argument("--no-host-reduce", dest="host_reduce", action="store_false", default=env.host_reduce,
                   help="workers that share a machine each push everything themselves instead of summing in "
                   "shared memory first and pushing one share each (GRADHUB_HOST_REDUCE=0; the default with "
                   "GRADHUB_ASYNC=1)")
    p.add_argument("--host-reduce", dest="host_reduce", action="store_true",
                   help="workers that share a machine sum there first, also in the asynchronous mode, where "
                   "they then wait for each other every step (GRADHUB_HOST_REDUCE=1; the default otherwise)")
    p.add_argument("--no-failover", dest="failover", action="store_false", default=env.failover,
                   help="fail the job when a server is lost, instead of moving its chunks to the other servers "
                   "and going on (GRADHUB_FAILOVER=0)")
    p.add_argument("--rack-reduce", choices=["auto", "on", "off"], default=env.rack_reduce,
                   help="with members in racks (GRADHUB_RACK), sum each chunk within each rack before it crosses "
                   "the core: auto lets PHub's model decide from --link-gbit and --core-gbit; a single job only "
                   + _env.fallback("GRADHUB_RACK_REDUCE"))
    p.add_argument("--link-gbit", type=_count(0, float), default=env.link_gbit,
                   help="each host's link in Gbit/s, for the model; 0: 10 assumed " + _env.fallback("GRADHUB_LINK_GBIT"))
    p.add_argument("--core-gbit", type=_count(0, float), default=env.core_gbit,
                   help="each rack's link to the network core in Gbit/s; 0: one host link assumed "
                   + _env.fallback("GRADHUB_CORE_GBIT"))


def _add_encrypt_arg(p) -> None:
    p.add_argument("--encrypt", action="store_true", default=_env.encrypt(),
                   help="encrypt and authenticate every connection with keys derived from the job token "
                   "(GRADHUB_ENCRYPT=1); every member of the job must set it, one that does not is refused")


def _add_metrics_arg(p, default: str | None) -> None:
    p.add_argument("--metrics-addr", default=default, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (members, jobs, bytes pushed and "
                   "returned, rounds and their latency, stalls, failovers, authentication failures, memory; a "
                   "shared service's scheduler reports every job, its servers nothing of their own) "
                   + _env.fallback("GRADHUB_METRICS_ADDR"))


def version_line() -> str:
    """`gradhub 0.1.0 (protocol N)`: the package, and the wire protocol its
    core speaks (members of one job must speak the same)."""
    from . import __version__

    return f"gradhub {__version__} (protocol {_core.PROTOCOL_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    """The command line; defaults come from the environment (a malformed
    variable raises ValueError naming it)."""
    senv = _env.scheduler_env()
    venv = _env.server_env()
    p = Parser(
        prog="gradhub",
        description="gradhub: gradient synchronization for data-parallel training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_env.env_help(ALL_ROLES),
    )
    p.add_argument("--version", action="version", version=version_line(),
                   help="print gradhub's version and its wire protocol's, then exit")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    lp = sub.add_parser(
        "launch",
        help="run a whole job: scheduler, servers and workers, on this machine or across hosts over SSH",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a scheduler, K servers and N workers on this machine, or (-H / --hostfile) N "
        "workers across hosts over SSH, as horovodrun does. Each worker runs the given command with GRADHUB_* "
        "set; output lines are prefixed with role and rank. If any process fails, everything (on every host) "
        "is stopped and the first failure's exit code is returned (an elastic job, --min-workers: while too few "
        "workers are left).",
        epilog="examples:\n  gradhub launch -w 4 -s 2 -- python train.py --epochs 3\n"
        "  gradhub launch -H node1:4,node2:4 -- python train.py     # 8 workers, a colocated server per node\n"
        "  gradhub launch --hostfile hosts --server-hosts cpu1,cpu2 -- python train.py\n"
        "  gradhub launch -w 4 --min-workers 2 -- python train.py  # elastic: goes on while 2 workers live\n"
        "  gradhub launch --host-discovery-script ./hosts.sh --min-workers 2 --max-workers 8 -- python train.py\n\n"
        + _env.env_help(ALL_ROLES),
    )

    def shared(p: argparse.ArgumentParser) -> None:  # what `gradhub scheduler` takes too
        _add_scheduler_args(p, senv)
        _add_encrypt_arg(p)

    launch_flags.add_args(lp, venv.threads or 1, shared)

    sp = sub.add_parser(
        "scheduler",
        help="run the job's scheduler (one per job)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the rendezvous/declaration/liveness service of one job. Exits 0 when every "
        "worker has finished, 1 if the job failed. Started again with the same arguments on the same "
        "address while its job runs (after it was killed), it takes the job back: every member dials it "
        "for up to the peer timeout and rejoins, and training goes on.",
        epilog=_env.env_help(("scheduler",)),
    )
    sp.add_argument("--bind", default=None,
                    help="host:port to listen on (default: the port of GRADHUB_SCHEDULER, or 9000, on its host "
                    "if that is loopback, else on 0.0.0.0)")
    sp.add_argument("--insecure", action="store_true", default=_env.insecure(),
                    help="listen beyond loopback without a job token (GRADHUB_INSECURE=1): anyone who can "
                    "reach the port can join the job")
    sp.add_argument("--workers", type=_count(1), default=senv.num_workers,
                    help="number of workers (GRADHUB_NUM_WORKERS)")
    sp.add_argument("--servers", type=_count(1), default=senv.num_servers,
                    help="number of servers (GRADHUB_NUM_SERVERS)")
    _add_scheduler_args(sp, senv)
    _add_encrypt_arg(sp)
    _add_metrics_arg(sp, senv.metrics_addr)
    g = sp.add_argument_group("shared service", "Run as a long-lived service hosting many jobs at once, each "
                              "known by its name (GRADHUB_JOB) and its own token, derived from the master token "
                              "GRADHUB_SERVICE_TOKEN (`gradhub token JOB`). Servers join with `gradhub server "
                              "--service`; a job's first worker starts it on every server; --workers/--servers "
                              "do not apply.")
    g.add_argument("--service", action="store_true", help="run as a shared service")
    service = _core.ServiceConfig("", "", encrypt=False)  # its defaults
    g.add_argument("--max-jobs", type=_count(1), default=None,
                   help=f"jobs running at once (default {service.max_jobs})")
    g.add_argument("--job-max-workers", type=_count(1), default=None,
                   help=f"workers a job may have (default {service.max_workers})")
    g.add_argument("--job-max-tensors", type=_count(0), default=None,
                   help="tensors a job may hold on the service at once (default: no limit)")
    g.add_argument("--job-max-mib", type=_count(0, float), default=None,
                   help="MiB of tensors a job may hold on the service, what its servers keep for it "
                   "(default: no limit)")

    vp = sub.add_parser(
        "server",
        help="run one summation server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a summation server: one thread per core, each owning a fixed share of the "
        "chunks. Registers with the scheduler and exits when the job ends. Started while the job runs "
        "(a job that began with two or more servers, failover on), it joins it: the scheduler moves "
        "its share of the chunks to it at once, and training goes on with the same sums.",
        epilog=_env.env_help(("server",)),
    )
    vp.add_argument("--scheduler", default=venv.scheduler,
                    help="scheduler host:port (GRADHUB_SCHEDULER)")
    vp.add_argument("--threads", type=_count(1),
                    default=venv.threads if venv.threads is not None else roles.default_server_threads(),
                    help="server threads (GRADHUB_SERVER_THREADS, else one per core)")
    vp.add_argument("--colocated", action="store_true", default=venv.colocated,
                    help="this server runs on a worker machine (GRADHUB_COLOCATED=1)")
    vp.add_argument("--advertise-addr", default=venv.advertise,
                    help="address workers should connect to " + _env.fallback("GRADHUB_ADVERTISE_ADDR"))
    vp.add_argument("--bind-host", default=None,
                    help="host to listen on (default: 127.0.0.1 if the scheduler is on loopback, else 0.0.0.0)")
    vp.add_argument("--insecure", action="store_true", default=_env.insecure(),
                    help="reach beyond loopback without a job token (GRADHUB_INSECURE=1)")
    vp.add_argument("--port", type=port, default=venv.port,
                    help="first port; thread t listens on port+t; 0: free ports " + _env.fallback("GRADHUB_SERVER_PORT"))
    vp.add_argument("--rank", type=_count(-1), default=venv.rank,
                    help="request this server rank; -1: assigned " + _env.fallback("GRADHUB_SERVER_RANK"))
    vp.add_argument("--connect-timeout", type=_count(0, float, above=True), default=venv.connect_timeout,
                    help="seconds to keep retrying the scheduler " + _env.fallback("GRADHUB_CONNECT_TIMEOUT"))
    vp.add_argument("--rack", default=venv.rack,
                    help="this server's rack, when the job's members are in racks (GRADHUB_RACK; workers set the "
                    "variable): a rack's workers may sum a chunk on their rack's servers before the core")
    vp.add_argument("--timeline", default=venv.timeline,
                    help="write a Chrome/Perfetto trace of every chunk round here: how long it waited for its "
                    "pushers and which worker came last, and how long finishing it took; {rank} becomes the "
                    "server's rank; `gradhub timeline merge` joins it with the workers' (GRADHUB_SERVER_TIMELINE)")
    _add_encrypt_arg(vp)
    _add_metrics_arg(vp, venv.metrics_addr)
    vp.add_argument("--service", action="store_true",
                    help="serve every job of the shared service at --scheduler (one server per job, fresh ports "
                    "each) until the service goes away; needs GRADHUB_SERVICE_TOKEN")

    tp = sub.add_parser(
        "token", help="print a job's token on a shared service",
        description="Print job JOB's token on the shared service whose master token is GRADHUB_SERVICE_TOKEN "
        "(or GRADHUB_SERVICE_TOKEN_FILE). Give it to the job as GRADHUB_JOB_TOKEN, with GRADHUB_JOB=JOB: it "
        "opens that job and no other. Computed here; nothing is sent anywhere.")
    tp.add_argument("job", help="the job's name: 1 to 64 letters, digits, '.', '_' or '-'")

    stp = sub.add_parser(
        "status", help="report a shared service's jobs",
        description="Ask the shared service at --scheduler (authenticated with GRADHUB_SERVICE_TOKEN) for its "
        "servers and jobs: members, tensors and bytes held, bytes pushed and the current rate.")
    stp.add_argument("--scheduler", default=venv.scheduler, help="the service's host:port (GRADHUB_SCHEDULER)")
    stp.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_encrypt_arg(stp)
    stp.add_argument("--timeout", type=_count(0, float, above=True), default=10.0, help="seconds to wait for the service (default 10)")
    tl = sub.add_parser(
        "timeline", help="merge workers' and servers' timelines into one trace",
        description="gradhub timeline merge OUT FILE...: the timelines of several workers (GRADHUB_TIMELINE "
        "with {rank} in the path) in one Chrome/Perfetto trace, on one clock.")
    tl.add_argument("action", choices=["merge"])
    tl.add_argument("out", type=output_file, help="the merged trace to write")
    tl.add_argument("files", nargs="+", help="the workers' (and servers': gradhub server --timeline) timeline files")
    stg = sub.add_parser(
        "settings", help="list the GRADHUB_* settings: default, who reads it, what it does",
        description="The GRADHUB_* settings, from the registry the core declares them in (src/settings.rs): "
        "the user-facing and the advanced ones; --all adds the internal ones (test, benchmark and ablation "
        "knobs). --markdown prints docs/settings.md's tables.")
    stg.add_argument("--all", action="store_true", dest="all_tiers",
                     help="every setting, the internal ones too")
    stg.add_argument("--markdown", action="store_true", help="print the tables of docs/settings.md")
    sub.add_parser("simulate", help="predict gradhub's and DDP's samples/s on any cluster (docs/planning.md)",
                   add_help=False)
    sub.add_parser("plan", help="search servers, layout and options for a cluster with the simulator",
                   add_help=False)
    sub.add_parser("bench", help="benchmarks for your machines: the data plane on loopback (bench core), many "
                   "small tensors, this machine's costs for simulate (bench calibrate), the GPU check (see "
                   "`gradhub bench --help`)", add_help=False)
    return p


def _run_scheduler(args) -> int:
    e = _env.scheduler_env()
    timing = dict(partition_bytes=args.partition_bytes, stall_seconds=args.stall_seconds,
                  peer_timeout=args.peer_timeout, join_timeout_ms=int(args.join_timeout * 1000),
                  host_reduce=args.host_reduce, failover=args.failover)
    if args.service:
        return roles.run_service(args.bind, scheduler=e.scheduler, max_jobs=args.max_jobs,
                                 metrics_addr=args.metrics_addr,
                                 job_max_tensors=args.job_max_tensors, job_max_mib=args.job_max_mib,
                                 job_max_workers=args.job_max_workers, **timing)
    stall, peer = timing.pop("stall_seconds"), timing.pop("peer_timeout")
    return roles.run_scheduler(args.bind, args.workers, args.servers, scheduler=e.scheduler, token=_env.job_token(),
                               insecure=args.insecure, stall_ms=int(stall * 1000), peer_timeout_ms=int(peer * 1000),
                               namespace=e.namespace, rack_reduce=args.rack_reduce, link_gbit=args.link_gbit,
                               core_gbit=args.core_gbit, metrics_addr=args.metrics_addr, **timing)


def _run_server(args) -> int:
    e = _env.server_env()
    common = dict(bind_host=args.bind_host, colocated=args.colocated, advertise=args.advertise_addr,
                  connect_timeout=args.connect_timeout)
    if args.service:
        return roles.run_service_server(args.scheduler, args.threads, **common)
    return roles.run_server(args.scheduler, args.threads, token=_env.job_token(), insecure=args.insecure,
                            base_port=args.port, rank=args.rank, num_workers=e.num_workers,
                            num_servers=e.num_servers, namespace=e.namespace, timeline=args.timeline,
                            rack=args.rack, metrics_addr=args.metrics_addr, **common)


def _settings(args) -> int:
    if args.markdown:
        print(_env.markdown_table(args.all_tiers), end="")
        return 0
    print(_env.settings_text(args.all_tiers), end="")
    return 0


def _token(args) -> int:
    master = _env.service_token()
    if master is None:
        print("gradhub token: set GRADHUB_SERVICE_TOKEN (or GRADHUB_SERVICE_TOKEN_FILE) to the service's master "
              "token", file=sys.stderr)
        return 2
    try:
        print(_core.job_token(master, args.job))
    except ValueError as e:
        print(f"gradhub token: {e}", file=sys.stderr)
        return 2
    return 0


def _status(args) -> int:
    master = _env.service_token()
    if master is None or not args.scheduler:
        print("gradhub status: needs --scheduler (or GRADHUB_SCHEDULER) and GRADHUB_SERVICE_TOKEN", file=sys.stderr)
        return 2
    try:
        text = _core.service_status(args.scheduler, master, args.timeout)
    except _core.GradhubError as e:
        print(f"gradhub status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(text)
        return 0
    r = json.loads(text)
    print(f"service {r['addr']}: up {r['uptime_s']:.0f} s, {len(r['jobs'])} job(s) of at most {r['max_jobs']}, "
          f"{len(r['servers'])} server(s)")
    for s in r["servers"]:
        jobs = ", ".join(s["jobs"]) or "none"
        print(f"  server {s['id']}: {s['host']} at {s['addr']} ({s['threads']} threads); serving jobs: {jobs}")
    for j in r["jobs"]:
        print(f"  job {j['name']}: {j['state']}, {j['age_s']:.0f} s, {j['workers']} workers on {j['servers']} "
              f"servers; {j['tensors']} tensors ({j['held_bytes'] / 2**20:.1f} MiB held); pushed "
              f"{j['pushed_bytes'] / 2**20:.1f} MiB in {j['rounds']} chunk rounds, now "
              f"{j['push_rate_bytes_per_s'] / 2**20:.1f} MiB/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] in ("simulate", "plan"):
        from .plan.cli import main as plan_main

        return plan_main(argv)
    try:
        parser = build_parser()
    except ValueError as e:  # a malformed GRADHUB_* variable
        print(f"gradhub: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if getattr(args, "encrypt", False):
        _env.set_encrypt()
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd == "settings":
        return _settings(args)
    if args.cmd == "timeline":
        from . import timeline

        try:
            events = timeline.merge(args.files)
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            print(f"gradhub timeline: {e}", file=sys.stderr)
            return 2
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(events, f)
        except OSError as e:
            print(f"gradhub timeline: {args.out}: cannot write it: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"gradhub timeline: {len(events)} events from {len(args.files)} files in {args.out}")
        return 0
    if args.cmd in ("token", "status"):
        try:
            return _token(args) if args.cmd == "token" else _status(args)
        except ValueError as e:  # the token file
            print(f"gradhub {args.cmd}: {e}", file=sys.stderr)
            return 2
    if args.cmd in ("scheduler", "server"):
        try:
            return _run_scheduler(args) if args.cmd == "scheduler" else _run_server(args)
        except ValueError as e:  # a malformed GRADHUB_* setting (e.g. the token file)
            print(f"gradhub {args.cmd}: {e}", file=sys.stderr)
            return 2
    from .launch import launch

    parser.prog = "gradhub launch"  # the checks of the options: launch's usage errors
    opts = launch_flags.options(args, parser.error)
    try:
        return launch(opts)
    except ValueError as e:  # a malformed GRADHUB_* setting (e.g. the token file)
        print(f"gradhub launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
