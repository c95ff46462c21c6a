"""The emulated cluster as the simulator sees it: its costs, and the
emulated model's compute replayed.

`EmulatedCosts` is gradhub's `Costs` (gradhub/plan/costs.py) with what only
this machine's emulated cluster has, as data the simulator takes: the CPU
of the network path between emulated hosts (veth, bridge, tc; netcal.py
`measure`), a worker's main-thread CPU per push_pull where every host's
threads share the cores (netcal.py `main_thread`), and the emulated model's
own overheads (how late a sleep returns, CPU per layer; `harness`). Its
defaults are the development machine's calibration
(docs/bench/plan/calibration.json). `emulated` replays a profile's compute
as the emulated model (emulate.py) spends it. `gradhub-lab calibrate`
(calibrate.py) measures them."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from gradhub.plan.costs import Costs, describe as describe_machine
from gradhub.plan.profile import SimLayer, SimProfile


@dataclass(frozen=True)
class EmulatedCosts(Costs):
    # The emulated network path (`gradhub-lab calibrate --emulated`,
    # netcal.measure): CPU per byte and per message crossing between
    # emulated hosts, beyond loopback TCP's.
    path_cpu_per_byte: float = 7.00e-10  # CPU seconds per byte crossing between emulated hosts
    path_cpu_per_msg_s: float = 0.0      # CPU per message crossing between emulated hosts (the fit's median: 0)
    # A worker's main thread per push_pull on the emulated cluster
    # (netcal.main_thread: measured on a model outside the validation set).
    emu_op_cpu_s: float = 2.35e-04
    # The emulated model's own costs (emulate.py; `harness`):
    sleep_overshoot_s: float = 7.62e-05  # how much later than asked time.sleep returns
    layer_cpu_s: float = 2.24e-05       # Python and autograd per emulated layer, forward + backward


def describe(c: EmulatedCosts) -> str:
    return (f"{describe_machine(c)}; the emulated model: sleep {c.sleep_overshoot_s * 1e6:.0f} us late, "
            f"{c.layer_cpu_s * 1e6:.0f} us CPU per layer")


def emulated(p: SimProfile, costs: EmulatedCosts) -> SimProfile:
    """The compute `gradhub-lab train`'s emulated model really spends on
    this profile: its clock (emulate.py `_Clock`) replayed layer by layer,
    forward then backward, with the calibrated CPU per layer and gradient
    bytes (torch.full, a memory pass) and the calibrated lateness of each
    sleep it takes (a sleep is taken once the clock is 0.2 ms ahead;
    lateness resets the clock, so it adds up)."""
    t, deadline = 0.0, None
    times: list[list[float]] = [[0.0, 0.0] for _ in p.layers]
    cpus: list[list[float]] = [[0.0, 0.0] for _ in p.layers]

    def spend(s: float, cpu: float) -> float:
        nonlocal t, deadline
        start = t
        t += cpu
        if deadline is None or deadline < t:
            deadline = t
        deadline += s
        if deadline - t > 2e-4:
            t = deadline + costs.sleep_overshoot_s
        return t - start

    n = len(p.layers)
    for i, l in enumerate(p.layers):
        cpus[i][0] = costs.layer_cpu_s / 2
        times[i][0] = spend(l.forward_s, cpus[i][0])
    for i in range(n - 1, -1, -1):
        l = p.layers[i]
        cpus[i][1] = costs.layer_cpu_s / 2 + sum(l.tensors) / costs.mem_Bps
        times[i][1] = spend(l.backward_s, cpus[i][1])
    # What the last sleep still owes is paid by the next iteration's first.
    layers = [SimLayer(l.name, l.tensors, f, b, min(f, fc), min(b, bc))
              for l, (f, b), (fc, bc) in zip(p.layers, times, cpus)]
    return SimProfile(p.name, p.batch, layers, p.source + ", as the emulated model runs it")


def harness(layers: int = 200) -> tuple[float, float]:
    """(sleep overshoot, CPU per layer) of the emulated model: how late
    time.sleep returns, and a forward + backward of a model of tiny layers
    with no compute, per layer."""
    import torch

    from gradhub.plan.models import Layer, Profile

    from .emulate import EmulatedModel

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
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return statistics.median(late), best / layers
