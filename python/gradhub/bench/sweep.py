"""Sweeps and plots: throughput vs per-host rate (P3 Fig. 7, Poseidon Fig. 8)
and goodput vs the number of CPU-only servers (BytePS Fig. 12). Raw numbers
go to a JSON file next to each PNG."""

from __future__ import annotations

import json
from pathlib import Path

from . import netns
from .runner import Layout, byteps_optimum_time, run_job

VARIANTS = {"priority": {}, "fifo": {"GRADHUB_SCHEDULING": "fifo"}, "overlap": {"GRADHUB_OVERLAP_FORWARD": "1"}}


def bandwidth_sweep(model: str, rates: list[str], workers: int, scale: float, iters: int, outdir: Path,
                    variants: list[str], cpu_servers: int = 0) -> dict:
    cfg = {"model": model, "scale": scale, "iters": iters, "warmup": 2}
    partition = max(4096, int(256 * 1024 / scale))
    layout = Layout(workers, cpu_servers, True)
    data = {"model": model, "workers": workers, "scale": scale, "cpu_servers": cpu_servers, "runs": []}
    for rate in rates:
        for system, v in [("none", ""), ("ddp", "")] + [("gradhub", x) for x in variants]:
            res = run_job(layout, rate, "gradhub.bench.emulate", cfg, system, env=VARIANTS.get(v, {}),
                          partition_bytes=partition)
            res.pop("raw", None)
            res["label"] = system + (f"/{v}" if v else "")
            res["rate_bps"] = netns.parse_rate(rate)
            data["runs"].append(res)
            print(f"  {model} {rate:>8s} {res['label']:18s} {res['samples_per_s']:9.1f} samples/s "
                  f"eff {res['scaling_efficiency']:.2f} cores {res['busy_cores'] or float('nan'):.2f}", flush=True)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"bandwidth_{model}.json").write_text(json.dumps(data, indent=1))
    _plot_bandwidth(data, outdir / f"bandwidth_{model}.png")
    return data


def _plot_bandwidth(data: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = sorted({r["label"] for r in data["runs"]}, key=lambda l: (l != "none", l))
    for label in labels:
        rs = sorted((r for r in data["runs"] if r["label"] == label), key=lambda r: r["rate_bps"])
        x = [r["rate_bps"] * data["scale"] / 1e9 for r in rs]
        ax.plot(x, [r["samples_per_s"] for r in rs], marker="o", label=label, linestyle="--" if label == "none" else "-")
    ax.set_xscale("log")
    ax.set_xlabel("per-host bandwidth, full-model equivalent (Gbit/s)")
    ax.set_ylabel("samples/s (all workers)")
    ax.set_title(f"{data['model']}, {data['workers']} workers (compute emulated)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def k_sweep(workers: int, ks: list[int], rate: str, mbytes: float, iters: int, outdir: Path) -> dict:
    rate_bps = netns.parse_rate(rate)
    data = {"workers": workers, "rate": rate, "mbytes": mbytes, "runs": []}
    for k in ks:
        res = run_job(Layout(workers, k, True), rate, "gradhub.bench.goodput", {"mbytes": mbytes, "iters": iters},
                      "gradhub")
        res.pop("raw", None)
        res.update(k=k, optimum_time=byteps_optimum_time(workers, k, mbytes * 1e6, rate_bps))
        data["runs"].append(res)
        print(f"  k={k}: {res['iter_time_mean'] * 1e3:.1f} ms (optimum {res['optimum_time'] * 1e3:.1f} ms), "
              f"cores {res['busy_cores'] or float('nan'):.2f}", flush=True)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "k_sweep.json").write_text(json.dumps(data, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ks_ = [r["k"] for r in data["runs"]]
    ax.plot(ks_, [mbytes / r["iter_time_mean"] for r in data["runs"]], marker="o", label="gradhub")
    ax.plot(ks_, [mbytes / r["optimum_time"] for r in data["runs"]], linestyle="--", label="BytePS optimum")
    ax.set_xlabel("CPU-only server machines (k)")
    ax.set_ylabel("goodput per worker (MB/s)")
    ax.set_title(f"{workers} workers, {rate} per host")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(outdir / "k_sweep.png", dpi=110)
    plt.close(fig)
    return data
