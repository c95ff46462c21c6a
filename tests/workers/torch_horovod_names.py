"""Worker: Horovod names gradhub.torch added for scripts that use more than
allreduce: Min/Max/Product, pre/postscaling, grouped allreduce, allgather_object,
barrier, cross rank/size, the build queries, HorovodInternalError, elastic.
Config: hosts (the host identity of every rank, when the test set them)."""

import json
import os

import torch

import gradhub.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
cfg = json.loads(os.environ.get("GH_TEST", "{}"))


def mine(shape, dtype, rank=None):
    g = torch.Generator().manual_seed(300 + (r if rank is None else rank))
    return torch.randint(-9, 10, shape, generator=g).to(dtype)


def everyone(shape, dtype):
    return torch.stack([mine(shape, dtype, k) for k in range(n)])


# Min, Max, Product: exact for every dtype (gathered, reduced here).
for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16):
    x = mine((4, 3), dtype)
    allx = everyone((4, 3), dtype)
    for op, want in ((hvd.Min, allx.amin(0)), (hvd.Max, allx.amax(0)), (hvd.Product, allx.prod(0).to(dtype))):
        got = hvd.allreduce(x, op=op, name=f"{op.name}.{dtype}")
        assert got.dtype == dtype and torch.equal(got, want), (op, dtype, got, want)
        assert torch.equal(x, mine((4, 3), dtype)), "allreduce must not modify its input"
    y = x.clone()
    h = hvd.allreduce_async_(y, op=hvd.Max, name=f"max_.{dtype}")
    assert hvd.synchronize(h) is y and torch.equal(y, allx.amax(0))

# Pre- and postscaling: result = postscale * reduce(prescale * x).
x = mine((7,), torch.float32)
total = everyone((7,), torch.float32).sum(0)
assert torch.equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scaled"), total)
assert torch.allclose(hvd.allreduce(x, postscale_factor=3.0, name="scaled.avg"), 3 * total / n)
assert torch.equal(hvd.allreduce(x, op=hvd.Min, prescale_factor=-1.0, name="scaled.min"),
                   -everyone((7,), torch.float32).amax(0))
xi = mine((5,), torch.int32)
got = hvd.allreduce(xi, op=hvd.Sum, prescale_factor=2.0, name="scaled.int")
assert got.dtype == torch.int32 and torch.equal(got, 2 * everyone((5,), torch.int32).sum(0).to(torch.int32))
y = x.clone()
assert torch.equal(hvd.allreduce_(y, op=hvd.Sum, postscale_factor=0.25, name="scaled.inplace"), total / 4)
assert torch.equal(y, total / 4)
# Differentiable with scaling, as Horovod: the gradient is reduced the same
# way, scaling included (each worker's ones, times 2, summed).
w = x.clone().requires_grad_(True)
hvd.allreduce(w, op=hvd.Sum, prescale_factor=2.0, name="scaled.grad").sum().backward()
assert torch.equal(w.grad, torch.full((7,), 2.0 * n)), w.grad

# Grouped allreduce: a list in, a list out, every member complete together.
group = [mine((3,), torch.float32), mine((2, 2), torch.float64), mine((4,), torch.int32)]
sums = [everyone(t.shape, t.dtype).sum(0).to(t.dtype) for t in group]
for got, want in zip(hvd.grouped_allreduce(group, op=hvd.Sum, name="grp"), sums):
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
h = hvd.grouped_allreduce_async(group, op=hvd.Sum, name="grp.async")
out = hvd.synchronize(h)
assert hvd.poll(h) and all(torch.equal(a, b) for a, b in zip(out, sums))
copies = [t.clone() for t in group]
assert all(a is b for a, b in zip(hvd.grouped_allreduce_(copies, op=hvd.Sum, name="grp.inplace"), copies))
assert all(torch.equal(a, b) for a, b in zip(copies, sums))
maxes = hvd.grouped_allreduce(group, op=hvd.Max, name="grp.max")
assert all(torch.equal(a, everyone(t.shape, t.dtype).amax(0)) for a, t in zip(maxes, group))

# allgather_object: every rank's object, by rank (sizes differ).
objs = hvd.allgather_object({"rank": r, "pad": "x" * (10 * r)}, name="objs")
assert objs == [{"rank": k, "pad": "x" * (10 * k)} for k in range(n)], objs

# barrier, layout queries.
hvd.barrier()
hosts = cfg.get("hosts")
if hosts:
    local = [hosts[:k].count(hosts[k]) for k in range(n)]  # local rank: rank order within a host
    same = [k for k in range(n) if local[k] == local[r]]
    assert (hvd.local_rank(), hvd.cross_rank(), hvd.cross_size()) == (local[r], same.index(r), len(same)), \
        (hvd.local_rank(), hvd.cross_rank(), hvd.cross_size(), local)
    sizes = {h: hosts.count(h) for h in hosts}
    assert hvd.is_homogeneous() == (len(set(sizes.values())) == 1)
else:  # one host (gradhub launch)
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)

# What this build is, as Horovod asks.
for q in (hvd.mpi_built, hvd.mpi_enabled, hvd.gloo_built, hvd.gloo_enabled, hvd.nccl_built, hvd.ddl_built,
          hvd.ccl_built, hvd.cuda_built, hvd.rocm_built, hvd.mpi_threads_supported):
    assert q() is False, q
assert hvd.HorovodInternalError is hvd.GradhubError
try:
    hvd.allreduce(x, op=hvd.Adasum)
    raise AssertionError("expected NotImplementedError")
except NotImplementedError as e:
    assert "not" in str(e), e
# Horovod's elastic API is there (tests/test_elastic.py runs it).
for name in ("run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"):
    assert hasattr(hvd.elastic, name), name

# The timeline: worker 0 writes every operation as a Chrome trace event.
import tempfile  # noqa: E402

path = os.path.join(tempfile.mkdtemp(), "timeline.json")
hvd.start_timeline(path, mark_cycles=True)
hvd.allreduce(torch.ones(1000), name="tl.a")
hvd.allgather(torch.ones(r + 1), name="tl.g")
hvd.stop_timeline()
hvd.allreduce(torch.ones(10), name="tl.after")
if r == 0:
    text = open(path).read().rstrip().rstrip(",")
    events = json.loads(text + "]")
    ops = [e for e in events if e["ph"] == "X"]
    # An allreduce's shape check across workers (as Horovod's) is an operation of its own.
    assert {e["args"]["tensor"] for e in ops} == {"tl.a.shape", "tl.a", "tl.g.counts", "tl.g.data"}, ops
    a = next(e for e in ops if e["args"]["tensor"] == "tl.a")
    assert a["args"]["bytes"] == 4000 and a["args"]["dtype"] == "float32" and a["dur"] > 0, a
    rows = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert rows == {"tl.a.shape", "tl.a", "tl.g.counts", "tl.g.data"}, rows
else:
    assert not os.path.exists(path), "only worker 0 writes the timeline"

# With {rank} in the path every worker writes its own; `gradhub timeline
# merge` puts them on one clock.
shared_dir = os.environ["GH_TIMELINE_DIR"]
hvd.start_timeline(os.path.join(shared_dir, "tl.{rank}.json"))
hvd.allreduce(torch.ones(100), name="tl.each")
hvd.stop_timeline()
hvd.barrier()
if r == 0:
    import subprocess  # noqa: E402
    import sys  # noqa: E402

    files = [os.path.join(shared_dir, f"tl.{q}.json") for q in range(n)]
    merged = os.path.join(shared_dir, "merged.json")
    subprocess.run([sys.executable, "-m", "gradhub", "timeline", "merge", merged, *files], check=True)
    events = json.load(open(merged))
    ops = [e for e in events if e["ph"] == "X" and e["args"]["tensor"] == "tl.each"]
    assert sorted(e["pid"] for e in ops) == list(range(n)), ops
    # One clock: every worker's operation overlaps the others' (it needs them all).
    assert max(e["ts"] for e in ops) < min(e["ts"] + e["dur"] for e in ops), ops

print("PASS", r, flush=True)
hvd.shutdown()
