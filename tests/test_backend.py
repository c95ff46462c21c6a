"""The torch.distributed backend "gradhub" (python/gradhub/torch/dist/):
`dist.init_process_group("gradhub")` under a torchrun-style start (the group
forms its own gradhub job from torch's store) and under `gradhub launch`
(the launcher's job). One worker run checks every collective x dtype x op
against gloo, Work, unsupported calls, a sub-group, DDP, FSDP2 and hybrid
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


def test_backend_under_gradhub_launch_2_workers():
    rc, out = run_launch(2, 1, "backend_collectives.py", {"port": free_port(), "port2": free_port()})
    assert rc == 0, out[-6000:]
    for q in range(2):
        assert f"PASS {q}" in out, out[-6000:]
    assert out.count("HSDP 2x1: 20 steps equal one process") == 2, out[-6000:]
