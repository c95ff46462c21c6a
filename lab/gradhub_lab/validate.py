"""`gradhub-lab validate`: the simulator against the emulated cluster.

Owns the validation set (models x rates x k x worker hosts), running the
missing measurements with `training.train` (one JSON record per run,
cached as JSON lines so a table can be re-printed without re-measuring), and
the predicted-vs-measured table, and beside it the machine's CPU per
iteration against the model's (so the CPU model is checked, not only the
throughput it yields). DDP does not use CPU-only servers, so it is
measured once per (model, rate, workers) and shared by every k.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from gradhub.plan.cluster import Cluster, Options, rate
from gradhub.plan.ddp import simulate_ddp
from gradhub.plan.profile import SimProfile, builtin
from gradhub.plan.sim import simulate_gradhub

from .rig import EmulatedCosts, emulated
from .training import TrainSpec, train

DEFAULT_CACHE = Path("docs/bench/plan/validate.jsonl")


@dataclass(frozen=True)
class Config:
    model: str
    workers: int
    k: int
    rate: str
    scale: float = 16.0

    @property
    def label(self) -> str:
        return f"{self.model} n={self.workers} k={self.k} {self.rate}"


def _grid() -> list[Config]:
    spec = [
        ("vgg19", 4, "500mbit", (0, 2, 4)), ("vgg19", 4, "1gbit", (0, 2, 4)), ("vgg19", 2, "1gbit", (0, 2)),
        ("resnet50", 4, "500mbit", (0, 2)), ("resnet50", 4, "1gbit", (0, 2)), ("resnet50", 2, "500mbit", (0,)),
        ("alexnet", 4, "500mbit", (0, 2)), ("alexnet", 4, "1gbit", (0, 4)),
        ("bert_base", 4, "500mbit", (0, 2)), ("bert_base", 4, "1gbit", (0, 2, 4)), ("bert_base", 2, "1gbit", (0,)),
    ]
    return [Config(m, n, k, r) for m, n, r, ks in spec for k in ks]


CONFIGS = _grid()


def _key(rec: dict) -> tuple:
    lay = rec.get("layout", {})
    if rec.get("system") == "none":  # no traffic: neither the servers nor the rate matter
        return (rec.get("model"), lay.get("workers"), None, None, float(rec.get("scale", 0)), "none")
    k = lay.get("cpu_servers", 0) if rec.get("system") == "gradhub" else None
    return (rec.get("model"), lay.get("workers"), k, rec.get("rate"), float(rec.get("scale", 0)), rec.get("system"))


def config_key(c: Config, system: str) -> tuple:
    if system == "none":
        return (c.model, c.workers, None, None, float(c.scale), "none")
    return (c.model, c.workers, c.k if system == "gradhub" else None, c.rate, float(c.scale), system)


def load_cache(path: Path) -> dict[tuple, dict]:
    out: dict[tuple, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[_key(rec)] = rec
    return out


def train_spec(model: str, scale: float, workers: int, k: int, rate: str, systems: list[str], iters: int,
               warmup: int, out: Path | None = None, trials: int = 1) -> TrainSpec:
    """`training.train`'s spec for one measured run (its records appended to `out` as JSON lines)."""
    return TrainSpec(model=model, workers=workers, cpu_servers=k, rate=rate, scale=scale, systems=tuple(systems),
                     iters=iters, warmup=warmup, trials=trials, json_out=str(out) if out else None)


def measure(configs: list[Config], cache: Path, iters: int = 20, warmup: int = 3, trials: int = 1) -> int:
    """Run `training.train` for every configuration (and system) the cache
    lacks, the median of `trials` interleaved trials; each run appends its
    records to the cache. Returns the number of failed runs."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    for c in configs:
        have = load_cache(cache)
        systems = [s for s in ("none", "ddp", "gradhub") if config_key(c, s) not in have]
        if not systems:
            continue
        print(f"== measuring {c.label}: {', '.join(systems)}", flush=True)
        spec = train_spec(c.model, c.scale, c.workers, c.k, c.rate, systems, iters, warmup, cache, trials)
        try:
            rc, _ = train(spec)
        except Exception as e:  # one broken run must not lose the rest of the batch
            print(f"gradhub-lab validate: {c.label} failed: {e}", file=sys.stderr, flush=True)
            rc = 1
        failed += rc != 0
    return failed


def ran_with(rec: dict) -> dict:
    """The defaults a cached gradhub record ran with, as Options fields. A
    record without `eager_update` predates the eager update: one update
    after every result, forward order; one with it but without `scheduling`
    updated eagerly with the largest tensors first."""
    if "eager_update" not in rec:
        return {"eager_update": False, "scheduling": "priority"}
    return {"eager_update": bool(rec["eager_update"]), "scheduling": rec.get("scheduling", "size")}


def simulate_config(c: Config, costs, cores: int, ran: dict | None = None, nosync_s: float | None = None):
    """The simulator's gradhub Result for a configuration as `predict` runs it."""
    prof, cl, opt = inputs(c, costs, cores, ran, nosync_s)
    return simulate_gradhub(prof, cl, opt, costs)


def inputs(c: Config, costs: EmulatedCosts, cores: int, ran: dict | None, nosync_s: float | None):
    """(profile, cluster, options) of a configuration, see `predict`."""
    prof = emulated(builtin(c.model, c.scale), costs)
    if nosync_s:
        spread = max(1.0, c.workers / cores) if cores else 1.0
        step_s = prof.model_bytes / costs.step_Bps * spread
        total = sum(lay.forward_s + lay.backward_s for lay in prof.layers)
        f = max(0.1, (nosync_s - step_s) / total)
        prof = SimProfile(prof.name, prof.batch,
                          [replace(lay, forward_s=lay.forward_s * f, backward_s=lay.backward_s * f)
                           for lay in prof.layers], prof.source + ", compute as measured without synchronization")
    cl = Cluster(c.workers, 1, c.k, True, rate(c.rate), shared_cores=cores)
    opt = replace(Options(), **(ran or {}))
    return prof, cl, opt.scaled(c.scale)


def predict(c: Config, costs, cores: int, ran: dict | None = None,
            nosync_s: float | None = None) -> tuple[float, float, float, float]:
    """(gradhub, DDP) samples/s the simulator predicts for a configuration,
    as `training.train` runs it (every byte count / scale, this
    machine's cores shared by every emulated host; `ran`: Options fields
    the measured run had, `ran_with`, else today's defaults), the
    core-seconds per gradhub iteration it charges the machine and the CPU
    seconds per iteration it charges a worker's main thread for gradhub.

    `nosync_s`: the emulated model's iteration measured without any
    synchronization, every worker computing at once (`gradhub-lab train
    --systems none`): the profile's compute is then what the emulated
    model takes on this machine with that many workers (the profile as
    measured, which a real model's would be too), not its idle
    calibration's replay (`profile.emulated`): each layer's time scaled so
    that forward, backward and the local step add up to it."""
    prof, cl, opt = inputs(c, costs, cores, ran, nosync_s)
    gh = simulate_gradhub(prof, cl, opt, costs)
    ddp = simulate_ddp(prof, Cluster(c.workers, 1, 0, False, rate(c.rate), shared_cores=cores), costs, 25e6 / c.scale)
    return gh.samples_per_s, ddp.samples_per_s, gh.machine_cpu_s, gh.main_sync_cpu_s


def table(configs: list[Config], cache: Path, costs, cores: int,
          measured_compute: bool = True) -> tuple[list[dict], str]:
    """Rows (measured and predicted samples/s of both systems, relative
    errors) and the Markdown table; configurations not measured are skipped."""
    have = load_cache(cache)
    rows = []
    for c in configs:
        g, d = have.get(config_key(c, "gradhub")), have.get(config_key(c, "ddp"))
        if not g or not d:
            continue
        none = have.get(config_key(c, "none"))
        pg, pd, cpu, main = predict(c, costs, cores, ran=ran_with(g),
                              nosync_s=none["iter_time_mean"] if none and measured_compute else None)
        rows.append({"model": c.model, "workers": c.workers, "k": c.k, "rate": c.rate, "scale": c.scale,
                     "gradhub_measured": g["samples_per_s"], "gradhub_predicted": pg,
                     "ddp_measured": d["samples_per_s"], "ddp_predicted": pd,
                     "gradhub_error": pg / g["samples_per_s"] - 1, "ddp_error": pd / d["samples_per_s"] - 1,
                     # The machine's busy cores x iteration time (the run's sampler, whole machine) beside
                     # the core-seconds the model charges the shared cores per iteration.
                     "cpu_measured_s": (g.get("busy_cores") or 0.0) * g["iter_time_mean"], "cpu_model_s": cpu,
                     # A worker's training thread: what gradhub adds to it per iteration (its CPU
                     # beyond the no-sync run's, in records that have `main_cpu_ms`) beside the model's charge.
                     "main_measured_s": (g["main_cpu_ms"] - none["main_cpu_ms"]) / 1e3
                     if none and "main_cpu_ms" in g and "main_cpu_ms" in none else None,
                     "main_model_s": main})
    lines = ["| model | hosts | k | rate (x scale) | gradhub measured | predicted | error | DDP measured | predicted "
             "| error |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['workers']} | {r['k']} | {r['rate']} (x{r['scale']:g}) "
                     f"| {r['gradhub_measured']:.1f} | {r['gradhub_predicted']:.1f} | {r['gradhub_error']:+.1%} "
                     f"| {r['ddp_measured']:.1f} | {r['ddp_predicted']:.1f} | {r['ddp_error']:+.1%} |")
    return rows, "\n".join(lines)


def cpu_table(rows: list[dict]) -> str:
    """Markdown: the machine's measured CPU per gradhub iteration (busy
    cores x iteration time) beside what the model charges the shared cores,
    and what gradhub adds to a worker's main thread beside the model's
    charge, so the CPU model can be checked across k, not only its
    throughput."""
    lines = ["| model | hosts | rate | k | measured core-ms / iteration | model | model / measured "
             "| main thread: gradhub's ms / iteration | model |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        m, p = r["cpu_measured_s"] * 1e3, r["cpu_model_s"] * 1e3
        main = "" if r.get("main_measured_s") is None else f"{r['main_measured_s'] * 1e3:.1f}"
        lines.append(f"| {r['model']} | {r['workers']} | {r['rate']} | {r['k']} | {m:.1f} | {p:.1f} "
                     f"| {p / m if m else float('nan'):.2f} | {main} | {r['main_model_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def run(args) -> int:
    """`gradhub-lab validate`."""
    costs = EmulatedCosts.load(args.costs)
    if args.plan_check:
        from .check import run as plan_check

        return plan_check(costs, args.cores or costs.machine_cores, args.iters, args.warmup, args.json)
    cache = Path(args.cache)
    configs = CONFIGS[: args.limit] if args.limit else CONFIGS
    if args.measure:
        failed = measure(configs, cache, args.iters, args.warmup, args.trials)
        if failed:
            print(f"gradhub-lab validate: {failed} run(s) failed", file=sys.stderr)
    if args.plots:
        from .plots import write

        for path in write(Path(args.plots), costs):
            print(f"wrote {path}")
    rows, md = table(configs, cache, costs, args.cores or costs.machine_cores, not args.idle_compute)
    if not rows:
        print(f"gradhub-lab validate: no measurements in {cache} (run with --measure)", file=sys.stderr)
        return 1
    print(md)
    print("\nCPU per gradhub iteration, the whole machine:\n" + cpu_table(rows))
    within = sum(abs(r["gradhub_error"]) <= 0.10 and abs(r["ddp_error"]) <= 0.10 for r in rows)
    print(f"\n{within} of {len(rows)} configurations within 10 % for both systems "
          f"(costs: {costs.source})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--measure", action="store_true",
                   help="run the configurations the cache lacks on the emulated cluster first (root; slow: "
                        "about 12 min for all; hold /work/bench.lock or equivalent while others measure)")
    p.add_argument("--cache", default=str(DEFAULT_CACHE),
                   help=f"JSON lines of measured runs, read and appended (default {DEFAULT_CACHE})")
    p.add_argument("--limit", type=int, default=0, help="only the first N configurations (default: all)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measured run (default 20; "
                                                          "6 moved rows by up to 8 points between runs)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--trials", type=int, default=1,
                   help="interleaved trials per run, the median counts (default 1; 3 on a machine others load)")
    p.add_argument("--costs", help="calibration file (default ~/.config/gradhub/costs.json, else built-in)")
    p.add_argument("--cores", type=int, default=0,
                   help="cores the emulated hosts share (default: the calibrated machine's, `machine_cores` in "
                        "the calibration file)")
    p.add_argument("--idle-compute", action="store_true",
                   help="predict with the emulated model's compute replayed from the idle calibration, even where "
                        "the cache has its no-sync run (by default each model's compute is its no-sync run's: "
                        "every worker computing at once, without synchronization)")
    p.add_argument("--json", help="write the table's rows (with --plan-check: the check's results) to this JSON file")
    p.add_argument("--plan-check", action="store_true",
                   help="instead of the table: check `gradhub plan` against exhaustive emulation on two small cases "
                        "(every candidate plan ranks is measured; its first choice must be the fastest measured; "
                        "root, about a minute here; hold /work/bench.lock or equivalent while others measure)")
    p.add_argument("--plots", metavar="DIR", help="also draw the scaling plots (8-256 GPUs) into DIR "
                                                  "(docs/bench/plan)")
