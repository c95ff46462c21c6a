"""`gradhub-lab` (also `python -m gradhub_lab`): the lab's commands, run from
the source checkout (their defaults write into its docs/).

- `cluster`, `train`, `goodput`, `sweep`, `suite`, `report`, `cleanup`: an
  emulated cluster on one machine (network namespaces, veth, tc; needs root;
  `--racks` puts its hosts in racks behind shaped core links) against DDP and
  the BytePS optimum; `suite` and `report` write docs/bench/;
- `tenancy`: many jobs on one shared service (emulated cluster): goodput per
  job, aggregate, fairness, and the cost of authentication;
- `faults`: the fault campaign (kills, stops, exceptions, strangers'
  connections in jobs started role by role; every outcome and sum checked);
- `torch-options`: examples/synthetic_benchmark.py under each PyTorch
  scheduling option on this machine;
- `validate` (and `--plan-check`): the simulator against the emulated
  cluster; `calibrate`: gradhub's machine costs plus the emulated cluster's
  own (`--emulated`: its network path and a worker's main thread there).

gradhub's own benchmarks (loopback, tensors, calibration, the GPU check)
are `gradhub bench`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from gradhub.plan import models as profiles

from . import netns
from .runner import VARIANTS, Layout
from .training import TrainSpec, layout_of, user_env


def _add_cluster_args(p):
    p.add_argument("--workers", type=int, default=4, help="worker hosts (default 4)")
    p.add_argument("--workers-per-host", type=int, default=1, metavar="W",
                   help="worker processes on each worker host (default 1); they share the host's network "
                        "namespace, so gradhub's host stage sums their gradients in shared memory first")
    p.add_argument("--cpu-servers", type=int, default=0, help="CPU-only server hosts, k (default 0)")
    p.add_argument("--no-colocated", action="store_true", help="no server on the worker hosts")
    p.add_argument("--server-threads", type=int, default=1, help="threads per server (default 1; 0: the server's own default, one per core)")
    p.add_argument("--rate", default="1gbit", help="per-host rate in each direction, tc syntax (default 1gbit)")
    p.add_argument("--racks", type=int, default=1, metavar="R",
                   help="worker hosts in R racks (contiguous; CPU-only servers round-robin), each joined to the "
                        "core by one link of --core-rate; gradhub's members name their rack and PHub's model "
                        "decides on two-level reduction (variants flat, racks force it; default 1)")
    p.add_argument("--core-rate", default=None,
                   help="each rack's link to the core, each way, tc syntax (default: --rate)")


def _add_compare_args(p):
    p.add_argument("--host-reduce", choices=("on", "off", "both"), default="on",
                   help="gradhub runs with the host stage on (default), off (GRADHUB_HOST_REDUCE=0 for the "
                        "scheduler), or both, side by side")
    p.add_argument("--trials", type=int, default=1,
                   help="run every configuration this many times, interleaved, and report the median "
                        "(by iteration time; default 1)")
    p.add_argument("--json", help="append results to this JSON-lines file")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set this variable for every gradhub role of every run (repeatable), e.g. "
                        "GRADHUB_SPREAD_BYTES=0; the lab passes no GRADHUB_* variable of its own "
                        "environment through")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gradhub-lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    o = sub.add_parser(
        "torch-options", help="examples/synthetic_benchmark.py under each DistributedOptimizer option",
        description="Runs examples/synthetic_benchmark.py (batch 16, 5 iterations of 10 batches) in a "
                    "`gradhub launch` job once per scheduling option (GRADHUB_SCHEDULING=fifo|priority, "
                    "GRADHUB_OVERLAP_FORWARD=1, GRADHUB_OPTIMIZER_ON_SERVER=1, both) and prints the total "
                    "images/s of each. Needs the gradhub source checkout.")
    o.add_argument("--model", default="mlp", help="synthetic_benchmark.py model (default mlp)")
    o.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    o.add_argument("--servers", type=int, default=1, help="servers (default 1)")
    ts = sub.add_parser(
        "torch-suite", help="torch's own backend tests (DistributedTest._DistTestBase) on gradhub beside gloo",
        description="Runs the CPU tests of torch's DistributedTest._DistTestBase (the suite torch runs against "
                    "gloo and NCCL: collectives, groups, point-to-point, object collectives, barriers, DDP) on "
                    "the gloo backend and on gradhub, each test spawning --world processes, and prints every "
                    "test gloo passes that gradhub does not, with the reason. About 4 s a test and backend.")
    ts.add_argument("--world", default="2,3", help="world sizes, comma list (default 2,3)")
    ts.add_argument("--select", default=None, help="a regular expression over test names (default: the CPU "
                    "tests of the kinds above)")
    ts.add_argument("--quick", action="store_true", help="one test of each kind (what CI runs)")
    ts.add_argument("--json", default=None, help="write every outcome to this file")
    ts.add_argument("--start", choices=("spawn", "fork"), default="spawn",
                    help="how each test's processes start: spawn (fresh interpreters, as torch's "
                         "test_distributed_spawn.py; default) or fork (children of one process that imported torch, "
                         "the suite and gradhub and started nothing: the same test bodies, about 1 s a test "
                         "instead of 4)")
    bl = sub.add_parser("backend-latency", help="one small collective through the gradhub backend beside gloo",
                        description="N processes on this machine call all_reduce, all_gather_into_tensor and "
                                    "reduce_scatter_tensor on a small tensor one after another, over gloo and "
                                    "over the gradhub backend (its own job, one colocated server); prints "
                                    "microseconds per call and the calling thread's CPU per call.")
    bl.add_argument("--procs", type=int, default=2, help="processes (default 2)")
    bl.add_argument("--iters", type=int, default=2000, help="calls of each kind (default 2000)")
    bl.add_argument("--bytes", type=int, default=4096, help="bytes per process (default 4096)")
    bl.add_argument("--trials", type=int, default=3, help="interleaved trials, median reported (default 3)")
    pp = sub.add_parser("p2p", help="point-to-point through the gradhub backend, direct and relayed, beside gloo",
                        description="2 processes on this machine move messages from rank 0 to rank 1 over the "
                                    "gradhub backend's send/recv (worker to worker), through its server (a "
                                    "broadcast of the 2-member group, as a relay would carry them) and over "
                                    "gloo's send/recv; prints the latency of a small message, the GB/s of a "
                                    "large one and both processes' CPU seconds per GB.")
    pp.add_argument("--iters", type=int, default=2000, help="round trips of the small message (default 2000)")
    pp.add_argument("--small", type=int, default=4, help="bytes of the small message (default 4)")
    pp.add_argument("--large", type=int, default=64 << 20, help="bytes of the large message (default 64 MiB)")
    pp.add_argument("--count", type=int, default=16, help="large messages per trial (default 16)")
    pp.add_argument("--trials", type=int, default=3, help="interleaved trials, median reported (default 3)")
    pp.add_argument("--json", default=None, help="write the medians to this file")
    from . import faults

    fp = sub.add_parser("faults", help="fault campaign: jobs started role by role, one fault each (kill, stop, "
                                       "pause, exception, stranger's connection), every outcome and sum checked",
                        formatter_class=argparse.RawDescriptionHelpFormatter, description=faults.__doc__)
    faults.add_arguments(fp)
    from . import tenancy

    tp = sub.add_parser("tenancy", help="1-4 concurrent jobs on one shared service in the emulated cluster: "
                                        "goodput per job, aggregate vs one job, Jain's fairness; cost of a token",
                        formatter_class=argparse.RawDescriptionHelpFormatter, description=tenancy.__doc__)
    tenancy.add_arguments(tp)
    c = sub.add_parser(
        "cluster", help="run any command on every worker host of an emulated cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build the emulated hosts, start the scheduler and servers, run COMMAND once per worker "
                    "host (gradhub and torch.distributed variables set), then remove everything.",
        epilog="examples:\n"
               "  gradhub-lab cluster --workers 4 --rate 1gbit -- python examples/digits.py\n"
               "  gradhub-lab cluster --workers 4 --cpu-servers 2 -- python train.py       # BytePS k=2\n"
               "  gradhub-lab cluster --workers 4 --cpu-servers 1 --no-colocated -- ...    # PHub centralized\n"
               "  gradhub-lab cluster --workers 4 --no-servers -- python ddp_baseline.py   # torch DDP peer")
    _add_cluster_args(c)
    c.add_argument("--no-servers", action="store_true",
                   help="start no gradhub scheduler or servers (e.g. to run a torch.distributed baseline)")
    c.add_argument("--partition-bytes", type=int, help="chunk size for the job (default: the scheduler's)")
    c.add_argument("--no-host-reduce", action="store_true",
                   help="turn gradhub's host stage off (GRADHUB_HOST_REDUCE=0 for the scheduler)")
    c.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    t = sub.add_parser("train", help="emulated training (sleep as compute) under gradhub, DDP/gloo and no sync")
    _add_cluster_args(t)
    t.add_argument("--model", default=TrainSpec.model, choices=sorted(profiles.PROFILES))
    t.add_argument("--scale", type=float, default=TrainSpec.scale, help="divide every byte count by this (default 16)")
    t.add_argument("--iters", type=int, default=TrainSpec.iters)
    t.add_argument("--warmup", type=int, default=TrainSpec.warmup)
    t.add_argument("--systems", default="none,ddp,gradhub",
                   help="comma list of none (no synchronization, every worker computing at once: the bound each "
                        "other run is put beside), ddp, gradhub, and torch.distributed on gradhub: ddp-hook (DDP "
                        "over gloo, gradhub's comm hook, the lab's gradhub job), ddp-gradhub (DDP over the "
                        "\"gradhub\" backend: it forms its own job with colocated servers, or joins the lab's "
                        "with --cpu-servers or --no-colocated), ddp-overlap and ddp-gradhub-overlap (DDP over gloo or "
                        "the \"gradhub\" backend with gradhub.torch.ddp_forward_overlap), fsdp-gloo, fsdp-gradhub "
                        "(FSDP2, every layer sharded)")
    t.add_argument("--unscaled", action="store_true",
                   help="leave the chunk size, fusion buckets and DDP's buckets at the defaults a user gets (roles at "
                        "defaults, as started by hand) instead of dividing them by --scale with every other byte count")
    t.add_argument("--fc-faithful", action="store_true",
                   help="the profile's fully-connected layers are real nn.Linear modules (scaled width; each "
                        "worker its own inputs), so sufficient factors (variants sfb/nosfb; auto by default) move "
                        "real factors; their parameters after training are compared with DDP's")
    t.add_argument("--straggler", type=float, default=1.0, metavar="F",
                   help="the last worker computes F times slower (e.g. 3): the case the asynchronous mode "
                        "(variants async, stale2) exists for; each worker's steps/s are printed")
    t.add_argument("--variants", default="priority", help=f"gradhub variants, comma list of {', '.join(VARIANTS)} (join with + to combine, e.g. overlap+server; nohost = host stage off, noshm = owners reach their own host's server over TCP instead of shared memory, nofailover = no failover nor replicas of the server optimizer)")
    _add_compare_args(t)
    g = sub.add_parser("goodput", help="push_pull-only goodput vs the BytePS optimum and gloo all-reduce")
    _add_cluster_args(g)
    g.add_argument("--k", default="0", help="comma list of CPU-only server counts to try (default 0)")
    g.add_argument("--mbytes", type=float, default=64.0, help="bytes synchronized per iteration, MB (default 64)")
    g.add_argument("--iters", type=int, default=5)
    g.add_argument("--no-ddp", action="store_true", help="skip the gloo all-reduce baseline")
    _add_compare_args(g)
    w = sub.add_parser("sweep", help="ad hoc bandwidth sweeps and k sweep, with PNG plots and JSON")
    w.add_argument("--models", default="vgg19,resnet50", help="comma list of profiles")
    w.add_argument("--rates", default="250mbit,500mbit,1gbit,2gbit", help="comma list of per-host rates")
    w.add_argument("--workers", type=int, default=4)
    w.add_argument("--scale", type=float, default=16)
    w.add_argument("--iters", type=int, default=6)
    w.add_argument("--variants", default="priority,fifo,overlap")
    w.add_argument("--k", default="0,1,2,3,4", help="k values for the goodput sweep ('' to skip)")
    w.add_argument("--k-rate", default="1gbit")
    w.add_argument("--mbytes", type=float, default=32.0)
    w.add_argument("--out", default="docs/bench", help="output folder (default docs/bench)")
    su = sub.add_parser("suite", help="run every experiment of docs/bench/suite.md and regenerate its tables",
                        description="Runs the fixed experiment list (about 25 minutes here), writes one "
                                    "JSON (+ PNG) per experiment into --out, then regenerates the report section "
                                    "of --doc from them.")
    su.add_argument("--out", default="docs/bench", help="data folder (default docs/bench)")
    su.add_argument("--doc", default="docs/bench/suite.md", help="document to update ('' to skip)")
    su.add_argument("--workers", type=int, default=4)
    su.add_argument("--only", help="comma list of experiments (default: all; see --list)")
    su.add_argument("--resume", action="store_true", help="skip experiments whose JSON already exists")
    su.add_argument("--quick", action="store_true", help="tiny version of every experiment (smoke test)")
    su.add_argument("--list", action="store_true", help="list the experiments and exit")
    r = sub.add_parser("report", help="regenerate the tables of docs/bench/suite.md from the JSON")
    r.add_argument("--out", default="docs/bench", help="data folder (default docs/bench)")
    r.add_argument("--doc", default="docs/bench/suite.md")
    sub.add_parser("cleanup", help="remove namespaces/bridges left by a killed run")
    from . import calibrate, validate

    cal = sub.add_parser("calibrate", help="measure this machine's costs, the emulated cluster's included, for the "
                                           "simulator (seconds)", description=calibrate.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    calibrate.add_arguments(cal)
    val = sub.add_parser("validate", help="the simulator's predictions beside emulated-cluster measurements")
    validate.add_arguments(val)
    return ap

def train_spec(args) -> TrainSpec:
    """`train`'s flags as a TrainSpec (ValueError naming a malformed --env)."""
    lists = {"systems": tuple(s.strip() for s in args.systems.split(",") if s.strip()),
             "variants": tuple(v.strip() for v in args.variants.split(",")),
             "env": user_env(args.env), "json_out": args.json}
    return TrainSpec(**{f.name: lists[f.name] if f.name in lists else getattr(args, f.name) for f in fields(TrainSpec)})


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd is None:
        ap.print_help()
        return 2
    if getattr(args, "workers_per_host", 1) < 1:
        ap.error("--workers-per-host must be at least 1")
    if args.cmd == "backend-latency":
        from . import backend_latency

        if args.procs < 2 or args.iters < 1 or args.bytes < 4 or args.trials < 1:
            ap.error("--procs at least 2, --iters and --trials at least 1, --bytes at least 4")
        return backend_latency.main(args.procs, args.iters, args.bytes, args.trials)
    if args.cmd == "p2p":
        from . import p2p

        if min(args.iters, args.count, args.trials) < 1 or args.small < 4 or args.large < 4:
            ap.error("--iters, --count and --trials at least 1, --small and --large at least 4")
        return p2p.main(args.iters, args.small, args.large, args.count, args.trials, args.json)
    if args.cmd == "torch-suite":
        from . import torch_suite

        try:
            worlds = [int(w) for w in args.world.split(",") if w]
        except ValueError:
            ap.error(f"--world {args.world!r}: a comma list of integers, e.g. 2,3")
        if not worlds or min(worlds) < 2:
            ap.error("--world: every world size must be at least 2")
        select = args.select or (torch_suite.QUICK if args.quick else torch_suite.SELECTION)
        return torch_suite.main(worlds, select, args.json, args.start)
    if args.cmd == "torch-options":
        from gradhub.bench.checkout import CheckoutError

        from .torch_options import run as run_options

        try:
            return run_options(args.model, args.workers, args.servers)
        except CheckoutError as e:
            print(f"gradhub-lab {args.cmd}: {e}", file=sys.stderr)
            return 2
    if args.cmd == "calibrate":
        from .calibrate import run as run_calibrate

        return run_calibrate(args)
    if args.cmd == "validate":
        from .validate import run as run_validate

        return run_validate(args)
    if args.cmd == "tenancy":
        from .tenancy import main as run_tenancy

        return run_tenancy(args)
    if args.cmd == "faults":
        if args.elastic:
            from .elastic_faults import run as run_elastic_faults

            return run_elastic_faults(args)
        from .faults import run as run_faults

        return run_faults(args)
    if args.cmd == "cluster":
        from .cluster import run_cluster

        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not cmd:
            ap.error("cluster needs a worker command after --")
        if args.no_servers:
            layout = Layout(args.workers, 0, False, workers_per_host=args.workers_per_host)
        else:
            layout = layout_of(args)
            if layout.num_servers == 0:
                ap.error("--no-colocated needs --cpu-servers >= 1 (or use --no-servers)")
        try:
            return run_cluster(layout, args.rate, cmd, args.partition_bytes, host_reduce=not args.no_host_reduce,
                               core_rate=args.core_rate)
        except netns.ClusterError as e:
            print(f"gradhub-lab: {e}", file=sys.stderr)
            return 2
    if args.cmd == "report":
        from pathlib import Path

        from .report import update_doc

        update_doc(Path(args.doc), Path(args.out))
        print(f"regenerated the report section of {args.doc} from {args.out}/*.json")
        return 0
    if args.cmd == "suite" and args.list:
        from .suite import experiment_list

        for e in experiment_list(args.workers):
            print(f"{e.name:22s} {e.what}")
        return 0
    if args.cmd == "cleanup":
        removed = netns.cleanup()
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    try:
        if args.cmd == "suite":
            from pathlib import Path

            from .suite import run_suite

            only = [x for x in (args.only or "").split(",") if x] or None
            return run_suite(Path(args.out), Path(args.doc) if args.doc else None, args.workers, args.quick, only,
                             args.resume, (argv if argv is not None else sys.argv[1:])[1:])
        if args.cmd == "sweep":
            from pathlib import Path

            from .experiments import bandwidth_sweep, k_sweep

            out = Path(args.out)
            for m in [x for x in args.models.split(",") if x]:
                bandwidth_sweep(m, args.rates.split(","), args.workers, args.scale, args.iters, out,
                                [v for v in args.variants.split(",") if v])
            if args.k:
                k_sweep(args.workers, [int(x) for x in args.k.split(",")], args.k_rate, args.mbytes, 4, out)
            return 0
        if args.cmd == "goodput":
            from .training import goodput

            return goodput(args)
        from .training import train

        try:
            spec = train_spec(args)
        except ValueError as e:
            print(f"gradhub-lab train: {e}", file=sys.stderr)
            return 2
        return train(spec)[0]
    except netns.ClusterError as e:
        print(f"gradhub-lab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"gradhub-lab: interrupted ({e}); emulated cluster removed", file=sys.stderr)
        return 130
