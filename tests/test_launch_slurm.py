"""Slurm: a task of an srun step gets its rank, size, local rank, local size
and the scheduler's node from Slurm's variables (launch/slurm.py, _env); a
job of 4 tasks started with the variables srun sets, on one node, sums
exactly with the scheduler and server embedded as under torchrun; and the
same under a real Slurm (slurmctld, slurmd and munge on this machine, as
root), which also checks examples/slurm.sbatch."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import WORKERS, free_port, job_env
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


# ---------------------------------------------------------------- a real Slurm

SLURM_CONF = """ClusterName=gradhubtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={tmp}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
# Never run on: nodes shaped like the sbatch example's, for `sbatch --test-only`.
NodeName=ghcheck[1-4] NodeAddr=127.0.0.1 CPUs=16 Gres=gpu:4 State=UNKNOWN
PartitionName=run Nodes={host} MaxTime=INFINITE State=UP OverSubscribe=FORCE
PartitionName=check Nodes=ghcheck[1-4] Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm(tmp_path):
    """slurmctld and slurmd on this machine (Debian's slurm-wlm, with munge),
    configured in tmp_path: `run` runs jobs here, `check` only checks them."""
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root")
    missing = [b for b in ("slurmctld", "slurmd", "srun", "sbatch", "munged") if shutil.which(b) is None]
    if missing:
        pytest.fail(f"Slurm is missing ({', '.join(missing)}): ./install.sh installs it (as root)")
    for d in ("state", "spool"):
        (tmp_path / d).mkdir()
    tmp_path.chmod(0o755)  # munge's socket is reached through it
    key = tmp_path / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = tmp_path / "slurm.conf"
    (tmp_path / "gres.conf").write_text("NodeName=ghcheck[1-4] Name=gpu Count=4\n")
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), tmp=tmp_path, ctld_port=free_port(),
                                      d_port=free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs = [subprocess.Popen(["munged", "-F", "-f", "-S", f"{tmp_path}/munge.sock", f"--key-file={key}",
                               f"--log-file={tmp_path}/munged.log", f"--pid-file={tmp_path}/munged.pid",
                               f"--seed-file={tmp_path}/munged.seed"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 30  # a hang guard
        while not (tmp_path / "munge.sock").exists():
            assert time.monotonic() < deadline, "munged did not start"
            time.sleep(0.1)
        procs.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", socket.gethostname()], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        while True:
            out = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%P %D"], env=env, capture_output=True,
                                 text=True).stdout
            idle = dict(line.split() for line in out.splitlines() if line.strip())
            if idle.get("run") == "1" and idle.get("check*") == "4":
                break
            assert time.monotonic() < deadline, f"Slurm's nodes did not come up: {idle}\n" + \
                (tmp_path / "slurmctld.log").read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        yield env
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_srun_on_a_real_slurm_sums_exactly_and_slurm_accepts_the_sbatch_example(slurm):
    cfg = {"sizes": [10, 70001], "dtypes": ["float32", "float16"], "rounds": 2}
    env = job_env(GH_TEST=json.dumps(cfg), SLURM_CONF=slurm["SLURM_CONF"])
    env.pop("GRADHUB_JOB_TOKEN")  # one node: the job stays on loopback
    p = subprocess.run(["srun", "-p", "run", "-N1", "-n4", "-l", sys.executable, str(WORKERS / "check_sums.py")],
                       env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for r in range(4):
        assert f"{r}: PASS {r}" in p.stdout and f"{r}: LOCAL {r} of 4" in p.stdout, p.stdout[-3000:]
    # The example's options, its heterogeneous components and its script, as Slurm reads them.
    example = WORKERS.parent.parent / "examples" / "slurm.sbatch"
    p = subprocess.run(["sbatch", "--test-only", str(example)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "to start at" in p.stderr, p.stderr
    bad = example.read_text().replace("--ntasks-per-node=4", "--ntasks-per-nodes=4")
    p = subprocess.run(["sbatch", "--test-only"], input=bad, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0, p.stderr  # the check can fail
