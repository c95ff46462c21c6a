"""`gradhub-lab calibrate`: this machine's costs for the simulator, the
emulated cluster's included (rig.py's `EmulatedCosts`). Without
--emulated: gradhub's microbenchmarks (`gradhub bench calibrate`) and the
emulated model's own overheads (`rig.harness`); with it: the emulated
network path's CPU (netcal.py `measure`) and a worker's main-thread CPU per
push_pull there (netcal.py `main_thread`; root). Each keeps what the other
measured in --out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gradhub.plan.costs import DEFAULT_FILE, Costs

from .rig import EmulatedCosts, describe, harness


def add_arguments(p) -> None:
    p.add_argument("--out", default=str(DEFAULT_FILE), help=f"where to write the costs (default {DEFAULT_FILE})")
    p.add_argument("--quick", action="store_true", help="smaller microbenchmarks (a few seconds)")
    p.add_argument("--emulated", action="store_true",
                   help="measure only the emulated cluster's costs: the network path's CPU (veth, bridge, tc; per "
                        "byte and per message beyond loopback) and a worker's main-thread CPU per push_pull there "
                        "(an emulated training run of a model outside the validation set), what `--shared-cores` "
                        "charges; update those in --out, keeping the others (root, network namespaces, about 3 "
                        "min; hold /work/bench.lock or equivalent while others measure)")


def run(args) -> int:
    """`gradhub-lab calibrate`: without --emulated, gradhub's microbenchmarks
    (`gradhub bench calibrate`) and the emulated model's overheads, the
    emulated path's costs kept as calibrated; with it, those only."""
    out = Path(args.out)
    old = EmulatedCosts.load(out) if out.exists() else EmulatedCosts()
    if args.emulated:
        from .netcal import main_thread, measure

        print("emulated network path, CPU beyond loopback TCP's:")
        m = measure(seconds=1.5 if args.quick else 3.0)
        c = replace(old, path_cpu_per_byte=m["path_cpu_per_byte"], path_cpu_per_msg_s=m["path_cpu_per_msg_s"],
                    source=f"{old.source.split('; ')[0]}; {m['path_source']}")
        print("a worker's main thread per push_pull, every host's threads on the shared cores:")
        c = replace(c, emu_op_cpu_s=main_thread(c, iters=15 if args.quick else 30,
                                                trials=1 if args.quick else 3)["emu_op_cpu_s"])
    else:   # the microbenchmarks; the emulated path's costs stay as calibrated
        from gradhub.bench.calibrate import calibrate

        machine = calibrate(args.quick)
        overshoot, layer_cpu = harness()
        c = replace(old, **{f: getattr(machine, f) for f in Costs.__dataclass_fields__
                            if f not in ("path_cpu_per_byte", "path_cpu_per_msg_s", "emu_op_cpu_s", "source")},
                    sleep_overshoot_s=overshoot, layer_cpu_s=layer_cpu,
                    source=machine.source.replace("gradhub bench calibrate", "gradhub-lab calibrate"))
        if "; " in old.source:
            c = replace(c, source=f"{c.source}; {old.source.split('; ', 1)[1]}")
    c.save(out)
    print(f"{describe(c)}\nwrote {args.out}")
    return 0
