"""The suite's experiments. Each runs jobs on emulated clusters and writes
one JSON file of raw numbers (plus a PNG where there is a plot):

  train_table      one model at one rate under several systems and layouts
  bandwidth_sweep  throughput vs per-host rate (P3 Fig. 7, Poseidon Fig. 8)
  k_sweep          goodput vs CPU-only servers with the BytePS optimum (BytePS Fig. 12)
  rate_check       goodput and CPU use vs rate: where the emulation stops being network-bound
"""

from __future__ import annotations

import json
from pathlib import Path

from gradhub.plan.theory import allreduce_time, byteps_optimum_time

from . import netns
from .runner import Layout, run_job, variant_env


def _label(system: str, variant: str = "", k: int | None = None) -> str:
    if system != "gradhub":
        return system
    return f"gradhub k={k} {variant}" if k is not None else f"gradhub {variant}"


def _clean(res: dict, **extra) -> dict:
    res.pop("raw", None)
    res.update(extra)
    return res


def _write(outdir: Path, name: str, data: dict) -> Path:
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def _train_run(layout, rate, model, scale, iters, system, variant, label, log) -> dict:
    cfg = {"model": model, "scale": scale, "iters": iters, "warmup": 2}
    partition = max(4096, int(256 * 1024 / scale))
    res = run_job(layout, rate, "gradhub_lab.emulate", cfg, system, env=variant_env(variant),
                  partition_bytes=partition)
    res = _clean(res, label=label, variant=variant, rate_bps=netns.parse_rate(rate))
    log(f"  {model} {rate:>8s} {label:28s} {res['samples_per_s']:10.1f} samples/s  eff {res['scaling_efficiency']:.2f}"
        f"  cores {res['busy_cores'] or float('nan'):.2f}")
    return res


def train_table(name: str, model: str, rate: str, runs: list[tuple[str, str, int]], workers: int, scale: float,
                iters: int, outdir: Path, log=print) -> dict:
    """runs: (system, variant, k) triples; k = CPU-only server hosts."""
    data = {"kind": "train", "model": model, "rate": rate, "workers": workers, "scale": scale, "iters": iters,
            "runs": []}
    for system, variant, k in runs:
        layout = Layout(workers, k, True)
        label = _label(system, variant, k)
        data["runs"].append(_train_run(layout, rate, model, scale, iters, system, variant, label, log))
    _write(outdir, name, data)
    return data


def bandwidth_sweep(model: str, rates: list[str], workers: int, scale: float, iters: int, outdir: Path,
                    variants: list[str], log=print) -> dict:
    data = {"kind": "bandwidth", "model": model, "workers": workers, "scale": scale, "cpu_servers": 0,
            "iters": iters, "runs": []}
    layout = Layout(workers, 0, True)
    for rate in rates:
        for system, v in [("none", ""), ("ddp", "")] + [("gradhub", x) for x in variants]:
            data["runs"].append(_train_run(layout, rate, model, scale, iters, system, v, _label(system, v), log))
    _write(outdir, f"bandwidth_{model}", data)
    _plot_bandwidth(data, outdir / f"bandwidth_{model}.png")
    return data


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_bandwidth(data: dict, path: Path):
    plt = _pyplot()
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


def _goodput_run(workers, k, rate, mbytes, iters, system="gradhub", trials=3) -> dict:
    """Median of `trials` jobs (by mean iteration time): one job's figure
    swings by up to ±5 % on this machine."""
    layout = Layout(workers, k, system == "gradhub")
    runs = [run_job(layout, rate, "gradhub_lab.goodput", {"mbytes": mbytes, "iters": iters}, system)
            for _ in range(max(1, trials))]
    runs.sort(key=lambda r: r["iter_time_mean"])
    res = runs[len(runs) // 2]
    res["trial_iter_times"] = [r["iter_time_mean"] for r in runs]
    rate_bps = netns.parse_rate(rate)
    opt = byteps_optimum_time(workers, k, mbytes * 1e6, rate_bps) if system == "gradhub" else \
        allreduce_time(workers, mbytes * 1e6, rate_bps)
    return _clean(res, k=k if system == "gradhub" else None, optimum_time=opt, mbytes=mbytes, rate_bps=rate_bps,
                  share_of_optimum=opt / res["iter_time_mean"])


def k_sweep(workers: int, ks: list[int], rate: str, mbytes: float, iters: int, outdir: Path, log=print,
            trials: int = 3) -> dict:
    data = {"kind": "k_sweep", "workers": workers, "rate": rate, "mbytes": mbytes, "iters": iters,
            "trials": trials, "runs": []}
    for k in ks:
        res = _goodput_run(workers, k, rate, mbytes, iters, trials=trials)
        data["runs"].append(res)
        log(f"  k={k}: {res['iter_time_mean'] * 1e3:.1f} ms (optimum {res['optimum_time'] * 1e3:.1f} ms, "
            f"{res['share_of_optimum']:.2f}), cores {res['busy_cores'] or float('nan'):.2f}")
    data["gloo"] = _goodput_run(workers, 0, rate, mbytes, iters, system="ddp", trials=trials)
    log(f"  gloo all-reduce: {data['gloo']['iter_time_mean'] * 1e3:.1f} ms ({data['gloo']['share_of_optimum']:.2f} "
        "of the ring optimum)")
    _write(outdir, "k_sweep", data)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ks_ = [r["k"] for r in data["runs"]]
    ax.plot(ks_, [mbytes / r["iter_time_mean"] for r in data["runs"]], marker="o", label="gradhub")
    ax.plot(ks_, [mbytes / r["optimum_time"] for r in data["runs"]], linestyle="--", label="BytePS optimum")
    ax.axhline(mbytes / data["gloo"]["iter_time_mean"], color="gray", linestyle=":", label="gloo all-reduce")
    ax.set_xlabel("CPU-only server machines (k)")
    ax.set_ylabel("goodput per worker (MB/s)")
    ax.set_title(f"{workers} workers, {rate} per host")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(outdir / "k_sweep.png", dpi=110)
    plt.close(fig)
    return data


def rate_check(workers: int, rates: list[str], mbytes: float, iters: int, outdir: Path, log=print,
               trials: int = 3) -> dict:
    """Goodput at k = 0 against rising rates: while it tracks the optimum the
    experiment measures the emulated network; when busy cores approach the
    machine's and the share drops, it measures this machine instead."""
    data = {"kind": "rate_check", "workers": workers, "mbytes": mbytes, "iters": iters, "trials": trials, "runs": []}
    for rate in rates:
        # Enough bytes per iteration that start-up costs stay small at high rates too.
        mb = mbytes * max(1.0, netns.parse_rate(rate) / 1e9)
        res = _goodput_run(workers, 0, rate, mb, iters, trials=trials)
        res["rate"] = rate
        data["runs"].append(res)
        log(f"  {rate:>8s}: {res['share_of_optimum']:.2f} of the optimum, cores {res['busy_cores'] or float('nan'):.2f}")
    _write(outdir, "rate_check", data)
    return data
