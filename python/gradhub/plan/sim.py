"""`gradhub simulate`'s model of gradhub: a chunk-level discrete-event
simulation of training iterations (engine.py).

What is modelled, per worker: forward and backward layer by layer; each
gradient handed over as backward produces it (wait-free backprop), small
ones packed into fusion buckets (torch/fusion.py's rule); each tensor cut
into chunks of the partition size, placed on server threads by BytePS's
weighted greedy split (placement/mod.rs); chunks leave in priority order
(GRADHUB_SCHEDULING: by default as they are ready, the next forward's
first layers first with forward overlap, the largest first with `size`)
while the bytes pushed but not yet received by their servers stay under the
credit and the spread, a chunk ahead of every one in flight going anyway
(preemption); then the host's uplink, the rack's core link, the owner's
downlink, the owner thread's sum, its result back the same way, and the
worker's local step (per message as its result comes in, once backward is
done: the eager update; all at once with GRADHUB_EAGER_UPDATE=0; per layer
before its next forward with forward overlap).

Symmetry: every worker host does the same thing at the same time (same
profile, same placement share), so one representative worker host, one
colocated server and one CPU-only server stand for all of them. A chunk
charges each resource what it costs that resource on average over the
hosts: a chunk owned by colocated servers puts (H-1)/H of its pushes and of
its results on each host link, one owned by CPU-only servers all of its
push on each host link and H/k of them on each CPU-only server's link.
Summed over a model this is exactly the BytePS split's per-link bytes; what
is averaged is which host owns a given chunk. On the emulated cluster
(`shared_cores`), every host's CPU work runs on the same few cores: one CPU
resource takes the whole cluster's work for each chunk, and a worker's
main thread, which runs the push_pulls' Python and sends what the windows
admit at once, takes its share there before backward goes on.

On a real GPU cluster (`Cluster.gpu_stage`: the NCCL backend, several GPUs
a machine) a push_pull starts with the torch local stage: NCCL's
reduce-scatter among the machine's GPUs over their links, each GPU's share
copied to host memory over PCIe (nccl.py's GPU links), then the host stage
and the servers as above; its result is copied back and all-gathered before
the gradient is ready. The machine's link runs at the NIC's payload rate,
no faster than the PCIe uplink it may share with two GPUs' copies."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from . import nccl
from .cluster import Cluster, Options
from .costs import Costs
from .engine import Engine, Resource
from .profile import SimProfile
from .theory import byteps_optimum_time, host_link_bytes, tbf_burst


@dataclass
class Result:
    system: str
    samples_per_s: float
    iter_s: float
    bottleneck: str
    utilization: dict[str, float] = field(default_factory=dict)
    host_bytes: float = 0.0          # per worker host link, per iteration and direction
    events: int = 0
    wall_s: float = 0.0
    detail: str = ""
    machine_cpu_s: float = 0.0       # with shared cores: the machine's core-seconds per iteration the model charges
    main_sync_cpu_s: float = 0.0     # a worker's main thread per iteration, for its push_pulls and own sends


@dataclass
class Message:
    """One push_pull per step: a tensor, or a fusion bucket of small ones."""
    prio: int                        # lower = sooner (forward index of its first layer)
    nbytes: int
    layers: list[int]                # layers whose gradients it carries
    members: int                     # tensors it waits for
    largest: int = 0                 # its largest tensor's bytes (GRADHUB_SCHEDULING=size ranks by it)
    chunks: list[tuple[int, str]] = field(default_factory=list)   # (bytes, owner kind "gpu"/"cpu")


MAIN_KEY = (-1,)   # the workers' main thread on the shared pool: before every chunk key (prio >= 0)


def messages(profile: SimProfile, opt: Options) -> tuple[list[Message], dict[tuple[int, int], int]]:
    """The step's push_pulls and which message each (layer, tensor) is in.
    Fusion: tensors of at most threshold/4 bytes, in backward order, packed
    into buckets of at most `threshold` bytes (a bucket of one is not fused)."""
    msgs: list[Message] = []
    of: dict[tuple[int, int], int] = {}
    thr = opt.fusion_threshold
    bucket: list[tuple[int, int, int]] = []

    def close():
        if len(bucket) == 1:
            li, ti, b = bucket[0]
            of[(li, ti)] = len(msgs)
            msgs.append(Message(li, b, [li], 1, b))
        elif bucket:
            for li, ti, _ in bucket:
                of[(li, ti)] = len(msgs)
            layers = sorted({li for li, _, _ in bucket})
            msgs.append(Message(min(layers), sum(b for _, _, b in bucket), layers, len(bucket),
                                max(b for _, _, b in bucket)))
        bucket.clear()

    size = 0
    for li in range(len(profile.layers) - 1, -1, -1):
        for ti, b in enumerate(profile.layers[li].tensors):
            if thr > 0 and 0 < b <= thr // 4:
                if size + b > thr:
                    close()
                    size = 0
                bucket.append((li, ti, b))
                size += b
            elif b > 0:
                of[(li, ti)] = len(msgs)
                msgs.append(Message(li, b, [li], 1, b))
    close()
    sched = opt.scheduling
    if sched == "auto":  # as the workers' _gh_reprioritize
        sched = "priority" if opt.overlap_forward else "fifo"
    if sched == "fifo":
        for m in msgs:
            m.prio = 0
    elif sched == "size":  # the largest first, ties in forward order
        order = sorted(range(len(msgs)), key=lambda i: (-msgs[i].largest, msgs[i].prio))
        for rank, i in enumerate(order):
            msgs[i].prio = rank
    return msgs, of


def uneven_shares(c: Cluster, opt: Options) -> bool:
    """Whether a worker's bytes differ across its server connections (the
    largest over 1.25 x the smallest, `admission::uneven`): with both
    colocated and CPU-only servers, whose weights (BytePS's split) differ."""
    pushers = c.hosts if opt.host_reduce or c.workers_per_host == 1 else c.workers
    w_gpu, w_cpu = max(pushers - c.cpu_servers, 0), 2 * (pushers - 1)
    if not (c.colocated and c.cpu_servers > 0 and w_gpu > 0 and w_cpu > 0):
        return False
    return max(w_gpu, w_cpu) > 1.25 * min(w_gpu, w_cpu)


def place(msgs: list[Message], c: Cluster, opt: Options) -> None:
    """Cut every message into chunks and give each the kind of its owner, by
    the scheduler's greedy least-weighted-load rule (weights n-k and 2(n-1))."""
    pushers = c.hosts if opt.host_reduce or c.workers_per_host == 1 else c.workers
    k = c.cpu_servers
    slots = []   # (weighted load, slot, weight, kind)
    w_gpu, w_cpu = max(pushers - k, 0), 2 * (pushers - 1)
    if c.colocated and w_gpu == 0 and k == 0:
        w_gpu = 1
    i = 0
    # Slots in a fixed order (CPU-only first): the order only breaks ties.
    for kind, count, w in (("cpu", k, w_cpu), ("gpu", c.hosts if c.colocated else 0, w_gpu)):
        for _ in range(count):
            for _t in range(c.server_threads):
                if w > 0:
                    slots.append([0.0, i, w / c.server_threads, kind])
                i += 1
    if not slots:   # e.g. one pushing machine and CPU-only servers: spread evenly
        slots = [[0.0, j, 1.0, "cpu"] for j in range(max(1, k * c.server_threads))]
    heap = [(0.0, s[1], s) for s in slots]
    heapq.heapify(heap)
    part = max(1, opt.partition_bytes)
    for m in msgs:
        m.chunks = []
        left = m.nbytes
        while left > 0:
            b = min(part, left)
            left -= b
            _, slot, s = heapq.heappop(heap)
            s[0] += b
            heapq.heappush(heap, (s[0] / s[2], slot, s))
            m.chunks.append((b, s[3]))


def two_level(c: Cluster, opt: Options) -> bool:
    """GRADHUB_RACK_REDUCE: PHub's model as scheduler/racks.rs applies it."""
    if c.racks <= 1 or opt.rack_reduce == "off":
        return False
    if opt.rack_reduce == "on":
        return True
    r = c.racks
    n = c.hosts / r
    core = c.core_bps or c.rate_bps
    servers = (c.hosts if c.colocated else 0) + c.cpu_servers
    b_rack = max(1.0, servers / r) * c.rate_bps
    one = 2 * n * (r - 1) / (r * core)
    two = max(n / b_rack, 1 / c.rate_bps, 2 * (r - 1) / (r * min(b_rack, core)))
    return one > two


class GradhubSim:
    def __init__(self, profile: SimProfile, c: Cluster, opt: Options, costs: Costs):
        self.p, self.c, self.o, self.k = profile, c, opt, costs
        self.msgs, self.of = messages(profile, opt)
        place(self.msgs, c, opt)
        H, W, k = c.hosts, c.workers_per_host, c.cpu_servers
        self.P = 1 if opt.host_reduce or W == 1 else W          # pushing processes per host
        self.n_push = H * self.P
        eff = c.link_efficiency or costs.wire_efficiency
        B = c.rate_bps * eff / 8                                 # payload bytes/s per link
        core = (c.core_bps or c.rate_bps) * eff / 8
        # The GPU stage (real GPU machines): NCCL among the machine's GPUs and
        # their copies to and from host memory; with the host stage on, the
        # torch local stage (a reduce-scatter, 1/W of each tensor copied per
        # GPU), else every GPU copies its whole gradient.
        self.gpu = c.gpu_stage
        self.link = nccl.gpu_link(c.gpu_link) if self.gpu else None
        B_host = B
        if self.gpu and self.link.nic_staged:
            # The NIC's PCIe switch uplink also carries the copies of the GPUs
            # under that switch (1/host_links of the machine's): per direction
            # the NIC's bytes plus those.
            M = max(1, profile.model_bytes)
            nic = host_link_bytes(H, k, M, W, opt.host_reduce, c.colocated)
            copies = M * (1 if opt.host_reduce else W) / self.link.host_links
            if nic > 0:
                B_host = min(B, self.link.copy_Bps * nic / (nic + copies))
        self.two = two_level(c, opt)
        e = self.e = Engine()
        self.cores = c.shared_cores
        self.up, self.down = Resource("worker host uplink"), Resource("worker host downlink")
        self.s_up, self.s_down = Resource("CPU-only server uplink"), Resource("CPU-only server downlink")
        self.core_up, self.core_down = Resource("rack core uplink"), Resource("rack core downlink")
        self.g_cpu = Resource("colocated server threads", c.server_threads)
        self.s_cpu = Resource("CPU-only server threads", c.server_threads)
        # Every worker has its I/O thread; with the host stage each pushes 1/W of the chunks.
        self.w_cpu = Resource("worker I/O threads", W)
        self.cpu = Resource("machine CPU (emulated hosts share it)")
        self.compute = Resource("GPU compute")
        self.rs, self.ag = Resource("GPU links (reduce-scatter)"), Resource("GPU links (all-gather)")
        self.d2h, self.h2d = Resource("PCIe to host"), Resource("PCIe from host")
        self.B, self.B_host, self.core_B = B, B_host, core
        # Per-chunk costs by owner kind, precomputed per distinct chunk size.
        self._cost_cache: dict[tuple[int, str], tuple] = {}
        # The representative worker's windows (every pusher of the host has its own).
        n_conns = ((H if c.colocated else 0) + k) * c.server_threads
        self.window = W * min(opt.credit * max(1, n_conns), opt.spread(uneven_shares(c, opt)))

    # -- per-chunk costs -------------------------------------------------
    def costs(self, b: int, kind: str) -> tuple:
        key = (b, kind)
        got = self._cost_cache.get(key)
        if got is not None:
            return got
        c, k, P, H = self.c, self.k, self.P, self.c.hosts
        R = c.racks
        if kind == "gpu":
            push_up = res_up = P * b * (H - 1) / H
            own_down, own_up = push_up, res_up
            summed = self.n_push * b / H
            loop = P * b / H            # pushes to the host's own server (loopback)
        else:
            push_up = P * b
            own_down = own_up = self.n_push * b / c.cpu_servers
            res_up = 0.0
            summed = own_down
            loop = 0.0
        if R > 1:
            n_r = H / R
            core_b = (R - 1) / R * b * (1 if self.two else n_r * P)
        else:
            core_b = 0.0
        # CPU: per chunk (worker + server) and per TCP byte (both ends).
        if self.cores:
            hosts_owning = H if kind == "gpu" else c.cpu_servers
            crossing = H * push_up + hosts_owning * own_up   # between emulated hosts (the rest is loopback)
            wire = crossing + H * loop * 2
            path = k.path_cpu(crossing, crossing / b)
            send = (self.n_push * k.chunk_cpu_s / 2 + k.tcp_cpu_per_byte * wire / 2 + path / 2) / self.cores
            srv = (self.n_push * k.chunk_cpu_s / 2 + hosts_owning * summed / k.sum_Bps
                   + k.tcp_cpu_per_byte * wire / 2 + path / 2) / self.cores
            send_path = path / 2 / self.cores
            if c.workers_per_host > 1 and self.o.host_reduce:
                send += 2 * c.workers * b / k.mem_Bps / self.cores   # contribute and copy out
            recv = 0.0
        else:
            send = P * k.chunk_cpu_s / 4 + k.tcp_cpu_per_byte * (push_up + loop) / 2
            recv = P * k.chunk_cpu_s / 4 + k.tcp_cpu_per_byte * (res_up + loop) / 2
            srv = (self.n_push / (H if kind == "gpu" else c.cpu_servers)) * k.chunk_cpu_s / 2 \
                + summed / k.sum_Bps + k.tcp_cpu_per_byte * (own_down + own_up) / 2
            send_path = 0.0
            if self.gpu and self.o.host_reduce:
                # The host stage on GPU machines: each chunk's live share (one
                # GPU's, the others push zeros as headers) contributed to shared
                # memory, and copied out for that GPU: a memory pass each way.
                send += b / k.mem_Bps
                recv += b / k.mem_Bps
        own_B = self.B_host if kind == "gpu" else self.B   # the owner's link: a worker machine's or a CPU-only one's
        # Incast: every pusher's chunks converge on the owner's downlink (effects.py).
        own_in = own_B * (c.incast if self.n_push > 1 else 1.0)
        got = (push_up / self.B_host, own_down / own_in, res_up / self.B_host, own_up / own_B, core_b / self.core_B,
               send, srv, recv, send_path)
        self._cost_cache[key] = got
        return got

    # -- the chunk pipeline ----------------------------------------------
    def run(self, iterations: int | None = None) -> Result:
        """Simulate a few iterations (2; 4 with forward overlap, whose
        iterations overlap) and time the steady one(s)."""
        t0 = time.perf_counter()
        o, p, e = self.o, self.p, self.e
        iters = iterations or (4 if o.overlap_forward else 2)
        L = len(p.layers)
        lat = self.c.latency_s
        N = self.c.workers
        # The local optimizer step: on the CPU in the emulated cluster (all
        # workers at once on the shared cores); on GPUs, part of the compute.
        # `spread`: on the shared cores every worker does the same CPU work at
        # the same time, so the pool's one job is all N workers' (N / cores
        # seconds per CPU second, at least 1).
        spread = max(1.0, N / self.cores) if self.cores else 1.0
        step_s = p.model_bytes / self.k.step_Bps * spread if self.cores else 0.0
        layer_msgs: list[list[int]] = [[] for _ in range(L)]
        for mi, m in enumerate(self.msgs):
            for li in m.layers:
                layer_msgs[li].append(mi)
        starts: dict[int, float] = {}
        pend: list = []                  # the worker's queue: (key, (iteration, message, chunk))
        inflight: dict = {}              # key -> bytes pushed, not yet received whole
        inflight_keys: list = []
        its = [{"msg_left": [len(m.chunks) for m in self.msgs], "members": [m.members for m in self.msgs],
                "layer_left": [len(x) for x in layer_msgs], "left": len(self.msgs), "waiting": None,
                "bwd_done": False, "comm_done": not self.msgs, "inflight": 0,
                # The eager update: bytes whose results came in during backward (updated at step()),
                # and updates not finished yet.
                "early_bytes": 0, "updating": 0} for _ in range(iters)]
        win = {"bytes": 0}
        caller: dict = {"sends": None, "tokens": 0}   # what the main thread sends now (shared cores only)
        updated = [[not layer_msgs[li] for li in range(L)] for _ in range(iters)]
        wcpu = self.cpu if self.cores else self.w_cpu
        # Per push_pull, every worker's CPU (all of them on the shared cores):
        # on the emulated cluster, its main thread's as measured there.
        op_s = (self.k.emu_op_cpu_s if self.cores and self.k.emu_op_cpu_s > 0 else self.k.op_cpu_s) * spread
        # The main thread's CPU for gradhub (push_pulls and its own sends),
        # pool-seconds over every iteration: Result.main_sync_cpu_s.
        main_sync = [0.0]

        def main_cpu(s, fn, *args):
            """The workers' main (autograd) thread's CPU: on the shared pool
            with the emulated cluster, ahead of the chunks' work waiting
            there (Linux runs a thread woken from sleep soon: its virtual
            runtime is behind), so it waits only for the job in service
            while the pool is busy; else a plain delay."""
            if self.cores:
                e.use(self.cpu, MAIN_KEY, s, fn, *args)
            else:
                e.at(e.now + s, fn, *args)

        def pump():
            while pend:
                key, (i, mi, ci) = pend[0]
                while inflight_keys and inflight_keys[0] not in inflight:
                    heapq.heappop(inflight_keys)
                first = not inflight_keys or key < inflight_keys[0]   # preemption
                b = self.msgs[mi].chunks[ci][0]
                if not first and win["bytes"] + b > self.window:
                    return
                heapq.heappop(pend)
                inflight[key] = b
                heapq.heappush(inflight_keys, key)
                win["bytes"] += b
                send_chunk(key, i, mi, ci)

        def send_chunk(key, i, mi, ci):
            b, kind = self.msgs[mi].chunks[ci]
            pu, od, ru, ou, cb, send, srv, recv, send_path = self.costs(b, kind)

            def via_core(then):
                """Across the racks' core links (one level or two), then on."""
                if cb:
                    e.use(self.core_up, 0, cb, lambda: e.use(self.core_down, 0, cb, then))
                else:
                    then()

            def arrive():
                e.use(self.down if kind == "gpu" else self.s_down, 0, od, received)

            def received():
                win["bytes"] -= inflight.pop(key)
                pump()
                res = self.cpu if self.cores else (self.g_cpu if kind == "gpu" else self.s_cpu)
                e.use(res, key, srv, result)

            def result():
                e.use(self.up if kind == "gpu" else self.s_up, 0, ou, lambda: e.at(e.now + lat, via_core, back2))

            def back2():
                e.use(self.down, 0, ru if kind == "gpu" else pu,
                      lambda: e.use(wcpu, key, recv, chunk_done, i, mi))

            def leave():
                e.use(self.up, 0, pu, lambda: e.at(e.now + lat, via_core, arrive))

            if caller["sends"] is not None:   # sent from the caller's thread, which waits for it
                if caller["tokens"] >= b:     # the link's token bucket lets it through at once
                    caller["tokens"] -= b
                    caller["sends"].append((send, leave))
                else:                         # queued at the shaper: the path's CPU comes later, elsewhere
                    caller["sends"].append((send - send_path, lambda: e.use(wcpu, key, send_path, leave)))
            else:
                e.use(wcpu, key, send, leave)

        eager = o.eager_update and not o.overlap_forward

        def update_some(i, nbytes):
            """The eager update of `nbytes` of parameters on the main thread."""
            st = its[i]
            st["updating"] += 1

            def updated():
                st["updating"] -= 1
                step_end(i)
            main_cpu(step_s * nbytes / max(1, p.model_bytes), updated)

        gpu_t: dict[int, tuple[float, float]] = {}

        def gpu_times(mi):
            """(reduce-scatter, copy) seconds of a message's GPU stage, each way."""
            got = gpu_t.get(mi)
            if got is None:
                n, W = self.msgs[mi].nbytes, self.c.workers_per_host
                if o.host_reduce:
                    got = (nccl.intra_collective(self.link, W, n), nccl.host_copy(self.link, W, n))
                else:   # every GPU copies its whole gradient
                    got = (0.0, nccl.host_copy(self.link, W, W * n))
                gpu_t[mi] = got
            return got

        def stage_in(i, mi):
            """On GPU machines: the machine's GPUs reduce-scatter the gradient
            and copy their shares to host memory; then the push_pull's chunks queue."""
            if not self.gpu:
                enqueue(i, mi)
                return
            key = (self.msgs[mi].prio, i, mi, -1)
            rs, cp = gpu_times(mi)
            e.use(self.rs, key, rs, lambda: e.use(self.d2h, key, cp, enqueue, i, mi))

        def chunk_done(i, mi):
            st = its[i]
            st["msg_left"][mi] -= 1
            if st["msg_left"][mi]:
                return
            if self.gpu:   # the result's shares copied back and all-gathered among the GPUs
                key = (self.msgs[mi].prio, i, mi, -1)
                ag, cp = gpu_times(mi)
                e.use(self.h2d, key, cp, lambda: e.use(self.ag, key, ag, msg_done, i, mi))
            else:
                msg_done(i, mi)

        def msg_done(i, mi):
            st = its[i]
            st["left"] -= 1
            if eager:  # step() updates it now, or (still in backward) all such at once when step() starts
                if st["bwd_done"]:
                    update_some(i, self.msgs[mi].nbytes)
                else:
                    st["early_bytes"] += self.msgs[mi].nbytes
            for li in self.msgs[mi].layers:
                st["layer_left"][li] -= 1
                if o.overlap_forward and st["layer_left"][li] == 0:
                    share = sum(p.layers[li].tensors) / max(1, p.model_bytes)
                    main_cpu(step_s * share, layer_updated, i, li)
            if st["left"] == 0:
                st["comm_done"] = True
                step_end(i)

        def step_end(i):
            """Synchronous step: the next forward once every result is in and the local step ran
            (with the eager update, once every message's update ran)."""
            st = its[i]
            if o.overlap_forward or not (st["comm_done"] and st["bwd_done"]) or i + 1 >= iters:
                return
            if not eager:
                main_cpu(step_s, forward, i + 1, 0)
            elif st["updating"] == 0 and not st.get("next"):
                st["next"] = True
                forward(i + 1, 0)

        def layer_updated(i, li):
            updated[i][li] = True
            if i + 1 < iters and its[i + 1]["waiting"] == li:
                its[i + 1]["waiting"] = None
                forward(i + 1, li)

        def forward(i, li):
            starts.setdefault(i, e.now)
            if o.overlap_forward and i > 0 and li < L and not updated[i - 1][li]:
                its[i]["waiting"] = li
                return
            if li == L:
                backward(i, L - 1)
                return
            lay = p.layers[li]
            if self.cores:
                e.use(self.compute, 0, lay.forward_s - lay.forward_cpu_s,
                      lambda: main_cpu(lay.forward_cpu_s * spread, forward, i, li + 1))
            else:
                e.use(self.compute, 0, lay.forward_s, forward, i, li + 1)

        def backward(i, li):
            if li < 0:
                its[i]["bwd_done"] = True
                if eager and its[i]["early_bytes"]:
                    update_some(i, its[i]["early_bytes"])
                if o.overlap_forward and i + 1 < iters:
                    forward(i + 1, 0)
                step_end(i)
                return
            lay = p.layers[li]
            e.use(self.compute, 0, lay.backward_s - (lay.backward_cpu_s if self.cores else 0.0), grads, i, li)

        def grads(i, li):
            st = its[i]
            ready = []
            for ti in range(len(p.layers[li].tensors)):
                mi = self.of.get((li, ti))
                if mi is None:      # an empty tensor: nothing to send
                    continue
                st["members"][mi] -= 1
                if st["members"][mi] == 0:
                    ready.append(mi)
            if not self.cores:
                for mi in ready:
                    e.use(wcpu, (self.msgs[mi].prio, i, mi, -1), op_s, stage_in, i, mi)
                backward(i, li - 1)
                return

            def issued():
                # push_pull sends what the windows admit at once, on the
                # caller's thread (client/io/submit.rs), and backward goes on
                # after it. As far as the uplink's token bucket lets them
                # through (full when the link is idle), that thread also
                # carries them along the emulated path; the rest waits in the
                # shaper, and the kernel sends it later from a timer.
                caller["sends"] = []
                idle = self.up.free > 0 and not self.up.queue
                caller["tokens"] = tbf_burst(self.c.rate_bps) if idle else 0
                for mi in ready:
                    enqueue(i, mi)
                sends, caller["sends"] = caller["sends"], None
                if not sends:
                    backward(i, li - 1)
                    return
                left = [len(sends)]

                def sent(leave):
                    leave()
                    left[0] -= 1
                    if left[0] == 0:
                        backward(i, li - 1)
                for cpu, leave in sends:
                    main_sync[0] += cpu
                    main_cpu(cpu, sent, leave)
            cpu_s = p.layers[li].backward_cpu_s * spread + len(ready) * op_s
            main_sync[0] += len(ready) * op_s
            main_cpu(cpu_s, issued)

        def enqueue(i, mi):
            """The push_pull starts (its Python and bookkeeping paid): its chunks join the queue."""
            for ci in range(len(self.msgs[mi].chunks)):
                heapq.heappush(pend, ((self.msgs[mi].prio, i, mi, ci), (i, mi, ci)))
            pump()

        forward(0, 0)
        e.run()
        if len(starts) < iters or not all(st["comm_done"] and st["bwd_done"] for st in its):
            raise RuntimeError("simulation stalled before every iteration finished (a model bug)")
        if o.overlap_forward:
            iter_s = (starts[iters - 1] - starts[1]) / (iters - 2)
        else:
            iter_s = starts[1] - starts[0]
        span = e.now
        res = [self.up, self.down, self.s_up, self.s_down, self.core_up, self.core_down, self.g_cpu, self.s_cpu,
               self.w_cpu, self.cpu, self.compute, self.rs, self.ag, self.d2h, self.h2d]
        util = {r.name: r.busy / r.units / span for r in res if r.busy > 0}
        neck = max(util, key=util.get) if util else "none"
        host_bytes = sum(self.costs(b, kind)[0] + (self.costs(b, kind)[2] if kind == "gpu" else 0)
                         for m in self.msgs for b, kind in m.chunks) * self.B_host
        return Result("gradhub", N * p.batch / iter_s, iter_s, neck, util, host_bytes, e.events,
                      time.perf_counter() - t0, "two-level racks" if self.two else "",
                      self.cpu.busy * self.cores / iters, main_sync[0] / spread / iters)


def simulate_gradhub(profile: SimProfile, c: Cluster, opt: Options, costs: Costs) -> Result:
    from .effects import with_stragglers

    return with_stragglers(GradhubSim(profile, c, opt, costs).run(), profile.compute_s, c.jitter, c.workers)


def byteps_optimum(profile: SimProfile, c: Cluster) -> float:
    """Samples/s if the BytePS optimum's communication time (no CPU, full
    rates, the host stage) overlapped perfectly with compute."""
    t = byteps_optimum_time(c.hosts, c.cpu_servers, profile.model_bytes, c.rate_bps) if c.colocated else 0.0
    return c.workers * profile.batch / max(profile.compute_s, t, 1e-12)
