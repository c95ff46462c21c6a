"""Worker: point-to-point on the torch.distributed backend "gradhub"
(send, recv, isend, irecv, recv from any source, batch_isend_irecv), started
as torchrun starts it (the group forms its own job from torch's store).
Checks, on n >= 3 processes:
- every ordered pair, dtypes and sizes (empty, one element, several frames
  of the wire), non-contiguous tensors: the bytes arrive exact;
- messages of one pair and tag arrive in order; tags are matched apart
  (received in the other order than sent);
- recv from any source returns each sender once;
- batch_isend_irecv around a ring, and on a sub-group by group ranks;
- a receive of the wrong size fails naming the sender;
- a receive nobody sends to times out (the group's timeout) and the next
  message still reaches the next receive.
Prints PASS <rank>."""

import datetime
import os
import time

import torch
import torch.distributed as dist

import gradhub.torch  # noqa: F401 - registers the backend

dist.init_process_group("gradhub", timeout=datetime.timedelta(seconds=60))
r, n = dist.get_rank(), dist.get_world_size()
assert n >= 3, n


def data(src: int, dst: int, dtype, numel: int, seed: int = 0) -> torch.Tensor:
    """What src sends dst: the same wherever it is made."""
    g = torch.Generator().manual_seed(10_000 * seed + 100 * src + dst)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)


# 1. Every ordered pair, dtypes and sizes (3M elements of f32: 12 MB, 3 frames).
CASES = [(torch.float32, 0), (torch.float32, 1), (torch.float16, 1001), (torch.bfloat16, 4097),
         (torch.int64, 333), (torch.bool, 77), (torch.float32, 3_000_000)]
for i, (dtype, numel) in enumerate(CASES):
    works, got = [], {}
    for q in range(n):
        if q != r:
            works.append(dist.isend(data(r, q, dtype, numel, i), dst=q))
            got[q] = torch.empty(numel, dtype=dtype)
            works.append(dist.irecv(got[q], src=q))
    for w in works:
        w.wait()
    for q, t in got.items():
        assert torch.equal(t, data(q, r, dtype, numel, i)), (i, q, dtype, numel)
print(f"rank {r}: every pair, {len(CASES)} dtypes and sizes, exact", flush=True)

# 2. Order within a pair and tag; tags matched apart; non-contiguous tensors.
nxt, prv = (r + 1) % n, (r - 1) % n
sends = [dist.isend(torch.full((5,), float(k)), dst=nxt, tag=3) for k in range(10)]
sends.append(dist.isend(torch.tensor([-1.0]), dst=nxt, tag=1))
sends.append(dist.isend(torch.tensor([-2.0]), dst=nxt, tag=2))
t2, t1 = torch.empty(1), torch.empty(1)
dist.recv(t2, src=prv, tag=2)
dist.recv(t1, src=prv, tag=1)
assert (t1.item(), t2.item()) == (-1.0, -2.0), (t1, t2)
bufs = [torch.empty(5) for _ in range(10)]
recvs = [dist.irecv(b, src=prv, tag=3) for b in bufs]
for w in sends + recvs:
    w.wait()
assert [b[0].item() for b in bufs] == [float(k) for k in range(10)], bufs
m = torch.arange(24.0).reshape(4, 6)
out = torch.zeros(4, 6)
w1 = dist.isend(m.t(), dst=nxt, tag=9)        # a non-contiguous view
w2 = dist.irecv(out.t(), src=prv, tag=9)      # received into one
w1.wait()
w2.wait()
assert torch.equal(out.t(), m.t()), out
print(f"rank {r}: order within a tag, tags apart, non-contiguous views", flush=True)

# 3. recv from any source: rank 0 hears from each other rank once.
if r == 0:
    seen = []
    for _ in range(n - 1):
        t = torch.empty(2)
        src = dist.recv(t, tag=7)
        assert t.tolist() == [float(src), 7.0], (src, t)
        seen.append(src)
    assert sorted(seen) == list(range(1, n)), seen
else:
    dist.send(torch.tensor([float(r), 7.0]), dst=0, tag=7)
print(f"rank {r}: recv from any source", flush=True)

# 4. batch_isend_irecv around the ring, and on a sub-group by group ranks.
a, b = torch.full((1000,), float(r)), torch.empty(1000)
ops = [dist.P2POp(dist.isend, a, nxt), dist.P2POp(dist.irecv, b, prv)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
assert torch.equal(b, torch.full((1000,), float(prv))), b
sub = dist.new_group([1, 2])
if r in (1, 2):
    me = dist.get_group_rank(sub, r)
    x, y = torch.tensor([10.0 * r]), torch.empty(1)
    ops = [dist.P2POp(dist.isend, x, group=sub, group_peer=1 - me), dist.P2POp(dist.irecv, y, group=sub, group_peer=1 - me)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert y.item() == 10.0 * (3 - r), y
print(f"rank {r}: batch_isend_irecv, ring and sub-group", flush=True)

# 5. Errors: a receive of the wrong size names the sender; a send to itself is refused.
if r == 1:
    dist.send(torch.ones(3), dst=0, tag=11)
elif r == 0:
    try:
        dist.recv(torch.empty(2), src=1, tag=11)
    except dist.DistBackendError as e:
        assert "member 1 sent a message of 12 bytes (tag 11) to a receive of 8 bytes" in str(e), e
    else:
        raise AssertionError("a receive of the wrong size passed")
print(f"rank {r}: a wrong size names the sender", flush=True)

# 6. A receive given up on (its group's timeout) is withdrawn: the message sent after goes to the next receive.
quick = dist.new_group([0, 2], timeout=datetime.timedelta(seconds=2))
if r == 0:
    t = torch.zeros(1)
    w = dist.irecv(t, src=2, group=quick, tag=12)
    t0 = time.monotonic()
    try:
        w.wait()
    except dist.DistBackendError as e:
        assert "receive from member 1 (tag 12) did not complete within" in str(e), e
    else:
        raise AssertionError("a receive nobody sent to completed")
    assert time.monotonic() - t0 < 10
    dist.send(torch.ones(1), dst=2, tag=13)           # tell rank 2 to send now (on the world group: 60 s)
    t2 = torch.empty(1)
    dist.recv(t2, src=2, group=quick, tag=12)
    assert t2.item() == 5.0 and t.item() == 0.0, (t, t2)
elif r == 2:
    dist.recv(torch.empty(1), src=0, tag=13)
    dist.send(torch.tensor([5.0]), dst=0, group=quick, tag=12)
print(f"rank {r}: a receive given up on is withdrawn", flush=True)

dist.barrier()
dist.destroy_process_group()
print(f"PASS {r}", flush=True)
