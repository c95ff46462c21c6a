"""The torch local stage (GRADHUB_LOCAL_STAGE=torch) on CPU tensors and
gloo: a job on one host (one all-reduce, nothing staged), exact sums with
1-4 workers per host on two emulated hosts, uneven hosts with the core's
host stage on and off, the bytes each worker stages (1/W of each tensor),
a lost host mate, and `auto` leaving CPU tensors to the shared-memory stage.
(Training equivalence, fusion and failover with the torch stage are the
parametrized tests of test_torch.py and test_failover.py.)"""

import json
import subprocess
import sys

import pytest

from conftest import assert_all_passed, job_env, run_launch

DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8"]


# 1 worker, an even count (named tensors, in flight) and an odd one: a fourth
# worker took the even count's path again.
@pytest.mark.parametrize("workers,in_flight", [(1, False), (2, True), (3, False)])
def test_a_job_on_one_host_sums_exactly_with_one_all_reduce_and_stages_nothing(workers, in_flight):
    # Every worker on one host: the host's sum is the job's, so no share is
    # staged and no server round runs (the worker checks the staged bytes are 0).
    cfg = {"sizes": [1, 3, 17, 1000, 65_537], "dtypes": DTYPES, "rounds": 2, "in_flight": in_flight,
           "train": True, "named": workers % 2 == 0}
    rc, out = run_launch(workers, 2, "torch_local_stage.py", cfg, env={"GRADHUB_LOCAL_STAGE": "torch"})
    assert_all_passed(rc, out, workers)
    assert out.count(f"of {workers} STAGE torch WHOLE JOB") == workers, out[-3000:]


@pytest.mark.parametrize("per_host,in_flight", [(1, False), (4, True)])  # 2 + 2: test_hosts_of_any_size
def test_exact_sums_and_one_share_staged_per_worker_on_two_hosts(cluster_factory, per_host, in_flight):
    # Sizes that split evenly and not (1 element over 4 workers: three stage nothing).
    c = cluster_factory(2 * per_host, 2, GRADHUB_LOCAL_STAGE="torch")
    cfg = {"sizes": [1, 3, 17, 1000, 65_537], "dtypes": DTYPES, "rounds": 2, "in_flight": in_flight,
           "train": True, "named": per_host % 2 == 0}
    for w in range(2 * per_host):
        c.start_worker(w, "torch_local_stage.py", cfg, GRADHUB_HOST_ID=f"ls-{w % 2}")
    for w in range(2 * per_host):
        assert c.procs[f"worker{w}"].wait(timeout=180) == 0, c.log(f"worker{w}")
        log = c.log(f"worker{w}")
        assert f"PASS {w}" in log and f"of {per_host} STAGE torch\n" in log, log


def test_average_through_the_torch_stage():
    cfg = {"sizes": [5, 4099], "dtypes": ["float32", "float64"], "rounds": 1, "average": True}
    rc, out = run_launch(3, 1, "torch_local_stage.py", cfg, env={"GRADHUB_LOCAL_STAGE": "torch"})
    assert_all_passed(rc, out, 3)


def test_auto_leaves_cpu_tensors_to_the_shared_memory_stage():
    cfg = {"sizes": [17, 1000], "dtypes": ["float32", "int64"], "rounds": 1, "stage": "shm", "train": True}
    rc, out = run_launch(2, 1, "torch_local_stage.py", cfg)
    assert_all_passed(rc, out, 2)


@pytest.mark.parametrize("hosts,host_reduce", [("aabb", "1"), ("aaab", "1"), ("aaab", "0")],
                         ids=["2+2", "3+1", "3+1-no-host-stage"])
def test_hosts_of_any_size_sum_exactly(cluster_factory, hosts, host_reduce):
    # Each host splits a tensor into its own number of shares: the job's sum
    # is the same whatever the hosts' sizes, through the core's host stage
    # (which adds the other workers' zeros) or without it.
    c = cluster_factory(len(hosts), 2, GRADHUB_HOST_REDUCE=host_reduce, GRADHUB_LOCAL_STAGE="torch")
    cfg = {"sizes": [1, 7, 1000, 65_537], "dtypes": ["float32", "bfloat16", "int64"], "rounds": 2,
           "in_flight": True, "train": True}
    for w, h in enumerate(hosts):
        c.start_worker(w, "torch_local_stage.py", cfg, GRADHUB_HOST_ID=f"ls-{h}")
    for w, h in enumerate(hosts):
        assert c.procs[f"worker{w}"].wait(timeout=120) == 0, c.log(f"worker{w}")
        log = c.log(f"worker{w}")
        assert f"PASS {w}" in log and f"of {hosts.count(h)} STAGE torch" in log, log


def test_bench_gpu_says_there_is_no_gpu_and_runs_the_cpu_parts(tmp_path):
    # On a GPU machine it runs every part (small ResNet-50 runs) and must pass too.
    import torch

    workers = torch.cuda.device_count() if torch.cuda.is_available() else 4
    p = subprocess.run([sys.executable, "-m", "gradhub", "bench", "gpu", "--out", str(tmp_path), "--steps", "2",
                        "--batch", "4", "--workers", str(workers)], env=job_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert not report["failed"] and report["train"]["max_rel_diff"] < 1e-9, report
    sums = report["sums"]
    assert sums["torch"]["checked"] == sums["shm"]["checked"] > 0
    # One host: the torch stage is one all-reduce, nothing staged; the shm stage stages nothing either.
    assert sums["torch"]["staged_bytes"] == 0 and sums["shm"]["staged_bytes"] == 0
    if workers >= 2:
        # Two emulated hosts of W = workers/2: worker 0 staged its share, 1/W of each tensor, rounded up.
        split = sums["torch-2hosts"]
        share = split["tensor_bytes"] / (workers // 2)
        assert share <= split["staged_bytes"] < share + 8 * split["checked"]  # less than an element more each
    if torch.cuda.is_available():
        assert report["resnet50"]["gradhub"] > 0 and report["resnet50"]["ddp"] > 0
    else:
        assert "no GPU" in p.stdout and "resnet50" not in report
    assert (tmp_path / "gpu.md").read_text().startswith("| part | result |")


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_local_worker_fails_its_host_mates_in_bounded_time(cluster_factory, how):
    # Worker 1 shares worker 0's host (and its torch group). Killed, its
    # sockets close; stopped, they stay open and silent: either way worker 0
    # must not sit in a local collective until torch's own timeout (10 min),
    # but fail as soon as the core knows worker 1 is gone, naming it.
    import signal
    import time

    c = cluster_factory(2, 1, GRADHUB_LOCAL_STAGE="torch", GRADHUB_PEER_TIMEOUT="3")
    cfg = {"model": "mlp", "opt": "sgd", "steps": 400, "step_sleep": 0.02}
    for w in range(2):  # SIGSTOP reaches only the process itself: no zygote
        c.start_worker(w, "torch_train.py", cfg, fresh=how == "stop", GRADHUB_HOST_ID="ls-one")
    c.wait_for("worker0", "STEP 3", 120)
    c.procs["worker1"].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    lost = time.monotonic()
    try:
        assert c.procs["worker0"].wait(timeout=60) != 0
        assert time.monotonic() - lost < 30
        log = c.log("worker0")
        assert "worker 1" in log, log
    finally:
        c.procs["worker1"].send_signal(signal.SIGCONT)
