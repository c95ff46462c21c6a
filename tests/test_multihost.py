"""Every role on its own emulated host (network namespaces joined by a bridge):
workers reach servers only through the addresses servers advertise."""

import os
import re
import subprocess
import sys
import time

import pytest

from conftest import WORKERS, job_env
from gradhub_lab.netns import check_available as netns_available

SUFFIX = f"{os.getpid() % 100000}"
BRIDGE = f"ghbr{SUFFIX}"
SUBNET = "10.213.{}.{}"


def in_ns(ns: str, argv: list[str], env: dict) -> subprocess.Popen:
    """Start `argv` in network namespace `ns`, output captured."""
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def run_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every process's output; all must exit 0 (any left running is killed)."""
    try:
        outs = [p.communicate(timeout=timeout)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    return outs


def sh(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


@pytest.fixture
def hosts():
    reason = netns_available()
    if reason:
        pytest.skip(reason)
    made, veths = [], []
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "link", "set", BRIDGE, "up")

    def add(i: int) -> tuple[str, str]:
        ns, veth = f"gh{SUFFIX}h{i}", f"gh{SUFFIX}v{i}"
        ip = SUBNET.format(0, i + 1)
        sh("ip", "netns", "add", ns)
        made.append(ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        veths.append(veth)
        sh("ip", "link", "set", veth, "master", BRIDGE)
        sh("ip", "link", "set", veth, "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns, ip

    try:
        yield add
    finally:
        # Deleting a namespace frees its veth pair asynchronously; deleting our
        # end first is synchronous, so the next test can reuse the names.
        for veth in veths:
            sh("ip", "link", "del", veth, check=False)
        for ns in made:
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", BRIDGE, check=False)


def test_job_across_emulated_hosts(hosts):
    sched_ns, sched_ip = hosts(0)
    server_hosts = [hosts(1), hosts(2)]
    worker_hosts = [hosts(3), hosts(4), hosts(5)]
    port = 9555
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:{port}", GRADHUB_NUM_WORKERS=3, GRADHUB_NUM_SERVERS=2,
                  GH_TEST='{"sizes": [1, 1000, 300001], "dtypes": ["float32", "bfloat16"], "rounds": 2}')
    py = sys.executable
    procs = [subprocess.Popen(["ip", "netns", "exec", sched_ns, py, "-m", "gradhub", "scheduler"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
    for i, (ns, _) in enumerate(server_hosts):
        # No --advertise-addr: each server must advertise its own host's address.
        argv = ["ip", "netns", "exec", ns, py, "-m", "gradhub", "server", "--threads", "2"]
        if i == 1:
            argv.append("--colocated")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for r, (ns, _) in enumerate(worker_hosts):
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, py, str(WORKERS / "check_sums.py")],
                                      env=dict(env, GRADHUB_RANK=str(r)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = run_all(procs, timeout=120)
    for r in range(3):
        assert f"PASS {r}" in outs[3 + r]
        # One worker per host: hosts are told apart by network namespace too.
        assert "LOCAL 0 of 1" in outs[3 + r], outs[3 + r]
    for i, (_, ip) in enumerate(server_hosts):
        assert f"on {ip} ports" in outs[1 + i], outs[1 + i]


def test_several_workers_per_emulated_host(hosts):
    """Hosts of 3 and 1 workers (each in its own network namespace, started
    role by role), a colocated server on each and a CPU-only one: sums are
    exact, and the 3 workers that share a host sum there first."""
    sched_ns, sched_ip = hosts(0)
    a, b, cpu = hosts(1), hosts(2), hosts(3)
    port = 9556
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:{port}", GRADHUB_NUM_WORKERS=4, GRADHUB_NUM_SERVERS=3,
                  GH_TEST='{"sizes": [1, 1000, 300001], "dtypes": ["float32", "float16", "bfloat16"], '
                          '"rounds": 3}')
    py = sys.executable
    procs = [in_ns(sched_ns, [py, "-m", "gradhub", "scheduler"], env)]
    for ns, colocated in ((a[0], True), (b[0], True), (cpu[0], False)):
        procs.append(in_ns(ns, [py, "-m", "gradhub", "server", "--threads", "1"] + ["--colocated"] * colocated, env))
    # Ranks 0, 2, 3 on host a (local ranks given as a launcher would), rank 1 alone on b.
    layout = [(a[0], {"GRADHUB_LOCAL_RANK": "0", "GRADHUB_LOCAL_SIZE": "3"}), (b[0], {}),
              (a[0], {"GRADHUB_LOCAL_RANK": "1", "GRADHUB_LOCAL_SIZE": "3"}),
              (a[0], {"GRADHUB_LOCAL_RANK": "2", "GRADHUB_LOCAL_SIZE": "3"})]
    for r, (ns, local) in enumerate(layout):
        procs.append(in_ns(ns, [py, str(WORKERS / "check_sums.py")], dict(env, GRADHUB_RANK=str(r), **local)))
    outs = run_all(procs, timeout=180)
    for r in range(4):
        assert f"PASS {r}" in outs[4 + r]
    # The host stage is said once per host, by its first worker.
    assert "3 workers on this host" in outs[4 + 0], outs[4 + 0]
    for r in (1, 2, 3):
        assert "workers on this host" not in outs[4 + r], outs[4 + r]
    # The servers expect one push per host and chunk.
    assert "4 workers on 2 hosts" in outs[1]


def test_process_sets_across_emulated_hosts(hosts):
    """Horovod's process sets with each set spread over two hosts (ranks 0,
    1 on one, 2, 3 on the other; sets of even and odd ranks), started role
    by role: every collective over a set, and each set's training, exact."""
    sched_ns, sched_ip = hosts(0)
    a, b, cpu = hosts(1), hosts(2), hosts(3)
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:9557", GRADHUB_NUM_WORKERS=4, GRADHUB_NUM_SERVERS=2)
    py = sys.executable
    procs = [in_ns(sched_ns, [py, "-m", "gradhub", "scheduler"], env)]
    procs += [in_ns(a[0], [py, "-m", "gradhub", "server", "--colocated"], env),
              in_ns(cpu[0], [py, "-m", "gradhub", "server"], env)]
    for r, ns in enumerate((a[0], a[0], b[0], b[0])):
        procs.append(in_ns(ns, [py, str(WORKERS / "torch_process_sets.py")], dict(env, GRADHUB_RANK=str(r))))
    outs = run_all(procs, timeout=240)
    for r in range(4):
        assert f"PASS {r}" in outs[3 + r], outs[3 + r]


def test_a_server_joins_a_job_across_emulated_hosts(hosts, tmp_path):
    """A CPU-only server on a host of its own joins a running job (2 workers
    sharing host a with its colocated server, 1 on host b, a CPU-only server):
    the workers reach it at the address it advertises, it takes chunks, and
    every sum stays exact. Roles started one by one."""
    sched_ns, sched_ip = hosts(0)
    a, b, cpu, late = hosts(1), hosts(2), hosts(3), hosts(4)
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:9558", GRADHUB_NUM_WORKERS=3, GRADHUB_NUM_SERVERS=2,
                  GH_TEST='{"steps": 150, "sleep": 0.0}')
    py = sys.executable
    logs = {}

    def start(name, ns, argv, **extra):
        logs[name] = tmp_path / f"{name}.log"
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=dict(env, **extra),
                                stdout=open(logs[name], "wb"), stderr=subprocess.STDOUT)

    procs = {"scheduler": start("scheduler", sched_ns, [py, "-m", "gradhub", "scheduler"]),
             "server0": start("server0", a[0], [py, "-m", "gradhub", "server", "--threads", "1", "--colocated"]),
             "server1": start("server1", cpu[0], [py, "-m", "gradhub", "server", "--threads", "1"])}
    for r, ns in enumerate((a[0], a[0], b[0])):
        procs[f"worker{r}"] = start(f"worker{r}", ns, [py, str(WORKERS / "failover.py")], GRADHUB_RANK=str(r))
    try:
        deadline = time.monotonic() + 120
        while "STEP 10" not in logs["worker0"].read_text(errors="replace"):
            assert time.monotonic() < deadline and procs["worker0"].poll() is None, logs["worker0"].read_text()
            time.sleep(0.05)
        procs["server2"] = start("server2", late[0], [py, "-m", "gradhub", "server", "--threads", "2"])
        for name, p in procs.items():
            if p.wait(timeout=180) != 0:
                every = "\n".join(f"===== {n}\n{f.read_text(errors='replace')[-4000:]}" for n, f in logs.items())
                raise AssertionError(f"{name} failed:\n{every}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    out = {n: f.read_text(errors="replace") for n, f in logs.items()}
    for r in range(3):
        assert f"PASS {r}" in out[f"worker{r}"] and "server 2 joined the job" in out[f"worker{r}"], out[f"worker{r}"]
    assert f"server 2 ({late[1]}, 2 thread(s), CPU-only) joined the running job" in out["scheduler"], out["scheduler"]
    assert f"on {late[1]} ports" in out["server2"], out["server2"]
    m = re.search(r"job complete \((\d+) chunk rounds summed", out["server2"])
    assert m and int(m.group(1)) > 0, out["server2"]


def test_two_level_reduction_across_racks_of_emulated_hosts(hosts):
    """Two racks of emulated hosts (rack r0: host a with 2 workers and its
    colocated server, host b with 1 worker and its; rack r1: host c with 2
    workers and its server), roles started one by one, racks named with
    GRADHUB_RACK and --rack: relays reach owners in the other rack at their
    advertised addresses, and every sum is exact."""
    sched_ns, sched_ip = hosts(0)
    a, b, c = hosts(1), hosts(2), hosts(3)
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:9559", GRADHUB_NUM_WORKERS=5, GRADHUB_NUM_SERVERS=3,
                  GRADHUB_RACK_REDUCE="on", GRADHUB_PARTITION_BYTES=65536,
                  GH_TEST='{"sizes": [1, 1000, 300001], "dtypes": ["float32", "float16", "bfloat16"], '
                          '"rounds": 2}')
    py = sys.executable
    procs = [in_ns(sched_ns, [py, "-m", "gradhub", "scheduler"], env)]
    for ns, rack in ((a[0], "r0"), (b[0], "r0"), (c[0], "r1")):
        procs.append(in_ns(ns, [py, "-m", "gradhub", "server", "--threads", "1", "--colocated", "--rack", rack], env))
    for r, (ns, rack) in enumerate(((a[0], "r0"), (a[0], "r0"), (b[0], "r0"), (c[0], "r1"), (c[0], "r1"))):
        procs.append(in_ns(ns, [py, str(WORKERS / "check_sums.py")], dict(env, GRADHUB_RANK=str(r), GRADHUB_RACK=rack)))
    outs = run_all(procs, timeout=180)
    for r in range(5):
        assert f"PASS {r}" in outs[4 + r], outs[4 + r]
    assert 'racks ["r0", "r1"]: two levels: forced' in outs[0], outs[0]
    for i, (_, ip) in enumerate((a, b, c)):
        assert f"on {ip} ports" in outs[1 + i], outs[1 + i]
        assert "relayed for this rack" in outs[1 + i], outs[1 + i]


def test_a_link_down_for_4s_and_training_resumes_within_2s_of_its_return(hosts):
    """A worker host's link goes down for 4 s mid-run (its veth, as a
    cable pulled): its data socket fails after 2 s of silence, the worker
    dials again in short attempts, and training goes on within 2 s of the
    link's return, every sum exact (TCP's own retries would wait seconds
    longer)."""
    sched_ns, sched_ip = hosts(0)
    server_ns, _ = hosts(1)
    worker_hosts = [hosts(2), hosts(3)]
    veth = f"gh{SUFFIX}v3"  # the second worker host's end on the bridge
    port = 9556
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:{port}", GRADHUB_NUM_WORKERS=2, GRADHUB_NUM_SERVERS=1,
                  GH_TEST='{"steps": 120, "pause": 0.05}')
    py = sys.executable
    procs = [in_ns(sched_ns, [py, "-m", "gradhub", "scheduler"], env),
             in_ns(server_ns, [py, "-m", "gradhub", "server", "--threads", "1"], env)]
    logs = [os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gh-link-{SUFFIX}-{r}.log") for r in range(2)]
    files = [open(log, "wb") for log in logs]
    for r, (ns, _) in enumerate(worker_hosts):
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, py, str(WORKERS / "steps.py")],
                                      env=dict(env, GRADHUB_RANK=str(r)), stdout=files[r], stderr=subprocess.STDOUT))

    def steps(r: int) -> list[float]:
        with open(logs[r]) as f:
            return [float(m.group(1)) for m in re.finditer(r"^STEP \d+ ([\d.]+)$", f.read(), re.M)]

    try:
        deadline = time.monotonic() + 60
        while len(steps(1)) < 20:
            assert time.monotonic() < deadline and procs[3].poll() is None, open(logs[1]).read()
            time.sleep(0.05)
        sh("ip", "link", "set", veth, "down")
        time.sleep(4)
        sh("ip", "link", "set", veth, "up")
        back = time.time()
        outs = run_all(procs[:2], timeout=120)
        for p in procs[2:]:
            assert p.wait(timeout=120) == 0, [open(log).read() for log in logs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in files:
            f.close()
    texts = [open(log).read() for log in logs]
    for r in range(2):
        assert f"PASS {r}" in texts[r], texts[r]
    after = [t for t in steps(1) if t > back]
    assert after, texts[1]
    resumed = after[0] - back
    print(f"training resumed {resumed:.2f}s after the link came back")
    assert resumed < 2.0, (resumed, texts[1], outs[1])
    assert "connected again" in texts[1], texts[1]
    for log in logs:
        os.unlink(log)
    assert "job complete" in outs[1]


def test_a_host_cut_off_from_its_server_past_the_peer_timeout_fails_naming_the_link(hosts):
    """A partition from some peers, not all: worker 1's host loses its route
    to the server (a blackhole route) but still reaches the scheduler. Its
    link is mended for the peer timeout, then given up: the job fails,
    naming the link, within a bound (no hang, nothing summed wrong)."""
    sched_ns, sched_ip = hosts(0)
    server_ns, server_ip = hosts(1)
    worker_hosts = [hosts(2), hosts(3)]
    port = 9557
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:{port}", GRADHUB_NUM_WORKERS=2, GRADHUB_NUM_SERVERS=1,
                  GRADHUB_PEER_TIMEOUT="3", GH_TEST='{"steps": 400, "pause": 0.05}')
    py = sys.executable
    procs = [in_ns(sched_ns, [py, "-m", "gradhub", "scheduler"], env),
             in_ns(server_ns, [py, "-m", "gradhub", "server", "--threads", "1"], env)]
    procs += [in_ns(ns, [py, str(WORKERS / "steps.py")], dict(env, GRADHUB_RANK=str(r)))
              for r, (ns, _) in enumerate(worker_hosts)]
    try:
        time.sleep(4)  # joined and training (400 steps take about 30 s)
        assert all(p.poll() is None for p in procs)
        sh("ip", "-n", worker_hosts[1][0], "route", "add", "blackhole", f"{server_ip}/32")
        cut = time.monotonic()
        outs = [p.communicate(timeout=60)[0].decode() for p in procs]
        took = time.monotonic() - cut
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode != 0 for p in procs), outs
    assert "could not be made again within 3.0s" in outs[3], outs[3]
    assert "server 0 (" + server_ip in outs[3], outs[3]
    # The others name the worker that failed the job.
    assert "worker 1" in outs[2], outs[2]
    assert not any("WRONG" in o or "AssertionError" in o for o in outs), outs
    # Silent for the socket's 2 s, mended for 3 s, then the job's end.
    assert took < 20, took


def test_point_to_point_and_a_pipeline_across_emulated_hosts(hosts):
    """torch's send and recv on the gradhub backend, started as torchrun
    starts it (rank 0 hosts the job at MASTER_ADDR): ranks 0 and 1 on host
    a, rank 2 on host b. Each member listens on its own host's address (the
    route to the job's scheduler) and the others reach it there: every
    point-to-point check passes (tests/workers/backend_p2p.py), then a
    2-stage pipeline with a stage on each host trains equal to one process,
    and so does DDP with `ddp_forward_overlap` on one rank a host."""
    a, b = hosts(1), hosts(2)
    py = sys.executable

    def run(script: str, layout: list[str], port: int) -> list[str]:
        procs = [in_ns(ns, [py, str(WORKERS / script)],
                       job_env(MASTER_ADDR=a[1], MASTER_PORT=port, RANK=q, WORLD_SIZE=len(layout)))
                 for q, ns in enumerate(layout)]
        return run_all(procs, timeout=180)

    outs = run("backend_p2p.py", [a[0], a[0], b[0]], 9560)
    for q in range(3):
        assert f"PASS {q}" in outs[q], outs[q]
    outs = run("backend_pipeline.py", [a[0], b[0]], 9561)
    for q in range(2):
        assert f"stage {q} of 2: GPipe then 1F1B equal one process (on cpu)" in outs[q], outs[q]
    # DDP whose exchange overlaps the next forward pass (gradhub.torch.ddp_forward_overlap), one rank a host.
    outs = run("backend_ddp_overlap.py", [a[0], b[0]], 9562)
    for q in range(2):
        assert f"PASS {q}" in outs[q] and "sgd, gradient_as_bucket_view=True: 12 steps equal" in outs[q], outs[q]


def test_a_2d_mesh_group_moves_no_byte_on_a_host_without_its_members(hosts):
    """A 2-D DeviceMesh on the gradhub backend, 2 hosts x 4 workers, the job's
    server on a host of its own: every group's collectives are exact
    (tests/workers/backend_mesh.py), and while host a's group sums and
    reduce-scatters 80 MiB, host b's link carries nothing of it (its
    workers take no part in a group they are not in): under 64 KiB there,
    the control traffic and a barrier. Host a's link carries its theory:
    each of its 4 workers pushes for itself (no host stage for a group's
    tensors), 4 MiB each way per all_reduce, 4 MiB up and its 1 MiB shard
    down per reduce_scatter."""
    sched_ns, sched_ip = hosts(0)
    a, b, srv = hosts(1), hosts(2), hosts(3)
    py = sys.executable
    env = job_env(GRADHUB_SCHEDULER=f"{sched_ip}:9562", GRADHUB_NUM_WORKERS=8, GRADHUB_NUM_SERVERS=1)
    procs = [in_ns(sched_ns, [py, "-m", "gradhub", "scheduler"], env),
             in_ns(srv[0], [py, "-m", "gradhub", "server", "--threads", "2"], env)]
    layout = [a[0]] * 4 + [b[0]] * 4
    procs += [in_ns(ns, [py, str(WORKERS / "backend_mesh.py")],
                    dict(env, MASTER_ADDR=a[1], MASTER_PORT="9563", RANK=str(q), WORLD_SIZE="8",
                         GH_TEST='{"hosts": 2}'))
              for q, ns in enumerate(layout)]
    outs = run_all(procs, timeout=240)
    moved = {}
    for q in range(8):
        out = outs[2 + q]
        assert f"PASS {q}" in out, out
        moved[q] = int(re.search(rf"^LINK {q} (\d+)$", out, re.M).group(1))
    print("link bytes while host a's group worked:", moved)
    theory = 10 * 4 * ((4 + 4) + (4 + 1)) * 2**20
    assert all(0.98 <= moved[q] / theory <= 1.1 for q in range(4)), (moved, theory)
    assert all(moved[q] < 64 << 10 for q in range(4, 8)), moved
