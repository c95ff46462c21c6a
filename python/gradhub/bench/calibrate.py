"""`gradhub bench calibrate`: this machine's costs for `gradhub simulate`
and `gradhub plan` (plan/costs.py's `Costs`), each measured by a fast
microbenchmark, never fitted to a training run: the summation rate of one
thread, the CPU a chunk costs beyond its bytes (worker and server together,
through the core's own client and server on loopback), the CPU per byte of
TCP (the same job, big chunks), a memory pass (the host stage's copies), a
worker's local step per parameter byte (gradient tensors made and an
SGD-with-momentum update) and its CPU per push_pull under
DistributedOptimizer (`gradhub bench tensors`' job), and the machine's core
count."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from ..plan.costs import DEFAULT_FILE, Costs, describe


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _memory(nbytes: int) -> tuple[float, float]:
    """(sum rate, copy rate) of one thread, bytes/s, on float32 arrays."""
    import numpy as np

    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    add = _best(lambda: np.add(a, b, out=a), 5)
    copy = _best(lambda: np.copyto(a, b), 5)
    return nbytes / add, nbytes / copy


def _step(nbytes: int) -> float:
    """Parameter bytes/s of the emulated model's step: gradient made with
    torch.full, SGD with momentum, zero_grad."""
    import torch

    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.zeros(nbytes // 4))
    opt = torch.optim.SGD([p], lr=1e-3, momentum=0.9)

    def one():
        opt.zero_grad()
        p.grad = torch.full(p.shape, 1e-6)
        opt.step()

    one()
    return nbytes / _best(one, 5)


def _chunks(nbytes: int, partitions: tuple[int, int], reps: int) -> tuple[float, float]:
    """(CPU per chunk, CPU per TCP byte) from the core's client and server on
    loopback: one worker, one server; the same tensor cut into small and
    big chunks. A push_pull of M bytes moves M to the server and M back."""
    import numpy as np

    from .core import Job

    cpu = {}
    for part in partitions:
        job = Job(part, 512 << 10)
        try:
            a = np.ones(nbytes // 4, dtype=np.float32)
            job.push_pull(a, "t").wait()
            best = float("inf")
            for _ in range(reps):
                c0 = job.cpu()
                job.push_pull(a, "t").wait()
                best = min(best, job.cpu() - c0)
            cpu[part] = best
        finally:
            job.close()
    small, big = partitions
    n_small, n_big = -(-nbytes // small), -(-nbytes // big)
    per_chunk = max(0.0, (cpu[small] - cpu[big]) / (n_small - n_big))
    per_byte = max(0.0, cpu[big] - n_big * per_chunk) / (2 * nbytes)
    return per_chunk, per_byte


def _ops(tensors: int, steps: int) -> float:
    """Worker CPU per push_pull under DistributedOptimizer: a one-worker
    job on loopback (`gradhub bench tensors`' job) with many tiny tensors,
    fusion off, minus the same step without synchronization, per tensor."""
    from .tensors import job

    on = job(tensors, 16, steps, 1, 0)
    off = job(tensors, 16, steps, 1, None)
    return max(0.0, (on["cpu_ms"] - off["cpu_ms"]) / 1e3 / tensors)


def calibrate(quick: bool = False) -> Costs:
    """This machine's costs from the microbenchmarks."""
    mb = 16 << 20 if quick else 64 << 20
    sum_Bps, mem_Bps = _memory(mb)
    step_Bps = _step(mb)
    chunk_cpu, tcp = _chunks(mb // 4 if quick else mb // 2, (16 << 10, 4 << 20), 3 if quick else 5)
    op_cpu = _ops(200, 60 if quick else 150)
    return Costs(sum_Bps=sum_Bps, chunk_cpu_s=chunk_cpu, tcp_cpu_per_byte=tcp, mem_Bps=mem_Bps, step_Bps=step_Bps,
                 op_cpu_s=op_cpu,
                 machine_cores=os.cpu_count() or 1,
                 source=f"gradhub bench calibrate on {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}")


def add_arguments(p) -> None:
    p.add_argument("--out", default=str(DEFAULT_FILE), help=f"where to write the costs (default {DEFAULT_FILE}, "
                                                            "which `gradhub simulate` and `gradhub plan` read)")
    p.add_argument("--quick", action="store_true", help="smaller microbenchmarks (a few seconds)")


def run(args) -> int:
    """`gradhub bench calibrate`: the microbenchmarks, written to --out;
    what else the file holds (costs measured otherwise: a cluster emulated
    on shared cores) stays."""
    out = Path(args.out)
    old = Costs.load(out) if out.exists() else Costs()
    c = replace(calibrate(args.quick), path_cpu_per_byte=old.path_cpu_per_byte,
                path_cpu_per_msg_s=old.path_cpu_per_msg_s, emu_op_cpu_s=old.emu_op_cpu_s)
    if "; " in old.source:
        c = replace(c, source=f"{c.source}; {old.source.split('; ', 1)[1]}")
    c.save(out)
    print(f"{describe(c)}\nwrote {args.out}")
    return 0
