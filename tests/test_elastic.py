"""gradhub.torch.elastic: Horovod's elastic state objects, sampler and
run() on 2 and 3 workers; a lost worker rolling the others back to the
last commit (a job of fixed size then raises ElasticResetError); and an
elastic job on a shared service going on with the survivors."""


import sys
import time

import pytest

from conftest import WORKERS, assert_all_passed, run_launch, worker_argv


@pytest.mark.parametrize("workers", [2, 3])
def test_state_sync_commit_restore_sampler_and_reset_callbacks(workers):
    rc, out = run_launch(workers, 1, "torch_elastic.py", {})
    assert_all_passed(rc, out, workers)
    assert out.count("MISMATCH RAISED GradhubMismatchError") == workers, out[-3000:]


def test_a_lost_worker_rolls_the_others_back_to_the_last_commit(cluster_factory):
    c = cluster_factory(3, 1, GRADHUB_PEER_TIMEOUT="3")
    for w in range(3):
        c.start_worker(w, "torch_elastic.py", {"lose": 2})
    assert c.procs["worker2"].wait(timeout=120) == 9, c.log("worker2")
    for w in range(2):
        assert c.procs[f"worker{w}"].wait(timeout=60) == 0, c.log(f"worker{w}")
        assert "ROLLED BACK" in c.log(f"worker{w}"), c.log(f"worker{w}")


@pytest.mark.parametrize("sfb", ["force"])  # the factors decided again; "off" is the join test's
def test_an_elastic_job_loses_a_worker_mid_step_and_the_others_finish_as_one_process(tmp_path, sfb):
    # 3 workers on a shared service, at least 2: worker "victim" dies mid-step;
    # the other two roll back to the last commit, form a generation of 2 with
    # new ranks, and end with full-batch single-process parameters (with the
    # weights as sufficient factors too: decided again in the new generation).
    from test_service import Service

    svc = Service(tmp_path, servers=1)
    try:
        token = svc.token("el")
        names = []
        for r in range(3):
            env = svc.worker_env("el", 3, r, token, steps=12, lose_at=5, sfb=sfb)
            env.update(GRADHUB_MIN_WORKERS="2", GRADHUB_PEER_TIMEOUT="3", GH_VICTIM="1" if r == 2 else "0")
            names.append(svc.spawn(f"el-w{r}", worker_argv("elastic_train.py"), env) and f"el-w{r}")
        codes = svc.wait(names, timeout=120)
        assert codes["el-w2"] == 9, svc.log("el-w2")
        for n in names[:2]:
            assert codes[n] == 0, svc.log(n) + svc.log("service")
            assert "SIZE 2" in svc.log(n) and "RESETS [2]" in svc.log(n) and "PASS" in svc.log(n), svc.log(n)
    finally:
        svc.close()


def test_a_worker_joins_a_running_elastic_job_at_its_next_commit(tmp_path):
    # 2 workers (at most 3) train; a third starts mid-run and waits; the two
    # are told, raise HostsUpdatedInterrupt at the same commit (no rollback),
    # and the three form the next generation: the newcomer gets the state
    # by sync() and all end with single-process parameters.
    from test_service import Service

    svc = Service(tmp_path, servers=1)
    try:
        token = svc.token("grow")
        cfg = dict(steps=8, step_sleep=0.05, final_size=3)

        def start(r: int) -> str:
            env = svc.worker_env("grow", 2, r, token, **cfg)
            env.update(GRADHUB_MIN_WORKERS="2", GRADHUB_MAX_WORKERS="3", GH_VICTIM="0")
            svc.spawn(f"grow-w{r}", worker_argv("elastic_train.py"), env)
            return f"grow-w{r}"

        names = [start(0), start(1)]
        deadline = time.monotonic() + 60
        while "STEP 3" not in svc.log(names[0]):
            assert time.monotonic() < deadline and svc.procs[names[0]].poll() is None, svc.log(names[0])
            time.sleep(0.05)
        names.append(start(2))
        codes = svc.wait(names, timeout=120)
        for n in names:
            assert codes[n] == 0, svc.log(n) + svc.log("service")
            assert "SIZE 3" in svc.log(n) and "PASS" in svc.log(n), svc.log(n)
        for n in names[:2]:
            assert "RESETS [3]" in svc.log(n), svc.log(n)  # the reset callbacks ran, with the new size
        assert "RESETS []" in svc.log(names[2])  # the newcomer joined; it never reset
        assert "a worker waits to join" in svc.log("service"), svc.log("service")
    finally:
        svc.close()


def test_the_elastic_fault_campaign_quick_mode(tmp_path):
    # The campaign command end to end, on one trial of a killed worker: no
    # hang, no wrong result, no disagreement, the trial as expected, its
    # recovery timed. (The behaviours themselves, with exact single-process
    # parameters, are the tests above: a worker lost mid-step, one that joins.)
    import subprocess

    from conftest import job_env

    out = tmp_path / "faults.json"
    # One of the four faults (the full campaign, docs/reliability.md, runs all four 25 times each).
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "faults", "--elastic", "--quick", "--faults",
                        "kill worker", "--json", str(out)],
                       env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:]
    import json

    s = json.loads(out.read_text())["summary"]
    assert s["trials"] == s["ok"] == 1 and s["hangs"] == s["wrong"] == s["disagree"] == 0, s
    assert set(s["by_fault"]) == {"kill worker"}, s
    assert all(row["recovery_median_s"] is not None for row in s["by_fault"].values()), s


@pytest.mark.parametrize("victim", [0], ids=["the-scheduler-host"])
def test_torchrun_max_restarts_forms_a_fresh_job(victim):
    # torchrun restarts every worker after one fails (rank 0 hosts the job's
    # scheduler): the restarted group is a fresh job (its own embedded
    # scheduler and token), not the dead one's.
    import subprocess

    from conftest import free_port, job_env

    env = job_env(GH_VICTIM_RANK=victim)
    for k in ("GRADHUB_SCHEDULER", "GRADHUB_JOB_TOKEN", "GRADHUB_NUM_WORKERS", "GRADHUB_NUM_SERVERS"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                        "--master-port", str(free_port()), str(WORKERS / "torchrun_restart.py")],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-6000:]
    assert "RESTARTED 1 PASS 0" in p.stdout and "RESTARTED 1 PASS 1" in p.stdout, p.stdout[-6000:]
    assert "RESTARTED 0" not in p.stdout, p.stdout[-6000:]


def test_an_elastic_job_below_its_minimum_fails_on_every_survivor_with_the_reason(tmp_path):
    # 3 workers, at least 3: one is lost; the two others roll back and wait
    # for the next generation, which cannot form: after the join timeout each
    # fails with the reason instead of waiting for ever.
    from test_service import Service

    svc = Service(tmp_path, servers=1, args=("--join-timeout", "4"))
    try:
        token = svc.token("short")
        names = []
        for r in range(3):
            env = svc.worker_env("short", 3, r, token, steps=12, lose_at=3)
            env.update(GRADHUB_MIN_WORKERS="3", GRADHUB_PEER_TIMEOUT="3", GH_VICTIM="1" if r == 2 else "0")
            svc.spawn(f"short-w{r}", worker_argv("elastic_train.py"), env)
            names.append(f"short-w{r}")
        codes = svc.wait(names, timeout=120)
        assert codes["short-w2"] == 9, svc.log("short-w2")
        for n in names[:2]:
            assert codes[n] != 0, svc.log(n)
            log = svc.log(n)
            assert "ElasticResetError" in log and "below the job's minimum of 3" in log, log
    finally:
        svc.close()
