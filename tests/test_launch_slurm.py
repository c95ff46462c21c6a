"""Slurm: a task of an srun step gets its rank, size, local rank, local size
and the scheduler's node from Slurm's variables (launch/slurm.py, _env); a
job of 4 tasks started with the variables srun sets, on one node, sums
exactly with the scheduler and server embedded as under torchrun."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from conftest import WORKERS, job_env
from gradhub import _env
from gradhub.launch.slurm import PORT_BASE, PORT_SPAN, expand_hostlist, expand_tasks_per_node, step


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,7],cpu-a", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu-a"]),
    ("r[1-2]-n[08-09]", ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]),
    ("a,b[9-10]", ["a", "b9", "b10"]),
])
def test_hostlists(text, hosts):
    assert expand_hostlist(text) == hosts


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        expand_tasks_per_node("two")


def slurm_vars(procid: int, localid: int, node: str, nodelist: str = "gpu[1-2]", per_node: str = "3,1",
               tasks: int = 4) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
            "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NODELIST": nodelist,
            "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURMD_NODENAME": node, "SLURM_NTASKS": "8"}


def test_step_layout():
    s = step(slurm_vars(3, 0, "gpu2"))
    assert (s.rank, s.size, s.local_rank, s.local_size, s.nodes) == (3, 4, 0, 1, ["gpu1", "gpu2"])
    assert s.scheduler_host == "gpu1" and PORT_BASE <= s.port < PORT_BASE + PORT_SPAN
    assert step(slurm_vars(1, 1, "gpu1")).local_size == 3
    # One node: loopback. Outside a step (the batch script itself): nothing.
    assert step(slurm_vars(0, 0, "gpu1", "gpu1", "4")).scheduler_host == "127.0.0.1"
    assert step({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None


def test_worker_env_under_srun(monkeypatch):
    for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GRADHUB_SCHEDULER",
              "GRADHUB_RANK", "GRADHUB_NUM_WORKERS", "GRADHUB_NUM_SERVERS", "GRADHUB_LOCAL_RANK", "GRADHUB_LOCAL_SIZE",
              "GRADHUB_SCHEDULER_PORT", "GRADHUB_JOB"):
        monkeypatch.delenv(k, raising=False)
    for k, v in slurm_vars(2, 2, "gpu1").items():
        monkeypatch.setenv(k, v)
    e = _env.worker_env()
    port = step(slurm_vars(2, 2, "gpu1")).port
    assert (e.rank, e.num_workers, e.local_rank, e.local_size) == (2, 4, 2, 3)
    assert e.embedded and e.scheduler == f"gpu1:{port}" and e.num_servers == 2  # one per node
    # GRADHUB_* wins: a scheduler of its own (the sbatch example's CPU-only servers).
    monkeypatch.setenv("GRADHUB_SCHEDULER", "cpu1:9000")
    monkeypatch.setenv("GRADHUB_NUM_SERVERS", "3")
    e = _env.worker_env()
    assert not e.embedded and e.scheduler == "cpu1:9000" and e.num_servers == 3 and e.rank == 2


def test_a_job_started_as_srun_starts_it_sums_exactly():
    # srun's variables for 4 tasks on this one node, set by hand (a real
    # Slurm is the sbatch example's business): rank 0 hosts the scheduler,
    # local rank 0 a colocated server, on loopback.
    node = socket.gethostname()
    cfg = {"sizes": [10, 70001], "dtypes": ["float32"], "rounds": 2}
    procs = []
    for r in range(4):
        env = job_env(GH_TEST=json.dumps(cfg), **slurm_vars(r, r, node, node, "4", 4))
        env.pop("GRADHUB_JOB_TOKEN")  # one node: loopback, no token needed
        env["SLURM_JOB_ID"] = str(4242 + (id(procs) % 1000))
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "check_sums.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    try:
        outs = [p.communicate(timeout=180)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"PASS {r}" in out and f"LOCAL {r} of 4" in out, out[-3000:]
