"""The torch.distributed backend "gradhub" (python/gradhub/torch/dist/):
`dist.init_process_group("gradhub")` under a torchrun-style start (the group
forms its own gradhub job from torch's store) and under `gradhub launch`
(the launcher's job). One worker run checks every collective x dtype x op
against gloo, Work, a sub-group, DDP, FSDP2 and hybrid
sharding on a 2-D DeviceMesh against one process, and destroy + init again
(tests/workers/backend_collectives.py, backend_fsdp.py)."""

from __future__ import annotations

import subprocess

import pytest

from conftest import free_port, job_env, run_launch, worker_argv

torch = pytest.importorskip("torch")


def run_torchrun_style(n: int, script: str, hosts: list[str], config: dict | None = None, timeout: float = 240,
                       **env) -> list[tuple[int, str]]:
    """Start `n` workers as torchrun does (MASTER_ADDR/PORT, RANK, WORLD_SIZE;
    no GRADHUB_SCHEDULER), worker q on emulated host hosts[q]
    (GRADHUB_HOST_ID); returns each one's (exit code, output)."""
    import json

    port = free_port()
    procs = []
    for q in range(n):
        e = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=q, WORLD_SIZE=n, GRADHUB_HOST_ID=hosts[q],
                    GH_TEST=json.dumps(config or {}), **env)
        procs.append(subprocess.Popen(worker_argv(script), env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    out = []
    try:
        for p in procs:
            o, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, o.decode(errors="replace")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_backend_collectives_ddp_and_groups_3_processes_on_2_emulated_hosts():
    # Ranks 0 and 1 share host A (one colocated server, the host stage), rank 2 is on host B.
    results = run_torchrun_style(3, "backend_collectives.py", ["host-a", "host-a", "host-b"])
    for q, (rc, out) in enumerate(results):
        assert rc == 0 and f"PASS {q}" in out, f"rank {q}:\n{out[-6000:]}"
        assert "against gloo" in out and "FSDP2: 20 steps equal one process" in out, out[-6000:]


@pytest.mark.parametrize("backend,hosts", [("gradhub", ["host-a", "host-a", "host-b"]), ("gloo", ["a", "b"])])
def test_ddp_forward_overlap_trains_as_one_process_and_plain_ddp(backend, hosts):
    # gradhub.torch.ddp_forward_overlap: SGD and Adam, an LR scheduler, buckets as views or not, no_sync,
    # a checkpoint mid-run, the refusals (tests/workers/backend_ddp_overlap.py); over gloo too.
    results = run_torchrun_style(len(hosts), "backend_ddp_overlap.py", hosts, {"backend": backend})
    for q, (rc, out) in enumerate(results):
        assert rc == 0 and f"PASS {q}" in out, f"rank {q}:\n{out[-6000:]}"
        assert "adam, gradient_as_bucket_view=False: 12 steps equal one process and plain DDP" in out, out[-3000:]


def test_point_to_point_3_processes_on_2_emulated_hosts():
    # Every pair, dtypes, sizes of several frames, order and tags, any source, batch_isend_irecv,
    # sub-groups, errors naming the sender, a receive withdrawn on its timeout (tests/workers/backend_p2p.py).
    results = run_torchrun_style(3, "backend_p2p.py", ["host-a", "host-a", "host-b"])
    for q, (rc, out) in enumerate(results):
        assert rc == 0 and f"PASS {q}" in out, f"rank {q}:\n{out[-6000:]}"


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_schedules_gpipe_and_1f1b_train_equal_to_one_process(stages):
    # torch.distributed.pipelining over the backend's point-to-point: one stage per process,
    # on 2 emulated hosts (tests/workers/backend_pipeline.py).
    hosts = ["host-a" if q < stages // 2 else "host-b" for q in range(stages)]
    results = run_torchrun_style(stages, "backend_pipeline.py", hosts)
    for q, (rc, out) in enumerate(results):
        assert rc == 0 and f"PASS {q}" in out, f"rank {q}:\n{out[-6000:]}"
        assert f"stage {q} of {stages}: GPipe then 1F1B equal one process (on cpu)" in out, out[-3000:]


def test_backend_under_gradhub_launch_2_workers():
    rc, out = run_launch(2, 1, "backend_collectives.py", {"port": free_port(), "port2": free_port()})
    assert rc == 0, out[-6000:]
    for q in range(2):
        assert f"PASS {q}" in out, out[-6000:]
    assert out.count("HSDP 2x1: 20 steps equal one process") == 2, out[-6000:]



@pytest.mark.parametrize("victim,how,named", [
    (2, "exit", "worker 2"),    # a worker only (rank 0 hosts host-a's server): its connections close
    (2, "stop", "worker 2"),    # silent (SIGSTOP): found by the peer timeout
    (0, "exit", "rank 0"),      # the rank that hosts the job's scheduler (and host-a's server)
])
def test_lost_peer_fails_every_pending_work_naming_it(victim, how, named):
    # The victim dies (or goes silent) while the others have an all_reduce, a broadcast and a receive
    # from it pending (tests/workers/backend_lost_peer.py); peer timeout 3 s.
    import json
    import time

    port, hosts = free_port(), ["host-a", "host-b", "host-a"]
    # A stopped worker must be the process the test kills: not a zygote's fork (its client's SIGKILL
    # reaches a fork only through a pipe the stopped fork does not watch).
    procs = [subprocess.Popen(worker_argv("backend_lost_peer.py", fresh=q == victim and how == "stop"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=q, WORLD_SIZE=3,
                                          GRADHUB_HOST_ID=hosts[q], GRADHUB_PEER_TIMEOUT=3,
                                          GH_TEST=json.dumps({"victim": victim, "how": how})))
             for q in range(3)]
    t0 = time.monotonic()
    try:
        outs = {}
        for q in range(3):
            if q != victim:
                o, _ = procs[q].communicate(timeout=60)
                outs[q] = (procs[q].returncode, o.decode(errors="replace"), time.monotonic() - t0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    for q, (rc, out, took) in outs.items():
        assert rc == 0 and f"EXIT {q}" in out, f"rank {q}:\n{out[-6000:]}"
        # (anywhere in a line: the core's log lines, on stderr, share the pipe and may end without a newline)
        lost = [line[line.index(f"LOST {q} "):] for line in out.splitlines() if f"LOST {q} " in line]
        assert len(lost) == 3, out[-6000:]
        for i, line in enumerate(lost):
            secs, msg = float(line.split()[2]), line.split(" ", 3)[3]
            assert secs < 3 + 5, line  # within the peer timeout (plus slack on a loaded machine)
            # (the receive: failed by its link's end, "member 2 ... closed", or with the job, as the others)
            assert msg.startswith("GradhubBackendError") and (named in msg or i == 2 and f"member {victim} " in msg), line
        later = out.split(f"LATER {q} ", 1)[-1].splitlines()[0]
        assert later.startswith("GradhubBackendError") and named in later, out[-6000:]
        assert took < 45, f"rank {q} took {took:.0f} s to exit"


def test_default_env_init_under_gradhub_launch():
    # No init_method, rank or world size: torch's env:// rendezvous on what `gradhub launch` exports.
    rc, out = run_launch(2, 1, "backend_env_init.py")
    assert rc == 0, out[-6000:]
    for q in range(2):
        assert f"PASS {q}: env:// init" in out, out[-6000:]


def test_gradhub_scheduler_wins_over_the_exported_master_addr(monkeypatch):
    # What `gradhub launch` exports: gradhub.init() joins the launcher's job, never one of its own.
    from gradhub import _env

    for k, v in dict(GRADHUB_SCHEDULER="127.0.0.1:1234", GRADHUB_RANK="1", GRADHUB_NUM_WORKERS="2",
                     GRADHUB_NUM_SERVERS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="5555", RANK="1",
                     WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    env = _env.worker_env()
    assert (env.scheduler, env.embedded, env.rank, env.num_workers, env.num_servers) == ("127.0.0.1:1234", False, 1,
                                                                                           2, 1)


def test_torch_s_own_backend_tests_pass_on_gradhub_quick_selection():
    # torch's DistributedTest._DistTestBase (gradhub-lab torch-suite --quick): one test of each kind, every
    # one of which gloo passes here, on 2 processes.
    from gradhub_lab import torch_suite

    outcomes = torch_suite.run_backend("gradhub", 2, torch_suite.QUICK, timeout=600)
    assert len(outcomes) == 15, outcomes
    # Where torch itself decides otherwise: torch 2.12 and 2.13 refuse monitored_barrier before calling
    # any backend but gloo; from 2.13 torch skips barrier_timeout_arg for every backend (a per-call
    # timeout, which 2.12 runs).
    version = tuple(int(x) for x in torch.__version__.split(".")[:2])
    torch_says = {"test_monitored_barrier_gloo": (version < (2, 14), "failed: ValueError: monitored_barrier is only "
                                                                     "implemented for GLOO"),
                  "test_barrier_timeout_arg": (version >= (2, 13), "skipped: ")}
    wrong = {n: o for n, o in outcomes.items()
             if o != "passed" and not (n in torch_says and torch_says[n][0] and o.startswith(torch_says[n][1]))}
    assert not wrong, wrong
