"""A scheduler killed mid-run (SIGKILL) and started again on its address:
the data plane trains on meanwhile, every member rejoins, the job is
rebuilt from what they report, and training ends with exact sums; one that
does not come back fails the job within the peer timeout, named. Roles
started by hand."""

import json
import os
import signal
import subprocess
import sys
import time

from conftest import free_port, job_env, worker_argv


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


def _pids_of(needle: bytes) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if needle in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def test_gradhub_launch_starts_a_killed_scheduler_again_and_the_job_succeeds():
    port = free_port()
    argv = [sys.executable, "-m", "gradhub", "launch", "-w", "2", "-s", "1", "--port", str(port), "--",
            *worker_argv("restart.py")]
    cfg = {"rounds": 60, "sleep": 0.03, "declare_every": 15}
    p = subprocess.Popen(argv, env=job_env(GH_TEST=json.dumps(cfg)), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    out = b""
    try:
        assert p.stdout is not None
        while b"ROUND 3" not in out:
            line = p.stdout.readline()
            assert line, out.decode(errors="replace")
            out += line
        sched = _pids_of(f"scheduler\x00--bind\x00127.0.0.1:{port}".encode())
        assert len(sched) == 1, sched
        os.kill(sched[0], signal.SIGKILL)
        rest, _ = p.communicate(timeout=120)
        out += rest
    finally:
        if p.poll() is None:
            p.kill()
    text = out.decode(errors="replace")
    assert p.returncode == 0, text[-6000:]
    assert "was killed by SIGKILL; starting it again on its address" in text, text[-6000:]
    assert "[worker 0] PASS" in text and "[worker 1] PASS" in text, text[-6000:]
    assert "job rebuilt: all its 3 members rejoined" in text, text[-6000:]


def test_a_job_that_lost_a_server_is_rebuilt_without_it(cluster_factory):
    """A server killed (its chunks move to the other), then the scheduler:
    the restarted scheduler does not wait for the lost server (the members
    say it was lost) and places nothing on it."""
    c = started(cluster_factory, rounds=90)
    c.wait_for("worker0", "ROUND 3", timeout=60)
    c.procs["server1"].kill()
    deadline = time.monotonic() + 30
    while "taken over" not in c.log("scheduler"):
        assert time.monotonic() < deadline, c.log("scheduler")
        time.sleep(0.05)
    c.procs["scheduler"].kill()
    c.procs["scheduler"].wait()
    time.sleep(0.5)
    c.restart_scheduler()
    for r in range(2):
        c.wait_for(f"worker{r}", "PASS", timeout=90)
        assert c.procs[f"worker{r}"].wait(timeout=30) == 0, c.log(f"worker{r}")
    assert c.procs["server0"].wait(timeout=30) == 0, c.log("server0")
    assert c.procs["scheduler"].wait(timeout=30) == 0, c.log("scheduler")
    assert "job rebuilt: all its 3 members rejoined" in c.log("scheduler"), c.log("scheduler")
