"""Worker: Horovod's join for uneven data. Worker r has 2 + 2r batches; a
worker out of data joins, and takes part in the others' allreduces,
unnamed calls and DistributedOptimizer gradients with zeros (an average
still divides by every worker, as in Horovod); an allgather (or broadcast)
then raises on the others, as in Horovod. The
parameters are checked against the same training computed here, and after
the join every worker takes the last one's parameters and goes on in step
(a second epoch)."""

import torch
import torch.nn.functional as F

import gradhub.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()


def batches(k):
    return 2 + 2 * k


def data(k, s):
    g = torch.Generator().manual_seed(100 * k + s)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def make():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


# Reference: at step s, the gradient is the sum over the workers that still
# have data, divided by every worker (joined ones contribute zeros).
ref = make()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
for s in range(batches(n - 1)):
    ref_opt.zero_grad()
    grads = [torch.zeros_like(p) for p in ref.parameters()]
    for k in range(n):
        if s < batches(k):
            ref.zero_grad()
            x, y = data(k, s)
            F.cross_entropy(ref(x), y).backward()
            grads = [g + p.grad for g, p in zip(grads, ref.parameters())]
    for p, g in zip(ref.parameters(), grads):
        p.grad = g / n
    ref_opt.step()

model = make()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
for s in range(batches(r)):
    opt.zero_grad()
    x, y = data(r, s)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    # Other operations while some workers have joined.
    active = sum(1 for k in range(n) if s < batches(k))
    got = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, name="metric")
    assert got.item() == sum(k + 1 for k in range(n) if s < batches(k)), (s, got)
    unnamed = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    assert torch.equal(unnamed, torch.full((3,), float(active))), (s, unnamed)
    # As in Horovod, an allgather while a worker has joined raises on the others.
    try:
        rows = hvd.allgather(torch.full((r + 1, 2), float(r)), name="rows")
    except RuntimeError as e:
        assert active < n and "joined" in str(e), (s, e)
    else:
        assert active == n and rows.shape[0] == sum(k + 1 for k in range(n)), (s, rows.shape)
last = hvd.join()
assert last == n - 1, last  # the worker with the most data joins last
# A joined worker's model stopped at its last batch: take the last one's,
# as Horovod's documentation says.
hvd.broadcast_parameters(model.state_dict(), root_rank=last)
for p, q in zip(model.parameters(), ref.parameters()):
    assert torch.allclose(p, q, atol=1e-6), (p, q)

# After the join everyone goes on in step, unnamed names included.
x = hvd.allreduce(torch.ones(2), op=hvd.Sum)
assert torch.equal(x, torch.full((2,), float(n))), x
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
assert torch.equal(hvd.broadcast(flat, 0, name="after.check"), flat)
# A second epoch with the roles reversed: worker 0 has the most data.
for s in range(batches(n - 1 - r)):
    hvd.allreduce(torch.ones(1), name="epoch2")
if n == 2 and r == 0:
    # Worker 1 has joined (its zeros completed the last rounds): a barrier
    # could never complete, and says so.
    try:
        hvd.barrier()
        raise AssertionError("expected an error")
    except ValueError as e:
        assert "join()" in str(e), e
assert hvd.join() == 0
# join() with an operation of one's own in flight is refused. (Worker 0's
# cannot complete before the others pass the barrier it enters afterwards.)
if r == 0 and n > 1:
    h = hvd.allreduce_async(torch.ones(1), name="inflight")
    try:
        hvd.join()
        raise AssertionError("expected an error")
    except ValueError as e:
        assert "in flight" in str(e), e
    hvd.barrier()
    hvd.synchronize(h)
elif n > 1:
    hvd.barrier()
    hvd.allreduce(torch.ones(1), name="inflight")
print("PASS", r, flush=True)
hvd.shutdown()
