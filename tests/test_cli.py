"""The gradhub command line: help, launch supervision, torchrun-style start, role env."""

import subprocess
import sys

from conftest import WORKERS, assert_all_passed, free_port, free_port_pair, job_env, run_launch, worker_argv


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
        procs.append(subprocess.Popen(worker_argv("check_sums.py"), env=env,
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


# ---------------------------------------------------------------- bad input: one line, exit code 2, no traceback

import json  # noqa: E402
import os  # noqa: E402
from importlib import metadata  # noqa: E402

import pytest  # noqa: E402

import gradhub  # noqa: E402
from gradhub import _core, cli  # noqa: E402

# Small and fast if a check ever lets a bad value through to the simulator.
SMALL = ["--model", "alexnet", "--scale", "64"]


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("GRADHUB_"):
            monkeypatch.delenv(k)


def one_line_error(capsys, call) -> tuple[int, str]:
    """(exit code, the one stderr line) of `call`, a usage error (SystemExit)
    or a returned code; nothing on stdout."""
    try:
        rc = call()
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    return rc, lines[0]


def usage(cmd: str, message: str) -> str:
    return f"gradhub {cmd}: error: {message} (see gradhub {cmd} --help)"


def out_of_range(flag: str, value: str, accepts: str) -> str:
    return f"argument {flag}: {value} is out of range ({accepts})"


PLANNER_ARGS = [
    (["simulate", "--workers-per-host", "0"], out_of_range("--workers-per-host", "0", "at least 1")),
    (["simulate", "--scale", "0"], out_of_range("--scale", "0", "more than 0")),
    (["simulate", "--scale", "inf"], out_of_range("--scale", "inf", "more than 0")),
    (["simulate", "--hosts", "-3"], out_of_range("--hosts", "-3", "at least 1")),
    (["simulate", "--hosts", "2.5"], "argument --hosts: '2.5' is not an integer (at least 1)"),
    (["simulate", "--cpu-servers", "-1"], out_of_range("--cpu-servers", "-1", "at least 0")),
    (["simulate", "--rate", "1potato"],
     "argument --rate: '1potato' is not a rate above 0 (examples: 1gbit, 500mbit, 25gbit)"),
    (["simulate", "--rate", "0mbit"], "argument --rate: '0mbit' is not a rate above 0 (examples: 1gbit, 500mbit, 25gbit)"),
    (["simulate", "--core-rate", "fast"],
     "argument --core-rate: 'fast' is not a rate above 0 (examples: 1gbit, 500mbit, 25gbit)"),
    (["simulate", "--racks", "0"], out_of_range("--racks", "0", "at least 1")),
    (["simulate", "--latency-us", "-5"], out_of_range("--latency-us", "-5", "at least 0")),
    (["simulate", "--latency-us", "nan"], out_of_range("--latency-us", "nan", "at least 0")),
    (["simulate", "--server-threads", "0"], out_of_range("--server-threads", "0", "at least 1")),
    (["simulate", "--shared-cores", "-1"], out_of_range("--shared-cores", "-1", "at least 0")),
    (["simulate", "--partition-bytes", "2"], out_of_range("--partition-bytes", "2", "at least 4")),
    (["simulate", "--credit-bytes", "0"], out_of_range("--credit-bytes", "0", "at least 1")),
    (["simulate", "--fusion-threshold", "-1"], out_of_range("--fusion-threshold", "-1", "at least 0")),
    (["plan", "--hosts", "0"], out_of_range("--hosts", "0", "at least 1")),
    (["plan", "--workers-per-host", "-2"], out_of_range("--workers-per-host", "-2", "at least 1")),
    (["plan", "--scale", "-1"], out_of_range("--scale", "-1", "more than 0")),
    (["plan", "--rate", "1gbyte"], "argument --rate: '1gbyte' is not a rate above 0 (examples: 1gbit, 500mbit, 25gbit)"),
    (["plan", "--cpu-available", "-1"], out_of_range("--cpu-available", "-1", "at least 0")),
    (["plan", "--gpu-price", "-1"], out_of_range("--gpu-price", "-1", "at least 0")),
    (["plan", "--cpu-price", "x"], "argument --cpu-price: 'x' is not a number (at least 0)"),
    (["plan", "--top", "0"], out_of_range("--top", "0", "at least 1")),
    (["plan", "--apply", "{tmp}/no/such/folder/gradhub.env"],
     "argument --apply: {tmp}/no/such/folder/gradhub.env: no folder {tmp}/no/such/folder"),
    (["plan", "--apply", "{tmp}"], "argument --apply: {tmp}: a folder, not a file"),
    (["simulate", "--costs", "{tmp}/missing.json"],
     "argument --costs: {tmp}/missing.json: no such file (make one with `gradhub bench calibrate`)"),
]


@pytest.mark.parametrize("argv,message", PLANNER_ARGS, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_planner_refuses_bad_arguments_in_one_line(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc, line = one_line_error(capsys, lambda: cli.main(argv[:1] + SMALL + argv[1:]))
    assert rc == 2 and line == usage(argv[0], message.replace("{tmp}", str(tmp_path)))


ROLE_ARGS = [
    (["launch", "-w", "0"], out_of_range("-w/--workers", "0", "at least 1")),
    (["launch", "-w", "two"], "argument -w/--workers: 'two' is not an integer (at least 1)"),
    (["launch", "-s", "0"], out_of_range("-s/--servers", "0", "at least 1")),
    (["launch", "--server-threads", "0"], out_of_range("--server-threads", "0", "at least 1")),
    (["launch", "--colocated-servers", "-1"], out_of_range("--colocated-servers", "-1", "at least 0")),
    (["launch", "--port", "65536"], out_of_range("--port", "65536", "at least 0, at most 65535")),
    (["launch", "--ssh-port", "0"], out_of_range("--ssh-port", "0", "at least 1, at most 65535")),
    (["launch", "--ssh-identity-file", "{tmp}/id_missing"],
     "argument --ssh-identity-file: {tmp}/id_missing: no such file"),
    (["launch", "--ssh-config", "{tmp}"], "argument --ssh-config: {tmp}: a folder, not a file"),
    (["launch", "--partition-bytes", "3"], out_of_range("--partition-bytes", "3", "at least 4")),
    (["launch", "--stall-seconds", "-1"], out_of_range("--stall-seconds", "-1", "at least 0, at most 1000000")),
    (["launch", "--peer-timeout", "-1"], out_of_range("--peer-timeout", "-1", "more than 0, at most 1000000")),
    (["launch", "--join-timeout", "1e7"], out_of_range("--join-timeout", "1e7", "more than 0, at most 1000000")),
    (["launch", "--link-gbit", "-1"], out_of_range("--link-gbit", "-1", "at least 0")),
    (["scheduler", "--workers", "0"], out_of_range("--workers", "0", "at least 1")),
    (["scheduler", "--servers", "-1"], out_of_range("--servers", "-1", "at least 1")),
    (["scheduler", "--core-gbit", "nan"], out_of_range("--core-gbit", "nan", "at least 0")),
    (["scheduler", "--max-jobs", "0"], out_of_range("--max-jobs", "0", "at least 1")),
    (["scheduler", "--job-max-workers", "0"], out_of_range("--job-max-workers", "0", "at least 1")),
    (["scheduler", "--job-max-tensors", "-1"], out_of_range("--job-max-tensors", "-1", "at least 0")),
    (["scheduler", "--job-max-mib", "-1"], out_of_range("--job-max-mib", "-1", "at least 0")),
    (["server", "--threads", "0"], out_of_range("--threads", "0", "at least 1")),
    (["server", "--port", "-1"], out_of_range("--port", "-1", "at least 0, at most 65535")),
    (["server", "--rank", "-2"], out_of_range("--rank", "-2", "at least -1")),
    (["server", "--connect-timeout", "0"], out_of_range("--connect-timeout", "0", "more than 0")),
    (["status", "--timeout", "-1"], out_of_range("--timeout", "-1", "more than 0")),
    (["timeline", "merge", "{tmp}/no/such/folder/out.json", "a.json"],
     "argument out: {tmp}/no/such/folder/out.json: no folder {tmp}/no/such/folder"),
    (["token"], "the following arguments are required: job"),
]


@pytest.mark.parametrize("argv,message", ROLE_ARGS, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_commands_refuse_bad_arguments_in_one_line(argv, message, tmp_path, capsys, clean_env):
    # The parser only (what main() runs first): a bad value let through
    # would start a role here.
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc, line = one_line_error(capsys, lambda: cli.build_parser().parse_args(argv))
    assert rc == 2 and line == usage(argv[0], message.replace("{tmp}", str(tmp_path)))


@pytest.mark.parametrize("flag,value,accepts", [("--slots-per-host", "0", "at least 1"),
                                                ("--discovery-interval", "0", "more than 0")])
def test_launch_refuses_bad_elastic_arguments_in_one_line(flag, value, accepts, capsys, clean_env):
    rc, line = one_line_error(capsys, lambda: cli.main(["launch", "-w", "1", flag, value, "--", "true"]))
    assert rc == 2 and line == usage("launch", out_of_range(flag, value, accepts))


LAYER = {"name": "fc", "params": 1000, "dtype": "float32", "forward_ms": 1.0, "backward_ms": 2.0}


def _layers(n=4, **changes):
    """n good layers, the last one changed (a value None: left out)."""
    last = {k: v for k, v in {**LAYER, **changes}.items() if v is not None}
    return [dict(LAYER) for _ in range(n - 1)] + [last]


BAD_PROFILES = [
    ("nope", "not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ('{"batch": 8, "layers": [', "not valid JSON: Expecting value: line 1 column 25 (char 24)"),
    ([1, 2], 'not a profile (expected a JSON object {"batch": B, "layers": [{"name", "params", "dtype", '
             '"forward_ms", "backward_ms"}, ...]})'),
    ({"layers": [LAYER]}, 'not a profile: lacks \'batch\' (expected {"batch": B, "layers": [{"name", "params", '
                          '"dtype", "forward_ms", "backward_ms"}, ...]})'),
    ({"batch": 8}, 'not a profile: lacks \'layers\' (expected {"batch": B, "layers": [{"name", "params", '
                   '"dtype", "forward_ms", "backward_ms"}, ...]})'),
    ({"batch": 0, "layers": [LAYER]}, "batch is 0, expected an integer at least 1"),
    ({"batch": "32", "layers": [LAYER]}, "batch is '32', expected an integer at least 1"),
    ({"batch": 2.5, "layers": [LAYER]}, "batch is 2.5, expected an integer at least 1"),
    ({"batch": 8, "layers": []}, "'layers' is [], expected a non-empty list of layers"),
    ({"batch": 8, "layers": {"fc": LAYER}}, "'layers' is {'fc': {'name': 'fc', 'params': 1000, 'dtype': "
                                            "'float32', 'forward_ms': 1.0, 'backward_ms': 2.0}}, expected a "
                                            "non-empty list of layers"),
    ({"batch": 8, "layers": [LAYER, 5]},
     'layer 1 is 5, expected an object {"name", "params", "dtype", "forward_ms", "backward_ms"}'),
    ({"batch": 8, "layers": _layers(params=None)}, "layer 3 lacks 'params'"),
    ({"batch": 8, "layers": _layers(forward_ms=None)}, "layer 3 lacks 'forward_ms'"),
    ({"batch": 8, "layers": _layers(backward_ms=None)}, "layer 3 lacks 'backward_ms'"),
    ({"batch": 8, "layers": [{}]}, "layer 0 lacks 'params'"),
    ({"batch": 8, "layers": _layers(params=-1)}, "layer 3: params is -1, expected an integer at least 0"),
    ({"batch": 8, "layers": _layers(params=1.5)}, "layer 3: params is 1.5, expected an integer at least 0"),
    ({"batch": 8, "layers": _layers(params=True)}, "layer 3: params is True, expected an integer at least 0"),
    ({"batch": 8, "layers": _layers(forward_ms=-1)}, "layer 3: forward_ms is -1, expected a number at least 0"),
    ({"batch": 8, "layers": _layers(backward_ms="2")}, "layer 3: backward_ms is '2', expected a number at least 0"),
    ('{"batch": 8, "layers": [{"params": 10, "forward_ms": NaN, "backward_ms": 1}]}',
     "layer 0: forward_ms is nan, expected a number at least 0"),
    ({"batch": 8, "layers": _layers(dtype="int8")},
     "layer 3: unknown dtype 'int8' (one of float32, float16, bfloat16, float64)"),
    ({"batch": 8, "layers": [dict(LAYER, params=0, forward_ms=0, backward_ms=0)] * 2},
     "nothing to simulate: every layer's params, forward_ms and backward_ms are 0"),
]


@pytest.mark.parametrize("content,problem", BAD_PROFILES, ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("cmd", ["simulate", "plan"])
def test_a_malformed_profile_is_one_line_naming_the_file(cmd, content, problem, tmp_path, capsys):
    f = tmp_path / "profile.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    rc, line = one_line_error(capsys, lambda: cli.main([cmd, "--profile", str(f), "--hosts", "2"]))
    assert rc == 2 and line == f"gradhub {cmd}: {f}: {problem}"


def test_a_profile_file_that_cannot_be_read_is_one_line(tmp_path, capsys):
    for f, why in ((tmp_path / "missing.json", "No such file or directory"), (tmp_path, "Is a directory")):
        rc, line = one_line_error(capsys, lambda: cli.main(["simulate", "--profile", str(f)]))
        assert rc == 2 and line == f"gradhub simulate: {f}: cannot read it: {why}"


def test_a_good_profile_still_simulates(tmp_path, capsys):
    f = tmp_path / "profile.json"
    f.write_text(json.dumps({"batch": 8, "layers": [{"params": 1000, "forward_ms": 1, "backward_ms": 2},
                                                    {"name": "b", "params": 0, "forward_ms": 3, "backward_ms": 6}]}))
    assert cli.main(["simulate", "--profile", str(f), "--hosts", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model_mbytes"] == pytest.approx(4000 / 1e6) and d["compute_ms"] == pytest.approx(12.0)


@pytest.mark.parametrize("content,problem", [
    ("[1]", "not a calibration file (a JSON object of costs, as `gradhub bench calibrate` writes)"),
    ("{", "not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ('{"sum_Bps": 0}', "sum_Bps is 0, not a number more than 0"),
    ('{"chunk_cpu_s": "fast"}', "chunk_cpu_s is 'fast', not a number at least 0"),
    ('{"mem_Bps": -1e9}', "mem_Bps is -1000000000.0, not a number more than 0"),
], ids=["list", "json", "zero-rate", "string", "negative-rate"])
def test_a_malformed_costs_file_is_one_line_naming_the_file(content, problem, tmp_path, capsys):
    f = tmp_path / "costs.json"
    f.write_text(content)
    rc, line = one_line_error(capsys, lambda: cli.main(["simulate", *SMALL, "--costs", str(f)]))
    assert rc == 2 and line == usage("simulate", f"argument --costs: {f}: {problem}")


@pytest.mark.parametrize("spec,problem", [
    ("no_such_module_here:make", "cannot import no_such_module_here: No module named 'no_such_module_here'"),
    ("json:no_such_factory", "module json has no no_such_factory"),
])
def test_a_torch_model_that_cannot_be_found_is_one_line(spec, problem, capsys):
    rc, line = one_line_error(capsys, lambda: cli.main(["simulate", "--torch-model", spec]))
    assert rc == 2 and line == f"gradhub simulate: --torch-model {spec}: {problem}"


def test_bad_input_through_the_command_is_one_line_without_traceback(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"batch": 8, "layers": _layers(params=None)}))
    for args, line in [(["simulate", "--workers-per-host", "0"],
                        usage("simulate", out_of_range("--workers-per-host", "0", "at least 1"))),
                       (["plan", "--hosts", "0"], usage("plan", out_of_range("--hosts", "0", "at least 1"))),
                       (["simulate", "--profile", str(f)], f"gradhub simulate: {f}: layer 3 lacks 'params'")]:
        out = gh(*args)
        assert out.returncode == 2 and out.stdout == "" and out.stderr == line + "\n", out.stderr


# ---------------------------------------------------------------- version


def test_version_is_the_packages_and_the_protocols(capsys):
    version = metadata.version("gradhub")
    assert gradhub.__version__ == version
    assert isinstance(gradhub.PROTOCOL_VERSION, int) and gradhub.PROTOCOL_VERSION == _core.PROTOCOL_VERSION
    assert "PROTOCOL_VERSION" in gradhub.__all__
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"gradhub {version} (protocol {_core.PROTOCOL_VERSION})\n"
    # The command itself, and without torch.
    out = gh("--version")
    assert out.returncode == 0 and out.stdout == f"gradhub {version} (protocol {_core.PROTOCOL_VERSION})\n"
    code = "import sys, gradhub\nprint(gradhub.__version__, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=job_env())
    assert out.stdout.split() == [version, "False"], out.stderr


def test_version_without_metadata_is_the_source_trees(monkeypatch):
    import tomllib
    from pathlib import Path

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    pyproject = Path(gradhub.__file__).resolve().parents[2] / "pyproject.toml"
    expected = tomllib.loads(pyproject.read_text())["project"]["version"] if pyproject.exists() else "0+unknown"
    assert gradhub._version() == expected
