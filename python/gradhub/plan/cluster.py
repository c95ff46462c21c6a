"""The cluster the simulator runs on, and gradhub's options on it.

`Cluster` is the hardware and layout (worker hosts, GPUs per host, CPU-only
servers, links, racks); `Options` is what gradhub's settings choose
(partition, credit, spread, fusion, host stage, forward overlap, scheduling,
two-level racks), with gradhub's defaults (src/settings.rs, src/lib.rs)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

KIB = 1024


@dataclass(frozen=True)
class Cluster:
    hosts: int                          # worker machines
    workers_per_host: int = 1           # GPUs (worker processes) per machine
    cpu_servers: int = 0                # CPU-only server machines, k
    colocated: bool = True              # a server on every worker machine
    rate_bps: float = 1e9               # each host link, each direction
    core_bps: float = 0.0               # each rack's link to the core (0: one host link)
    racks: int = 1
    latency_s: float = 50e-6            # one way, per hop
    server_threads: int = 1
    # The emulated cluster: every host shares this machine's cores (0: each
    # host has its own CPU, as real machines do).
    shared_cores: int = 0
    # A real GPU machine's insides and its NIC's transport, as NCCL sees them
    # (nccl.py): a name of nccl.GPU_LINKS or a bus bandwidth in GB/s; "rdma"
    # or "tcp" (NCCL's socket transport). gradhub itself always runs TCP.
    gpu_link: str = "nvlink"
    transport: str = "rdma"
    # Payload per bit of line rate on every link, as measured on the cluster
    # (0: the transport's own: TCP's wire efficiency, nccl.TRANSPORTS).
    link_efficiency: float = 0.0
    # DDP's all-reduce: "nccl" (GPUs), "gloo" (torch DDP on CPU: a flat ring
    # over TCP, what the emulated cluster runs), "auto": gloo with shared
    # cores (the emulated cluster), else nccl.
    allreduce: str = "auto"
    # What large jobs lose (effects.py): one GPU's per-step compute time's
    # coefficient of variation (stragglers; 0: every GPU alike), and the
    # share of its line rate a server's downlink keeps under incast (1: lossless).
    jitter: float = 0.0
    incast: float = 1.0

    @property
    def backend(self) -> str:
        if self.allreduce != "auto":
            return self.allreduce
        return "gloo" if self.shared_cores else "nccl"

    @property
    def gpu_stage(self) -> bool:
        """Whether a machine's GPUs reduce among themselves over their links
        before gradhub's host stage (the torch local stage on GPUs): real
        GPU machines of several GPUs under the NCCL backend."""
        return self.backend == "nccl" and self.workers_per_host > 1 and not self.shared_cores

    @property
    def workers(self) -> int:
        return self.hosts * self.workers_per_host

    @property
    def num_servers(self) -> int:
        return self.cpu_servers + (self.hosts if self.colocated else 0)

    def describe(self) -> str:
        lay = f"{self.hosts} hosts x {self.workers_per_host} GPUs, k={self.cpu_servers}"
        lay += "" if self.colocated else " (not colocated)"
        if self.racks > 1:
            lay += f", {self.racks} racks (core {(self.core_bps or self.rate_bps) / 1e9:g} Gbit/s)"
        lay += f", {self.rate_bps / 1e9:g} Gbit/s"
        if self.backend == "nccl":
            lay += f" ({self.transport}, GPU links {self.gpu_link})"
        return lay


@dataclass(frozen=True)
class Options:
    partition_bytes: int = 256 * KIB    # DEFAULT_PARTITION_BYTES
    credit_bytes: int | None = None     # per server-thread connection; None: the larger of 512 KiB and 4 chunks
    spread_bytes: int | None = None     # None: 2 MiB where a worker's shares are uneven, else none
    fusion_threshold: int = 256 * KIB   # GRADHUB_FUSION_THRESHOLD
    host_reduce: bool = True            # GRADHUB_HOST_REDUCE
    overlap_forward: bool = False       # GRADHUB_OVERLAP_FORWARD
    eager_update: bool = True           # GRADHUB_EAGER_UPDATE (synchronous schedule only)
    scheduling: str = "auto"            # GRADHUB_SCHEDULING (auto: priority with forward overlap, else size)
    rack_reduce: str = "auto"           # GRADHUB_RACK_REDUCE

    @property
    def credit(self) -> int:
        """The credit the workers use (`default_credit_bytes` in src/lib.rs)."""
        return max(512 * KIB, 4 * self.partition_bytes) if self.credit_bytes is None else self.credit_bytes

    def spread(self, uneven: bool) -> float:
        """The spread window (`client::io::admission`): by default 4 least
        credits (2 MiB), only where a worker's placed shares are uneven."""
        if self.spread_bytes is not None:
            return self.spread_bytes or float("inf")
        return 4 * 512 * KIB if uneven else float("inf")

    def scaled(self, scale: float) -> "Options":
        """What the lab's emulated runs at `--scale S` use: partition and fusion
        divided like every byte count (credit and spread are not)."""
        return replace(self, partition_bytes=max(4096, int(self.partition_bytes / scale)),
                       fusion_threshold=max(1024, int(self.fusion_threshold / scale)))

    def env(self) -> dict[str, str]:
        """The settings that differ from gradhub's defaults, as GRADHUB_* variables."""
        d = Options()
        out = {}
        for f, var, fmt in (("partition_bytes", "GRADHUB_PARTITION_BYTES", str),
                            ("credit_bytes", "GRADHUB_CREDIT_BYTES", str),
                            ("spread_bytes", "GRADHUB_SPREAD_BYTES", str),
                            ("fusion_threshold", "GRADHUB_FUSION_THRESHOLD", str),
                            ("host_reduce", "GRADHUB_HOST_REDUCE", lambda v: "1" if v else "0"),
                            ("overlap_forward", "GRADHUB_OVERLAP_FORWARD", lambda v: "1" if v else "0"),
                            ("eager_update", "GRADHUB_EAGER_UPDATE", lambda v: "1" if v else "0"),
                            ("scheduling", "GRADHUB_SCHEDULING", str),
                            ("rack_reduce", "GRADHUB_RACK_REDUCE", str)):
            v = getattr(self, f)
            if v != getattr(d, f):
                out[var] = fmt(v)
        return out


def parse_rate(rate: str) -> int:
    """'1gbit', '500mbit', '10Gbit', '100kbit' -> bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"invalid rate {rate!r} (examples: 1gbit, 500mbit)")
    mult = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return int(float(m.group(1)) * mult)


def rate(text: str) -> float:
    """bits/s from tc syntax (`1gbit`, `500mbit`, `25gbit`)."""
    return float(parse_rate(text))


@dataclass
class Prices:
    """Optional machine prices (per hour), for cost per sample."""
    gpu_host: float = 0.0
    cpu_host: float = 0.0

    def per_hour(self, c: Cluster) -> float:
        return self.gpu_host * c.hosts + self.cpu_host * c.cpu_servers
