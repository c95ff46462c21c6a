"""Command lines of `gradhub simulate` and `gradhub plan` (argparse, output
formatting)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

from .._argtypes import Parser, count, output_file
from .cluster import Cluster, Options, Prices, rate
from .costs import DEFAULT_FILE, Costs
from .ddp import simulate_ddp
from .gpus import load_on
from .sim import byteps_optimum, simulate_gradhub


def _rate(text: str) -> str:
    """An argparse type: a link rate in tc syntax, above 0 (kept as text)."""
    try:
        ok = rate(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate above 0 (examples: 1gbit, 500mbit, 25gbit)")
    return text


def _costs_file(text: str) -> str:
    """An argparse type: a calibration file `Costs.load` can read (kept as
    the path): a JSON object whose costs are numbers."""
    try:
        Costs.load(text)
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text}: no such file (make one with `gradhub bench calibrate`)") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: cannot read it: {e.strerror or e}") from None
    except ValueError as e:   # json.JSONDecodeError, UnicodeDecodeError
        raise argparse.ArgumentTypeError(f"{text}: not valid JSON: {e}") from None
    except (AttributeError, TypeError):   # not an object, or a field the dataclass refuses
        raise argparse.ArgumentTypeError(f"{text}: not a calibration file (a JSON object of costs, as "
                                         "`gradhub bench calibrate` writes)") from None
    d = json.loads(Path(text).read_text())
    for f in fields(Costs):
        v = d.get(f.name, getattr(Costs, f.name))
        if f.name == "source":
            continue
        # Rates divide: more than 0; times and CPU costs: at least 0.
        rate_like = f.name.endswith("_Bps") or f.name in ("wire_efficiency", "machine_cores")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v if rate_like else 0 <= v) \
                or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{text}: {f.name} is {v!r}, not a number "
                                             f"{'more than' if rate_like else 'at least'} 0")
    return text


def _gpu_link(text: str) -> str:
    """An argparse type: a GPU link `nccl.gpu_link` knows (kept as text)."""
    from .nccl import gpu_link

    try:
        gpu_link(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--gpu-link ")) from None
    return text


def _gpu_name(text: str) -> str:
    """An argparse type: a GPU of the catalogue (gpus.py)."""
    from .gpus import GPUS

    names = sorted({n for n, _ in GPUS})
    if text.strip().lower() not in names:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU of the catalogue ({', '.join(names)})")
    return text.strip().lower()


def _model_args(p) -> None:
    from .models import PROFILES
    from .profile import EXTRA

    p.add_argument("--model", default="vgg19", choices=sorted([*PROFILES, *EXTRA]),
                   help="a built-in model (default vgg19)")
    p.add_argument("--scale", type=count(0, float, above=True), default=1.0,
                   help="divide every byte count by this, as the lab's emulated runs do (default 1: the real model)")
    p.add_argument("--profile", metavar="FILE.json",
                   help='a profile file: {"batch": 32, "layers": [{"name", "params", "dtype", "forward_ms", '
                        '"backward_ms"}, ...]} in forward order')
    p.add_argument("--torch-model", metavar="MODULE:FACTORY",
                   help="time a PyTorch model on this machine: FACTORY() returns (model, example_batch)")
    p.add_argument("--gpu", type=_gpu_name, metavar="NAME",
                   help="the built-in model's compute on this GPU: v100, a100, h100 (published per-GPU training "
                        "throughputs, docs/planning.md; default: the profile's own, PHub's GTX 1080 Ti for CNNs)")
    p.add_argument("--precision", choices=["amp", "fp32"], default="amp",
                   help="with --gpu: amp (mixed precision, default) or fp32 (TF32 on A100 and H100)")
    p.add_argument("--costs", type=_costs_file,
                   help=f"calibration file from `gradhub bench calibrate` (default {DEFAULT_FILE} if "
                        "present, else this project's machine)")


def _cluster_args(p, plan: bool = False) -> None:
    p.add_argument("--hosts", type=count(1), default=4, help="worker (GPU) machines (default 4)")
    p.add_argument("--workers-per-host", type=count(1), default=1, metavar="W", help="GPUs per machine (default 1)")
    if not plan:
        p.add_argument("--cpu-servers", type=count(0), default=0, metavar="K",
                       help="CPU-only server machines (default 0)")
        p.add_argument("--no-colocated", action="store_true", help="no server on the GPU machines")
    p.add_argument("--rate", type=_rate, default="1gbit",
                   help="each machine's link, each direction, tc syntax (default 1gbit)")
    p.add_argument("--core-rate", type=_rate, help="each rack's link to the core (default: one host link)")
    p.add_argument("--racks", type=count(1), default=1, help="racks the machines are split into (default 1)")
    p.add_argument("--latency-us", type=count(0, float), default=50.0, help="one-way latency per hop, us (default 50)")
    p.add_argument("--server-threads", type=count(1), default=1, help="threads per server (default 1)")
    p.add_argument("--shared-cores", type=count(0), default=0,
                   help="every host shares this many cores (the emulated cluster on one machine; default 0: "
                        "each machine has its own)")
    p.add_argument("--gpu-link", type=_gpu_link, default="nvlink",
                   help="the GPU machines' insides, as NCCL sees them: nvlink (V100 NVLink, one NIC: BytePS's "
                        "machine; default), nvlink-a100, nvlink-h100, pcie (PCIe 3.0 only), or an all-reduce bus "
                        "bandwidth in GB/s (docs/planning.md)")
    p.add_argument("--transport", choices=["rdma", "tcp"], default="rdma",
                   help="NCCL's transport between machines (default rdma; tcp: NCCL's sockets); gradhub runs TCP")
    p.add_argument("--link-efficiency", type=count(0, float, most=1.0), default=0.0, metavar="F",
                   help="payload per bit of line rate measured on the cluster, at most 1 (default: the transport's)")
    p.add_argument("--jitter", type=count(0, float, most=1.0), default=0.0, metavar="CV",
                   help="stragglers: one GPU's per-step compute time, standard deviation over mean (0.01: 1%%); every "
                        "synchronous step waits for the slowest of the GPUs (default 0: all alike; docs/planning.md)")
    p.add_argument("--incast", type=count(0, float, above=True, most=1.0), default=1.0, metavar="F",
                   help="share of its line rate a server's downlink keeps while every worker pushes to it "
                        "(default 1: lossless, as RDMA with PFC)")
    p.add_argument("--allreduce", choices=["auto", "nccl", "gloo"], default="auto",
                   help="DDP's all-reduce: nccl (GPUs), gloo (a flat ring on CPU); default auto: gloo with "
                        "--shared-cores (the emulated cluster), else nccl")


def _cluster(args, k: int = 0, colocated: bool = True) -> Cluster:
    return Cluster(args.hosts, args.workers_per_host, getattr(args, "cpu_servers", k),
                   not getattr(args, "no_colocated", not colocated), rate(args.rate),
                   rate(args.core_rate) if args.core_rate else 0.0, max(1, args.racks), args.latency_us * 1e-6,
                   args.server_threads, args.shared_cores, args.gpu_link, args.transport,
                   args.link_efficiency, args.allreduce, args.jitter, args.incast)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="gradhub", description="Predict gradhub's and DDP's training throughput.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    s = sub.add_parser("simulate", help="simulate training iterations under gradhub and DDP",
                       description="A chunk-level discrete-event simulation of training under gradhub (and of "
                       "DDP's bucketed ring all-reduce) on the given cluster: samples/s, the busiest resource, the "
                       "share of the BytePS optimum. See docs/planning.md.",
                       epilog="example: gradhub simulate --model vgg19 --hosts 32 --workers-per-host 8 "
                              "--cpu-servers 16 --rate 100gbit")
    _model_args(s)
    _cluster_args(s)
    s.add_argument("--partition-bytes", type=count(4), default=Options.partition_bytes, help="chunk size (default 256 KiB)")
    s.add_argument("--credit-bytes", type=count(1), default=Options.credit_bytes, help="credit per connection (default: the larger of 512 KiB and 4 chunks, as the workers' default)")
    s.add_argument("--fusion-threshold", type=count(0), default=Options.fusion_threshold, help="fusion bucket bytes")
    s.add_argument("--no-host-reduce", action="store_true", help="host stage off")
    s.add_argument("--overlap-forward", action="store_true", help="forward overlap on")
    s.add_argument("--scheduling", choices=["auto", "priority", "size", "fifo"], default="auto",
                   help="GRADHUB_SCHEDULING (default auto: priority with forward overlap, else fifo)")
    s.add_argument("--fifo", action="store_true", help="GRADHUB_SCHEDULING=fifo (the same as --scheduling fifo)")
    s.add_argument("--no-eager-update", action="store_true",
                   help="GRADHUB_EAGER_UPDATE=0: the synchronous step updates after every result is in")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    pl = sub.add_parser("plan", help="search layouts and options for the fastest (or cheapest) training",
                        description="Searches k CPU-only machines (0 to --cpu-available), colocated or not, the "
                        "host stage, partition, credit and forward overlap with the simulator, and prints the best "
                        "few with predicted throughput, speed-up over DDP, cost per sample and the binding "
                        "resource.")
    _model_args(pl)
    _cluster_args(pl, plan=True)
    pl.add_argument("--cpu-available", type=count(0), default=4, help="CPU-only machines available, at most (default 4)")
    pl.add_argument("--gpu-price", type=count(0, float), default=0.0, help="price per GPU machine and hour (rank by cost)")
    pl.add_argument("--cpu-price", type=count(0, float), default=0.0, help="price per CPU-only machine and hour")
    pl.add_argument("--no-overlap", action="store_true", help="do not consider forward overlap (it changes "
                                                              "training semantics: updates one step late per layer)")
    pl.add_argument("--top", type=count(1), default=5, help="how many choices to print (default 5)")
    pl.add_argument("--apply", type=output_file, metavar="FILE", help="write the first choice's settings to FILE (KEY=VALUE lines)")
    pl.add_argument("--plot", type=output_file, metavar="FILE.png|svg",
                    help="also draw samples/s (and cost per sample with prices) against the number of CPU-only "
                         "machines, DDP as a line, the first choice marked (needs matplotlib: gradhub[bench])")
    pl.add_argument("--json", action="store_true", help="print JSON")
    return p


def _simulate(args) -> int:
    prof = load_on(args.model, args.scale, args.profile, args.torch_model, args.gpu, args.precision)
    costs = Costs.load(args.costs)
    c = _cluster(args)
    if c.num_servers < 1:
        print("gradhub simulate: --no-colocated needs --cpu-servers >= 1", file=sys.stderr)
        return 2
    o = Options(partition_bytes=args.partition_bytes, credit_bytes=args.credit_bytes,
                fusion_threshold=args.fusion_threshold, host_reduce=not args.no_host_reduce,
                overlap_forward=args.overlap_forward, scheduling="fifo" if args.fifo else args.scheduling,
                eager_update=not args.no_eager_update)
    gh = simulate_gradhub(prof, c, o, costs)
    from .ddp import BUCKET_CAP

    # torch DDP's 25 MiB buckets; the emulated cluster's runs use 25 MB (both / scale, as the lab runs them).
    ddp = simulate_ddp(prof, replace(c, cpu_servers=0), costs, (BUCKET_CAP if c.backend == "nccl" else 25e6) / args.scale)
    opt = byteps_optimum(prof, c)
    out = {"model": prof.name, "unit": prof.unit, "cluster": c.describe(), "workers": c.workers,
           "model_mbytes": prof.model_bytes / 1e6, "compute_ms": prof.compute_s * 1e3,
           "gradhub_samples_per_s": gh.samples_per_s, "ddp_samples_per_s": ddp.samples_per_s,
           "speedup_over_ddp": gh.samples_per_s / ddp.samples_per_s, "bottleneck": gh.bottleneck,
           "ddp_bottleneck": ddp.bottleneck, "ddp_allreduce": ddp.detail, "utilization": gh.utilization,
           "byteps_optimum_samples_per_s": opt, "share_of_byteps_optimum": gh.samples_per_s / opt,
           "host_link_mbytes_per_iter": gh.host_bytes / 1e6, "iteration_ms": gh.iter_s * 1e3,
           "simulated_events": gh.events, "simulation_s": gh.wall_s + ddp.wall_s, "costs": costs.source}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{prof.name} ({prof.model_bytes / 1e6:.1f} MB of gradients, {prof.compute_s * 1e3:.0f} ms compute per "
          f"batch of {prof.batch} {prof.unit}) on {c.describe()}:")
    u = prof.unit
    print(f"  gradhub  {gh.samples_per_s:10.1f} {u}/s  ({gh.iter_s * 1e3:.1f} ms/iteration; busiest: "
          f"{gh.bottleneck} {gh.utilization.get(gh.bottleneck, 0):.0%})")
    print(f"  DDP      {ddp.samples_per_s:10.1f} {u}/s  ({ddp.iter_s * 1e3:.1f} ms/iteration; busiest: "
          f"{ddp.bottleneck}; {ddp.detail})")
    print(f"  gradhub / DDP {out['speedup_over_ddp']:.2f}; {out['share_of_byteps_optimum']:.0%} of the BytePS "
          f"optimum ({opt:.1f} {u}/s); {gh.host_bytes / 1e6:.1f} MB per host link and iteration; "
          f"simulated in {out['simulation_s']:.2f} s")
    return 0


def _plan(args) -> int:
    from .search import EVIDENCE, MODEL_ERROR, env_file, margin_text, plan, verdict

    prof = load_on(args.model, args.scale, args.profile, args.torch_model, args.gpu, args.precision)
    costs = Costs.load(args.costs)
    base = _cluster(args)
    prices = Prices(args.gpu_price, args.cpu_price) if (args.gpu_price or args.cpu_price) else None
    seen: dict = {}
    if args.plot:   # before the search: a missing matplotlib or a wrong suffix fails at once
        from .plot import check_path, matplotlib_or_error

        check_path(args.plot)
        matplotlib_or_error()
    choices, ddp = plan(prof, base, costs, args.cpu_available, prices, not args.no_overlap, top=args.top, seen=seen)
    use, gain = verdict(choices, ddp, base, prices)
    if args.plot:
        from .plot import draw

        per = f"{prof.unit} per unit of price" if prices else f"{prof.unit}/s"
        draw(args.plot, prof, base, costs, args.cpu_available, seen, choices, ddp, prices,
             f"{'DDP' if use == 'ddp' else use} ({gain:.2f}x DDP's {per})",
             f"{prof.name} on {base.hosts} GPU machines x {base.workers_per_host} GPUs, {args.rate}")
    rows = [{"k": ch.cluster.cpu_servers, "colocated": ch.cluster.colocated, "env": ch.options.env(),
             "samples_per_s": ch.result.samples_per_s, "speedup_over_ddp": ch.result.samples_per_s / ddp.samples_per_s,
             "cost_per_sample": ch.cost_per_sample, "bottleneck": ch.result.bottleneck,
             "bottleneck_utilization": ch.result.utilization.get(ch.result.bottleneck, 0.0)} for ch in choices]
    if args.apply and choices:
        Path(args.apply).write_text(env_file(choices[0]))
    if args.json:
        print(json.dumps({"model": prof.name, "unit": prof.unit, "ddp_samples_per_s": ddp.samples_per_s, "ddp_allreduce": ddp.detail,
                          "verdict": use, "gain_over_ddp": gain, "model_error": MODEL_ERROR,
                          "margin_evidence": [{"where": w, "what": d, "error": e} for w, d, e in EVIDENCE], "choices": rows}))
        return 0
    print(f"{prof.name} on {base.hosts} GPU machines x {base.workers_per_host} GPUs, {args.rate}, up to "
          f"{args.cpu_available} CPU-only machines; DDP: {ddp.samples_per_s:.1f} {prof.unit}/s ({ddp.detail})")
    print(f"{'#':>2s} {'k':>3s} {'colocated':>9s} {prof.unit + '/s':>10s} {'vs DDP':>7s} {'$/M' + prof.unit[:-1]:>10s}  "
          f"settings; why (busiest resource)")
    for i, (ch, r) in enumerate(zip(choices, rows), 1):
        cps = f"{r['cost_per_sample'] * 1e6:10.3f}" if r["cost_per_sample"] is not None else f"{'-':>10s}"
        env = " ".join(f"{k}={v}" for k, v in sorted(r["env"].items())) or "defaults"
        print(f"{i:2d} {r['k']:3d} {str(r['colocated']).lower():>9s} {r['samples_per_s']:10.1f} "
              f"{r['speedup_over_ddp']:7.2f} {cps}  {env}; {r['bottleneck']} {r['bottleneck_utilization']:.0%}")
    what = f"{prof.unit} per unit of price" if prices else f"{prof.unit}/s"
    if use == "ddp":
        print(f"verdict: use DDP: the best layout gives {gain:.2f}x DDP's {what}, no clear winner within the "
              f"model's margin ({margin_text()})")
    else:
        print(f"verdict: use gradhub (choice 1): {gain:.2f}x DDP's {what}, beyond the model's margin "
              f"({margin_text()})")
    if args.plot:
        print(f"wrote {args.plot}")
    if args.apply and choices:
        print(f"wrote {args.apply} (the first choice: `set -a; . {args.apply}; set +a` before `gradhub launch`)")
    return 0


def _negative_values(argv: list[str]) -> list[str]:
    """`--rate -5gbit` as `--rate=-5gbit` (any negative spelling: -5gbit,
    -.5gbit, -1e9, -inf, -nan): argparse takes a value that
    starts with "-" and is not a plain number for an option and says only
    "expected one argument"; joined, the option's own check names what is
    wrong with the value."""
    out, it = [], iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a.startswith("--") and "=" not in a and i + 1 < len(argv) \
                and re.match(r"-\s*(\.?\d|inf|nan)", argv[i + 1], re.IGNORECASE):
            out.append(f"{a}={argv[i + 1]}")
            next(it, None)
        else:
            out.append(a)
    return out


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(_negative_values(argv))
    try:
        return _simulate(args) if args.cmd == "simulate" else _plan(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"gradhub {args.cmd}: {e}", file=sys.stderr)
        return 2
