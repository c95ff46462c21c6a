"""Worker (2-3 workers): Horovod's expectations run the way Horovod's own CI
runs its tests, every case in this one process, each starting with init()
(idempotent, as Horovod's) and ending with a barrier, whatever the cases
before left behind (an async operation never waited for, errors, joins,
process sets added and removed). Cases: every async operation
refuses a name in flight; alltoall's argument errors at the call and its
disagreements; reducescatter/allreduce disagreements, also in a process set;
join with allreduce (every dtype, either rank first, names seen before or
not) and with allgather/broadcast; broadcast_optimizer_state for every
torch optimizer (state and hyperparameters of the root); a branch of the
model unused on one worker; gradients switched on and off between two
optimizers; the optimizer without names, with clipping; poll(); process sets
registered and removed again and again (one-member sets included), their
collectives and gradients, non-members refused; a second init() keeping the
sets. Expected values are derived here from the inputs."""

import inspect
import itertools
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

import gradhub.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []


def case(fn):
    hvd.init()
    start = time.perf_counter()
    try:
        fn()
    except Exception:  # noqa: BLE001 - reported, and the job fails at the end
        failures.append(fn.__name__)
        traceback.print_exc()
    hvd.barrier()
    if r == 0:
        print(f"case {fn.__name__}: {time.perf_counter() - start:.2f} s", flush=True)
    return fn


def raises(exc, fn, text=""):
    try:
        fn()
    except exc as e:
        assert text in str(e), (text, e)
        return
    raise AssertionError(f"expected {exc.__name__} ({text})")


def same_everywhere(t: torch.Tensor) -> bool:
    """Whether every worker holds this tensor's value (compared with worker 0's)."""
    return torch.equal(hvd.broadcast(t.detach().reshape(-1).double(), root_rank=0), t.detach().reshape(-1).double())


def two_sets():
    even = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    odd = hvd.add_process_set([q for q in range(n) if q % 2 == 1])
    return even, odd, (even if r % 2 == 0 else odd)


@case
def duplicate_names_in_flight():
    # Horovod: a second operation under a name still in flight on this
    # worker is a ValueError at the call (tried 10 times, as its tests do).
    t = torch.ones(17, 17)
    ops = {
        "allreduce_async": lambda nm, ps: hvd.allreduce_async(t, name=nm, process_set=ps),
        "allreduce_async_": lambda nm, ps: hvd.allreduce_async_(t.clone(), name=nm, process_set=ps),
        "grouped_allreduce_async": lambda nm, ps: hvd.grouped_allreduce_async([t, t], name=nm, process_set=ps),
        "broadcast_async": lambda nm, ps: hvd.broadcast_async(t, ps.ranks[0] if ps.ranks else 0, name=nm,
                                                              process_set=ps),
        "broadcast_async_": lambda nm, ps: hvd.broadcast_async_(t.clone(), ps.ranks[0] if ps.ranks else 0, name=nm,
                                                                process_set=ps),
        "reducescatter_async": lambda nm, ps: hvd.reducescatter_async(torch.ones(n * 4, 3), name=nm, process_set=ps),
        "grouped_reducescatter_async": lambda nm, ps: hvd.grouped_reducescatter_async([torch.ones(n * 4, 3)], name=nm,
                                                                                      process_set=ps),
        "alltoall_async": lambda nm, ps: hvd.alltoall_async(torch.ones(ps.size() * 2, 3), name=nm, process_set=ps),
        "allgather_async": lambda nm, ps: hvd.allgather_async(t, name=nm, process_set=ps),
        "grouped_allgather_async": lambda nm, ps: hvd.grouped_allgather_async([t], name=nm, process_set=ps),
        "sparse_allreduce_async": lambda nm, ps: hvd.sparse_allreduce_async(torch.ones(4).to_sparse(), name=nm,
                                                                            process_set=ps),
    }
    even, odd, mine = two_sets()
    for ps in (hvd.global_process_set, mine):
        members = ps.ranks or list(range(n))
        if len(members) < 2:
            continue  # a one-member set's operation may complete at once: nothing to hold it in flight
        # The first operation stays in flight until its last member starts
        # it, which that member (`late`) does only after the others tried a
        # second one (the reduction below): no race with its completion.
        for kind, start in ops.items():
            for late in members[:2]:
                name = f"duplicate_name.{kind}.{late}"
                if r != late:
                    first = start(name, ps)
                    for _ in range(10):  # as Horovod's tests: at once, every time
                        raises(ValueError, lambda: start(name, ps), "already in flight")
                hvd.allreduce(torch.zeros(1), process_set=ps)
                if r == late:
                    first = start(name, ps)
                hvd.synchronize(first)  # the first one completes on every worker
    hvd.remove_process_set(odd)
    hvd.remove_process_set(even)


@case
def alltoall_argument_errors_and_disagreements():
    # Argument errors: a ValueError at the call, the async form included.
    raises(ValueError, lambda: hvd.alltoall(torch.empty(n + 1)), "divisible")
    raises(ValueError, lambda: hvd.alltoall_async(torch.empty(n + 1)), "divisible")
    raises(ValueError, lambda: hvd.alltoall(torch.empty(n - 1), torch.ones(n, dtype=torch.int32)), "summing")
    raises(ValueError, lambda: hvd.alltoall(torch.empty(n), torch.ones(n, dtype=torch.float32)), "integers")
    raises(ValueError, lambda: hvd.alltoall_async(torch.empty(n), [1.0] * n), "integers")
    # Disagreements: a RuntimeError (Horovod's HorovodInternalError) on every worker.
    raises(RuntimeError, lambda: hvd.alltoall(torch.ones(2 * n, 10 * (r + 1), 2)), "disagree")
    raises(RuntimeError, lambda: hvd.alltoall(torch.ones(n, dtype=torch.int32 if r % 2 else torch.float32)))
    # Still usable: integer splits as a list or an int64 tensor.
    out, got = hvd.alltoall(torch.arange(n, dtype=torch.float32), torch.ones(n, dtype=torch.int64))
    assert torch.equal(out, torch.full((n,), float(r))) and torch.equal(got, torch.ones(n, dtype=torch.int32))


@case
def reduction_disagreements_global_and_in_a_set():
    even, odd, mine = two_sets()
    for ps in (hvd.global_process_set, mine):
        if ps.size() == 1:
            continue  # nothing to disagree with
        k = ps.rank()
        for op in (hvd.allreduce, hvd.reducescatter):
            raises(RuntimeError, lambda: op(torch.ones([17 + k] * 3), process_set=ps))
            raises(RuntimeError, lambda: op(torch.ones(17, 23 * 57) if k == 0 else torch.ones(17, 23, 57),
                                            process_set=ps))
            raises(RuntimeError, lambda: op(torch.ones([17] * 3, dtype=torch.int32 if k % 2 == 0 else torch.float32),
                                            process_set=ps))
        raises(RuntimeError, lambda: hvd.allgather(torch.ones(2, 3 + k), process_set=ps), "disagree")
        raises(RuntimeError, lambda: hvd.broadcast(torch.ones(3), root_rank=ps.ranks[min(k, 1)] if ps.ranks else
                                                   min(k, 1), process_set=ps), "root rank")
        total = float(sum(ps.ranks) if ps.ranks else sum(range(n)))
        assert torch.equal(hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, process_set=ps),
                           torch.full((3,), total))
    hvd.remove_process_set(odd)
    hvd.remove_process_set(even)


@case
def join_with_allreduce_every_dtype():
    # The joined worker counts as zeros; an average divides by every worker
    # (integers: the sum times 1/size in float64, truncated, as Horovod).
    for dtype, dim, first, seen in itertools.product([torch.int32, torch.int64, torch.float32, torch.float64],
                                                     [1, 2, 3], [0, 1], [False, True]):
        g = torch.Generator().manual_seed(dim)
        a = torch.randint(-100, 100, [5] * dim, generator=g).to(dtype)
        b = torch.randint(-100, 100, [17] * dim, generator=g).to(dtype)
        if seen:  # the names reduced once before, by every worker
            hvd.synchronize(hvd.allreduce_async(a, name="join.a", average=True))
            hvd.synchronize(hvd.allreduce_async(b, name="join.b", average=True))
        if r == first:
            last = hvd.join()
        else:
            got = [hvd.allreduce_async(a, name="join.a", average=True),
                   hvd.allreduce_async(b, name="join.b", average=True)]
            got = [hvd.synchronize(h) for h in got]
            last = hvd.join()
            for x, t in zip(got, (a, b)):
                want = (t.double() * (n - 1) * (1.0 / n)).to(dtype) if not dtype.is_floating_point \
                    else t * (n - 1) / n
                assert torch.allclose(x, want, rtol=1e-6, atol=0), (dtype, dim, first, seen, x - want)
        # The last to join: one of those that reduced (any of them but `first`).
        assert last != first and last in range(n), (last, first)


@case
def join_with_allgather_and_broadcast():
    t = torch.ones(17, 17, 17)
    for what in ("allgather", "broadcast"):
        if r == 0:
            hvd.join()
        else:
            fn = (lambda: hvd.allgather(t)) if what == "allgather" else \
                (lambda: hvd.broadcast(t, 1, name="join.broadcast"))
            raises(RuntimeError, fn, "joined")
            hvd.join()
    assert torch.equal(hvd.allgather(torch.full((1, 2), float(r))), torch.arange(n).float().repeat_interleave(2)
                       .reshape(n, 2))


def torch_optimizers():
    """Every optimizer of torch.optim that takes these models' parameters
    (not LBFGS nor SparseAdam, as in Horovod; not Muon: 2-D parameters only)."""
    found = [c for c in torch.optim.Optimizer.__subclasses__() if c.__module__.startswith("torch.optim")
             and c not in (torch.optim.LBFGS, torch.optim.SparseAdam) and c.__name__ != "Muon"]
    return sorted(found, key=lambda c: c.__name__)


def make_optimizer(cls, options: dict, model):
    accepted = inspect.signature(cls.__init__).parameters
    return cls(model.parameters(), **{k: v for k, v in options.items() if k in accepted})


# Every option these optimizers know that changes their state (momentum, centered).
OPTIONS = dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True)


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(20, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))


@case
def broadcast_optimizer_state_of_every_optimizer():
    x, y = torch.randn(16, 20, generator=torch.Generator().manual_seed(r)), torch.randn(16, 5)
    for cls in torch_optimizers():
        model = mlp()
        opt = hvd.DistributedOptimizer(make_optimizer(cls, OPTIONS, model), named_parameters=model.named_parameters())
        opt.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
        # Each worker's state differs (its own parameters); the root's wins.
        roots = hvd.broadcast_object(opt.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        mine = opt.state_dict()
        assert len(mine["state"]) == len(roots["state"]), cls
        for k, s in roots["state"].items():
            for key, v in s.items():
                assert (torch.equal(mine["state"][k][key], v) if torch.is_tensor(v) else mine["state"][k][key] == v), \
                    (cls, key)


@case
def broadcast_optimizer_state_hyperparameters():
    p0 = dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999), etas=(0.8, 2.4),
              step_sizes=(1e-5, 100))
    p1 = dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9), etas=(0.25, 1.75),
              step_sizes=(1e-7, 5))
    x, y = torch.randn(16, 20), torch.randn(16, 5)
    for cls in torch_optimizers():
        model = mlp()
        opt = hvd.DistributedOptimizer(make_optimizer(cls, p0 if r == 0 else p1, model),
                                       named_parameters=model.named_parameters())
        F.mse_loss(model(x), y).backward()
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        accepted = inspect.signature(cls.__init__).parameters
        for k, v in p0.items():
            if k in accepted:
                got = opt.param_groups[0][k]
                assert type(got) is type(v) and got == v, (cls, k, got, v)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()  # the options' types still work in the update


@case
def a_branch_unused_on_one_worker():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = torch.nn.Linear(20, 10), torch.nn.Linear(10, 5), torch.nn.Linear(5, 5)

        def forward(self, x):
            a = self.fc2(F.relu(self.fc1(x)))
            return a, self.fc3(F.relu(a))

    x, y = torch.randn(16, 20, generator=torch.Generator().manual_seed(r)), torch.randn(16, 5)
    for cls in torch_optimizers():
        model = Net()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(make_optimizer(cls, OPTIONS, model), named_parameters=model.named_parameters())
        a, b = model(x)
        opt.zero_grad()
        F.mse_loss(a if r == 0 else b, y, reduction="sum").backward()
        opt.step()
        assert all(same_everywhere(p) for p in model.parameters()), cls


@case
def gradients_switched_between_two_optimizers():
    gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
    hvd.broadcast_parameters(gen.state_dict(), root_rank=0)
    hvd.broadcast_parameters(disc.state_dict(), root_rank=0)
    gen_opt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                       named_parameters=gen.named_parameters())
    disc_opt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=disc.named_parameters())
    inp = torch.rand([1, 1, 20, 20], generator=torch.Generator().manual_seed(r))
    for _ in range(3):
        for train_gen in (True, False):
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            frozen = [p.detach().clone() for p in (disc if train_gen else gen).parameters()]
            gen_opt.zero_grad()
            disc_opt.zero_grad()
            disc(gen(inp)).sum().backward()
            (gen_opt if train_gen else disc_opt).step()
            assert all(torch.equal(a, b) for a, b in zip(frozen, (disc if train_gen else gen).parameters()))
    assert all(same_everywhere(p) for p in itertools.chain(gen.parameters(), disc.parameters()))


@case
def optimizer_without_names_and_with_clipping():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 1), torch.nn.Conv2d(8, 1, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert set(opt._parameter_names) == set(model.parameters()) and len(set(opt._parameter_names.values())) == 4
    opt.zero_grad()
    model(torch.rand([1, 1, 20, 20], generator=torch.Generator().manual_seed(r))).sum().backward()
    opt.step()
    assert all(same_everywhere(p) for p in model.parameters())
    # Clipping between synchronize() and step(); step() after synchronize() warns unless skipped.
    lin = torch.nn.Linear(1, 1)
    torch.nn.init.constant_(lin.weight, 0.5)
    torch.nn.init.zeros_(lin.bias)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), named_parameters=lin.named_parameters())
    for skip in (True, False):
        opt.zero_grad()
        F.mse_loss(lin(torch.ones(1, 1)), torch.ones(1, 1)).backward()
        opt.synchronize()
        before = lin.weight.grad.item()
        torch.nn.utils.clip_grad_norm_(lin.parameters(), 0.1)
        assert abs(lin.weight.grad.item()) < abs(before)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        assert [str(w.message) for w in seen if "skip_synchronize" in str(w.message)] == ([] if skip else
                                                                                          [str(seen[0].message)])


@case
def poll_is_false_while_in_flight():
    handles, pending_seen = [], False
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float16, torch.float32, torch.float64],
                                        [1, 2, 3]):
        t = torch.full([17] * dim, r + 1, dtype=dtype)
        h = hvd.allreduce_async(t, average=False)
        pending_seen |= not hvd.poll(h)
        handles.append((h, torch.full([17] * dim, n * (n + 1) // 2, dtype=dtype)))
    assert pending_seen, "poll() was True at once for every operation"
    for h, want in handles:
        assert torch.equal(hvd.synchronize(h), want)


@case
def process_sets_added_and_removed_again_and_again():
    for _ in range(3):
        even, odd, mine = two_sets()
        m, members = mine.size(), mine.ranks
        for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float32, torch.float64], [1, 2, 3]):
            t = torch.full([5] * dim, r + 1, dtype=dtype)
            total = sum(q + 1 for q in members)
            assert torch.equal(hvd.allreduce(t, op=hvd.Sum, process_set=mine), torch.full_like(t, total))
            assert torch.equal(hvd.allreduce(t, process_set=mine), (torch.full_like(t, total).double() * (1.0 / m))
                               .to(dtype) if not dtype.is_floating_point else torch.full_like(t, total) / m)
            assert all(torch.equal(x, torch.full_like(t, total))
                       for x in hvd.grouped_allreduce([t, t], op=hvd.Sum, process_set=mine))
            assert torch.equal(hvd.allgather(t, process_set=mine),
                               torch.cat([torch.full_like(t, q + 1) for q in members]))
            assert torch.equal(hvd.broadcast(t, members[-1], process_set=mine), torch.full_like(t, members[-1] + 1))
            rows = torch.ones([2 * m] + [3] * (dim - 1), dtype=dtype) * (r + 1)
            assert torch.equal(hvd.alltoall(rows, process_set=mine),
                               torch.cat([torch.ones([2] + [3] * (dim - 1), dtype=dtype) * (q + 1) for q in members]))
            assert torch.equal(hvd.reducescatter(rows, op=hvd.Sum, process_set=mine),
                               torch.full([2] + [3] * (dim - 1), total, dtype=dtype))
        assert hvd.broadcast_object({"from": r}, root_rank=members[0], process_set=mine) == {"from": members[0]}
        assert hvd.allgather_object(r, process_set=mine) == members
        # Gradients over the set: reducescatter's (Sum: the set's size), allgather's (averaged: 1).
        x = torch.ones(m * 4, 3, requires_grad=True)
        hvd.reducescatter(x, op=hvd.Sum, process_set=mine).backward(torch.ones(4, 3))
        assert torch.equal(x.grad, torch.full_like(x, float(m)))
        y = torch.ones(3, 2, requires_grad=True)
        hvd.allgather(y, process_set=mine).backward(torch.ones(3 * m, 2))
        assert torch.equal(y.grad, torch.ones(3, 2))
        hvd.barrier(process_set=mine)
        # A worker outside a set does not call its collectives (Horovod raises too).
        other = odd if mine is even else even
        if other.ranks:
            raises(ValueError, lambda: hvd.allreduce(torch.ones(2), process_set=other), "not in")
            raises(ValueError, lambda: hvd.broadcast(torch.ones(2), other.ranks[0], process_set=mine), "not in")
        # The optimizer over `even`: a local optimizer on the odd workers, as in Horovod.
        lin = torch.nn.Linear(2, 1)
        torch.nn.init.constant_(lin.weight, 1.0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=1.0),
                                       named_parameters=lin.named_parameters(), process_set=even)
        lin(torch.full((1, 2), float(r + 1))).sum().backward()
        opt.step()
        step = sum(q + 1 for q in even.ranks) / len(even.ranks) if r in even.ranks else r + 1
        assert torch.allclose(lin.weight, torch.full((1, 2), 1.0 - step))
        assert hvd.remove_process_set(odd) and hvd.remove_process_set(even)
        assert even.process_set_id is None and not hvd.remove_process_set(even)


@case
def a_second_init_keeps_the_sets():
    even, odd, mine = two_sets()
    hvd.init()
    hvd.init(process_sets=[even, odd])  # registered already: nothing to add
    assert mine.process_set_id is not None and mine.included()
    total = float(sum(q + 1 for q in mine.ranks))
    assert torch.equal(hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, process_set=mine),
                       torch.full((2,), total))
    hvd.remove_process_set(odd)
    hvd.remove_process_set(even)


assert not failures, f"failed cases: {failures}"
print("PASS", r, flush=True)
