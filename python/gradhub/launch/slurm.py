"""Slurm: an srun step's plan (`srun python train.py` in an allocation).
srun starts the tasks; each task reads its own part from Slurm's variables
(_slurm.py, through _env: rank SLURM_PROCID, size SLURM_STEP_NUM_TASKS, local
rank SLURM_LOCALID, the tasks on its node from SLURM_STEP_TASKS_PER_NODE);
`plan` lists every task of the step the same way, from the variables every
task shares, as srun's default (block) distribution places them: node by
node, ranks contiguous. The step's first node hosts the scheduler (inside
rank 0) and each node's local rank 0 a colocated server, as under torchrun.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Sequence

from .._slurm import PORT_BASE, PORT_SPAN, SlurmStep, expand_hostlist, expand_tasks_per_node, step
from .plan import Plan, ProcessSpec

__all__ = ["PORT_BASE", "PORT_SPAN", "SlurmStep", "expand_hostlist", "expand_tasks_per_node", "plan", "step"]


def plan(env: Mapping[str, str], command: Sequence[str] = ()) -> Plan:
    """The plan of the srun step whose variables (any task's) are in `env`:
    one worker per task running `command`, on its node, each with what
    gradhub.init() there takes from Slurm, under the GRADHUB_* names (a
    GRADHUB_* variable in `env` still wins, as it does in a task: a
    scheduler of the job's own, GRADHUB_SCHEDULER_PORT, GRADHUB_NUM_SERVERS).
    A ValueError outside a step or for variables that do not parse."""
    # The step's layout as any of its tasks sees it (the task's own numbers do not matter here).
    s = step({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", **env}) if "SLURM_STEP_NUM_TASKS" in env else None
    if s is None:
        raise ValueError("not in an srun step: SLURM_STEP_NUM_TASKS is not set")
    per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(s.size)))
    own = env.get("GRADHUB_SCHEDULER")
    embedded = not own
    scheduler = own or f"{s.scheduler_host}:{env.get('GRADHUB_SCHEDULER_PORT') or s.port}"
    # One colocated server per node inside the workers; none of the step's own for a named job (a shared service).
    servers = env.get("GRADHUB_NUM_SERVERS") or (str(len(s.nodes)) if embedded and "GRADHUB_JOB" not in env else "0")
    tasks: list[ProcessSpec] = []
    for i, node in enumerate(s.nodes):
        here = per_node[i] if i < len(per_node) else per_node[-1]
        for local in range(here):
            if len(tasks) == s.size:
                break
            rank = len(tasks)
            tasks.append(ProcessSpec(role="worker", label=f"worker {rank}@{node}", host=node, argv=tuple(command),
                                     env=MappingProxyType({
                                         "GRADHUB_SCHEDULER": scheduler, "GRADHUB_NUM_WORKERS": str(s.size),
                                         "GRADHUB_NUM_SERVERS": servers, "GRADHUB_RANK": str(rank),
                                         "GRADHUB_LOCAL_RANK": str(local), "GRADHUB_LOCAL_SIZE": str(here)}),
                                     rank=rank))
    if len(tasks) != s.size:
        raise ValueError(f"Slurm's SLURM_STEP_TASKS_PER_NODE={env.get('SLURM_STEP_TASKS_PER_NODE')!r} places "
                         f"{len(tasks)} of the step's {s.size} tasks on its nodes {','.join(s.nodes)}")
    used = tuple(dict.fromkeys(t.host for t in tasks if t.host is not None))
    return Plan(scheduler, tuple(tasks), used, command=tuple(command), embedded=embedded)
