"""`gradhub-lab train` and `gradhub-lab goodput`: emulated training under
gradhub, DDP/gloo and no synchronization (and DDP with gradhub's comm hook,
DDP and FSDP2 over the "gradhub" torch.distributed backend, FSDP2 over
gloo), and push_pull-only goodput, on an emulated cluster (runner.py,
netns.py), each run beside its theory (the BytePS split's link bytes,
gradhub/plan/theory.py)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field

from gradhub.tools import DEFAULT_FUSION_THRESHOLD
from gradhub.plan import models as profiles
from gradhub.plan.cluster import parse_rate
from gradhub.plan.theory import (allreduce_time, byteps_optimum_time, host_link_bytes, ring_host_link_bytes,
                                 server_link_bytes)

from .runner import BACKEND_SYSTEMS, Layout, core_link_bytes, ring_core_link_bytes, run_job, variant_env

# Every system `train` runs (emulate.py), and those whose members are gradhub
# roles (--env reaches them).
SYSTEMS = ("none", "ddp", "gradhub", "ddp-hook", "ddp-gradhub", "ddp-overlap", "ddp-gradhub-overlap", "fsdp-gloo",
           "fsdp-gradhub")
GRADHUB_SYSTEMS = ("gradhub", "ddp-hook", "ddp-gradhub", "ddp-gradhub-overlap", "fsdp-gradhub")


@dataclass
class TrainSpec:
    """One training comparison (`gradhub-lab train`'s flags, as data)."""
    model: str = "vgg19"
    workers: int = 4                    # worker hosts
    workers_per_host: int = 1
    cpu_servers: int = 0                # k
    no_colocated: bool = False
    server_threads: int = 1             # 0: the server's own default (one per core)
    rate: str = "1gbit"                 # per host and direction, tc syntax
    racks: int = 1
    core_rate: str | None = None        # each rack's core link (None: rate)
    scale: float = 16
    iters: int = 10
    warmup: int = 3
    systems: tuple[str, ...] = ("none", "ddp", "gradhub")
    unscaled: bool = False
    fc_faithful: bool = False
    straggler: float = 1.0
    variants: tuple[str, ...] = ("priority",)   # gradhub variants (runner.VARIANTS, joined by +)
    host_reduce: str = "on"             # on, off or both
    trials: int = 1
    env: dict[str, str] = field(default_factory=dict)   # for every gradhub role of every run
    json_out: str | None = None         # append the records to this JSON-lines file


def _emit(path: str | None, rec: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def user_env(pairs: list[str]) -> dict[str, str]:
    """--env NAME=VALUE flags as a dict (ValueError naming a malformed one)."""
    env = {}
    for kv in pairs:
        name, sep, value = kv.partition("=")
        if not sep or not name:
            raise ValueError(f"--env {kv!r}: expected NAME=VALUE")
        env[name] = value
    return env


def _host_variants(variant: str, host_reduce: str) -> list[str]:
    """The gradhub variant(s) to run for one --variants entry under --host-reduce."""
    off = "+".join(x for x in [variant, "nohost"] if x)
    if "nohost" in variant.split("+"):
        return [variant]
    return {"on": [variant], "off": [off], "both": [variant, off]}[host_reduce]


def _median_run(runs: list[dict]) -> dict:
    """The trial with the median mean iteration time, with every trial's key figures."""
    ordered = sorted(runs, key=lambda r: r["iter_time_mean"])
    res = dict(ordered[len(ordered) // 2])
    res["trials"] = [{k: r.get(k) for k in ("iter_time_mean", "samples_per_s", "goodput_Bps", "busy_cores",
                                            "host_tx_per_iter", "host_rx_per_iter", "tc_drops", "result_error")
                      if r.get(k) is not None} for r in runs]
    return res


def _mb(x) -> str:
    return f"{x / 1e6:7.1f}" if x is not None else f"{'-':>7s}"


def _host_cols(res: dict, theory: float | None) -> str:
    """Host link bytes per iteration (upload/download, mean over worker hosts) next to the theory."""
    tx, rx = res.get("host_tx_per_iter"), res.get("host_rx_per_iter")
    if tx is None:
        return ""
    share = f"{max(tx, rx) / theory:6.2f}" if theory else f"{'':6s}"
    return f" {_mb(tx)} {_mb(rx)} {_mb(theory)} {share}"


def _server_lines(res: dict, theory: float | None) -> str:
    """CPU-only server hosts' links (sampled bridge-side counters, per mean
    iteration) and the scheduler's placement, printed under a run."""
    out = ""
    sb = res.get("server_host_bytes")
    if sb:
        cells = ", ".join(f"{h} {v['tx'] / 1e6:.1f}/{v['rx'] / 1e6:.1f}" for h, v in sorted(sb.items()))
        out += f"\n    CPU-only server links, up/down MB per iteration: {cells}" + \
               (f" (theory {theory / 1e6:.1f})" if theory else "")
    if res.get("server_shares"):
        out += f"\n    placement: {res['server_shares']}"
    return out


def _core_lines(res: dict, layout: Layout, system: str, model_bytes: float) -> str:
    """With racks: each rack's core link (up/down MB per iteration) beside
    the theory for what ran, and the scheduler's choice."""
    core = res.get("core_bytes")
    if not core:
        return ""
    choice = res.get("rack_choice") or ""
    two = choice.startswith("two levels")
    theory = {"ddp": ring_core_link_bytes(layout, model_bytes), "gradhub": core_link_bytes(layout, model_bytes, two)}
    t = theory.get(system)
    cells = ", ".join(f"{h} {v['tx'] / 1e6:.1f}/{v['rx'] / 1e6:.1f}" for h, v in sorted(core.items()))
    out = f"\n    core links, up/down MB per iteration: {cells}" + (f" (theory {t / 1e6:.1f})" if t else "")
    if system == "gradhub" and choice:
        out += f"\n    racks: {choice}"
    return out


def _check(res: dict, label: str) -> str:
    err = res.get("result_error")
    if err is not None and err > 1e-3:
        print(f"gradhub-lab: WARNING {label}: synchronized values deviate from the exact ones by "
              f"{err:.3g} (relative)", file=sys.stderr, flush=True)
        return "  WRONG VALUES"
    return ""


def layout_of(args, k=None, colocated=None) -> Layout:
    """The Layout a command's flags (or a TrainSpec) describe; `k`, `colocated`: instead of theirs."""
    return Layout(args.workers, args.cpu_servers if k is None else k,
                  (not args.no_colocated) if colocated is None else colocated, args.server_threads,
                  args.workers_per_host, max(1, getattr(args, "racks", 1)))


def gradhub_host_bytes(layout: Layout, model_bytes: float, host_reduce: bool) -> float:
    """Theoretical bytes per worker host's link per iteration and direction (BytePS split)."""
    return host_link_bytes(layout.workers, layout.cpu_servers, model_bytes, layout.workers_per_host, host_reduce,
                           colocated=layout.colocated)


def fsdp_host_bytes(layout: Layout, model_bytes: float, system: str) -> float | None:
    """Theoretical bytes per worker host's link per iteration and direction
    under FSDP2 with every layer resharded after forward: two all-gathers of
    the parameters (forward, backward) and one reduce-scatter of the
    gradients. gloo: a ring all-gather, (n-1)/n M each way; its
    reduce-scatter moves what its all-reduce does, 2(n-1)/n M (measured:
    not a ring reduce-scatter's (n-1)/n). The gradhub backend
    (colocated servers, one worker per host; None otherwise) places each
    member's shard on its own host's server (sharded tensors): an
    all-gather pushes one's own slot there and pulls the others' slots,
    (n-1)/n M each way; a reduce-scatter pushes the other shards, (n-1)/n
    M, and pulls its own from its own host: a ring's bytes, 3(n-1)/n M in
    all. With CPU-only servers alone the two ways
    differ: an all-gather pushes M/n and pulls the others' slots, (n-1)/n
    M, a reduce-scatter pushes M and pulls M/n, so down carries
    (2n-1)/n M and up (n+2)/n M; the figure given is the busier way's."""
    n = layout.num_workers
    if system == "fsdp-gloo":
        return 4 * (n - 1) / n * model_bytes
    if layout.workers_per_host != 1:
        return None
    if layout.cpu_servers and not layout.colocated:
        return max(2 * n - 1, n + 2) / n * model_bytes
    if layout.cpu_servers or not layout.colocated:
        return None
    return 3 * (n - 1) / n * model_bytes


def _compare_with_ddp(runs: list[tuple[str, dict]]) -> None:
    """FC-faithful runs of one trial: each system's real FC parameters after
    training against DDP's (`fc_param_diff`, the largest difference relative
    to the tensor's largest value)."""
    import torch

    ref = next((r["dump"] for label, r in runs if label == "ddp" and r.get("dump")), None)
    if ref is None or not os.path.exists(ref):
        return
    want = torch.load(ref)
    for label, r in runs:
        if label == "ddp" or not r.get("dump") or not os.path.exists(r["dump"]):
            continue
        got = torch.load(r["dump"])
        r["fc_param_diff"] = max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-30))
                                 for n, w in want.items())


def train(spec: TrainSpec) -> tuple[int, list[dict]]:
    """Run one training comparison on the emulated cluster, print its table
    and return (exit code, the records: one per run, each the median of
    the trials), each also appended to `spec.json_out` if given."""
    layout = layout_of(spec)
    unknown = [s for s in spec.systems if s not in SYSTEMS]
    if unknown:
        print(f"gradhub-lab train: unknown system {unknown[0]!r} (choose from {', '.join(SYSTEMS)})", file=sys.stderr)
        return 2, []
    backend = [s for s in spec.systems if s in BACKEND_SYSTEMS]
    if backend and layout.racks > 1:
        print(f"gradhub-lab train: {backend[0]}: the gradhub backend's job has no racks (no --racks)",
              file=sys.stderr)
        return 2, []
    prof = profiles.get(spec.model)
    cfg = {"model": spec.model, "scale": spec.scale, "iters": spec.iters, "warmup": spec.warmup,
           "fc": spec.fc_faithful, "unscaled": spec.unscaled, "straggler": spec.straggler}
    partition = None if spec.unscaled else max(4096, int(256 * 1024 / spec.scale))
    W = spec.workers_per_host
    print(f"{prof.name}: {prof.num_params / 1e6:.1f} M params ({prof.num_params * 4 / 1e6 / spec.scale:.1f} MB "
          f"after /{spec.scale:g}), {prof.time_per_batch * 1e3:.0f} ms compute per batch of {prof.batch}; "
          f"{spec.workers} worker hosts x {W} workers, {spec.cpu_servers} CPU-only servers, "
          f"colocated={layout.colocated}, rate {spec.rate} (= {spec.rate} x {spec.scale:g} for the full model)"
          + (f"; {layout.racks} racks, core links {spec.core_rate or spec.rate}" if layout.racks > 1 else "")
          + (f"; median of {spec.trials} interleaved trials" if spec.trials > 1 else ""))
    print(f"{'run':28s} {'samples/s':>10s} {'eff':>6s} {'p50 ms':>8s} {'p90 ms':>8s} {'cores':>6s} {'vs ddp':>7s}"
          f" {'up MB':>7s} {'down MB':>7s} {'theo MB':>7s} {'/theo':>6s}   (per host link and iteration)")
    runs = []   # (label, system, variant)
    for system in spec.systems:
        if system != "gradhub":
            runs.append((system, system, ""))
            continue
        for v in spec.variants:
            for hv in _host_variants(v, spec.host_reduce):
                try:
                    variant_env(hv)
                except ValueError as e:
                    print(f"gradhub-lab train: {e}", file=sys.stderr)
                    return 2, []
                runs.append((f"gradhub/{hv}" if hv else "gradhub", system, hv))
    user_env = dict(spec.env)
    trials: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    dumps = tempfile.TemporaryDirectory(prefix="gradhub-bench-fc-") if spec.fc_faithful else None
    for t in range(max(1, spec.trials)):
        for label, system, v in runs:
            env = {**variant_env(v), **(user_env if system in GRADHUB_SYSTEMS else {})}
            # Fusion buckets scale with every other byte count (the same tensors are fused).
            if not spec.unscaled:
                env.setdefault("GRADHUB_FUSION_THRESHOLD", str(max(1024, int(DEFAULT_FUSION_THRESHOLD / spec.scale))))
            run_cfg = dict(cfg, dump=os.path.join(dumps.name, f"{t}-{label.replace('/', '_')}.pt")) \
                if dumps is not None and system != "none" else cfg
            res = run_job(layout, spec.rate, "gradhub_lab.emulate", run_cfg, system, env=env,
                          partition_bytes=partition, core_rate=spec.core_rate)
            res.pop("raw", None)
            res["dump"] = run_cfg.get("dump")
            trials[label].append(res)
            if spec.trials > 1:
                print(f"  trial {t + 1}: {label:26s} {res['samples_per_s']:10.1f} samples/s, "
                      f"cores {res['busy_cores'] or float('nan'):.2f}", flush=True)
        if dumps is not None:
            _compare_with_ddp([(label, trials[label][-1]) for label, _, _ in runs])
    if dumps is not None:
        dumps.cleanup()
    ddp = none = None
    records = []
    for label, system, v in runs:
        res = _median_run(trials[label])
        res.pop("dump", None)
        if system == "ddp":
            ddp = res["samples_per_s"]
        elif system == "none":
            none = res["samples_per_s"]
        M = res.get("model_bytes", 0)
        host_reduce = "nohost" not in v.split("+")
        if system.startswith("fsdp"):
            theory = fsdp_host_bytes(layout, M, system)
        else:
            ring = ring_host_link_bytes(layout.workers, W, M)
            theory = {"none": 0.0, "ddp": ring, "ddp-overlap": ring}.get(
                system, gradhub_host_bytes(layout, M, host_reduce))
        s_theory = server_link_bytes(layout.workers, layout.cpu_servers, M, W, host_reduce, layout.colocated) \
            if system in ("gradhub", "ddp-hook") else None
        compared = ddp and system not in ("none", "ddp")
        ratio = f"{res['samples_per_s'] / ddp:7.2f}" if compared else f"{'':7s}"
        cores = res["busy_cores"]
        print(f"{label:28s} {res['samples_per_s']:10.1f} {res['scaling_efficiency']:6.2f} "
              f"{res['iter_time_p50'] * 1e3:8.1f} {res['iter_time_p90'] * 1e3:8.1f} "
              f"{cores if cores is not None else float('nan'):6.2f} {ratio}{_host_cols(res, theory)}"
              f"{_check(res, label)}{_server_lines(res, s_theory) if system in ('gradhub', 'ddp-hook') else ''}"
              + _core_lines(res, layout, system, M)
              + (f"\n  {res['sfb_layers']} layer(s) as sufficient factors; rebuilding their gradients took "
                 f"{res['sfb_rebuild_ms']:.1f} ms of worker CPU per iteration" if res.get("sfb_layers") else "")
              + (f"\n  {res['samples_per_s'] / none:.2f} of the no-sync run (every worker computing at once)"
                 if none and system != "none" else "")
              + (f"\n  FC layers' parameters after training: {res['fc_param_diff']:.1e} (relative) from DDP's"
                 if res.get("fc_param_diff") is not None and system != "ddp" else "")
              + (f"\n  steps/s by worker: {', '.join(f'{s:.2f}' for s in res['worker_steps_per_s'])}"
                 if spec.straggler != 1.0 and res.get("worker_steps_per_s") else "")
              + (f"\n  autotune: {res['autotune']['trials']} trials in {res['autotune']['steps']} untimed steps chose "
                 f"{res['autotune']['choice']} ({res['autotune']['gain']:.2f}x its start)" if res.get("autotune") else ""),
              flush=True)
        if res.get("core_bytes"):
            two = (res.get("rack_choice") or "").startswith("two levels")
            res["core_bytes_theory"] = ring_core_link_bytes(layout, M) if system == "ddp" else \
                core_link_bytes(layout, M, two) if system == "gradhub" else None
        res.update(kind="train", label=label, model=spec.model, scale=spec.scale, variant=v,
                   host_reduce=host_reduce, host_bytes_theory=theory, server_bytes_theory=s_theory,
                   workers_per_host=W,
                   vs_ddp=res["samples_per_s"] / ddp if compared else None,
                   vs_none=res["samples_per_s"] / none if none and system != "none" else None)
        _emit(spec.json_out, res)
        records.append(res)
    return 0, records


def goodput(args) -> int:
    """`gradhub-lab goodput`: push_pull-only goodput against the BytePS optimum and gloo's ring."""
    mbytes = args.mbytes
    rate = parse_rate(args.rate)
    n, W = args.workers, args.workers_per_host
    M = mbytes * 1e6
    print(f"goodput: {n} worker hosts x {W} workers, {mbytes:g} MB per iteration, {args.rate} per host"
          + (f"; median of {args.trials} interleaved trials" if args.trials > 1 else ""))
    print(f"{'config':26s} {'time ms':>9s} {'goodput GB/s':>13s} {'optimum ms':>11s} {'of optimum':>11s} "
          f"{'cores':>6s} {'up MB':>7s} {'down MB':>7s} {'theo MB':>7s} {'/theo':>6s}")
    try:
        env_of_user = user_env(args.env)
    except ValueError as e:
        print(f"gradhub-lab goodput: {e}", file=sys.stderr)
        return 2
    runs = []   # (label, layout, system, env, host_reduce, k)
    for k in [int(x) for x in args.k.split(",")]:
        for hr in {"on": [True], "off": [False], "both": [True, False]}[args.host_reduce]:
            label = f"gradhub k={k}" + ("" if hr else " nohost")
            runs.append((label, layout_of(args, k=k), "gradhub", {**({} if hr else variant_env("nohost")), **env_of_user},
                         hr, k))
    if not args.no_ddp:
        runs.append(("gloo all-reduce", layout_of(args, k=0, colocated=False), "ddp", {}, None, None))
    trials: dict[str, list[dict]] = {r[0]: [] for r in runs}
    for _ in range(max(1, args.trials)):
        for label, layout, system, env, hr, k in runs:
            res = run_job(layout, args.rate, "gradhub_lab.goodput", {"mbytes": mbytes, "iters": args.iters},
                          system, env=env, core_rate=args.core_rate)
            res.pop("raw", None)
            trials[label].append(res)
    for label, layout, system, env, hr, k in runs:
        res = _median_run(trials[label])
        t = res["iter_time_mean"]
        if system == "ddp":
            t_opt = allreduce_time(n * W, M, rate)   # each host link carries one ring edge each way
            theory = ring_host_link_bytes(n, W, M)
        else:
            t_opt = byteps_optimum_time(n, k, M, rate) if layout.colocated else None
            theory = gradhub_host_bytes(layout, M, hr)
        s_theory = server_link_bytes(n, k, M, W, hr, layout.colocated) if system == "gradhub" else None
        share = f"{t_opt / t:11.2f}" if t_opt else f"{'':11s}"
        print(f"{label:26s} {t * 1e3:9.1f} {res['goodput_Bps'] / 1e9:13.3f} "
              f"{(t_opt or 0) * 1e3:11.1f} {share} {res['busy_cores'] or float('nan'):6.2f}"
              f"{_host_cols(res, theory)}  drops {res['tc_drops']}"
              + ("  (vs ring optimum)" if system == "ddp" else "") + _check(res, label)
              + (_server_lines(res, s_theory) if system == "gradhub" else ""), flush=True)
        res.update(kind="goodput", label=label, k=k, optimum_time=t_opt, mbytes=mbytes, host_reduce=hr,
                   host_bytes_theory=theory, server_bytes_theory=s_theory, workers_per_host=W, share_of_optimum=t_opt / t if t_opt else None)
        _emit(args.json, res)
    return 0
