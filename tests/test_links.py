"""Broken data links mended: a proxy between the workers and a server
resets the connections, flips bytes, or stops forwarding; the workers dial
again and re-send what was unanswered, and every sum stays exact (the
server counts each push once). Roles started by hand, as across hosts."""

import time

import pytest
from conftest import free_port
from gradhub_lab.proxy import Proxy

# Several chunks per tensor, three dtypes; 2 workers check every sum.
CONFIG = {"sizes": [1, 1000, 262_147], "rounds": 100,
          "sleep": {"0": 0.03, "1": 0.03}}


@pytest.fixture
def proxies():
    """Proxies made by a test, closed after it whatever its outcome."""
    made = []
    yield made
    for p in made:
        p.close()


def proxied_job(cluster_factory, proxies, **env):
    """2 workers and a server whose data port the workers reach only
    through a proxy (the server listens on 127.0.0.1, advertises 127.0.0.2)."""
    port = free_port()
    proxy = Proxy("127.0.0.2", port, "127.0.0.1", port)
    proxies.append(proxy)
    # Every push through a socket: no host stage, no shared memory with the server.
    env = {"GRADHUB_HOST_REDUCE": "0", "GRADHUB_SERVER_SHM": "0", **env}
    c = cluster_factory(2, 1, server_ports=[port],
                        server_args=[["--bind-host", "127.0.0.1", "--advertise-addr", "127.0.0.2"]], **env)
    for r in range(2):
        c.start_worker(r, "check_sums.py", CONFIG)
    c.wait_for("worker0", "LOCAL")
    c.wait_for("worker1", "LOCAL")
    return c, proxy


def finish(c, proxy):
    for r in range(2):
        c.wait_for(f"worker{r}", "PASS", timeout=90)
        assert c.procs[f"worker{r}"].wait(timeout=30) == 0, c.log(f"worker{r}")
    assert c.procs["server0"].wait(timeout=30) == 0, c.log("server0")
    proxy.close()


def wait_traffic(c, proxy, more: int, timeout: float = 30):
    """Until `more` bytes went up through the proxy (training is under way)."""
    start, deadline = proxy.bytes_up, time.monotonic() + timeout
    while proxy.bytes_up < start + more:
        assert time.monotonic() < deadline, (
            f"no traffic through the proxy for {timeout}s; its events: {proxy.events}\n"
            + "\n".join(f"--- {n}:\n{c.log(n)}" for n in ("worker0", "worker1", "server0")))
        time.sleep(0.01)


def flip_bytes(c, proxy, flips):
    """Flip a byte at each (direction, offset) of `flips`, once traffic is
    under way, each after the last one happened."""
    for direction, after in flips:
        wait_traffic(c, proxy, 1 << 20)
        done = proxy.flips_done
        proxy.flip(direction, after=after, mask=0x20)
        deadline = time.monotonic() + 30
        while proxy.flips_done == done:
            assert time.monotonic() < deadline, "the flip never happened"
            time.sleep(0.01)


def test_reset_links_are_mended_and_every_sum_stays_exact(cluster_factory, proxies):
    c, proxy = proxied_job(cluster_factory, proxies)
    for _ in range(3):
        wait_traffic(c, proxy, 2 << 20)
        proxy.reset()
    finish(c, proxy)
    logs = c.log("worker0") + c.log("worker1")
    assert logs.count("connected again") >= 3, logs
    # The server saw each reset too; had it not, the new connection would
    # have replaced the old one ("mended its link").
    assert "Connection reset by peer" in c.log("server0") or "mended its link" in c.log("server0")


def test_a_byte_changed_on_the_way_is_refused_and_sent_again_never_summed(cluster_factory, proxies):
    c, proxy = proxied_job(cluster_factory, proxies)
    # Into pushes (checked by the server) and into results (by the workers),
    # at offsets inside payloads and headers alike.
    flip_bytes(c, proxy, (("up", 300_000), ("down", 500_000), ("up", 1_000_003), ("down", 77)))
    finish(c, proxy)
    logs = c.log("worker0") + c.log("worker1") + c.log("server0")
    assert "checksum mismatch" in logs, logs
    assert "connected again" in logs, logs


def second_server_proxied(cluster_factory, proxies):
    """2 workers and 2 servers (2 s peer timeout); server 1 is reached only
    through a proxy (it listens on 127.0.0.1, advertises 127.0.0.2), by the
    workers and by server 0's links to it alike. No worker started yet."""
    port = free_port()
    proxy = Proxy("127.0.0.2", port, "127.0.0.1", port)
    proxies.append(proxy)
    env = {"GRADHUB_HOST_REDUCE": "0", "GRADHUB_SERVER_SHM": "0", "GRADHUB_PEER_TIMEOUT": "2"}
    c = cluster_factory(2, 2, server_ports=[free_port(), port],
                        server_args=[[], ["--bind-host", "127.0.0.1", "--advertise-addr", "127.0.0.2"]], **env)
    return c, proxy


def test_a_live_server_its_workers_cannot_reach_is_failed_over(cluster_factory, proxies):
    # Two servers; server 1 behind a proxy that resets every connection
    # and lets none through for longer than a link is mended (the peer
    # timeout): the workers give up, tell the scheduler, which writes server
    # 1 off although it still hears from it; its chunks move to server 0
    # and every sum stays exact.
    c, proxy = second_server_proxied(cluster_factory, proxies)
    for r in range(2):
        c.start_worker(r, "check_sums.py", CONFIG)
    c.wait_for("worker0", "LOCAL")
    wait_traffic(c, proxy, 2 << 20)
    proxy.reset()  # every connection lost, and no new one through
    proxy.down()
    c.wait_for("scheduler", "taken over", timeout=30)
    proxy.up()
    for r in range(2):
        c.wait_for(f"worker{r}", "PASS", timeout=90)
        assert c.procs[f"worker{r}"].wait(timeout=30) == 0, c.log(f"worker{r}")
    assert "unreachable from worker" in c.log("scheduler"), c.log("scheduler")
    assert c.procs["server0"].wait(timeout=30) == 0, c.log("server0")
    # Server 1 was told it is out, and left with an error.
    assert c.procs["server1"].wait(timeout=30) != 0 and "out of the job" in c.log("server1"), c.log("server1")


def test_a_worker_cut_off_from_every_server_is_named_and_no_server_is_written_off(cluster_factory, proxies):
    # Two servers, each behind its own proxy; worker 1 alone is cut off
    # from both (its network failed: every connection reset, none let
    # through), the other worker and the scheduler still reach everyone.
    # Worker 1 gives up on both servers and reports them: the scheduler
    # blames worker 1, which alone reported them, instead of writing the
    # healthy servers off one after the other.
    ports = [free_port(), free_port()]
    made = [Proxy(f"127.0.0.{2 + s}", p, "127.0.0.1", p) for s, p in enumerate(ports)]
    proxies.extend(made)
    env = {"GRADHUB_HOST_REDUCE": "0", "GRADHUB_SERVER_SHM": "0", "GRADHUB_PEER_TIMEOUT": "2"}
    c = cluster_factory(2, 2, server_ports=ports,
                        server_args=[["--bind-host", "127.0.0.1", "--advertise-addr", f"127.0.0.{2 + s}"]
                                     for s in range(2)], **env)
    for r in range(2):
        c.start_worker(r, "check_sums.py", CONFIG)
    c.wait_for("worker0", "LOCAL")
    for p in made:
        wait_traffic(c, p, 1 << 20)
    for p in made:
        p.cut(1)
    c.wait_for("scheduler", "job failed", timeout=30)
    sched = c.log("scheduler")
    assert "worker 1 cannot reach servers 0, 1, which no other worker reported: it is the one cut off" in sched, sched
    assert "taken over" not in sched and "moving its chunks" not in sched, sched
    for name in ("worker0", "worker1", "server0", "server1"):
        assert c.procs[name].wait(timeout=30) != 0, c.log(name)
    assert "worker 1" in c.log("worker0") and "it is the one cut off" in c.log("worker1"), c.log("worker1")


def test_a_broken_replica_link_is_dialled_again_and_training_stays_exact(cluster_factory, proxies):
    # The optimizer on the servers (AdamW): each chunk's state is kept on
    # the other server, over a server-to-server link. Server 1 is reached
    # through a proxy, links from server 0 included; every connection
    # through it is reset twice. Server 0 dials its replica again and sends
    # it every chunk's state; the workers mend their links; every worker
    # ends with the parameters of single-process training (torch_train.py).
    c, proxy = second_server_proxied(cluster_factory, proxies)
    cfg = {"model": "mlp", "opt": "adamw", "steps": 30, "step_sleep": 0.05, "server": True}
    for r in range(2):
        c.start_worker(r, "torch_train.py", cfg)
    for step in ("STEP 5", "STEP 15"):
        c.wait_for("worker0", step, timeout=120)
        proxy.reset()
    for r in range(2):
        assert c.procs[f"worker{r}"].wait(timeout=120) == 0, c.log(f"worker{r}")
        assert f"PASS {r}" in c.log(f"worker{r}"), c.log(f"worker{r}")
    assert "linked to replica" in c.log("server0") and "again" in c.log("server0"), c.log("server0")
    for name in ("scheduler", "server0", "server1"):
        assert c.procs[name].wait(timeout=30) == 0, c.log(name)
