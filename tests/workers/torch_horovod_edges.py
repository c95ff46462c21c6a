"""Worker (2-3 workers): Horovod's behaviour at the edges, as its own tests
and documentation expect it: error types, integer pre/postscaling,
reducescatter's gradient, optimizer details, sparse gradients, the
disagreements it detects, barrier after operations in flight, and join
(last: it ends the job's collectives)."""

import time

import torch

import gradhub.torch as hvd


def raises(exc, fn, text=""):
    try:
        fn()
    except exc as e:
        assert text in str(e), (text, e)
        return e
    raise AssertionError(f"expected {exc.__name__} ({text})")


# ---- 1. Error types. Before init: a ValueError, as Horovod's, and a RuntimeError, as gradhub's.
for catch in (ValueError, RuntimeError):
    raises(catch, hvd.size, "not initialized")
    raises(catch, lambda: hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)))
hvd.init(process_sets="dynamic")
r, n = hvd.rank(), hvd.size()
assert n >= 2

# Disagreements: Horovod's HorovodInternalError, a RuntimeError; still a ValueError.
for catch in (RuntimeError, ValueError, hvd.HorovodInternalError):
    raises(catch, lambda: hvd.allgather(torch.ones(2, 3 + min(r, 1))), "disagree")
    raises(catch, lambda: hvd.allgather(torch.ones(2, 3, dtype=torch.float32 if r else torch.int32)), "disagree")
    raises(catch, lambda: hvd.alltoall(torch.ones(n, 2 + min(r, 1))), "disagree")
    raises(catch, lambda: hvd.alltoall(torch.ones(n, 2, dtype=torch.float64 if r else torch.float32)), "disagree")
    raises(catch, lambda: hvd.broadcast(torch.ones(3), root_rank=min(r, 1)), "root rank")
    raises(catch, lambda: hvd.broadcast(torch.ones(2, 3) if r else torch.ones(3, 2), root_rank=0), "shapes")
# Adasum in reducescatter: a RuntimeError, as Horovod's (NotImplementedError is one).
raises(RuntimeError, lambda: hvd.reducescatter(torch.ones(n * 2), op=hvd.Adasum), "Adasum")

# ---- 7. Disagreements the core alone would not see: every worker raises, and goes on.
# Other sizes or dtypes: the core's GradhubError (a RuntimeError, as Horovod's).
raises(RuntimeError, lambda: hvd.allreduce(torch.ones([17 + min(r, 1)] * 3)), "declared inconsistently")
raises(RuntimeError, lambda: hvd.allreduce(torch.ones(6, dtype=torch.int32 if r else torch.int64), op=hvd.Sum))
# The same size in other shapes: a GradhubMismatchError (a RuntimeError and a ValueError).
for catch in (RuntimeError, ValueError):
    raises(catch, lambda: hvd.allreduce(torch.ones(4, 6) if r else torch.ones(6, 4)), "different shapes")
    raises(catch, lambda: hvd.allreduce_(torch.ones(4, 6) if r else torch.ones(6, 4), name="same.numel"), "shapes")
    raises(catch, lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(4, 6) if r else torch.ones(6, 4)]),
           "shapes")
    raises(catch, lambda: hvd.reducescatter(torch.ones(n * 2, 6) if r else torch.ones(n * 6, 2)), "shapes")
assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)))
# Two allgather_async under one name in flight: a ValueError (Horovod's), before anything is sent.
# Worker 0 starts the first only after the others tried the second (the
# reduction between), so theirs cannot have completed.
if r != 0:
    h = hvd.allgather_async(torch.ones(1, 2), name="dup")
    raises(ValueError, lambda: hvd.allgather_async(torch.ones(1, 2), name="dup"), "already in flight")
hvd.allreduce(torch.zeros(1))
if r == 0:
    h = hvd.allgather_async(torch.ones(1, 2), name="dup")
assert hvd.synchronize(h).shape == (n, 2)
hvd.synchronize(hvd.allgather_async(torch.ones(1, 2), name="dup"))  # free again once done

# ---- 2. Integer pre/postscaling: Horovod scales in float64 and truncates (toward zero).
g = torch.Generator().manual_seed(5)
factor = float(torch.rand(1, generator=g)) * 3 - 1  # the same on every worker
xs = [torch.randint(-100, 100, (n * 3, 4), generator=torch.Generator().manual_seed(k)) for k in range(n)]
for dtype in (torch.int32, torch.int64, torch.float32, torch.float64):
    x = [t.to(dtype) for t in xs]
    ints = not dtype.is_floating_point

    def close(a, b):
        return torch.equal(a, b) if ints else torch.allclose(a, b, rtol=1e-5, atol=1e-4)

    pre = sum((t.double() * factor).to(dtype) for t in x)
    post = (sum(t.double() for t in x) * factor).to(dtype)
    avg_post = (sum(t.double() for t in x) * (factor / n)).to(dtype)
    if not ints:
        pre = sum(t * factor for t in x)
        post, avg_post = sum(x) * factor, sum(x) * factor / n
    mine, rows = x[r], slice(r * 3, r * 3 + 3)
    got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=factor)
    assert close(got, pre), (dtype, got - pre)
    assert close(hvd.allreduce(mine, op=hvd.Sum, postscale_factor=factor), post), dtype
    assert close(hvd.allreduce(mine, op=hvd.Average, postscale_factor=factor), avg_post), dtype
    assert close(hvd.allreduce(mine, op=hvd.Average), (sum(t.double() for t in x) * (1.0 / n)).to(dtype)), dtype
    a, b = hvd.grouped_allreduce([mine, mine], op=hvd.Sum, prescale_factor=factor)
    assert close(a, pre) and close(b, pre), dtype
    a, b = hvd.grouped_allreduce([mine, mine], op=hvd.Average, postscale_factor=factor)
    assert close(a, avg_post) and close(b, avg_post), dtype
    assert close(hvd.reducescatter(mine, op=hvd.Sum, prescale_factor=factor), pre[rows]), dtype
    assert close(hvd.reducescatter(mine, op=hvd.Average, postscale_factor=factor), avg_post[rows]), dtype
    a, b = hvd.grouped_reducescatter([mine, mine], op=hvd.Sum, postscale_factor=factor)
    assert close(a, post[rows]) and close(b, post[rows]), dtype

# ---- 3. reducescatter's gradient, as Horovod's: the allgather of the output gradients, times size for Sum.
for op, want in ((hvd.Sum, float(n)), (hvd.Average, 1.0)):
    for dim in (1, 2, 3):
        for dtype in (torch.float32, torch.float64):
            t = torch.randn([n * 4] * dim, dtype=dtype, requires_grad=True)
            out = hvd.reducescatter(t, op=op)
            out.backward(torch.ones([4] + [n * 4] * (dim - 1), dtype=dtype))
            assert torch.equal(t.grad, torch.full_like(t, want)), (op, dim, dtype)
    ts = [torch.randn(n * 4, 3, requires_grad=True) for _ in range(3)]
    for o in hvd.grouped_reducescatter(ts, op=op):
        o.backward(torch.ones(4, 3))
    assert all(torch.equal(t.grad, torch.full_like(t, want)) for t in ts), op

# ---- 4. Optimizer details.
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
names = opt._parameter_names
assert set(names) == set(model.parameters()) and len(set(names.values())) == 4, names
opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters())
assert {names_ for names_ in opt2._parameter_names.values()} == {k for k, _ in model.named_parameters()}


class NoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(5, 2))

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


ng = NoGrad()
ng_opt = hvd.DistributedOptimizer(torch.optim.SGD(ng.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-6),
                                  named_parameters=ng.named_parameters())
hvd.broadcast_parameters(ng.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(ng_opt, root_rank=0)
assert ng_opt.param_groups[0]["params"][0].grad is None
grad = ng_opt.param_groups[0]["params"][1].grad
assert torch.equal(hvd.broadcast(grad, root_rank=0, name="nograd.grad"), grad)
# A worker outside the optimizer's process set: a local optimizer, as in Horovod.
first = hvd.add_process_set(list(range(n - 1)))
lin = torch.nn.Linear(2, 1)
torch.nn.init.constant_(lin.weight, 1.0)
set_opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=1.0), named_parameters=lin.named_parameters(),
                                   process_set=first)
assert isinstance(set_opt, torch.optim.SGD)
lin(torch.full((1, 2), float(r + 1))).sum().backward()
set_opt.step()
inside = list(range(n - 1))
want = 1.0 - (sum(k + 1 for k in inside) / len(inside) if r in inside else r + 1)
assert torch.allclose(lin.weight, torch.full((1, 2), want)), (lin.weight, want)

# ---- 5. Sparse.
idx = torch.tensor([[r, r + 1]])
sp = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 2.0]), (n + 1,))
handle = hvd.sparse_allreduce_async(sp, name="sparse.callable", op=hvd.Sum)
dense = handle().to_dense()  # Horovod's handle is a function giving the result
want = torch.zeros(n + 1)
for k in range(n):
    want[k] += 1.0
    want[k + 1] += 2.0
assert torch.equal(dense, want), dense
assert torch.equal(hvd.synchronize(hvd.sparse_allreduce_async(sp, op=hvd.Sum)).to_dense(), want)


def inputs(k):
    return torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if k == 0 else torch.tensor([[1, 3, 4], [4, 7, 9]]) + k - 1


for sparse_as_dense in (False, True):
    torch.manual_seed(3)
    emb = torch.nn.Embedding(10 + n, 3, sparse=True)
    ref = torch.nn.Embedding(10 + n, 3, sparse=True)
    ref.load_state_dict(emb.state_dict())
    sopt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                    named_parameters=[(f"emb.{sparse_as_dense}", emb.weight)],
                                    sparse_as_dense=sparse_as_dense)
    hvd.broadcast_optimizer_state(sopt, root_rank=0)
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
    # broadcast_optimizer_state made the state with one step of zero gradients, as in Horovod.
    ref.weight.grad = torch.zeros_like(ref.weight).to_sparse()
    ref_opt.step()
    for step in range(2):
        sopt.zero_grad()
        emb(inputs(r)).sum().backward()
        sopt.step()
        assert emb.weight.grad.is_sparse
        ref_opt.zero_grad()
        grads = []
        for k in range(n):
            ref.zero_grad()
            ref(inputs(k)).sum().backward()
            grads.append(ref.weight.grad.to_dense())
        ref.weight.grad = (sum(grads) / n).to_sparse(1)
        ref_opt.step()
    assert torch.allclose(emb.weight, ref.weight, atol=1e-6), (sparse_as_dense, emb.weight - ref.weight)

# ---- 8. barrier: the operations in flight before it complete first, on every worker.
if r != 0:
    time.sleep(0.3)
inflight = hvd.allreduce_async(torch.ones(1000), name="before.barrier")
hvd.barrier()
assert hvd.poll(inflight), "barrier returned before an operation started before it"
assert torch.equal(hvd.synchronize(inflight), torch.ones(1000))

# ---- 6. join: the joined worker counts as zeros and an average divides by every worker;
# allgather and broadcast raise on the others; join() returns the last rank on every worker.
if r == 0:
    last = hvd.join()
else:
    got = hvd.allreduce(torch.full((4,), 2.0), average=True, name="join.avg")
    assert torch.allclose(got, torch.full((4,), 2.0 * (n - 1) / n)), got
    got = hvd.allreduce(torch.full((4,), 3), average=True, name="join.int")
    assert torch.equal(got, torch.full((4,), int(3 * (n - 1) * (1.0 / n)))), got
    raises(RuntimeError, lambda: hvd.allgather(torch.ones(2, 2), name="join.gather"), "joined")
    raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), root_rank=1, name="join.bcast"), "joined")
    time.sleep(0.3 * r)  # the last rank joins last
    last = hvd.join()
assert last == n - 1, last
assert hvd.join() in range(n)  # a second join, as Horovod's tests do: every worker goes on
assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
print("PASS", r, flush=True)
