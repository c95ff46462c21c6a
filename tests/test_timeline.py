"""Timelines of a whole job: each worker's operations (GRADHUB_TIMELINE) and
each server's chunk rounds (`gradhub server --timeline`, how long each
waited for its pushers and which worker came last), merged on one clock by
`gradhub timeline merge`. Roles started one by one."""

import json
import subprocess
import sys

from conftest import job_env

STEPS = 6


def test_servers_and_workers_on_one_timeline(cluster_factory, tmp_path):
    c = cluster_factory(2, 2, GRADHUB_SERVER_TIMELINE=str(tmp_path / "server.{rank}.json"))
    for w in range(2):
        c.start_worker(w, "failover.py", {"steps": STEPS, "sleep": 0.05},
                       GRADHUB_TIMELINE=str(tmp_path / "worker.{rank}.json"))
    for name in ("worker0", "worker1", "scheduler", "server0", "server1"):
        assert c.procs[name].wait(timeout=120) == 0, c.log(name)
    files = [str(tmp_path / f) for f in ("worker.0.json", "worker.1.json", "server.0.json", "server.1.json")]
    merged = tmp_path / "merged.json"
    p = subprocess.run([sys.executable, "-m", "gradhub", "timeline", "merge", str(merged), *files],
                       capture_output=True, text=True, env=job_env(), timeout=60)
    assert p.returncode == 0, p.stderr
    events = json.loads(merged.read_text())
    rounds = [e for e in events if e.get("name") == "WAIT_FOR_PUSHERS"]
    finish = [e for e in events if e.get("name") == "FINISH_ROUND"]
    assert {e["pid"] for e in rounds} <= {1_000_000, 1_000_001} and len(finish) == len(rounds)
    # 'small' is one chunk: one round per step, on one server, rounds 0..STEPS-1.
    small = sorted((e for e in rounds if e["args"]["tensor"] == "small"), key=lambda e: e["args"]["round"])
    assert [e["args"]["round"] for e in small] == list(range(STEPS)), small
    for e in rounds:
        assert e["dur"] >= 0 and {e["args"]["first"], e["args"]["last"]} <= {0, 1}, e
    # Every chunk's round is recorded: a 300,000-float tensor is 5 chunks of 256 KiB.
    big = {(e["args"]["chunk"], e["args"]["round"]) for e in rounds if e["args"]["tensor"] == "big"}
    assert big == {(ch, r) for ch in range(5) for r in range(STEPS)}, sorted(big)
    # One clock: each round of 'small' ends at its server before it ends at
    # the workers (whose operation needs the result), up to the clocks' jitter.
    for w in (0, 1):
        ops = sorted((e for e in events if e.get("pid") == w and e.get("ph") == "X"
                      and e["args"]["tensor"] == "small"), key=lambda e: e["ts"])
        assert len(ops) == STEPS, ops
        for op, rnd in zip(ops, small):
            assert rnd["ts"] + rnd["dur"] <= op["ts"] + op["dur"] + 5_000, (rnd, op)
            assert rnd["ts"] + 5_000 >= op["ts"], (rnd, op)


def test_a_workers_chunks_have_their_stages_on_the_timeline(cluster_factory, tmp_path):
    """Beside each worker's operations its core records every chunk it
    pushes: QUEUED, SEND and (when another push completed the round) RESULT,
    back to back, within the operation that pushed it."""
    c = cluster_factory(2, 2, GRADHUB_PARTITION_BYTES=65536)
    for w in range(2):
        # Hosts of their own: each worker pushes every chunk.
        c.start_worker(w, "failover.py", {"steps": STEPS, "sleep": 0.05}, GRADHUB_HOST_ID=f"host{w}",
                       GRADHUB_TIMELINE=str(tmp_path / "worker.{rank}.json"))
    for name in ("worker0", "worker1", "scheduler", "server0", "server1"):
        assert c.procs[name].wait(timeout=120) == 0, c.log(name)
    for w in (0, 1):
        ops = [e for e in json.loads((tmp_path / f"worker.{w}.json").read_text().rstrip().rstrip(",") + "]")
               if e.get("ph") == "X"]
        path = tmp_path / f"worker.{w}.chunks.json"
        events = json.loads(path.read_text().rstrip().rstrip(",") + "]")
        clock = [e for e in events if e.get("name") == "clock"]
        assert len(clock) == 1 and all(e["pid"] == w for e in events), events[:3]
        rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        stages = [e for e in events if e.get("ph") == "X"]
        by_chunk = {}
        for e in stages:
            assert e["tid"] in rows and rows[e["tid"]] == f"{e['args']['tensor']} (chunks)", e
            assert e["dur"] >= 0, e
            by_chunk.setdefault((e["args"]["tensor"], e["args"]["chunk"], e["args"]["round"]), []).append(e)
        # 'big' (300,000 floats) is 19 chunks of 64 KiB, each pushed once per step.
        big = {k for k in by_chunk if k[0] == "big"}
        assert big == {("big", ch, r) for ch in range(19) for r in range(STEPS)}, sorted(big)
        finished_by_result = 0
        for key, evs in by_chunk.items():
            names = [e["name"] for e in sorted(evs, key=lambda e: e["ts"])]
            assert names in (["QUEUED", "SEND", "RESULT"], ["QUEUED", "SEND"]), (key, names)
            finished_by_result += names == ["QUEUED", "SEND"]
            # Back to back: each stage starts where the one before it ended.
            evs = sorted(evs, key=lambda e: e["ts"])
            for a, b in zip(evs, evs[1:]):
                assert abs(a["ts"] + a["dur"] - b["ts"]) < 1.0, (a, b)
        # Some pushes completed their round (answered by the result itself), some waited for the other worker.
        assert 0 < finished_by_result < len(by_chunk)
        # Within the push_pull that sent them (one file's clock: the two files start within a moment).
        small_ops = sorted((e for e in ops if e["args"]["tensor"] == "small"), key=lambda e: e["ts"])
        small = sorted((e for e in stages if e["args"]["tensor"] == "small" and e["name"] == "QUEUED"),
                       key=lambda e: e["ts"])
        assert len(small_ops) == len(small) == STEPS
