"""Two-level reduction across racks (PHub §3.4): each rack sums a chunk on
one of its own servers (the chunk's relay) before the rack's sum crosses the
core to the chunk's owner. Jobs started role by role on loopback, hosts told
apart by GRADHUB_HOST_ID and racks by GRADHUB_RACK."""

import re

import pytest


def rack_job(cluster_factory, hosts, servers, script, config, mode="on", sched=(), threads=2, **env):
    """`hosts`: per worker host, (rack, workers on it); `servers`: per
    server, (rack, host index or None for a CPU-only machine of its own),
    each with `threads` threads (so a rack's chunks are relayed by several
    threads, each linked to several owners).
    Returns the cluster with every worker started."""
    nw = sum(n for _, n in hosts)
    server_args, server_envs = [], []
    for rack, host in servers:
        server_args.append(["--rack", rack] + (["--colocated"] if host is not None else []))
        server_envs.append({"GRADHUB_HOST_ID": f"host{host}" if host is not None else f"cpu-{len(server_envs)}"})
    c = cluster_factory(nw, len(servers), threads, scheduler_args=["--rack-reduce", mode, *sched],
                        server_args=server_args, server_envs=server_envs, **env)
    rank = 0
    for h, (rack, n) in enumerate(hosts):
        for _ in range(n):
            c.start_worker(rank, script, config, GRADHUB_HOST_ID=f"host{h}", GRADHUB_RACK=rack)
            rank += 1
    return c


def every_member_passes(c, workers: int, servers: int) -> None:
    for w in range(workers):
        assert c.procs[f"worker{w}"].wait(timeout=180) == 0, c.log(f"worker{w}")
        assert f"PASS {w}" in c.log(f"worker{w}"), c.log(f"worker{w}")
    for s in range(servers):
        assert c.procs[f"server{s}"].wait(timeout=30) == 0, c.log(f"server{s}")
    assert c.procs["scheduler"].wait(timeout=30) == 0, c.log("scheduler")


def relayed(log: str) -> int:
    m = re.search(r"job complete \(.*?(?:, (\d+) relayed for this rack)?\)", log)
    assert m, log
    return int(m.group(1) or 0)


LAYOUTS = {
    # 2 racks of 2 one-worker hosts, a server on each host.
    "2x2": ([("r0", 1), ("r0", 1), ("r1", 1), ("r1", 1)], [("r0", 0), ("r0", 1), ("r1", 2), ("r1", 3)]),
    # Uneven, several workers per host (the host stage first): rack r0 holds
    # a host of 2 workers and one of 1, rack r1 one host of 2; and a third
    # rack of one CPU-only server, whose chunks only relays push.
    "uneven+cpu": ([("r0", 2), ("r0", 1), ("r1", 2)], [("r0", 0), ("r1", 2), ("r2", None)]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("average", [False, True])
def test_two_level_reduction_sums_exactly(cluster_factory, layout, average):
    hosts, servers = LAYOUTS[layout]
    nw = sum(n for _, n in hosts)
    cfg = {"sizes": [1, 3, 1000, 70_001], "dtypes": ["float32", "float16", "bfloat16"], "rounds": 3,
           "average": average}
    c = rack_job(cluster_factory, hosts, servers, "check_sums.py", cfg, GRADHUB_PARTITION_BYTES=16384)
    every_member_passes(c, nw, len(servers))
    sched = c.log("scheduler")
    assert "two levels: forced" in sched, sched
    # Every rack with workers relayed chunks owned in the others.
    for s, (rack, host) in enumerate(servers):
        log = c.log(f"server{s}")
        if host is not None:
            assert relayed(log) > 0, log
        else:
            assert relayed(log) == 0 and "job complete" in log, log


def test_training_with_the_optimizer_on_the_servers_across_racks(cluster_factory):
    # torch_train.py checks every worker's parameters against single-process
    # training on the combined batch: the optimizer config reaches owners
    # through the relays, and the init round keeps rank 0's parameters.
    # (The optimizer on the workers sums gradients as
    # test_two_level_reduction_sums_exactly does: not run again here.)
    hosts, servers = LAYOUTS["uneven+cpu"]
    cfg = {"model": "mlp", "opt": "adamw", "steps": 8, "server": True}
    c = rack_job(cluster_factory, hosts, servers, "torch_train.py", cfg, GRADHUB_PARTITION_BYTES=4096)
    every_member_passes(c, 5, 3)
    assert relayed(c.log("server0")) > 0, c.log("server0")


@pytest.mark.parametrize("core,expect", [("0.25", "two levels: PHub's model"), ("10", "one level: PHub's model")])
def test_phub_model_decides_and_the_log_says_why(cluster_factory, core, expect):
    # 2 pushers per rack, one server per host at 1 Gbit/s: a core link of
    # 0.25 Gbit/s makes the rack's sum cheaper to send than each host's share.
    hosts, servers = LAYOUTS["2x2"]
    cfg = {"sizes": [10_000], "dtypes": ["float32"], "rounds": 1}
    c = rack_job(cluster_factory, hosts, servers, "check_sums.py", cfg, mode="auto",
                 sched=["--link-gbit", "1", "--core-gbit", core], GRADHUB_PARTITION_BYTES=4096)
    every_member_passes(c, 4, 4)
    sched = c.log("scheduler")
    assert f'racks ["r0", "r1"]: {expect} with 2 pushing machine(s) per rack' in sched, sched
    total = sum(relayed(c.log(f"server{s}")) for s in range(4))
    assert (total > 0) == expect.startswith("two"), [c.log(f"server{s}") for s in range(4)]
    # Failover is off with two levels only.
    assert ("failover is off" in sched) == expect.startswith("two"), sched


def test_a_member_without_a_rack_fails_the_job_with_a_clear_error(cluster_factory):
    hosts, servers = LAYOUTS["2x2"]
    c = rack_job(cluster_factory, hosts, servers[:3] + [("", 3)], "check_sums.py", {"rounds": 1})
    for w in range(4):
        assert c.procs[f"worker{w}"].wait(timeout=60) != 0
        assert "server 3 gave no rack while other members did" in c.log(f"worker{w}"), c.log(f"worker{w}")
    assert c.procs["scheduler"].wait(timeout=30) != 0


def test_forcing_two_levels_without_a_server_in_every_rack_is_an_error(cluster_factory):
    hosts = [("r0", 1), ("r1", 1)]
    c = rack_job(cluster_factory, hosts, [("r0", 0)], "check_sums.py", {"rounds": 1})
    for w in range(2):
        assert c.procs[f"worker{w}"].wait(timeout=60) != 0
        log = c.log(f"worker{w}")
        assert 'two-level reduction (GRADHUB_RACK_REDUCE=on) is impossible: rack(s) ["r1"] hold workers' in log, log


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_server_fails_a_job_that_reduces_within_racks_in_bounded_time(cluster_factory, how):
    # A relay's owner (or a relay) gone: failover is off with two levels, so
    # every worker fails with the scheduler's report instead of hanging on a
    # rack's round (a frozen server is found by the peer timeout).
    import signal
    import time

    hosts, servers = LAYOUTS["2x2"]
    cfg = {"model": "mlp", "opt": "sgd", "steps": 200, "step_sleep": 0.05}
    c = rack_job(cluster_factory, hosts, servers, "torch_train.py", cfg, GRADHUB_PARTITION_BYTES=4096,
                 GRADHUB_PEER_TIMEOUT=3)
    c.wait_for("worker0", "STEP 3", 120)
    c.procs["server2"].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    lost = time.monotonic()
    try:
        for w in range(4):
            assert c.procs[f"worker{w}"].wait(timeout=60) != 0
            assert "server 2" in c.log(f"worker{w}"), c.log(f"worker{w}")
        assert time.monotonic() - lost < 30
        if how == "stop":  # found by the scheduler (a kill may be reported by a worker first)
            sched = c.log("scheduler")
            assert "failover is off with two-level reduction across racks" in sched, sched
    finally:
        c.procs["server2"].send_signal(signal.SIGCONT)
