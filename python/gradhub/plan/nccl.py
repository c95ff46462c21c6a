"""NCCL on GPU machines: what an all-reduce (DDP's, ddp.py) and the GPU
stage of gradhub's local reduction (a reduce-scatter and an all-gather
among a machine's GPUs, sim.py) cost on a real cluster.

NCCL predicts, for every operation, the time of each algorithm (ring,
tree) and protocol (LL, LL128, Simple) as a latency plus the bytes over an
algorithm bandwidth, and runs the fastest (its tuning model,
src/graph/tuning.cc). This module is that model, written from its
documented behaviour, with its latencies and bandwidth rules for NCCL
2.6-2.7 (the generation the papers' Horovod used: BytePS ran NCCL 2.5.7),
fed with the machine's bus bandwidths:

- inside a machine, its GPU links' all-reduce bus bandwidth (nccl-tests'
  busbw, `GPU_LINKS`); across machines, each machine's one NIC at its
  transport's efficiency (`TRANSPORTS`);
- ring: one ring over all N = H x W ranks, entering and leaving each
  machine once, so it moves 2(N-1)/N of the data through every NIC at the
  slower of the two bandwidths, and pays a latency per pipeline step:
  2(N-1) steps, 2(H-1) of them across machines;
- tree (H > 1): a chain inside each machine and NCCL's double binary tree
  across machines: latency 2((W-1) intra + log2(H) inter) steps, the
  bandwidth half of its bus bandwidth (each byte goes up and down);
- hierarchy: the intra-machine steps pay the GPU links' latency, only the
  machine-crossing steps the network's.

Every constant is in docs/planning.md ("All-reduce as NCCL runs it") with
its source. Single-NIC machines are assumed (`--rate` is each machine's
link): LL128 only inside one machine (NCCL enables it across machines only
where the NIC shares a PCIe switch with the GPU, which one NIC for eight
GPUs cannot do for all of them; BytePS §4.2.2)."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class GpuLink:
    """A GPU machine's internals as NCCL and gradhub's GPU stage see them."""
    name: str
    bus_Bps: float        # NCCL all-reduce bus bandwidth among the machine's GPUs (nccl-tests busbw)
    kind: str             # "nvlink" or "pci": which latencies of NCCL's tuning model apply
    copy_Bps: float       # one GPU <-> host memory copy over PCIe, bytes/s
    host_links: int       # PCIe switch uplinks to the CPU the GPUs' copies share
    # NCCL's traffic across machines is staged through host memory (no
    # GPUDirect RDMA) over a PCIe uplink the NIC shares: it crosses that link
    # twice each way (GPU to memory, memory to NIC; back the same way), so the
    # network runs at no more than half the link's copy rate.
    nic_staged: bool = False
    source: str = ""


# The bus bandwidths are all-reduce busbw as nccl-tests defines it
# (doc/PERFORMANCE.md: algbw x 2(n-1)/n); docs/planning.md cites each.
GPU_LINKS = {
    # V100 SXM2 (DGX-1 class, the papers' NVLink machines): 1.2 Tbit/s of NVLink per GPU (BytePS §4.2.2)
    # at NCCL's ~80 % protocol efficiency on NVLink (github.com/NVIDIA/nccl-tests/issues/212) = 120 GB/s; four PCIe 3.0
    # switches of two GPUs each (BytePS §4.2.2), 13.1 GB/s per GPU-host copy (BytePS §4.2.1).
    # Its one NIC sits on the PCIe switch of GPUs 0 and 1, and NCCL sends through that switch's uplink
    # (BytePS §4.2.2), staged in host memory: GPUDirect RDMA needs the GPU and the NIC on one switch
    # (BytePS §4.2.2: under 50 Gbit/s otherwise, "confirmed by our own measurements").
    "nvlink": GpuLink("nvlink", 120 * GB, "nvlink", 13.1 * GB, 4, True, "V100 NVLink, one NIC (BytePS's machine)"),
    # A100 SXM4 / HGX A100: 200-208 GB/s measured (github.com/NVIDIA/nccl-tests/issues/149, /178); PCIe 4.0 doubles 3.0's rate.
    # HGX machines put their NICs under the GPUs' PCIe switches: GPUDirect RDMA, no staging.
    "nvlink-a100": GpuLink("nvlink-a100", 205 * GB, "nvlink", 26.2 * GB, 4, False, "A100 NVLink (HGX A100)"),
    # H100 SXM / HGX H100, ring algorithm: 365-370 GB/s (github.com/NVIDIA/nccl/issues/1455, github.com/NVIDIA/nccl-tests/issues/212); PCIe 5.0.
    "nvlink-h100": GpuLink("nvlink-h100", 370 * GB, "nvlink", 52.4 * GB, 4, False, "H100 NVLink (HGX H100)"),
    # PCIe 3.0 only (BytePS §4.2.1's machine: two PCIe switches of four GPUs): a ring crossing the switches
    # runs at the cross-switch GPU-to-GPU copy rate, 80 Gbit/s = 10 GB/s; 13.1 GB/s per GPU-host copy.
    # Its NIC has PCIe lanes of its own (BytePS §4.2.1): staging costs the GPUs' uplinks, not the NIC's.
    "pcie": GpuLink("pcie", 10 * GB, "pci", 13.1 * GB, 2, False, "PCIe 3.0, no NVLink (BytePS's machine)"),
}


def gpu_link(spec: str | GpuLink) -> GpuLink:
    """A named GPU link (`GPU_LINKS`), or a bus bandwidth in GB/s (`150`,
    `150GB/s`: NVLink latencies, the V100 machine's PCIe copies)."""
    if isinstance(spec, GpuLink):
        return spec
    key = spec.strip().lower()
    if key in GPU_LINKS:
        return GPU_LINKS[key]
    num = key.removesuffix("gb/s").removesuffix("gbps").removesuffix("gb")
    try:
        bw = float(num)
    except ValueError:
        raise ValueError(f"--gpu-link {spec!r}: one of {', '.join(GPU_LINKS)}, or a bus bandwidth in GB/s") from None
    if bw <= 0:
        raise ValueError(f"--gpu-link {spec!r}: the bus bandwidth must be positive")
    base = GPU_LINKS["nvlink"]
    return GpuLink(f"{bw:g}GB/s", bw * GB, "nvlink", base.copy_Bps, base.host_links, False, "given")


@dataclass(frozen=True)
class Transport:
    name: str
    efficiency: float     # NCCL's bus bandwidth across machines per bit/s of NIC line rate, x 8
    per_message: bool     # pays the kernel's per-message CPU on every machine-crossing step (sockets)
    source: str = ""


TRANSPORTS = {
    # 12.2 GB/s of all-reduce busbw on a 100 Gbit/s InfiniBand card: "as good as you can get"
    # (NCCL's maintainer, github.com/NVIDIA/nccl-tests/issues/29): 0.976 of the line rate.
    "rdma": Transport("rdma", 12.2 / 12.5, False, "github.com/NVIDIA/nccl-tests/issues/29"),
    # NCCL's socket transport: TCP's payload per Ethernet frame (Costs.wire_efficiency, 1448/1514)
    # and the calibrated CPU per message (Costs.chunk_cpu_s) on each machine-crossing step.
    "tcp": Transport("tcp", 0.0, True, "Costs.wire_efficiency, Costs.chunk_cpu_s"),
}

# NCCL's tuning model, microseconds (src/graph/tuning.cc, NCCL 2.6-2.7): a base
# latency per algorithm and protocol, and a latency per step by the link it
# crosses. Index: (algorithm, protocol).
PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LAT_US = {("tree", "LL"): 4.4, ("tree", "LL128"): 4.4, ("tree", "Simple"): 0.0,
               ("ring", "LL"): 3.6, ("ring", "LL128"): 10.0, ("ring", "Simple"): 8.4}
HW_LAT_US = {
    "nvlink": {("tree", "LL"): 0.52, ("tree", "LL128"): 1.2, ("tree", "Simple"): 28.0,
               ("ring", "LL"): 0.47, ("ring", "LL128"): 1.9, ("ring", "Simple"): 3.4},
    "pci": {("tree", "LL"): 1.0, ("tree", "LL128"): 1.9, ("tree", "Simple"): 28.0,
            ("ring", "LL"): 1.0, ("ring", "LL128"): 2.5, ("ring", "Simple"): 5.7},
    "net": {("tree", "LL"): 5.0, ("tree", "LL128"): 8.5, ("tree", "Simple"): 50.0,
            ("ring", "LL"): 2.7, ("ring", "LL128"): 4.0, ("ring", "Simple"): 9.6},
}
# Bus bandwidth per protocol, as a share of Simple's (LL sends 8 bytes per 16 of
# flag and data, and NCCL counts a quarter for rings, 1/3.8 for trees; LL128 120
# of 128 bytes, 0.92 on rings, 0.915 on trees across machines, 7/9 in one).
RING_PROTO_BW = {"LL": 1 / 4, "LL128": 0.92, "Simple": 1.0}
TREE_PROTO_BW = {"LL": 1 / 3.8, "LL128": 0.915, "Simple": 1.0}
TREE_BW_SHARE = 0.9                    # a tree's bus bandwidth: 0.9 of the ring's ...
TREE_MAX_BUS_Bps = {True: 80 * GB, False: 110 * GB}   # ... at most this (more than 2 machines: True)
# Trees fall short of the model at medium sizes; NCCL scales their bandwidth by
# these factors, per power of two of size / 64 B (64 B to 128 MiB; 1 above).
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}
# The ring's "plateau effect": across machines, a Simple ring all-reduce of at
# least N/16 x 64 KiB pays 1.9 x its latency.
RING_PLATEAU = 1.9
# Intra-machine LL steps of a job across machines: 1.8 x their latency.
LL_MULTINODE = 1.8


@dataclass(frozen=True)
class Fabric:
    """What NCCL runs on: H machines of W GPUs, each machine's NIC."""
    hosts: int
    gpus: int
    link: GpuLink
    nic_Bps: float              # the NIC's payload bandwidth (line rate x transport efficiency), bytes/s
    transport: Transport
    msg_s: float = 0.0          # per machine-crossing step: the socket transport's per-message CPU

    @property
    def ranks(self) -> int:
        return self.hosts * self.gpus


def fabric(c, costs) -> Fabric:
    """The fabric of a planner `Cluster` (its gpu_link, transport, rate and
    link_efficiency) with `costs` for the socket transport."""
    link = gpu_link(c.gpu_link)
    tr = TRANSPORTS[c.transport]
    eff = c.link_efficiency or tr.efficiency or costs.wire_efficiency
    nic = c.rate_bps / 8 * eff
    if link.nic_staged:
        nic = min(nic, link.copy_Bps / 2)
    return Fabric(c.hosts, c.workers_per_host, link, nic, tr, costs.chunk_cpu_s if tr.per_message else 0.0)


def _log2i(x: int) -> int:
    return max(0, int(x).bit_length() - 1)


def bus_bandwidth(f: Fabric) -> float:
    """The ring's bus bandwidth: the GPU links in one machine; across
    machines the slower of the GPU links and the NIC (every channel's ring
    crosses each NIC once each way)."""
    return f.link.bus_Bps if f.hosts == 1 else min(f.link.bus_Bps, f.nic_Bps)


def _enabled(f: Fabric, algo: str, proto: str) -> bool:
    if algo == "tree" and f.hosts == 1:
        return False        # trees span machines; one machine all-reduces on rings
    if proto == "LL128":
        return f.link.kind == "nvlink" and f.hosts == 1
    return True


def latency_s(f: Fabric, algo: str, proto: str, nbytes: float) -> float:
    """NCCL's latency of an all-reduce (seconds): the base, plus each
    pipeline step's latency by the link it crosses."""
    intra = HW_LAT_US[f.link.kind][(algo, proto)]
    if f.hosts > 1 and proto == "LL":
        intra *= LL_MULTINODE
    inter = HW_LAT_US["net"][(algo, proto)] + f.msg_s * 1e6
    lat = BASE_LAT_US[(algo, proto)]
    if f.hosts == 1:
        steps = 2 * (f.ranks - 1)
        return (lat + steps * intra) * 1e-6
    if algo == "ring":
        steps, inter_steps = 2 * (f.ranks - 1), 2 * (f.hosts - 1)
        lat += (steps - inter_steps) * intra + inter_steps * inter
        if proto == "Simple" and nbytes >= f.ranks / 16 * 65536:
            lat *= RING_PLATEAU
    else:
        lat += 2 * ((f.gpus - 1) * intra + _log2i(f.hosts) * inter)
    return lat * 1e-6


def algo_bandwidth(f: Fabric, algo: str, proto: str, nbytes: float) -> float:
    """Bytes of the all-reduce per second once its latency is paid."""
    bus = bus_bandwidth(f)
    if algo == "ring":
        n = f.ranks
        return bus * RING_PROTO_BW[proto] * n / (2 * (n - 1))
    bus = min(bus * TREE_BW_SHARE, TREE_MAX_BUS_Bps[f.hosts > 2]) * TREE_PROTO_BW[proto]
    idx = _log2i(int(nbytes) >> 6)
    if idx < len(TREE_CORRECTION[proto]):
        bus *= TREE_CORRECTION[proto][idx]
    return bus * 0.5


def options(f: Fabric, nbytes: float) -> dict[tuple[str, str], float]:
    """Every enabled (algorithm, protocol) and its predicted seconds."""
    if f.ranks < 2 or nbytes <= 0:
        return {("ring", "Simple"): 0.0}
    return {(a, p): latency_s(f, a, p, nbytes) + nbytes / algo_bandwidth(f, a, p, nbytes)
            for a in ("ring", "tree") for p in PROTOCOLS if _enabled(f, a, p)}


def allreduce(f: Fabric, nbytes: float) -> tuple[float, str]:
    """(seconds, "algorithm/protocol") of one all-reduce of nbytes, as NCCL
    picks it: the fastest of its own predictions."""
    opts = options(f, nbytes)
    (a, p), t = min(opts.items(), key=lambda kv: kv[1])
    return t, f"{a}/{p}"


def intra_collective(link: GpuLink, gpus: int, nbytes: float) -> float:
    """Seconds of a reduce-scatter (or all-gather) of nbytes among one
    machine's GPUs: a ring of W-1 steps moving (W-1)/W of the data at the
    GPU links' bus bandwidth (nccl-tests: busbw = algbw x (n-1)/n), Simple
    protocol."""
    if gpus < 2 or nbytes <= 0:
        return 0.0
    lat = (BASE_LAT_US[("ring", "Simple")] + (gpus - 1) * HW_LAT_US[link.kind][("ring", "Simple")]) * 1e-6
    return lat + (gpus - 1) / gpus * nbytes / link.bus_Bps


def host_copy(link: GpuLink, gpus: int, nbytes: float) -> float:
    """Seconds to copy a machine's nbytes between its GPUs (1/W each) and
    host memory: the GPUs' copies share the PCIe switches' uplinks."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (link.copy_Bps * max(1, min(link.host_links, gpus)))


def describe(f: Fabric) -> str:
    return (f"{f.hosts} x {f.gpus} GPUs, {f.link.name} ({f.link.bus_Bps / GB:g} GB/s bus), NIC "
            f"{f.nic_Bps / GB:.2f} GB/s for NCCL over {f.transport.name}")
