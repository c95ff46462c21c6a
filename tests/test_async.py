"""The asynchronous mode (GRADHUB_ASYNC=1) and its staleness bound
(GRADHUB_STALENESS) end to end: every worker starts from worker 0's
parameters; with a bound of 0 the workers keep in step and train exactly as
synchronous SGD on the combined batch; a straggler does not hold the others
back; a bound holds (the servers' record of the most steps a worker was ahead
when answered); a member in another mode is refused at init. The digits
example's accuracy is checked in test_examples.py."""

import re
import time

import pytest
from conftest import alarming, assert_all_passed, run_launch


def steps_and_lead(out: str, workers: int) -> tuple[list[int], int]:
    steps = [0] * workers
    for r, n in re.findall(r"\[worker (\d+)\] STEPS (\d+)", out):
        steps[int(r)] = int(n)
    leads = [int(n) for n in re.findall(r"at most (\d+) steps ahead of the slowest", out)]
    assert leads, out[-4000:]
    return steps, max(leads)


@pytest.mark.parametrize("hosts", [[0, 1, 2], [0, 0, 1, 1]], ids=["3-hosts", "host-stage"])
def test_a_bound_of_zero_keeps_the_workers_in_step_exactly_as_synchronous_sgd(hosts):
    # Two servers (so chunks have replicas); with the host stage asked for
    # (off by default in this mode), each host's two workers combine their
    # changes and push once, and the scheduler says they keep in step.
    n = len(hosts)
    env = {"GRADHUB_ASYNC": 1, "GRADHUB_STALENESS": 0}
    if len(set(hosts)) < n:
        env["GRADHUB_HOST_REDUCE"] = 1
    rc, out = run_launch(n, 2, "async_train.py", {"steps": 12, "exact": True, "hosts": hosts}, env=env)
    assert_all_passed(rc, out, n)
    steps, lead = steps_and_lead(out, n)
    assert steps == [12] * n and lead == 0, (steps, lead)
    said = "asynchronous with the host stage on (GRADHUB_HOST_REDUCE=1): the workers of each host wait" in out
    assert said == (len(set(hosts)) < n), out[-4000:]


def test_a_straggler_does_not_hold_the_others_back_and_a_bound_holds():
    # Four workers on one host, the default settings: host mates do not
    # wait for each other (the host stage is off in this mode).
    cfg = {"seconds": 3.0, "sleep": {"0": 0.005, "1": 0.005, "2": 0.005, "3": 0.15}, "hosts": [0, 0, 0, 0]}
    rc, out = run_launch(4, 2, "async_train.py", cfg, env={"GRADHUB_ASYNC": 1})
    assert_all_passed(rc, out, 4)
    assert not alarming(out), out[-6000:]
    steps, lead = steps_and_lead(out, 4)
    # Unbounded: the fast workers run at their own pace, far ahead.
    assert min(steps[:3]) >= 4 * steps[3], steps
    assert lead > 2, (steps, lead)
    rc, out = run_launch(4, 2, "async_train.py", cfg, env={"GRADHUB_ASYNC": 1, "GRADHUB_STALENESS": 2})
    assert_all_passed(rc, out, 4)
    bounded, lead = steps_and_lead(out, 4)
    assert 1 <= lead <= 2, (bounded, lead)
    # The fast workers waited for the straggler (they ran on alone only
    # after it left, in the moments before their own clocks ran out).
    assert max(bounded[:3]) < min(steps[:3]) / 2, (steps, bounded)


def test_a_member_in_another_mode_is_refused_at_init(cluster_factory):
    c = cluster_factory(1, 1, GRADHUB_ASYNC=1)
    w = c.start_worker(0, "async_train.py", {"steps": 1}, GRADHUB_ASYNC="0")
    assert w.wait(timeout=60) != 0
    assert "GRADHUB_ASYNC" in c.log("worker0") and "asynchronous" in c.log("worker0"), c.log("worker0")
    rc, out = run_launch(1, 1, "async_train.py", {"steps": 1}, env={"GRADHUB_STALENESS": 2})
    assert rc != 0 and "GRADHUB_STALENESS=2 bounds the asynchronous mode only" in out, out[-3000:]


def test_a_lost_server_keeps_the_parameters_and_no_change_is_lost_or_applied_twice(cluster_factory):
    # In step (bound 0), so the parameters must still equal synchronous SGD's
    # after server 1 dies mid-run: its chunks go on at their replicas, which
    # have every change any worker was answered with; pushes it had not
    # answered come again and are applied there once.
    c = cluster_factory(3, 3, GRADHUB_PEER_TIMEOUT="2", GRADHUB_ASYNC=1, GRADHUB_STALENESS=0)
    cfg = {"steps": 40, "exact": True, "progress": True, "sleep": {"0": 0.005, "1": 0.005, "2": 0.005}}
    for w in range(3):
        c.start_worker(w, "async_train.py", cfg)
    c.wait_for("worker0", "STEP 5", 120)
    time.sleep(0.01)
    c.procs["server1"].kill()
    for w in range(3):
        assert c.procs[f"worker{w}"].wait(timeout=120) == 0, c.log(f"worker{w}")
        assert "PASS" in c.log(f"worker{w}") and "server 1 was lost" in c.log(f"worker{w}"), c.log(f"worker{w}")
    assert any("taking over its chunks" in c.log(s) for s in ("server0", "server2"))
