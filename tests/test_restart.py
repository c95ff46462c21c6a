"""A scheduler killed mid-run (SIGKILL) and started again on its address:
the data plane trains on meanwhile, every member rejoins, the job is
rebuilt from what they report, and training ends with exact sums; one that
does not come back fails the job within the peer timeout, named. Roles
started by hand."""

import time


def started(cluster_factory, rounds=60, **kw):
    c = cluster_factory(2, 2, threads=2, **kw)
    for r in range(2):
        c.start_worker(r, "restart.py", {"rounds": rounds, "sleep": 0.03, "declare_every": 15})
    return c


def rounds_done(c, name):
    return c.log(name).count("ROUND ")


def test_a_scheduler_killed_and_started_again_is_rejoined_and_the_job_ends_exact(cluster_factory):
    c = started(cluster_factory)
    c.wait_for("worker0", "ROUND 3", timeout=60)
    c.procs["scheduler"].kill()
    c.procs["scheduler"].wait()
    at_kill = rounds_done(c, "worker0")
    time.sleep(1.5)
    # The data plane went on without it (until a declaration or barrier waits).
    assert rounds_done(c, "worker0") > at_kill, c.log("worker0")
    c.restart_scheduler()
    for r in range(2):
        c.wait_for(f"worker{r}", "PASS", timeout=90)
        assert c.procs[f"worker{r}"].wait(timeout=30) == 0, c.log(f"worker{r}")
    for s in range(2):
        assert c.procs[f"server{s}"].wait(timeout=30) == 0, c.log(f"server{s}")
    assert c.procs["scheduler"].wait(timeout=30) == 0, c.log("scheduler")
    sched = c.log("scheduler")
    assert "rebuilding it from its members" in sched and "job rebuilt: all its 4 members rejoined" in sched, sched
    for name in ("worker0", "worker1", "server0", "server1"):
        assert "is back: rejoined after" in c.log(name), c.log(name)


def test_a_scheduler_that_does_not_come_back_fails_the_job_naming_it(cluster_factory):
    c = started(cluster_factory, rounds=100_000, GRADHUB_PEER_TIMEOUT="3")
    c.wait_for("worker0", "ROUND 3", timeout=60)
    c.procs["scheduler"].kill()
    t0 = time.monotonic()
    for name in ("worker0", "worker1", "server0", "server1"):
        assert c.procs[name].wait(timeout=30) != 0, c.log(name)
    took = time.monotonic() - t0
    assert took < 3 + 10, took
    for name in ("worker0", "server0"):
        assert "did not come back within 3.0s" in c.log(name), c.log(name)


def test_a_restarted_scheduler_waits_for_every_member_and_names_the_one_missing(cluster_factory):
    c = started(cluster_factory, rounds=100_000, GRADHUB_PEER_TIMEOUT="4")
    c.wait_for("worker0", "ROUND 3", timeout=60)
    c.procs["worker1"].kill()  # gone with the scheduler: it never rejoins
    c.procs["scheduler"].kill()
    c.procs["scheduler"].wait()
    c.restart_scheduler()
    assert c.procs["scheduler"].wait(timeout=30) != 0, c.log("scheduler")
    assert "worker 1 did not rejoin within 4.0s" in c.log("scheduler"), c.log("scheduler")
    assert c.procs["worker0"].wait(timeout=30) != 0, c.log("worker0")
