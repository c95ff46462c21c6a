"""The gradhub command line: help, launch supervision, torchrun-style start, role env."""

import subprocess
import sys

from conftest import WORKERS, assert_all_passed, free_port, free_port_pair, job_env, run_launch


def gh(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "gradhub", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or job_env())


def test_help_texts():
    out = gh("--help")
    assert out.returncode == 0 and "launch" in out.stdout and "GRADHUB_SCHEDULER" in out.stdout
    for cmd, words in [("launch", ["--workers", "--servers", "--server-threads", "--colocated"]),
                       ("scheduler", ["--workers", "--servers", "--partition-bytes", "--peer-timeout"]),
                       ("server", ["--scheduler", "--threads", "--colocated", "--advertise-addr"])]:
        out = gh(cmd, "--help")
        assert out.returncode == 0, out.stderr
        for w in words:
            assert w in out.stdout, (cmd, w)


def test_timeline_merge_refuses_what_is_not_a_timeline(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    old = tmp_path / "old.json"
    old.write_text('[\n{"name": "process_name", "ph": "M", "pid": 0, "args": {}},\n')
    for f, why in ((bad, "Expecting value"), (old, "no clock event"), (tmp_path / "missing.json", "No such file")):
        out = gh("timeline", "merge", str(tmp_path / "out.json"), str(f))
        assert out.returncode == 2 and why in out.stderr, out.stderr
    assert not (tmp_path / "out.json").exists()


def test_missing_settings_are_reported():
    out = gh("server")
    assert out.returncode == 2 and "--scheduler" in out.stderr
    out = gh("scheduler")
    assert out.returncode == 2 and "--workers" in out.stderr
    out = gh("launch", "-w", "2")
    assert out.returncode == 2 and "worker command" in out.stderr


def test_server_role_never_imports_torch():
    code = ("import sys, gradhub, gradhub.cli\n"
            "p = gradhub.cli.build_parser(); p.parse_args(['server', '--scheduler', 'x:1'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nprint('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=job_env())
    assert out.stdout.strip() == "clean", out.stderr


def test_launch_propagates_worker_failure(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import gradhub, sys, time\ngradhub.init()\n"
                      "if gradhub.rank() == 1:\n    sys.exit(7)\ntime.sleep(60)\n")
    argv = [sys.executable, "-m", "gradhub", "launch", "-w", "2", "-s", "1", "--", sys.executable, str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=job_env())
    assert out.returncode == 7, out
    assert "worker 1 exited with code 7" in out.stderr


def test_output_is_prefixed_with_role_and_rank():
    rc, out = run_launch(2, 1, "check_sums.py", {"sizes": [10], "dtypes": ["float32"], "rounds": 1})
    assert_all_passed(rc, out, 2)
    assert "[scheduler]" in out and "[server 0]" in out and "[worker 1] PASS" in out


def test_torchrun_environment_embeds_scheduler_and_servers():
    # What torchrun sets for 2 nodes x 2 processes (here all on this machine):
    # rank 0 hosts the scheduler, local rank 0 of each "node" a colocated server.
    master_port = free_port_pair()
    procs = []
    cfg = '{"sizes": [1, 5000, 300000], "dtypes": ["float32", "float16"], "rounds": 2}'
    for rank in range(4):
        # Two "nodes" on one machine: each process says which node it is on.
        env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port, WORLD_SIZE=4, RANK=rank,
                      LOCAL_RANK=rank % 2, LOCAL_WORLD_SIZE=2, GRADHUB_HOST_ID=f"node{rank // 2}", GH_TEST=cfg)
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "check_sums.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"PASS {r}" in o, o
        assert f"LOCAL {r % 2} of 2" in o, o


def test_role_from_environment_runs_that_role():
    # BytePS style: the same script, started with GRADHUB_ROLE=server/scheduler,
    # runs that role inside gradhub.init() and exits when the job ends.
    port = free_port()
    base = dict(GRADHUB_SCHEDULER=f"127.0.0.1:{port}", GRADHUB_NUM_WORKERS=2, GRADHUB_NUM_SERVERS=1,
                GH_TEST='{"sizes": [100], "dtypes": ["float32"], "rounds": 1}')
    script = str(WORKERS / "check_sums.py")
    procs = [subprocess.Popen([sys.executable, script], env=job_env(GRADHUB_ROLE=role, **base),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for role in ("scheduler", "server")]
    procs += [subprocess.Popen([sys.executable, script], env=job_env(GRADHUB_ROLE="worker", GRADHUB_RANK=r, **base),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert "PASS 0" in outs[2] and "PASS 1" in outs[3]
    assert "job complete" in outs[0] and "job complete" in outs[1]


def test_launch_gives_local_ranks_and_a_wrong_local_size_is_an_error():
    rc, out = run_launch(3, 1, "check_sums.py", {"sizes": [10], "dtypes": ["float32"], "rounds": 1})
    assert_all_passed(rc, out, 3)
    for r in range(3):
        assert f"[worker {r}] LOCAL {r} of 3" in out, out[-3000:]
    # A local size that does not match the workers on this host fails init()
    # on every worker with a message naming the host, instead of a silent slowdown.
    rc, out = run_launch(3, 1, "check_sums.py", {"sizes": [10]}, env={"GRADHUB_LOCAL_SIZE": "2"}, timeout=120)
    assert rc != 0, out[-3000:]
    assert "was told its host has 2 workers, but 3 registered from host" in out, out[-3000:]


def test_a_congestion_control_that_cannot_be_set_is_warned_about_once_per_process():
    cfg = {"sizes": [300_000], "dtypes": ["float32"], "rounds": 3}
    rc, out = run_launch(2, 1, "check_sums.py", cfg, env={"GRADHUB_TCP_CONGESTION": "no_such_cc"}, timeout=120)
    assert_all_passed(rc, out, 2)
    warned = [line for line in out.splitlines() if 'GRADHUB_TCP_CONGESTION="no_such_cc" cannot be set' in line]
    # Every data socket tries it (the server's accepts, each worker's
    # connects), and each process says so once.
    assert sorted(line.split(" [gradhub tcp] warning:")[0] for line in warned) == [
        "[server 0]", "[worker 0]", "[worker 1]"], out[-3000:]
    rc, out = run_launch(2, 1, "check_sums.py", cfg, env={"GRADHUB_TCP_CONGESTION": "system"}, timeout=120)
    assert_all_passed(rc, out, 2)
    assert "GRADHUB_TCP_CONGESTION" not in out, out[-3000:]
