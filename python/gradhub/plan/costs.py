"""Machine costs the simulator charges for CPU work, and `gradhub bench
calibrate`, which measures them on this machine.

Every cost is a rate or a per-unit time, measured by a fast microbenchmark,
never fitted to a training run: the summation rate of one thread, the CPU a
chunk costs beyond its bytes (worker and server together, through the core's
own client and server on loopback), the CPU per byte of TCP (the same job,
big chunks), a memory pass (the host stage's copies), and a worker's local
step per parameter byte (gradient tensors made and an SGD-with-momentum
update, what `gradhub bench train`'s emulated model does every step), and
the emulated model's own overheads (how late a sleep returns, CPU per
layer) and the machine's core count, which only the validation against the
emulated cluster uses. The
wire efficiency is TCP payload per byte a link carries (1448 of 1514 bytes
per full Ethernet frame with timestamps), which tc's shaper counts."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

DEFAULT_FILE = Path(os.path.expanduser("~/.config/gradhub/costs.json"))


@dataclass(frozen=True)
class Costs:
    # Defaults: `gradhub bench calibrate` on the 2-core machine gradhub is
    # developed on (docs/bench/plan/calibration.json, docs/planning.md).
    sum_Bps: float = 1.67e+10           # bytes/s one server thread adds into an accumulator
    chunk_cpu_s: float = 1.08e-05       # CPU per chunk beyond its bytes (worker + server)
    tcp_cpu_per_byte: float = 1.31e-10  # CPU seconds per byte sent and received over TCP (both ends)
    mem_Bps: float = 1.57e+10           # one memory pass (copy), bytes/s
    step_Bps: float = 1.54e+09          # a worker's local step, parameter bytes/s
    op_cpu_s: float = 6.79e-05          # worker CPU per push_pull of DistributedOptimizer (Python, hooks, core)
    # The emulated model's own costs (bench/emulate.py; only when simulating the emulated cluster):
    sleep_overshoot_s: float = 7.62e-05  # how much later than asked time.sleep returns
    layer_cpu_s: float = 2.24e-05       # Python and autograd per emulated layer, forward + backward
    wire_efficiency: float = 1448 / 1514
    # The emulated network path (veth, bridge, tc, the other host's stack;
    # `gradhub bench calibrate --emulated`, netcal.py): CPU per byte and per
    # message crossing between emulated hosts, beyond loopback TCP's. Only
    # the shared-cores pool charges it: a real cluster's NICs do not take it
    # from the hosts' cores that way.
    path_cpu_per_byte: float = 7.00e-10  # CPU seconds per byte crossing between emulated hosts
    path_cpu_per_msg_s: float = 0.0      # CPU per message crossing between emulated hosts (the fit's median: 0)
    # A worker's main thread per push_pull on the emulated cluster, where
    # every worker's threads and the servers share the machine's cores
    # (`gradhub bench calibrate --emulated`, netcal.main_thread: measured on
    # a model outside the validation set); 0: op_cpu_s, measured alone.
    # The built-in value is docs/bench/plan/calibration.json's.
    emu_op_cpu_s: float = 2.35e-04
    # Cores of the machine calibrated: what the emulated cluster's hosts all
    # share there (`gradhub bench validate`, `--shared-cores`).
    machine_cores: int = 2
    source: str = "built-in (docs/bench/plan/calibration.json)"

    def path_cpu(self, crossing_bytes: float, messages: float) -> float:
        """CPU seconds the emulated network path costs beyond loopback TCP
        for these bytes and messages between emulated hosts (the simulators
        charge it on the shared cores only)."""
        return crossing_bytes * self.path_cpu_per_byte + messages * self.path_cpu_per_msg_s

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path | None = None) -> "Costs":
        """The calibration file (path, else ~/.config/gradhub/costs.json if
        present, else the defaults)."""
        p = Path(path) if path else DEFAULT_FILE
        if not p.exists():
            if path:
                raise FileNotFoundError(f"no calibration file {p} (make one with `gradhub bench calibrate`)")
            return Costs()
        d = json.loads(p.read_text())
        known = {f.name for f in fields(Costs)}
        return Costs(**{k: v for k, v in d.items() if k in known})


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

    from ..bench.core import Job

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


def _harness(layers: int = 200) -> tuple[float, float]:
    """(sleep overshoot, CPU per layer) of the emulated model: how late
    time.sleep returns, and a forward + backward of a model of tiny layers
    with no compute, per layer."""
    import statistics

    import torch

    from ..bench.emulate import EmulatedModel
    from ..bench.profiles import Layer, Profile

    late = []
    for d in (3e-4, 1e-3, 3e-3) * 40:
        t0 = time.perf_counter()
        time.sleep(d)
        late.append(time.perf_counter() - t0 - d)
    torch.set_num_threads(1)
    m = EmulatedModel(Profile("tiny", 1, 0.0, [Layer(f"l{i}", [1], 1.0) for i in range(layers)]), 1)
    x = torch.ones(1, requires_grad=True)

    def step():
        m.zero_grad()
        m(x).backward()

    step()
    return statistics.median(late), _best(step, 10) / layers


def _ops(tensors: int, steps: int) -> float:
    """Worker CPU per push_pull under DistributedOptimizer: a one-worker
    job on loopback (`gradhub bench tensors`' job) with many tiny tensors,
    fusion off, minus the same step without synchronization, per tensor."""
    from ..bench.tensors import _job

    on = _job(tensors, 16, steps, 1, 0)
    off = _job(tensors, 16, steps, 1, None)
    return max(0.0, (on["cpu_ms"] - off["cpu_ms"]) / 1e3 / tensors)


def calibrate(quick: bool = False) -> Costs:
    """This machine's costs from the microbenchmarks (the emulated path's
    come from `netcal.measure`, which needs root)."""
    mb = 16 << 20 if quick else 64 << 20
    sum_Bps, mem_Bps = _memory(mb)
    step_Bps = _step(mb)
    chunk_cpu, tcp = _chunks(mb // 4 if quick else mb // 2, (16 << 10, 4 << 20), 3 if quick else 5)
    op_cpu = _ops(200, 60 if quick else 150)
    overshoot, layer_cpu = _harness()
    return Costs(sum_Bps=sum_Bps, chunk_cpu_s=chunk_cpu, tcp_cpu_per_byte=tcp, mem_Bps=mem_Bps, step_Bps=step_Bps,
                 op_cpu_s=op_cpu, sleep_overshoot_s=overshoot, layer_cpu_s=layer_cpu,
                 machine_cores=os.cpu_count() or 1,
                 source=f"gradhub bench calibrate on {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}")


def describe(c: Costs) -> str:
    return (f"sum {c.sum_Bps / 1e9:.2f} GB/s per thread, {c.chunk_cpu_s * 1e6:.1f} us CPU per chunk, "
            f"TCP {c.tcp_cpu_per_byte * 1e9:.3f} ns CPU per byte, memory {c.mem_Bps / 1e9:.2f} GB/s, "
            f"local step {c.step_Bps / 1e9:.2f} GB/s of parameters, {c.op_cpu_s * 1e6:.0f} us worker CPU per "
            f"push_pull, sleep {c.sleep_overshoot_s * 1e6:.0f} us late, {c.layer_cpu_s * 1e6:.0f} us CPU per emulated "
            f"layer, wire efficiency {c.wire_efficiency:.3f}, {c.machine_cores} cores, emulated network path "
            f"{c.path_cpu_per_byte * 1e9:.3f} ns per byte and {c.path_cpu_per_msg_s * 1e6:.1f} us per message"
            + (f", {c.emu_op_cpu_s * 1e6:.0f} us main-thread CPU per push_pull there" if c.emu_op_cpu_s else ""))
