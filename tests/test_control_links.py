"""Broken control connections mended while the scheduler lives: a proxy
between the members and the scheduler resets every connection or flips a
byte; each member dials again, its session resumes (each side sends again
what the other had not received), and the job ends exact, every process
exit 0. Roles started by hand, as across hosts."""

import time

import pytest
from conftest import free_port
from gradhub_lab.proxy import Proxy

MEMBERS = ("worker0", "worker1", "server0", "server1")


@pytest.fixture
def proxied(cluster_factory):
    """2 workers and 2 servers that reach the scheduler (127.0.0.1) only
    through a proxy (127.0.0.2); the workers declare a tensor and enter a
    barrier every 10 rounds, which the scheduler answers."""
    made = []

    def make(**env):
        port = free_port()
        proxy = Proxy("127.0.0.2", port, "127.0.0.1", port)
        made.append(proxy)
        c = cluster_factory(2, 2, threads=2, port=port, scheduler_via=f"127.0.0.2:{port}", **env)
        for r in range(2):
            c.start_worker(r, "restart.py", {"rounds": 80, "sleep": 0.03, "declare_every": 10})
        c.wait_for("worker0", "ROUND 3", timeout=60)
        return c, proxy

    yield make
    for p in made:
        p.close()


def rounds_done(c) -> int:
    return c.log("worker0").count("ROUND ")


def ends_exact(c) -> None:
    for r in range(2):
        c.wait_for(f"worker{r}", "PASS", timeout=90)
    for name in MEMBERS + ("scheduler",):
        assert c.procs[name].wait(timeout=30) == 0, c.log(name)


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_reset_control_connections_resume_and_the_job_ends_exact(proxied, encrypt):
    c, proxy = proxied(**({"GRADHUB_ENCRYPT": "1"} if encrypt else {}))
    for _ in range(3):
        # Each reset after training went on (a declaration and a barrier
        # answered in between, at least once).
        seen = rounds_done(c)
        deadline = time.monotonic() + 60
        while rounds_done(c) < seen + 12:
            assert time.monotonic() < deadline, c.log("worker0")
            time.sleep(0.05)
        proxy.reset()
    ends_exact(c)
    for name in MEMBERS:
        assert "the session resumed after" in c.log(name), c.log(name)
    sched = c.log("scheduler")
    assert sched.count("the session resumed on a new connection") >= 3 * 4, sched
    assert "taken over" not in sched and "failed" not in sched, sched


def test_a_control_frame_changed_on_the_way_is_refused_and_the_session_resumes(proxied):
    c, proxy = proxied()
    for direction in ("down", "up"):
        done = proxy.flips_done
        proxy.flip(direction, after=100, mask=0x10)
        deadline = time.monotonic() + 30
        while proxy.flips_done == done:
            assert time.monotonic() < deadline, "the flip never happened"
            time.sleep(0.01)
        time.sleep(0.5)
    ends_exact(c)
    logs = "".join(c.log(n) for n in MEMBERS + ("scheduler",))
    assert "checksum mismatch" in logs, logs
    assert "the session resumed on a new connection" in c.log("scheduler"), c.log("scheduler")


def test_control_connections_silent_past_the_keep_alive_are_made_again(proxied):
    """Every control connection stops carrying anything, for good, while
    both ends live (the proxy freezes them: a flow a middlebox lost). Half
    the peer timeout later each side takes its connection for broken; every
    member dials again and its session resumes before the peer timeout
    would have written it off, and the job ends exact."""
    c, proxy = proxied(GRADHUB_PEER_TIMEOUT="3")
    seen = rounds_done(c)
    proxy.freeze()
    deadline = time.monotonic() + 60
    while rounds_done(c) < seen + 20:
        assert time.monotonic() < deadline, c.log("worker0")
        time.sleep(0.05)
    ends_exact(c)
    sched = c.log("scheduler")
    assert "nothing heard for 1.5s; its connection is shut" in sched, sched
    assert sched.count("the session resumed on a new connection") >= 4, sched
    assert "taken over" not in sched and "failed" not in sched, sched
    for name in MEMBERS:
        assert "the session resumed after" in c.log(name), c.log(name)
