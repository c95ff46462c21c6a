"""`gradhub bench`: every benchmark of gradhub, in one place.

- `tenancy`: many jobs on one shared service (emulated cluster): goodput per
  job, aggregate, fairness, and the cost of authentication;
- `faults`: the fault campaign (kills, stops, exceptions, strangers'
  connections in jobs started role by role; every outcome and sum checked);
- `core` and `torch-options`: the data plane on loopback against raw TCP, and
  the PyTorch scheduling options on this machine (developer benchmarks: they
  need the source checkout; `core` builds its compiled TCP baseline with cargo);
- `tensors`: what a step costs with many small tensors, tensor fusion on
  and off (`gradhub launch` jobs on this machine);
- `timeline-plot`: a window of a merged timeline as a picture;
- `cluster`, `train`, `goodput`, `sweep`, `suite`, `report`, `cleanup`: an
  emulated cluster on one machine (network namespaces, veth, tc; needs root;
  `--racks` puts its hosts in racks behind shaped core links) against DDP and
  the BytePS optimum.

Kernel throughput is `cargo bench --bench kernels` (benches/kernels.rs)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from .._env import DEFAULT_FUSION_THRESHOLD
from . import netns, profiles
from .runner import (VARIANTS, Layout, allreduce_time, byteps_optimum_time, core_link_bytes, host_link_bytes,
                     ring_core_link_bytes, ring_host_link_bytes, run_job, server_link_bytes, variant_env)


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
                        "GRADHUB_SPREAD_BYTES=0; the bench passes no GRADHUB_* variable of its own "
                        "environment through")


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
    tp2 = sub.add_parser("timeline-plot", help="a window of a merged timeline (gradhub timeline merge) as a PNG")
    tp2.add_argument("trace", help="the merged trace")
    tp2.add_argument("out", help="the picture to write (PNG)")
    tp2.add_argument("--start", type=float, default=None, help="ms into the trace (default: the middle)")
    tp2.add_argument("--span", type=float, default=600.0, help="ms to show (default 600)")
    tp2.add_argument("--title", default="")
    ts = sub.add_parser("tensors", help="step cost with many small tensors, tensor fusion on and off (gradhub "
                        "launch jobs on this machine)")
    ts.add_argument("--mbytes", type=float, default=1.2, help="parameter bytes in all, MB (default 1.2)")
    ts.add_argument("--counts", default="30,300", help="comma list of tensor counts (default 30,300)")
    ts.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    ts.add_argument("--steps", type=int, default=200, help="steps per job (default 200)")
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
    from . import faults

    fp = sub.add_parser("faults", help="fault campaign: jobs started role by role, one fault each (kill, stop, "
                                       "pause, exception, stranger's connection), every outcome and sum checked",
                        formatter_class=argparse.RawDescriptionHelpFormatter, description=faults.__doc__)
    faults.add_arguments(fp)
    from . import gpu

    gp = sub.add_parser("gpu", help="the GPU check: exact sums through each local stage, training equivalence, "
                                    "staging bandwidth, ResNet-50 under DDP/NCCL and gradhub (CPU parts only "
                                    "without a GPU)",
                        formatter_class=argparse.RawDescriptionHelpFormatter, description=gpu.__doc__)
    gpu.add_arguments(gp)
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
               "  gradhub bench cluster --workers 4 --rate 1gbit -- python examples/digits.py\n"
               "  gradhub bench cluster --workers 4 --cpu-servers 2 -- python train.py       # BytePS k=2\n"
               "  gradhub bench cluster --workers 4 --cpu-servers 1 --no-colocated -- ...    # PHub centralized\n"
               "  gradhub bench cluster --workers 4 --no-servers -- python ddp_baseline.py   # torch DDP peer")
    _add_cluster_args(c)
    c.add_argument("--no-servers", action="store_true",
                   help="start no gradhub scheduler or servers (e.g. to run a torch.distributed baseline)")
    c.add_argument("--partition-bytes", type=int, help="chunk size for the job (default: the scheduler's)")
    c.add_argument("--no-host-reduce", action="store_true",
                   help="turn gradhub's host stage off (GRADHUB_HOST_REDUCE=0 for the scheduler)")
    c.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    t = sub.add_parser("train", help="emulated training (sleep as compute) under gradhub, DDP/gloo and no sync")
    _add_cluster_args(t)
    t.add_argument("--model", default="vgg19", choices=sorted(profiles.PROFILES))
    t.add_argument("--scale", type=float, default=16, help="divide every byte count by this (default 16)")
    t.add_argument("--iters", type=int, default=10)
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--systems", default="none,ddp,gradhub",
                   help="comma list of none (no synchronization, every worker computing at once: the bound each "
                        "other run is put beside), ddp, gradhub")
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
    from ..plan import cli as plan_cli, validate

    cal = sub.add_parser("calibrate", help="measure this machine's costs for `gradhub simulate` (seconds)")
    plan_cli.add_calibrate_arguments(cal)
    val = sub.add_parser("validate", help="the simulator's predictions beside emulated-cluster measurements")
    validate.add_arguments(val)
    return ap


def _emit(args, rec):
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _user_env(args) -> dict[str, str]:
    env = {}
    for kv in args.env:
        name, sep, value = kv.partition("=")
        if not sep or not name:
            raise ValueError(f"--env {kv!r}: expected NAME=VALUE")
        env[name] = value
    return env


def _host_variants(variant: str, host_reduce: str) -> list[str]:
    """The gradhub variant(s) to run for one --variants entry under --host-reduce."""
    off = "+".join(x for x in [variant, "nohost"] if x)
    if "nohost" in variant.split("+"):
        return [variant]
    return {"on": [variant], "off": [off], "both": [variant, off]}[host_reduce]


def _median_run(runs: list[dict]) -> dict:
    """The trial with the median mean iteration time, with every trial's key figures."""
    ordered = sorted(runs, key=lambda r: r["iter_time_mean"])
    res = dict(ordered[len(ordered) // 2])
    res["trials"] = [{k: r.get(k) for k in ("iter_time_mean", "samples_per_s", "goodput_Bps", "busy_cores",
                                            "host_tx_per_iter", "host_rx_per_iter", "tc_drops", "result_error")
                      if r.get(k) is not None} for r in runs]
    return res


def _mb(x) -> str:
    return f"{x / 1e6:7.1f}" if x is not None else f"{'-':>7s}"


def _host_cols(res: dict, theory: float | None) -> str:
    """Host link bytes per iteration (upload/download, mean over worker hosts) next to the theory."""
    tx, rx = res.get("host_tx_per_iter"), res.get("host_rx_per_iter")
    if tx is None:
        return ""
    share = f"{max(tx, rx) / theory:6.2f}" if theory else f"{'':6s}"
    return f" {_mb(tx)} {_mb(rx)} {_mb(theory)} {share}"


def _server_lines(res: dict, theory: float | None) -> str:
    """CPU-only server hosts' links (sampled bridge-side counters, per mean
    iteration) and the scheduler's placement, printed under a run."""
    out = ""
    sb = res.get("server_host_bytes")
    if sb:
        cells = ", ".join(f"{h} {v['tx'] / 1e6:.1f}/{v['rx'] / 1e6:.1f}" for h, v in sorted(sb.items()))
        out += f"\n    CPU-only server links, up/down MB per iteration: {cells}" + \
               (f" (theory {theory / 1e6:.1f})" if theory else "")
    if res.get("server_shares"):
        out += f"\n    placement: {res['server_shares']}"
    return out


def _core_lines(res: dict, layout: Layout, system: str, model_bytes: float) -> str:
    """With racks: each rack's core link (up/down MB per iteration) beside
    the theory for what ran, and the scheduler's choice."""
    core = res.get("core_bytes")
    if not core:
        return ""
    choice = res.get("rack_choice") or ""
    two = choice.startswith("two levels")
    theory = {"ddp": ring_core_link_bytes(layout, model_bytes), "gradhub": core_link_bytes(layout, model_bytes, two)}
    t = theory.get(system)
    cells = ", ".join(f"{h} {v['tx'] / 1e6:.1f}/{v['rx'] / 1e6:.1f}" for h, v in sorted(core.items()))
    out = f"\n    core links, up/down MB per iteration: {cells}" + (f" (theory {t / 1e6:.1f})" if t else "")
    if system == "gradhub" and choice:
        out += f"\n    racks: {choice}"
    return out


def _check(res: dict, label: str) -> str:
    err = res.get("result_error")
    if err is not None and err > 1e-3:
        print(f"gradhub bench: WARNING {label}: synchronized values deviate from the exact ones by "
              f"{err:.3g} (relative)", file=sys.stderr, flush=True)
        return "  WRONG VALUES"
    return ""


def _layout(args, k=None, colocated=None) -> Layout:
    return Layout(args.workers, args.cpu_servers if k is None else k,
                  (not args.no_colocated) if colocated is None else colocated, args.server_threads,
                  args.workers_per_host, max(1, getattr(args, "racks", 1)))


def gradhub_host_bytes(layout: Layout, model_bytes: float, host_reduce: bool) -> float:
    """Theoretical bytes per worker host's link per iteration and direction (BytePS split)."""
    return host_link_bytes(layout.workers, layout.cpu_servers, model_bytes, layout.workers_per_host, host_reduce,
                           colocated=layout.colocated)


def _compare_with_ddp(runs: list[tuple[str, dict]]) -> None:
    """FC-faithful runs of one trial: each system's real FC parameters after
    training against DDP's (`fc_param_diff`, the largest difference relative
    to the tensor's largest value)."""
    import torch

    ref = next((r["dump"] for label, r in runs if label == "ddp" and r.get("dump")), None)
    if ref is None or not os.path.exists(ref):
        return
    want = torch.load(ref)
    for label, r in runs:
        if label == "ddp" or not r.get("dump") or not os.path.exists(r["dump"]):
            continue
        got = torch.load(r["dump"])
        r["fc_param_diff"] = max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-30))
                                 for n, w in want.items())


def cmd_train(args) -> int:
    layout = _layout(args)
    prof = profiles.get(args.model)
    cfg = {"model": args.model, "scale": args.scale, "iters": args.iters, "warmup": args.warmup,
           "fc": args.fc_faithful, "unscaled": args.unscaled, "straggler": args.straggler}
    partition = None if args.unscaled else max(4096, int(256 * 1024 / args.scale))
    W = args.workers_per_host
    print(f"{prof.name}: {prof.num_params / 1e6:.1f} M params ({prof.num_params * 4 / 1e6 / args.scale:.1f} MB "
          f"after /{args.scale:g}), {prof.time_per_batch * 1e3:.0f} ms compute per batch of {prof.batch}; "
          f"{args.workers} worker hosts x {W} workers, {args.cpu_servers} CPU-only servers, "
          f"colocated={layout.colocated}, rate {args.rate} (= {args.rate} x {args.scale:g} for the full model)"
          + (f"; {layout.racks} racks, core links {args.core_rate or args.rate}" if layout.racks > 1 else "")
          + (f"; median of {args.trials} interleaved trials" if args.trials > 1 else ""))
    print(f"{'run':28s} {'samples/s':>10s} {'eff':>6s} {'p50 ms':>8s} {'p90 ms':>8s} {'cores':>6s} {'vs ddp':>7s}"
          f" {'up MB':>7s} {'down MB':>7s} {'theo MB':>7s} {'/theo':>6s}   (per host link and iteration)")
    runs = []   # (label, system, variant)
    for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
        if system != "gradhub":
            runs.append((system, system, ""))
            continue
        for v in [v.strip() for v in args.variants.split(",")]:
            for hv in _host_variants(v, args.host_reduce):
                try:
                    variant_env(hv)
                except ValueError as e:
                    print(f"gradhub bench: {e}", file=sys.stderr)
                    return 2
                runs.append((f"gradhub/{hv}" if hv else "gradhub", system, hv))
    try:
        user_env = _user_env(args)
    except ValueError as e:
        print(f"gradhub bench: {e}", file=sys.stderr)
        return 2
    trials: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    dumps = tempfile.TemporaryDirectory(prefix="gradhub-bench-fc-") if args.fc_faithful else None
    for t in range(max(1, args.trials)):
        for label, system, v in runs:
            env = {**variant_env(v), **(user_env if system == "gradhub" else {})}
            # Fusion buckets scale with every other byte count (the same tensors are fused).
            if not args.unscaled:
                env.setdefault("GRADHUB_FUSION_THRESHOLD", str(max(1024, int(DEFAULT_FUSION_THRESHOLD / args.scale))))
            run_cfg = dict(cfg, dump=os.path.join(dumps.name, f"{t}-{label.replace('/', '_')}.pt")) \
                if dumps is not None and system != "none" else cfg
            res = run_job(layout, args.rate, "gradhub.bench.emulate", run_cfg, system, env=env,
                          partition_bytes=partition, core_rate=args.core_rate)
            res.pop("raw", None)
            res["dump"] = run_cfg.get("dump")
            trials[label].append(res)
            if args.trials > 1:
                print(f"  trial {t + 1}: {label:26s} {res['samples_per_s']:10.1f} samples/s, "
                      f"cores {res['busy_cores'] or float('nan'):.2f}", flush=True)
        if dumps is not None:
            _compare_with_ddp([(label, trials[label][-1]) for label, _, _ in runs])
    if dumps is not None:
        dumps.cleanup()
    ddp = none = None
    for label, system, v in runs:
        res = _median_run(trials[label])
        res.pop("dump", None)
        if system == "ddp":
            ddp = res["samples_per_s"]
        elif system == "none":
            none = res["samples_per_s"]
        M = res.get("model_bytes", 0)
        host_reduce = "nohost" not in v.split("+")
        theory = {"none": 0.0, "ddp": ring_host_link_bytes(layout.workers, W, M)}.get(
            system, gradhub_host_bytes(layout, M, host_reduce))
        s_theory = server_link_bytes(layout.workers, layout.cpu_servers, M, W, host_reduce, layout.colocated) \
            if system == "gradhub" else None
        ratio = f"{res['samples_per_s'] / ddp:7.2f}" if ddp and system == "gradhub" else f"{'':7s}"
        cores = res["busy_cores"]
        print(f"{label:28s} {res['samples_per_s']:10.1f} {res['scaling_efficiency']:6.2f} "
              f"{res['iter_time_p50'] * 1e3:8.1f} {res['iter_time_p90'] * 1e3:8.1f} "
              f"{cores if cores is not None else float('nan'):6.2f} {ratio}{_host_cols(res, theory)}"
              f"{_check(res, label)}{_server_lines(res, s_theory) if system == 'gradhub' else ''}"
              + _core_lines(res, layout, system, M)
              + (f"\n  {res['sfb_layers']} layer(s) as sufficient factors; rebuilding their gradients took "
                 f"{res['sfb_rebuild_ms']:.1f} ms of worker CPU per iteration" if res.get("sfb_layers") else "")
              + (f"\n  {res['samples_per_s'] / none:.2f} of the no-sync run (every worker computing at once)"
                 if none and system != "none" else "")
              + (f"\n  FC layers' parameters after training: {res['fc_param_diff']:.1e} (relative) from DDP's"
                 if res.get("fc_param_diff") is not None and system != "ddp" else "")
              + (f"\n  steps/s by worker: {', '.join(f'{s:.2f}' for s in res['worker_steps_per_s'])}"
                 if args.straggler != 1.0 and res.get("worker_steps_per_s") else "")
              + (f"\n  autotune: {res['autotune']['trials']} trials in {res['autotune']['steps']} untimed steps chose "
                 f"{res['autotune']['choice']} ({res['autotune']['gain']:.2f}x its start)" if res.get("autotune") else ""),
              flush=True)
        if res.get("core_bytes"):
            two = (res.get("rack_choice") or "").startswith("two levels")
            res["core_bytes_theory"] = ring_core_link_bytes(layout, M) if system == "ddp" else \
                core_link_bytes(layout, M, two) if system == "gradhub" else None
        res.update(kind="train", label=label, model=args.model, scale=args.scale, variant=v,
                   host_reduce=host_reduce, host_bytes_theory=theory, server_bytes_theory=s_theory,
                   workers_per_host=W,
                   vs_ddp=res["samples_per_s"] / ddp if ddp and system == "gradhub" else None,
                   vs_none=res["samples_per_s"] / none if none and system != "none" else None)
        _emit(args, res)
    return 0


def cmd_goodput(args) -> int:
    mbytes = args.mbytes
    rate = netns.parse_rate(args.rate)
    n, W = args.workers, args.workers_per_host
    M = mbytes * 1e6
    print(f"goodput: {n} worker hosts x {W} workers, {mbytes:g} MB per iteration, {args.rate} per host"
          + (f"; median of {args.trials} interleaved trials" if args.trials > 1 else ""))
    print(f"{'config':26s} {'time ms':>9s} {'goodput GB/s':>13s} {'optimum ms':>11s} {'of optimum':>11s} "
          f"{'cores':>6s} {'up MB':>7s} {'down MB':>7s} {'theo MB':>7s} {'/theo':>6s}")
    try:
        user_env = _user_env(args)
    except ValueError as e:
        print(f"gradhub bench: {e}", file=sys.stderr)
        return 2
    runs = []   # (label, layout, system, env, host_reduce, k)
    for k in [int(x) for x in args.k.split(",")]:
        for hr in {"on": [True], "off": [False], "both": [True, False]}[args.host_reduce]:
            label = f"gradhub k={k}" + ("" if hr else " nohost")
            runs.append((label, _layout(args, k=k), "gradhub", {**({} if hr else variant_env("nohost")), **user_env},
                         hr, k))
    if not args.no_ddp:
        runs.append(("gloo all-reduce", _layout(args, k=0, colocated=False), "ddp", {}, None, None))
    trials: dict[str, list[dict]] = {r[0]: [] for r in runs}
    for _ in range(max(1, args.trials)):
        for label, layout, system, env, hr, k in runs:
            res = run_job(layout, args.rate, "gradhub.bench.goodput", {"mbytes": mbytes, "iters": args.iters},
                          system, env=env, core_rate=args.core_rate)
            res.pop("raw", None)
            trials[label].append(res)
    for label, layout, system, env, hr, k in runs:
        res = _median_run(trials[label])
        t = res["iter_time_mean"]
        if system == "ddp":
            t_opt = allreduce_time(n * W, M, rate)   # each host link carries one ring edge each way
            theory = ring_host_link_bytes(n, W, M)
        else:
            t_opt = byteps_optimum_time(n, k, M, rate) if layout.colocated else None
            theory = gradhub_host_bytes(layout, M, hr)
        s_theory = server_link_bytes(n, k, M, W, hr, layout.colocated) if system == "gradhub" else None
        share = f"{t_opt / t:11.2f}" if t_opt else f"{'':11s}"
        print(f"{label:26s} {t * 1e3:9.1f} {res['goodput_Bps'] / 1e9:13.3f} "
              f"{(t_opt or 0) * 1e3:11.1f} {share} {res['busy_cores'] or float('nan'):6.2f}"
              f"{_host_cols(res, theory)}  drops {res['tc_drops']}"
              + ("  (vs ring optimum)" if system == "ddp" else "") + _check(res, label)
              + (_server_lines(res, s_theory) if system == "gradhub" else ""), flush=True)
        res.update(kind="goodput", label=label, k=k, optimum_time=t_opt, mbytes=mbytes, host_reduce=hr,
                   host_bytes_theory=theory, server_bytes_theory=s_theory, workers_per_host=W, share_of_optimum=t_opt / t if t_opt else None)
        _emit(args, res)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd is None:
        ap.print_help()
        return 2
    if getattr(args, "workers_per_host", 1) < 1:
        ap.error("--workers-per-host must be at least 1")
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
    if args.cmd in ("calibrate", "validate"):
        from ..plan import cli as plan_cli, validate

        return plan_cli.run_calibrate(args) if args.cmd == "calibrate" else validate.run(args)
    if args.cmd == "timeline-plot":
        from .timeline_plot import plot

        print(plot(args.trace, args.out, args.start, args.span, args.title))
        return 0
    if args.cmd == "tensors":
        from .tensors import run as run_tensors

        counts = [int(x) for x in args.counts.split(",") if x.strip()]
        return run_tensors(int(args.mbytes * 1e6), counts, args.workers, args.steps)
    if args.cmd == "gpu":
        from .gpu import run as run_gpu

        return run_gpu(args)
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
            layout = _layout(args)
            if layout.num_servers == 0:
                ap.error("--no-colocated needs --cpu-servers >= 1 (or use --no-servers)")
        try:
            return run_cluster(layout, args.rate, cmd, args.partition_bytes, host_reduce=not args.no_host_reduce,
                               core_rate=args.core_rate)
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
