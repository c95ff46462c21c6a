"""gradhub.torch.elastic: Horovod's elastic state objects, sampler and
run() on 2 and 3 workers; a lost worker rolling the others back to the
last commit (a job of fixed size then raises ElasticResetError); and an
elastic job on a shared service going on with the survivors."""


import sys

import pytest

from conftest import WORKERS, assert_all_passed, run_launch


@pytest.mark.parametrize("workers", [2, 3])
def test_state_sync_commit_restore_sampler_and_reset_callbacks(workers):
    rc, out = run_launch(workers, 1, "torch_elastic.py", {})
    assert_all_passed(rc, out, workers)
    assert out.count("MISMATCH RAISED GradhubMismatchError") == workers, out[-3000:]


def test_a_lost_worker_rolls_the_others_back_to_the_last_commit(cluster_factory):
    c = cluster_factory(3, 1, GRADHUB_PEER_TIMEOUT="3")
    for w in range(3):
        c.start_worker(w, "torch_elastic.py", {"lose": 2})
    assert c.procs["worker2"].wait(timeout=120) == 9
    for w in range(2):
        assert c.procs[f"worker{w}"].wait(timeout=60) == 0, c.log(f"worker{w}")
        assert "ROLLED BACK" in c.log(f"worker{w}"), c.log(f"worker{w}")


def test_an_elastic_job_loses_a_worker_mid_step_and_the_others_finish_as_one_process(tmp_path):
    # 3 workers on a shared service, at least 2: worker "victim" dies mid-step;
    # the other two roll back to the last commit, form a generation of 2 with
    # new ranks, and end with full-batch single-process parameters.
    from test_service import Service

    svc = Service(tmp_path, servers=1)
    try:
        token = svc.token("el")
        names = []
        for r in range(3):
            env = svc.worker_env("el", 3, r, token, steps=12, lose_at=5)
            env.update(GRADHUB_MIN_WORKERS="2", GRADHUB_PEER_TIMEOUT="3", GH_VICTIM="1" if r == 2 else "0")
            names.append(svc.spawn(f"el-w{r}", [sys.executable, str(WORKERS / "elastic_train.py")], env) and f"el-w{r}")
        codes = svc.wait(names, timeout=120)
        assert codes["el-w2"] == 9, svc.log("el-w2")
        for n in names[:2]:
            assert codes[n] == 0, svc.log(n) + svc.log("service")
            assert "SIZE 2" in svc.log(n) and "RESETS [2]" in svc.log(n) and "PASS" in svc.log(n), svc.log(n)
    finally:
        svc.close()
