"""GRADHUB_DETERMINISTIC=1 end to end: two runs whose pushes arrive in
different orders (random sleeps, other seeds) give bitwise identical sums of
every dtype, each the sum in rank order; without it the float sums of the
same two runs differ (the data makes the order show), so the test can fail.
Server rounds with 3-4 pushers on 1 and 2 servers, the host stage (2 and 3
workers per emulated host), and a member set otherwise refused at init."""

import re

import pytest

from conftest import assert_all_passed, run_launch
from test_racks import rack_job

FLOATS = ["float32", "float64", "float16", "bfloat16"]


def hashes(workers: int, servers: int, hosts: list[int], seed: int, deterministic: bool) -> dict[str, str]:
    """Every dtype's hash of results, the same on every worker."""
    cfg = {"hosts": hosts, "delay_seed": seed}
    # The servers share emulated host 0 (the workers set their own): that
    # host's workers, if several, push to them by reference, the others over TCP.
    rc, out = run_launch(workers, servers, "deterministic.py", cfg,
                         env={"GRADHUB_DETERMINISTIC": int(deterministic), "GRADHUB_HOST_ID": "det-0"})
    assert_all_passed(rc, out, workers)
    got: dict[str, set[str]] = {}
    for dtype, h in re.findall(r"\[worker \d+\] HASH (\w+) (\w+)", out):
        got.setdefault(dtype, set()).add(h)
    assert sorted(got) == sorted(FLOATS + ["int64"]) and all(len(v) == 1 for v in got.values()), out[-3000:]
    return {d: v.pop() for d, v in got.items()}


@pytest.mark.parametrize("workers,servers,hosts", [
    (3, 1, [0, 1, 2]),        # one server, three pushers
    (4, 2, [0, 1, 2, 3]),     # two servers, four pushers
    (4, 1, [0, 0, 1, 2]),     # two workers on the server's host (its stage, by reference), then three pushers
    (3, 2, [0, 0, 0]),        # three workers on one host: the host stage's order
], ids=["3w-1s", "4w-2s", "host-stage-2", "host-stage-3"])
def test_sums_are_bitwise_identical_run_after_run_only_when_deterministic(workers, servers, hosts):
    a = hashes(workers, servers, hosts, seed=1, deterministic=True)
    b = hashes(workers, servers, hosts, seed=2, deterministic=True)
    assert a == b
    c = hashes(workers, servers, hosts, seed=1, deterministic=False)
    d = hashes(workers, servers, hosts, seed=2, deterministic=False)
    # Integers are exact in any order; float sums made in arrival order are not.
    assert c["int64"] == d["int64"] == a["int64"]
    assert [t for t in FLOATS if c[t] == d[t]] == []


def test_two_level_reduction_is_deterministic_too(cluster_factory):
    # 2 racks of 2 one-worker hosts: each owner adds its rack's 2 workers and the other rack's relayed sum.
    def run(seed: int, deterministic: bool) -> dict[str, str]:
        hosts, servers = [("r0", 1), ("r0", 1), ("r1", 1), ("r1", 1)], [("r0", 0), ("r0", 1), ("r1", 2), ("r1", 3)]
        cfg = {"hosts": [0, 1, 2, 3], "racks": True, "delay_seed": seed}
        c = rack_job(cluster_factory, hosts, servers, "deterministic.py", cfg, threads=1,
                     GRADHUB_DETERMINISTIC=int(deterministic), GRADHUB_PARTITION_BYTES=65536)
        got = {}
        for w in range(4):
            assert c.procs[f"worker{w}"].wait(timeout=180) == 0, c.log(f"worker{w}")
            got[w] = dict(re.findall(r"HASH (\w+) (\w+)", c.log(f"worker{w}")))
        assert "two levels: forced" in c.log("scheduler") and all(got[w] == got[0] for w in got), got
        c.close()
        return got[0]

    a, b, c, d = run(1, True), run(2, True), run(1, False), run(2, False)
    assert a == b and c["int64"] == d["int64"] == a["int64"]
    assert [t for t in FLOATS if c[t] == d[t]] == []


def test_a_member_set_otherwise_is_refused_at_init(cluster_factory):
    # The scheduler and the server sum in arrival order; the worker asks for rank order.
    c = cluster_factory(1, 1)
    p = c.start_worker(0, "deterministic.py", {"hosts": [0], "delay_seed": 0, "rounds": 1},
                       GRADHUB_DETERMINISTIC="1")
    assert p.wait(timeout=60) != 0
    assert "worker was started with GRADHUB_DETERMINISTIC=1 but the scheduler with 0" in c.log("worker0"), \
        c.log("worker0")


def test_the_torch_local_stage_is_refused_in_rank_order():
    # NCCL and gloo add in their own order: an explicit torch stage is an error, auto takes shared memory.
    env = {"GRADHUB_DETERMINISTIC": 1, "GRADHUB_LOCAL_STAGE": "torch"}
    rc, out = run_launch(2, 1, "torch_local_stage.py", {"sizes": [10], "rounds": 1}, env=env, timeout=120)
    assert rc != 0 and "use GRADHUB_LOCAL_STAGE=shm or auto" in out, out[-3000:]
