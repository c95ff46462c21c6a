"""`gradhub bench`: every benchmark of gradhub, in one place.

- `core` and `torch-options`: the data plane on loopback against raw TCP, and
  the PyTorch scheduling options on this machine (developer benchmarks: they
  need the source checkout; `core` builds its compiled TCP baseline with cargo);
- `cluster`, `train`, `goodput`, `sweep`, `suite`, `report`, `cleanup`: an
  emulated cluster on one machine (network namespaces, veth, tc; needs root)
  against DDP and the BytePS optimum.

Kernel throughput is `cargo bench --bench kernels` (benches/kernels.rs)."""

from __future__ import annotations

import argparse
import json
import sys

from . import netns, profiles
from .runner import VARIANTS, Layout, allreduce_time, byteps_optimum_time, run_job, variant_env


def _add_cluster_args(p):
    p.add_argument("--workers", type=int, default=4, help="worker hosts (default 4)")
    p.add_argument("--cpu-servers", type=int, default=0, help="CPU-only server hosts, k (default 0)")
    p.add_argument("--no-colocated", action="store_true", help="no server on the worker hosts")
    p.add_argument("--server-threads", type=int, default=1, help="threads per server (default 1)")
    p.add_argument("--rate", default="1gbit", help="per-host rate in each direction, tc syntax (default 1gbit)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gradhub bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    from . import core

    k = sub.add_parser(
        "core", help="data plane on loopback vs raw TCP: transport, latency, priority, sweep (source checkout)",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=core.__doc__,
        epilog="needs the gradhub source checkout (pip install -e .) and cargo: the raw-TCP baseline "
               "(examples/tcp_baseline.rs) is built with `cargo build --release --example tcp_baseline` "
               "if it is missing")
    core.add_arguments(k)
    o = sub.add_parser(
        "torch-options", help="examples/synthetic_benchmark.py under each DistributedOptimizer option "
                              "(source checkout)",
        description="Runs examples/synthetic_benchmark.py (batch 16, 5 iterations of 10 batches) in a "
                    "`gradhub launch` job once per scheduling option (GRADHUB_SCHEDULING=fifo|priority, "
                    "GRADHUB_OVERLAP_FORWARD=1, GRADHUB_OPTIMIZER_ON_SERVER=1, both) and prints the total "
                    "images/s of each. Needs the gradhub source checkout.")
    o.add_argument("--model", default="mlp", help="synthetic_benchmark.py model (default mlp)")
    o.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    o.add_argument("--servers", type=int, default=1, help="servers (default 1)")
    c = sub.add_parser(
        "cluster", help="run any command on every worker host of an emulated cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build the emulated hosts, start the scheduler and servers, run COMMAND once per worker "
                    "host (gradhub and torch.distributed variables set), then remove everything.",
        epilog="examples:\n"
               "  gradhub bench cluster --workers 4 --rate 1gbit -- python examples/digits.py\n"
               "  gradhub bench cluster --workers 4 --cpu-servers 2 -- python train.py       # BytePS k=2\n"
               "  gradhub bench cluster --workers 4 --cpu-servers 1 --no-colocated -- ...    # PHub centralized\n"
               "  gradhub bench cluster --workers 4 --no-servers -- python ddp_baseline.py   # torch DDP peer")
    _add_cluster_args(c)
    c.add_argument("--no-servers", action="store_true",
                   help="start no gradhub scheduler or servers (e.g. to run a torch.distributed baseline)")
    c.add_argument("--partition-bytes", type=int, help="chunk size for the job (default: the scheduler's)")
    c.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    t = sub.add_parser("train", help="emulated training (sleep as compute) under gradhub, DDP/gloo and no sync")
    _add_cluster_args(t)
    t.add_argument("--model", default="vgg19", choices=sorted(profiles.PROFILES))
    t.add_argument("--scale", type=float, default=16, help="divide every byte count by this (default 16)")
    t.add_argument("--iters", type=int, default=10)
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--systems", default="none,ddp,gradhub", help="comma list of none, ddp, gradhub")
    t.add_argument("--variants", default="priority", help=f"gradhub variants, comma list of {', '.join(VARIANTS)} (join with + to combine, e.g. overlap+server)")
    t.add_argument("--json", help="append results to this JSON-lines file")
    g = sub.add_parser("goodput", help="push_pull-only goodput vs the BytePS optimum and gloo all-reduce")
    _add_cluster_args(g)
    g.add_argument("--k", default="0", help="comma list of CPU-only server counts to try (default 0)")
    g.add_argument("--mbytes", type=float, default=64.0, help="bytes synchronized per iteration, MB (default 64)")
    g.add_argument("--iters", type=int, default=5)
    g.add_argument("--no-ddp", action="store_true", help="skip the gloo all-reduce baseline")
    g.add_argument("--json", help="append results to this JSON-lines file")
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
    su = sub.add_parser("suite", help="run every experiment of docs/benchmarks.md and regenerate its tables",
                        description="Runs the fixed experiment list (about 25 minutes here), writes one "
                                    "JSON (+ PNG) per experiment into --out, then regenerates the report section "
                                    "of --doc from them.")
    su.add_argument("--out", default="docs/bench", help="data folder (default docs/bench)")
    su.add_argument("--doc", default="docs/benchmarks.md", help="document to update ('' to skip)")
    su.add_argument("--workers", type=int, default=4)
    su.add_argument("--only", help="comma list of experiments (default: all; see --list)")
    su.add_argument("--resume", action="store_true", help="skip experiments whose JSON already exists")
    su.add_argument("--quick", action="store_true", help="tiny version of every experiment (smoke test)")
    su.add_argument("--list", action="store_true", help="list the experiments and exit")
    r = sub.add_parser("report", help="regenerate the report section of docs/benchmarks.md from the JSON")
    r.add_argument("--out", default="docs/bench", help="data folder (default docs/bench)")
    r.add_argument("--doc", default="docs/benchmarks.md")
    sub.add_parser("cleanup", help="remove namespaces/bridges left by a killed run")
    return ap


def _emit(args, rec):
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(rec) + "\n")


def cmd_train(args) -> int:
    layout = Layout(args.workers, args.cpu_servers, not args.no_colocated, args.server_threads)
    prof = profiles.get(args.model)
    cfg = {"model": args.model, "scale": args.scale, "iters": args.iters, "warmup": args.warmup}
    partition = max(4096, int(256 * 1024 / args.scale))
    print(f"{prof.name}: {prof.num_params / 1e6:.1f} M params ({prof.num_params * 4 / 1e6 / args.scale:.1f} MB "
          f"after /{args.scale:g}), {prof.time_per_batch * 1e3:.0f} ms compute per batch of {prof.batch}; "
          f"{args.workers} workers, {args.cpu_servers} CPU-only servers, colocated={layout.colocated}, "
          f"rate {args.rate} (= {args.rate} x {args.scale:g} for the full model)")
    print(f"{'run':28s} {'samples/s':>10s} {'eff':>6s} {'p50 ms':>8s} {'p90 ms':>8s} {'cores':>6s} {'vs ddp':>7s}")
    rows = []
    ddp = None
    for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
        variants = [v.strip() for v in args.variants.split(",")] if system == "gradhub" else [""]
        for v in variants:
            try:
                env = variant_env(v)
            except ValueError as e:
                print(f"gradhub bench: {e}", file=sys.stderr)
                return 2
            res = run_job(layout, args.rate, "gradhub.bench.emulate", cfg, system, env=env,
                          partition_bytes=partition)
            label = system + (f"/{v}" if v else "")
            if system == "ddp":
                ddp = res["samples_per_s"]
            ratio = f"{res['samples_per_s'] / ddp:7.2f}" if ddp and system == "gradhub" else f"{'':7s}"
            cores = res["busy_cores"]
            print(f"{label:28s} {res['samples_per_s']:10.1f} {res['scaling_efficiency']:6.2f} "
                  f"{res['iter_time_p50'] * 1e3:8.1f} {res['iter_time_p90'] * 1e3:8.1f} "
                  f"{cores if cores is not None else float('nan'):6.2f} {ratio}", flush=True)
            res.update(kind="train", label=label, model=args.model, scale=args.scale)
            res.pop("raw", None)
            rows.append(res)
            _emit(args, res)
    return 0


def cmd_goodput(args) -> int:
    mbytes = args.mbytes
    rate = netns.parse_rate(args.rate)
    n = args.workers
    print(f"goodput: {n} workers, {mbytes:g} MB per iteration, {args.rate} per host")
    print(f"{'config':22s} {'time ms':>9s} {'goodput GB/s':>13s} {'optimum ms':>11s} {'of optimum':>11s} {'cores':>6s}")
    for k in [int(x) for x in args.k.split(",")]:
        layout = Layout(n, k, not args.no_colocated, args.server_threads)
        res = run_job(layout, args.rate, "gradhub.bench.goodput", {"mbytes": mbytes, "iters": args.iters}, "gradhub")
        t_opt = byteps_optimum_time(n, k, mbytes * 1e6, rate) if layout.colocated else None
        t = res["iter_time_mean"]
        share = f"{t_opt / t:11.2f}" if t_opt else f"{'':11s}"
        print(f"{'gradhub k=' + str(k):22s} {t * 1e3:9.1f} {res['goodput_Bps'] / 1e9:13.3f} "
              f"{(t_opt or 0) * 1e3:11.1f} {share} {res['busy_cores'] or float('nan'):6.2f}  drops {res['tc_drops']}",
              flush=True)
        res.update(kind="goodput", k=k, optimum_time=t_opt, mbytes=mbytes)
        res.pop("raw", None)
        _emit(args, res)
    if not args.no_ddp:
        layout = Layout(n, 0, False)
        res = run_job(layout, args.rate, "gradhub.bench.goodput", {"mbytes": mbytes, "iters": args.iters}, "ddp")
        t = res["iter_time_mean"]
        t_ring = allreduce_time(n, mbytes * 1e6, rate)
        print(f"{'gloo all-reduce':22s} {t * 1e3:9.1f} {res['goodput_Bps'] / 1e9:13.3f} {t_ring * 1e3:11.1f} "
              f"{t_ring / t:11.2f} {res['busy_cores'] or float('nan'):6.2f}  (vs ring optimum)", flush=True)
        res.update(kind="goodput", k=None, optimum_time=t_ring, mbytes=mbytes)
        res.pop("raw", None)
        _emit(args, res)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd is None:
        ap.print_help()
        return 2
    if args.cmd in ("core", "torch-options"):
        from .checkout import CheckoutError

        try:
            if args.cmd == "core":
                from .core import run as run_core

                return run_core(args)
            from .torch_options import run as run_options

            return run_options(args.model, args.workers, args.servers)
        except CheckoutError as e:
            print(f"gradhub bench {args.cmd}: {e}", file=sys.stderr)
            return 2
    if args.cmd == "cluster":
        from .cluster import run_cluster

        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not cmd:
            ap.error("cluster needs a worker command after --")
        if args.no_servers:
            layout = Layout(args.workers, 0, False)
        else:
            layout = Layout(args.workers, args.cpu_servers, not args.no_colocated, args.server_threads)
            if layout.num_servers == 0:
                ap.error("--no-colocated needs --cpu-servers >= 1 (or use --no-servers)")
        try:
            return run_cluster(layout, args.rate, cmd, args.partition_bytes)
        except netns.ClusterError as e:
            print(f"gradhub bench: {e}", file=sys.stderr)
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
        return cmd_train(args) if args.cmd == "train" else cmd_goodput(args)
    except netns.ClusterError as e:
        print(f"gradhub bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"gradhub bench: interrupted ({e}); emulated cluster removed", file=sys.stderr)
        return 130
