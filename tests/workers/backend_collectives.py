"""Worker: the torch.distributed backend "gradhub" (gradhub/torch/dist/).

Started as torchrun would start it (MASTER_ADDR, RANK, WORLD_SIZE: the
group forms its own gradhub job from torch's store), or by `gradhub launch`
(GH_TEST's "port": a tcp:// store; the job is the launcher's). Checks, in
one run:
- every collective x dtype x op against a gloo group over the same ranks on
  the same inputs (where gloo has the op), else against the result computed
  from every rank's inputs (AVG, PREMUL_SUM);
- async Work: wait, is_completed, get_future;
- all_gather_coalesced, sparse all_reduce, monitored_barrier (passing, and
  naming the ranks that did not come);
- a sub-group (new_group) and its collectives, non-members idle;
- DDP training for 20 steps (SGD with momentum) equals one process training
  on the combined batch, and so do FSDP2 and, with an even number of
  workers, hybrid sharding on a 2-D DeviceMesh (backend_fsdp.py);
- destroy_process_group() and a second init_process_group in the process.
"""

import datetime
import os

import torch
import torch.distributed as dist

import gradhub.torch  # noqa: F401 - registers the backend
from common import CONFIG

R = dist.ReduceOp
if "port" in CONFIG:  # under gradhub launch
    rank, world = int(os.environ["GRADHUB_RANK"]), int(os.environ["GRADHUB_NUM_WORKERS"])
    init = dict(init_method=f"tcp://127.0.0.1:{CONFIG['port']}", rank=rank, world_size=world)
else:
    init = {}
dist.init_process_group("gradhub", timeout=datetime.timedelta(seconds=60), **init)
r, n = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "gradhub", dist.get_backend()
gloo = dist.new_group(backend="gloo")

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
checked = {"gloo": 0, "computed": 0}


def data(q: int, dtype, shape=(7, 5), seed: int = 0) -> torch.Tensor:
    """Rank q's input: the same wherever it is made."""
    g = torch.Generator().manual_seed(1000 * seed + q)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, shape, generator=g).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.is_floating_point:
        tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(a.dtype, 1e-5)
        assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol), (what, (a.double() - b.double()).abs().max())
    else:
        assert torch.equal(a, b), (what, a, b)


def both(fn, *tensors):
    """Run `fn(group, *copies)` on gradhub and on gloo; the copies after it."""
    mine = [t.clone() for t in tensors]
    ref = [t.clone() for t in tensors]
    fn(None, *mine)
    try:
        fn(gloo, *ref)
    except (RuntimeError, ValueError, TypeError):
        return mine, None  # gloo has no such op (dtype): compare with the computed result
    return mine, ref


def expect(mine, ref, computed, what):
    if ref is not None:
        for a, b in zip(mine, ref):
            close(a, b, what + " vs gloo")
        checked["gloo"] += 1
    else:
        for a, b in zip(mine, computed):
            close(a, b, what + " vs computed")
        checked["computed"] += 1


def reduce_all(xs, op, dtype):
    st = torch.stack([x.double() if dtype.is_floating_point else x.long() for x in xs])
    if dtype == torch.bool:
        out = {R.SUM: st.any(0), R.MAX: st.any(0), R.MIN: st.all(0), R.PRODUCT: st.all(0),
               R.BOR: st.any(0), R.BAND: st.all(0), R.BXOR: st.sum(0) % 2 == 1}[op]
        return out.to(torch.bool)
    if op == R.SUM:
        out = st.sum(0)
    elif op == R.AVG:
        out = st.sum(0) / len(xs) if dtype.is_floating_point else torch.trunc(st.sum(0).double() / len(xs)).long()
    elif op == R.MIN:
        out = st.amin(0)
    elif op == R.MAX:
        out = st.amax(0)
    elif op == R.PRODUCT:
        out = st.prod(0)
    else:
        fn = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
        out = st[0]
        for x in st[1:]:
            out = fn(out, x)
    return out.to(dtype)


# ---------------------------------------------------------------- all_reduce
for dtype in DTYPES:
    ops = [R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT]
    if not dtype.is_floating_point:
        ops += [R.BAND, R.BOR, R.BXOR]
    if dtype == torch.bool:
        ops = [R.SUM, R.MIN, R.MAX, R.PRODUCT, R.BAND, R.BOR, R.BXOR]
    if dtype.is_floating_point:
        ops.append("premul")
    xs = [data(q, dtype) for q in range(n)]
    for op in ops:
        if op == "premul":
            mine = xs[r].clone()
            dist.all_reduce(mine, op=dist._make_nccl_premul_sum(0.5))
            expect([mine], None, [(reduce_all(xs, R.SUM, dtype).double() * 0.5).to(dtype)], f"all_reduce {dtype} premul")
            continue
        if op == R.AVG:  # gloo has no AVG
            mine = xs[r].clone()
            dist.all_reduce(mine, op=op)
            expect([mine], None, [reduce_all(xs, op, dtype)], f"all_reduce {dtype} {op}")
            continue
        mine, ref = both(lambda g, t, op=op: dist.all_reduce(t, op=op, group=g), xs[r])
        expect(mine, ref, [reduce_all(xs, op, dtype)], f"all_reduce {dtype} {op}")

    # coalesced (DDP's and FSDP's grouped reductions)
    ts = [data(r, dtype, (3,), seed=1), data(r, dtype, (4, 2), seed=2)]
    if dtype != torch.bool:
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t)
        cm.wait()
        for t, s in zip(ts, [1, 2]):
            expect([t], None, [reduce_all([data(q, dtype, t.shape, seed=s) for q in range(n)], R.SUM, dtype)],
                   f"coalesced all_reduce {dtype}")

    # broadcast, from every root
    for root in range(n):
        mine, ref = both(lambda g, t, root=root: dist.broadcast(t, root, group=g), xs[r])
        expect(mine, ref, [xs[root]], f"broadcast {dtype} root {root}")

    # all_gather: the list form and into one tensor; odd sizes (not whole words) too
    for shape in [(7, 5), (3,)]:
        x = [data(q, dtype, shape, seed=3) for q in range(n)]
        mine, ref = both(lambda g, *outs: dist.all_gather(list(outs), x[r], group=g),
                         *[torch.zeros(shape, dtype=dtype) for _ in range(n)])
        expect(mine, ref, x, f"all_gather {dtype} {shape}")
        mine, ref = both(lambda g, out: dist.all_gather_into_tensor(out, x[r], group=g),
                         torch.zeros((n * shape[0], *shape[1:]), dtype=dtype))
        expect(mine, ref, [torch.cat(x)], f"all_gather_into_tensor {dtype} {shape}")

    # reduce_scatter: the list form and from one tensor
    if dtype != torch.bool:
        ins = [[data(q, dtype, (4, 3), seed=10 + d) for d in range(n)] for q in range(n)]
        for op in [R.SUM, R.MAX] + ([R.AVG] if dtype.is_floating_point else []):
            mine = torch.zeros((4, 3), dtype=dtype)
            dist.reduce_scatter(mine, [t.clone() for t in ins[r]], op=op)
            want = reduce_all([ins[q][r] for q in range(n)], op, dtype)
            expect([mine], None, [want], f"reduce_scatter {dtype} {op}")
            mine = torch.zeros((4, 3), dtype=dtype)
            dist.reduce_scatter_tensor(mine, torch.cat(ins[r]), op=op)
            expect([mine], None, [want], f"reduce_scatter_tensor {dtype} {op}")

    # all_to_all: even, uneven splits, list form
    x = torch.stack([data(r, dtype, (3,), seed=20 + d) for d in range(n)])
    mine, ref = both(lambda g, out: dist.all_to_all_single(out, x, group=g), torch.zeros_like(x))
    expect(mine, ref, [torch.stack([data(q, dtype, (3,), seed=20 + r) for q in range(n)])], f"all_to_all_single {dtype}")
    ins_split = [q + 1 for q in range(n)]          # rank r sends q + 1 rows to q
    xin = data(r, dtype, (sum(ins_split), 2), seed=30)
    out_split = [r + 1] * n                           # and receives r + 1 from each
    mine, ref = both(lambda g, out: dist.all_to_all_single(out, xin, out_split, ins_split, group=g),
                     torch.zeros((sum(out_split), 2), dtype=dtype))
    parts = [data(q, dtype, (sum(ins_split), 2), seed=30)[sum(ins_split[:r]):sum(ins_split[:r + 1])] for q in range(n)]
    expect(mine, ref, [torch.cat(parts)], f"all_to_all_single uneven {dtype}")
    ins_l = [data(r, dtype, (2, q + 1), seed=40) for q in range(n)]
    mine, ref = both(lambda g, *outs: dist.all_to_all(list(outs), ins_l, group=g),
                     *[torch.zeros((2, r + 1), dtype=dtype) for _ in range(n)])
    expect(mine, ref, [data(q, dtype, (2, r + 1), seed=40) for q in range(n)], f"all_to_all {dtype}")

    # reduce, gather, scatter to/from the last rank
    root = n - 1
    if dtype != torch.bool:
        mine = xs[r].clone()
        dist.reduce(mine, root, op=R.SUM)
        if r == root:
            expect([mine], None, [reduce_all(xs, R.SUM, dtype)], f"reduce {dtype}")
    outs = [torch.zeros((7, 5), dtype=dtype) for _ in range(n)] if r == root else None
    dist.gather(xs[r], outs, dst=root)
    if r == root:
        expect(outs, None, xs, f"gather {dtype}")
    if hasattr(dist, "gather_single"):   # torch 2.15: its C++ Backend does not hand this one to Python
        whole = torch.zeros((n * 7, 5), dtype=dtype) if r == root else None
        try:
            dist.gather_single(xs[r], whole, dst=root)
        except RuntimeError as e:
            assert "gradhub does not support gather_single" in str(e), e
        else:
            if r == root:
                expect([whole], None, [torch.cat(xs)], f"gather_single {dtype}")
    out = torch.zeros((7, 5), dtype=dtype)
    dist.scatter(out, [data(q, dtype, seed=50) for q in range(n)] if r == root else None, src=root)
    expect([out], None, [data(r, dtype, seed=50)], f"scatter {dtype}")

dist.barrier()

# ---------------------------------------------------------------- Work
t = torch.ones(1000) * (r + 1)
w = dist.all_reduce(t, async_op=True)
fut = w.get_future()
assert w.wait() is True and w.is_completed(), "Work after wait()"
assert fut.wait()[0] is t or torch.equal(fut.wait()[0], t)
assert torch.equal(t, torch.full((1000,), n * (n + 1) / 2)), t[:3]
ws = [dist.all_reduce(torch.ones(10), async_op=True) for _ in range(5)]  # several in flight, one name key
for w in ws:
    w.wait()
assert all(w.is_completed() for w in ws)

# ---------------------------------------------------------------- all_gather_coalesced: one output list per member
ins = [torch.full((2, 2), float(r)), torch.full((3,), 10.0 + r)]
outs = [[torch.zeros(2, 2), torch.zeros(3)] for _ in range(n)]
dist.all_gather_coalesced(outs, ins)
for q in range(n):
    assert torch.equal(outs[q][0], torch.full((2, 2), float(q))) and torch.equal(outs[q][1], torch.full((3,), 10.0 + q)), outs

# ---------------------------------------------------------------- sparse all_reduce (SUM), as gloo's
for shape, dense in [((6,), ()), ((5, 4), (3,))]:
    def sparse(q):
        g = torch.Generator().manual_seed(77 + q)
        k = q + 1   # a different number of entries on every rank
        idx = torch.stack([torch.randint(0, s_, (k,), generator=g) for s_ in shape])
        return torch.sparse_coo_tensor(idx, torch.randn((k, *dense), generator=g), (*shape, *dense))
    t = sparse(r)
    dist.all_reduce(t)
    want = sum((sparse(q) for q in range(n)), torch.zeros((*shape, *dense)).to_sparse(len(shape))).coalesce()
    assert t.is_sparse and torch.allclose(t.to_dense(), want.to_dense(), atol=1e-6), (t, want)

# ---------------------------------------------------------------- monitored_barrier: passes, then names who did not come
try:
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    monitored = True
except ValueError as e:   # torch 2.12 and 2.13 refuse it on any backend but gloo, before calling it
    assert "only implemented for GLOO" in str(e), e
    monitored = False
if monitored:
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
if monitored and r == 0:
    for wait_all, words in [(False, "Rank 1 failed to pass monitoredBarrier"),
                            (True, f"Ranks {', '.join(map(str, range(1, n)))} failed to pass monitoredBarrier"),
                            (False, "Rank 0 timed out in monitoredBarrier")]:
        t0 = datetime.datetime.now()
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=0 if "timed out" in words else 0.3),
                                   wait_all_ranks=wait_all)
        except RuntimeError as e:
            assert words in str(e), (words, e)
        else:
            raise AssertionError(f"monitored_barrier did not raise {words!r}")
        assert (datetime.datetime.now() - t0).total_seconds() < 10
dist.barrier()

# ---------------------------------------------------------------- a sub-group
sub_ranks = list(range(n - 1)) if n > 2 else [0, 1]
sub = dist.new_group(sub_ranks)
if r in sub_ranks:
    t = torch.full((100,), float(r + 1))
    dist.all_reduce(t, group=sub)
    assert torch.equal(t, torch.full((100,), float(sum(q + 1 for q in sub_ranks)))), t[:3]
    t = torch.full((100,), float(r + 1))
    dist.all_reduce(t, op=R.AVG, group=sub)
    assert torch.allclose(t, torch.full((100,), sum(q + 1 for q in sub_ranks) / len(sub_ranks))), t[:3]
    outs = [torch.zeros(3) for _ in sub_ranks]
    dist.all_gather(outs, torch.full((3,), float(r)), group=sub)
    assert [int(o[0]) for o in outs] == sub_ranks, outs
    b = torch.full((4,), float(r))
    dist.broadcast(b, sub_ranks[-1], group=sub)  # a global rank, as torch's API takes
    assert torch.equal(b, torch.full((4,), float(sub_ranks[-1]))), b
dist.barrier()

# ---------------------------------------------------------------- DDP, FSDP2 and a 2-D DeviceMesh (hybrid sharding)
import backend_fsdp  # noqa: E402

backend_fsdp.ddp("DDP", bucket_cap_mb=0.005)  # several buckets
backend_fsdp.check()

# ---------------------------------------------------------------- destroy and init again
dist.destroy_process_group()
dist.init_process_group("gradhub", **({**init, "init_method": f"tcp://127.0.0.1:{CONFIG['port2']}"}
                                      if "port" in CONFIG else init))
t = torch.full((5,), float(r + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((5,), n * (n + 1) / 2)), t
dist.destroy_process_group()
print(f"checked {checked['gloo']} against gloo, {checked['computed']} against the computed result", flush=True)
print("PASS", r, flush=True)
