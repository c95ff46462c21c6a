"""The scaling plots of docs/planning.md: predicted samples/s from 8 to 256
GPUs (machines of 8 GPUs) for ResNet-50, VGG-16 and BERT-large at 25 and
100 Gbit/s: gradhub with no CPU-only machine and with as many as GPU
machines (BytePS's setup), DDP over gloo as simulated, a ring all-reduce at
link speed (NCCL-like: CPU free) and linear scaling of one GPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from gradhub.plan.cluster import Cluster, Options
from gradhub.plan.costs import Costs
from gradhub.plan.ddp import simulate_ddp
from gradhub.plan.profile import builtin
from gradhub.plan.sim import simulate_gradhub

MODELS = ("resnet50", "vgg16", "bert_large")
RATES = (25e9, 100e9)
GPUS = (8, 16, 32, 64, 128, 256)
THREADS = 8   # server threads per server machine (as BytePS runs its servers)


def series(model: str, rate_bps: float, costs: Costs) -> dict[str, list[float]]:
    p = builtin(model)
    free_cpu = replace(costs, sum_Bps=1e18, chunk_cpu_s=0.0, tcp_cpu_per_byte=0.0, op_cpu_s=0.0, step_Bps=1e18)
    out: dict[str, list[float]] = {"gpus": list(GPUS), "gradhub k=0": [], "gradhub k=n": [], "DDP (gloo)": [],
                                   "ring at link speed": [], "linear": []}
    for g in GPUS:
        n = g // 8
        c = Cluster(n, 8, 0, True, rate_bps, server_threads=THREADS)
        out["gradhub k=0"].append(simulate_gradhub(p, c, Options(), costs).samples_per_s)
        out["gradhub k=n"].append(simulate_gradhub(p, replace(c, cpu_servers=n), Options(), costs).samples_per_s)
        out["DDP (gloo)"].append(simulate_ddp(p, c, costs).samples_per_s)
        out["ring at link speed"].append(simulate_ddp(p, c, free_cpu).samples_per_s)
        out["linear"].append(g * p.batch / p.compute_s)
    return out


def write(out_dir: Path, costs: Costs) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written, data = [], {}
    for model in MODELS:
        fig, axes = plt.subplots(1, len(RATES), figsize=(10, 4), sharey=True)
        for ax, rate in zip(axes, RATES):
            s = series(model, rate, costs)
            data[f"{model}@{rate / 1e9:g}gbit"] = s
            for name, ys in s.items():
                if name != "gpus":
                    ax.plot(s["gpus"], ys, marker="o" if name.startswith("gradhub") else None,
                            linestyle=":" if name == "linear" else "-", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(GPUS, [str(g) for g in GPUS])
            ax.set_title(f"{model}, {rate / 1e9:g} Gbit/s per machine")
            ax.set_xlabel("GPUs (8 per machine)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("predicted samples/s")
        axes[-1].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"scaling_{model}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    (out_dir / "scaling.json").write_text(json.dumps(data, indent=1) + "\n")
    return written
