"""Worker: Horovod's exchange collectives in gradhub.torch: reducescatter,
alltoall (even and uneven splits), grouped allgather/reducescatter, async
allgather whose poll() is honest, sparse allreduce, process-set names, and
their gradients; every value checked against what every worker holds,
computed here."""

import time

import torch

import gradhub.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()


def mine(shape, dtype=torch.float32, rank=None):
    g = torch.Generator().manual_seed(500 + (r if rank is None else rank))
    return torch.randint(-9, 10, shape, generator=g).to(dtype)


def rows_of(total, q):
    """Horovod's split: the first total % n workers take one row more."""
    counts = [total // n + (1 if k < total % n else 0) for k in range(n)]
    return sum(counts[:q]), counts[q]


# reducescatter: the reduced tensor's rows of this worker.
for dtype in (torch.float32, torch.float64, torch.int64):
    for total in (n, 2 * n + 1, 7):
        x = mine((total, 3), dtype)
        full = sum(mine((total, 3), dtype, k) for k in range(n))
        start, count = rows_of(total, r)
        got = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{dtype}.{total}")
        assert got.dtype == dtype and torch.equal(got, full[start:start + count]), (dtype, total, got)
        if dtype.is_floating_point:
            avg = hvd.reducescatter(x, name=f"rsavg.{dtype}.{total}")
            assert torch.allclose(avg, full[start:start + count] / n), avg
x = mine((5, 2))
start, count = rows_of(5, r)
got = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="rs.scaled")
assert torch.equal(got, sum(mine((5, 2), rank=k) for k in range(n))[start:start + count])
h = hvd.reducescatter_async(x, op=hvd.Sum, name="rs.async")
assert torch.equal(hvd.synchronize(h), got)
outs = hvd.grouped_reducescatter([x, 2 * x], op=hvd.Sum, name="grs")
assert torch.equal(outs[0], got) and torch.equal(outs[1], 2 * got)
outs = hvd.synchronize(hvd.grouped_reducescatter_async([x, 3 * x], op=hvd.Sum, name="grs.async"))
assert torch.equal(outs[1], 3 * got)
# Its gradient, as Horovod's: every worker's output gradient, back to the
# rows it came from (for Average not divided by the size; for Sum times it).
x = mine((6, 2)).requires_grad_()
y = hvd.reducescatter(x, name="rs.grad")  # average
(y * (r + 1)).sum().backward()
start_of = [rows_of(6, k) for k in range(n)]
want = torch.zeros(6, 2)
for k, (s, c) in enumerate(start_of):
    want[s:s + c] = k + 1
assert torch.allclose(x.grad, want), (x.grad, want)

# alltoall, even split: block q of this worker goes to worker q.
x = torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + 100 * r
got = hvd.alltoall(x, name="a2a.even")
want = torch.cat([(torch.arange(2 * n * 3, dtype=torch.float32).reshape(2 * n, 3) + 100 * k)[2 * r:2 * r + 2]
                  for k in range(n)])
assert torch.equal(got, want), (got, want)
# Uneven splits: worker k sends (k + q) % 3 rows to worker q.
def splits_of(k):
    return [(k + q) % 3 for q in range(n)]


def rows_sent(k):
    s = splits_of(k)
    return torch.full((sum(s), 2), float(k)) + torch.arange(sum(s), dtype=torch.float32)[:, None]


x = rows_sent(r).to(torch.int64)
got, received = hvd.alltoall(x, splits=torch.tensor(splits_of(r), dtype=torch.int32), name="a2a.uneven")
parts = []
for k in range(n):
    s = splits_of(k)
    parts.append(rows_sent(k)[sum(s[:r]):sum(s[:r]) + s[r]])
assert got.dtype == torch.int64 and torch.equal(got, torch.cat(parts).to(torch.int64)), (got, parts)
assert received.tolist() == [splits_of(k)[r] for k in range(n)], received
out, rec = hvd.synchronize(hvd.alltoall_async(x, splits=splits_of(r), name="a2a.async"))
assert torch.equal(out, got) and torch.equal(rec, received)
# Its gradient: each row's gradient returns to the worker that sent it.
x = rows_sent(r).requires_grad_()
y, _ = hvd.alltoall(x, splits=splits_of(r), name="a2a.grad")
(y * (r + 1)).sum().backward()
s = splits_of(r)
want = torch.cat([torch.full((s[q], 2), float(q + 1)) for q in range(n)])
assert torch.equal(x.grad, want), (x.grad, want)
# Bad splits are refused before anything is sent.
bads = [lambda: hvd.alltoall(torch.zeros(3, 2), splits=[4] + [0] * (n - 1), name="a2a.bad2")]
if n > 1:  # not divisible by the workers
    bads.append(lambda: hvd.alltoall(torch.zeros(n + 1, 2), name="a2a.bad"))
for bad in bads:
    try:
        bad()
        raise AssertionError("expected ValueError")
    except ValueError as e:
        assert "alltoall" in str(e), e

# Grouped and async allgather: every worker's rows, first dimensions differing.
a, b = mine((r + 1, 2)), mine((r + 2, 3), torch.int32)
got = hvd.grouped_allgather([a, b], name="gag")
assert torch.equal(got[0], torch.cat([mine((k + 1, 2), rank=k) for k in range(n)]))
assert got[1].dtype == torch.int32 and torch.equal(got[1], torch.cat([mine((k + 2, 3), torch.int32, k)
                                                                      for k in range(n)]))
h = hvd.grouped_allgather_async([a], name="gag.async")
assert torch.equal(hvd.synchronize(h)[0], got[0])
# poll() is False while a worker has not joined in, True once done.
h = hvd.allgather_async(a, name="ag.poll")
if r == 0 and n > 1:
    time.sleep(0.5)  # the others wait for this worker's allgather
if r != 0:
    assert hvd.poll(h) is False, "worker 0 has not started its allgather yet"
hvd.synchronize(h)
assert hvd.poll(h) is True

# Sparse allreduce: every worker's entries, summed (averaged) as a dense tensor would be.
idx = torch.tensor([[r, (r + 1) % 4]])
sp = torch.sparse_coo_tensor(idx, torch.tensor([1.0 + r, 2.0]), (4,))
out = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sparse", op=hvd.Sum))
dense = sum(torch.sparse_coo_tensor(torch.tensor([[k, (k + 1) % 4]]), torch.tensor([1.0 + k, 2.0]), (4,)).to_dense()
            for k in range(n))
assert out.is_sparse and torch.equal(out.to_dense(), dense), (out, dense)
avg = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sparse.avg"))
assert torch.allclose(avg.to_dense(), dense / n)

# Process sets: the global one is accepted everywhere (others: torch_process_sets.py).
assert hvd.global_process_set.size() == n and hvd.global_process_set.included()
got = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="ps.global", process_set=hvd.global_process_set)
assert torch.equal(got, torch.full((3,), float(n)))
hvd.barrier(process_set=hvd.global_process_set)
for exc, bad in ((TypeError, lambda: hvd.allreduce(torch.ones(1), process_set=object())),
                 (ValueError, lambda: hvd.reducescatter(torch.ones(n), process_set=hvd.ProcessSet([0])))):
    try:
        bad()
        raise AssertionError(f"expected {exc.__name__}")
    except exc as e:
        assert "ProcessSet" in str(e) or "not registered" in str(e), e

print("PASS", r, flush=True)
hvd.shutdown()
