"""`gradhub simulate`'s model of PyTorch DDP: bucketed all-reduce on the
same cluster, over NCCL on GPU machines (nccl.py: rings and trees as NCCL
picks them, inside a machine over its GPU links) or over gloo (a flat ring
over TCP whose CPU the processes pay: torch DDP on CPU, what the emulated
cluster runs; `Cluster.backend`).

Buckets as DDP builds them: parameters in reverse order, the first bucket
capped at 1 MiB (torch's `_DEFAULT_FIRST_BUCKET_BYTES`), the others at
`bucket_cap` (25 MiB; the lab's `gradhub-lab train` runs 25 MB divided by the scale). A
bucket is all-reduced once backward has produced all its gradients, one
bucket at a time, in order. Over gloo, a ring over N = hosts x GPUs
processes, ranked host by host, moves 2(N-1)/N of a bucket through each host link each way,
in 2(N-1) steps that each pay a latency; each process also sums (N-1)/N of
it. With racks the ring crosses each rack's core link once each way.
After the last bucket, the local step (on the CPU in the emulated
cluster only); then the next forward."""

from __future__ import annotations

import time

from .cluster import Cluster
from .costs import Costs
from .engine import Engine, Resource
from .nccl import allreduce as nccl_allreduce, fabric
from .profile import SimProfile
from .sim import Result

FIRST_BUCKET = 1 << 20
# torch DDP's bucket_cap_mb=25, in bytes (int(25 * 1024 * 1024)). The emulated
# cluster's runs (`gradhub-lab train`) pass 25e6 / scale themselves.
BUCKET_CAP = 25 * 1024 * 1024


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


def allreduce_time(c: Cluster, nbytes: float, costs: Costs) -> tuple[float, float, float, str]:
    """(network seconds, CPU seconds, latency seconds, algorithm) of one
    all-reduce of nbytes under the cluster's backend: NCCL's choice (its
    time counted as network, GPU kernels take no host CPU) or gloo's ring."""
    if c.backend == "nccl":
        t, algo = nccl_allreduce(fabric(c, costs), nbytes)
        return t, 0.0, 0.0, algo
    net, cpu, lat = ring_time(c, nbytes, costs)
    return net, cpu, lat, "gloo ring"


# Horovod 0.19-0.20 (the papers' all-reduce baseline): every cycle its
# background thread fuses the tensors ready by then into all-reduces of at
# most the fusion threshold (docs/tensor-fusion.rst; defaults 5 ms and 64 MB
# until 0.21, which changed them to 1 ms and 128 MB).
HOROVOD_CYCLE_S = 5e-3
HOROVOD_FUSION_BYTES = 64 * 1024 * 1024


def simulate_ddp(profile: SimProfile, c: Cluster, costs: Costs, bucket_cap: float = BUCKET_CAP,
                 fusion: str = "ddp", cycle_s: float = HOROVOD_CYCLE_S, negotiation: bool = True) -> Result:
    """One iteration of data-parallel training with all-reduce. `fusion`:
    "ddp" (torch DDP's buckets, each all-reduced once all its gradients are
    in) or "horovod" (Horovod's cycles: every `cycle_s`, the tensors
    ready by then, fused up to HOROVOD_FUSION_BYTES per all-reduce, launched
    after the ranks' negotiation, effects.negotiation_s, unless
    `negotiation` is off). Stragglers (`c.jitter`) lengthen every step
    (effects.py)."""
    from .effects import negotiation_s, with_stragglers

    nego = negotiation_s(c.workers, c.latency_s) if negotiation else 0.0
    t0 = time.perf_counter()
    e = Engine()
    nccl = c.backend == "nccl"
    link = Resource("NCCL all-reduce" if nccl else "host link (ring)")
    cpu, compute = Resource("CPU (ring sums and copies)"), Resource("GPU compute")
    algos: dict[str, int] = {}
    L = len(profile.layers)
    N = c.workers
    # The local step on the CPU in the emulated cluster only (sim.py).
    step_s = profile.model_bytes / costs.step_Bps * max(1.0, N / c.shared_cores) if c.shared_cores else 0.0
    queue: list[float] = []          # all-reduces ready to launch, in order (one stream: one at a time)
    state = {"qi": 0, "busy": False, "sent": 0, "bwd_end": None, "end": None, "ops": 0, "negotiating": 0}
    if fusion == "ddp":
        bks = buckets(profile, bucket_cap)
        total = len(bks)
        # The last layer (in backward order) each bucket waits for.
        ready_after: dict[int, list[int]] = {}
        for bi, (_, lo) in enumerate(bks):
            ready_after.setdefault(lo, []).append(bi)
        ready_b: set[int] = set()
        nxt = [0]
    elif fusion == "horovod":
        tensors = [b for li in range(L - 1, -1, -1) for b in profile.layers[li].tensors if b > 0]
        total = len(tensors)
        ready_t: list[float] = []    # tensors ready, not yet fused
    else:
        raise ValueError(f"fusion {fusion!r}: ddp or horovod")

    def start_next():
        if state["busy"] or state["qi"] >= len(queue):
            return
        nbytes = queue[state["qi"]]
        state["qi"] += 1
        state["busy"] = True
        state["ops"] += 1
        net, cpu_s, lat, algo = allreduce_time(c, nbytes, costs)
        algos[algo] = algos.get(algo, 0) + 1
        # Network and CPU of a ring overlap step by step: the slower binds.
        link.busy += net
        cpu.busy += cpu_s
        e.at(e.now + max(net, cpu_s) + lat, finished)

    def finished():
        state["busy"] = False
        if state["sent"] == total and state["qi"] == len(queue):
            state["end"] = e.now
        start_next()

    def launch(batch):
        """The negotiated tensors, fused up to the threshold, queued for the stream."""
        size = 0.0
        for b in batch:
            if size and size + b > HOROVOD_FUSION_BYTES:
                queue.append(size)
                size = 0.0
            size += b
        queue.append(size)
        state["sent"] += len(batch)
        state["negotiating"] -= len(batch) if nego > 0 else 0
        start_next()

    def cycle():
        """Horovod's background thread, every cycle_s: what is ready now is
        negotiated among the ranks (nego seconds), then fused and launched."""
        if ready_t:
            batch = list(ready_t)
            ready_t.clear()
            if nego > 0:
                state["negotiating"] += len(batch)
                e.at(e.now + nego, launch, batch)
            else:
                launch(batch)
        if state["sent"] + state["negotiating"] < total:
            e.at(e.now + cycle_s, cycle)

    def backward(li):
        if li < 0:
            state["bwd_end"] = e.now
            return
        e.use(compute, 0, profile.layers[li].backward_s, grads, li)

    def grads(li):
        if fusion == "ddp":
            ready_b.update(ready_after.get(li, []))
            while nxt[0] in ready_b:       # DDP launches its buckets in order
                queue.append(bks[nxt[0]][0])
                nxt[0] += 1
                state["sent"] += 1
            start_next()
        else:
            ready_t.extend(b for b in profile.layers[li].tensors if b > 0)
        backward(li - 1)

    fwd = profile.forward_s
    compute.busy += fwd
    e.at(fwd, backward, L - 1)
    if fusion == "horovod" and total:
        e.at(fwd + cycle_s, cycle)
    e.run()
    iter_s = max(state["end"] or 0.0, state["bwd_end"] or 0.0) + step_s
    util = {r.name: r.busy / iter_s for r in (link, cpu, compute) if r.busy > 0}
    neck = max(util, key=util.get) if util else "none"
    host_bytes = 2 * (N - 1) / N * profile.model_bytes if c.hosts > 1 else 0.0
    how = ", ".join(f"{n} {a}" for a, n in sorted(algos.items()))
    what = "buckets" if fusion == "ddp" else "Horovod all-reduces"
    r = Result("ddp", N * profile.batch / iter_s, iter_s, neck, util, host_bytes, e.events,
               time.perf_counter() - t0, f"{state['ops']} {what} ({how})")
    return with_stragglers(r, profile.compute_s, c.jitter, N)
