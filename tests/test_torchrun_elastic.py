"""gradhub under `torchrun --nnodes 1:2 --rdzv-backend c10d`: two torchrun
agents, each on its own emulated host (a network namespace, so the scheduler's
address really travels between hosts). A node that leaves (its agent and
workers killed) or joins makes torchrun restart every worker with the new
world size; the worker script (tests/workers/torchrun_elastic.py) resumes
from its checkpoint, and the job ends with the parameters of one process
trained on exactly the committed batches.

Creates network namespaces: run only under `flock /work/bench.lock`."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import WORKERS, free_port, job_env
from test_multihost import hosts, sh  # noqa: F401 (the emulated-hosts fixture)

spec = importlib.util.spec_from_file_location("torchrun_elastic", WORKERS / "torchrun_elastic.py")
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)

STEPS = 12


class Node:
    """One torchrun agent (with its workers) in network namespace `ns`."""

    def __init__(self, ns: str, ip: str, rdzv: str, log: Path, env: dict, host: bool):
        self.ns, self.log_path = ns, log
        conf = f"is_host={int(host)},last_call_timeout=1,join_timeout=60"
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "gh",
                "--rdzv-conf", conf, "--local-addr", ip, "--max-restarts", "3", "--monitor-interval", "0.2",
                str(WORKERS / "torchrun_elastic.py")]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.log()):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"no {pattern!r}:\n{self.log()[-6000:]}"
            time.sleep(0.1)

    def kill(self) -> None:
        """The whole node: its agent and every worker (they run in sessions of their own)."""
        for pid in sh("ip", "netns", "pids", self.ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)

    def finish(self, timeout: float) -> str:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"rc {rc}:\n{self.log()[-8000:]}"
        return self.log()


@pytest.fixture
def nodes(hosts, tmp_path):  # noqa: F811
    """start(i, rdzv_host): an agent on emulated host i (10.213.0.{i + 1}),
    with torchrun's c10d rendezvous store on host rdzv_host."""
    addrs = [hosts(0), hosts(1)]
    made: list[Node] = []
    # LOGLEVEL: torchrun's agents log each rendezvous and restart (shown when a test fails).
    env = job_env(GH_CKPT=str(tmp_path / "ckpt.pt"), GH_STEPS=STEPS, GH_STEP_SLEEP="0.25",
                  GRADHUB_PEER_TIMEOUT="3", OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    port = free_port()

    def start(i: int, rdzv_host: int, **extra) -> Node:
        ns, ip = addrs[i]
        made.append(Node(ns, ip, f"{addrs[rdzv_host][1]}:{port}", tmp_path / f"node{i}.log",
                         dict(env, **extra), host=i == rdzv_host))
        return made[-1]

    try:
        yield start, tmp_path / "ckpt.pt"
    finally:
        for n in made:
            if n.proc.poll() is None:
                n.kill()


def final_params(log: str, size: int) -> list[list[float]]:
    found = [eval(m) for m in re.findall(rf"DONE rank \d+ size {size} params (\[.*\])", log)]  # noqa: S307
    assert found, log[-6000:]
    return found


def check_against_one_process(ckpt: Path, params: list[list[float]], sizes: list[int]) -> None:
    import torch

    history = torch.load(ckpt)["history"]
    # Every step committed once, in order, at the sizes the job went through.
    assert len(history) >= STEPS and [s for s, _ in history] == list(range(len(history))), history
    assert [n for i, (_, n) in enumerate(history) if i == 0 or history[i - 1][1] != n] == sizes, history
    ref = worker.reference(history)
    for p in params:
        assert max(abs(a - b) for a, b in zip(p, ref)) < 1e-9, (p, ref)


def test_a_worker_fails_then_a_node_leaves_and_the_other_finishes_alone(nodes):
    # Node 0 has the lower address: torchrun's group rank 0, so its worker
    # hosts the job's scheduler (and a colocated server). Node 1 hosts
    # torchrun's rendezvous store and survives. No job token given: rank 0
    # makes one up and shares it through torchrun's store.
    start, ckpt = nodes
    env = dict(GRADHUB_JOB_TOKEN="", GH_FAIL_AT="3", GH_FAIL_RANK="1")
    n1, n0 = start(1, 1, **env), start(0, 1, **env)
    # First node 1's worker fails: its agent counts a restart
    # (TORCHELASTIC_RESTART_COUNT 1), node 0's agent sees a node waiting and
    # restarts its healthy worker as a change of nodes (its count stays 0).
    # The token made up by the new rank 0 must reach node 1's worker all the same.
    n1.wait_for(r"START rank 1 size 2 step 3 attempt 1", timeout=90)
    n0.wait_for(r"START rank 0 size 2 step 3 attempt 0", timeout=30)
    # Then node 0 leaves, scheduler and all: node 1's worker fails on the
    # lost peer, and torchrun restarts it alone, as rank 0.
    n1.wait_for(r"STEP 6 size 2", timeout=60)
    n0.kill()
    out = n1.finish(timeout=60)
    assert re.search(r"START rank 0 size 1 step \d+ attempt 2", out), out[-6000:]
    check_against_one_process(ckpt, final_params(out, 1), [2, 1])


def test_a_node_joins_and_the_job_goes_on_with_both(nodes):
    start, ckpt = nodes
    # Node 0 starts alone (--nnodes 1:2), hosting the rendezvous store; node
    # 1 joins mid-run: torchrun restarts node 0's worker, both now size 2.
    # torch's agents share their TCPStore with the workers by default, and a
    # node that joins a running group then waits for ever for the store's
    # address (torch 2.x): joins need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    # and without the agent's store, the job token is the user's.
    join = dict(GH_FINAL_SIZE="2", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    n0 = start(0, 0, **join)
    n0.wait_for(r"STEP 3 size 1", timeout=60)
    n1 = start(1, 0, **join)
    outs = [n0.finish(timeout=60), n1.finish(timeout=30)]
    params = [p for out in outs for p in final_params(out, 2)]
    assert len(params) == 2 and params[0] == params[1], params
    check_against_one_process(ckpt, params, [1, 2])
