"""A lost summation server: its chunks move to the others and training goes
on with exactly the sums it would have had; with the
optimizer on the servers, each chunk moves to the replica that kept its
parameters and optimizer state. Jobs are started role by role, and a
server is killed (SIGKILL: its connections close) or stopped (SIGSTOP: it
goes silent, found by the heartbeat) in the middle of the rounds."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import job_env
from gradhub_lab.faults import FAULTS

WORKERS, SERVERS = 4, 3
PEER_TIMEOUT = "2"


def start(cluster_factory, script, config, host_reduce="0", **env):
    """4 workers on 2 hosts (2 each: the host stage sums there when on), 3 servers."""
    c = cluster_factory(WORKERS, SERVERS, GRADHUB_PEER_TIMEOUT=PEER_TIMEOUT, GRADHUB_HOST_REDUCE=host_reduce, **env)
    for w in range(WORKERS):
        c.start_worker(w, script, config, GRADHUB_HOST_ID=f"host{w // 2}")
    return c


def lose_server(c, how, after_line, victim="server1"):
    c.wait_for("worker0", after_line, 120)
    time.sleep(0.01)  # into the next rounds
    c.procs[victim].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    return time.monotonic()


@pytest.mark.parametrize("host_reduce", ["0", "1"], ids=["sockets", "host-stage"])
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_server_is_taken_over_and_every_sum_stays_exact(cluster_factory, how, host_reduce):
    c = start(cluster_factory, "failover.py", {"steps": 40, "sleep": 0.0}, host_reduce)
    lost_at = lose_server(c, how, "STEP 8")
    try:
        for w in range(WORKERS):
            assert c.procs[f"worker{w}"].wait(timeout=120) == 0, c.log(f"worker{w}")
            assert f"PASS {w}" in c.log(f"worker{w}")
        took = time.monotonic() - lost_at
        logs = "\n".join(c.log(n) for n in c.procs)
        assert c.procs["scheduler"].wait(timeout=30) == 0, logs
        for s in ("server0", "server2"):
            assert c.procs[s].wait(timeout=30) == 0, c.log(s)
    finally:
        if how == "stop":
            c.procs["server1"].send_signal(signal.SIGCONT)
    sched = c.log("scheduler")
    assert "server 1" in sched and "moving its chunks" in sched, sched
    if how == "kill":
        assert "disconnected" in sched or "connection lost" in sched, sched
    else:
        assert "no heartbeat" in sched, sched
    for w in range(WORKERS):
        assert "server 1 was lost" in c.log(f"worker{w}"), c.log(f"worker{w}")
    # The 36 steps after the loss took seconds, not a hang.
    assert took < 60
    if how == "stop":
        # Resumed, the lost server finds itself out of the job and exits.
        assert c.procs["server1"].wait(timeout=30) != 0
        assert "error" in c.log("server1"), c.log("server1")


@pytest.mark.parametrize("host_reduce,opt,server,how,stage", [
    ("0", "sgd", False, "kill", "shm"),
    ("1", "sgd", False, "kill", "shm"),
    ("1", "sgd", False, "kill", "torch"),  # the torch local stage (gloo) before the network
    ("0", "sgd", True, "kill", "shm"),          # momentum state on the servers
    ("1", "adamw", True, "kill", "shm"),
    ("0", "adamw", True, "stop", "shm"),
], ids=["sockets", "host-stage", "torch-stage", "server-sgd", "server-adamw-host-stage", "server-adamw-stopped"])
def test_training_that_loses_a_server_ends_with_the_parameters_of_one_that_did_not(cluster_factory, host_reduce,
                                                                                   opt, server, how, stage):
    # torch_train.py checks every worker's parameters against single-process
    # training on the combined batch (what a job that lost no server gets).
    cfg = {"model": "mlp", "opt": opt, "steps": 16, "step_sleep": 0.05, "server": server}
    c = start(cluster_factory, "torch_train.py", cfg, host_reduce, GRADHUB_LOCAL_STAGE=stage)
    lose_server(c, how, "STEP 5")
    try:
        for w in range(WORKERS):
            assert c.procs[f"worker{w}"].wait(timeout=120) == 0, c.log(f"worker{w}")
            assert f"PASS {w}" in c.log(f"worker{w}") and "server 1 was lost" in c.log(f"worker{w}")
        assert c.procs["scheduler"].wait(timeout=30) == 0, c.log("scheduler")
    finally:
        if how == "stop":
            c.procs["server1"].send_signal(signal.SIGCONT)
    if server:
        # The chunks went to their replicas, state and all.
        takers = [c.log(s) for s in ("server0", "server2")]
        assert any("taking over its chunks" in log for log in takers), takers


def test_losing_a_chunk_and_its_replica_with_optimizer_state_is_a_clear_error(cluster_factory):
    # Two of three servers at once: some chunk loses both its server and
    # its replica, and with them its optimizer state.
    cfg = {"model": "mlp", "opt": "sgd", "steps": 30, "step_sleep": 0.05, "server": True}
    c = start(cluster_factory, "torch_train.py", cfg)
    c.wait_for("worker0", "STEP 3", 120)
    for s in ("server1", "server2"):
        c.procs[s].send_signal(signal.SIGKILL)
    for w in range(WORKERS):
        assert c.procs[f"worker{w}"].wait(timeout=60) != 0
        log = c.log(f"worker{w}")
        assert "was lost" in log and "server-side optimizer" in log, log
    assert c.procs["scheduler"].wait(timeout=30) == 1, c.log("scheduler")
    assert c.procs["server0"].wait(timeout=30) == 1, c.log("server0")


def test_losing_a_server_with_optimizer_state_and_failover_off_is_a_clear_error(cluster_factory):
    cfg = {"model": "mlp", "opt": "sgd", "steps": 30, "step_sleep": 0.05, "server": True}
    c = start(cluster_factory, "torch_train.py", cfg, GRADHUB_FAILOVER="0")
    lose_server(c, "kill", "STEP 3")
    for w in range(WORKERS):
        assert c.procs[f"worker{w}"].wait(timeout=60) != 0
        assert "server 1" in c.log(f"worker{w}"), c.log(f"worker{w}")
    assert c.procs["scheduler"].wait(timeout=30) == 1, c.log("scheduler")


def add_server(c, name="server3"):
    """Start one more server while the job runs (no rank: the scheduler gives it the next)."""
    argv = [sys.executable, "-m", "gradhub", "server", "--threads", "2", "--advertise-addr", "127.0.0.1"]
    return c._spawn(name, argv)


def exit_code(c, name, timeout):
    """`name`'s exit code; on a hang, every member's log in the failure."""
    try:
        return c.procs[name].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        logs = "\n".join(f"===== {n}\n{c.log(n)[-3000:]}" for n in c.procs)
        raise AssertionError(f"{name} still running after {timeout}s:\n{logs}") from None


def every_worker_passes(c):
    for w in range(WORKERS):
        assert exit_code(c, f"worker{w}", 120) == 0, c.log(f"worker{w}")
        assert f"PASS {w}" in c.log(f"worker{w}")
    assert c.procs["scheduler"].wait(timeout=30) == 0, c.log("scheduler")


def rounds_summed(log: str) -> int:
    m = re.search(r"job complete \((\d+) chunk rounds summed", log)
    assert m, log
    return int(m.group(1))


@pytest.mark.parametrize("host_reduce", ["0", "1"], ids=["sockets", "host-stage"])
@pytest.mark.parametrize("how", ["grow", "repair"])
def test_a_server_that_joins_takes_chunks_and_every_sum_stays_exact(cluster_factory, how, host_reduce):
    # grow: a fourth server joins mid-rounds; repair: one of three is
    # killed first, and the one that joins replaces it.
    c = start(cluster_factory, "failover.py", {"steps": 40, "sleep": 0.0}, host_reduce)
    if how == "repair":
        lose_server(c, "kill", "STEP 5")
        c.wait_for("scheduler", "taken over", 60)
    c.wait_for("worker0", "STEP 10", 120)
    add_server(c)
    every_worker_passes(c)
    alive = ["server0", "server2", "server3"] + (["server1"] if how == "grow" else [])
    for s in alive:
        assert c.procs[s].wait(timeout=30) == 0, c.log(s)
    sched = c.log("scheduler")
    assert "server 3 (127.0.0.1, 2 thread(s), CPU-only) joined the running job" in sched, sched
    took = re.search(r"server 3 took over (\d+) chunk\(s\) \(0 kept", sched)
    assert took and int(took.group(1)) > 0, sched
    # It summed rounds of its own, while the others went on with theirs.
    assert rounds_summed(c.log("server3")) > 0, c.log("server3")
    for w in range(WORKERS):
        assert "server 3 joined the job" in c.log(f"worker{w}"), c.log(f"worker{w}")


@pytest.mark.parametrize("server", [False, True], ids=["summation", "server-optimizer"])
def test_training_that_gains_a_server_ends_with_the_parameters_of_one_that_did_not(cluster_factory, server, tmp_path):
    # With the optimizer on the servers, chunks that hold its state stay
    # where they are; only those without any move. The workers hold at step
    # 8 until the new server has joined (a loaded machine starts it slowly).
    go = tmp_path / "go"
    cfg = {"model": "mlp", "opt": "sgd", "steps": 16, "step_sleep": 0.05, "server": server,
           "hold_at": 8, "hold_file": str(go)}
    c = start(cluster_factory, "torch_train.py", cfg)
    c.wait_for("worker0", "STEP 5", 120)
    add_server(c)
    c.wait_for("scheduler", "server 3 took over", 120)
    go.write_text("go")
    every_worker_passes(c)
    assert c.procs["server3"].wait(timeout=30) == 0, c.log("server3")
    sched = c.log("scheduler")
    m = re.search(r"server 3 took over (\d+) chunk\(s\) \((\d+) kept", sched)
    assert m, sched
    if server:
        assert int(m.group(2)) > 0, sched
    else:
        assert int(m.group(1)) > 0 and int(m.group(2)) == 0, sched


def test_two_servers_join_one_after_the_other_and_a_first_one_is_lost_after(cluster_factory):
    # Slots stay numbered alike everywhere across joins, and a failover
    # after them moves a first server's chunks to old and new servers alike.
    c = cluster_factory(WORKERS, 2, GRADHUB_PEER_TIMEOUT=PEER_TIMEOUT, GRADHUB_HOST_REDUCE="1")
    for w in range(WORKERS):
        c.start_worker(w, "failover.py", {"steps": 60, "sleep": 0.0}, GRADHUB_HOST_ID=f"host{w // 2}")
    c.wait_for("worker0", "STEP 5", 120)
    add_server(c, "server2")
    c.wait_for("scheduler", "server 2 took over", 60)
    add_server(c, "server3")
    c.wait_for("scheduler", "server 3 took over", 60)
    c.procs["server0"].kill()
    every_worker_passes(c)
    sched = c.log("scheduler")
    assert "moving its chunks of" in sched and "to server(s) [1, 2, 3]" in sched, sched
    for s in ("server2", "server3"):
        assert c.procs[s].wait(timeout=30) == 0, c.log(s)
        assert rounds_summed(c.log(s)) > 0, c.log(s)


def test_a_server_cannot_join_a_job_that_started_with_one(cluster_factory):
    c = cluster_factory(2, 1)
    for w in range(2):
        c.start_worker(w, "failover.py", {"steps": 30, "sleep": 0.02})
    c.wait_for("worker0", "STEP 3", 120)
    p = add_server(c, "server1")
    assert p.wait(timeout=60) != 0
    assert "cannot take a server while it runs" in c.log("server1"), c.log("server1")
    for w in range(2):
        assert c.procs[f"worker{w}"].wait(timeout=120) == 0, c.log(f"worker{w}")


def test_fault_campaign_quick_mode(tmp_path):
    """`gradhub-lab faults --quick`: one job per fault (kill, stop, pause
    of each role, a stalled server, an exception, strangers' connections, a
    server's links reset, changed or held by a proxy), each started role
    by role, each with a tensor whose optimizer runs on the servers, half of them encrypted: no hang, no wrong sum
    or parameter, every outcome the expected one."""
    out = tmp_path / "faults.json"
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "faults", "--quick", "--seed", "0",
                        "--json", str(out)], capture_output=True, text=True, timeout=900, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    s = res["summary"]
    one_at_a_time = [f for f in FAULTS if f.count == 1 and f.quick]
    assert s["trials"] == len(s["by_fault"]) == len(one_at_a_time), s
    assert s["hangs"] == 0 and s["wrong"] == 0 and s["as_expected"] == s["trials"], p.stdout
    # Killed, stopped for good, and perhaps stalled past the peer timeout.
    assert s["continued_after_server_loss"] == s["server_losses"] >= 2, s
    assert s["continued_with_server_optimizer"] == s["server_losses_with_server_optimizer"] == s["server_losses"], s
    by = {r["fault"]: r for r in res["trials"]}
    # Lost workers and schedulers are reported everywhere within 3 peer timeouts.
    for name in ("kill worker", "stop worker", "stop scheduler", "raise in worker"):
        assert by[name]["outcome"] == "failed, reported"
        assert by[name]["all_down_s"] < 3 * res["peer_timeout"], by[name]
    # A scheduler killed and started again: every member rejoins, the job goes on.
    assert by["restart scheduler"]["outcome"] == "continued", by["restart scheduler"]
    assert by["restart scheduler"]["rejoined_s"] < res["peer_timeout"], by["restart scheduler"]
    # Links reset, bytes flipped, links held, a worker cut off from a server
    # for a while, through a proxy: the job goes on.
    for name in ("reset links", "flip bytes", "hold links", "partition"):
        assert by[name]["outcome"] == "continued" and "back_s" in by[name], by[name]
    assert f"trials {len(one_at_a_time)}" in p.stdout and "hangs 0" in p.stdout


def test_fault_campaign_usage_errors():
    run = [sys.executable, "-m", "gradhub_lab", "faults"]
    p = subprocess.run(run + ["--list"], capture_output=True, text=True, timeout=60, env=job_env())
    assert p.returncode == 0 and "kill server" in p.stdout and "expect: continue" in p.stdout
    p = subprocess.run(run + ["--faults", "melt server"], capture_output=True, text=True, timeout=60, env=job_env())
    assert p.returncode == 2 and "unknown fault" in p.stderr
