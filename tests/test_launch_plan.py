"""The launch plan (launch/plan.py, launch/slurm.py): every process of a job,
where it runs, its command line and its environment, from the command line
as `gradhub launch` parses it and the hosts (-H, a hostfile, a discovery
script's, Slurm's). Nothing here starts a process: `subprocess.Popen`
fails the test if anything tries."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gradhub import _env, cli
from gradhub.launch import discovery, flags, slurm
from gradhub.launch.elastic import Elastic
from gradhub.launch.hosts import Host, parse_hostfile, parse_hosts
from gradhub.launch.plan import GRADHUB, Site, layout, plan

CMD = ["python", "train.py", "--epochs", "3"]
ENVIRON = {"PATH": "/usr/bin", "HOME": "/home/me", "SSH_AUTH_SOCK": "/tmp/agent", "XDG_RUNTIME_DIR": "/run/user/1",
           "MY_SETTING": "kept"}


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError(f"a plan started a process: {a}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def options(*argv: str) -> flags.LaunchOptions:
    """The options of `gradhub launch ARGV -- CMD`, parsed as the command does."""
    p = cli.build_parser()
    args = p.parse_args(["launch", *argv, "--", *CMD])

    def error(msg: str):
        raise AssertionError(f"usage error: {msg}")

    return flags.options(args, error)


def by_label(p) -> dict:
    return {s.label: s for s in p.processes}


def test_a_job_on_this_machine():
    opts = options("-w", "3", "-s", "2", "--colocated-servers", "1", "--server-threads", "4", "--port", "9100",
                   "--partition-bytes", "65536", "--no-failover", "--join-timeout", "45")
    assert opts.command == tuple(CMD) and not opts.remote and not opts.elastic
    site = Site(scheduler="127.0.0.1:9100", environ=ENVIRON, token="made-up", store=("127.0.0.1", 9101))
    p = plan(opts, layout(opts, None), site)
    assert [s.label for s in p.processes] == ["scheduler", "server 0", "server 1", "worker 0", "worker 1", "worker 2"]
    assert all(s.host is None for s in p.processes) and p.hosts == () and p.elastic is None
    sched = p.processes[0]
    assert sched.argv[:len(GRADHUB)] == GRADHUB and sched.argv[len(GRADHUB):len(GRADHUB) + 3] == (
        "scheduler", "--bind", "127.0.0.1:9100")
    assert "--service" not in sched.argv and "--no-failover" in sched.argv
    assert sched.argv[sched.argv.index("--partition-bytes") + 1] == "65536"
    assert sched.argv[sched.argv.index("--join-timeout") + 1] == "45.0"
    s0, s1 = p.servers
    # Servers on loopback, ranked; the first C colocated.
    assert s0.argv[len(GRADHUB):] == ("server", "--threads", "4", "--rank", "0", "--colocated",
                                      "--advertise-addr", "127.0.0.1", "--bind-host", "127.0.0.1")
    assert "--colocated" not in s1.argv and s1.argv[s1.argv.index("--rank") + 1] == "1"
    for s in p.processes:
        # This machine's processes keep the whole environment, plus the job's.
        assert s.env["HOME"] == "/home/me" and s.env["MY_SETTING"] == "kept"
        assert s.env["GRADHUB_JOB_TOKEN"] == "made-up" and s.env["GRADHUB_SCHEDULER"] == "127.0.0.1:9100"
        assert (s.env["GRADHUB_NUM_WORKERS"], s.env["GRADHUB_NUM_SERVERS"]) == ("3", "2")
        assert s.env["GRADHUB_PARTITION_BYTES"] == "65536" and s.env["GRADHUB_ROLE"] == s.role
    for r, w in enumerate(p.workers):
        assert w.argv == tuple(CMD) and w.rank == r
        e = w.env
        assert (e["GRADHUB_RANK"], e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == (str(r), str(r), str(r), "3")
        assert (e["NODE_RANK"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) == ("0", "0", "1")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) == ("127.0.0.1", "9101", "3")
        assert "GRADHUB_LOCAL_RANK" not in e  # on one machine the scheduler counts them


def test_the_users_own_token_is_kept():
    opts = options("-w", "1")
    environ = {**ENVIRON, "GRADHUB_JOB_TOKEN": "users-own"}
    p = plan(opts, layout(opts, None), Site("127.0.0.1:1", environ, token=None, store=("127.0.0.1", 2)))
    assert {s.env["GRADHUB_JOB_TOKEN"] for s in p.processes} == {"users-own"}
    # --colocated: every server.
    opts = options("-w", "2", "-s", "3", "--colocated")
    p = plan(opts, layout(opts, None), Site("127.0.0.1:1", ENVIRON, store=("127.0.0.1", 2)))
    assert all("--colocated" in s.argv for s in p.servers) and len(p.servers) == 3


def test_a_job_across_hosts_from_H():
    opts = options("-H", "node1:2,node2:2,node3:4", "-w", "3")
    assert opts.remote
    lay = layout(opts, parse_hosts(opts.hosts))
    assert lay.hosts == ("node1", "node2") and lay.servers == ("node1", "node2")  # node3's slots unused
    assert lay.every_host == ["node1", "node2"]
    p = plan(opts, lay, Site("10.0.0.9:9000", ENVIRON, token="t", store=("node1", 29400)))
    assert list(by_label(p)) == ["scheduler", "server 0@node1", "server 1@node2", "worker 0@node1",
                                 "worker 1@node1", "worker 2@node2"]
    sched = p.processes[0]
    assert sched.host is None and sched.env["HOME"] == "/home/me"  # the scheduler runs here
    for s in p.servers:
        assert s.argv[len(GRADHUB):] == ("server", "--threads", "1", "--rank", str(s.rank), "--colocated")
        assert "--advertise-addr" not in s.argv  # a remote server finds its own address
    expect = {  # rank: host, local rank, local size, node
        0: ("node1", 0, 2, 0), 1: ("node1", 1, 2, 0), 2: ("node2", 0, 1, 1)}
    for w in p.workers:
        host, local, size, node = expect[w.rank]
        e = w.env
        assert w.host == host and w.argv == tuple(CMD)
        assert (e["GRADHUB_RANK"], e["RANK"], e["GRADHUB_LOCAL_RANK"], e["LOCAL_RANK"]) == (
            str(w.rank), str(w.rank), str(local), str(local))
        assert e["GRADHUB_LOCAL_SIZE"] == e["LOCAL_WORLD_SIZE"] == str(size)
        assert (e["NODE_RANK"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) == (str(node), str(node), "2")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) == ("node1", "29400", "3")
        assert e["GRADHUB_SCHEDULER"] == "10.0.0.9:9000" and e["GRADHUB_JOB_TOKEN"] == "t"
    for s in p.processes[1:]:
        # What travels to another host: the job's environment, not this login's.
        assert s.env["MY_SETTING"] == "kept" and s.env["PATH"] == "/usr/bin"
        assert not {"HOME", "SSH_AUTH_SOCK", "XDG_RUNTIME_DIR"} & set(s.env), s.label


def test_the_scheduler_on_the_first_host_and_cpu_only_servers():
    opts = options("-H", "a:1,b:1", "--scheduler-host", "first", "--server-hosts", "c,d,e")
    lay = layout(opts, parse_hosts(opts.hosts))
    assert lay.every_host == ["a", "b", "c", "d", "e"] and lay.cpu_servers
    p = plan(opts, lay, Site("192.168.1.1:7000", ENVIRON, store=("192.168.1.1", 7001)))
    sched = p.processes[0]
    assert (sched.label, sched.host) == ("scheduler@a", "a") and "HOME" not in sched.env
    assert [(s.label, s.host) for s in p.servers] == [("server 0@c", "c"), ("server 1@d", "d"), ("server 2@e", "e")]
    assert not any("--colocated" in s.argv for s in p.servers)
    assert {w.env["GRADHUB_NUM_SERVERS"] for w in p.workers} == {"3"}
    assert [w.host for w in p.workers] == ["a", "b"]


def test_a_job_from_a_hostfile(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# the GPU nodes\ngpu1 slots=2\ngpu2:3   # the other\n")
    opts = options("--hostfile", str(hf), "-s", "5")  # -s is for this machine: across hosts, one per host
    lay = layout(opts, parse_hostfile(opts.hostfile))
    assert lay.workers == 5 and lay.hosts == ("gpu1", "gpu2")  # -w: every slot
    p = plan(opts, lay, Site("10.0.0.1:9000", ENVIRON, store=("gpu1", 5000)))
    assert [(w.host, w.env["GRADHUB_LOCAL_RANK"], w.env["LOCAL_WORLD_SIZE"], w.env["NODE_RANK"]) for w in p.workers] == [
        ("gpu1", "0", "2", "0"), ("gpu1", "1", "2", "0"),
        ("gpu2", "0", "3", "1"), ("gpu2", "1", "3", "1"), ("gpu2", "2", "3", "1")]
    assert len(p.servers) == 2 and {w.env["GRADHUB_NUM_SERVERS"] for w in p.workers} == {"2"}


def test_an_elastic_job_on_this_machine():
    opts = options("-w", "3", "-s", "2", "--min-workers", "2", "--max-workers", "4")
    assert opts.elastic
    el = Elastic(opts)
    p = plan(opts, layout(opts, None), Site("127.0.0.1:9000", {**ENVIRON, "GRADHUB_SERVICE_TOKEN_FILE": "/x"},
                                             token="t", store=None, elastic=el))
    assert p.elastic is el and p.most_workers == 4
    # The service: --service, no ranks; the master token, never a job token.
    assert "--service" in p.processes[0].argv
    for s in p.servers:
        assert "--service" in s.argv and "--rank" not in s.argv
    for s in p.service:
        assert s.env["GRADHUB_SERVICE_TOKEN"] == el.master
        assert "GRADHUB_JOB_TOKEN" not in s.env and "GRADHUB_SERVICE_TOKEN_FILE" not in s.env
    for w in p.workers:
        e = w.env
        assert e["GRADHUB_JOB"] == el.job and e["GRADHUB_JOB_TOKEN"] == el.token != el.master
        assert (e["GRADHUB_MIN_WORKERS"], e["GRADHUB_MAX_WORKERS"], e["GRADHUB_NUM_WORKERS"]) == ("2", "4", "3")
        assert not {"GRADHUB_SERVICE_TOKEN", "GRADHUB_SERVICE_TOKEN_FILE"} & set(e)
        # Its size changes: no torch rendezvous of a fixed size.
        assert not {"MASTER_ADDR", "WORLD_SIZE", "RANK"} & set(e)
    # A replacement: the next rank, like the others here.
    j = p.joiner(3, None)
    assert (j.label, j.host, j.argv) == ("worker 3", None, tuple(CMD))
    assert (j.env["GRADHUB_RANK"], j.env["LOCAL_RANK"], j.env["LOCAL_WORLD_SIZE"], j.env["NODE_RANK"]) == (
        "3", "3", "3", "0")
    assert j.env["GRADHUB_JOB_TOKEN"] == el.token and "GRADHUB_SERVICE_TOKEN" not in j.env


def test_an_elastic_job_across_hosts_and_one_that_follows_discovered_hosts():
    opts = options("-H", "a:2,b:2", "--min-workers", "1")
    el = Elastic(opts)
    p = plan(opts, layout(opts, parse_hosts(opts.hosts)), Site("10.0.0.1:9000", ENVIRON, elastic=el))
    assert p.most_workers == 4 and [w.host for w in p.workers] == ["a", "a", "b", "b"]
    assert "GRADHUB_MAX_WORKERS" not in p.workers[0].env  # the starting size is the bound
    j = p.joiner(7, "b")
    # On another host the service gives a joiner its local ranks.
    assert (j.label, j.host, j.env["GRADHUB_RANK"]) == ("worker 7@b", "b", "7")
    assert not {"LOCAL_RANK", "GRADHUB_LOCAL_RANK", "NODE_RANK", "HOME"} & set(j.env)
    assert j.env["GRADHUB_JOB"] == el.job
    # Discovered hosts: -w defaults to every slot found, up to --max-workers.
    opts = options("--host-discovery-script", "./hosts.sh", "--min-workers", "2", "--max-workers", "3")
    found = {"n1": 2, "n2": 2}
    lay = layout(opts, [Host(h, n) for h, n in found.items()])
    assert [(r, h, local) for r, h, local in lay.slots] == [(0, "n1", 0), (1, "n1", 1), (2, "n2", 0)]
    # Re-planned on the hosts found now (n1 gone): the job starts on what is left.
    lay = layout(opts, [Host("n2", 2), Host("n3", 1)])
    assert lay.hosts == ("n2", "n3") and lay.workers == 3


@pytest.mark.parametrize("argv,hosts,words", [
    (["-w", "2", "--min-workers", "3"], None, "1 <= --min-workers (3) <= the workers (2) <= --max-workers (2)"),
    (["-w", "2", "--max-workers", "4"], None, "--max-workers needs --min-workers"),
    (["-H", "a:1,b:1", "-w", "3"], "a:1,b:1", "the hosts have 2 slots"),
    (["-H", "a:1", "--server-hosts", "c,c"], "a:1", "a host is listed twice"),
])
def test_a_plan_that_cannot_be_is_refused(argv, hosts, words):
    opts = options(*argv)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        layout(opts, parse_hosts(hosts) if hosts else None)


def test_usage_errors_are_the_parsers():
    p = cli.build_parser()

    def error(msg):
        raise SystemExit(msg)

    for argv, words in [(["--", *CMD], "needs -w/--workers"), (["-w", "1"], "needs a worker command"),
                        (["-w", "1", "--server-hosts", "a", "--", *CMD], "--server-hosts needs -H"),
                        (["-H", "a:1", "--host-discovery-script", "s", "--", *CMD], "leave out -H")]:
        with pytest.raises(SystemExit, match=words):
            flags.options(p.parse_args(["launch", *argv]), error)


def slurm_vars(nodelist="gpu[1-2]", per_node="3,1", tasks=4, **more) -> dict[str, str]:
    """What srun sets alike in every task of a step (SLURM_PROCID and the like aside)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_NTASKS": "8", **more}


def test_an_srun_steps_plan():
    p = slurm.plan(slurm_vars(), ["python", "train.py"])
    port = slurm.step({**slurm_vars(), "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).port
    assert p.embedded and p.scheduler == f"gpu1:{port}" and p.hosts == ("gpu1", "gpu2")
    assert [(w.label, w.host, w.env["GRADHUB_LOCAL_RANK"], w.env["GRADHUB_LOCAL_SIZE"]) for w in p.workers] == [
        ("worker 0@gpu1", "gpu1", "0", "3"), ("worker 1@gpu1", "gpu1", "1", "3"),
        ("worker 2@gpu1", "gpu1", "2", "3"), ("worker 3@gpu2", "gpu2", "0", "1")]
    assert {(w.env["GRADHUB_NUM_WORKERS"], w.env["GRADHUB_NUM_SERVERS"], w.env["GRADHUB_SCHEDULER"])
            for w in p.workers} == {("4", "2", p.scheduler)}
    assert all(w.argv == ("python", "train.py") for w in p.workers)
    # `2(x3)`: three nodes of two tasks; one node: loopback.
    p = slurm.plan(slurm_vars("n[01-03]", "2(x3)", 6))
    assert [w.host for w in p.workers] == ["n01", "n01", "n02", "n02", "n03", "n03"]
    assert slurm.plan(slurm_vars("solo", "4", 4)).scheduler.startswith("127.0.0.1:")
    # A scheduler of the job's own (the sbatch example's): not embedded, its servers.
    p = slurm.plan(slurm_vars(GRADHUB_SCHEDULER="cpu1:9000", GRADHUB_NUM_SERVERS="3"))
    assert not p.embedded and {w.env["GRADHUB_SCHEDULER"] for w in p.workers} == {"cpu1:9000"}
    assert {w.env["GRADHUB_NUM_SERVERS"] for w in p.workers} == {"3"}
    with pytest.raises(ValueError, match="not in an srun step"):
        slurm.plan({"SLURM_JOB_ID": "1"})
    with pytest.raises(ValueError, match="places 3 of the step's 5 tasks"):
        slurm.plan(slurm_vars("a,b", "2,1", 5))


def test_each_srun_task_reads_what_the_steps_plan_gives_it(monkeypatch):
    for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GRADHUB_SCHEDULER",
              "GRADHUB_RANK", "GRADHUB_NUM_WORKERS", "GRADHUB_NUM_SERVERS", "GRADHUB_LOCAL_RANK", "GRADHUB_LOCAL_SIZE",
              "GRADHUB_SCHEDULER_PORT", "GRADHUB_JOB"):
        monkeypatch.delenv(k, raising=False)
    step = slurm_vars("gpu[1-3]", "2,1,2", 5)
    p = slurm.plan(step)
    for w in p.workers:
        # srun's variables in that task (block distribution), and what gradhub.init() there reads from them.
        local = int(w.env["GRADHUB_LOCAL_RANK"])
        for k, v in {**step, "SLURM_PROCID": str(w.rank), "SLURM_LOCALID": str(local), "SLURMD_NODENAME": w.host,
                     "SLURM_NODEID": str(p.hosts.index(w.host))}.items():
            monkeypatch.setenv(k, v)
        e = _env.worker_env()
        assert e.embedded and e.scheduler == w.env["GRADHUB_SCHEDULER"], w
        assert (e.rank, e.num_workers, e.num_servers, e.local_rank, e.local_size) == (
            w.rank, 5, 3, local, int(w.env["GRADHUB_LOCAL_SIZE"])), w


def test_env_reads_slurm_without_the_launcher():
    # _env (every worker imports it) reads Slurm's variables from a leaf module, not from the launcher.
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(_env))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.startswith("launch") for m in imported), imported
    assert "_slurm" in imported
    assert slurm.step is sys.modules["gradhub._slurm"].step


def test_the_launch_flags_are_the_options_fields():
    # One place: every flag of `gradhub launch` (its dest) is a field of the options, and back.
    p = cli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    dests = {a.dest for a in sub.choices["launch"]._actions if a.dest not in ("help", "encrypt")}
    fields = set(flags.LaunchOptions.__dataclass_fields__)
    assert dests == fields, dests ^ fields


def test_an_elastic_job_re_planned_when_its_discovered_hosts_change():
    opts = options("--host-discovery-script", "./hosts.sh", "--min-workers", "1", "--max-workers", "5")
    found = {"a": 2, "b": 1}
    p = plan(opts, layout(opts, [Host(h, n) for h, n in found.items()]), Site("10.0.0.1:9000", ENVIRON,
                                                                             elastic=Elastic(opts)))
    assert p.most_workers == 5 and [w.host for w in p.workers] == ["a", "a", "b"]
    # b gone, a grown by 2 and c new with 3: b's worker stops; a's two new slots, then c's first, up to 5 workers.
    m = discovery.moves(found, {"a": 4, "c": 3}, {"a": 2, "b": 1}, p.most_workers)
    assert m.stop == {"b": 1} and m.start == ["a", "a", "c"]
    joiners = [p.joiner(3 + i, h) for i, h in enumerate(m.start)]
    assert [(j.label, j.env["GRADHUB_RANK"]) for j in joiners] == [("worker 3@a", "3"), ("worker 4@a", "4"),
                                                                  ("worker 5@c", "5")]
    # A host with fewer slots stops its extra workers; nothing grows past the most; no change, no move.
    assert discovery.moves({"a": 3}, {"a": 1, "b": 9}, {"a": 3}, 2) == discovery.Moves({"a": 2}, ["b"])
    assert discovery.moves({"a": 2}, {"a": 2}, {"a": 1}, 5) == discovery.Moves()
    # A host gone whose workers all exited already: nothing to stop.
    assert discovery.moves({"a": 2, "b": 1}, {"a": 2}, {"a": 2}, 5) == discovery.Moves()


def test_a_plan_cannot_be_changed_once_made():
    opts = options("-w", "1")
    p = plan(opts, layout(opts, None), Site("127.0.0.1:1", ENVIRON, store=("127.0.0.1", 2)))
    with pytest.raises(TypeError):
        p.workers[0].env["GRADHUB_RANK"] = "5"  # type: ignore[index]
    with pytest.raises(AttributeError):
        p.workers[0].host = "elsewhere"  # type: ignore[misc]
