"""Worker: every gradhub.torch API function against its definition."""

import threading

import numpy as np
import torch

import gradhub
import gradhub.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
assert hvd.is_initialized() and 0 <= hvd.local_rank() < hvd.local_size()


def close(a, b, tol=1e-6):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (a.flatten()[:5], b.flatten()[:5])


def mine(shape, dtype=torch.float32, rank=None):
    rank = r if rank is None else rank
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-20, 20, shape, generator=g).to(dtype)


def everyone(shape, dtype=torch.float32):
    return [mine(shape, dtype, k) for k in range(n)]


# allreduce: average (default), sum, op=, and the Horovod average= spelling.
for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32):
    x = mine((3, 5), dtype)
    total = sum(t.double() for t in everyone((3, 5), dtype))
    s = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}")
    assert s.dtype == dtype and torch.equal(x, mine((3, 5), dtype)), "allreduce must not modify its input"
    close(s, total)
    if dtype.is_floating_point:
        close(hvd.allreduce(x, name=f"avg.{dtype}"), total / n, 1e-2 if dtype != torch.float32 else 1e-6)
        close(hvd.allreduce(x, average=False, name=f"avgF.{dtype}"), total)
close(hvd.push_pull(mine((7,)), average=False, name="pp"), sum(everyone((7,))))

# float64 and the integers are summed exactly, in their own type (no detour
# through float32, which is exact only below 2^24); small integers and bool
# through int64, wrapping (and OR-ing) as torch's sums do.
big = torch.full((4,), 2**40 + r, dtype=torch.int64)
want = torch.full((4,), n * 2**40 + n * (n - 1) // 2, dtype=torch.int64)
assert torch.equal(hvd.allreduce(big, op=hvd.Sum, name="exact.i64"), want)
fine = torch.full((4,), 1.0 + 2.0**-40 * (r + 1), dtype=torch.float64)
want = torch.full((4,), n + 2.0**-40 * (n * (n + 1) // 2), dtype=torch.float64)
assert torch.equal(hvd.allreduce(fine, op=hvd.Sum, name="exact.f64"), want)
wrap = torch.tensor([2**31 - 1 - r], dtype=torch.int32)
want = torch.tensor([sum(2**31 - 1 - k for k in range(n))], dtype=torch.int64).to(torch.int32)
assert torch.equal(hvd.allreduce(wrap, op=hvd.Sum, name="exact.i32"), want), "int32 sums wrap like torch's"
assert torch.equal(hvd.allreduce(torch.tensor([2 * r + 1]), name="exact.avg"), torch.tensor([n]))
u8 = torch.full((3,), 200, dtype=torch.uint8)
assert torch.equal(hvd.allreduce(u8, op=hvd.Sum, name="exact.u8"), torch.full((3,), 200 * n, dtype=torch.int64)
                   .to(torch.uint8))
flags = torch.tensor([r == 0, False])
assert torch.equal(hvd.allreduce(flags, op=hvd.Sum, name="exact.bool"), torch.tensor([True, False]))
# The numpy API: the same exact sums; average=True of integers is refused before anything is sent.
a = np.full(5, 2**40 + r, dtype=np.int64)
assert (gradhub.push_pull(a, name="np.i64") == n * 2**40 + n * (n - 1) // 2).all()
try:
    gradhub.push_pull(np.ones(3, dtype=np.int32), name="np.avg", average=True)
    raise AssertionError("average of integers must be refused")
except ValueError as e:
    assert "floating-point" in str(e), e

# In place and async.
x = mine((4, 4))
out = hvd.allreduce_(x, op=hvd.Sum, name="inplace")
assert out is x
close(x, sum(everyone((4, 4))))
handles = [hvd.allreduce_async(mine((100,)) * (i + 1), op=hvd.Sum, name=f"async.{i}") for i in range(10)]
for i, h in enumerate(handles):
    close(hvd.synchronize(h), sum(everyone((100,))) * (i + 1))
    assert hvd.poll(h)
y = mine((6,))
h = hvd.allreduce_async_(y, op=hvd.Average, name="async_inplace")
assert hvd.synchronize(h) is y
close(y, sum(everyone((6,))) / n)
# Completion callbacks (the DDP hook's path).
got, ready = [], threading.Event()


def on_done(handle):
    got.append(handle.wait())
    ready.set()


h = hvd.allreduce_async(mine((8,)), op=hvd.Sum, name="callback")
h.add_done_callback(on_done)
assert ready.wait(60)
close(got[0], sum(everyone((8,))))
# Already done: called at once, on this thread.
seen = []
h.add_done_callback(lambda handle: seen.append((handle is h, threading.current_thread() is threading.main_thread())))
assert seen == [(True, True)], seen

# Compression round trip: fp16 / bf16 error bounds.
v = torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10
exact = hvd.allreduce(v, op=hvd.Sum, name="cmp.exact")
for comp, eps in ((hvd.Compression.fp16, 2.0**-10), (hvd.Compression.bf16, 2.0**-7)):
    got = hvd.allreduce(v, op=hvd.Sum, name=f"cmp.{comp.__name__}", compression=comp)
    assert got.dtype == torch.float32
    # each input rounded once, the f32 sum rounded once more
    bound = (exact.abs() + n * 40) * eps
    assert torch.all((got - exact).abs() <= bound), (got - exact).abs().max()
    c, ctx = comp.compress(v)
    assert c.dtype in (torch.float16, torch.bfloat16) and comp.decompress(c, ctx).dtype == torch.float32

# broadcast from every root, every dtype (bytes are exact).
for root in range(n):
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool):
        x = (mine((2, 3), torch.float64) + 0.25).to(dtype)
        want = (mine((2, 3), torch.float64, root) + 0.25).to(dtype)
        got = hvd.broadcast(x, root_rank=root, name=f"b.{root}.{dtype}")
        assert got.dtype == dtype and torch.equal(got, want), (root, dtype)
        hvd.broadcast_(x, root, name=f"b_.{root}.{dtype}")
        assert torch.equal(x, want)
    h = hvd.broadcast_async(mine((5,)), root, name=f"ba.{root}")
    close(hvd.synchronize(h), mine((5,), rank=root))

# allgather with uneven first dimensions.
for dtype in (torch.float32, torch.int64, torch.float16):
    x = torch.full((r + 1, 3), r, dtype=dtype)
    got = hvd.allgather(x, name=f"ag.{dtype}")
    want = torch.cat([torch.full((k + 1, 3), k, dtype=dtype) for k in range(n)])
    assert got.dtype == dtype and torch.equal(got, want), got
# Differentiable allgather, as Horovod: the workers' output gradients are
# averaged and each takes its rows (every worker's w is 2 + its rank here).
x = torch.ones(2, 2, requires_grad=True)
g = hvd.allgather(x, name="ag.grad")
(g * (2.0 + r)).sum().backward()
close(x.grad, torch.full((2, 2), 2.0 + (n - 1) / 2))
# Differentiable broadcast, as Horovod: the root gets the averaged gradient, the others zero.
x = torch.ones(3, requires_grad=True)
(hvd.broadcast(x, 0, name="bc.grad") * (1.0 + r)).sum().backward()
close(x.grad, torch.full((3,), 1.0 + (n - 1) / 2 if r == 0 else 0.0))
# Differentiable allreduce.
x = torch.ones(3, requires_grad=True)
hvd.allreduce(x, op=hvd.Sum, name="ar.grad").sum().backward()
close(x.grad, torch.full((3,), float(n)))

# Objects, parameters and optimizer state.
obj = {"rank": r, "text": "x" * (r * 100), "t": torch.arange(r + 1)}
got = hvd.broadcast_object(obj, root_rank=n - 1)
assert got["rank"] == n - 1 and got["text"] == "x" * ((n - 1) * 100) and torch.equal(got["t"], torch.arange(n))
torch.manual_seed(r)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
model(torch.randn(8, 4)).sum().backward()
opt.step()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
flat = torch.cat([t.detach().float().flatten() for t in model.state_dict().values()])
assert torch.equal(hvd.broadcast(flat, 0, name="check.params"), flat)
assert opt.param_groups[0]["lr"] == 0.1
bufs = torch.cat([opt.state[p]["momentum_buffer"].flatten() for p in model.parameters()])
assert torch.equal(hvd.broadcast(bufs, 0, name="check.momentum"), bufs)
# A fresh optimizer's state is made first (one zero-gradient step), as in Horovod.
fresh = torch.nn.Linear(3, 2)
fopt = torch.optim.Adam(fresh.parameters(), lr=0.1)
hvd.broadcast_optimizer_state(fopt, root_rank=0)
assert all(set(fopt.state[p]) >= {"exp_avg", "exp_avg_sq", "step"} for p in fresh.parameters()), fopt.state
# Parameters without a gradient keep the step's zeros, as in Horovod (whose tests read them).
assert all(float(fopt.state[p]["step"]) == 1 and torch.equal(p.grad, torch.zeros_like(p)) for p in fresh.parameters())
try:
    hvd.broadcast_optimizer_state(torch.optim.LBFGS(fresh.parameters()), root_rank=0)
    raise AssertionError("expected ValueError")
except ValueError as e:
    assert "LBFGS" in str(e), e

# SyncBatchNorm equals BatchNorm over the combined batch (forward and gradients).
torch.manual_seed(7)
full = torch.randn(4 * n, 3, 5)
ref = torch.nn.BatchNorm1d(3)
sbn = hvd.SyncBatchNorm(3)
sbn.load_state_dict(ref.state_dict())
xf = full.clone().requires_grad_(True)
yr = ref(xf)
(yr * torch.arange(yr.numel()).reshape(yr.shape)).sum().backward()
xs = full[4 * r:4 * (r + 1)].clone().requires_grad_(True)
ys = sbn(xs)
(ys * torch.arange(yr.numel()).reshape(yr.shape)[4 * r:4 * (r + 1)]).sum().backward()
close(ys, yr[4 * r:4 * (r + 1)].detach(), 1e-5)
close(xs.grad, xf.grad[4 * r:4 * (r + 1)], 1e-4)
close(sbn.running_mean, ref.running_mean, 1e-5)
close(sbn.running_var, ref.running_var, 1e-5)
close(hvd.allreduce(sbn.weight.grad, op=hvd.Sum, name="sbn.w"), ref.weight.grad, 1e-4)

print("PASS", r, flush=True)
hvd.shutdown()
