"""The benchmarks: gradhub's (`gradhub bench`: loopback, tensors, timeline
pictures) and the lab's (`gradhub-lab`, lab/gradhub_lab/): pure parts
(profiles, formulas, aggregation) and small end-to-end runs on a 2-host
emulated cluster."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradhub.plan import models as profiles
from gradhub.plan.theory import allreduce_time, byteps_optimum_time, host_link_bytes, ring_host_link_bytes
from gradhub_lab import netns
from gradhub_lab.runner import Layout, core_link_bytes, ring_core_link_bytes, summarize
from conftest import job_env

# Published parameter counts (torchvision for the CNNs, Hugging Face for the transformers).
PUBLISHED = {
    "vgg19": 143_667_240,
    "resnet50": 25_557_032,
    "alexnet": 61_100_840,
    "inception_v3": 27_161_264,   # with the auxiliary classifier
    "bert_base": 109_482_240,     # BertModel with pooler
    "gpt2_small": 124_439_808,    # GPT2Model, tied output head
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_profile_sizes_match_the_real_architectures(name):
    p = profiles.get(name)
    assert p.num_params == PUBLISHED[name]
    times = p.compute_times()
    assert len(times) == len(p.layers) and all(f >= 0 and b == pytest.approx(2 * f) for f, b in times)
    assert sum(f + b for f, b in times) == pytest.approx(p.time_per_batch)


def test_profile_layer_structure():
    vgg = profiles.vgg19()
    # 16 conv + 3 fc layers, in forward order; the first FC layer dominates the bytes.
    assert len(vgg.layers) == 19 and vgg.layers[0].name == "features.0" and vgg.layers[-1].name == "classifier.6"
    assert vgg.layers[16].params[0] == 25088 * 4096
    # Convolutions dominate VGG's FLOPs, FC layers its parameters.
    conv_flops = sum(l.flops for l in vgg.layers[:16])
    assert conv_flops / sum(l.flops for l in vgg.layers) > 0.95
    r50 = profiles.resnet50()
    assert r50.layers[0].name == "conv1" and r50.layers[-1].name == "fc"
    with pytest.raises(ValueError, match="unknown model profile"):
        profiles.get("lenet")


def test_byteps_optimum_formula():
    M, B = 100e6, 1e9  # bytes, bits/s
    for n in (2, 4, 8):
        # k = 0: equals ring all-reduce; k = n: M/B per direction, the PS optimum.
        assert byteps_optimum_time(n, 0, M, B) == pytest.approx(allreduce_time(n, M, B))
        assert byteps_optimum_time(n, n, M, B) == pytest.approx(M * 8 / B)
        # More CPU machines never hurt, and beyond n they do not help.
        ts = [byteps_optimum_time(n, k, M, B) for k in range(n + 3)]
        assert all(a >= b for a, b in zip(ts, ts[1:]))
        assert ts[n] == ts[n + 2]
    assert byteps_optimum_time(1, 0, M, B) == 0.0
    # n = 4, k = 2: 2*4*3 / (16 + 8 - 4) = 1.2 M/B.
    assert byteps_optimum_time(4, 2, M, B) == pytest.approx(1.2 * M * 8 / B)


def test_host_link_bytes_formula():
    M = 100e6
    for n in (2, 3, 4, 8):
        # k = 0: each host sends and receives 2(n-1)/n of the model, as a ring all-reduce's link does.
        assert host_link_bytes(n, 0, M) == pytest.approx(2 * (n - 1) / n * M)
        # Only CPU-only servers (k >= n, or none colocated): push M, pull M.
        assert host_link_bytes(n, n, M) == pytest.approx(M)
        assert host_link_bytes(n, n + 2, M) == pytest.approx(M)
        assert host_link_bytes(n, 2, M, colocated=False) == pytest.approx(M)
        # Without the host stage every one of a host's W workers pushes and pulls for itself.
        assert host_link_bytes(n, 1, M, workers_per_host=4, host_reduce=False) == \
            pytest.approx(4 * host_link_bytes(n, 1, M, workers_per_host=4))
    # Two hosts: M per direction whatever k; n = 4, k = 2: c = 2/20, M (1 + 2 c) = 1.2 M.
    assert [host_link_bytes(2, k, M) for k in range(4)] == pytest.approx([M] * 4)
    assert host_link_bytes(4, 2, M) == pytest.approx(1.2 * M)
    assert host_link_bytes(1, 0, M) == 0.0
    # gloo's ring over 2 hosts x 4 processes ranked host by host: one ring edge per host and direction.
    assert ring_host_link_bytes(2, 4, M) == pytest.approx(2 * 7 / 8 * M)
    lay = Layout(2, 1, True, 1, 3)
    assert lay.num_workers == 6 and lay.num_servers == 3
    assert lay.rack_of() == {}
    # 4 hosts in 2 racks (contiguous), CPU-only servers round-robin; core links per direction.
    racks = Layout(4, 2, True, 1, 1, racks=2)
    assert racks.rack_of() == {"w0": 0, "w1": 0, "w2": 1, "w3": 1, "s0": 0, "s1": 1}
    assert core_link_bytes(Layout(4, racks=2), M, False) == pytest.approx(2 * M)
    assert core_link_bytes(Layout(4, racks=2), M, True) == pytest.approx(M)
    assert core_link_bytes(Layout(6, racks=3), M, True) == pytest.approx(4 / 3 * M)
    assert ring_core_link_bytes(Layout(4, racks=2), M) == pytest.approx(1.5 * M)
    assert lay.worker_slots() == [(0, "w0", 0), (1, "w0", 1), (2, "w0", 2), (3, "w1", 0), (4, "w1", 1), (5, "w1", 2)]


def test_summarize_host_bytes_per_iteration():
    net = lambda tx, rx: {"tx0": 1000, "rx0": 2000, "tx1": 1000 + tx, "rx1": 2000 + rx}
    rs = [{"iter_times": [0.1] * 4, "host": "w0", "net": net(400, 800)},
          {"iter_times": [0.1] * 4, "host": "w0", "net": net(440, 800)},
          {"iter_times": [0.1] * 4, "host": "w1", "net": net(800, 400), "sum_error": 0.0}]
    s = summarize(rs)
    assert s["host_bytes"] == {"w0": {"tx": 105.0, "rx": 200.0}, "w1": {"tx": 200.0, "rx": 100.0}}
    assert s["host_tx_per_iter"] == pytest.approx(152.5) and s["host_rx_per_iter"] == pytest.approx(150.0)
    assert s["result_error"] == 0.0


def test_fc_faithful_parameters_are_compared_with_ddps(tmp_path):
    # Each system's dumped FC parameters against DDP's of the same trial:
    # the largest difference relative to the tensor's largest value.
    import torch

    from gradhub_lab import training

    want = {"a.weight": torch.tensor([[1.0, -2.0], [4.0, 0.5]]), "a.bias": torch.tensor([0.25, -0.5])}
    got = {"a.weight": want["a.weight"] + torch.tensor([[0.0, 0.0], [0.02, 0.0]]), "a.bias": want["a.bias"].clone()}
    torch.save(want, tmp_path / "ddp.pt")
    torch.save(got, tmp_path / "gh.pt")
    torch.save(want, tmp_path / "same.pt")
    runs = [("none", {"dump": None}), ("ddp", {"dump": str(tmp_path / "ddp.pt")}),
            ("gradhub/priority", {"dump": str(tmp_path / "gh.pt")}), ("gradhub/nosfb", {"dump": str(tmp_path / "same.pt")})]
    training._compare_with_ddp(runs)
    assert runs[2][1]["fc_param_diff"] == pytest.approx(0.02 / 4.0)
    assert runs[3][1]["fc_param_diff"] == 0.0
    assert "fc_param_diff" not in runs[0][1] and "fc_param_diff" not in runs[1][1]


def test_summarize_aggregates_workers():
    rs = [
        {"iter_times": [0.1, 0.1, 0.1], "batch": 32, "compute_per_iter": 0.08},
        {"iter_times": [0.2, 0.2, 0.2], "batch": 32, "compute_per_iter": 0.08},
    ]
    s = summarize(rs)
    assert s["iter_time_mean"] == pytest.approx(0.2)  # slowest worker sets the pace
    assert s["samples_per_s"] == pytest.approx(2 * 32 / 0.2)
    assert s["scaling_efficiency"] == pytest.approx(0.08 / 0.2)
    assert s["iter_time_p50"] in (0.1, 0.2) and s["iter_time_max"] == 0.2
    g = summarize([{"iter_times": [0.5, 0.5], "bytes": 1e9}])
    assert g["goodput_Bps"] == pytest.approx(2e9)
    with pytest.raises(ValueError):
        summarize([])


def test_parse_rate():
    assert netns.parse_rate("1gbit") == 10**9
    assert netns.parse_rate("500mbit") == 5 * 10**8
    assert netns.parse_rate("2.5Gbit") == 25 * 10**8
    with pytest.raises(ValueError):
        netns.parse_rate("fast")


@pytest.mark.machine_wide
def test_cluster_end_to_end_two_hosts(tmp_path):
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "res.jsonl"
    # FC-faithful: the FC head is real nn.Linear layers, exchanged as
    # sufficient factors by default; their parameters after training are
    # compared with DDP's, and every run is put beside the no-sync one.
    argv = [sys.executable, "-m", "gradhub_lab", "train", "--model", "alexnet", "--workers", "2",
            "--scale", "64", "--iters", "3", "--warmup", "1", "--rate", "1gbit", "--fc-faithful", "--json", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["none", "ddp", "gradhub/priority"]
    for r in rows:
        assert r["samples_per_s"] > 0 and 0 < r["scaling_efficiency"] <= 1.2
        assert r["busy_cores"] is None or 0 <= r["busy_cores"] <= 2.5
        # The training thread's CPU per iteration: some, never more than the iteration's time.
        assert 0 < r["main_cpu_ms"] <= 1e3 * r["iter_time_mean"] * 1.05, r
    none, ddp, gh = rows
    assert gh["sfb_layers"] == 3, gh
    assert gh["fc_param_diff"] < 1e-5, gh["fc_param_diff"]  # the average of the same gradients as DDP's
    assert gh["vs_none"] == pytest.approx(gh["samples_per_s"] / none["samples_per_s"])
    assert "of the no-sync run" in p.stdout and "from DDP's" in p.stdout
    # Nothing is left behind.
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "ghb" not in left
    # --env reaches every gradhub role: with the narrowest spread (one
    # chunk at a time past the oldest unreceived) across hosts, every sum
    # still comes out exact (a wrong one fails the run). k=1: the colocated
    # servers and a CPU-only one (k=0 alone: the goodput test below).
    g = subprocess.run([sys.executable, "-m", "gradhub_lab", "goodput", "--workers", "2", "--k", "1",
                        "--mbytes", "4", "--iters", "2", "--rate", "1gbit", "--env", "GRADHUB_SPREAD_BYTES=1"],
                       capture_output=True, text=True, timeout=600, env=job_env())
    assert g.returncode == 0, g.stdout + g.stderr
    assert "gradhub k=1" in g.stdout and "gloo all-reduce" in g.stdout
    bad = subprocess.run([sys.executable, "-m", "gradhub_lab", "goodput", "--env", "GRADHUB_SPREAD_BYTES"],
                         capture_output=True, text=True, timeout=60, env=job_env())
    assert bad.returncode == 2 and "expected NAME=VALUE" in bad.stderr, bad.stderr


@pytest.mark.machine_wide
def test_two_workers_per_host_host_stage_halves_the_host_link_bytes(tmp_path):
    """2 emulated hosts x 2 workers: with the host stage a host's link carries
    what one worker would send (the theoretical figure), without it twice that,
    and gloo's ring 2(N-1)/N of the tensor; every sum is exact."""
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "gp.jsonl"
    M = 8e6
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "goodput", "--workers", "2", "--workers-per-host",
                        "2", "--k", "0", "--mbytes", "8", "--iters", "8", "--rate", "1gbit", "--host-reduce", "both",
                        "--json", str(out)], capture_output=True, text=True, timeout=300, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["label"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["gloo all-reduce", "gradhub k=0", "gradhub k=0 nohost"], p.stdout
    on, off, gloo = rows["gradhub k=0"], rows["gradhub k=0 nohost"], rows["gloo all-reduce"]
    assert on["workers"] == off["workers"] == gloo["workers"] == 4
    assert on["host_bytes_theory"] == pytest.approx(M)             # 2 hosts: M per direction
    assert off["host_bytes_theory"] == pytest.approx(2 * M)
    assert gloo["host_bytes_theory"] == pytest.approx(1.5 * M)     # 2(N-1)/N, N = 4
    for r in (on, off, gloo):
        assert r["result_error"] == 0.0, r["label"]                # exact sums (powers of 4)
        assert set(r["host_bytes"]) == {"w0", "w1"}
        for host, b in r["host_bytes"].items():
            for way in ("tx", "rx"):
                # Payload plus TCP/IP and frame headers, ACKs of the other direction.
                assert 0.95 <= b[way] / r["host_bytes_theory"] <= 1.15, (r["label"], host, b)
    assert max(on["host_tx_per_iter"], on["host_rx_per_iter"]) < 0.6 * min(off["host_tx_per_iter"],
                                                                           off["host_rx_per_iter"])
    assert "ghb" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.machine_wide
def test_train_two_workers_per_host_exact_updates(tmp_path):
    """Emulated training with 2 x 2 workers, host stage on and off: every
    parameter ends where exact averaging puts it, and the host stage's link
    bytes are those of one worker per host. (DDP on this layout: the goodput
    test above.)"""
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "tr.jsonl"
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "train", "--model", "alexnet", "--workers", "2",
                        "--workers-per-host", "2", "--scale", "64", "--iters", "3", "--warmup", "1",
                        "--systems", "gradhub", "--host-reduce", "both", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["label"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["gradhub/priority", "gradhub/priority+nohost"], p.stdout
    M = rows["gradhub/priority"]["model_bytes"]
    assert M == pytest.approx(profiles.get("alexnet").num_params * 4 / 64, rel=1e-3)
    for r in rows.values():
        assert r["workers"] == 4 and r["samples_per_s"] > 0
        assert r["result_error"] < 1e-4, r["label"]
        assert r["busy_cores"] is None or 0 <= r["busy_cores"] <= 2.5
    on, off = rows["gradhub/priority"], rows["gradhub/priority+nohost"]
    assert on["host_bytes_theory"] == pytest.approx(M) and off["host_bytes_theory"] == pytest.approx(2 * M)
    assert 0.9 <= on["host_tx_per_iter"] / M <= 1.3 and 0.9 <= on["host_rx_per_iter"] / M <= 1.3
    assert on["host_tx_per_iter"] < 0.75 * off["host_tx_per_iter"]


@pytest.mark.machine_wide
def test_train_ddp_and_fsdp_on_the_gradhub_backend_and_hook(tmp_path):
    """The torch.distributed systems on 2 emulated hosts: DDP with gradhub's
    comm hook (the lab's job), DDP and FSDP2 over the "gradhub" backend (the
    group forms its own job across the hosts' namespaces) and FSDP2 over
    gloo each train exactly (FSDP: every worker's shards), and their link
    bytes are their theory's: M each way for DDP on gradhub (2 hosts),
    4(n-1)/n M for FSDP on gloo (ring all-gathers, a reduce-scatter that
    moves an all-reduce's bytes), 1.5 M for FSDP on gradhub (each
    all-gather and reduce-scatter 0.5 M: each shard on its reader's host,
    a reduce-scatter pulls only its shard); DDP over the
    backend with a CPU-only server (the lab's job) too."""
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "torch.jsonl"
    systems = ["ddp-hook", "ddp-gradhub", "fsdp-gloo", "fsdp-gradhub"]
    p = subprocess.Popen([sys.executable, "-m", "gradhub_lab", "train", "--model", "alexnet", "--workers", "2",
                          "--scale", "64", "--iters", "2", "--warmup", "1", "--systems", ",".join(systems),
                          "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env())
    try:
        stdout, stderr = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 0, stdout + stderr
    rows = {r["label"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == systems, stdout
    M = rows["ddp-hook"]["model_bytes"]
    assert M == pytest.approx(profiles.get("alexnet").num_params * 4 / 64, rel=1e-3)
    theory = {"ddp-hook": M, "ddp-gradhub": M, "fsdp-gloo": 2 * M, "fsdp-gradhub": 1.5 * M}
    for label, r in rows.items():
        assert r["workers"] == 2 and r["samples_per_s"] > 0 and r["model_bytes"] == M, label
        assert r["result_error"] < 1e-4, (label, r["result_error"])
        assert r["host_bytes_theory"] == pytest.approx(theory[label]), label
        assert set(r["host_bytes"]) == {"w0", "w1"}, label
        for way in ("host_tx_per_iter", "host_rx_per_iter"):
            assert 0.9 <= r[way] / theory[label] <= 1.2, (label, way, r[way] / theory[label])
    # Nothing of its clusters is left behind (their namespaces are named by
    # the lab's process id and a count; other jobs may run clusters meanwhile).
    mine = re.compile(rf"^{netns.PREFIX}{p.pid % 10000}\d{{1,2}}(sched|w\d+)\b", re.M)
    assert not mine.search(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout)
    # With a CPU-only server the backend joins the lab's job (GRADHUB_SCHEDULER), as a user with
    # CPU-only server hosts starts it by hand: exact, and each worker host's link carries M each way.
    cpu = tmp_path / "cpu.jsonl"
    r = subprocess.run([sys.executable, "-m", "gradhub_lab", "train", "--model", "alexnet", "--workers", "2",
                        "--cpu-servers", "1", "--no-colocated", "--scale", "64", "--iters", "2", "--warmup", "1",
                        "--systems", "ddp-gradhub", "--json", str(cpu)], capture_output=True, text=True, timeout=300,
                       env=job_env())
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = map(json.loads, cpu.read_text().splitlines())
    assert row["result_error"] < 1e-4 and row["host_bytes_theory"] == pytest.approx(M), row
    assert set(row["server_host_bytes"]) == {"s0"}, row
    for way in ("host_tx_per_iter", "host_rx_per_iter"):
        assert 0.9 <= row[way] / M <= 1.2, (way, row[way] / M)
    bad = subprocess.run([sys.executable, "-m", "gradhub_lab", "train", "--systems", "ddp-gradhub", "--racks",
                          "2"], capture_output=True, text=True, timeout=60, env=job_env())
    assert bad.returncode == 2 and "no racks" in bad.stderr, bad.stderr


@pytest.mark.machine_wide
def test_train_across_two_racks_two_levels_halve_the_core_link_bytes(tmp_path):
    """4 emulated hosts in 2 racks joined by shaped core links: one level puts
    2N(R-1)/R of the model on each core link and direction, two levels
    2(R-1)/R (half, for N = 2 hosts per rack); both train exactly, and the
    scheduler's choice is recorded."""
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "racks.jsonl"
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "train", "--model", "alexnet", "--workers", "4",
                        "--racks", "2", "--core-rate", "1gbit", "--scale", "64", "--iters", "3", "--warmup", "1",
                        "--systems", "gradhub", "--variants", "flat,racks", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["label"]: r for r in map(json.loads, out.read_text().splitlines())}
    flat, two = rows["gradhub/flat"], rows["gradhub/racks"]
    M = flat["model_bytes"]
    assert flat["core_bytes_theory"] == pytest.approx(2 * M) and two["core_bytes_theory"] == pytest.approx(M)
    assert flat["rack_choice"].startswith("two-level reduction is off") and two["rack_choice"].startswith("two levels")
    for r in (flat, two):
        assert r["result_error"] < 1e-4, r["label"]
        assert set(r["core_bytes"]) == {"core0", "core1"}, r["core_bytes"]
        for rack, b in r["core_bytes"].items():
            for way in ("tx", "rx"):
                assert 0.9 <= b[way] / r["core_bytes_theory"] <= 1.3, (r["label"], rack, b)
    assert "ghb" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.machine_wide
@pytest.mark.parametrize("extra", [["--cpu-servers", "1"], ["--no-servers"]], ids=["k1", "no-servers"])
def test_bench_cluster_runs_a_command_on_every_host(extra):
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    script = str(Path(__file__).parent / "workers" / "cluster_job.py")
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "cluster", "--workers", "2", "--rate", "500mbit",
                        *extra, "--", sys.executable, script], capture_output=True, text=True, timeout=300,
                       env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    ips = sorted(re.findall(r"\[worker (\d)@w\1\] OK rank=\1 ip=(10\.231\.\d+\.\d+)/16", p.stdout))
    assert len(ips) == 2 and ips[0][1] != ips[1][1], p.stdout
    servers = re.findall(r"\[server(?: \d+)?@(\w+)\].*serving 2 workers on (10\.231\.\S+)", p.stdout)
    assert len(servers) == (0 if "--no-servers" in extra else 3), p.stdout
    assert "ghb" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.machine_wide
def test_bench_cluster_workers_per_host_local_ranks():
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    code = ("import os\nprint('ENV', *(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE',"
            " 'GRADHUB_LOCAL_RANK', 'GRADHUB_LOCAL_SIZE')), os.readlink('/proc/self/ns/net'))")
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "cluster", "--workers", "2", "--workers-per-host",
                        "2", "--no-servers", "--", sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    seen = sorted(re.findall(r"\[worker (\d)@(w\d)\] ENV (\d) 4 (\d) 2 (\d) 2 (\S+)", p.stdout))
    assert [(r, h, lr) for r, h, rr, lr, glr, ns in seen if r == rr and lr == glr] == \
        [("0", "w0", "0"), ("1", "w0", "1"), ("2", "w1", "0"), ("3", "w1", "1")], p.stdout
    # Ranks 0-1 share w0's network namespace, 2-3 w1's.
    ns = [x[-1] for x in seen]
    assert ns[0] == ns[1] != ns[2] == ns[3], p.stdout


@pytest.mark.machine_wide
def test_bench_cluster_stops_the_job_when_a_worker_fails():
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(120)"
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "cluster", "--workers", "2", "--", sys.executable,
                        "-c", code], capture_output=True, text=True, timeout=60, env=job_env())
    assert p.returncode == 3
    assert "worker 1@w1 exited with code 3" in p.stderr
    assert "ghb" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_bench_needs_root_message(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "needs root" in netns.check_available()
    with pytest.raises(netns.ClusterError, match="needs root"):
        netns.EmulatedCluster(["w0"])


def _train_run(label, system, k, samples):
    return {"label": label, "system": system, "layout": {"cpu_servers": k}, "samples_per_s": samples,
            "scaling_efficiency": samples / 500, "iter_time_p50": 0.5, "iter_time_p90": 0.6, "busy_cores": 0.8}


def test_report_renders_tables_targets_and_keeps_the_rest(tmp_path):
    from gradhub_lab.report import BEGIN, END, update_doc

    data = tmp_path / "bench"
    data.mkdir()
    runs = [_train_run("none", "none", 0, 400.0), _train_run("ddp", "ddp", 0, 180.0),
            _train_run("gradhub k=0 fifo", "gradhub", 0, 200.0), _train_run("gradhub k=0 overlap", "gradhub", 0, 250.0),
            _train_run("gradhub k=4 overlap", "gradhub", 4, 330.0)]
    (data / "train_vgg19.json").write_text(json.dumps(
        {"model": "vgg19", "rate": "1gbit", "workers": 4, "scale": 16, "runs": runs,
         "meta": {"cpu": "TestCPU", "cores": 2, "commit": "abc1234", "date": "2026-01-01 00:00 UTC",
                  "command": "gradhub-lab suite --only train_vgg19"}}))
    opt = byteps_optimum_time(4, 0, 32e6, 1e9)
    (data / "k_sweep.json").write_text(json.dumps(
        {"workers": 4, "rate": "1gbit", "mbytes": 32, "runs": [
            {"k": 0, "iter_time_mean": opt / 0.95, "optimum_time": opt, "share_of_optimum": 0.95, "busy_cores": 0.5},
            {"k": 1, "iter_time_mean": opt / 0.8, "optimum_time": opt, "share_of_optimum": 0.8, "busy_cores": 0.7}]}))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nhand-written intro\n")
    update_doc(doc, data)
    first = doc.read_text()
    assert first.startswith("# Benchmarks\n\nhand-written intro\n") and BEGIN in first and END in first
    assert "TestCPU" in first and "abc1234" in first and "gradhub-lab suite --only train_vgg19" in first
    # Ratios are computed from the runs: 330/180 = 1.83 >= 1.8, 250/180 = 1.39 >= 1.3, overlap/FIFO = 1.25.
    assert "best is gradhub k=4 overlap at 1.83 × — **met**" in first
    assert "best is gradhub k=0 overlap at 1.39 × — **met**" in first
    assert "DDP reaches 0.36 of the compute bound and 0.45 of the no-sync run" in first
    assert "1.25 × FIFO — **met**" in first
    assert "| gradhub k=4 overlap | 330.0 | 0.66 | 0.82 |" in first
    assert "**not met** (met for k = 0; missed for k = 1)" in first
    assert "![goodput vs k](bench/k_sweep.png)" in first
    assert "Not measured yet: rate_check" in first
    # Re-rendering replaces the section in place; text after it is kept.
    doc.write_text(first + "\nhand-written outro\n")
    (data / "train_vgg19.json").write_text((data / "train_vgg19.json").read_text().replace("330.0", "200.0"))
    update_doc(doc, data)
    second = doc.read_text()
    assert second.count(BEGIN) == 1 and second.endswith("hand-written outro\n")
    assert "best is gradhub k=4 overlap at 1.11 × — **not met**" in second and "1.83" not in second


@pytest.mark.machine_wide
def test_suite_quick_end_to_end(tmp_path):
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    doc = tmp_path / "b.md"
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "suite", "--quick", "--workers", "2", "--only",
                        "k_sweep", "--out", str(tmp_path / "bench"), "--doc", str(doc)],
                       capture_output=True, text=True, timeout=600, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "bench" / "k_sweep.json").read_text())
    assert [r["k"] for r in data["runs"]] == [0, 1] and data["gloo"]["iter_time_mean"] > 0
    for r in data["runs"]:
        assert r["optimum_time"] == pytest.approx(byteps_optimum_time(2, r["k"], 4e6, 1e9))
        assert 0 < r["share_of_optimum"] < 1.5
    assert data["meta"]["cores"] >= 1 and "suite --quick" in data["meta"]["command"]
    assert (tmp_path / "bench" / "k_sweep.png").stat().st_size > 1000
    text = doc.read_text()
    assert "| gradhub k=1 (1 CPU-only + 2 colocated) |" in text and "gloo ring all-reduce" in text
    bad = subprocess.run([sys.executable, "-m", "gradhub_lab", "suite", "--only", "nope", "--out",
                          str(tmp_path / "x")], capture_output=True, text=True, env=job_env())
    assert bad.returncode == 2 and "unknown experiment" in bad.stderr


# ---------------------------------------------------------------- gradhub bench (the raw-TCP baseline: source checkout)


def test_bench_core_help_and_usage_errors():
    h = subprocess.run([sys.executable, "-m", "gradhub", "bench", "core", "--help"], capture_output=True, text=True,
                       timeout=60, env=job_env())
    assert h.returncode == 0 and "cargo" in h.stdout and "checkout" in h.stdout and "--quick" in h.stdout
    bad = subprocess.run([sys.executable, "-m", "gradhub", "bench", "core", "nope"], capture_output=True, text=True,
                         timeout=60, env=job_env())
    assert bad.returncode == 2 and "unknown benchmark nope" in bad.stderr


def test_bench_core_explains_a_missing_checkout_or_cargo(tmp_path, monkeypatch):
    from gradhub.bench import checkout

    monkeypatch.setattr(checkout, "_is_checkout", lambda d: False)
    with pytest.raises(checkout.CheckoutError, match="source checkout"):
        checkout.checkout_root()
    (tmp_path / "examples").mkdir()
    (tmp_path / "Cargo.toml").write_text("")
    (tmp_path / "examples" / "tcp_baseline.rs").write_text("")
    monkeypatch.setattr(checkout, "checkout_root", lambda: tmp_path)
    monkeypatch.setattr(checkout.shutil, "which", lambda name: None)
    with pytest.raises(checkout.CheckoutError, match="needs cargo"):
        checkout.tcp_baseline()


def test_bench_core_without_the_checkout_prints_gradhubs_figures_alone(tmp_path, monkeypatch, capsys):
    """Installed without the source checkout (or cargo), `gradhub bench
    core` still runs: transport and latency say why their raw-TCP baseline
    is missing and print gradhub's figures alone."""
    import argparse

    from gradhub.bench import checkout, core

    def missing():
        raise checkout.CheckoutError("this benchmark needs the gradhub source checkout")

    monkeypatch.setattr(core, "tcp_baseline", missing)
    out = tmp_path / "core.json"
    args = argparse.Namespace(which=["latency"], quick=True, json=str(out))
    assert core.run(args) == 0
    printed = capsys.readouterr()
    assert "source checkout" in printed.err and "not run" in printed.out and "gradhub push_pull" in printed.out
    lat = json.loads(out.read_text())["latency"]
    assert 0 < lat["push_pull_us"] < 100_000 and "tcp_rust_us" not in lat


def test_bench_core_latency_quick(tmp_path):
    # Builds examples/tcp_baseline.rs with cargo if `cargo test --release` has not already.
    from gradhub.bench import checkout

    try:
        checkout.checkout_root()
    except checkout.CheckoutError as e:
        pytest.skip(str(e))
    out = tmp_path / "core.json"
    p = subprocess.run([sys.executable, "-m", "gradhub", "bench", "core", "latency", "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TCP ping-pong, compiled client (baseline)" in p.stdout and "gradhub push_pull" in p.stdout
    lat = json.loads(out.read_text())["latency"]
    assert all(0 < lat[k] < 100_000 for k in ("tcp_rust_us", "tcp_python_us", "push_pull_us")), lat


def test_bench_hostile_and_state_quick(tmp_path):
    """A running job under 200 hostile connections keeps its sums, closes
    them all and keeps its threads bounded; unnamed calls leave no tensors."""
    from gradhub.bench import checkout

    try:
        checkout.checkout_root()
    except checkout.CheckoutError as e:
        pytest.skip(str(e))
    out = tmp_path / "core.json"
    p = subprocess.run([sys.executable, "-m", "gradhub", "bench", "core", "hostile", "state", "--quick",
                        "--json", str(out)], capture_output=True, text=True, timeout=600, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    h = res["hostile"]
    assert h["wrong"] == 0 and h["opened"] == h["connections"] == 200
    assert h["closed"] == h["opened"], h
    # 2 workers + 1 server: at most 2 x 3 + 16 connections register at once
    # (one thread each), and a thread that gave its place back may not have
    # exited yet when /proc is read (one such seen; 2 allowed).
    assert max(s["scheduler_threads"] for s in h["samples"]) <= h["samples"][0]["scheduler_threads"] + 22 + 2, h
    assert len({s["server_threads"] for s in h["samples"]}) == 1, h  # an event loop: no thread per connection
    assert h["logs"]["server"]["closing"] >= 100
    modes = {r["mode"]: r for r in res["state"]}
    assert all(s["worker_tensors"] == 0 for s in modes["unnamed"]["samples"])
    assert modes["unique"]["samples"][-1]["worker_tensors"] == modes["unique"]["calls"]


def test_jain_index():
    from gradhub_lab.tenancy import jain

    assert jain([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0]) == pytest.approx(0.5)
    assert jain([2.0, 1.0]) == pytest.approx(0.9)


@pytest.mark.machine_wide
def test_bench_tenancy_quick(tmp_path):
    """Two jobs at once on one shared service in the emulated cluster: both
    progress, and the report has each job's share and the fairness index."""
    reason = netns.check_available()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "tenancy.json"
    p = subprocess.run([sys.executable, "-m", "gradhub_lab", "tenancy", "--jobs", "1,2", "--duration", "2",
                        "--mib", "1", "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads(out.read_text().splitlines()[-1])
    by_jobs = {s["jobs"]: s for s in rec["summary"]}
    assert by_jobs[1]["vs_one_job"] == pytest.approx(1.0)
    assert len(by_jobs[2]["per_job_bytes_per_s"]) == 2 and min(by_jobs[2]["per_job_bytes_per_s"]) > 0
    assert 0.5 <= by_jobs[2]["jain"] <= 1.0
    assert "Jain" in p.stdout


def test_bench_tensors_reports_each_count_with_fusion_on_and_off():
    p = subprocess.run([sys.executable, "-m", "gradhub", "bench", "tensors", "--counts", "4,40", "--steps", "30",
                        "--mbytes", "0.04", "--workers", "2"], capture_output=True, text=True, timeout=300,
                       env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [l.split() for l in p.stdout.splitlines() if len(l.split()) == 7 and l.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["4", "40"], p.stdout
    for r in rows:
        t, each, base, off, on, cpu_off, cpu_on = r
        assert int(each) * int(t) == pytest.approx(40_000, rel=0.01)
        assert all(float(x) > 0 for x in (base, off, on, cpu_off, cpu_on)), r


def test_timeline_plot_draws_a_window_of_a_merged_trace(tmp_path):
    events = [{"name": "clock", "ph": "M", "pid": 0, "args": {"unix_us": 0}}]
    for i in range(50):  # a worker's chunks and operations, a server's rounds
        t = 1000.0 * i
        events += [
            {"name": "PUSH_PULL", "ph": "X", "ts": t, "dur": 900, "pid": 0, "tid": 1, "args": {}},
            {"name": "QUEUED", "ph": "X", "ts": t, "dur": 300, "pid": 0, "tid": 100000, "args": {}},
            {"name": "SEND", "ph": "X", "ts": t + 300, "dur": 300, "pid": 0, "tid": 100000, "args": {}},
            {"name": "RESULT", "ph": "X", "ts": t + 600, "dur": 300, "pid": 0, "tid": 100000, "args": {}},
            {"name": "WAIT_FOR_PUSHERS", "ph": "X", "ts": t + 300, "dur": 400, "pid": 1_000_000, "tid": 0, "args": {}},
        ]
    trace, png = tmp_path / "merged.json", tmp_path / "step.png"
    trace.write_text(json.dumps(events))
    p = subprocess.run([sys.executable, "-m", "gradhub", "bench", "timeline-plot", str(trace), str(png),
                        "--start", "10", "--span", "20"], capture_output=True, text=True, timeout=120, env=job_env())
    assert p.returncode == 0, p.stdout + p.stderr
    # 20 ms from 10 ms: 20 or 21 of each kind of span, in 3 bands (worker ops, worker chunks, server thread).
    assert "in 3 rows, 20 ms from 10 ms" in p.stdout, p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
