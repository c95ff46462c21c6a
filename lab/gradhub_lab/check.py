"""`gradhub-lab validate --plan-check`: `gradhub plan` against exhaustive
emulation on small cases.

For each case, plan ranks its candidates (the layouts and host-stage
settings it searches there, at gradhub's defaults scaled like every byte
count) with the simulator on this machine's shared cores; then every
candidate is measured on the emulated cluster with `training.train` (the
runner the validation table uses). Plan's first choice must be the
fastest measured. Each case is chosen so plan's own predictions for its
first and second choice are at least MIN_GAP apart, so run-to-run noise
cannot swap them; the check says so when a case is ill-chosen."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from gradhub.plan.cluster import Cluster, Options, rate
from gradhub.plan.profile import builtin
from gradhub.plan.search import plan

from .rig import EmulatedCosts, emulated
from .training import TrainSpec, train

MIN_GAP = 0.15


@dataclass(frozen=True)
class Case:
    question: str
    model: str
    scale: float
    hosts: int
    rate: str
    workers_per_host: int = 1
    cpu_servers: tuple[int, ...] = (0,)   # the k searched (with a server on every worker machine)


CASES = [
    # Halves each host link's bytes (docs/planning.md): a clear answer.
    Case("host stage or not (2 machines x 2 GPUs)", "alexnet", 64, 2, "500mbit", 2),
    # 3 CPU-only machines take the colocated servers' share: 2M(n-1)/n -> M per link.
    Case("3 CPU-only machines or none (3 machines)", "alexnet", 64, 3, "250mbit", 1, (0, 3)),
]


def ranked(case: Case, costs: EmulatedCosts, cores: int):
    """Plan's choices for the case, best first (every candidate: top = all)."""
    prof = emulated(builtin(case.model, case.scale), costs)
    base = Cluster(case.hosts, case.workers_per_host, 0, True, rate(case.rate), shared_cores=cores)
    cands = [replace(base, cpu_servers=k) for k in case.cpu_servers]
    choices, _ = plan(prof, base, costs, max(case.cpu_servers), knobs={}, top=4 * len(cands),
                      start=Options().scaled(case.scale), candidates=cands)
    return choices


def label(ch) -> str:
    c = ch.cluster
    host = "" if c.workers_per_host == 1 else (", host stage on" if ch.options.host_reduce else ", host stage off")
    return f"k={c.cpu_servers}{host}"


def measure(case: Case, ch, iters: int, warmup: int) -> float:
    """Samples/s of one candidate on the emulated cluster."""
    c = ch.cluster
    spec = TrainSpec(model=case.model, scale=case.scale, workers=case.hosts, workers_per_host=c.workers_per_host,
                     cpu_servers=c.cpu_servers, no_colocated=not c.colocated, rate=case.rate, systems=("gradhub",),
                     iters=iters, warmup=warmup, host_reduce="on" if ch.options.host_reduce else "off")
    rc, records = train(spec)
    if rc != 0 or not records:
        raise RuntimeError(f"the emulated run of {case.question}, {label(ch)} failed")
    return records[-1]["samples_per_s"]


def check(case: Case, costs, cores: int, iters: int = 4, warmup: int = 1) -> dict:
    """Plan's ranking beside every candidate's measurement."""
    choices = ranked(case, costs, cores)
    rows = [{"candidate": label(ch), "predicted": ch.result.samples_per_s,
             "measured": measure(case, ch, iters, warmup)} for ch in choices]
    gap = rows[0]["predicted"] / rows[1]["predicted"] - 1 if len(rows) > 1 else float("inf")
    fastest = max(range(len(rows)), key=lambda i: rows[i]["measured"])
    return {"question": case.question, "model": case.model, "scale": case.scale, "hosts": case.hosts,
            "rate": case.rate, "rows": rows, "predicted_gap": gap, "fastest_measured": fastest,
            "first_is_fastest": fastest == 0, "well_chosen": gap >= MIN_GAP}


def markdown(results: list[dict]) -> str:
    lines = ["| question | model (x scale), rate | plan's rank: candidate | predicted samples/s | measured |",
             "| --- | --- | --- | ---: | ---: |"]
    for r in results:
        for i, row in enumerate(r["rows"]):
            head = f"{r['question']} | {r['model']} (x{r['scale']:g}), {r['rate']}" if i == 0 else " | "
            mark = " (fastest)" if i == r["fastest_measured"] else ""
            lines.append(f"| {head} | {i + 1}: {row['candidate']} | {row['predicted']:.1f} "
                         f"| {row['measured']:.1f}{mark} |")
    return "\n".join(lines)


def run(costs, cores: int, iters: int, warmup: int, json_path: str | None = None) -> int:
    """`gradhub-lab validate --plan-check`: 0 when plan's first choice is the fastest measured in every case."""
    results = [check(c, costs, cores, iters, warmup) for c in CASES]
    print(markdown(results))
    ok = True
    for r in results:
        verdict = "its first choice is the fastest measured" if r["first_is_fastest"] else \
            f"NOT the fastest measured (choice {r['fastest_measured'] + 1} is)"
        note = "" if r["well_chosen"] else f" (ill-chosen case: predictions under {MIN_GAP:.0%} apart)"
        print(f"{r['question']}: plan's first two choices predicted {r['predicted_gap']:.0%} apart; {verdict}{note}")
        ok &= r["first_is_fastest"] and r["well_chosen"]
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1
