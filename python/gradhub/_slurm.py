"""Slurm: a job step's layout (`srun python train.py` in an allocation) from
Slurm's variables, so gradhub.init() needs nothing else: rank SLURM_PROCID,
size SLURM_STEP_NUM_TASKS, local rank SLURM_LOCALID, the number of tasks on
this node from SLURM_STEP_TASKS_PER_NODE, and the step's first node (from
SLURM_STEP_NODELIST) hosting the scheduler, as rank 0 does under torchrun.
Pure functions of a mapping (`_env` passes the environment); a leaf module,
which `_env` (a task reading its own part) and launch/slurm.py (the step's
whole plan) both use."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

# Port of the scheduler rank 0 hosts, unless GRADHUB_SCHEDULER_PORT says:
# derived from the job and step ids, so concurrent steps on a node differ.
PORT_BASE, PORT_SPAN = 20000, 20000


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    out.append(cur)
    return [s for s in out if s]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, e.g. `gpu[01-03,7],cpu-a` ->
    gpu01 gpu02 gpu03 gpu7 cpu-a (ranges keep their zero padding)."""
    hosts = []
    for item in _split_top(text.strip()):
        m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", item)
        if not m:
            hosts.append(item)
            continue
        prefix, ranges, rest = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not hi:
                numbers = [lo]
            else:
                numbers = [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
            for n in numbers:
                hosts += expand_hostlist(prefix + n + rest) if "[" in rest else [prefix + n + rest]
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]."""
    out = []
    for item in text.split(","):
        m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", item.strip())
        if not m:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={text!r}: cannot read {item!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


@dataclass
class SlurmStep:
    rank: int
    size: int
    local_rank: int
    local_size: int
    nodes: list[str]
    port: int          # the scheduler's default port

    @property
    def scheduler_host(self) -> str:
        # One node: the job stays on loopback (no token needed).
        return "127.0.0.1" if len(self.nodes) == 1 else self.nodes[0]


def step(env: Mapping[str, str]) -> SlurmStep | None:
    """The layout of the srun step this process is a task of; None outside
    one (a batch script itself is not a task of a step)."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None

    def num(name: str) -> int:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            raise ValueError(f"Slurm's {name}={env.get(name)!r} is not a number") from None

    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(num("SLURM_STEP_NUM_TASKS"))))
    here = env.get("SLURMD_NODENAME", "")
    index = nodes.index(here) if here in nodes else int(env.get("SLURM_NODEID", "0"))
    local_size = per_node[index] if index < len(per_node) else per_node[-1]
    job, stp = num("SLURM_JOB_ID"), int(env.get("SLURM_STEP_ID", "0") or 0)
    return SlurmStep(rank=num("SLURM_PROCID"), size=num("SLURM_STEP_NUM_TASKS"), local_rank=num("SLURM_LOCALID"),
                     local_size=local_size, nodes=nodes or ["127.0.0.1"],
                     port=PORT_BASE + (job * 16 + stp) % PORT_SPAN)
