"""Worker: Horovod's process sets (2-4 workers). Two disjoint sets (even and
odd ranks) train models of their own at the same time, each set's gradients
averaged over its members only (nobody else takes part in a set's
operations); every collective over a set (and an overlapping
third set) against values computed here; global operations, named and
unnamed, interleaved with them; and the errors."""

import torch
import torch.nn.functional as F

import gradhub.torch as hvd


def expect(exc, text, fn):
    try:
        fn()
    except exc as e:
        assert text in str(e), (text, e)
    else:
        raise AssertionError(f"expected {exc.__name__} ({text})")


hvd.init(process_sets="dynamic")
r, n = hvd.rank(), hvd.size()
assert n >= 2, "needs at least 2 workers"
# Workers that register different sets get an error, every one of them.
expect(ValueError, "different sets", lambda: hvd.add_process_set([r]))
evens = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
odds = hvd.add_process_set(hvd.ProcessSet([k for k in range(n) if k % 2 == 1]))
first_two = hvd.add_process_set([0, 1])
mine = evens if r % 2 == 0 else odds
other = odds if mine is evens else evens
members = mine.ranks
assert (mine.size(), mine.rank(), mine.included()) == (len(members), members.index(r), True)
assert (other.rank(), other.included()) == (-1, False)
assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == r
assert evens.process_set_id != odds.process_set_id


def value(k, shape=(5,), dtype=torch.float32):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).add(10 * k + 1).to(dtype)


def summed(ranks, shape=(5,), dtype=torch.float32):
    return sum(value(k, shape, torch.float64) for k in ranks).to(dtype)


# Sums and averages over the set, in several dtypes, named and unnamed,
# with a global unnamed operation between them (numbered the same on every
# worker whatever sets it is in).
for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64):
    got = hvd.allreduce(value(r, (3, 4), dtype), op=hvd.Sum, name=f"sum.{dtype}", process_set=mine)
    assert torch.equal(got, summed(members, (3, 4), dtype)), (dtype, got)
    g = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    assert torch.equal(g, torch.full((2,), float(n))), g
    got = hvd.allreduce(value(r, (7,), dtype), process_set=mine)
    want = summed(members, (7,), torch.float64) / len(members)
    want = want.round().to(dtype) if not dtype.is_floating_point else want.to(dtype)
    assert torch.allclose(got.double(), want.double(), rtol=1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6), \
        (dtype, got, want)

x = value(r)
hvd.allreduce_(x, op=hvd.Sum, name="inplace", process_set=mine)
assert torch.equal(x, summed(members)), x
outs = hvd.grouped_allreduce([value(r), value(r, (2, 2))], op=hvd.Sum, process_set=mine)
assert torch.equal(outs[0], summed(members)) and torch.equal(outs[1], summed(members, (2, 2))), outs
h = hvd.allreduce_async(value(r), op=hvd.Sum, name="async", process_set=mine, postscale_factor=0.5)
assert torch.equal(hvd.synchronize(h), summed(members) * 0.5)
for op, fn in ((hvd.Min, min), (hvd.Max, max)):
    got = hvd.allreduce(torch.tensor([float(r)]), op=op, process_set=mine)
    assert got.item() == fn(members), (op, got)

# Broadcast from each member (a rank in the job, as in Horovod).
for root in members:
    got = hvd.broadcast(value(r, (4,), torch.int32), root, name=f"bcast.{root}", process_set=mine)
    assert torch.equal(got, value(root, (4,), torch.int32)), (root, got)
assert hvd.broadcast_object({"from": r, "list": [r] * 3}, members[-1], process_set=mine) == \
    {"from": members[-1], "list": [members[-1]] * 3}

# allgather with first dimensions that differ, in the set's rank order.
rows = hvd.allgather(torch.full((r + 1, 2), float(r)), name="rows", process_set=mine)
assert torch.equal(rows, torch.cat([torch.full((k + 1, 2), float(k)) for k in members])), rows
assert hvd.allgather_object(("w", r), process_set=mine) == [("w", k) for k in members]
got = hvd.synchronize(hvd.allgather_async(torch.tensor([r]), process_set=mine))
assert got.tolist() == members, got

# reducescatter and alltoall over the set.
m = len(members)
rs = hvd.reducescatter(torch.ones(2 * m, 3) * (r + 1), op=hvd.Sum, process_set=mine)
assert torch.equal(rs, torch.full((2, 3), float(sum(k + 1 for k in members)))), rs
a2a = hvd.alltoall(torch.arange(m, dtype=torch.float32) + 100 * r, process_set=mine)
me = members.index(r)
assert a2a.tolist() == [100.0 * k + me for k in members], a2a

# Autograd: allreduce over a set is differentiable like the global one (the
# output's gradient, ones, is summed over the set's members).
w = torch.ones(3, requires_grad=True)
hvd.allreduce(w * (r + 1), op=hvd.Sum, name="grad", process_set=mine).sum().backward()
assert torch.equal(w.grad, torch.full((3,), float(len(members) * (r + 1)))), w.grad

# A set's barrier, and a third set overlapping the others.
hvd.barrier(process_set=mine)
if first_two.included():
    got = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, name="overlap", process_set=first_two)
    assert got.item() == 3.0, got


# Both sets train a model of their own at the same time: each set's
# gradients are averaged over its members; compared with the same training
# computed here on the set's combined batch.
def data(k, s):
    g = torch.Generator().manual_seed(100 * k + s)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def make(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


seed = 7 + mine.process_set_id
ref = make(seed)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
model = make(seed)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters(), process_set=mine)
hvd.broadcast_parameters(model.state_dict(), root_rank=members[0], process_set=mine)
steps = 3 + 2 * (mine is odds)  # the sets run different numbers of steps
for s in range(steps):
    ref_opt.zero_grad()
    grads = [torch.zeros_like(p) for p in ref.parameters()]
    for k in members:
        ref.zero_grad()
        xb, yb = data(k, s)
        F.cross_entropy(ref(xb), yb).backward()
        grads = [g + p.grad for g, p in zip(grads, ref.parameters())]
    for p, g in zip(ref.parameters(), grads):
        p.grad = g / len(members)
    ref_opt.step()
    opt.zero_grad()
    xb, yb = data(r, s)
    F.cross_entropy(model(xb), yb).backward()
    opt.step()
for p, q in zip(model.parameters(), ref.parameters()):
    assert torch.allclose(p, q, atol=1e-6), (p, q)
hvd.broadcast_optimizer_state(opt, root_rank=members[0], process_set=mine)

# Errors: a set this worker is not in, one not registered, not a set at all.
expect(ValueError, "not in", lambda: hvd.allreduce(torch.ones(1), process_set=other))
expect(ValueError, "not registered", lambda: hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0])))
expect(TypeError, "ProcessSet", lambda: hvd.allgather(torch.ones(1), process_set=[0]))
expect(ValueError, "not in", lambda: hvd.broadcast(torch.ones(1), root_rank=other.ranks[0], process_set=other))
expect(ValueError, "not in", lambda: hvd.broadcast(torch.ones(1), root_rank=other.ranks[0], process_set=mine))
expect(ValueError, "already registered", lambda: hvd.add_process_set(list(members)))
assert hvd.remove_process_set(first_two) and not hvd.remove_process_set(first_two)
expect(ValueError, "not registered", lambda: hvd.allreduce(torch.ones(1), process_set=first_two))
# Everyone in step afterwards.
assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(n)))
print("PASS", r, flush=True)
hvd.shutdown()
