"""`gradhub bench`: gradhub's benchmarks for your own machines.

- `core`: the data plane on loopback (transport, latency, priority, sweep,
  host stage, state, hostile connections, failover), each figure beside
  its baseline; the raw-TCP baseline is a compiled program built from the
  source checkout with cargo: without it, `core` says so and runs the rest;
- `tensors`: what a step costs with many small tensors, tensor fusion on
  and off (`gradhub launch` jobs on this machine);
- `calibrate`: this machine's costs for `gradhub simulate` and `gradhub plan`;
- `gpu`: the GPU check (exact sums through each local stage, training
  equivalence, staging bandwidth, ResNet-50 under DDP/NCCL and gradhub);
- `timeline-plot`: a window of a merged timeline as a picture.

The emulated cluster (network namespaces, tc), the simulator's validation,
the fault campaigns and the suite behind docs/ are the source checkout's
lab (`gradhub-lab`, lab/ in the repository). Kernel throughput is `cargo
bench --bench kernels` (benches/kernels.rs)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gradhub bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    from . import calibrate, core, gpu

    k = sub.add_parser(
        "core", help="data plane on loopback vs raw TCP: transport, latency, priority, sweep, host, state, hostile, "
                     "failover",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=core.__doc__,
        epilog="the raw-TCP baseline of transport and latency (examples/tcp_baseline.rs) needs the gradhub source "
               "checkout (pip install -e .) and cargo: it is built with `cargo build --release --example "
               "tcp_baseline` if it is missing; without them those two print gradhub's figures alone")
    core.add_arguments(k)
    ts = sub.add_parser("tensors", help="step cost with many small tensors, tensor fusion on and off (gradhub "
                        "launch jobs on this machine)")
    ts.add_argument("--mbytes", type=float, default=1.2, help="parameter bytes in all, MB (default 1.2)")
    ts.add_argument("--counts", default="30,300", help="comma list of tensor counts (default 30,300)")
    ts.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    ts.add_argument("--steps", type=int, default=200, help="steps per job (default 200)")
    cal = sub.add_parser("calibrate", help="measure this machine's costs for `gradhub simulate` (seconds)",
                         description=calibrate.__doc__)
    calibrate.add_arguments(cal)
    gp = sub.add_parser("gpu", help="the GPU check: exact sums through each local stage, training equivalence, "
                                    "staging bandwidth, ResNet-50 under DDP/NCCL and gradhub (CPU parts only "
                                    "without a GPU)",
                        formatter_class=argparse.RawDescriptionHelpFormatter, description=gpu.__doc__)
    gpu.add_arguments(gp)
    tp = sub.add_parser("timeline-plot", help="a window of a merged timeline (gradhub timeline merge) as a PNG")
    tp.add_argument("trace", help="the merged trace")
    tp.add_argument("out", help="the picture to write (PNG)")
    tp.add_argument("--start", type=float, default=None, help="ms into the trace (default: the middle)")
    tp.add_argument("--span", type=float, default=600.0, help="ms to show (default 600)")
    tp.add_argument("--title", default="")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd is None:
        ap.print_help()
        return 2
    if args.cmd == "core":
        from .core import run as run_core

        return run_core(args)
    if args.cmd == "tensors":
        from .tensors import run as run_tensors

        counts = [int(x) for x in args.counts.split(",") if x.strip()]
        return run_tensors(int(args.mbytes * 1e6), counts, args.workers, args.steps)
    if args.cmd == "calibrate":
        from .calibrate import run as run_calibrate

        return run_calibrate(args)
    if args.cmd == "gpu":
        from .gpu import run as run_gpu

        return run_gpu(args)
    from .timeline_plot import plot

    print(plot(args.trace, args.out, args.start, args.span, args.title))
    return 0
