"""`gradhub plan`: search layouts and options with the simulator.

Layouts (k CPU-only servers from 0 to what is available, colocated or not,
the host stage on or off with several GPUs per host) are searched
exhaustively; for each, the options (partition, credit, forward overlap)
are improved one at a time from gradhub's defaults (coordinate descent:
each knob's best value with the others fixed, until nothing improves),
which the tests check against an exhaustive search on small cases."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cluster import Cluster, Options, Prices
from .costs import Costs
from .ddp import simulate_ddp
from .profile import SimProfile
from .sim import Result, simulate_gradhub

KIB = 1024
KNOBS = {
    "partition_bytes": (64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB),
    "credit_bytes": (128 * KIB, 512 * KIB, 2048 * KIB),
    "overlap_forward": (False, True),
}


@dataclass
class Choice:
    cluster: Cluster
    options: Options
    result: Result
    cost_per_sample: float | None = None


def layouts(base: Cluster, max_cpu: int) -> list[Cluster]:
    out = []
    for k in range(0, max_cpu + 1):
        for colocated in ((True, False) if k else (True,)):
            out.append(replace(base, cpu_servers=k, colocated=colocated))
    return out


def option_sets(base: Cluster, start: Options = Options()) -> list[Options]:
    """Starting points: the host stage on and off with several GPUs per machine."""
    host = (True, False) if base.workers_per_host > 1 else (True,)
    return [replace(start, host_reduce=h) for h in host]


def _score(r: Result, c: Cluster, prices: Prices | None) -> float:
    """Higher is better: samples/s, or samples per unit of price with prices."""
    if prices and prices.per_hour(c) > 0:
        return r.samples_per_s / prices.per_hour(c)
    return r.samples_per_s


def tune(profile: SimProfile, c: Cluster, start: Options, costs: Costs, knobs: dict, prices=None,
         cache: dict | None = None) -> tuple[Options, Result]:
    """Coordinate descent over `knobs` from `start`."""
    cache = {} if cache is None else cache

    def sim(o: Options) -> Result:
        key = (c, o)
        if key not in cache:
            cache[key] = simulate_gradhub(profile, c, o, costs)
        return cache[key]

    best, best_r = start, sim(start)
    improved = True
    while improved:
        improved = False
        for knob, values in knobs.items():
            for v in values:
                o = replace(best, **{knob: v})
                r = sim(o)
                if _score(r, c, prices) > _score(best_r, c, prices) * (1 + 1e-9):
                    best, best_r, improved = o, r, True
    return best, best_r


def plan(profile: SimProfile, base: Cluster, costs: Costs, max_cpu: int, prices: Prices | None = None,
         allow_overlap: bool = True, knobs: dict | None = None, top: int = 5, start: Options = Options(),
         candidates: list[Cluster] | None = None) -> tuple[list[Choice], Result]:
    """The best `top` (layout, options), best first, and DDP's result on the
    GPU machines alone. `start`: the options the search starts from (e.g.
    scaled for the emulated cluster); `candidates`: the layouts to search
    (default: every k up to max_cpu, colocated or not)."""
    knobs = dict(KNOBS if knobs is None else knobs)
    if not allow_overlap:
        knobs.pop("overlap_forward", None)
    found = []
    for c in (layouts(base, max_cpu) if candidates is None else candidates):
        for first in option_sets(c, start):
            o, r = tune(profile, c, first, costs, knobs, prices)
            cps = None
            if prices and prices.per_hour(c) > 0:
                cps = prices.per_hour(c) / 3600 / r.samples_per_s
            found.append(Choice(c, o, r, cps))
    found.sort(key=lambda ch: -_score(ch.result, ch.cluster, prices))
    ddp = simulate_ddp(profile, replace(base, cpu_servers=0, colocated=False), costs)
    return found[:top], ddp


def exhaustive(profile: SimProfile, base: Cluster, costs: Costs, max_cpu: int, knobs: dict,
               prices: Prices | None = None) -> Choice:
    """Every layout x every combination of knob values: the best (the tests' reference)."""
    import itertools

    best = None
    for c in layouts(base, max_cpu):
        for start in option_sets(c):
            names = list(knobs)
            for vals in itertools.product(*(knobs[n] for n in names)):
                o = replace(start, **dict(zip(names, vals)))
                r = simulate_gradhub(profile, c, o, costs)
                if best is None or _score(r, c, prices) > _score(best.result, best.cluster, prices):
                    best = Choice(c, o, r)
    return best


def env_file(ch: Choice) -> str:
    """The choice as an env file `gradhub launch` and the roles read (export it, or pass it to your launcher)."""
    c = ch.cluster
    lines = [f"# gradhub plan: {c.describe()}; predicted {ch.result.samples_per_s:.1f} samples/s "
             f"(busiest: {ch.result.bottleneck})",
             f"# layout: {c.cpu_servers} CPU-only server machine(s)"
             + ("" if c.colocated else "; no server on the GPU machines (gradhub bench cluster --no-colocated)"),
             f"GRADHUB_NUM_SERVERS={c.num_servers}"]
    lines += [f"{k}={v}" for k, v in sorted(ch.options.env().items())]
    return "\n".join(lines) + "\n"
