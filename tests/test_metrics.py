"""`--metrics-addr`: the scheduler and a server serve Prometheus' text
format over HTTP; scraped during a job, the counters move."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

from conftest import free_port
from test_service import service  # noqa: F401 (the fixture)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(addr: str) -> dict[tuple[str, str], float]:
    """Every sample of a scrape: (name, labels as written) -> value."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        text = r.read().decode()
    assert text.endswith("# EOF\n"), text
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


WORKER = """
import os, sys, time
import numpy as np
import gradhub
gradhub.init()
x = np.ones(300_000, dtype=np.float32)
def step():
    y = x.copy()
    gradhub.push_pull(y, name="grad")
    assert (y == gradhub.size()).all()
step()
gradhub.barrier()
open(sys.argv[1] + f".{gradhub.rank()}", "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
for _ in range(3):
    step()
gradhub.barrier()
open(sys.argv[1] + f".{gradhub.rank()}.done", "w").close()
while not os.path.exists(sys.argv[2] + ".end"):
    time.sleep(0.05)
print("PASS", gradhub.rank(), flush=True)
"""


def wait_files(paths, procs) -> None:
    deadline = time.monotonic() + 120  # a hang guard
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline and all(w.poll() is None for w in procs), \
            [w.communicate()[0] for w in procs if w.poll() is not None]
        time.sleep(0.05)


def test_scheduler_and_server_metrics_move_during_a_job(cluster_factory, tmp_path):
    sched_m, server_m = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    c = cluster_factory(2, 1, scheduler_args=["--metrics-addr", sched_m],
                        server_args=[["--metrics-addr", server_m]], GRADHUB_HOST_REDUCE="0")
    c.wait_for("server0", "metrics on http://")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ready, go = tmp_path / "ready", tmp_path / "go"
    env = dict(c.env)
    workers = [subprocess.Popen([sys.executable, str(script), str(ready), str(go)],
                                env=dict(env, GRADHUB_RANK=str(r)), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT) for r in range(2)]
    try:
        wait_files([tmp_path / f"ready.{r}" for r in range(2)], workers)
        s1, v1 = scrape(sched_m), scrape(server_m)
        assert s1[("gradhub_members", '{gradhub_job="",role="worker"}')] == 2, s1
        assert s1[("gradhub_members", '{gradhub_job="",role="server"}')] == 1, s1
        assert s1[("gradhub_jobs", "")] == 1
        # What the servers hold: the one tensor, float32.
        assert s1[("gradhub_held_bytes", '{gradhub_job=""}')] == 300_000 * 4, s1
        # A stranger with the wrong token is counted.
        bad = subprocess.run([sys.executable, "-c", "import gradhub; gradhub.init()"], capture_output=True,
                             env=dict(env, GRADHUB_RANK="0", GRADHUB_JOB_TOKEN="wrong", GRADHUB_CONNECT_TIMEOUT="2"),
                             timeout=60)
        assert bad.returncode != 0
        assert scrape(sched_m)[("gradhub_auth_failures_total", "")] >= 1

        go.touch()
        wait_files([tmp_path / f"ready.{r}.done" for r in range(2)], workers)
        v2 = scrape(server_m)
        (tmp_path / "go.end").touch()
        outs = [w.communicate(timeout=120)[0].decode() for w in workers]
        assert all(w.returncode == 0 for w in workers), outs
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    job = '{gradhub_job=""}'
    # Each worker pushes the whole tensor each step (host stage off): 2 x 1.2 MB a step.
    step_bytes = 2 * 300_000 * 4
    assert v1[("gradhub_pushed_bytes_total", job)] == step_bytes, v1
    assert v2[("gradhub_pushed_bytes_total", job)] == 4 * step_bytes, v2
    assert v2[("gradhub_returned_bytes_total", job)] == 4 * step_bytes, v2
    assert v2[("gradhub_rounds_total", job)] > v1[("gradhub_rounds_total", job)] > 0
    count = ("gradhub_round_latency_seconds_count", job)
    assert v2[count] == v2[("gradhub_rounds_total", job)] > v1[count]
    assert v2[("gradhub_round_latency_seconds_bucket", '{le="+Inf",gradhub_job=""}')] == v2[count]
    assert v2[("gradhub_resident_bytes", "")] > 0
    assert v2[("gradhub_cpu_seconds_total", "")] > 0
    # The Grafana dashboard (deploy/grafana/) queries only metrics the scheduler and server export.
    exported = {n for n, _ in s1} | {n for n, _ in v2}
    queried = dashboard_metrics()
    assert queried and queried <= exported, queried - exported


def dashboard_metrics() -> set[str]:
    """Every metric deploy/grafana/gradhub-dashboard.json queries (its
    panels' expressions and its variables' queries; `gradhub_job` is a label)."""
    import json
    import re
    from pathlib import Path

    d = json.loads((Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "gradhub-dashboard.json")
                   .read_text())
    texts = [t["expr"] for p in d["panels"] for t in p["targets"]]
    texts += [v["query"] for v in d["templating"]["list"] if v.get("type") == "query"]
    return {m for t in texts for m in re.findall(r"\bgradhub_[a-z_]+\b", t)} - {"gradhub_job"}


def test_service_metrics_per_job(service, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    svc = service(servers=1, args=("--metrics-addr", addr))
    done = tmp_path / "done"  # the job runs until the test has seen its counters move
    names = svc.start_job("alpha", 2, dtype="float32", steps=10, size=30_000, sleep=0.05, until=str(done))
    st = svc.wait_until(lambda st: any(j["pushed_bytes"] > 0 for j in st["jobs"]), "traffic reports")
    first = scrape(addr)
    job = '{gradhub_job="alpha"}'
    assert first[("gradhub_jobs", "")] == 1
    assert first[("gradhub_members", '{gradhub_job="alpha",role="worker"}')] == 2, first
    assert first[("gradhub_members", '{gradhub_job="alpha",role="server"}')] == 1, first
    # The same figure `gradhub status` reports (its tensors: 30 000 floats and the worker's own small ones,
    # which may come and go between two reads: the scrape is one of the figures status gives around it).
    after = svc.status()["jobs"][0]["held_bytes"]
    held = first[("gradhub_held_bytes", job)]
    assert min(st["jobs"][0]["held_bytes"], after) <= held <= max(st["jobs"][0]["held_bytes"], after), (st, after)
    assert held >= 30_000 * 4
    assert first[("gradhub_pushed_bytes_total", job)] > 0
    # The servers report every second: the counters move while the job runs.
    deadline = time.monotonic() + 60  # a hang guard
    while scrape(addr)[("gradhub_pushed_bytes_total", job)] == first[("gradhub_pushed_bytes_total", job)]:
        assert time.monotonic() < deadline and all(svc.procs[n].poll() is None for n in names), svc.log("service")
        time.sleep(0.2)
    done.touch()
    assert all(c == 0 for c in svc.wait(names).values())
    svc.wait_until(lambda st: not st["jobs"], "the job to be gone")
    assert scrape(addr)[("gradhub_jobs", "")] == 0
