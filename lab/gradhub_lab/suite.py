"""`gradhub-lab suite`: every experiment behind docs/bench/suite.md, then
`report` to regenerate its tables from the JSON.

The experiment list is fixed (that is what makes the document reproducible);
--only picks some, --resume skips those whose JSON already exists (to finish
an interrupted run), --quick shrinks every experiment for a smoke test.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import experiments

# Per-model rates for the bandwidth sweeps: from clearly communication-bound
# to nearly compute-bound for DDP at scale 16 on 4 workers.
SWEEP_RATES = {
    "vgg19": ["500mbit", "1gbit", "2gbit"],
    "alexnet": ["500mbit", "1gbit", "2gbit"],
    "resnet50": ["250mbit", "500mbit", "1gbit"],
    "inception_v3": ["250mbit", "500mbit", "1gbit"],
    "bert_base": ["500mbit", "1gbit", "2gbit"],
    "gpt2_small": ["500mbit", "1gbit", "2gbit"],
}


@dataclass
class Experiment:
    name: str
    what: str
    run: Callable[[Path, Callable], dict]


def experiment_list(workers: int = 4, quick: bool = False) -> list[Experiment]:
    n = workers
    scale = 64 if quick else 16
    iters = 2 if quick else 6
    gp_iters = 2 if quick else 5
    trials = 1 if quick else 3
    mbytes = 4 if quick else 32
    pick = (lambda xs: xs[-1:]) if quick else (lambda xs: xs)
    ks = [0, 1] if quick else list(range(n + 1))

    def train(model, rate, runs):
        return lambda out, log: experiments.train_table(f"train_{model}", model, rate, runs, n, scale, iters, out, log)

    base = [("none", "", 0), ("ddp", "", 0)]
    exps = [
        Experiment("rate_check", "goodput and CPU use vs per-host rate (k=0)",
                   lambda out, log: experiments.rate_check(n, pick(["500mbit", "1gbit", "2gbit", "4gbit"]), mbytes,
                                                           gp_iters, out, log, trials)),
        Experiment("k_sweep", "goodput vs CPU-only servers, BytePS optimum, gloo",
                   lambda out, log: experiments.k_sweep(n, ks, "1gbit", mbytes, gp_iters, out, log, trials)),
        Experiment("train_vgg19", "VGG-19 at 1 Gbit/s: every scheduling option, k=0 and k=n",
                   train("vgg19", "1gbit", base + [
                       ("gradhub", "fifo", 0), ("gradhub", "priority", 0), ("gradhub", "overlap", 0),
                       ("gradhub", "server", 0), ("gradhub", "overlap+server", 0),
                       ("gradhub", "fifo", n), ("gradhub", "priority", n), ("gradhub", "overlap", n),
                       ("gradhub", "overlap+server", n)])),
        Experiment("train_resnet50", "ResNet-50 at 500 Mbit/s: k=0 and k=n",
                   train("resnet50", "500mbit", base + [
                       ("gradhub", "fifo", 0), ("gradhub", "priority", 0), ("gradhub", "overlap", 0),
                       ("gradhub", "priority", n), ("gradhub", "overlap", n)])),
        Experiment("train_bert_base", "BERT-base at 2 Gbit/s: FIFO vs priority vs overlap",
                   train("bert_base", "2gbit", base + [
                       ("gradhub", "fifo", 0), ("gradhub", "priority", 0), ("gradhub", "overlap", 0),
                       ("gradhub", "fifo", n), ("gradhub", "overlap", n)])),
    ]
    for model, rates in SWEEP_RATES.items():
        exps.append(Experiment(
            f"bandwidth_{model}", f"{model}: throughput vs per-host rate",
            lambda out, log, m=model, r=rates: experiments.bandwidth_sweep(m, pick(r), n, scale, iters, out,
                                                                         ["priority", "overlap"], log)))
    return exps


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "memory": mem, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "commit": commit or "unknown",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run_suite(out: Path, doc: Path | None, workers: int, quick: bool, only: list[str] | None, resume: bool,
              argv: list[str]) -> int:
    exps = experiment_list(workers, quick)
    known = {e.name for e in exps}
    bad = [x for x in only or [] if x not in known]
    if bad:
        print(f"gradhub-lab suite: unknown experiment(s) {', '.join(bad)}; choose from {', '.join(sorted(known))}",
              file=sys.stderr)
        return 2
    todo = [e for e in exps if not only or e.name in only]
    if resume:
        todo = [e for e in todo if not (out / f"{e.name}.json").exists()]
    out.mkdir(parents=True, exist_ok=True)
    meta = machine_info()
    meta["command"] = " ".join(["gradhub-lab suite", *argv])
    t0 = time.monotonic()
    for i, e in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {e.name}: {e.what}", flush=True)
        t = time.monotonic()
        e.run(out, lambda s: print(s, flush=True))
        # Stamp the file with where and when it was measured.
        path = out / f"{e.name}.json"
        data = json.loads(path.read_text())
        data["meta"] = meta
        path.write_text(json.dumps(data, indent=1))
        print(f"  ({time.monotonic() - t:.0f} s)", flush=True)
    print(f"suite: {len(todo)} experiment(s) in {(time.monotonic() - t0) / 60:.1f} min", flush=True)
    if doc is not None:
        from .report import update_doc

        update_doc(doc, out)
        print(f"regenerated the report section of {doc}")
    return 0
