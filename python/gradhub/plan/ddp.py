"""`gradhub simulate`'s model of PyTorch DDP over gloo: bucketed ring
all-reduce on the same cluster.

Buckets as DDP builds them: parameters in reverse order, the first bucket
capped at 1 MiB (torch's `_DEFAULT_FIRST_BUCKET_BYTES`), the others at
`bucket_cap` (25 MB; `gradhub bench train` divides it by the scale). A
bucket is all-reduced once backward has produced all its gradients, one
bucket at a time, in order. A ring over N = hosts x GPUs processes, ranked
host by host, moves 2(N-1)/N of a bucket through each host link each way,
in 2(N-1) steps that each pay a latency; each process also sums (N-1)/N of
it. With racks the ring crosses each rack's core link once each way.
After the last bucket, the local step (on the CPU in the emulated
cluster only); then the next forward."""

from __future__ import annotations

import time

from .cluster import Cluster
from .costs import Costs
from .engine import Engine, Resource
from .profile import SimProfile
from .sim import Result

FIRST_BUCKET = 1 << 20


def buckets(profile: SimProfile, cap: float) -> list[tuple[int, int]]:
    """(bytes, index of the earliest layer in it) per bucket, in the order backward fills them."""
    out, size, lo, limit = [], 0, None, FIRST_BUCKET
    for li in range(len(profile.layers) - 1, -1, -1):
        for b in profile.layers[li].tensors:
            if size and size + b > limit:
                out.append((size, lo))
                size, limit = 0, cap
            size += b
            lo = li
    if size:
        out.append((size, lo))
    return out


def ring_time(c: Cluster, nbytes: float, costs: Costs) -> tuple[float, float, float]:
    """(network seconds, CPU seconds, latency seconds) of one ring all-reduce of nbytes."""
    n = c.workers
    if n < 2:
        return 0.0, 0.0, 0.0
    B = c.rate_bps * costs.wire_efficiency / 8
    per_link = 2 * (n - 1) / n * nbytes
    net = per_link / B if c.hosts > 1 else 0.0
    if c.racks > 1:
        net = max(net, per_link / ((c.core_bps or c.rate_bps) * costs.wire_efficiency / 8))
    # Each process sends and receives 2(N-1)/N of the bucket and sums (N-1)/N of it.
    cpu_one = costs.tcp_cpu_per_byte * per_link + (n - 1) / n * nbytes / costs.sum_Bps
    if c.shared_cores:   # the emulated path between hosts: one message per ring step sent
        cpu_one += costs.path_cpu(per_link, 2 * (n - 1)) if c.hosts > 1 else 0.0
    cpu = cpu_one * n / c.shared_cores if c.shared_cores else cpu_one
    return net, cpu, 2 * (n - 1) * c.latency_s


def simulate_ddp(profile: SimProfile, c: Cluster, costs: Costs, bucket_cap: float = 25e6) -> Result:
    t0 = time.perf_counter()
    e = Engine()
    link, cpu, compute = Resource("host link (ring)"), Resource("CPU (ring sums and copies)"), Resource("GPU compute")
    bks = buckets(profile, bucket_cap)
    L = len(profile.layers)
    # The last layer (in backward order) each bucket waits for.
    ready_after = {}
    for bi, (_, lo) in enumerate(bks):
        ready_after.setdefault(lo, []).append(bi)
    N = c.workers
    # The local step on the CPU in the emulated cluster only (sim.py).
    step_s = profile.model_bytes / costs.step_Bps * max(1.0, N / c.shared_cores) if c.shared_cores else 0.0
    state = {"next": 0, "ready": set(), "busy": False, "done": 0, "bwd_end": None, "end": None}

    def start_next():
        if state["busy"] or state["next"] not in state["ready"]:
            return
        bi = state["next"]
        state["busy"] = True
        net, cpu_s, lat = ring_time(c, bks[bi][0], costs)
        # Network and CPU of a ring overlap step by step: the slower binds.
        link.busy += net
        cpu.busy += cpu_s
        e.at(e.now + max(net, cpu_s) + lat, finished)

    def finished():
        state["busy"] = False
        state["next"] += 1
        state["done"] += 1
        if state["done"] == len(bks):
            state["end"] = e.now
        start_next()

    def backward(li):
        if li < 0:
            state["bwd_end"] = e.now
            return
        e.use(compute, 0, profile.layers[li].backward_s, grads, li)

    def grads(li):
        state["ready"].update(ready_after.get(li, []))
        start_next()
        backward(li - 1)

    fwd = profile.forward_s
    compute.busy += fwd
    e.at(fwd, backward, L - 1)
    e.run()
    iter_s = max(state["end"] or 0.0, state["bwd_end"] or 0.0) + step_s
    util = {r.name: r.busy / iter_s for r in (link, cpu, compute) if r.busy > 0}
    neck = max(util, key=util.get) if util else "none"
    host_bytes = 2 * (N - 1) / N * profile.model_bytes if c.hosts > 1 else 0.0
    return Result("ddp", N * profile.batch / iter_s, iter_s, neck, util, host_bytes, e.events,
                  time.perf_counter() - t0, f"{len(bks)} buckets")
