"""Machine costs the simulator charges for CPU work (`gradhub bench
calibrate` measures them on this machine: bench/calibrate.py).

Every cost is a rate or a per-unit time: the summation rate of one thread,
the CPU a chunk costs beyond its bytes (worker and server together), the
CPU per byte of TCP, a memory pass (the host stage's copies), a worker's
local step per parameter byte and its CPU per push_pull, and the machine's
core count. The wire efficiency is TCP payload per byte a link carries
(1448 of 1514 bytes per full Ethernet frame with timestamps).

A cluster emulated on one machine (`Cluster.shared_cores`: every host's
threads on the same few cores) has costs a real one does not: the CPU of
the network path between its hosts and a worker's main thread per
push_pull among every host's threads. They are fields here too, 0 unless
measured (the lab measures its emulated cluster's and passes them in)."""

from __future__ import annotations

import json
import os
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
    wire_efficiency: float = 1448 / 1514
    # Shared cores only (`Cluster.shared_cores`): CPU per byte and per
    # message crossing between the emulated hosts, beyond loopback TCP's
    # (veth, bridge, shaper, the other host's stack); a real cluster's NICs
    # do not take it from the hosts' cores that way. 0: not measured.
    path_cpu_per_byte: float = 0.0
    path_cpu_per_msg_s: float = 0.0
    # Shared cores only: a worker's main thread per push_pull there, where
    # every worker's threads and the servers share the cores; 0: op_cpu_s,
    # measured alone.
    emu_op_cpu_s: float = 0.0
    # Cores of the machine calibrated.
    machine_cores: int = 2
    source: str = "built-in (docs/bench/plan/calibration.json)"

    def path_cpu(self, crossing_bytes: float, messages: float) -> float:
        """CPU seconds the network path between hosts sharing the cores
        costs beyond loopback TCP for these bytes and messages (the
        simulators charge it on the shared cores only)."""
        return crossing_bytes * self.path_cpu_per_byte + messages * self.path_cpu_per_msg_s

    def save(self, path: Path) -> None:
        """Write the costs to `path`, keeping what else a file already there
        holds (costs another tool measured: the lab's)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            old = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            old = {}
        old = old if isinstance(old, dict) else {}
        path.write_text(json.dumps({**old, **asdict(self)}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path | None = None):
        """The calibration file (path, else ~/.config/gradhub/costs.json if
        present, else the defaults); keys of other costs are left out."""
        p = Path(path) if path else DEFAULT_FILE
        if not p.exists():
            if path:
                raise FileNotFoundError(f"no calibration file {p} (make one with `gradhub bench calibrate`)")
            return cls()
        d = json.loads(p.read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def describe(c: Costs) -> str:
    shared = [f"{c.path_cpu_per_byte * 1e9:.3f} ns per byte and {c.path_cpu_per_msg_s * 1e6:.1f} us per message "
              "between hosts"] if c.path_cpu_per_byte or c.path_cpu_per_msg_s else []
    shared += [f"{c.emu_op_cpu_s * 1e6:.0f} us main-thread CPU per push_pull"] if c.emu_op_cpu_s else []
    return (f"sum {c.sum_Bps / 1e9:.2f} GB/s per thread, {c.chunk_cpu_s * 1e6:.1f} us CPU per chunk, "
            f"TCP {c.tcp_cpu_per_byte * 1e9:.3f} ns CPU per byte, memory {c.mem_Bps / 1e9:.2f} GB/s, "
            f"local step {c.step_Bps / 1e9:.2f} GB/s of parameters, {c.op_cpu_s * 1e6:.0f} us worker CPU per "
            f"push_pull, wire efficiency {c.wire_efficiency:.3f}, {c.machine_cores} cores"
            + (f"; on shared cores: {', '.join(shared)}" if shared else ""))
