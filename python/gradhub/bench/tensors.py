"""`gradhub bench tensors`: what a step costs with many small tensors, with
tensor fusion on and off (the aim: a model with 300 tensors pays no more
per step than one with 30).

Each configuration is a `gradhub launch` job on this machine (loopback, so
the per-tensor costs are not hidden behind a slow network): W workers train
a model of T parameters of equal size, the same total bytes for every T,
with `DistributedOptimizer` (SGD); a step is zero_grad, backward and step.
Printed per configuration: the median step time, and worker 0's CPU
seconds per step (all its threads, the core's included), beside a run
without synchronization (the step's own cost).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

TIMEOUT = 600


def worker() -> None:
    """One worker of a configuration (GH_BENCH: tensors, numel, steps, sync)."""
    import torch

    cfg = json.loads(os.environ["GH_BENCH"])
    torch.set_num_threads(1)
    n, numel, steps = cfg["tensors"], cfg["numel"], cfg["steps"]
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(n)]
    coef = torch.ones(numel)
    if cfg["sync"]:
        import gradhub.torch as hvd

        hvd.init()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.01),
                                       named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
        rank = hvd.rank()
    else:
        opt, rank = torch.optim.SGD(params, lr=0.01), 0
    times = []
    cpu0 = None
    for s in range(steps):
        if s == steps // 5:
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = sum((p * coef).sum() for p in params)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        warm = sorted(times[steps // 5:])
        cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
        print("RESULT " + json.dumps({"step_ms": 1e3 * warm[len(warm) // 2], "cpu_ms": 1e3 * cpu / len(warm)}),
              flush=True)
    if cfg["sync"]:
        hvd.shutdown()


def job(tensors: int, numel: int, steps: int, workers: int, fusion: int | None) -> dict:
    """One configuration: `workers` workers of `tensors` parameters of `numel`
    float32 each, `steps` steps; `fusion`: the fusion threshold, or None for
    one process without synchronization. Worker 0's median step and CPU
    per step, ms."""
    env = dict(os.environ, GH_BENCH=json.dumps({"tensors": tensors, "numel": numel, "steps": steps,
                                                 "sync": fusion is not None}))
    if fusion is not None:
        env["GRADHUB_FUSION_THRESHOLD"] = str(fusion)
    code = [sys.executable, "-c", "from gradhub.bench.tensors import worker; worker()"]
    argv = code if fusion is None else [sys.executable, "-m", "gradhub", "launch", "-w", str(workers), "-s", "1",
                                        "--", *code]
    p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    lines = [l for l in p.stdout.splitlines() if "RESULT " in l]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"job failed (exit {p.returncode}):\n{p.stdout[-3000:]}")
    return json.loads(lines[-1].split("RESULT ", 1)[1])


def run(total_bytes: int, counts: list[int], workers: int, steps: int) -> int:
    from .._env import DEFAULT_FUSION_THRESHOLD

    print(f"{workers} workers, 1 server, loopback; {total_bytes / 1e6:.2f} MB of float32 parameters in T tensors; "
          f"median step over {steps} steps (the first fifth left out); CPU: worker 0's, ms per step")
    print(f"{'T':>5s} {'bytes each':>11s} {'no sync ms':>11s} {'fusion off ms':>14s} {'fusion on ms':>13s} "
          f"{'off CPU ms':>11s} {'on CPU ms':>10s}")
    for t in counts:
        numel = max(1, total_bytes // 4 // t)
        base = job(t, numel, steps, workers, None)
        off = job(t, numel, steps, workers, 0)
        on = job(t, numel, steps, workers, DEFAULT_FUSION_THRESHOLD)
        print(f"{t:5d} {numel * 4:11d} {base['step_ms']:11.2f} {off['step_ms']:14.2f} {on['step_ms']:13.2f} "
              f"{off['cpu_ms']:11.2f} {on['cpu_ms']:10.2f}", flush=True)
    return 0
